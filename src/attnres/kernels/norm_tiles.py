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
