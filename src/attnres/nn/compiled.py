"""What ``torch.compile`` does to a module's names, in one place: its wrapper
(``OptimizedModule``) holds the original module as ``_orig_mod``, so the wrapper's
``state_dict`` names every weight ``_orig_mod.<name>`` - at the top for ``torch.compile(model)``,
inside for a module that compiled one of its parts (``model._orig_mod.<name>``). The
checkpoint loaders (``attnres.checkpoint.module``) and the model's own ``load_state_dict``
(``attnres.models.trunk``) read names through this module."""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["COMPILED_PREFIX", "uncompiled", "uncompiled_name"]

#: The attribute of ``torch.compile``'s wrapper that holds the original module.
_ORIGINAL = "_orig_mod"
#: What ``torch.compile(model).state_dict()`` puts before each of the model's names.
COMPILED_PREFIX = _ORIGINAL + "."


def uncompiled(model: nn.Module) -> nn.Module:
    """``model``, or for a ``torch.compile``'d one its original module (the same parameters,
    under their own names). The wrapper's class, not the attribute, tells it: a module of the
    user's may hold something as ``_orig_mod`` of its own (its weights are all its own)."""
    return getattr(model, _ORIGINAL) if _is_compiled(model) else model


def _is_compiled(model: object) -> bool:
    """Whether ``model`` is ``torch.compile``'s wrapper (``OptimizedModule``): none is made
    before ``torch._dynamo`` is imported, which is left to ``torch.compile`` (seconds)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def uncompiled_name(name: str) -> str:
    """A state-dict name without the ``_orig_mod.`` of each compiled module on its path
    (``_orig_mod.model.norm.weight`` and ``model._orig_mod.norm.weight``: ``model.norm.weight``):
    the name the weight has where nothing is compiled."""
    return ".".join(part for part in name.split(".") if part != _ORIGINAL)
