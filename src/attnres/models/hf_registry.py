"""Where the torch-only core finds the ``transformers`` families (``ModelConfig.hf_architecture``,
``model.from_hf``) without importing ``transformers``: a table of hooks that the transformers
wing (:mod:`attnres.hf`) fills when it is imported.

The core asks for a hook by name (:func:`hf_hook`); when the wing has not been imported yet,
it is imported then, by name (it needs ``transformers``: the ``hf`` extra), so that
``build_model`` of a family config works without an ``import attnres.hf`` first. Nothing
under ``models/`` imports the wing or ``transformers`` itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["WING", "HOOKS", "NATIVE_MODEL_TYPE", "register_hf_hooks", "hf_hook"]

#: The module that fills the table when imported.
WING = "attnres.hf"
#: The ``model_type`` of attnres's own models (``AttnResConfig``: ``attnres export``'s directories),
#: here for the layers below the wing that read a saved directory's ``config.json`` (``init_from``).
NATIVE_MODEL_TYPE = "attnres"
#: The hooks the wing provides, and what each is.
HOOKS = {
    "build_model": "a ModelConfig with hf_architecture -> the family's freshly initialised AttnRes causal LM",
    "check_config": "a ModelConfig with hf_architecture -> its hf_config, each alias named as its field "
                    "(num_experts: num_local_experts), or ValueError on an unknown hf_config key",
    "fields_from_directory": "a saved transformers directory -> the ModelConfig fields of its model (model.from_hf)",
    "layout_of": "a family model_type -> its decoder layer's Layout (sublayer and norm attribute names)",
    "family_of": "a model_type, plain or AttnRes (attnres_X) -> the family's model_type X",
    "router_recorder": "a family model -> a context manager recording what its routers decide (RouterRecorder)",
}

_hooks: dict[str, Callable[..., Any]] = {}


def register_hf_hooks(**hooks: Callable[..., Any]) -> None:
    """Fill the table (the wing calls this when imported; idempotent). The keys are :data:`HOOKS`'."""
    unknown = sorted(set(hooks) - set(HOOKS))
    if unknown:
        raise ValueError(f"unknown transformers hook(s) {unknown}; known: {sorted(HOOKS)}")
    _hooks.update(hooks)


def hf_hook(name: str) -> Callable[..., Any]:
    """The wing's hook ``name`` (one of :data:`HOOKS`), importing the wing first if needed."""
    if name not in HOOKS:
        raise ValueError(f"unknown transformers hook {name!r}; known: {sorted(HOOKS)}")
    if name not in _hooks:
        importlib.import_module(WING)  # registers the hooks (raises ImportError without transformers)
    return _hooks[name]
