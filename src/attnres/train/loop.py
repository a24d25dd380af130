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
import signal
import threading
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
from .optim import build_optimizer
from .schedule import lr_factor


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


class MetricsLogger:
    """Appends JSON records to ``metrics.jsonl`` and mirrors scalars to TensorBoard when the
    ``tensorboard`` package is installed and enabled."""

    def __init__(self, out_dir: Path, tensorboard: bool, resume_step: int | None) -> None:
        self.path = out_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            # Drop what an interrupted run logged after its last checkpoint: it is redone.
            kept = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        elif resume_step is None:
            self.path.write_text("")
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                pass
            else:
                self.writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resume_step)

    def log(self, kind: str, step: int, **values: Any) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
        if self.writer is not None:
            for name, value in values.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{kind}/{name}", value, step)
                elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
                    for i, v in enumerate(value):
                        self.writer.add_scalar(f"{kind}/{name}/{i}", v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class StopSignals:
    """While active, SIGINT and SIGTERM only set :attr:`received`; the loop checkpoints and
    returns at the end of the current step. A second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum, _frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


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
        return _train(config, None, "none")
    ctx = init_distributed(config.device, config.dist_timeout_s)
    with collective_errors(ctx):
        return _train(config, ctx, mode)


def _train(config: TrainConfig, ctx: DistContext | None, mode: str) -> TrainResult:
    """:func:`train` for one process; ``ctx`` is its place in the process group (or None)."""
    main = ctx is None or ctx.is_main
    device = resolve_device(config.device) if ctx is None else ctx.device
    out_dir = Path(config.out_dir)
    corpus = load_corpus(config.data.paths, config.data.val_fraction)

    def prepare():
        return prepare_data(corpus, config.data.tokenizer, config.data.vocab_size, config.data.cache_dir)

    if ctx is None:
        data = prepare()
    else:  # rank 0 tokenises (and trains the BPE) once; the others then read its cache
        data = prepare() if main else None
        dist.barrier()
        data = data or prepare()
    if config.model.vocab_size != data.vocab_size:  # the tokenizer decides (the caller's config is left alone)
        config = dataclasses.replace(config, model=config.model.replace(vocab_size=data.vocab_size))

    torch.manual_seed(config.seed)
    model = AttnResLM(config.model).to(device)
    sampler = BatchSampler(data.train, config.seq_len, config.batch_size, config.seed)
    val_batches = validation_batches(data.val, config.seq_len, config.batch_size, config.eval_batches)

    step, tokens_seen, resume_step, train_loss, val_loss = 0, 0, None, None, None
    if main:
        remove_partial_checkpoints(out_dir)
    existing = latest_checkpoint(out_dir)
    state = None
    if config.resume:
        if existing is None:
            raise ValueError(f"resume=true but {str(out_dir / 'checkpoints')!r} holds no checkpoint")
        _check_resumable(read_checkpoint_state(existing)["config"], config.to_dict(), existing)
        # Weights (and RNG) go into the whole model, before data parallelism shards it; the
        # optimiser state once the optimiser exists (below).
        state = load_checkpoint(existing, model)
        sampler.load_state_dict(state["sampler"])
        step, tokens_seen, resume_step = state["step"], state["tokens_seen"], state["step"]
        train_loss, val_loss = state["train_loss"], state["val_loss"]
    elif existing is not None:
        raise ValueError(f"{str(out_dir)!r} already holds checkpoints; set resume=true to continue, or pick another out_dir")
    if ctx is not None:
        if config.batch_size % ctx.world_size:
            raise ValueError(f"TrainConfig.batch_size={config.batch_size} (the global batch) must be divisible by the "
                             f"number of ranks {ctx.world_size}")
        dist.barrier()  # every rank has seen the same checkpoints before rank 0 writes anything
    forward = model if ctx is None else wrap_model(model, mode, ctx)
    optimizer = build_optimizer(model, config)
    if state is not None:
        opt_state = read_optimizer_state(existing, state)
        optimizer.load_state_dict(shard_optimizer_state(optimizer, opt_state) if mode == "fsdp" else opt_state)
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=1))

    if config.compile:
        forward = torch.compile(forward)
    use_bf16 = config.dtype == "bfloat16"

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()

    end = min(config.steps, config.stop_after or config.steps)
    logger = MetricsLogger(out_dir, config.tensorboard, resume_step) if main else None
    progress = None
    if config.progress and main:
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            progress = tqdm(total=config.steps, initial=step, unit="step", dynamic_ncols=True)
    params = [p for p in model.parameters() if p.requires_grad]
    last_ckpt, interrupted = (existing if config.resume else None), None
    window_tokens, window_start = 0, time.perf_counter()

    def checkpoint() -> Path:
        run_state = {"config": config.to_dict(), "sampler": sampler.state_dict(), "tokens_seen": tokens_seen,
                     "train_loss": train_loss, "val_loss": val_loss}
        if ctx is None:
            return save_checkpoint(out_dir, step, model, optimizer, run_state, config.keep_checkpoints)
        # Every rank takes part in gathering the shards; rank 0 writes the consolidated files.
        model_state, opt_state = full_model_state(model), full_optimizer_state(optimizer)
        if main:
            write_checkpoint(out_dir, step, model_state, opt_state, run_state, config.keep_checkpoints)
        dist.barrier()
        return checkpoint_path(out_dir, step)

    try:
        with StopSignals() as signals:
            model.train()
            while step < end:
                factor = lr_factor(step, config.steps, config.schedule, config.warmup_steps, config.min_lr_ratio,
                                   config.decay_fraction)
                for group in optimizer.param_groups:
                    group["lr"] = group["initial_lr"] * factor
                optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                for micro in range(config.grad_accum):
                    ids = sampler.next_batch()  # the global batch; each rank trains on its rows
                    ids = (ids if ctx is None else local_rows(ids, ctx)).to(device)
                    with gradient_sync(forward, mode, micro == config.grad_accum - 1):
                        with autocast():
                            loss = forward(ids, labels=ids).loss
                        (loss / config.grad_accum).backward()
                    loss_sum += loss.item()
                train_loss = loss_sum / config.grad_accum
                if ctx is not None:  # the global batch's loss, the same on every rank (so is the stop decision)
                    train_loss = mean_over_ranks(train_loss, ctx)
                diag_step = (step + 1) % config.diagnostics_every == 0
                grads = block_grad_norms(model) if diag_step else None  # before clipping
                clip = config.grad_clip if config.grad_clip > 0 else math.inf
                grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(params, clip)).item()
                if not (math.isfinite(train_loss) and math.isfinite(grad_norm)):
                    where = f"the last good checkpoint is {str(last_ckpt)!r}" if last_ckpt else "no checkpoint was written yet"
                    raise TrainingDiverged(
                        f"non-finite {'loss' if not math.isfinite(train_loss) else 'gradient norm'} at step {step + 1} "
                        f"(loss={train_loss}, grad_norm={grad_norm}); stopping without saving: {where}. "
                        "Lower lr, raise warmup_steps or set grad_clip."
                    )
                optimizer.step()
                step += 1
                tokens_seen += config.tokens_per_step
                window_tokens += config.tokens_per_step

                if (step % config.log_every == 0 or step == end) and main:
                    now = time.perf_counter()
                    tok_s = window_tokens / max(now - window_start, 1e-9)
                    logger.log("train", step, loss=train_loss, lr=config.lr * factor, grad_norm=grad_norm,
                               tokens=tokens_seen, tokens_per_s=tok_s)
                    if progress is not None:
                        progress.set_postfix(loss=f"{train_loss:.4f}", tok_s=f"{tok_s:,.0f}")
                    window_tokens, window_start = 0, now
                if step % config.eval_every == 0 or step == config.steps:
                    # Every rank evaluates the same batches (FSDP2 forwards are collectives).
                    val_loss = evaluate(model, val_batches, device, autocast)
                    if main:
                        logger.log("eval", step, val_loss=val_loss, tokens=tokens_seen)
                if diag_step:
                    with autocast():
                        diag = forward_diagnostics(model, val_batches[0].to(device))
                    if main:
                        logger.log("diagnostics", step, block_grad_norm=grads, **diag)
                if progress is not None:
                    progress.update(1)
                received = signals.received
                # A launcher signals every rank, not necessarily during the same step: stop together.
                if ctx is not None and any_rank(received is not None, ctx):
                    received = received or "SIGTERM"
                if received is not None:
                    interrupted = received
                    last_ckpt = checkpoint()
                    break
                if step % config.checkpoint_every == 0 or step == end:
                    last_ckpt = checkpoint()
    finally:
        if progress is not None:
            progress.close()
        if logger is not None:
            logger.close()
    return TrainResult(step=step, train_loss=train_loss, val_loss=val_loss, checkpoint=last_ckpt, out_dir=out_dir,
                       interrupted=interrupted)
