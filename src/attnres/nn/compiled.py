"""What ``torch.compile`` does to a module's names, in one place: its wrapper
(``OptimizedModule``) holds the original module as ``_orig_mod``, so the wrapper's
``state_dict`` names every weight ``_orig_mod.<name>`` - at the top for ``torch.compile(model)``,
inside for a module that compiled one of its parts (``model._orig_mod.<name>``). The
checkpoint loaders (``attnres.checkpoint.module``) and the model's own ``load_state_dict``
(``attnres.models.trunk``) read names through this module."""

from __future__ import annotations

from torch import nn

__all__ = ["COMPILED_PREFIX", "uncompiled", "uncompiled_name"]

#: The attribute of ``torch.compile``'s wrapper that holds the original module.
_ORIGINAL = "_orig_mod"
#: What ``torch.compile(model).state_dict()`` puts before each of the model's names.
COMPILED_PREFIX = _ORIGINAL + "."


def uncompiled(model: nn.Module) -> nn.Module:
    """``model``, or for a ``torch.compile``'d one its original module (the same parameters,
    under their own names)."""
    return getattr(model, _ORIGINAL, model)


def uncompiled_name(name: str) -> str:
    """A state-dict name without the ``_orig_mod.`` of each compiled module on its path
    (``_orig_mod.model.norm.weight`` and ``model._orig_mod.norm.weight``: ``model.norm.weight``):
    the name the weight has where nothing is compiled."""
    return ".".join(part for part in name.split(".") if part != _ORIGINAL)
