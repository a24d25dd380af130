"""``attnres plot``: the loss curves of runs trained one by one, in one figure
(attnres.experiments.curves)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from attnres.cli import main as cli_main  # noqa: E402
from attnres.experiments.curves import read_curves, run_labels  # noqa: E402


def write_run(path: Path, records: list[dict]) -> Path:
    """A run directory as attnres train leaves it, as far as plot reads: config.json and metrics.jsonl."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model": {"residual": "standard"}, "steps": 10}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def train_record(step: int, loss: float) -> dict:
    return {"kind": "train", "step": step, "loss": loss, "tokens": 64 * step}


def eval_record(step: int, loss: float) -> dict:
    return {"kind": "eval", "step": step, "val_loss": loss, "tokens": 64 * step}


@pytest.fixture()
def runs(tmp_path) -> Path:
    root = tmp_path / "runs"
    # lr-1: resumed from step 2 after it had logged steps 3-4 (logged again), a diverged step's NaN
    write_run(root / "lr-1", [train_record(1, 5.0), train_record(2, 4.0), eval_record(2, 4.2), train_record(3, 9.0),
                              train_record(4, 9.0), train_record(3, 3.5), train_record(4, math.nan),
                              train_record(5, 3.0), eval_record(5, 3.1)])
    write_run(root / "lr-2", [train_record(1, 5.5), train_record(2, 4.5), eval_record(2, 4.6)])
    write_run(root / "fresh", [])  # started, nothing logged yet
    return root


def test_the_curves_are_what_the_log_holds_once_per_step(runs):
    curves = read_curves(runs / "lr-1")
    assert curves.train["step"] == [1, 2, 3, 5]  # step 3 as logged last, step 4's NaN left out
    assert curves.train["loss"] == [5.0, 4.0, 3.5, 3.0] and curves.train["tokens"] == [64, 128, 192, 320]
    assert (curves.val["step"], curves.val["loss"]) == ([2, 5], [4.2, 3.1])
    assert read_curves(runs / "fresh").empty and read_curves(runs / "nowhere").empty


def test_unreadable_metrics_lines_are_counted_once_per_run(runs, tmp_path, recwarn):
    """A metrics.jsonl line cut short (a kill mid-write) or of the wrong types (a hand edit)
    was skipped without a word. One line per run says how many were skipped, in which file,
    and which lines; the curves drawn are the same."""
    log = runs / "lr-1" / "metrics.jsonl"
    before = read_curves(runs / "lr-1")
    log.write_text(log.read_text() + json.dumps({"kind": "train", "step": 9, "loss": "high"}) + '\n{"kind": "tr')
    n = len(log.read_text().splitlines())
    assert cli_main(["plot", str(runs), "--out", str(tmp_path / "curves.png")]) == 0
    said = [str(w.message) for w in recwarn if "metrics.jsonl" in str(w.message)]
    assert said == [f"{str(log)!r}: skipped 2 unreadable line(s) [{n - 1}, {n}] (a run killed mid-write leaves a "
                    "truncated last line)"]
    assert read_curves(runs / "lr-1") == before


def test_runs_are_labelled_by_what_tells_them_apart(tmp_path):
    a, b = tmp_path / "sweep" / "lr-1", tmp_path / "sweep" / "lr-2"
    assert run_labels([a, b]) == ["lr-1", "lr-2"]
    assert run_labels([a, tmp_path / "other" / "x"]) == ["sweep/lr-1", "other/x"]
    assert run_labels([a]) == ["lr-1"]


def test_the_command_draws_every_run_found_and_names_those_without_a_loss(runs, tmp_path, capsys):
    out = tmp_path / "curves.png"
    assert cli_main(["plot", str(runs), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"attnres plot: wrote {out} (2 runs: lr-1, lr-2); no loss logged yet: fresh")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = tmp_path / "tokens.svg"
    assert cli_main(["plot", str(runs / "lr-1"), str(runs / "lr-2"), "--x", "tokens", "--smooth", "0", "--log-x",
                     "--out", str(svg)]) == 0
    assert "training tokens" in svg.read_text()  # the x axis's label


def test_a_figure_that_fails_mid_write_leaves_the_one_before_whole(runs, tmp_path, writes_cut_short, capsys):
    """The figure was saved in place: a kill or a full disk mid-write left a figure cut short
    where the last one was (and a full disk ended in a traceback). It is saved beside and
    renamed into place: the figure before stays whole, in one line naming --out and the cause."""
    cut_short, snapshot = writes_cut_short
    out = tmp_path / "figure" / "curves.png"
    out.parent.mkdir()
    assert cli_main(["plot", str(runs), "--out", str(out)]) == 0
    before = snapshot(out.parent)
    cut_short()
    with pytest.raises(SystemExit, match=r"attnres plot: error: --out '.*curves.png' could not be written: no space"):
        cli_main(["plot", str(runs), "--out", str(out)])
    assert snapshot(out.parent) == before


@pytest.mark.parametrize("argv, message", [
    (["--out", "curves.jpg"], r"--out 'curves.jpg': give a file ending in .png, .pdf, .svg"),
    (["--smooth", "1"], r"--smooth: must be a number in \[0, 1\)"),
    (["--smooth", "x"], r"--smooth: must be a number in \[0, 1\)"),
    (["no-such-folder"], r"no such folder: 'no-such-folder'"),
])
def test_bad_arguments_are_refused_by_name(argv, message, runs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["plot", str(runs), *argv])
    assert exit_.value.code not in (0, None)
    import re

    assert re.search(message, str(exit_.value.code) + capsys.readouterr().err)


def test_nothing_to_draw_is_said(runs, tmp_path):
    with pytest.raises(SystemExit, match="no run has logged a loss yet"):
        cli_main(["plot", str(runs / "fresh"), "--out", str(tmp_path / "c.png")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no training runs under"):
        cli_main(["plot", str(tmp_path / "empty"), "--out", str(tmp_path / "c.png")])
    assert not (tmp_path / "c.png").exists()


def test_a_run_of_checkpoints_without_its_log_is_said_to_miss_the_log(runs, tmp_path, capsys):
    """A run copied with its checkpoints but not its metrics.jsonl was told "a run's directory
    holds config.json and metrics.jsonl" (alone) or "no loss logged yet" (beside others): its
    log is what is missing, and attnres train is what writes it."""
    copied = tmp_path / "copied"
    (copied / "checkpoints" / "step-10").mkdir(parents=True)
    (copied / "config.json").write_text((runs / "lr-1" / "config.json").read_text())
    with pytest.raises(SystemExit) as exit_:
        cli_main(["plot", str(copied), "--out", str(tmp_path / "c.png")])
    said = str(exit_.value.code)
    assert said.startswith("attnres plot: error: no run has a loss to draw; no metrics.jsonl (the run's log of its "
                           "losses, which attnres train writes from the run's start") and "copied" in said
    assert "holds config.json and metrics.jsonl" not in said and not (tmp_path / "c.png").exists()
    (runs / "copied").mkdir()
    (runs / "copied" / "checkpoints").mkdir()
    (runs / "copied" / "config.json").write_text((copied / "config.json").read_text())
    assert cli_main(["plot", str(runs), "--out", str(tmp_path / "c.png")]) == 0
    assert capsys.readouterr().out.startswith(f"attnres plot: wrote {tmp_path / 'c.png'} (2 runs: lr-1, lr-2); no loss "
                                              "logged yet: fresh; no metrics.jsonl (the run's log of its losses")


def test_without_matplotlib_the_extra_is_named(runs, tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    with pytest.raises(SystemExit, match=r"attnres plot: error: this needs the 'experiments' extra: .*matplotlib"):
        cli_main(["plot", str(runs), "--out", str(tmp_path / "c.png")])
    # in Python too (it said "import of matplotlib halted", nothing of the extra; the README draws this way)
    from attnres.experiments.curves import plot_curves, read_curves

    with pytest.raises(ModuleNotFoundError, match=r"^plot_curves needs the 'experiments' extra: .*\[experiments\]") as e:
        plot_curves({"run": read_curves(runs / "lr-1")})
    assert e.value.name == "matplotlib"


def test_the_command_offers_the_axes_the_figure_draws():
    from attnres.cli import plot as command
    from attnres.experiments import curves

    assert command.AXES == curves.AXES  # (the command keeps its own copy: --help imports no experiments)
    with pytest.raises(ValueError, match="x must be one of"):
        curves.plot_curves({}, "unused.png", x="epoch")


def test_drawing_from_python_returns_the_figure_and_leaves_the_sessions_matplotlib_alone(runs, tmp_path,
                                                                                          users_matplotlib):
    """``plot_curves`` and ``plot_mixing_panels`` called ``matplotlib.use("Agg")``: in a notebook
    every later figure of the user's stopped showing (and pyplot kept the figures they drew
    until closed); the figure itself was not returned, only written to a file."""
    import matplotlib
    import matplotlib.pyplot as plt
    import torch
    from matplotlib.figure import Figure

    from attnres.analysis.mixing_report import plot_mixing_panels
    from attnres.experiments.curves import plot_curves

    fig = plot_curves({"lr-1": read_curves(runs / "lr-1")})  # no path: drawn, nothing written
    assert isinstance(fig, Figure) and [ax.get_title() for ax in fig.axes][1] == "validation loss"
    panels = plot_mixing_panels([("M", torch.eye(3), None)], tmp_path / "mixing.png")
    assert isinstance(panels, Figure) and (tmp_path / "mixing.png").read_bytes()[:4] == b"\x89PNG"
    assert matplotlib.get_backend() == "svg" and plt.get_fignums() == users_matplotlib


def test_a_run_whose_every_loss_is_not_finite_is_called_diverged_not_unstarted(runs, tmp_path, capsys):
    """A diverged run (every logged loss NaN) was listed as "no loss logged yet", as if it had
    not started, and alone it ended with "no run has logged a loss yet"."""
    write_run(tmp_path / "sweep" / "lr-10", [train_record(1, math.nan), eval_record(1, math.inf)])
    assert read_curves(tmp_path / "sweep" / "lr-10").nonfinite == 2
    out = tmp_path / "curves.png"
    assert cli_main(["plot", str(runs / "lr-2"), str(tmp_path / "sweep" / "lr-10"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("(1 run: runs/lr-2); no finite loss logged (diverged): sweep/lr-10")
    with pytest.raises(SystemExit, match=r"no run has logged a finite loss; no loss logged yet: runs/fresh; no finite loss "
                       r"logged \(diverged\): sweep/lr-10 \("):
        cli_main(["plot", str(runs / "fresh"), str(tmp_path / "sweep" / "lr-10"), "--out", str(out)])


def test_a_run_that_logged_one_training_loss_is_drawn_as_a_point(tmp_path):
    """A run shorter than ``log_every`` (README's notebook example: 4 steps) logs one training
    loss, its last step's. Its training panel was empty - a line through one point draws
    nothing - while its legend gave the value; the validation panel drew its one point."""
    from attnres.experiments.curves import plot_curves

    run = write_run(tmp_path / "short", [train_record(4, 4.8), eval_record(4, 4.7)])
    train_ax, _ = plot_curves({"short": read_curves(run)}).axes
    drawn = [line for line in train_ax.get_lines() if len(line.get_xdata())]
    assert drawn and all(line.get_marker() == "o" for line in drawn)
    assert [list(line.get_xdata()) for line in drawn] == [[4], [4]]  # the raw loss and the smoothed
    long_run = write_run(tmp_path / "long", [train_record(1, 5.0), train_record(2, 4.0)])
    train_ax, _ = plot_curves({"long": read_curves(long_run)}).axes
    assert {line.get_marker() for line in train_ax.get_lines() if len(line.get_xdata())} == {"None"}


def test_a_run_that_diverged_before_its_first_logged_step_is_called_diverged(tmp_path, capsys):
    """A run stopped at step 3 by a NaN gradient norm, log_every=10, logged only its
    ``diverged`` record: ``attnres plot`` said "no run has logged a loss yet (a run's directory
    holds config.json and metrics.jsonl)", as if it had not started, of a directory holding both."""
    run = write_run(tmp_path / "runs" / "lr-1e4", [{"kind": "diverged", "step": 3, "loss": 2.6e11, "grad_norm": None,
                                                     "nonfinite": {"grad_norm": "NaN"}}])
    assert read_curves(run).diverged == 3 and read_curves(run).empty
    with pytest.raises(SystemExit, match=r"no run has logged a finite loss; no finite loss logged \(diverged\): lr-1e4 "):
        cli_main(["plot", str(run), "--out", str(tmp_path / "curves.png")])


def test_runs_that_do_not_compare_are_said_so(tmp_path):
    """A byte run beside a BPE run was drawn on one "nats per token" axis, and against steps a
    run of 128 tokens a step beside one of 32, both without a word: the curves looked like a
    comparison. The plot is drawn, with a warning naming each run's tokenizer or tokens per step."""
    root = tmp_path / "runs"
    for name, vocab, tokenizer, per_step in (("byte", 256, "byte", 64), ("bpe", 4096, "bpe", 64),
                                             ("long", 4096, "bpe", 256)):
        run = write_run(root / name, [{**train_record(2, 4.0), "tokens": 2 * per_step},
                                      {**eval_record(2, 4.1), "tokens": 2 * per_step}])
        (run / "config.json").write_text(json.dumps({"model": {"vocab_size": vocab}, "data": {"tokenizer": tokenizer}}))
    out = str(tmp_path / "curves.png")
    with pytest.warns(UserWarning) as shown:
        assert cli_main(["plot", str(root / "byte"), str(root / "bpe"), "--out", out]) == 0
    assert [str(w.message) for w in shown] == [
        "the runs' losses are per token of different tokenizers (byte: 256 tokens (byte), bpe: 4096 tokens (bpe)), "
        "which do not compare; attnres eval gives each run's bits per byte, which do"]
    with pytest.warns(UserWarning) as shown:
        assert cli_main(["plot", str(root / "bpe"), str(root / "long"), "--out", out]) == 0
    assert [str(w.message) for w in shown] == [
        "the runs train on different tokens per step (bpe: 64, long: 256): at equal steps they have seen different "
        "amounts of data; --x tokens draws them at equal data"]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # at equal data: nothing to say
        assert cli_main(["plot", str(root / "bpe"), str(root / "long"), "--out", out, "--x", "tokens"]) == 0
    # one tokenizer on other text (the newest checkpoints' data fingerprints): drawn side by side without a word
    for name, fingerprint in (("bpe", "a" * 64), ("long", "b" * 64)):
        (root / name / "checkpoints" / "step-00000002").mkdir(parents=True)
        (root / name / "checkpoints" / "step-00000002" / "state.json").write_text(
            json.dumps({"data": {"fingerprint": fingerprint}}))
    with pytest.warns(UserWarning) as shown:
        assert cli_main(["plot", str(root / "bpe"), str(root / "long"), "--out", out, "--x", "tokens"]) == 0
    assert [str(w.message) for w in shown] == [
        f"the runs trained on different text (data fingerprints bpe: {'a' * 12}, long: {'b' * 12}), so their losses "
        "do not compare"]
    # one run resumed onto other text (allow_data_change): its validation curve is of two texts
    resumed = write_run(root / "resumed", [train_record(2, 4.0), eval_record(2, 4.1),
                                           {"kind": "data_change", "step": 2, "fingerprint": "b" * 64, "before": "a" * 64},
                                           train_record(4, 3.0), eval_record(4, 3.5)])
    with pytest.warns(UserWarning) as shown:
        assert cli_main(["plot", str(resumed), "--out", out]) == 0
    assert [str(w.message) for w in shown] == [
        "resumed was resumed onto other text (allow_data_change) at step 2: its validation loss before and after is "
        "of two texts' validation splits, which do not compare"]


def test_every_run_of_a_large_grid_is_drawn_its_own_way(runs):
    """Past matplotlib's 10 colours the 11th run was drawn as the 1st (an ablation grid's 12
    variants: 'mhc' and 'baseline' one blue line, one blue legend entry each). Each run now
    differs from every other in colour, line style or marker, in both panels and legends."""
    from attnres.experiments.curves import plot_curves

    one = read_curves(runs / "lr-1")
    fig = plot_curves({f"run-{k}": one for k in range(23)}, smooth=0)
    for ax in fig.axes:
        handles, labels = ax.get_legend_handles_labels()
        assert labels == [f"run-{k} (last {v:.4f})" for k, v in [(k, one.train["loss"][-1] if ax is fig.axes[0]
                                                                else one.val["loss"][-1]) for k in range(23)]]
        looks = [(h.get_color(), h.get_linestyle(), h.get_marker()) for h in handles]
        assert len(set(looks)) == 23, looks


def test_the_training_legend_says_which_last_value_is_raw_and_which_smoothed(runs):
    """The training legend gave the last raw loss beside the smoothed curve, unlabelled: read as
    where the bold line ends, it was off by a step's noise. It says both, each by name; without
    smoothing, the last loss."""
    from attnres.experiments.curves import _ema, plot_curves

    curves = read_curves(runs / "lr-1")
    raw, smoothed = curves.train["loss"][-1], _ema(curves.train["loss"], 0.6)[-1]
    assert f"{raw:.4f}" != f"{smoothed:.4f}"
    train_ax, val_ax = plot_curves({"lr-1": curves}, smooth=0.6).axes
    assert train_ax.get_legend_handles_labels()[1] == [f"lr-1 (last {raw:.4f} raw, {smoothed:.4f} smoothed)"]
    assert val_ax.get_legend_handles_labels()[1] == [f"lr-1 (last {curves.val['loss'][-1]:.4f})"]
    assert plot_curves({"lr-1": curves}, smooth=0).axes[0].get_legend_handles_labels()[1] == [f"lr-1 (last {raw:.4f})"]


def test_the_step_axis_of_a_run_of_one_logged_step_has_whole_ticks(tmp_path):
    """A run of one logged step (``steps=1``) was drawn against ticks 0.96, 0.98, 1.00, ...:
    optimiser steps and tokens are counted, so both axes tick at whole numbers (a log axis
    keeps its own ticks)."""
    from attnres.experiments.curves import plot_curves

    run = write_run(tmp_path / "one", [train_record(1, 5.5), eval_record(1, 5.4)])
    for x in ("step", "tokens"):
        fig = plot_curves({"one": read_curves(run)}, x=x)
        fig.canvas.draw()  # the locator places the ticks at drawing
        for ax in fig.axes:
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks), (x, ax.get_title(), ticks)
