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

There is one path for every layout. The ranks ``torchrun`` starts form one ``(pp, dp, tp)``
device mesh (``TrainConfig.parallel``; every rank data parallel by default) and one process
is the mesh of size 1: :class:`~attnres.distributed.mesh_model.ParallelModel` is this rank's part of the
model at any layout, and the trainer differs only where a pipeline splits the model into
stages (a consolidated checkpoint then cannot be loaded into the whole model first). A run
on several ranks writes sharded checkpoints (:func:`attnres.checkpoint.save_sharded`: every
rank its shards, resumable at any layout), one process consolidated ones
(:func:`attnres.checkpoint.write_checkpoint`); either resumes in the other.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from ..analysis.diagnostics import block_grad_norms, forward_diagnostics
from ..checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    is_sharded,
    load_checkpoint,
    load_sharded,
    read_optimizer_state,
    refuse_out_dir_not_a_run,
    save_sharded,
    write_checkpoint,
)
from ..checkpoint.locate import train_on_from
from ..checkpoint.manifest import MODEL_FILE, OPTIMIZER_FILE, RNG_FILE
from ..checkpoint.sharded import verify_files_on_every_rank
from ..data.corpus import absolute_paths, data_files
from ..data.tokenizer import TOKENIZER_KINDS, tokenizer_file
from ..distributed.data_parallel import shard_optimizer_state
from ..distributed.launch import (
    DistContext,
    agree,
    any_rank,
    barrier,
    collect_garbage,
    collective_errors,
    main_first,
    mean_over_ranks,
    on_every_rank,
    patient,
    process_context,
    raise_on_every_rank,
    waiting_for_rank_0,
)
from ..distributed.mesh_model import ParallelModel, build_parallel_model, check_parallel_config
from ..distributed.parallel import build_layout, check_one_process, resolve_degrees
from ..nn.residual.block import naming_block_size
from ..ops.depth_attention.library import triton_unavailable
from ..nn.residual.imports import imports_record
from ..output_paths import OutputPathError, check_output_dir, write_text_atomically
from ..progress import StepProgress
from ..shell_words import shell_path
from ..user_warning import warn_user
from ..termination import sigterm_raises
from ..validation import missing_path_hint
from .config import BLOCK_SIZE_FIELD, TrainConfig, flatten
from .cpu_memory import retains_freed_memory
from .hf_source import load_hf_weights
from .lock import RunLock, lock_run_dir
from .metrics import DATA_CHANGE, MetricsLogger
from .optim import build_optimizer
from .out_dir import OutDirError, check_out_dir, os_cause
from .resume import check_resumable, check_resumable_before_data, init_model_changes
from .schedule import lr_factor
from .setup import RunData, Start, locate_start, prepare_run_data, removed_while_set_up
from .signals import StopSignals
from .status import refuse_a_folder_of_runs
from .wandb_log import WANDB_FILE, WandbMirror, require_wandb
from .summary import (RunFacts, oversized_batch, short_validation, startup_summary, unused_pipeline_options,
                      unused_stream_option, warmup_overrun)

T = TypeVar("T")


class _Named:
    """Parameters by name, for :func:`build_optimizer` (which groups them by name)."""

    def __init__(self, params: dict) -> None:
        self._params = params

    def named_parameters(self):
        return iter(self._params.items())


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; nothing was saved for that step."""


class TrainingOutOfMemory(RuntimeError):
    """An allocation failed (the CPU's or a CUDA device's memory): the message names the
    batch, the allocation that failed and what to lower."""


def out_of_memory(error: BaseException, config: TrainConfig, device: torch.device) -> TrainingOutOfMemory | None:
    """:class:`TrainingOutOfMemory` in words when ``error`` is an allocation failure (torch's
    CPU allocator or CUDA's, or Python's ``MemoryError``), else ``None``."""
    text = str(error)
    if not (isinstance(error, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in text
            or "not enough memory" in text):
        return None
    asked = re.search(r"(?:you tried to allocate|Tried to allocate) ([0-9.]+) ?(bytes|[KMGT]iB)", text)
    if asked is None:
        failed = "an allocation failed"
    else:
        size = float(asked.group(1)) * 1024 ** ("bytes KiB MiB GiB TiB".split().index(asked.group(2)))
        failed = f"an allocation of {size / 2**20:,.0f} MiB failed"
    micro = f"batch_size {config.batch_size} x seq_len {config.seq_len}"
    return TrainingOutOfMemory(
        f"out of memory on {device}: one micro-batch of {micro} tokens needs more memory than is available ({failed}); "
        f"lower batch_size, and raise grad_accum to keep the {config.tokens_per_step:,} tokens per step (batch_size "
        "x grad_accum x seq_len)")


@dataclass
class TrainResult:
    """What :func:`train` returns. ``interrupted`` names the signal that stopped the run
    (``"SIGINT"``/``"SIGTERM"``), else ``None``. ``checkpoint`` is the run's last checkpoint:
    ``None`` only where this call trained no step and resumed none (a run ends each call with
    one), so a type checker asks for the check before ``load_run(result.checkpoint)``."""

    step: int
    train_loss: float | None
    val_loss: float | None
    checkpoint: Path | None
    out_dir: Path
    interrupted: str | None = None
    val_step: int | None = None  # the step ``val_loss`` was measured at (None: unknown, or none measured)


@naming_block_size(BLOCK_SIZE_FIELD)  # (a resume's run config, read again, names the field as the user wrote it)
def train(config: TrainConfig, vocab_size_given: bool = False) -> TrainResult:
    """Run (or resume) the training run described by ``config``; see the module docstring.
    Returns a :class:`TrainResult`: the step reached, the last training and validation losses,
    the last checkpoint (``load_run(result.checkpoint)`` loads the model) and ``out_dir``.

    Under ``torchrun`` every rank calls this; the process group is created on first use
    (unless one exists) and kept until the process exits.

    Raises ``ValueError`` for bad data, configs or checkpoints, :class:`TrainingDiverged`
    on a non-finite loss (the last good checkpoint is left untouched),
    :class:`TrainingOutOfMemory` when a step does not fit in memory, and
    :class:`~attnres.distributed.DistributedError` when another rank died or stalled.

    ``vocab_size_given``: the user set ``model.vocab_size`` (in a config file or an override),
    who is warned when the tokenizer's size replaces it.
    """
    config.validate()
    ctx = process_context(config.device, config.dist_timeout_s)
    # One process: a SIGTERM during the set-up (reading, tokenising) releases the lock and removes
    # what it was writing, as Ctrl-C does; the loop's StopSignals take it over for the steps. (A rank
    # of a launch may wait in a collective, where no Python handler runs: there the default ends it.)
    terminating = sigterm_raises() if ctx.world_size == 1 else contextlib.nullcontext()
    with collective_errors(ctx), terminating:
        try:
            result = Trainer(config, ctx, vocab_size_given).run()
            if ctx.world_size > 1:  # (FSDP2's hooks keep a sharded model in reference cycles:
                collect_garbage()   # freed now, its memory with it, not at some later collection)
            return result
        except (RuntimeError, MemoryError) as e:
            oom = out_of_memory(e, config, ctx.device)
            if oom is None:
                raise
        raise oom  # outside the handler: the failed step's tensors are freed with its traceback


class Trainer:
    """One process's part of a training run; :func:`train` is the public entry point.

    Building one sets the whole run up: it takes the run directory's lock, finds the
    checkpoint to resume or initialise from, prepares the data, builds this rank's part of
    the model over the mesh (:class:`~attnres.distributed.mesh_model.ParallelModel`) and the optimiser,
    loads the checkpoint's state and opens the metrics log. :meth:`run` trains to the end
    (or a signal) and releases everything; :meth:`close` releases it without training. It
    leaves the C allocator alone (``cpu_allocator`` is the ``attnres`` command's to apply).
    ``ctx``: this process's place in the process group (world size 1 alone,
    :func:`attnres.distributed.process_context`); ``vocab_size_given``: :func:`train`'s.
    """

    def __init__(self, config: TrainConfig, ctx: DistContext, vocab_size_given: bool = False) -> None:
        config.validate()
        check_backend(config, ctx.device)
        require_wandb(config.wandb_project)
        check_layout(config, ctx)
        self.ctx, self.main, self.device = ctx, ctx.is_main, ctx.device
        self._vocab_size_given = vocab_size_given
        # the waits for rank 0's long local work (tokenising a large corpus, hashing every
        # rank's shards of a checkpoint) are not bounded by dist_timeout_s, meant for the steps
        self.patient = patient(ctx, config.setup_timeout_s)
        self.out_dir = Path(config.out_dir)
        self.lock: RunLock | None = None
        self.logger: MetricsLogger | None = None
        self.wandb: WandbMirror | None = None  # started before the data is read; then the logger's
        self.progress = None
        self._agree(lambda: check_inputs(config, self.main))  # (every rank's alike: printed once per node)
        # Made by this run: removed again (when left empty) if the set-up fails or nothing is trained.
        self.created = self.main and not self.out_dir.exists()
        self.idle = False  # nothing left to train: nothing is written
        check_out_dir(self.out_dir, ctx)  # writable, and the same directory on every rank
        # Under torchrun only rank 0 takes the lock (the ranks are one run, and only rank 0
        # writes); the others check a lock left on their host, and stop with rank 0 on an error.
        self.lock = lock_run_dir(self.out_dir, ctx, self._main_first)
        try:
            # (every rank reads the same out_dir and config, so an error here is every rank's: it
            # goes through one collective, to stop them together and be printed once per node)
            self.start = self._agree(lambda: self._locate_start(config))
            # W&B starts before the data is read: a missing login stops the run at once, not after
            # minutes of reading and tokenising a large corpus (rank 0; its error is every rank's)
            self.wandb = self._main_first(lambda: self._start_wandb(config), what="starting the W&B run")
            self.config, self.data = self._agree(lambda: self._prepare_data(config))
            self.layout = build_layout(self.config.parallel, self.device)
            self.sharded = self.layout.size > 1  # the checkpoint format: every rank its shards, or one file set
            self.pm = self._build_model()
            self.model: nn.Module = self.pm.model
            self.optimizer = build_optimizer(_Named(self.pm.named_parameters()), self.config)
            self._load_states()
            barrier(self.patient)  # every rank has seen the same checkpoints before rank 0 writes anything
            state = self.start.resume.state if self.start.resume is not None else {}
            self.step_count: int = state.get("step", 0)
            self.resume_step: int | None = state.get("step")
            self.tokens_seen: int = state.get("tokens_seen", 0)
            self.train_loss: float | None = state.get("train_loss")
            self.val_loss: float | None = state.get("val_loss")
            self.val_step: int | None = state.get("val_step")  # the step val_loss was measured at
            self.aux_loss: float | None = None  # a mixture of experts' load-balancing loss (its family's)
            self.last_ckpt: Path | None = self.start.resume.path if self.start.resume is not None else None
            # A run with nothing left to train writes nothing: a --resume-from into a new out_dir
            # would otherwise leave it a config.json and a metrics log of no step.
            self.idle = self.step_count >= self.config.end_step
            if not self.idle:
                self._main_first(self._open_outputs)
        except BaseException:
            self.close()
            self._remove_if_made_for_nothing()
            raise

    # -- coordination ---------------------------------------------------------------------
    def _main_first(self, fn, shared: bool = False, what: str = "its part of the set-up"):
        """``fn()`` on rank 0 first, then on the others, or with ``shared`` rank 0's result on
        every rank (:func:`~attnres.distributed.launch.main_first`, on the patient group;
        ``what``: rank 0's work, named by the others while they wait long)."""
        return main_first(fn, self.patient, shared, what)

    def _agree(self, fn):
        """``fn()`` on every rank, stopping every rank on any rank's error
        (:func:`~attnres.distributed.launch.agree`)."""
        return agree(fn, self.patient)

    def _locate_start(self, config: TrainConfig) -> Start:
        """The checkpoint to start from, checked against ``config`` as far as it can be before
        the data is read."""
        start = locate_start(config, self.main, self._main_first)
        if start.resume is not None:  # what differs named before the data is read and checked
            check_resumable_before_data(start.resume.run_config(), config.to_dict(), start.resume)
        return start

    def _start_wandb(self, config: TrainConfig) -> WandbMirror | None:
        """The W&B run (rank 0, with ``wandb_project``), started with the config as given; the
        metrics log sends it the config the data resolves (the model's vocabulary). None for a
        run with nothing left to train, which writes nothing."""
        step = self.start.resume.state.get("step") if self.start.resume is not None else None
        if not self.main or config.wandb_project is None or (step or 0) >= config.end_step:
            return None
        return WandbMirror(config.wandb_project, self.out_dir, step, config.to_dict())

    def _prepare_data(self, config: TrainConfig) -> tuple[TrainConfig, RunData]:
        """The run's data, and ``config`` with the model's vocabulary set from it, checked
        against the checkpoint resumed."""
        start = self.start
        config, data = prepare_run_data(config, start, self._main_first, self._vocab_size_given)
        if start.resume is not None:
            check_resumable(start.resume.run_config(), config.to_dict(), start.resume)
        return config, data

    def close(self) -> None:
        """Close the progress bar and the metrics log and release the lock (idempotent). Each
        is closed even when closing one before it raised: a Ctrl-C while W&B or TensorBoard
        flushed left the lock of this (live) process behind, refusing every later run of
        ``out_dir`` in it - a notebook's kernel had to be restarted."""
        progress, logger, wandb, lock = self.progress, self.logger, self.wandb, self.lock
        self.progress = self.logger = self.wandb = self.lock = None
        with contextlib.ExitStack() as closing:  # (run last to first)
            if lock is not None:
                closing.callback(lock.release)
            if wandb is not None:  # started, but the set-up failed before the log took it
                closing.callback(wandb.close, failed=True)
            if logger is not None:
                closing.callback(logger.close)
            if progress is not None:
                closing.callback(progress.close)

    def _remove_if_made_for_nothing(self, written: bool = False) -> None:
        """Remove ``out_dir`` if this run made it and left it empty (a failed set-up, nothing
        to train); one that is not empty holds something worth keeping. ``written``: also what
        the start wrote before any step was trained (a run stopped before its first step - a
        warning made an error, ``warnings.filterwarnings("error")``, or an interrupt - left its
        config.json and an empty metrics log, in a directory of no run)."""
        if self.created:
            with contextlib.suppress(OSError):
                if written:
                    for name in ("config.json", "metrics.jsonl"):
                        (self.out_dir / name).unlink(missing_ok=True)
                    shutil.rmtree(self.out_dir / "tensorboard", ignore_errors=True)
                # (what W&B left when it started before a set-up that failed: this run's too)
                (self.out_dir / WANDB_FILE).unlink(missing_ok=True)
                shutil.rmtree(self.out_dir / "wandb", ignore_errors=True)
                self.out_dir.rmdir()

    # -- set-up ---------------------------------------------------------------------------
    def _whole_model_weights(self) -> Callable[[nn.Module], None] | None:
        """What loads into the whole model before the layout splits it: a consolidated
        checkpoint's weights (and RNG states, on resume) or a transformers directory's
        weights. Sharded checkpoints load into this rank's shards later (:meth:`_load_states`)."""
        resume, init, config = self.start.resume, self.start.init, self.config
        if resume is not None and not is_sharded(resume.state):
            source = resume
            load = lambda model: _load_resumed(source, config, lambda: load_checkpoint(  # noqa: E731
                source.path, model, verified=source.state))
        elif init is not None and init.state.get("hf_directory"):
            return lambda model: load_hf_weights(model, init.path)
        elif init is not None and not is_sharded(init.state):
            source = init
            # (a residual change was refused, or allowed, when the run was set up: refuse_residual_change)
            load = lambda model: _load_init_weights(source, config, lambda: load_checkpoint(  # noqa: E731
                source.path, model, restore_rng=False, verified=source.state,
                allow_residual_change=config.allow_residual_change))
        else:
            return None
        if config.parallel.pp > 1:  # the config and the checkpoint are the same on every rank: so is the error
            # (each stage builds only its own layers: the whole weights have no model to load into)
            way = ("continue it with parallel.pp=1 first (a run on several ranks then writes sharded checkpoints)"
                   if source is resume else
                   "start this run with parallel.pp=1 and stop_after=1 on the same ranks (its checkpoint is sharded), "
                   "then resume it with --resume and parallel.pp > 1; or give init_from a sharded checkpoint")
            raise on_every_rank(CheckpointError(
                f"{str(source.path)!r} is a consolidated checkpoint; pipeline-parallel runs (parallel.pp > 1) start "
                f"from sharded (DCP) checkpoints only: {way}"))
        # (verified when it was found, on rank 0; each other rank reads the files from its own out_dir: the
        # weights, and resuming the optimiser's and generators' states, :meth:`_load_states`)
        reads = (MODEL_FILE, OPTIMIZER_FILE, RNG_FILE) if source is resume else (MODEL_FILE,)
        verify_files_on_every_rank(source.path, reads, source.state)
        return load

    def _build_model(self) -> ParallelModel:
        """This rank's part of the model, initialised from ``seed`` (and from the whole-model
        weights to load, if any) and laid out over the mesh."""
        config = self.config  # (its layout checked at the start, before any work: check_layout)
        # bf16: FSDP2's mixed precision where dp shards (bf16 parameters and gradients, float32
        # reductions and master weights); autocast stays on around every step, for what FSDP2
        # does not cast (buffers such as the RoPE tables, the tp norms' gains kept out of FSDP2).
        param_dtype = torch.bfloat16 if config.dtype == "bfloat16" else None
        return build_parallel_model(config.model, config.parallel, self.layout, self.device, config.seed,
                                    config.activation_checkpoint, param_dtype, config.compile,
                                    prepare=self._whole_model_weights())

    def _load_states(self) -> None:
        """The checkpoint's state that goes into this rank's shards: a sharded checkpoint's
        weights, optimiser and RNG states (resume) or weights (init_from), or a consolidated
        one's optimiser state, cut to this rank's shards (its weights are already in)."""
        resume, init = self.start.resume, self.start.init
        if resume is not None and is_sharded(resume.state):
            # (verified when it was found, on rank 0, which does not hash it again; each other rank hashes the
            # files it reads: a copy of its own, where out_dir is not on a file system every node shares)
            _load_resumed(resume, self.config, lambda: load_sharded(resume.path, self.pm.named_parameters(),
                                                                     self.optimizer, verified=resume.state))
        elif resume is not None:
            full = _load_resumed(resume, self.config, lambda: read_optimizer_state(resume.path, resume.state))
            self.optimizer.load_state_dict(shard_optimizer_state(self.optimizer, full))
        elif init is not None and is_sharded(init.state):
            _load_init_weights(init, self.config, lambda: load_sharded(init.path, self.pm.named_parameters(), None,
                                                                        restore_rng=False, verified=init.state))

    def _open_outputs(self) -> None:
        """``config.json`` and the metrics log (rank 0)."""
        if not self.main:
            return
        try:
            # (renamed into place: a resumed run killed while writing it left the run's config cut
            # short, which the next --resume and attnres status could not read)
            write_text_atomically(self.out_dir / "config.json", json.dumps(self.config.to_dict(), indent=1),
                                  "out_dir's config.json")
            if self.wandb is not None:
                self.wandb.update_config(self.config.to_dict())
            self.logger = MetricsLogger(self.out_dir, self.config.tensorboard, self.resume_step, self.wandb)
            if self.logger.kept_aside is not None:  # (an earlier start's log, of no checkpoint: not replaced unsaid)
                print(f"attnres train: kept the metrics.jsonl an earlier start left in out_dir (no checkpoint) as "
                      f"{self.logger.kept_aside.name}")
            self.wandb = None  # the log's to close now
            if self.start.resume is not None and self.data.changed:  # (the eval records after it: of other text)
                before = (self.start.resume.state.get("data") or {}).get("fingerprint")
                self.logger.log(DATA_CHANGE, self.resume_step, fingerprint=self.data.fingerprint, before=before)
        except OutputPathError as e:
            raise OutDirError(str(e)) from None
        except OSError as e:  # a disk that filled up since the start-up check
            raise OutDirError(f"could not write to out_dir {str(self.out_dir)!r}: {os_cause(e)}") from None

    def _open_progress(self) -> None:
        """The progress display (rank 0), once the set-up has been printed: a bar drawn before
        it would leave the first line of the set-up on the bar's line."""
        if self.main and self.config.progress:
            self.progress = StepProgress(self.config.steps, initial=self.step_count, stop=self.config.end_step)

    def announce(self) -> None:
        """Print the resolved set-up (rank 0): how the run starts, the model, tokens per
        step, data size in tokens, device and dtype, and the layout over several ranks."""
        if not self.main:
            return
        resume, init, data = self.start.resume, self.start.init, self.data
        if resume is not None:
            start = f"resuming {str(resume.path)!r} at step {resume.step}"
            start += " on changed data (allow_data_change)" if data.changed else ""
        elif init is not None:
            start = (f"new run in {str(self.out_dir)!r} from the weights of {str(init.path)!r} (init_from; "
                     "fresh optimiser and schedule)")
        else:
            start = f"new run in {str(self.out_dir)!r}"
        tok = data.tokens.tokenizer
        padded = self.config.model.vocab_size - tok.vocab_size
        padding = f", the embedding padded by {padded} rows beyond it" if padded > 0 else ""
        device = str(self.device) + (" (freed memory retained)" if self.device.type == "cpu" and retains_freed_memory() else "")
        facts = RunFacts(start=start, first_step=self.step_count, parameters=self.model.num_parameters(),
                         train_tokens=len(data.tokens.train), val_tokens=len(data.tokens.val),
                         tokenizer=f"{tok.model_name}, {tok.vocab_size} tokens, {data.tokenizer_origin}{padding}",
                         fingerprint=data.fingerprint, device=device, world_size=self.ctx.world_size,
                         layout=self._describe_layout() if self.ctx.world_size > 1 else "")
        print(startup_summary(self.config, facts), flush=True)
        if self.step_count >= self.config.end_step:
            return  # (nothing to train: the settings of steps it will not take - a warm-up as long as the run - are moot)
        changes = init_model_changes(init, self.config.model.to_dict()) if init is not None else None
        for message in (changes, warmup_overrun(self.config), unused_stream_option(self.config),
                        unused_pipeline_options(self.config), oversized_batch(self.config, len(data.tokens.train)),
                        short_validation(self.config, len(data.tokens.val))):
            if message is not None:
                warn_user(message)

    def _describe_layout(self) -> str:
        p = self.config.parallel
        pipe = (f", {p.pp_schedule} schedule, {p.pp_virtual} virtual stage(s), {p.microbatches} micro-batches"
                f"{', cross-stage cache' if p.pp_cache else ''}") if self.layout.pp > 1 else ""
        # (said, not silently skipped: a run asking for them finds none in metrics.jsonl)
        diag = ("; no per-block diagnostics (diagnostics_every: they need the whole model on a rank, tp = pp = 1; "
                "`attnres analyze` a checkpoint for its depth weights)"
                if not self.pm.holds_whole_model and self.config.diagnostics_every <= self.config.steps else "")
        return (f"{self.layout.describe()}{pipe}; this rank holds {self.pm.local_parameter_bytes():,} bytes of "
                f"parameters; sharded (DCP) checkpoints{diag}")

    def autocast(self):
        if self.config.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- one step and what follows it -----------------------------------------------------
    def step(self) -> tuple[float, float, list[float] | None]:
        """One optimiser step: learning rate from the schedule, ``grad_accum`` micro-batches
        (this data-parallel rank's rows of each global batch), the divergence guard,
        clipping, the update. Returns ``(lr factor, gradient norm, per-block gradient norms
        or None)``; raises :class:`TrainingDiverged`."""
        config, pm, step = self.config, self.pm, self.step_count
        factor = lr_factor(step, config.steps, config.schedule, config.warmup_steps, config.min_lr_ratio,
                           config.decay_fraction)
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, aux_sum = 0.0, None
        for micro in range(config.grad_accum):
            ids = pm.rows(self.data.sampler.next_batch())  # the global batch; this dp rank trains on its rows
            pm.sync_gradients(micro == config.grad_accum - 1)
            loss, aux = pm.forward_backward(ids, config.grad_accum, self.autocast)
            loss_sum += loss
            if aux is not None:  # logged apart: loss is the language-modelling loss
                aux_sum = (aux_sum or 0.0) + aux
        # The global batch's loss, the same on every rank (so is the stop decision); tp and
        # pp peers hold the same value, so the world's mean is dp's.
        self.train_loss = train_loss = mean_over_ranks(loss_sum / config.grad_accum, self.ctx)
        self.aux_loss = None if aux_sum is None else mean_over_ranks(aux_sum / config.grad_accum, self.ctx)
        pm.finish_grads()
        diagnose = (step + 1) % config.diagnostics_every == 0 and pm.holds_whole_model
        grads = block_grad_norms(self.model) if diagnose else None  # before clipping
        grad_norm = pm.clip_grads(config.grad_clip if config.grad_clip > 0 else math.inf)
        if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
            if self.main and self.logger is not None:  # (what attnres status reads: the run diverged, not stopped)
                self.logger.log("diverged", step + 1, loss=train_loss, grad_norm=grad_norm)
            raise on_every_rank(TrainingDiverged(  # the loss and the norm are global: every rank sees them
                f"non-finite {'loss' if not math.isfinite(train_loss) else 'gradient norm'} at step {step + 1} "
                f"(loss={train_loss}, grad_norm={grad_norm}); stopping without saving: {self._recovery_hint()}"))
        self.optimizer.step()
        self.step_count += 1
        self.tokens_seen += config.tokens_per_step
        return factor, grad_norm, grads

    def _recovery_hint(self) -> str:
        if self.last_ckpt is None:
            return "no checkpoint was written yet. Lower lr, raise warmup_steps or set grad_clip."
        return (f"the last good checkpoint is {str(self.last_ckpt)!r}. Lower lr, raise warmup_steps or set grad_clip, "
                f"and start again from its weights with its run's config, `{train_on_from(self.last_ckpt)[1]}` (a "
                "fresh optimiser and schedule; DIR a new out_dir)")

    def log_step(self, factor: float, grad_norm: float, window: list) -> None:
        """A ``train`` record (rank 0) with the tokens/s of the window since the last one;
        ``window`` is ``[tokens, start time]``, reset here."""
        now = time.perf_counter()
        tok_s = window[0] / max(now - window[1], 1e-9)
        aux = {} if self.aux_loss is None else {"aux_loss": self.aux_loss}
        self.logger.log("train", self.step_count, loss=self.train_loss, **aux, lr=self.config.lr * factor,
                        grad_norm=grad_norm, tokens=self.tokens_seen, tokens_per_s=tok_s)
        if self.progress is not None:
            self.progress.show(loss=f"{self.train_loss:.4f}", **{k: f"{v:.4f}" for k, v in aux.items()},
                               tok_s=f"{tok_s:,.0f}")
        window[:] = [0, now]

    def evaluate(self) -> None:
        """The validation loss (token-weighted by batch size); every rank evaluates the same
        batches (FSDP2 forwards are collectives), rank 0 logs it."""
        batches = self.data.val_batches
        total = sum(self.pm.loss(b, self.autocast) * b.shape[0] for b in batches)
        self.val_loss = total / sum(b.shape[0] for b in batches)
        self.val_step = self.step_count
        if self.main:
            self.logger.log("eval", self.step_count, val_loss=self.val_loss, tokens=self.tokens_seen)
        if self.progress is not None:
            self.progress.mark(val_loss=f"{self.val_loss:.4f}")

    def diagnostics(self, grads: list[float]) -> None:
        """The Fig. 5 / Fig. 8 diagnostics on the first validation batch, with the per-block
        gradient norms ``grads`` of this step."""
        with self.autocast():
            diag = forward_diagnostics(self.model, self.data.val_batches[0].to(self.device))
        if self.main:
            self.logger.log("diagnostics", self.step_count, block_grad_norm=grads, **diag)

    def checkpoint(self) -> Path:
        """Write the checkpoint of the current step, with the tokenizer, the data's
        fingerprint and the modules the residual needs (``imports``): sharded (every rank its
        shards) on several ranks, consolidated in one process."""
        config, step, data = self.config, self.step_count, self.data
        run_state = {"config": config.to_dict(), "sampler": data.sampler.state_dict(), "tokens_seen": self.tokens_seen,
                     "train_loss": self.train_loss, "val_loss": self.val_loss, "val_step": self.val_step,
                     "tokenizer": data.tokenizer_meta,
                     "data": {"fingerprint": data.fingerprint, "train_tokens": len(data.tokens.train),
                              "val_tokens": len(data.tokens.val), "paths": absolute_paths(config.data.paths)},
                     "init_from": self.start.origin,
                     # (the modules a later command must import for a residual of the user's: named, not imported)
                     "imports": imports_record(config.model.residual.kind),
                     # (the ranks it ran on, in all and per node: attnres status repeats the launch)
                     "launch": {"world_size": self.ctx.world_size,
                                "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", self.ctx.world_size))}}
        try:
            if self.sharded:
                self.last_ckpt = save_sharded(self.out_dir, step, self.pm.named_parameters(), self.optimizer,
                                              run_state, config.keep_checkpoints, data.tokenizer_files, main=self.main,
                                              agree=self._publish_agreement(step))
            else:
                self.last_ckpt = write_checkpoint(self.out_dir, step, self.model.state_dict(),
                                                  self.optimizer.state_dict(), run_state, config.keep_checkpoints,
                                                  data.tokenizer_files)
        except CheckpointWriteError as e:  # sharded: every rank raises it alike (save_sharded agrees on it)
            raise on_every_rank(CheckpointWriteError(f"{e}. {self._continue_hint()}")) from None
        return self.last_ckpt

    def _publish_agreement(self, step: int):
        """The ``agree`` of a sharded checkpoint: every rank stops on any rank's error, while the
        others wait (and say so when it takes long) for rank 0 to hash every rank's shards."""
        def agree(error: Exception | None) -> None:
            with waiting_for_rank_0(self.patient, f"publishing the checkpoint of step {step}: hashing every shard"):
                raise_on_every_rank(error, self.patient)
        return agree

    def _continue_hint(self) -> str:
        """How to go on after an output write failed (a full disk): from the last good checkpoint."""
        last = self.last_ckpt
        if last is None:
            return "No checkpoint of this run was written yet: once the cause is removed, start it again"
        how = ("--resume (resume=true)" if last.resolve().parent == (self.out_dir / "checkpoints").resolve()
               else f"--resume-from {last}")
        return (f"The last good checkpoint is {str(last)!r}: once the cause is removed (a full disk: free space, or "
                f"move out_dir to a larger one), continue from it with {how}")

    def stop_signal(self, signals: StopSignals) -> str | None:
        """The signal that asks this run to stop, agreed by every rank (a launcher signals
        every rank, not necessarily during the same step)."""
        received = signals.received
        if any_rank(received is not None, self.ctx):
            received = received or "SIGTERM"
        return received

    # -- the run --------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Train from the current step to ``steps`` (or ``stop_after``, or a signal), then
        release the lock and close the logs."""
        try:
            self.announce()
            self._open_progress()
            return self._train_loop()
        except OutDirError as e:  # the metrics log could not be written (a full disk)
            raise OutDirError(f"{e}. {self._continue_hint()}") from None
        finally:
            self.close()
            if self.idle or self.step_count == (self.resume_step or 0):
                self._remove_if_made_for_nothing(written=True)

    def _after_step(self, factor: float, grad_norm: float, grads: list[float] | None, window: list, end: int) -> None:
        """Logging, evaluation and diagnostics at their cadences after a step."""
        config, step = self.config, self.step_count
        window[0] += config.tokens_per_step
        if self.progress is not None:  # first: a line written below names this step
            self.progress.update(1)
        if (step % config.log_every == 0 or step == end) and self.main:
            self.log_step(factor, grad_norm, window)
        if step % config.eval_every == 0 or step == config.steps:
            _off_the_clock(window, self.evaluate)
        if grads is not None:
            _off_the_clock(window, lambda: self.diagnostics(grads))

    def _train_loop(self) -> TrainResult:
        config = self.config
        end = self.config.end_step
        interrupted = None
        window = [0, time.perf_counter()]
        with StopSignals() as signals:
            self.pm.train()
            while self.step_count < end:
                factor, grad_norm, grads = self.step()
                self._after_step(factor, grad_norm, grads, window, end)
                interrupted = self.stop_signal(signals)
                if interrupted is not None or self.step_count % config.checkpoint_every == 0 or self.step_count == end:
                    _off_the_clock(window, self.checkpoint)
                if interrupted is not None:
                    break
        return TrainResult(step=self.step_count, train_loss=self.train_loss, val_loss=self.val_loss,
                           checkpoint=self.last_ckpt, out_dir=self.out_dir, interrupted=interrupted,
                           val_step=self.val_step)


def _off_the_clock(window: list, work: Callable[[], object]) -> None:
    """Run ``work`` (an evaluation, the diagnostics, a checkpoint) outside the tokens/s
    ``window`` (``[tokens, start time]``): the train record after each evaluation gave half the
    rate of the others, the evaluation's time counted as the steps'."""
    started = time.perf_counter()
    work()
    window[1] += time.perf_counter() - started


def check_layout(config: TrainConfig, ctx: DistContext) -> None:
    """``ValueError`` unless the layout fits the launched ranks (or the one process, without a
    process group) and the model: said before the data is read or a model built, the same
    answer on every rank."""
    try:
        if ctx.backend is None:
            check_one_process(config.parallel)
        dp = 1 if ctx.backend is None else resolve_degrees(config.parallel, ctx.world_size)[0]
        check_parallel_config(config.model, config.parallel, config.seq_len, config.batch_size, dp,
                              config.activation_checkpoint, resuming=config.resuming)
    except ValueError as e:
        raise on_every_rank(e) from None


def check_inputs(config: TrainConfig, main: bool = True) -> None:
    """``ValueError`` for a data file, tokenizer file or ``data.cache_dir`` the run cannot use:
    said before ``out_dir`` is created (a bad one leaves nothing behind) and before out_dir's
    objections (the data are read later), and an ``out_dir`` that is a checkpoint, a run's
    ``checkpoints/`` folder or a Hugging Face directory, which the run would write into. A
    resumed ``out_dir`` that does not exist is rank 0's to refuse (``main``): on a node that
    does not share it, check_out_dir's message says what is wrong."""
    refuse_out_dir_not_a_run(config.out_dir)
    refuse_a_folder_of_runs(config.out_dir)
    if main and config.resume and config.resume_from is None and not Path(config.out_dir).exists():
        raise ValueError(f"resume=true but out_dir {str(config.out_dir)!r} does not exist"
                         f"{missing_path_hint(config.out_dir, directories_only=True)}: there is no run there to "
                         "resume; name the run's directory, or drop --resume to start a new run")
    if config.data.cache_dir is not None:
        check_output_dir(config.data.cache_dir, "data.cache_dir")
    data_files(config.data.paths)
    if config.data.tokenizer not in TOKENIZER_KINDS and not config.resuming and config.init_from is None:
        tokenizer_file(config.data.tokenizer, "data.tokenizer")  # (a start from a checkpoint keeps its own)


def check_backend(config: TrainConfig, device: torch.device) -> None:
    """Refuse ``model.residual.backend="triton"`` where its kernels cannot run - off a GPU
    (unless under Triton's interpreter, ``TRITON_INTERPRET=1``, for tests), or without
    triton - before any work: the first forward's error would come after the data, the model
    and the start-up summary, as a traceback."""
    reason = triton_unavailable(device) if config.model.residual.backend == "triton" else None
    if reason is not None:
        raise ValueError(f"model.residual.backend='triton' cannot run here: {reason}; use backend='auto' (the C "
                         "kernel on the CPU, the Triton kernels on CUDA where triton is installed, else PyTorch) "
                         "or 'torch'")


def _load_init_weights(source, config: TrainConfig, load: Callable[[], None]) -> None:
    """``init_from`` a checkpoint: ``load()`` its weights only; an error naming the model
    fields that differ when they do not fit. Every rank loads the same checkpoint into the
    same model (a sharded one's misfit DCP reports on every rank), so the error is every
    rank's: printed once per node. A checkpoint gone since it was verified (the rotation of a
    run still training, ``keep_checkpoints``) is said so, not as a FileNotFoundError's traceback
    (nor, of a sharded one, as weights that do not fit this model)."""
    try:
        load()
    except (FileNotFoundError, CheckpointError) as e:  # (a sharded one's DCP reader says it as a CheckpointError)
        if Path(source.path).exists():
            if isinstance(e, FileNotFoundError):
                raise
            raise _misfit(source, config, e) from None
        raise removed_while_set_up(config, source, resumed=False) from None


def _load_resumed(source, config: TrainConfig, load: Callable[[], T]) -> T:
    """``load()`` of the checkpoint resumed (its weights, optimiser or RNG states): one gone
    since it was verified - ``resume_from`` a checkpoint of another run, still training, whose
    rotation (``keep_checkpoints``) removed it - is said so, not as a FileNotFoundError's
    traceback naming one of its files."""
    try:
        return load()
    except (FileNotFoundError, CheckpointError):  # (a sharded one's DCP reader says it as a CheckpointError)
        if Path(source.path).exists():
            raise
        raise removed_while_set_up(config, source, resumed=True) from None


def _other_architecture(source, theirs: str | None, ours: str | None) -> str:
    """The error of :func:`_misfit` where the checkpoint's model and this run's are of different
    architectures (attnres's own, a transformers family): a run of `model.from_hf=DIR` given as
    ``init_from`` without it (or a native run's into one) listed every ``hf_config`` field that
    differs and said to set them all, where what differs is the architecture."""
    def name(arch: str | None) -> str:
        return f"a model of transformers' {arch!r} architecture" if arch else "attnres's own model (no model.hf_architecture)"

    path = Path(source.path)
    run = path.parent.parent if path.parent.name == "checkpoints" else path
    fix = ("leave out model.from_hf / model.hf_architecture" if theirs is None else
           "give model.from_hf (the directory its run was trained from)")
    if (run / "config.json").is_file():
        fix += f", or train from its run's config: `attnres train --config {shell_path(run / 'config.json')} " \
               f"init_from={shell_path(path)} out_dir=DIR`"
    return (f"init_from={str(source.path)!r}: the checkpoint holds {name(theirs)} and this run builds {name(ours)}: "
            f"the weights of one do not load into the other; {fix}")


def _misfit(source, config: TrainConfig, error: CheckpointError) -> Exception:
    """What :func:`_load_init_weights` raises for ``error``, met loading ``source``'s weights:
    the model fields that differ from the checkpoint's first and alone (the load's own error
    lists every tensor that does not fit), else the load's error."""
    saved, ours = flatten(source.run_config()["model"]), flatten(config.model.to_dict())
    differing = sorted(k for k in set(saved) | set(ours) if saved.get(k) != ours.get(k))
    if not differing:
        return on_every_rank(CheckpointError(f"init_from: {error}"))
    if saved.get("hf_architecture") != ours.get("hf_architecture"):
        return on_every_rank(CheckpointError(_other_architecture(source, saved.get("hf_architecture"),
                                                                 ours.get("hf_architecture"))))
    values = ", ".join(f"model.{k}: {saved.get(k)!r} there, {ours.get(k)!r} here" for k in differing)
    return on_every_rank(CheckpointError(
        f"init_from={str(source.path)!r}: its weights do not fit this run's model, which differs from the "
        f"checkpoint's in {['model.' + k for k in differing]} ({values}); set those fields as the checkpoint "
        "has them"))
