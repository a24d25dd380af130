"""Effect sizes with their uncertainty for the no-free-lunch grid, beside the decided-cell
rule of :mod:`.findings`.

The rule calls a cell when all of its ``n`` paired seeds agree in sign. With no effect at
all (per-seed gaps independent and symmetric about 0, e.g. seed noise alone) that happens
with probability ``2 · 2^−n``: 25 % with 3 seeds. A grid of many cells therefore "decides"
about a quarter of its null cells, and the count of decided cells says little. Here each
cell gets instead the mean paired gap on the log scale with a Student-t interval and the
paired t-test's two-sided p-value, shown as a ratio: ``10^gap − 1`` (+35 % = AttnRes's loss
is 1.35x the standard residual's).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from attnres.experiments.stats import t_interval

__all__ = ["sign_rule_pass_rate", "PairedEffect", "paired_effect"]


def sign_rule_pass_rate(n_seeds: int) -> float:
    """Probability that ``n_seeds`` independent gaps, each symmetric about 0 with no mass at
    0, all have the same sign: ``2 · (1/2)^n`` (the decided-cell rule's false-call rate)."""
    if isinstance(n_seeds, bool) or not isinstance(n_seeds, int) or n_seeds < 1:
        raise ValueError(f"n_seeds must be an integer >= 1; got {n_seeds!r}")
    return 2.0 * 0.5**n_seeds


@dataclass(frozen=True)
class PairedEffect:
    """Mean of ``n`` paired log10 gaps with its ``level`` t-interval and two-sided p-value
    (``None`` with fewer than 2 finite gaps or no spread)."""

    n: int
    mean: float
    low: float | None
    high: float | None
    p_value: float | None

    @staticmethod
    def _pct(gap: float) -> str:
        return f"{(10**gap - 1) * 100:+.0f} %"

    def text(self) -> str:
        """``+35 % [+11, +64] p=0.012``: the loss ratio minus 1, its interval and p."""
        if self.low is None:
            return self._pct(self.mean) + f" (n={self.n})"
        lo, hi = ((10**x - 1) * 100 for x in (self.low, self.high))
        return f"{self._pct(self.mean)} [{lo:+.0f}, {hi:+.0f}] p={self.p_value:.2g}"

    def excludes_zero(self) -> int:
        """+1 / -1 when the interval lies above / below 0, else 0."""
        if self.low is None:
            return 0
        return 1 if self.low > 0 else -1 if self.high < 0 else 0


def paired_effect(gaps: Iterable[float], level: float = 0.95) -> PairedEffect | None:
    """The :class:`PairedEffect` of per-seed ``gaps`` (``None`` when no gap is finite, e.g.
    diverged runs)."""
    d = [g for g in gaps if math.isfinite(g)]
    if not d:
        return None
    t = t_interval(d, level)
    return PairedEffect(t.n, t.mean, t.low, t.high, t.p_value)
