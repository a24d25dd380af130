"""The module whose weights a checkpoint holds."""

from __future__ import annotations

from torch import nn


def uncompiled(model: nn.Module) -> nn.Module:
    """``model``, or for a ``torch.compile``'d one its original module (the same parameters):
    the compiled wrapper names every weight ``_orig_mod.<name>``, so a checkpoint saved from it
    loaded into nothing but another compiled model (``load_run`` refused it)."""
    return getattr(model, "_orig_mod", model)
