"""Aggregate experiment records: mean ± std over seeds, Markdown tables beside the report's
numbers (report Table 4, Fig. 6; the scaling fits of Table 2 in :mod:`.scaling_report`), and
PNG plots (matplotlib, Agg backend).

:func:`write_report` writes ``<out>/report.md`` and the plots of one experiment.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...checkpoint.manifest import step_of_directory
from ...output_paths import save_figure_atomically, write_text_atomically
from ...shell_words import shell_path
from ...train import latest_checkpoint
from ...train.status import run_status
from .compare import compare_markdown
from .overhead import interval_label
from ...user_warning import warn_user
from ..layout import RESULT_FILE, data_fingerprint, read_experiment_header, read_overhead, run_dir, saved_config
from .presets import PRESETS, get_experiment
from ..grids.scaling_report import scaling_section
from ..stats import TInterval, holm, markdown_table, mean_difference, mean_std, pooled_sd, t_interval

#: Table 4 of the report (16-layer model, validation loss), by our variant names.
REPORT_TABLE4 = {
    "baseline": 1.766, "denseformer": 1.767, "mhc": 1.747, "full": 1.737, "full+input_dependent_query": 1.731,
    "full+input_independent_mixing": 1.749, "full+sigmoid": 1.741, "full-key_norm": 1.743, "swa": 1.764,
    "block_s4": 1.746, "block+multihead": 1.752, "block-key_norm": 1.750,
}
#: Fig. 6 (same model): validation loss by block size S (S = 2, 4, 8 read as "1.746-1.748").
REPORT_FIG6 = {"baseline": "1.766", 1: "1.737", 2: "1.746–1.748", 4: "1.746–1.748", 8: "1.746–1.748", 16: "1.753",
               32: "1.757"}
#: Fig. 7's summary: AttnRes wins every cell by 0.019-0.063; optimum d/L_b ~ 45 (AttnRes) vs 60 (baseline).
REPORT_FIG7 = "AttnRes lower in all 25 cells by 0.019–0.063; best d/L_b ≈ 45 (AttnRes) vs ≈ 60 (baseline)"


@dataclass
class Summary:
    """One variant over its seeds: loss mean/std, and means of the measured quantities."""

    variant: str
    family: str
    coords: dict[str, Any]
    seeds: int
    loss: float
    loss_std: float | None
    params: int
    residual_params: int
    step_time_s: float | None
    peak_memory_bytes: float | None
    step_ratio: float | None = None  # measured side by side (overhead.json): median per-round ratio to the baseline
    step_noise: float | None = None  # its noise (overhead.json; absent from files of earlier versions)


def summarize(records: list[dict[str, Any]]) -> dict[str, Summary]:
    """Group run records by variant (in first-seen order) and average over seeds."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(r["variant"], []).append(r)
    out = {}
    for name, rs in groups.items():
        loss, std = mean_std([r["val_loss"] for r in rs])
        times = [r["step_time_s"] for r in rs if r.get("step_time_s") is not None]
        mems = [r["peak_memory_bytes"] for r in rs if r.get("peak_memory_bytes") is not None]
        out[name] = Summary(name, rs[0]["family"], rs[0]["coords"], len(rs), loss, std, rs[0]["params"],
                            rs[0]["residual_params"], statistics.fmean(times) if times else None,
                            statistics.fmean(mems) if mems else None)
    return out


# -- formatting ------------------------------------------------------------------------------
def _loss(s: Summary) -> str:
    return f"{s.loss:.4f}" + (f" ± {s.loss_std:.4f}" if s.loss_std is not None else "") + f" (n={s.seeds})"


def _overhead(s: Summary, base: Summary | None) -> list[str]:
    """Parameters, residual parameters, step time and peak memory, with ratios to ``base``."""
    def ratio(a, b):
        return f" ({a / b:.2f}×)" if base is not None and a is not None and b else ""

    time = "n/a" if s.step_time_s is None else f"{s.step_time_s * 1e3:.1f}" + (
        f" ({s.step_ratio:.2f}×{f' ± {s.step_noise:.2f}' if s.step_noise is not None else ''})"
        if s.step_ratio is not None else ratio(s.step_time_s, base and base.step_time_s))
    mem = "n/a" if s.peak_memory_bytes is None else f"{s.peak_memory_bytes / 2**20:.1f}" + ratio(
        s.peak_memory_bytes, base and base.peak_memory_bytes)
    dparams = "" if base is None else f" ({s.params - base.params:+,})"
    return [f"{s.params:,}{dparams}", f"{s.residual_params:,}", time, mem]


def apply_overhead(summ: dict[str, Summary], out: Path) -> str | None:
    """Replace the logged step times and peak memory of ``summ`` with the side-by-side
    measurements of ``out/overhead.json`` when it exists; returns how they were measured."""
    m = read_overhead(out)
    if m is None:
        return None
    for name, v in m["variants"].items():
        if name in summ:
            summ[name].step_time_s = v["median_ms"] / 1e3
            summ[name].step_ratio = v["step_ratio"]
            summ[name].step_noise = v.get("step_ratio_noise")
            summ[name].peak_memory_bytes = v["peak_memory_bytes"]
    clock = {"cpu": " on the process's CPU time (other load on the machine does not count)",
             "wall": " on wall-clock time"}.get(m.get("clock"), "")  # files of earlier versions do not say
    noise = (f"; ± its noise: the larger of the {interval_label(m['repeats'])} of that median and how far an identical "
             "copy of the baseline (A/A twin) lands from 1" if "twin" in m else "")
    return (f"Step time and peak memory: one training step of each variant ({m['batch']} x {m['seq_len']} tokens, "
            f"{m['threads']} thread(s)), all variants timed interleaved over {m['repeats']} rounds{clock}; "
            f"× baseline = median of the per-round ratios{noise}. Peak memory: rise of live CPU allocations during "
            "the step (profiler). ")


_OVERHEAD_COLS = ["params (Δ vs baseline)", "residual params", "step ms (× baseline)", "peak MiB (× baseline)"]


def _report_loss_table4(name: str) -> str:
    for key in (name, name.split("_w")[0], name.split("_h")[0]):
        if key in REPORT_TABLE4:
            return f"{REPORT_TABLE4[key]:.3f}"
    return "–"


def baseline_differences(records: list[dict[str, Any]], baseline: str = "baseline") -> tuple[dict[str, str], str]:
    """Per variant, its loss minus the baseline's with a 95 % Student-t interval, the p-value
    and Holm's adjustment over all the variants compared (a grid reads them all at once); and
    a sentence saying how. Empty without a baseline or a spread to give an interval from.

    Paired by seed where the variant ran two or more seeds the baseline ran (as ``attnres
    compare``): a seed fixes the batches and the initial draws of both runs, so the mean of the
    per-seed differences, with its sd from those differences, leaves out the seed-to-seed noise
    they share. Unpaired (difference of the means, the seed sd pooled over every variant, whose
    seeds share a mean) where the variant shares fewer: one difference has no sd to give an
    interval from (such a cell was that seed's difference alone, the variant's other seeds
    unused); unpaired, every seed counts, conservatively (the shared seed's noise is taken as
    independent). Each cell says which it is; a variant with neither keeps the table's bare
    difference of the means. Holm's family is the cells with a p-value."""
    groups: dict[str, list[tuple[Any, float]]] = {}
    for r in records:
        groups.setdefault(r["variant"], []).append((r.get("seed"), r["val_loss"]))
    if baseline not in groups:
        return {}, ""
    base = {seed: loss for seed, loss in groups[baseline] if seed is not None}
    paired = {name: [loss - base[seed] for seed, loss in runs if seed in base]
              for name, runs in groups.items() if name != baseline}
    shared = {name: len(d) for name, d in paired.items()}
    paired = {name: d for name, d in paired.items() if len(d) > 1}
    unpaired = [name for name in groups if name != baseline and name not in paired]
    pooled = _pooled_or_none([[loss for _, loss in runs] for runs in groups.values()]) if unpaired else None
    if not paired and pooled is None:
        return {}, ""  # (no spread anywhere: the tables show the bare difference of the means)
    diffs: dict[str, tuple[TInterval, str]] = {}
    for name, runs in groups.items():
        if name in paired:
            diffs[name] = t_interval(paired[name]), f"paired, n={len(paired[name])}"
        elif name != baseline and pooled is not None:
            losses = [loss for _, loss in runs]
            diffs[name] = mean_difference(losses, [loss for _, loss in groups[baseline]], *pooled), "unpaired"
    adjusted = dict(zip(diffs, holm([d.p_value for d, _ in diffs.values()])))
    cells = {name: f"{d.text('+.4f')} ({how}" + (f"; p = {d.p_value:.2g}; Holm {adjusted[name]:.2g})"
                                                 if d.p_value is not None else ")")
             for name, (d, how) in diffs.items()}
    tested = sum(d.p_value is not None for d, _ in diffs.values())  # (Holm's family: a cell without p is none of it)
    return cells, _differences_note(paired, {name: shared[name] for name in unpaired}, pooled, tested)


def _pooled_or_none(groups: list[list[float]]) -> tuple[float, int] | None:
    """:func:`pooled_sd` of ``groups``, or ``None`` where it has no spread to give."""
    if all(len(g) < 2 for g in groups):
        return None
    sd, df = pooled_sd(groups)
    return (sd, df) if sd > 0 else None


def _differences_note(paired: dict[str, list[float]], unpaired: dict[str, int], pooled: tuple[float, int] | None,
                      compared: int) -> str:
    """The sentence under a table of :func:`baseline_differences`: how each kind of cell was
    computed. ``unpaired``: those variants' seeds in common with the baseline (0 or 1)."""
    how = []
    if paired:
        how.append("paired: the variant's run minus the baseline's run of the same seed (the same batches and initial "
                   "draws), mean over the seeds both ran (n) with a 95 % Student-t interval from the sd of those "
                   "differences (n - 1 degrees of freedom), as `attnres compare` pairs them")
    if unpaired and pooled is not None:
        why = "; ".join(f"{', '.join(names)}: {words}" for words, names in _by_shared_seeds(unpaired))
        how.append(f"unpaired ({why}): difference of the mean "
                   f"losses, 95 % Student-t interval from the seed sd pooled over every variant ({pooled[0]:.4f} on "
                   f"{pooled[1]} degrees of freedom)")
    return (f"Δ vs baseline, {'; '.join(how)}. p of the t-test, and Holm's adjustment over the {compared} variants "
            "compared (read a variant as different from the baseline where the adjusted p < 0.05).")


def _by_shared_seeds(unpaired: dict[str, int]) -> list[tuple[str, list[str]]]:
    """The unpaired variants grouped by why: no seed in common with the baseline, or one."""
    words = {0: "no seed in common with the baseline", 1: "one seed in common, no spread to pair"}
    return [(words[k], names) for k in sorted(words) if (names := [n for n, c in unpaired.items() if c == k])]


def _ablation_md(summ: dict[str, Summary], records: list[dict[str, Any]]) -> str:
    base = summ.get("baseline")
    deltas, note = baseline_differences(records)
    rows = []
    for s in summ.values():
        delta = "–" if base is None else deltas.get(s.variant, f"{s.loss - base.loss:+.4f}")
        rows.append([s.variant, _report_loss_table4(s.variant), _loss(s), delta] + _overhead(s, base))
    table = markdown_table(["variant", "report (Table 4)", "ours: val loss", "Δ vs baseline"] + _OVERHEAD_COLS, rows)
    return table + (f"\n\n{note}" if note else "")


def _block_size_md(summ: dict[str, Summary], out: Path, records: list[dict[str, Any]]) -> str:
    base = summ.get("baseline")
    deltas, note = baseline_differences(records)
    rows = []
    for s in summ.values():
        S = s.coords.get("S", "baseline")
        delta = "–" if base is None or s is base else deltas.get(s.variant, f"{s.loss - base.loss:+.4f}")
        rows.append([str(S), str(s.coords.get("N", "–")), REPORT_FIG6.get(S, "–"), _loss(s), delta] + _overhead(s, base))
    from matplotlib.figure import Figure

    pts = sorted((s.coords["S"], s.loss, s.loss_std or 0.0) for s in summ.values() if "S" in s.coords)
    fig = Figure(figsize=(5, 3.5))
    ax = fig.subplots()
    ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", label="AttnRes")
    if base is not None:
        ax.axhline(base.loss, color="gray", linestyle="--", label="baseline")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size S (sublayers)")
    ax.set_ylabel("validation loss")
    ax.legend()
    fig.tight_layout()
    save_figure_atomically(fig, out / "block_size.png", "the grid's figure", dpi=120)
    table = markdown_table(["S", "N blocks", "report (Fig. 6)", "ours: val loss", "Δ vs baseline"] + _OVERHEAD_COLS, rows)
    return table + (f"\n\n{note}" if note else "") + "\n\n![block-size sweep](block_size.png)"


def _scaling_md(records: list[dict[str, Any]], out: Path, preset: str) -> str:
    """The scaling section (:mod:`.scaling_report`); with a known ``preset`` the runs of its
    grid that have not finished are marked."""
    expected = None
    if preset in PRESETS["scaling"]:
        expected = [(v.family, v.coords["size"]) for v in get_experiment("scaling", preset).variants]
    return scaling_section(records, out, expected)


def _multiplier_md(records: list[dict[str, Any]], out: Path, preset: str) -> str:
    from ..grids.multiplier_report import multiplier_section  # imported when the report is written (scipy)
    from .presets import multiplier_grid

    if preset not in PRESETS["multiplier"]:
        return multiplier_section(records, out)
    variants = [v.name for v in get_experiment("multiplier", preset).variants]
    return multiplier_section(records, out, multiplier_grid(preset).seeds, variants)


def _arch_sweep_md(summ: dict[str, Summary], out: Path) -> str:
    from matplotlib.figure import Figure

    cells: dict[tuple[float, float], dict[str, Summary]] = {}
    for s in summ.values():
        cells.setdefault((s.coords["d/L_b"], s.coords["H/L_b"]), {})[s.family] = s
    rows = []
    for (rd, rh), fam in cells.items():
        any_s = next(iter(fam.values()))
        b, a = fam.get("baseline"), fam.get("block")
        delta = f"{a.loss - b.loss:+.4f}" if a and b else "–"
        rows.append([f"{rd:g}", f"{rh:g}", str(any_s.coords["L_b"]), str(any_s.coords["d"]), str(any_s.coords["H"]),
                     _loss(b) if b else "–", _loss(a) if a else "–", delta]
                    + (_overhead(a, b) if a else ["–"] * 4))
    rds = sorted({k[0] for k in cells})
    rhs = sorted({k[1] for k in cells})
    families = sorted({f for fam in cells.values() for f in fam})
    fig = Figure(figsize=(4.5 * len(families), 3.5))
    axes = fig.subplots(1, len(families), squeeze=False)
    # One colour scale for both families: each on its own, one colour was two losses, and the
    # baseline's panel and AttnRes' looked alike whatever the gap between them.
    losses = [s.loss for fam in cells.values() for s in fam.values() if math.isfinite(s.loss)]
    lo, hi = (min(losses), max(losses)) if losses else (0.0, 1.0)
    for ax, family in zip(axes[0], families):
        grid = np.full((len(rhs), len(rds)), np.nan)
        for (rd, rh), fam in cells.items():
            if family in fam:
                grid[rhs.index(rh), rds.index(rd)] = fam[family].loss
        im = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis", vmin=lo, vmax=hi)
        for (i, j), v in np.ndenumerate(grid):
            if np.isfinite(v):  # dark on viridis' bright upper half (white on its yellow could not be read)
                ax.text(j, i, f"{v:.3f}", ha="center", va="center", color="k" if v > (lo + hi) / 2 else "w",
                        fontsize=7)
        ax.set_xticks(range(len(rds)), [f"{v:g}" for v in rds])
        ax.set_yticks(range(len(rhs)), [f"{v:g}" for v in rhs])
        ax.set_xlabel("d / L_b")
        ax.set_ylabel("H / L_b")
        ax.set_title(family)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    save_figure_atomically(fig, out / "arch_sweep.png", "the grid's figure", dpi=120)
    best = {f: min((fam[f].loss, k[0]) for k, fam in cells.items() if f in fam)[1] for f in families}
    table = markdown_table(["d/L_b", "H/L_b", "L_b", "d", "H", "baseline loss", "AttnRes (Block) loss", "Δ"] + _OVERHEAD_COLS, rows)
    best_txt = ", ".join(f"{f}: d/L_b = {v:g}" for f, v in best.items())
    return f"Report (Fig. 7): {REPORT_FIG7}.\n\nOurs: best cell {best_txt}.\n\n{table}\n\n![arch sweep](arch_sweep.png)"


def _setup(out: Path, records: list[dict[str, Any]], per_size: bool = False) -> str:
    """One line with the shared training set-up, read from the first run's ``config.json``
    (``per_size``: the model and the steps differ by size, so the line leaves them out)."""
    c = saved_config(out, records[0])
    if c is None:
        return ""
    m = c["model"]
    seeds = sorted({r["seed"] for r in records})
    # (arch-sweep's cells differ in shape: the line gave the first run's, "d_model 24, 3 transformer
    # blocks, 3 heads", as the shape of every run)
    shapes = {(x["model"]["d_model"], x["model"]["n_layers"], x["model"]["n_heads"])
              for x in filter(None, (saved_config(out, r) for r in records))}
    model = ("model shape, steps and warm-up: by size (the runs table); " if per_size else
             "model shape: by run (the table); " if len(shapes) > 1 else
             f"d_model {m['d_model']}, {m['n_layers']} transformer blocks, {m['n_heads']} heads, ")
    warmup = "" if per_size else f", {_plural(c['warmup_steps'], 'warm-up step')}"
    return (f"Set-up: {model}vocab {m['vocab_size']} ({c['data']['tokenizer']}); {c['batch_size']} x {c['seq_len']} "
            f"tokens per step; {c['optimizer']} lr {c['lr']:g}, {c['schedule']} schedule{warmup}; "
            f"dtype {c['dtype']}; seeds {seeds}.\n\n")


_COMPARE_TOKENS_PER_S = ("tokens/s (side by side): the tokens of one step over its step time measured side by side, "
                         "as the step-time ratios (the runs' wall-clock rates moved with the load on the machine; "
                         "without that measurement, --overhead-repeats 0, none is shown). ")
_LOGGED_COSTS = "Step time: median ms per optimiser step of the training runs; peak memory: CUDA only (n/a on CPU). "


def _measures(name: str, side_by_side: str | None) -> str:
    """How the report's costs were measured: side by side (``overhead.json``) or from the runs' logs."""
    if name == "compare":  # tokens/s: of the step timed side by side
        return (side_by_side or "") + _COMPARE_TOKENS_PER_S
    if name in ("scaling", "multiplier"):  # their tables show compute (FLOPs), not time
        return ""
    return side_by_side or _LOGGED_COSTS


_TITLES = {"compare": "Standard vs Block vs Full AttnRes", "ablation": "Ablations (Table 4)", "block-size": "Block-size sweep (Fig. 6)",
           "scaling": "Scaling laws (Table 2 / Fig. 4)", "arch-sweep": "Architecture sweep (Fig. 7)",
           "multiplier": "The compute multiplier (Table 2 / Fig. 4), measured directly"}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _unfinished_runs(out: Path, records: list[dict[str, Any]], variants: set[str] | None) -> tuple[list[str], list[str]]:
    """The run directories ``out/<variant>/seed<k>`` of ``variants`` (``None``: any) that hold
    no ``result.json`` yet, with the step each reached: ``(interrupted, training now)`` - the
    latter hold a live lock (another process's ``--variants``, say)."""
    finished = {(r["variant"], r["seed"]) for r in records}
    found: tuple[list[str], list[str]] = ([], [])
    for d in sorted(out.glob("*/seed*")):
        name, seed = d.parent.name, d.name.removeprefix("seed")
        if (not d.is_dir() or not seed.isdigit() or (name, int(seed)) in finished or (d / RESULT_FILE).exists()
                or (variants is not None and name not in variants)):
            continue
        latest = latest_checkpoint(d, replaced=True)  # (a reader: one a kill left moved aside is still the run's)
        config = saved_config(out, {"variant": name, "seed": int(seed)}) or {}
        reached = step_of_directory(latest) if latest is not None else 0
        found[run_status(d).state == "running"].append(f"{name} seed {seed} at step {reached} of "
                                                      f"{config.get('steps', '?')}")
    return found


def reportable(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run records a report uses: those whose final validation loss is a number."""
    return [r for r in records if isinstance(r.get("val_loss"), (int, float)) and math.isfinite(r["val_loss"])]


def _data_fingerprint(out: Path, record: dict[str, Any]) -> str | None:
    """The fingerprint of the text the run of ``record`` trained on: its record's (``data_fingerprint``),
    else its final checkpoint's (records of earlier versions); ``None`` where neither says."""
    if isinstance(record.get("data_fingerprint"), str):
        return record["data_fingerprint"]
    if not isinstance(record.get("variant"), str) or not isinstance(record.get("seed"), int):
        return None
    return data_fingerprint(latest_checkpoint(run_dir(out, record["variant"], record["seed"]), replaced=True))


def _other_texts(out: Path, records: list[dict[str, Any]]) -> str:
    """A paragraph, and a warning, where the runs were not all trained on the same text (its
    file edited while the grid ran: the runs after it trained on the new text, without a word,
    and the tables compared them with the others); "" where they were."""
    texts: dict[str, list[str]] = {}
    for r in records:
        fingerprint = _data_fingerprint(out, r)
        if fingerprint is not None:
            texts.setdefault(fingerprint, []).append(f"{r.get('variant')} seed {r.get('seed')}")
    if len(texts) < 2:
        return ""
    groups = "; ".join(f"{fingerprint[:12]}: {', '.join(runs)}" for fingerprint, runs in texts.items())
    said = (f"These runs were not all trained on the same text (its data files changed while the grid ran), so "
            f"their losses do not compare: data fingerprints {groups}. Retrain the runs of the text that is not wanted "
            "(delete their folders and run the grid's command again)")
    warn_user(said)
    return f"**{said}.**\n\n"


#: How many of the grid's variants without a run :func:`_left_out` names (an arch-sweep has 50).
_NAMED_UNTRAINED = 6


def _untrained_variants(out: Path, records: list[dict[str, Any]], grid: list[str] | None) -> list[str]:
    """The variants of ``grid`` (its variants' names, in order; ``None``: not known) with no
    run in ``out``: no record and no ``<variant>/seed*`` folder (a grid trained with
    ``--variants`` of some of them). None where no variant has one (an empty folder, said
    otherwise)."""
    if grid is None:
        return []
    recorded = {r.get("variant") for r in records}
    untrained = [v for v in grid if v not in recorded and not any(d.is_dir() for d in (out / v).glob("seed*"))]
    return untrained if len(untrained) < len(grid) else []


def _untrained_md(untrained: list[str]) -> str:
    """The part of the "Left out" line naming the grid's variants with no run: each, and the
    ``--variants`` that trains them, up to :data:`_NAMED_UNTRAINED`; beyond, the first ones and
    how many more, and no ``--variants`` (one ending in "..." cannot be pasted; 50 names are
    not read)."""
    them = "them" if len(untrained) > 1 else "it"
    if len(untrained) > _NAMED_UNTRAINED:
        return (f"{_plural(len(untrained), 'variant')} of the grid with no run in this folder "
                f"({', '.join(untrained[:_NAMED_UNTRAINED])} and {len(untrained) - _NAMED_UNTRAINED} more: the grid's "
                "command without --variants trains them)")
    return (f"{_plural(len(untrained), 'variant')} of the grid with no run in this folder ({', '.join(untrained)}: "
            f"the grid's command without --variants trains {them}, with `--variants {' '.join(untrained)}` {them} alone)")


def _left_out(out: Path, records: list[dict[str, Any]], variants: set[str] | None,
              untrained: Sequence[str] = ()) -> tuple[list[dict[str, Any]], str]:
    """The records the report can use (a final validation loss that is a number) and a
    sentence naming the runs it leaves out: those whose loss is not a number (NaN, or
    ``null`` in ``result.json``), those not finished (no ``result.json``), and the grid's
    variants never trained (``untrained``: :func:`_untrained_variants`)."""
    kept = reportable(records)
    not_a_number = [f"{r['variant']} seed {r['seed']}" for r in records if r not in kept]
    unfinished, training = _unfinished_runs(out, records, variants)
    parts = []
    if untrained:
        parts.append(_untrained_md(list(untrained)))
    if not_a_number:
        parts.append(f"{_plural(len(not_a_number), 'run')} whose final validation loss is not a number "
                     f"({', '.join(not_a_number)}: see its metrics.jsonl; retrain it in another --out, e.g. at a lower lr)")
    if unfinished:
        # (not "the same command": said by --report-only, or after stop_after, that one trains nothing)
        parts.append(f"{_plural(len(unfinished), 'unfinished run')} ({', '.join(unfinished)}: the grid's command, "
                     f"without --report-only or stop_after, finishes {'them' if len(unfinished) > 1 else 'it'}; "
                     f"`attnres status {shell_path(out)}` prints that command)")
    if training:
        parts.append(f"{_plural(len(training), 'run')} being trained now by another process ({', '.join(training)}: "
                     "--report-only once it has finished)")
    return kept, ("Left out of this report: " + "; ".join(parts) + ".\n\n") if parts else ""


def write_report(name: str, records: list[dict[str, Any]], out: str | Path, preset: str = "") -> Path:
    """Write ``<out>/report.md`` (and the experiment's plot) from run ``records``; returns
    the Markdown path. Losses: mean ± sample std over seeds; step time: median ms per step;
    peak memory: CUDA only. ``preset``: by default the grid's, from ``out``'s experiment.json."""
    if name not in _TITLES:
        raise ValueError(f"unknown experiment {name!r}; available: {', '.join(_TITLES)}")
    out = Path(out)
    # (docs/experiments.md's `write_report("scaling", records, "runs/scaling")` wrote, without the preset, a
    # report other than --report-only's: no preset in the title, no unfinished size marked, the multiplier's seeds)
    # (a Variant of the user's own, added in Python, is the grid's too: its unfinished runs are named - every
    # folder's where no preset is given)
    variants = {v.name for v in get_experiment(name, preset).variants} | {r.get("variant") for r in records} \
        if preset else None
    header = read_experiment_header(out) or {}
    if not preset and header.get("experiment") == name and header.get("preset") in PRESETS.get(name, ()):
        preset = header["preset"]
    grid = [v.name for v in get_experiment(name, preset).variants] if preset else None
    # (a compare grid trained with --variants standard and block only: its report, titled "Standard vs Block vs
    # Full", left Full out without a word)
    untrained = _untrained_variants(out, records, grid)
    records, left_out = _left_out(out, records, variants, untrained)
    if not records:
        # (of a folder with no run at all it said no more: neither which folder nor what trains its runs)
        raise ValueError(f"no finished runs to report for experiment {name!r}"
                         + (f" ({left_out.strip().removesuffix('.')})" if left_out else
                            f" in {shell_path(out)}: no run of the grid has been trained there; its command without "
                            "--report-only trains them (`attnres status` lists the runs a folder holds)"))
    out.mkdir(parents=True, exist_ok=True)
    summ = summarize(records)
    measured = apply_overhead(summ, out)
    body = {"compare": lambda: compare_markdown(records, out, untrained), "ablation": lambda: _ablation_md(summ, records),
            "block-size": lambda: _block_size_md(summ, out, records), "scaling": lambda: _scaling_md(records, out, preset), "arch-sweep": lambda: _arch_sweep_md(summ, out),
            "multiplier": lambda: _multiplier_md(records, out, preset)}[name]()
    steps = sorted({r["steps"] for r in records})
    head = (f"# {_TITLES[name]}{f' — preset {preset}' if preset else ''}\n\n{_setup(out, records, per_size=name in ('scaling', 'multiplier'))}"
            f"{_other_texts(out, records)}{left_out}{_plural(len(records), 'run')}, steps {steps}. Validation loss: mean ± sample std over seeds (n = seeds). "
            + _measures(name, measured)
            + "The report's numbers come from far larger models and budgets: compare orderings and gaps, not values.\n\n")
    path = out / "report.md"
    write_text_atomically(path, head + body + "\n", "the grid's report")  # (cut short by a kill, it would stay so)
    return path
