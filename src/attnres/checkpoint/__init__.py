"""Checkpoint I/O, below training and inference: both formats, the manifest they share,
finding and verifying a checkpoint.

* :mod:`~attnres.checkpoint.manifest` - the ``step-*`` directories, atomic publishing, the
  ``state.json`` manifest and its verification (every file's size and SHA-256);
* :mod:`~attnres.checkpoint.consolidated` - the whole model and optimiser state as
  safetensors (one process);
* :mod:`~attnres.checkpoint.sharded` - ``torch.distributed.checkpoint`` (DCP), every rank its
  shards, resumable at any layout; :func:`consolidate`
  (:mod:`~attnres.checkpoint.consolidation`) turns one into ``model.safetensors``;
  :mod:`~attnres.checkpoint.dcp_metadata` reads DCP's pickled index without running what
  it holds;
* :mod:`~attnres.checkpoint.locate` - the newest checkpoint that verifies.

Nothing here knows a training config, a model class or a process group's layout: a model
is any ``nn.Module``, run state a JSON-serialisable mapping. One exception, by duck typing: a
model that tells its residual (an ``AttnResLM``'s ``config``) is refused the weights of a
checkpoint of another residual (:mod:`~attnres.checkpoint.residual`), unless
``allow_residual_change``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ..extras import require_extra

# (before the modules below, which import it: else "No module named 'safetensors'", nothing of the extra)
require_extra("train", "safetensors", "attnres.checkpoint (checkpoints: training, loading runs)")

from .consolidated import load_checkpoint, read_optimizer_state, save_checkpoint, write_checkpoint
from .locate import (
    Source,
    find_valid_checkpoint,
    is_hf_directory,
    no_checkpoint_at,
    refuse_model_file,
    refuse_out_dir_not_a_run,
    set_aside_newer,
)
from .manifest import (
    CheckpointError,
    CheckpointWriteError,
    checkpoint_dirs,
    checkpoint_path,
    latest_checkpoint,
    read_checkpoint_state,
    remove_partial_checkpoints,
)
from .consolidation import consolidate
from .sharded import is_sharded, load_sharded, load_sharded_weights, read_sharded_tensors, save_sharded


def load_weights(path: str | Path, state: dict[str, Any], model: nn.Module, *,
                 allow_residual_change: bool = False) -> None:
    """Load the weights of the verified checkpoint ``path`` (its ``state.json``: ``state``)
    into the whole ``model``, in one process, whichever format it has. Raises
    :class:`CheckpointError` when they do not fit, or when ``model`` (an ``AttnResLM``) has
    another residual than the checkpoint's, unless ``allow_residual_change``
    (:func:`load_checkpoint`)."""
    if is_sharded(state):
        load_sharded_weights(path, model, state, allow_residual_change=allow_residual_change)
    else:
        load_checkpoint(path, model, restore_rng=False, verified=state, allow_residual_change=allow_residual_change)


__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "Source",
    "checkpoint_dirs",
    "checkpoint_path",
    "consolidate",
    "find_valid_checkpoint",
    "is_hf_directory",
    "is_sharded",
    "latest_checkpoint",
    "load_checkpoint",
    "load_sharded",
    "load_sharded_weights",
    "load_weights",
    "no_checkpoint_at",
    "read_checkpoint_state",
    "read_optimizer_state",
    "read_sharded_tensors",
    "refuse_model_file",
    "refuse_out_dir_not_a_run",
    "remove_partial_checkpoints",
    "save_checkpoint",
    "save_sharded",
    "set_aside_newer",
    "write_checkpoint",
]
