"""Modules that own parameters and their initialisation: the residual streams
(:class:`BlockAttnRes`, :class:`FullAttnRes`, :class:`StandardResidual`, and the other
registered variants through :func:`registered_residuals`), :class:`RMSNorm`, and the
Llama-style sublayers of :class:`attnres.AttnResLM`.

A residual stream drives any model whose sublayers map ``[..., d]`` to ``[..., d]``: the model
hands each sublayer the input the residual gives it and hands the output back (the README's
"AttnRes in your own PyTorch model"; :class:`ResidualStream` describes the protocol):

>>> import torch
>>> from attnres.nn import BlockAttnRes
>>> residual = BlockAttnRes(dim=8, n_sublayers=4, block_size=2)  # 2 blocks of 2 sublayers
>>> sublayers = [torch.nn.Linear(8, 8) for _ in range(4)]        # yours: [..., d] -> [..., d]
>>> state = residual.start(torch.randn(2, 5, 8))                 # the embedding [B, T, d]
>>> for l, sublayer in enumerate(sublayers):
...     h = residual.sublayer_input(state, l)                    # depth attention: [B, T, d]
...     residual.add_output(state, l, sublayer(h))               # its raw output [B, T, d]
>>> residual.finish(state).shape                                 # before your final norm
torch.Size([2, 5, 8])
"""

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
