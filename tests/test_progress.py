"""A training run's progress: a bar on a terminal, plain lines in a log (attnres.progress)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

import attnres.progress as progress_mod
from attnres.progress import StepProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_away_from_a_terminal_each_evaluation_is_one_plain_line(monkeypatch):
    """In a log file a tqdm bar was one line of carriage-return redraws (3 kB for 30 steps,
    megabytes for a long run), without the validation loss. Now: a line per ``mark``, and per
    ``show`` only once ``every_s`` has passed since the last line."""
    clock = iter([0.0, 5.0, 5.0, 10.0, 70.0, 200.0])
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: next(clock))
    log = io.StringIO()
    p = StepProgress(100, initial=0, stream=log, every_s=60)  # started at 0 s
    p.update(10)
    p.show(loss="6.0000")  # 5 s: too soon for a line
    assert log.getvalue() == ""
    p.mark(val_loss="5.9000")  # 5 s: a line
    p.update(10)
    p.show(loss="5.5000")  # 10 s: 5 s after the last line
    p.update(10)
    p.show(loss="5.0000")  # 70 s: 65 s after it
    p.update(70)
    p.mark(val_loss="4.0000")  # 200 s, the end: no time left to go
    p.close()
    assert log.getvalue().splitlines() == [
        "step 10/100  loss 6.0000  val_loss 5.9000  (0:05 elapsed, ~0:45 to go)",
        "step 30/100  loss 5.0000  val_loss 5.9000 (at step 10)  (1:10 elapsed, ~2:43 to go)",
        "step 100/100  loss 5.0000  val_loss 4.0000  (3:20 elapsed)",
    ]


def test_a_line_between_evaluations_says_the_step_its_validation_loss_is_from(monkeypatch):
    """A log's line at step 310 read 'val_loss 5.0833' beside that step's train loss, though
    the run evaluated at step 200 (eval_every=200): the loss of another model. A line after
    the evaluation names its step; the evaluation's own line, and a field ``show`` sets, do not."""
    clock = iter([0.0, 10.0, 80.0, 150.0])
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: next(clock))
    log = io.StringIO()
    p = StepProgress(1000, initial=0, stream=log, every_s=60)
    p.update(200)
    p.mark(val_loss="5.0833")  # the evaluation's line
    p.update(110)
    p.show(loss="4.7128", tok_s="3,458")  # a minute later, between evaluations
    p.update(90)
    p.show(val_loss="4.6000")  # a field shown as of this step
    assert log.getvalue().splitlines() == [
        "step 200/1000  val_loss 5.0833  (0:10 elapsed, ~0:40 to go)",
        "step 310/1000  val_loss 5.0833 (at step 200)  loss 4.7128  tok_s 3,458  (1:20 elapsed, ~2:58 to go)",
        "step 400/1000  val_loss 4.6000  loss 4.7128  tok_s 3,458  (2:30 elapsed, ~3:45 to go)",
    ]


def test_a_resumed_run_estimates_from_its_own_steps(monkeypatch):
    clock = iter([0.0, 3600.0 + 60.0])
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: next(clock))
    log = io.StringIO()
    p = StepProgress(1000, initial=900, stream=log)
    p.update(50)
    p.mark(val_loss="3.0000")
    assert log.getvalue() == "step 950/1000  val_loss 3.0000  (1:01:00 elapsed, ~1:01:00 to go)\n"


def test_a_run_that_stops_early_estimates_the_time_to_its_stop(monkeypatch):
    """``stop_after=K``: the invocation ends at step K, so the time to go is to K, not to
    ``steps`` (a job of 10 minutes said hours were left)."""
    clock = iter([0.0, 60.0, 120.0])
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: next(clock))
    log = io.StringIO()
    p = StepProgress(1000, initial=100, stream=log, stop=300)
    p.update(100)
    p.mark(val_loss="3.0000")
    p.update(100)
    p.mark(val_loss="2.9000")
    assert log.getvalue().splitlines() == [
        "step 200/1000  val_loss 3.0000  (1:00 elapsed, ~1:00 to go to step 300 (stop_after))",
        "step 300/1000  val_loss 2.9000  (2:00 elapsed)",
    ]


def test_on_a_terminal_a_bar_shows_the_validation_loss_too():
    pytest.importorskip("tqdm")
    screen = Terminal()
    p = StepProgress(10, stream=screen)
    p.update(5)
    p.show(loss="6.0000", tok_s="1,000")
    p.mark(val_loss="5.9000")
    p.update(5)
    p.close()
    drawn = screen.getvalue()
    assert "\r" in drawn and "step 5/10" not in drawn
    assert "10/10" in drawn and "loss=6.0000" in drawn and "val_loss=5.9000" in drawn


def test_on_a_terminal_a_run_that_stops_early_fills_its_bar_to_its_stop():
    """``stop_after=K`` on a terminal: the bar ran to ``steps`` and its time to go was to
    ``steps`` (hours, for a job that ends in minutes), while the log lines counted to K."""
    pytest.importorskip("tqdm")
    screen = Terminal()
    p = StepProgress(1000, initial=100, stream=screen, stop=300)
    assert p.bar.total == 300  # (tqdm's time to go: the steps left to its total at the measured rate)
    p.update(100)
    p.close()
    assert "to stop_after=300 of 1000 steps" in screen.getvalue() and "200/300" in screen.getvalue()
    whole = StepProgress(1000, initial=100, stream=Terminal())
    assert whole.bar.total == 1000 and not whole.bar.desc


def test_a_training_run_in_a_log_writes_lines_with_its_validation_loss(tmp_path: Path, capfd):
    pytest.importorskip("yaml")
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main

    corpus = write_corpus(tmp_path / "corpus.txt")
    assert cli_main(["train", *overrides(corpus, tmp_path / "run", progress="true")]) == 0
    err = capfd.readouterr().err
    assert "step/s" not in err  # no bar
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split("  ")[0] for line in lines] == ["step 3/6", "step 6/6"]  # eval_every=3
    assert all("  val_loss " in line and "  loss " in line for line in lines), lines  # (the train loss too)


def test_other_bars_in_a_log_are_redrawn_once_a_minute_not_ten_times_a_second():
    pytest.importorskip("tqdm")
    assert progress_mod.progress_bar(total=3, file=io.StringIO()).mininterval == progress_mod.LOG_INTERVAL_S
    assert progress_mod.progress_bar(total=3, file=Terminal()).mininterval == 0.1
    assert progress_mod.progress_bar(False, total=3) is None


def test_other_bars_in_a_jupyter_notebook_are_redrawn_as_on_a_terminal():
    """A notebook's output is no terminal: a perplexity or tokenising bar there was redrawn once
    a minute, as in a log file, and looked stuck at 0 % meanwhile."""
    pytest.importorskip("tqdm")
    cell = type("OutStream", (io.StringIO,), {"__module__": "ipykernel.iostream"})()
    assert progress_mod.progress_bar(total=3, file=cell).mininterval == 0.1


def test_a_jupyter_notebook_gets_a_bar_not_lines():
    """A notebook's output is no terminal, but it redraws a bar in place: the bar, not lines."""
    pytest.importorskip("tqdm")
    cell = type("OutStream", (io.StringIO,), {"__module__": "ipykernel.iostream"})()
    p = StepProgress(10, stream=cell)
    p.update(5)
    p.mark(val_loss="5.9000")
    p.close()
    assert p.bar is None and "step 5/10" not in cell.getvalue() and "5/10" in cell.getvalue()


def _tiny_llama_directory(path: Path) -> Path:
    from fixtures.tiny_families import tiny_model

    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf.export import make_hf_tokenizer

    tiny_model("llama", vocab_size=256).save_pretrained(path)
    make_hf_tokenizer(ByteTokenizer()).save_pretrained(path)
    return path


def _transformers_command(name: str, llama: Path, tmp_path: Path) -> list[str]:
    text = tmp_path / "held_out.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 8)
    if name in ("analyze", "train") and not (tmp_path / "up").exists():  # (they read an upcycle)
        from attnres.hf.upcycle.io import upcycle_directory
        from attnres.progress import transformers_bars

        with transformers_bars(False):  # (the set-up's bars are not the command's)
            upcycle_directory(llama, tmp_path / "up", "attnres_block", 2)
    if name == "train":  # (a new out_dir per call, and text enough for its windows)
        (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 400)
        out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
        return ["train", f"model.from_hf={tmp_path / 'up'}", f"init_from={tmp_path / 'up'}", "steps=1", "warmup_steps=0",
                "seq_len=16", "batch_size=2", "eval_batches=1", "progress=false", "tensorboard=false",
                f"data.paths=[{tmp_path / 'corpus.txt'}]", f"out_dir={out}"]
    return {"generate": ["generate", str(llama), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"],
            "eval": ["eval", str(llama), "--tasks", "none", "--text", str(text), "--device", "cpu",
                     "--out", str(tmp_path / "results.json")],
            "upcycle": ["upcycle", "--model", str(llama), "--out", str(tmp_path / "up")],
            # (analyze of an upcycle, and train's init_from of one, printed the bar: a log's line per redraw)
            "analyze": ["analyze", str(tmp_path / "up"), "--text", str(text), "--seq-len", "16", "--device", "cpu",
                        "--out", str(tmp_path / "analysis")]}[name]


@pytest.mark.parametrize("command", ["generate", "eval", "upcycle", "analyze", "train"])
@pytest.mark.parametrize("user_had_them", [True, False])
def test_transformers_bars_follow_ours_and_the_users_setting_is_kept(command, user_had_them, tmp_path, capsys):
    """`attnres generate/eval/upcycle/analyze DIR` (and train's init_from=DIR) in a log printed transformers' own "Loading weights"
    (and upcycle's "Writing model shards") bars, carriage-return redraws our bars avoid there.
    Away from a terminal they are off; on one they show; after the command, transformers'
    setting is the one a Python caller had."""
    pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    from attnres.cli import main as cli_main

    llama = _tiny_llama_directory(tmp_path / "llama")
    capsys.readouterr()
    (hf_logging.enable_progress_bar if user_had_them else hf_logging.disable_progress_bar)()
    try:
        assert cli_main(_transformers_command(command, llama, tmp_path)) == 0
        err = capsys.readouterr().err
        assert "Loading weights" not in err and "Writing model shards" not in err, err
        assert hf_logging.is_progress_bar_enabled() == user_had_them
        if user_had_them:  # on a terminal: shown, as ours are
            with pytest.MonkeyPatch.context() as patch:
                terminal = Terminal()
                patch.setattr("sys.stderr", terminal)
                assert cli_main(_transformers_command(command, llama, tmp_path)) == 0
            assert "Loading weights" in terminal.getvalue(), terminal.getvalue()
            assert hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()
