"""The resolved set-up of a training run in a few lines, printed at start-up: how the run
starts, the model (parameters, residual), tokens per step, data size in tokens, device and
dtype - so that a config that does not say what was meant shows before any step runs."""

from __future__ import annotations

from dataclasses import dataclass

from .config import TrainConfig


@dataclass
class RunFacts:
    """What the summary reports besides the config."""

    start: str  # how the run starts, in words
    first_step: int  # the step the run continues after (0 for a new run)
    parameters: int
    train_tokens: int
    val_tokens: int
    tokenizer: str  # kind and vocabulary, and where it came from
    fingerprint: str
    device: str
    world_size: int
    layout: str = ""  # the mesh, over several ranks


def warmup_overrun(config: TrainConfig) -> str | None:
    """In words, what a warm-up as long as the run or longer (``warmup_steps >= steps``) does
    to the learning rate (it peaks below ``lr``, or only at the last step, and never decays);
    ``None`` for a warm-up shorter than the run."""
    if config.warmup_steps < config.steps:
        return None
    peak = config.lr * config.steps / config.warmup_steps
    return (f"warmup_steps={config.warmup_steps} >= steps={config.steps}: the learning rate rises for the whole run, "
            f"to {peak:.3g} at the last step ({config.steps / config.warmup_steps:.3g} x lr), and the "
            f"{config.schedule!r} schedule after the warm-up never starts; set warmup_steps below steps (e.g. "
            f"warmup_steps={max(config.steps // 10, 1) if config.steps > 1 else 0})")


def short_validation(config: TrainConfig, val_tokens: int) -> str | None:
    """In words, that the validation split holds fewer windows of ``seq_len`` tokens than
    ``eval_batches x batch_size`` (the run's ``val_loss`` is measured on those it holds, fewer
    tokens than asked for: noisier than the setting says); ``None`` where it holds them all."""
    asked = config.eval_batches * config.batch_size
    held = val_tokens // config.seq_len
    if held >= asked:
        return None
    # Lowering eval_batches helps only down to one batch: a split of fewer windows than
    # batch_size is short of even eval_batches=1, so only a larger split silences this.
    fewer = held // config.batch_size
    remedy = (f", or lower eval_batches to {fewer}" if fewer else
              f" (it holds less than one batch of batch_size={config.batch_size} windows, which even eval_batches=1 "
              "asks for)")
    return (f"eval_batches={config.eval_batches} x batch_size={config.batch_size} = {asked} validation windows of "
            f"seq_len={config.seq_len} tokens asked for, and the validation split ({val_tokens:,} tokens) holds "
            f"{held}: val_loss is measured on those {held * config.seq_len:,} tokens; raise data.val_fraction for "
            f"more{remedy}")


def oversized_batch(config: TrainConfig, train_tokens: int) -> str | None:
    """In words, that one step draws more windows of ``seq_len`` tokens (``batch_size x
    grad_accum``) than the training split holds: the sampler then repeats windows within the
    step (the next epoch's order), so the step costs more and sees no more text; ``None``
    where a step fits in the split."""
    per_step = config.batch_size * config.grad_accum
    held = train_tokens // config.seq_len
    if held < 1 or per_step <= held:  # (a split shorter than one window is refused by the sampler)
        return None
    accum = f" x grad_accum={config.grad_accum} = {per_step:,}" if config.grad_accum > 1 else ""
    return (f"batch_size={config.batch_size}{accum} training windows of seq_len={config.seq_len} tokens "
            f"a step, and the training split ({train_tokens:,} tokens) holds {held:,}: every step trains on each window "
            f"about {per_step / held:.3g} times, at that cost and with no more text; lower batch_size to at most "
            f"{held // config.grad_accum if held >= config.grad_accum else held:,}"
            f"{' (and grad_accum to 1)' if held < config.grad_accum else ''}, or give more text")


#: The autocast rounding options of ``ModelConfig.residual``, and what each does under autocast.
_AUTOCAST_OPTIONS = {"autocast_stream": "stores the residual stream in the autocast dtype",
                     "autocast_norm_output": "rounds the sublayers' norm outputs to the autocast dtype",
                     "autocast_phase1_sums": "stores AttnRes' Phase-1 weighted sums in the autocast dtype"}


def unused_stream_option(config: TrainConfig) -> str | None:
    """In words, that one of ``model.residual``'s autocast options (:data:`_AUTOCAST_OPTIONS`)
    does nothing in this run (no autocast: ``dtype`` is not ``bfloat16``); ``None`` otherwise."""
    unused = [name for name in _AUTOCAST_OPTIONS if getattr(config.model.residual, name)]
    if not unused or config.dtype == "bfloat16":
        return None
    name = unused[0]
    return (f"model.residual.{name}=true has no effect with dtype={config.dtype}: it {_AUTOCAST_OPTIONS[name]}, and "
            "without autocast the stream keeps the parameters' dtype; set dtype=bfloat16 for bf16 autocast")


def unused_pipeline_options(config: TrainConfig) -> str | None:
    """In words, that the pipeline's settings (``parallel.pp_schedule``, ``pp_virtual``,
    ``pp_cache``, ``pp_microbatches``) set away from their defaults do nothing in this run
    (``parallel.pp=1``: no pipeline); ``None`` otherwise. A launch that meant a pipeline and
    left out ``parallel.pp`` trained data parallel, without a word."""
    p = config.parallel
    if p.pp > 1:
        return None
    default = type(p)()
    unused = [f"parallel.{name}={str(value).lower() if isinstance(value, bool) else value}"
              for name in ("pp_schedule", "pp_virtual", "pp_cache", "pp_microbatches")
              if (value := getattr(p, name)) != getattr(default, name)]
    if not unused:
        return None
    return (f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect with parallel.pp=1: "
            f"{'it shapes' if len(unused) == 1 else 'they shape'} a pipeline, and this run has none; set parallel.pp "
            "(the pipeline stages, e.g. parallel.pp=2 on 2 ranks) for one")


def startup_summary(config: TrainConfig, facts: RunFacts) -> str:
    model = config.model.to_dict()
    end = config.end_step
    to_go = max(end - facts.first_step, 0)
    stop = f"; stop_after ends this invocation at step {end}" if end < config.steps else ""
    processes = f", {facts.world_size} processes" if facts.world_size > 1 else ""
    dtype = config.dtype
    if dtype == "bfloat16" and config.model.residual.autocast_stream:
        dtype += " (the residual stream in bf16: autocast_stream)"
    elif dtype == "bfloat16" and config.model.residual.autocast_norm_output:
        dtype += " (the sublayers' norm outputs in bf16: autocast_norm_output)"
    if dtype.startswith("bfloat16") and config.model.residual.autocast_phase1_sums:
        dtype += " (Phase 1's sums in bf16: autocast_phase1_sums)"
    lr = f"lr {config.lr:g}"
    if config.warmup_steps >= config.steps:
        lr += (f" (peak {config.lr * config.steps / config.warmup_steps:.3g}: warmup_steps {config.warmup_steps} >= steps "
               f"{config.steps})")
    if to_go:
        head = f"attnres train: {facts.start}; steps {facts.first_step + 1}-{end} of {config.steps} ({to_go} to go{stop})"
    else:  # it printed 'steps 41-40 of 40 (0 to go)'
        limit = f"stop_after={config.stop_after}" if end < config.steps else f"steps={config.steps}"
        head = f"attnres train: {facts.start}; nothing to train: the run is at step {facts.first_step} and {limit} ends it there"
    # (a transformers family's model said only its residual and sizes, as if it were attnres's own)
    family = f", transformers' {model['hf_architecture']} architecture" if model.get("hf_architecture") else ""
    lines = [
        head,
        f"  model   {facts.parameters:,} parameters{family}; residual {config.model.describe_residual()}; "
        f"d_model {model.get('d_model')}, "
        f"{model.get('n_layers')} transformer blocks, vocabulary {model.get('vocab_size')}",
        f"  tokens  {config.tokens_per_step:,} per step (batch {config.batch_size} x seq_len {config.seq_len} x "
        f"grad_accum {config.grad_accum}); {config.optimizer}, {lr}, {config.schedule} schedule",
        f"  data    {facts.train_tokens:,} training + {facts.val_tokens:,} validation tokens; tokenizer "
        f"{facts.tokenizer}; fingerprint {facts.fingerprint[:12]}",
        f"  device  {facts.device}, {dtype}{processes}; out_dir {config.out_dir}",
    ]
    if facts.layout:
        lines.append(f"  layout  {facts.layout}")
    return "\n".join(lines)
