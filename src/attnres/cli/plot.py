"""``attnres plot``: the loss curves of training runs, side by side in one figure."""

from __future__ import annotations

import argparse

#: The x axes (:func:`attnres.experiments.curves.plot_curves`'s ``x``) and the file types a
#: figure may be written as (matplotlib's, by suffix); here, so that ``attnres --help``
#: imports nothing of the experiments.
AXES = ("step", "tokens")
FIGURE_SUFFIXES = (".png", ".pdf", ".svg")


def add_parser(sub) -> None:
    pl = sub.add_parser(
        "plot", help="the training and validation loss curves of runs, side by side in one figure",
        description="Draw the training loss (raw and smoothed) and the validation loss of the training runs at or "
        "under each DIR (a run or one of its checkpoints, a folder of runs, a grid's --out; default runs/) in one "
        "figure, one colour per run: e.g. `attnres plot runs/baseline runs/block --out curves.png`. Reads the "
        "runs' metrics.jsonl only, so a run still training is drawn as far as it got.",
    )
    pl.add_argument("dirs", nargs="*", default=["runs"], metavar="DIR", help="runs or folders of runs (default: runs)")
    pl.add_argument("--out", default="curves.png",
                    help=f"the figure to write ({', '.join(FIGURE_SUFFIXES)}; default curves.png); its folder must exist")
    pl.add_argument("--x", choices=AXES, default="step", help="the x axis: optimiser steps (default) or training tokens "
                    "(runs of different batch sizes compared at equal data)")
    pl.add_argument("--smooth", type=_smoothing, default=0.6,
                    help="weight of the training loss's moving average, in [0, 1) (TensorBoard's; 0 = none; "
                    "default 0.6)")
    pl.add_argument("--log-x", action="store_true", help="a logarithmic x axis")


def _smoothing(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1) (0 = no smoothing); got {text!r}")
    return value


def run(args, parser) -> int:
    from pathlib import Path

    from ..experiments.curves import plot_curves, read_curves, run_labels
    from ..output_paths import OutputPathError, check_output_file
    from ..train.metrics import METRICS_FILE
    from .common import runs_under

    out = Path(args.out)
    if out.suffix.lower() not in FIGURE_SUFFIXES:
        parser.commands["plot"].error(f"--out {args.out!r}: give a file ending in {', '.join(FIGURE_SUFFIXES)}")
    runs = runs_under("plot", args.dirs)
    try:
        check_output_file(out)
    except OutputPathError as e:
        raise SystemExit(f"attnres plot: error: {e}") from None
    paths = dict(zip(run_labels(runs), runs))
    curves = {label: read_curves(path) for label, path in paths.items()}
    # (a run of checkpoints without its log - copied without it - was "no loss logged yet", and alone
    # told that a run's directory holds config.json and metrics.jsonl, where it held config.json)
    no_log = [label for label, c in curves.items() if c.empty and not (paths[label] / METRICS_FILE).is_file()]
    # (every loss NaN or infinite, or the run stopped by a diverged step before it logged one)
    diverged = [label for label, c in curves.items()
                if c.empty and (c.nonfinite or c.diverged is not None) and label not in no_log]
    empty = [label for label, c in curves.items() if c.empty and label not in diverged + no_log]
    drawn = {label: c for label, c in curves.items() if not c.empty}
    left_out = "".join(f"; {what}: {', '.join(labels)}" for what, labels in (
        ("no loss logged yet", empty), ("no finite loss logged (diverged)", diverged),
        (f"no {METRICS_FILE} (the run's log of its losses, which attnres train writes from the run's start; "
         "the run was copied or cleaned without it?)", no_log)) if labels)
    if not drawn:
        what = (f"no training runs under {', '.join(args.dirs)}" if not runs else f"no run has a loss to draw{left_out}"
                if no_log else "no run has logged a loss yet" if not diverged
                else f"no run has logged a finite loss{left_out}")
        hint = "" if no_log else f" (a run's directory holds config.json and {METRICS_FILE})"
        raise SystemExit(f"attnres plot: error: {what}{hint}")
    _warn_incomparable(drawn, paths, args.x)
    try:
        plot_curves(drawn, out, x=args.x, smooth=args.smooth, log_x=args.log_x)
    except OutputPathError as e:  # (a disk that filled up since the check: the figure that was there stays)
        raise SystemExit(f"attnres plot: error: {e}") from None
    print(f"attnres plot: wrote {out} ({len(drawn)} run{'s' if len(drawn) > 1 else ''}: {', '.join(drawn)}){left_out}")
    return 0


def _warn_incomparable(drawn: dict, paths: dict, x: str) -> None:
    """Warn where the figure sets side by side what does not compare: losses per token of
    different tokenizers (a byte run's and a BPE run's: nats per byte against per word piece,
    drawn on one axis of "nats per token") or of one tokenizer on different text (their newest
    checkpoints' data fingerprints), or, against steps, runs of different tokens per step."""
    from ..experiments.curves import tokenizer_of, tokens_per_step
    from ..train.status import run_data
    from ..user_warning import warn_user

    def differing(values: dict) -> str | None:
        known = {label: v for label, v in values.items() if v is not None}
        return ", ".join(f"{label}: {v}" for label, v in known.items()) if len(set(known.values())) > 1 else None

    tokenizers = differing({label: tokenizer_of(paths[label]) for label in drawn})
    if tokenizers:
        warn_user(f"the runs' losses are per token of different tokenizers ({tokenizers}), which do not "
                  "compare; attnres eval gives each run's bits per byte, which do")
    texts = None if tokenizers else differing({label: run_data(paths[label]) for label in drawn})
    if texts:  # (one tokenizer: a baseline and a variant on other text looked like a comparison)
        warn_user(f"the runs trained on different text (data fingerprints {texts}), so their losses do not compare")
    for label, c in drawn.items():  # (one run's validation curve across a resume onto other text: two texts' losses)
        if c.data_changes:
            warn_user(f"{label} was resumed onto other text (allow_data_change) at step "
                      f"{', '.join(map(str, c.data_changes))}: its validation loss before and after is of two texts' "
                      "validation splits, which do not compare")
    per_step = differing({label: (f"{n:,.0f}" if n is not None else None)
                          for label, n in ((label, tokens_per_step(c)) for label, c in drawn.items())})
    if x == "step" and per_step:
        warn_user(f"the runs train on different tokens per step ({per_step}): at equal steps they have "
                  "seen different amounts of data; --x tokens draws them at equal data")
