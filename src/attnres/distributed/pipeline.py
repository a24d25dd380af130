"""Pipeline parallelism for :class:`attnres.AttnResLM` on ``torch.distributed.pipelining``,
with cross-stage caching (report §4.1, Fig. 3).

The transformer blocks are cut into ``C = P * V`` chunks (``P`` ranks, ``V`` virtual stages
per rank); chunk ``c`` runs on rank ``c % P``. Chunk 0 also owns the embedding, the last chunk
the output aggregation, final norm, LM head and loss. Between chunks the residual stream
travels as tensors (see :mod:`attnres.distributed.comm_accounting`): its completed entries
(Block: ``b_0 .. b_{n-1}``; Full: ``v_0 .. v_l``) followed by the running tensor (Block: the
partial sum inside a block; standard: the hidden state), each ``[micro-batch, T, d]``.

The serialised stream is the residual's public :class:`~attnres.nn.residual.DepthHistory`:
the sending chunk takes ``residual.history(state)``, the receiving one
``residual.resume(history, at_sublayer)`` and runs its blocks with the model's own sublayer
loop (:func:`attnres.models.run_sublayers`).

Every step runs on torch's schedules (``ScheduleGPipe`` / ``ScheduleLoopedBFS``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B``), one :class:`CachedStage` (a
``PipelineStage``) per chunk. Cross-stage caching is an adapter on those stages:

* :class:`StageCache` keeps, per micro-batch, the completed entries each of the rank's chunks
  received (the stage's own input leaves); chunk ``c >= P`` takes the first ``H_{c-P}``
  entries from there (what its rank received for chunk ``c - P``) and only the rest comes
  over the wire, ``H_c - H_{c-P}`` entries;
* a cached entry enters chunk ``c``'s graph through :class:`_Deposit`: an identity whose
  backward *deposits* the gradient in the cache under the entry's origin (the chunk that
  received it, and its input slot) instead of flowing into another stage's graph;
* when the origin chunk's backward has run (always after every later chunk's: the
  gradient chain ``c -> c-1 -> ... -> c-P``), :class:`CachedStage` adds the deposits to the
  input gradients it sends back. So every entry's gradient reaches the chunk that produced
  it with all its uses, and no stage's graph is walked twice.

A received block is dropped from the cache when the backward of the micro-batch that
received it has run (no later chunk can still need it then).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage

from ..models import IGNORE_INDEX, AttnResLM, next_token_loss, require_attnres_lm, run_sublayers
from ..models.trunk import plain_call
from ..nn.residual import AttnResBase, DepthHistory
from ..validation import Fields
from .comm_accounting import CommCounter, chunk_histories
from .parallel import microbatches_problem

__all__ = ["SCHEDULES", "PipelineChunk", "PipelineConfig", "PipelineRunner", "StageCache", "CachedStage",
           "stage_parameter_names"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

_CHECK = Fields("PipelineConfig")
_fail = _CHECK.fail
#: The installed torch. Before 2.12 ``torch.distributed.pipelining`` opens every stage's first
#: exchange with its neighbours by messages over the process group, a rank's own stages included:
#: on one rank with ``V >= 2`` it sends to itself, which gloo cannot ("Pair is not connected").
TORCH_VERSION = torch.torch_version.TorchVersion(torch.__version__)
ONE_RANK_GLOO_TORCH = "2.12"


@dataclass(frozen=True)
class PipelineConfig:
    """How a model is pipelined.

    n_ranks: ``P``, the pipeline ranks (the process group's size).
    virtual_stages: ``V`` chunks per rank (``C = P V`` chunks in all).
    schedule: ``"gpipe"`` (all forwards, then all backwards; with ``V > 1`` chunk by chunk,
        ``ScheduleLoopedBFS``), ``"1f1b"`` (``V = 1``) or ``"interleaved_1f1b"`` (``V >= 2``).
    n_microbatches: micro-batches per step; the batch must divide into them evenly.
    cache: cross-stage caching (report §4.1): a rank keeps the history it received for its
        earlier virtual stages and transitions carry only the entries produced since.
    layers_per_chunk: transformer blocks per chunk (``C`` integers >= 1 summing to
        ``n_layers``); ``None`` splits evenly, the remainder to the last chunks.
    """

    n_ranks: int
    virtual_stages: int = 1
    schedule: str = "gpipe"
    n_microbatches: int = 1
    cache: bool = False
    layers_per_chunk: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("n_ranks", "virtual_stages", "n_microbatches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                _fail(name, "an integer >= 1", v)
        if self.schedule not in SCHEDULES:
            _fail("schedule", "one of " + ", ".join(map(repr, SCHEDULES)), self.schedule)
        if not isinstance(self.cache, bool):
            _CHECK.boolean("cache", self.cache)
        if self.schedule == "1f1b" and self.virtual_stages != 1:
            _fail("virtual_stages", "1 for schedule '1f1b' (use 'interleaved_1f1b' for V >= 2)", self.virtual_stages)
        if self.schedule == "interleaved_1f1b" and self.virtual_stages < 2:
            _fail("virtual_stages", ">= 2 for schedule 'interleaved_1f1b' (use '1f1b' for V = 1)", self.virtual_stages)
        problem = microbatches_problem(self.schedule, self.n_ranks, self.n_microbatches, "n_ranks")
        if problem is not None:
            _fail("n_microbatches", problem, self.n_microbatches)
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
    ``[B, T, d]`` - or, with a :class:`StageCache` attached (``cache``), only what came over
    the wire and the rest from the cache. It returns the logits ``[B, T, vocab]`` (last
    chunk) or the serialised stream in front of its last sublayer, as a tuple (with a cache:
    without the entries the next chunk's rank already holds).

    ``sublayer_call`` runs each sublayer (activation checkpointing); ``sequence_shards``:
    the hidden states hold ``T / sequence_shards`` positions (tensor parallelism shards the
    sequence; the RoPE tables still span ``T``).
    """

    def __init__(self, model: AttnResLM, index: int, layers: range, n_chunks: int) -> None:
        super().__init__()
        cfg = model.config
        stream = model.residual
        stream.history_layout(0)  # raises for a residual that cannot be cut into stages
        if not isinstance(stream, AttnResBase) and any(True for _ in stream.parameters()):
            raise ValueError(f"pipeline parallelism splits the depth queries of AttnRes between stages; residual "
                             f"{cfg.residual.kind!r} has parameters it cannot split: train it without a pipeline "
                             "(parallel.pp=1)")
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
        # Kept out of the module tree: the model's residual module runs the schedule (the
        # other chunks' depth queries are not this chunk's parameters), and the RoPE tables
        # are buffers every chunk shares.
        self._shared = (stream, model.rope)
        self.cache: StageCache | None = None
        self.sublayer_call = plain_call
        self.sequence_shards = 1
        self.wire_dtype = torch.float32

    def forward(self, *inputs: Tensor) -> Tensor | tuple[Tensor, ...]:
        stream, rope = self._shared
        # Under tensor parallelism the norms are sequence-parallel modules whose input hook
        # takes a tensor: the residual hands them its merged input rather than fusing the
        # norm into the merge (the same values up to rounding).
        defer = self.sequence_shards == 1
        if self.first:
            x = self.embed_tokens(inputs[0])
            state = stream.start(x, defer_norm=defer)
        else:
            entries = list(inputs) if self.cache is None else self.cache.assemble(self.index, inputs)
            n = self.n_completed_in
            history = DepthHistory(entries[:n], entries[n] if self.running_in else None)
            x = entries[0]
            state = stream.resume(history, self.s0, defer_norm=defer)
        cos, sin = rope(x.shape[-2] * self.sequence_shards)
        blocks = ((int(k), layer) for k, layer in self.layers.items())
        run_sublayers(stream, state, blocks, cos, sin, sublayer_call=self.sublayer_call)
        # What leaves a chunk travels in the runner's static dtype (``wire_dtype``): under
        # bf16 the sublayer outputs in the history are bf16 and the rest float32, and torch's
        # stages check every tensor against their static shapes. Casting bf16 up is exact.
        if self.last:
            return self.lm_head(self.norm(stream.finish(state))).to(self.wire_dtype)
        completed, running = stream.history(state)
        held = 0 if self.cache is None else self.cache.held(self.index + 1)
        return tuple(t.to(self.wire_dtype) for t in completed[held:]) + \
            ((running.to(self.wire_dtype),) if running is not None else ())


def stage_parameter_names(model: AttnResLM, config: PipelineConfig, rank: int) -> list[str]:
    """The parameters (full-model names) of rank ``rank``'s chunks; works on a model built
    on the ``meta`` device."""
    layers = config.chunk_layers(model.config.n_layers)
    names: list[str] = []
    for c in range(rank, config.n_chunks, config.n_ranks):
        names += [n for n, _ in PipelineChunk(model, c, layers[c], config.n_chunks).named_parameters()]
    return names


# -- the cache ----------------------------------------------------------------------------
Origin = tuple[int, int, int]  # (chunk that received the entry, micro-batch, its input slot)


class _Deposit(torch.autograd.Function):
    """Identity; the backward deposits the gradient in the cache under the entry's origin
    and stops there (the entry is another stage's input leaf)."""

    @staticmethod
    def forward(ctx, x: Tensor, cache: StageCache, origin: Origin) -> Tensor:
        ctx.cache, ctx.origin = cache, origin
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.cache.deposit(ctx.origin, grad)
        return None, None, None


class StageCache:
    """One rank's cross-stage cache for one schedule (see the module docstring).

    ``received[c]`` is ``H_c``, the completed entries chunk ``c`` takes in; ``enabled``
    turns the caching on (off: every chunk gets its whole history over the wire).
    ``microbatch`` is set by the stage before each forward.
    """

    def __init__(self, received: list[int], n_ranks: int, enabled: bool) -> None:
        self.received, self.n_ranks, self.enabled = received, n_ranks, enabled
        self.microbatch = 0
        self._entries: dict[tuple[int, int], list[tuple[Tensor, Origin]]] = {}
        self._deposits: dict[Origin, Tensor] = {}

    def held(self, c: int) -> int:
        """Completed entries chunk ``c`` takes from this rank's cache instead of the wire."""
        if not self.enabled or c >= len(self.received) or c < self.n_ranks:
            return 0
        return self.received[c - self.n_ranks]

    def assemble(self, c: int, wire: tuple[Tensor, ...]) -> list[Tensor]:
        """Chunk ``c``'s whole input (completed entries, then the running tensor) from the
        cache and ``wire`` (what came over the wire); records the completed entries."""
        m, held = self.microbatch, self.held(c)
        n_wire = self.received[c] - held
        got = [(t, (c, m, i)) for i, t in enumerate(wire[:n_wire])]
        cached = self._entries[(c - self.n_ranks, m)][:held] if held else []
        self._entries[(c, m)] = cached + got
        grad = torch.is_grad_enabled()
        entries = [_Deposit.apply(t, self, origin) if grad and t.requires_grad else t for t, origin in cached]
        return entries + [t for t, _ in got] + list(wire[n_wire:])

    def deposit(self, origin: Origin, grad: Tensor) -> None:
        prior = self._deposits.get(origin)
        self._deposits[origin] = grad.clone() if prior is None else prior + grad

    def collect(self, c: int, m: int, grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        """Chunk ``c``'s input gradients for micro-batch ``m`` plus what later chunks of this
        rank deposited for those inputs; drops the micro-batch's entries of chunk ``c``."""
        out = list(grads)
        for i in range(len(out)):
            extra = self._deposits.pop((c, m, i), None)
            if extra is not None:
                out[i] = extra if out[i] is None else out[i] + extra
        self._entries.pop((c, m), None)
        return tuple(out)

    def clear(self) -> None:
        """Between steps. Raises if a deposit was never collected (a lost gradient)."""
        left = sorted(self._deposits)
        self._entries.clear()
        self._deposits.clear()
        if left:
            raise RuntimeError(f"pipeline cache: gradients deposited for {left} were never sent back")


class CachedStage(PipelineStage):
    """A ``PipelineStage`` for one :class:`PipelineChunk` that tells its cache the
    micro-batch, adds the cache's gradient deposits to the input gradients it sends back,
    and counts what it sends (outputs forward, input gradients backward; torch's one-off
    set-up messages are not counted)."""

    def __init__(self, chunk: PipelineChunk, *args, cache: StageCache, counter: CommCounter | None, **kwargs):
        super().__init__(chunk, *args, **kwargs)
        self.cache, self.counter = cache, counter

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        self.cache.microbatch = fwd_chunk_id
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if not self.is_last and self.counter is not None:
            outs = out if isinstance(out, tuple) else (out,)
            self.counter.record("forward", self.stage_index + 1, len(outs), sum(t.numel() * t.element_size() for t in outs))
        return out

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        if not kwargs.get("full_backward", True):
            raise RuntimeError("the cached pipeline stage supports full backward passes only")
        super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        grads = self.cache.collect(self.stage_index, bwd_chunk_id, self.bwd_cache.get(bwd_chunk_id, ()))
        if not self.is_first:
            self.bwd_cache[bwd_chunk_id] = grads
            if self.counter is not None:
                sent = [g for g in grads if g is not None]
                self.counter.record("backward", self.stage_index, len(sent), sum(g.numel() * g.element_size() for g in sent))


# -- the runner -------------------------------------------------------------------------
def _refuse_a_send_to_itself(config: PipelineConfig, group: dist.ProcessGroup | None) -> None:
    """One rank holding several chunks on gloo under torch older than 2.12 (see
    :data:`TORCH_VERSION`): refused here, before its first step fails inside torch."""
    if config.n_ranks == 1 and config.virtual_stages > 1 and TORCH_VERSION < ONE_RANK_GLOO_TORCH \
            and dist.get_backend(group) == "gloo":
        _fail("virtual_stages", f"1 with n_ranks=1 on gloo under torch {TORCH_VERSION} (its pipeline schedules "
              f"send between a rank's own stages, which gloo cannot; torch>={ONE_RANK_GLOO_TORCH} does not)",
              config.virtual_stages)


class PipelineRunner:
    """This rank's part of a pipelined ``model``: its chunks, one training step and the
    evaluation loss, on torch's pipeline schedules.

    ``forward_backward(input_ids [B, T], labels [B, T], scale=1.0)`` runs every micro-batch
    forward and backward, accumulates ``scale`` times the parameter gradients of the batch's
    mean next-token loss (call ``optimizer.step()`` / ``zero_grad()`` around it as usual)
    and returns that mean loss on every rank, equal to ``model(input_ids, labels).loss``.
    ``loss(input_ids, labels)`` is the same loss without gradients (one micro-batch). Every
    rank passes the same batch (chunk 0 reads the ids, the last chunk the labels).

    ``model`` is the full model (possibly built on the ``meta`` device with only this rank's
    part materialised, see :func:`stage_parameter_names`); the runner uses the modules of its
    own chunks, :attr:`chunks` (wrap them for data or tensor parallelism before the first
    step). ``counter`` records what this rank sends in training steps. ``dtype``: the
    residual stream's dtype (the embedding output's); ``sequence_shards``: the hidden states
    hold ``T / sequence_shards`` positions (tensor parallelism).
    """

    def __init__(self, model: AttnResLM, config: PipelineConfig, group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None, dtype: torch.dtype | None = None, sequence_shards: int = 1) -> None:
        require_attnres_lm(model, "PipelineRunner")
        self.config, self.group = config, group
        world = dist.get_world_size(group)
        if world != config.n_ranks:
            _fail("n_ranks", f"the process group's size {world}", config.n_ranks)
        _refuse_a_send_to_itself(config, group)
        self.rank = dist.get_rank(group)
        self.model_config = cfg = model.config
        self._check_input_ids = model.check_input_ids
        P, C = config.n_ranks, config.n_chunks
        layers = config.chunk_layers(cfg.n_layers)
        self.received, self.running = chunk_histories(cfg, [len(r) for r in layers])
        probe = StageCache(self.received, P, config.cache)
        silent = [c for c in range(1, C) if self.received[c] - probe.held(c) + int(self.running[c]) == 0]
        if silent:
            raise ValueError(f"pipeline edges into chunks {silent} would carry nothing ({cfg.n_layers} transformer blocks "
                             f"in {C} chunks, split {[len(r) for r in layers]}): give every chunk at least one block")
        self.chunks = {c: PipelineChunk(model, c, layers[c], C) for c in range(self.rank, C, P)}
        for chunk in self.chunks.values():
            chunk.sequence_shards = sequence_shards
        self.sequence_shards = sequence_shards
        self.device = device or torch.device("cpu")
        self.dtype = dtype or torch.float32
        for chunk in self.chunks.values():
            chunk.wire_dtype = self.dtype
        self.counter = CommCounter()
        self._n_valid, self._scale = 1, 1.0
        self._schedules: dict[tuple, Any] = {}

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (each once), for its optimizer."""
        return list(self.named_parameters().values())

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters under the full model's names."""
        return {n: p for chunk in self.chunks.values() for n, p in chunk.named_parameters()}

    def _peer(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` (broadcast takes global ranks)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    # -- stages and schedules -----------------------------------------------------------
    def _build(self, micro: int, seq: int, n_microbatches: int):
        """Stages and schedule for micro-batches of ``[micro, seq]``, with static shapes
        (torch skips its shape inference run)."""
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
        )

        cfg, C = self.config, self.config.n_chunks
        cache = StageCache(self.received, cfg.n_ranks, cfg.cache)
        local = seq // self.sequence_shards
        d = self.model_config.d_model

        def entries(c: int) -> tuple[Tensor, ...]:  # what the edge into chunk c carries
            n = self.received[c] - cache.held(c) + int(self.running[c])
            return tuple(torch.empty(micro, local, d, dtype=self.dtype, device="meta", requires_grad=True) for _ in range(n))

        stages = []
        for c, chunk in self.chunks.items():
            ins = (torch.empty(micro, seq, dtype=torch.long, device="meta"),) if c == 0 else entries(c)
            outs = (torch.empty(micro, seq, self.model_config.vocab_size, dtype=self.dtype, device="meta",
                                requires_grad=True),) if c == C - 1 else entries(c + 1)
            stages.append(CachedStage(chunk, c, C, self.device, input_args=ins, output_args=outs, group=self.group,
                                    cache=cache, counter=self.counter))
        kw = dict(n_microbatches=n_microbatches, loss_fn=self._loss, scale_grads=False)
        if cfg.schedule == "interleaved_1f1b":
            schedule = ScheduleInterleaved1F1B(stages, **kw)
        elif cfg.schedule == "1f1b":
            schedule = Schedule1F1B(stages[0], **kw)
        elif cfg.virtual_stages == 1:
            schedule = ScheduleGPipe(stages[0], **kw)
        else:
            schedule = ScheduleLoopedBFS(stages, **kw)
        return schedule, cache

    def _loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """This micro-batch's share of the batch mean (times ``scale``): the summed
        cross-entropy over the batch's number of predicted tokens, so that the micro-batch
        losses add up to it."""
        return next_token_loss(logits, labels, reduction="sum") * (self._scale / self._n_valid)

    def _check(self, input_ids: Tensor, labels: Tensor, n_microbatches: int) -> tuple[Tensor, Tensor]:
        if input_ids.dim() != 2 or labels.shape != input_ids.shape:
            raise ValueError(f"input_ids and labels must be [batch, seq] of one shape, got {tuple(input_ids.shape)} and "
                             f"{tuple(labels.shape)}")
        self._check_input_ids(input_ids)
        if input_ids.shape[0] % n_microbatches:
            raise ValueError(f"batch size {input_ids.shape[0]} is not divisible by PipelineConfig.n_microbatches="
                             f"{n_microbatches} (TrainConfig.parallel.pp_microbatches)")
        if input_ids.shape[1] % self.sequence_shards:
            raise ValueError(f"sequence length {input_ids.shape[1]} is not divisible by the tensor-parallel degree "
                             f"{self.sequence_shards}")
        self._n_valid = max(int((labels[:, 1:] != IGNORE_INDEX).sum()), 1)
        return input_ids.to(self.device), labels.to(self.device)

    def forward_backward(self, input_ids: Tensor, labels: Tensor, scale: float = 1.0) -> Tensor:
        M = self.config.n_microbatches
        input_ids, labels = self._check(input_ids, labels, M)
        self._scale = scale
        key = (input_ids.shape[0] // M, input_ids.shape[1])
        if key not in self._schedules:  # static shapes: a new batch shape gets its own stages
            self._schedules[key] = self._build(*key, M)
        schedule, cache = self._schedules[key]
        for chunk in self.chunks.values():
            chunk.cache = cache
        has_first, has_last = 0 in self.chunks, self.config.n_chunks - 1 in self.chunks
        losses: list[Tensor] = []
        args = (input_ids,) if has_first else ()
        kwargs = dict(target=labels, losses=losses) if has_last else {}
        try:
            schedule.step(*args, **kwargs)
        finally:
            cache.clear()
        loss = torch.stack(losses).sum().detach().float() / scale if has_last else torch.zeros((), device=self.device)
        loss = loss.reshape(()).to(self.device)
        dist.broadcast(loss, self._peer((self.config.n_chunks - 1) % self.config.n_ranks), group=self.group)
        return loss

    @torch.no_grad()
    def loss(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        """The batch's mean next-token loss, without gradients, on every rank: the whole batch
        goes through the chunks in order, one forward each (no schedule: nothing overlaps in a
        forward-only pass), each edge one stacked tensor over point-to-point messages."""
        input_ids, labels = self._check(input_ids, labels, 1)
        cfg, P, C = self.config, self.config.n_ranks, self.config.n_chunks
        cache = StageCache(self.received, P, cfg.cache)
        b, t = input_ids.shape
        out: Any = None
        for c in range(C):
            src, dst = (c - 1) % P, c % P
            if c > 0 and src != dst:
                if self.rank == src:
                    dist.send(torch.stack(out).contiguous(), self._peer(dst), group=self.group)
                elif self.rank == dst:
                    n = self.received[c] - cache.held(c) + int(self.running[c])
                    buf = torch.empty(n, b, t // self.sequence_shards, self.model_config.d_model, dtype=self.dtype,
                                      device=self.device)
                    dist.recv(buf, self._peer(src), group=self.group)
                    out = tuple(buf.unbind(0))
            if self.rank == dst:
                chunk = self.chunks[c]
                chunk.cache = cache
                out = chunk(input_ids) if c == 0 else chunk(*out)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if C - 1 in self.chunks:
            loss = next_token_loss(out, labels).detach().float().reshape(())
        dist.broadcast(loss, self._peer((C - 1) % P), group=self.group)
        return loss
