"""The compute multiplier measured directly (report §5.1, Table 2 / Fig. 4).

The report's "Block AttnRes matches the baseline trained with 1.25x the compute" compares
fitted scaling laws. Here it is measured at one model shape without a fit across sizes: the
standard model is trained to a *ladder* of budgets (each run with its own schedule), AttnRes
to one budget ``C_a``; per seed, the compute ``C*`` at which the standard model's final loss
equals AttnRes's is read off the ladder, and ``m = C* / C_a`` is the multiplier (> 1: AttnRes
is worth that much more standard compute; compute counts each model's own FLOPs, so AttnRes's
extra work per token is charged to it).

``C*`` is interpolated linearly in ``(ln C, ln L)`` between the two rungs around AttnRes's
loss: exact where the loss follows a power law between neighbouring rungs. Outside the
ladder it is extrapolated along the nearest segment and flagged; a ladder whose loss does not
fall with compute (seed noise larger than the rungs' spacing) is read from its least-squares
power law instead, also flagged. The seeds' multipliers are then averaged with a Student-t
interval (:func:`~.stats.t_interval`): each seed fixes the data order and initialisation of
all its runs, so a seed is one independent replicate of the whole comparison.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..stats import log_linear_fit

__all__ = ["Crossing", "ladder_crossing", "ladder_loss", "curve_crossing", "seed_multipliers"]


@dataclass(frozen=True)
class Crossing:
    """Where a ladder reaches a loss: ``compute`` (``C*``), whether it lies outside the
    ladder's range (``extrapolated``) and how it was read (``"interpolated"``, or ``"fit"``
    for a ladder whose loss does not fall with compute)."""

    compute: float
    extrapolated: bool
    method: str


def ladder_crossing(ladder: Sequence[tuple[float, float]], loss: float) -> Crossing:
    """The compute at which the ladder's loss reaches ``loss``. ``ladder``: ``(compute,
    loss)`` of one seed's standard runs (at least 2 distinct computes, positive values)."""
    pts = sorted((float(c), float(l)) for c, l in ladder)
    if len({c for c, _ in pts}) < 2 or any(c <= 0 or l <= 0 or not math.isfinite(l) for c, l in pts):
        raise ValueError(f"a ladder needs >= 2 distinct positive computes with finite positive losses; got {pts!r}")
    if not (math.isfinite(loss) and loss > 0):
        raise ValueError(f"the loss to match must be finite and positive; got {loss!r}")
    x = np.log([c for c, _ in pts])
    y = np.log([l for _, l in pts])
    target = math.log(loss)
    outside = not y[-1] <= target <= y[0]
    if np.all(np.diff(y) < 0):
        # the segment around the target, or the end segment on its side
        i = int(np.clip(np.searchsorted(-y, -target), 1, len(y) - 1))
        slope = (y[i] - y[i - 1]) / (x[i] - x[i - 1])
        return Crossing(float(math.exp(x[i - 1] + (target - y[i - 1]) / slope)), outside, "interpolated")
    log_a, alpha = log_linear_fit(x, y)
    if alpha <= 0:
        raise ValueError(f"the ladder's loss does not fall with compute (fitted exponent {alpha:.4g}): no compute "
                         "reaches a given loss")
    return Crossing(float(math.exp((log_a - target) / alpha)), outside, "fit")


def ladder_loss(ladder: Sequence[tuple[float, float]], compute: float) -> tuple[float, bool]:
    """``(loss, extrapolated)``: the ladder's loss at ``compute``, linear in ``(ln C, ln L)``
    between the rungs around it (along the end segment outside the ladder's range)."""
    pts = sorted((float(c), float(l)) for c, l in ladder)
    if len({c for c, _ in pts}) < 2 or compute <= 0:
        raise ValueError(f"a ladder needs >= 2 distinct computes and the compute to read must be > 0; got {pts!r}, "
                         f"{compute!r}")
    x, y = np.log([c for c, _ in pts]), np.log([l for _, l in pts])
    at = math.log(compute)
    i = int(np.clip(np.searchsorted(x, at), 1, len(x) - 1))
    slope = (y[i] - y[i - 1]) / (x[i] - x[i - 1])
    return float(math.exp(y[i - 1] + slope * (at - x[i - 1]))), not x[0] <= at <= x[-1]


def curve_crossing(steps: Sequence[float], losses: Sequence[float], loss: float) -> float | None:
    """The first step at which one run's validation curve (``losses`` at ``steps``, increasing)
    reaches ``loss``: linear in ``(ln step, ln loss)`` between that evaluation and the one before;
    ``None`` if the curve never reaches it or already starts below it. Reading a run of the
    reference along its own curve (one schedule, not a ladder of runs) gives the multiplier
    at intermediate budgets; within a constant learning-rate phase the reading is fair to both
    models, across a decay it is not."""
    for i in range(1, len(steps)):
        if losses[i] <= loss < losses[i - 1]:
            x0, x1 = math.log(steps[i - 1]), math.log(steps[i])
            y0, y1 = math.log(losses[i - 1]), math.log(losses[i])
            return float(math.exp(x0 + (math.log(loss) - y0) * (x1 - x0) / (y1 - y0)))
    return None


def seed_multipliers(ladder: Sequence[dict[str, Any]], arm: Sequence[dict[str, Any]],
                     compute_field: str = "flops") -> dict[int, tuple[float, Crossing]]:
    """Per seed, ``(multiplier, crossing)`` of the ``arm`` runs (records with ``seed``,
    ``val_loss`` and ``compute_field``) against the ``ladder`` runs of the same seed; seeds
    with fewer than 2 ladder runs, or without an arm run, are left out."""
    rungs: dict[int, list[tuple[float, float]]] = {}
    for r in ladder:
        rungs.setdefault(int(r["seed"]), []).append((r[compute_field], r["val_loss"]))
    out = {}
    for r in arm:
        seed = int(r["seed"])
        if len(rungs.get(seed, [])) >= 2:
            try:
                crossing = ladder_crossing(rungs[seed], r["val_loss"])
            except ValueError as e:
                raise ValueError(f"seed {seed}, run {r.get('variant', '?')!r}: {e}") from None
            out[seed] = (crossing.compute / r[compute_field], crossing)
    return dict(sorted(out.items()))
