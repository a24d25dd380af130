"""Pipeline parallelism for :class:`attnres.AttnResLM`, with cross-stage caching (report §4.1).

The transformer blocks are cut into ``C = P * V`` chunks (``P`` ranks, ``V`` virtual stages
per rank); chunk ``c`` runs on rank ``c % P``. Chunk 0 also owns the embedding, the last chunk
the output aggregation, final norm, LM head and loss. Between chunks the residual stream
travels as tensors (see :mod:`attnres.distributed.comm_accounting`): its completed entries
(Block: ``b_0 .. b_{n-1}``; Full: ``v_0 .. v_l``) followed by the running tensor (Block: the
partial sum inside a block; standard: the hidden state), each ``[micro-batch, T, d]``.

The serialised stream is the residual's public :class:`~attnres.nn.residual.DepthHistory`:
the sending chunk takes ``residual.history(state)``, the receiving one
``residual.resume(history, at_sublayer)``, which rebuilds the two-phase state (every received
entry's RMS factor and logits once per chunk - the sender does not own the later queries, so
precomputed logits cannot travel - then Phase 1 for the rest of the open block/group), and
runs its blocks with the model's own sublayer loop (:func:`attnres.models.run_sublayers`).

Two runtimes execute a step (:class:`PipelineConfig` ``runtime``):

* ``"torch"``: ``torch.distributed.pipelining`` stages and schedules (``ScheduleGPipe`` /
  ``ScheduleLoopedBFS``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``); the naive path.
* ``"attnres"``: a small executor of the same orders over ``torch.distributed`` P2P ops,
  needed for cross-stage caching: there a chunk also consumes tensors that the same rank
  received for an earlier virtual stage, and their gradient must reach that earlier stage's
  backward. ``PipelineStage`` has inputs from the previous stage only and no hook for such a
  rank-local edge (docs/distributed-pipeline.md says more).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..models import IGNORE_INDEX, AttnResLM, next_token_loss, run_sublayers
from ..nn.residual import AttnResBase, DepthHistory
from ..validation import Fields
from .comm_accounting import CommCounter, chunk_histories

__all__ = [
    "RUNTIMES",
    "SCHEDULES",
    "PipelineChunk",
    "PipelineConfig",
    "PipelineRunner",
    "schedule_orders",
    "timetable",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
RUNTIMES = ("auto", "torch", "attnres")


_CHECK = Fields("PipelineConfig")
_fail = _CHECK.fail


@dataclass(frozen=True)
class PipelineConfig:
    """How a model is pipelined.

    n_ranks: ``P``, the pipeline ranks (the process group's size).
    virtual_stages: ``V`` chunks per rank (``C = P V`` chunks in all).
    schedule: ``"gpipe"`` (all forwards, then all backwards; with ``V > 1`` chunk by chunk,
        as ``ScheduleLoopedBFS``), ``"1f1b"`` (``V = 1``) or ``"interleaved_1f1b"`` (``V >= 2``,
        ``n_microbatches`` a multiple of ``P``).
    n_microbatches: micro-batches per step; the batch must divide into them evenly.
    cache: cross-stage caching (report §4.1): a rank keeps the history it received for its
        earlier virtual stages and transitions carry only the entries produced since.
    runtime: ``"torch"`` (``torch.distributed.pipelining``), ``"attnres"`` (this module's
        executor) or ``"auto"`` (``"attnres"`` with ``cache``, else ``"torch"``).
    layers_per_chunk: transformer blocks per chunk (``C`` integers >= 0 summing to
        ``n_layers``); ``None`` splits evenly, the remainder to the last chunks (chunk 0
        also holds the embedding, the last one the head).
    """

    n_ranks: int
    virtual_stages: int = 1
    schedule: str = "gpipe"
    n_microbatches: int = 1
    cache: bool = False
    runtime: str = "auto"
    layers_per_chunk: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("n_ranks", "virtual_stages", "n_microbatches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                _fail(name, "an integer >= 1", v)
        if self.schedule not in SCHEDULES:
            _fail("schedule", "one of " + ", ".join(map(repr, SCHEDULES)), self.schedule)
        if self.runtime not in RUNTIMES:
            _fail("runtime", "one of " + ", ".join(map(repr, RUNTIMES)), self.runtime)
        if not isinstance(self.cache, bool):
            _CHECK.boolean("cache", self.cache)
        if self.schedule == "1f1b" and self.virtual_stages != 1:
            _fail("virtual_stages", "1 for schedule '1f1b' (use 'interleaved_1f1b' for V >= 2)", self.virtual_stages)
        if self.schedule == "interleaved_1f1b":
            if self.virtual_stages < 2:
                _fail("virtual_stages", ">= 2 for schedule 'interleaved_1f1b' (use '1f1b' for V = 1)", self.virtual_stages)
            if self.n_microbatches % self.n_ranks:
                _fail("n_microbatches", f"a multiple of n_ranks={self.n_ranks} for 'interleaved_1f1b'", self.n_microbatches)
        if self.cache and self.runtime == "torch":
            _fail("runtime", "'attnres' or 'auto' with cache=True (torch.distributed.pipelining has no rank-local cache edge)", self.runtime)
        if self.layers_per_chunk is not None:
            lpc = self.layers_per_chunk
            if (
                not isinstance(lpc, tuple)
                or len(lpc) != self.n_chunks
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lpc)
            ):
                _fail("layers_per_chunk", f"None or a tuple of {self.n_chunks} integers >= 0", lpc)

    @property
    def n_chunks(self) -> int:
        return self.n_ranks * self.virtual_stages

    @property
    def resolved_runtime(self) -> str:
        if self.runtime != "auto":
            return self.runtime
        return "attnres" if self.cache else "torch"

    def chunk_layers(self, n_layers: int) -> list[range]:
        """The transformer blocks of every chunk."""
        counts = self.layers_per_chunk
        if counts is None:
            q, r = divmod(n_layers, self.n_chunks)
            counts = tuple(q + (c >= self.n_chunks - r) for c in range(self.n_chunks))
        elif sum(counts) != n_layers:
            _fail("layers_per_chunk", f"a split of n_layers={n_layers}", counts)
        out, start = [], 0
        for n in counts:
            out.append(range(start, start + n))
            start += n
        return out


# -- one chunk of the model -------------------------------------------------------------
class PipelineChunk(nn.Module):
    """Chunk ``index`` of ``model``: its transformer blocks, their depth queries, plus the
    embedding (first chunk) or the output aggregation, final norm and LM head (last chunk).

    Parameter names are the full model's (``layers.3.attn.q_proj.weight``,
    ``residual.mixers.6.query``, ...); the modules are shared with ``model``, not copied.

    ``forward``: the first chunk takes ``input_ids [B, T]``, the others the serialised stream
    (``n_completed_in`` entries, then the running tensor if ``running_in``), all
    ``[B, T, d]``. It returns the logits ``[B, T, vocab]`` (last chunk) or the serialised
    stream in front of its last sublayer, as a tuple.
    """

    def __init__(self, model: AttnResLM, index: int, layers: range, n_chunks: int) -> None:
        super().__init__()
        cfg = model.config
        stream = model.residual
        stream.history_layout(0)  # raises for a residual that cannot be cut into stages
        if not isinstance(stream, AttnResBase) and any(True for _ in stream.parameters()):
            raise ValueError(f"pipeline parallelism splits the depth queries of AttnRes between stages; residual "
                             f"{cfg.residual.kind!r} has parameters it cannot split")
        if cfg.tie_embeddings and n_chunks > 1:
            raise ValueError("ModelConfig.tie_embeddings must be False for a pipeline (embedding and LM head live on different chunks)")
        self.index, self.first, self.last = index, index == 0, index == n_chunks - 1
        self.s0, self.s1 = 2 * layers.start, 2 * layers.stop
        self.n_completed_in, self.running_in = stream.history_layout(self.s0) if not self.first else (0, False)
        if self.first:
            self.embed_tokens = model.embed_tokens
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.residual = nn.Module()
        owned = list(range(self.s0, self.s1)) + ([cfg.n_sublayers] if self.last else [])
        if isinstance(stream, AttnResBase):
            self.residual.mixers = nn.ModuleDict({str(l): stream.mixers[l] for l in owned})
        if self.last:
            self.norm, self.lm_head = model.norm, model.lm_head
        self.rope = model.rope  # cos/sin tables only
        # The model's residual module runs the schedule; kept out of the module tree so that
        # the other chunks' depth queries are not this chunk's parameters.
        self._stream = (stream,)

    def forward(self, *inputs: Tensor) -> Tensor | tuple[Tensor, ...]:
        stream = self._stream[0]
        if self.first:
            x = self.embed_tokens(inputs[0])
            state = stream.start(x, defer_norm=True)
        else:
            n = self.n_completed_in
            history = DepthHistory(list(inputs[:n]), inputs[n] if self.running_in else None)
            x = inputs[0]
            state = stream.resume(history, self.s0, defer_norm=True)
        cos, sin = self.rope(x.shape[-2])
        run_sublayers(stream, state, ((int(k), layer) for k, layer in self.layers.items()), cos, sin)
        if self.last:
            return self.lm_head(self.norm(stream.finish(state)))
        completed, running = stream.history(state)
        return tuple(completed) + ((running,) if running is not None else ())


# -- schedules --------------------------------------------------------------------------
Action = tuple[str, int, int]  # ("F" | "B", chunk, micro-batch)


def _interleaved(k: int, rank: int, n_ranks: int, virtual_stages: int, backward: bool) -> tuple[int, int]:
    """``(chunk, micro-batch)`` of a rank's ``k``-th forward (or backward) in interleaved 1F1B:
    rounds of ``P`` micro-batches per chunk, chunks ascending (backward: descending)."""
    i = k % (n_ranks * virtual_stages)
    v = i // n_ranks
    if backward:
        v = virtual_stages - 1 - v
    return v * n_ranks + rank, k // (n_ranks * virtual_stages) * n_ranks + i % n_ranks


def schedule_orders(schedule: str, n_ranks: int, virtual_stages: int, n_microbatches: int) -> list[list[Action]]:
    """Per rank, the order of its forward/backward actions.

    gpipe: every forward (chunk by chunk), then every backward (last chunk first). 1f1b:
    ``P - 1 - r`` warm-up forwards, then one forward / one backward, then the rest.
    interleaved_1f1b (Megatron-LM's order): micro-batches in rounds of ``P`` per chunk,
    ``2 (P - 1 - r) + (V - 1) P`` warm-up forwards, then alternating.
    """
    P, V, M = n_ranks, virtual_stages, n_microbatches
    orders = []
    for r in range(P):
        if schedule == "gpipe":
            fwd = [("F", v * P + r, m) for v in range(V) for m in range(M)]
            bwd = [("B", v * P + r, m) for v in reversed(range(V)) for m in range(M)]
            orders.append(fwd + bwd)
            continue
        if schedule == "1f1b":
            fwd = [("F", r, m) for m in range(M)]
            bwd = [("B", r, m) for m in range(M)]
            warm = min(P - 1 - r, M)
        else:
            fwd = [("F", *_interleaved(k, r, P, V, backward=False)) for k in range(M * V)]
            bwd = [("B", *_interleaved(k, r, P, V, backward=True)) for k in range(M * V)]
            warm = min(2 * (P - 1 - r) + (V - 1) * P, M * V)
        order = fwd[:warm]
        for f, b in zip(fwd[warm:], bwd):
            order += [f, b]
        order += bwd[len(fwd) - warm :]
        orders.append(order)
    return orders


def timetable(orders: list[list[Action]], n_chunks: int) -> list[list[Action | None]]:
    """Lock-step time slots for ``orders``: in each slot every rank runs its next action if
    what it needs (the previous chunk's forward; the forward and the next chunk's backward)
    finished in an earlier slot. Raises ``RuntimeError`` if the orders deadlock."""
    done: set[Action] = set()
    pos = [0] * len(orders)
    slots = []
    while any(p < len(o) for p, o in zip(pos, orders)):
        slot: list[Action | None] = []
        for r, order in enumerate(orders):
            a = order[pos[r]] if pos[r] < len(order) else None
            if a is not None:
                kind, c, m = a
                need = [("F", c - 1, m)] if kind == "F" and c > 0 else []
                if kind == "B":
                    need = [("F", c, m)] + ([("B", c + 1, m)] if c + 1 < n_chunks else [])
                if not all(n in done for n in need):
                    a = None
            slot.append(a)
        if all(a is None for a in slot):
            raise RuntimeError(f"pipeline schedule deadlocks at {[o[p] if p < len(o) else None for p, o in zip(pos, orders)]}")
        for r, a in enumerate(slot):
            if a is not None:
                done.add(a)
                pos[r] += 1
        slots.append(slot)
    return slots


# -- the runner -------------------------------------------------------------------------
class PipelineRunner:
    """This rank's part of a pipelined ``model``: its chunks and one training step.

    ``forward_backward(input_ids [B, T], labels [B, T])`` runs every micro-batch forward and
    backward, accumulates the parameter gradients (call ``optimizer.step()`` /
    ``zero_grad()`` around it as usual) and returns the mean next-token loss of the whole
    batch on every rank, equal to ``model(input_ids, labels).loss``. Every rank passes the
    same batch (chunk 0 reads the ids, the last chunk the labels).

    ``model`` is the full model, built identically on every rank (same seed); the runner
    uses the modules of its own chunks. ``counter`` records what this rank sends.
    """

    def __init__(self, model: AttnResLM, config: PipelineConfig, group: dist.ProcessGroup | None = None) -> None:
        self.config, self.group = config, group
        world = dist.get_world_size(group)
        if world != config.n_ranks:
            _fail("n_ranks", f"the process group's size {world}", config.n_ranks)
        self.rank = dist.get_rank(group)
        self.model_config = model.config
        self._check_input_ids = model.check_input_ids
        P, C = config.n_ranks, config.n_chunks
        layers = config.chunk_layers(model.config.n_layers)
        self.chunks = {c: PipelineChunk(model, c, layers[c], C) for c in range(self.rank, C, P)}
        self.dtype = model.embed_tokens.weight.dtype
        self.device = model.embed_tokens.weight.device
        self.received, self.running = chunk_histories(model.config, [len(r) for r in layers])
        self.counter = CommCounter()
        self._n_valid = 1
        self._torch_schedule = None
        self._slots = None
        # NCCL wants every rank of a group in its first collective before P2P batches.
        dist.barrier(group=group)

    def parameters(self):
        """This rank's parameters (each once), for its optimizer."""
        seen = {}
        for chunk in self.chunks.values():
            for p in chunk.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters under the full model's names."""
        return {n: p for chunk in self.chunks.values() for n, p in chunk.named_parameters()}

    def _cached(self, c: int) -> int:
        """Completed entries chunk ``c`` takes from this rank's cache instead of the wire."""
        P = self.config.n_ranks
        return self.received[c - P] if self.config.cache and c >= P else 0

    def _sent(self, c: int) -> int:
        """Tensors on the edge into chunk ``c``, each way."""
        return self.received[c] - self._cached(c) + int(self.running[c])

    def _loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """This micro-batch's share of the batch mean: the summed cross-entropy over the
        batch's number of predicted tokens, so that the micro-batch losses add up to it."""
        return next_token_loss(logits, labels, reduction="sum") / self._n_valid

    def forward_backward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        M = self.config.n_microbatches
        if input_ids.dim() != 2 or labels.shape != input_ids.shape:
            raise ValueError(f"input_ids and labels must be [batch, seq] of one shape, got {tuple(input_ids.shape)} and {tuple(labels.shape)}")
        self._check_input_ids(input_ids)
        if input_ids.shape[0] % M:
            raise ValueError(f"batch size {input_ids.shape[0]} is not divisible by PipelineConfig.n_microbatches={M}")
        input_ids, labels = input_ids.to(self.device), labels.to(self.device)
        self._n_valid = max(int((labels[:, 1:] != IGNORE_INDEX).sum()), 1)
        if self.config.resolved_runtime == "torch":
            loss = self._step_torch(input_ids, labels)
        else:
            loss = self._step_attnres(input_ids, labels)
        last_rank = (self.config.n_chunks - 1) % self.config.n_ranks
        out = torch.zeros((), dtype=torch.float32, device=self.device) if loss is None else loss.detach().float().reshape(())
        dist.broadcast(out, self._peer(last_rank), group=self.group)
        return out

    def _peer(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` (P2P ops and broadcast take global ranks)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    # -- torch.distributed.pipelining ---------------------------------------------------
    def _step_torch(self, input_ids: Tensor, labels: Tensor) -> Tensor | None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
        )

        cfg = self.config
        if self._torch_schedule is None:
            counter = self.counter

            class CountingStage(PipelineStage):
                """Counts per micro-batch what the stage sends: its outputs (as they are) and
                the gradients of its inputs; torch's one-off metadata inference is not counted."""

                def forward_one_chunk(self, *args, **kwargs):
                    out = super().forward_one_chunk(*args, **kwargs)
                    if not self.is_last:
                        outs = out if isinstance(out, tuple) else (out,)
                        counter.record("forward", self.stage_index + 1, len(outs), sum(t.numel() * t.element_size() for t in outs))
                    return out

                def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
                    super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
                    if not self.is_first:
                        grads = [g for g in self.bwd_cache[bwd_chunk_id] if g is not None]
                        counter.record("backward", self.stage_index, len(grads), sum(g.numel() * g.element_size() for g in grads))

            stages = [CountingStage(chunk, c, cfg.n_chunks, self.device, group=self.group) for c, chunk in self.chunks.items()]
            kw = dict(n_microbatches=cfg.n_microbatches, loss_fn=self._loss, scale_grads=False)
            if cfg.schedule == "interleaved_1f1b":
                self._torch_schedule = ScheduleInterleaved1F1B(stages, **kw)
            elif cfg.schedule == "1f1b":
                self._torch_schedule = Schedule1F1B(stages[0], **kw)
            elif cfg.virtual_stages == 1:
                self._torch_schedule = ScheduleGPipe(stages[0], **kw)
            else:
                self._torch_schedule = ScheduleLoopedBFS(stages, **kw)
        has_first, has_last = 0 in self.chunks, cfg.n_chunks - 1 in self.chunks
        losses: list[Tensor] = []
        args = (input_ids,) if has_first else ()
        kwargs = dict(target=labels, losses=losses) if has_last else {}
        self._torch_schedule.step(*args, **kwargs)
        return torch.stack(losses).sum() if has_last else None

    # -- this module's executor ---------------------------------------------------------
    def _step_attnres(self, input_ids: Tensor, labels: Tensor) -> Tensor | None:
        cfg = self.config
        P, C, M = cfg.n_ranks, cfg.n_chunks, cfg.n_microbatches
        if self._slots is None:
            self._slots = timetable(schedule_orders(cfg.schedule, P, cfg.virtual_stages, M), C)
        ids, labs = input_ids.chunk(M), labels.chunk(M)
        shape = (ids[0].shape[0], ids[0].shape[1], self.model_config.d_model)
        inbox: dict[tuple[str, int, int], list[Tensor]] = {}  # ("F", chunk, mb): received leaves; ("B", ...): grads
        outbox: dict[tuple[str, int, int], Tensor] = {}
        saved: dict[tuple[int, int], tuple[list[Tensor], Any]] = {}
        history: dict[tuple[int, int], list[Tensor]] = {}  # chunk c's completed input entries: the cache of chunk c + P
        total = None
        for slot in self._slots:
            action = slot[self.rank]
            if action is not None:
                kind, c, m = action
                chunk = self.chunks[c]
                if kind == "F":
                    got = inbox.pop(("F", c, m), []) if c > 0 else []
                    held = self._cached(c)
                    inputs = (history[(c - P, m)][:held] if held else []) + got
                    history[(c, m)] = inputs[: self.received[c]]
                    out = chunk(ids[m]) if c == 0 else chunk(*inputs)
                    if chunk.last:
                        loss = self._loss(out, labs[m])
                        total = loss.detach() if total is None else total + loss.detach()
                        saved[(c, m)] = (got, loss)
                    else:
                        send = list(out[self._cached(c + 1) :])
                        saved[(c, m)] = (got, send)
                        if send:
                            outbox[("F", c + 1, m)] = torch.stack(send).detach()
                else:
                    got, out = saved.pop((c, m))
                    if chunk.last:
                        out.backward()
                    elif out:
                        torch.autograd.backward(out, inbox.pop(("B", c, m)))
                    # A received leaf's gradient now also holds what chunk c + P added through
                    # the cache (its backward ran first), so it reaches the chunk that sent it.
                    if got:
                        outbox[("B", c - 1, m)] = torch.stack([x.grad if x.grad is not None else torch.zeros_like(x) for x in got])
                    history.pop((c, m), None)
            self._exchange(slot, outbox, inbox, shape)
        return total

    def _exchange(self, slot: list[Action | None], outbox: dict, inbox: dict, shape: tuple[int, int, int]) -> None:
        """Sends and receives the messages of one time slot: each action that feeds another
        rank's chunk sends one stacked ``[n, micro-batch, T, d]`` tensor. Every rank walks
        the same slot in rank order, so both sides post matching operations in one order."""
        P = self.config.n_ranks
        ops, arrivals = [], []
        for kind, c, m in (a for a in slot if a is not None):
            dst_chunk = c + 1 if kind == "F" else c - 1
            if not 0 <= dst_chunk < self.config.n_chunks:
                continue
            edge = max(c, dst_chunk)  # the edge into chunk `edge`
            n = self._sent(edge)
            if n == 0:
                continue
            src, dst = c % P, dst_chunk % P
            key = (kind, dst_chunk, m)
            if src == self.rank:
                buf = outbox.pop(key)
                self.counter.record("forward" if kind == "F" else "backward", edge, n, buf.numel() * buf.element_size())
                if dst == self.rank:
                    arrivals.append((key, buf))
                else:
                    ops.append(dist.P2POp(dist.isend, buf, self._peer(dst), self.group))
            elif dst == self.rank:
                buf = torch.empty((n, *shape), dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buf, self._peer(src), self.group))
                arrivals.append((key, buf))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for key, buf in arrivals:
            if key[0] == "F":
                inbox[key] = [t.detach().requires_grad_() for t in buf.unbind(0)]
            else:
                inbox[key] = list(buf.unbind(0))

