"""Learning-rate schedules, as a factor of the peak rate for each optimiser step.

The factor depends only on the step number and the config, so the schedule's whole state is
the step counter that the checkpoint stores.
"""

from __future__ import annotations

import math


def wsd_decay_start(total: int, warmup: int, decay_fraction: float) -> int:
    """The first step of a WSD schedule's decay: the last ``ceil(decay_fraction * total)``
    steps decay, never before the warm-up ends."""
    return max(warmup, total - math.ceil(decay_fraction * total))


def lr_factor(step: int, total: int, kind: str, warmup: int, min_ratio: float, decay_fraction: float = 0.2) -> float:
    """Multiplier of the peak learning rate for 0-based optimiser step ``step`` of ``total``.

    * warmup (all kinds): ``(step + 1) / warmup`` for the first ``warmup`` steps;
    * ``"cosine"``: then cosine from 1 down to ``min_ratio`` at the last step;
    * ``"wsd"`` (warmup-stable-decay): then 1 until the last ``ceil(decay_fraction * total)``
      steps, which decay linearly to ``min_ratio`` at the last step;
    * ``"constant"``: then 1.
    """
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    last = total - 1
    if kind == "cosine":
        span = last - warmup
        progress = 1.0 if span <= 0 else min(1.0, (step - warmup) / span)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "wsd":
        decay_steps = math.ceil(decay_fraction * total)
        decay_start = wsd_decay_start(total, warmup, decay_fraction)
        if step < decay_start or decay_steps == 0:
            return 1.0
        span = last - decay_start
        progress = 1.0 if span <= 0 else min(1.0, (step - decay_start) / span)
        return 1.0 - (1.0 - min_ratio) * progress
    raise ValueError(f"schedule must be one of 'cosine', 'wsd', 'constant'; got {kind!r}")
