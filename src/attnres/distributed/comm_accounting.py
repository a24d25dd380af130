"""What a pipeline sends between chunks, with and without cross-stage caching (report §4.1).

A pipeline of ``P`` ranks and ``V`` virtual stages per rank cuts the transformer blocks into
``C = P * V`` chunks; chunk ``c`` runs on rank ``c % P``. At every chunk boundary the
residual stream is serialised as

* its **completed entries**, the history AttnRes attends over: Block AttnRes the embedding
  ``b_0`` and the completed block sums ``b_1 .. b_{n-1}``; Full AttnRes the embedding and
  every earlier sublayer output ``v_0 .. v_l``; the standard residual has none;
* and a **running tensor** where one is open: Block AttnRes the partial sum of the current
  block when the boundary falls inside a block; the standard residual its hidden state.

The report's unit is one completed entry (``N_p d`` values per token per chunk). Naively
every transition into chunk ``c`` sends the whole history ``H_c``; with caching, rank
``c % P`` keeps what it *received* for chunk ``c - P`` and the transition carries only the
entries produced since, ``H_c - H_{c-P}`` (chunk 0 receives nothing, so ``H_0 = 0``). Both
also send the running tensor, which changes in every chunk. The backward pass sends one
gradient per forward tensor over the same edges.

With ``N_p`` completed entries produced by every chunk (the embedding counts as one of
chunk 0's) the totals are report §4.1's formulas, :func:`naive_transfers` and
:func:`cached_transfers`; :func:`plan_transitions` counts any split exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..models.config import ModelConfig

__all__ = [
    "CommCounter",
    "Transition",
    "cached_transfers",
    "chunk_histories",
    "history_layout",
    "naive_transfers",
    "plan_transitions",
]


def history_layout(config: ModelConfig, sublayer: int) -> tuple[int, bool]:
    """``(completed entries, running tensor?)`` of the residual stream in front of sublayer
    ``sublayer`` (0-based; ``L`` = after the last one) once the embedding exists, as the
    residual variant describes it (``ResidualStream.history_layout``): Block (size ``S``)
    ``1 + s // S`` entries and a partial sum unless ``s`` is a block boundary; Full ``1 + s``
    entries; standard no entries and the hidden state."""
    if not 0 <= sublayer <= config.n_sublayers:
        raise ValueError(f"sublayer must be in [0, {config.n_sublayers}], got {sublayer}")
    return tuple(_layout_module(config).history_layout(sublayer))


def _layout_module(config: ModelConfig):
    """The config's residual module on the meta device (no memory): it describes its layout."""
    with torch.device("meta"):
        return config.build_residual()


def chunk_histories(config: ModelConfig, layers_per_chunk: Sequence[int]) -> tuple[list[int], list[bool]]:
    """Per chunk ``c``: the completed entries ``H_c`` it receives (``H_0 = 0``: chunk 0 makes
    the embedding itself) and whether a running tensor comes with them."""
    if sum(layers_per_chunk) != config.n_layers:
        raise ValueError(f"layers_per_chunk {list(layers_per_chunk)} must sum to n_layers={config.n_layers}")
    residual = _layout_module(config)
    completed, running, start = [0], [False], 0
    for n in layers_per_chunk[:-1]:
        start += n
        h, r = residual.history_layout(2 * start)
        completed.append(h)
        running.append(r)
    return completed, running


@dataclass(frozen=True)
class Transition:
    """One chunk boundary, ``chunk - 1 -> chunk``, for one micro-batch.

    blocks: completed entries sent; running: 1 if a running tensor is sent, else 0;
    cached: completed entries the receiving rank already holds (0 without caching).
    """

    chunk: int
    src_rank: int
    dst_rank: int
    blocks: int
    running: int
    cached: int

    @property
    def tensors(self) -> int:
        """Tensors of ``[micro-batch, T, d]`` on this edge, each way (forward, then gradients)."""
        return self.blocks + self.running


def plan_transitions(completed: Sequence[int], running: Sequence[bool], n_ranks: int, cached: bool) -> list[Transition]:
    """The transitions into chunks ``1 .. C-1`` given each chunk's received history
    (:func:`chunk_histories`): naive sends ``H_c``; cached sends ``H_c - H_{c-P}`` for
    ``c >= P`` (everything produced since the receiving rank last received a history)."""
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    if len(completed) != len(running):
        raise ValueError("completed and running must have one entry per chunk")
    out = []
    for c in range(1, len(completed)):
        held = completed[c - n_ranks] if cached and c >= n_ranks else 0
        out.append(Transition(c, (c - 1) % n_ranks, c % n_ranks, completed[c] - held, int(running[c]), held))
    return out


def naive_transfers(n_ranks: int, virtual_stages: int, per_chunk: int) -> int:
    """Spec §5, ``Comm_naive = C (C - 1) / 2 * N_p`` completed entries, ``C = P V``."""
    c = n_ranks * virtual_stages
    return c * (c - 1) // 2 * per_chunk


def cached_transfers(n_ranks: int, virtual_stages: int, per_chunk: int) -> int:
    """Spec §5, ``Comm_cached = P (P - 1) / 2 * N_p + (V - 1) P^2 N_p`` completed entries."""
    p = n_ranks
    return p * (p - 1) // 2 * per_chunk + (virtual_stages - 1) * p * p * per_chunk


class CommCounter:
    """Counts what a rank actually sends: per ``(direction, chunk)`` the messages, tensors
    and bytes (direction ``"forward"`` into ``chunk``, ``"backward"`` out of ``chunk``).
    Counters of several ranks add up with :meth:`merge`."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, int], list[int]] = {}  # [messages, tensors, bytes]

    def record(self, direction: str, chunk: int, tensors: int, nbytes: int, messages: int = 1) -> None:
        e = self.entries.setdefault((direction, chunk), [0, 0, 0])
        e[0] += messages
        e[1] += tensors
        e[2] += nbytes

    def reset(self) -> None:
        self.entries.clear()

    def merge(self, other: CommCounter) -> None:
        for (direction, chunk), (m, t, b) in other.entries.items():
            self.record(direction, chunk, t, b, messages=m)

    def tensors(self, direction: str = "forward") -> dict[int, int]:
        """Tensors sent per chunk boundary (all micro-batches together)."""
        return {c: e[1] for (d, c), e in sorted(self.entries.items()) if d == direction}

    def total_tensors(self, direction: str = "forward") -> int:
        return sum(self.tensors(direction).values())

    def total_bytes(self, direction: str | None = None) -> int:
        return sum(e[2] for (d, _), e in self.entries.items() if direction in (None, d))

    def as_dict(self) -> dict[str, dict[int, list[int]]]:
        """``{direction: {chunk: [messages, tensors, bytes]}}`` (JSON-friendly)."""
        out: dict[str, dict[int, list[int]]] = {}
        for (d, c), e in sorted(self.entries.items()):
            out.setdefault(d, {})[c] = list(e)
        return out
