"""Residuals as depth mixing matrices (report §6.2, Fig. 9): the result type of
:meth:`ResidualStream.mixing_matrix <attnres.nn.residual.ResidualStream.mixing_matrix>` and
the constructions the built-in variants share.

Every variant writes the input of sublayer ``l`` as ``h_l = sum_i M[i -> l] v_i`` over the
sources ``v_0`` (the embedding) and ``v_i`` (the raw output of sublayer ``i``). As a tensor,
``M[..., r, i]`` with row ``r = l - 1`` for sublayer ``l = 1 .. L`` and row ``L`` for the
output aggregation (the hidden state handed to the final norm); column ``i`` is ``v_i``. Row
``r`` can only see columns ``0 .. r``: ``M`` is lower-triangular, its diagonal the weight of
the most recent source. Everything is built in float64, so that the structure of ``M`` (for
instance the rank-one blocks of Highway's carry products) survives to the rank estimate of
:mod:`attnres.analysis`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "MixingMatrix",
    "MIXING_DTYPE",
    "unit_lower_triangular",
    "scaled_columns",
    "scatter_source_weights",
    "carry_products",
    "stream_products",
]

#: The dtype every mixing matrix is built in.
MIXING_DTYPE = torch.float64


@dataclass(repr=False)
class MixingMatrix:
    """One forward's depth mixing matrix.

    weights: ``[*lead, L + 1, L + 1]`` in float64: ``weights[..., r, i]`` is the weight of
        source ``v_i`` in the input of sublayer ``r + 1`` (row ``L``: the output
        aggregation). ``lead`` are the token dimensions of the forward (``[B, T]`` in the
        model) for input-dependent variants, and empty for variants whose weights are
        parameters only (``input_dependent=False``), which broadcast over tokens.
    input_dependent: whether the weights depend on the input (Highway, (m)HC, AttnRes).
    per_channel: ``[*lead, L + 1, L + 1, d]`` for variants that mix channel by channel
        (Highway's gates, LayerScale's vectors), else ``None``; then ``weights`` is its
        reduction and ``h_l = sum_i per_channel[..., l - 1, i, :] * v_i`` holds exactly.
    reduction: how ``weights`` was reduced from what the variant applies, in words (``None``
        when ``weights`` is exactly what it applies): e.g. ``"mean over the d channels"``.
    source_groups: consecutive sources that enter the variant as one sum and so share one
        weight in every row that sees them complete (Block AttnRes: ``[0]``, then each
        block's outputs), or ``None``.
    """

    weights: Tensor
    input_dependent: bool
    per_channel: Tensor | None = None
    reduction: str | None = None
    source_groups: list[range] | None = None

    @property
    def size(self) -> int:
        """``L + 1``: rows (sublayers and the output aggregation) and columns (sources)."""
        return self.weights.shape[-1]

    def __repr__(self) -> str:
        """One line, as :class:`attnres.analysis.DepthMixing`'s: the shapes, not the entries (the
        dataclass's repr printed every token's matrix, thousands of lines of a recorded forward)."""
        parts = [f"weights {list(self.weights.shape)}",
                 "input-dependent" if self.input_dependent else "input-independent"]
        if self.per_channel is not None:
            parts.append(f"per_channel {list(self.per_channel.shape)}")
        if self.reduction is not None:
            parts.append(f"reduction {self.reduction!r}")
        if self.source_groups is not None:
            parts.append("source_groups " + ", ".join(f"v{g.start}..v{g.stop - 1}" if len(g) > 1 else f"v{g.start}"
                                                      for g in self.source_groups))
        return f"MixingMatrix({', '.join(parts)})"


def unit_lower_triangular(n_sublayers: int, device=None) -> Tensor:
    """``[L + 1, L + 1]``: ones on and below the diagonal (the standard residual)."""
    n = n_sublayers + 1
    return torch.ones(n, n, dtype=MIXING_DTYPE, device=device).tril()


def scaled_columns(column_scales: Tensor) -> Tensor:
    """A single-stream residual ``h_{l+1} = h_l + s_l v_{l+1}``: ``M[i -> l] = s_i`` for every
    row that sees ``v_i``. ``column_scales``: ``[L + 1]`` or ``[L + 1, d]`` (the embedding's
    scale first, 1 in these variants) -> ``[L + 1, L + 1]`` or ``[L + 1, L + 1, d]``."""
    s = column_scales.to(MIXING_DTYPE)
    n = s.shape[0]
    mask = unit_lower_triangular(n - 1, s.device)
    if s.dim() == 1:
        return mask * s
    return mask.unsqueeze(-1) * s.unsqueeze(0)


def scatter_source_weights(weights: Sequence[Tensor], columns: Sequence[Sequence[Sequence[int]]]) -> Tensor:
    """Depth-attention weights placed in ``M``: ``weights[r]`` is mixer ``r``'s ``[n_r, ...]``
    (its sources first, then the token dimensions) and ``columns[r][s]`` the sources ``v_i``
    that its source ``s`` sums (Full AttnRes: one each; Block AttnRes: a block's outputs), each
    of which takes the source's weight. Returns ``[..., R, R]`` with ``R = len(weights)``."""
    R = len(weights)
    lead = weights[0].shape[1:]
    M = torch.zeros(*lead, R, R, dtype=MIXING_DTYPE, device=weights[0].device)
    for r, (w, cols) in enumerate(zip(weights, columns)):
        if w.shape[0] != len(cols):
            raise ValueError(f"mixer {r} recorded {w.shape[0]} weights for {len(cols)} sources")
        w = w.to(MIXING_DTYPE)
        for s, members in enumerate(cols):
            M[..., r, list(members)] = w[s].unsqueeze(-1)
    return M


def carry_products(gates: Sequence[Tensor], per_channel: bool = False) -> tuple[Tensor, Tensor | None]:
    """Highway ``h_{l+1} = (1 - g_l) h_l + g_l v_{l+1}`` (report §6.2): with the carry product
    ``c_{i -> r} = prod_{k = i .. r - 1} (1 - g_k)`` (0-based sublayers ``k``),
    ``M[0 -> r] = c_{0 -> r}`` and ``M[i -> r] = g_{i - 1} c_{i -> r}`` for ``i >= 1``, channel
    by channel. ``gates``: the ``L`` gates ``[..., d]``. Returns the mean over the ``d``
    channels ``[..., L + 1, L + 1]`` and, with ``per_channel``, the channel-wise matrices
    ``[..., L + 1, L + 1, d]`` (else ``None``; they are ``d`` times larger)."""
    g = [x.to(MIXING_DTYPE) for x in gates]
    L = len(g)
    lead, d = g[0].shape[:-1], g[0].shape[-1]
    mean = torch.zeros(*lead, L + 1, L + 1, dtype=MIXING_DTYPE, device=g[0].device)
    full = torch.zeros(*lead, L + 1, L + 1, d, dtype=MIXING_DTYPE, device=g[0].device) if per_channel else None
    for i in range(L + 1):
        w = torch.ones_like(g[0]) if i == 0 else g[i - 1]  # column i's write-in weight
        for r in range(i, L + 1):
            if r > i:
                w = w * (1 - g[r - 1])
            mean[..., r, i] = w.mean(-1)
            if full is not None:
                full[..., r, i, :] = w
    return mean, full


def stream_products(read: Sequence[Tensor], write: Sequence[Tensor], transitions: Sequence[Tensor]) -> Tensor:
    """``m``-stream residuals ``H_{l+1} = T_l H_l + b_l v_{l+1}`` (streams as rows ``[m, d]``),
    read as ``h_l = a_l^T H_l``: Eq. 10 of the report, ``M[i -> r] = a_r^T T_{r-1} ... T_i b_i``
    (the report's ``beta_i^T A*_{i+1 -> l} alpha_l`` with ``A = T^T``).

    read: ``L + 1`` vectors ``a_r [..., m]`` (the last one reads the output aggregation);
    write: ``L + 1`` vectors ``b_i [..., m]`` (the first one writes the embedding);
    transitions: ``L`` matrices ``T_l [..., m, m]``. Returns ``[..., L + 1, L + 1]``."""
    a = [x.to(MIXING_DTYPE) for x in read]
    b = [x.to(MIXING_DTYPE) for x in write]
    T = [x.to(MIXING_DTYPE) for x in transitions]
    n = len(a)
    if len(b) != n or len(T) != n - 1:
        raise ValueError(f"Eq. 10 needs L + 1 read and write vectors and L transitions; got {len(a)}, {len(b)}, {len(T)}")
    M = torch.zeros(*a[0].shape[:-1], n, n, dtype=MIXING_DTYPE, device=a[0].device)
    for r in range(n):
        u = a[r]  # a_r^T T_{r-1} ... T_i, walking i down from r
        for i in range(r, -1, -1):
            M[..., r, i] = (u * b[i]).sum(-1)
            if i:
                u = torch.einsum("...j,...jk->...k", u, T[i - 1])
    return M
