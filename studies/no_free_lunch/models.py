"""Models of the no-free-lunch experiment: residual MLP stacks whose residual is one of the
project's residual streams, driven only through their public four calls.

A model with ``depth`` blocks is::

    v_0 = embed(x)                                  (Linear d_in -> width)
    for l in 0 .. depth-1:                          (one block = one sublayer)
        h_l = residual.sublayer_input(state, l)
        residual.add_output(state, l, f_l(h_l))     f_l(h) = W2 GELU(W1 norm_l(h))   (width -> 2 width -> width)
    y = head(final_norm(residual.finish(state)))    (Linear width -> d_out)

With ``prenorm=True``, ``norm_l`` and ``final_norm`` are RMSNorms with learnable gains (the
PreNorm network of the report); with ``prenorm=False`` both are the identity, so every
sublayer sees the raw mixed hidden state and the head the raw output aggregation. AttnRes's
own RMSNorm on its keys belongs to the residual and stays in both settings.

Variants (:data:`VARIANTS`):

* ``standard`` - :class:`~attnres.nn.StandardResidual`, ``h_{l+1} = h_l + f_l(h_l)``;
* ``full`` - :class:`~attnres.nn.FullAttnRes` (faithful: zero queries, softmax);
* ``block`` - :class:`~attnres.nn.BlockAttnRes` with ``S = max(2, ceil(depth / 8))``, the
  project's rule for the compare grid (about 8 blocks where depth allows, S = 2 below);
* ``full_sigmoid`` - the mechanism test: Full AttnRes with the report's Table-4 sigmoid
  ablation (``AttnResAblation(sigmoid_weights=True)``, the naive path): the same zero
  queries, but each weight is ``sigmoid(logit)`` on its own, so the weights no longer sum
  to one (at init every source gets 1/2 and the input of sublayer ``l`` is half the
  standard residual's sum).

``impl`` picks the schedule of ``full`` and ``block`` (``"two_phase"`` or ``"naive"``: the
same function, see the tests of :mod:`attnres.nn.residual`).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from attnres.experiments.job.presets import block_size_for
from attnres.nn import BlockAttnRes, FullAttnRes, RMSNorm, StandardResidual
from attnres.nn.residual import AttnResAblation, ResidualStream

__all__ = ["VARIANTS", "ATTNRES_VARIANTS", "block_size_for", "build_residual", "ResidualMLP"]

VARIANTS = ("standard", "full", "block", "full_sigmoid")
#: The variants compared against ``standard``.
ATTNRES_VARIANTS = VARIANTS[1:]


def build_residual(variant: str, width: int, depth: int, impl: str = "two_phase") -> ResidualStream:
    """The residual stream of ``variant`` over ``depth`` sublayers of ``width``; ``impl`` is
    the AttnRes schedule of ``full`` and ``block`` (the sigmoid ablation always runs naive)."""
    if variant == "standard":
        return StandardResidual(width, depth)
    if variant == "full":
        return FullAttnRes(width, depth, schedule=impl)
    if variant == "block":
        return BlockAttnRes(width, depth, block_size_for(depth), schedule=impl)
    if variant == "full_sigmoid":
        return FullAttnRes(width, depth, schedule="naive", ablation=AttnResAblation(sigmoid_weights=True))
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


class _MLP(nn.Module):
    """One sublayer: ``W2 GELU(W1 norm(h))`` with ``norm`` an RMSNorm or the identity."""

    def __init__(self, width: int, hidden: int, prenorm: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(width) if prenorm else nn.Identity()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, h: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(self.norm(h))))


class ResidualMLP(nn.Module):
    """A residual MLP stack of ``depth`` one-sublayer blocks (see the module docstring).

    ``forward(x)`` returns ``[..., d_out]``; ``forward(x, return_rms=True)`` also returns the
    RMS of every sublayer's input ``h_l`` and of the residual's final output (``depth + 1``
    floats, averaged over the batch): how large the mixed hidden state grows with depth.
    """

    def __init__(self, variant: str, d_in: int, d_out: int, width: int, depth: int, prenorm: bool,
                 hidden_mult: int = 2, impl: str = "two_phase") -> None:
        super().__init__()
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be an integer >= 1, got {width!r}")
        self.variant, self.depth, self.prenorm = variant, depth, prenorm
        self.residual = build_residual(variant, width, depth, impl)
        self.embed = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(_MLP(width, hidden_mult * width, prenorm) for _ in range(depth))
        self.final_norm = RMSNorm(width) if prenorm else nn.Identity()
        self.head = nn.Linear(width, d_out)

    def forward(self, x: Tensor, return_rms: bool = False):
        r = self.residual
        state = r.start(self.embed(x))
        rms = []
        for l, block in enumerate(self.blocks):
            h = r.sublayer_input(state, l)
            if return_rms:
                rms.append(_rms(h))
            r.add_output(state, l, block(h))
        out = r.finish(state)
        y = self.head(self.final_norm(out))
        if return_rms:
            return y, rms + [_rms(out)]
        return y


def _rms(h: Tensor) -> float:
    return h.detach().float().pow(2).mean(dim=-1).sqrt().mean().item()
