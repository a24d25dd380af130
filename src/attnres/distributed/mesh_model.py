"""This rank's part of a model laid out over a ``(pp, dp, tp)`` :class:`~attnres.distributed.ParallelLayout`
- every training run's, one process included (the mesh of size 1, where every degree is 1
and each step below is a no-op).

:func:`build_parallel_model` builds it, composing PyTorch's own pieces the way torchtitan
does, innermost first:

1. **pipeline** (``pp > 1``): the model is built on the ``meta`` device and only this stage's
   parameters are materialised, with the values a full build from the same seed gives them
   (:mod:`attnres.distributed.materialize`); the stage's chunks run under torch's pipeline
   schedules (:class:`~attnres.distributed.PipelineRunner`, with the cross-stage cache when
   ``pp_cache``). ``pp = 1``: the whole model (any ``ModelConfig``'s, through
   :func:`attnres.models.build_model`) is this rank's one module, and a caller may load
   whole weights into it before it is split (``prepare``);
2. **tensor parallel** (``tp > 1``): the projections are split column/row-wise over the
   ``tp`` mesh dimension, norms and the residual on the sequence shard
   (:mod:`attnres.distributed.tensor_parallel`);
3. **compile**: the whole model when nothing is split (one process), else each block's
   attention and MLP (regional, so the hooks of FSDP2 and tp stay eager around them);
4. **data parallel** (``dp > 1``): FSDP2 ``fully_shard`` over the ``dp`` mesh dimension, per
   sublayer (``attn``, ``mlp``) and per module (embedding, LM head, norms, depth queries),
   so the embedding and LM head are sharded too.

:class:`ParallelModel` then offers what a trainer needs, the same calls at every layout: a
step's forward and backward over this data-parallel rank's rows (:meth:`forward_backward`),
the evaluation loss (:meth:`loss`), gradients finished across tensor-parallel ranks
(:meth:`finish_grads`), the global gradient norm and clipping (:meth:`clip_grads`), and this
rank's parameters under the full model's names (:meth:`named_parameters`: the keys of the
sharded checkpoint, so a checkpoint does not depend on the layout).
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..models import AttnResLM, ModelConfig, build_model
from ..models.trunk import checkpoint_options, sublayer_caller
from .data_parallel import apply_fsdp, full_tensor, reshard
from .dtensor import is_dtensor
from .grads import clip_grads_, global_grad_norm
from .materialize import build_on_meta
from .parallel import ParallelConfig, ParallelLayout
from .tensor_parallel import apply_tensor_parallel, check_tp_shapes, reduce_grads, reduce_replicated_grads

if TYPE_CHECKING:
    from .pipeline import PipelineRunner

__all__ = ["ParallelModel", "build_parallel_model", "check_parallel_config", "compile_blocks"]


def check_parallel_config(model: ModelConfig, parallel: ParallelConfig, seq_len: int, batch_size: int,
                          dp: int, activation_checkpoint: str = "none", resuming: bool = False) -> None:
    """``ValueError`` naming the field for a combination the layout cannot run. ``resuming``:
    ``batch_size`` and the model are the checkpoint's, which a resume keeps, so the way out is
    the layout."""
    if model.hf_architecture is not None:
        if not parallel.is_default:
            raise ValueError("TrainConfig.parallel.tp/pp split the native AttnResLM; model.hf_architecture="
                             f"{model.hf_architecture!r} trains with data parallelism only (parallel.tp=1, parallel.pp=1)")
    if parallel.tp > 1:
        check_tp_shapes(model, parallel.tp)
        if seq_len % parallel.tp:
            raise ValueError(f"TrainConfig.seq_len={seq_len} must be divisible by parallel.tp={parallel.tp} (the "
                             "norms and the residual run on the sequence shard)")
    if parallel.pp > 1:
        if model.tie_embeddings:
            way = (": this resume keeps the checkpoint's tied model, so continue it with parallel.pp=1 (data or tensor "
                   "parallel)" if resuming else "")
            raise ValueError("model.tie_embeddings must be false with parallel.pp > 1 (the embedding and the LM head "
                             f"live on different stages){way}")
        try:  # a residual that cannot be cut into stages says so (a variant of one's own too)
            with torch.device("meta"):
                model.build_residual().history_layout(0)
        except ValueError as e:
            raise ValueError(f"model.residual.kind={model.residual.kind!r} cannot run with parallel.pp={parallel.pp}: "
                             f"{e}") from None
        chunks = parallel.pp * parallel.pp_virtual
        if model.n_layers < chunks:
            raise ValueError(f"model.n_layers={model.n_layers} must be >= parallel.pp * parallel.pp_virtual = {chunks} "
                             "(every chunk holds at least one transformer block)")
        rows = batch_size // dp
        if rows % parallel.microbatches:
            step = dp * parallel.microbatches
            way = (f"set batch_size={-(-batch_size // step) * step} (or another multiple of dp x pp_microbatches = "
                   f"{step}), or parallel.pp_microbatches" if not resuming else "set parallel.pp_microbatches")
            raise ValueError(f"each data-parallel rank's batch (batch_size / dp = {batch_size} / {dp} = {rows}) must be "
                             f"divisible by parallel.pp_microbatches={parallel.microbatches}: {way} to a divisor of "
                             f"{rows} that the schedule takes{_KEPT * resuming}")
    if batch_size % dp:
        up = -(-batch_size // dp) * dp
        bigger = f"set batch_size={up} (or another multiple of {dp}), or " if not resuming else ""
        *some, last = [str(d) for d in _divisors(batch_size)]
        degrees = f"{', '.join(some)} or {last}" if some else last
        raise ValueError(f"TrainConfig.batch_size={batch_size} (the global batch) must be divisible by parallel.dp={dp} "
                         f"(each data-parallel rank trains on batch_size / dp rows): {bigger}launch a number of "
                         f"data-parallel ranks that divides {batch_size} (parallel.dp = {degrees}){_KEPT * resuming}")


#: Why a resume's error does not offer another batch_size.
_KEPT = " (batch_size is the checkpoint's: a resume keeps it)"


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (pairs up to its square root: a batch_size may be large)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The native transformer blocks ``module`` holds (a model's ``layers`` list, a pipeline
    chunk's ``layers`` mapping); none for a ``transformers`` family's model."""
    layers = getattr(module, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    return list(layers) if isinstance(layers, nn.ModuleList) else []


class ParallelModel:
    """This rank's modules of the model and how to train them (see the module docstring).

    ``model``: the full model object (on ``meta`` outside this stage when ``pp > 1``), for
    its config, names and the diagnostics; ``chunks``: this rank's modules, wrapped for tp
    and dp (``[model]`` when ``pp = 1``); ``runner``: the
    :class:`~attnres.distributed.PipelineRunner` (``pp > 1``) or ``None``; ``forward``: what a
    training step calls when ``pp = 1`` (``model``, or its compiled version).
    """

    def __init__(self, model: nn.Module, layout: ParallelLayout, chunks: list[nn.Module],
                 runner: PipelineRunner | None, device: torch.device, forward: Callable | None = None,
                 replicated: list[str] | None = None, dp_manual: list[str] | None = None) -> None:
        self.model, self.layout, self.chunks, self.runner = model, layout, chunks, runner
        self.device = device
        self.forward = forward if forward is not None else chunks[0]
        self._replicated = replicated or []  # names of the parameters tp left replicated
        self._dp_manual = dp_manual or []  # names of the parameters FSDP2 leaves alone under dp x tp
        # What a training / validation forward passes besides the labels: a family model builds
        # no KV cache, and a mixture-of-experts family asks for its router logits in training,
        # so that its causal LM adds the load-balancing loss.
        self._training_kwargs = getattr(model, "training_forward_kwargs", dict)()
        self._evaluation_kwargs = getattr(model, "evaluation_forward_kwargs", dict)()

    @property
    def holds_whole_model(self) -> bool:
        """Whether one module runs the whole model here: no pipeline stages, no
        tensor-parallel shards (FSDP2 gathers what it shards). The per-block diagnostics
        need it."""
        return self.runner is None and self.layout.tp == 1

    # -- parameters ---------------------------------------------------------------------
    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters (DTensors where sharded) under the full model's names: the
        sharded ones FSDP2 registers between steps (the objects the optimiser holds). Tied
        parameters appear once."""
        reshard(self.chunks)
        return {n: p for chunk in self.chunks for n, p in chunk.named_parameters()}

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

    def sync_gradients(self, sync: bool) -> None:
        """Before a micro-batch: with ``sync=False`` FSDP2 only accumulates the gradients
        locally; the last micro-batch of a step syncs, reducing the accumulated sum once.
        (The pipeline schedules handle their own micro-batches.)"""
        if self.runner is None and self.layout.dp > 1:
            self.chunks[0].set_requires_gradient_sync(sync)

    def forward_backward(self, ids: Tensor, grad_accum: int,
                         autocast=contextlib.nullcontext) -> tuple[float, float | None]:
        """Forward and backward of the mean next-token loss over ``ids`` (this dp rank's
        rows), gradients divided by ``grad_accum`` (the step's micro-batches). Returns the
        language-modelling loss (the same on every pp/tp rank of this dp rank) and the
        auxiliary loss, or ``None``: a mixture-of-experts family that trains with its
        router's load-balancing loss (``training_forward_kwargs``) adds
        ``router_aux_loss_coef`` times it to the objective, as the family does; it is
        reported apart, not in the first value."""
        ids = ids.to(self.device)
        if self.runner is not None:
            with autocast():
                return self.runner.forward_backward(ids, ids, scale=1.0 / grad_accum).item(), None
        with autocast():
            out = self.forward(ids, labels=ids, **self._training_kwargs)
        (out.loss / grad_accum).backward()
        aux = getattr(out, "aux_loss", None)
        if aux is None:
            return out.loss.item(), None
        aux = aux.item()
        return out.loss.item() - self.model.config.router_aux_loss_coef * aux, aux

    @torch.no_grad()
    def loss(self, ids: Tensor, autocast=contextlib.nullcontext) -> float:
        """The mean next-token loss over ``ids``, without gradients (eager: the model, not
        its whole-model compiled version), on every rank."""
        self.train(False)
        try:
            ids = ids.to(self.device)
            with autocast():
                if self.runner is not None:
                    return self.runner.loss(ids, ids).item()
                return self.model(ids, labels=ids, **self._evaluation_kwargs).loss.item()
        finally:
            reshard(self.chunks)
            self.train(True)

    def finish_grads(self) -> None:
        """Sum, over the tp group, the gradients of the parameters that tensor parallelism
        keeps whole on every rank while each rank sees its sequence shard only: the depth
        queries and key norms (plain tensors) and the sequence-parallel norms' gains (DTensor
        gradients left ``Partial``, redistributed to their parameters' ``Replicate``)."""
        if self.layout.tp == 1:
            return
        from torch.distributed.tensor import DTensor, Partial, Replicate

        params = self.named_parameters()
        reduce_replicated_grads([params[n] for n in self._replicated if n in params], self.layout.group("tp"))
        for p in params.values():
            g = p.grad
            if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
                p.grad = g.redistribute(placements=[Replicate() if isinstance(pl, Partial) else pl
                                                    for pl in g.placements])
        grads = [params[n].grad for n in self._dp_manual if n in params and params[n].grad is not None]
        reduce_grads(grads, self.layout.group("dp"), divisor=self.layout.dp)  # outside FSDP2: the mean over dp by hand

    def clip_grads(self, max_norm: float) -> float:
        """The global gradient norm (all stages, all shards), before clipping to ``max_norm``
        (``inf``: no clipping). Where one module holds every parameter (no pipeline, no tensor
        shards), torch's ``clip_grad_norm_`` computes it (DTensor-aware under FSDP2; bit for
        bit torch's in one process); otherwise :mod:`attnres.distributed.grads`."""
        params = self.parameters()
        if self.holds_whole_model:
            return full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm)).item()
        norm = global_grad_norm(params, self.layout.dp * self.layout.tp)
        if math.isfinite(max_norm):
            clip_grads_(params, max_norm, norm)
        return norm.item()


def compile_blocks(chunks: list[nn.Module]) -> None:
    """Regional compilation: ``torch.compile`` each transformer block's ``attn`` and ``mlp``
    ``forward``, in place. Only the forward is compiled, not the module call: the hooks
    FSDP2 (the all-gather before, the reshard after) and tensor parallelism register on these
    modules stay eager around the compiled region. The residual between the sublayers, the
    embedding and the head stay eager. All blocks share one compiled code (the parameters
    are graph inputs), recompiled at most for a new shape."""
    for chunk in chunks:
        for layer in _blocks(chunk):
            for module in (layer.attn, layer.mlp):
                module.forward = torch.compile(module.forward)


def _pipeline_chunks(config: ModelConfig, parallel: ParallelConfig, layout: ParallelLayout,
                     device: torch.device) -> tuple[AttnResLM, PipelineRunner]:
    """The model on ``meta`` with this stage's parameters materialised, and its runner."""
    # (torch.distributed.pipelining, and TorchDynamo with it, most of a second to import: a
    # run without pipeline stages does not)
    from .pipeline import PipelineConfig, PipelineRunner, stage_parameter_names

    build = build_on_meta(lambda: AttnResLM(config))
    model = build.module
    pcfg = PipelineConfig(n_ranks=layout.pp, virtual_stages=parallel.pp_virtual, schedule=parallel.pp_schedule,
                          n_microbatches=parallel.microbatches, cache=parallel.pp_cache)
    names = stage_parameter_names(model, pcfg, layout.pp_rank)
    # The other stages' depth queries stay zeros: the residual stacks every query, and this
    # stage only uses its own.
    build.materialize(names, device, placeholder=lambda n: n.startswith("residual."))
    rope = model.rope
    rope.cos, rope.sin = rope._tables(device=device)
    return model, PipelineRunner(model, pcfg, group=layout.group("pp"), device=device, sequence_shards=layout.tp)


def _shard(chunks: list[nn.Module], layout: ParallelLayout, param_dtype: torch.dtype | None,
           compile: bool, pipelined: bool) -> tuple[list[str], list[str]]:
    """Tensor parallelism, regional compilation and FSDP2 on ``chunks``, in that order.
    Returns the names of the parameters tp left replicated and of those FSDP2 leaves alone."""
    replicated: list[str] = []
    if layout.tp > 1:
        for chunk in chunks:
            apply_tensor_parallel(chunk, layout.submesh("tp"), _blocks(chunk))
        replicated = [n for chunk in chunks for n, p in chunk.named_parameters() if not is_dtensor(p)]
    if compile:
        compile_blocks(chunks)
    # The sequence-parallel norms' gains (tp-Replicate DTensors) stay out of FSDP2 under
    # dp x tp: their gradients come out tp-Partial, which FSDP2's reduce-scatter loses (they
    # came out zero). They are small (d per norm); finish_grads sums them over tp and
    # averages them over dp.
    dp_manual = [n for chunk in chunks for n, p in chunk.named_parameters()
                 if layout.dp > 1 and layout.tp > 1 and is_dtensor(p) and all(pl.is_replicate() for pl in p.placements)]
    if layout.dp > 1:
        # With tp, the parameters are already DTensors on the tp dimension: FSDP2 shards them
        # further over dp (2-D, as torchtitan composes FSDP x TP).
        if layout.tp > 1:
            _silence_fsdp_view_warning(chunks)
        for chunk in chunks:
            params = dict(chunk.named_parameters())
            apply_fsdp(chunk, _blocks(chunk), layout.submesh("dp"), param_dtype, reshard_after_forward=not pipelined,
                       ignored={params[n] for n in dp_manual if n in params})
    return replicated, dp_manual


def _silence_fsdp_view_warning(chunks: list[nn.Module]) -> None:
    """Under tp our sublayers and chunks return ``DTensor.to_local()`` views, and FSDP2 (torch
    2.13; 2.11 does not) warns at every forward of each that an in-place op on a view output would
    skip its pre-backward hook. Nothing modifies them in place - dp x tp gradients equal one
    process's (``tests/test_parallel_train.py``) - so the warning, which told users their
    gradients may be wrong, is silenced for these modules' classes only."""
    names = sorted({type(m).__name__ for chunk in chunks for m in (chunk, *(b.attn for b in _blocks(chunk)),
                                                                   *(b.mlp for b in _blocks(chunk)))})
    pattern = "|".join(re.escape(f"FSDP{n}") for n in names)
    warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \(({pattern})\) returned a view tensor",
                            category=UserWarning)


def checkpoint_family_model(model: nn.Module, mode: str) -> None:
    """``activation_checkpoint=mode`` for a transformers family's model: its own activation
    checkpointing, per sublayer as the native model's (the residual between them is never
    recomputed: attnres.hf.families.modeling), with the native model's checkpoint options."""
    options = checkpoint_options(mode)
    if hasattr(model, "activation_checkpointing_enable"):  # (the newer name; transformers 5.20 has only the one below)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def build_parallel_model(config: ModelConfig, parallel: ParallelConfig, layout: ParallelLayout, device: torch.device,
                         seed: int, activation_checkpoint: str = "none", param_dtype: torch.dtype | None = None,
                         compile: bool = False, prepare: Callable[[nn.Module], None] | None = None) -> ParallelModel:
    """The model of ``config``, initialised from ``seed`` exactly as a single process
    initialises it, laid out over ``layout`` (see the module docstring).

    ``param_dtype``: where ``dp > 1``, FSDP2's ``MixedPrecisionPolicy`` - the gathered
    parameters the forward and backward use, and so the gradients, in that dtype; the
    gradients are reduce-scattered in float32 and the sharded parameters the optimiser
    updates (the master weights) stay float32. Without dp nothing is cast here (the caller's
    autocast does it).

    ``compile``: ``torch.compile`` of the whole model in one process, else of each
    transformer block's attention and MLP (:func:`compile_blocks`), after tensor parallelism
    and before FSDP2, as torchtitan orders them. ``prepare(model)`` (``pp = 1`` only) runs on
    the whole model before anything splits it (loading a consolidated checkpoint)."""
    torch.manual_seed(seed)
    runner = None
    if layout.pp > 1:
        if prepare is not None:
            raise ValueError("a whole-model initialisation (prepare) needs parallel.pp = 1")
        model, runner = _pipeline_chunks(config, parallel, layout, device)
        chunks = list(runner.chunks.values())
    else:
        model = build_model(config).to(device)
        if prepare is not None:
            prepare(model)
        chunks = [model]
    if activation_checkpoint != "none" and config.hf_architecture is not None:
        checkpoint_family_model(model, activation_checkpoint)
    elif activation_checkpoint != "none":
        call = sublayer_caller(activation_checkpoint)
        for chunk in chunks:
            chunk.sublayer_call = call
    # Regional compilation wherever something is split (a transformers family's model has
    # no native blocks: it compiles whole, as in one process).
    regional = compile and layout.dp * layout.tp * layout.pp > 1 and bool(_blocks(chunks[0]))
    replicated, dp_manual = _shard(chunks, layout, param_dtype, regional, runner is not None)
    forward = torch.compile(model) if compile and not regional else None
    return ParallelModel(model, layout, chunks, runner, device, forward, replicated, dp_manual)
