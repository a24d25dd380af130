"""The one place a ``ModelConfig`` becomes a model, for training and loading alike."""

from __future__ import annotations

from torch import nn

from .config import ModelConfig
from .hf_registry import hf_hook
from .lm import AttnResLM

__all__ = ["build_model"]


def build_model(config: ModelConfig) -> nn.Module:
    """The freshly initialised model ``config`` describes: an :class:`AttnResLM`, or with
    ``hf_architecture`` a ``transformers`` family's AttnRes causal LM
    (:mod:`attnres.hf.families`, found through :mod:`.hf_registry`; needs ``transformers``),
    on the default device."""
    if config.hf_architecture is None:
        return AttnResLM(config)
    return hf_hook("build_model")(config)
