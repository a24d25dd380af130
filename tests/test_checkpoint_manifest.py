"""The checkpoint manifest (``state.json``) as a reader meets it from elsewhere: another
version's format, an entry missing or malformed. Each is a :class:`CheckpointError` naming
the checkpoint and the problem, never a bare ``KeyError`` / ``FileNotFoundError``, and no
file is read that the manifest does not vouch for."""

from __future__ import annotations

import json
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
