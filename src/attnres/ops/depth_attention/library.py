"""The depth-attention operations as ``torch.library`` custom operators.

Two operators cover the two-phase schedule (report §4.2), each with a backward operator:

* ``attnres::phase1`` (backward: ``phase1_backward``): Phase 1 of ``S`` queries over ``n``
  shared sources - each source's RMS factor and logits once for the ``S`` queries, the
  weighted sums and each query's log-sum-exp;
* ``attnres::merge`` (backward: ``merge_backward``): one sublayer's input - softmax over
  sources of known logit (Phase 1's weighted sum) and sources whose logits it computes
  (Block AttnRes' partial sum, Full AttnRes' outputs of the current group), the weighted
  sum, the next sublayer's RMSNorm.

Every operator has a fake implementation (``torch.compile`` traces it as one node, so
compiled and eager training run the same kernels) and its autograd registered with
``torch.library.register_autograd``: the forward saves what :mod:`.torch_impl` describes
and the backward calls the backward operator - one decomposition for all implementations.

The ``backend`` argument (followed only by the optional ``addend`` and ``out_dtype``) picks
the implementation: ``"auto"`` (by device: the C kernel of :mod:`.cpu_kernel` for CPU tensors
it supports, else :mod:`.torch_impl`; the Triton kernels of :mod:`.triton_impl` for CUDA
tensors when triton is installed, else PyTorch), ``"torch"`` (:mod:`.torch_impl` on any
device) or ``"triton"`` (the Triton kernels; on CPU only under ``TRITON_INTERPRET=1``). The
public wrappers are :func:`phase1` and :func:`merge`; :mod:`.reference` has the same
functions as plain autograd graphs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from ...user_warning import warn_user
from ...validation import did_you_mean
from . import cpu_kernel, reference, torch_impl
from .reference import _check_merge, check_phase1, compute_dtype, stream_dtype

__all__ = ["BACKENDS", "phase1", "merge", "pick", "through_dispatcher", "triton_unavailable", "under_transforms"]

#: Values of the operators' ``backend`` argument.
BACKENDS = ("auto", "torch", "triton")


@functools.cache
def _triton_impl() -> ModuleType | ImportError:
    """:mod:`.triton_impl`, imported on first use (triton is optional: imported where it can
    run), then kept - no import statement per call; the ``ImportError`` where triton cannot
    be imported (on CUDA the operations then run in PyTorch, after one warning)."""
    try:
        from . import triton_impl
    except ImportError as e:
        return e
    return triton_impl


#: Whether the warning that the operations run in PyTorch for want of triton was given.
_warned_without_triton: list[bool] = []


def _without_triton(backend: str, error: ImportError) -> ModuleType:
    """What runs where the Triton kernels were wanted but triton cannot be imported:
    ``backend="triton"`` asked for them (a ``ValueError``); ``"auto"`` on CUDA gets PyTorch."""
    if backend == "triton":
        raise ValueError(f"backend='triton' needs the triton package, which cannot be imported here ({error}); "
                         "pip install triton, or use backend='auto' (PyTorch where triton is missing)") from error
    if not _warned_without_triton:
        _warned_without_triton.append(True)
        warn_user(f"triton cannot be imported ({error}): AttnRes' depth attention runs in PyTorch on CUDA, "
                  "slower than its Triton kernels (pip install triton)", RuntimeWarning)
    return torch_impl


def _warn_if_too_old(triton_impl: ModuleType, device: torch.device) -> None:
    """Warn once where ``"auto"`` runs the operations in PyTorch on a CUDA card older than
    Triton compiles for (other tensors the kernels do not take, float64 ones, say nothing)."""
    reason = triton_impl.unsupported_gpu(device)
    if reason is not None and not _warned_without_triton:
        _warned_without_triton.append(True)
        warn_user(f"AttnRes' depth attention runs in PyTorch: {reason}", RuntimeWarning)


def triton_unavailable(device: torch.device) -> str | None:
    """Why ``backend="triton"`` cannot run on tensors of ``device`` here, or ``None`` where it
    can: the kernels run on CUDA devices (elsewhere only under Triton's interpreter,
    ``TRITON_INTERPRET=1``, the tests), need triton importable and a card Triton compiles for
    (compute capability 7.0 or newer). For the callers that pick a
    backend before any work (a training run, a loaded checkpoint): the operators themselves
    refuse it only at their first call, after the data and the model were set up."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the Triton kernels run on CUDA GPUs, and the device is {device.type}"
    triton_impl = _triton_impl()
    if isinstance(triton_impl, ImportError):
        return f"triton cannot be imported here: {triton_impl}"
    return triton_impl.unsupported_gpu(device)


def pick(backend: str, tensors: Sequence[Tensor | None]) -> ModuleType:
    """The implementation module that runs an operator over ``tensors`` (see the module
    docstring): by ``backend`` and the first tensor's device."""
    if backend == "torch":
        return torch_impl
    device = next(t for t in tensors if t is not None).device.type
    if backend == "triton" or device == "cuda":
        triton_impl = _triton_impl()
        if isinstance(triton_impl, ImportError):
            return _without_triton(backend, triton_impl)
        if backend == "triton":
            triton_impl.check(tensors)
            return triton_impl
        if triton_impl.supports(tensors):
            return triton_impl
        _warn_if_too_old(triton_impl, next(t for t in tensors if t is not None).device)
        return torch_impl
    if device == "cpu" and cpu_kernel.supports(tensors):
        return cpu_kernel
    return torch_impl


def _placeholder(like: Tensor) -> Tensor:
    """A stand-in for an absent result (operators cannot return ``None``)."""
    return torch.empty(0, dtype=like.dtype, device=like.device)


def _fill(results: Sequence[Tensor | None], like: Tensor) -> list[Tensor]:
    return [_placeholder(like) if r is None else r for r in results]


def _contiguous(xs: Sequence[Tensor | None]) -> list[Tensor | None]:
    return [x if x is None else x.contiguous() for x in xs]


def _converts(backend: str, stream: Tensor) -> bool:
    """Whether arguments of another dtype than the ``stream`` tensor's - queries, norm gains,
    Phase-1 sums narrower than the stream - are converted to it (:func:`_as_stream`): with
    ``backend="auto"`` on a float32/float64 CPU stream, for the C kernel (which takes one
    dtype; otherwise the whole operator ran in PyTorch, silently). The reference reads each
    of them in the stream's dtype (its compute dtype), so the kernel computes the same
    function. Elsewhere (CUDA, a bf16 stream, the ``"torch"`` and ``"triton"`` backends, which
    read them as they are) nothing is converted, and this test is all a call pays."""
    return backend == "auto" and stream.is_cpu and stream.dtype in (torch.float32, torch.float64)


def _as_stream(stream: torch.dtype, xs: Sequence[Tensor | None]) -> list[Tensor | None]:
    """``xs`` in the ``stream`` dtype (see :func:`_converts`)."""
    return [x.to(stream) if x is not None and x.dtype != stream else x for x in xs]


def _like(grads: Sequence[Tensor | None], inputs: Sequence[Tensor | None]) -> list[Tensor | None]:
    """Each gradient in its input's dtype (of inputs :func:`_as_stream` converted)."""
    return [g.to(x.dtype) if g is not None and x is not None and g.dtype != x.dtype else g
            for g, x in zip(grads, inputs)]


# ----------------------------------------------------------------------------------------
# phase1
# ----------------------------------------------------------------------------------------


def _run_phase1(qg: Tensor, sources: list[Tensor], eps: float, backend: str,
                out_dtype: Optional[torch.dtype] = None) -> tuple[list[Tensor], Tensor]:
    if _converts(backend, sources[0]):
        qg = qg.to(sources[0].dtype)
    qg = qg.contiguous()  # (small: [S, d])
    outs, lse = pick(backend, [*sources, qg]).phase1_forward(qg, sources, eps, out_dtype)
    return list(outs), lse


_phase1 = torch.library.custom_op("attnres::phase1", _run_phase1, mutates_args=())


@_phase1.register_fake
def _(qg, sources, eps, backend, out_dtype=None):
    x0 = sources[0]
    lse = x0.new_empty((*x0.shape[:-1], qg.shape[0]), dtype=compute_dtype(x0.dtype))
    return [torch.empty_like(x0, dtype=out_dtype or x0.dtype) for _ in range(qg.shape[0])], lse


def _run_phase1_backward(qg: Tensor, lse: Tensor, sources: list[Tensor], g_outs: list[Optional[Tensor]],
                         g_lse: Optional[Tensor], eps: float, needs: list[bool], backend: str
                         ) -> tuple[Tensor, list[Tensor]]:
    given = qg
    if _converts(backend, sources[0]):
        qg = qg.to(sources[0].dtype)
    qg, lse, g_lse = _contiguous([qg, lse, g_lse])
    g_outs = _contiguous(g_outs)
    # (by the forward's tensors: the sums' gradients have the sums' dtype, which the
    # implementation that wrote them reads - the C kernel converts a narrower one)
    module = pick(backend, [*sources, qg, lse, g_lse])
    g_qg, g_src = module.phase1_backward(qg, lse, sources, g_outs, g_lse, eps, needs[0], needs[1:])
    return _fill(_like([g_qg], [given]), given)[0], _fill(g_src, sources[0])


_phase1_backward = torch.library.custom_op("attnres::phase1_backward", _run_phase1_backward, mutates_args=())


@_phase1_backward.register_fake
def _(qg, lse, sources, g_outs, g_lse, eps, needs, backend):
    g_qg = torch.empty_like(qg) if needs[0] else _placeholder(qg)
    return g_qg, [torch.empty_like(x) if need else _placeholder(x) for x, need in zip(sources, needs[1:])]


def _phase1_setup(ctx, inputs, output):
    qg, sources, eps, backend, *_out_dtype = inputs
    ctx.set_materialize_grads(False)
    ctx.backend, ctx.eps, ctx.n = backend, eps, len(sources)
    ctx.save_for_backward(qg, output[1], *sources)


def _phase1_grads(ctx, g_outs, g_lse, needs: list[bool], direct: bool = False
                  ) -> tuple[Tensor | None, list[Tensor | None]]:
    """``(d qg, [d source...])`` through the backward operator (``direct``: its
    implementation, see :func:`_direct`), ``None`` where not needed."""
    qg, lse, *sources = ctx.saved_tensors
    g_outs = list(g_outs) if g_outs is not None else [None] * qg.shape[0]
    if (all(g is None for g in g_outs) and g_lse is None) or not any(needs):
        return None, [None] * len(sources)
    backward = _run_phase1_backward if direct else torch.ops.attnres.phase1_backward
    g_qg, g_src = backward(qg, lse, sources, g_outs, g_lse, ctx.eps, needs, ctx.backend)
    return (g_qg if needs[0] else None), [g if need else None for g, need in zip(g_src, needs[1:])]


def _phase1_grad(ctx, g_outs, g_lse):
    ni = ctx.needs_input_grad  # (qg, sources, eps, backend, out_dtype)
    g_qg, g_src = _phase1_grads(ctx, g_outs, g_lse, [ni[0], *ni[1]])
    return (g_qg, g_src, None, None, None)[: len(ni)]


_phase1.register_autograd(_phase1_grad, setup_context=_phase1_setup)


# ----------------------------------------------------------------------------------------
# merge
# ----------------------------------------------------------------------------------------


def _run_merge(z: Tensor, sources: list[Tensor], computed: list[Tensor], qg: Optional[Tensor],
               norm_weight: Optional[Tensor], eps: float, norm_eps: float, backend: str, addend: Optional[Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # (qg small: [d]; z [..., k] may be a strided view of Phase 1's lse)
    if _converts(backend, (computed or sources)[0]):
        *sources, qg, norm_weight = _as_stream(stream_dtype(sources, computed), [*sources, qg, norm_weight])
    qg = _contiguous([qg])[0]
    module = pick(backend, [*sources, *computed, qg, norm_weight])
    out, alpha, rc, zc, rstd, total = module.merge_forward(z, sources, computed, qg, norm_weight, eps, norm_eps,
                                                           addend, out_dtype)
    return out, alpha, *_fill([rc, zc, rstd, total], alpha)


_merge = torch.library.custom_op("attnres::merge", _run_merge, mutates_args=())


@_merge.register_fake
def _(z, sources, computed, qg, norm_weight, eps, norm_eps, backend, addend=None, out_dtype=None):
    x0, stream = [*sources, *computed][0], stream_dtype(sources, computed)
    lead, compute = x0.shape[:-1], compute_dtype(stream)
    alpha = x0.new_empty((*lead, len(sources) + len(computed)), dtype=compute)
    stat = x0.new_empty((*lead, len(computed)), dtype=compute) if computed else _placeholder(alpha)
    rstd = x0.new_empty((*lead, 1), dtype=compute) if norm_weight is not None else _placeholder(alpha)
    total = torch.empty_like(computed[-1]) if addend is not None else _placeholder(alpha)
    return torch.empty_like(x0, dtype=out_dtype or stream), alpha, stat, stat.clone(), rstd, total


def _run_merge_backward(g: Tensor, g_views: list[Tensor], alpha: Tensor, rc: Optional[Tensor], zc: Optional[Tensor],
                        rstd: Optional[Tensor], sources: list[Tensor], computed: list[Tensor], qg: Optional[Tensor],
                        norm_weight: Optional[Tensor], needs: list[bool], backend: str,
                        g_total: Optional[Tensor] = None, addend_dtype: Optional[torch.dtype] = None
                        ) -> tuple[Tensor, list[Tensor], list[Tensor], Tensor, Tensor, Tensor]:
    given = None  # (the arguments as given, where they are converted)
    if _converts(backend, (computed or sources)[0]):
        given = [*sources, qg, norm_weight]
        *sources, qg, norm_weight = _as_stream(stream_dtype(sources, computed), given)
    g, qg, g_total = _contiguous([g, qg, g_total])
    g_views = _contiguous(g_views)
    # (by the forward's tensors: the output's gradients have its dtype, which the implementation
    # that wrote it reads - the C kernel converts a narrower one)
    module = pick(backend, [*sources, *computed, alpha, rc, zc, rstd, qg, norm_weight])
    g_z, g_src, g_comp, g_qg, g_norm, g_addend = module.merge_backward(g, alpha, rc, zc, rstd, sources, computed, qg,
                                                                       norm_weight, needs, g_total, addend_dtype,
                                                                       g_views)
    if given is not None:
        *g_src, g_qg, g_norm = _like([*g_src, g_qg, g_norm], given)
    g_qg, g_norm, g_addend = _fill([g_qg, g_norm, g_addend], alpha)
    return _fill([g_z], alpha)[0], _fill(g_src, alpha), _fill(g_comp, alpha), g_qg, g_norm, g_addend


_merge_backward = torch.library.custom_op("attnres::merge_backward", _run_merge_backward, mutates_args=())


@_merge_backward.register_fake
def _(g, g_views, alpha, rc, zc, rstd, sources, computed, qg, norm_weight, needs, backend, g_total=None,
      addend_dtype=None):
    k, c = len(sources), len(computed)

    def grad(need, like):
        return torch.empty_like(like) if need and like is not None else _placeholder(alpha)

    g_z = alpha.new_empty((*alpha.shape[:-1], k)) if needs[0] else _placeholder(alpha)
    xs = [*sources, *computed]
    grads = [grad(need, x) for x, need in zip(xs, needs[1 : 1 + k + c])]
    g_addend = (torch.empty_like(xs[-1], dtype=addend_dtype) if addend_dtype is not None and needs[k + c]
                else _placeholder(alpha))
    return g_z, grads[:k], grads[k:], grad(needs[1 + k + c], qg), grad(needs[2 + k + c], norm_weight), g_addend


def _merge_setup(ctx, inputs, output):
    z, sources, computed, qg, norm_weight, _eps, _norm_eps, backend, *rest = inputs
    addend = rest[0] if rest else None  # (rest: the addend and the output's dtype, where given)
    _out, alpha, rc, zc, rstd, total = output
    ctx.set_materialize_grads(False)
    ctx.backend, ctx.k, ctx.c = backend, len(sources), len(computed)
    ctx.addend_dtype = None if addend is None else addend.dtype
    if addend is not None:  # the merge read the sum it formed, not the last computed source
        computed = [*computed[:-1], total]
    stats = [rc if computed else None, zc if computed else None, rstd if norm_weight is not None else None]
    ctx.save_for_backward(alpha, *stats, qg, norm_weight, *sources, *computed)
    # (the weights and statistics carry no gradient - a loss on them has none; in one call:
    # each call replaces the last one's set, which left the weights differentiable, their
    # gradient dropped in silence)
    ctx.mark_non_differentiable(alpha, rc, zc, rstd, *([total] if addend is None else []))


def _merge_grads(ctx, g, g_total, needs: list[bool], direct: bool = False, g_views: Sequence[Tensor | None] = ()):
    """``(d z, [d source...], [d computed...], d qg, d norm_weight, d addend)`` through the
    backward operator (``direct``: its implementation, see :func:`_direct`), ``None`` where
    not needed; ``needs`` in the order ``(z, *sources, *computed, qg, norm_weight)``, with an
    addend's need in its last computed source's. ``g_total``: the gradient of the sum formed
    with an addend, which reaches both of its terms; ``g_views``: the gradients of the views
    of the output handed to its other readers (``None`` where one was not used)."""
    alpha, rc, zc, rstd, qg, norm_weight, *xs = ctx.saved_tensors
    k, c = ctx.k, ctx.c
    present = [t for t in (g, *g_views) if t is not None]  # (the output's readers that were used)
    g, g_views = (present[0], present[1:]) if present else (None, [])
    if ctx.addend_dtype is None:  # (no sum formed: its placeholder's gradient, if any, is not one)
        g_total = None
    if (g is None and g_total is None) or not any(needs):
        return None, [None] * k, [None] * c, None, None, None
    # (an addend in a dtype of its own, e.g. an autocast sublayer's bf16: the backward writes its
    # gradient in that dtype too, no cast afterwards)
    addend_dtype = ctx.addend_dtype if ctx.addend_dtype not in (None, xs[-1].dtype) else None
    g_addend = None
    if g is None:  # only the sum is used downstream: its gradient passes to both terms
        g_z, g_src, g_comp, g_qg, g_norm = None, [None] * k, [None] * (c - 1) + [g_total], None, None
    else:
        backward = _run_merge_backward if direct else torch.ops.attnres.merge_backward
        g_z, g_src, g_comp, g_qg, g_norm, g_addend = backward(
            g, list(g_views), alpha, rc, zc, rstd, xs[:k], xs[k:], qg, norm_weight, needs, ctx.backend, g_total,
            addend_dtype)
    keep = lambda t, need: t if need else None  # noqa: E731
    grads = [keep(t, need) for t, need in zip([*g_src, *g_comp], needs[1 : 1 + k + c])]
    if ctx.addend_dtype is None or grads[-1] is None:
        g_addend = None
    elif addend_dtype is None:  # (the sum's dtype: its gradient is the addend's)
        g_addend = grads[-1]
    elif g_addend is None:  # (the sum's gradient passed on as it came)
        g_addend = grads[-1].to(addend_dtype)
    return (keep(g_z, needs[0]), grads[:k], grads[k:], keep(g_qg, needs[1 + k + c]), keep(g_norm, needs[2 + k + c]),
            g_addend)


def _merge_needs(ni, k: int, c: int, addend_index: int | None) -> list[bool]:
    """The backward operator's ``needs`` from ``ctx.needs_input_grad`` as flat entries for
    ``(z, qg, norm_weight, *sources, *computed)`` (``addend_index``: the addend's entry)."""
    z, qg, norm_weight, xs = ni[0], ni[1], ni[2], list(ni[3:3 + k + c])
    if addend_index is not None and ni[addend_index]:
        xs[-1] = True
    return [z, *xs, qg, norm_weight]


def _merge_grad(ctx, g, _alpha, _rc, _zc, _rstd, g_total):
    ni = ctx.needs_input_grad  # (z, sources, computed, qg, norm_weight, eps, norm_eps, backend, addend, out_dtype)
    flat = [ni[0], ni[3], ni[4], *ni[1], *ni[2], ni[8] if len(ni) > 8 else False]
    needs = _merge_needs(flat, ctx.k, ctx.c, 3 + ctx.k + ctx.c)
    g_z, g_src, g_comp, g_qg, g_norm, g_addend = _merge_grads(ctx, g, g_total, needs)
    if ctx.addend_dtype is not None and not ni[2][-1]:
        g_comp = [*g_comp[:-1], None]
    return (g_z, g_src, g_comp, g_qg, g_norm, None, None, None, g_addend, None)[: len(ni)]


_merge.register_autograd(_merge_grad, setup_context=_merge_setup)


def _no_double_backward(ctx, *grads):
    """The backward operators' own backward: a double backward (``create_graph=True``, then a
    backward through the gradients) is not implemented - said with the fix (PyTorch's own
    message asked to register an autograd formula)."""
    raise RuntimeError("a double backward (a gradient of a gradient: torch.autograd.grad(..., create_graph=True), "
                       "then a backward through it) reached AttnRes' depth-attention operators, which do not "
                       "implement one: build the residual with backend='reference' (the plain autograd graph, the "
                       "same function; ModelConfig.residual.backend='reference' in the model)")


for _backward_op in (_phase1_backward, _merge_backward):
    _backward_op.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


# ----------------------------------------------------------------------------------------
# The public wrappers
# ----------------------------------------------------------------------------------------
#
# They reach the operators through thin autograd Functions whose forward and backward run
# the same forward and backward operators, with the same saved tensors and the same gradient
# functions as the registered autograd above: the registered path costs about a hundred
# microseconds more per call in eager mode (its tensor-list handling), which the schedule
# pays a few dozen times per step. torch.compile traces the Functions, and the operators
# inside them are the nodes of its graphs.


_dispatched = threading.local()


@contextlib.contextmanager
def through_dispatcher() -> Iterator[None]:
    """Within this context (this thread), eager calls go through PyTorch's dispatcher as the
    operators ``attnres::*`` (see :func:`_direct`): for tools that watch the dispatcher - a
    ``TorchDispatchMode`` that counts operators, torch.profiler's operator table."""
    before = getattr(_dispatched, "on", False)
    _dispatched.on = True
    try:
        yield
    finally:
        _dispatched.on = before


def _direct() -> bool:
    """Whether the wrappers run the operators' Python implementations (``_run_*``) without
    the dispatcher: in eager mode, where a custom operator's dispatch (its autograd layer,
    dynamo guard and wrapper) costs tens of microseconds a call - more than a small shape's
    kernel, with a few dozen calls a step. Never while torch.compile or torch.jit.trace
    traces (its graphs carry the operators) or within :func:`through_dispatcher`. Same implementations, same
    results."""
    return not (torch.compiler.is_compiling() or torch.jit.is_tracing() or getattr(_dispatched, "on", False))


def _direct_backward() -> bool:
    """:func:`_direct` for a backward: not under ``create_graph`` (grad mode on in a
    backward), where the backward operator's dispatch refuses a double backward clearly."""
    return _direct() and not torch.is_grad_enabled()


def _phase1_forward(qg: Tensor, sources: list[Tensor], eps: float, backend: str,
                    out_dtype: torch.dtype | None) -> tuple[list[Tensor], Tensor]:
    """The operator ``attnres::phase1`` - or, where :func:`_direct`, its implementation."""
    return (_run_phase1 if _direct() else torch.ops.attnres.phase1)(qg, sources, eps, backend, out_dtype)


def _merge_forward(*args) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The operator ``attnres::merge`` - or, where :func:`_direct`, its implementation."""
    return (_run_merge if _direct() else torch.ops.attnres.merge)(*args)


class _Phase1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qg, eps, backend, out_dtype, *sources):
        outs, lse = _phase1_forward(qg, list(sources), eps, backend, out_dtype)
        _phase1_setup(ctx, (qg, sources, eps, backend), (outs, lse))
        return (*outs, lse)

    @staticmethod
    def backward(ctx, *grads):
        ni = ctx.needs_input_grad  # (qg, eps, backend, out_dtype, *sources)
        g_qg, g_src = _phase1_grads(ctx, grads[:-1], grads[-1], [ni[0], *ni[4:]], _direct_backward())
        return g_qg, None, None, None, *g_src


class _Merge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, qg, norm_weight, eps, norm_eps, backend, k, addend, out_dtype, readers, *xs):
        args = (z, list(xs[:k]), list(xs[k:]), qg, norm_weight, eps, norm_eps, backend, addend, out_dtype)
        outputs = _merge_forward(*args)
        _merge_setup(ctx, args, outputs)
        # (one view of the output per further reader: each reader's gradient reaches the
        # backward on its own edge, added there in the compute dtype - not by autograd in the
        # output's dtype)
        return (*outputs, *(outputs[0].view_as(outputs[0]) for _ in range(readers - 1)))

    @staticmethod
    def backward(ctx, g, _alpha, _rc, _zc, _rstd, g_total, *g_views):
        ni = ctx.needs_input_grad  # (z, qg, norm_weight, eps, norm_eps, backend, k, addend, out_dtype, readers, *xs)
        needs = _merge_needs([ni[0], ni[1], ni[2], *ni[10:]], ctx.k, ctx.c, None)
        if ni[7]:
            needs[ctx.k + ctx.c] = True  # (the addend's gradient is the last computed source's)
        g_z, g_src, g_comp, g_qg, g_norm, g_addend = _merge_grads(ctx, g, g_total, needs, _direct_backward(), g_views)
        if ctx.addend_dtype is not None and not ni[-1]:
            g_comp = [*g_comp[:-1], None]
        return g_z, g_qg, g_norm, None, None, None, None, g_addend, None, None, *g_src, *g_comp


# Without autograd, phase1 and merge call the operators directly (in eager mode their
# implementations, see _direct). Besides saving the Functions' bookkeeping, this keeps
# torch.compile off a Dynamo path that is wrong for them: under no_grad it inlines a
# Function's ``forward`` with the arguments shifted by one (``ctx`` dropped), which handed
# the operators wrong arguments in compiled inference.


def under_transforms() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ``jvp``, ...) is
    active - not while torch.compile traces. The wrappers then run :mod:`.reference` (the same
    function): the operators' autograd Functions do not support the transforms, which refused
    them asking for ``setup_context``."""
    return not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active()


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}{did_you_mean(backend, BACKENDS)}")


def phase1(qg: Tensor, sources: Sequence[Tensor], eps: float = 1e-6, backend: str = "auto",
           out_dtype: torch.dtype | None = None) -> tuple[list[Tensor], Tensor]:
    """:func:`.reference.phase1` as the operator ``attnres::phase1``: ``qg [S, d]`` over ``n``
    sources -> ``S`` weighted sums ``[..., d]`` (in ``out_dtype``, by default the sources';
    their gradients in it too) and ``lse [..., S]``; one pass over each source for all ``S``
    queries, forward and backward. Under ``torch.func`` transforms it runs
    :func:`.reference.phase1` (:func:`under_transforms`); a double backward is refused
    (``backend="reference"`` has one)."""
    _check_backend(backend)
    if under_transforms():
        return reference.phase1(qg, sources, eps, out_dtype)
    check_phase1(qg, sources, out_dtype, eps)
    if out_dtype == sources[0].dtype:
        out_dtype = None  # (one operator call for the default, however it is asked for)
    if not torch.is_grad_enabled():  # the operator itself (see the note above _check_backend)
        outs, lse = _phase1_forward(qg, list(sources), float(eps), backend, out_dtype)
        return list(outs), lse
    *outs, lse = _Phase1.apply(qg, float(eps), backend, out_dtype, *sources)
    return outs, lse


def merge(z: Tensor, sources: Sequence[Tensor], computed: Sequence[Tensor] = (), qg: Tensor | None = None,
          eps: float = 1e-6, norm_weight: Tensor | None = None, norm_eps: float = 1e-6,
          backend: str = "auto", addend: Tensor | None = None, out_dtype: torch.dtype | None = None,
          readers: int = 1) -> tuple[Tensor, ...]:
    """:func:`.reference.merge` (same arguments and results) as the operator
    ``attnres::merge``: ``(out [..., d], alpha [..., k + c])``, with ``addend`` also the sum
    it formed; saves the weights, the computed sources' logits and RMS factors, the norm's
    ``1/rms`` and references to its inputs (to the sum, not to its terms). ``out`` in
    ``out_dtype`` (default: the stream's, :func:`.reference.stream_dtype`); its gradient may
    come in that dtype. ``sources`` may be narrower than ``computed`` (Phase-1 sums in the
    autocast dtype); each source's gradient comes in its own dtype. ``readers >
    1``: ``out`` is a tuple of that many views of it, one per reader, whose gradients the
    backward adds in the compute dtype (one kernel reads them all). ``alpha`` is returned
    for recording and is not differentiable: a loss on it sends no gradient back (that of
    :func:`.reference.merge` does; the residual modules record differentiable weights). Under
    ``torch.func`` transforms it runs :func:`.reference.merge` (:func:`under_transforms`); a
    double backward is refused (``backend="reference"`` has one)."""
    _check_backend(backend)
    if under_transforms():
        return reference.merge(z, sources, computed, qg, eps, norm_weight, norm_eps, addend, out_dtype, readers)
    _check_merge(z, sources, computed, qg, addend, out_dtype, readers, norm_weight, eps, norm_eps)
    if out_dtype is not None and out_dtype == stream_dtype(sources, computed):
        out_dtype = None  # (one operator call for the default, however it is asked for)
    if not torch.is_grad_enabled():  # the operator itself (see the note above _check_backend)
        out, alpha, _rc, _zc, _rstd, total = _merge_forward(z, list(sources), list(computed), qg, norm_weight,
                                                            float(eps), float(norm_eps), backend, addend, out_dtype)
        views = (out,) * (readers - 1)
    else:
        out, alpha, _rc, _zc, _rstd, total, *views = _Merge.apply(
            z, qg, norm_weight, float(eps), float(norm_eps), backend, len(sources), addend, out_dtype, readers,
            *sources, *computed)
    if readers > 1:
        out = (out, *views)
    return (out, alpha) if addend is None else (out, alpha, total)
