"""Turning a sharded (DCP) checkpoint into the one ``model.safetensors`` that export,
generation and the transformers integration read, in one process (no gather across ranks)."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file

from ..nn.compiled import by_own_names
from ..output_paths import check_output_dir, honour_umask, replace_atomically
from .locate import find_valid_checkpoint, no_checkpoint_at
from .manifest import CheckpointError
from .sharded import is_sharded, read_sharded_tensors

__all__ = ["consolidate"]


def consolidate(path: str | Path, out: str | Path | None = None) -> Path:
    """Write the consolidated ``model.safetensors`` of the sharded checkpoint ``path`` (a
    ``step-*`` directory, or a run directory: its newest checkpoint that verifies) into the
    directory ``out`` (made if missing; default: the checkpoint's own). Returns the file
    written. :class:`CheckpointError` naming the path where there is no sharded checkpoint:
    a consolidated one (one process wrote it) already holds its ``model.safetensors``."""
    source = find_valid_checkpoint(path)
    if source is None:
        raise CheckpointError(f"consolidate: {no_checkpoint_at(path)}")
    if not is_sharded(source.state):
        raise CheckpointError(f"consolidate: checkpoint {str(source.path)!r} is consolidated already (one process "
                              "wrote it): its model.safetensors is the file to use, or `attnres export` it")
    folder = source.path if out is None else check_output_dir(out, "consolidate's out")
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "model.safetensors"
    # (under the weights' own names, as write_checkpoint stores them: an earlier version's
    # save_sharded stored a compiled part's with torch.compile's '_orig_mod.')
    tensors = {k: v.contiguous() for k, v in by_own_names(read_sharded_tensors(source.path), "consolidate").items()}
    # (renamed into place: safetensors before 0.6 writes in place, and a kill part-way left a
    # model.safetensors cut short beside the checkpoint, or over the one consolidated before)
    replace_atomically(target, lambda tmp: save_file(tensors, str(tmp)), "consolidate's out")
    honour_umask([target])
    return target
