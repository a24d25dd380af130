"""Run management (issue 15): the tokenizer and the data's fingerprint inside every
checkpoint, the run-directory lock, recovery (a corrupted checkpoint, --resume-from, a
truncated metrics log, init_from), changing ``steps`` on resume, overrides that change only
what they name, and the start-up summary."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("yaml")

from safetensors.torch import load_file  # noqa: E402
from test_train import assert_same_weights, final_weights, overrides, write_corpus  # noqa: E402

from attnres import AttnResLM, ModelConfig  # noqa: E402
from attnres.cli import main as cli_main  # noqa: E402
from attnres.data import dataset as dataset_mod  # noqa: E402
from attnres.data import load_corpus, prepare_data  # noqa: E402
from attnres.data import tokenizer as tokenizer_mod  # noqa: E402
from attnres.data.tokenizer import BPETokenizer, run_interruptibly  # noqa: E402
from attnres.inference.loading import load_run, load_tokenizer  # noqa: E402
from attnres.train import latest_checkpoint, load_config, train  # noqa: E402
from attnres.train.cpu_memory import retains_freed_memory  # noqa: E402
from attnres.checkpoint import CheckpointError, read_checkpoint_state  # noqa: E402
from attnres.train.lock import LOCK_FILE, RunLock, RunLocked  # noqa: E402
from attnres.train.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def corpus_file(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus.txt")


def bpe(corpus: Path, out: Path, **extra) -> list[str]:
    """Overrides of a tiny run with a small BPE (300 tokens), caches under the run's folder."""
    return overrides(corpus, out, **{"data.tokenizer": "bpe", "data.vocab_size": 300,
                                     "data.cache_dir": str(out.parent / "cache"), **extra})


def edit_one_word(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("fox", "cat", 1), encoding="utf-8")


# -- 2: the tokenizer and the data fingerprint live in the checkpoint -------------------

def test_checkpoint_stores_tokenizer_and_data_fingerprint(tmp_path, corpus_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train(load_config(None, bpe(Path("corpus.txt"), tmp_path / "run", steps=2)))  # a relative data path
    ckpt = latest_checkpoint(tmp_path / "run")
    state = read_checkpoint_state(ckpt)  # verifies tokenizer.json against its SHA-256 too
    assert state["tokenizer"]["kind"] == "bpe" and "tokenizer.json" in state["files"]
    assert state["data"]["fingerprint"] == load_corpus(["corpus.txt"]).digest
    stored = BPETokenizer.load(ckpt / "tokenizer.json")
    assert stored.vocab_size == state["tokenizer"]["vocab_size"] == state["config"]["model"]["vocab_size"]

    # From another directory, after the data changed: the stored tokenizer, no retraining.
    edit_one_word(corpus_file)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(dataset_mod, "train_bpe", lambda *a: pytest.fail("the BPE was retrained"))
    text = "the quick brown fox jumps over the lazy dog"
    assert load_tokenizer(tmp_path / "run").encode(text) == stored.encode(text)
    assert cli_main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "the quick", "--max-new-tokens",
                     "3", "--temperature", "0"]) == 0


def test_validation_split_is_found_from_another_directory(tmp_path, corpus_file, monkeypatch):
    """A run trained on a relative ``data.paths`` gives its validation split (``attnres eval``'s
    default text) from any directory: the checkpoint records the data's absolute paths (it
    was looked up relative to the current directory: "data path 'corpus.txt' does not exist").
    Data that is gone is reported with the checkpoint and how to go on (--text)."""
    monkeypatch.chdir(tmp_path)
    train(load_config(None, overrides(Path("corpus.txt"), tmp_path / "run", steps=1, warmup_steps=0)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same data: no warning that it changed
        assert load_run(tmp_path / "run").validation_text() == load_corpus([str(corpus_file)]).val
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    corpus_file.rename(tmp_path / "moved.txt")
    with pytest.raises(SystemExit, match=r"cannot be read again from its data \[.*corpus.txt'\]: data path .* does "
                                         r"not exist; pass the held-out text \(--text FILE\)"):
        cli_main(["eval", str(tmp_path / "run"), "--tasks", "none", "--device", "cpu"])


def test_byte_tokenizer_is_stored_as_a_marker(tmp_path, corpus_file):
    train(load_config(None, overrides(corpus_file, tmp_path / "run", steps=1)))
    ckpt = latest_checkpoint(tmp_path / "run")
    state = read_checkpoint_state(ckpt)
    assert state["tokenizer"] == {"kind": "byte", "vocab_size": 256, "fingerprint": "byte"}
    assert not (ckpt / "tokenizer.json").exists()
    assert load_tokenizer(ckpt).encode("é") == list("é".encode())


def test_a_run_trains_with_your_own_tokenizer_json(tmp_path, corpus_file, monkeypatch, capsys):
    """``data.tokenizer=PATH``: a ``tokenizer.json`` (or a directory holding one, a
    transformers model's) tokenises the data, is stored with every checkpoint and sets the
    model's vocabulary; its special tokens (a BOS its post-processor adds) are not inserted
    into the text. A misspelt kind is refused by the config, a path that does not exist
    before training; a run started from a checkpoint keeps that checkpoint's tokenizer and
    says that the one asked for is not used."""
    from tokenizers import processors

    from attnres.data.tokenizer import train_bpe

    own = train_bpe(load_corpus([str(corpus_file)]).train, 280)
    backend = own.backend
    backend.add_special_tokens(["<bos>"])
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[
        ("<bos>", backend.token_to_id("<bos>"))])
    (tmp_path / "tok").mkdir()
    own = BPETokenizer(backend)
    own.save(tmp_path / "tok" / "tokenizer.json")
    assert backend.encode("the fox").ids[0] == backend.token_to_id("<bos>")  # as it would, unasked
    run = tmp_path / "run"
    monkeypatch.setattr(dataset_mod, "train_bpe", lambda *a: pytest.fail("a BPE was trained"))
    result = train(load_config(None, overrides(corpus_file, run, steps=2, warmup_steps=0, **{"data.tokenizer": str(tmp_path / "tok")})))
    state = read_checkpoint_state(result.checkpoint)
    assert f"tokenizer bpe, 281 tokens, read from {tmp_path / 'tok'};" in capsys.readouterr().out  # not "made from the data"
    assert state["tokenizer"]["fingerprint"] == own.fingerprint and state["tokenizer"]["kind"] == "bpe"
    assert state["config"]["model"]["vocab_size"] == own.vocab_size == 281
    stored = load_tokenizer(run)
    text = "the quick brown fox"
    assert stored.encode(text) == backend.encode(text, add_special_tokens=False).ids and stored.decode(
        stored.encode(text)) == text
    with pytest.raises(ValueError, match=r"data.tokenizer must be one of 'bpe', 'byte', or the path of a "
                                         r"tokenizer.json .*; got 'bpr'"):
        load_config(None, overrides(corpus_file, tmp_path / "x", **{"data.tokenizer": "bpr"}))
    with pytest.raises(ValueError, match=r"data.tokenizer '.*nope.json' does not exist: give a tokenizer.json"):
        train(load_config(None, overrides(corpus_file, tmp_path / "x", **{"data.tokenizer": str(tmp_path / "nope.json")})))
    for misspelt, meant in (("tk", "tok"), ("tok/tokenizr.json", "tokenizer.json")):  # (the nearest name: was none)
        with pytest.raises(ValueError, match=rf"data.tokenizer '.*{misspelt}' does not exist \(did you mean "
                                             rf"'{meant}'\?\): give a tokenizer.json"):
            train(load_config(None, overrides(corpus_file, tmp_path / "x",
                                              **{"data.tokenizer": str(tmp_path / misspelt)})))
    (tmp_path / "notes.json").write_text("plain text")
    with pytest.raises(ValueError, match=r"cannot read tokenizer file '.*notes.json' \(a tokenizer.json of the "
                                         r"tokenizers library, as a checkpoint or attnres export holds\): "):
        train(load_config(None, overrides(corpus_file, tmp_path / "x", **{"data.tokenizer": str(tmp_path / "notes.json")})))
    assert not (tmp_path / "x" / "checkpoints").exists()
    with pytest.warns(UserWarning, match=r"data.tokenizer='byte' is not used: a run started from .* keeps the "
                                         r"tokenizer stored with it \(bpe, 281 tokens\)"):
        result = train(load_config(None, overrides(corpus_file, tmp_path / "init", steps=1, warmup_steps=0, init_from=str(run))))
    assert read_checkpoint_state(result.checkpoint)["tokenizer"]["fingerprint"] == own.fingerprint
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*is not used")  # the same file: nothing to say
        train(load_config(None, overrides(corpus_file, tmp_path / "init2", steps=1, warmup_steps=0, init_from=str(run),
                                          **{"data.tokenizer": str(tmp_path / "tok" / "tokenizer.json")})))


def test_the_tokenizer_a_started_run_keeps_is_named_by_its_model(tmp_path):
    """init_from a run trained with a WordLevel tokenizer.json and data.tokenizer=byte warned
    that the run keeps the tokenizer stored with it "(bpe, 15 tokens)" - how it is stored, not
    what it is - while the start-up summary said "tokenizer wordlevel, 15 tokens"."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models, pre_tokenizers

    from attnres.train.setup import warn_if_tokenizer_unused

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "fox": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    source = SimpleNamespace(path=tmp_path / "run" / "checkpoints" / "step-00000003")
    with pytest.warns(UserWarning, match=r"keeps the tokenizer stored with it \(wordlevel, 3 tokens\)"):
        warn_if_tokenizer_unused("byte", BPETokenizer(backend), source)


def test_resume_refuses_changed_data_unless_allowed(tmp_path, corpus_file):
    run = tmp_path / "run"
    train(load_config(None, bpe(corpus_file, run, stop_after=3)))
    stored = (latest_checkpoint(run) / "tokenizer.json").read_text()
    edit_one_word(corpus_file)
    with pytest.raises(ValueError, match=r"data differ .*allow_data_change=true"):
        train(load_config(None, bpe(corpus_file, run, resume="true")))
    with pytest.warns(UserWarning, match="allow_data_change=true: the data differ"):
        result = train(load_config(None, bpe(corpus_file, run, resume="true", allow_data_change="true")))
    assert result.step == 6
    after = read_checkpoint_state(result.checkpoint)
    # The checkpoint's tokenizer carried on (same ids); the new data's fingerprint is recorded.
    assert (result.checkpoint / "tokenizer.json").read_text() == stored
    assert after["data"]["fingerprint"] == load_corpus([str(corpus_file)]).digest
    # the log says where its validation losses change text (they were drawn as one curve without a word)
    changes = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "data_change"]
    assert changes == [{"kind": "data_change", "step": 3, "fingerprint": after["data"]["fingerprint"],
                        "before": read_checkpoint_state(run / "checkpoints" / "step-00000003")["data"]["fingerprint"]}]


def test_a_data_change_is_logged_once_per_resume_that_makes_it(tmp_path, corpus_file):
    """Resuming twice from the checkpoint before a change of text (resume_from it again) kept
    the first resume's data_change record, at the resume step, and added the second's: plot
    and status read two changes. Resumed from it once more onto the old text, the run kept
    a change it no longer made. The record at the resume step is the resume's own to write."""
    from attnres.checkpoint import read_checkpoint_state

    run = tmp_path / "run"
    train(load_config(None, bpe(corpus_file, run, stop_after=3)))
    before = latest_checkpoint(run)
    original = corpus_file.read_text(encoding="utf-8")
    edit_one_word(corpus_file)
    again = dict(resume_from=str(before), allow_data_change="true")

    def changes() -> list[int]:
        return [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "data_change"]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(load_config(None, bpe(corpus_file, run, resume="true", allow_data_change="true")))
        assert changes() == [3]
        train(load_config(None, bpe(corpus_file, run, **again)))
        assert changes() == [3]
        corpus_file.write_text(original, encoding="utf-8")  # (back onto the checkpoint's own text)
        train(load_config(None, bpe(corpus_file, run, **again)))
    assert changes() == []
    assert read_checkpoint_state(latest_checkpoint(run))["data"] == read_checkpoint_state(before)["data"]


def test_a_resume_onto_other_data_takes_no_earlier_version_s_cache_of_it(tmp_path, corpus_file):
    """A resumed run that allow_data_change lets onto other text took an earlier version's
    token cache of that text (its ids cut inside whitespace runs, see docs/data.md) with "It is
    kept for this run, which resumes a checkpoint that may have trained on it": the checkpoint
    trained on none of that text, and its data position starts over. The run makes its own,
    as a new run given the checkpoint's tokenizer does."""
    run = tmp_path / "run"
    train(load_config(None, bpe(corpus_file, run, stop_after=3)))
    tok = BPETokenizer.load(latest_checkpoint(run) / "tokenizer.json")
    other = write_corpus(tmp_path / "other.txt", seed=1)
    made = prepare_data(load_corpus([str(other)], 0.02), "bpe", 300, str(tmp_path / "cache"), given=tok)
    earlier = made.cache_dir.rename(made.cache_dir.with_name(made.cache_dir.name.removesuffix(dataset_mod.CUT_SUFFIX)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(load_config(None, bpe(other, run, resume="true", allow_data_change="true")))
    assert result.step == 6
    said = [str(w.message) for w in caught]
    assert any("allow_data_change=true: the data differ" in m for m in said), said
    assert not [m for m in said if "made by an earlier attnres" in m], said
    assert earlier.exists() and made.cache_dir.exists()  # (made again, the earlier one left)


def test_unchanged_data_at_another_path_resumes(tmp_path, corpus_file):
    """The data is identified by its content: a moved corpus resumes bit-exactly."""
    train(load_config(None, overrides(corpus_file, tmp_path / "full")))
    train(load_config(None, overrides(corpus_file, tmp_path / "split", stop_after=3)))
    moved = tmp_path / "moved" / "corpus.txt"
    moved.parent.mkdir()
    corpus_file.rename(moved)
    train(load_config(None, overrides(moved, tmp_path / "split", resume="true")))
    assert_same_weights(final_weights(tmp_path / "full"), final_weights(tmp_path / "split"))


def strip_to_old_format(ckpt: Path) -> None:
    """Make a checkpoint look like one of an earlier version: no tokenizer, no fingerprint."""
    state = json.loads((ckpt / "state.json").read_text())
    for key in ("tokenizer", "data", "init_from", "state_sha256"):
        state.pop(key, None)
    state["files"].pop("tokenizer.json", None)
    (ckpt / "tokenizer.json").unlink(missing_ok=True)
    (ckpt / "state.json").write_text(json.dumps(state))


def test_old_checkpoints_fall_back_with_a_warning(tmp_path, corpus_file):
    run = tmp_path / "run"
    train(load_config(None, bpe(corpus_file, run, stop_after=3)))
    strip_to_old_format(latest_checkpoint(run))
    with pytest.warns(UserWarning, match="stores no tokenizer"):
        tok = load_tokenizer(run)
    assert tok.kind == "bpe"
    with pytest.warns(UserWarning, match="stores no data fingerprint"):
        assert train(load_config(None, bpe(corpus_file, run, resume="true"))).step == 6



def _as_an_earlier_versions_cache(cache_root: Path) -> BPETokenizer:
    """Rename the one BPE cache in ``cache_root`` as an earlier version named it (without
    -cleancut), its tokenizer.json one that training a BPE again does not give: an earlier
    version's BPE trained on its text cut elsewhere (stood in for by two ids swapped). Returns it."""
    (cache,) = [d for d in cache_root.iterdir() if d.name.endswith(dataset_mod.CUT_SUFFIX)]
    earlier = cache.rename(cache.with_name(cache.name.removesuffix(dataset_mod.CUT_SUFFIX)))
    doc = json.loads((earlier / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    a, b = (k for k, v in vocab.items() if v in (256, 257))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (earlier / "tokenizer.json").write_text(json.dumps(doc))
    return BPETokenizer.load(earlier / "tokenizer.json")


def test_an_old_checkpoint_takes_the_tokenizer_of_the_cache_it_trained_on(tmp_path, corpus_file):
    """A checkpoint that stores no tokenizer (an earlier version's) trained with the BPE of its
    token cache, which that version named without -cleancut. load_tokenizer and a resumed run
    trained a BPE again (and tokenised the corpus into a new -cleancut cache), which need not
    give that one: an earlier version's training read the text cut elsewhere (after the first
    of three line breaks at a ~1 MB cut, a BPE of 4000 tokens on 1 MB came out otherwise),
    with the same number of tokens, so no check caught it. They take that cache's tokenizer."""
    run = tmp_path / "run"
    train(load_config(None, bpe(corpus_file, run, stop_after=3)))
    strip_to_old_format(latest_checkpoint(run))
    earlier = _as_an_earlier_versions_cache(tmp_path / "cache")
    with pytest.warns(UserWarning, match="stores no tokenizer.*the token cache it trained on"):
        assert load_tokenizer(run).fingerprint == earlier.fingerprint
    assert not [d for d in (tmp_path / "cache").iterdir() if d.name.endswith(dataset_mod.CUT_SUFFIX)]
    with pytest.warns(UserWarning, match="stores no data fingerprint"):
        assert train(load_config(None, bpe(corpus_file, run, resume="true"))).step == 6
    assert read_checkpoint_state(latest_checkpoint(run))["tokenizer"]["fingerprint"] == earlier.fingerprint


def test_the_start_up_summary_says_the_tokenizer_of_an_old_checkpoint_came_from_its_cache(tmp_path, corpus_file,
                                                                                          capsys):
    """A run resumed from a checkpoint that stores no tokenizer, which takes the tokenizer of
    the token cache it trained on (warned as such), said in its start-up summary that the
    tokenizer was "stored in the checkpoint". It says where it came from."""
    run = tmp_path / "run"
    train(load_config(None, bpe(corpus_file, run, stop_after=3)))
    strip_to_old_format(latest_checkpoint(run))
    _as_an_earlier_versions_cache(tmp_path / "cache")
    capsys.readouterr()
    with pytest.warns(UserWarning, match="stores no tokenizer.*the token cache it trained on"):
        assert train(load_config(None, bpe(corpus_file, run, resume="true"))).step == 6
    said = [line for line in capsys.readouterr().out.splitlines() if "; tokenizer bpe, " in line]
    assert len(said) == 1 and "stored in the checkpoint" not in said[0], said
    assert "tokenizer bpe, 300 tokens, from the token cache the checkpoint trained on (it stores none);" in said[0]

# -- 3: the run-directory lock ------------------------------------------------------------

def test_a_second_run_on_a_locked_out_dir_is_refused(tmp_path, corpus_file):
    run = tmp_path / "run"
    with RunLock(run):  # as a live run holds it, in the middle of writing a checkpoint
        in_progress = run / "checkpoints" / ".tmp-step-00000002-1"
        in_progress.mkdir(parents=True)
        with pytest.raises(RunLocked, match=rf"in use by another run: PID {os.getpid()} on host '{socket.gethostname()}'"):
            train(load_config(None, overrides(corpus_file, run, steps=2)))
        with pytest.raises(SystemExit, match="attnres train: error: .* in use by another run"):
            cli_main(["train", *overrides(corpus_file, run, steps=2, resume="true")])
        assert sorted(p.name for p in run.iterdir()) == ["checkpoints", LOCK_FILE]  # nothing written
        assert in_progress.is_dir()  # nor the live run's checkpoint in progress deleted
        in_progress.rmdir()
    assert not (run / LOCK_FILE).exists()
    result = train(load_config(None, overrides(corpus_file, run, steps=2)))
    assert result.step == 2 and not (run / LOCK_FILE).exists()  # released at the end


def test_stale_lock_is_taken_over_and_foreign_host_is_named(tmp_path, corpus_file):
    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its PID no longer runs
    (run / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": 0}))
    with pytest.warns(UserWarning, match=f"stale lock .*PID {dead.pid}"):
        assert train(load_config(None, overrides(corpus_file, run, steps=1))).step == 1
    other = tmp_path / "other"
    other.mkdir()
    (other / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "some-other-host", "started": 0}))
    with pytest.raises(RunLocked, match=r"PID 1 on host 'some-other-host'.*delete"):
        train(load_config(None, overrides(corpus_file, other, steps=1)))



def test_without_proc_a_reused_pid_does_not_hold_the_lock(tmp_path, monkeypatch):
    """macOS has no /proc: the lock recorded no start time, so a lock whose PID a new process
    took (after a reboot) was "in use by another run" - and the advice was to stop that
    process. Where /proc is missing ``ps`` gives the start time: the lock is taken over."""
    from attnres.train import lock

    real_read = Path.read_text
    monkeypatch.setattr(lock, "PROC", tmp_path / "no-proc", raising=False)
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (_ for _ in ()).throw(FileNotFoundError(self))
                        if str(self).startswith("/proc/") else real_read(self, *a, **k))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = RunLock(tmp_path / "mine")
        with mine:
            assert json.loads((tmp_path / "mine" / LOCK_FILE).read_text())["proc_start"]
        holder = {"pid": other.pid, "host": socket.gethostname(), "started": 0}
        assert not lock.stale_here({**holder, "proc_start": lock._start_time(other.pid)})  # its own: live
        run = tmp_path / "run"
        run.mkdir()
        (run / LOCK_FILE).write_text(json.dumps({**holder, "proc_start": "Thu Jan  1 00:00:00 2026"}))
        with pytest.warns(UserWarning, match=f"stale lock .*PID {other.pid}"), RunLock(run):
            pass
    finally:
        other.kill()
        other.wait()

@pytest.mark.skipif(not hasattr(os, "fork"), reason="a process forked to be killed")
def test_a_lock_left_empty_by_a_run_killed_while_taking_it_is_taken_over(tmp_path):
    """Where the file system has no hard links the lock is created empty, then written: a run
    killed between the two left an empty run.lock that no run could take ("an unreadable lock
    file ...; delete that file"). The temporary file it leaves names it: a process of this
    host that no longer runs, and the lock is taken over with a warning naming it."""
    import signal

    run = tmp_path / "run"
    child = os.fork()  # (a process of its own to kill, started in a millisecond)
    if child == 0:
        try:
            def no_hard_links(*args):
                raise PermissionError("hard links not supported")

            def killed(*args):  # (between the exclusive create and the write: SIGKILL, nothing cleaned up)
                os.kill(os.getpid(), signal.SIGKILL)

            os.link, os.fdopen = no_hard_links, killed
            RunLock(run).acquire()
        finally:
            os._exit(1)
    assert os.waitpid(child, 0)[1] == signal.SIGKILL  # (killed by the signal)
    left = {p.name: p.read_text() for p in run.iterdir()}
    assert left[LOCK_FILE] == "" and len(left) == 2, left
    (temporary,) = (name for name in left if name != LOCK_FILE)
    pid = json.loads(left[temporary])["pid"]
    with pytest.warns(UserWarning, match=rf"stale lock .*PID {pid} on host .*killed while taking the lock"), \
            RunLock(run):
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]  # (its temporary file removed too)
    assert list(run.iterdir()) == []


def test_an_empty_lock_left_by_a_killed_run_of_this_runs_pid_is_taken_over(tmp_path):
    """The temporary lock file was named by the PID alone: a run restarted under the PID of the
    run killed while taking the lock (a container's PID 1 again) wrote its own over the one
    that named the killed run, found no other, and refused the empty lock it had left. The
    killed run's file stays its own: the lock is taken over, with a warning naming it."""
    from attnres.train import lock

    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text("")
    killed = {"pid": os.getpid(), "host": socket.gethostname(), "proc_start": "an earlier start", "started": 0}
    assert lock.stale_here(killed)  # (its PID is this process's now)
    (run / f".{LOCK_FILE}.{os.getpid()}").write_text(json.dumps(killed))  # (as the killed run named it)
    with pytest.warns(UserWarning, match=rf"stale lock .*PID {os.getpid()} .*killed while taking the lock"), \
            RunLock(run):
        assert json.loads((run / LOCK_FILE).read_text())["proc_start"] == lock._start_time(os.getpid())
    assert list(run.iterdir()) == []


def test_an_empty_lock_that_a_live_or_unknown_process_may_be_writing_is_refused(tmp_path):
    """An empty run.lock is taken over only where every temporary lock file names a process of
    this host that no longer runs: one of a live process (writing the lock now, on a file
    system without hard links), of another host, or none at all is refused as before."""
    from attnres.train import lock

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = {"host": socket.gethostname(), "started": 0}
        for name, temporaries in (("live", {live.pid: {**me, "pid": live.pid, "proc_start": lock._start_time(live.pid)}}),
                                  ("other-host", {4242: {**me, "pid": 4242, "host": "some-other-host"}}),
                                  ("none", {})):
            run = tmp_path / name
            run.mkdir()
            (run / LOCK_FILE).write_text("")
            for pid, holder in temporaries.items():
                (run / f".{LOCK_FILE}.{pid}").write_text(json.dumps(holder))
            with pytest.raises(RunLocked, match="unreadable lock file .*if no run uses this directory, delete that file"):
                RunLock(run).acquire()
            assert (run / LOCK_FILE).read_text() == "", name
    finally:
        live.kill()
        live.wait()


def test_a_lock_that_cannot_be_written_without_hard_links_is_not_left_behind(tmp_path, monkeypatch):
    """Without hard links the lock was created, then written: a write that failed (a full
    disk) left it empty, and no later run could take it. It is removed; the error stays."""
    import errno

    from attnres.train import lock

    class FullDisk:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    def no_hard_links(*args):
        raise PermissionError("hard links not supported")

    run = tmp_path / "run"
    monkeypatch.setattr(lock.os, "link", no_hard_links)
    monkeypatch.setattr(lock.os, "fdopen", lambda fd, mode: os.close(fd) or FullDisk())
    with pytest.raises(OSError, match="No space left"):
        RunLock(run).acquire()
    assert list(run.iterdir()) == []
    monkeypatch.undo()
    with RunLock(run):
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()


# -- 4: recovery --------------------------------------------------------------------------

def test_corrupted_newest_checkpoint_falls_back_to_an_intact_one(tmp_path, corpus_file):
    train(load_config(None, overrides(corpus_file, tmp_path / "full")))
    split = tmp_path / "split"
    train(load_config(None, overrides(corpus_file, split, stop_after=3, checkpoint_every=1, keep_checkpoints=2)))
    newest = latest_checkpoint(split)
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated, as a crash or a full disk leaves it
    with pytest.warns(UserWarning) as caught:
        result = train(load_config(None, overrides(corpus_file, split, resume="true", checkpoint_every=1,
                                                   keep_checkpoints=2)))
    messages = " ".join(str(w.message) for w in caught)
    assert "falling back to the newest valid checkpoint" in messages and "step-00000002" in messages
    assert (split / "checkpoints" / "corrupt-step-00000003").is_dir()  # kept for inspection, out of the way
    assert result.step == 6
    assert_same_weights(final_weights(tmp_path / "full"), final_weights(split))


def test_resume_from_an_earlier_checkpoint(tmp_path, corpus_file):
    train(load_config(None, overrides(corpus_file, tmp_path / "full")))
    split = tmp_path / "split"
    train(load_config(None, overrides(corpus_file, split, stop_after=4, checkpoint_every=2)))
    earlier = split / "checkpoints" / "step-00000002"
    # key=value overrides on both sides of the option
    args = overrides(corpus_file, split, checkpoint_every=2)
    assert cli_main(["train", *args[:3], "--resume-from", str(earlier), *args[3:]]) == 0
    assert (split / "checkpoints" / "superseded-step-00000004").is_dir()
    with pytest.raises(SystemExit, match=r"resume_from: '.*nowhere' does not exist"):
        cli_main(["train", *args, "--resume-from", str(tmp_path / "nowhere")])
    assert_same_weights(final_weights(tmp_path / "full"), final_weights(split))
    steps = [r["step"] for r in read_metrics(split / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, 7))


def test_resume_from_without_out_dir_names_the_run_instead_of_the_default(tmp_path, corpus_file, monkeypatch):
    """``attnres train --resume-from runs/a/checkpoints/step-2`` with no config file and no
    out_dir continued run a into the default out_dir, runs/attnres (said only in the
    summary's out_dir), a second run of the same steps beside the first; it now says so and
    names the two out_dirs meant. The checkpoint's own run as out_dir, and any other, go on."""
    monkeypatch.chdir(tmp_path)
    a = tmp_path / "a"
    train(load_config(None, overrides(corpus_file, a, stop_after=4, checkpoint_every=2)))
    earlier = a / "checkpoints" / "step-00000002"
    with pytest.raises(SystemExit, match=rf"resume_from='{earlier}' without out_dir would continue it into the default "
                       rf"out_dir 'runs/attnres', not its run: give out_dir={a} to continue that run \(its checkpoints "
                       r"after step-00000002 set aside as superseded\), or out_dir=DIR to continue it in a new "
                       r"directory$"):
        cli_main(["train", "--resume-from", str(earlier), "progress=false"])
    with pytest.raises(SystemExit, match=rf"resume_from='{a}' without out_dir .* give out_dir={a} to continue that "
                       "run, or out_dir=DIR"):  # (its newest: none set aside)
        cli_main(["train", "--resume-from", str(a), "progress=false"])
    assert not (tmp_path / "runs").exists()
    assert cli_main(["train", "--resume-from", str(earlier), f"out_dir={a}", "stop_after=3", "progress=false"]) == 0
    assert cli_main(["train", "--resume-from", str(a), f"out_dir={tmp_path / 'b'}", "stop_after=4",
                     "progress=false"]) == 0


def test_resume_from_another_runs_checkpoint_into_a_run_directory_is_refused(tmp_path, corpus_file):
    """``--resume-from runs/a/checkpoints/step-2 out_dir=runs/b``, runs/b another run with
    checkpoints of its own: b's checkpoints were set aside as superseded and b's metrics.jsonl
    cut back to step 2, its history gone, with a continuation of a's run in their place."""
    a, b = tmp_path / "a", tmp_path / "b"
    train(load_config(None, overrides(corpus_file, a, stop_after=2)))
    train(load_config(None, overrides(corpus_file, b, stop_after=4, lr=1e-3)))
    log = (b / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=rf"resume_from='{a}/checkpoints/step-00000002' is not a checkpoint of out_dir "
                       rf"'{b}', which holds checkpoints of another run \(step-00000004 the newest\)"):
        train(load_config(None, overrides(corpus_file, b, lr=1e-3, resume_from=str(a / "checkpoints" / "step-00000002"))))
    assert [p.name for p in (b / "checkpoints").iterdir()] == ["step-00000004"] and (b / "metrics.jsonl").read_text() == log
    # into a new out_dir it continues, as it did
    assert train(load_config(None, overrides(corpus_file, tmp_path / "c", resume_from=str(a)))).step == 6


def test_truncated_last_metrics_line_is_tolerated(tmp_path, corpus_file):
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus_file, run, stop_after=3)))
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 4, "lo')  # killed mid-write
    with pytest.warns(UserWarning, match="skipped 1 unreadable line"):
        assert train(load_config(None, overrides(corpus_file, run, resume="true"))).step == 6
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(line) for line in lines)
    assert [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"] == list(range(1, 7))


def test_init_from_restarts_after_divergence_with_a_fresh_optimiser(tmp_path, corpus_file, capsys):
    diverged = tmp_path / "diverged"
    args = overrides(corpus_file, diverged, lr="1e30", schedule="constant", warmup_steps=0, grad_clip=0,
                     checkpoint_every=1)
    with pytest.raises(SystemExit, match=r"non-finite .*init_from=.*step-00000001"):
        cli_main(["train", *args])  # the message says how to start again
    # (lr=1e30 spoils even the first checkpoint's weights; a healthy one to start from:)
    train(load_config(None, overrides(corpus_file, tmp_path / "healthy", steps=2)))
    good = latest_checkpoint(tmp_path / "healthy")
    # A new run from those weights with a (negligible) learning rate: one step leaves them
    # where the checkpoint had them, and the optimiser and schedule start from zero.
    restart = tmp_path / "restart"
    result = train(load_config(None, overrides(corpus_file, restart, steps=1, lr="1e-12", warmup_steps=0,
                                               schedule="constant", weight_decay=0, init_from=str(good))))
    assert result.step == 1
    assert "from the weights of" in capsys.readouterr().out
    before, after = load_file(str(good / "model.safetensors")), final_weights(restart)
    for name in before:
        assert torch.allclose(before[name], after[name], atol=1e-9), name
    assert float(load_file(str(result.checkpoint / "optimizer.safetensors"))["0.step"]) == 1  # fresh AdamW
    assert read_checkpoint_state(result.checkpoint)["init_from"] == {"checkpoint": str(good), "step": 2}
    # A model that does not fit the checkpoint is named field by field, alone (the load's own
    # error, a line per tensor, used to come first).
    with pytest.raises(ValueError) as error:
        train(load_config(None, overrides(corpus_file, tmp_path / "wide", steps=1, init_from=str(good),
                                          **{"model.d_model": 128})))
    assert str(error.value).startswith(f"init_from={str(good)!r}: its weights do not fit this run's model, which "
                                       "differs from the checkpoint's in ['model.d_model'] (model.d_model: 64 there, "
                                       "128 here)"), error.value
    assert "size mismatch" not in str(error.value)


# -- 5: steps on resume -------------------------------------------------------------------

def test_changing_steps_on_resume_is_refused_where_it_moves_the_schedule(tmp_path, corpus_file):
    run = tmp_path / "cosine"
    train(load_config(None, overrides(corpus_file, run, stop_after=4)))  # 2 warm-up steps, 2 of the cosine decay
    with pytest.raises(ValueError, match=r"steps=6.*'cosine'.*at step 4 the learning rate.*stop_after=K.*init_from="):
        train(load_config(None, overrides(corpus_file, run, resume="true", steps=12)))


def test_a_refused_steps_change_of_a_wsd_run_names_the_decay_it_reached(tmp_path, corpus_file):
    """It advised 'use schedule=wsd or constant' to a run that already is WSD."""
    wsd = dict(schedule="wsd", decay_fraction=0.2, warmup_steps=2)
    train(load_config(None, overrides(corpus_file, tmp_path / "done", steps=6, **wsd)))  # decays from step 5
    with pytest.raises(ValueError) as error:
        train(load_config(None, overrides(corpus_file, tmp_path / "done", steps=12, resume="true", **wsd)))
    assert str(error.value).endswith("(fresh optimiser and schedule). A WSD run's steps may change on resume only "
                                     "before its decay starts, and this run is past it: its decay started at step 5 "
                                     "of steps=6."), error.value
    train(load_config(None, overrides(corpus_file, tmp_path / "stable", steps=12, stop_after=3, **wsd)))
    with pytest.raises(ValueError) as error:  # steps=3 decays from step 3
        train(load_config(None, overrides(corpus_file, tmp_path / "stable", steps=3, resume="true", **wsd)))
    assert str(error.value).endswith("and with steps=3 the decay would start at step 3, which the checkpoint (step 3) "
                                     "has already taken."), error.value


def test_the_train_longer_command_of_a_refused_steps_change_builds_the_run_s_model(tmp_path, corpus_file):
    """The refusal said to train longer with `init_from=CHECKPOINT`, without the run's config: that
    command built the default model (here 2 layers, not the run's 3) and was refused. It now names
    the run's config.json, and runs as printed (DIR filled in)."""
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus_file, run, stop_after=4, **{"model.n_layers": 3})))
    with pytest.raises(SystemExit, match="steps=12") as error:
        cli_main(["train", f"out_dir={run}", "--resume", "steps=12"])
    command = re.search(r"To train longer, [^`]*`(attnres train [^`]*)`", str(error.value))
    assert command is not None, error.value
    words = shlex.split(command.group(1).replace("out_dir=DIR", f"out_dir={tmp_path / 'longer'}"))
    assert words[:3] == ["attnres", "train", "--config"] and Path(words[3]) == run / "config.json", words
    assert cli_main(words[1:] + ["stop_after=1"]) == 0  # (one step shows it starts)
    assert json.loads((tmp_path / "longer" / "config.json").read_text())["model"]["n_layers"] == 3


def test_extending_a_wsd_run_before_its_decay_equals_training_longer(tmp_path, corpus_file):
    wsd = dict(schedule="wsd", decay_fraction=0.2, warmup_steps=2)
    train(load_config(None, overrides(corpus_file, tmp_path / "long", steps=12, **wsd)))
    # steps=6 decays from step 5; the run stops at step 3, still in the stable phase.
    train(load_config(None, overrides(corpus_file, tmp_path / "extended", steps=6, stop_after=3, **wsd)))
    train(load_config(None, overrides(corpus_file, tmp_path / "extended", steps=12, resume="true", **wsd)))
    assert_same_weights(final_weights(tmp_path / "long"), final_weights(tmp_path / "extended"))


# -- 6: overrides change only what they name; the start-up summary -------------------------

def test_model_override_without_config_keeps_the_default_preset():
    config = load_config(None, ["model.residual=standard"])
    assert config.model == ModelConfig.preset("tiny", residual="standard")
    assert load_config(None, ["model.d_model=32", "model.n_heads=2"]).model == ModelConfig.preset("tiny", d_model=32,
                                                                                                  n_heads=2)


def test_a_trainer_is_whole_when_built(tmp_path, corpus_file, monkeypatch):
    """Building a ``Trainer`` sets every attribute it will ever have (training adds none, so
    no call order is load-bearing), holds the run's lock from then on, and ``close()``
    releases it without training."""
    from attnres.distributed import process_context
    from attnres.train.loop import Trainer

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    config = load_config(None, overrides(corpus_file, tmp_path / "run", steps=4))
    trainer = Trainer(config, process_context("cpu"))
    built = set(vars(trainer))
    assert (tmp_path / "run" / LOCK_FILE).exists() and trainer.step_count == 0 and trainer.layout.size == 1
    with pytest.raises(RunLocked):
        Trainer(config, process_context("cpu"))
    result = trainer.run()
    assert result.step == 4 and set(vars(trainer)) == built
    assert not (tmp_path / "run" / LOCK_FILE).exists()
    resumed = Trainer(load_config(None, overrides(corpus_file, tmp_path / "run", steps=4, resume="true")),
                      process_context("cpu"))
    assert resumed.step_count == 4 and resumed.last_ckpt == result.checkpoint
    resumed.close()
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_the_model_preset_demo_is_now_train_cpu():
    """`demo` named both the main job's grid and this model: the model's is `train-cpu` now,
    and the old name still works, with a DeprecationWarning."""
    from attnres.models import PRESETS

    assert "demo" not in PRESETS
    with pytest.warns(DeprecationWarning, match="model preset 'demo' is now called 'train-cpu'"):
        assert load_config(None, ["model=demo"]).model == ModelConfig.preset("train-cpu")
    assert load_config(Path(__file__).parents[1] / "configs" / "train-cpu.yaml").model.d_model == 128


def test_the_order_of_residual_overrides_does_not_matter():
    """A residual name sets its kind only; its fields may be named before or after it."""
    want = ModelConfig.preset("tiny", residual={"kind": "attnres_block", "block_size": 3})
    for items in (["model.residual=attnres_block", "model.residual.block_size=3"],
                  ["model.residual.block_size=3", "model.residual=attnres_block"]):
        assert load_config(None, items).model == want, items
    yaml_model = {"model": {"preset": "tiny", "residual": "attnres_block"}}
    from attnres.train.config import apply_overrides

    assert apply_overrides(yaml_model, ["model.residual.block_size=3"])["model"]["residual"] == {
        "kind": "attnres_block", "block_size": 3}


def test_resuming_a_finished_run_says_only_that_it_is_finished(tmp_path, corpus_file, capsys):
    """A finished run of warmup_steps >= steps resumed: 'nothing to train', and still the
    warning that its warm-up rises for the whole run - advice on steps it will not take."""
    run = tmp_path / "run"
    settings = dict(steps=2, warmup_steps=5, **{"model.residual": "standard"})
    with pytest.warns(UserWarning, match=r"^warmup_steps=5 >= steps=2"):  # (the run itself is warned)
        train(load_config(None, overrides(corpus_file, run, **settings)))
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(load_config(None, overrides(corpus_file, run, resume="true", **settings)))
    assert "nothing to train: the run is at step 2 and steps=2 ends it there" in capsys.readouterr().out
    assert [str(w.message) for w in caught] == []


def test_startup_summary_states_the_resolved_run(tmp_path, corpus_file, capsys):
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus_file, run, stop_after=2, **{"model.residual": "standard"})))
    text = capsys.readouterr().out
    model = AttnResLM(ModelConfig.preset("tiny", residual="standard"))
    data = prepare_data(load_corpus([str(corpus_file)]), "byte")
    assert f"new run in '{run}'; steps 1-2 of 6" in text
    assert f"{model.num_parameters():,} parameters; residual standard" in text
    assert "128 per step (batch 4 x seq_len 32 x grad_accum 1)" in text
    assert f"{len(data.train):,} training + {len(data.val):,} validation tokens" in text
    # What this process's allocator does (the command sets it; an earlier test may have run it here).
    retained = " (freed memory retained)" if retains_freed_memory() else ""
    assert f"device  cpu{retained}, float32" in text
    train(load_config(None, overrides(corpus_file, run, resume="true", **{"model.residual": "standard"})))
    assert f"resuming '{latest_checkpoint(run).parent / 'step-00000002'}' at step 2; steps 3-6" in capsys.readouterr().out
    # nothing left (it said 'steps 7-6 of 6 (0 to go)'), and a stop_after already passed
    for more, limit in (({}, "steps=6"), ({"stop_after": 3}, "stop_after=3")):
        train(load_config(None, overrides(corpus_file, run, resume="true", **{"model.residual": "standard"}, **more)))
        assert f"at step 6; nothing to train: the run is at step 6 and {limit} ends it there" in capsys.readouterr().out
    # ... and writes nothing: a --resume-from into a new out_dir left it a config.json and a metrics log
    elsewhere = tmp_path / "elsewhere"
    train(load_config(None, overrides(corpus_file, elsewhere, resume_from=str(run), **{"model.residual": "standard"})))
    assert "nothing to train" in capsys.readouterr().out and not elsewhere.exists()
    (run / "config.json").unlink()  # in the run's own out_dir too
    train(load_config(None, overrides(corpus_file, run, resume="true", **{"model.residual": "standard"})))
    assert not (run / "config.json").exists()


def test_the_command_prints_its_set_up_then_its_warnings_then_the_bar(tmp_path, corpus_file, monkeypatch, capsys):
    """The console script: the set-up first, the package's own warnings as one line each
    (not Python's ``file:line: UserWarning`` and a line of our source), and only then the
    progress bar - one drawn earlier left the set-up's first line on the bar's line."""
    import tqdm

    import attnres.progress
    from attnres.cli import run as console_script

    class Bar:  # the training bar draws "BAR" on stdout when created, where the set-up is printed
        def __init__(self, *args, unit="it", **kwargs):
            if unit == "step":
                print("BAR")

        update = set_postfix = close = lambda self, *args, **kwargs: None

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    monkeypatch.setattr(attnres.progress, "_is_terminal", lambda stream: True)  # the bar is drawn on terminals
    monkeypatch.setattr(sys, "argv", ["attnres", "train", *overrides(corpus_file, tmp_path / "run", steps=2,
                                                                      warmup_steps=5, progress="true")])
    with pytest.raises(SystemExit) as exit_:
        console_script()
    assert exit_.value.code == 0
    captured = capsys.readouterr()
    assert captured.out.index("attnres train: new run in") < captured.out.index("BAR")
    assert "attnres: warning: warmup_steps=5 >= steps=2: the learning rate rises" in captured.err
    assert "UserWarning" not in captured.err and "self.announce()" not in captured.err


def test_plain_warnings_shorten_only_the_packages_own(capsys):
    import warnings

    import attnres.cli.common as common

    with warnings.catch_warnings(record=True) as shown:  # what Python's own display receives
        warnings.simplefilter("always")
        before = warnings.showwarning
        with common.plain_warnings():
            warnings.warn_explicit("ours", UserWarning, str(common._PACKAGE_DIR / "train" / "loop.py"), 7)
            warnings.warn_explicit("theirs", UserWarning, "/elsewhere/module.py", 3)
            # one that names the package for Python's display names it once ('attnres: warning: attnres: ...')
            warnings.warn_explicit("attnres: the CPU kernel could not be built", UserWarning,
                                   str(common._PACKAGE_DIR / "ops" / "depth_attention" / "cpu_kernel.py"), 9)
        assert warnings.showwarning is before
    assert capsys.readouterr().err == "attnres: warning: ours\nattnres: warning: the CPU kernel could not be built\n"
    assert [(str(w.message), w.filename, w.lineno) for w in shown] == [("theirs", "/elsewhere/module.py", 3)]


def test_the_packages_warnings_are_printed_once_per_node(capsys, monkeypatch):
    """Under torchrun only a node's first rank (LOCAL_RANK 0) prints the package's warnings:
    every rank reads the same config (a deprecated key warned on each of 8 ranks printed 8
    lines); other packages' warnings are left to Python."""
    import warnings

    from attnres.train import load_config

    import attnres.cli.common as common

    for local_rank, expected in (("1", 0), ("0", 1)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            with common.plain_warnings():
                load_config(None, ["distributed=ddp"])
                warnings.warn_explicit("theirs", UserWarning, "/elsewhere/module.py", 3)
        assert capsys.readouterr().err.count("attnres: warning: TrainConfig.distributed is deprecated") == expected
        assert [str(w.message) for w in shown] == ["theirs"]


# -- 8: Ctrl-C during first-time BPE training -----------------------------------------------

@pytest.fixture
def ctrl_c_raises():
    """SIGINT raising KeyboardInterrupt, as in a terminal: a process that a shell starts in the
    background (a CI runner, ``nohup ... &``) inherits SIGINT ignored, and Python then installs
    no handler, so a Ctrl-C test would wait for nothing."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_interrupts_bpe_training(tmp_path, monkeypatch, ctrl_c_raises):
    """``tokenizers`` holds the calling thread until its training ends and runs no Python
    signal handler meanwhile: Ctrl-C waited for the whole training (12 s on big.txt). The BPE
    now trains in a worker thread while the main thread waits in slices, so Ctrl-C stops
    at once, and no cache is left behind."""
    (tmp_path / "c.txt").write_text("\n".join(f"line {i} of the quick brown fox {i * 7 % 13}" for i in range(20000)))
    corpus = load_corpus([str(tmp_path / "c.txt")])
    real, readers = tokenizer_mod.text_chunks, set()

    def chunks(text, size=1 << 20):
        for k, piece in enumerate(real(text, size=4096)):
            readers.add(threading.current_thread() is threading.main_thread())
            if k == 3:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the trainer reads the text
            yield piece

    monkeypatch.setattr(tokenizer_mod, "text_chunks", chunks)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(corpus, "bpe", 400, str(tmp_path / "cache"))
    assert readers == {False}  # the trainer ran off the main thread, which kept handling signals
    assert not list((tmp_path / "cache").glob("*/meta.json")) and not list((tmp_path / "cache").glob(".*tmp*"))


def test_run_interruptibly_returns_the_call_or_stops_at_ctrl_c(ctrl_c_raises):
    assert run_interruptibly(lambda: 41 + 1) == 42
    with pytest.raises(ZeroDivisionError):
        run_interruptibly(lambda: 1 / 0)
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def blocked():  # a call that ignores signals, as the Rust trainer does
        started.set()
        release.wait(60)
        finished.set()

    def interrupt():
        started.wait(60)
        os.kill(os.getpid(), signal.SIGINT)

    watcher = threading.Thread(target=interrupt)
    watcher.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_interruptibly(blocked)
        assert not finished.is_set()  # interrupted while the call still ran
    finally:
        release.set()
        watcher.join()


SLOW_TOKENISING = """
import os, time
from pathlib import Path
import attnres.data.dataset as dataset

encode = dataset._encode_to_file

def slow(tok, text, path, *args, **kwargs):  # tokenising a large corpus: here, time to send SIGTERM
    Path(os.environ["ATTNRES_TEST_MARK"]).write_text(str(path.parent))
    time.sleep(60)
    return encode(tok, text, path, *args, **kwargs)

dataset._encode_to_file = slow
"""


def test_sigterm_while_tokenising_leaves_no_lock_and_no_partial_cache(tmp_path):
    """SIGTERM (``kill``, a scheduler's time limit) while the data was tokenised ended the
    process at once (Python's default): ``run.lock`` and the temporary cache directory stayed,
    taken over or removed only by the next run. It now stops as Ctrl-C does: both removed,
    one line, status 143."""
    corpus, out, mark = write_corpus(tmp_path / "corpus.txt"), tmp_path / "run", tmp_path / "tokenising"
    out.mkdir()  # (an existing out_dir stays: only its lock should go)
    hook = tmp_path / "slow_tokenising.py"
    hook.write_text(SLOW_TOKENISING)
    proc = subprocess.Popen([sys.executable, "-m", "attnres", "--import", str(hook), "train",
                             *overrides(corpus, out, steps=3)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "ATTNRES_TEST_MARK": str(mark)})
    try:
        for _ in range(1200):  # (the interpreter's and torch's start-up: seconds)
            if mark.exists() or proc.poll() is not None:
                break
            threading.Event().wait(0.05)
        assert mark.exists(), proc.communicate(timeout=60)
        partial = Path(mark.read_text())
        assert partial.name.startswith(".") and partial.is_dir() and (out / LOCK_FILE).is_file()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "attnres train: stopped by SIGTERM before a checkpoint was written" in err
    assert list(out.iterdir()) == []
    assert not partial.exists() and list(partial.parent.iterdir()) == []


# -- 8: a long text without line breaks --------------------------------------------------

@pytest.mark.parametrize("sep", [" ", ""], ids=["one-line", "no-spaces"])
def test_text_without_line_breaks_is_split(tmp_path, sep):
    """One line of 400 KB (the issue: 3.5 MB) was 'too small to split'; it is now cut at
    spaces, or anywhere when it has none, into pieces of the usual size."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon"] * 16_000
    (tmp_path / "one.txt").write_text(sep.join(words))
    corpus = load_corpus([str(tmp_path / "one.txt")], val_fraction=0.02)
    total = len(corpus.train) + len(corpus.val)
    assert total == len(sep.join(words))
    assert len(corpus.val) == pytest.approx(0.02 * total, rel=0.05)
    if sep:  # cut at spaces: every piece starts with a whole word
        assert corpus.val.split(" ")[0] in {"alpha", "beta", "gamma", "delta", "epsilon"}


def test_the_readme_start_up_sample_is_what_the_command_prints(tmp_path, monkeypatch, capsys):
    """The README's sample start-up output, from the command it gives (as written there), on
    the test corpus."""
    import re
    import shlex

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    sample = re.search(r"```\n(attnres train: new run in 'runs/x'.*?)```", readme, re.S).group(1)
    command = re.search(r"for example `(attnres train data\.paths=\[corpus\.txt\][^`]*)`", readme, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "corpus.txt")
    assert cli_main([*shlex.split(command)[1:], "tensorboard=false"]) == 0
    printed = capsys.readouterr().out
    retained = " (freed memory retained)" if retains_freed_memory() else ""
    assert printed.startswith(sample.replace(" (freed memory retained)", retained))


def test_the_final_line_says_when_the_validation_loss_was_measured(tmp_path, corpus_file, capsys):
    """`finished at step 9, ..., val loss 7.56` showed the step-5 evaluation as if current."""
    run = tmp_path / "run"
    assert cli_main(["train", *overrides(corpus_file, run, steps=6, eval_every=3, stop_after=5)]) == 0
    assert re.search(r"stopped at step 5 of 6 \(stop_after\), train loss \S+, val loss \S+ \(at step 3\); checkpoint .*; "
                     r"continue with --resume \(`attnres train out_dir=\S+ --resume`", capsys.readouterr().out)
    assert cli_main(["train", *overrides(corpus_file, run, steps=6, eval_every=3), "--resume"]) == 0  # evaluates at 6
    assert re.search(r"finished at step 6, train loss \S+, val loss [\d.]+; checkpoint", capsys.readouterr().out)
    assert read_checkpoint_state(latest_checkpoint(run))["val_step"] == 6


def test_resume_and_init_from_a_checkpoint_without_a_run_config_are_refused_by_name(tmp_path, corpus_file):
    """A checkpoint written by other code (``save_checkpoint``) has no run config: resuming
    it compared the run with the defaults (a tokens_seen 'edited' at 2048 tokens per step, or a
    run of the default model accepted), and init_from met a KeyError when its weights did not fit."""
    from torch import nn
    from attnres.checkpoint import write_checkpoint

    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = write_checkpoint(tmp_path / "other", 1, model.state_dict(), opt.state_dict(), {"tokens_seen": 4}, keep=1)
    for start in ({"resume_from": str(ckpt)}, {"init_from": str(ckpt)}):
        with pytest.raises(CheckpointError, match=r"stores no run config"):
            train(load_config(None, overrides(corpus_file, tmp_path / "run", **start)))


def test_init_from_a_checkpoint_of_another_residual_is_refused_unless_allowed(tmp_path, corpus_file):
    """Full and Block AttnRes (and Block AttnRes of another block size) have parameters of the
    same names and shapes: init_from a Block AttnRes run with a Full AttnRes config (or none,
    the preset's Block AttnRes for a Full run's checkpoint) loaded its weights into the other
    model with a warning among the start-up lines. It is refused, naming both, before any
    training; allow_residual_change=true trains it (an upcycle of Block into Full)."""
    train(load_config(None, overrides(corpus_file, tmp_path / "base", steps=1, warmup_steps=0)))  # attnres_block, S=2
    good = latest_checkpoint(tmp_path / "base")
    start = dict(steps=1, warmup_steps=0, init_from=str(good))
    for change, said in ((("model.residual.kind", "attnres_full"),
                          r"model.residual.kind: 'attnres_block' there, 'attnres_full' here\)"),
                         (("model.residual.block_size", 1), r"model.residual.block_size: 2 there, 1 here\)")):
        with pytest.raises(ValueError, match=rf"init_from='.*step-00000001': this run's residual differs from the "
                                             rf"checkpoint's \({said}.*allow_residual_change=true"):
            train(load_config(None, overrides(corpus_file, tmp_path / f"to-{change[1]}", **start, **dict([change]))))
        assert not (tmp_path / f"to-{change[1]}" / "checkpoints").exists()
    with pytest.warns(UserWarning, match=r"model.residual.kind: 'attnres_block' there, 'attnres_full' here"):
        result = train(load_config(None, overrides(corpus_file, tmp_path / "full", **start, allow_residual_change=True,
                                                   **{"model.residual.kind": "attnres_full"})))
    assert read_checkpoint_state(result.checkpoint)["config"]["model"]["residual"]["kind"] == "attnres_full"
    # the same residual run by another kernel: no refusal
    train(load_config(None, overrides(corpus_file, tmp_path / "same", **start, **{"model.residual.backend": "torch"})))
    # weights that do not fit (Block AttnRes has queries the standard model has not): the load's own message,
    # field by field, not "the same names and shapes" and an option that cannot help
    with pytest.raises(CheckpointError, match=r"its weights do not fit this run's model.*"
                                              r"model.residual.kind: 'attnres_block' there, 'standard' here"):
        train(load_config(None, overrides(corpus_file, tmp_path / "standard", **start,
                                          **{"model.residual.kind": "standard"})))


def test_init_from_says_which_model_fields_it_changes_where_the_weights_still_fit(tmp_path, corpus_file, recwarn):
    """A model field that changes what the model computes but not its tensors' shapes (the
    block size, rope_theta) was taken without a word, as a --config left out gives it: the run
    trained another model than the checkpoint's from its weights."""
    train(load_config(None, overrides(corpus_file, tmp_path / "base", steps=1)))
    good = latest_checkpoint(tmp_path / "base")
    start = dict(steps=1, warmup_steps=0, init_from=str(good))
    with pytest.warns(UserWarning, match=r"its weights fit, but this run's model differs from the checkpoint's in "
                                         r"\['model.residual.block_size', 'model.rope_theta'\] \(model.residual."
                                         r"block_size: 2 there, 1 here, model.rope_theta: 10000.0 there, 500 here\)"):
        train(load_config(None, overrides(corpus_file, tmp_path / "changed", **start, allow_residual_change=True,
                                          **{"model.residual.block_size": 1, "model.rope_theta": 500})))
    recwarn.clear()  # the same model, or another kernel for it: nothing to say
    train(load_config(None, overrides(corpus_file, tmp_path / "same", **start, **{"model.residual.backend": "torch"})))
    assert not [w for w in recwarn if "init_from" in str(w.message)], [str(w.message) for w in recwarn]


@pytest.mark.parametrize("saved_residual, run_residual", [
    ({"kind": "attnres_block"}, {"kind": "attnres_block", "block_size": 2}),  # (unset: ceil(4 / 8) ... = 2 here)
    ({"kind": "attnres_block", "block_size": 2}, {"kind": "attnres_block", "block_size": None}),
    ({"kind": "attnres_full", "block_size": 4}, {"kind": "attnres_full", "block_size": None}),  # (Full reads none)
])
def test_init_from_says_nothing_of_a_residual_spelled_otherwise_that_computes_the_same(tmp_path, saved_residual,
                                                                                        run_residual):
    """init_from's start-up warning compared the residual as written: a checkpoint whose Block
    AttnRes left block_size unset and a run that spells the block size it resolves to (or the
    other way round), or a block size that Full AttnRes does not read, were said to train
    "another model than the checkpoint's from its weights" - the same model, which the refusal
    of a residual change (reading the residual as it computes) lets through. Nothing is said
    now; another block size still is."""
    from attnres.checkpoint import Source
    from attnres.train.config import TrainConfig
    from attnres.train.resume import init_model_changes

    model = ModelConfig(vocab_size=64, d_model=32, n_layers=8, n_heads=2, max_seq_len=32, residual=saved_residual)
    assert model.residual.kind != "attnres_block" or model.residual.resolved_block_size(model.n_sublayers) == 2
    source = Source(tmp_path / "step-00000001", {"config": TrainConfig(model=model, seq_len=16).to_dict(), "step": 1})
    assert init_model_changes(source, model.replace(residual=run_residual).to_dict()) is None
    if model.residual.kind == "attnres_block":
        said = init_model_changes(source, model.replace(residual={**run_residual, "block_size": 4}).to_dict())
        assert said is not None and re.search(r"in \['model.residual.block_size'\] \(model.residual.block_size: "
                                              r"2 there, 4 here\)", said), said


@pytest.mark.parametrize("saved_model, run_model, said", [
    ({}, {"n_kv_heads": 2}, None),  # (unset: as many as n_heads=2)
    ({"mlp_hidden": 128}, {"mlp_hidden": None}, None),  # (unset: 8/3 of d_model=32, rounded up to 64)
    ({}, {"n_kv_heads": 1}, "model.n_kv_heads: 2 there, 1 here"),
    ({"mlp_hidden": 128}, {"mlp_hidden": 192}, "model.mlp_hidden: 128 there, 192 here"),
])
def test_init_from_says_nothing_of_a_model_field_spelled_as_what_it_resolves_to(tmp_path, saved_model, run_model,
                                                                                 said):
    """init_from's start-up warning compared the fields other than the residual as written: a
    checkpoint that left n_kv_heads (or mlp_hidden) unset and a run that spells what it
    resolves to were said to train "another model than the checkpoint's from its weights"
    ("model.n_kv_heads: None there, 2 here"). Nothing is said now; another value still is,
    named as resolved."""
    from attnres.checkpoint import Source
    from attnres.train.config import TrainConfig
    from attnres.train.resume import init_model_changes

    model = ModelConfig(vocab_size=64, d_model=32, n_layers=8, n_heads=2, max_seq_len=32).replace(**saved_model)
    source = Source(tmp_path / "step-00000001", {"config": TrainConfig(model=model, seq_len=16).to_dict(), "step": 1})
    changes = init_model_changes(source, model.replace(**run_model).to_dict())
    assert changes is None if said is None else said in changes, changes


@pytest.mark.parametrize("saved_residual, run_residual, resumes", [
    ({"kind": "attnres_block"}, {"block_size": 2}, True),  # (unset: 2 here, as the checkpoint resolved it)
    ({"kind": "attnres_block", "block_size": 2}, {"block_size": None}, True),
    ({"kind": "attnres_full", "block_size": 4}, {"block_size": None}, True),  # (Full AttnRes reads no block size)
    ({"kind": "attnres_block"}, {"block_size": 4}, False),
    ({"kind": "attnres_block", "block_size": 4}, {"kind": "attnres_full"}, False),
])
def test_resume_takes_a_block_size_spelled_otherwise_that_computes_the_same(tmp_path, saved_residual, run_residual,
                                                                            resumes):
    """`attnres train --resume model.residual.block_size=2` of a run whose Block AttnRes left
    it unset (2 for its depth), or a block size given to Full AttnRes, which reads none, was
    refused as a config change ("model.residual.block_size: None there, 2 here") - the same
    model, the same steps. It resumes; another block size, or another residual, is refused."""
    from attnres.checkpoint import Source
    from attnres.train.config import TrainConfig
    from attnres.train.resume import check_resumable

    model = ModelConfig(vocab_size=64, d_model=32, n_layers=8, n_heads=2, max_seq_len=32, residual=saved_residual)
    saved = TrainConfig(model=model, seq_len=16).to_dict()
    source = Source(tmp_path / "step-00000001", {"config": saved, "step": 1})
    current = TrainConfig(model=model.replace(residual=run_residual), seq_len=16).to_dict()
    if resumes:
        check_resumable(saved, current, source)
    else:
        with pytest.raises(ValueError, match=r"the config differs in \['model.residual"):
            check_resumable(saved, current, source)


@pytest.mark.parametrize("saved_model, run_model, refused", [
    ({}, {"n_kv_heads": 2}, None),  # (unset: as many as n_heads=2)
    ({"n_kv_heads": 2}, {"n_kv_heads": None}, None),
    ({}, {"mlp_hidden": 128}, None),  # (unset: 8/3 of d_model=32, rounded up to 64)
    ({"mlp_hidden": 128}, {"mlp_hidden": None}, None),
    ({"residual": {"kind": "attnres_full"}}, {"residual": {"full_group_size": 4}}, None),  # (unset: round(sqrt(16)))
    ({"residual": {"full_group_size": 3}}, {"residual": {"full_group_size": 5}}, None),  # (Block AttnRes reads none)
    ({}, {"n_kv_heads": 1}, "model.n_kv_heads: 2 there, 1 here"),
    ({}, {"mlp_hidden": 192}, "model.mlp_hidden: 128 there, 192 here"),
    ({"residual": {"kind": "attnres_full"}}, {"residual": {"full_group_size": 2}},
     "model.residual.full_group_size: 4 there, 2 here"),
])
def test_resume_takes_a_model_field_spelled_as_what_it_resolves_to(tmp_path, saved_model, run_model, refused):
    """Resume compared the model section as written, so a field whose None is derived from
    another (n_kv_heads: n_heads; mlp_hidden: 8/3 d; Full AttnRes' full_group_size:
    round(sqrt(L))) left unset on one side and spelled as its value on the other was refused
    as a config change ("model.n_kv_heads: None there, 2 here") - the same model, the same
    steps. It resumes, as a block size did; another value is refused, named as resolved."""
    from attnres.checkpoint import Source
    from attnres.train.config import TrainConfig
    from attnres.train.resume import check_resumable

    model = ModelConfig(vocab_size=64, d_model=32, n_layers=8, n_heads=2, max_seq_len=32).replace(**saved_model)
    saved = TrainConfig(model=model, seq_len=16).to_dict()
    source = Source(tmp_path / "step-00000001", {"config": saved, "step": 1})
    current = TrainConfig(model=model.replace(**run_model), seq_len=16).to_dict()
    if refused is None:
        check_resumable(saved, current, source)
    else:
        with pytest.raises(ValueError, match=r"the config differs in \['model\.") as caught:
            check_resumable(saved, current, source)
        assert refused in str(caught.value), caught.value


@pytest.mark.parametrize("saved_model, run_model, named", [
    ({}, {"n_heads": 4}, ["model.n_heads"]),  # (n_kv_heads unset on both sides: as many as n_heads)
    ({}, {"d_model": 64}, ["model.d_model"]),  # (mlp_hidden unset: 8/3 of d_model)
    ({}, {"n_layers": 4}, ["model.n_layers"]),  # (block_size unset: ceil(L / 8))
    ({"removed_field": 3}, {}, ["model.removed_field"]),  # (a stored model that does not build here)
    ({"residual": {"kind": "unregistered_here"}}, {}, ["model.residual.kind"]),
])
def test_a_resume_refusal_names_the_changed_field_not_the_unset_ones_that_follow_it(tmp_path, saved_model, run_model,
                                                                                    named):
    """Resume compared the model as it resolves: a field left unset on both sides was named
    beside the field it follows ("model.n_heads: 2 there, 4 here, model.n_kv_heads: 2 there,
    4 here"); and a stored model that does not build here (a field of another version, a
    residual not registered) was compared as written against the run's resolved, so that
    n_kv_heads, mlp_hidden and the block size, unset on both sides, were said to differ
    ("model.n_kv_heads: None there, 2 here"). Only what was changed is named."""
    from attnres.checkpoint import Source
    from attnres.train.config import TrainConfig
    from attnres.train.resume import check_resumable, init_model_changes

    model = ModelConfig(vocab_size=64, d_model=32, n_layers=8, n_heads=2, max_seq_len=32)
    saved = TrainConfig(model=model, seq_len=16).to_dict()
    saved["model"] = {**saved["model"], **saved_model}
    if "residual" in saved_model:
        saved["model"]["residual"] = {**model.residual.to_dict(), **saved_model["residual"]}
    source = Source(tmp_path / "step-00000001", {"config": saved, "step": 1})
    current = TrainConfig(model=model.replace(**run_model), seq_len=16).to_dict()
    with pytest.raises(ValueError, match=r"the config differs in \[") as caught:
        check_resumable(saved, current, source)
    assert str(caught.value).split("the config differs in ")[1].startswith(f"{named} ("), caught.value
    # (init_from's start-up warning, by the same comparison)
    changes = init_model_changes(source, current["model"])
    assert f"in {named} (" in changes, changes


@pytest.mark.parametrize("lock_text", ["not a lock of ours", '{"pid": 1, "host"'])
def test_a_lock_that_a_killed_run_did_not_begin_to_write_is_not_taken_over(tmp_path, lock_text):
    """An unreadable run.lock was taken over wherever the temporary lock files beside it named
    dead processes of this host - a lock holding another program's text, or one unreadable for
    want of permission, which no killed acquisition wrote. Only a lock that is empty, or the
    start of what a killed run was writing (killed mid-write), is taken over; this one is
    refused, named, and left as it is."""
    from attnres.train import lock

    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text(lock_text)
    killed = {"pid": os.getpid(), "host": socket.gethostname(), "proc_start": "an earlier start", "started": 0}
    assert lock.stale_here(killed)
    (run / f".{LOCK_FILE}.{os.getpid()}.0123456789ab").write_text(json.dumps(killed))
    with pytest.raises(RunLocked, match="unreadable lock file .*delete that file"):
        RunLock(run).acquire()
    assert (run / LOCK_FILE).read_text() == lock_text


def test_a_lock_cut_short_by_a_kill_mid_write_is_taken_over(tmp_path):
    """A run killed while writing the lock (no hard links) may leave the start of its content,
    not only an empty file: that, too, is the killed run's, and is taken over."""
    from attnres.train import lock

    run = tmp_path / "run"
    run.mkdir()
    killed = {"pid": os.getpid(), "host": socket.gethostname(), "proc_start": "an earlier start", "started": 0}
    content = json.dumps(killed)
    (run / LOCK_FILE).write_text(content[:10])
    (run / f".{LOCK_FILE}.{os.getpid()}.0123456789ab").write_text(content)
    assert lock.stale_here(killed)
    with pytest.warns(UserWarning, match="killed while taking the lock"), RunLock(run):
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert list(run.iterdir()) == []
