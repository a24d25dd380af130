"""Loading a checkpoint's weights into the module they belong to, whatever part of it (or of
the module that saved them) ``torch.compile`` wrapped."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor, nn

from ..nn.compiled import uncompiled_name
from .manifest import CheckpointError


def load_weights(path: str | Path, model: nn.Module, weights: dict[str, Tensor]) -> None:
    """Load ``weights`` (a checkpoint's, read from ``path``) into ``model``, or raise
    :class:`CheckpointError` naming what does not fit. A name that differs from one of
    ``model``'s only in ``torch.compile``'s ``_orig_mod.`` loads as that one: the state dict of
    ``torch.compile(wrapper)`` (``_orig_mod.model.<name>``) into ``wrapper``, a checkpoint of
    ``wrapper`` into one whose ``model`` is compiled (``model._orig_mod.<name>``). A tied
    weight is stored once: its other names are filled by the tie."""
    ours = {uncompiled_name(name): name for name in model.state_dict()}
    weights = {ours.get(uncompiled_name(name), name): tensor for name, tensor in weights.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    held = model.state_dict()
    loaded = {held[k].data_ptr() for k in weights if k in held}
    missing = [k for k in missing if held[k].data_ptr() not in loaded]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit the model: missing {sorted(missing)}, "
                              f"unexpected {sorted(unexpected)}")
