"""The depth-attention operations as ``torch.library`` custom operators.

Three operators cover the two-phase schedule (report §4.2), each with a backward operator:

=================================  ================================================  =========================
operator                           computes                                          backward operator
=================================  ================================================  =========================
``attnres::rms_logits``            a completed source's logits against ``K``         ``rms_logits_backward``
                                   later queries, and its RMS factor
``attnres::phase1``                Phase 1 of ``S`` queries over ``n`` shared        ``phase1_backward``
                                   sources: weighted sums and log-sum-exp
``attnres::merge``                 one sublayer's input: softmax over known logits   ``merge_backward``
                                   (and Block's partial sum), weighted sum, the
                                   next sublayer's RMSNorm
=================================  ================================================  =========================

Every operator has a fake implementation (``torch.compile`` traces it as one node, so
compiled and eager training run the same kernels) and its autograd registered with
``torch.library.register_autograd``: the forward saves what :mod:`.torch_impl` describes
and the backward calls the backward operator - one decomposition for all implementations.

The last argument, ``impl``, picks the implementation: ``"auto"`` (by device: the C kernel
of :mod:`.cpu_kernel` for CPU tensors it supports, else :mod:`.torch_impl`; the Triton
kernels of :mod:`.triton_impl` for CUDA tensors when triton is installed, else PyTorch),
``"torch"`` (:mod:`.torch_impl` on any device) or ``"triton"`` (the Triton kernels; on CPU
only under ``TRITON_INTERPRET=1``). The public wrappers are :func:`rms_logits`,
:func:`phase1` and :func:`merge`; :mod:`.reference` has the same three functions as plain
autograd graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from . import cpu_kernel, torch_impl
from .reference import _check_merge, compute_dtype

__all__ = ["IMPLS", "rms_logits", "phase1", "merge", "pick"]

#: Values of the operators' ``impl`` argument.
IMPLS = ("auto", "torch", "triton")


def pick(impl: str, tensors: Sequence[Tensor | None]) -> ModuleType:
    """The implementation module that runs an operator over ``tensors`` (see the module
    docstring): by ``impl`` and the first tensor's device."""
    if impl == "torch":
        return torch_impl
    device = next(t for t in tensors if t is not None).device.type
    if impl == "triton" or device == "cuda":
        from . import triton_impl  # (triton is optional: imported where it can run)

        if impl == "triton":
            triton_impl.check(tensors)
            return triton_impl
        return triton_impl if triton_impl.supports(tensors) else torch_impl
    if device == "cpu" and cpu_kernel.supports(tensors):
        return cpu_kernel
    return torch_impl


def _placeholder(like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A stand-in for an absent result (operators cannot return ``None``)."""
    return torch.empty(0, dtype=dtype or like.dtype, device=like.device)


def _fill(results: Sequence[Tensor | None], likes: Sequence[Tensor]) -> tuple[Tensor, ...]:
    return tuple(_placeholder(like) if r is None else r for r, like in zip(results, likes))


# ----------------------------------------------------------------------------------------
# rms_logits
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("attnres::rms_logits", mutates_args=())
def _rms_logits(x: Tensor, qg: Tensor, eps: float, impl: str) -> tuple[Tensor, Tensor]:
    qg = qg.contiguous()
    return pick(impl, [x, qg]).rms_logits_forward(x, qg, eps)


@_rms_logits.register_fake
def _(x, qg, eps, impl):
    compute = compute_dtype(x.dtype)
    return x.new_empty((*x.shape[:-1], qg.shape[0]), dtype=compute), x.new_empty(x.shape[:-1], dtype=compute)


@torch.library.custom_op("attnres::rms_logits_backward", mutates_args=())
def _rms_logits_backward(gz: Tensor, x: Tensor, qg: Tensor, r: Tensor, needs: list[bool], impl: str
                         ) -> tuple[Tensor, Tensor]:
    qg, gz = qg.contiguous(), gz.contiguous()
    gx, gq = pick(impl, [x, qg, r, gz]).rms_logits_backward(gz, x, qg, r, *needs)
    return _fill([gx, gq], [x, qg])


@_rms_logits_backward.register_fake
def _(gz, x, qg, r, needs, impl):
    return (torch.empty_like(x) if needs[0] else _placeholder(x)), (torch.empty_like(qg) if needs[1] else _placeholder(qg))


def _rms_logits_setup(ctx, inputs, output):
    x, qg, _eps, impl = inputs
    ctx.set_materialize_grads(False)
    ctx.impl = impl
    ctx.save_for_backward(x, qg, output[1])


def _rms_logits_grads(ctx, gz, needs: list[bool]) -> tuple[Tensor | None, Tensor | None]:
    """``(d x, d qg)`` through the backward operator, ``None`` where not needed."""
    if gz is None or not any(needs):
        return None, None
    x, qg, r = ctx.saved_tensors
    gx, gq = torch.ops.attnres.rms_logits_backward(gz, x, qg, r, needs, ctx.impl)
    return (gx if needs[0] else None), (gq if needs[1] else None)


def _rms_logits_grad(ctx, gz, _gr):
    return *_rms_logits_grads(ctx, gz, list(ctx.needs_input_grad[:2])), None, None


_rms_logits.register_autograd(_rms_logits_grad, setup_context=_rms_logits_setup)


# ----------------------------------------------------------------------------------------
# phase1
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("attnres::phase1", mutates_args=())
def _phase1(z: Tensor, sources: list[Tensor], impl: str) -> tuple[list[Tensor], Tensor]:
    z = z.contiguous()  # (small: [..., S, n])
    outs, lse = pick(impl, [*sources, z]).phase1_forward(z, sources)
    return list(outs), lse


@_phase1.register_fake
def _(z, sources, impl):
    return [torch.empty_like(sources[0]) for _ in range(z.shape[-2])], z.new_empty(z.shape[:-1])


@torch.library.custom_op("attnres::phase1_backward", mutates_args=())
def _phase1_backward(z: Tensor, lse: Tensor, sources: list[Tensor], g_outs: list[Optional[Tensor]],
                     g_lse: Optional[Tensor], needs: list[bool], impl: str) -> tuple[Tensor, list[Tensor]]:
    z, g_outs = z.contiguous(), [g if g is None else g.contiguous() for g in g_outs]
    g_lse = None if g_lse is None else g_lse.contiguous()
    module = pick(impl, [*sources, z, lse, *g_outs, g_lse])
    g_z, g_src = module.phase1_backward(z, lse, sources, g_outs, g_lse, needs[0], needs[1:])
    return _fill([g_z], [z])[0], list(_fill(g_src, sources))


@_phase1_backward.register_fake
def _(z, lse, sources, g_outs, g_lse, needs, impl):
    g_z = torch.empty_like(z) if needs[0] else _placeholder(z)
    return g_z, [torch.empty_like(x) if need else _placeholder(x) for x, need in zip(sources, needs[1:])]


def _phase1_setup(ctx, inputs, output):
    z, sources, impl = inputs
    ctx.set_materialize_grads(False)
    ctx.impl, ctx.n = impl, len(sources)
    ctx.save_for_backward(z, output[1], *sources)


def _phase1_grads(ctx, g_outs, g_lse, needs: list[bool]) -> tuple[Tensor | None, list[Tensor | None]]:
    """``(d z, [d source...])`` through the backward operator, ``None`` where not needed."""
    z, lse, *sources = ctx.saved_tensors
    g_outs = list(g_outs) if g_outs is not None else [None] * z.shape[-2]
    if (all(g is None for g in g_outs) and g_lse is None) or not any(needs):
        return None, [None] * len(sources)
    g_z, g_src = torch.ops.attnres.phase1_backward(z, lse, sources, g_outs, g_lse, needs, ctx.impl)
    return (g_z if needs[0] else None), [g if need else None for g, need in zip(g_src, needs[1:])]


def _phase1_grad(ctx, g_outs, g_lse):
    ni = ctx.needs_input_grad
    g_z, g_src = _phase1_grads(ctx, g_outs, g_lse, [ni[0], *ni[1]])
    return g_z, g_src, None


_phase1.register_autograd(_phase1_grad, setup_context=_phase1_setup)


# ----------------------------------------------------------------------------------------
# merge
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("attnres::merge", mutates_args=())
def _merge(z: Tensor, sources: list[Tensor], partial: Optional[Tensor], qg: Optional[Tensor],
           norm_weight: Optional[Tensor], eps: float, norm_eps: float, impl: str
           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    z, qg = z.contiguous(), None if qg is None else qg.contiguous()  # (small: [..., n] and [d])
    module = pick(impl, [*sources, z, partial, qg, norm_weight])
    out, alpha, r_b, zb, rstd = module.merge_forward(z, sources, partial, qg, norm_weight, eps, norm_eps)
    return (out, alpha, *_fill([r_b, zb, rstd], [alpha] * 3))


@_merge.register_fake
def _(z, sources, partial, qg, norm_weight, eps, norm_eps, impl):
    x0, compute = sources[0], compute_dtype(sources[0].dtype)
    lead = x0.shape[:-1]
    alpha = x0.new_empty((*lead, len(sources) + (partial is not None)), dtype=compute)
    stat = x0.new_empty(lead, dtype=compute) if partial is not None else _placeholder(alpha)
    rstd = x0.new_empty((*lead, 1), dtype=compute) if norm_weight is not None else _placeholder(alpha)
    return torch.empty_like(x0), alpha, stat, stat.clone(), rstd


@torch.library.custom_op("attnres::merge_backward", mutates_args=())
def _merge_backward(g: Tensor, alpha: Tensor, r_b: Optional[Tensor], zb: Optional[Tensor], rstd: Optional[Tensor],
                    sources: list[Tensor], partial: Optional[Tensor], qg: Optional[Tensor],
                    norm_weight: Optional[Tensor], needs: list[bool], impl: str
                    ) -> tuple[Tensor, list[Tensor], Tensor, Tensor, Tensor]:
    g, qg = g.contiguous(), None if qg is None else qg.contiguous()
    module = pick(impl, [*sources, g, alpha, r_b, zb, rstd, partial, qg, norm_weight])
    g_z, g_src, g_partial, g_qg, g_norm = module.merge_backward(g, alpha, r_b, zb, rstd, sources, partial, qg,
                                                                norm_weight, needs)
    g_partial, g_qg, g_norm = _fill([g_partial, g_qg, g_norm], [alpha] * 3)
    return _fill([g_z], [alpha])[0], list(_fill(g_src, sources)), g_partial, g_qg, g_norm


@_merge_backward.register_fake
def _(g, alpha, r_b, zb, rstd, sources, partial, qg, norm_weight, needs, impl):
    n = len(sources)

    def grad(need, like):
        return torch.empty_like(like) if need and like is not None else _placeholder(alpha)

    g_z = alpha.new_empty((*alpha.shape[:-1], n)) if needs[0] else _placeholder(alpha)
    g_src = [torch.empty_like(x) if need else _placeholder(x) for x, need in zip(sources, needs[1 : n + 1])]
    return g_z, g_src, grad(needs[n + 1], partial), grad(needs[n + 2], qg), grad(needs[n + 3], norm_weight)


def _merge_setup(ctx, inputs, output):
    z, sources, partial, qg, norm_weight, _eps, _norm_eps, impl = inputs
    _out, alpha, r_b, zb, rstd = output
    ctx.set_materialize_grads(False)
    ctx.impl, ctx.n = impl, len(sources)
    has_partial, has_norm = partial is not None, norm_weight is not None
    stats = [r_b if has_partial else None, zb if has_partial else None, rstd if has_norm else None]
    ctx.save_for_backward(alpha, *stats, partial, qg, norm_weight, *sources)


def _merge_grads(ctx, g, needs: list[bool]):
    """``(d z, [d source...], d partial, d qg, d norm_weight)`` through the backward
    operator, ``None`` where not needed; ``needs`` in that order."""
    alpha, r_b, zb, rstd, partial, qg, norm_weight, *sources = ctx.saved_tensors
    if g is None or not any(needs):
        return None, [None] * len(sources), None, None, None
    grads = torch.ops.attnres.merge_backward(g, alpha, r_b, zb, rstd, sources, partial, qg, norm_weight, needs, ctx.impl)
    n = len(sources)
    g_src = [t if need else None for t, need in zip(grads[1], needs[1 : n + 1])]
    return (grads[0] if needs[0] else None), g_src, *(t if need else None for t, need in zip(grads[2:], needs[n + 1 :]))


def _merge_grad(ctx, g, *_aux):
    ni = ctx.needs_input_grad
    g_z, g_src, g_partial, g_qg, g_norm = _merge_grads(ctx, g, [ni[0], *ni[1], ni[2], ni[3], ni[4]])
    return g_z, g_src, g_partial, g_qg, g_norm, None, None, None


_merge.register_autograd(_merge_grad, setup_context=_merge_setup)


# ----------------------------------------------------------------------------------------
# The public wrappers
# ----------------------------------------------------------------------------------------
#
# They reach the operators through thin autograd Functions whose forward and backward call
# the same forward and backward operators, with the same saved tensors and the same gradient
# functions as the registered autograd above: in eager mode the registered path costs
# about a hundred microseconds more per call (its tensor-list handling), which the schedule
# pays a few dozen times per step. torch.compile traces the Functions, and the operators
# inside them are the nodes of its graphs.


class _RmsLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, qg, eps, impl):
        z, r = torch.ops.attnres.rms_logits(x, qg, eps, impl)
        _rms_logits_setup(ctx, (x, qg, eps, impl), (z, r))
        ctx.mark_non_differentiable(r)
        return z, r

    @staticmethod
    def backward(ctx, gz, _gr):
        return *_rms_logits_grads(ctx, gz, list(ctx.needs_input_grad[:2])), None, None


class _Phase1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, impl, *sources):
        outs, lse = torch.ops.attnres.phase1(z, list(sources), impl)
        _phase1_setup(ctx, (z, sources, impl), (outs, lse))
        return (*outs, lse)

    @staticmethod
    def backward(ctx, *grads):
        ni = ctx.needs_input_grad
        g_z, g_src = _phase1_grads(ctx, grads[:-1], grads[-1], [ni[0], *ni[2:]])
        return g_z, None, *g_src


class _Merge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, partial, qg, norm_weight, eps, norm_eps, impl, *sources):
        args = (z, list(sources), partial, qg, norm_weight, eps, norm_eps, impl)
        outputs = torch.ops.attnres.merge(*args)
        _merge_setup(ctx, args, outputs)
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, g, *_aux):
        ni = ctx.needs_input_grad
        g_z, g_src, g_partial, g_qg, g_norm = _merge_grads(ctx, g, [ni[0], *ni[7:], ni[1], ni[2], ni[3]])
        return g_z, g_partial, g_qg, g_norm, None, None, None, *g_src


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def rms_logits(x: Tensor, qg: Tensor, eps: float, impl: str = "auto") -> Tensor:
    """:func:`.reference.rms_logits` as the operator ``attnres::rms_logits``: ``x [..., d]``,
    ``qg [K, d]`` -> ``z [..., K]`` (compute dtype); saves ``x``, ``qg`` and one RMS factor
    per token."""
    _check_impl(impl)
    if qg.dim() != 2 or qg.shape[-1] != x.shape[-1]:
        raise ValueError(f"qg must have shape [K, {x.shape[-1]}], got {tuple(qg.shape)}")
    return _RmsLogits.apply(x, qg, float(eps), impl)[0]


def phase1(z: Tensor, sources: Sequence[Tensor], impl: str = "auto") -> tuple[list[Tensor], Tensor]:
    """:func:`.reference.phase1` as the operator ``attnres::phase1``: ``z [..., S, n]`` ->
    ``S`` weighted sums ``[..., d]`` and ``lse [..., S]``; one pass over each source for all
    ``S`` queries, forward and backward."""
    _check_impl(impl)
    if z.shape[-1] != len(sources):
        raise ValueError(f"z has {z.shape[-1]} logits per query for {len(sources)} sources")
    *outs, lse = _Phase1.apply(z, impl, *sources)
    return outs, lse


def merge(z: Tensor, sources: Sequence[Tensor], partial: Tensor | None = None, qg: Tensor | None = None,
          eps: float = 1e-6, norm_weight: Tensor | None = None, norm_eps: float = 1e-6,
          impl: str = "auto") -> tuple[Tensor, Tensor]:
    """:func:`.reference.merge` (same arguments and results) as the operator
    ``attnres::merge``: ``(out [..., d], alpha [..., n (+1)])``; saves the weights, the
    partial sum's logit and RMS factor, the norm's ``1/rms`` and references to its inputs."""
    _check_impl(impl)
    _check_merge(z, sources, partial, qg)
    out, alpha, *_ = _Merge.apply(z, partial, qg, norm_weight, float(eps), float(norm_eps), impl, *sources)
    return out, alpha
