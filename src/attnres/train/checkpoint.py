"""Checkpoints: one directory per step, written atomically, loaded without unpickling.

Layout of ``<out_dir>/checkpoints/step-00000100/``::

    model.safetensors      the model's weights (tied weights stored once)
    optimizer.safetensors  every tensor of the optimiser state, keyed "<param index>.<name>"
    rng.safetensors        torch CPU (and CUDA) generator states
    tokenizer.json         the run's BPE tokenizer (none for the byte tokenizer)
    state.json             step, data position, config, optimiser hyper-parameters and
                           scalar state, the tokenizer's description and the data's
                           fingerprint, and the SHA-256 of every file above; written last

A checkpoint is written into a hidden temporary directory that is renamed into place only
when complete, so a crash never leaves a half-written ``step-*`` directory; loading checks
every file's size and hash against ``state.json``, so a truncated or corrupted checkpoint is
reported clearly instead of resuming from garbage. Only safetensors and JSON are read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file
from torch import nn

FORMAT_VERSION = 1
STATE_FILE = "state.json"
PREFIX = "step-"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted or does not fit the model/config."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _join_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    for idx, entry in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(entry)
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def _rng_state() -> dict[str, torch.Tensor]:
    states = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            states[f"torch_cuda_{i}"] = s
    return states


def checkpoint_dirs(out_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories under ``<out_dir>/checkpoints``, oldest first."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[len(PREFIX):]))


def remove_partial_checkpoints(out_dir: str | Path) -> list[Path]:
    """Delete temporary checkpoint directories that a crash left half-written (they were
    never renamed into place, so no run can depend on them). Returns what was removed."""
    root = Path(out_dir) / "checkpoints"
    stale = sorted(p for p in root.glob(".tmp-*") if p.is_dir()) if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    dirs = checkpoint_dirs(out_dir)
    return dirs[-1] if dirs else None


def _unique_tensors(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model_state`` without the keys whose tensor shares memory with an earlier one (tied
    weights): safetensors stores each tensor once, and ``load_model`` restores the tie."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for name, t in model_state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out[name] = t.detach().cpu().contiguous()
    return out


def checkpoint_path(out_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives (once written)."""
    return Path(out_dir) / "checkpoints" / f"{PREFIX}{step:08d}"


def save_checkpoint(out_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], keep: int, files: dict[str, bytes] | None = None) -> Path:
    """Write the checkpoint of ``step`` atomically, then delete all but the newest ``keep``.

    ``state`` is JSON-serialisable run state (data position, config, counters); ``files``
    are further files to store (name -> content, e.g. the tokenizer), verified on load like
    the others. Returns the checkpoint directory.
    """
    return write_checkpoint(out_dir, step, model.state_dict(), optimizer.state_dict(), state, keep, files)


def write_checkpoint(out_dir: str | Path, step: int, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
                     state: dict[str, Any], keep: int, files: dict[str, bytes] | None = None) -> Path:
    """:func:`save_checkpoint` from state dicts: ``model_state`` as ``model.state_dict()``
    gives it, ``optimizer_state`` as ``optimizer.state_dict()`` (data-parallel training passes
    the gathered, consolidated ones, so the files do not depend on the number of ranks)."""
    final = checkpoint_path(out_dir, step)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(_unique_tensors(model_state), str(tmp / "model.safetensors"))
    opt_tensors, opt_meta = _split_optimizer_state(optimizer_state)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    save_file(_rng_state(), str(tmp / "rng.safetensors"))
    extra = dict(files or {})
    reserved = {"model.safetensors", "optimizer.safetensors", "rng.safetensors", STATE_FILE} & set(extra)
    if reserved or any(Path(name).name != name for name in extra):
        raise ValueError(f"checkpoint files must be plain names other than the checkpoint's own; got {sorted(extra)}")
    for name, content in extra.items():
        (tmp / name).write_bytes(content)
    names = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", *extra)
    publish_checkpoint(tmp, final, out_dir, names, {"format_version": FORMAT_VERSION, "step": step},
                       {"optimizer": opt_meta, **state}, keep)
    return final


def publish_checkpoint(tmp: Path, final: Path, out_dir: str | Path, names, head: dict, tail: dict, keep: int) -> None:
    """The last steps of every checkpoint writer: hash ``names`` (files under ``tmp``) into
    the state file ``{**head, "files": ..., **tail}``, fsync it, move ``tmp`` to ``final`` in
    one rename, and keep only the newest ``keep`` checkpoints of ``out_dir``."""
    listing = {name: {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size} for name in names}
    with (tmp / STATE_FILE).open("w") as f:
        json.dump({**head, "files": listing, **tail}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in checkpoint_dirs(out_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def read_checkpoint_state(path: str | Path, optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """``state.json`` of a checkpoint after verifying every file it lists (size and SHA-256)
    but those of ``optional`` that are absent (inference needs no ``optimizer.safetensors``).
    Raises :class:`CheckpointError` naming the problem."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        doc = json.loads((path / STATE_FILE).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {STATE_FILE} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupted: {STATE_FILE} is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format_version") != FORMAT_VERSION or not isinstance(doc.get("files"), dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} is not an attnres checkpoint of format {FORMAT_VERSION}")
    for name, info in doc["files"].items():
        f = path / name
        if name in optional and not f.exists():
            continue
        if not f.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {name} is missing")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint {str(path)!r} is truncated or corrupted: {name} has {size} bytes, expected {info['bytes']}")
        if _sha256(f) != info["sha256"]:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupted: {name} does not match its SHA-256 in {STATE_FILE}")
    return doc


def read_optimizer_state(path: str | Path, doc: dict[str, Any]) -> dict[str, Any]:
    """The optimiser state dict of a verified checkpoint (``doc`` from
    :func:`read_checkpoint_state`), in the layout of ``optimizer.state_dict()``."""
    return _join_optimizer_state(load_file(str(Path(path) / "optimizer.safetensors")), doc["optimizer"])


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    restore_rng: bool = True, verified: dict[str, Any] | None = None) -> dict[str, Any]:
    """Verify a checkpoint and load it into ``model`` (and ``optimizer``, and the global RNGs).
    Returns the run state from ``state.json``. ``verified``: that state, when the caller has
    just verified the checkpoint with :func:`read_checkpoint_state` (its files are not hashed
    again)."""
    path = Path(path)
    doc = verified if verified is not None else read_checkpoint_state(path)
    try:
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
        if missing or unexpected:
            raise CheckpointError(f"checkpoint {str(path)!r} does not fit the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        if optimizer is not None:
            optimizer.load_state_dict(read_optimizer_state(path, doc))
        if restore_rng:
            rng = load_file(str(path / "rng.safetensors"))
            torch.set_rng_state(rng["torch_cpu"])
            cuda = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
            if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
    except (SafetensorError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded into this model/optimiser: {e}") from None
    return doc
