"""``DepthQuery``: one mixer's depth-attention parameters and its reference attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...ops import compute_dtype, depth_attention
from ...ops.depth_attention.ablations import depth_attention_variant
from ..norm import RMSNorm
from .config import AttnResAblation

__all__ = ["DepthQuery"]


class DepthQuery(nn.Module):
    """One sublayer's depth-attention parameters: the pseudo-query ``w_l`` ``[d]`` (zero at
    init) and the RMSNorm gain on its keys ``[d]`` (one at init).

    The query is a plain 1-D parameter, not an ``nn.Linear``: global init passes that
    re-initialise ``nn.Linear`` weights, or every parameter with ``dim() >= 2``, leave it at
    zero.
    """

    def __init__(self, dim: int, eps: float = 1e-6, ablation: AttnResAblation | None = None, n_sources: int = 1) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(dim))
        self.key_norm = RMSNorm(dim, eps)
        self.ablation = ablation if ablation is not None and ablation.active else None
        # Table-4 ablations only: a zero-initialised query projection, or per-source logits.
        self.query_proj = nn.Linear(dim, dim, bias=False) if self.ablation and self.ablation.input_dependent_query else None
        self.mixing_logits = (
            nn.Parameter(torch.zeros(n_sources)) if self.ablation and self.ablation.input_independent_mixing else None
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The init of the report (§3.1): a zero query (uniform weights over the sources), unit
        key-norm gains; an ablation's query projection or source logits zero too."""
        nn.init.zeros_(self.query)
        self.key_norm.reset_parameters()
        if self.query_proj is not None:
            nn.init.zeros_(self.query_proj.weight)
        if self.mixing_logits is not None:
            nn.init.zeros_(self.mixing_logits)

    def folded_query(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``w_l * g_l`` in ``dtype``: the key-norm gain folded into the query (``[d]``).
        The product is taken in ``dtype`` (float32), not in the parameters' precision."""
        return self.query.to(dtype) * self.key_norm.weight.to(dtype)

    def attend(self, sources: list[Tensor], scale: float = 1.0, return_weights: bool = False):
        """Reference depth attention of this query over ``sources``, ``n`` tensors ``[..., d]``
        (:func:`attnres.ops.depth_attention`), or its Table-4 ablation when one is configured:
        ``h [..., d]``, and with ``return_weights`` the weights ``[n, ...]``."""
        if self.ablation is None:
            return depth_attention(
                self.query, sources, self.key_norm.weight, eps=self.key_norm.eps, scale=scale,
                return_weights=return_weights,
            )
        ab = self.ablation
        query = self.query
        if self.query_proj is not None:
            last = sources[-1]
            compute = compute_dtype(last.dtype)
            x = F.rms_norm(last.to(compute), (last.shape[-1],), eps=self.key_norm.eps)
            query = self.query.to(compute) + self.query_proj(x.to(self.query_proj.weight.dtype)).to(compute)
        result = depth_attention_variant(
            query, sources, self.key_norm.weight, self.key_norm.eps,
            normalize_keys=ab.key_norm, weighting="sigmoid" if ab.sigmoid_weights else "softmax",
            heads=ab.heads, mixing_logits=self.mixing_logits, return_weights=return_weights,
        )
        if return_weights and ab.heads is not None:
            return result[0], result[1].mean(dim=-1)  # recorded weights: mean over heads
        return result

    def forward(self, sources: list[Tensor], scale: float = 1.0, return_weights: bool = False):
        """:meth:`attend`: a mixer of one's own, ``DepthQuery(d)([v_0, v_1, v_2])`` (a model's
        depth pooling), ended in nn.Module's "missing the required forward function". The
        residual modules call :meth:`attend` and their own operations, not this: a hook on one
        of their ``mixers`` does not run."""
        return self.attend(sources, scale, return_weights)
