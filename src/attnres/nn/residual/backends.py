"""Backends of the two-phase schedule: who computes Phase 1 and the Phase-2 merges.

Each backend implements the same three calls with the same signatures, so one is a drop-in
for another and the tests compare them:

* ``phase1(z, sources, first)``: the softmax statistics and weighted sums of ``count``
  queries over the completed sources (report Algorithm 1, Phase 1);
* ``merge(state, p1, s, xs, zs)``: the input of the ``s``-th of those queries' sublayers,
  its Phase-1 result merged with ``k >= 0`` more sources (Phase 2; Full AttnRes);
* ``merge_partial(state, p1, s, partial, qg, eps)``: the same with one more source, Block
  AttnRes' partial sum, whose logit it computes too;
* ``logits(x, qg, eps)``: a new source's logits against every later query (its RMS factor
  and one product), once, when it completes.

:class:`TorchBackend` is the PyTorch path written as a plain autograd graph (``attnres.ops``)
and the reference of the others; :class:`LeanBackend` is the training path (under autograd):
one custom autograd node per sublayer that saves only the sources and per-token statistics
and recomputes the rest in its backward (:mod:`attnres.ops.recompute`; on CPU in the fused C
kernel of :mod:`attnres.kernels.cpu`), with the next sublayer's RMSNorm fused in when the
caller defers it; :class:`DecodingBackend` is PyTorch
with fewer, smaller operations for no-grad decoding of a token or a few;
:class:`TritonBackend` runs the fused kernels of :mod:`attnres.kernels` and, when the caller
feeds the input to an RMSNorm (``state.defer_norm``), fuses that norm in.
:func:`select_backend` picks one per forward, from the embedding.

Phase 1's results differ by backend, and the type says which: the PyTorch graph keeps the
weighted sums and one log-sum-exp per query (:class:`LsePhase1`), the kernels the weighted
sums with the max and the sum-exp (:class:`StatsPhase1`), the lean path only the logits and
the sources (:class:`LogitsPhase1`: its merge forms the weighted sum itself) or, where its
CPU kernel batches Phase 1 (Full AttnRes), the weighted sums with their log-sum-exp
(:class:`KernelPhase1`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ...ops import (
    compute_dtype,
    decoding,
    lean_depth_merge,
    lean_phase1,
    lean_rms_logits,
    merge_partial_sum,
    merge_with_one_source,
    merge_with_sources_lse,
    rms_logits,
    tap_source,
    weighted_sums,
)
from ...kernels.cpu import cpu_kernel_supports
from ..norm import FusableNormInput
from .base import ResidualState

__all__ = [
    "Phase1Result",
    "WeightedPhase1",
    "LsePhase1",
    "StatsPhase1",
    "LogitsPhase1",
    "KernelPhase1",
    "Backend",
    "TorchBackend",
    "LeanBackend",
    "DecodingBackend",
    "TritonBackend",
    "select_backend",
]


@dataclass
class Phase1Result:
    """Phase 1 of ``count`` consecutive queries ``first .. first + count - 1``."""

    first: int


@dataclass
class WeightedPhase1(Phase1Result):
    """Phase 1 with its weighted sums formed.

    o_hat: ``count`` tensors ``[..., d]``, each query's normalised weighted sum over the
        completed sources, in the compute dtype (float32, or float64).
    p: ``[..., count, n]``, the weights over the ``n`` completed sources.
    """

    o_hat: list[Tensor]
    p: Tensor


@dataclass
class LsePhase1(WeightedPhase1):
    """PyTorch's Phase 1: ``lse [..., count]``, the log-sum-exp of each query's logits."""

    lse: Tensor


@dataclass
class LogitsPhase1(Phase1Result):
    """The lean path's Phase 1: ``z [..., count, n]``, the logits of the ``count`` queries
    for the ``n`` completed ``sources``; each query's softmax and weighted sum are formed
    inside its merge (one autograd node), so nothing ``[..., d]``-sized is made here."""

    z: Tensor
    sources: list[Tensor]


@dataclass
class KernelPhase1(Phase1Result):
    """The lean path's Phase 1 in the CPU kernel (:func:`~attnres.ops.lean_phase1`): each
    query's weighted sum ``o_hat`` (``count`` tensors ``[..., d]``) and the log-sum-exp of
    its logits ``lse [..., count]``; Phase 2 merges ``o_hat`` as one source with logit
    ``lse``."""

    o_hat: list[Tensor]
    lse: Tensor


@dataclass
class StatsPhase1(WeightedPhase1):
    """The kernels' Phase 1: ``m`` and ``sumexp [..., count]``, each query's max logit and
    the sum of ``exp(z - m)``."""

    m: Tensor
    sumexp: Tensor


def _cast(h: Tensor, dtype: torch.dtype) -> Tensor:
    return h if h.dtype == dtype else h.to(dtype)


class Backend:
    """The interface; see the module docstring."""

    name: ClassVar[str] = ""

    def phase1(self, z: Tensor, sources: list[Tensor], first: int) -> Phase1Result:
        """``z [..., count, n]``: the logits of ``count`` queries for ``n`` sources ``[..., d]``."""
        raise NotImplementedError

    def merge(self, state: ResidualState, p1: Phase1Result, s: int, xs: list[Tensor], zs: list[Tensor],
              fusable: bool = True):
        """Query ``p1.first + s``'s input with the sources ``xs`` (logits ``zs``, ``[...]``)
        merged in: ``[..., d]`` in ``state.dtype``; records its weights into ``state``.
        ``fusable=False``: a tensor even when the caller defers the norm (the output
        aggregation, whose final norm the model applies after slicing)."""
        raise NotImplementedError

    def merge_partial(self, state: ResidualState, p1: Phase1Result, s: int, partial: Tensor, qg: Tensor, eps: float):
        """:meth:`merge` with one source, ``partial``, whose logit for the gain-folded query
        ``qg [d]`` is computed here."""
        raise NotImplementedError

    def logits(self, x: Tensor, qg: Tensor, eps: float) -> Tensor:
        """The logits ``[..., K]`` of a new source ``x [..., d]`` against the gain-folded
        queries ``qg [K, d]`` (:func:`~attnres.ops.rms_logits`)."""
        return rms_logits(x, qg, eps)

    def source(self, x: Tensor) -> Tensor:
        """``x [..., d]`` as it is kept as a source of later merges (the same tensor, or an
        alias whose gradient the merges sum in place)."""
        return x


class TorchBackend(Backend):
    """PyTorch (``attnres.ops``) as a plain autograd graph: the readable reference of the
    other backends; inference and recording forwards run on it."""

    name = "torch_graph"

    def phase1(self, z: Tensor, sources: list[Tensor], first: int) -> LsePhase1:
        count = z.shape[-2]
        if len(sources) == 1:
            # One source: its weight is exactly 1, so Phase 1 returns it as it is (no pass).
            x = sources[0].to(compute_dtype(sources[0].dtype))
            return LsePhase1(first, [x] * count, torch.ones_like(z), z[..., 0])
        m = z.amax(dim=-1)
        e = torch.exp(z - m.unsqueeze(-1))
        sumexp = e.sum(dim=-1)
        p = e / sumexp.unsqueeze(-1)
        return LsePhase1(first, weighted_sums(p, sources), p, m + torch.log(sumexp))

    def merge(self, state: ResidualState, p1: LsePhase1, s: int, xs: list[Tensor], zs: list[Tensor],
              fusable: bool = True) -> Tensor:
        o_hat = p1.o_hat[s]
        if not xs:
            state.record(p1.p[..., s, :])
            return _cast(o_hat, state.dtype)
        if len(xs) == 1:
            h, w_x = merge_with_one_source(o_hat, p1.lse[..., s], xs[0], zs[0])
            if state.weights is not None:
                state.record(torch.cat([p1.p[..., s, :] * (1 - w_x).unsqueeze(-1), w_x.unsqueeze(-1)], dim=-1))
            return _cast(h, state.dtype)
        h, w = merge_with_sources_lse(o_hat, p1.lse[..., s], xs, zs)
        if state.weights is not None:
            state.record(torch.cat([p1.p[..., s, :] * w[..., :1], w[..., 1:]], dim=-1))
        return h.to(state.dtype)

    def merge_partial(self, state: ResidualState, p1: LsePhase1, s: int, partial: Tensor, qg: Tensor, eps: float) -> Tensor:
        return self.merge(state, p1, s, [partial], [rms_logits(partial, qg, eps)])


class LeanBackend(Backend):
    """The training path (:mod:`attnres.ops.recompute`): each sublayer's input is one custom
    autograd node (:func:`~attnres.ops.lean_depth_merge`) that takes the logits of the
    completed sources, forms the softmax and the weighted sum itself, computes Block's
    partial-sum logit and applies the next sublayer's RMSNorm when the caller defers it
    (``state.defer_norm``: a :class:`~attnres.nn.norm.FusableNormInput`). It saves only the
    sources and per-token statistics; its backward recomputes the rest. Records no weights
    (recording forwards take :class:`TorchBackend`)."""

    name = "torch"

    def __init__(self, cpu_kernel: bool = False, batch_phase1: bool = False) -> None:
        self.cpu_kernel = cpu_kernel  # merges on CPU in the fused C kernel where it applies
        self.batch_phase1 = cpu_kernel and batch_phase1  # Phase 1 of several queries in one kernel pass

    def phase1(self, z: Tensor, sources: list[Tensor], first: int) -> LogitsPhase1 | KernelPhase1:
        # With the kernel, several queries over several sources share one pass over them;
        # one query (the output aggregation) or one source gains nothing from it.
        if self.batch_phase1 and z.shape[-2] > 1 and len(sources) > 1 and cpu_kernel_supports([*sources, z], z.dtype):
            o_hat, lse = lean_phase1(z, sources)
            return KernelPhase1(first, o_hat, lse)
        return LogitsPhase1(first, z, list(sources))

    def logits(self, x: Tensor, qg: Tensor, eps: float) -> Tensor:
        return lean_rms_logits(x, qg, eps, self.cpu_kernel)

    def source(self, x: Tensor) -> Tensor:
        return tap_source(x) if self.cpu_kernel else x

    def _input(self, state: ResidualState, z: Tensor, sources: list[Tensor], partial, qg, eps: float, fusable: bool,
               keep_input: bool = False):
        if partial is None and len(sources) == 1:  # one source: weight exactly 1, the source itself
            return _cast(sources[0], state.dtype)

        def compute(norm_weight, norm_eps):
            return lean_depth_merge(z, sources, partial, qg, eps, norm_weight, norm_eps if norm_eps is not None else 0.0,
                                    state.dtype, keep_input, self.cpu_kernel)

        return FusableNormInput(compute) if state.defer_norm and fusable else compute(None, None)

    def merge(self, state: ResidualState, p1: LogitsPhase1 | KernelPhase1, s: int, xs: list[Tensor],
              zs: list[Tensor], fusable: bool = True):
        if isinstance(p1, KernelPhase1):  # Phase 1's result is one source; few others: h is recomputed
            z = torch.stack([p1.lse[..., s], *zs], dim=-1)
            return self._input(state, z, [p1.o_hat[s], *xs], None, None, 0.0, fusable)
        z = p1.z[..., s, :]
        if xs:
            z = torch.cat([z, torch.stack(zs, dim=-1)], dim=-1)
        # Full AttnRes (and Block's first sublayer of a block): many sources, so the norm's
        # input is kept rather than recomputed from all of them in the backward (L d in all
        # for Full, N d for Block).
        return self._input(state, z, p1.sources + list(xs), None, None, 0.0, fusable, keep_input=True)

    def merge_partial(self, state: ResidualState, p1: LogitsPhase1 | KernelPhase1, s: int, partial: Tensor,
                      qg: Tensor, eps: float):
        if isinstance(p1, KernelPhase1):
            return self._input(state, p1.lse[..., s : s + 1], [p1.o_hat[s]], partial, qg, eps, True)
        # Block's Phase-2 sublayers: the norm's input is recomputed from the n + 1 sources in
        # the backward, not kept (keeping it, L d in all, measured no faster: docs/training-overhead.md).
        return self._input(state, p1.z[..., s, :], p1.sources, partial, qg, eps, True)


class DecodingBackend(TorchBackend):
    """PyTorch for small no-grad inputs (decoding): Block's Phase 2 in one
    :func:`~attnres.ops.merge_partial_sum` (it records no weights; recording forwards take
    :class:`TorchBackend`)."""

    name = "decoding"

    def merge_partial(self, state: ResidualState, p1: LsePhase1, s: int, partial: Tensor, qg: Tensor, eps: float) -> Tensor:
        return _cast(merge_partial_sum(p1.o_hat[s], p1.lse[..., s], partial, qg, eps), state.dtype)


class TritonBackend(Backend):
    """The fused Triton kernels (:mod:`attnres.kernels`); with ``state.defer_norm`` every
    Phase-2 result is a :class:`~attnres.nn.norm.FusableNormInput`, so the sublayer's
    RMSNorm runs inside the merge kernel."""

    name = "triton"

    def phase1(self, z: Tensor, sources: list[Tensor], first: int) -> StatsPhase1:
        count = z.shape[-2]
        if len(sources) == 1:
            x = sources[0].to(compute_dtype(sources[0].dtype))
            return StatsPhase1(first, [x] * count, torch.ones_like(z), z[..., 0], torch.ones_like(z[..., 0]))
        from ...kernels.phase1 import phase1_attention

        lead, d, n = sources[0].shape[:-1], sources[0].shape[-1], len(sources)
        O, m, sumexp, p = phase1_attention(z.reshape(-1, count, n), [x.reshape(-1, d) for x in sources])
        return StatsPhase1(
            first, [O[k].reshape(*lead, d) for k in range(count)], p.reshape(*lead, count, n),
            m.reshape(*lead, count), sumexp.reshape(*lead, count),
        )

    @staticmethod
    def _deferred(state: ResidualState, compute, record, fusable: bool = True):
        """``compute(norm_weight, norm_eps) -> (out, w)`` as the sublayer input: recorded
        once (``record(w)``), fused with the norm when the caller defers it."""
        recorded = []

        def run(norm_weight, norm_eps):
            out, w = compute(norm_weight, norm_eps)
            if not recorded:
                recorded.append(True)
                if state.weights is not None:
                    record(w)
            return out

        return FusableNormInput(run) if state.defer_norm and fusable else run(None, None)

    def merge(self, state: ResidualState, p1: StatsPhase1, s: int, xs: list[Tensor], zs: list[Tensor],
              fusable: bool = True):
        from ...kernels.merge import merge_sources

        o_hat, m, sumexp, p = p1.o_hat[s], p1.m[..., s], p1.sumexp[..., s], p1.p[..., s, :]

        def compute(norm_weight, norm_eps):
            if norm_weight is None and not xs:  # nothing to merge and no norm: Phase 1's result
                return _cast(o_hat, state.dtype), None
            fused = {} if norm_weight is None else {"norm_weight": norm_weight, "norm_eps": norm_eps}
            return merge_sources(o_hat, m, sumexp, xs, zs, out_dtype=state.dtype, **fused)

        def record(w):
            state.record(p if w is None else torch.cat([p * w[..., :1], w[..., 1:]], dim=-1))

        return self._deferred(state, compute, record, fusable)

    def merge_partial(self, state: ResidualState, p1: StatsPhase1, s: int, partial: Tensor, qg: Tensor, eps: float):
        from ...kernels.phase2 import phase2_merge

        o_hat, m, sumexp, p = p1.o_hat[s], p1.m[..., s], p1.sumexp[..., s], p1.p[..., s, :]

        def compute(norm_weight, norm_eps):
            fused = {} if norm_weight is None else {"norm_weight": norm_weight, "norm_eps": norm_eps}
            return phase2_merge(o_hat, m, sumexp, partial, qg, eps, out_dtype=state.dtype, **fused)

        def record(w):
            state.record(torch.cat([p * (1 - w).unsqueeze(-1), w.unsqueeze(-1)], dim=-1))

        return self._deferred(state, compute, record)


TORCH, LEAN = TorchBackend(), LeanBackend()
LEAN_CPU_KERNEL, LEAN_CPU_KERNEL_PHASE1 = LeanBackend(cpu_kernel=True), LeanBackend(cpu_kernel=True, batch_phase1=True)
DECODING, TRITON = DecodingBackend(), TritonBackend()


def triton_available() -> bool:
    from ...kernels import triton_available as available

    return available()


def select_backend(kernels: str, x: Tensor, record_weights: bool, graph_when_compiling: bool = False,
                   batch_phase1: bool = False) -> Backend:
    """The backend of one forward over tensors like ``x`` (the embedding): ``kernels`` is
    ``ModelConfig.residual.kernels`` (``"auto"``: the kernels for CUDA tensors when triton
    is installed). On PyTorch: under autograd :class:`LeanBackend` (with ``"auto"`` on CPU,
    its merges in the fused C kernel of :mod:`attnres.kernels.cpu`; ``"torch_graph"``, or a
    forward that records its weights: :class:`TorchBackend`; with ``graph_when_compiling``,
    also a forward traced by ``torch.compile``, whose partitioner then chooses what to save;
    with ``batch_phase1``, the kernel's Phase 1 of several queries in one pass);
    without autograd, small inputs that record nothing decode on :class:`DecodingBackend`,
    the rest take :class:`TorchBackend`."""
    if kernels == "triton" or (kernels == "auto" and x.is_cuda and triton_available()):
        return TRITON
    if torch.is_grad_enabled():
        graph = record_weights or kernels == "torch_graph" or (graph_when_compiling and torch.compiler.is_compiling())
        if graph:
            return TORCH
        # (ctypes calls do not trace: a compiled forward keeps the kernel out)
        kernel = kernels == "auto" and x.device.type == "cpu" and not torch.compiler.is_compiling()
        if not kernel:
            return LEAN
        return LEAN_CPU_KERNEL_PHASE1 if batch_phase1 else LEAN_CPU_KERNEL
    if not record_weights and decoding(x):
        return DECODING
    return TORCH
