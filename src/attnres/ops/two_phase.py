"""Building blocks of the two-phase schedule (report §4.2, Algorithm 1 and Appendix B).

Two layers of functions live here:

* The *textbook* pair, written to mirror Algorithm 1 line by line:
  :func:`attend_with_stats` (several queries over one group of sources, returning the
  unnormalised output with max and sum-exp statistics) and :func:`merge_partials` (the
  online-softmax merge of two such partial results), plus :func:`finalize`.
* The *fast-path* helpers the model uses (:func:`rms_inverse`, :func:`source_logits`,
  :func:`weighted_sum`, :func:`merge_with_source`). They compute the same quantities but
  avoid stacking sources: on CPU, tiny batched matmuls and large stacked copies cost more
  than a few fused elementwise passes. Tests check both layers against
  :func:`attnres.ops.depth_attention`.

Conventions: ``d`` is the hidden size, ``S`` the number of queries, ``n`` the number of
sources, ``...`` the token dimensions (``B, T``). Statistics are float32 (float64 for
float64 inputs).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .depth_attention import check_sources

__all__ = [
    "PartialAttention",
    "attend_with_stats",
    "merge_partials",
    "finalize",
    "compute_dtype",
    "full_precision",
    "rms_inverse",
    "source_logits",
    "weighted_sum",
    "weighted_sums",
    "merge_with_sources",
    "merge_with_one_source",
    "merge_with_sources_lse",
    "rms_logits",
    "merge_partial_sum",
    "decoding",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Depth attention runs in float32, or float64 when the inputs are float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def full_precision(x: Tensor) -> contextlib.AbstractContextManager:
    """A context that switches autocast off for ``x``'s device when it is on (a no-op
    otherwise), so that depth-attention matmuls are not silently run in bf16."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


class PartialAttention(NamedTuple):
    """Softmax attention over a subset of the sources, not yet normalised.

    ``out = sum_j exp(z_j - max) * v_j`` with shape ``[S, ..., d]``; ``max`` and ``sumexp``
    (``sum_j exp(z_j - max)``) have shape ``[S, ...]``. ``out / sumexp`` is the attention
    restricted to these sources; :func:`merge_partials` combines two disjoint subsets.
    """

    out: Tensor
    max: Tensor
    sumexp: Tensor


def attend_with_stats(
    queries: Tensor,
    sources: Sequence[Tensor],
    key_norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    scale: float = 1.0,
) -> PartialAttention:
    """Phase 1: ``S`` pseudo-queries attend over one group of ``n`` sources at once.

    Args:
        queries: ``[S, d]``, one pseudo-query per sublayer of the block.
        sources: ``n >= 1`` tensors ``[..., d]`` (one shape, dtype and device).
        key_norm_weight: ``[S, d]`` key-norm gains, one row per query (``None`` = 1).
        eps, scale: as in :func:`attnres.ops.depth_attention`.

    Returns:
        :class:`PartialAttention` with ``out [S, ..., d]``, ``max`` and ``sumexp [S, ...]``.

    The RMS factor of each source is computed once and shared by all ``S`` queries, and the
    key-norm gain is folded into the query: ``w . (g * x_hat) = (w * g) . x_hat``.
    """
    check_sources(sources)
    d = sources[0].shape[-1]
    if queries.dim() != 2 or queries.shape[-1] != d:
        raise ValueError(f"queries must have shape [S, {d}], got {tuple(queries.shape)}")
    if key_norm_weight is not None and key_norm_weight.shape != queries.shape:
        raise ValueError(
            f"key_norm_weight must have the queries' shape {tuple(queries.shape)}, "
            f"got {tuple(key_norm_weight.shape)}"
        )
    compute = compute_dtype(sources[0].dtype)
    with full_precision(sources[0]):
        values = torch.stack([s.to(compute) for s in sources])  # [n, ..., d]
        rinv = torch.rsqrt(values.pow(2).mean(dim=-1) + eps)  # [n, ...], once per source
        qg = queries.to(compute)
        if key_norm_weight is not None:
            qg = qg * key_norm_weight.to(compute)
        logits = torch.einsum("n...d,sd->sn...", values, qg) * rinv * scale  # [S, n, ...]
        m = logits.amax(dim=1)  # [S, ...]
        p = torch.exp(logits - m.unsqueeze(1))  # [S, n, ...]
        out = torch.einsum("sn...,n...d->s...d", p, values)
    return PartialAttention(out, m, p.sum(dim=1))


def merge_partials(a: PartialAttention, b: PartialAttention) -> PartialAttention:
    """Phase 2: the online-softmax merge of two partial results over disjoint sources.

    ``m = max(m_a, m_b)``; ``out = e^(m_a-m) out_a + e^(m_b-m) out_b``;
    ``sumexp = e^(m_a-m) sumexp_a + e^(m_b-m) sumexp_b``. Exact up to rounding.
    """
    m = torch.maximum(a.max, b.max)
    sa = torch.exp(a.max - m)
    sb = torch.exp(b.max - m)
    out = a.out * sa.unsqueeze(-1) + b.out * sb.unsqueeze(-1)
    return PartialAttention(out, m, a.sumexp * sa + b.sumexp * sb)


def finalize(partial: PartialAttention, dtype: torch.dtype | None = None) -> Tensor:
    """``out / sumexp``, cast once to ``dtype`` (default: keep the compute dtype)."""
    h = partial.out / partial.sumexp.unsqueeze(-1)
    return h if dtype is None else h.to(dtype)


# ----------------------------------------------------------------------------------------
# Fast-path helpers used by the residual modules.
# ----------------------------------------------------------------------------------------


def rms_inverse(x: Tensor, eps: float) -> Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` over the last dimension: ``[..., d] -> [...]``.

    One read of ``x``; computed once per source and reused by every query that sees it.
    """
    compute = compute_dtype(x.dtype)
    sq = torch.linalg.vector_norm(x, dim=-1, dtype=compute).square()
    return torch.rsqrt(sq / x.shape[-1] + eps)


def source_logits(x: Tensor, rinv: Tensor, qg: Tensor, scale: float = 1.0) -> Tensor:
    """Logits of one source against ``K`` gain-folded queries: ``[..., d] -> [..., K]``.

    ``qg`` is ``[K, d]`` (query times key-norm gain) or ``[d]`` (then the result is
    ``[...]``). One read of ``x`` serves all ``K`` queries. Autocast is switched off here:
    depth logits stay in float32 under bf16 autocast.
    """
    compute = compute_dtype(x.dtype)
    xc = x if x.dtype == compute else x.to(compute)
    r = rinv if scale == 1.0 else rinv * scale
    with full_precision(x):
        if qg.dim() == 1:
            return (xc @ qg) * r
        return F.linear(xc, qg) * r.unsqueeze(-1)


def weighted_sum(weights: Tensor, sources: Sequence[Tensor]) -> Tensor:
    """``sum_j weights[..., j] * sources[j]`` in the compute dtype: ``[..., n] -> [..., d]``.

    A chain of fused multiply-adds: each source is read once and no stacked copy of the
    sources is made (that copy and a batched tiny matmul cost more on CPU).
    """
    compute = compute_dtype(sources[0].dtype)
    w = weights.unsqueeze(-1)
    out = sources[0].to(compute) * w[..., 0, :]
    for j in range(1, len(sources)):
        out.addcmul_(sources[j], w[..., j, :])  # in place: no new buffer per source
    return out


#: Without autograd and below this many elements per source, :func:`weighted_sums` stacks
#: the sources and takes one batched matmul: decoding (a token or a few per sequence) is
#: bound by the number of operations, not by memory traffic. Otherwise one fused multiply-add
#: pass per source and query, with no stacked copy (prefill and training, bound by memory
#: traffic; training keeps one summation order whatever the shape).
SMALL_SOURCE_NUMEL = 1 << 16


def weighted_sums(weights: Tensor, sources: Sequence[Tensor]) -> list[Tensor]:
    """Phase 1's outputs for ``K`` queries at once: ``weights [..., K, n]`` over ``n`` sources
    ``[..., d]`` -> ``K`` tensors ``[..., d]`` in the compute dtype (see :func:`weighted_sum`;
    small sources without autograd take one stacked matmul instead of ``K n`` passes)."""
    small = sources[0].numel() <= SMALL_SOURCE_NUMEL and len(sources) > 1 and not torch.is_grad_enabled()
    if not small:
        return [weighted_sum(weights[..., k, :], sources) for k in range(weights.shape[-2])]
    compute = compute_dtype(sources[0].dtype)
    stacked = torch.stack(list(sources), dim=-2)  # [..., n, d]
    if stacked.dtype != compute:
        stacked = stacked.to(compute)
    with full_precision(stacked):
        return list((weights.to(compute) @ stacked).unbind(dim=-2))  # [..., K, d] -> K x [..., d]


def merge_with_one_source(o_hat: Tensor, lse: Tensor, x: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
    """Phase 2 with one more source (Block AttnRes: the partial sum): ``(h, w_x)``.

    With two terms the weight of ``x`` is ``e^z / (sumexp e^m + e^z) = sigmoid(z - lse)``,
    ``lse = m + log(sumexp)`` the log-sum-exp of Phase 1 (``[...]``, computed once per
    block): the online-softmax merge in a few operations instead of a dozen - what decoding,
    a token at a time, pays for - and stable for any ``z``. Then one fused pass:
    ``h = o_hat + w_x (x - o_hat)`` (``[..., d]``, compute dtype); ``w_x`` is ``[...]``.
    """
    w_x = torch.sigmoid(z - lse)
    x = x if x.dtype == o_hat.dtype else x.to(o_hat.dtype)
    return torch.lerp(o_hat, x, w_x.unsqueeze(-1)), w_x


def decoding(x: Tensor) -> bool:
    """Whether ``x`` takes the operation-count-bound decoding paths: small, no autograd and
    no autocast (under autocast the fused paths below would need autocast switched off)."""
    return x.numel() <= SMALL_SOURCE_NUMEL and not torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type)


def merge_partial_sum(o_hat: Tensor, lse: Tensor, x: Tensor, qg: Tensor, eps: float) -> Tensor:
    """Block AttnRes's Phase 2 while decoding: the partial sum ``x [..., d]``'s logit for the
    gain-folded query ``qg [d]`` and the merge with the Phase-1 result ``o_hat [..., d]``
    (log-sum-exp ``lse [...]``) in one go -> ``h [..., d]`` in ``o_hat``'s dtype.

    The same as :func:`merge_with_one_source` after :func:`rms_logits`, in eight small
    operations instead of twelve (decoding pays per operation): the weight of ``o_hat`` is
    ``sigmoid(lse - z)`` with ``z = qg . x / rms(x) = sqrt(d) qg . x / sqrt(x . x + d eps)``,
    one ``addcdiv``, and ``h = x + w_o (o_hat - x)``.
    """
    d = x.shape[-1]
    xc = x if x.dtype == o_hat.dtype else x.to(o_hat.dtype)
    den = torch.linalg.vector_norm(xc, dim=-1).square_().add_(d * eps).sqrt_()  # sqrt(d) rms(x), [...]
    w_o = torch.addcdiv(lse, xc @ qg, den, value=-math.sqrt(d)).sigmoid_()
    return torch.lerp(xc, o_hat, w_o.unsqueeze(-1))


def rms_logits(x: Tensor, qg: Tensor, eps: float) -> Tensor:
    """Logits of a new source ``x [..., d]`` against gain-folded queries ``qg`` ``[K, d]``
    (-> ``[..., K]``) or ``[d]`` (-> ``[...]``): ``qg . x / rms(x)``, what
    :func:`source_logits` gives with :func:`rms_inverse`. While decoding (see :func:`decoding`)
    it takes a few small operations - the norm, the product, then the RMS factor in
    place - instead of an RMSNorm, which costs several times that on CPU; otherwise
    ``x`` is read once for its RMS factor and once for the product, with no normalised copy
    written."""
    if decoding(x):
        compute = compute_dtype(x.dtype)
        xc = x if x.dtype == compute else x.to(compute)
        rinv = torch.linalg.vector_norm(xc, dim=-1).square_().mul_(1.0 / x.shape[-1]).add_(eps).rsqrt_()  # [...]
        if qg.dim() == 1:
            return (xc @ qg).mul_(rinv)
        return F.linear(xc, qg).mul_(rinv.unsqueeze(-1))
    return source_logits(x, rms_inverse(x, eps), qg)


def merge_with_sources(
    o_hat: Tensor, m: Tensor, sumexp: Tensor, xs: Sequence[Tensor], zs: Sequence[Tensor]
) -> tuple[Tensor, Tensor]:
    """Phase 2: online-softmax merge of a normalised Phase-1 result with ``k >= 1`` more sources.

    Args:
        o_hat: ``[..., d]`` the Phase-1 result already divided by its ``sumexp``.
        m, sumexp: ``[...]`` its max and sum-exp statistics.
        xs: ``k`` sources ``[..., d]`` (Block: the partial sum ``b_n^{i-1}``; Full: the
            ``i-1`` earlier outputs of the current group).
        zs: their logits ``[...]`` for this sublayer's query.

    Returns:
        ``(h, w)`` with ``h [..., d]`` in the compute dtype and ``w [..., 1 + k]`` the weights
        of ``o_hat`` and of each ``x``:
        ``h = (e^(m-M) sumexp o_hat + sum_k e^(z_k-M) x_k) / (e^(m-M) sumexp + sum_k e^(z_k-M))``
        with ``M = max(m, z_1, ..., z_k)``.
    """
    return merge_with_sources_lse(o_hat, m + torch.log(sumexp), xs, zs)


def merge_with_sources_lse(o_hat: Tensor, lse: Tensor, xs: Sequence[Tensor], zs: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`merge_with_sources` with Phase 1's statistics as one log-sum-exp ``lse [...]``
    (``m + log(sumexp)``): the weights are one softmax over ``[lse, z_1, ..., z_k]``, stable
    for any logits. Returns ``(h [..., d], w [..., 1 + k])`` as :func:`merge_with_sources`.
    While decoding the weighted sum is one stacked matmul; otherwise fused multiply-adds
    with no stacked copy."""
    if len(xs) == 1:
        h, w_x = merge_with_one_source(o_hat, lse, xs[0], zs[0])
        return h, torch.stack([1 - w_x, w_x], dim=-1)
    w = torch.softmax(torch.stack([lse, *zs], dim=-1), dim=-1)  # [..., 1 + k]
    if decoding(o_hat):
        stacked = torch.stack([o_hat, *(x if x.dtype == o_hat.dtype else x.to(o_hat.dtype) for x in xs)], dim=-2)
        return (w.unsqueeze(-2) @ stacked).squeeze(-2), w  # [..., 1, 1 + k] @ [..., 1 + k, d]
    wu = w.unsqueeze(-1)
    h = o_hat * wu[..., 0, :]
    for k, x in enumerate(xs, start=1):
        h.addcmul_(x, wu[..., k, :])
    return h, w
