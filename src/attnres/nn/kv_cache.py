"""Key/value caches for incremental decoding: a growing one and one of static capacity."""

from __future__ import annotations

from numbers import Integral

import torch
from torch import Tensor


def check_left_padding(attention_mask: Tensor | None, shape: tuple[int, int], what: str) -> Tensor | None:
    """``attention_mask`` as a boolean tensor (``None`` stays ``None``) after checking that
    it has ``shape`` (``what``: its name in the error), holds only 0 and 1, and is left-padded
    with at least one real token per row; ``ValueError`` otherwise. A host sync: call it once
    per prompt, not per step."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a tensor of {what} {shape}, got {got}")
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
    mask = attention_mask.bool()
    if not bool(mask[:, -1].all()) or not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        raise ValueError("attention_mask must be left-padded (zeros, then ones) with at least one real token per row")
    return mask


class KVCache:
    """Self-attention keys and values of every layer, ``[B, n_kv_heads, T, head_dim]`` each.

    Only self-attention needs a cache across time: the residual (standard, Full or Block
    AttnRes) mixes over depth for each token on its own, so it is simply run on the new
    tokens. Storage grows geometrically (``capacity`` is a hint: the number of positions to
    allocate at the first update), so a decode step writes one position in place instead of
    copying the whole cache.

    ``update(layer, k, v)`` is called by ``Attention`` once per layer and forward; every
    layer must see the same number of new tokens, in order.

    ``left_padded``: set by ``prefill`` when its prompt was left-padded, so that a later step
    (or ``StaticKVCache.load_``) given no ``attention_mask`` is refused (it would attend to the
    padded keys).
    """

    def __init__(self, n_layers: int, capacity: int = 0) -> None:
        # (KVCache("2") failed with "'<' not supported between instances of 'str' and 'int'", a float
        # number of layers or positions later, in the first update; any integer type, as generate takes
        # max_new_tokens: a NumPy one became a capacity this refused)
        for name, value, least in (("n_layers", n_layers, 1), ("capacity", capacity, 0)):
            if isinstance(value, bool) or not isinstance(value, Integral) or value < least:
                raise ValueError(f"KVCache: {name} must be an integer >= {least}, got {value!r}")
        self.n_layers = int(n_layers)
        self.capacity = int(capacity)
        self._k: list[Tensor | None] = [None] * n_layers
        self._v: list[Tensor | None] = [None] * n_layers
        self._len = [0] * n_layers
        self.left_padded = False

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
        if buf_k is not None and k.shape[0] != buf_k.shape[0]:
            if start:
                raise ValueError(f"KVCache holds a batch of {buf_k.shape[0]} sequences and this forward has "
                                 f"{k.shape[0]}: continue a cache with the batch that filled it (or start a new one)")
            buf_k = buf_v = None  # emptied (crop(0)): a new batch takes new buffers
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
        self._check_layer(layer)
        return self._k[layer][:, :, : self._len[layer]]

    def values(self, layer: int) -> Tensor:
        """The cached values of ``layer``, ``[B, n_kv_heads, seq_len, head_dim]``."""
        self._check_layer(layer)
        return self._v[layer][:, :, : self._len[layer]]

    def _check_layer(self, layer: int) -> None:
        # (layer 5 of 2 failed with "list index out of range", -1 read the last layer, a layer not yet
        # filled with "'NoneType' object is not subscriptable")
        if isinstance(layer, bool) or not isinstance(layer, Integral) or not 0 <= layer < self.n_layers:
            raise ValueError(f"layer must be an integer in [0, {self.n_layers}) (the cache's n_layers), got {layer!r}")
        if self._k[layer] is None:
            raise ValueError(f"layer {layer} holds nothing yet: the cache is filled by a forward (prefill)")

    def crop(self, seq_len: int) -> None:
        """Forget every position from ``seq_len`` on (keeps the allocation)."""
        # (a float one was taken as the cache's length, which every later forward then read)
        if isinstance(seq_len, bool) or not isinstance(seq_len, Integral) or not 0 <= seq_len <= self.seq_len:
            raise ValueError(f"seq_len must be an integer in [0, {self.seq_len}], got {seq_len!r}")
        self._len = [int(seq_len)] * self.n_layers

    def nbytes(self) -> int:
        """Bytes allocated for keys and values (capacity, not only the used part)."""
        return sum(t.numel() * t.element_size() for t in self._k + self._v if t is not None)


class StaticKVCache:
    """Keys and values of every layer in buffers of a fixed ``capacity``, with the fill level
    and the padding on the device: a decode step over it has static shapes and reads no
    number back to the host, so it can be compiled with ``fullgraph=True`` or captured in a
    CUDA graph.

    Buffers: ``k[l]`` / ``v[l]`` ``[B, n_kv_heads, capacity, head_dim]``, zero at
    first (a slot nobody wrote must hold finite numbers: a masked key still enters the
    attention's weighted sum, with weight 0). Device state:

    * ``end`` (``[]``, int64): the slots filled so far, the same for every row; the next
      ``T`` tokens go to slots ``end .. end + T - 1``;
    * ``start`` (``[B]``, int64): each row's first real slot (its left padding).

    Row ``b``'s real keys are slots ``start[b] .. end - 1``; its next token's RoPE position
    is ``end - start[b]`` (positions count real tokens, as with ``attention_mask``).
    ``update(layer, k, v)`` writes the new keys at ``end`` and returns the whole buffers;
    the last layer's update advances ``end``. ``attention_inputs(rope, T)`` gives the
    trunk the RoPE tables and the mask ``[B, 1, T, capacity]`` of the next ``T`` tokens.
    """

    def __init__(
        self, n_layers: int, batch_size: int, n_kv_heads: int, head_dim: int, capacity: int, *,
        dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
    ) -> None:
        for name, value in (("n_layers", n_layers), ("batch_size", batch_size), ("n_kv_heads", n_kv_heads),
                            ("head_dim", head_dim), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        n_layers, batch_size, n_kv_heads, head_dim, capacity = (int(v) for v in (n_layers, batch_size, n_kv_heads,
                                                                                 head_dim, capacity))
        self.n_layers, self.batch_size, self.capacity = n_layers, batch_size, capacity
        shape = (batch_size, n_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        device = self.k[0].device
        self.end = torch.zeros((), dtype=torch.long, device=device)
        self.start = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.slots = torch.arange(capacity, device=device)  # constant: slot numbers, for masks and writes

    @classmethod
    def for_model(cls, model, batch_size: int, capacity: int | None = None) -> StaticKVCache:
        """A cache for ``model`` (an ``AttnResLM`` or a Hugging Face AttnRes model), in its
        parameters' dtype and device; ``capacity`` defaults to the model's ``max_seq_len``."""
        config = model.model_config
        capacity = config.max_seq_len if capacity is None else capacity
        if isinstance(capacity, Integral) and not isinstance(capacity, bool) and capacity > config.max_seq_len:
            raise ValueError(f"capacity must be <= ModelConfig.max_seq_len={config.max_seq_len}, got {capacity}")
        param = model.embed_tokens.weight
        return cls(config.n_layers, batch_size, config.kv_heads, config.head_dim, capacity,
                   dtype=param.dtype, device=param.device)

    @property
    def seq_len(self) -> int:
        """The filled slots as a Python int: reads ``end`` back from the device (a host sync),
        which the decode step itself never does."""
        return int(self.end)

    def attention_inputs(self, rope, t: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(cos, sin, attn_mask)`` of the next ``t`` tokens (slots ``end .. end + t - 1``):
        RoPE tables ``[B, t, head_dim]`` at each row's positions, and the boolean mask
        ``[B, 1, t, capacity]`` - causal, real keys only, and a padded query (a prompt slot
        before ``start``) attends to itself so that no softmax row is empty."""
        query = self.end + self.slots[:t]  # [t]
        cos, sin = rope.at((query[None, :] - self.start[:, None]).clamp(min=0))
        keys = self.slots
        allowed = (keys <= query[:, None]) & ((keys >= self.start[:, None, None]) | (keys == query[:, None]))
        return cos, sin, allowed.unsqueeze(1)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k``/``v`` ``[B, H, T, D]`` into slots ``end .. end + T - 1`` of ``layer``;
        return the whole buffers ``[B, H, capacity, D]`` (``attention_inputs``' mask hides
        the slots not filled). The last layer's update advances ``end`` by ``T``. Keys and
        values of another dtype (a float32 model under ``torch.autocast``: bfloat16) are
        stored in the cache's (the parameters'), which autocast's attention casts back."""
        t = k.shape[2]
        index = self.end + self.slots[:t]
        self.k[layer].index_copy_(2, index, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(2, index, v.to(self.v[layer].dtype))
        if layer == self.n_layers - 1:
            self.end.add_(t)
        return self.k[layer], self.v[layer]

    def load_(self, cache: KVCache, attention_mask: Tensor | None = None) -> None:
        """Copy a filled :class:`KVCache` (a prefill's) into slots ``0 .. cache.seq_len - 1``
        and set ``end`` and ``start`` in place (the buffers keep their addresses, so a
        captured graph keeps reading them); the other slots are zeroed.
        ``attention_mask [B, cache.seq_len]``: the prompt's left padding (``None``: none)."""
        t = cache.seq_len
        if t > self.capacity:
            raise ValueError(f"the cache holds {t} positions, more than the capacity {self.capacity}")
        if cache.n_layers != self.n_layers or cache.keys(0).shape[0] != self.batch_size:
            raise ValueError(f"the cache holds {cache.n_layers} layers at batch size {cache.keys(0).shape[0]}, this one "
                             f"{self.n_layers} at {self.batch_size}")
        if attention_mask is None and cache.left_padded:
            raise ValueError(f"the cache was prefilled from a left-padded batch (its attention_mask holds zeros): pass "
                             f"that mask too, attention_mask [B, T] = [{self.batch_size}, {t}]; without it the padded "
                             "keys would be attended")
        attention_mask = check_left_padding(attention_mask, (self.batch_size, t), "the batch and cached positions")
        for layer in range(self.n_layers):
            for dst, src in ((self.k[layer], cache.keys(layer)), (self.v[layer], cache.values(layer))):
                dst[:, :, :t].copy_(src)
                dst[:, :, t:].zero_()
        self.end.fill_(t)
        if attention_mask is None:
            self.start.zero_()
        else:
            self.start.copy_((~attention_mask).sum(-1))

    def crop_(self, seq_len: int | Tensor) -> None:
        """Forget every slot from ``seq_len`` on (sets ``end``; no host sync for a tensor)."""
        if isinstance(seq_len, Tensor):
            self.end.copy_(seq_len)
            return
        if not 0 <= seq_len <= self.capacity:
            raise ValueError(f"seq_len must be in [0, {self.capacity}], got {seq_len}")
        self.end.fill_(seq_len)

    def nbytes(self) -> int:
        """Bytes of the key and value buffers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
