"""The no-free-lunch report: ``report.md`` with the computed findings and loss tables, gap
heatmaps over (lam, depth) per normalisation setting (``gap_train_loss.png``,
``gap_test_loss.png``) and the hidden-state size over depth (``hidden_rms.png``)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from attnres.experiments.stats import holm, markdown_table

from .effects import paired_effect, sign_rule_pass_rate
from .findings import MIN_SEEDS, METRICS, compute_findings, index_records, paired_deltas, verdict
from .models import VARIANTS

__all__ = ["write_nfl_report", "gap_grid"]

_LABELS = {"standard": "standard", "full": "Full AttnRes", "block": "Block AttnRes",
           "full_sigmoid": "Full AttnRes, sigmoid weights", "prenorm": "PreNorm", "no_norm": "no normalisation",
           "train_loss": "train loss", "test_loss": "test loss"}
_NORM_ORDER = ("prenorm", "no_norm")


def _axes(index):
    norms = [n for n in _NORM_ORDER if any(k[0] == n for k in index)]
    present = {k[1] for k in index}
    variants = [v for v in VARIANTS if v in present] + sorted(present - set(VARIANTS))
    return norms, variants, sorted({k[2] for k in index}), sorted({k[3] for k in index})


def gap_grid(index, norm: str, variant: str, depths: list[int], lams: list[float], metric: str):
    """``[depth, lam]`` arrays of the mean and std of the paired log10 gap against the
    standard residual, the number of seeds with ``variant`` lower, the paired seeds, and
    the decided sign (see :func:`~.findings.verdict`)."""
    shape = (len(depths), len(lams))
    mean, std = np.full(shape, np.nan), np.full(shape, np.nan)
    lower, n, sign = np.zeros(shape, int), np.zeros(shape, int), np.zeros(shape, int)
    for i, d in enumerate(depths):
        for j, lam in enumerate(lams):
            v = verdict(paired_deltas(index, norm, variant, d, lam, metric).values(), MIN_SEEDS)
            mean[i, j] = np.nan if v.mean is None else v.mean
            std[i, j] = np.nan if v.std is None else v.std
            lower[i, j], n[i, j], sign[i, j] = v.lower, v.n, v.sign
    return mean, std, lower, n, sign


def _heatmap(index, metric: str, out: Path) -> str:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    norms, variants, depths, lams = _axes(index)
    others = [v for v in variants if v != "standard"]
    grids = {(nm, v): gap_grid(index, nm, v, depths, lams, metric) for nm in norms for v in others}
    finite = [abs(x) for g in grids.values() for x in g[0].ravel() if np.isfinite(x)]
    vmax = max(0.05, min(1.0, max(finite, default=0.05)))
    fig, axes = plt.subplots(len(norms), len(others), figsize=(3.8 * len(others) + 1, 3.4 * len(norms) + 0.6),
                             squeeze=False, layout="constrained")
    for r, nm in enumerate(norms):
        for c, v in enumerate(others):
            ax = axes[r][c]
            mean, std, lower, n, sign = grids[(nm, v)]
            im = ax.imshow(np.clip(mean, -vmax, vmax), origin="lower", aspect="auto", cmap="RdBu_r",
                           vmin=-vmax, vmax=vmax)
            for (i, j), m in np.ndenumerate(mean):
                if n[i, j] == 0:
                    continue
                text = ("div." if not np.isfinite(m) else f"{m:+.2f}") + ("" if not np.isfinite(std[i, j]) else
                                                                         f"\n±{std[i, j]:.2f}") + f"\n{lower[i, j]}/{n[i, j]}"
                dark = not np.isfinite(m) or abs(m) > 0.6 * vmax
                ax.text(j, i, text, ha="center", va="center", fontsize=6.5,
                        fontweight="bold" if sign[i, j] else "normal", color="w" if dark else "k")
                if sign[i, j]:
                    ax.add_patch(Rectangle((j - 0.45, i - 0.45), 0.9, 0.9, fill=False, lw=1.2, ec="w" if dark else "k"))
            ax.set_xticks(range(len(lams)), [f"{x:g}" for x in lams])
            ax.set_yticks(range(len(depths)), [str(d) for d in depths])
            ax.set_xlabel("λ (0 = structured, 1 = lookup)")
            ax.set_ylabel("depth (blocks)")
            ax.set_title(f"{_LABELS.get(v, v)} − standard\n{_LABELS.get(nm, nm)}", fontsize=9)
    fig.colorbar(im, ax=axes, shrink=0.8, label=f"log10({_LABELS[metric]} ratio), colours clipped at ±{vmax:.2g}; < 0: AttnRes lower")
    fig.suptitle(f"{_LABELS[metric]}: AttnRes − standard, paired by seed (boxed: all ≥ {MIN_SEEDS} seeds agree)",
                 fontsize=10)
    name = f"gap_{metric}.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def _hidden_rms_plot(index, out: Path) -> str | None:
    import matplotlib.pyplot as plt

    norms, variants, depths, lams = _axes(index)
    d = depths[-1]
    fig, axes = plt.subplots(1, len(norms), figsize=(5 * len(norms), 3.4), squeeze=False)
    plotted = False
    for ax, nm in zip(axes[0], norms):
        for v in variants:
            profiles = [r["hidden_rms"] for lam in lams for r in index.get((nm, v, d, lam), {}).values()
                        if r.get("hidden_rms")]
            if not profiles:
                continue
            ax.plot(range(len(profiles[0])), np.mean(profiles, axis=0), marker=".", label=_LABELS.get(v, v))
            plotted = True
        ax.set_yscale("log")
        ax.set_xlabel("sublayer l (input h_l); last point: the residual's output")
        ax.set_ylabel("RMS")
        ax.set_title(f"{_LABELS.get(nm, nm)}, depth {d} (mean over λ and seeds)", fontsize=9)
        ax.legend(fontsize=7)
    if not plotted:
        plt.close(fig)
        return None
    fig.tight_layout()
    fig.savefig(out / "hidden_rms.png", dpi=110)
    plt.close(fig)
    return "hidden_rms.png"


def _claim_cells(index, norm: str, variants: list[str]):
    """The cells the findings' revision claim reads: (variant, depth, lam, metric) for train
    loss at every lam and test loss where the target has structure (lam < 1)."""
    _, _, depths, lams = _axes(index)
    return [(v, d, lam, m) for v in variants for d in depths for lam in lams for m in METRICS
            if m == "train_loss" or lam < 1.0]


def _effects_summary(index, norms: list[str], attnres: list[str], level: float) -> str:
    """How often the decided-cell rule calls a cell by chance, and what the intervals say."""
    seeds = [len(s) for s in index.values()]
    n = min(seeds)
    lines = [f"With {n} paired seeds a cell with no effect at all passes the decided-cell rule with probability "
             f"2·(1/2)^{n} = {sign_rule_pass_rate(n):.0%} (all seeds agree in sign, either sign), so decided-cell "
             f"counts overstate the evidence. Each cell here: the mean paired gap as a loss ratio (AttnRes / standard − 1) "
             f"with its {level:.0%} Student-t interval over seeds and the paired t-test's p-value, per cell and not "
             "corrected for the number of cells; the counts below also say how many cells remain after Holm's "
             "adjustment over all the claim cells of a setting (read at once, they are many tests). Bold: the cells "
             "the decided-cell rule calls."]
    for nm in norms:
        cells = _claim_cells(index, nm, attnres)
        decided = {+1: 0, -1: 0}
        excl = {+1: 0, -1: 0}
        effects = []
        for v, d, lam, m in cells:
            gaps = paired_deltas(index, nm, v, d, lam, m).values()
            sign = verdict(gaps, MIN_SEEDS).sign
            effect = paired_effect(gaps, level)
            if sign:
                decided[sign] += 1
            if effect is not None and effect.excludes_zero():
                excl[effect.excludes_zero()] += 1
            effects.append(effect)
        kept = {+1: 0, -1: 0}
        for e, p in zip(effects, holm([e.p_value if e is not None else None for e in effects])):
            if p is not None and p < 1 - level:
                kept[1 if e.mean > 0 else -1] += 1
        lines.append(f"- {_LABELS[nm]}, {' and '.join(_LABELS[v] for v in attnres)} ({len(cells)} cells: train loss at "
                     f"every λ, test loss at λ < 1): decided for AttnRes {decided[-1]}, for the standard residual "
                     f"{decided[+1]} (by chance alone about {sign_rule_pass_rate(n) * len(cells):.0f} would be decided); "
                     f"interval below 0 (AttnRes lower) {excl[-1]}, above 0 {excl[+1]}; after Holm's adjustment over "
                     f"the {len(cells)} cells: {kept[-1]} and {kept[+1]}.")
    lines.append(_seed_level_tests(index, norms, attnres, level))
    return "\n".join(lines)


#: The patterns the findings read over many cells at once: (name, which (lam, metric) cells).
_PATTERNS = (
    ("test loss at 0 < λ < 1 (noisy structure)", lambda lam, m: m == "test_loss" and 0 < lam < 1),
    ("train loss at λ > 0", lambda lam, m: m == "train_loss" and lam > 0),
    ("test loss at λ = 0 (clean teacher)", lambda lam, m: m == "test_loss" and lam == 0),
)


def _seed_level_tests(index, norms: list[str], attnres: list[str], level: float) -> str:
    """One test per pattern instead of one per cell: per seed, the mean gap over the pattern's
    cells (every AttnRes variant, depth and λ of it), then the paired t-test over the seeds.
    Cells are not independent replicates (a seed's task and batches are shared by its cells);
    seeds are."""
    _, _, depths, lams = _axes(index)
    lines = [f"- Seed-level tests (per seed, the mean gap over a pattern's cells; {level:.0%} Student-t interval "
             "and p over the seeds, one test per pattern):"]
    for nm in norms:
        for name, member in _PATTERNS:
            per_seed: dict[int, list[float]] = {}
            cells = [(v, d, lam, m) for v in attnres for d in depths for lam in lams for m in METRICS if member(lam, m)]
            for v, d, lam, m in cells:
                for seed, gap in paired_deltas(index, nm, v, d, lam, m).items():
                    per_seed.setdefault(seed, []).append(gap)
            means = [statistics.fmean(g) for g in per_seed.values() if all(math.isfinite(x) for x in g)]
            effect = paired_effect(means, level) if means else None
            if effect is not None:
                lines.append(f"  - {_LABELS[nm]}, {name} ({len(cells)} cells, {effect.n} seeds): {effect.text()}")
    return "\n".join(lines)


def _lam_tables(index, variants: list[str], cell, title) -> list[str]:
    """One table per (norm setting, loss): rows (model, depth), columns lam, each entry
    ``cell(norm, variant, depth, lam, metric)``; headed ``title(norm, metric)``."""
    norms, _, depths, lams = _axes(index)
    parts = []
    for nm in norms:
        for metric in METRICS:
            rows = [[_LABELS.get(v, v), str(d)] + [cell(nm, v, d, lam, metric) for lam in lams]
                    for v in variants for d in depths]
            parts.append(f"#### {title(nm, metric)}\n\n"
                         + markdown_table(["model", "depth", *[f"λ = {x:g}" for x in lams]], rows))
    return parts


def _effects_section(index, level: float = 0.95) -> str:
    """Per-cell effect sizes with intervals (:mod:`.effects`), one table per setting and loss."""
    norms, variants, _, _ = _axes(index)
    attnres = [v for v in ("full", "block") if v in variants]

    def cell(nm, v, d, lam, metric) -> str:
        gaps = paired_deltas(index, nm, v, d, lam, metric).values()
        e = paired_effect(gaps, level)
        mark = "**" if verdict(gaps, MIN_SEEDS).sign else ""
        return "–" if e is None else f"{mark}{e.text()}{mark}"

    tables = _lam_tables(index, [v for v in variants if v != "standard"], cell,
                         lambda nm, metric: f"{_LABELS[metric]}, {_LABELS[nm]}: AttnRes / standard − 1")
    return "\n\n".join(([_effects_summary(index, norms, attnres, level)] if attnres else []) + tables)


def _loss_cell(runs, metric: str) -> str:
    """Mean ± sample std of ``metric`` over the finished ``runs`` of a cell, diverged ones counted."""
    vals = [r[metric] for r in runs if not r.get("diverged") and r.get(metric) is not None]
    div = sum(1 for r in runs if r.get("diverged"))
    if not vals:
        return "–" if not div else f"{div} diverged"
    cell = f"{statistics.fmean(vals):.4g}" + (f" ± {statistics.stdev(vals):.2g}" if len(vals) > 1 else "")
    return cell + (f" ({div} div.)" if div else "")


def _loss_tables(index) -> str:
    _, variants, _, _ = _axes(index)
    return "\n\n".join(_lam_tables(index, variants,
                                     lambda nm, v, d, lam, metric: _loss_cell(index.get((nm, v, d, lam), {}).values(), metric),
                                     lambda nm, metric: f"{_LABELS[metric]}, {_LABELS[nm]}"))


def _rms_summary(index) -> str:
    norms, variants, depths, lams = _axes(index)
    rows = []
    for nm in norms:
        for v in variants:
            row = [_LABELS[nm], _LABELS.get(v, v)]
            for d in depths:
                vals = [r["hidden_rms"][-1] for lam in lams for r in index.get((nm, v, d, lam), {}).values()
                        if r.get("hidden_rms")]
                row.append(f"{statistics.fmean(vals):.3g}" if vals else "–")
            rows.append(row)
    return markdown_table(["norm", "model", *[f"depth {d}" for d in depths]], rows)


def _setup(out: Path, records: list[dict[str, Any]]) -> str:
    marker = out / "experiment.json"
    c = json.loads(marker.read_text()).get("config", {}) if marker.exists() else {}
    lines = []
    if c:
        lines.append(
            f"Residual MLP stacks of width d = {c['width']}: an input projection ({c['d_in']} → {c['width']}), "
            f"`depth` blocks of one sublayer each (d → {c['hidden_mult'] * c['width']} → d, GELU), a linear head "
            f"(→ {c['d_out']}). PreNorm: an RMSNorm before every sublayer and before the head; no normalisation: "
            f"neither (AttnRes keeps the RMSNorm on its keys). Block AttnRes: S = max(2, ⌈depth/8⌉). AttnRes "
            f"schedule: `{c['impl']}`.")
        lines.append(
            f"Task: {c['n_train']} training inputs x ~ N(0, I_{c['d_in']}), targets y = √(1−λ)·Wx + √λ·R "
            f"(W a random linear teacher, R a random lookup table; unit variance for every λ, so predicting 0 "
            f"gives train loss 1); test loss on {c['n_test']} fresh inputs against √(1−λ)·Wx. Training: AdamW "
            f"(lr {c['lr']:g}, weight decay {c['weight_decay']:g}), {c['steps']} steps of {c['batch_size']} "
            f"examples ({c['steps'] * c['batch_size'] / c['n_train']:.0f} epochs), {c['warmup_steps']} warm-up steps "
            f"then cosine decay, gradient clipping {c['grad_clip']:g}, float32, one CPU thread.")
    seeds = sorted({r["seed"] for r in records})
    per_cell = [len(s) for s in index_records(records).values()]
    diverged = sum(1 for r in records if r.get("diverged"))
    wall = sum(r.get("wall_s", 0.0) for r in records)
    lines.append(f"{len(records)} runs, seeds {seeds} ({min(per_cell)}–{max(per_cell)} per cell), "
                 f"{diverged} diverged. Training time summed over the runs: {wall / 60:.1f} min.")
    return "\n\n".join(lines)


def write_nfl_report(records: list[dict[str, Any]], out: str | Path, command: str = "") -> Path:
    """Write ``<out>/report.md`` and its PNGs from the run ``records``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    if not records:
        raise ValueError("no finished no-free-lunch runs to report")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    index = index_records(records)
    heatmaps = [_heatmap(index, m, out) for m in METRICS]
    rms_png = _hidden_rms_plot(index, out)
    claims = compute_findings(records)
    by_source = {}
    for c in claims:
        by_source.setdefault(c.source, []).append(c.markdown())
    titles = {"critique": "The critique", "revision": "The critique's revision (PreNorm)",
              "mechanism": "The stated mechanism (sum-to-one softmax weights), tested with sigmoid weights"}
    findings = "\n\n".join(f"**{titles[s]}**\n\n" + "\n".join(items) for s, items in by_source.items()) or \
        "No findings: the grid has no standard-residual runs to compare with."
    parts = [
        "# No free lunch? Standard residual vs AttnRes on structured and memorisation tasks",
        (f"Command: `{command}`" if command else ""),
        _setup(out, records),
        "## How to read",
        "Gap = log10(loss of AttnRes / loss of the standard residual), paired by seed (same task, batches and "
        "initial MLP weights): negative = AttnRes lower; −0.1 ≈ 21 % lower. A cell is *decided* when at least "
        f"{MIN_SEEDS} seeds are paired and all agree in sign (boxed in the heatmaps, with `k/n` = seeds with AttnRes "
        "lower); elsewhere no claim is made. The test loss at λ = 1 has no structure to generalise (its target "
        "is 0): it only measures how far predictions on unseen inputs stray, and is left out of the claims.",
        "## Findings (computed)",
        findings,
        "## Effect sizes with intervals",
        _effects_section(index),
        "## Gaps over (λ, depth)",
        "\n\n".join(f"![{h}]({h})" for h in heatmaps),
        "## Size of the hidden state",
        "RMS of the residual's output after training (mean over λ and seeds): the standard residual's sum grows "
        "with depth, softmax AttnRes's convex combination cannot exceed its largest source (per example), sigmoid weights "
        "(each in (0, 1), not summing to one) can.",
        _rms_summary(index) + (f"\n\n![hidden RMS]({rms_png})" if rms_png else ""),
        "## Losses (mean ± sample std over seeds)",
        _loss_tables(index),
    ]
    path = out / "report.md"
    path.write_text("\n\n".join(p for p in parts if p) + "\n")
    return path
