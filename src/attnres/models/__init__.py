"""The language model, its decoder trunk and its configuration."""

from .config import PRESETS, ModelConfig, ResidualConfig
from .lm import AttnResLM, LMOutput
from .trunk import IGNORE_INDEX, DecoderTrunk, next_token_loss, run_sublayers

__all__ = [
    "ModelConfig",
    "ResidualConfig",
    "PRESETS",
    "AttnResLM",
    "LMOutput",
    "DecoderTrunk",
    "run_sublayers",
    "next_token_loss",
    "IGNORE_INDEX",
]
