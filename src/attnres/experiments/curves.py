"""Loss curves of training runs (``attnres plot``): each run's training and validation losses,
read from its ``metrics.jsonl``, drawn on one figure - runs trained one by one (a baseline and
a Block AttnRes run, a learning-rate sweep) side by side, where ``attnres compare`` draws the
runs it trains itself.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..extras import require_extra
from ..output_paths import read_json_object, save_figure_atomically
from ..train.metrics import DATA_CHANGE, METRICS_FILE, read_metrics
from ..train.status import tokenizer_description

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Curves", "plot_curves", "read_curves", "run_labels", "tokenizer_of", "tokens_per_step"]

#: What the x axis may count: optimiser steps or training tokens.
AXES = ("step", "tokens")


@dataclass
class Curves:
    """One run's losses: ``train`` and ``val`` map an axis name (``step``, ``tokens``) and
    ``loss`` to equally long lists, in step order; ``nonfinite``: the steps whose logged loss
    was not a finite number (left out of the curves: a diverged run's); ``diverged``: the step
    whose loss or gradient norm stopped the run (its ``diverged`` record), if one did;
    ``data_changes``: the steps it was resumed at onto other text (its ``data_change`` records)."""

    train: dict[str, list[float]] = field(default_factory=lambda: {"step": [], "tokens": [], "loss": []})
    val: dict[str, list[float]] = field(default_factory=lambda: {"step": [], "tokens": [], "loss": []})
    nonfinite: int = 0
    diverged: int | None = None
    data_changes: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.train["step"] and not self.val["step"]


def read_curves(run: str | Path) -> Curves:
    """The losses ``run``'s metrics log holds. A step logged twice (a run resumed from an
    earlier checkpoint logs the steps after it again) keeps its last record; a loss that is
    not finite (a diverged step) is left out of the curve. Lines that cannot be read are
    skipped with one warning naming the file, their count and their numbers."""
    train: dict[int, tuple[float, float]] = {}
    val: dict[int, tuple[float, float]] = {}
    diverged, data_changes = None, set()
    for record in read_metrics(Path(run) / METRICS_FILE):
        kind, loss = record["kind"], record.get("loss" if record["kind"] == "train" else "val_loss")
        if kind in ("train", "eval"):
            loss = float(loss) if isinstance(loss, (int, float)) else math.nan
            (train if kind == "train" else val)[int(record["step"])] = (float(record.get("tokens", math.nan)), loss)
        elif kind == "diverged":  # (before its first log_every, the only record of a run)
            diverged = int(record["step"])
        elif kind == DATA_CHANGE:  # (a resume repeated from the same checkpoint writes it again)
            data_changes.add(int(record["step"]))
    curves = Curves(nonfinite=sum(not math.isfinite(loss) for points in (train, val) for _, loss in points.values()),
                    diverged=diverged, data_changes=sorted(data_changes))
    for points, into in ((train, curves.train), (val, curves.val)):
        for step in sorted(s for s, (_, loss) in points.items() if math.isfinite(loss)):
            into["step"].append(step)
            into["tokens"].append(points[step][0])
            into["loss"].append(points[step][1])
    return curves


def tokenizer_of(run: str | Path) -> str | None:
    """The tokenizer ``run``'s losses are per token of, as its ``config.json`` says
    (:func:`~attnres.train.status.tokenizer_description`); ``None`` when unreadable."""
    config, _ = read_json_object(Path(run) / "config.json")
    return tokenizer_description(config) if config is not None else None


def tokens_per_step(curves: Curves) -> float | None:
    """The training tokens of one step of the run ``curves`` were read from (from its logged
    records: ``tokens`` over ``step``), ``None`` when it logged none."""
    for points in (curves.train, curves.val):
        if points["step"] and math.isfinite(points["tokens"][-1]):
            return points["tokens"][-1] / points["step"][-1]
    return None


def run_labels(runs: list[Path]) -> list[str]:
    """Each run's path with the folders all of them share left out (``runs/lr-1e-3`` and
    ``runs/lr-3e-3``: ``lr-1e-3``, ``lr-3e-3``); one run: its folder's name."""
    if len(runs) <= 1:
        return [r.resolve().name for r in runs]
    resolved = [r.resolve() for r in runs]
    common = Path(os.path.commonpath(resolved))
    return [str(r.relative_to(common)) for r in resolved]


def _ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
    out, average, norm = [], 0.0, 0.0
    for v in values:
        average, norm = weight * average + (1 - weight) * v, weight * norm + (1 - weight)
        out.append(average / norm)
    return out


def _last(points: dict[str, list[float]], smooth: float = 0.0) -> str:
    """A legend's last value: the last logged loss, and beside a smoothed curve the smoothed one
    too - where the bold line ends (the raw value alone, beside the smoothed curve, read as the
    curve's end and was off it by a step's noise)."""
    if not points["step"]:
        return ""
    raw = points["loss"][-1]
    return f" (last {raw:.4f} raw, {_ema(points['loss'], smooth)[-1]:.4f} smoothed)" if smooth else f" (last {raw:.4f})"


#: The line styles and markers of the runs after matplotlib's first 10 colours, 10 runs each.
_LINE_STYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D")


def plot_curves(curves: dict[str, Curves], path: str | Path | None = None, x: str = "step", smooth: float = 0.6,
                log_x: bool = False) -> Figure:
    """Two panels: each run's training loss (raw and faint, and smoothed by an exponential
    moving average of weight ``smooth``, 0 = none) and its validation loss, against ``x``
    (:data:`AXES`), one colour per run in both, the legends with each run's last logged
    value (the training loss's smoothed one beside it when ``smooth``: "last 3.0012 raw,
    3.1045 smoothed"). Returns the matplotlib ``Figure`` (a notebook shows it), also written to ``path``
    (``.png``, ``.pdf``, ``.svg``) when given. Drawn without pyplot: matplotlib's backend and
    pyplot's figures are left as they are, and the figure is freed with its last reference."""
    if x not in AXES:
        raise ValueError(f"x must be one of {AXES}; got {x!r}")
    require_extra("experiments", "matplotlib", "plot_curves")  # (a notebook gets the extra, as the command)
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 4))
    train_ax, val_ax = fig.subplots(1, 2)
    for k, (label, c) in enumerate(curves.items()):
        # matplotlib's 10 colours, then again with the next line style and marker: the 11th run
        # (a grid's 12 ablations) was drawn as the 1st, one colour for two runs in both legends
        color, style, marker = f"C{k % 10}", _LINE_STYLES[k // 10 % 4], _MARKERS[k // 10 % 4]
        if c.train["step"]:
            # a run shorter than log_every logs one training loss, its last step's: a point,
            # which a line alone does not draw either
            point = {"marker": marker, "ms": 3} if len(c.train["step"]) == 1 else {}
            train_ax.plot(c.train[x], c.train["loss"], color=color, ls=style, alpha=0.25 if smooth else 1.0, lw=0.8,
                          **point)
            if smooth:
                train_ax.plot(c.train[x], _ema(c.train["loss"], smooth), color=color, ls=style, lw=1.4, **point)
        if c.val["step"]:  # markers: a run of one evaluation is a point, which a line alone does not draw
            val_ax.plot(c.val[x], c.val["loss"], color=color, ls=style, marker=marker, ms=3, lw=1.4)
        # one legend entry per run in both panels (a run without evaluations too), the last values said
        train_ax.plot([], [], color=color, ls=style, label=label + _last(c.train, smooth))
        val_ax.plot([], [], color=color, ls=style, marker=marker, ms=3, label=label + _last(c.val))
    xlabel = "optimiser step" if x == "step" else "training tokens"
    for ax, title in ((train_ax, "training loss" + (f" (smoothed, {smooth:g})" if smooth else "")),
                      (val_ax, "validation loss")):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (nats per token)")
        if log_x:
            ax.set_xscale("log")
        else:  # steps and tokens are counted: a run of one logged step was read at steps 0.96, 0.98, ...
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        save_figure_atomically(fig, path, "--out", dpi=120)
    return fig
