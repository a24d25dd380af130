"""The Python loaders' refusal of a checkpoint of another residual: ``load_checkpoint(path,
model)`` (and ``load_sharded_weights``, ``load_weights``) loaded a Block AttnRes run's weights
into a Full AttnRes model, or one of another block size (the same names and shapes), without a
word, where ``attnres train init_from=...`` refuses it. Only a model that tells its residual
(an ``AttnResLM``: its ``config``, a :class:`~attnres.models.ModelConfig`) is compared with the
model config ``attnres train`` stores in ``state.json``; any other ``nn.Module``, and a
checkpoint written by other code (no stored config), load as before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from .manifest import STATE_FILE, CheckpointError

__all__ = ["refuse_residual_change", "residual_hint"]


def refuse_residual_change(path: str | Path, state: dict[str, Any] | None, model: nn.Module, allowed: bool) -> None:
    """Raise :class:`CheckpointError` when ``model``'s residual is not the one of the checkpoint
    ``path`` (its ``state.json``: ``state``, read here where ``None``) while its weights fit,
    naming both and the way out; ``allowed`` (``allow_residual_change=True``): meant, as a Block
    AttnRes run continued as Full AttnRes."""
    if allowed:
        return
    # (imported when a load asks, not with attnres.checkpoint: the model modules import torch._dynamo, which
    # the checkpoint's other tools - finding, verifying, consolidating one - need not wait for)
    from ..models.residual_change import residual_change_refusal

    if (found := _saved_and_ours(path, state, model)) is None:
        return
    saved, config = found
    refusal = residual_change_refusal(
        saved, config, f"checkpoint {str(path)!r}", "this model's",
        "Build the model with the checkpoint's residual (config.model.residual in its state.json), or pass "
        "allow_residual_change=True to load its weights into this residual")
    if refusal is not None:
        raise CheckpointError(refusal)


def _saved_and_ours(path: str | Path, state: dict[str, Any] | None, model: nn.Module):
    """``(the checkpoint's stored model config, model's ModelConfig)``, or ``None`` where
    ``model`` tells no residual or the checkpoint stores no config (``state``: its
    ``state.json``, read here where ``None``)."""
    from ..models.config import ModelConfig

    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        return None
    if state is None:
        try:
            state = json.loads((Path(path) / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None  # (reading the weights says what is wrong with the checkpoint)
    saved = (state.get("config") or {}).get("model") if isinstance(state, dict) else None
    return (saved, config) if isinstance(saved, dict) else None


def residual_hint(path: str | Path, state: dict[str, Any] | None, model: nn.Module) -> str:
    """What to add to a load's refusal of weights that do not fit ``model`` where the
    checkpoint is of another residual (a Block AttnRes run into a standard model): the
    missing and unexpected weights alone did not say that the model was built with another
    residual, nor how to build the checkpoint's. ``""`` where the residuals agree, ``model``
    tells none or the checkpoint stores no config."""
    from ..models.residual_change import residual_difference

    if (found := _saved_and_ours(path, state, model)) is None:
        return ""
    values = residual_difference(*found)
    if values is None:
        return ""
    return (f". The checkpoint's model has another residual ({values}): build the model with the checkpoint's "
            "residual (config.model.residual in its state.json), or load the checkpoint's own model with "
            "attnres.inference.load_run")
