"""Per-layer key/value cache for incremental decoding."""

from __future__ import annotations

from torch import Tensor


class KVCache:
    """Self-attention keys and values of every layer, ``[B, n_kv_heads, T, head_dim]`` each.

    Only self-attention needs a cache across time: the residual (standard, Full or Block
    AttnRes) mixes over depth for each token on its own, so it is simply run on the new
    tokens. Storage grows geometrically (``capacity`` is a hint: the number of positions to
    allocate at the first update), so a decode step writes one position in place instead of
    copying the whole cache.

    ``update(layer, k, v)`` is called by ``Attention`` once per layer and forward; every
    layer must see the same number of new tokens, in order.
    """

    def __init__(self, n_layers: int, capacity: int = 0) -> None:
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        self.n_layers = n_layers
        self.capacity = capacity
        self._k: list[Tensor | None] = [None] * n_layers
        self._v: list[Tensor | None] = [None] * n_layers
        self._len = [0] * n_layers

    @property
    def seq_len(self) -> int:
        """Number of cached positions (the ``past`` of the next forward)."""
        if len(set(self._len)) != 1:
            raise RuntimeError(f"KVCache layers hold different lengths {self._len}: a forward was interrupted")
        return self._len[0]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k``/``v`` ``[B, H, T, D]`` to ``layer``; return all ``[B, H, past + T, D]``."""
        start = self._len[layer]
        end = start + k.shape[2]
        buf_k, buf_v = self._k[layer], self._v[layer]
        if buf_k is None or end > buf_k.shape[2]:
            size = max(end, self.capacity, 2 * (0 if buf_k is None else buf_k.shape[2]))
            new_k = k.new_empty(k.shape[0], k.shape[1], size, k.shape[3])
            new_v = v.new_empty(v.shape[0], v.shape[1], size, v.shape[3])
            if buf_k is not None:
                new_k[:, :, :start] = buf_k[:, :, :start]
                new_v[:, :, :start] = buf_v[:, :, :start]
            self._k[layer], self._v[layer] = buf_k, buf_v = new_k, new_v
        buf_k[:, :, start:end] = k
        buf_v[:, :, start:end] = v
        self._len[layer] = end
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def keys(self, layer: int) -> Tensor:
        """The cached keys of ``layer``, ``[B, n_kv_heads, seq_len, head_dim]``."""
        return self._k[layer][:, :, : self._len[layer]]

    def values(self, layer: int) -> Tensor:
        """The cached values of ``layer``, ``[B, n_kv_heads, seq_len, head_dim]``."""
        return self._v[layer][:, :, : self._len[layer]]

    def crop(self, seq_len: int) -> None:
        """Forget every position from ``seq_len`` on (keeps the allocation)."""
        if not 0 <= seq_len <= self.seq_len:
            raise ValueError(f"seq_len must be in [0, {self.seq_len}], got {seq_len}")
        self._len = [seq_len] * self.n_layers

    def nbytes(self) -> int:
        """Bytes allocated for keys and values (capacity, not only the used part)."""
        return sum(t.numel() * t.element_size() for t in self._k + self._v if t is not None)
