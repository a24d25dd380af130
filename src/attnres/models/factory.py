"""The one place a ``ModelConfig`` becomes a model, for training and loading alike."""

from __future__ import annotations

from torch import nn

from .config import ModelConfig
from .hf_registry import hf_hook
from .lm import AttnResLM

__all__ = ["build_model", "context_limit"]


def build_model(config: ModelConfig) -> nn.Module:
    """The freshly initialised model ``config`` describes: an :class:`AttnResLM`, or with
    ``hf_architecture`` a ``transformers`` family's AttnRes causal LM
    (:mod:`attnres.hf.families`, found through :mod:`.hf_registry`; needs ``transformers``),
    on the default device."""
    if config.hf_architecture is None:
        return AttnResLM(config)
    return hf_hook("build_model")(config)


def context_limit(model: nn.Module) -> int:
    """The most positions ``model`` (what :func:`build_model` gives) attends over: an
    :class:`AttnResLM`'s ``max_seq_len``, a transformers model's ``max_position_embeddings``."""
    config = model.config
    return config.max_seq_len if isinstance(model, AttnResLM) else config.max_position_embeddings
