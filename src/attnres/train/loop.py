"""The training loop: :func:`train` runs a :class:`TrainConfig` end to end.

One optimiser step: set the learning rate from the schedule, accumulate gradients over
``grad_accum`` micro-batches (optionally under bfloat16 autocast), stop on a non-finite loss
or gradient, clip, step. Every ``log_every`` steps a metrics record (loss, lr, gradient
norm, tokens/s) goes to ``<out_dir>/metrics.jsonl`` (and TensorBoard when installed); every
``eval_every`` steps the validation loss; every ``diagnostics_every`` steps the Fig. 5/8
diagnostics; every ``checkpoint_every`` steps, at the end, and on SIGINT/SIGTERM a checkpoint.

Resuming (``resume=True``) restores weights, optimiser, data position and RNG states from the
newest checkpoint in ``out_dir``, so that N steps plus N resumed steps give bit-for-bit the
parameters of 2N uninterrupted steps.

Under ``torchrun`` (``TrainConfig.distributed``, docs/distributed.md) every rank runs this loop
on its slice of each global batch, with FSDP2 or DDP averaging the gradients; rank 0 logs and
writes consolidated checkpoints (the single-process layout), so a run resumes on any number
of ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
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
    wrap_model,
)
from ..distributed.launch import DistContext, collective_errors, init_distributed, resolve_mode
from .checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_state,
    read_optimizer_state,
    remove_partial_checkpoints,
    save_checkpoint,
    write_checkpoint,
)
from .config import RESUMABLE_CHANGES, TrainConfig
from .metrics import MetricsLogger
from .optim import build_optimizer
from .schedule import lr_factor
from .signals import StopSignals


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


def _check_resumable(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    differing = sorted(k for k in set(saved) | set(current) if k not in RESUMABLE_CHANGES and saved.get(k) != current.get(k))
    if differing:
        raise ValueError(f"cannot resume from {str(path)!r}: the config differs in {differing} "
                         f"(only {sorted(RESUMABLE_CHANGES)} may change on resume)")


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

    :meth:`run` calls, in order, :meth:`setup_data`, :meth:`build_model`, :meth:`restore`,
    :meth:`build_optimizer` and :meth:`open_outputs`, then :meth:`step` until the run ends,
    with :meth:`log_step`, :meth:`evaluate`, :meth:`diagnostics` and :meth:`checkpoint` at
    their cadences. ``ctx`` is this process's place in the process group (``None`` alone).
    """

    def __init__(self, config: TrainConfig, ctx: DistContext | None, mode: str) -> None:
        self.config, self.ctx, self.mode = config, ctx, mode
        self.main = ctx is None or ctx.is_main
        self.device = resolve_device(config.device) if ctx is None else ctx.device
        self.out_dir = Path(config.out_dir)
        self.step_count, self.tokens_seen = 0, 0
        self.train_loss: float | None = None
        self.val_loss: float | None = None
        self.resume_step: int | None = None
        self.last_ckpt: Path | None = None
        self.logger: MetricsLogger | None = None
        self.progress = None
        self._restored: tuple[Path, dict[str, Any]] | None = None  # (checkpoint, its state) on resume

    # -- set-up ---------------------------------------------------------------------------
    def setup_data(self) -> None:
        """Read and tokenise the corpus (rank 0 first under torchrun, the others then read
        its cache), set the model's vocabulary from the tokenizer, build the sampler and the
        validation batches."""
        config, ctx = self.config, self.ctx
        corpus = load_corpus(config.data.paths, config.data.val_fraction)

        def prepare():
            return prepare_data(corpus, config.data.tokenizer, config.data.vocab_size, config.data.cache_dir)

        if ctx is None:
            data = prepare()
        else:  # rank 0 tokenises (and trains the BPE) once; the others then read its cache
            data = prepare() if self.main else None
            dist.barrier()
            data = data or prepare()
        if config.model.vocab_size != data.vocab_size:  # the tokenizer decides (the caller's config is left alone)
            self.config = config = dataclasses.replace(config, model=config.model.replace(vocab_size=data.vocab_size))
        self.data = data
        self.sampler = BatchSampler(data.train, config.seq_len, config.batch_size, config.seed)
        self.val_batches = validation_batches(data.val, config.seq_len, config.batch_size, config.eval_batches)

    def build_model(self) -> None:
        """The model, initialised from ``seed``."""
        torch.manual_seed(self.config.seed)
        self.model = AttnResLM(self.config.model).to(self.device)

    def restore(self) -> None:
        """With ``resume``: weights, RNG states, data position and counters from the newest
        checkpoint (the optimiser state follows in :meth:`build_optimizer`). Without: refuse
        an ``out_dir`` that already holds checkpoints."""
        config, out_dir = self.config, self.out_dir
        if self.main:
            remove_partial_checkpoints(out_dir)
        existing = latest_checkpoint(out_dir)
        if config.resume:
            if existing is None:
                raise ValueError(f"resume=true but {str(out_dir / 'checkpoints')!r} holds no checkpoint")
            _check_resumable(read_checkpoint_state(existing)["config"], config.to_dict(), existing)
            # Weights (and RNG) go into the whole model, before data parallelism shards it.
            state = load_checkpoint(existing, self.model)
            self.sampler.load_state_dict(state["sampler"])
            self.step_count, self.tokens_seen, self.resume_step = state["step"], state["tokens_seen"], state["step"]
            self.train_loss, self.val_loss = state["train_loss"], state["val_loss"]
            self._restored = (existing, state)
            self.last_ckpt = existing
        elif existing is not None:
            raise ValueError(f"{str(out_dir)!r} already holds checkpoints; set resume=true to continue, or pick another out_dir")

    def build_optimizer(self) -> None:
        """Wrap the model for data parallelism, build the optimiser and, on resume, load its
        state."""
        config, ctx = self.config, self.ctx
        if ctx is not None:
            if config.batch_size % ctx.world_size:
                raise ValueError(f"TrainConfig.batch_size={config.batch_size} (the global batch) must be divisible by "
                                 f"the number of ranks {ctx.world_size}")
            dist.barrier()  # every rank has seen the same checkpoints before rank 0 writes anything
        self.forward = self.model if ctx is None else wrap_model(self.model, self.mode, ctx)
        self.optimizer = build_optimizer(self.model, config)
        if self._restored is not None:
            path, state = self._restored
            opt_state = read_optimizer_state(path, state)
            self.optimizer.load_state_dict(shard_optimizer_state(self.optimizer, opt_state)
                                           if self.mode == "fsdp" else opt_state)
        if config.compile:
            self.forward = torch.compile(self.forward)
        self.params = [p for p in self.model.parameters() if p.requires_grad]

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
        loss_sum = 0.0
        for micro in range(config.grad_accum):
            ids = self.sampler.next_batch()  # the global batch; each rank trains on its rows
            ids = (ids if ctx is None else local_rows(ids, ctx)).to(self.device)
            with gradient_sync(self.forward, self.mode, micro == config.grad_accum - 1):
                with self.autocast():
                    loss = self.forward(ids, labels=ids).loss
                (loss / config.grad_accum).backward()
            loss_sum += loss.item()
        train_loss = loss_sum / config.grad_accum
        if ctx is not None:  # the global batch's loss, the same on every rank (so is the stop decision)
            train_loss = mean_over_ranks(train_loss, ctx)
        self.train_loss = train_loss
        grads = block_grad_norms(self.model) if (step + 1) % config.diagnostics_every == 0 else None  # before clipping
        clip = config.grad_clip if config.grad_clip > 0 else math.inf
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.params, clip)).item()
        if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
            where = (f"the last good checkpoint is {str(self.last_ckpt)!r}" if self.last_ckpt
                     else "no checkpoint was written yet")
            raise TrainingDiverged(
                f"non-finite {'loss' if not math.isfinite(train_loss) else 'gradient norm'} at step {step + 1} "
                f"(loss={train_loss}, grad_norm={grad_norm}); stopping without saving: {where}. "
                "Lower lr, raise warmup_steps or set grad_clip."
            )
        self.optimizer.step()
        self.step_count += 1
        self.tokens_seen += config.tokens_per_step
        return factor, grad_norm, grads

    def log_step(self, factor: float, grad_norm: float, window: list) -> None:
        """A ``train`` record (rank 0) with the tokens/s of the window since the last one;
        ``window`` is ``[tokens, start time]``, reset here."""
        now = time.perf_counter()
        tok_s = window[0] / max(now - window[1], 1e-9)
        self.logger.log("train", self.step_count, loss=self.train_loss, lr=self.config.lr * factor,
                        grad_norm=grad_norm, tokens=self.tokens_seen, tokens_per_s=tok_s)
        if self.progress is not None:
            self.progress.set_postfix(loss=f"{self.train_loss:.4f}", tok_s=f"{tok_s:,.0f}")
        window[:] = [0, now]

    def evaluate(self) -> None:
        """The validation loss; every rank evaluates the same batches (FSDP2 forwards are
        collectives), rank 0 logs it."""
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
        """Write the checkpoint of the current step (every rank takes part in gathering the
        shards; rank 0 writes the consolidated files)."""
        config, step = self.config, self.step_count
        run_state = {"config": config.to_dict(), "sampler": self.sampler.state_dict(), "tokens_seen": self.tokens_seen,
                     "train_loss": self.train_loss, "val_loss": self.val_loss}
        if self.ctx is None:
            path = save_checkpoint(self.out_dir, step, self.model, self.optimizer, run_state, config.keep_checkpoints)
        else:
            model_state, opt_state = full_model_state(self.model), full_optimizer_state(self.optimizer)
            if self.main:
                write_checkpoint(self.out_dir, step, model_state, opt_state, run_state, config.keep_checkpoints)
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
        self.setup_data()
        self.build_model()
        self.restore()
        self.build_optimizer()
        self.open_outputs()
        config = self.config
        end = min(config.steps, config.stop_after or config.steps)
        interrupted = None
        window = [0, time.perf_counter()]
        try:
            with StopSignals() as signals:
                self.model.train()
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
