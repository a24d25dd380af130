"""Hugging Face models around the native decoder: ``AttnResModel`` and ``AttnResForCausalLM``.

Both are built from the same modules as :class:`attnres.AttnResLM` and run its decoder pass
(:meth:`attnres.AttnResLM.decode`), so the parameter names and the function are the native
ones: ``embed_tokens``, ``layers.{i}.{attn_norm,attn,mlp_norm,mlp}``, ``residual``, ``norm``
and (causal LM) ``lm_head``. ``AttnResForCausalLM.from_native(model)`` and ``.to_native()``
convert losslessly.

HF caches: ``past_key_values`` is any ``transformers.Cache`` (a ``DynamicCache`` by
default); :class:`HFCacheAdapter` presents it to the attention layers as the native
per-layer key/value store (``[B, n_kv_heads, T, head_dim]`` per layer). The residual needs
no cache (it mixes over depth token by token).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ..models.lm import IGNORE_INDEX, AttnResLM, build_residual
from ..nn.norm import RMSNorm
from ..nn.rope import RotaryEmbedding
from ..nn.transformer import Attention, TransformerBlock
from .configuration import AttnResConfig


class HFCacheAdapter:
    """A ``transformers.Cache`` seen through the native ``KVStore`` interface:
    ``update(layer, k, v)`` appends and returns all keys/values; ``seq_len`` is the number
    of cached positions when the adapter is made (the ``past`` of the forward using it)."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache
        self.seq_len = cache.get_seq_length()

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.cache.update(k, v, layer)


class AttnResPreTrainedModel(PreTrainedModel):
    """Common base: config class, init that keeps the AttnRes pseudo-queries at zero,
    attention implementations ("sdpa", "eager") and activation checkpointing."""

    config_class = AttnResConfig
    config: AttnResConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = True
    _no_split_modules = ["TransformerBlock"]
    _supports_sdpa = True
    _supports_attention_backend = False
    _supports_flash_attn = False

    def __init__(self, config: AttnResConfig) -> None:
        super().__init__(config)
        native = config.to_model_config()
        self.native_config = native
        self.embed_tokens = nn.Embedding(native.vocab_size, native.d_model)
        self.layers = nn.ModuleList(
            TransformerBlock(native.d_model, native.n_heads, native.kv_heads, native.hidden_size, native.norm_eps)
            for _ in range(native.n_layers)
        )
        self.residual = build_residual(native)
        if hasattr(self.residual, "kernels"):
            self.residual.kernels = native.attnres_kernels
        self.norm = RMSNorm(native.d_model, native.norm_eps)
        self.rope = RotaryEmbedding(native.head_dim, native.max_seq_len, native.rope_theta)
        self.gradient_checkpointing = False

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def _init_weights(self, module: nn.Module) -> None:
        """The native init (``AttnResLM.init_weights``): Normal(0, init_std) for projections
        and embeddings, ones for norm gains, and the residual's own reset - zero
        pseudo-queries - last (modules are visited children first, so nothing overwrites
        it). Tensors loaded from a checkpoint are left alone by HF's init guard."""
        if module is self.residual:
            module.reset_parameters()
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, RotaryEmbedding):
            cos, sin = module._tables()
            module.cos.copy_(cos)
            module.sin.copy_(sin)

    def _set_attention(self) -> None:
        """Point every attention layer at ``config._attn_implementation``."""
        impl = self.config._attn_implementation or "sdpa"
        if impl not in Attention.IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation must be one of {Attention.IMPLEMENTATIONS}; got {impl!r}")
        for layer in self.layers:
            layer.attn.implementation = impl

    def _hidden(
        self,
        input_ids: Tensor | None,
        attention_mask: Tensor | None,
        past_key_values: Cache | None,
        use_cache: bool | None,
        inputs_embeds: Tensor | None,
    ) -> tuple[Tensor, Cache | None]:
        """The decoder pass shared by both heads: final-norm input ``h [B, T, d]`` and the cache."""
        if inputs_embeds is not None:
            raise ValueError("AttnRes models take input_ids, not inputs_embeds")
        if input_ids is None:
            raise ValueError("input_ids is required")
        AttnResLM.check_input_ids(self, input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training and use_cache:
            use_cache = False  # recomputing a sublayer would append its keys/values twice
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        store = HFCacheAdapter(past_key_values) if use_cache else None
        past = 0 if store is None else store.seq_len
        if past + input_ids.shape[1] > self.native_config.max_seq_len:
            raise ValueError(
                f"cached length {past} + {input_ids.shape[1]} new tokens exceeds max_seq_len={self.native_config.max_seq_len}"
            )
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(f"attention_mask must be 2-D [batch, past + seq_len], got {attention_mask.dim()}-D")
            if bool(attention_mask.all()):
                attention_mask = None
        self._set_attention()
        sublayer_call = None
        if self.gradient_checkpointing and self.training:
            sublayer_call = self._gradient_checkpointing_func
        h, _ = AttnResLM.decode(self, input_ids, attention_mask, store, sublayer_call=sublayer_call)
        return h, past_key_values if use_cache else None


class AttnResModel(AttnResPreTrainedModel):
    """The decoder without LM head; ``last_hidden_state`` is after the final norm."""

    def __init__(self, config: AttnResConfig) -> None:
        super().__init__(config)
        self.post_init()

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        h, cache = self._hidden(input_ids, attention_mask, past_key_values, use_cache, inputs_embeds)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h), past_key_values=cache)


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    """Causal LM with the native parameter names; works with ``generate`` (with
    ``use_cache``), ``Trainer``, activation checkpointing and lm-evaluation-harness.

    ``attention_mask`` ``[B, past + T]``: 1 = real token, 0 = left padding (as in
    ``AttnResLM``; RoPE positions count real tokens, so ``position_ids`` are not needed and
    are ignored).
    """

    _tied_weights_keys = {"lm_head.weight": "embed_tokens.weight"}

    def __init__(self, config: AttnResConfig) -> None:
        super().__init__(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        labels: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``input_ids [B, T]`` -> logits ``[B, T, vocab]`` (the last ``logits_to_keep``
        positions when > 0) and, with ``labels``, the mean next-token cross-entropy
        (labels shifted inside, ``-100`` ignored), as ``AttnResLM`` computes it."""
        h, cache = self._hidden(input_ids, attention_mask, past_key_values, use_cache, inputs_embeds)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(self.norm(h))
        loss = None
        if labels is not None:
            shifted = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
            loss = F.cross_entropy(shifted, labels[:, 1:].reshape(-1).to(logits.device), ignore_index=IGNORE_INDEX)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)

    # -- conversion ----------------------------------------------------------------------
    @classmethod
    def from_native(cls, model: AttnResLM, **config_kwargs) -> AttnResForCausalLM:
        """An HF copy of a native model (same weights, same device and dtype).
        ``config_kwargs`` set HF fields such as ``eos_token_id``."""
        config = AttnResConfig.from_model_config(model.config, **config_kwargs)
        param = next(model.parameters())
        hf = cls(config).to(device=param.device, dtype=param.dtype)
        hf.load_state_dict(model.state_dict())
        return hf

    def to_native(self) -> AttnResLM:
        """A native :class:`attnres.AttnResLM` with these weights (same device and dtype)."""
        native = AttnResLM(self.config.to_model_config())
        param = next(self.parameters())
        native = native.to(device=param.device, dtype=param.dtype)
        native.load_state_dict(self.state_dict())
        return native
