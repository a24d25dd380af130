"""This rank's part of a model laid out over a ``(pp, dp, tp)`` :class:`~attnres.distributed.ParallelLayout`.

:func:`build_parallel_model` builds it, composing PyTorch's own pieces the way torchtitan
does, innermost first:

1. **pipeline** (``pp > 1``): the model is built on the ``meta`` device and only this stage's
   parameters are materialised, with the values a full build from the same seed gives them
   (:mod:`attnres.distributed.materialize`); the stage's chunks run under torch's pipeline
   schedules (:class:`~attnres.distributed.PipelineRunner`, with the cross-stage cache when
   ``pp_cache``). ``pp = 1``: the whole model is one chunk, first and last.
2. **tensor parallel** (``tp > 1``): each chunk's projections are split column/row-wise over
   the ``tp`` mesh dimension, norms and the residual on the sequence shard
   (:mod:`attnres.distributed.tensor_parallel`);
3. **data parallel** (``dp > 1``): FSDP2 ``fully_shard`` over the ``dp`` mesh dimension, per
   sublayer (``attn``, ``mlp``) and per chunk (embedding, LM head, norms, depth queries), so
   the embedding and LM head are sharded too.

:class:`ParallelModel` then offers what a trainer needs: a step's forward and backward over
this data-parallel rank's rows (:meth:`forward_backward`), the evaluation loss
(:meth:`loss`), gradients finished across tensor-parallel ranks (:meth:`finish_grads`), the
global gradient norm and clipping (:mod:`attnres.distributed.grads`), and this rank's
parameters under the full model's names (:meth:`named_parameters`: the keys of the sharded
checkpoint, so a checkpoint does not depend on the layout).
"""

from __future__ import annotations

import contextlib
import math
import torch
from torch import Tensor, nn

from ..models import AttnResLM, ModelConfig, next_token_loss
from ..models.trunk import sublayer_caller
from .data_parallel import mixed_precision_policy
from .grads import clip_grads_, global_grad_norm
from .materialize import build_on_meta
from .parallel import ParallelConfig, ParallelLayout
from .pipeline import PipelineChunk, PipelineConfig, PipelineRunner, stage_parameter_names
from .tensor_parallel import apply_tensor_parallel, check_tp_shapes, reduce_replicated_grads

__all__ = ["ParallelModel", "build_parallel_model", "check_parallel_config", "compile_blocks"]


def check_parallel_config(model: ModelConfig, parallel: ParallelConfig, seq_len: int, batch_size: int,
                          grad_accum: int, dp: int, mode: str) -> None:
    """``ValueError`` naming the field for a combination the layout cannot run."""
    if model.hf_architecture is not None:
        raise ValueError("TrainConfig.parallel.tp/pp split the native AttnResLM; model.hf_architecture="
                         f"{model.hf_architecture!r} trains with data parallelism only (parallel.tp=1, parallel.pp=1)")
    if mode == "ddp" and dp > 1:
        raise ValueError("TrainConfig.distributed='ddp' cannot be combined with parallel.tp/pp: data parallelism over "
                         "the mesh is FSDP2 (distributed=fsdp or auto)")
    if parallel.tp > 1:
        check_tp_shapes(model, parallel.tp)
        if seq_len % parallel.tp:
            raise ValueError(f"TrainConfig.seq_len={seq_len} must be divisible by parallel.tp={parallel.tp} (the "
                             "norms and the residual run on the sequence shard)")
    if parallel.pp > 1:
        if model.tie_embeddings:
            raise ValueError("model.tie_embeddings must be false with parallel.pp > 1 (the embedding and the LM head "
                             "live on different stages)")
        chunks = parallel.pp * parallel.pp_virtual
        if model.n_layers < chunks:
            raise ValueError(f"model.n_layers={model.n_layers} must be >= parallel.pp * parallel.pp_virtual = {chunks} "
                             "(every chunk holds at least one transformer block)")
        rows = batch_size // dp
        if rows % parallel.microbatches:
            raise ValueError(f"each data-parallel rank's batch (batch_size / dp = {batch_size} / {dp} = {rows}) must be "
                             f"divisible by parallel.pp_microbatches={parallel.microbatches}")
    if batch_size % dp:
        raise ValueError(f"TrainConfig.batch_size={batch_size} (the global batch) must be divisible by parallel.dp={dp}")


class ParallelModel:
    """This rank's chunks of the model and how to train them (see the module docstring).

    ``model``: the full :class:`~attnres.AttnResLM` object (on ``meta`` outside this
    stage when ``pp > 1``), for its config and names; ``chunks``: this rank's
    :class:`~attnres.distributed.PipelineChunk` modules, wrapped for tp and dp;
    ``runner``: the :class:`~attnres.distributed.PipelineRunner` (``pp > 1``) or ``None``.
    """

    def __init__(self, model: AttnResLM, layout: ParallelLayout, chunks: list[PipelineChunk],
                 runner: PipelineRunner | None, replicated: list[str], device: torch.device,
                 dp_manual: list[str] | None = None) -> None:
        self.model, self.layout, self.chunks, self.runner = model, layout, chunks, runner
        self.config = model.config
        self.device = device
        self._replicated = replicated  # names of the parameters tp left replicated
        self._dp_manual = dp_manual or []  # names of the parameters FSDP2 leaves alone under dp x tp

    # -- parameters ---------------------------------------------------------------------
    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters (DTensors where sharded) under the full model's names: the
        sharded ones FSDP2 registers between steps (the objects the optimiser holds)."""
        self.reshard()
        return {n: p for chunk in self.chunks for n, p in chunk.named_parameters()}

    def reshard(self) -> None:
        """Free FSDP2's gathered parameters: under pp the chunks keep them from forward to
        backward (``reshard_after_forward=False``), and a forward-only evaluation leaves
        them gathered; the module then shows its unsharded tensors, not the parameters."""
        from torch.distributed.fsdp import FSDPModule

        for chunk in self.chunks:
            if isinstance(chunk, FSDPModule):
                chunk.reshard()

    def parameters(self) -> list[nn.Parameter]:
        return list(self.named_parameters().values())

    def local_parameter_bytes(self) -> int:
        """Bytes of parameters this rank holds (its shards only)."""
        total = 0
        for p in self.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            total += t.numel() * t.element_size()
        return total

    def train(self, mode: bool = True) -> None:
        for chunk in self.chunks:
            chunk.train(mode)

    # -- a step ---------------------------------------------------------------------------
    def rows(self, batch: Tensor) -> Tensor:
        """This data-parallel rank's rows ``[r B/dp, (r+1) B/dp)`` of the global batch."""
        per = batch.shape[0] // self.layout.dp
        return batch[self.layout.dp_rank * per:(self.layout.dp_rank + 1) * per]

    def forward_backward(self, ids: Tensor, scale: float, autocast=contextlib.nullcontext) -> float:
        """Forward and backward of the mean next-token loss over ``ids`` (this dp rank's
        rows), gradients scaled by ``scale``; returns the loss (the same on every pp/tp rank
        of this dp rank)."""
        ids = ids.to(self.device)
        if self.runner is not None:
            with autocast():
                return self.runner.forward_backward(ids, ids, scale=scale).item()
        with autocast():
            loss = next_token_loss(self.chunks[0](ids), ids)
        (loss * scale).backward()
        return loss.item()

    @torch.no_grad()
    def loss(self, ids: Tensor, autocast=contextlib.nullcontext) -> float:
        """The mean next-token loss over ``ids``, without gradients, on every rank."""
        self.train(False)
        try:
            ids = ids.to(self.device)
            with autocast():
                if self.runner is not None:
                    return self.runner.loss(ids, ids).item()
                return next_token_loss(self.chunks[0](ids), ids).item()
        finally:
            self.reshard()
            self.train(True)

    def finish_grads(self) -> None:
        """Sum, over the tp group, the gradients of the parameters that tensor parallelism
        keeps whole on every rank while each rank sees its sequence shard only: the depth
        queries and key norms (plain tensors) and the sequence-parallel norms' gains (DTensor
        gradients left ``Partial``, redistributed to their parameters' ``Replicate``)."""
        if self.layout.tp > 1:
            from torch.distributed.tensor import DTensor, Partial, Replicate

            params = self.named_parameters()
            reduce_replicated_grads([params[n] for n in self._replicated if n in params], self.layout.group("tp"))
            for p in params.values():
                g = p.grad
                if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
                    p.grad = g.redistribute(placements=[Replicate() if isinstance(pl, Partial) else pl
                                                        for pl in g.placements])
            grads = [params[n].grad for n in self._dp_manual if n in params and params[n].grad is not None]
            if grads:  # outside FSDP2: the mean over dp by hand
                import torch.distributed as dist

                local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
                flat = torch.cat([t.reshape(-1) for t in local])
                dist.all_reduce(flat, group=self.layout.group("dp"))
                flat /= self.layout.dp
                offset = 0
                for t in local:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def clip_grads(self, max_norm: float) -> float:
        """The global gradient norm (all stages, all shards), before clipping to ``max_norm``
        (``inf``: no clipping)."""
        params = self.parameters()
        layout = self.layout
        norm = global_grad_norm(params, layout.dp * layout.tp)
        if math.isfinite(max_norm):
            clip_grads_(params, max_norm, norm)
        return norm.item()


def compile_blocks(chunks: list[PipelineChunk]) -> None:
    """Regional compilation: ``torch.compile`` each transformer block's ``attn`` and ``mlp``
    ``forward``, in place. Only the forward is compiled, not the module call: the hooks
    FSDP2 (the all-gather before, the reshard after) and tensor parallelism register on these
    modules stay eager around the compiled region. The residual between the sublayers, the
    embedding and the head stay eager. All blocks share one compiled code (the parameters
    are graph inputs), recompiled at most for a new shape."""
    for chunk in chunks:
        for layer in chunk.layers.values():
            for module in (layer.attn, layer.mlp):
                module.forward = torch.compile(module.forward)


def build_parallel_model(config: ModelConfig, parallel: ParallelConfig, layout: ParallelLayout, device: torch.device,
                         seed: int, activation_checkpoint: str = "none",
                         param_dtype: torch.dtype | None = None, compile: bool = False) -> ParallelModel:
    """The model of ``config``, initialised from ``seed`` exactly as a single process
    initialises it, laid out over ``layout`` (see the module docstring).

    ``param_dtype`` (``dp > 1``): FSDP2's ``MixedPrecisionPolicy`` - the gathered parameters
    the forward and backward use, and so the gradients, in that dtype; the gradients are
    reduce-scattered in float32 and the sharded parameters the optimiser updates (the
    master weights) stay float32.

    ``compile``: regional ``torch.compile`` of each transformer block's attention and MLP
    (:func:`compile_blocks`), after tensor parallelism and before FSDP2, as torchtitan orders
    them."""
    torch.manual_seed(seed)
    runner = None
    if layout.pp > 1:
        build = build_on_meta(lambda: AttnResLM(config))
        model = build.module
        pcfg = PipelineConfig(n_ranks=layout.pp, virtual_stages=parallel.pp_virtual, schedule=parallel.pp_schedule,
                              n_microbatches=parallel.microbatches, cache=parallel.pp_cache)
        names = stage_parameter_names(model, pcfg, layout.pp_rank)
        # The other stages' depth queries stay zeros: the residual stacks every query, and
        # this stage only uses its own.
        build.materialize(names, device, placeholder=lambda n: n.startswith("residual."))
        rope = model.rope
        rope.cos, rope.sin = rope._tables(device=device)
        runner = PipelineRunner(model, pcfg, group=layout.group("pp"), device=device, sequence_shards=layout.tp)
        chunks = list(runner.chunks.values())
    else:
        model = AttnResLM(config).to(device)
        chunk = PipelineChunk(model, 0, range(config.n_layers), 1)
        chunk.sequence_shards = layout.tp
        chunks = [chunk]
    call = sublayer_caller(activation_checkpoint)
    for chunk in chunks:
        chunk.sublayer_call = call
    replicated: list[str] = []
    if layout.tp > 1:
        tp_mesh = layout.submesh("tp")
        for chunk in chunks:
            apply_tensor_parallel(chunk, tp_mesh, chunk.layers.values())
        from torch.distributed.tensor import DTensor

        replicated = [n for chunk in chunks for n, p in chunk.named_parameters() if not isinstance(p, DTensor)]
    if compile:
        compile_blocks(chunks)
    # The sequence-parallel norms' gains (tp-Replicate DTensors) stay out of FSDP2 under
    # dp x tp: their gradients come out tp-Partial, which FSDP2's reduce-scatter loses (we
    # measured zero gradients). They are small (d per norm); finish_grads sums them over tp
    # and averages them over dp.
    from torch.distributed.tensor import DTensor as _DT

    dp_manual = [n for chunk in chunks for n, p in chunk.named_parameters()
                 if layout.dp > 1 and layout.tp > 1 and isinstance(p, _DT) and all(pl.is_replicate() for pl in p.placements)]
    if layout.dp > 1:
        from torch.distributed.fsdp import fully_shard

        mp = mixed_precision_policy(param_dtype)
        # With tp, the parameters are already DTensors on the tp dimension: FSDP2 shards them
        # further over dp (2-D, as torchtitan composes FSDP x TP).
        for chunk in chunks:
            for layer in chunk.layers.values():
                fully_shard(layer.attn, mesh=layout.submesh("dp"), mp_policy=mp)
                fully_shard(layer.mlp, mesh=layout.submesh("dp"), mp_policy=mp)
            params = dict(chunk.named_parameters())
            fully_shard(chunk, mesh=layout.submesh("dp"), reshard_after_forward=runner is None, mp_policy=mp,
                        ignored_params={params[n] for n in dp_manual if n in params} or None)
    return ParallelModel(model, layout, chunks, runner, replicated, device, dp_manual)
