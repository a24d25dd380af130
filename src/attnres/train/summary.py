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


def startup_summary(config: TrainConfig, facts: RunFacts) -> str:
    model = config.model.to_dict()
    end = min(config.steps, config.stop_after or config.steps)
    to_go = max(end - facts.first_step, 0)
    stop = f"; stop_after ends this invocation at step {end}" if end < config.steps else ""
    processes = f", {facts.world_size} processes" if facts.world_size > 1 else ""
    lines = [
        f"attnres train: {facts.start}; steps {facts.first_step + 1}-{end} of {config.steps} ({to_go} to go{stop})",
        f"  model   {facts.parameters:,} parameters; residual {config.model.describe_residual()}; d_model {model.get('d_model')}, "
        f"{model.get('n_layers')} transformer blocks, vocabulary {model.get('vocab_size')}",
        f"  tokens  {config.tokens_per_step:,} per step (batch {config.batch_size} x seq_len {config.seq_len} x "
        f"grad_accum {config.grad_accum}); {config.optimizer}, lr {config.lr:g}, {config.schedule} schedule",
        f"  data    {facts.train_tokens:,} training + {facts.val_tokens:,} validation tokens; tokenizer "
        f"{facts.tokenizer}; fingerprint {facts.fingerprint[:12]}",
        f"  device  {facts.device}, {config.dtype}{processes}; out_dir {config.out_dir}",
    ]
    if facts.layout:
        lines.append(f"  layout  {facts.layout}")
    return "\n".join(lines)
