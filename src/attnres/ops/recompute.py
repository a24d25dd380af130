"""The training path of the two-phase schedule: custom autograd functions that save only the
sources and per-token statistics, and recompute the rest in their backward (report §4.2).

Every function here has a *reference* beside it with the same signature, written with plain
PyTorch operations (autograd records their graph): the tests compare the two, forward and
every gradient, and gradcheck the functions in float64.

=====================================  =====================================================
function (custom backward)             reference (autograd graph)
=====================================  =====================================================
:func:`lean_rms_logits`                :func:`~attnres.ops.rms_logits`
:func:`lean_depth_merge`               :func:`depth_merge_reference`
:func:`lean_phase1` (CPU kernel)        :func:`phase1_reference`
=====================================  =====================================================

On CPU, with ``cpu_kernel=True`` (the ``"auto"`` backend's choice) the merge and the logits
run in the fused C kernel of :mod:`attnres.kernels.cpu`, whose PyTorch counterparts are the
code in :class:`_DepthMerge` and :class:`_RmsLogits` (same saved tensors);
:func:`lean_phase1` batches a block's queries over their shared sources there, and
:func:`tap_source` lets the nodes that read a source sum its gradient in place.

What the autograd graph of the reference keeps, per sublayer: the Phase-1 weighted sums
``o_hat`` (one ``[..., d]`` in float32 per query), the merged input ``h_l`` (kept by the
sublayer's RMSNorm), the partial sum, and a dozen per-token temporaries of the logit, its
RMS factor and the softmax. What :func:`lean_depth_merge` keeps: references to its sources
(kept anyway, since later sublayers read them), the partial sum (in place of the ``h_l``
the standard residual's norm keeps), the softmax weights over the ``n`` sources (``n``
floats per token), and three per-token scalars (the partial sum's logit and RMS factor, the
norm's ``1/rms``). The weighted sum ``h_l``, the norm's input and the Phase-1 results are
recomputed in the backward from those, in one pass per source - or, with ``keep_input``
(many sources: Full AttnRes), the norm's input is kept, as the standard model keeps its own.

The merge also fuses what follows it: the logit of Block AttnRes' partial sum (its RMS
factor and its dot product with the query) and the next sublayer's RMSNorm, so a sublayer's
residual is one node of the autograd graph, with one analytic backward, instead of about
twenty operations and their saved tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..kernels.cpu import (
    cpu_kernel_supports,
    logits_backward,
    logits_forward,
    merge_backward,
    merge_forward,
    phase1_backward,
    phase1_forward,
)
from .two_phase import compute_dtype, full_precision, rms_inverse, rms_logits, weighted_sum, weighted_sums

__all__ = [
    "lean_rms_logits",
    "lean_depth_merge",
    "depth_merge_reference",
    "lean_phase1",
    "phase1_reference",
    "tap_source",
    "GradSlot",
]


def _dot(a: Tensor, b: Tensor, scratch: Tensor, out: Tensor | None = None) -> Tensor:
    """``sum(a * b, -1)`` in ``a``'s dtype (``b`` is cast to it): ``[..., d] -> [...]``.

    The product goes into ``scratch`` (``[..., d]`` like ``a``), reused by every dot of one
    backward: on CPU a fresh ``[..., d]`` buffer per dot costs more than the dot (the
    allocator returns large blocks to the system, and every new one is paged in again)."""
    torch.mul(a, b if b.dtype == a.dtype else b.to(a.dtype), out=scratch)
    return torch.sum(scratch, dim=-1) if out is None else torch.sum(scratch, dim=-1, out=out)


def _token_sum(weights: Tensor, x: Tensor) -> Tensor:
    """``sum over tokens of weights[...] * x[..., d]`` -> ``[d]``: one matrix-vector product,
    no ``[..., d]`` temporary."""
    d = x.shape[-1]
    return weights.reshape(-1) @ x.reshape(-1, d)


# ----------------------------------------------------------------------------------------
# Logits of a completed source against every later query.
# ----------------------------------------------------------------------------------------


class _RmsLogits(torch.autograd.Function):
    """``z = (x . qg_k) / rms(x)``; saves ``x`` (a source: kept anyway), ``qg`` and the
    per-token RMS factor; the backward is analytic."""

    @staticmethod
    def forward(ctx, x: Tensor, qg: Tensor, eps: float, use_kernel: bool) -> Tensor:
        ctx.kernel = use_kernel and cpu_kernel_supports([x, qg], x.dtype)  # (it checks qg's dtype too)
        if ctx.kernel:  # attnres/kernels/cpu_merge.c: one pass, the products in registers
            z, r = logits_forward(x, qg if qg.dim() == 2 else qg.unsqueeze(0), eps)
            ctx.slots = GradSlot.of([x])
            ctx.save_for_backward(x, qg, r)
            return z if qg.dim() == 2 else z.squeeze(-1)
        compute = compute_dtype(x.dtype)
        with full_precision(x):
            xc = x if x.dtype == compute else x.to(compute)
            q = qg if qg.dtype == compute else qg.to(compute)
            r = rms_inverse(xc, eps)  # [...]
            z = (xc @ q) * r if q.dim() == 1 else F.linear(xc, q) * r.unsqueeze(-1)
        ctx.save_for_backward(x, q, r)
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx, gz: Tensor):
        if ctx.kernel:
            return (*_rms_logits_kernel_backward(ctx, gz), None, None)
        x, q, r = ctx.saved_tensors
        d = x.shape[-1]
        compute = q.dtype
        gz = gz.to(compute)
        xc = x if x.dtype == compute else x.to(compute)
        gx = gq = None
        if q.dim() == 1:
            gr = gz * r  # [...]
            if ctx.needs_input_grad[0]:
                # d z / d x = r q - (r^3 / d) (q . x) x = r q - (r^2 z / d) x
                gx = (gr.unsqueeze(-1) * q).addcmul_(xc, (gr * r * r * (xc @ q) / d).unsqueeze(-1), value=-1)
            if ctx.needs_input_grad[1]:
                gq = _token_sum(gr, xc)
        else:
            gr = gz * r.unsqueeze(-1)  # [..., K]
            if ctx.needs_input_grad[0]:
                u = gr @ q  # [..., d]: r * sum_k gz_k q_k
                gx = u.addcmul_(xc, (r * r * _dot(u, xc, torch.empty_like(u)) / d).unsqueeze(-1), value=-1)
            if ctx.needs_input_grad[1]:
                gq = gr.reshape(-1, gr.shape[-1]).t() @ xc.reshape(-1, d)
        if gx is not None and gx.dtype != x.dtype:
            gx = gx.to(x.dtype)
        return gx, gq, None, None


def _rms_logits_kernel_backward(ctx, gz: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """:class:`_RmsLogits`' backward on the CPU kernel: ``(d x, d qg)``; ``d x`` goes into
    the source's gradient slot where it has one."""
    x, qg, r = ctx.saved_tensors
    vector = qg.dim() == 1  # one query [d]: the logits are [...]
    if vector:
        qg, gz = qg.unsqueeze(0), gz.unsqueeze(-1)
    needs_x, needs_qg = ctx.needs_input_grad[:2]
    into = GradSlot.destinations(ctx.slots, [x], [needs_x])[0]
    gx, gq = logits_backward(gz, x, qg, r, needs_x, needs_qg, into)
    return gx, (gq.squeeze(0) if gq is not None and vector else gq)


def lean_rms_logits(x: Tensor, qg: Tensor, eps: float, cpu_kernel: bool = False) -> Tensor:
    """:func:`~attnres.ops.rms_logits` (same signature, same result) as one autograd node
    that saves only ``x``, ``qg`` and one RMS factor per token: ``x [..., d]`` against
    gain-folded queries ``qg [K, d]`` (-> ``[..., K]``) or ``[d]`` (-> ``[...]``), in the
    compute dtype. ``cpu_kernel``: in the fused CPU kernel where it applies (as
    :func:`lean_depth_merge`; it then sums the gradient of a :func:`tap_source` output in
    place)."""
    return _RmsLogits.apply(x, qg, eps, cpu_kernel)


# ----------------------------------------------------------------------------------------
# A source's gradient, summed in place by the merges that read it.
# ----------------------------------------------------------------------------------------


class GradSlot:
    """One source's gradient from the merges that read it, summed in place by the CPU
    kernel: one buffer per source instead of a new ``[..., d]`` per (merge, source) pair,
    each then added up by autograd (three more passes). :func:`tap_source` creates it; the
    tap's backward hands the sum on. Tied to one backward pass (autograd's graph-task id),
    so a merge in a later pass over a retained graph never adds to a stale sum."""

    __slots__ = ("grad", "task")

    def __init__(self) -> None:
        self.grad: Tensor | None = None
        self.task = -1

    def destination(self, x: Tensor) -> tuple[Tensor, bool]:
        """Where a merge writes ``d loss / d x``, and whether it adds to what is there."""
        task = torch._C._current_graph_task_id()
        if self.grad is None or self.task != task:
            self.grad, self.task = torch.empty_like(x), task
            return self.grad, False
        return self.grad, True

    def take(self) -> Tensor | None:
        """The sum of this backward pass (``None`` if no merge wrote one), emptying the slot."""
        grad, self.grad = self.grad, None
        return grad if self.task == torch._C._current_graph_task_id() else None

    @staticmethod
    def of(sources: Sequence[Tensor]) -> list[GradSlot | None]:
        """The slot of each source (``None``: not a :func:`tap_source` output)."""
        return [getattr(x.grad_fn, "attnres_grad_slot", None) for x in sources]

    @staticmethod
    def destinations(slots, sources, needs) -> list[tuple[Tensor, bool] | None]:
        """Each needed source's :meth:`destination` (``None``: no slot, or not needed)."""
        return [slot.destination(x) if slot is not None and need else None
                for slot, x, need in zip(slots, sources, needs)]


class _SourceTap(torch.autograd.Function):
    """Identity whose node carries a :class:`GradSlot`; the backward adds the slot's sum to
    the gradient from the other consumers (autograd runs it after every merge that read
    the source: each merge is one of its consumers)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.set_materialize_grads(False)
        ctx.attnres_grad_slot = GradSlot()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor | None):
        summed = ctx.attnres_grad_slot.take()
        if summed is None:
            return g
        return summed if g is None else summed.add_(g)


def tap_source(x: Tensor) -> Tensor:
    """``x`` as a source of the lean path's merges (``[..., d]``, same values): with the CPU
    kernel they sum its gradient into one :class:`GradSlot` instead of returning one each.
    Merges on the PyTorch code, or over a view of the result, return theirs as usual."""
    return _SourceTap.apply(x) if x.requires_grad and torch.is_grad_enabled() else x


# ----------------------------------------------------------------------------------------
# One sublayer's input: softmax over depth, weighted sum, optional partial sum and norm.
# ----------------------------------------------------------------------------------------


class _DepthMerge(torch.autograd.Function):
    """See :func:`lean_depth_merge`. Inputs after the settings: ``z, partial, qg,
    norm_weight, *sources`` (``None`` where absent)."""

    @staticmethod
    def forward(ctx, eps, norm_eps, out_dtype, keep_input, use_kernel, z, partial, qg, norm_weight, *sources):
        ctx.kernel = use_kernel and z.dtype == sources[0].dtype and cpu_kernel_supports(
            [*sources, partial, qg, norm_weight], out_dtype)
        if ctx.kernel:  # the same computation in one pass over the tokens (attnres/kernels/cpu_merge.c)
            h, alpha, r_b, zb, rstd, kept = merge_forward(z, sources, partial, qg, eps, norm_weight, norm_eps, keep_input)
            ctx.slots = GradSlot.of(sources)
        else:
            h, alpha, r_b, zb, rstd, kept = _merge_forward(z, sources, partial, qg, eps, norm_weight, norm_eps,
                                                           out_dtype, keep_input)
        ctx.out_dtype = out_dtype
        ctx.eps, ctx.norm_eps = eps, norm_eps
        ctx.has_partial, ctx.has_norm = partial is not None, norm_weight is not None
        ctx.save_for_backward(alpha, r_b, zb, rstd, kept, partial, qg, norm_weight, *sources)
        return h if h.dtype == out_dtype else h.to(out_dtype)

    @staticmethod
    @once_differentiable  # (its PyTorch code writes into scratch buffers: no double backward)
    def backward(ctx, gout: Tensor):
        alpha, r_b, zb, rstd, kept, partial, qg, norm_weight, *sources = ctx.saved_tensors
        ni = ctx.needs_input_grad
        needs = ni[:3] + ni[5:]  # eps, norm_eps, out_dtype, z, partial, qg, norm_weight, *sources
        if ctx.kernel:
            into = GradSlot.destinations(ctx.slots, sources, needs[7:])
            g_z, g_partial, g_qg, g_norm, grads_src = merge_backward(
                gout, alpha, r_b, zb, rstd, kept, partial, qg, norm_weight, sources, needs[7:], needs[3],
                needs[4], needs[5], needs[6], into)
        else:
            g_z, g_partial, g_qg, g_norm, grads_src = _merge_backward(ctx, gout, needs, alpha, r_b, zb, rstd, kept,
                                                                      partial, qg, norm_weight, sources)
        return None, None, None, None, None, g_z, g_partial, g_qg, g_norm, *grads_src


def _merge_forward(z, sources, partial, qg, eps, norm_weight, norm_eps, out_dtype, keep_input):
    """:class:`_DepthMerge`'s forward in PyTorch (the kernel's reference): ``(h, alpha, r_b,
    zb, rstd, kept)``, ``None`` where absent."""
    compute = compute_dtype(sources[0].dtype)
    d = sources[0].shape[-1]
    with full_precision(sources[0]):
        zc = z if z.dtype == compute else z.to(compute)
        srcs = list(sources)
        r_b = zb = None
        if partial is not None:  # the partial sum's logit for this query, and its RMS factor
            pc = partial if partial.dtype == compute else partial.to(compute)
            q = qg if qg.dtype == compute else qg.to(compute)
            r_b = rms_inverse(pc, eps)
            zb = (pc @ q) * r_b
            zc = torch.cat([zc, zb.unsqueeze(-1)], dim=-1)
            srcs.append(partial)
        alpha = torch.softmax(zc, dim=-1)  # [..., n]
        h = weighted_sum(alpha, srcs)
        rstd = kept = None
        if norm_weight is not None:
            if out_dtype != compute:  # the norm reads the stream's value, rounded to its dtype
                h = h.to(out_dtype).to(compute)
            kept = h if keep_input else None
            h, rstd = torch.ops.aten._fused_rms_norm(h, [d], norm_weight.to(compute), norm_eps)
    return h, alpha, r_b, zb, rstd, kept


def _merge_backward(ctx, gout, needs, alpha, r_b, zb, rstd, kept, partial, qg, norm_weight, sources):
    """:class:`_DepthMerge`'s backward in PyTorch (the kernel's reference): ``(g_z,
    g_partial, g_qg, g_norm, grads of the sources)``."""
    compute = alpha.dtype
    d = sources[0].shape[-1]
    srcs = sources + ([partial] if ctx.has_partial else [])
    g = gout if gout.dtype == compute else gout.to(compute)
    g_norm = None
    scratch = torch.empty_like(g)  # every [..., d] product of this backward that is not returned
    if ctx.has_norm:  # recompute h, the norm's input, from the sources and the weights
        if kept is not None:
            h = kept
        else:
            h = weighted_sum(alpha, srcs)
            if ctx.out_dtype != compute:
                h = h.to(ctx.out_dtype).to(compute)
        if needs[6]:  # dw = sum over tokens of g h rstd
            g_norm = _token_sum(rstd, torch.mul(g, h, out=scratch)).to(norm_weight.dtype)
        # y = h rstd w: dh = rstd (u - (rstd^2 / d) (u . h) h) with u = g w.
        u = g * norm_weight.to(compute)
        gh = u.addcmul_(h, rstd * rstd * _dot(u, h, scratch).unsqueeze(-1) / d, value=-1).mul_(rstd)  # rstd [..., 1]
        if ctx.out_dtype != compute:  # the backward of that rounding
            gh = gh.to(ctx.out_dtype).to(compute)
    else:
        gh = g
    # Softmax backward: dz_j = alpha_j (gh . x_j - gh . h), gh . h = sum_j alpha_j (gh . x_j).
    s = alpha.new_empty((len(srcs), *alpha.shape[:-1]))  # [n, ...]: one row per source, no stack
    for j, x in enumerate(srcs):
        _dot(gh, x, scratch, out=s[j])
    s = s.movedim(0, -1)  # [..., n]
    gz_all = alpha * (s - (alpha * s).sum(dim=-1, keepdim=True))
    grads_src = []
    for j, x in enumerate(sources):
        if needs[7 + j]:
            gx = gh * alpha[..., j : j + 1]
            grads_src.append(gx if gx.dtype == x.dtype else gx.to(x.dtype))
        else:
            grads_src.append(None)
    g_partial = g_qg = None
    if ctx.has_partial:
        gzb = gz_all[..., -1]
        pc = partial if partial.dtype == compute else partial.to(compute)
        q = qg if qg.dtype == compute else qg.to(compute)
        gr = gzb * r_b  # [...]
        if needs[4]:
            # d zb / d b = r q - (r^2 zb / d) b, plus the direct weight alpha_b.
            g_partial = (gh * alpha[..., -1:]).addcmul_(gr.unsqueeze(-1), q)
            g_partial.addcmul_(pc, (gr * r_b * zb / d).unsqueeze(-1), value=-1)
            if g_partial.dtype != partial.dtype:
                g_partial = g_partial.to(partial.dtype)
        if needs[5]:
            g_qg = _token_sum(gr, pc)
            if g_qg.dtype != qg.dtype:
                g_qg = g_qg.to(qg.dtype)
        gz_all = gz_all[..., :-1]
    g_z = gz_all if needs[3] else None
    return g_z, g_partial, g_qg, g_norm, grads_src


# ----------------------------------------------------------------------------------------
# Phase 1 of a block's (or group's) queries in one pass over their sources (CPU kernel).
# ----------------------------------------------------------------------------------------


class _Phase1(torch.autograd.Function):
    """See :func:`lean_phase1`. Saves ``z``, the log-sum-exp and references to the sources;
    the backward recomputes the weights from them."""

    @staticmethod
    def forward(ctx, z: Tensor, *sources: Tensor):
        ctx.set_materialize_grads(False)
        outs, lse = phase1_forward(z, sources)
        ctx.slots = GradSlot.of(sources)
        ctx.save_for_backward(z, lse, *sources)
        return (*outs, lse)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        z, lse, *sources = ctx.saved_tensors
        g_outs, g_lse = grads[:-1], grads[-1]
        needs = ctx.needs_input_grad
        into = GradSlot.destinations(ctx.slots, sources, needs[1:])
        g_z, g_src = phase1_backward(z, lse, sources, g_outs, g_lse, needs[0], needs[1:], into)
        return g_z, *g_src


def lean_phase1(z: Tensor, sources: Sequence[Tensor]) -> tuple[list[Tensor], Tensor]:
    """Phase 1 of ``S`` queries over their ``n`` shared sources (report §4.2) in the CPU
    kernel: one read of each source in the forward and one in the backward for all ``S``
    queries, where per-query merges read it ``S`` times.

    Args:
        z: ``[..., S, n]``, the queries' logits for ``sources``.
        sources: ``n`` tensors ``[..., d]``; CPU, contiguous, all float32 or all float64
            like ``z`` (:func:`~attnres.kernels.cpu.cpu_kernel_supports`).

    Returns:
        ``S`` weighted sums ``sum_i softmax(z_s)_i x_i`` (``[..., d]``) and the log-sum-exp
        of each query's logits ``[..., S]``, the statistics with which Phase 2 merges them
        (:func:`lean_depth_merge` with the weighted sum as a source whose logit is the
        log-sum-exp). :func:`phase1_reference` is the same function in PyTorch.
    """
    *outs, lse = _Phase1.apply(z, *sources)
    return outs, lse


def phase1_reference(z: Tensor, sources: Sequence[Tensor]) -> tuple[list[Tensor], Tensor]:
    """:func:`lean_phase1` with plain PyTorch operations: the readable reference."""
    return weighted_sums(torch.softmax(z, dim=-1), sources), torch.logsumexp(z, dim=-1)


def _check_merge_inputs(z: Tensor, sources: Sequence[Tensor], partial: Tensor | None, qg: Tensor | None) -> None:
    if not sources:
        raise ValueError("depth merge needs at least one source with a known logit")
    if z.shape[-1] != len(sources):
        raise ValueError(f"z has {z.shape[-1]} logits for {len(sources)} sources")
    if (partial is None) != (qg is None):
        raise ValueError("partial and qg come together (the partial sum's logit needs the query)")


def lean_depth_merge(
    z: Tensor,
    sources: Sequence[Tensor],
    partial: Tensor | None = None,
    qg: Tensor | None = None,
    eps: float = 1e-6,
    norm_weight: Tensor | None = None,
    norm_eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
    keep_input: bool = False,
    cpu_kernel: bool = False,
) -> Tensor:
    """One query's depth attention from known logits, as one autograd node.

    Args:
        z: ``[..., n]``, the query's logits for ``sources`` (computed once per source, when
            it completed: :func:`lean_rms_logits`).
        sources: ``n >= 1`` tensors ``[..., d]``, the values.
        partial: Block AttnRes' partial sum ``[..., d]``, one more source whose logit for the
            gain-folded query ``qg [d]`` is computed here (RMS factor ``eps``); ``None``: none.
        norm_weight, norm_eps: the next sublayer's RMSNorm, applied to the result here
            (``None``: no norm).
        out_dtype: the result's dtype (default: the sources').
        keep_input: with a norm, save its input ``h`` (one ``[..., d]``) instead of
            recomputing it in the backward (one pass per source): for many sources (Full
            AttnRes), where the recompute costs more time than the tensor costs memory.
        cpu_kernel: run forward and backward in the fused CPU kernel
            (:mod:`attnres.kernels.cpu`) where it applies (CPU tensors, all float32 or all
            float64, contiguous, a C compiler on the machine); the PyTorch code otherwise.

    Returns:
        ``RMSNorm(h)`` (or ``h``) ``[..., d]`` with ``h = sum_j softmax(z, z_b)_j x_j``: the
        softmax and the sum in float32 (float64 for float64 sources), autocast off.

    Saves only the softmax weights (``n (+1)`` floats per token), the partial sum's logit and
    RMS factor, the norm's ``1/rms`` and references to the inputs; the backward recomputes
    ``h`` (one fused multiply-add pass per source) when the norm needs it.
    :func:`depth_merge_reference` is the same function as a plain autograd graph.
    """
    _check_merge_inputs(z, sources, partial, qg)
    out_dtype = sources[0].dtype if out_dtype is None else out_dtype
    return _DepthMerge.apply(eps, norm_eps, out_dtype, keep_input, cpu_kernel, z, partial, qg, norm_weight, *sources)


def depth_merge_reference(
    z: Tensor,
    sources: Sequence[Tensor],
    partial: Tensor | None = None,
    qg: Tensor | None = None,
    eps: float = 1e-6,
    norm_weight: Tensor | None = None,
    norm_eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
    keep_input: bool = False,
    cpu_kernel: bool = False,
) -> Tensor:
    """:func:`lean_depth_merge` written with plain PyTorch operations (autograd records and
    keeps their graph): the readable reference, same signature, same result."""
    _check_merge_inputs(z, sources, partial, qg)
    compute = compute_dtype(sources[0].dtype)
    out_dtype = sources[0].dtype if out_dtype is None else out_dtype
    srcs = list(sources)
    with full_precision(sources[0]):
        logits = z.to(compute)
        if partial is not None:
            logits = torch.cat([logits, rms_logits(partial, qg.to(compute), eps).unsqueeze(-1)], dim=-1)
            srcs.append(partial)
        h = weighted_sum(torch.softmax(logits, dim=-1), srcs)
        if norm_weight is not None:
            h = F.rms_norm(h, (h.shape[-1],), norm_weight.to(compute), norm_eps)
    return h.to(out_dtype)
