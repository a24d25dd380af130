"""The report section of ``attnres experiment multiplier`` (:mod:`.multiplier`): the runs, the
per-seed multipliers of Block and Full AttnRes with their mean and Student-t interval and the
power to tell 1.1x from 1.25x, deep against shallow at equal compute, and ``multiplier.png``
(loss against compute: each seed's standard ladder and AttnRes's points). Works on a partial
grid: a comparison uses the seeds whose runs it needs have all finished, and says how many.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from ...output_paths import save_figure_atomically
from .multiplier import ladder_loss, seed_multipliers
from ..stats import TInterval, detectable_effect, markdown_table, t_interval, t_test_power

__all__ = ["REPORT_MULTIPLIER", "Comparison", "compare_arms", "complete_seeds", "multiplier_section"]

#: The report's reading (Table 2 fits, at 5.6 PFLOP/s-days): Block AttnRes ~ 1.25x.
REPORT_MULTIPLIER = 1.25
#: The two multipliers the grid should tell apart: "about the order of the report" vs less.
POWER_PAIR = (1.10, 1.25)
_NAMES = {"baseline": "standard", "block": "Block AttnRes", "full": "Full AttnRes"}
_COMPUTE = "pflops_days"


def _shape(r: dict[str, Any]) -> str:
    return str((r.get("coords") or {}).get("shape", "model"))


def _label(r: dict[str, Any]) -> str:
    c = r.get("coords") or {}
    block = f", S = {c['S']} (N = {c['N']})" if "S" in c else ""
    return f"{_shape(r)} {_NAMES.get(r['family'], r['family'])}{block}"


class Comparison:
    """One arm against one standard ladder over the seeds that have both complete:
    ``multipliers`` (seed → m), ``log_mean`` (t-interval of ln m, p against 0: multipliers
    are ratios, so they are averaged geometrically and the interval, mapped back by exp, stays
    positive), ``gap`` (seed → arm's loss minus the ladder's at the arm's compute; its
    t-interval ``gap_mean``), ``flagged`` (seeds read outside the ladder or from its fit),
    ``incomplete`` (seeds left out); ``arm_shape`` and ``ladder``: the two shapes."""

    def __init__(self, arm: str, arm_shape: str, ladder: str, runs: list[dict[str, Any]],
                 rungs: list[dict[str, Any]], expected_rungs: int) -> None:
        self.arm, self.arm_shape, self.ladder = arm, arm_shape, ladder
        by_seed: dict[int, list[dict[str, Any]]] = {}
        for r in rungs:
            by_seed.setdefault(int(r["seed"]), []).append(r)
        complete = {k for k, rs in by_seed.items() if len(rs) >= max(2, expected_rungs)}
        self.incomplete = sorted({int(r["seed"]) for r in runs} - complete)
        runs = [r for r in runs if int(r["seed"]) in complete]
        found = seed_multipliers([r for r in rungs if int(r["seed"]) in complete], runs, _COMPUTE)
        self.multipliers = {k: m for k, (m, _) in found.items()}
        self.flagged = {k: ("extrapolated" if c.extrapolated else c.method) for k, (_, c) in found.items()
                        if c.extrapolated or c.method != "interpolated"}
        self.gap = {}
        for r in runs:
            ladder_pts = [(x[_COMPUTE], x["val_loss"]) for x in by_seed[int(r["seed"])]]
            self.gap[int(r["seed"])] = r["val_loss"] - ladder_loss(ladder_pts, r[_COMPUTE])[0]
        self.log_mean = t_interval([math.log(m) for m in self.multipliers.values()]) if self.multipliers else None
        self.gap_mean = t_interval(list(self.gap.values())) if self.gap else None

    @property
    def own_shape(self) -> bool:
        """Whether the arm is of the ladder's shape (else: a comparison across shapes)."""
        return self.arm_shape == self.ladder

    def text(self) -> str:
        """``1.123× [1.051, 1.200]``: the geometric mean and its interval."""
        t = self.log_mean
        return f"{math.exp(t.mean):.3f}×" + ("" if t.low is None else f" [{math.exp(t.low):.3f}, {math.exp(t.high):.3f}]")

    def power(self) -> float | None:
        """Power to tell the two multipliers of :data:`POWER_PAIR` apart (a ratio of
        1.25 / 1.1 on the log scale) at this comparison's seed spread and number of seeds
        (two-sided t-test at 5 %)."""
        if self.log_mean is None or self.log_mean.se is None:
            return None
        return t_test_power(math.log(POWER_PAIR[1] / POWER_PAIR[0]), self.log_mean.se, self.log_mean.df)

    def detectable(self) -> float | None:
        """The smallest ratio of two multipliers found with 80 % power at this seed spread."""
        if self.log_mean is None or self.log_mean.se is None:
            return None
        return math.exp(detectable_effect(self.log_mean.se, self.log_mean.df))


def compare_arms(records: list[dict[str, Any]]) -> list[Comparison]:
    """Every AttnRes arm against its own shape's standard ladder, then every arm of each
    shape (and its standard model at AttnRes's budget) against the other shapes' ladders:
    deep against shallow at equal compute."""
    shapes = list(dict.fromkeys(_shape(r) for r in records))
    ladders = {s: [r for r in records if _shape(r) == s and r["family"] == "baseline"] for s in shapes}
    expected = {s: len({r["variant"] for r in ladders[s]}) for s in shapes}
    arms: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r["family"] != "baseline":
            arms.setdefault(r["variant"], []).append(r)
    out = [Comparison(_label(rs[0]), s, s, rs, ladders[s], expected[s])
           for s in shapes for rs in arms.values() if _shape(rs[0]) == s and ladders[s]]
    for s in shapes:  # the other shapes at equal compute
        at_budget = [r for r in ladders[s] if (r.get("coords") or {}).get("budget") == 1.0]
        mine = [rs for rs in arms.values() if _shape(rs[0]) == s] + ([at_budget] if at_budget else [])
        for other in shapes:
            if other != s and ladders[other]:
                out += [Comparison(_label(rs[0]), s, other, rs, ladders[other], expected[other]) for rs in mine]
    return out


# -- tables ------------------------------------------------------------------------------------
def _runs_table(records: list[dict[str, Any]]) -> str:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(r["variant"], []).append(r)
    base = {_shape(r): r["flops_per_token"] for r in records if r["family"] == "baseline"}
    rows = []
    for name, rs in groups.items():
        r0 = rs[0]
        losses = [r["val_loss"] for r in rs]
        loss = f"{statistics.fmean(losses):.4f}" + (f" ± {statistics.stdev(losses):.4f}" if len(rs) > 1 else "")
        passes = [r.get("data_passes") for r in rs]
        most = max((p for p in passes if p is not None), default=None)
        passes_txt = "unknown" if most is None else f"{most:.3g}" + (" **(repeats data)**" if most > 1 else "")
        ratio = r0["flops_per_token"] / base[_shape(r0)] if _shape(r0) in base else None
        c = r0.get("coords") or {}
        rows.append([name, _label(r0), f"{c.get('L_b', '–')}/{c.get('d', '–')}/{c.get('H', '–')}", f"{r0['steps']:,}",
                     f"{r0['non_embedding_params']:,}", "–" if ratio is None else f"{ratio:.3f}",
                     f"{r0[_COMPUTE]:.3e}", passes_txt, f"{loss} (n={len(rs)}; seeds {sorted(r['seed'] for r in rs)})"])
    return markdown_table(["run", "model", "L_b/d/H", "steps", "non-emb. params", "FLOPs/token × standard",
                           "C (PFLOP/s-days)", "passes over the data", "val loss (mean ± sd)"], rows)


def _interval(t: TInterval | None, fmt: str) -> str:
    if t is None:
        return "–"
    p = f"; p = {t.p_value:.2g} vs {t.null:g}" if t.p_value is not None else ""
    return f"{t.text(fmt)} (n = {t.n}{p})"


def _multiplier_table(comparisons: list[Comparison]) -> str:
    rows = []
    for c in comparisons:
        seeds = ", ".join(f"{k}: {m:.3f}" + ("*" if k in c.flagged else "") for k, m in c.multipliers.items())
        power, detect = c.power(), c.detectable()
        left = f" (seeds {', '.join(map(str, c.incomplete))} incomplete)" if c.incomplete else ""
        p = c.log_mean.p_value if c.log_mean is not None else None
        mean = "–" if c.log_mean is None else f"{c.text()} (n = {c.log_mean.n}" + (f"; p = {p:.2g} vs 1)" if p is not None else ")")
        rows.append([c.arm, f"{c.ladder} standard", seeds or "–", mean + left,
                     "–" if power is None else f"{power:.2f}", "–" if detect is None else f"×{detect:.3f}",
                     _interval(c.gap_mean, "+.4f")])
    return markdown_table(["model", "against the ladder of", "multiplier per seed", "geometric mean [95 % t-interval]",
                           f"power {POWER_PAIR[0]:g}× vs {POWER_PAIR[1]:g}×", "detectable ratio (80 %)",
                           "loss − ladder's at equal compute [95 %]"], rows)


def complete_seeds(records: list[dict[str, Any]], variants: list[str] | None = None) -> list[int]:
    """The seeds that have every run of the grid: every one of ``variants`` (default: every
    variant seen in ``records``)."""
    variants = set(variants) if variants is not None else {r["variant"] for r in records}
    by_seed: dict[int, set[str]] = {}
    for r in records:
        by_seed.setdefault(int(r["seed"]), set()).add(r["variant"])
    return sorted(k for k, v in by_seed.items() if v >= variants)


def _verdict(comparisons: list[Comparison], complete: list[int], planned: int | None) -> str:
    own = [c for c in comparisons if c.own_shape and c.log_mean is not None]
    n = len(complete)
    if not own:
        return ((f"**Partial: {n} of {planned} planned seeds complete.** " if planned else "")
                + "No comparison yet: no seed has an AttnRes run and its whole standard ladder.")
    status = (f"**Partial: {n} of {planned} planned seeds complete** (seeds {complete}; each comparison uses "
              "every seed whose runs it needs, n below)." if planned and n < planned else f"{n} seeds.")
    lines = [f"{status} Multiplier = standard compute reaching AttnRes's loss / AttnRes's compute (report: "
             f"{REPORT_MULTIPLIER:g}× for Block, Table 2 fits)."]
    for c in own:
        m = c.log_mean
        flagged = f"; {len(c.flagged)} seed(s) read outside the ladder" if c.flagged else ""
        if m.low is None:
            lines.append(f"- {c.arm}: {c.text()} over {m.n} seed(s): no interval yet{flagged}")
            continue
        where = ("above 1" if m.excludes(0.0) and m.low > 0 else "below 1" if m.excludes(0.0) else "including 1")
        report = "excludes" if m.excludes(math.log(REPORT_MULTIPLIER)) else "includes"
        power = c.power()
        lines.append(f"- {c.arm}: {c.text()} over {m.n} seeds, interval {where}, {report} the report's "
                     f"{REPORT_MULTIPLIER:g}×" + ("" if power is None else f" (power to tell {POWER_PAIR[0]:g}× from "
                                                 f"{POWER_PAIR[1]:g}×: {power:.2f})") + flagged)
    first = own[0].arm_shape
    for c in comparisons:  # the first shape's models against the other shapes' ladders
        g = c.gap_mean
        if c.own_shape or g is None or c.arm_shape != first:
            continue
        sign = ("no interval yet" if g.low is None else "lower" if g.excludes(0.0) and g.high < 0
                else "higher" if g.excludes(0.0) else "no difference resolved")
        lines.append(f"- {c.arm} against the {c.ladder} standard model at equal compute: loss {g.text('+.4f')} "
                     f"({sign}; n = {g.n}); multiplier {c.text()}")
    return "\n".join(lines)


# -- plot --------------------------------------------------------------------------------------
def _short_log_ticks(ax: Any) -> None:
    """Tick labels such as ``8e-08`` on a log compute axis spanning less than a decade (the
    ladder's 0.8-1.6 T): matplotlib then labels every minor tick in ``8×10^-8`` form, and
    ``7×10^-8 8×10^-8 9×10^-8 10^-7`` ran into one another. Where more than 5 minor ticks
    show, those of 1, 2, 3 and 5 alone are labelled."""
    from matplotlib.ticker import FuncFormatter

    lo, hi = ax.get_xlim()
    if hi / lo >= 10:  # a decade or more: labels at the powers of ten alone, as matplotlib draws them
        return
    crowded = len([t for t in ax.xaxis.get_minorticklocs() if lo <= t <= hi]) > 5

    def label(v: float, _: Any) -> str:
        mantissa = round(v / 10 ** math.floor(math.log10(v)), 6)
        return f"{v:.0e}" if not crowded or mantissa in (1, 2, 3, 5) else ""

    ax.xaxis.set_major_formatter(FuncFormatter(label))
    ax.xaxis.set_minor_formatter(FuncFormatter(label))


def _plot(records: list[dict[str, Any]], out: Path) -> str:
    from matplotlib.figure import Figure

    shapes = list(dict.fromkeys(_shape(r) for r in records))
    fig = Figure(figsize=(5.2 * len(shapes), 4))
    axes = fig.subplots(1, len(shapes), squeeze=False)
    colors = {"baseline": "k", "block": "C0", "full": "C3"}
    ladder_means = {}
    for s in shapes:
        rungs: dict[float, list[float]] = {}
        for r in records:
            if _shape(r) == s and r["family"] == "baseline":
                rungs.setdefault(r[_COMPUTE], []).append(r["val_loss"])
        ladder_means[s] = sorted((c, statistics.fmean(v)) for c, v in rungs.items())
    for ax, s in zip(axes[0], shapes):
        mine = [r for r in records if _shape(r) == s]
        for seed in sorted({r["seed"] for r in mine}):
            pts = sorted((r[_COMPUTE], r["val_loss"]) for r in mine if r["seed"] == seed and r["family"] == "baseline")
            if len(pts) > 1:  # one seed's ladder
                ax.plot(*zip(*pts), "-", color="0.7", lw=0.7)
        for family in ("baseline", "block", "full"):
            pts = [(r[_COMPUTE], r["val_loss"]) for r in mine if r["family"] == family]
            if pts:
                ax.plot(*zip(*pts), "o", ms=3.5, alpha=0.7, color=colors[family], label=f"{_NAMES[family]} (seeds)")
        if len(ladder_means[s]) > 1:
            ax.plot(*zip(*ladder_means[s]), "-", color="k", lw=1.5, label="standard ladder, mean over seeds")
        for other in shapes:
            if other != s and len(ladder_means[other]) > 1:
                ax.plot(*zip(*ladder_means[other]), "--", color="0.4", lw=1, label=f"{other} standard ladder, mean")
        ax.set(xscale="log", xlabel="training compute C (PFLOP/s-days)", ylabel="validation loss", title=f"{s} shape")
        _short_log_ticks(ax)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure_atomically(fig, out / "multiplier.png", "the grid's figure", dpi=120)
    return "multiplier.png"


def multiplier_section(records: list[dict[str, Any]], out: str | Path, planned_seeds: int | None = None,
                       variants: list[str] | None = None) -> str:
    """The report section for the multiplier ``records`` (``planned_seeds``: how many seeds
    the plan calls for, to mark fewer as partial; ``variants``: the grid's runs per seed, to
    tell a complete seed)."""
    out = Path(out)
    comparisons = compare_arms(records)
    repeats = sorted({r["variant"] for r in records if (r.get("data_passes") or 0) > 1})
    warn = (f"**Runs that saw data twice** (more than one pass over the training split): {', '.join(repeats)}.\n\n"
            if repeats else "")
    png = _plot(records, out)
    return (f"### Verdict\n\n{_verdict(comparisons, complete_seeds(records, variants), planned_seeds)}\n\n{warn}### Runs\n\n{_runs_table(records)}\n\n"
            "### Multipliers\n\nPer seed, the standard ladder's compute at AttnRes's final loss (linear in ln C, ln L "
            "between its rungs; * = read outside the ladder or from its power-law fit) over AttnRes's compute (each "
            "model's own FLOPs). Geometric mean over seeds with the 95 % Student-t interval of ln m (seeds are the "
            "replicates: each fixes the data order and initialisation of all its runs) and p against 1. Power: of the "
            f"two-sided t-test to tell {POWER_PAIR[0]:g}× from {POWER_PAIR[1]:g}× at these seeds' spread; detectable "
            "ratio: the smallest ratio of two multipliers found with 80 % power. Last column: loss minus the ladder's "
            "loss interpolated at the model's compute (< 0: better than the standard model at equal compute), with "
            "its t-interval over seeds.\n\n"
            f"{_multiplier_table(comparisons)}\n\n![loss against compute]({png})")
