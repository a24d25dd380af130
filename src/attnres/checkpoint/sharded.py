"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): what runs on several
ranks write (every layout of the ``(pp, dp, tp)`` mesh, ``TrainConfig.parallel``).

Layout of ``<out_dir>/checkpoints/step-00000100/``::

    dcp/                   DCP files: every rank writes the shards it holds
                           (``__<rank>_0.distcp``) and rank 0 the metadata
    rng.safetensors        rank 0's torch generator states
    tokenizer.json         as in a consolidated checkpoint
    state.json             run state as in a consolidated checkpoint, ``"layout": "dcp"``,
                           and the SHA-256 of every file above (the DCP files included)

The keys are layout-free: ``model.<full parameter name>`` (``model.layers.3.attn.q_proj.weight``)
and ``optim.<full parameter name>.<state name>`` (``exp_avg``, ``exp_avg_sq``, ``step``,
``momentum_buffer``), whatever stage, tensor or data-parallel shard holds them. So a
checkpoint written at one layout loads at any other (``pp=2 -> pp=1``, ``tp=2 -> dp=2``,
``dp=2 -> dp=4``, or one process): each rank asks DCP for its own shards by key and reads only
those. No rank ever gathers the whole model.

As with consolidated checkpoints, the files are written into a hidden directory renamed into
place when complete (every rank must see the same file system: a shared one across nodes).
:func:`load_sharded_weights` loads one into a whole model in one process (generation,
export and evaluation do so through :func:`attnres.inference.load_run`); :func:`consolidate`
writes the consolidated ``model.safetensors`` that other tools read.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn

from .manifest import FORMAT_VERSION, RNG_FILE, CheckpointError, checkpoint_path, publish_checkpoint, rng_state
from .manifest import restore_rng as _restore_rng

__all__ = ["DCP_LAYOUT", "is_sharded", "save_sharded", "load_sharded", "load_sharded_weights", "read_sharded_tensors",
           "consolidate"]

DCP_LAYOUT = "dcp"
DCP_DIR = "dcp"


def is_sharded(state: dict[str, Any]) -> bool:
    """Whether a checkpoint's ``state.json`` describes a sharded (DCP) checkpoint."""
    return state.get("layout") == DCP_LAYOUT


def _optimizer_entries(params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    out = {}
    for name, p in params.items():
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, Tensor):
                out[f"optim.{name}.{key}"] = value
    return out


def _state_dict(params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer | None) -> dict[str, Tensor]:
    sd: dict[str, Tensor] = {f"model.{n}": p.detach() for n, p in params.items()}
    if optimizer is not None:
        sd.update(_optimizer_entries(params, optimizer))
    return sd


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def save_sharded(out_dir: str | Path, step: int, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer,
                 run_state: dict[str, Any], keep: int, files: dict[str, bytes] | None = None, main: bool = True) -> Path:
    """Write the sharded checkpoint of ``step`` (every rank calls this, with its own
    ``params``: full-model names to this rank's parameters, DTensors where sharded); returns
    its directory. ``main``: this rank writes the run state (rank 0)."""
    import torch.distributed.checkpoint as dcp

    final = checkpoint_path(out_dir, step)
    root = final.parent
    tmp = root / f".tmp-{final.name}-dcp"
    if main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / DCP_DIR).mkdir(parents=True)
    _barrier()
    dcp.save(_state_dict(params, optimizer), checkpoint_id=str(tmp / DCP_DIR))
    if main:
        save_file(rng_state(), str(tmp / RNG_FILE))
        for name, content in (files or {}).items():
            (tmp / name).write_bytes(content)
        names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        publish_checkpoint(tmp, final, out_dir, names,
                           {"format_version": FORMAT_VERSION, "layout": DCP_LAYOUT, "step": step}, run_state, keep)
    _barrier()
    return final


def init_optimizer_state(params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    """Create every parameter's optimiser state (zero gradients, a step at learning rate 0,
    so the parameters do not move), so that a checkpoint's state can be loaded into it in
    place, in this layout's shards."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    grads = {n: p.grad for n, p in params.items()}
    for p in params.values():
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for n, p in params.items():
        p.grad = grads[n]


def load_sharded(path: str | Path, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer | None = None,
                 restore_rng: bool = True) -> None:
    """Load a sharded checkpoint into ``params`` (this rank's, in this run's layout) and
    ``optimizer`` in place: each rank reads its own shards. Every rank calls this."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if optimizer is not None:
        init_optimizer_state(params, optimizer)
    sd = _state_dict(params, optimizer)
    try:
        with torch.no_grad():
            dcp.load(sd, checkpoint_id=str(path / DCP_DIR))
    except Exception as e:  # noqa: BLE001 - DCP raises CheckpointException and others
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded into this model/optimiser: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
    if restore_rng:
        _restore_rng(path, cuda=False)


def read_sharded_tensors(path: str | Path, prefix: str = "model.") -> dict[str, Tensor]:
    """The whole tensors of the sharded checkpoint ``path`` whose keys start with ``prefix``
    (``"model."``: the weights; ``"optim."``: the optimiser state), keys without the prefix,
    read in one process (no process group, no gather across ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(Path(path) / DCP_DIR))
    meta = reader.read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
          if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return {k[len(prefix):]: v for k, v in sd.items()}


def load_sharded_weights(path: str | Path, model: nn.Module) -> None:
    """Load the weights of the sharded checkpoint ``path`` into the whole ``model`` (one
    process: generation, export, evaluation). A tied weight is stored once, under the name
    ``named_parameters`` gives it; its other names are filled by the tie.
    :class:`CheckpointError` when the checkpoint does not fit the model."""
    weights = read_sharded_tensors(path)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    state = model.state_dict()
    loaded = {state[k].data_ptr() for k in weights if k in state}
    missing = [k for k in missing if state[k].data_ptr() not in loaded]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit the model: missing {sorted(missing)}, "
                              f"unexpected {sorted(unexpected)}")


def consolidate(path: str | Path, out: str | Path | None = None) -> Path:
    """Write the consolidated ``model.safetensors`` (the single-process layout that export,
    generation and the transformers integration read) of the sharded checkpoint ``path``,
    in one process, into ``out`` (default: ``path``). Returns the file written."""
    target = Path(out or path) / "model.safetensors"
    save_file({k: v.contiguous() for k, v in read_sharded_tensors(path).items()}, str(target))
    return target
