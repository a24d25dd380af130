"""Depth attention with the ablations of the report's Table 4 (report §5.3).

:func:`depth_attention_variant` generalises :func:`attnres.ops.depth_attention`:

* ``query`` may be per token (``[..., d]``): the *input-dependent query* ablation;
* ``mixing_logits`` replaces query and keys by learned scalars per source: the
  *input-independent mixing* ablation;
* ``weighting="sigmoid"``: unnormalised sigmoid weights instead of the softmax;
* ``normalize_keys=False``: raw keys, no RMSNorm;
* ``heads=H``: multihead depth attention - the ``d`` channels are split into ``H`` groups,
  each with its own softmax over the sources (the key RMSNorm still runs over all ``d``).

With every option at its default it computes exactly what ``depth_attention`` computes, by
a separate code path (tests compare the two).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...validation import did_you_mean
from .reference import check_sources

__all__ = ["depth_attention_variant", "WEIGHTINGS"]

WEIGHTINGS = ("softmax", "sigmoid")


def depth_attention_variant(
    query: Tensor | None,
    sources: Sequence[Tensor],
    key_norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    normalize_keys: bool = True,
    weighting: str = "softmax",
    heads: int | None = None,
    mixing_logits: Tensor | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Depth attention with ablation options.

    Args:
        query: ``[d]`` (static pseudo-query) or ``[..., d]`` (one query per token); ignored
            (may be ``None``) with ``mixing_logits``.
        sources: ``n >= 1`` tensors ``[..., d]`` of one shape, dtype and device.
        key_norm_weight: ``[d]`` RMSNorm gain on the keys (``None`` = 1).
        normalize_keys: RMSNorm on the keys (the default) or raw keys.
        weighting: ``"softmax"`` or ``"sigmoid"`` (weights not normalised).
        heads: ``H`` channel groups with separate weights (``d % H == 0``); ``None`` = one.
        mixing_logits: ``[n]`` learned, input-independent logits that replace ``query . key``.

    Returns:
        ``h [..., d]`` in the sources' dtype; with ``return_weights`` also the weights,
        ``[n, ...]`` (``[n, ..., H]`` with ``heads``), in float32.
    """
    check_sources(sources)
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}{did_you_mean(weighting, WEIGHTINGS)}")
    n, d = len(sources), sources[0].shape[-1]
    h = 1 if heads is None else heads
    if not isinstance(h, int) or h < 1 or d % h:
        raise ValueError(f"heads must be a positive divisor of d={d}, got {heads!r}")
    compute = torch.float64 if sources[0].dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=sources[0].device.type, enabled=False):
        values = torch.stack([s.to(compute) for s in sources])  # [n, ..., d]
        if mixing_logits is not None:
            if mixing_logits.shape != (n,):
                raise ValueError(f"mixing_logits must have shape ({n},), got {tuple(mixing_logits.shape)}")
            shape = (*values.shape[:-1], h) if heads is not None else values.shape[:-1]  # [n, ...(, H)]
            logits = mixing_logits.to(compute).reshape(n, *([1] * (len(shape) - 1))).expand(shape)
        else:
            if query is None or query.shape[-1] != d:
                raise ValueError(f"query must end in the sources' dimension {d}")
            keys = values
            if normalize_keys:
                keys = keys * torch.rsqrt(values.pow(2).mean(dim=-1, keepdim=True) + eps)
                if key_norm_weight is not None:
                    keys = keys * key_norm_weight.to(compute)
            prod = keys * query.to(compute)  # [n, ..., d]
            if heads is None:
                logits = prod.sum(dim=-1)  # [n, ...]
            else:
                logits = prod.unflatten(-1, (h, d // h)).sum(dim=-1)  # [n, ..., H]
        weights = torch.softmax(logits, dim=0) if weighting == "softmax" else torch.sigmoid(logits)
        if heads is None:
            out = (weights.unsqueeze(-1) * values).sum(dim=0)
        else:
            out = (weights.unsqueeze(-1) * values.unflatten(-1, (h, d // h))).sum(dim=0).flatten(-2)
    out = out.to(sources[0].dtype)
    return (out, weights) if return_weights else out
