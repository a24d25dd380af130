"""The main job's report (``attnres compare``): standard vs Block vs Full AttnRes trained with
the same data, hyper-parameters and seeds, read back from the run directories.

:func:`compare_markdown` builds the body of ``report.md`` and writes its PNG plots:

* ``val_loss.png`` - validation loss against optimiser steps and against training compute
  (mean over seeds, with a ± one-standard-deviation band);
* ``magnitudes.png`` - the report's Fig. 5 (b, c): output magnitude per transformer block,
  the magnitude of the hidden state entering each block, and the gradient magnitude per
  block, from the last diagnostics record of every run (mean over seeds);
* ``depth_weights.png`` - the report's Fig. 8: mean depth-attention weights of every
  sublayer over its sources, pre-attention and pre-MLP rows apart (first seed);
* ``mixing.png`` - the report's Fig. 9: each model's depth mixing matrix (first seed's last
  checkpoint), with the semiseparable ranks and the sink table of every seed
  (:mod:`.analyze`; also ``mixing.json``).

Tables: validation loss at equal steps (the last step) and at equal compute (the standard
model's total compute; AttnRes costs a little more per token, so it is read off its curve
at an earlier step by linear interpolation between evaluations); when ``overhead.json``
exists (the step of every model timed side by side, see :mod:`.overhead`), also tokens/s of
that timed step, the step-time ratio and the loss at equal wall-clock time on this
machine (read off the curve at ``steps / ratio`` the same way); and the same gaps paired
by seed (each AttnRes run minus the standard run of the same seed, which saw the same
batches). A "Findings" section states what the numbers say about the report's
claims, computed, not written by hand.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...output_paths import save_figure_atomically
from ...train.metrics import read_metrics
from ...train.schedule import wsd_decay_start
from ..flops import to_pflops_days
from ..layout import read_overhead, run_dir, saved_config
from ..grids.multiplier import curve_crossing
from ..stats import markdown_table, mean_std, t_interval
from ...analysis.profiling import median_interval_coverage
from .overhead import interval_label

BASELINE = "standard"
#: Fewer seeds than this: the findings state the measured gaps but claim no ordering (with one
#: or two seeds, seed-to-seed noise cannot be told from a difference between the models).
MIN_SEEDS_FOR_ORDERING = 3
NO_ORDERING = (f"fewer than {MIN_SEEDS_FOR_ORDERING} seeds, so no claim of an ordering can be made (run more seeds, "
               "e.g. --seeds 0 1 2).")
_LABELS = {"standard": "standard (PreNorm)", "block": "Block AttnRes", "full": "Full AttnRes"}
_COLORS = {"standard": "tab:gray", "block": "tab:blue", "full": "tab:orange"}


@dataclass
class Run:
    """One finished run: its record (``result.json``) and the curves of its ``metrics.jsonl``."""

    record: dict[str, Any]
    eval_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    diagnostics: dict[str, Any] | None = None  # the last diagnostics record

    @property
    def variant(self) -> str:
        return self.record["variant"]

    @property
    def flops_per_step(self) -> float:
        return self.record["flops"] / self.record["steps"]

    def loss_at_step(self, step: float) -> float:
        """Validation loss at ``step`` by linear interpolation between evaluations (``nan``
        outside the evaluated range)."""
        if not self.eval_steps or not self.eval_steps[0] <= step <= self.eval_steps[-1]:
            return math.nan
        return float(np.interp(step, self.eval_steps, self.val_loss))


def load_runs(out: Path, records: list[dict[str, Any]]) -> list[Run]:
    """A :class:`Run` per record, its curves read from ``out/<variant>/seed<k>/metrics.jsonl``."""
    runs = []
    for rec in records:
        run = Run(rec)
        for m in read_metrics(run_dir(out, rec["variant"], rec["seed"]) / "metrics.jsonl"):
            if m["kind"] == "eval":
                if run.eval_steps and m["step"] <= run.eval_steps[-1]:  # a resumed run re-logs nothing earlier
                    continue
                run.eval_steps.append(m["step"])
                run.val_loss.append(m["val_loss"])
            elif m["kind"] == "diagnostics":
                run.diagnostics = m
        runs.append(run)
    return runs


def decay_start(out: Path, record: dict[str, Any]) -> int | None:
    """The step where the run's WSD learning-rate decay begins, from its ``config.json``
    (``None`` for other schedules, without a config, or where a warm-up as long as the run
    leaves no step to decay: the report would speak of a decay the runs never had)."""
    c = saved_config(out, record)
    if c is None or c.get("schedule") != "wsd":
        return None
    start = wsd_decay_start(c["steps"], c["warmup_steps"], c["decay_fraction"])
    return start if start < c["steps"] else None


def _by_variant(runs: list[Run]) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = {}
    for r in runs:
        out.setdefault(r.variant, []).append(r)
    return out


def _pm(values: list[float]) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "–"
    mean, std = mean_std(values)
    return f"{mean:.4f}" + (f" ± {std:.4f}" if std is not None else "") + f" (n={len(values)})"


def _equal_compute_losses(groups: dict[str, list[Run]]) -> dict[str, dict[int, float]]:
    """Per variant and seed: validation loss at the baseline's total compute."""
    budget = statistics.fmean(r.record["flops"] for r in groups[BASELINE])
    return {name: {r.record["seed"]: r.loss_at_step(budget / r.flops_per_step) for r in rs}
            for name, rs in groups.items()}


def _equal_time_losses(groups: dict[str, list[Run]], step_ratio: dict[str, float]) -> dict[str, dict[int, float]]:
    """Per variant and seed: validation loss after the baseline's training time, a step of the
    variant costing ``step_ratio[variant]`` baseline steps (measured side by side)."""
    budget = statistics.fmean(r.record["steps"] for r in groups[BASELINE])
    return {name: {r.record["seed"]: r.loss_at_step(budget / step_ratio[name]) for r in rs}
            for name, rs in groups.items() if name in step_ratio}


#: The fewest rounds of the overhead timing whose interval of the median covers 95 %, the
#: coverage the step-time ratio's noise stands for: over fewer (the range of the rounds, 2
#: rounds 50 %) the noise is too narrow, and no equal-time conclusion is drawn.
EQUAL_TIME_ROUNDS = next(n for n in range(1, 64) if median_interval_coverage(n) >= 0.95)


def too_few_rounds(noisy: dict[str, tuple[float, float]], repeats: int) -> dict[str, tuple[float, float]]:
    """:func:`equal_time_noise`'s readings of a timing over ``repeats`` rounds: as they are
    from :data:`EQUAL_TIME_ROUNDS`, below it each spread infinite - every reading too noisy
    (:func:`too_noisy`), whatever the narrower interval of those rounds says."""
    if repeats >= EQUAL_TIME_ROUNDS:
        return noisy
    return {name: (effect, math.inf) for name, (effect, _) in noisy.items()}


def too_noisy(effect: float, spread: float) -> bool:
    """Whether a measured ``effect`` cannot be told apart from noise of size ``spread``: the
    spread exceeds the effect, or either is not a number."""
    return not abs(effect) >= spread


def _mean_gap(losses: dict[str, dict[int, float]], name: str) -> float:
    gaps = [losses[name][s] - losses[BASELINE][s] for s in sorted(set(losses[name]) & set(losses[BASELINE]))]
    return statistics.fmean(gaps) if gaps else math.nan


def equal_time_noise(groups: dict[str, list[Run]], step_ratio: dict[str, float], noise: dict[str, float]
                     ) -> dict[str, tuple[float, float]]:
    """Per variant with a measured step-time ratio and noise: ``(effect, spread)`` of its
    equal-time reading. ``effect``: the mean paired gap to the baseline at equal time;
    ``spread``: the most that gap moves when the ratio moves by its noise (a bound below 1 is
    read at the last step). The equal-time conclusion is drawn only where the effect
    exceeds the spread (:func:`too_noisy`)."""
    out = {}
    for name, rs in groups.items():
        if name == BASELINE or BASELINE not in groups or name not in step_ratio or noise.get(name) is None:
            continue
        pair = {BASELINE: groups[BASELINE], name: rs}
        ratio, width = step_ratio[name], noise[name]
        effect, *bounds = (_mean_gap(_equal_time_losses(pair, {BASELINE: 1.0, name: r}), name)
                           for r in (ratio, max(1.0, ratio - width), ratio + width))
        out[name] = (effect, max(abs(b - effect) for b in bounds))
    return out


def _tables(groups: dict[str, list[Run]], overheads: dict[str, dict[str, float]] | None = None, repeats: int = 10,
            untrained: Collection[str] = ()) -> tuple[str, dict[str, Any], dict[str, tuple[float, float]]]:
    """The loss and paired-gap tables; ``overheads``: ``overhead.json``'s per-variant ratios,
    measured over ``repeats`` rounds; ``untrained``: the grid's variants the report names as
    having no run (:func:`_how_to_train`). Also returns the paired gaps and :func:`equal_time_noise`."""
    step_ratio = {name: v["step_ratio"] for name, v in (overheads or {}).items()}
    base = groups.get(BASELINE)
    final = {name: {r.record["seed"]: r.record["val_loss"] for r in rs} for name, rs in groups.items()}
    losses = {"steps": final}
    noisy: dict[str, tuple[float, float]] = {}
    if base:
        losses["compute"] = _equal_compute_losses(groups)
        if step_ratio and BASELINE in step_ratio:
            losses["time"] = _equal_time_losses(groups, step_ratio)
            noisy = too_few_rounds(equal_time_noise(groups, step_ratio, {n: v.get("step_ratio_noise")
                                                                     for n, v in overheads.items()}), repeats)

    def cell(values: list[float], key: str, name: str) -> str:
        flag = key == "time" and name in noisy and too_noisy(*noisy[name])
        return _pm(values) + (" (too noisy)" if flag else "")
    base_flops = statistics.fmean(r.record["flops_per_token"] for r in base) if base else None
    rows = []
    for name, rs in groups.items():
        rec = rs[0].record
        row = [_LABELS.get(name, name), f"{rec['params']:,}", f"{rec['residual_params']:,}"]
        row += [cell(list(by_seed[name].values()), key, name) if name in by_seed else "–"
                for key, by_seed in losses.items()]
        row += [_tokens_per_s_cell(rec, (overheads or {}).get(name)),
                f"{rec['flops_per_token'] / base_flops:.3f}" if base_flops else "–"]
        if overheads:
            row += [_ratio_cell(overheads.get(name)), f"{overheads[name]['peak_ratio']:.2f}" if name in overheads else "–"]
        rows.append(row)
    header = ["model", "params", "residual params"] + [f"val loss @ equal {key}" for key in losses]
    header += ["tokens/s (side by side)", "FLOPs/token (× standard)"]
    header += ["step time (× standard)", "peak memory (× standard)"] if overheads else []
    md = [markdown_table(header, rows)]
    seeds_note = _other_seeds(final)
    if seeds_note:
        md.append(seeds_note)
    gaps: dict[str, Any] = {}
    if not base:
        md.append(_NO_BASELINE + _how_to_train([BASELINE], untrained))
    elif len(groups) == 1:
        md.append(_NO_ATTNRES + _how_to_train(["block", "full"], untrained))
    else:
        paired_rows = []
        for name in groups:
            if name == BASELINE:
                continue
            seeds = sorted(set(final[name]) & set(final[BASELINE]))
            gaps[name] = {key: [by_seed[name][s] - by_seed[BASELINE][s] for s in seeds]
                          for key, by_seed in losses.items() if name in by_seed}
            row = [_LABELS.get(name, name)]
            for key, d in gaps[name].items():
                read = [v for v in d if not math.isnan(v)]  # nan: the budget ends before the first evaluation
                flag = " (too noisy)" if key == "time" and name in noisy and too_noisy(*noisy[name]) else ""
                row += [_gap_cell(read) + flag, f"{sum(v < 0 for v in read)}/{len(read)}" if read else "–"]
            paired_rows.append(row)
        header = ["model"]
        for key in losses:
            header += [f"Δ val loss @ equal {key}", "seeds better"]
        md.append("Paired by seed (AttnRes run minus the standard run of the same seed, which saw the same "
                  "batches; negative = AttnRes better): mean [95 % Student-t interval over the seeds] and the paired "
                  "t-test's p:\n\n" + markdown_table(header, paired_rows))
    if noisy:
        md.append(_TIME_NOTE.format(interval=interval_label(repeats))
                  + ("" if repeats >= EQUAL_TIME_ROUNDS else _FEW_ROUNDS_NOTE.format(repeats=repeats,
                                                                                      rounds=EQUAL_TIME_ROUNDS)))
    if unread := _unread_note(groups, losses):
        md.append(unread)
    return "\n\n".join(md), gaps, noisy


def _unread_note(groups: dict[str, list[Run]], losses: dict[str, dict[str, dict[int, float]]]) -> str | None:
    """Why an AttnRes cell at equal compute or equal time is "–" (else ``None``): the step it is
    read at lies outside the steps its run was evaluated at, where the curve has no value - a
    grid of few steps evaluated at its end only (preset tiny, a shortened demo) reads none."""
    unread = [key for key in ("compute", "time") if any(
        math.isnan(v) for name, by_seed in losses.get(key, {}).items() if name != BASELINE for v in by_seed.values())]
    if not unread:
        return None
    evaluated = sorted({r.eval_steps[0] for name, rs in groups.items() if name != BASELINE for r in rs if r.eval_steps})
    first = f" (the first at step {evaluated[0]})" if evaluated else ""
    return (f"\"–\" at equal {' and at equal '.join(unread)}: the step to read lies outside the steps the AttnRes run was "
            f"evaluated at{first}, where its curve has no value; a lower `eval_every` evaluates earlier steps.")


def _other_seeds(final: dict[str, dict[int, float]]) -> str:
    """A note where the models' rows are means over different seeds (a grid split by
    ``--variants``, one model's seed still training): standard over seeds 0 and 1 against Block
    over seed 1 alone read as a gap of seed 0's batches, which no table said; "" where every row
    holds the same seeds."""
    seeds = {name: sorted(by_seed) for name, by_seed in final.items()}
    if len({tuple(s) for s in seeds.values()}) < 2:
        return ""
    each = "; ".join(f"{_LABELS.get(name, name)}: {', '.join(map(str, s))}" for name, s in seeds.items())
    return (f"The rows are means over different seeds ({each}), each seed its own batches: they do not compare "
            "with one another. The paired table compares each AttnRes run with the standard run of its seed; "
            "the grid's command with the missing `--seeds` trains the others.")


_NO_BASELINE = ("No standard run has finished in this grid: the readings at equal compute and equal time and the gaps "
                "paired by seed are taken against the standard model's run of the same seed.")
_NO_ATTNRES = ("No AttnRes run has finished in this grid: the gaps paired by seed need a Block or Full AttnRes run of "
               "the same seed as the standard one.")


def _how_to_train(names: list[str], untrained: Collection[str]) -> str:
    """The sentence after :data:`_NO_BASELINE` or :data:`_NO_ATTNRES` on how to train the
    variants ``names``: the command, unless every one is among ``untrained`` (the variants the
    report's "Left out of this report" line names with that command: said once)."""
    them = "them" if len(names) > 1 else "it"
    if set(names) <= set(untrained):
        return f" The line \"Left out of this report\" above names the command that trains {them}."
    return f" Train {them} with the same command and `--variants {' '.join(names)}`."
_TIME_NOTE = ("Step time: CPU time of one training step at one thread, interleaved, × standard = median of the "
              "per-round ratios ± its noise (the larger of its {interval} and how far an identical copy of the "
              "standard model lands from 1). Equal time reads each curve at the standard model's steps / that ratio; "
              "where moving the ratio by its noise moves the paired gap by more than the gap itself, the reading is "
              "marked \"too noisy\" and no equal-time conclusion is drawn.")
_FEW_ROUNDS_NOTE = (" Timed over {repeats} round(s), fewer than the {rounds} whose interval covers 95 %: every "
                    "equal-time reading is marked \"too noisy\" and none is drawn (`--overhead-repeats {rounds}` or more "
                    "draws them).")


def _tokens_per_s_cell(record: dict[str, Any], measured: dict[str, Any] | None) -> str:
    """Tokens per second of one training step timed side by side (``overhead.json``: CPU time
    at one thread, interleaved, as the step-time ratios), so that it moves with the ratios and
    not with the load on the machine; "–" where nothing was timed side by side (the runs'
    wall-clock rates were that load's)."""
    if not measured or not measured.get("median_ms"):
        return "–"
    return f"{record['tokens'] / record['steps'] / (measured['median_ms'] / 1e3):,.0f}"


def _gap_cell(values: list[float]) -> str:
    """A paired gap over seeds: mean [95 % t-interval] (n, p), or the mean alone without a spread."""
    if not values:
        return "–"
    t = t_interval(values)
    return t.text("+.4f") + f" (n={t.n}" + (f", p={t.p_value:.2g})" if t.p_value is not None else ")")


def _ratio_cell(measured: dict[str, Any] | None) -> str:
    """A step-time ratio with its noise (``overhead.json`` of earlier versions has none)."""
    if measured is None:
        return "–"
    noise = measured.get("step_ratio_noise")
    return f"{measured['step_ratio']:.2f}" + (f" ± {noise:.2f}" if noise is not None else "")


def _mean_curve(rs: list[Run], key: str) -> np.ndarray | None:
    """Mean over seeds of a per-block diagnostics list (``None`` if no run logged it)."""
    values = [r.diagnostics[key] for r in rs if r.diagnostics and r.diagnostics.get(key)]
    return np.mean(np.asarray(values, dtype=float), axis=0) if values else None


def _plot_val_loss(groups: dict[str, list[Run]], path: Path, start: int | None = None) -> None:
    """Mean ± std curves against steps and against compute; ``start``: where a WSD decay begins."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 3.8))
    axes = fig.subplots(1, 2)
    for name, rs in groups.items():
        steps = sorted(set.intersection(*(set(r.eval_steps) for r in rs)))
        if not steps:
            continue
        losses = np.asarray([[r.val_loss[r.eval_steps.index(s)] for s in steps] for r in rs])
        mean, std = losses.mean(axis=0), losses.std(axis=0, ddof=1) if len(rs) > 1 else np.zeros(len(steps))
        compute = np.asarray(steps) * statistics.fmean(r.flops_per_step for r in rs)
        for ax, x in zip(axes, (np.asarray(steps), to_pflops_days(1.0) * compute)):
            # markers: a curve of one evaluation (a short run) is a point, which a line alone does not draw
            ax.plot(x, mean, label=f"{_LABELS.get(name, name)} (n={len(rs)})", color=_COLORS.get(name), marker="o", ms=3)
            ax.fill_between(x, mean - std, mean + std, alpha=0.2, color=_COLORS.get(name))
    # steps are counted: a grid of one evaluation (preset tiny) was read at steps 3.80, 3.85, ...
    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    # Zoom on the second half of training, where the curves separate.
    for ax, xlabel in zip(axes, ("optimiser step", "training compute (PFLOP/s-days)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        lines = [ln.get_ydata() for ln in ax.get_lines()]
        if lines and len(lines[0]) > 3:
            tail = np.concatenate([y[len(y) // 3:] for y in lines])
            pad = 0.05 * (tail.max() - tail.min() + 1e-9)
            ax.set_ylim(tail.min() - pad, tail.max() + pad)
        ax.grid(alpha=0.3)
    if start is not None:
        axes[0].axvline(start, color="black", lw=0.8, ls=":", label="learning-rate decay starts")
    if axes[0].get_legend_handles_labels()[0]:  # else matplotlib warns "No artists with labels found"
        axes[0].legend()
    axes[0].set_title("equal steps")
    axes[1].set_title("equal compute")
    fig.tight_layout()
    save_figure_atomically(fig, path, "the grid's figure", dpi=120)


def _plot_magnitudes(groups: dict[str, list[Run]], path: Path) -> bool:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = [("block_output_rms", "output magnitude per block (Fig. 5b)", "RMS of the block's output"),
              ("block_input_rms", "hidden state entering each block", "RMS of the sublayer input"),
              ("block_grad_norm", "gradient magnitude per block (Fig. 5c)", "L2 norm of the block's gradient")]
    fig = Figure(figsize=(13, 3.6))
    axes = fig.subplots(1, 3)
    drew = False
    for ax, (key, title, ylabel) in zip(axes, panels):
        for name, rs in groups.items():
            curve = _mean_curve(rs, key)
            if curve is not None:
                ax.plot(np.arange(1, len(curve) + 1), curve, marker="o", ms=3, label=_LABELS.get(name, name),
                        color=_COLORS.get(name))
                drew = True
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("transformer block")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # blocks are counted: no fractional ticks (a few blocks)
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    if drew:  # no diagnostics record (a run shorter than diagnostics_every): no plot, and no empty legend
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        save_figure_atomically(fig, path, "the grid's figure", dpi=120)
    return drew


def _source_axis(weights: list[list[float]]) -> str:
    """The x label of a depth-weight heatmap, from the weights: Block AttnRes' output row has
    fewer sources than there are sublayer outputs and the embedding. (It was told by the variant's
    name, "block": a Block variant of another name, a Variant of the user's own, read "sublayer
    outputs"; and a block's partial sum, the last source of a row inside a block, went unsaid.)"""
    if len(weights[-1]) < len(weights):
        # two lines: on one it was wider than its panel, run into its neighbour's and cut at the figure's edge
        return "source (0 = embedding, then completed blocks,\nthen the current block's partial sum)"
    return "source (0 = embedding, then sublayer outputs)"


def _plot_depth_weights(groups: dict[str, list[Run]], path: Path) -> bool:
    """Fig. 8: one row per sublayer (pre-attention and pre-MLP apart, the output aggregation in
    both), one column per source; the first seed's last diagnostics."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    shown = [(name, rs[0].diagnostics["depth_weights"], rs[0].diagnostics) for name, rs in groups.items()
             if rs[0].diagnostics and rs[0].diagnostics.get("depth_weights")]
    if not shown:
        return False
    fig = Figure(figsize=(10, 3.6 * len(shown)))
    axes = fig.subplots(len(shown), 2, squeeze=False)
    for row, (name, weights, diag) in zip(axes, shown):
        width = max(len(w) for w in weights)
        for ax, parity, kind in zip(row, (0, 1), ("pre-attention", "pre-MLP")):
            rows = [w for l, w in enumerate(weights[:-1]) if l % 2 == parity] + [weights[-1]]
            grid = np.full((len(rows), width), np.nan)
            for i, w in enumerate(rows):
                grid[i, :len(w)] = w
            im = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            # blocks counted from 1, as magnitudes.png's x axis and mixing.png's rows count them (this
            # figure's "attn 0" was the first block's, magnitudes.png's block 1)
            ax.set_yticks(range(len(rows)), [f"{'attn' if parity == 0 else 'mlp'} {i + 1}" for i in range(len(rows) - 1)]
                          + ["output"], fontsize=7)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # sources are counted: no fractional ticks
            ax.set_xlabel(_source_axis(weights))
            step = f" (step {diag['step']})" if "step" in diag else ""  # the record's, not the run's last step
            ax.set_title(f"{_LABELS.get(name, name)}: {kind}{step}", fontsize=10)
            fig.colorbar(im, ax=ax)
    fig.tight_layout()
    save_figure_atomically(fig, path, "the grid's figure", dpi=120)
    return True


def _decay_gap_findings(groups: dict[str, list[Run]], start: int) -> list[str]:
    """Report Fig. 5a: the gap to the baseline "widening during the decay phase". Paired gap
    at the step the decay starts against the gap at the end."""
    base = {r.record["seed"]: r for r in groups.get(BASELINE, [])}
    out = []
    for name, rs in groups.items():
        pairs = [(r, base[r.record["seed"]]) for r in rs if name != BASELINE and r.record["seed"] in base]
        before = [r.loss_at_step(start) - b.loss_at_step(start) for r, b in pairs]
        end = [r.record["val_loss"] - b.record["val_loss"] for r, b in pairs]
        if not pairs or any(math.isnan(v) for v in before):
            continue
        (m0, _), (m1, _) = mean_std(before), mean_std(end)
        if len(pairs) < MIN_SEEDS_FOR_ORDERING:
            out.append(f"{_LABELS.get(name, name)}: gap to the standard model {m0:+.4f} when the learning-rate decay "
                       f"starts (step {start}), {m1:+.4f} at the end, over {len(pairs)} seed(s): {NO_ORDERING}")
            continue
        out.append(f"{_LABELS.get(name, name)}: gap to the standard model {m0:+.4f} when the learning-rate decay starts "
                   f"(step {start}), {m1:+.4f} at the end: it moves {abs(m1 - m0):.4f} "
                   f"{'in AttnRes’s favour' if m1 < m0 else 'against AttnRes'} during the decay, in AttnRes’s favour "
                   f"in {sum(e < b for e, b in zip(end, before))}/{len(pairs)} seed(s) (report Fig. 5a: in its favour).")
    return out


def stable_phase_multipliers(groups: dict[str, list[Run]], start: int, points: int = 5) -> dict[str, dict[int, Any]]:
    """Per AttnRes variant and evaluation step s before the decay (``points`` of them, evenly
    spread): the t-interval over seeds of ln m, m = the standard run's step at which its own
    curve reaches the variant's loss at s (same seed, stable phase only) over s, times the
    FLOPs-per-token ratio. A seed whose standard curve does not reach the loss before the
    decay gives a lower bound instead (">", start / s over the ratio), one whose loss at s is
    above the standard run's first evaluation an upper bound ("<"); those are counted apart:
    ``{name: {s: (interval or None, [(side, bound), ...])}}``."""
    base = {r.record["seed"]: r for r in groups.get(BASELINE, [])}
    if not base:
        return {}
    steps = [s for s in next(iter(base.values())).eval_steps if 0 < s <= start]
    picks = sorted({steps[round(i * (len(steps) - 1) / max(1, points - 1))] for i in range(points)}) if steps else []
    out: dict[str, dict[int, Any]] = {}
    for name, rs in groups.items():
        if name == BASELINE:
            continue
        for s in picks:
            logs, bounds = [], []
            for r in rs:
                b = base.get(r.record["seed"])
                if b is None:
                    continue
                stable = [(x, y) for x, y in zip(b.eval_steps, b.val_loss) if x <= start]
                loss = r.loss_at_step(s)
                reached = curve_crossing([x for x, _ in stable], [y for _, y in stable], loss)
                ratio = r.record["flops_per_token"] / b.record["flops_per_token"]
                if reached is not None:
                    logs.append(math.log(reached / s / ratio))
                elif stable and loss < min(y for _, y in stable):
                    bounds.append((">", stable[-1][0] / s / ratio))
                elif stable and loss >= stable[0][1]:
                    bounds.append(("<", stable[0][0] / s / ratio))
            if logs or bounds:
                out.setdefault(name, {})[s] = (t_interval(logs) if logs else None, bounds)
    return out


def _stable_phase_md(groups: dict[str, list[Run]], start: int) -> str:
    found = stable_phase_multipliers(groups, start)
    if not found:
        return ""
    steps = sorted({s for by in found.values() for s in by})
    rows = []
    for name, by in found.items():
        cells = []
        for s in steps:
            t, bounds = by.get(s, (None, []))
            cell = "" if t is None else f"{math.exp(t.mean):.2f}×" + (
                f" [{math.exp(t.low):.2f}, {math.exp(t.high):.2f}]" if t.low is not None else "") + f" (n={t.n})"
            for side, what in ((">", "not reached before the decay"), ("<", "above the first evaluation")):
                these = [v for d, v in bounds if d == side]
                if these:
                    edge = min(these) if side == ">" else max(these)
                    cell += ("; " if cell else "") + f"{len(these)} seed(s) {side} {edge:.2f}× ({what})"
            cells.append(cell or "–")
        rows.append([_LABELS.get(name, name)] + cells)
    return ("## Compute multiplier along the stable phase\n\nAt each step s before the decay (step "
            f"{start}): the step at which the standard run of the same seed reaches AttnRes's loss at s, along its "
            "own curve (stable phase only, linear in ln step and ln loss between evaluations), over s, times the FLOPs-per-token "
            "ratio; geometric mean over seeds with its 95 % Student-t interval. Both models are read at the same "
            "constant learning rate, so the decay does not favour either; it is a reading of one run per model, "
            "not of runs trained to each budget (`attnres experiment multiplier` trains those).\n\n"
            + markdown_table(["model"] + [f"s = {s}" for s in steps], rows))


def _findings(groups: dict[str, list[Run]], gaps: dict[str, Any], start: int | None = None,
              noisy: dict[str, tuple[float, float]] | None = None, repeats: int | None = None) -> list[str]:
    """Plain statements of what the measured numbers say about the report's claims; ``start``:
    the step a WSD decay begins; ``noisy``: :func:`equal_time_noise`."""
    out = []
    for name, g in gaps.items():
        for key, what in (("steps", "equal steps"), ("compute", "equal compute"), ("time", "equal time")):
            d = [v for v in g.get(key, []) if not math.isnan(v)]
            if not d:
                continue
            if key == "time" and name in (noisy or {}) and too_noisy(*noisy[name]):
                effect, spread = noisy[name]
                if math.isinf(spread):  # (too_few_rounds)
                    out.append(f"{_LABELS.get(name, name)} at equal time: too noisy to draw a conclusion: the step-time "
                               f"ratio was timed over {repeats} round(s), whose interval covers less than the 95 % its "
                               f"noise stands for ({EQUAL_TIME_ROUNDS} rounds give it). Re-time it with the same command "
                               f"and --overhead-repeats {EQUAL_TIME_ROUNDS} or more (finished runs are skipped).")
                    continue
                out.append(f"{_LABELS.get(name, name)} at equal time: too noisy to draw a conclusion: the step-time "
                           f"ratio's noise moves the paired gap ({effect:+.4f}) by up to {spread:.4f}. Re-time it on a "
                           "quieter machine with the same command (finished runs are skipped).")
                continue
            t = t_interval(d)
            if len(d) < MIN_SEEDS_FOR_ORDERING:
                out.append(f"{_LABELS.get(name, name)} at {what}: paired gap to the standard model {t.text('+.4f')} "
                           f"over {len(d)} seed(s): {NO_ORDERING}")
                continue
            better = f"better in {sum(v < 0 for v in d)}/{len(d)}"
            interval = "" if t.low is None else f"95 % t-interval [{t.low:+.4f}, {t.high:+.4f}], p = {t.p_value:.2g}, "
            if t.low is not None and not t.excludes(0.0):
                out.append(f"{_LABELS.get(name, name)} at {what}: no difference from the standard model resolved: paired "
                           f"gap {t.mean:+.4f} ({interval}over {len(d)} seeds; {better}).")
                continue
            verdict = ("lower" if t.mean < 0 else "higher") + " validation loss than the standard model"
            out.append(f"{_LABELS.get(name, name)} at {what}: {verdict} by {abs(t.mean):.4f} ({interval}paired over "
                       f"{len(d)} seed(s); {better}).")
    for name, rs in groups.items():
        outs, grads = _mean_curve(rs, "block_output_rms"), _mean_curve(rs, "block_grad_norm")
        inputs = _mean_curve(rs, "block_input_rms")
        if outs is None or grads is None or len(outs) < 2:
            continue
        monotone = bool(np.all(np.diff(outs) > 0))
        grad_cv = float(np.std(grads) / np.mean(grads))
        hidden = "" if inputs is None else f"; hidden state entering the blocks, last/first = {inputs[-1] / inputs[0]:.2f}"
        out.append(f"{_LABELS.get(name, name)}: block output magnitude last/first = {outs[-1] / outs[0]:.2f}"
                   f" ({'grows monotonically with depth' if monotone else 'not monotone in depth'}){hidden}; gradient "
                   f"magnitude first/last block = {grads[0] / grads[-1]:.2f}, spread over blocks (std/mean) = {grad_cv:.2f}.")
    if start is not None:
        out += _decay_gap_findings(groups, start)
    return out


def compare_markdown(records: list[dict[str, Any]], out: Path, untrained: Collection[str] = ()) -> str:
    """The body of the compare report (tables, plots written into ``out``, findings);
    ``untrained``: the grid's variants the report's head names as having no run."""
    runs = load_runs(out, records)
    order = [n for n in (BASELINE, "block", "full") if any(r.variant == n for r in runs)]
    groups = {n: [r for r in runs if r.variant == n] for n in order}
    groups.update({n: rs for n, rs in _by_variant(runs).items() if n not in groups})
    measured = read_overhead(out)
    repeats = measured.get("repeats", 10) if measured else 10
    tables, gaps, noisy = _tables(groups, measured["variants"] if measured else None, repeats, untrained)
    parts = [tables]
    start = decay_start(out, runs[0].record) if runs else None
    wsd_note = "" if start is None else (
        f"The learning rate decays from step {start} (WSD). The equal-compute column reads AttnRes mid-decay, before "
        "its learning rate has reached the end of its schedule, so it understates what AttnRes trained for that "
        "budget would reach; the same holds for equal time.\n\n")
    _plot_val_loss(groups, out / "val_loss.png", start)
    parts.append(f"## Validation loss\n\n{wsd_note}![validation loss](val_loss.png)")
    stable = _stable_phase_md(groups, start) if start is not None else ""
    if stable:
        parts.append(stable)
    if not any(r.diagnostics for r in runs):  # else the Fig. 5 and Fig. 8 sections are left out without a word
        parts.append("## Output and gradient magnitude, depth-attention weights (report Fig. 5, 8)\n\n"
                     "No run logged a diagnostics record: they end before their first `diagnostics_every` step. "
                     "Rerun with `diagnostics_every` at most `steps` (in another --out) for these figures.")
    if _plot_magnitudes(groups, out / "magnitudes.png"):
        parts.append("## Output and gradient magnitude per transformer block (report Fig. 5)\n\n"
                     "From the last diagnostics record of each run (mean over seeds). The report: output magnitude "
                     "grows monotonically with depth under PreNorm and stays bounded with Block AttnRes; gradients "
                     "concentrate in the earliest blocks under PreNorm and are more uniform with AttnRes.\n\n"
                     "![magnitudes](magnitudes.png)")
    if _plot_depth_weights(groups, out / "depth_weights.png"):
        parts.append("## Depth-attention weights (report Fig. 8)\n\nMean weight of each source, per sublayer "
                     "(first seed, last diagnostics record). The report: diagonal dominance (each sublayer leans "
                     "on its most recent sources), persistent weight on the embedding, broader pre-attention than "
                     "pre-MLP rows.\n\n![depth weights](depth_weights.png)")
    from .analyze import mixing_section  # loads checkpoints: only when the report is written

    mixing = mixing_section({n: [run_dir(out, r.variant, r.record["seed"]) for r in rs] for n, rs in groups.items()},
                            out, _LABELS)
    if mixing is not None:
        parts.append(mixing)
    findings = _findings(groups, gaps, start, noisy, repeats)
    if findings:
        parts.append("## Findings (computed)\n\n" + "\n".join(f"- {f}" for f in findings))
    return "\n\n".join(parts)
