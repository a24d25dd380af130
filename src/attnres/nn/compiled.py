"""What ``torch.compile`` does to a module's names, in one place: its wrapper
(``OptimizedModule``) holds the original module as ``_orig_mod``, so the wrapper's
``state_dict`` names every weight ``_orig_mod.<name>`` - at the top for ``torch.compile(model)``,
inside for a module that compiled one of its parts (``model._orig_mod.<name>``). The
checkpoint loaders (``attnres.checkpoint.module``) and the model's own ``load_state_dict``
(``attnres.models.trunk``) read names through this module."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TypeVar

from torch import nn

__all__ = ["COMPILED_PREFIX", "by_own_names", "uncompiled", "uncompiled_name"]

V = TypeVar("V")

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


def by_own_names(named: Mapping[str, V], who: str) -> dict[str, V]:
    """``named`` (weights, parameters) under their own names (:func:`uncompiled_name`), as a
    checkpoint stores them, or ``ValueError`` naming ``who`` where two names are one without
    ``_orig_mod.`` (a module holding both ``x.w`` and ``x._orig_mod.w``): one would have been
    stored over the other."""
    own: dict[str, str] = {}
    for name in named:
        taken = own.setdefault(uncompiled_name(name), name)
        if taken != name:
            raise ValueError(f"{who}: the weights {taken!r} and {name!r} are both stored as "
                             f"{uncompiled_name(name)!r} (a checkpoint names weights without torch.compile's "
                             "'_orig_mod.'): rename the module attribute called '_orig_mod'")
    return {own_name: named[name] for own_name, name in own.items()}
