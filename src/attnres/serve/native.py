"""``AttnResForCausalLM`` (an ``attnres export`` directory) as a vLLM model.

The native decoder is a Llama-style PreNorm transformer (grouped-query attention with RoPE,
SwiGLU MLP, RMSNorm: this package's choice; the report's model is a Kimi Linear MoE, report
§5), so its sublayers are vLLM's own Llama modules -
``LlamaAttention`` (``QKVParallelLinear``, the rotary embedding, vLLM's ``Attention`` over
the paged KV cache, ``RowParallelLinear``) and ``LlamaMLP`` (``MergedColumnParallelLinear``,
``SiluAndMul``) - with vLLM's ``RMSNorm`` as pre-norms, ``VocabParallelEmbedding`` and
``ParallelLMHead``, under the native parameter names (``layers.{i}.attn_norm``,
``layers.{i}.attn``, ``layers.{i}.mlp_norm``, ``layers.{i}.mlp``, ``residual``, ``norm``).
The residual is the config's (standard, Full or Block AttnRes), run through its protocol by
:func:`attnres.serve.decoder.run_decoder`.

Weights: the export's names are the native ones, without a ``model.`` prefix; the mapper
adds it and stacks ``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into
``gate_up_proj``, as vLLM's Llama does. RoPE: the native tables are computed in float64 and
rounded once; vLLM's cache (float32 arithmetic) is replaced by those values, so positions
are encoded exactly as in ``attnres generate``.

LoRA: vLLM wraps the same projection layers (``SupportsLoRA``; ``packed_modules_mapping``
names the stacked ones), and PEFT's adapters of the export's transformers model name them as
the checkpoint does (``layers.{i}.attn.q_proj``); no adapters on the embedding or the head.

Pipeline parallelism: each rank builds its range of the decoder layers (vLLM's
``make_layers``; the others are ``PPMissingLayer``), the embedding on the first rank (and on
the last where the head is tied to it), the final norm and the head on the last; every rank
holds the residual's parameters (a query and a gain per sublayer). The stream crosses the
stages as :func:`attnres.serve.decoder.run_decoder` describes.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.llama import LlamaAttention, LlamaMLP
from vllm.model_executor.models.interfaces import SupportsLoRA, SupportsPP
from vllm.model_executor.models.utils import AutoWeightsLoader, PPMissingLayer, WeightsMapper, make_layers, maybe_prefix
from vllm.sequence import IntermediateTensors

from ..hf.configuration import AttnResConfig
from ..models import AttnResLM, ModelConfig
from ..nn.rope import RotaryEmbedding
from ..hf.families.layout import Layout
from .checkpoint import checked_weights, expected_shapes
from .decoder import (DYNAMIC_ARG_DIMS, SublayerNames, check_config_class, check_servable, empty_stream,
                      last_stage_head, run_decoder, serving_residual, stage_embedding)
from .families import NATIVE_ARCHITECTURE

__all__ = ["AttnResForCausalLM", "AttnResModel", "NativeDecoderLayer"]

NAMES = SublayerNames(attention="attn", mlp="mlp", layout=Layout("attn_norm", "mlp_norm"))
#: What an export refuses, with the reason (decoder.check_servable).
REFUSED = {
    "eagle3": "an attnres export (AttnResForCausalLM) does not hand EAGLE-3 drafters its hidden states; the upcycled "
              "Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, GPT-OSS, DeepSeek-V2 and DeepSeek-V3 do",
}


def _exact_rope(rotary: nn.Module, config: ModelConfig) -> None:
    """Overwrite vLLM's rotary cache ``[max_pos, head_dim]`` (cos | sin of the first half,
    rotate-half layout) with the native float64-computed tables, rounded once."""
    cos, sin = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta)._tables(torch.float64)
    half = config.head_dim // 2
    cache = rotary.cos_sin_cache
    with torch.no_grad():
        cache.copy_(torch.cat([cos[:, :half], sin[:, :half]], dim=-1).to(device=cache.device, dtype=cache.dtype))


class NativeDecoderLayer(nn.Module):
    """One native transformer block from vLLM's modules: ``attn_norm``, ``attn``,
    ``mlp_norm``, ``mlp`` (the residual is the model's, not the layer's)."""

    def __init__(self, config: ModelConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        rope = {"rope_type": "default", "rope_theta": config.rope_theta}
        family_view = SimpleNamespace(head_dim=config.head_dim, rope_parameters=rope)  # what LlamaAttention reads
        self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = LlamaAttention(config=family_view, hidden_size=config.d_model, num_heads=config.n_heads,
                                   num_kv_heads=config.kv_heads, max_position_embeddings=config.max_seq_len,
                                   quant_config=vllm_config.quant_config, cache_config=vllm_config.cache_config,
                                   prefix=f"{prefix}.attn")
        _exact_rope(self.attn.rotary_emb, config)
        self.mlp_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = LlamaMLP(hidden_size=config.d_model, intermediate_size=config.hidden_size, hidden_act="silu",
                            quant_config=vllm_config.quant_config, prefix=f"{prefix}.mlp")


@support_torch_compile(dynamic_arg_dims=DYNAMIC_ARG_DIMS)
class AttnResModel(nn.Module):
    """The native decoder body: embedding, blocks, residual, final norm -> ``[num_tokens, d]``
    (on a pipeline stage before the last: the stream, as intermediate tensors)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: ModelConfig = vllm_config.model_config.hf_config.to_model_config()
        pp = get_pp_group()
        if pp.is_first_rank or (config.tie_embeddings and pp.is_last_rank):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.d_model,
                                                       quant_config=vllm_config.quant_config,
                                                       prefix=f"{prefix}.embed_tokens")
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.n_layers, lambda prefix: NativeDecoderLayer(config, vllm_config, prefix), prefix=f"{prefix}.layers")
        self.residual = serving_residual(config.residual, config.d_model, config.n_sublayers)
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps) if pp.is_last_rank else PPMissingLayer()
        self.make_empty_intermediate_tensors = empty_stream(self.residual, self.start_layer, config.d_model)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        embedding = stage_embedding(self, input_ids, inputs_embeds)
        out, _ = run_decoder(self.residual, self.layers, NAMES, positions, embedding,
                             stage=range(self.start_layer, self.end_layer), intermediate=intermediate_tensors)
        return out if isinstance(out, IntermediateTensors) else self.norm(out)


class AttnResForCausalLM(nn.Module, SupportsPP, SupportsLoRA):
    """vLLM model for the ``AttnResForCausalLM`` architecture of ``attnres export``."""

    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
            ".gate_proj": (".gate_up_proj", 0),
            ".up_proj": (".gate_up_proj", 1),
        },
        orig_to_new_prefix={p: "model." + p for p in ("embed_tokens.", "layers.", "residual.", "norm.")},
    )
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        check_config_class(vllm_config, AttnResConfig, NATIVE_ARCHITECTURE)
        self.config = vllm_config.model_config.hf_config
        self.native_config: ModelConfig = self.config.to_model_config()
        self.checkpoint_dir = Path(vllm_config.model_config.model)
        self.model = AttnResModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        native = self.native_config
        self.lm_head = last_stage_head(native.vocab_size, native.d_model, vllm_config.quant_config,
                                       maybe_prefix(prefix, "lm_head"),
                                       tied_to=self.model.embed_tokens if native.tie_embeddings else None)
        self.logits_processor = LogitsProcessor(native.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        check_servable(self, vllm_config, REFUSED)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Check the export's tensors against its config - all of them, the residual's too (a
        checkpoint without them would serve zero queries: refused, as vLLM refuses missing
        weights) - then load them vLLM's way."""
        native = self.native_config
        optional = {"lm_head.weight"} if native.tie_embeddings else set()
        checked = checked_weights(weights, expected_shapes(lambda: AttnResLM(native)), self.checkpoint_dir, optional)
        return AutoWeightsLoader(self).load_weights(checked, mapper=self.hf_to_vllm_mapper)
