"""Statistics of experiment results: mean ± sample std over seeds, power-law fits in log space."""

from __future__ import annotations

import math
import statistics

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
