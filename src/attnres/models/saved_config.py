"""Refusing a saved ``config.json`` that does not describe the model it claims (no
``transformers`` import).

An AttnRes config class fills every field a ``config.json`` lacks with its default, so a file
without its residual settings - edited by hand, or rewritten by a tool that keeps only the
fields it knows - would load as another model (Block AttnRes with the default block size,
say) whose weights have the same shapes: nothing downstream could tell. Likewise a
``model_type`` that is not the one of the file's ``architectures`` makes the loader (vLLM
picks the model class by the architecture, transformers by the ``model_type``) build one
model from another's config. The AttnRes config classes call :func:`check_saved_config` on
every dictionary read from a file, before any default is filled in.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["IncompleteConfig", "check_saved_config", "config_source", "naming_source"]


class IncompleteConfig(ValueError):
    """A saved config lacks a field of its model, or names another model."""


def config_source(kwargs: Mapping[str, Any]) -> str:
    """The file a config dictionary came from, for messages: ``<dir>/config.json`` when
    the loader passed the directory (``name_or_path``), else ``config.json``."""
    where = kwargs.get("name_or_path")
    return str(Path(where) / "config.json") if where else "config.json"


def check_saved_config(config: Mapping[str, Any], *, model_type: str, architectures: Collection[str],
                       required: Mapping[str, str], source: str, given: Collection[str] = ()) -> None:
    """Raise :class:`IncompleteConfig` naming ``source`` and the field when the saved
    ``config`` names another ``model_type``, lists ``architectures`` other than the given
    ones, or lacks a field of ``required`` (field -> what it holds) that is not ``given``
    otherwise (as a keyword argument of the loader, or in the keys of earlier versions)."""
    saved_type = config.get("model_type")
    if saved_type is not None and saved_type != model_type:
        raise IncompleteConfig(f"{source}: model_type {saved_type!r} is not {model_type!r}, the model_type of the class "
                               f"loading it ({', '.join(sorted(architectures))}): the file names another model")
    saved_architectures = config.get("architectures") or []
    foreign = [name for name in saved_architectures if name not in architectures]
    if foreign:
        raise IncompleteConfig(
            f"{source}: architectures {foreign} do not match model_type {model_type!r}, whose architecture is "
            f"{' or '.join(sorted(architectures))}: set \"model_type\" to the one of the architecture (the file was "
            "edited, or written by another tool)")
    for field, meaning in required.items():
        if field not in config and field not in given:
            raise IncompleteConfig(
                f"{source} has no field {field!r} ({meaning}): without it the model would load with the default, "
                "another function than the one its weights were trained as. Restore the field, or write the "
                "directory again (attnres export, attnres upcycle, save_pretrained)")


def naming_source(source: str, build: Callable[[], T]) -> T:
    """``build()``, its ``ValueError`` naming ``source`` first: a field a hand edit broke is
    refused by the field's check, which does not know the file (``vllm serve DIR`` shows the
    message inside a validation error of vLLM's own ``ModelConfig``, no file named)."""
    try:
        return build()
    except ValueError as e:
        if len(e.args) == 1 and isinstance(e.args[0], str) and not e.args[0].startswith(source):
            e.args = (f"{source}: {e.args[0]}",)
        raise
