"""The language model, its decoder trunk and its configuration; :func:`build_model` for any
``ModelConfig`` (the native model, or a ``transformers`` family's: :mod:`attnres.hf.families`,
found through :mod:`.hf_registry`)."""

from .config import PRESETS, ModelConfig, ResidualConfig
from .factory import build_model
from .lm import AttnResLM, LMOutput, require_attnres_lm
from .trunk import IGNORE_INDEX, DecoderTrunk, next_token_loss, run_sublayers

__all__ = [
    "ModelConfig",
    "ResidualConfig",
    "PRESETS",
    "AttnResLM",
    "require_attnres_lm",
    "build_model",
    "LMOutput",
    "DecoderTrunk",
    "run_sublayers",
    "next_token_loss",
    "IGNORE_INDEX",
]
