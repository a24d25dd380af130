"""Modules that own parameters and their initialisation."""

from .norm import FusableNormInput, RMSNorm
from .residual import (
    SCHEDULES,
    BlockAttnRes,
    DepthHistory,
    DepthQuery,
    FullAttnRes,
    ResidualConfig,
    ResidualState,
    ResidualStream,
    SingleStreamResidual,
    StandardResidual,
    register_residual,
    registered_residuals,
)
from .rope import RotaryEmbedding, apply_rotary
from .transformer import Attention, SwiGLU, TransformerBlock

__all__ = [
    "RMSNorm",
    "FusableNormInput",
    "RotaryEmbedding",
    "apply_rotary",
    "Attention",
    "SwiGLU",
    "TransformerBlock",
    "ResidualStream",
    "ResidualState",
    "DepthHistory",
    "ResidualConfig",
    "SingleStreamResidual",
    "StandardResidual",
    "FullAttnRes",
    "BlockAttnRes",
    "DepthQuery",
    "register_residual",
    "registered_residuals",
    "SCHEDULES",
]
