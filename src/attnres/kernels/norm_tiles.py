"""Triton helpers for the RMSNorm that Phase 2 fuses (the next sublayer's pre-norm).

With ``h [d]`` the merged row, ``gain [d]`` the norm's weight and ``rstd`` its inverse RMS:

    y = h * rstd * gain,   rstd = 1 / sqrt(mean(h^2) + eps)
    dh = rstd * gain * dy - h * coef,   coef = rstd^3 / d * sum(gain * dy * h)
    dgain = sum_rows dy * h * rstd

The PyTorch reference is :class:`attnres.nn.RMSNorm` (``F.rms_norm``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def inverse_rms(sum_sq, d, eps):
    """``1 / sqrt(sum_sq / d + eps)`` (float32 scalar)."""
    return 1.0 / tl.sqrt(sum_sq / d + eps)


@triton.jit
def norm_input_grad(gy, h, gain, rstd, coef):
    """The gradient reaching ``h`` through the norm, one tile: ``rstd gain dy - coef h``."""
    return rstd * gain * gy - coef * h


@triton.jit
def norm_grad_coef(sum_gain_gy_h, rstd, d):
    """``coef`` of :func:`norm_input_grad` from ``sum(gain * dy * h)`` over the row."""
    return sum_gain_gy_h * rstd * rstd * rstd / d


@triton.jit
def tile_of(start, d, BLOCK_D: tl.constexpr):
    """Columns ``start .. start + BLOCK_D`` of a row of ``d`` and their in-row mask."""
    cols = start + tl.arange(0, BLOCK_D)
    return cols, cols < d


@triton.jit
def load_f32(ptr, cols, mask):
    """One tile of a row (``ptr`` points at the row), in float32, zero outside the row."""
    return tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def gain_dy_h(Gain, dy_row, h, cols, mask):
    """One tile of ``gain * dy * h``, whose row sum gives :func:`norm_grad_coef`."""
    return load_f32(Gain, cols, mask) * load_f32(dy_row, cols, mask) * h


@triton.jit
def norm_backward_tile(dy, h, Gain, partial_row, cols, mask, rstd, coef):
    """One tile of the norm's backward: adds ``dy * h * rstd`` to this program's partial
    sums of the gain gradient (``partial_row``) and returns the gradient reaching ``h``."""
    add_to_partial(partial_row, cols, mask, dy * h * rstd)
    return norm_input_grad(dy, h, load_f32(Gain, cols, mask), rstd, coef)


@triton.jit
def add_to_partial(partial_row, cols, mask, value):
    """Add one tile to this program's row of partial sums (a gradient reduced over rows:
    each program owns its row, so no atomics are needed)."""
    tl.store(partial_row + cols, tl.load(partial_row + cols, mask=mask, other=0.0) + value, mask=mask)
