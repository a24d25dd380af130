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

Intervals: Student t over seeds, with the seed variance pooled over every (family, size)
cell of the grid (``F·S·(n−1)`` degrees of freedom: 12 for 3 families x 4 sizes x 2 seeds),
so that two seeds per cell still give usable intervals (a bootstrap over 2 seeds reduces to
mean ± 0.71·|d₀ − d₁| and covers about 61 % of the time, not 95 %). The families' seed noises
are treated as independent: where a seed's noise is in part shared by the families (a seed
fixes the data order of all of them) the intervals of their differences are conservative.
Each mean has variance ``σ²/n``; a fit's coefficients and predictions take theirs from the
least-squares weights. The multiplier's intervals carry the loss difference's noise through
the reference's fitted slope, held at its point value. Seed noise only: not the choice of
the power law's form or of the sizes. :func:`detectable_difference` is the smallest loss
difference at one size the grid finds with 80 % power.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .scaling_grid import ScalingData
from ..stats import detectable_effect, log_linear_fit, pooled_sd

__all__ = ["PowerLaw", "Estimate", "FamilyFit", "Comparison", "ScalingFit", "compute_multiplier", "seed_noise",
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
    """A point estimate with its t-interval and, for a difference, the two-sided p-value
    against no difference (``None`` without them, e.g. a single seed)."""

    value: float
    low: float | None = None
    high: float | None = None
    p_value: float | None = None

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
    """Everything :func:`fit_scaling` computes, keyed by family. ``sd_log`` / ``sd_loss``:
    the pooled seed standard deviation of one run's log loss / loss, on ``df`` degrees of
    freedom (``None`` with one seed)."""

    data: ScalingData
    level: float
    sd_log: float | None
    sd_loss: float | None
    df: int | None
    fits: dict[str, FamilyFit]
    comparisons: dict[str, Comparison]

    def detectable_difference(self, power: float = 0.8) -> float | None:
        """The smallest loss difference between two families at one size that the two-sided
        t-test at ``1 - level`` finds with probability ``power`` (``None`` with one seed or no
        seed spread)."""
        if not self.sd_loss:
            return None
        return detectable_effect(self.sd_loss * math.sqrt(2 / len(self.data.seeds)), self.df, self.level, power)


def seed_noise(values: np.ndarray) -> tuple[float, int]:
    """``(sd, df)``: the seed standard deviation of ``values[..., k]`` pooled over every cell of
    the leading axes (each cell's seeds share one mean)."""
    return pooled_sd(values.reshape(-1, values.shape[-1]).tolist())


def _t(level: float, df: int | None) -> float | None:
    from scipy import stats

    return None if df is None else float(stats.t.ppf((1 + level) / 2, df))


def _estimate(value: float, se: float | None, t: float | None, df: int | None, p_test: bool = False,
              transform=lambda v: v) -> Estimate:
    """``transform(value ± t·se)`` (an increasing map), with the p-value of ``value`` against 0."""
    if se is None or not math.isfinite(value) or not math.isfinite(se):
        return Estimate(float(transform(value)))
    p = None
    if p_test:
        from scipy import stats

        p = float(2 * stats.t.sf(abs(value) / se, df)) if se > 0 else None
    return Estimate(float(transform(value)), float(transform(value - t * se)), float(transform(value + t * se)), p)


def _weights(log_c: np.ndarray, at: float) -> np.ndarray:
    """Least-squares weights ``w`` with ``ŷ(at) = w · y`` for a line fitted to ``(log_c, y)``."""
    dx = log_c - log_c.mean()
    return 1 / len(log_c) + dx * (at - log_c.mean()) / (dx**2).sum()


def _common_points(c_ref: np.ndarray, c_fam: np.ndarray) -> list[float]:
    lo, hi = max(c_ref.min(), c_fam.min()), min(c_ref.max(), c_fam.max())
    return [] if lo > hi else [float(lo), float(math.sqrt(lo * hi)), float(hi)]


def _family_fit(data: ScalingData, f: int, se_mean: float | None, t: float | None, df: int | None) -> FamilyFit:
    log_c, log_l = np.log(data.compute[f]), np.log(data.mean_loss[f])
    log_a, alpha = log_linear_fit(log_c, log_l)
    dx = log_c - log_c.mean()
    se_alpha = None if se_mean is None else se_mean / math.sqrt(float((dx**2).sum()))
    se_log_a = None if se_mean is None else se_mean * math.sqrt(float((_weights(log_c, 0.0) ** 2).sum()))
    return FamilyFit(data.families[f], PowerLaw(float(math.exp(log_a)), float(alpha)),
                     _estimate(float(log_a), se_log_a, t, df, transform=math.exp),
                     _estimate(float(alpha), se_alpha, t, df))


def _comparison(data: ScalingData, f: int, fits: dict[str, FamilyFit], sd_log: float | None, sd_loss: float | None,
                t: float | None, df: int | None) -> Comparison:
    n = len(data.seeds)
    se_log_mean = None if sd_log is None else sd_log / math.sqrt(n)
    se_diff = None if sd_log is None else se_log_mean * math.sqrt(2)
    ref = fits[data.reference].law
    mean = data.mean_loss
    deltas, mults = [], []
    for s in range(len(data.sizes)):
        deltas.append(_estimate(float(mean[f, s] - mean[0, s]), None if sd_loss is None else sd_loss * math.sqrt(2 / n),
                                t, df, p_test=True))
        # anchored at the reference's own point at this size, moved along its fitted slope: the
        # reference's misfit at that size does not enter, only the loss ratio and the slope
        gain = float(np.log(mean[0, s]) - np.log(mean[f, s]))  # > 0: the family's loss is lower
        shift = math.log(data.compute[0, s]) - math.log(data.compute[f, s])
        mults.append(_estimate(gain, se_diff, t, df, transform=lambda g, shift=shift: math.exp(g / ref.alpha + shift)))
    common = []
    log_c_ref, log_c_fam = np.log(data.compute[0]), np.log(data.compute[f])
    fam = fits[data.families[f]].law
    for c in _common_points(data.compute[0], data.compute[f]):
        at = math.log(c)
        gain = float(math.log(ref.loss(c)) - math.log(fam.loss(c)))
        se = None if se_log_mean is None else se_log_mean * math.sqrt(
            float((_weights(log_c_ref, at) ** 2).sum() + (_weights(log_c_fam, at) ** 2).sum()))
        common.append((c, _estimate(gain, se, t, df, transform=lambda g: math.exp(g / ref.alpha))))
    return Comparison(data.families[f], deltas, mults, common)


def fit_scaling(data: ScalingData, level: float = 0.95) -> ScalingFit:
    """Fit every family of ``data`` and compare each with the reference (see the module
    docstring); Student-t intervals at ``level`` from the seed variance pooled over the grid
    (none with a single seed)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1); got {level!r}")
    if len(data.seeds) >= 2:
        sd_log, df = seed_noise(np.log(data.loss))
        sd_loss, _ = seed_noise(data.loss)
    else:
        sd_log = sd_loss = df = None
    t = _t(level, df)
    se_mean = None if sd_log is None else sd_log / math.sqrt(len(data.seeds))
    fits = {family: _family_fit(data, f, se_mean, t, df) for f, family in enumerate(data.families)}
    comparisons = {data.families[f]: _comparison(data, f, fits, sd_log, sd_loss, t, df)
                   for f in range(1, len(data.families))}
    return ScalingFit(data, level, sd_log, sd_loss, df, fits, comparisons)
