"""Full AttnRes (report §3.1): depth attention over the embedding and every earlier output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import Tensor

from .attnres_base import AttnResBase, CompletedSources, Schedule
from .backends import Backend
from .base import DepthHistory, HistoryLayout, ResidualState
from .config import AttnResAblation, ResidualConfig
from .registry import register_residual

__all__ = ["FullAttnRes", "FullNaiveState", "FullTwoPhaseState", "GroupOutput"]


@dataclass
class FullNaiveState(ResidualState):
    """sources: ``v_0 .. v_l``, the embedding and every output so far."""

    sources: list[Tensor] | None = None


class GroupOutput(NamedTuple):
    """An output of the current Appendix-B group: ``x [..., d]``, its logits against
    queries ``first_query .. L`` (``[..., L + 1 - first_query]``)."""

    x: Tensor
    logits: Tensor
    first_query: int


@dataclass
class FullTwoPhaseState(ResidualState):
    """sources: the outputs of earlier groups (completed); group: the current group's own
    outputs so far, which its later sublayers merge in Phase 2; backend: this forward's."""

    sources: CompletedSources | None = None
    group: list[GroupOutput] = field(default_factory=list)
    backend: Backend | None = None


class _Naive(Schedule):
    name = "naive"

    def start(self, m, embedding, common):
        return FullNaiveState(sources=[embedding], **common)

    def input(self, m: FullAttnRes, state: FullNaiveState, l: int) -> Tensor:
        return m.attend_naive(state, l, m.windowed(state.sources))

    def add(self, m, state, l, output):
        state.sources.append(output)

    def finish(self, m: FullAttnRes, state: FullNaiveState) -> Tensor:
        return m.attend_naive(state, m.n_sublayers, m.windowed(state.sources))

    def history(self, m, state: FullNaiveState) -> DepthHistory:
        return DepthHistory(list(state.sources), None)

    def resume(self, m, history, at, common):
        return FullNaiveState(sources=list(history.completed), **common)


class _TwoPhase(Schedule):
    """Appendix B: the ``L`` outputs scheduled in groups of ``group_size``; Phase 1 over the
    outputs of earlier groups, Phase 2 over the group's own earlier outputs."""

    name = "two_phase"

    def start(self, m: FullAttnRes, embedding: Tensor, common: dict[str, Any]) -> FullTwoPhaseState:
        state = FullTwoPhaseState(sources=m.new_sources(embedding.dtype), **common)
        state.backend = m.backend(embedding, state.weights is not None)
        state.phase = "phase1"
        m.complete(state.sources, embedding, 0, state.backend)
        return state

    @staticmethod
    def _close_group(state: FullTwoPhaseState) -> None:
        """The group's outputs become completed sources (their logits are already known)."""
        tp = state.sources
        for x, z, off in state.group:
            tp.sources.append(x)
            tp.logits.append(z)
            tp.offsets.append(off)
        state.group = []

    def input(self, m: FullAttnRes, state: FullTwoPhaseState, l: int):
        tp = state.sources
        if l % m.group_size == 0:
            state.phase = "phase1"
            self._close_group(state)
            m.phase1(state.backend, tp, l, min(m.group_size, m.n_sublayers - l))
        state.phase = "phase2"
        intra = [g.x for g in state.group]
        intra_logits = [g.logits[..., l - g.first_query] for g in state.group]
        return state.backend.merge(state, tp.p1, l - tp.p1.first, intra, intra_logits)

    def add(self, m: FullAttnRes, state: FullTwoPhaseState, l: int, output: Tensor) -> None:
        state.phase = "phase1"  # the new output's RMS factor and logits against every later query
        output = state.backend.source(output)
        state.group.append(GroupOutput(output, state.backend.logits(output, state.sources.qg[l + 1 :], m.eps), l + 1))

    def finish(self, m: FullAttnRes, state: FullTwoPhaseState) -> Tensor:
        self._close_group(state)
        return m.aggregate(state, state.backend, state.sources)

    def history(self, m, state: FullTwoPhaseState) -> DepthHistory:
        return DepthHistory(list(state.sources.sources) + [g.x for g in state.group], None)

    def resume(self, m: FullAttnRes, history: DepthHistory, at: int, common: dict[str, Any]) -> FullTwoPhaseState:
        completed = history.completed
        state = FullTwoPhaseState(sources=m.new_sources(completed[0].dtype), **common)
        state.backend = m.backend(completed[0], state.weights is not None)
        state.phase = "phase1"
        g = m.group_size
        g0 = at // g * g  # first sublayer of the open group; v_0 .. v_{g0} are completed sources
        for x in completed[: g0 + 1]:
            m.complete(state.sources, x, at, state.backend)
        qg = state.sources.qg
        group = [(j, state.backend.source(x)) for j, x in enumerate(completed[g0 + 1 :], g0 + 1)]
        state.group = [GroupOutput(x, state.backend.logits(x, qg[j:], m.eps), j) for j, x in group]
        if at % g and at < m.n_sublayers:
            m.phase1(state.backend, state.sources, at, min(g0 + g, m.n_sublayers) - at)
        return state


@register_residual("attnres_full")
class FullAttnRes(AttnResBase):
    """Full AttnRes (report §3.1): sublayer ``l`` attends over ``[v_0, v_1, ..., v_l]``.

    ``group_size`` is the Appendix-B scheduling group ``S`` of the two-phase path (it does
    not change the function): Phase 1 batches a group's queries over all outputs of earlier
    groups, Phase 2 walks the group's own earlier outputs. ``None`` picks ``round(sqrt(L))``,
    which minimises the ``(S + N) d`` per-layer I/O of Appendix B.
    """

    SCHEDULES = {"naive": _Naive(), "two_phase": _TwoPhase()}
    # Under torch.compile the plain graph, fused by inductor, trained faster than the lean
    # nodes in every comparison (d = 512: 1.046 vs 1.094 and 1.034 vs 1.059 against the
    # standard model; docs/training-overhead.md); for Block the two paths split within the noise.
    GRAPH_WHEN_COMPILING = True
    # On the CPU kernel, Phase 1 of a group's queries in one pass over the earlier outputs:
    # main job 1.135 against 1.25 for per-sublayer merges over every source, and no more
    # memory (its weighted sums take the place of the norm inputs the merges keep otherwise).
    # Block keeps per-sublayer merges over its few block sums: batching them measured no
    # faster at the main job and would keep one weighted sum per sublayer (L d).
    BATCH_PHASE1_ON_CPU = True

    def __init__(
        self, dim: int, n_sublayers: int, eps: float = 1e-6, impl: str = "two_phase", group_size: int | None = None,
        ablation: AttnResAblation | None = None, kernels: str = "auto",
    ) -> None:
        self.window = ablation.window if ablation is not None else None
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1 (or None), got {self.window}")
        super().__init__(dim, n_sublayers, eps, impl, ablation, kernels)
        if group_size is None:
            group_size = max(1, round(n_sublayers**0.5))
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1 (or None for automatic), got {group_size}")
        self.group_size = group_size

    @classmethod
    def from_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> FullAttnRes:
        return cls(dim, n_sublayers, eps=config.eps, impl=config.impl, group_size=config.full_group_size,
                   ablation=config.ablation, kernels=config.kernels)

    def sources_per_mixer(self) -> list[int]:
        counts = [l + 1 for l in range(self.n_sublayers + 1)]
        return counts if self.window is None else [min(c, 1 + self.window) for c in counts]

    def history_layout(self, sublayer: int) -> HistoryLayout:
        """``v_0 .. v_s``: ``1 + s`` completed entries, nothing running."""
        return HistoryLayout(1 + sublayer, False)

    def source_members(self) -> list[list[list[int]]]:
        """Mixer ``r`` attends over ``v_0 .. v_r`` (with a window: ``v_0`` and the last ones)."""
        return [[[i] for i in self.windowed(list(range(r + 1)))] for r in range(self.n_sublayers + 1)]

    def windowed(self, sources: list[Tensor]) -> list[Tensor]:
        """The embedding plus the ``window`` most recent outputs (all sources without one)."""
        if self.window is None or len(sources) <= 1 + self.window:
            return sources
        return [sources[0]] + sources[-self.window :]
