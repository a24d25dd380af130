"""Consolidated checkpoints: the whole model and optimiser state as safetensors files,
written by one process and loaded without unpickling.

Layout of ``<out_dir>/checkpoints/step-00000100/``::

    model.safetensors      the model's weights (tied weights stored once)
    optimizer.safetensors  every tensor of the optimiser state, keyed "<param index>.<name>"
    rng.safetensors        torch CPU (and CUDA) generator states
    tokenizer.json         the run's BPE tokenizer (none for the byte tokenizer)
    state.json             step, data position, config, optimiser hyper-parameters and
                           scalar state, the tokenizer's description and the data's
                           fingerprint, and the SHA-256 of every file above; written last

Publishing and verification are :mod:`attnres.checkpoint.manifest`'s. Only safetensors and
JSON are read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .manifest import (
    FORMAT_VERSION,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    STATE_FILE,
    CheckpointError,
    check_extra_files,
    checkpoint_path,
    publish_checkpoint,
    read_checkpoint_state,
    rng_state,
    run_state_problem,
    write_failure,
)
from .manifest import restore_rng as _restore_rng
from .module import load_weights, weight_key
from .residual import refuse_residual_change, residual_hint
from .sharded import is_sharded, load_sharded_weights, verify_dcp_files
from ..nn.compiled import by_own_names, uncompiled, uncompiled_name
from ..validation import check_path_argument, check_sizes

__all__ = ["save_checkpoint", "write_checkpoint", "load_checkpoint", "read_optimizer_state"]


def _split_optimizer_state(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors (for safetensors) and everything else (for JSON) of an optimiser state dict."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, entry in sd["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(idx), {})[name] = value
    # (the parameters' names of an optimiser built from named_parameters() as the weights are
    # stored: without torch.compile's '_orig_mod.', whichever of compiled or not loads them)
    groups = [{**g, "param_names": [uncompiled_name(n) for n in g["param_names"]]} if "param_names" in g else g
              for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _join_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    for idx, entry in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(entry)
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()} for g in meta["param_groups"]]
    # (an earlier version stored a compiled model's optimiser's names with torch.compile's
    # '_orig_mod.', which torch gives the loading optimiser: read as the weights' own names)
    groups = [{**g, "param_names": tuple(uncompiled_name(n) for n in g["param_names"])} if "param_names" in g else g
              for g in groups]
    return {"state": state, "param_groups": groups}


def _unique_tensors(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model_state`` without the keys whose tensor shares memory with an earlier one (tied
    weights, :func:`~attnres.checkpoint.module.weight_key`): safetensors stores each tensor
    once, and ``load_weights`` restores the tie."""
    seen: set[object] = set()
    out = {}
    for name, t in model_state.items():
        key = weight_key(t)
        if key not in seen:
            seen.add(key)
            out[name] = t.detach().cpu().contiguous()
    return out


def save_checkpoint(out_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], keep: int, files: dict[str, bytes] | None = None) -> Path:
    """Write the checkpoint of ``step`` atomically, then delete all but the newest ``keep``.

    ``state`` is JSON-serialisable run state (data position, config, counters); ``files``
    are further files to store (name -> content, e.g. the tokenizer), verified on load like
    the others. Returns the checkpoint directory. A ``torch.compile``'d model (or one with
    compiled parts) is saved as its original module (:func:`write_checkpoint`).
    """
    return write_checkpoint(out_dir, step, model.state_dict(), optimizer.state_dict(), state, keep, files)


def write_checkpoint(out_dir: str | Path, step: int, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
                     state: dict[str, Any], keep: int, files: dict[str, bytes] | None = None) -> Path:
    """:func:`save_checkpoint` from state dicts: ``model_state`` as ``model.state_dict()``
    gives it, ``optimizer_state`` as ``optimizer.state_dict()``. The weights are stored under
    their own names, without ``torch.compile``'s ``_orig_mod.`` (that of
    ``torch.compile(model).state_dict()``, or of a compiled part: ``model._orig_mod.<name>``),
    so that a checkpoint loads alike wherever the loading model is compiled."""
    check_sizes("write_checkpoint", keep=keep)  # (0 kept every checkpoint, -1 deleted the oldest: by accident)
    extra = check_extra_files(files, {MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, STATE_FILE}, "write_checkpoint")
    # (a state JSON cannot hold failed at the end, in json's bare TypeError, after the weights and the
    # optimiser's state were written: named before anything is, as save_sharded names it)
    problem = run_state_problem(state, "write_checkpoint")
    if problem is not None:
        raise problem
    model_state = by_own_names(model_state, "write_checkpoint")
    final = checkpoint_path(out_dir, step)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(_unique_tensors(model_state), str(tmp / MODEL_FILE))
        opt_tensors, opt_meta = _split_optimizer_state(optimizer_state)
        save_file(opt_tensors, str(tmp / OPTIMIZER_FILE))
        save_file(rng_state(), str(tmp / RNG_FILE))
        for name, content in extra.items():
            (tmp / name).write_bytes(content)
        names = (MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, *extra)
        publish_checkpoint(tmp, final, out_dir, names, {"format_version": FORMAT_VERSION, "step": step},
                           {"optimizer": opt_meta, **state}, keep)
    except BaseException as e:  # keep what was there: a half-written directory of the model's size and twice the
        shutil.rmtree(tmp, ignore_errors=True)  # optimiser's stayed after a second Ctrl-C until a resume removed it
        if isinstance(e, (OSError, SafetensorError)):  # a full disk, a read-only file system: said in one line
            raise write_failure(final, e) from None
        raise
    return final


def read_optimizer_state(path: str | Path, doc: dict[str, Any]) -> dict[str, Any]:
    """The optimiser state dict of a verified checkpoint (``doc`` from
    :func:`read_checkpoint_state`), in the layout of ``optimizer.state_dict()``."""
    return _join_optimizer_state(load_file(str(Path(path) / OPTIMIZER_FILE)), doc["optimizer"])


def _fitting_optimizer_state(path: Path, saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``saved`` (a checkpoint's optimiser state), or :class:`CheckpointError` naming the file
    and the fix where ``optimizer`` has other parameter groups: torch's own ValueError ("loaded
    state dict has a different number of parameter groups") named neither."""
    theirs = [len(g["params"]) for g in saved["param_groups"]]
    ours = [len(g["params"]) for g in optimizer.param_groups]
    if theirs != ours:
        raise CheckpointError(f"checkpoint {str(path)!r}: its {OPTIMIZER_FILE} is the state of an optimiser whose "
                              f"parameter groups hold {theirs} parameters; this optimiser's hold {ours}: build the "
                              "optimiser as the run that wrote it did (attnres train's: "
                              "attnres.train.build_optimizer(model, config)), or load the weights alone "
                              "(optimizer=None)")
    return saved


def _load_sharded_checkpoint(path: Path, doc: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None,
                             restore_rng: bool, allow_residual_change: bool) -> None:
    """:func:`load_checkpoint` of a sharded checkpoint: its weights (and the CPU generator's
    state), or :class:`CheckpointError` where an optimiser is given, whose state it keeps by
    parameter name for :func:`~attnres.checkpoint.load_sharded`."""
    if optimizer is not None:
        raise CheckpointError(f"checkpoint {str(path)!r} is sharded (DCP, written on several ranks): load_checkpoint "
                              "loads its weights alone (optimizer=None); its optimiser state loads with "
                              "attnres.checkpoint.load_sharded(path, dict(model.named_parameters()), optimizer)")
    load_sharded_weights(path, model, doc, allow_residual_change=allow_residual_change)
    if restore_rng:
        _restore_rng(path, cuda=False)


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    restore_rng: bool = True, verified: dict[str, Any] | None = None, *,
                    allow_residual_change: bool = False) -> dict[str, Any]:
    """Verify a checkpoint and load it into ``model`` (and ``optimizer``, and the global RNGs).
    Returns the run state from ``state.json``. ``verified``: that state, when the caller has
    just verified the checkpoint with :func:`read_checkpoint_state` (its files are not hashed
    again). A model that tells its residual (an ``AttnResLM``) whose residual is not the one
    the checkpoint's run config stores while the weights fit (Full vs Block AttnRes, another
    block size) is refused (:class:`CheckpointError` naming both) unless
    ``allow_residual_change``. A sharded checkpoint's weights load too
    (:func:`~attnres.checkpoint.load_sharded_weights`), without an optimiser."""
    check_path_argument(path, "load_checkpoint(path, model, optimizer=None, ...)", "a checkpoint directory (step-*)")
    if not isinstance(model, nn.Module):  # (a state dict there failed deep in the load)
        raise TypeError(f"load_checkpoint: model must be the nn.Module to load into, got {type(model).__name__}")
    model = uncompiled(model)  # (its weights, under the names the checkpoint stores)
    path = Path(path)
    doc = verified if verified is not None else read_checkpoint_state(path)
    if is_sharded(doc):  # (no model.safetensors: a bare FileNotFoundError)
        # (a shard its DCP metadata names and the manifest lacks ended in DCP's CheckpointException;
        # the metadata read against the manifest, nothing hashed: whether or not ``verified``)
        verify_dcp_files(path, doc)
        _load_sharded_checkpoint(path, doc, model, optimizer, restore_rng, allow_residual_change)
        return doc
    refuse_residual_change(path, doc, model, allow_residual_change)
    try:
        load_weights(path, model, load_file(str(path / MODEL_FILE)))
        if optimizer is not None:
            optimizer.load_state_dict(_fitting_optimizer_state(path, read_optimizer_state(path, doc), optimizer))
        if restore_rng:
            _restore_rng(path)
    except CheckpointError as e:  # weights that do not fit: of a model with another residual, said so
        raise CheckpointError(f"{e}{residual_hint(path, doc, model)}") from None
    except (SafetensorError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded into this model/optimiser: {e}"
                              f"{residual_hint(path, doc, model)}") from None
    return doc
