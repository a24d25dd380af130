"""The scaling-law section of ``attnres experiment scaling``'s report (report §5.1, Table 2,
Fig. 4): the runs (missing ones marked), per-family fits with intervals beside Table 2, the
compute multiplier at each size and over the fits' common range, the report's per-size
losses beside ours, and ``scaling.png`` (Fig.-4-style, seeds as points, fits drawn; the
multiplier per size beside it). The numbers come from :mod:`.scaling_fit`; this module only
renders them, on a complete grid or, provisionally, on the complete sizes of a partial one.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from ...output_paths import save_figure_atomically
from .scaling_fit import PowerLaw, ScalingFit, compute_multiplier, fit_scaling
from .scaling_grid import (MIN_SIZES, ScalingGridError, finished_sizes, fittable_part, missing_runs, scaling_data,
                           size_key)
from ..stats import holm, markdown_table

__all__ = ["REPORT_TABLE2", "REPORT_TABLE2_SIZES", "REPORT_MULTIPLIER_AT", "scaling_section"]

#: Table 2 fits: L = A * C^-alpha, C in PFLOP/s-days, by family.
REPORT_TABLE2 = {"baseline": (1.891, 0.057), "block": (1.870, 0.058), "full": (1.865, 0.057)}
#: Table 2 rows: activated non-embedding parameters, tokens, L_b, d_model, and validation loss by family.
REPORT_TABLE2_SIZES = [
    ("194M", "38.7B", 12, 896, {"baseline": 1.931, "block": 1.909, "full": 1.899}),
    ("241M", "45.4B", 13, 960, {"baseline": 1.895, "block": 1.875, "full": 1.874}),
    ("296M", "62.1B", 14, 1024, {"baseline": 1.829, "block": 1.809, "full": 1.804}),
    ("436M", "87.9B", 16, 1168, {"baseline": 1.766, "block": 1.746, "full": 1.737}),
    ("528M", "119.0B", 17, 1264, {"baseline": 1.719, "block": 1.693, "full": 1.692}),
]
#: Where the report reads its "1.25x" (PFLOP/s-days).
REPORT_MULTIPLIER_AT = 5.6
_NAMES = {"baseline": "standard (PreNorm)", "block": "Block AttnRes", "full": "Full AttnRes"}


def _name(family: str) -> str:
    return _NAMES.get(family, family)


def report_multiplier(family: str) -> float | None:
    """The multiplier the report's Table 2 fits give ``family`` at 5.6 PFLOP/s-days."""
    if family not in REPORT_TABLE2 or family == "baseline":
        return None
    ref, fam = PowerLaw(*REPORT_TABLE2["baseline"]), PowerLaw(*REPORT_TABLE2[family])
    return float(compute_multiplier(ref, fam.loss(REPORT_MULTIPLIER_AT), REPORT_MULTIPLIER_AT))


# -- tables ------------------------------------------------------------------------------------
def _runs_table(records: list[dict[str, Any]], sizes: list[str], families: list[str],
                missing: list[tuple[str, str, int]]) -> str:
    by = {}
    for r in records:
        by.setdefault((size_key(r), r["family"]), []).append(r)
    gaps = {}
    for f, s, k in missing:
        gaps.setdefault((s, f), []).append(k)
    rows = []
    for s in sizes:
        for f in families:
            rs = [r for r in by.get((s, f), []) if (s, f) not in gaps or r["seed"] not in gaps[(s, f)]]
            miss = f"**missing: seed {', '.join(map(str, gaps[(s, f)]))}**" if (s, f) in gaps else ""
            if not rs:
                rows.append([s, _name(f), "–", "–", "–", "–", "–", miss])
                continue
            losses = [r["val_loss"] for r in rs]
            loss = f"{statistics.fmean(losses):.4f}" + (f" ± {statistics.stdev(losses):.4f}" if len(losses) > 1 else "")
            params = rs[0].get("non_embedding_params") or rs[0].get("params")
            rows.append([s, _name(f), _shape(rs[0]), f"{params:,}", f"{rs[0]['steps']:,}",
                         f"{rs[0]['pflops_days']:.3e}", f"{loss} (n={len(rs)})", miss])
    header = ["size", "model", "shape", "non-emb. params", "steps", "C (PFLOP/s-days)", "val loss", "missing runs"]
    if not gaps:  # (no run missing: no column of empty cells under an empty header)
        header, rows = header[:-1], [row[:-1] for row in rows]
    return markdown_table(header, rows)


def _shape(record: dict[str, Any]) -> str:
    """``L_b / d / H`` (and Block's S) from the record's grid coordinates, where it has them."""
    c = record.get("coords") or {}
    shape = "/".join(str(c[k]) for k in ("L_b", "d", "H") if k in c) or "–"
    return shape + (f", S = {c['S']}" if "S" in c else "")


def _fits_table(fit: ScalingFit) -> str:
    rows = []
    for f, ff in fit.fits.items():
        rep = REPORT_TABLE2.get(f)
        rows.append([_name(f), f"{rep[0]:.3f}·C^−{rep[1]:.3f}" if rep else "–", ff.law.text(),
                     ff.A.text(".3f"), ff.alpha.text(".4f")])
    return markdown_table(["model", "report (Table 2)", "ours: L = A·C^−α", "A [interval]", "α [interval]"], rows)


def _multiplier_tables(fit: ScalingFit) -> str:
    data = fit.data
    head = ["model"] + [f"{s} (C {c:.2e})" for s, c in zip(data.sizes, data.compute[0])]
    mult_rows, delta_rows = [], []
    adjusted = iter(holm([e.p_value for cmp in fit.comparisons.values() for e in cmp.delta_at_size]))
    for f, cmp in fit.comparisons.items():
        mult_rows.append([_name(f)] + [e.text(".2f", "×") for e in cmp.multiplier_at_size])
        delta_rows.append([_name(f)] + [e.text("+.4f") + _p_text(e.p_value, next(adjusted)) for e in cmp.delta_at_size])
    common_rows = []
    for f, cmp in fit.comparisons.items():
        rep = report_multiplier(f)
        cells = [f"{e.text('.2f', '×')} at {c:.2e}" for c, e in cmp.multiplier_common] or ["ranges do not overlap"]
        common_rows.append([_name(f), f"{rep:.2f}× at {REPORT_MULTIPLIER_AT:g}" if rep else "–", "; ".join(cells)])
    return ("**Compute multiplier at each size**: the compute at which the standard model reaches the model's mean loss "
            "(from its own mean loss and compute at that size, along its fitted slope), over the model's own compute "
            "(> 1: the model is worth that much more standard compute).\n\n"
            + markdown_table(head, mult_rows)
            + "\n\n**Over the fits' common compute range** (its low end, geometric middle and high end), from both fits:\n\n"
            + markdown_table(["model", "report (Table 2 fits)", "ours"], common_rows)
            + "\n\n**Loss difference at equal size** (model − standard; < 0: lower loss; p: two-sided t-test, "
            "then Holm-adjusted over all the cells of this table):\n\n"
            + markdown_table(head, delta_rows) + _detectable_text(fit))


def _p_text(p: float | None, adjusted: float | None) -> str:
    return "" if p is None else f" (p = {p:.2g}; Holm {adjusted:.2g})"


def _detectable_text(fit: ScalingFit) -> str:
    """The smallest loss difference at one size the grid finds with 80 % power, in nats and
    as a multiplier at the reference's slope."""
    d = fit.detectable_difference()
    if d is None:
        return ""
    alpha, loss = fit.fits[fit.data.reference].law.alpha, float(fit.data.mean_loss[0, -1])
    return (f"\n\nSmallest loss difference at one size this grid finds with 80 % power (two-sided, 5 %): "
            f"{d:.4f} nats, at the largest size a multiplier of {math.exp(d / loss / alpha):.2f}× (or "
            f"{math.exp(-d / loss / alpha):.2f}×) along the standard model's slope.")


def _report_sizes_table(fit: ScalingFit) -> str:
    families = [f for f in fit.data.families if f != fit.data.reference]
    rows = [[p, t, str(lb), str(d), f"{losses['baseline']:.3f}"]
            + [f"{losses[f]:.3f} ({losses[f] - losses['baseline']:+.3f})" if f in losses else "–" for f in families]
            for p, t, lb, d, losses in REPORT_TABLE2_SIZES]
    return markdown_table(["params", "tokens", "L_b", "d", "standard"] + [_name(f) for f in families], rows)


# -- plot --------------------------------------------------------------------------------------
def _plot(fit: ScalingFit, out: Path) -> str:
    from matplotlib.figure import Figure
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    data = fit.data
    fig = Figure(figsize=(10, 3.8))
    ax, bx = fig.subplots(1, 2)
    for f, family in enumerate(data.families):
        color = f"C{f}"
        xs = np.repeat(data.compute[f], len(data.seeds))
        ax.plot(xs, data.loss[f].ravel(), "o", ms=3.5, alpha=0.6, color=color)
        grid = np.geomspace(data.compute[f].min(), data.compute[f].max(), 50)
        ax.plot(grid, fit.fits[family].law.loss(grid), "-", color=color,
                label=f"{_name(family)}: {fit.fits[family].law.text()}")
        if f:
            m = fit.comparisons[family].multiplier_at_size
            low = [e.value - e.low if e.low is not None else 0 for e in m]
            high = [e.high - e.value if e.high is not None else 0 for e in m]
            bx.errorbar(data.compute[f], [e.value for e in m], yerr=[low, high], fmt="o-", color=color, capsize=3,
                        label=_name(family))
    ax.set(xscale="log", yscale="log", xlabel="training compute C (PFLOP/s-days)", ylabel="validation loss",
           title="loss vs compute: seeds (points), fits (lines)")
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):  # plain numbers on a narrow log axis
        axis(FormatStrFormatter("%.2f"))
    ax.legend(fontsize=7)
    bx.axhline(1.0, color="gray", lw=0.8)
    rep = report_multiplier("block")
    bx.axhline(rep, color="gray", ls="--", lw=0.8, label=f"report: Block {rep:.2f}×")
    bx.set(xscale="log", xlabel="training compute C (PFLOP/s-days)", ylabel="compute multiplier vs standard",
           title=f"multiplier per size ({fit.level:.0%} interval)" if fit.df else "multiplier per size")
    bx.legend(fontsize=7)
    for axes in (ax, bx):  # a narrow log x range labels every minor tick: they overlap
        axes.xaxis.set_minor_formatter(NullFormatter())
    fig.tight_layout()
    save_figure_atomically(fig, out / "scaling.png", "the grid's figure", dpi=120)
    return "scaling.png"


# -- the section -------------------------------------------------------------------------------
def _fit_text(records: list[dict[str, Any]], sizes: list[str], seeds: list[int], out: Path, level: float) -> str:
    """Fits, multipliers and the plot on the runs of ``records`` at ``sizes`` x ``seeds``."""
    data = scaling_data([r for r in records if size_key(r) in sizes and int(r["seed"]) in seeds])
    fit = fit_scaling(data, level=level)
    how = (f"Intervals: {fit.level:.0%} Student t over the {len(data.seeds)} seeds, the seed variance pooled over "
           f"every (model, size) cell: seed sd {fit.sd_loss:.4f} nats ({fit.sd_log:.2e} in log loss) on {fit.df} "
           "degrees of freedom; the families' seed noise treated as independent; seed noise only (see "
           "`attnres.experiments.grids.scaling_fit`)." if fit.df else "One seed: no intervals.")
    png = _plot(fit, out)
    return (f"### Fits (report Table 2)\n\n{how}\n\n{_fits_table(fit)}\n\n### Compute multiplier\n\n"
            f"{_multiplier_tables(fit)}\n\n### The report's Table 2 (its sizes; in brackets: − standard)\n\n"
            f"{_report_sizes_table(fit)}\n\n![scaling curves]({png})")


def scaling_section(records: list[dict[str, Any]], out: str | Path, expected: list[tuple[str, str]] | None = None,
                    level: float = 0.95) -> str:
    """The report section for the scaling ``records`` (``expected``: the grid's (family,
    size) pairs, to mark the runs not finished yet; its sizes with no finished run at all are
    named and left out). Fits need every family at every seed
    at ``MIN_SIZES`` sizes or more; a partial grid is fitted, marked provisional, on its
    largest complete part (:func:`~.scaling_grid.fittable_part`)."""
    out = Path(out)
    seeds = sorted({int(r["seed"]) for r in records})
    families = list(dict.fromkeys([f for f, _ in expected or []] + [r["family"] for r in records]))
    sizes = list(dict.fromkeys([s for _, s in expected or []] + [size_key(r) for r in records]))
    expected = expected or [(f, s) for f in families for s in sizes]
    text = "### Runs\n\n"
    # A size of the grid that no run has finished is left out rather than marked missing: the
    # grid was run on fewer sizes (said here); sizes that are partly done stay a partial grid.
    ran = finished_sizes(records)
    not_run = [s for s in sizes if s not in ran]
    if not_run and len(not_run) < len(sizes):
        text += (f"Sizes of the grid not run (no finished run): {', '.join(not_run)}. The grid below is the "
                 f"{len(sizes) - len(not_run)} sizes that ran.\n\n")
        sizes = [s for s in sizes if s in ran]
        expected = [(f, s) for f, s in expected if s in ran]
    missing = missing_runs(records, expected, seeds)
    fit_sizes, fit_seeds = sizes, seeds
    if missing:
        fit_sizes, fit_seeds = fittable_part(records, expected)
        text += (f"**Partial grid**: {len(missing)} run(s) missing or failed (seeds seen: {seeds}). "
                 + (f"Fits below are provisional, on the complete sizes {', '.join(fit_sizes)} x seeds {fit_seeds}."
                    if len(fit_sizes) >= MIN_SIZES else
                    f"No fit: {len(fit_sizes)} complete size(s), fewer than the {MIN_SIZES} a fit needs.") + "\n\n")
    text += _runs_table(records, sizes, families, missing)
    if len(fit_sizes) < MIN_SIZES and missing:
        return text
    try:
        return f"{text}\n\n{_fit_text(records, fit_sizes, fit_seeds, out, level)}"
    except ScalingGridError as e:
        return f"{text}\n\nNo fit: {e}."
