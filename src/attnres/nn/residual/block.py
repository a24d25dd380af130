"""Block AttnRes (report §3.2): depth attention over block sums and the current partial sum."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...migrations import reading_stored
from ...ops import Operations
from ...user_warning import warn_user
from ...validation import Int
from .attnres_base import AttnResBase, CompletedSources, Schedule
from .base import DepthHistory, HistoryLayout, ResidualState
from .config import AttnResAblation, ResidualConfig
from .kinds import refuse_other_kind
from .registry import register_residual

__all__ = ["BlockAttnRes", "BlockNaiveState", "BlockTwoPhaseState", "naming_block_size"]


@dataclass
class BlockNaiveState(ResidualState):
    """blocks: ``b_0 .. b_{n-1}`` (the embedding and the completed block sums);
    partial: the current block's partial sum ``b_n^{i-1}`` (``None`` at a block start)."""

    blocks: list[Tensor] | None = None
    partial: Tensor | None = None


@dataclass
class BlockTwoPhaseState(ResidualState):
    """sources: the completed blocks with their logits; partial: as in
    :class:`BlockNaiveState`, except that ``pending``, the last sublayer's output, may not
    be added to it yet: the next sublayer's merge forms the sum in the pass that reads both
    (an add and a merge would read them, write the sum and read it again); ops: this
    forward's depth-attention operations."""

    sources: CompletedSources | None = None
    partial: Tensor | None = None
    pending: Tensor | None = None
    ops: Operations | None = None


def _settle(state: BlockTwoPhaseState) -> None:
    """Add the pending output to the partial sum where no merge formed the sum."""
    if state.pending is not None:
        state.partial, state.pending = state.partial + state.pending, None


def _formed(state: BlockTwoPhaseState, total: Tensor) -> None:
    """A merge formed the partial sum with the pending output."""
    state.partial, state.pending = total, None


def _add_to_partial(state, output: Tensor) -> None:
    state.partial = output if state.partial is None else state.partial + output


class _Naive(Schedule):
    """Every sublayer attends over its sources with the reference depth attention."""

    name = "naive"

    def start(self, m, embedding, common):
        return BlockNaiveState(blocks=[embedding], **common)

    def input(self, m: BlockAttnRes, state: BlockNaiveState, l: int) -> Tensor:
        if l % m.block_size == 0 and state.partial is not None:
            state.blocks.append(state.partial)
            state.partial = None
        return m.attend_naive(state, l, state.blocks + _partial(state))

    def add(self, m, state, l, output):
        _add_to_partial(state, output)

    def finish(self, m, state: BlockNaiveState) -> Tensor:
        # (no partial sum where a state resumed at L holds the last block as completed: it was a None source)
        return m.attend_naive(state, m.n_sublayers, state.blocks + _partial(state))

    def history(self, m: BlockAttnRes, state: BlockNaiveState) -> DepthHistory:
        return m.canonical_history(list(state.blocks), state.partial, state.next_sublayer)

    def resume(self, m, history, at, common):
        return BlockNaiveState(blocks=list(history.completed), partial=history.running, **common)


class _TwoPhase(Schedule):
    """Report §4.2, Algorithm 1: Phase 1 once per block over the completed blocks, batched
    over the block's queries (and the output aggregation's, with the last block); Phase 2
    per sublayer, the merge with the partial sum, whose logit it computes."""

    name = "two_phase"

    def start(self, m: BlockAttnRes, embedding: Tensor, common: dict[str, Any]) -> BlockTwoPhaseState:
        state = BlockTwoPhaseState(sources=m.new_sources(embedding.dtype), ops=m.operations(), **common)
        state.sources.sources.append(embedding)
        return state

    def input(self, m: BlockAttnRes, state: BlockTwoPhaseState, l: int):
        if l % m.block_size == 0:
            _settle(state)  # (the block's last output: no merge reads the sum before Phase 1)
            state.phase = "phase1"
            if state.partial is not None:
                state.sources.sources.append(state.partial)
                state.partial = None
            m.phase1(state, l, m.block_end(l))
        state.phase = "phase2"
        return self._merge(m, state, l)

    @staticmethod
    def _merge(m: BlockAttnRes, state: BlockTwoPhaseState, l: int, fusable: bool = True):
        """Mixer ``l``'s merge with the partial sum - formed from the pending output by the
        merge itself."""
        if state.pending is None:
            return m.phase2_input(state, l, _partial(state), fusable)
        return m.phase2_input(state, l, [state.partial], fusable, addend=state.pending,
                              on_total=lambda total: _formed(state, total))

    def reads_output_as_is(self, m, state: BlockTwoPhaseState, output: Tensor) -> bool:
        """An output that will be pending (not a block's first) stays in its dtype, e.g. an
        autocast sublayer's bf16 under a float32 stream: the merge that forms the partial sum
        reads it as it is and adds it in float32 - the same sum, without a pass that casts it
        (reading 2 bytes an element, writing 4) and with 2 bytes an element less for the merge
        to read."""
        return state.partial is not None and torch.promote_types(state.dtype, output.dtype) == state.dtype

    def add(self, m, state, l, output):
        state.phase = "phase2"
        _settle(state)  # (a sublayer that never read its input: no merge formed the sum)
        if state.partial is None:
            state.partial = output
        else:
            state.pending = output

    def finish(self, m: BlockAttnRes, state: BlockTwoPhaseState) -> Tensor:
        if not m.covers_aggregation(state):  # (resumed at L) Phase 1 of the aggregation alone
            m.phase1(state, m.n_sublayers, m.n_sublayers)
        return self._merge(m, state, m.n_sublayers, fusable=False)

    def history(self, m: BlockAttnRes, state: BlockTwoPhaseState) -> DepthHistory:
        _settle(state)
        return m.canonical_history(list(state.sources.sources), state.partial, state.next_sublayer)

    def resume(self, m: BlockAttnRes, history: DepthHistory, at: int, common: dict[str, Any]) -> BlockTwoPhaseState:
        ref = history.running if history.running is not None else history.completed[0]
        state = BlockTwoPhaseState(sources=m.new_sources(ref.dtype), partial=history.running, ops=m.operations(),
                                   **common)
        state.sources.sources.extend(history.completed)
        if history.running is not None and at < m.n_sublayers:
            state.phase = "phase1"
            m.phase1(state, at, m.block_end(at))  # the rest of the open block
        return state


def _partial(state: BlockNaiveState | BlockTwoPhaseState) -> list[Tensor]:
    return [] if state.partial is None else [state.partial]


#: The attribute a ``ResidualConfig`` holds once warned of a single block: the
#: ``(block_size, n_sublayers)`` it was warned of.
_SAID_SINGLE_BLOCK = "_attnres_single_block_said"


#: The block size as the user wrote it on the path that checks the config, for the single
#: block's warning: ``ModelConfig(...)`` in Python by default; ``attnres train`` and
#: ``TrainConfig`` say ``model.residual.block_size``, upcycle its ``--block-size``,
#: ``AttnResConfig(...)`` its ``residual`` (:func:`naming_block_size`).
_BLOCK_SIZE_FIELD: ContextVar[str] = ContextVar("attnres_block_size_field", default="ModelConfig.residual.block_size")


@contextmanager
def naming_block_size(field: str) -> Iterator[None]:
    """Within, a single block is warned of naming ``field``: the one the user wrote (an
    upcycle's ``--block-size`` named for a plain ``ModelConfig(...)`` confused)."""
    token = _BLOCK_SIZE_FIELD.set(field)
    try:
        yield
    finally:
        _BLOCK_SIZE_FIELD.reset(token)


def _warn_single_block_once(config: ResidualConfig, n_sublayers: int) -> None:
    """:func:`_warn_single_block` of ``config``, once per config object and depth: a config is
    checked again by what takes it (``AttnResLM(config)``, ``TrainConfig(model=config)``, the
    train loop), which repeated the warning of the statement that made it. The mark is kept
    on the object (a copy keeps it, as ``AttnResLM`` takes one); another block size or depth
    is warned again. A config read within ``migrations.stored_config()`` (a checkpoint's, a
    run's ``config.json``: the stored configs, as the deprecated keys' warning) is marked
    without a word: it was warned of when its run started, and a resume read it again five
    times, each a new object that the mark did not cover."""
    said = (config.block_size, n_sublayers)
    if vars(config).get(_SAID_SINGLE_BLOCK) == said:  # (vars: ResidualConfig.__getattr__ answers renamed fields)
        return
    if not reading_stored():
        _warn_single_block(*said)
    vars(config)[_SAID_SINGLE_BLOCK] = said  # (after it: a warning raised as an error is raised again)


def _warn_single_block(block_size: int | None, n_sublayers: int, built: bool = False) -> None:
    """Warn when a given ``block_size`` cuts the model's ``n_sublayers`` into a single block
    (report §3.2: ``S >= L``). Defined, so not refused, but Block AttnRes is then another thing
    than meant - every sublayer attends over the embedding and its partial sum only, never a
    completed block - most often ``S`` counted in transformer blocks (layers), not sublayers,
    or the number of blocks given for their size. ``built``: said of a ``BlockAttnRes(...)``
    built directly, whose block size has no default, not of a config's field."""
    if block_size is None or n_sublayers < 2 or block_size < n_sublayers:
        return
    default = -(-n_sublayers // 8)  # ResidualConfig's unset block_size
    single = ("Block AttnRes has a single block (N = 1), no completed block to attend over; block_size counts "
              f"sublayers - at most {n_sublayers - 1} gives 2 or more blocks")
    if built:
        warn_user(f"BlockAttnRes: block_size={block_size} is at least its n_sublayers={n_sublayers}: {single} (a block "
                  f"size, not a number of blocks); {default} gives {-(-n_sublayers // default)} blocks (about 8 where "
                  "the depth allows, as the report recommends, §3.2)")
        return
    warn_user(f"{_BLOCK_SIZE_FIELD.get()} = {block_size} is at least the model's "
              f"{n_sublayers} sublayers ({n_sublayers // 2} layer{'s' if n_sublayers > 2 else ''} of 2): {single}; "
              f"unset, it is {default}: {-(-n_sublayers // default)} blocks (about 8 where the depth allows, "
              "as the report recommends, §3.2)")


@register_residual("attnres_block")
class BlockAttnRes(AttnResBase):
    """Block AttnRes (report §3.2) with block size ``S`` counted in sublayers.

    Sublayer ``l`` (0-based) is at position ``i = l % S + 1`` of block ``n = l // S + 1``; it
    attends over ``[b_0, ..., b_{n-1}]`` when ``i = 1`` and over
    ``[b_0, ..., b_{n-1}, b_n^{i-1}]`` otherwise. The output aggregation attends over
    ``[b_0, ..., b_N]``; the last block may be shorter. ``S = 1`` is Full AttnRes and
    ``S >= L`` a single block.

    ``block_size``: ``S``; the other arguments are :class:`AttnResBase`'s. E.g. 16
    sublayers in 8 blocks: ``BlockAttnRes(dim=512, n_sublayers=16, block_size=2)``. A
    ``block_size`` of ``n_sublayers`` or more (a single block) is warned of, as in a config
    (``warn_single_block=False``: meant so, or said already, as ``from_config`` builds it).
    """

    SCHEDULES = {"naive": _Naive(), "two_phase": _TwoPhase()}
    reads_fields = frozenset({"block_size"})

    def __init__(
        self, dim: int, n_sublayers: int, block_size: int, eps: float = 1e-6, schedule: str = "two_phase",
        ablation: AttnResAblation | None = None, backend: str = "auto",
        recompute_phase1: bool = True, *, warn_single_block: bool = True,
    ) -> None:
        if not Int(1).ok(block_size):
            raise ValueError(f"BlockAttnRes: block_size must be an integer >= 1, got {block_size!r}")
        if ablation is not None and ablation.window is not None:
            raise ValueError("the sliding-window ablation applies to Full AttnRes only")
        self.block_size = block_size
        super().__init__(dim, n_sublayers, eps, schedule, ablation, backend, recompute_phase1)
        if warn_single_block:  # (a model of one's own: BlockAttnRes(d, 8, block_size=8), meant as 8 blocks, was
            # one block without a word; from_config's config was warned of when checked)
            _warn_single_block(block_size, n_sublayers, built=True)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_size={self.block_size}"

    @classmethod
    def from_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> BlockAttnRes:
        refuse_other_kind(cls, config)
        return cls(dim, n_sublayers, config.resolved_block_size(n_sublayers), eps=config.eps, schedule=config.schedule,
                   ablation=config.ablation, backend=config.backend,
                   recompute_phase1=config.recompute_phase1, warn_single_block=False)

    @classmethod
    def check_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> None:
        super().check_config(config, dim, n_sublayers)
        if config.ablation.window is not None:
            raise ValueError("ModelConfig.residual.ablation.window must be None unless residual.kind='attnres_full' "
                             f"(the sliding window ablates Full AttnRes); got {config.ablation.window!r}")
        _warn_single_block_once(config, n_sublayers)

    @classmethod
    def _layout_words(cls, config: ResidualConfig, n_sublayers: int) -> list[str]:
        S = config.resolved_block_size(n_sublayers)
        return [f"S={S}", f"N={-(-n_sublayers // S)}"]

    def block_end(self, l: int) -> int:
        """The sublayer after the block of sublayer ``l`` (``L`` for the last block)."""
        return min((l // self.block_size + 1) * self.block_size, self.n_sublayers)

    @property
    def n_blocks(self) -> int:
        """``N = ceil(L / S)``, the number of blocks (embedding not counted)."""
        return -(-self.n_sublayers // self.block_size)

    def sources_per_mixer(self) -> list[int]:
        counts = []
        for l in range(self.n_sublayers):
            n, i = l // self.block_size + 1, l % self.block_size + 1
            counts.append(n if i == 1 else n + 1)
        return counts + [self.n_blocks + 1]

    def history_layout(self, sublayer: int) -> HistoryLayout:
        """``b_0`` and the completed blocks, ``1 + s // S``, and a partial sum unless ``s``
        is a block boundary."""
        return HistoryLayout(1 + sublayer // self.block_size, sublayer % self.block_size != 0)

    def source_members(self) -> list[list[list[int]]]:
        """Sublayer ``l`` of block ``n``: ``b_0 = [v_0]``, each completed block ``b_k`` =
        ``v_{(k-1)S+1} .. v_{kS}``, then the partial sum ``v_{(n-1)S+1} .. v_l``; the output
        aggregation: ``b_0 .. b_N``."""
        S, L = self.block_size, self.n_sublayers
        block = lambda k: list(range((k - 1) * S + 1, min(k * S, L) + 1))  # noqa: E731
        out = []
        for l in range(L):
            n, first = l // S + 1, l % S == 0
            out.append([[0]] + [block(k) for k in range(1, n)] + ([] if first else [list(range((n - 1) * S + 1, l + 1))]))
        out.append([[0]] + [block(k) for k in range(1, self.n_blocks + 1)])
        return out

    def canonical_history(self, blocks: list[Tensor], partial: Tensor | None, sublayer: int) -> DepthHistory:
        """A block that ends exactly at ``sublayer`` counts as completed there."""
        if partial is not None and sublayer % self.block_size == 0:
            return DepthHistory(blocks + [partial], None)
        return DepthHistory(blocks, partial)

    def residual_flops_per_token(self) -> float:
        return super().residual_flops_per_token() + self.n_sublayers * self.dim  # the partial sums
