"""``metrics.jsonl`` is strict JSON: a value that is not a finite number is written as null and
named in the record's ``nonfinite`` field (attnres.train.metrics); every reader in the
package reads such a file as it reads one of an earlier version, with bare ``NaN`` /
``Infinity``."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from attnres.experiments.curves import read_curves
from attnres.experiments.job.compare import load_runs
from attnres.experiments.job.runner import median_step_time
from attnres.experiments.layout import run_dir
from attnres.train.metrics import MetricsLogger, read_metrics
from attnres.train.status import run_status

NAN, INF = math.nan, math.inf

#: A run whose validation loss diverged at step 4 (NaN), with an infinite rate and RMS on the way.
RECORDS = [
    ("train", 2, dict(loss=4.0, lr=1e-3, grad_norm=1.0, tokens=128, tokens_per_s=INF)),
    ("eval", 2, dict(val_loss=4.1, tokens=128)),
    ("diagnostics", 2, dict(block_grad_norm=[0.5, 0.25], block_output_rms=[1.0, INF], block_input_rms=[1.0, -INF],
                            depth_weights=[[1.0], [0.5, NAN]])),
    ("train", 4, dict(loss=NAN, lr=1e-3, grad_norm=2.0, tokens=256, tokens_per_s=100.0)),
    ("eval", 4, dict(val_loss=NAN, tokens=256)),
]


def refuse(constant):
    raise ValueError(f"not JSON: {constant}")


def write_runs(root: Path) -> tuple[Path, Path]:
    """The same records as an earlier version wrote them (``json.dumps``: bare NaN) and as the
    metrics log writes them now, in two run directories of an ``attnres compare`` grid."""
    old, new = run_dir(root, "old", 0), run_dir(root, "new", 0)
    for run in (old, new):
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"model": {"residual": "standard"}, "steps": 4}))
    (old / "metrics.jsonl").write_text("".join(json.dumps({"kind": k, "step": s, **v}) + "\n" for k, s, v in RECORDS))
    logger = MetricsLogger(new, tensorboard=False, resume_step=None)
    for kind, step, values in RECORDS:
        logger.log(kind, step, **values)
    logger.close()
    return old, new


def same(a, b) -> bool:
    """Equal, NaN equal to NaN (compared as Python's json writes them)."""
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def test_the_log_is_strict_json_and_says_which_values_were_not_finite(tmp_path):
    _, new = write_runs(tmp_path)
    lines = [json.loads(line, parse_constant=refuse) for line in (new / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["tokens_per_s"] is None and lines[0]["nonfinite"] == {"tokens_per_s": "Infinity"}
    assert lines[1] == {"kind": "eval", "step": 2, "val_loss": 4.1, "tokens": 128}  # finite: as before
    assert lines[2]["nonfinite"] == {"block_output_rms/1": "Infinity", "block_input_rms/1": "-Infinity",
                                     "depth_weights/1/1": "NaN"}
    assert lines[2]["depth_weights"] == [[1.0], [0.5, None]]
    assert lines[4] == {"kind": "eval", "step": 4, "val_loss": None, "tokens": 256, "nonfinite": {"val_loss": "NaN"}}


def test_old_and_new_logs_read_alike_in_every_reader(tmp_path):
    old, new = write_runs(tmp_path)
    got = read_metrics(new / "metrics.jsonl")
    assert same(got, read_metrics(old / "metrics.jsonl")) and same(got, [{"kind": k, "step": s, **v}
                                                                         for k, s, v in RECORDS])
    assert math.isnan(got[4]["val_loss"]) and got[0]["tokens_per_s"] == INF and got[2]["block_input_rms"][1] == -INF
    # attnres status, plot, compare (its curves and diagnostics), the grid's step times
    assert same(run_status(new).to_dict() | {"path": ""}, run_status(old).to_dict() | {"path": ""})
    assert math.isnan(run_status(new).val_loss) and math.isnan(run_status(new).train_loss)
    assert same(dataclasses.asdict(read_curves(new)), dataclasses.asdict(read_curves(old)))
    new_run, old_run = load_runs(tmp_path, [{"variant": "new", "seed": 0}, {"variant": "old", "seed": 0}])
    assert same(new_run.val_loss, old_run.val_loss) and math.isnan(new_run.val_loss[-1])
    assert same(new_run.diagnostics, old_run.diagnostics)
    assert median_step_time(new / "metrics.jsonl", 128) == median_step_time(old / "metrics.jsonl", 128)


def test_a_resumed_log_keeps_its_records_strict(tmp_path):
    """On resume the log is rewritten up to the checkpoint's step: an old file's NaN lines
    become strict ones, and are read back the same."""
    old, _ = write_runs(tmp_path)
    before = read_metrics(old / "metrics.jsonl")
    MetricsLogger(old, tensorboard=False, resume_step=4).close()
    for line in (old / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=refuse)
    assert same(read_metrics(old / "metrics.jsonl"), before)


@pytest.mark.parametrize("marks", ['"oops"', '{"val_loss": "NaN", "nowhere/3": "NaN", "tokens": "NaN"}'])
def test_a_nonfinite_field_that_does_not_fit_is_ignored(tmp_path, marks):
    path = tmp_path / "metrics.jsonl"
    path.write_text(f'{{"kind": "eval", "step": 1, "val_loss": null, "tokens": 5, "nonfinite": {marks}}}\n')
    (record,) = read_metrics(path)
    assert record["tokens"] == 5 and "nonfinite" not in record
    assert record["val_loss"] is None if marks == '"oops"' else math.isnan(record["val_loss"])


def test_a_resumed_run_keeps_the_tensorboard_events_of_its_checkpoints_step(tmp_path):
    """Resumed from the checkpoint of step 2, TensorBoard dropped the train and eval events of
    step 2 itself (``purge_step`` purges the step given and later ones), which the resumed run
    does not log again: every resume left a hole at its checkpoint's step, which
    metrics.jsonl kept."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(tmp_path, tensorboard=True, resume_step=None)
    for step in (1, 2, 3):  # step 3 after the checkpoint of step 2: logged again on resume
        first.log("train", step, loss=float(step))
    first.close()
    resumed = MetricsLogger(tmp_path, tensorboard=True, resume_step=2)
    resumed.log("train", 3, loss=30.0)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_a_resumed_log_cut_short_by_a_failed_write_keeps_its_records(tmp_path, monkeypatch):
    """On resume the log was rewritten in place: a full disk (or a kill) part-way left
    metrics.jsonl cut short, the run's history before the checkpoint gone. It is written
    beside it and renamed into place: a failure leaves the log as it was."""
    import errno

    old, _ = write_runs(tmp_path)
    before = (old / "metrics.jsonl").read_text()

    def full_disk(self, text, *args, **kwargs):
        with open(self, "w") as f:
            f.write(text[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        MetricsLogger(old, tensorboard=False, resume_step=2)
    monkeypatch.undo()
    assert (old / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in old.iterdir() if p.name.startswith(".")) == []  # (no temporary file left)


def test_a_fresh_run_in_a_directory_of_an_earlier_attempt_shows_only_its_own_tensorboard_events(tmp_path):
    """A run killed before its first checkpoint, then started again in the same out_dir (with
    other settings): metrics.jsonl started over, but TensorBoard showed the first attempt's
    events beside the new run's, one curve of two runs."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(tmp_path, tensorboard=True, resume_step=None)
    for step in (10, 20, 30):
        first.log("train", step, loss=float(step))
    first.close()
    again = MetricsLogger(tmp_path, tensorboard=True, resume_step=None)
    again.log("train", 10, loss=1.0)
    again.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(10, 1.0)]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [10]


@pytest.mark.parametrize("line", ['{"kind": "eval", "step": "x", "val_loss": 1.0}',
                                  '{"kind": "train", "step": 3, "loss": "high", "tokens": 96}',
                                  '{"kind": "train", "step": 3, "loss": 1.0, "tokens_per_s": "fast"}',
                                  '{"kind": "eval", "step": 3, "val_loss": 1.0, "tokens": "many"}',
                                  '{"kind": 7, "step": 3}', '{"kind": "eval", "step": true, "val_loss": 1.0}'])
def test_a_line_of_the_wrong_types_is_skipped_as_unreadable(tmp_path, line, capsys):
    """A line edited by hand with a string where a number goes stopped attnres status and plot
    with a traceback ('>' not supported between 'int' and 'str', Unknown format code 'f'). It is
    skipped as an unreadable line, and the rest of the log is read."""
    from attnres.cli import main as cli_main

    _, run = write_runs(tmp_path)
    with (run / "metrics.jsonl").open("a") as f:
        f.write(line + "\n")
    with pytest.warns(UserWarning, match=r"skipped 1 unreadable line\(s\) \[6\]"):
        assert same(read_metrics(run / "metrics.jsonl"), [{"kind": k, "step": s, **v} for k, s, v in RECORDS])
    assert run_status(run).step == 4 and read_curves(run).train["step"] == [2]
    assert cli_main(["status", str(run)]) == 0
    pytest.importorskip("matplotlib")  # (attnres plot's extra, experiments)
    assert cli_main(["plot", str(run), "--out", str(tmp_path / "curves.png"), "--x", "tokens"]) == 0


def test_a_fresh_run_keeps_the_log_of_an_earlier_start_that_left_no_checkpoint(tmp_path, capsys):
    """A run killed before its first checkpoint, then started again in the same out_dir: the
    new run's metrics.jsonl replaced the first attempt's, its only record of the steps it
    trained, without a word. The earlier log is moved aside (metrics.jsonl.old-1, then -2, ...)
    and one line says so; an empty log (a start that trained no step) is just replaced."""
    from test_train import overrides, write_corpus

    from attnres.train import load_config, train

    first = MetricsLogger(tmp_path, tensorboard=False, resume_step=None)
    assert first.kept_aside is None  # (nothing there before it)
    first.log("train", 10, loss=1.0)
    first.close()
    again = MetricsLogger(tmp_path, tensorboard=False, resume_step=None)
    assert again.kept_aside == tmp_path / "metrics.jsonl.old-1"
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl.old-1")] == [10]
    assert read_metrics(tmp_path / "metrics.jsonl") == []
    assert MetricsLogger(tmp_path, tensorboard=False, resume_step=None).kept_aside is None  # (empty: nothing kept)

    run = tmp_path / "run"  # a killed run: its config and log, no checkpoint
    corpus = write_corpus(tmp_path / "corpus.txt")
    run.mkdir()
    killed = MetricsLogger(run, tensorboard=False, resume_step=None)
    killed.log("train", 1, loss=5.0)
    killed.close()
    (run / "metrics.jsonl.old-1").write_text("")  # (taken: the next free name is used)
    capsys.readouterr()
    train(load_config(None, overrides(corpus, run, steps=1, warmup_steps=0, eval_every=100, diagnostics_every=100)))
    assert ("attnres train: kept the metrics.jsonl an earlier start left in out_dir (no checkpoint) as "
            "metrics.jsonl.old-2\n") in capsys.readouterr().out
    assert [r["loss"] for r in read_metrics(run / "metrics.jsonl.old-2")] == [5.0]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"] == [1]
