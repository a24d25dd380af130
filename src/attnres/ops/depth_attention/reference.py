"""The readable reference of depth attention (report §3.1) and of the three operations of
the two-phase schedule (report §4.2), as plain PyTorch: autograd records their graph.

:func:`depth_attention` is the definition every path is tested against: stack the sources,
RMS-normalise the keys, one dot product with the pseudo-query per source, a softmax over
the sources, and the weighted sum of the *raw* sources.

:func:`phase1` and :func:`merge` split it the way the two-phase schedule runs it, with the
signatures of the custom operators (:mod:`.library`); the operators' implementations
(:mod:`.torch_impl`, :mod:`.cpu_kernel`, :mod:`.triton_impl`) are compared with these,
forward and every gradient. :func:`rms_logits` is the logit both compute.

Conventions: ``d`` is the hidden size, ``K`` or ``S`` a number of queries, ``n`` a number of
sources, ``...`` the token dimensions. Logits, weights and statistics are in the *compute
dtype* - float32, or float64 for float64 sources; results are in the sources' dtype.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "depth_attention",
    "check_sources",
    "compute_dtype",
    "full_precision",
    "rms_inverse",
    "weighted_sum",
    "rms_logits",
    "phase1",
    "stream_dtype",
    "merge",
]


def _not_a_list(sources: object) -> str:
    """What was given for the list of sources, and the list it stands for: a stacked tensor
    ``[n, ..., d]`` or a generator was named by its type alone ("got Tensor")."""
    if isinstance(sources, Tensor):
        return (f"a tensor of shape {tuple(sources.shape)}: for sources stacked along dim 0 pass "
                "list(sources.unbind(0)); for one source, [source]")
    if hasattr(sources, "__iter__"):
        return f"{type(sources).__name__}: pass list(...) of it"
    return type(sources).__name__


def check_sources(sources: Sequence[Tensor], what: str = "sources") -> None:
    """Raise ``ValueError`` unless ``sources`` is a non-empty sequence of floating-point
    tensors that share one shape ``[..., d]``, one dtype and one device."""
    if isinstance(sources, Tensor) or not isinstance(sources, Sequence):
        raise ValueError(f"{what} must be a non-empty list or tuple of tensors, got {_not_a_list(sources)}")
    if len(sources) == 0:
        raise ValueError(f"{what} must be non-empty: depth attention needs at least one source")
    first = sources[0]
    if not isinstance(first, Tensor) or first.dim() < 1:
        raise ValueError(f"{what}[0] must be a tensor of shape [..., d]")
    if not first.is_floating_point():
        raise ValueError(f"{what} must be floating-point tensors (float64, float32, bfloat16, float16), got {first.dtype}")
    for i, s in enumerate(sources[1:], start=1):
        if not isinstance(s, Tensor):
            raise ValueError(f"{what}[{i}] is a {type(s).__name__}, expected a tensor")
        if s.shape != first.shape:
            raise ValueError(
                f"{what}[{i}] has shape {tuple(s.shape)} but {what}[0] has {tuple(first.shape)}; "
                "all sources must have the same shape"
            )
        if s.dtype != first.dtype:
            raise ValueError(
                f"{what}[{i}] has dtype {s.dtype} but {what}[0] has {first.dtype}; "
                "all sources must have the same dtype"
            )
        if s.device != first.device:
            raise ValueError(f"{what}[{i}] is on {s.device} but {what}[0] is on {first.device}")


def _check_vector(name: str, v: Tensor | None, d: int, device: torch.device | None = None,
                  required: bool = False) -> None:
    if v is None and not required:
        return
    if not isinstance(v, Tensor) or v.shape != (d,):
        shape = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
        raise ValueError(f"{name} must have shape ({d},) to match the sources' last dimension, got {shape}")
    if device is not None and v.device != device:
        raise ValueError(f"{name} is on {v.device} but the sources are on {device}")


def _check_eps(name: str, value: float) -> None:
    """An RMS epsilon: a number >= 0 (a negative or NaN one gave NaN results, with no word of why)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Depth attention runs in float32, or float64 when the inputs are float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def full_precision(x: Tensor) -> contextlib.AbstractContextManager:
    """A context that switches autocast off for ``x``'s device when it is on (a no-op
    otherwise), so that depth-attention products are not silently run in bf16."""
    device_type = x.device.type
    # (meta tensors - shape inference - have no autocast state to ask)
    if device_type != "meta" and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def depth_attention(
    query: Tensor,
    sources: Sequence[Tensor],
    key_norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    scale: float = 1.0,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Softmax attention of one pseudo-query over a list of depth sources.

    ``h = sum_i alpha_i * v_i`` with ``alpha = softmax_i(scale * query . RMSNorm(v_i))`` and
    ``RMSNorm(x) = x / sqrt(mean(x^2) + eps) * key_norm_weight``.

    Args:
        query: ``[d]`` pseudo-query ``w_l`` (zero at init, which gives uniform weights).
        sources: ``n >= 1`` tensors of one shape ``[..., d]``, one dtype and device: the
            values, which are also the keys before normalisation.
        key_norm_weight: ``[d]`` learnable gain of the RMSNorm on the keys; ``None`` means 1.
        eps: RMSNorm epsilon.
        scale: logit scale; the report uses 1 (no ``1/sqrt(d)``).
        return_weights: also return the attention weights.

    Returns:
        ``h`` of shape ``[..., d]`` in the sources' dtype, and with ``return_weights`` the
        weights ``[n, ...]`` in float32 (float64 for float64 sources).

    All arithmetic runs in float32 (or float64 for float64 inputs); the result is cast back
    to the sources' dtype once, at the end.
    """
    check_sources(sources)
    _check_eps("eps", eps)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    d = sources[0].shape[-1]
    _check_vector("query", query, d, sources[0].device, required=True)
    _check_vector("key_norm_weight", key_norm_weight, d, sources[0].device)
    compute = compute_dtype(sources[0].dtype)

    # Autocast off: the matmul below must not silently drop to bf16.
    with full_precision(sources[0]):
        values = torch.stack([s.to(compute) for s in sources])  # [n, ..., d]
        keys = values * torch.rsqrt(values.pow(2).mean(dim=-1, keepdim=True) + eps)
        if key_norm_weight is not None:
            keys = keys * key_norm_weight.to(compute)
        logits = (keys @ query.to(compute)) * scale  # [n, ...]
        weights = torch.softmax(logits, dim=0)
        out = (weights.unsqueeze(-1) * values).sum(dim=0).to(sources[0].dtype)
    if return_weights:
        return out, weights
    return out


# ----------------------------------------------------------------------------------------
# Helpers shared with the PyTorch implementation.
# ----------------------------------------------------------------------------------------


def rms_inverse(x: Tensor, eps: float) -> Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` over the last dimension, in the compute dtype:
    ``[..., d] -> [...]``. Computed once per source and reused by every query that sees it."""
    compute = compute_dtype(x.dtype)
    sq = torch.linalg.vector_norm(x, dim=-1, dtype=compute).square()
    return torch.rsqrt(sq / x.shape[-1] + eps)


def weighted_sum(weights: Tensor, sources: Sequence[Tensor]) -> Tensor:
    """``sum_j weights[..., j] * sources[j]`` in the weights' dtype (the compute dtype):
    ``[..., n] -> [..., d]``; the sources may be narrower (a merge's Phase-1 sums).

    A chain of fused multiply-adds: each source is read once and no stacked copy of the
    sources is made (that copy and a batched tiny matmul cost more on CPU). Under a
    ``torch.func`` transform the adds are out of place: ``vmap`` has no batching rule for
    ``addcmul_`` and warned of a performance drop at every vmap over a model."""
    compute = weights.dtype
    w = weights.unsqueeze(-1)
    out = sources[0].to(compute) * w[..., 0, :]
    in_place = torch.compiler.is_compiling() or not torch._C._are_functorch_transforms_active()
    for j in range(1, len(sources)):
        if in_place:
            out.addcmul_(sources[j], w[..., j, :])  # no new buffer per source
        else:
            out = torch.addcmul(out, sources[j], w[..., j, :])
    return out


# ----------------------------------------------------------------------------------------
# The operations, as plain autograd graphs.
# ----------------------------------------------------------------------------------------


def rms_logits(x: Tensor, qg: Tensor, eps: float) -> Tensor:
    """Logits of a source ``x [..., d]`` against ``K`` gain-folded queries ``qg [K, d]``
    (query times key-norm gain, report §3.1: ``w . (g * x_hat) = (w * g) . x_hat``):
    ``z [..., K] = (x . qg_k) / rms(x)`` in the compute dtype."""
    compute = compute_dtype(x.dtype)
    with full_precision(x):
        xc = x.to(compute)
        return F.linear(xc, qg.to(compute)) * rms_inverse(xc, eps).unsqueeze(-1)


def phase1(qg: Tensor, sources: Sequence[Tensor], eps: float = 1e-6,
           out_dtype: torch.dtype | None = None) -> tuple[list[Tensor], Tensor]:
    """Phase 1 (report Algorithm 1) of ``S`` gain-folded queries ``qg [S, d]`` over ``n``
    shared sources ``[..., d]``: each source's RMS factor once for the ``S`` queries, the
    logits, and the ``S`` weighted sums ``sum_i softmax(z_s)_i x_i`` (``[..., d]``, in
    ``out_dtype``, by default the sources' - under autocast the autocast dtype, which halves
    the bytes the merges read: ``ResidualConfig.autocast_phase1_sums``) with the log-sum-exp
    of each query's logits ``lse [..., S]`` - the one statistic with which Phase 2 merges a
    weighted sum as a source whose logit is ``lse``."""
    check_phase1(qg, sources, out_dtype, eps)
    with full_precision(sources[0]):
        z = torch.stack([rms_logits(x, qg, eps) for x in sources], dim=-1)  # [..., S, n]
        p = torch.softmax(z, dim=-1)
        outs = [weighted_sum(p[..., s, :], sources).to(out_dtype or sources[0].dtype) for s in range(z.shape[-2])]
        return outs, torch.logsumexp(z, dim=-1)


def stream_dtype(sources: Sequence[Tensor], computed: Sequence[Tensor]) -> torch.dtype:
    """The dtype of the residual stream a merge reads: its computed sources' (Block AttnRes'
    partial sum, Full AttnRes' outputs), else its sources' of known logit. Phase-1 sums may be
    stored narrower (``autocast_phase1_sums``): the merge's output, and the value its norm
    reads, are in the stream's dtype all the same."""
    return (computed or sources)[0].dtype


def merge(
    z: Tensor,
    sources: Sequence[Tensor],
    computed: Sequence[Tensor] = (),
    qg: Tensor | None = None,
    eps: float = 1e-6,
    norm_weight: Tensor | None = None,
    norm_eps: float = 1e-6,
    addend: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    readers: int = 1,
) -> tuple[Tensor, ...]:
    """One query's depth attention (Phase 2, report §4.2), and the next sublayer's RMSNorm.

    Args:
        z: ``[..., k]``, the query's logits for ``sources`` (compute dtype).
        sources: ``k >= 0`` tensors ``[..., d]`` of known logit (a Phase-1 weighted sum,
            whose logit is its log-sum-exp), in one dtype: the computed sources' or, for
            Phase-1 sums stored in the autocast dtype, a narrower one (their gradients are
            returned in it).
        computed: ``c >= 0`` tensors ``[..., d]`` whose logits for the gain-folded query
            ``qg [d]`` are computed here (RMS epsilon ``eps``): Block AttnRes' partial sum,
            Full AttnRes' outputs of the current group. ``k + c >= 1``.
        norm_weight, norm_eps: the next sublayer's RMSNorm, applied to the result (``None``:
            none). It reads ``h`` rounded to the stream's dtype (:func:`stream_dtype`), as
            an unfused norm would;
            the gradient reaching ``h`` stays in the compute dtype.
        addend: ``[..., d]`` added to the last computed source first - Block AttnRes'
            partial sum and the last sublayer's output, whose sum the merge forms in the
            pass that reads them (the sum keeps that source's dtype).
        out_dtype: the dtype of ``out`` (``None``: the stream's); under autocast, the
            autocast dtype that the next sublayer's linear layers would each round ``out``
            to - rounded once, here.
        readers: how many layers read ``out``; above 1, ``out`` is a tuple with one tensor
            for each, whose gradients add up in the compute dtype (each reader's own
            rounding of ``h`` here: the values, and the sum of their gradients, that
            readers each rounding a float32 ``out`` would give).

    Returns:
        ``(out, alpha)``: ``out [..., d]`` in ``out_dtype``, ``RMSNorm(h)`` (or ``h``)
        with ``h = sum_j alpha_j x_j``; ``alpha [..., k + c] = softmax(z, z_computed)``;
        with ``addend``, ``(out, alpha, total)``, ``total`` the sum it formed.
    """
    _check_merge(z, sources, computed, qg, addend, out_dtype, readers, norm_weight, eps, norm_eps)
    total = None
    if addend is not None:
        total = computed[-1] + addend
        computed = [*computed[:-1], total]
    srcs, stream = [*sources, *computed], stream_dtype(sources, computed)
    compute = compute_dtype(stream)
    with full_precision(srcs[0]):
        logits = torch.cat([z.to(compute), *(rms_logits(x, qg.unsqueeze(0), eps) for x in computed)], dim=-1)
        alpha = torch.softmax(logits, dim=-1)
        h = weighted_sum(alpha, srcs)
        if norm_weight is not None:
            # The norm reads h rounded to the stream's dtype, the gradient passes that rounding
            # straight through in the compute dtype (not rounded to the stream's dtype: that
            # would put its noise into every logit's and query's gradient).
            rounded = h.to(stream).to(compute)
            h = F.rms_norm(h + (rounded - h).detach(), (h.shape[-1],), norm_weight.to(compute), norm_eps)
    if readers > 1:
        # (rounded from the compute dtype for each reader: their gradients meet in it)
        out = tuple(h.to(out_dtype or stream) for _ in range(readers))
    else:
        out = h.to(out_dtype or stream)
    return (out, alpha) if total is None else (out, alpha, total)


def check_phase1(qg: Tensor, sources: Sequence[Tensor], out_dtype: torch.dtype | None = None,
                 eps: float = 1e-6) -> None:
    """Phase 1's arguments, checked at the boundary (every implementation: the kernels take
    every size from the first source and trust the others)."""
    check_sources(sources)
    _check_out_dtype(out_dtype)
    _check_eps("eps", eps)
    d = sources[0].shape[-1]
    if not isinstance(qg, Tensor) or qg.dim() != 2 or qg.shape[-1] != d:
        got = tuple(qg.shape) if isinstance(qg, Tensor) else type(qg).__name__
        # (one query [d], as depth_attention takes it, was answered with the shape alone)
        one = "; one query: qg[None]" if isinstance(qg, Tensor) and qg.shape == (d,) else ""
        raise ValueError(f"qg must have shape [S, {d}] (S queries of the sources' d = {d}), got {got}{one}")
    if qg.device != sources[0].device:
        raise ValueError(f"qg is on {qg.device} but the sources are on {sources[0].device}")


def _check_merge(z: Tensor, sources: Sequence[Tensor], computed: Sequence[Tensor], qg: Tensor | None,
                 addend: Tensor | None = None, out_dtype: torch.dtype | None = None, readers: int = 1,
                 norm_weight: Tensor | None = None, eps: float = 1e-6, norm_eps: float = 1e-6) -> None:
    """The merge's arguments, checked at the boundary (every implementation: the kernels take
    every size from the first source and trust the others)."""
    if not _merge_sources_agree(sources, computed):
        _refuse_merge_sources(sources, computed)
    first = (sources or computed)[0]
    if not isinstance(z, Tensor) or z.shape[:-1] != first.shape[:-1]:
        got = tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__
        raise ValueError(f"z must have shape [{', '.join(map(str, first.shape[:-1]))}, {len(sources)}] (a logit per "
                         f"source of known logit, per row of the sources), got {got}")
    if z.device != first.device:  # (the C kernel refused it naming itself, the reference deep inside a cat)
        raise ValueError(f"z is on {z.device} but the sources are on {first.device}")
    d = first.shape[-1]
    _check_vector("qg", qg, d, first.device)
    _check_vector("norm_weight", norm_weight, d, first.device)
    if not isinstance(readers, int) or isinstance(readers, bool) or readers < 1:
        raise ValueError(f"readers must be an int >= 1, got {readers!r}")
    _check_out_dtype(out_dtype)
    if sources and computed and torch.promote_types(sources[0].dtype, computed[0].dtype) != computed[0].dtype:
        raise ValueError(f"the sources of known logit ({sources[0].dtype}) may be narrower than the computed sources "
                         f"({computed[0].dtype}, the stream's dtype), not wider")
    if addend is not None:
        if not computed:
            raise ValueError("addend is added to the last computed source: computed must not be empty")
        last = computed[-1]
        if not isinstance(addend, Tensor):
            raise ValueError(f"addend must be a tensor [..., d] or None, got {type(addend).__name__}")
        if addend.shape != last.shape or torch.promote_types(last.dtype, addend.dtype) != last.dtype:
            raise ValueError(f"addend must have the last computed source's shape {tuple(last.shape)} and a dtype "
                             f"that promotes to its {last.dtype}; got {tuple(addend.shape)}, {addend.dtype}")
        if addend.device != last.device:
            raise ValueError(f"addend is on {addend.device} but the sources are on {last.device}")
    if z.shape[-1] != len(sources):
        raise ValueError(f"z has {z.shape[-1]} logits for {len(sources)} sources")
    compute = compute_dtype(stream_dtype(sources, computed))
    if z.dtype != compute:  # (the C kernel refused another dtype naming itself, the reference took it)
        raise ValueError(f"z must be in the compute dtype {compute} (float64 for float64 sources, else float32), "
                         f"got {z.dtype}: pass z.to({compute})")
    _check_eps("eps", eps)
    _check_eps("norm_eps", norm_eps)
    if computed and qg is None:
        raise ValueError("computed sources need the query qg (their logits are computed here)")


def _check_out_dtype(out_dtype: torch.dtype | None) -> None:
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise ValueError(f"out_dtype must be a floating-point torch.dtype or None, got {out_dtype!r}")


def _merge_sources_agree(sources: Sequence[Tensor], computed: Sequence[Tensor]) -> bool:
    """Whether the merge's two lists of tensors pass :func:`_refuse_merge_sources`'s checks:
    one pass over them on the hot path (a merge per sublayer), without building a message."""
    if isinstance(sources, Tensor) or isinstance(computed, Tensor) or not isinstance(sources, Sequence) \
            or not isinstance(computed, Sequence) or not (sources or computed):
        return False
    first = (sources or computed)[0]
    if not isinstance(first, Tensor) or first.dim() < 1:
        return False
    shape, device = first.shape, first.device
    for group in (sources, computed):
        if not group:
            continue
        dtype = group[0].dtype if isinstance(group[0], Tensor) else None
        if dtype is None or not dtype.is_floating_point:
            return False
        for x in group:
            if not isinstance(x, Tensor) or x.shape != shape or x.dtype != dtype or x.device != device:
                return False
    return True


def _refuse_merge_sources(sources: Sequence[Tensor], computed: Sequence[Tensor]) -> None:
    """Raise the ``ValueError`` that says what is wrong with the merge's sources: not a list,
    none at all, a source that is not a tensor ``[..., d]``, shapes or devices that differ, or
    a list whose tensors do not share one floating-point dtype."""
    for what, group in (("sources", sources), ("computed", computed)):
        if isinstance(group, Tensor) or not isinstance(group, Sequence):
            raise ValueError(f"{what} must be a list or tuple of tensors, got {type(group).__name__}")
    if not sources and not computed:
        raise ValueError("depth merge needs at least one source")
    named = [*((f"sources[{i}]", x) for i, x in enumerate(sources)),
             *((f"computed[{i}]", x) for i, x in enumerate(computed))]
    first_name, first = named[0]
    for name, x in named:
        if not isinstance(x, Tensor) or x.dim() < 1:
            raise ValueError(f"{name} must be a tensor of shape [..., d], got {type(x).__name__}")
        if x.shape != first.shape or x.device != first.device:
            raise ValueError(f"{name} has shape {tuple(x.shape)} on {x.device} but {first_name} has "
                             f"{tuple(first.shape)} on {first.device}; every source must have one shape and device")
    for what, group in (("sources", sources), ("computed", computed)):
        for i, x in enumerate(group):
            if not x.is_floating_point() or x.dtype != group[0].dtype:
                raise ValueError(f"{what}[{i}] has dtype {x.dtype} but {what}[0] has {group[0].dtype}; the {what} "
                                 "must share one floating-point dtype")
    raise AssertionError("_merge_sources_agree refused sources that pass every check")  # (the two must agree)
