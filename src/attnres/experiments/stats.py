"""Statistics of experiment results: mean ± sample std over seeds, power-law fits in log space,
Student-t intervals over seeds (pooled where a design allows), t-test power and Holm's
multiple-comparison adjustment."""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

import numpy as np


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (``ddof = 1``; ``None`` for a single value)."""
    if not values:
        raise ValueError("mean_std needs at least one value")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def log_linear_fit(log_x: np.ndarray, log_y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(log A, alpha)`` of ``y = A * x^-alpha`` by least squares in log space, over the last
    axis, for any leading (batch) axes: closed form, so that thousands of bootstrap fits cost
    one array operation. ``log_x`` broadcasts against ``log_y``."""
    log_x, log_y = np.broadcast_arrays(np.asarray(log_x, dtype=float), np.asarray(log_y, dtype=float))
    dx = log_x - log_x.mean(axis=-1, keepdims=True)
    slope = (dx * (log_y - log_y.mean(axis=-1, keepdims=True))).sum(axis=-1) / (dx**2).sum(axis=-1)
    return log_y.mean(axis=-1) - slope * log_x.mean(axis=-1), -slope


def fit_power_law(compute: list[float], loss: list[float]) -> tuple[float, float]:
    """``(A, alpha)`` of ``L = A * C^-alpha``, fitted by least squares in log space
    (``log L = log A - alpha log C``). Needs at least two distinct positive compute values and
    positive losses."""
    c, l = np.asarray(compute, dtype=float), np.asarray(loss, dtype=float)
    if c.shape != l.shape or len(np.unique(c)) < 2 or (c <= 0).any() or (l <= 0).any():
        raise ValueError(f"fit_power_law needs >= 2 distinct positive compute values and as many positive losses; "
                         f"got compute={list(compute)!r}, loss={list(loss)!r}")
    log_a, alpha = log_linear_fit(np.log(c), np.log(l))
    return float(math.exp(log_a)), float(alpha)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of strings."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


# -- seed-level inference: Student-t intervals, power, multiple comparisons -------------------
# Every experiment reports a handful of seeds. With n seeds a mean's interval must come from
# Student's t with n - 1 degrees of freedom (or more, where a design pools the seed variance of
# several cells): a bootstrap over 2 or 3 seeds resamples from 2 or 3 values and covers far
# less often than it says (about 61 % for a nominal 95 % with 2 seeds).
@dataclass(frozen=True)
class TInterval:
    """A mean of ``n`` values with its Student-t interval at ``level`` and the two-sided
    p-value of the t-test against ``null``. ``se``: the standard error; ``df``: the degrees of
    freedom of the variance estimate (``n - 1``, or more when pooled). Without a spread (one
    value, or identical ones, and no pooled estimate) ``se``, ``low``, ``high`` and
    ``p_value`` are ``None``."""

    n: int
    mean: float
    se: float | None
    df: int | None
    low: float | None
    high: float | None
    p_value: float | None
    level: float = 0.95
    null: float = 0.0

    def text(self, fmt: str = "+.4f", suffix: str = "") -> str:
        """``-0.0318 [-0.0505, -0.0131]`` (or the mean alone without an interval)."""
        v = f"{self.mean:{fmt}}{suffix}"
        return v if self.low is None else f"{v} [{self.low:{fmt}}, {self.high:{fmt}}]"

    def excludes(self, x: float) -> bool:
        """Whether the interval lies wholly on one side of ``x``."""
        return self.low is not None and (self.low > x or self.high < x)


def t_interval(values, level: float = 0.95, null: float = 0.0, sd: float | None = None,
               df: int | None = None) -> TInterval:
    """The mean of ``values`` with its Student-t interval and p-value against ``null``.

    ``sd`` and ``df``: a standard deviation of one value estimated elsewhere (pooled over the
    cells of a design, :func:`pooled_sd`) with its degrees of freedom; by default the sample
    standard deviation of ``values`` with ``n - 1``."""
    from scipy import stats

    vals = [float(v) for v in values]
    if not vals or not all(math.isfinite(v) for v in vals):
        raise ValueError(f"t_interval needs at least one value, all finite; got {vals!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1); got {level!r}")
    n, mean = len(vals), statistics.fmean(vals)
    if sd is None:
        sd, df = (statistics.stdev(vals), n - 1) if n > 1 else (None, None)
    elif df is None or df < 1:
        raise ValueError(f"a given sd needs its degrees of freedom df >= 1; got {df!r}")
    if not sd:
        return TInterval(n, mean, None, None, None, None, None, level, null)
    se = sd / math.sqrt(n)
    half = float(stats.t.ppf((1 + level) / 2, df)) * se
    p = float(2 * stats.t.sf(abs(mean - null) / se, df))
    return TInterval(n, mean, se, df, mean - half, mean + half, p, level, null)


def mean_difference(a, b, sd: float, df: int, level: float = 0.95) -> TInterval:
    """``mean(a) - mean(b)`` of two independent groups of values with its Student-t interval
    and p-value against 0, from a standard deviation ``sd`` of one value on ``df`` degrees of
    freedom (pooled over a design's cells, :func:`pooled_sd`)."""
    a, b = [float(v) for v in a], [float(v) for v in b]
    if not a or not b:
        raise ValueError("mean_difference needs at least one value in each group")
    diff = statistics.fmean(a) - statistics.fmean(b)
    # t_interval of one value whose sd is the difference's standard error
    return dataclasses.replace(t_interval([diff], level, sd=sd * math.sqrt(1 / len(a) + 1 / len(b)), df=df),
                               n=len(a) + len(b))


def pooled_sd(groups) -> tuple[float, int]:
    """``(sd, df)``: the standard deviation of one value pooled over ``groups`` (each a list of
    values that share a mean, e.g. the seeds of one grid cell): ``sqrt(Σ (n_i - 1) s_i² /
    Σ (n_i - 1))`` with ``Σ (n_i - 1)`` degrees of freedom. Groups of one value add nothing."""
    ss, df = 0.0, 0
    for g in groups:
        g = [float(v) for v in g]
        if len(g) > 1:
            m = statistics.fmean(g)
            ss += sum((v - m) ** 2 for v in g)
            df += len(g) - 1
    if df == 0:
        raise ValueError("pooled_sd needs a group of at least 2 values")
    return math.sqrt(ss / df), df


def t_test_power(effect: float, se: float, df: int, level: float = 0.95) -> float:
    """Power of the two-sided t-test at ``1 - level`` to tell a true difference ``effect``
    from 0 when its estimate has standard error ``se`` on ``df`` degrees of freedom
    (noncentral t)."""
    from scipy import stats

    crit = stats.t.ppf((1 + level) / 2, df)
    nc = effect / se
    # P(T' > crit) + P(T' < -crit), the second as P(T' > crit) at -nc: scipy's nct.cdf far
    # in the lower tail returns nan for some (df, nc)
    return float(stats.nct.sf(crit, df, nc) + stats.nct.sf(crit, df, -nc))


def detectable_effect(se: float, df: int, level: float = 0.95, power: float = 0.8) -> float:
    """The smallest true difference the two-sided t-test at ``1 - level`` finds with
    probability ``power``, for an estimate with standard error ``se`` on ``df`` degrees of
    freedom."""
    from scipy import optimize

    hi = se
    while t_test_power(hi, se, df, level) < power:
        hi *= 2
    return float(optimize.brentq(lambda e: t_test_power(e, se, df, level) - power, 0.0, hi, xtol=se * 1e-6))


def holm(p_values) -> list[float]:
    """Holm's step-down adjustment of ``p_values`` (family-wise error over all of them; a
    ``None`` stays ``None`` and does not count): reject where the adjusted p < alpha."""
    p_values = list(p_values)
    ps = [(p, i) for i, p in enumerate(p_values) if p is not None]
    out: list[float | None] = [None] * len(p_values)
    running, m = 0.0, len(ps)
    for rank, (p, i) in enumerate(sorted(ps)):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out
