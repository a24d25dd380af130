"""The training loop: :func:`train` runs a :class:`TrainConfig` end to end.

One optimiser step: set the learning rate from the schedule, accumulate gradients over
``grad_accum`` micro-batches (optionally under bfloat16 autocast), stop on a non-finite loss
or gradient, clip, step. Every ``log_every`` steps a metrics record (loss, lr, gradient
norm, tokens/s) goes to ``<out_dir>/metrics.jsonl`` (and TensorBoard when installed); every
``eval_every`` steps the validation loss; every ``diagnostics_every`` steps the Fig. 5/8
diagnostics; every ``checkpoint_every`` steps, at the end, and on SIGINT/SIGTERM a checkpoint.

Resuming (``resume=True``) restores weights, optimiser, data position and RNG states from the
newest checkpoint in ``out_dir`` that verifies (``resume_from``: a given one), so that N steps
plus N resumed steps give bit-for-bit the parameters of 2N uninterrupted steps; ``init_from``
starts a new run from a checkpoint's weights (see :mod:`attnres.train.resume`). Every
checkpoint stores the tokenizer and the data's fingerprint; a run holds an exclusive lock on
its ``out_dir`` (:mod:`attnres.train.lock`) and prints its resolved set-up at start-up.

Under ``torchrun`` (``TrainConfig.distributed``, docs/distributed.md) every rank runs this loop
on its slice of each global batch, with FSDP2 or DDP averaging the gradients; rank 0 logs.
FSDP2 runs write sharded DCP checkpoints (:mod:`attnres.train.sharded_checkpoint`: every rank
its shards, nothing gathered), DDP runs consolidated ones (the single-process layout); either
resumes on any number of ranks, and an FSDP2 run resumes consolidated checkpoints too.
With ``TrainConfig.parallel`` (tensor or pipeline parallelism, or an explicit ``parallel.dp``)
the ranks form one ``(pp, dp, tp)`` device mesh (:mod:`attnres.distributed.mesh_model`),
whose sharded checkpoints resume at any layout, one process included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..analysis.diagnostics import block_grad_norms, forward_diagnostics
from ..data import BatchSampler, load_corpus, prepare_data, validation_batches
from ..models import AttnResLM
from ..distributed.data_parallel import (
    any_rank,
    full_model_state,
    full_optimizer_state,
    full_tensor,
    gradient_sync,
    local_rows,
    mean_over_ranks,
    shard_optimizer_state,
    sharded_parameters,
    wrap_model,
)
from ..distributed.launch import DistContext, collective_errors, init_distributed, resolve_mode
from ..distributed.parallel import build_layout
from ..data.tokenizer import Tokenizer, tokenizer_from_state, tokenizer_state
from .checkpoint import (
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    read_optimizer_state,
    remove_partial_checkpoints,
    save_checkpoint,
    write_checkpoint,
)
from .config import TrainConfig, flatten
from .cpu_memory import set_cpu_allocator
from .hf_source import hf_source, is_hf_directory, load_hf_weights
from .lock import RunLock
from .metrics import MetricsLogger
from .optim import build_optimizer
from .resume import Source, check_data, check_resumable, find_valid_checkpoint, set_aside_newer
from .schedule import lr_factor
from .sharded_checkpoint import is_sharded, load_sharded, save_sharded
from .signals import StopSignals
from .summary import RunFacts, startup_summary


class _Named:
    """Parameters by name, for :func:`build_optimizer` (which groups them by name)."""

    def __init__(self, params: dict) -> None:
        self._params = params

    def named_parameters(self):
        return iter(self._params.items())


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; nothing was saved for that step."""


@dataclass
class TrainResult:
    """What :func:`train` returns. ``interrupted`` names the signal that stopped the run
    (``"SIGINT"``/``"SIGTERM"``), else ``None``."""

    step: int
    train_loss: float | None
    val_loss: float | None
    checkpoint: Path | None
    out_dir: Path
    interrupted: str | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("TrainConfig.device='cuda' but no CUDA device is available")
    return torch.device(name)


@torch.no_grad()
def evaluate(model: AttnResLM, batches: list[torch.Tensor], device: torch.device, autocast) -> float:
    """Mean validation loss over ``batches`` (token-weighted by batch size)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        ids = batch.to(device)
        with autocast():
            total += model(ids, labels=ids).loss.item() * ids.shape[0]
        count += ids.shape[0]
    model.train(was_training)
    return total / count


def train(config: TrainConfig) -> TrainResult:
    """Run (or resume) the training run described by ``config``; see the module docstring.

    Under ``torchrun`` (``config.distributed``) every rank calls this; the process group is
    created on first use (unless one exists) and kept until the process exits.

    Raises ``ValueError`` for bad data, configs or checkpoints, :class:`TrainingDiverged`
    on a non-finite loss (the last good checkpoint is left untouched) and
    :class:`~attnres.distributed.DistributedError` when another rank died or stalled.
    """
    config.validate()
    mode = resolve_mode(config.distributed)
    if mode == "none":
        return Trainer(config, None, "none").run()
    ctx = init_distributed(config.device, config.dist_timeout_s)
    with collective_errors(ctx):
        return Trainer(config, ctx, mode).run()


class Trainer:
    """One process's part of a training run; :func:`train` is the public entry point.

    :meth:`run` holds the run directory's lock (:meth:`locked`) and calls, in order,
    :meth:`locate` (the checkpoint to resume or initialise from), :meth:`setup_data`,
    :meth:`build_model`, :meth:`restore`, :meth:`build_optimizer`, :meth:`open_outputs` and
    :meth:`announce`, then :meth:`step` until the run ends, with :meth:`log_step`,
    :meth:`evaluate`, :meth:`diagnostics` and :meth:`checkpoint` at their cadences. ``ctx``
    is this process's place in the process group (``None`` alone).
    """

    def __init__(self, config: TrainConfig, ctx: DistContext | None, mode: str) -> None:
        self.config, self.ctx, self.mode = config, ctx, mode
        self.main = ctx is None or ctx.is_main
        self.device = resolve_device(config.device) if ctx is None else ctx.device
        # Freed activations stay in the process for the next step (attnres.train.cpu_memory).
        self.retains_memory = self.device.type == "cpu" and set_cpu_allocator(config.cpu_allocator)
        self.out_dir = Path(config.out_dir)
        self.step_count, self.tokens_seen = 0, 0
        self.train_loss: float | None = None
        self.aux_loss: float | None = None  # a mixture of experts' load-balancing loss (its family's)
        self.forward_kwargs: dict[str, Any] = {}  # what a training forward passes besides labels
        self.val_loss: float | None = None
        self.resume_step: int | None = None
        self.last_ckpt: Path | None = None
        self.logger: MetricsLogger | None = None
        self.progress = None
        self.source: Source | None = None  # the checkpoint this run resumes
        self.init_source: Source | None = None  # the checkpoint whose weights start this run (init_from)
        self.origin: dict[str, Any] | None = None  # init_from provenance, carried in every checkpoint
        self.data_changed = False
        # A run over the (pp, dp, tp) mesh: tensor or pipeline parallelism, or dp given.
        self.mesh_mode = not config.parallel.is_default or config.parallel.dp is not None
        self.pm = None  # its ParallelModel

    # -- coordination ---------------------------------------------------------------------
    def _main_first(self, fn):
        """``fn()`` on rank 0 first, then on the others (which may then read what rank 0
        wrote: a token cache, checkpoints set aside). An error on rank 0 stops every rank."""
        if self.ctx is None:
            return fn()
        result, error = None, None
        if self.main:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - re-raised below, after telling the other ranks
                error = e
        if any_rank(error is not None, self.ctx):  # a collective: also the barrier
            raise error or ValueError("rank 0 failed to set up the run (see its error)")
        return result if self.main else fn()

    @contextlib.contextmanager
    def locked(self):
        """Hold the run directory's lock for the whole run. Under torchrun only rank 0 takes
        it (the ranks are one run, and only rank 0 writes); the others learn whether it
        succeeded, so that every rank stops with the error instead of waiting for rank 0."""
        lock = RunLock(self.out_dir) if self.main else None
        self._main_first(lock.acquire if lock is not None else (lambda: None))
        try:
            yield
        finally:
            if lock is not None:
                lock.release()

    # -- set-up ---------------------------------------------------------------------------
    def locate(self) -> None:
        """The checkpoint to start from: with ``resume`` / ``resume_from`` the newest one that
        verifies (corrupted ones in this run's directory are set aside, with a warning); with
        ``init_from`` the weights to start from. A new run refuses an ``out_dir`` that holds
        checkpoints."""
        config, out_dir = self.config, self.out_dir
        if self.main:
            remove_partial_checkpoints(out_dir)
        if config.resuming:
            where = Path(config.resume_from) if config.resume_from is not None else out_dir
            own = where.resolve() in (out_dir.resolve(), (out_dir / "checkpoints").resolve()) or \
                where.resolve().parent == (out_dir / "checkpoints").resolve()
            self.source = self._main_first(lambda: find_valid_checkpoint(where, set_aside=self.main and own))
            if self.source is None and config.resume_from is not None:
                raise ValueError(f"resume_from={config.resume_from!r} is neither a checkpoint nor a run directory with "
                                 "checkpoints")
            if self.source is None:
                raise ValueError(f"resume=true but {str(where / 'checkpoints')!r} holds no checkpoint")
            if config.resume_from is not None and self.main:
                for moved in set_aside_newer(out_dir, self.source.step):
                    print(f"attnres train: {moved.name}: a later checkpoint than the one resumed from, set aside")
            return
        if latest_checkpoint(out_dir) is not None:
            raise ValueError(f"{str(out_dir)!r} already holds checkpoints; set resume=true (--resume) to continue, "
                             "--resume-from DIR to continue a given checkpoint, or pick another out_dir")
        if config.init_from is not None and is_hf_directory(config.init_from):
            if config.model.hf_architecture is None:
                raise ValueError(f"init_from={config.init_from!r} is a transformers directory: its model must be this run's "
                                 f"(model.from_hf={config.init_from})")
            self.init_source = hf_source(config.init_from)
            self.origin = {"transformers_directory": str(self.init_source.path), "step": 0}
            return
        if config.init_from is not None:
            self.init_source = find_valid_checkpoint(config.init_from)
            if self.init_source is None:
                raise ValueError(f"init_from={config.init_from!r} is neither a checkpoint nor a run directory with "
                                 "checkpoints")
            self.origin = {"checkpoint": str(self.init_source.path), "step": self.init_source.step}

    def stored_tokenizer(self, source: Source) -> Tokenizer | None:
        """The tokenizer stored with ``source``; ``None`` (with a warning) for checkpoints of
        earlier versions, which store none: the tokenizer is then made from ``data`` as then."""
        meta = source.state.get("tokenizer")
        if meta is None:
            what = ("holds no tokenizer.json" if source.state.get("hf_directory")
                    else "stores no tokenizer (written by an earlier version)")
            warnings.warn(f"{str(source.path)!r} {what}: making it from the data settings", stacklevel=2)
            return None
        return tokenizer_from_state(meta, source.path)

    def setup_data(self) -> None:
        """Read and tokenise the corpus (rank 0 first under torchrun, the others then read
        its cache), set the model's vocabulary from the tokenizer, build the sampler and the
        validation batches. A run that starts from a checkpoint keeps that checkpoint's
        tokenizer; a resumed one checks that the data is the checkpoint's."""
        config = self.config
        corpus = load_corpus(config.data.paths, config.data.val_fraction)
        start = self.source or self.init_source
        given = self.stored_tokenizer(start) if start is not None else None
        if self.source is not None:
            self.data_changed = check_data(self.source, corpus.digest, config.allow_data_change)
        data = self._main_first(lambda: prepare_data(corpus, config.data.tokenizer, config.data.vocab_size,
                                                     config.data.cache_dir, given=given))
        if config.model.vocab_size != data.vocab_size:  # the tokenizer decides (the caller's config is left alone)
            self.config = config = dataclasses.replace(config, model=config.model.replace(vocab_size=data.vocab_size))
        self.data, self.fingerprint = data, corpus.digest
        self.tokenizer_meta, self.tokenizer_files = tokenizer_state(data.tokenizer)
        self.tokenizer_origin = "stored in the checkpoint" if given is not None else "made from the data"
        self.sampler = BatchSampler(data.train, config.seq_len, config.batch_size, config.seed)
        self.val_batches = validation_batches(data.val, config.seq_len, config.batch_size, config.eval_batches)

    def build_model(self) -> None:
        """The model, initialised from ``seed``; over the mesh, this rank's part of it."""
        config = self.config
        if self.mesh_mode:
            from ..distributed.mesh_model import build_parallel_model, check_parallel_config

            self.layout = build_layout(config.parallel, self.device)
            check_parallel_config(config.model, config.parallel, config.seq_len, config.batch_size, config.grad_accum,
                                  self.layout.dp, self.mode)
            # bf16 over dp: FSDP2's mixed precision (bf16 parameters and gradients, float32
            # reductions and master weights); autocast stays on for what FSDP2 does not cast
            # (buffers such as the RoPE tables, the tp norms' gains kept out of FSDP2).
            param_dtype = torch.bfloat16 if config.dtype == "bfloat16" and self.layout.dp > 1 else None
            self.pm = build_parallel_model(config.model, config.parallel, self.layout, self.device, config.seed,
                                           config.activation_checkpoint, param_dtype, config.compile)
            self.model = self.pm.model
            return
        torch.manual_seed(self.config.seed)
        if self.config.model.hf_architecture is None:
            self.model = AttnResLM(self.config.model).to(self.device)
        else:  # a transformers family's own modules around the residual (attnres.upcycle)
            from ..upcycle.scratch import build_hf_model

            self.model = build_hf_model(self.config.model).to(self.device)
        # A mixture-of-experts family trains with its router's load-balancing loss, as it does.
        self.forward_kwargs = getattr(self.model, "training_forward_kwargs", dict)()
        if config.activation_checkpoint != "none":
            from ..models.trunk import sublayer_caller

            if not isinstance(self.model, AttnResLM):
                raise ValueError(f"TrainConfig.activation_checkpoint={config.activation_checkpoint!r} needs the native "
                                 "AttnResLM (model.hf_architecture unset); use activation_checkpoint=none")
            self.model.sublayer_call = sublayer_caller(config.activation_checkpoint)

    def restore(self) -> None:
        """Resume: weights, RNG states, data position and counters of the checkpoint (the
        optimiser state follows in :meth:`build_optimizer`), after checking that the config
        may continue it. ``init_from``: the weights only."""
        if self.source is not None:
            source = self.source
            check_resumable(source.state["config"], self.config.to_dict(), source)
            if is_sharded(source.state):  # weights, optimiser and RNG once the layout is built
                state = source.state
            elif self.mesh_mode:
                raise CheckpointError(f"{str(source.path)!r} is a consolidated checkpoint; runs with parallel.tp/pp/dp "
                                      "resume sharded (DCP) checkpoints only: resume it with parallel.tp=1, "
                                      "parallel.pp=1 and no parallel.dp")
            else:
                # Weights (and RNG) go into the whole model, before data parallelism shards it.
                state = load_checkpoint(source.path, self.model, verified=source.state)
            if not self.data_changed:
                self.sampler.load_state_dict(state["sampler"])
            self.step_count, self.tokens_seen, self.resume_step = state["step"], state["tokens_seen"], state["step"]
            self.train_loss, self.val_loss = state["train_loss"], state["val_loss"]
            self.origin = state.get("init_from")
            self.last_ckpt = source.path
        elif self.init_source is not None and self.init_source.state.get("hf_directory"):
            load_hf_weights(self.model, self.init_source.path)
        elif self.init_source is not None and is_sharded(self.init_source.state):
            pass  # loaded in build_optimizer, into this layout's shards
        elif self.init_source is not None and self.mesh_mode:
            raise CheckpointError(f"init_from={str(self.init_source.path)!r}: runs with parallel.tp/pp/dp start from "
                                  "sharded (DCP) checkpoints or HF directories only")
        elif self.init_source is not None:
            source = self.init_source
            try:
                load_checkpoint(source.path, self.model, restore_rng=False, verified=source.state)
            except CheckpointError as e:
                saved, ours = flatten(source.state["config"]["model"]), flatten(self.config.model.to_dict())
                differing = sorted(k for k in set(saved) | set(ours) if saved.get(k) != ours.get(k))
                raise CheckpointError(f"init_from: {e}; the checkpoint's model differs from this run's in "
                                      f"{['model.' + k for k in differing]}") from None

    def build_optimizer(self) -> None:
        """Wrap the model for data parallelism, build the optimiser and, on resume, load its
        state."""
        config, ctx = self.config, self.ctx
        if self.mesh_mode:
            if ctx is not None:
                dist.barrier()
            params = self.pm.named_parameters()
            self.optimizer = build_optimizer(_Named(params), config)
            self._load_sharded(params)
            self.forward = None
            self.params = list(params.values())
            return
        if ctx is not None:
            if config.batch_size % ctx.world_size:
                raise ValueError(f"TrainConfig.batch_size={config.batch_size} (the global batch) must be divisible by "
                                 f"the number of ranks {ctx.world_size}")
            dist.barrier()  # every rank has seen the same checkpoints before rank 0 writes anything
        # bf16 under FSDP2: its mixed precision (as over the mesh), autocast around it.
        param_dtype = torch.bfloat16 if config.dtype == "bfloat16" else None
        self.forward = self.model if ctx is None else wrap_model(self.model, self.mode, ctx, param_dtype)
        self.optimizer = build_optimizer(self.model, config)
        if self.source is not None:
            if not is_sharded(self.source.state):
                opt_state = read_optimizer_state(self.source.path, self.source.state)
                self.optimizer.load_state_dict(shard_optimizer_state(self.optimizer, opt_state)
                                               if self.mode == "fsdp" else opt_state)
        self._load_sharded(dict(self.model.named_parameters()))
        if config.compile:
            self.forward = torch.compile(self.forward)
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def _load_sharded(self, params: dict) -> None:
        """Resume (weights, optimiser, RNG) or initialise (weights) from a sharded
        checkpoint, into this rank's ``params`` in this run's layout."""
        if self.source is not None and is_sharded(self.source.state):
            load_sharded(self.source.path, params, self.optimizer)
        elif self.init_source is not None and is_sharded(self.init_source.state):
            load_sharded(self.init_source.path, params, None, restore_rng=False)

    def open_outputs(self) -> None:
        """``config.json``, the metrics log and the progress bar (rank 0)."""
        config = self.config
        if not self.main:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=1))
        self.logger = MetricsLogger(self.out_dir, config.tensorboard, self.resume_step)
        if config.progress:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.progress = tqdm(total=config.steps, initial=self.step_count, unit="step", dynamic_ncols=True)

    def announce(self) -> None:
        """Print the resolved set-up (rank 0): how the run starts, the model, tokens per
        step, data size in tokens, device and dtype."""
        if not self.main:
            return
        if self.source is not None:
            start = f"resuming {str(self.source.path)!r} at step {self.source.step}"
            if self.data_changed:
                start += " on changed data (allow_data_change)"
        elif self.init_source is not None:
            start = (f"new run in {str(self.out_dir)!r} from the weights of {str(self.init_source.path)!r} (init_from; "
                     "fresh optimiser and schedule)")
        else:
            start = f"new run in {str(self.out_dir)!r}"
        tok = self.data.tokenizer
        facts = RunFacts(start=start, first_step=self.step_count, parameters=self.model.num_parameters(),
                         train_tokens=len(self.data.train), val_tokens=len(self.data.val),
                         tokenizer=f"{tok.kind}, {tok.vocab_size} tokens, {self.tokenizer_origin}",
                         fingerprint=self.fingerprint,
                         device=str(self.device) + (" (freed memory retained)" if self.retains_memory else ""),
                         world_size=1 if self.ctx is None else self.ctx.world_size)
        summary = startup_summary(self.config, facts)
        if self.pm is not None:
            p = self.config.parallel
            pipe = (f", {p.pp_schedule} schedule, {p.pp_virtual} virtual stage(s), {p.microbatches} micro-batches"
                    f"{', cross-stage cache' if p.pp_cache else ''}") if self.layout.pp > 1 else ""
            summary += (f"\n  layout  {self.layout.describe()}{pipe}; this rank holds "
                        f"{self.pm.local_parameter_bytes():,} bytes of parameters; sharded (DCP) checkpoints")
        print(summary, flush=True)

    def autocast(self):
        if self.config.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- one step and what follows it -----------------------------------------------------
    def step(self) -> tuple[float, float, list[float] | None]:
        """One optimiser step: learning rate from the schedule, ``grad_accum`` micro-batches,
        the divergence guard, clipping, the update. Returns ``(lr factor, gradient norm,
        per-block gradient norms or None)``; raises :class:`TrainingDiverged`."""
        config, ctx, step = self.config, self.ctx, self.step_count
        factor = lr_factor(step, config.steps, config.schedule, config.warmup_steps, config.min_lr_ratio,
                           config.decay_fraction)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor
        self.optimizer.zero_grad(set_to_none=True)
        if self.pm is not None:
            return self._mesh_step(factor)
        loss_sum, aux_sum = 0.0, None
        for micro in range(config.grad_accum):
            ids = self.sampler.next_batch()  # the global batch; each rank trains on its rows
            ids = (ids if ctx is None else local_rows(ids, ctx)).to(self.device)
            with gradient_sync(self.forward, self.mode, micro == config.grad_accum - 1):
                with self.autocast():
                    out = self.forward(ids, labels=ids, **self.forward_kwargs)
                (out.loss / config.grad_accum).backward()
            loss_sum += out.loss.item()
            if getattr(out, "aux_loss", None) is not None:  # logged apart: loss is the language-modelling loss
                aux = out.aux_loss.item()
                aux_sum = (aux_sum or 0.0) + aux
                loss_sum -= self.model.router_aux_loss_coef * aux
        train_loss = loss_sum / config.grad_accum
        self.aux_loss = None if aux_sum is None else aux_sum / config.grad_accum
        if ctx is not None:  # the global batch's loss, the same on every rank (so is the stop decision)
            train_loss = mean_over_ranks(train_loss, ctx)
            self.aux_loss = None if aux_sum is None else mean_over_ranks(self.aux_loss, ctx)
        self.train_loss = train_loss
        grads = block_grad_norms(self.model) if (step + 1) % config.diagnostics_every == 0 else None  # before clipping
        clip = config.grad_clip if config.grad_clip > 0 else math.inf
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.params, clip)).item()
        self._apply_update(train_loss, grad_norm, step + 1)
        return factor, grad_norm, grads

    def _mesh_step(self, factor: float) -> tuple[float, float, None]:
        """:meth:`step` over the mesh: this data-parallel rank's rows through this rank's part
        of the model (the pipeline schedule under pp), tp's replicated gradients summed, the
        global gradient norm over every stage and shard."""
        config, pm = self.config, self.pm
        loss_sum = 0.0
        sync_dp = pm.runner is None and pm.layout.dp > 1
        for micro in range(config.grad_accum):
            ids = pm.rows(self.sampler.next_batch())
            if sync_dp:
                pm.chunks[0].set_requires_gradient_sync(micro == config.grad_accum - 1)
            loss_sum += pm.forward_backward(ids, 1.0 / config.grad_accum, self.autocast)
        train_loss = loss_sum / config.grad_accum
        if self.ctx is not None:  # tp and pp peers hold the same value: the world's mean is dp's
            train_loss = mean_over_ranks(train_loss, self.ctx)
        self.train_loss = train_loss
        pm.finish_grads()
        grad_norm = pm.clip_grads(config.grad_clip if config.grad_clip > 0 else math.inf)
        self._apply_update(train_loss, grad_norm, self.step_count + 1)
        return factor, grad_norm, None

    def _apply_update(self, train_loss: float, grad_norm: float, step_number: int) -> None:
        """Stop on a non-finite loss or gradient norm (nothing saved), else take the optimiser
        step and count it."""
        if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
            raise TrainingDiverged(
                f"non-finite {'loss' if not math.isfinite(train_loss) else 'gradient norm'} at step {step_number} "
                f"(loss={train_loss}, grad_norm={grad_norm}); stopping without saving: {self._recovery_hint()}"
            )
        self.optimizer.step()
        self.step_count += 1
        self.tokens_seen += self.config.tokens_per_step

    def _recovery_hint(self) -> str:
        if self.last_ckpt is None:
            return "no checkpoint was written yet. Lower lr, raise warmup_steps or set grad_clip."
        return (f"the last good checkpoint is {str(self.last_ckpt)!r}. Lower lr, raise warmup_steps or set grad_clip, "
                f"and start again from its weights with init_from={self.last_ckpt} (a fresh optimiser and schedule) "
                "in a new out_dir")

    def log_step(self, factor: float, grad_norm: float, window: list) -> None:
        """A ``train`` record (rank 0) with the tokens/s of the window since the last one;
        ``window`` is ``[tokens, start time]``, reset here."""
        now = time.perf_counter()
        tok_s = window[0] / max(now - window[1], 1e-9)
        aux = {} if self.aux_loss is None else {"aux_loss": self.aux_loss}
        self.logger.log("train", self.step_count, loss=self.train_loss, **aux, lr=self.config.lr * factor,
                        grad_norm=grad_norm, tokens=self.tokens_seen, tokens_per_s=tok_s)
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{self.train_loss:.4f}", **{k: f"{v:.4f}" for k, v in aux.items()},
                                      tok_s=f"{tok_s:,.0f}")
        window[:] = [0, now]

    def evaluate(self) -> None:
        """The validation loss; every rank evaluates the same batches (FSDP2 forwards are
        collectives), rank 0 logs it."""
        if self.pm is not None:
            total = sum(self.pm.loss(b, self.autocast) * b.shape[0] for b in self.val_batches)
            self.val_loss = total / sum(b.shape[0] for b in self.val_batches)
        else:
            self.val_loss = evaluate(self.model, self.val_batches, self.device, self.autocast)
        if self.main:
            self.logger.log("eval", self.step_count, val_loss=self.val_loss, tokens=self.tokens_seen)

    def diagnostics(self, grads: list[float] | None) -> None:
        """The Fig. 5 / Fig. 8 diagnostics on the first validation batch, with the per-block
        gradient norms ``grads`` of this step."""
        with self.autocast():
            diag = forward_diagnostics(self.model, self.val_batches[0].to(self.device))
        if self.main:
            self.logger.log("diagnostics", self.step_count, block_grad_norm=grads, **diag)

    def checkpoint(self) -> Path:
        """Write the checkpoint of the current step, with the tokenizer and the data's
        fingerprint: sharded (DCP, every rank its shards) over the mesh and under FSDP2,
        consolidated in one process and under DDP (rank 0 writes)."""
        config, step = self.config, self.step_count
        run_state = {"config": config.to_dict(), "sampler": self.sampler.state_dict(), "tokens_seen": self.tokens_seen,
                     "train_loss": self.train_loss, "val_loss": self.val_loss, "tokenizer": self.tokenizer_meta,
                     "data": {"fingerprint": self.fingerprint, "train_tokens": len(self.data.train),
                              "val_tokens": len(self.data.val)},
                     "init_from": self.origin}
        if self.pm is not None:
            path = save_sharded(self.out_dir, step, self.pm.named_parameters(), self.optimizer, run_state,
                                config.keep_checkpoints, self.tokenizer_files, main=self.main)
        elif self.mode == "fsdp":  # each rank writes its own shards; nothing is gathered
            path = save_sharded(self.out_dir, step, sharded_parameters(self.model), self.optimizer, run_state,
                                config.keep_checkpoints, self.tokenizer_files, main=self.main)
        elif self.ctx is None:
            path = save_checkpoint(self.out_dir, step, self.model, self.optimizer, run_state, config.keep_checkpoints,
                                   self.tokenizer_files)
        else:
            model_state, opt_state = full_model_state(self.model), full_optimizer_state(self.optimizer)
            if self.main:
                write_checkpoint(self.out_dir, step, model_state, opt_state, run_state, config.keep_checkpoints,
                                 self.tokenizer_files)
            dist.barrier()
            path = checkpoint_path(self.out_dir, step)
        self.last_ckpt = path
        return path

    def stop_signal(self, signals: StopSignals) -> str | None:
        """The signal that asks this run to stop, agreed by every rank (a launcher signals
        every rank, not necessarily during the same step)."""
        received = signals.received
        if self.ctx is not None and any_rank(received is not None, self.ctx):
            received = received or "SIGTERM"
        return received

    # -- the run --------------------------------------------------------------------------
    def run(self) -> TrainResult:
        with self.locked():
            self.locate()
            self.setup_data()
            self.build_model()
            self.restore()
            self.build_optimizer()
            self.open_outputs()
            self.announce()
            return self.train_loop()

    def train_loop(self) -> TrainResult:
        config = self.config
        end = min(config.steps, config.stop_after or config.steps)
        interrupted = None
        window = [0, time.perf_counter()]
        try:
            with StopSignals() as signals:
                self.model.train()
                if self.pm is not None:
                    self.pm.train()
                while self.step_count < end:
                    factor, grad_norm, grads = self.step()
                    step = self.step_count
                    window[0] += config.tokens_per_step
                    if (step % config.log_every == 0 or step == end) and self.main:
                        self.log_step(factor, grad_norm, window)
                    if step % config.eval_every == 0 or step == config.steps:
                        self.evaluate()
                    if grads is not None:
                        self.diagnostics(grads)
                    if self.progress is not None:
                        self.progress.update(1)
                    interrupted = self.stop_signal(signals)
                    if interrupted is not None:
                        self.checkpoint()
                        break
                    if step % config.checkpoint_every == 0 or step == end:
                        self.checkpoint()
        finally:
            if self.progress is not None:
                self.progress.close()
            if self.logger is not None:
                self.logger.close()
        return TrainResult(step=self.step_count, train_loss=self.train_loss, val_loss=self.val_loss,
                           checkpoint=self.last_ckpt, out_dir=self.out_dir, interrupted=interrupted)
