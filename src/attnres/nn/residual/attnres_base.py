"""What Full and Block AttnRes share: the mixers, the naive reference and the two-phase
bookkeeping.

Two-phase bookkeeping (report §4.2, Algorithm 1): every *completed* source (the embedding, a
finished block sum, or - for Full - an output of an earlier group) is read once when it
completes, for its RMS factor and its logits against **every later query at once**
(``rms_logits``); the RMS factor is never recomputed. A sublayer's input is then one
``merge`` of its sources from those logits (with Block's partial sum, whose logit the merge
computes), the next sublayer's RMSNorm fused in; Full AttnRes first runs ``phase1`` for a
group's queries over the earlier groups' outputs (Appendix B).

The three operations come from :mod:`attnres.ops.depth_attention`, picked once per forward
from ``kernels`` (``"torch_graph"``: the plain-graph reference; otherwise the custom
operators, which pick their implementation by device). Each variant picks its *schedule* -
naive or two-phase - when ``impl`` is set: a stateless strategy object whose
``start/input/add/finish/history/resume`` the module calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...ops import Operations, compute_dtype, operations
from ..norm import FusableNormInput
from .base import DepthHistory, ResidualState, ResidualStream
from .config import IMPLEMENTATIONS, KERNEL_BACKENDS, AttnResAblation, ResidualConfig
from .mixing import MixingMatrix, scatter_source_weights
from .query import DepthQuery

__all__ = ["AttnResBase", "CompletedSources", "Schedule", "Phase1", "OPERATIONS_BY_KERNELS"]

#: ``ResidualConfig.kernels`` -> the family of :data:`attnres.ops.OPERATIONS` it runs.
OPERATIONS_BY_KERNELS = {"auto": "auto", "triton": "triton", "torch": "torch", "torch_graph": "reference"}


@dataclass
class Phase1:
    """Phase 1 of queries ``first .. first + count - 1`` over the completed sources: their
    logits ``z [..., count, n]``, weighted sums ``outs`` (``count`` tensors ``[..., d]``) and
    log-sum-exp ``lse [..., count]``."""

    first: int
    z: Tensor
    outs: list[Tensor]
    lse: Tensor


@dataclass
class CompletedSources:
    """The two-phase schedule's completed sources.

    qg: ``[L + 1, d]``, every mixer's query with its key-norm gain folded in.
    sources: the completed sources ``[..., d]``; ``logits[j]`` their logits ``[..., L + 1 -
        offsets[j]]`` against queries ``offsets[j] .. L`` (computed once, at completion).
    p1: Full AttnRes' Phase 1 of the current group.
    """

    qg: Tensor
    sources: list[Tensor]
    logits: list[Tensor]
    offsets: list[int]
    p1: Phase1 | None = None


class Schedule:
    """How a variant runs: the naive reference or the two-phase schedule. Stateless; every
    method takes the residual module ``m`` and the forward's state."""

    name = ""

    def start(self, m: AttnResBase, embedding: Tensor, common: dict[str, Any]) -> ResidualState:
        raise NotImplementedError

    def input(self, m: AttnResBase, state: ResidualState, l: int):
        raise NotImplementedError

    def add(self, m: AttnResBase, state: ResidualState, l: int, output: Tensor) -> None:
        raise NotImplementedError

    def finish(self, m: AttnResBase, state: ResidualState) -> Tensor:
        raise NotImplementedError

    def history(self, m: AttnResBase, state: ResidualState) -> DepthHistory:
        raise NotImplementedError

    def resume(self, m: AttnResBase, history: DepthHistory, at: int, common: dict[str, Any]) -> ResidualState:
        raise NotImplementedError


class AttnResBase(ResidualStream):
    """Shared parameters (``mixers[l]`` feeds sublayer ``l``, ``mixers[L]`` is the output
    aggregation: ``L + 1`` :class:`DepthQuery` in all) and machinery of Full and Block AttnRes."""

    has_depth_attention = True
    #: The variant's schedules by ``impl``; set by subclasses.
    SCHEDULES: dict[str, Schedule] = {}

    def __init__(
        self, dim: int, n_sublayers: int, eps: float = 1e-6, impl: str = "two_phase",
        ablation: AttnResAblation | None = None, kernels: str = "auto",
    ) -> None:
        super().__init__(dim, n_sublayers)
        if kernels not in KERNEL_BACKENDS:
            raise ValueError(f"kernels must be one of {KERNEL_BACKENDS}, got {kernels!r}")
        self.ablation = ablation if ablation is not None and ablation.active else None
        self.eps = eps
        self.kernels = kernels
        self.impl = impl
        counts = self.sources_per_mixer()
        self.mixers = nn.ModuleList(DepthQuery(dim, eps, self.ablation, counts[l]) for l in range(n_sublayers + 1))

    # -- configuration -------------------------------------------------------------------
    @property
    def impl(self) -> str:
        """``"two_phase"`` or ``"naive"``; setting it switches the schedule (same function)."""
        return self._impl

    @impl.setter
    def impl(self, value: str) -> None:
        if value not in IMPLEMENTATIONS:
            raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {value!r}")
        if self.ablation is not None and value != "naive":
            raise ValueError("AttnRes ablations run on the naive path: use impl='naive' (ModelConfig.residual.impl)")
        self._impl = value
        self.schedule = self.SCHEDULES[value]

    @classmethod
    def check_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> None:
        cls._no_options(config)
        if config.ablation.active and config.impl != "naive":
            raise ValueError("ModelConfig.residual.impl must be 'naive' when an AttnRes ablation is set (the two-phase "
                             f"schedule needs static queries and a softmax); got {config.impl!r}")

    @classmethod
    def describe(cls, config: ResidualConfig, n_sublayers: int) -> str:
        words = cls._layout_words(config, n_sublayers)
        if config.impl != "two_phase":
            words.append(config.impl)
        if config.ablation.active:
            default = AttnResAblation()
            words += [f"{k}={v}" for k, v in vars(config.ablation).items() if v != getattr(default, k)]
        return f"{cls.name} ({', '.join(words)})" if words else cls.name

    @classmethod
    def _layout_words(cls, config: ResidualConfig, n_sublayers: int) -> list[str]:
        return []

    def reset_parameters(self) -> None:
        for m in self.mixers:
            m.reset_parameters()

    def operations(self) -> Operations:
        """The depth-attention operations of the two-phase schedule that ``kernels`` names."""
        return operations(OPERATIONS_BY_KERNELS[self.kernels])

    # -- the protocol, delegated to the schedule -----------------------------------------
    def _start(self, embedding: Tensor, common: dict[str, Any]) -> ResidualState:
        return self.schedule.start(self, embedding, common)

    def _input(self, state: ResidualState, l: int):
        return self.schedule.input(self, state, l)

    def _add(self, state: ResidualState, l: int, output: Tensor) -> None:
        self.schedule.add(self, state, l, output)

    def _finish(self, state: ResidualState) -> Tensor:
        return self.schedule.finish(self, state)

    def _history(self, state: ResidualState) -> DepthHistory:
        return self.schedule.history(self, state)

    def _resume(self, history: DepthHistory, at_sublayer: int, common: dict[str, Any]) -> ResidualState:
        return self.schedule.resume(self, history, at_sublayer, common)

    # -- the naive reference -------------------------------------------------------------
    def attend_naive(self, state: ResidualState, l: int, sources: list[Tensor]) -> Tensor:
        """Mixer ``l`` over ``sources`` with the reference depth attention (recording)."""
        if state.weights is None:
            return self.mixers[l].attend(sources)
        h, w = self.mixers[l].attend(sources, return_weights=True)
        state.record(w, sources_last=False)
        return h

    # -- two-phase bookkeeping -----------------------------------------------------------
    def folded_queries(self, dtype: torch.dtype) -> Tensor:
        """``[L + 1, d]``: every mixer's query with its key-norm gain folded in.

        Without autograd (inference, decoding) the result is kept until a query or gain
        changes (their version counters and storage are the key): decoding runs the residual
        once per token, and rebuilding this costs ~3 small ops per sublayer each time."""
        compute = compute_dtype(dtype)
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return torch.stack([m.folded_query(compute) for m in self.mixers])
        key = [compute, self.mixers[0].query.device]
        for m in self.mixers:  # direct dict reads: nn.Module.__getattr__ would make this 4x slower
            q, g = m._parameters["query"], m._modules["key_norm"]._parameters["weight"]
            key += (q._version, q.data_ptr(), g._version, g.data_ptr())
        cached = self.__dict__.get("_folded_cache")
        if cached is None or cached[0] != key:
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable in and out of inference mode
                cached = (key, torch.stack([m.folded_query(compute) for m in self.mixers]))
            self.__dict__["_folded_cache"] = cached
        return cached[1]

    def new_sources(self, dtype: torch.dtype) -> CompletedSources:
        return CompletedSources(self.folded_queries(dtype), [], [], [])

    def complete(self, state: ResidualState, x: Tensor, first_query: int) -> None:
        """Register ``x`` as a completed source visible to queries ``first_query .. L``: its
        logits against all of them, once."""
        tp = state.sources
        tp.sources.append(x)
        tp.logits.append(state.ops.rms_logits(x, tp.qg[first_query:], self.eps))
        tp.offsets.append(first_query)

    @staticmethod
    def gathered_logits(tp: CompletedSources, first_query: int, count: int) -> Tensor:
        """``[..., count, n]``: the logits of queries ``first_query ..`` for the ``n`` completed
        sources, from those computed at each source's completion."""
        cols = [z[..., first_query - off : first_query - off + count] for z, off in zip(tp.logits, tp.offsets)]
        return torch.stack(cols, dim=-1)

    def phase1(self, state: ResidualState, first_query: int, end: int) -> None:
        """Phase 1 of queries ``first_query .. end - 1`` over the completed sources - and of the
        output aggregation's query ``L`` when ``end`` is ``L``: the same pass - into
        ``state.sources.p1`` (one source: its weight is exactly 1)."""
        tp = state.sources
        count = end - first_query + (end == self.n_sublayers)
        z = self.gathered_logits(tp, first_query, count)  # [..., count, n]
        if len(tp.sources) == 1:
            outs, lse = [tp.sources[0]] * count, z[..., 0]
        else:
            outs, lse = state.ops.phase1(z, tp.sources)
        tp.p1 = Phase1(first_query, z, outs, lse)

    def covers_aggregation(self, state: ResidualState) -> bool:
        """Whether the last Phase 1 ran the output aggregation's query too."""
        p1 = state.sources.p1
        return p1 is not None and p1.first + len(p1.outs) > self.n_sublayers

    def phase2_input(self, state: ResidualState, l: int, xs: list[Tensor], zs: list[Tensor],
                     partial: Tensor | None = None, fusable: bool = True):
        """Query ``l``'s input (Phase 2, report §4.2): its Phase-1 weighted sum - one source
        whose logit is its log-sum-exp - merged with the sources ``xs`` (logits ``zs``, Full
        AttnRes' outputs of the current group) or Block AttnRes' ``partial`` sum. The
        recorded weights give the Phase-1 sources their softmax weights scaled by the weight
        of the weighted sum in the merge."""
        p1 = state.sources.p1
        s = l - p1.first
        p = torch.softmax(p1.z[..., s, :], dim=-1) if state.weights is not None else None
        z = torch.stack([p1.lse[..., s], *zs], dim=-1)  # [..., 1 + len(xs)]
        qg = state.sources.qg[l] if partial is not None else None
        return self.merged_input(state, z, [p1.outs[s], *xs], partial, qg, fusable=fusable,
                                 record=lambda alpha: torch.cat([p * alpha[..., :1], alpha[..., 1:]], dim=-1))

    def merged_input(self, state: ResidualState, z: Tensor, sources: list[Tensor], partial: Tensor | None = None,
                     qg: Tensor | None = None, fusable: bool = True, record=None):
        """A sublayer's input: the merge of ``sources`` (logits ``z [..., n]``) and ``partial``
        (logit from ``qg``), a tensor - or, when the caller defers the norm and ``fusable``, a
        :class:`~attnres.nn.norm.FusableNormInput` whose norm the merge applies. Records the
        weights once (``record(alpha)`` maps the merge's weights to the mixer's sources)."""
        if partial is None and len(sources) == 1:  # one source: weight exactly 1, the source itself
            if state.weights is not None:
                state.record(torch.ones_like(z) if record is None else record(torch.ones_like(z)))
            return sources[0]
        sources, recorded = list(sources), []  # (a snapshot: activation checkpointing may recompute it later)

        def compute(norm_weight, norm_eps):
            out, alpha = state.ops.merge(z, sources, partial, qg, self.eps, norm_weight,
                                         0.0 if norm_eps is None else norm_eps)
            if not recorded and state.weights is not None:
                recorded.append(True)
                state.record(alpha if record is None else record(alpha))
            return out

        return FusableNormInput(compute) if state.defer_norm and fusable else compute(None, None)

    # -- the depth mixing matrix (report §6.2) --------------------------------------------
    def source_members(self) -> list[list[list[int]]]:
        """For every mixer (sublayers, then the output aggregation), its sources in the order
        it attends over them, each as the indices ``i`` of the ``v_i`` it sums."""
        raise NotImplementedError

    def _mixing_matrix(self, state: ResidualState, per_channel: bool = False) -> MixingMatrix:
        """Each mixer's recorded weights placed on the ``v_i`` its sources sum: a source that
        is a sum (a block, a partial sum) gives its weight to every member (report §6.2)."""
        members = self.source_members()
        M = scatter_source_weights(state.weights, members)
        groups = None
        if any(len(m) > 1 for cols in members for m in cols):
            groups = [range(m[0], m[-1] + 1) for m in members[-1]]
        heads = self.ablation is not None and self.ablation.heads is not None
        return MixingMatrix(M, input_dependent=True, source_groups=groups,
                            reduction="mean over the depth-attention heads (the sublayer inputs mix per-head channel "
                            "groups with their own weights)" if heads else None)

    # -- description ---------------------------------------------------------------------
    def residual_flops_per_token(self) -> float:
        """Per mixer over ``n`` sources: ``2 n d`` for the weighted sum and ``2 n d`` for the
        logits; ``3 d`` per source for its key RMSNorm (once per source); ``2 d^2`` per
        input-dependent query projection."""
        d, L = self.dim, self.n_sublayers
        ab = self.ablation or AttnResAblation()
        counts = self.sources_per_mixer()
        total = 0.0
        for l in range(L + 1):
            n = counts[l]
            total += 2 * n * d  # weighted sum
            if not ab.input_independent_mixing:
                total += 2 * n * d  # logits
            if ab.input_dependent_query and l < L:
                total += 2 * d * d
        if not ab.input_independent_mixing and ab.key_norm:
            total += 3 * d * (L + 1)  # each source's key RMSNorm, once per source (upper bound for Block)
        return total
