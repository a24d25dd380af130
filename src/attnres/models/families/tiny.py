"""Tiny random models of every supported family, for tests and exactness measurements.

Each is a few-thousand-parameter model of the family (3 decoder layers, so L = 6 sublayers;
d = 32; mixtures of experts with 4 to 8 experts, top-2) that still exercises what makes the
family what it is: sliding windows that bite, Gemma's sandwich norms, the dense first layers
of DeepSeek and GLM, Qwen's dense ``mlp_only_layers``, shared experts, GPT-OSS's attention
sinks and biased router, Granite's multipliers.
"""

from __future__ import annotations

import torch

from .layout import FAMILIES

__all__ = ["TINY_COMMON", "TINY_EXTRA", "VOCAB", "tiny_model"]

VOCAB = 97
TINY_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None)
_EXPERTS = dict(moe_intermediate_size=16)
_MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)
#: What each family needs on top of :data:`TINY_COMMON`.
TINY_EXTRA: dict[str, dict] = {
    "mistral": dict(sliding_window=4),
    "qwen2": dict(use_sliding_window=False),
    "gemma": dict(head_dim=8),
    "gemma2": dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=4),
    "gemma3_text": dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=4),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, sliding_window=4),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=24, use_sliding_window=False,
                      mlp_only_layers=[1], **_EXPERTS),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True, **_EXPERTS),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=16),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=4, intermediate_size=16,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150000.0}),
    "deepseek_v2": dict(n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1,
                        q_lora_rank=None, **_MLA, **_EXPERTS),
    "deepseek_v3": dict(n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                        n_shared_experts=1, q_lora_rank=24, **_MLA, **_EXPERTS),
    "glm4_moe": dict(n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                     n_shared_experts=1, use_qk_norm=True, head_dim=8, **_EXPERTS),
    "dots1": dict(n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                  n_shared_experts=1, **_EXPERTS),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1,
                         moe_layer_end_index=2, **_EXPERTS),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, head_dim=8),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, intermediate_size=16),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, residual_multiplier=0.5,
                       embedding_multiplier=2.0, logits_scaling=3.0, attention_multiplier=0.3),
}


def tiny_model(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0, **changes):
    """A tiny random causal LM of family ``model_type`` (eval mode), with norm gains moved
    away from their init so that they matter. ``changes`` override config fields. In float64
    mixtures of experts use the eager experts loop (transformers' default, a grouped matrix
    product, has no float64 kernel)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type not in FAMILIES:
        raise ValueError(f"no tiny model for model_type {model_type!r}; families: {', '.join(sorted(FAMILIES))}")
    config = AutoConfig.for_model(model_type, **{**TINY_COMMON, **TINY_EXTRA.get(model_type, {}), **changes})
    eager = FAMILIES[model_type].router is not None and dtype == torch.float64
    kw = {"experts_implementation": "eager"} if eager else {}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, **kw).to(dtype).eval()
    with torch.no_grad():  # non-trivial norm gains (Gemma's start at 0 = unit gain)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model
