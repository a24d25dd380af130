"""Reference softmax attention over depth (report §3.1).

This is the readable definition every fast path in the package is tested against:
stack the sources, RMS-normalise the keys, one dot product with the pseudo-query per
source, a softmax over the sources, and the weighted sum of the *raw* sources.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["depth_attention", "check_sources"]


def check_sources(sources: Sequence[Tensor], what: str = "sources") -> None:
    """Raise ``ValueError`` unless ``sources`` is a non-empty sequence of tensors that share
    one shape ``[..., d]``, one dtype and one device."""
    if isinstance(sources, Tensor) or not isinstance(sources, Sequence):
        raise ValueError(f"{what} must be a non-empty list or tuple of tensors, got {type(sources).__name__}")
    if len(sources) == 0:
        raise ValueError(f"{what} must be non-empty: depth attention needs at least one source")
    first = sources[0]
    if not isinstance(first, Tensor) or first.dim() < 1:
        raise ValueError(f"{what}[0] must be a tensor of shape [..., d]")
    for i, s in enumerate(sources[1:], start=1):
        if not isinstance(s, Tensor):
            raise ValueError(f"{what}[{i}] is a {type(s).__name__}, expected a tensor")
        if s.shape != first.shape:
            raise ValueError(
                f"{what}[{i}] has shape {tuple(s.shape)} but {what}[0] has {tuple(first.shape)}; "
                "all sources must have the same shape"
            )
        if s.dtype != first.dtype:
            raise ValueError(
                f"{what}[{i}] has dtype {s.dtype} but {what}[0] has {first.dtype}; "
                "all sources must have the same dtype"
            )
        if s.device != first.device:
            raise ValueError(f"{what}[{i}] is on {s.device} but {what}[0] is on {first.device}")


def _check_vector(name: str, v: Tensor | None, d: int) -> None:
    if v is None:
        return
    if not isinstance(v, Tensor) or v.shape != (d,):
        shape = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
        raise ValueError(f"{name} must have shape ({d},) to match the sources' last dimension, got {shape}")


def depth_attention(
    query: Tensor,
    sources: Sequence[Tensor],
    key_norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    scale: float = 1.0,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Softmax attention of one pseudo-query over a list of depth sources.

    ``h = sum_i alpha_i * v_i`` with ``alpha = softmax_i(scale * query . RMSNorm(v_i))`` and
    ``RMSNorm(x) = x / sqrt(mean(x^2) + eps) * key_norm_weight``.

    Args:
        query: ``[d]`` pseudo-query ``w_l`` (zero at init, which gives uniform weights).
        sources: ``n >= 1`` tensors of one shape ``[..., d]``, one dtype and device: the
            values, which are also the keys before normalisation.
        key_norm_weight: ``[d]`` learnable gain of the RMSNorm on the keys; ``None`` means 1.
        eps: RMSNorm epsilon.
        scale: logit scale; the report uses 1 (no ``1/sqrt(d)``).
        return_weights: also return the attention weights.

    Returns:
        ``h`` of shape ``[..., d]`` in the sources' dtype, and with ``return_weights`` the
        weights ``[n, ...]`` in float32 (float64 for float64 sources).

    All arithmetic runs in float32 (or float64 for float64 inputs); the result is cast back
    to the sources' dtype once, at the end.
    """
    check_sources(sources)
    d = sources[0].shape[-1]
    _check_vector("query", query, d)
    _check_vector("key_norm_weight", key_norm_weight, d)
    compute = torch.float64 if sources[0].dtype == torch.float64 else torch.float32

    # Autocast off: the matmul below must not silently drop to bf16.
    device_type = sources[0].device.type
    with torch.autocast(device_type=device_type, enabled=False):
        values = torch.stack([s.to(compute) for s in sources])  # [n, ..., d]
        keys = values * torch.rsqrt(values.pow(2).mean(dim=-1, keepdim=True) + eps)
        if key_norm_weight is not None:
            keys = keys * key_norm_weight.to(compute)
        logits = (keys @ query.to(compute)) * scale  # [n, ...]
        weights = torch.softmax(logits, dim=0)
        out = (weights.unsqueeze(-1) * values).sum(dim=0).to(sources[0].dtype)
    if return_weights:
        return out, weights
    return out
