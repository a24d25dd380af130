"""Scaling-law fits and the compute multiplier (report §5.1, Table 2, Fig. 4).

Per family, ``L = A · C^−α`` is fitted by least squares in log space to the mean validation
loss over seeds at each size (``C`` in PFLOP/s-days). The **compute multiplier** of a family
over the reference (the standard residual) is how many times more compute the reference
needs to reach that family's loss: ``m = C_ref(L) / C`` with ``C_ref(L) = (A_ref / L)^(1/α_ref)``
from the reference's fit. It is read two ways:

* at each size, from the measured losses: starting from the reference's own mean loss and
  compute at that size, the compute at which the reference reaches the family's mean loss
  along its fitted slope, ``C_ref · (L_ref / L)^(1/α_ref)``, over the family's compute. The
  paired loss ratio carries the size's evidence; the reference's misfit to its power law at
  that size does not enter (with ``α`` small the multiplier ``exp(Δ log L / α)`` magnifies
  any error in the loss, so this matters);
* over the two fits' common compute range (its ends and geometric middle), from both fits:
  the report's "Block AttnRes matches the baseline trained with 1.25x more compute" is this,
  read at 5.6 PFLOP/s-days.

Intervals: a paired bootstrap over seeds. Each draw resamples, at every size, the seeds with
replacement, the same seeds for every family (a seed fixes the data order for all of them, so
their losses co-vary), rescales each resampled mean's deviation by ``sqrt(n / (n-1))`` (the
plain bootstrap's variance of a mean is ``(n-1)/n`` of the usual unbiased estimate, half of it
with 2 seeds), refits every family and recomputes every quantity; the interval is the draws'
central ``level`` quantiles. It covers seed-to-seed noise only, not the choice of the power
law's form or of the sizes; with 2 seeds per size the seed spread is itself poorly known,
so read the intervals as indicative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .scaling_grid import ScalingData
from .stats import log_linear_fit

__all__ = ["PowerLaw", "Estimate", "FamilyFit", "Comparison", "ScalingFit", "compute_multiplier", "bootstrap_means",
           "fit_scaling"]


@dataclass(frozen=True)
class PowerLaw:
    """``L = A · C^−alpha``."""

    A: float
    alpha: float

    def loss(self, compute: float | np.ndarray) -> float | np.ndarray:
        return self.A * np.power(compute, -self.alpha)

    def compute_for(self, loss: float | np.ndarray) -> float | np.ndarray:
        """The compute at which this law reaches ``loss`` (``nan`` unless alpha > 0)."""
        return np.exp(_log_compute_for(math.log(self.A), self.alpha, np.log(loss)))

    def text(self) -> str:
        return f"{self.A:.3f}·C^−{self.alpha:.3f}"


def _log_compute_for(log_a, alpha, log_loss):
    """``log C`` at which ``log L = log A - alpha log C`` reaches ``log_loss``; nan where alpha <= 0
    (a loss that does not fall with compute has no compute to offer)."""
    alpha = np.asarray(alpha, dtype=float)
    safe = np.where(alpha > 0, alpha, np.nan)
    return (np.asarray(log_a) - np.asarray(log_loss)) / safe


def compute_multiplier(reference: PowerLaw, loss: float | np.ndarray, compute: float | np.ndarray) -> float | np.ndarray:
    """How many times ``compute`` the ``reference`` law needs to reach ``loss``."""
    return reference.compute_for(loss) / np.asarray(compute)


@dataclass(frozen=True)
class Estimate:
    """A point estimate and its bootstrap interval (``None`` without one, e.g. a single seed)."""

    value: float
    low: float | None = None
    high: float | None = None

    def text(self, fmt: str = ".3f", suffix: str = "") -> str:
        v = f"{self.value:{fmt}}{suffix}"
        return v if self.low is None else f"{v} [{self.low:{fmt}}, {self.high:{fmt}}]"

    def excludes(self, x: float) -> bool:
        """Whether the interval lies wholly on one side of ``x``."""
        return self.low is not None and (self.low > x or self.high < x)


@dataclass(frozen=True)
class FamilyFit:
    """One family's power law with intervals on ``A`` and ``alpha``."""

    family: str
    law: PowerLaw
    A: Estimate
    alpha: Estimate


@dataclass(frozen=True)
class Comparison:
    """A family against the reference: ``delta_at_size`` (mean loss minus the reference's,
    paired by seed), ``multiplier_at_size``, and ``multiplier_common`` as ``(C, estimate)`` at
    the low end, geometric middle and high end of the fits' common compute range (empty when
    the ranges do not overlap)."""

    family: str
    delta_at_size: list[Estimate]
    multiplier_at_size: list[Estimate]
    multiplier_common: list[tuple[float, Estimate]]


@dataclass(frozen=True)
class ScalingFit:
    """Everything :func:`fit_scaling` computes, keyed by family."""

    data: ScalingData
    level: float
    n_boot: int
    fits: dict[str, FamilyFit]
    comparisons: dict[str, Comparison]


def bootstrap_means(data: ScalingData, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """``[f, b, s]``: mean loss per family and size in ``n_boot`` paired, rescaled seed
    resamples (see the module docstring). Needs at least 2 seeds."""
    n = len(data.seeds)
    if n < 2:
        raise ValueError("a bootstrap over seeds needs at least 2 seeds per size")
    picks = rng.integers(0, n, size=(n_boot, len(data.sizes), n))
    sizes = np.arange(len(data.sizes))[None, :, None]
    means = data.loss[:, sizes, picks].mean(axis=-1)  # [f, b, s]
    center = data.mean_loss[:, None, :]
    return center + math.sqrt(n / (n - 1)) * (means - center)


def _estimate(values: np.ndarray, boot: bool, level: float) -> Estimate:
    """``values[0]``: the point estimate; ``values[1:]``: its bootstrap draws (when ``boot``)."""
    point = float(values[0])
    if not boot:
        return Estimate(point)
    draws = values[1:]
    finite = draws[np.isfinite(draws)]
    if finite.size < 0.9 * draws.size:  # too many draws without an answer (e.g. a flat reference fit)
        return Estimate(point, math.nan, math.nan)
    lo, hi = np.quantile(finite, [(1 - level) / 2, (1 + level) / 2])
    return Estimate(point, float(lo), float(hi))


def _common_points(c_ref: np.ndarray, c_fam: np.ndarray) -> list[float]:
    lo, hi = max(c_ref.min(), c_fam.min()), min(c_ref.max(), c_fam.max())
    return [] if lo > hi else [float(lo), float(math.sqrt(lo * hi)), float(hi)]


def _comparison(data: ScalingData, f: int, log_a: np.ndarray, alpha: np.ndarray, means: np.ndarray,
                level: float, boot: bool) -> Comparison:
    """``log_a``, ``alpha``: ``[f, 1 + B]`` (the point fit first, then the draws); ``means``:
    ``[f, 1 + B, s]`` likewise."""
    log_c = np.log(data.compute)

    def est(values: np.ndarray) -> Estimate:
        return _estimate(values, boot, level)

    delta = means[f] - means[0]
    # anchored at the reference's own point at each size, moved along its fitted slope: the
    # reference's misfit at that size does not enter, only the paired loss ratio and the slope
    ratio = _log_compute_for(np.log(means[0]), alpha[0][:, None], np.log(means[f]))
    mult = np.exp(ratio + log_c[0] - log_c[f])
    common = []
    for c in _common_points(data.compute[0], data.compute[f]):
        log_loss = log_a[f] - alpha[f] * math.log(c)
        common.append((c, est(np.exp(_log_compute_for(log_a[0], alpha[0], log_loss) - math.log(c)))))
    return Comparison(data.families[f], [est(delta[:, s]) for s in range(len(data.sizes))],
                      [est(mult[:, s]) for s in range(len(data.sizes))], common)


def fit_scaling(data: ScalingData, level: float = 0.95, n_boot: int = 2000, seed: int = 0) -> ScalingFit:
    """Fit every family of ``data`` and compare each with the reference (see the module
    docstring); ``n_boot`` paired bootstrap draws over seeds give intervals at ``level``
    (none with a single seed). Deterministic for a given ``seed``."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1); got {level!r}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise ValueError(f"n_boot must be an integer >= 1; got {n_boot!r}")
    boot = len(data.seeds) >= 2
    means = data.mean_loss[:, None, :]
    if boot:
        means = np.concatenate([means, bootstrap_means(data, n_boot, np.random.default_rng(seed))], axis=1)
    log_a, alpha = log_linear_fit(np.log(data.compute)[:, None, :], np.log(means))  # [f, 1 + B]
    fits = {family: FamilyFit(family, PowerLaw(float(np.exp(log_a[f, 0])), float(alpha[f, 0])),
                              _estimate(np.exp(log_a[f]), boot, level), _estimate(alpha[f], boot, level))
            for f, family in enumerate(data.families)}
    comparisons = {data.families[f]: _comparison(data, f, log_a, alpha, means, level, boot)
                   for f in range(1, len(data.families))}
    return ScalingFit(data, level, n_boot if boot else 0, fits, comparisons)
