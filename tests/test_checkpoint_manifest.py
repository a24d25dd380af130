"""The checkpoint manifest (``state.json``) as a reader meets it from elsewhere: another
version's format, an entry missing or malformed. Each is a :class:`CheckpointError` naming
the checkpoint and the problem, never a bare ``KeyError`` / ``FileNotFoundError``, and no
file is read that the manifest does not vouch for."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")

from attnres.checkpoint import CheckpointError, load_checkpoint, read_checkpoint_state, write_checkpoint  # noqa: E402
from attnres.checkpoint.manifest import STATE_HASH, seal_state  # noqa: E402


def _write(tmp_path: Path) -> Path:
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return write_checkpoint(tmp_path / "run", 1, model.state_dict(), opt.state_dict(), {"note": "x"}, keep=2)


def _edit(ckpt: Path, change, seal: bool = True) -> None:
    """Change ``state.json`` as another writer would have written it (sealed with its hash
    again, so only the change itself is met)."""
    doc = json.loads((ckpt / "state.json").read_text())
    doc.pop(STATE_HASH, None)
    change(doc)
    (ckpt / "state.json").write_text(json.dumps(seal_state(doc) if seal else doc))


def test_a_newer_format_says_to_upgrade(tmp_path):
    ckpt = _write(tmp_path)
    _edit(ckpt, lambda d: d.update(format_version=2))
    with pytest.raises(CheckpointError, match=r"written by a newer attnres \(checkpoint format 2\).*upgrade"):
        read_checkpoint_state(ckpt)
    _edit(ckpt, lambda d: d.update(format_version=0))
    with pytest.raises(CheckpointError, match="has checkpoint format 0; this version reads format 1 only"):
        read_checkpoint_state(ckpt)
    _edit(ckpt, lambda d: d.pop("format_version"))
    with pytest.raises(CheckpointError, match="not an attnres checkpoint manifest"):
        read_checkpoint_state(ckpt)



def test_a_newer_format_is_not_skipped_as_damaged(tmp_path):
    """A run's newest checkpoint written by a newer attnres stops a resume (upgrade): it was
    renamed corrupt-step-* and the run fell back to the one before, training again the steps
    the newer version had taken and burying them."""
    from attnres.checkpoint import find_valid_checkpoint

    older = _write(tmp_path)
    model = nn.Linear(3, 2)
    newer = write_checkpoint(tmp_path / "run", 2, model.state_dict(), torch.optim.AdamW(model.parameters()).state_dict(),
                             {"note": "x"}, keep=2)
    _edit(newer, lambda d: d.update(format_version=2))
    for set_aside in (True, False):
        with pytest.raises(CheckpointError, match=r"written by a newer attnres .*upgrade attnres.*"
                                                  r"or name an older checkpoint.*step-00000001"):
            find_valid_checkpoint(tmp_path / "run", set_aside=set_aside, resuming=set_aside)
        assert newer.is_dir() and older.is_dir()  # nothing set aside


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "rng.safetensors"])
def test_a_file_the_manifest_does_not_list_is_not_read(tmp_path, name):
    ckpt = _write(tmp_path)
    _edit(ckpt, lambda d: d["files"].pop(name))
    with pytest.raises(CheckpointError, match=rf"state.json does not list \['{name}'\], which loading reads"):
        read_checkpoint_state(ckpt)
    (ckpt / name).unlink()  # was a bare FileNotFoundError from safetensors when loading
    with pytest.raises(CheckpointError, match=rf"does not list \['{name}'\]"):
        load_checkpoint(ckpt, nn.Linear(3, 2), restore_rng=False)


def test_a_malformed_entry_is_named(tmp_path):
    ckpt = _write(tmp_path)
    _edit(ckpt, lambda d: d["files"]["model.safetensors"].pop("bytes"), seal=False)  # an unsealed (older) manifest
    with pytest.raises(CheckpointError, match="entry for model.safetensors has no size and SHA-256"):
        read_checkpoint_state(ckpt)  # was KeyError: 'bytes'
    _edit(ckpt, lambda d: d.update(layout="zip"))
    with pytest.raises(CheckpointError, match="unknown layout 'zip'"):
        read_checkpoint_state(ckpt)


def test_an_untouched_checkpoint_still_loads(tmp_path):
    ckpt = _write(tmp_path)
    assert read_checkpoint_state(ckpt, optional=("optimizer.safetensors",))["note"] == "x"
    (ckpt / "optimizer.safetensors").unlink()  # inference needs no optimiser state
    assert read_checkpoint_state(ckpt, optional=("optimizer.safetensors",))["step"] == 1


# -- the run config a checkpoint of attnres train carries ----------------------------------

def test_a_checkpoint_without_a_run_config_is_named_by_load_run(tmp_path):
    from attnres.inference import load_run, load_tokenizer

    ckpt = _write(tmp_path)  # save_checkpoint from other code: the state it was given, no run config
    for load in (load_run, load_tokenizer):  # were KeyError: 'config'
        with pytest.raises(CheckpointError, match=r"stores no run config .*not written by attnres train"):
            load(ckpt)
    _edit(ckpt, lambda d: d.update(config={"seed": 0}))  # and no model section: was KeyError: 'model'
    with pytest.raises(CheckpointError, match="stores no run config"):
        load_run(ckpt)


def test_a_saved_model_config_this_version_cannot_build_names_the_checkpoint(tmp_path):
    from attnres import ModelConfig
    from attnres.inference import load_run

    ckpt = _write(tmp_path)
    model = ModelConfig.preset("tiny").to_dict()
    _edit(ckpt, lambda d: d.update(config={"model": {**model, "new_field": 1}}))  # as a newer attnres writes it
    with pytest.raises(CheckpointError, match=rf"checkpoint '{ckpt}': its saved model config .*new_field"):
        load_run(ckpt)


# -- naming a run: its checkpoints/ folder, checkpoints set aside ----------------------------

def test_a_runs_checkpoints_folder_names_the_run(tmp_path):
    from attnres.checkpoint import find_valid_checkpoint

    ckpt = _write(tmp_path)  # <tmp>/run/checkpoints/step-00000001
    # what ls and tab completion offer between the run and its step-* directories: was
    # "neither a checkpoint nor a run directory with checkpoints"
    assert find_valid_checkpoint(tmp_path / "run" / "checkpoints").path == ckpt
    assert find_valid_checkpoint(tmp_path / "run").path == ckpt


def test_a_run_with_only_checkpoints_set_aside_says_so(tmp_path):
    from attnres.checkpoint import find_valid_checkpoint, no_checkpoint_at

    ckpt = _write(tmp_path)
    ckpt.rename(ckpt.with_name("superseded-" + ckpt.name))  # as a --resume-from an earlier step leaves it
    assert find_valid_checkpoint(tmp_path / "run") is None
    assert no_checkpoint_at(tmp_path / "run").endswith(
        "holds only checkpoints set aside (superseded-step-00000001: corrupt-* did not verify, superseded-* belong to "
        "an abandoned trajectory); name one of them to use it anyway")  # was "holds none yet"
    assert find_valid_checkpoint(ckpt.with_name("superseded-" + ckpt.name)).step == 1  # and named, it loads


def test_a_step_the_run_never_checkpointed_is_named_with_those_it_did(tmp_path):
    """``--resume-from runs/x/checkpoints/step-00001000`` (README's example, on a run that
    checkpointed other steps) said only that it does not exist."""
    for step in (2, 4):
        (tmp_path / "run" / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"step-00001000' does not exist; its run's checkpoints: step-00000002, "
                                              r"step-00000004$"):
        read_checkpoint_state(tmp_path / "run" / "checkpoints" / "step-00001000")
    with pytest.raises(CheckpointError, match=r"'.*elsewhere' does not exist$"):
        read_checkpoint_state(tmp_path / "elsewhere")


def _written(tmp_path: Path, step: int, keep: int, *, sharded: bool = False) -> Path:
    """A checkpoint of step ``step`` of a tiny module in ``tmp_path / "run"``, consolidated or sharded."""
    import warnings

    from attnres.checkpoint import save_sharded

    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    if not sharded:
        return write_checkpoint(tmp_path / "run", step, model.state_dict(), opt.state_dict(), {}, keep=keep)
    with warnings.catch_warnings():  # (DCP's save without a process group; the package's own warnings pass)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        return save_sharded(tmp_path / "run", step, dict(model.named_parameters()), opt, {}, keep=keep)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_older_than_the_runs_newest_is_not_rotated_away_as_it_is_written(tmp_path, sharded):
    """The ``keep`` rotation kept the newest checkpoints by step: a checkpoint written into a
    directory that holds a newer one (a run resumed from an earlier step through the Python
    API, without ``set_aside_newer``) was deleted as soon as it was published, and
    ``write_checkpoint`` returned a path that did not exist. The rotation keeps the newest
    ``keep`` up to the step written; a newer one is left."""
    from attnres.checkpoint import checkpoint_dirs

    _written(tmp_path, 5, keep=1, sharded=sharded)
    with pytest.warns(UserWarning, match="newer checkpoint"):  # (test_a_checkpoint_written_below_...)
        _written(tmp_path, 1, keep=1, sharded=sharded)
        path = _written(tmp_path, 3, keep=1, sharded=sharded)
    assert path.is_dir() and read_checkpoint_state(path)["step"] == 3
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-00000003", "step-00000005"]


@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_written_below_a_newer_one_says_which_the_run_resumes_from(tmp_path, sharded):
    """A checkpoint written into a directory that holds a newer one (a run resumed from an
    earlier step through the Python API) leaves the newer one, of the abandoned trajectory,
    in place - and the run's newest is what ``attnres train --resume``, ``generate RUN`` and
    ``find_valid_checkpoint`` take: they went on from the abandoned trajectory without a word,
    discarding what was trained since. A warning names the newer checkpoints and
    ``set_aside_newer``, which ``--resume-from`` applies; writing in order says nothing."""
    import warnings

    from attnres.checkpoint import find_valid_checkpoint, set_aside_newer

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (in order: no warning)
        _written(tmp_path, 2, keep=3, sharded=sharded)
        _written(tmp_path, 4, keep=3, sharded=sharded)
    with pytest.warns(UserWarning, match=r"a checkpoint was written into '.*run' below its 1 newer checkpoint "
                                         r"\(step-00000004\).*set_aside_newer\('.*run', STEP\), STEP the step "
                                         r"resumed from"):
        _written(tmp_path, 3, keep=3, sharded=sharded)
    assert find_valid_checkpoint(tmp_path / "run").step == 4  # (what the warning is about)
    set_aside_newer(tmp_path / "run", 3)
    assert find_valid_checkpoint(tmp_path / "run").step == 3


def test_the_warning_of_newer_checkpoints_is_shown_once_while_the_run_catches_up(tmp_path):
    """The warning named the step written, so Python's filter (once per text and line) showed
    it again at every checkpoint of the resumed run until it passed the newer ones."""
    import warnings

    _written(tmp_path, 10, keep=3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for step in (1, 2, 3):
            _written(tmp_path, step, keep=3)
    assert len(seen) == 1 and "step-00000010" in str(seen[0].message)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoints_files_and_its_rename_reach_the_disk_before_the_rotation(tmp_path, monkeypatch, sharded):
    """Only ``state.json`` was flushed (fsync) before the rename that publishes a checkpoint:
    the weights, the optimiser state and the rename itself could still be in memory when the
    rotation deleted the checkpoint before it, so a power cut could leave a run whose only
    checkpoint is empty files. Every file it lists, its folders and the rename are flushed
    before any older checkpoint is deleted."""
    import os
    import shutil

    from attnres.checkpoint import manifest

    _written(tmp_path, 1, keep=1, sharded=sharded)
    events: list[str] = []
    real_fsync, real_rmtree = os.fsync, shutil.rmtree

    def fsync(fd):
        events.append("fsync " + os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def rmtree(path, *args, **kwargs):
        events.append(f"rmtree {path}")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(manifest.os, "fsync", fsync)
    monkeypatch.setattr(manifest.shutil, "rmtree", rmtree)
    final = _written(tmp_path, 2, keep=1, sharded=sharded)
    removed = events.index(f"rmtree {tmp_path / 'run' / 'checkpoints' / 'step-00000001'}")
    flushed = {e.removeprefix("fsync ") for e in events[:removed] if e.startswith("fsync ")}
    from fnmatch import fnmatch

    unflushed = [name for name in read_checkpoint_state(final)["files"]  # (flushed in the temporary folder)
                 if not any(fnmatch(f, str(final.parent / f".tmp-{final.name}-*" / name)) for f in flushed)]
    assert unflushed == [], flushed
    assert str(final.parent) in flushed  # (the rename)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("killed", ["before the new one is renamed in", "before the old one is deleted"])
def test_a_step_written_again_survives_a_kill_while_it_is_replaced(tmp_path, monkeypatch, sharded, killed):
    """Writing a step a run holds already (a run resumed from an earlier one) deleted the old
    checkpoint before renaming the new one into place: a kill in between lost the step (a
    resume went back to the one before it). The old one is moved aside (``.old-step-*``)
    first; the next run's start (``remove_partial_checkpoints``) renames it back when the new
    one never came (and says so), else deletes it. The step verifies either way, the old or the
    new one."""
    import os
    import shutil
    import warnings

    from attnres.checkpoint import checkpoint_dirs, manifest, remove_partial_checkpoints

    _written(tmp_path, 1, keep=2, sharded=sharded)
    old = read_checkpoint_state(_written(tmp_path, 2, keep=2, sharded=sharded))["files"]
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def replace(src, dst):
        if killed == "before the new one is renamed in" and Path(src).name.startswith(".tmp-"):
            raise KeyboardInterrupt
        real_replace(src, dst)

    def rmtree(path, *args, **kwargs):
        if killed == "before the old one is deleted" and Path(path).name.startswith(".old-") and Path(path).exists():
            raise KeyboardInterrupt
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(manifest.os, "replace", replace)
    monkeypatch.setattr(manifest.shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        _written(tmp_path, 2, keep=2, sharded=sharded)
    monkeypatch.undo()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        remove_partial_checkpoints(tmp_path / "run")
    restored = [str(w.message) for w in said if "restored step-00000002" in str(w.message)]
    assert len(restored) == (killed == "before the new one is renamed in"), [str(w.message) for w in said]
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-00000001", "step-00000002"]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".")) == []
    files = read_checkpoint_state(tmp_path / "run" / "checkpoints" / "step-00000002")["files"]
    assert (files == old) == (killed == "before the new one is renamed in")


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_a_keep_that_is_not_a_count_of_checkpoints_is_refused_before_writing(tmp_path, sharded, keep):
    """``keep`` is how many checkpoints the rotation keeps: ``keep=0`` kept every one (a slice
    ``[:-0]``), ``keep=-1`` deleted the oldest only, ``keep=1.5`` failed after the checkpoint
    was written (slice indices must be integers). Refused first, naming the argument."""
    from attnres.checkpoint import checkpoint_dirs

    _written(tmp_path, 1, keep=1, sharded=sharded)
    who = "save_sharded" if sharded else "write_checkpoint"
    with pytest.raises(ValueError, match=rf"^{who}: keep must be an integer >= 1, got {keep!r}$"):
        _written(tmp_path, 2, keep=keep, sharded=sharded)
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-00000001"]


def test_an_optimiser_with_other_parameter_groups_is_named_with_the_checkpoint(tmp_path):
    """``load_checkpoint`` into an optimiser whose parameter groups differ from the saved one's
    (another split into groups, a parameter left out) ended in torch's bare ValueError, "loaded
    state dict has a different number of parameter groups", naming neither the checkpoint nor
    what differs. A CheckpointError names the file, both group sizes and the fix."""
    ckpt = _write(tmp_path)
    model = nn.Linear(3, 2)
    for groups, ours in (([{"params": [model.weight]}, {"params": [model.bias]}], r"\[1, 1\]"),
                         ([model.weight], r"\[1\]")):
        with pytest.raises(CheckpointError, match=rf"checkpoint '.*step-00000001': its optimizer.safetensors is the "
                                                  rf"state of an optimiser whose parameter groups hold \[2\] parameters; "
                                                  rf"this optimiser's hold {ours}: build the optimiser as the run .*, or "
                                                  r"load the weights alone \(optimizer=None\)"):
            load_checkpoint(ckpt, model, torch.optim.AdamW(groups), restore_rng=False)
    load_checkpoint(ckpt, model, torch.optim.AdamW(model.parameters()), restore_rng=False)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("name", ["../escape", "..", "", "rng.safetensors", "state.json"])
def test_a_stored_file_that_is_not_a_plain_name_of_its_own_is_refused_before_writing(tmp_path, sharded, name):
    """``save_sharded(..., files=...)`` wrote each file where its name led: ``../escape`` beside
    the checkpoint (outside what its manifest vouches for), ``rng.safetensors`` over the RNG
    states; ``write_checkpoint`` refused those but took ``..`` and ``""`` (then failed as a write
    error). Both refuse them before writing, naming the name and their own files."""
    import warnings

    from attnres.checkpoint import checkpoint_dirs, save_sharded

    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    files = {name: b"x"}
    who = "save_sharded" if sharded else "write_checkpoint"
    with pytest.raises(ValueError, match=rf"^{who}: files must be plain file names other than the checkpoint's own "
                                         rf"\(.*rng.safetensors, state.json\); got {re.escape(repr(name))}$"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP's save without a process group
            if sharded:
                save_sharded(tmp_path / "run", 1, dict(model.named_parameters()), opt, {}, keep=1, files=files)
            else:
                write_checkpoint(tmp_path / "run", 1, model.state_dict(), opt.state_dict(), {}, keep=1, files=files)
    assert checkpoint_dirs(tmp_path / "run") == [] and not (tmp_path / "run" / "checkpoints" / "escape").exists()


def test_a_platform_that_does_not_open_directories_still_writes_checkpoints(tmp_path, monkeypatch):
    """Flushing a checkpoint's folders opens them (``os.open(dir)``), which Windows refuses
    (PermissionError): the checkpoint is written all the same, its files flushed."""
    import os

    from attnres.checkpoint import manifest

    real_open = os.open

    def no_directories(path, flags, *args, **kwargs):
        if Path(path).is_dir():
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(manifest.os, "open", no_directories)
    assert read_checkpoint_state(_written(tmp_path, 1, keep=1))["step"] == 1


@pytest.mark.parametrize("keep", [1, 2])
def test_readers_see_a_step_moved_aside_by_a_kill_and_write_nothing(tmp_path, monkeypatch, keep):
    """After a kill between ``publish_checkpoint``'s two renames (the step written again moved
    aside to ``.old-step-*``, the new one not yet renamed in), the readers - find_valid_checkpoint
    (generate, eval), newest_state, attnres status - did not see the step until the trainer's next
    start renamed it back: they went back to the step before it, or found no checkpoint (keep=1).
    They read it where it is, and write nothing: the run's next start still restores it."""
    import os
    import warnings

    from attnres.checkpoint import find_valid_checkpoint, latest_checkpoint, manifest, remove_partial_checkpoints
    from attnres.checkpoint.locate import newest_state
    from attnres.train.status import run_status

    _written(tmp_path, 1, keep=keep)
    _written(tmp_path, 2, keep=keep)
    real_replace = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(manifest.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        _written(tmp_path, 2, keep=keep)
    monkeypatch.undo()
    run, aside = tmp_path / "run", tmp_path / "run" / "checkpoints" / ".old-step-00000002"
    (tmp_path / "run" / "config.json").write_text(json.dumps({"model": {"residual": "standard"}, "steps": 2}))
    listing = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ".old-step-00000002" in listing and "step-00000002" not in listing
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        found = find_valid_checkpoint(run)
    assert (found.path, found.step) == (aside, 2)
    assert any("from .old-step-00000002" in str(w.message) and "next start renames it back" in str(w.message)
               for w in said), [str(w.message) for w in said]
    assert latest_checkpoint(run, replaced=True) == aside and newest_state(run)[0] == aside
    assert run_status(run).step == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == listing  # (read, not restored)
    assert [p.name for p in manifest.checkpoint_dirs(run)] == ["step-00000001"][:keep - 1]  # (the writer's listing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        remove_partial_checkpoints(run)
    assert latest_checkpoint(run, replaced=True) == latest_checkpoint(run) == run / "checkpoints" / "step-00000002"


def test_write_checkpoint_names_a_state_json_cannot_hold_before_anything_is_written(tmp_path):
    """``write_checkpoint``'s ``state`` (what it adds to ``state.json``) that JSON cannot hold
    failed at the end with json's bare TypeError, after the weights and the optimiser's state
    had been written; it is named before anything is, as ``save_sharded`` names it."""
    model = nn.Linear(3, 2)
    out = tmp_path / "run"
    with pytest.raises(TypeError) as raised:
        write_checkpoint(out, 1, model.state_dict(), torch.optim.AdamW(model.parameters()).state_dict(),
                         {"tokens_seen": 3, "sampler": {"seed": object()}}, keep=1)
    assert str(raised.value).startswith("write_checkpoint: run_state['sampler']['seed'] cannot be written to "
                                        "state.json"), raised.value
    assert not out.exists()


@pytest.mark.parametrize("sharded", [False, True])
def test_a_step_written_again_whose_rename_fails_is_kept_where_it_was(tmp_path, monkeypatch, sharded):
    """Writing a step the run holds already moves the old checkpoint aside (``.old-step-*``)
    before renaming the new one in. Where that rename failed (an I/O error), the writers raised
    "the checkpoints written before it are untouched" with the old one still aside: the
    writers' listing (the rotation, a new run's 'already holds checkpoints') and the step named
    by its directory (``load_checkpoint(run/checkpoints/step-00000002)``) did not see it until
    the trainer's next start. It is renamed back before the error is raised."""
    import os

    from attnres.checkpoint import CheckpointWriteError, checkpoint_dirs, manifest

    _written(tmp_path, 1, keep=2, sharded=sharded)
    old = read_checkpoint_state(_written(tmp_path, 2, keep=2, sharded=sharded))["files"]
    real_replace = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise OSError(5, "Input/output error", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(manifest.os, "replace", replace)
    with pytest.raises(CheckpointWriteError, match="could not write checkpoint step-00000002 .*Input/output error.* "
                                                   "the checkpoints written before it are untouched"):
        _written(tmp_path, 2, keep=2, sharded=sharded)
    monkeypatch.undo()
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]
    assert [p.name for p in checkpoint_dirs(run)] == ["step-00000001", "step-00000002"]
    assert read_checkpoint_state(run / "checkpoints" / "step-00000002")["files"] == old


def test_a_step_moved_aside_by_a_kill_and_named_by_its_directory_says_where_it_is(tmp_path, monkeypatch):
    """After a kill between ``publish_checkpoint``'s two renames, the readers given the run
    directory read the step where it is (``.old-step-*``), but given the step's own directory
    (``attnres generate RUN/checkpoints/step-00000002``, ``load_checkpoint``) they said it "does
    not exist; its run's checkpoints: step-00000001" - the step before it as the run's newest.
    The error names where it is, which loads, and writes nothing."""
    import os

    from attnres.checkpoint import find_valid_checkpoint, manifest

    _written(tmp_path, 1, keep=2)
    _written(tmp_path, 2, keep=2)
    real_replace = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise KeyboardInterrupt  # (a kill: the run's next start restores the step)
        real_replace(src, dst)

    monkeypatch.setattr(manifest.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        _written(tmp_path, 2, keep=2)
    monkeypatch.undo()
    folder = tmp_path / "run" / "checkpoints"
    listing = sorted(p.name for p in folder.iterdir())
    aside = folder / ".old-step-00000002"
    for read in (read_checkpoint_state, find_valid_checkpoint):
        with pytest.raises(CheckpointError, match=rf"checkpoint '.*step-00000002' does not exist: a run killed while "
                                                  rf"writing that step again left it moved aside as \.old-step-00000002, "
                                                  rf"which the run's next start renames back; name "
                                                  rf"{re.escape(repr(str(aside)))}, or the run directory"):
            read(folder / "step-00000002")
    assert find_valid_checkpoint(aside).step == 2
    assert sorted(p.name for p in folder.iterdir()) == listing  # (read, not restored)


def test_a_step_that_cannot_be_renamed_back_either_is_restored_at_the_next_start(tmp_path, monkeypatch):
    """Where renaming the old checkpoint back fails too (the disk gone read-only), the error
    says the first failure (the rename of the new one), and the run's next start restores the
    step (:func:`remove_partial_checkpoints`)."""
    import os
    import warnings

    from attnres.checkpoint import CheckpointWriteError, checkpoint_dirs, manifest, remove_partial_checkpoints

    _written(tmp_path, 1, keep=2)
    real_replace = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise OSError(5, "Input/output error", str(dst))
        if Path(src).name.startswith(".old-"):
            raise OSError(30, "Read-only file system", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(manifest.os, "replace", replace)
    with pytest.raises(CheckpointWriteError, match=r"Input/output error"):
        _written(tmp_path, 1, keep=2)
    monkeypatch.undo()
    run = tmp_path / "run"
    assert [p.name for p in checkpoint_dirs(run, replaced=True)] == [".old-step-00000001"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (restored step-00000001: said)
        remove_partial_checkpoints(run)
    assert [p.name for p in checkpoint_dirs(run)] == ["step-00000001"]
    assert read_checkpoint_state(run / "checkpoints" / "step-00000001")["step"] == 1


def test_a_run_whose_step_a_kill_moved_aside_resumes_from_it_by_that_name_and_is_still_a_run(tmp_path, capsys):
    """``--resume-from RUN/checkpoints/.old-step-X`` (the name attnres status and the readers
    show after a kill between publish_checkpoint's two renames) into its own run failed in
    "does not exist": the start renames it back to step-X before looking it up. It resumes
    from step-X, saying so. And a ``checkpoints/`` folder whose only entry is that
    ``.old-step-X`` was no run's: training_output did not name it, and ``out_dir=RUN/checkpoints``
    was not refused as a run's checkpoints folder."""
    import warnings

    from test_train import overrides, write_corpus

    from attnres.checkpoint.locate import refuse_out_dir_not_a_run, training_output
    from attnres.output_paths import OutputPathError
    from attnres.train import load_config, train

    run, corpus = tmp_path / "run", write_corpus(tmp_path / "corpus.txt")
    common = overrides(corpus, run, steps=4, warmup_steps=0, eval_every=100, diagnostics_every=100, checkpoint_every=2,
                       keep_checkpoints=1)
    train(load_config(None, [*common, "stop_after=2"]))
    checkpoints = run / "checkpoints"
    (checkpoints / "step-00000002").rename(checkpoints / ".old-step-00000002")  # (killed writing step 2 again)
    assert [p.name for p in checkpoints.iterdir()] == [".old-step-00000002"]
    assert training_output(checkpoints) == f"the checkpoints/ folder of the training run {str(run)!r}"
    with pytest.raises(OutputPathError, match=r"is the checkpoints/ folder of the run .*not a run directory"):
        refuse_out_dir_not_a_run(checkpoints)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the restore's own warning)
        train(load_config(None, [*common, f"resume_from={checkpoints / '.old-step-00000002'}"]))
    out = capsys.readouterr().out
    assert ("attnres train: resuming step-00000002: the start renamed .old-step-00000002 (a step a kill left moved "
            "aside) back to it") in out
    assert "resuming" in out and "at step 2" in out and (checkpoints / "step-00000004").is_dir()
