"""Checking a checkpoint against its ``config.json`` before vLLM loads it (no vLLM import).

vLLM's own loader finds a config that does not match the weights only deep inside a weight
loader (an ``AssertionError`` with two shapes and no name) or not at all (a tensor the model
has no place for, silently skipped). The served models therefore pass the checkpoint's
tensors through :func:`checked_weights` first: every tensor is compared with the model that
``config.json`` describes - built on the meta device with the transformers or native classes
that wrote it, so the names and shapes are the checkpoint's own - and a mismatch raises a
:class:`CheckpointMismatch` naming the file, the tensor, both shapes and the config.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = ["CheckpointMismatch", "expected_shapes", "checked_weights"]


class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not match the model its ``config.json`` describes."""


def expected_shapes(build) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of the model ``build()`` returns holds,
    built on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        model: nn.Module = build()
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _file_holding(directory: Path, name: str) -> str:
    """The safetensors file of ``directory`` that holds tensor ``name`` (for messages)."""
    try:
        from safetensors import safe_open

        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                if name in f.keys():
                    return str(path)
    except Exception:  # the message still names the directory
        pass
    return str(directory)


def checked_weights(
    weights: Iterable[tuple[str, Tensor]],
    expected: dict[str, tuple[int, ...]],
    directory: str | Path,
    optional: Iterable[str] = (),
) -> Iterator[tuple[str, Tensor]]:
    """Yield ``weights`` (name, tensor) unchanged, raising :class:`CheckpointMismatch` on a
    tensor whose name or shape the model ``expected`` describes does not have, and - once
    all are read - on tensors that are missing, other than the ``optional`` ones (a tied
    LM head, the residual's tensors that take their faithful init)."""
    directory = Path(directory)
    config = directory / "config.json"
    seen: set[str] = set()
    for name, tensor in weights:
        shape = tuple(tensor.shape)
        if name not in expected:
            raise CheckpointMismatch(
                f"{_file_holding(directory, name)} holds tensor {name!r} {list(shape)}, which the model described by "
                f"{config} has no place for: the config does not match the weights (another number of layers, "
                "another architecture or residual?)")
        if shape != expected[name]:
            raise CheckpointMismatch(
                f"{_file_holding(directory, name)}: tensor {name!r} has shape {list(shape)}, but {config} describes "
                f"{list(expected[name])}: the config does not match the weights")
        seen.add(name)
        yield name, tensor
    missing = sorted(set(expected) - seen - set(optional))
    if missing:
        shown = ", ".join(repr(m) for m in missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise CheckpointMismatch(f"the checkpoint in {directory} lacks {len(missing)} tensor(s) that the model described "
                                 f"by {config} needs: {shown}; the config does not match the weights")
