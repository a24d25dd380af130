"""Statistics of experiment results: mean ± sample std over seeds, power-law fits."""

from __future__ import annotations

import math
import statistics

import numpy as np


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (``ddof = 1``; ``None`` for a single value)."""
    if not values:
        raise ValueError("mean_std needs at least one value")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def fit_power_law(compute: list[float], loss: list[float]) -> tuple[float, float]:
    """``(A, alpha)`` of ``L = A * C^-alpha``, fitted by least squares in log space
    (``log L = log A - alpha log C``) with ``scipy.optimize.curve_fit``. Needs at least
    two distinct positive compute values and positive losses."""
    import warnings

    from scipy.optimize import OptimizeWarning, curve_fit

    c, l = np.asarray(compute, dtype=float), np.asarray(loss, dtype=float)
    if c.shape != l.shape or len(np.unique(c)) < 2 or (c <= 0).any() or (l <= 0).any():
        raise ValueError(f"fit_power_law needs >= 2 distinct positive compute values and as many positive losses; "
                         f"got compute={list(compute)!r}, loss={list(loss)!r}")
    with warnings.catch_warnings():  # two points fit exactly: no covariance, which we do not use
        warnings.simplefilter("ignore", OptimizeWarning)
        (log_a, alpha), _ = curve_fit(lambda x, log_a, alpha: log_a - alpha * x, np.log(c), np.log(l), p0=(0.0, 0.05))
    return float(math.exp(log_a)), float(alpha)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of strings."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
