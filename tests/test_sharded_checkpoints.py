"""Sharded (DCP) checkpoints read in one process: their ``.metadata`` pickle is read by a
restricted unpickler (a file that would run code is refused, and nothing runs), every file the
metadata names must be in the manifest, and a normal checkpoint loads without warnings.

The checkpoints here are written by ``save_sharded`` in one process (the 2-rank cases are in
``tests/test_multinode.py``); a tiny model, no training.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("yaml")

from attnres import AttnResLM  # noqa: E402
from attnres.checkpoint import CheckpointError, find_valid_checkpoint, read_sharded_tensors, save_sharded  # noqa: E402
from attnres.checkpoint.manifest import STATE_FILE, _sha256, seal_state  # noqa: E402
from attnres.cli import main as cli_main  # noqa: E402
from attnres.data import ByteTokenizer  # noqa: E402
from attnres.data.tokenizer import tokenizer_state  # noqa: E402
from attnres.inference.loading import load_run  # noqa: E402
from attnres.train import build_optimizer, load_config, train  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def sharded_checkpoint(out_dir: Path, corpus: Path | None = None) -> Path:
    """A sharded checkpoint (step 1) of a tiny model, as a run's checkpoint, written in one process."""
    paths = f"[{corpus}]" if corpus is not None else "[]"
    config = load_config(None, ["model.d_model=32", "data.tokenizer=byte", f"data.paths={paths}", "seq_len=16",
                                "batch_size=2", "steps=4", f"out_dir={out_dir}", "progress=false", "tensorboard=false"])
    torch.manual_seed(0)
    model = AttnResLM(config.model)
    optimizer = build_optimizer(model, config)
    meta, files = tokenizer_state(ByteTokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's save without a process group
        return save_sharded(out_dir, 1, dict(model.named_parameters()), optimizer,
                            {"config": config.to_dict(), "tokenizer": meta}, keep=3, files=files)


def rewrite_manifest(path: Path) -> None:
    """Recompute the size and SHA-256 of every file ``state.json`` lists, and its own, as the
    author of a tampered checkpoint would."""
    doc = json.loads((path / STATE_FILE).read_text())
    doc["files"] = {name: {"sha256": _sha256(path / name), "bytes": (path / name).stat().st_size}
                    for name in doc["files"]}
    (path / STATE_FILE).write_text(json.dumps(seal_state(doc)))


class RunsCode:
    """Unpickling this calls ``os.system``: it writes the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(path: Path, payload) -> None:
    (path / "dcp" / ".metadata").write_bytes(pickle.dumps(payload))
    rewrite_manifest(path)


def damage(path: Path) -> Path:
    """One byte changed in the middle of one of ``path``'s DCP data files (which it returns)."""
    shard = max((path / "dcp").glob("*.distcp"), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


def test_normal_sharded_checkpoint_loads_quietly(tmp_path):
    """Written in one process and read back (generation's path) with no DCP warning."""
    path = sharded_checkpoint(tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = load_run(path)
        weights = read_sharded_tensors(path)
    assert set(weights) == {n for n, _ in run.model.named_parameters()}
    for name, p in run.model.named_parameters():
        assert torch.equal(p.detach(), weights[name]), name


def test_metadata_that_would_run_code_is_refused(tmp_path, capsys):
    """A ``.metadata`` whose pickle calls ``os.system`` (with a manifest that matches it):
    generate, load_run, consolidation and resume all refuse it naming the file, and the
    marker the payload would write does not exist."""
    path = sharded_checkpoint(tmp_path / "run")
    marker = tmp_path / "marker"
    plant(path, RunsCode(marker))
    with pytest.raises(CheckpointError, match=r"not a DCP metadata file this package can read safely: it refers to "
                       r"posix\.system, which DCP metadata never holds\. Nothing from it was run"):
        load_run(path)
    with pytest.raises(CheckpointError, match="refers to posix.system"):
        read_sharded_tensors(path)
    with pytest.raises(SystemExit, match="attnres generate: error: .*refers to posix.system"):
        cli_main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "the"])
    from test_train import write_corpus

    # (a corpus of its own: the default one is an optional package's, which a GPU machine may lack)
    corpus = write_corpus(tmp_path / "corpus.txt")
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies: .*refers to posix\.system"):
        train(load_config(None, ["model.d_model=32", "data.tokenizer=byte", f"data.paths=[{corpus}]", "resume=true",
                                 f"out_dir={tmp_path / 'run'}", "progress=false", "tensorboard=false"]))
    assert not marker.exists()


def test_metadata_with_other_than_tensors_is_refused(tmp_path):
    """Real DCP classes, but an entry DCP would read with ``torch.load(weights_only=False)``
    (a non-tensor), a tensor entry whose size is not a size, or a storage index pointing
    outside the checkpoint directory."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from attnres.checkpoint.dcp_metadata import read_dcp_metadata

    path = sharded_checkpoint(tmp_path / "run")
    meta = read_dcp_metadata(path / "dcp")
    first = next(iter(meta.state_dict_metadata))
    with_bytes = pickle.loads(pickle.dumps(meta))
    with_bytes.state_dict_metadata[first] = BytesStorageMetadata()
    plant(path, with_bytes)
    with pytest.raises(CheckpointError, match="refers to torch.distributed.checkpoint.metadata.BytesStorageMetadata"):
        load_run(path)
    odd_size = pickle.loads(pickle.dumps(meta))
    odd_size.state_dict_metadata[first].size = Path("not-a-size")
    plant(path, odd_size)
    with pytest.raises(CheckpointError, match="it describes entries other than tensors"):
        read_sharded_tensors(path)
    outside = pickle.loads(pickle.dumps(meta))
    next(iter(outside.storage_data.values())).relative_path = "../../state.json"
    plant(path, outside)
    with pytest.raises(CheckpointError, match=r"its storage index names '\.\./\.\./state\.json', not a plain file"):
        load_run(path)


def shard_out_of_sight(path: Path) -> None:
    """Make sharded checkpoint ``path`` one an ``out_dir`` the nodes do not share produced
    before: a shard its DCP metadata names is neither there nor in its (sealed) manifest."""
    shard = path / "dcp" / "__0_0.distcp"
    shard.rename(path / "elsewhere.distcp")
    doc = json.loads((path / STATE_FILE).read_text())
    del doc["files"]["dcp/__0_0.distcp"]
    doc["files"].pop("elsewhere.distcp", None)
    (path / STATE_FILE).write_text(json.dumps(seal_state(doc)))


#: What verifying a checkpoint whose shard is out of sight (:func:`shard_out_of_sight`) says.
SHARD_OUT_OF_SIGHT = (r"is incomplete: dcp/__0_0\.distcp, which its DCP metadata names, is missing .*out_dir must be "
                      r"on a file system every node shares")


def test_checkpoint_missing_a_file_its_metadata_names_does_not_verify(tmp_path):
    """What an ``out_dir`` the nodes do not share produced before: rank 0 listed (and hashed)
    only the DCP files it could see. Verification now reads the metadata and names the
    missing file instead of a later FileNotFoundError."""
    path = sharded_checkpoint(tmp_path / "run")
    shard_out_of_sight(path)
    with pytest.raises(CheckpointError, match=SHARD_OUT_OF_SIGHT):
        find_valid_checkpoint(path)
    with pytest.raises(SystemExit, match="attnres generate: error: .*dcp/__0_0.distcp, which its DCP metadata names"):
        cli_main(["generate", "--checkpoint", str(path), "--prompt", "the"])


def test_a_sharded_init_from_removed_while_the_run_sets_up_is_named(tmp_path, monkeypatch):
    """init_from a sharded checkpoint of a run still training, deleted by its rotation
    (keep_checkpoints) after it was verified: DCP's reader's error was taken for a misfit and
    said the checkpoint was incomplete or did not load into this model. It says it was removed,
    as of a consolidated one."""
    from test_first_use import rotate_init_from_once_verified
    from test_train import write_corpus

    corpus = write_corpus(tmp_path / "corpus.txt")
    path = sharded_checkpoint(tmp_path / "source", corpus)
    rotate_init_from_once_verified(monkeypatch)
    with pytest.raises(SystemExit, match=rf"attnres train: error: init_from='{path}' was removed while this run was set "
                                         r"up: its run, still training, keeps only its newest checkpoints"):
        cli_main(["train", "model.d_model=32", "data.tokenizer=byte", f"data.paths=[{corpus}]", "seq_len=16",
                  "batch_size=2", "steps=1", "warmup_steps=0", f"out_dir={tmp_path / 'run'}", "progress=false",
                  "tensorboard=false", f"init_from={path}"])


def test_a_sharded_resume_from_removed_while_the_run_sets_up_is_named(tmp_path):
    """--resume-from a sharded checkpoint of a run still training, deleted by its rotation
    (keep_checkpoints) after it was verified: DCP's reader's error is said as the removal, as
    of a consolidated one (tests/test_first_use.py runs that one through attnres train)."""
    import shutil

    from attnres.checkpoint.sharded import load_sharded
    from attnres.train.loop import _load_resumed

    path = sharded_checkpoint(tmp_path / "source")
    source = find_valid_checkpoint(path)
    config = load_config(None, ["model.d_model=32", f"out_dir={tmp_path / 'run'}", f"resume_from={path}"])
    model = AttnResLM(config.model)
    shutil.rmtree(path)
    with pytest.raises(CheckpointError, match=rf"^resume_from='{path}' was removed while this run was set up: .* or "
                                              r"copy a checkpoint aside and resume from the copy$"):
        _load_resumed(source, config, lambda: load_sharded(path, dict(model.named_parameters()),
                                                           build_optimizer(model, config)))


def test_consolidate_takes_a_run_and_names_what_it_cannot_consolidate(tmp_path):
    """`attnres.checkpoint.consolidate` (docs/scale-out.md) given a run directory - what
    generate, export and resume_from take - said "checkpoint 'runs/x' is incomplete:
    dcp/.metadata is missing", as it did for a one-process (consolidated) checkpoint, and an
    `out` folder that did not exist gave safetensors' "I/O error". A run directory now
    consolidates its newest checkpoint; a consolidated one is named as such; `out` is made."""
    from attnres.checkpoint import consolidate, save_checkpoint
    from safetensors.torch import load_file

    path = sharded_checkpoint(tmp_path / "run")
    written = consolidate(tmp_path / "run", tmp_path / "new" / "folder")
    assert written == tmp_path / "new" / "folder" / "model.safetensors"
    whole = load_file(str(written))
    shards = read_sharded_tensors(path)
    assert set(whole) == set(shards) and all(torch.equal(whole[k], shards[k]) for k in shards)
    assert consolidate(path) == path / "model.safetensors"

    model = AttnResLM(load_config(None, ["model.d_model=32"]).model)
    optimizer = torch.optim.AdamW(model.parameters())
    one = save_checkpoint(tmp_path / "one", 1, model, optimizer, {"step": 1}, keep=1)
    with pytest.raises(CheckpointError, match=rf"consolidate: checkpoint '{one}' is consolidated already \(one "
                                              r"process wrote it\): its model.safetensors is the file to use"):
        consolidate(tmp_path / "one")
    with pytest.raises(CheckpointError, match=r"consolidate: .*'.*nowhere' does not exist"):
        consolidate(tmp_path / "nowhere")


def test_sharded_weights_of_another_residual_are_refused_unless_allowed(tmp_path):
    """``load_sharded_weights(path, model)`` (and ``load_weights``, which ``load_run`` uses) of a
    Block AttnRes run into a Full AttnRes model loaded its weights (the same names and shapes)
    without a word, as ``load_checkpoint`` did: refused by the same rule, naming both residuals;
    ``allow_residual_change=True`` loads them."""
    from attnres import ModelConfig
    from attnres.checkpoint import load_sharded_weights, load_weights, read_checkpoint_state

    path = sharded_checkpoint(tmp_path / "run")
    state = read_checkpoint_state(path)
    full = AttnResLM(ModelConfig.from_dict(state["config"]["model"]).replace(residual="attnres_full"))
    for load in (lambda: load_sharded_weights(path, full), lambda: load_weights(path, state, full)):
        with pytest.raises(CheckpointError, match=r"this model's residual differs from the checkpoint's \(model."
                                                  r"residual.kind: 'attnres_block' there, 'attnres_full' here\).*"
                                                  r"allow_residual_change=True"):
            load()
    load_sharded_weights(path, full, allow_residual_change=True)
    saved = read_sharded_tensors(path)
    assert all(torch.equal(full.state_dict()[k], v) for k, v in saved.items())


def test_consolidate_killed_while_writing_keeps_the_model_file_there(tmp_path, monkeypatch):
    """safetensors before 0.6 writes in place: consolidate killed part-way (or out of disk)
    left a model.safetensors cut short in the checkpoint, over the one consolidated before.
    It is written beside and renamed into place: the earlier file stays, no temporary file."""
    from attnres.checkpoint import consolidate
    from attnres.checkpoint import consolidation

    path = sharded_checkpoint(tmp_path / "run")
    before = consolidate(path).read_bytes()

    def in_place_killed_half_way(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as f:
            f.write(before[: len(before) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(consolidation, "save_file", in_place_killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        consolidate(path)
    assert (path / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in path.iterdir() if p.name.startswith(".")) == []


def test_sharded_weights_load_into_a_compiled_model(tmp_path):
    """``load_sharded_weights(path, torch.compile(model))`` found none of the checkpoint's
    names under the compiled wrapper's ``_orig_mod.`` prefix ("does not fit the model"): it loads
    into the original module, as ``load_checkpoint`` does."""
    from attnres import ModelConfig
    from attnres.checkpoint import load_sharded_weights, read_checkpoint_state

    path = sharded_checkpoint(tmp_path / "run")
    model = AttnResLM(ModelConfig.from_dict(read_checkpoint_state(path)["config"]["model"]))
    load_sharded_weights(path, torch.compile(model))
    saved = read_sharded_tensors(path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


def test_sharded_weights_load_into_a_model_with_a_compiled_part(tmp_path):
    """A model with a compiled block (``model.layers[0] = torch.compile(model.layers[0])``)
    names its weights ``layers.0._orig_mod.<name>``: ``load_sharded_weights`` found none of them
    ("does not fit the model"). A name that differs only in ``_orig_mod.`` loads as the model's."""
    from attnres import ModelConfig
    from attnres.checkpoint import load_sharded_weights, read_checkpoint_state

    path = sharded_checkpoint(tmp_path / "run")
    model = AttnResLM(ModelConfig.from_dict(read_checkpoint_state(path)["config"]["model"]))
    model.layers[0] = torch.compile(model.layers[0])
    load_sharded_weights(path, model)
    held = {k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()}
    assert all(torch.equal(held[k], v) for k, v in read_sharded_tensors(path).items())


COMPILED_PART_CONFIG = ["model.d_model=32", "seq_len=16", "batch_size=2", "steps=4", "progress=false"]


def one_step_trained(compiled: bool):
    """A tiny model after one optimiser step (state to store), its first block compiled or not
    (``model.layers[0] = torch.compile(model.layers[0])``, compiled at its first call: never here)."""
    config = load_config(None, COMPILED_PART_CONFIG)
    torch.manual_seed(0)
    model = AttnResLM(config.model)
    if compiled:
        model.layers[0] = torch.compile(model.layers[0])
    optimizer = build_optimizer(model, config)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return model, optimizer, config


def loads_as_saved(path: Path, model, optimizer, compiled: bool) -> None:
    """``load_sharded`` of ``path`` into a zeroed model (compiled or not) gives the weights and
    optimiser state of ``model``, name for own name."""
    from attnres.checkpoint import load_sharded
    from attnres.nn.compiled import uncompiled_name

    own = {uncompiled_name(n): p for n, p in model.named_parameters()}
    other, other_optimizer, _ = one_step_trained(compiled)
    for p in other.parameters():
        p.data.zero_()
    load_sharded(path, dict(other.named_parameters()), other_optimizer, restore_rng=False)
    for name, p in other.named_parameters():
        assert torch.equal(p, own[uncompiled_name(name)]), name
        assert torch.equal(other_optimizer.state[p]["exp_avg"], optimizer.state[own[uncompiled_name(name)]]["exp_avg"])


def test_a_model_with_a_compiled_part_saves_and_resumes_under_its_own_names(tmp_path):
    """``save_sharded`` stored the names its caller passed: a model with a compiled block
    (``model.layers[0] = torch.compile(model.layers[0])``) wrote ``model.layers.0._orig_mod.<name>``
    and ``optim.layers.0._orig_mod.<name>.exp_avg``, which a resume with nothing compiled could
    not find (nor the other way round). They are stored under their own names, as
    ``write_checkpoint`` stores them, and ``load_sharded`` reads a compiled part's names so."""
    for saved_compiled in (True, False):
        model, optimizer, config = one_step_trained(saved_compiled)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP's save without a process group
            path = save_sharded(tmp_path / f"run-{saved_compiled}", 1, dict(model.named_parameters()), optimizer,
                                {"config": config.to_dict()}, keep=1)
        stored = [*read_sharded_tensors(path), *read_sharded_tensors(path, "optim.")]
        assert stored and not any("_orig_mod" in name for name in stored), stored
        loads_as_saved(path, model, optimizer, not saved_compiled)


def test_an_earlier_versions_checkpoint_of_a_compiled_part_loads_under_its_own_names(tmp_path, monkeypatch):
    """An earlier version's ``save_sharded`` stored the names its caller passed (before
    ``by_own_names``): a model with a compiled block wrote ``model.layers.0._orig_mod.<name>``
    and ``optim.layers.0._orig_mod.<name>.exp_avg``. Since ``load_sharded`` asks DCP for the
    own names, such a checkpoint loaded neither into a model with nothing compiled nor into
    one with the same block compiled (DCP: missing keys). It loads into both, the optimiser
    state too, and ``consolidate`` writes the own names."""
    from attnres.checkpoint import consolidate, load_sharded_weights, sharded
    from attnres.nn.compiled import uncompiled_name
    from safetensors.torch import load_file

    model, optimizer, config = one_step_trained(True)
    with monkeypatch.context() as old_version, warnings.catch_warnings():
        old_version.setattr(sharded, "by_own_names", lambda named, who: dict(named))  # (the names as passed)
        warnings.simplefilter("ignore", UserWarning)  # DCP's save without a process group
        path = save_sharded(tmp_path / "run", 1, dict(model.named_parameters()), optimizer,
                            {"config": config.to_dict()}, keep=1)
    stored = [*read_sharded_tensors(path), *read_sharded_tensors(path, "optim.")]
    assert any(name.startswith("layers.0._orig_mod.") for name in stored), stored  # (the old names)
    for compiled in (False, True):
        loads_as_saved(path, model, optimizer, compiled)
    whole, _, _ = one_step_trained(False)  # (and the weights alone, as load_run reads them)
    for p in whole.parameters():
        p.data.zero_()
    load_sharded_weights(path, whole)
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), model.parameters()))
    written = load_file(str(consolidate(path, tmp_path / "out")))
    assert written.keys() == {uncompiled_name(n) for n, _ in model.named_parameters()}


def test_sharded_weights_given_no_state_are_verified_first(tmp_path):
    """``load_sharded_weights(path, model)`` read the DCP files as they were: a shard with one
    byte changed (a copy cut short or damaged) loaded its wrong weights without a word, where
    ``load_checkpoint`` verifies a consolidated one. Without the caller's verified ``state`` it
    verifies the checkpoint (every file's SHA-256) and names the file."""
    from attnres import ModelConfig
    from attnres.checkpoint import load_sharded_weights, read_checkpoint_state

    path = sharded_checkpoint(tmp_path / "run")
    model = AttnResLM(ModelConfig.from_dict(read_checkpoint_state(path)["config"]["model"]))
    shard = damage(path)
    with pytest.raises(CheckpointError, match=rf"checkpoint '{path}' is corrupted: dcp/{shard.name} does not match its "
                                              r"SHA-256 in state.json"):
        load_sharded_weights(path, model)


def test_weights_of_another_size_are_named_with_the_checkpoint(tmp_path):
    """``load_sharded_weights`` into a model of another width ended in load_state_dict's bare
    RuntimeError, a line per weight ("size mismatch for embed_tokens.weight: ..."), naming
    neither the checkpoint nor what to do; ``load_checkpoint`` wrapped those lines. Both say
    the checkpoint, the first weights that differ, and to build the model with its config."""
    from attnres import ModelConfig
    from attnres.checkpoint import load_checkpoint, load_sharded_weights, read_checkpoint_state, save_checkpoint

    path = sharded_checkpoint(tmp_path / "run")
    saved = ModelConfig.from_dict(read_checkpoint_state(path)["config"]["model"])
    wider = AttnResLM(ModelConfig.from_dict({**saved.to_dict(), "d_model": 2 * saved.d_model}))
    model = AttnResLM(saved)
    consolidated = save_checkpoint(tmp_path / "one", 1, model, torch.optim.AdamW(model.parameters()), {}, keep=1)
    for where, load in ((path, lambda: load_sharded_weights(path, wider)),
                        (consolidated, lambda: load_checkpoint(consolidated, wider, restore_rng=False))):
        with pytest.raises(CheckpointError, match=rf"^checkpoint '{where}' does not fit the model: \d+ weight\(s\) have "
                                                  rf"other shapes \(embed_tokens.weight \[256, 32\] there, \[256, 64\] "
                                                  r"here; .*\): build the model with the checkpoint's config"):
            load()


def test_load_checkpoint_of_a_sharded_checkpoint_loads_its_weights_and_names_the_optimisers_loader(tmp_path):
    """``load_checkpoint(path, model)`` - the loader docs/inference.md names for a model one
    built - of a sharded checkpoint ended in a bare FileNotFoundError (no model.safetensors).
    It loads the weights (verified, as ``load_sharded_weights``); given an optimiser, whose
    state a sharded checkpoint keeps by name, it names ``load_sharded``."""
    from attnres import ModelConfig
    from attnres.checkpoint import load_checkpoint, read_checkpoint_state

    path = sharded_checkpoint(tmp_path / "run")
    model = AttnResLM(ModelConfig.from_dict(read_checkpoint_state(path)["config"]["model"]))
    assert load_checkpoint(path, model, restore_rng=False)["step"] == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in read_sharded_tensors(path).items())
    with pytest.raises(CheckpointError, match=rf"checkpoint '{path}' is sharded \(DCP, written on several ranks\): "
                                              r"load_checkpoint loads its weights alone \(optimizer=None\); its "
                                              r"optimiser state loads with attnres.checkpoint.load_sharded\(path, "):
        load_checkpoint(path, model, torch.optim.AdamW(model.parameters()), restore_rng=False)


def test_load_checkpoint_of_a_sharded_checkpoint_verifies_its_dcp_files(tmp_path):
    """``load_checkpoint(path, model)`` of a sharded checkpoint checked its manifest's hashes
    but not that every shard its DCP metadata names is listed, as ``load_sharded_weights(path,
    model)`` and ``find_valid_checkpoint`` do: a shard out of sight (an ``out_dir`` the nodes
    did not share) ended in DCP's CheckpointException - a BaseException, past ``except
    Exception`` - with a FileNotFoundError inside. It is the same CheckpointError."""
    from attnres import ModelConfig
    from attnres.checkpoint import load_checkpoint, read_checkpoint_state

    path = sharded_checkpoint(tmp_path / "run")
    model = AttnResLM(ModelConfig.from_dict(read_checkpoint_state(path)["config"]["model"]))
    shard_out_of_sight(path)
    with pytest.raises(CheckpointError, match=SHARD_OUT_OF_SIGHT):
        load_checkpoint(path, model, restore_rng=False)


def test_a_shard_that_cannot_be_read_after_verification_is_a_checkpoint_error(tmp_path):
    """``read_sharded_tensors`` - behind ``load_sharded_weights``, ``load_weights`` of a
    verified state and ``consolidate`` - let DCP's CheckpointException out: a BaseException,
    past every ``except Exception`` (the commands' error handling: a traceback), where a shard
    changed since it was verified (cut short, or deleted by the rotation of a run still
    training). It is a CheckpointError naming the checkpoint, as ``load_sharded``'s."""
    from attnres import ModelConfig
    from attnres.checkpoint import load_weights, read_checkpoint_state

    path = sharded_checkpoint(tmp_path / "run")
    state = read_checkpoint_state(path)
    model = AttnResLM(ModelConfig.from_dict(state["config"]["model"]))
    shard = next((path / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(CheckpointError, match=rf"checkpoint '{path}' cannot be read: "):
        load_weights(path, state, model)
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"checkpoint '{path}' cannot be read: .*No such file"):
        read_sharded_tensors(path)


def test_a_checkpoint_written_before_the_first_step_resumes_with_a_fresh_optimiser(tmp_path):
    """A sharded checkpoint written before the optimiser's first step (the state a run starts
    from, saved through the Python API) holds no optimiser state: ``load_sharded`` with an
    optimiser asked DCP for every entry ('Missing key in checkpoint state_dict:
    optim.<name>.exp_avg'). It loads the weights and leaves the optimiser fresh, as it was
    saved: the next step is the first step of the run that wrote it."""
    from attnres.checkpoint import load_sharded

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's save without a process group
        path = save_sharded(tmp_path / "run", 0, dict(model.named_parameters()), optimizer, {}, keep=1)
    other = torch.nn.Linear(3, 2)  # (other weights)
    other_optimizer = torch.optim.AdamW(other.parameters())
    load_sharded(path, dict(other.named_parameters()), other_optimizer, restore_rng=False)
    assert other_optimizer.state_dict()["state"] == {}
    for m, opt in ((model, optimizer), (other, other_optimizer)):
        m(torch.ones(1, 3)).sum().backward()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))


def test_a_parameter_frozen_when_saved_resumes_with_a_fresh_optimiser_state(tmp_path):
    """A parameter that had no optimiser state when the checkpoint was saved (frozen:
    ``requires_grad`` False, never stepped) was asked of DCP all the same ('Missing key
    optim.bias.exp_avg') and nothing loaded. The state that is there loads; the frozen one's
    starts fresh, as it would have gone on; another optimiser's state is still refused."""
    from attnres.checkpoint import load_sharded

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's save without a process group
        path = save_sharded(tmp_path / "run", 1, dict(model.named_parameters()), optimizer, {}, keep=1)
    other = torch.nn.Linear(3, 2)  # (other weights; the bias unfrozen since)
    other_optimizer = torch.optim.AdamW(other.parameters())
    load_sharded(path, dict(other.named_parameters()), other_optimizer, restore_rng=False)
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
    assert other.bias not in other_optimizer.state  # (fresh: its first step will be its first)
    saved = optimizer.state[model.weight]
    assert all(torch.equal(other_optimizer.state[other.weight][k], v) for k, v in saved.items())
    sgd = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)  # (no momentum_buffer was saved)
    with pytest.raises(CheckpointError, match="cannot be loaded into this model/optimiser"):
        load_sharded(path, dict(other.named_parameters()), sgd, restore_rng=False)


@pytest.mark.parametrize("rng", [{"generator": torch.zeros(3, dtype=torch.uint8)}, {"torch_cpu": torch.zeros(3)}])
def test_an_rng_file_without_the_cpu_state_is_named(tmp_path, rng):
    """A sharded checkpoint whose ``rng.safetensors`` (its hash matching: written by another
    tool) holds no ``torch_cpu`` ended ``load_sharded`` - and a resume - in a bare
    ``KeyError: 'torch_cpu'`` (one of another type or size, in torch's TypeError or
    RuntimeError): a CheckpointError names the checkpoint, the file and the key."""
    from attnres.checkpoint import load_sharded, read_checkpoint_state
    from attnres import ModelConfig
    from safetensors.torch import save_file

    path = sharded_checkpoint(tmp_path / "run")
    save_file(rng, str(path / "rng.safetensors"))
    rewrite_manifest(path)
    model = AttnResLM(ModelConfig.from_dict(read_checkpoint_state(path)["config"]["model"]))
    with pytest.raises(CheckpointError, match=rf"^checkpoint '{path}' cannot be resumed: rng.safetensors holds "
                                              r"(no 'torch_cpu' \(holds \['generator'\]\)|an invalid 'torch_cpu' \(RNG "
                                              r"state must be a torch.ByteTensor\)), the CPU generator's state"):
        load_sharded(path, dict(model.named_parameters()))


def test_load_sharded_verifies_the_checkpoint_unless_given_its_verified_state(tmp_path, monkeypatch):
    """``load_sharded(path, params, optimizer)`` - the Python API docs/inference.md names for a
    sharded checkpoint's optimiser state - read the DCP files as they were: a shard with one
    byte changed loaded its wrong weights without a word (the trainer verifies before it
    calls it). It verifies the checkpoint and names the file; given the ``verified`` state
    (the trainer's), it does not hash the shards again; a consolidated checkpoint is named so."""
    from attnres import ModelConfig
    from attnres.checkpoint import load_sharded, manifest, read_checkpoint_state, write_checkpoint

    path = sharded_checkpoint(tmp_path / "run")
    state = read_checkpoint_state(path)
    model = AttnResLM(ModelConfig.from_dict(state["config"]["model"]))
    params = dict(model.named_parameters())
    hashed = []
    sha256 = manifest._sha256
    monkeypatch.setattr(manifest, "_sha256", lambda f: (hashed.append(f.name), sha256(f))[1])
    load_sharded(path, params, restore_rng=False, verified=state)
    assert hashed == []  # (verified by the caller: not read twice)
    load_sharded(path, params, restore_rng=False)
    assert any(name.endswith(".distcp") for name in hashed), hashed
    shard = damage(path)
    with pytest.raises(CheckpointError, match=rf"checkpoint '{path}' is corrupted: dcp/{shard.name} does not match its "
                                              r"SHA-256 in state.json"):
        load_sharded(path, params, build_optimizer(model, load_config(None, COMPILED_PART_CONFIG)))
    linear = torch.nn.Linear(3, 2)
    one = write_checkpoint(tmp_path / "one", 1, linear.state_dict(), torch.optim.AdamW(linear.parameters()).state_dict(),
                           {}, keep=1)
    with pytest.raises(CheckpointError, match=rf"checkpoint '{one}' is consolidated, not sharded: load it with "
                                              r"attnres.checkpoint.load_checkpoint"):
        load_sharded(one, dict(linear.named_parameters()))


def test_a_run_from_a_sharded_checkpoint_hashes_its_shards_once(tmp_path, monkeypatch):
    """``attnres train init_from=<sharded>`` verifies the checkpoint when it finds it, and
    hands ``load_sharded`` the state it verified: the shards (a large model's gigabytes) are
    not hashed a second time by ``load_sharded``'s own verification."""
    from collections import Counter

    from attnres.checkpoint import manifest
    from test_train import write_corpus

    corpus = write_corpus(tmp_path / "corpus.txt")
    path = sharded_checkpoint(tmp_path / "source", corpus)
    hashed = Counter()
    sha256 = manifest._sha256
    monkeypatch.setattr(manifest, "_sha256", lambda f: (hashed.update([f]), sha256(f))[1])
    train(load_config(None, ["model.d_model=32", "data.tokenizer=byte", f"data.paths=[{corpus}]", "seq_len=16",
                             "batch_size=2", "steps=1", "warmup_steps=0", f"out_dir={tmp_path / 'run'}",
                             "progress=false", "tensorboard=false", f"init_from={path}"]))
    shards = {f: n for f, n in hashed.items() if f.is_relative_to(path) and f.suffix == ".distcp"}
    assert shards and set(shards.values()) == {1}, hashed


def test_a_run_state_json_cannot_hold_is_named_before_anything_is_written(tmp_path):
    """A ``run_state`` that JSON cannot hold failed only when rank 0 wrote ``state.json``, last,
    with json's bare TypeError, which ``agree`` never heard of (the other ranks waited for rank 0
    until the process group's timeout), and the temporary ``.tmp-...-dcp`` directory, every
    shard in it, stayed. It is named before anything is written, and nothing is left."""
    model = torch.nn.Linear(3, 2)
    out = tmp_path / "run"
    with warnings.catch_warnings(), pytest.raises(TypeError) as raised:
        warnings.simplefilter("ignore", UserWarning)  # DCP's save without a process group
        save_sharded(out, 1, dict(model.named_parameters()), torch.optim.AdamW(model.parameters()),
                     {"tokens_seen": 3, "sampler": {"order": [1, 2], "seed": object()}}, keep=1)
    assert str(raised.value).startswith("save_sharded: run_state['sampler']['seed'] cannot be written to state.json "
                                        "(Object of type object is not JSON serializable)"), raised.value
    assert not out.exists() or list(out.rglob("*")) == [], list(out.rglob("*"))


def test_the_temporary_directory_goes_whatever_stops_the_save(tmp_path, monkeypatch):
    """Only a CheckpointWriteError removed the temporary directory: any other error while
    completing the checkpoint (here one from writing its state) left it, every shard in it."""
    from attnres.checkpoint import sharded

    def stopped(*args, **kwargs):
        raise RuntimeError("stopped while publishing")

    monkeypatch.setattr(sharded, "publish_checkpoint", stopped)
    model = torch.nn.Linear(3, 2)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="stopped while publishing"):
        warnings.simplefilter("ignore", UserWarning)  # DCP's save without a process group
        save_sharded(tmp_path / "run", 1, dict(model.named_parameters()), torch.optim.AdamW(model.parameters()), {},
                     keep=1)
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []


def worker(root: Path) -> None:
    """On each of 2 ranks (``torchrun --nproc-per-node 2 this-file root``), through the Python
    API: ``save_sharded`` with its defaults; ``save_sharded`` that fails on rank 0 alone (a
    shard out of its sight); ``load_sharded`` of a checkpoint one of whose shards rank 0
    damaged; ``load_sharded`` where rank 1 reads a copy of its own (another node's out_dir)
    whose shard is damaged. Each rank records how each ended in ``<root>/rank<r>.json``."""
    import datetime
    import shutil

    import torch.distributed as dist

    from attnres.checkpoint import load_sharded, read_checkpoint_state, sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # (a rank left waiting: fails, not hangs)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    params = dict(model.named_parameters())
    ended: dict[str, str] = {}

    def attempt(name: str, fn) -> None:
        try:
            fn()
            ended[name] = "done"
        except Exception as e:  # noqa: BLE001 - recorded for the test to read
            ended[name] = f"{type(e).__name__}: {e}"

    def save(step: int) -> Path:
        return save_sharded(root / "run", step, params, torch.optim.AdamW(model.parameters()), {}, keep=2)

    attempt("defaults", lambda: read_checkpoint_state(save(1)))  # (published whole: it verifies)
    attempt("not json on rank 0", lambda: save_sharded(root / "run", 3, params, torch.optim.AdamW(model.parameters()),
                                                       {"seed": {1, 2}} if rank == 0 else {}, keep=2))
    in_sight = sharded._check_shards_in_sight
    if rank == 0:
        def out_of_sight(tmp: Path) -> None:
            raise CheckpointError("a shard out of sight")

        sharded._check_shards_in_sight = out_of_sight
    attempt("rank 0 fails", lambda: save(2))
    sharded._check_shards_in_sight = in_sight
    dist.barrier()
    first = root / "run" / "checkpoints" / "step-00000001"
    if rank == 0 and first.is_dir():
        (root / "damaged").write_text(damage(first).name)
    dist.barrier()
    attempt("damaged", lambda: load_sharded(first, params))
    intact = save_sharded(root / "node0", 4, params, torch.optim.AdamW(model.parameters()), {}, keep=1)
    own = root / "node1" / "checkpoints" / intact.name  # (rank 1's out_dir, on a file system of its own)
    if rank == 1:
        shutil.copytree(intact, own)
        (root / "damaged on rank 1").write_text(damage(own).name)
    dist.barrier()
    attempt("damaged on rank 1", lambda: load_sharded(intact if rank == 0 else own, params))
    # (the trainer's load: rank 0 verified the checkpoint when it found it, and every rank has its state.json)
    verified = read_checkpoint_state(intact)
    attempt("damaged on rank 1, verified on rank 0",
            lambda: load_sharded(intact if rank == 0 else own, params, verified=verified))
    attempt("verified on rank 0", lambda: load_sharded(intact, params, verified=verified))
    with torch.no_grad():  # (another run's step-00000004: whole, of other weights)
        model.weight.add_(1.0)
    other = save_sharded(root / "node2", 4, params, torch.optim.AdamW(model.parameters()), {}, keep=1)
    attempt("another checkpoint on rank 1", lambda: load_sharded(intact if rank == 0 else other, params,
                                                                 verified=verified))
    consolidated_from_own_copies(root, rank, model, attempt)
    (root / f"rank{rank}.json").write_text(json.dumps(ended))
    dist.barrier()  # (every rank has answered: none was left waiting)
    dist.destroy_process_group()


def consolidated_from_own_copies(root: Path, rank: int, model: torch.nn.Module, attempt) -> None:
    """The trainer's check of a consolidated checkpoint on several ranks
    (``verify_files_on_every_rank``, of the files each rank reads, with rank 0's verified
    ``state.json``): intact on every rank; with rank 1 reading a copy of its own whose
    ``model.safetensors`` has one byte changed (an out_dir the nodes do not share)."""
    import shutil

    import torch.distributed as dist

    from attnres.checkpoint import read_checkpoint_state, write_checkpoint
    from attnres.checkpoint.manifest import MODEL_FILE, OPTIMIZER_FILE, RNG_FILE
    from attnres.checkpoint.sharded import verify_files_on_every_rank

    if rank == 0:
        write_checkpoint(root / "whole0", 5, model.state_dict(), torch.optim.AdamW(model.parameters()).state_dict(), {},
                         keep=1)
    dist.barrier()
    intact = root / "whole0" / "checkpoints" / "step-00000005"
    own = root / "whole1" / "checkpoints" / intact.name
    if rank == 1:
        shutil.copytree(intact, own)
        data = bytearray((own / MODEL_FILE).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (own / MODEL_FILE).write_bytes(bytes(data))
    dist.barrier()
    verified = read_checkpoint_state(intact)  # (rank 0 found and verified it; every rank has its state.json)
    reads = (MODEL_FILE, OPTIMIZER_FILE, RNG_FILE)
    attempt("consolidated, verified on rank 0", lambda: verify_files_on_every_rank(intact, reads, verified))
    attempt("consolidated, damaged on rank 1",
            lambda: verify_files_on_every_rank(intact if rank == 0 else own, reads, verified))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, list[dict[str, str]]]:
    """The worker's launch on 2 ranks: its root and how each scenario ended on each rank."""
    from distributed_utils import torchrun

    root = tmp_path_factory.mktemp("two-ranks")
    torchrun(2, __file__, str(root))
    return root, [json.loads((root / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow  # one more 2-process launch, about 20 s
def test_save_sharded_with_its_defaults_publishes_once_on_several_ranks(two_ranks):
    """``save_sharded(out_dir, step, params, optimizer, run_state, keep)`` on several ranks
    made every rank main (``main=True``): each removed the temporary directory the others
    wrote into, and published; it failed. Rank 0 of the default process group is main."""
    _, ended = two_ranks
    assert ended[0]["defaults"] == ended[1]["defaults"] == "done", ended  # (and it verified)


@pytest.mark.slow  # (the same launch)
def test_save_sharded_failing_on_one_rank_fails_on_every_rank(two_ranks):
    """The default ``agree`` raised a rank's error on that rank alone: the others waited in a
    barrier for it (until the process group's timeout). Every rank raises it; nothing is
    published."""
    root, ended = two_ranks
    message = (f"CheckpointWriteError: could not write checkpoint step-00000002 in "
               f"{str(root / 'run' / 'checkpoints')!r}: a shard out of sight; nothing of it was kept")
    assert ended[0]["rank 0 fails"].startswith(message) and ended[1]["rank 0 fails"] == ended[0]["rank 0 fails"], ended
    assert sorted(p.name for p in (root / "run" / "checkpoints").iterdir()) == ["step-00000001"]


@pytest.mark.slow  # (the same launch)
def test_a_run_state_json_cannot_hold_on_rank_0_stops_every_rank(two_ranks):
    """Rank 0 raised json's TypeError alone, writing state.json after every rank had written its
    shards: rank 1 waited for it until the process group's timeout. Every rank stops before
    anything is written, rank 0 with the TypeError naming the entry, rank 1 with its message."""
    root, ended = two_ranks
    message = "save_sharded: run_state['seed'] cannot be written to state.json (Object of type set is not JSON"
    assert ended[0]["not json on rank 0"].startswith(f"TypeError: {message}"), ended
    assert ended[1]["not json on rank 0"].startswith(f"CheckpointWriteError: {message}"), ended
    assert not any(p.name.startswith(".tmp") for p in (root / "run" / "checkpoints").iterdir())


@pytest.mark.slow  # (the same launch)
@pytest.mark.parametrize(("scenario", "where", "seen"), [
    ("damaged", ("run", "checkpoints", "step-00000001"), ""),
    ("damaged on rank 1", ("node1", "checkpoints", "step-00000004"), " (as rank 1 sees it)"),
    ("damaged on rank 1, verified on rank 0", ("node1", "checkpoints", "step-00000004"), " (as rank 1 sees it)"),
])
def test_load_sharded_of_a_damaged_checkpoint_fails_on_every_rank_together(two_ranks, scenario, where, seen):
    """On several ranks ``load_sharded`` verifies the checkpoint (rank 0 hashes every file, as the
    trainer does) and every rank raises the same CheckpointError: none loads the damaged shard,
    and none is left waiting in DCP's collectives for a rank that raised alone. Rank 0 alone
    verified it: a rank reading another copy (an out_dir the nodes do not share) loaded its
    damaged shard as it was, or failed alone in DCP's words; each rank now verifies the files it
    reads, and the error names the rank that found it. So it does where rank 0 verified the
    checkpoint before (``verified=``, the trainer's resume and init_from), which was checked on
    rank 0 alone; an intact one loads on every rank."""
    root, ended = two_ranks
    shard = (root / scenario.partition(",")[0]).read_text()
    assert ended[0][scenario] == ended[1][scenario] == (
        f"CheckpointError: checkpoint {str(root.joinpath(*where))!r} is corrupted: dcp/{shard} does not match its "
        f"SHA-256 in state.json{seen}"), ended
    assert ended[0]["verified on rank 0"] == ended[1]["verified on rank 0"] == "done", ended


@pytest.mark.slow  # (the same launch)
def test_a_rank_s_copy_of_another_checkpoint_than_rank_0_verified_is_refused_on_every_rank(two_ranks):
    """The trainer's load (``verified=``: rank 0 verified the checkpoint it found) where rank 1's
    out_dir holds another checkpoint of the same name, whole by its own state.json (another
    run's ``step-00000004``, an out_dir the nodes do not share): rank 1 loaded other weights
    than rank 0's, without a word. Its files are checked against what rank 0 verified."""
    root, ended = two_ranks
    assert ended[0]["another checkpoint on rank 1"] == ended[1]["another checkpoint on rank 1"], ended
    assert ended[1]["another checkpoint on rank 1"].startswith(
        f"CheckpointError: checkpoint {str(root / 'node2' / 'checkpoints' / 'step-00000004')!r} is not the one rank 0 "
        "verified: dcp/"), ended
    assert ended[1]["another checkpoint on rank 1"].endswith(" (as rank 1 sees it)"), ended


@pytest.mark.slow  # (the same launch)
def test_a_rank_s_damaged_copy_of_a_consolidated_checkpoint_fails_on_every_rank_together(two_ranks):
    """A multi-rank run resumed or started from a consolidated checkpoint: rank 0 verified it
    when it found it, and every rank read model.safetensors (and the optimiser's and generators'
    files) from its own out_dir unchecked, so a rank's damaged copy (an out_dir the nodes do not
    share) loaded as it was. Each other rank now hashes what it reads, and every rank raises the
    same CheckpointError naming the rank; an intact one passes on every rank."""
    root, ended = two_ranks
    assert ended[0]["consolidated, verified on rank 0"] == ended[1]["consolidated, verified on rank 0"] == "done", ended
    assert ended[0]["consolidated, damaged on rank 1"] == ended[1]["consolidated, damaged on rank 1"] == (
        f"CheckpointError: checkpoint {str(root / 'whole1' / 'checkpoints' / 'step-00000005')!r} is corrupted: "
        "model.safetensors does not match its SHA-256 in state.json (as rank 1 sees it)"), ended


def test_a_run_from_a_consolidated_checkpoint_checks_the_files_each_rank_reads(tmp_path, monkeypatch):
    """The trainer checks, on every rank (a collective: nothing in one process), the files of a
    consolidated checkpoint each rank reads against the state rank 0 verified: the weights, and
    resuming the optimiser's and generators' states too."""
    import attnres.train.loop as loop

    checked = []
    real = loop.verify_files_on_every_rank
    monkeypatch.setattr(loop, "verify_files_on_every_rank",
                        lambda path, names, verified: checked.append((path.name, tuple(names))) or
                        real(path, names, verified))
    from test_train import overrides, write_corpus

    corpus = write_corpus(tmp_path / "text.txt", n_lines=100)
    run, again = overrides(corpus, tmp_path / "a", steps=2, stop_after=1), overrides(corpus, tmp_path / "b", steps=1)
    assert cli_main(["train", *run]) == 0
    assert cli_main(["train", *run, "--resume", "stop_after=null"]) == 0
    assert cli_main(["train", *again, f"init_from={tmp_path / 'a'}"]) == 0
    assert checked == [("step-00000001", ("model.safetensors", "optimizer.safetensors", "rng.safetensors")),
                       ("step-00000002", ("model.safetensors",))], checked


if __name__ == "__main__":
    import sys

    worker(Path(sys.argv[1]))
