"""Training compute of one model: FLOPs per token, and PFLOP/s-days.

Counting convention (a multiply-add is 2 FLOPs; training = forward + backward = 3 x forward):

* **matmuls**: ``2 * P_mm`` per token forward, with ``P_mm`` the weights of every
  ``nn.Linear`` in the transformer blocks and the LM head (the embedding lookup is free; a
  tied head still costs its matmul). This is the usual ``6 N`` of training.
* **attention**: the causal score and value products, ``2 * 2 * d * ctx`` per layer forward,
  with the mean causal context ``ctx = (T + 1) / 2`` for sequences of ``T`` tokens.
* **residual**: the residual mechanism's own work per token forward, as the variant counts
  it (``ResidualStream.residual_flops_per_token``): standard adds ``d`` per sublayer;
  AttnRes over ``n`` sources costs ``2 n d`` for the logits, ``2 n d`` for the weighted sum,
  ``3 d`` per source for its key RMSNorm (computed once per source), ``2 d^2`` for an
  input-dependent query projection; Block AttnRes adds ``d`` per sublayer for the partial
  sum; DenseFormer ``2 n d`` per weighted average; the multi-stream baselines
  (Hyper-Connections, mHC) ``2 m d`` to read, ``2 m^2 d`` to mix and ``2 m d`` to write their
  ``m`` streams plus their mapping projections. Softmaxes, Sinkhorn iterations and norms
  over scalars are ignored (O(L^2) per token, not O(d)). A registered variant that does not
  count its FLOPs raises ``NotImplementedError`` here rather than being counted as another.

RMSNorms of the transformer, RoPE, activations and the loss are ignored, as is usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.config import ModelConfig

#: FLOPs in one PFLOP/s-day (the unit of the report's scaling laws, Table 2).
PFLOPS_DAY = 1e15 * 24 * 3600


@dataclass(frozen=True)
class FlopCount:
    """Training FLOPs per token (forward + backward), split by origin. ``total`` is their sum."""

    matmul: float
    attention: float
    residual: float

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.residual


def matmul_parameters(config: ModelConfig) -> int:
    """Weights of the transformer's projections and the LM head (embedding excluded)."""
    d, kv = config.d_model, config.kv_heads * config.head_dim
    attn = d * d + 2 * d * kv + d * d  # q, k, v, o
    mlp = 3 * d * config.hidden_size  # gate, up, down
    return config.n_layers * (attn + mlp) + d * config.vocab_size


def non_embedding_parameters(config: ModelConfig) -> int:
    """Weights of the transformer blocks' projections: the model size of a scaling law
    (Kaplan et al.'s N; the report's Table 2 counts activated parameters without embeddings).
    Norm gains and the residual mechanism's few parameters are left out, like the LM head."""
    return matmul_parameters(config) - config.d_model * config.vocab_size


def residual_flops_forward(config: ModelConfig) -> float:
    """Forward FLOPs per token of the residual mechanism alone (see the module docstring)."""
    with torch.device("meta"):  # the module describes itself; meta tensors cost nothing
        return config.build_residual().residual_flops_per_token()


def training_flops_per_token(config: ModelConfig, seq_len: int) -> FlopCount:
    """Training FLOPs per token of ``config`` on sequences of ``seq_len`` tokens."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an integer >= 1; got {seq_len!r}")
    attention = config.n_layers * 4 * config.d_model * (seq_len + 1) / 2
    return FlopCount(
        matmul=3 * 2 * matmul_parameters(config),
        attention=3 * attention,
        residual=3 * residual_flops_forward(config),
    )


def to_pflops_days(flops: float) -> float:
    """FLOPs -> PFLOP/s-days."""
    return flops / PFLOPS_DAY
