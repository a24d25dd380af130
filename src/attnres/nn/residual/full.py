"""Full AttnRes (report §3.1): depth attention over the embedding and every earlier output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ...ops import Operations
from ...validation import Int
from .attnres_base import AttnResBase, CompletedSources, Schedule
from .base import DepthHistory, HistoryLayout, ResidualState
from .config import AttnResAblation, ResidualConfig, default_full_group_size
from .kinds import refuse_other_kind
from .registry import register_residual

__all__ = ["FullAttnRes", "FullNaiveState", "FullTwoPhaseState"]


@dataclass
class FullNaiveState(ResidualState):
    """sources: ``v_0 .. v_l``, the embedding and every output so far."""

    sources: list[Tensor] | None = None


@dataclass
class FullTwoPhaseState(ResidualState):
    """sources: the outputs of earlier groups (completed); group: the current group's own
    outputs so far, which its later sublayers merge in Phase 2; ops: this forward's
    depth-attention operations."""

    sources: CompletedSources | None = None
    group: list[Tensor] = field(default_factory=list)
    ops: Operations | None = None


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
    outputs of earlier groups (one pass over them for the group's queries, and the output
    aggregation's with the last group), Phase 2 over the group's own earlier outputs."""

    name = "two_phase"

    def start(self, m: FullAttnRes, embedding: Tensor, common: dict[str, Any]) -> FullTwoPhaseState:
        state = FullTwoPhaseState(sources=m.new_sources(embedding.dtype), ops=m.operations(), **common)
        state.sources.sources.append(embedding)
        return state

    @staticmethod
    def _close_group(state: FullTwoPhaseState) -> None:
        """The group's outputs become completed sources."""
        state.sources.sources.extend(state.group)
        state.group = []

    def input(self, m: FullAttnRes, state: FullTwoPhaseState, l: int):
        if l % m.group_size == 0:
            state.phase = "phase1"
            self._close_group(state)
            m.phase1(state, l, m.group_end(l))
        state.phase = "phase2"
        return m.phase2_input(state, l, list(state.group))

    def add(self, m: FullAttnRes, state: FullTwoPhaseState, l: int, output: Tensor) -> None:
        state.phase = "phase2"
        state.group.append(output)

    def finish(self, m: FullAttnRes, state: FullTwoPhaseState) -> Tensor:
        if not m.covers_aggregation(state):  # (resumed at L) Phase 1 of the aggregation alone
            self._close_group(state)
            m.phase1(state, m.n_sublayers, m.n_sublayers)
        return m.phase2_input(state, m.n_sublayers, list(state.group), fusable=False)

    def history(self, m, state: FullTwoPhaseState) -> DepthHistory:
        return DepthHistory(list(state.sources.sources) + list(state.group), None)

    def resume(self, m: FullAttnRes, history: DepthHistory, at: int, common: dict[str, Any]) -> FullTwoPhaseState:
        completed = history.completed
        state = FullTwoPhaseState(sources=m.new_sources(completed[0].dtype), ops=m.operations(), **common)
        g0 = at // m.group_size * m.group_size  # first sublayer of the open group; v_0 .. v_{g0} are completed
        state.sources.sources.extend(completed[: g0 + 1])
        state.group = list(completed[g0 + 1 :])
        if at % m.group_size and at < m.n_sublayers:
            state.phase = "phase1"
            m.phase1(state, at, m.group_end(at))
        return state


@register_residual("attnres_full")
class FullAttnRes(AttnResBase):
    """Full AttnRes (report §3.1): sublayer ``l`` attends over ``[v_0, v_1, ..., v_l]``.

    ``group_size`` is the Appendix-B scheduling group ``S`` of the two-phase path (it does
    not change the function): Phase 1 batches a group's queries over all outputs of earlier
    groups, Phase 2 walks the group's own earlier outputs. ``None`` picks ``round(sqrt(L))``,
    which minimises the ``(S + N) d`` per-layer I/O of Appendix B. A ``group_size`` above
    ``L`` is one group of all ``L`` sublayers, the schedule of ``group_size=L``, and is kept
    as ``L`` (a config's ``full_group_size`` for a deeper model runs here). The other
    arguments are :class:`AttnResBase`'s.
    """

    SCHEDULES = {"naive": _Naive(), "two_phase": _TwoPhase()}
    reads_fields = frozenset({"full_group_size"})

    def __init__(
        self, dim: int, n_sublayers: int, eps: float = 1e-6, schedule: str = "two_phase", group_size: int | None = None,
        ablation: AttnResAblation | None = None, backend: str = "auto",
        recompute_phase1: bool = True,
    ) -> None:
        self.window = ablation.window if ablation is not None else None
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1 (or None), got {self.window}")
        super().__init__(dim, n_sublayers, eps, schedule, ablation, backend, recompute_phase1)
        if group_size is not None and not Int(1).ok(group_size):  # (1.5 was taken; '2' failed comparing)
            raise ValueError(f"FullAttnRes: group_size must be an integer >= 1, or None for round(sqrt(n_sublayers)); "
                             f"got {group_size!r}")
        if group_size is None:
            group_size = default_full_group_size(n_sublayers)
        # (group_size=10 of 4 sublayers runs one group of 4; its repr and the first group a
        # caller reads from group_size said 10)
        self.group_size = min(group_size, n_sublayers)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"

    @classmethod
    def from_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> FullAttnRes:
        refuse_other_kind(cls, config)
        return cls(dim, n_sublayers, eps=config.eps, schedule=config.schedule, group_size=config.full_group_size,
                   ablation=config.ablation, backend=config.backend,
                   recompute_phase1=config.recompute_phase1)

    def group_end(self, l: int) -> int:
        """The sublayer after the Appendix-B group of sublayer ``l`` (``L`` for the last)."""
        return min((l // self.group_size + 1) * self.group_size, self.n_sublayers)

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
