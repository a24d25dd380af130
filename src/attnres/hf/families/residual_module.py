"""A saved directory's record of the module that registers its residual, where the residual is
the user's own (``attnres.register_residual`` in their module): without it, a fresh process
loading the directory - ``from_pretrained(DIR, trust_remote_code=True)``, ``vllm serve DIR`` -
knew only the residual's name, and stopped with the registry's list of the names it knows.

``config.json`` names the module (:data:`NATIVE_KEY` for an AttnRes model, :data:`FAMILY_KEY`
for an upcycled family's; absent for a built-in residual, so such a directory is written as
before), as this process had it when it saved. Where ``trust_remote_code`` allows the
directory's code to run, its module file imports that module first
(:func:`attnres.nn.residual.imports.import_residual_module`); elsewhere nothing is imported
for a directory (that would run code a downloaded ``config.json`` names) and the refusal
names the module to import (:func:`naming_residual_module`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from ...nn.residual import residual_class
from ...nn.residual.imports import MAIN, not_registered_by, unimportable_residual
from ...nn.residual.registry import UnregisteredResidual

__all__ = ["FAMILY_KEY", "NATIVE_KEY", "naming_residual_module", "read_for_vllm", "residual_module",
           "saved_residual_module"]

#: The key of ``config.json`` that names the module, in an AttnRes model's config (beside ``residual``).
NATIVE_KEY = "residual_module"
#: The same in an upcycled family's config (beside ``attnres_residual``).
FAMILY_KEY = "attnres_residual_module"


#: Whether this process reads config.json for vLLM (:func:`read_for_vllm`).
_FOR_VLLM = False


def read_for_vllm() -> None:
    """Mark this process as one vLLM started (``attnres.serve.register``, its plugin, calls
    this): there neither ``import MODULE`` nor ``attnres --import`` runs before vLLM reads
    config.json, so a residual refused here says how vLLM imports its module."""
    global _FOR_VLLM
    _FOR_VLLM = True


def _how_to_import(module: str) -> str:
    """How to import ``module`` before the config is read: in Python or the attnres command;
    in vLLM's processes, which import only their plugins, through a plugin of the user's own
    (the ``vllm.general_plugins`` entry point: vLLM imports its module and calls it, in every
    process it starts; docs/serving.md)."""
    if not _FOR_VLLM:
        return f"import it first (`import {module}` in Python, `attnres --import {module} <command> ...`)"
    name = module.replace(".", "_")
    return (f"vLLM imports no module a config.json names, only its plugins, in every process it starts: make "
            f"{module!r} one - a function in it (`def vllm_plugin(): pass`: importing the module registers the "
            f"residual) and an entry point in the pyproject.toml of the package that holds it ([project.entry-points."
            f"\"vllm.general_plugins\"] {name} = \"{module}:vllm_plugin\"), then pip install that package (with "
            f"VLLM_PLUGINS set, add {name} to it); docs/serving.md")


def residual_module(kind: str) -> str | None:
    """The module whose import registers residual ``kind`` here; ``None`` for a built-in
    variant (``"__main__"`` for a class a script defined)."""
    cls = residual_class(kind)
    return None if cls.builtin() else cls.__module__


def saved_residual_module(kwargs: dict[str, Any], key: str) -> str | None:
    """Take ``key`` out of a config's keyword arguments (what ``config.json`` held; the value
    is the registry's again when the config is saved), refusing what is no module name."""
    module = kwargs.pop(key, None)
    if module is not None and not (isinstance(module, str) and all(p.isidentifier() for p in module.split("."))):
        raise ValueError(f"{key} must name the module that registers the residual, such as 'my_pkg.residuals'; "
                         f"got {module!r}")
    return module


@contextlib.contextmanager
def naming_residual_module(module: str | None, kind: object, key: str) -> Iterator[None]:
    """Within, the registry's refusal of ``kind`` (not registered in this process) names
    ``module`` - the one ``config.json`` records - and how to import it."""
    try:
        yield
    except UnregisteredResidual as e:
        if module is None or e.kind != kind:
            raise
        if module == MAIN:
            raise UnregisteredResidual(unimportable_residual(module, kind, key), kind) from None
        if module in sys.modules:
            raise UnregisteredResidual(not_registered_by(module, kind, key), kind) from None
        raise UnregisteredResidual(f"residual {kind!r} is not registered: module {module!r} registers it "
                                   f"(config.json's {key}); {_how_to_import(module)}", kind) from None
