"""Hugging Face models around the native decoder: ``AttnResModel`` and ``AttnResForCausalLM``.

Both are :class:`attnres.models.DecoderTrunk` modules, like :class:`attnres.AttnResLM`: the
same modules, the same decoder pass and the same loss, so the parameter names and the
function are the native ones: ``embed_tokens``, ``layers.{i}.{attn_norm,attn,mlp_norm,mlp}``, ``residual``, ``norm``
and (causal LM) ``lm_head``. ``AttnResForCausalLM.from_native(model)`` and ``.to_native()``
convert losslessly.

HF caches: ``past_key_values`` is any ``transformers.Cache`` (a ``DynamicCache`` by
default); :class:`HFCacheAdapter` presents it to the attention layers as the native
per-layer key/value store (``[B, n_kv_heads, T, head_dim]`` per layer). A compileable cache
(``StaticCache``: ``generate(..., cache_implementation="static")``, the default on CUDA)
goes through :class:`HFStaticCacheAdapter` instead: its fill level stays on the device, so
the decode step has static shapes and no host sync, and transformers compiles it with CUDA
graphs. The residual needs no cache (it mixes over depth token by token).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils.generic import can_return_tuple

from ..models import AttnResLM, DecoderTrunk, ModelConfig, next_token_loss
from ..models.trunk import check_device, check_label_values, check_labels_type, one_prompt_hint
from ..nn.compiled import uncompiled
from ..nn.norm import RMSNorm
from ..nn.rope import RotaryEmbedding
from ..nn.transformer import Attention
from ..validation import did_you_mean
from .families import offload, onload
from .families.modeling import InitsResidualFromFresh
from .families.remote_code import KeepsItsSourceHome
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


class HFCacheReader(HFCacheAdapter):
    """A given ``transformers.Cache`` read but not written: each layer attends over the keys
    and values it holds and the new ones, and the cache is left as it was. For activation
    checkpointing, whose backward runs each attention sublayer again: written, the cache
    appended the recomputed keys a second time. (PEFT's prefix tuning hands its virtual
    tokens over as such a cache in every training forward.)"""

    @staticmethod
    def needs_gradients(cache: Cache) -> bool:
        """Whether any key or value the cache holds needs gradients (prefix tuning's)."""
        return any(getattr(held, "keys", None) is not None and held.keys.requires_grad
                   for held in getattr(cache, "layers", ()))

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        layers = getattr(self.cache, "layers", ())
        held = layers[layer] if layer < len(layers) else None
        if getattr(held, "keys", None) is None or held.keys.numel() == 0:  # (a layer the cache has not filled)
            return k, v
        return torch.cat([held.keys, k], dim=-2), torch.cat([held.values, v], dim=-2)


class HFStaticCacheAdapter(HFCacheAdapter):
    """A compileable ``transformers.Cache`` (``StaticCache``: buffers of ``C`` positions, the
    fill level a device tensor) seen as the native static store: like
    ``attnres.inference.StaticKVCache`` it gives the trunk the RoPE tables and the mask of the
    next ``T`` tokens over all ``C`` slots (``attention_inputs``), reading nothing back to
    the host.

    ``attention_mask``: what ``generate`` passes for such a cache, ``[B, 1, T, C]`` (boolean,
    True = may attend, or additive float: 0 = may attend), or ``[B, past + T]`` of 0/1 (left
    padding), or ``None``. A padded query (a row with no key allowed) attends to itself, so
    that no softmax row is empty; RoPE positions count the real keys a query sees (its own
    included), as with the native mask.
    """

    def __init__(self, cache: Cache, attention_mask: Tensor | None) -> None:
        self.cache = cache
        self.seq_len = cache.get_seq_length()  # a device tensor once the cache holds keys (0 before)
        self.mask = attention_mask

    def attention_inputs(self, rope: RotaryEmbedding, t: int) -> tuple[Tensor, Tensor, Tensor]:
        capacity = self.cache.get_mask_sizes(t, 0)[0]
        slots = torch.arange(capacity, device=rope.cos.device)
        query = self.seq_len + slots[:t]
        allowed = slots <= query[:, None]  # [T, C]: causal
        mask = self.mask
        if mask is not None and mask.dim() == 4:
            allowed = (mask if mask.dtype == torch.bool else mask == 0)[:, 0]
        elif mask is not None:
            real = F.pad(mask.bool(), (0, capacity - mask.shape[1]))
            allowed = allowed & real[:, None, :]
        allowed = allowed | (slots == query[:, None])
        positions = allowed.sum(-1) - 1  # [B, T] (or [T] without a mask)
        cos, sin = rope.at(positions if positions.dim() == 2 else positions[None])
        return cos, sin, (allowed if allowed.dim() == 3 else allowed[None]).unsqueeze(1)


class AttnResPreTrainedModel(KeepsItsSourceHome, InitsResidualFromFresh, PreTrainedModel, DecoderTrunk):
    """Common base: config class, the decoder trunk, init that gives every parameter the
    checkpoint lacks its faithful value (zero pseudo-queries, unit gains), attention
    implementations ("sdpa", "eager") and activation checkpointing."""

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
        self.native_config = config.to_model_config()
        self.build_trunk(self.native_config)
        self.gradient_checkpointing = False
        self._reentrant_checkpoint = False

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        """As transformers' (which sets ``config.vocab_size``), keeping the native config the
        decoder checks token ids against in step: the new ids are accepted at once."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        self.native_config = self.model_config = self.config.to_model_config()
        return embeddings

    def _init_weights(self, module: nn.Module) -> None:
        """The native init (``AttnResLM.init_weights``): Normal(0, init_std) for projections
        and embeddings, ones for norm gains, and the residual's own init - zero
        pseudo-queries - last (modules are visited children first, so nothing overwrites
        it). Tensors loaded from a checkpoint are left alone by HF's init guard.

        The residual's tensors are initialised module by module (transformers skips modules
        without parameters of their own, the residual itself among them): each one the
        checkpoint lacks gets the value of a freshly built residual - zero pseudo-queries,
        unit key-norm gains, each baseline's own init - whatever the module type; copying
        cannot overwrite a loaded tensor, as the variants' in-place resets could."""
        name = next((n for n, m in self.residual.named_modules() if m is module), None)
        if name is not None:
            self._init_residual_tensors(module, name)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, RotaryEmbedding):
            module.reset_tables()

    def _new_residual(self) -> nn.Module:
        return self.native_config.build_residual()

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    every_n_layers: int = 1) -> None:
        """As transformers' (``activation_checkpointing_enable`` calls it), and with a
        reentrant checkpoint (``use_reentrant=True``, or torch's default where the call does
        not say) each sublayer computes its own pre-norm: a reentrant checkpoint runs the
        sublayer without autograd, and the residual's fused norm (``defer_norm``) needs it."""
        kw = {} if gradient_checkpointing_func is None else {"gradient_checkpointing_func": gradient_checkpointing_func}
        super()._set_gradient_checkpointing(enable=enable, every_n_layers=every_n_layers, **kw)
        keywords = getattr(gradient_checkpointing_func, "keywords", None) or {}
        self._reentrant_checkpoint = enable and keywords.get("use_reentrant", True) is not False
        if self._reentrant_checkpoint:
            self.defer_norm = False
        else:
            self.__dict__.pop("defer_norm", None)  # the class's: fused

    def _set_attention(self) -> None:
        """Point every attention layer at ``config._attn_implementation``."""
        impl = self.config._attn_implementation or "sdpa"
        if impl not in Attention.IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation must be one of {Attention.IMPLEMENTATIONS}; got {impl!r}"
                             f"{did_you_mean(impl, Attention.IMPLEMENTATIONS)}")
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
        """The decoder pass shared by both heads: final-norm input ``h [B, T, d]`` and the cache.
        ``inputs_embeds [B, T, d]`` in place of ``input_ids``: taken as ``embed_tokens(input_ids)``."""
        use_cache = self.config.use_cache if use_cache is None else use_cache
        # Without gradients (generate, an evaluation in training mode) there is no backward to
        # recompute a sublayer: it runs as is, cache included, as transformers' layers do.
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        if checkpointing and use_cache:
            use_cache = False  # recomputing a sublayer would append its keys/values twice
        # A cache given is read whatever use_cache says, as transformers' models read it: the Trainer sets
        # config.use_cache = False, and PEFT's prefix tuning hands its virtual tokens over as a cache.
        given = past_key_values is not None
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if given and checkpointing and past_key_values.is_compileable:  # (its buffers hold C slots, most of them empty)
            raise ValueError(f"past_key_values: a {type(past_key_values).__name__} cannot be read under activation "
                             "checkpointing in training; pass a DynamicCache, or turn checkpointing off "
                             "(model.activation_checkpointing_disable())")
        if given and checkpointing and self._reentrant_checkpoint and HFCacheReader.needs_gradients(past_key_values):
            # (each sublayer's recompute ran its own backward through the graph that made the cache: "Trying to
            # backward through the graph a second time")
            raise ValueError("the cache passed in holds tensors that need gradients (PEFT's prefix tuning), which a "
                             "reentrant activation checkpoint cannot pass through; checkpoint without it: "
                             "gradient_checkpointing_kwargs={'use_reentrant': False} (TrainingArguments, or "
                             "model.activation_checkpointing_enable)")
        if (use_cache or given) and past_key_values.is_compileable:
            return self._hidden_static(input_ids, attention_mask, past_key_values, inputs_embeds), past_key_values
        self._refuse_meta_inputs(input_ids=input_ids, attention_mask=attention_mask)
        input_ids, b, t = self.check_inputs(input_ids, inputs_embeds)
        store = (HFCacheReader(past_key_values) if given and checkpointing
                 else HFCacheAdapter(past_key_values) if use_cache or given else None)
        past = 0 if store is None else store.seq_len
        if past + t > self.native_config.max_seq_len:
            raise ValueError(f"cached length {past} + {t} new tokens exceeds max_seq_len={self.native_config.max_seq_len}")
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError(f"attention_mask must be 2-D [batch, past + seq_len], got {attention_mask.dim()}-D")
            # A mask of exactly ones of the batch's shape is no padding: dropped. Any other goes to the decoder,
            # which names a wrong shape and checks the values once (trunk.check_mask_values): a mask of ones of
            # another shape, or holding 2s, was dropped as 'no padding' without a word.
            if attention_mask.shape == (b, past + t) and bool((attention_mask == 1).all()):
                attention_mask = None
        self._set_attention()
        onloaded = onload(self.residual)  # (device_map offloading: the residual runs no forward of its own)
        h, _ = self.decode(input_ids, attention_mask, store, inputs_embeds=inputs_embeds,
                           **({"sublayer_call": self._gradient_checkpointing_func} if checkpointing else {}))
        offload(onloaded)
        return h, past_key_values if use_cache or given else None

    def _refuse_meta_inputs(self, **tensors: Tensor | None) -> None:
        """Refuse an input on the meta device (no values) next to weights that have values,
        naming it: ids there gave logits of nothing without a word, a mask "Tensor.item() cannot
        be called on meta tensors", labels "Cannot copy out of meta tensor". Inputs on another
        real device are left to accelerate's hooks, which move them (``device_map``)."""
        weight = self.embed_tokens.weight
        for name, tensor in tensors.items():
            if isinstance(tensor, Tensor) and tensor.device.type == "meta" and weight.device.type != "meta":
                check_device(tensor, name, weight.device)

    def _hidden_static(self, input_ids: Tensor | None, attention_mask: Tensor | None, cache: Cache,
                       inputs_embeds: Tensor | None = None) -> Tensor:
        """The decoder pass over a compileable cache (``StaticCache``) with no host sync:
        under ``torch.compile`` (transformers compiles the decode step of such a cache) the
        token ids are not checked - the compiled steps only see sampled tokens, the prompt
        goes through an eager prefill that checks it."""
        if not torch.compiler.is_compiling():
            self.check_inputs(input_ids, inputs_embeds)
        t = (input_ids if inputs_embeds is None else inputs_embeds).shape[1]
        capacity, offset = cache.get_mask_sizes(t, 0)
        if offset != 0 or capacity > self.native_config.max_seq_len:
            limit = self.native_config.max_seq_len
            raise ValueError(f"a static cache must hold at most max_seq_len={limit} positions from position 0; this one "
                             f"holds {capacity} from {offset}: make it with max_cache_len={limit} or less (generate's "
                             "own holds the prompt and max_new_tokens)")
        if attention_mask is not None and attention_mask.dim() not in (2, 4):
            raise ValueError(f"attention_mask must be [batch, past + seq_len] or [batch, 1, seq_len, {capacity}], "
                             f"got {attention_mask.dim()}-D")
        self._set_attention()
        onloaded = onload(self.residual)
        h, _ = self.decode(input_ids, None, HFStaticCacheAdapter(cache, attention_mask), inputs_embeds=inputs_embeds)
        offload(onloaded)
        return h


def _refuse_unreturned_outputs(config: AttnResConfig, kwargs: dict) -> None:
    """Refuse ``output_hidden_states`` / ``output_attentions`` (in the call or the config),
    which transformers models honour and these would silently drop: the native decoder keeps
    no per-layer record (the residual is a depth mixture, not one stream per layer, and the
    attention runs fused); and ``return_depth_weights``, the native model's keyword, which the
    ``**kwargs`` took and dropped: an output without the weights, and not a word."""
    if kwargs.get("return_depth_weights"):
        raise ValueError("return_depth_weights=True is a keyword of attnres's own model (AttnResLM), not of its "
                         "transformers wrapper: the depth-attention weights come from "
                         "model.to_native()(input_ids, return_depth_weights=True).depth_weights")
    for name in ("output_hidden_states", "output_attentions"):
        if kwargs.get(name, getattr(config, name, False)):
            raise ValueError(
                f"{name}=True: the native AttnRes decoder records no per-layer hidden states or attention weights "
                "(its residual mixes over depth, and its attention runs fused); drop it (and from model.config / the "
                "generation config). The final hidden state is AttnResModel's last_hidden_state; the depth-attention "
                "weights come from model.to_native()(input_ids, return_depth_weights=True).depth_weights")


def _peft_cache_name() -> str:
    """The name under which the PEFT that wraps this model looks for the cache among a
    ``generate`` step's inputs: peft 0.22+ asks ``peft.import_utils.get_transformers_cache_name``
    (transformers' own name), peft 0.21 and earlier look under ``past_key_values``. (Read from
    the loaded module: a model under prompt learning has PEFT imported already.)"""
    name_of = getattr(sys.modules.get("peft.import_utils"), "get_transformers_cache_name", None)
    return name_of() if name_of is not None else "past_key_values"


def _given_cache(past_key_values: Cache | None, cache: Cache | None) -> Cache | None:
    """The cache a caller passed: transformers 5.24 renamed ``past_key_values`` to ``cache``
    (``generate`` passes the new name), earlier 5.x versions use the old one."""
    if cache is not None and past_key_values is not None:
        raise ValueError("pass the cache as `cache` or as `past_key_values`, not both")
    name, given = ("past_key_values", past_key_values) if past_key_values is not None else ("cache", cache)
    if given is not None and not isinstance(given, Cache):  # (a legacy tuple of tensors: "no attribute 'is_compileable'")
        raise ValueError(f"{name} must be a transformers Cache (DynamicCache, StaticCache, or the one a forward "
                         f"returned), got {type(given).__name__}")
    return given


def _check_logits_to_keep(logits_to_keep) -> None:
    """Refuse what would keep other positions than meant: a negative count kept all but the
    first ones without a word (``slice(1, None)`` for -1), a 2-D tensor of indices gave 4-D
    logits, a float or a string failed in indexing. Reads no tensor's values."""
    if isinstance(logits_to_keep, Tensor):
        if logits_to_keep.dim() == 1 and not logits_to_keep.is_floating_point() and logits_to_keep.dtype != torch.bool:
            return
    elif isinstance(logits_to_keep, int) and not isinstance(logits_to_keep, bool) and logits_to_keep >= 0:
        return
    got = (f"a {logits_to_keep.dim()}-D {logits_to_keep.dtype} tensor" if isinstance(logits_to_keep, Tensor)
           else repr(logits_to_keep))
    raise ValueError(f"logits_to_keep must be an integer >= 0 (the last positions; 0: all) or a 1-D tensor of position "
                     f"indices; got {got}")


#: The name of the cache field of each output class (``cache`` from transformers 5.24 on,
#: ``past_key_values`` before); looked up once, since Dynamo cannot trace ``dataclasses.fields``.
_CACHE_FIELDS = {cls: "cache" if "cache" in {f.name for f in dataclasses.fields(cls)} else "past_key_values"
                 for cls in (BaseModelOutputWithPast, CausalLMOutputWithPast)}


def _cache_field(output_cls: type, cache: Cache | None) -> dict[str, Cache | None]:
    """``{name: cache}`` under the name ``output_cls`` has for it."""
    return {_CACHE_FIELDS[output_cls]: cache}


class AttnResModel(AttnResPreTrainedModel):
    """The decoder without LM head; ``last_hidden_state`` is after the final norm."""

    def __init__(self, config: AttnResConfig) -> None:
        super().__init__(config)
        self.post_init()

    @can_return_tuple  # return_dict=False (the call's or the config's): a tuple, as transformers' models give
    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        _refuse_unreturned_outputs(self.config, kwargs)
        h, cache = self._hidden(input_ids, attention_mask, _given_cache(past_key_values, cache), use_cache, inputs_embeds)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h), **_cache_field(BaseModelOutputWithPast, cache))


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

    def generate(self, *args, **kwargs):
        """transformers' ``generate``. On CUDA, unless the call names a cache, a
        ``cache_implementation`` or ``use_cache=False``, it decodes over a static cache
        (``cache_implementation="static"``), whose decode step transformers compiles with
        ``torch.compile(mode="reduce-overhead")`` (CUDA graphs); elsewhere the default
        dynamic cache. Pass ``cache_implementation="dynamic"`` to keep the dynamic one. Under
        PEFT's prompt learning (prompt or prefix tuning) the dynamic cache stays: its virtual
        tokens do not fit a static cache sized for the prompt, and peft 0.21's inputs for one
        failed ("KeyError: 'cache_position'")."""
        config = kwargs.get("generation_config") or self.generation_config
        prompt = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        if isinstance(prompt, Mapping):  # (a tokenizer's output, apply_chat_template's in transformers 5: "AttributeError")
            raise ValueError(f"generate: input_ids must be a [batch, seq_len] tensor, got the {type(prompt).__name__} of "
                             f"{', '.join(map(str, prompt))} a tokenizer returns: unpack it, generate(**inputs, ...)")
        if one_prompt_hint(prompt):  # (transformers failed in "IndexError: tuple index out of range")
            got = f"shape {tuple(prompt.shape)}" if isinstance(prompt, Tensor) else f"a {type(prompt).__name__}"
            raise ValueError(f"generate: input_ids must be a [batch, seq_len] tensor, got {got}{one_prompt_hint(prompt)}")
        self._check_generation_length(kwargs.get("inputs_embeds") if prompt is None else prompt, kwargs, config)
        self._check_generation_mode(kwargs, config)
        named = any(kwargs.get(k) is not None for k in ("cache", "past_key_values", "cache_implementation"))
        if (self.device.type == "cuda" and not named and config.cache_implementation is None
                and kwargs.get("use_cache", config.use_cache) is not False and not self._prompt_learning()):
            kwargs["cache_implementation"] = "static"
        return super().generate(*args, **kwargs)

    def _check_generation_mode(self, kwargs: dict, config) -> None:
        """Refuse, naming the option, the generation modes that gave other tokens than greedy
        decoding without a word, or failed deep inside transformers or PEFT: early-exit drafting
        (``assistant_early_exit``), and under PEFT's prompt learning a static cache and
        assisted decoding (``assistant_model``, ``prompt_lookup_num_tokens``), which feed the
        model inputs that PEFT does not put its virtual tokens in front of."""
        def given(name):
            return kwargs[name] if kwargs.get(name) is not None else getattr(config, name, None)

        if given("assistant_early_exit") is not None:  # (it failed in "object has no attribute ''")
            raise ValueError(f"assistant_early_exit={given('assistant_early_exit')}: transformers' early-exit drafting "
                             "runs the model's first layers by changing config.num_hidden_layers, which the AttnRes "
                             "decoder does not read (its residual mixes over every layer); draft with a smaller model "
                             "instead: assistant_model=...")
        if not self._prompt_learning():
            return
        if kwargs.get("inputs_embeds") is not None:  # (transformers: "AttnResForCausalLM doesn't have its forwarding
            # implemented": it reads the signature of the prepare_inputs_for_generation PEFT puts on the model)
            raise ValueError("inputs_embeds under PEFT's prompt learning (prompt, prefix or p-tuning): PEFT's "
                             "prepare_inputs_for_generation, which it puts on the model for the call, takes no "
                             "embeddings; pass input_ids (this model takes inputs_embeds without PEFT, or with LoRA)")
        cache = given("cache_implementation")
        drafting = [f"{name}=..." for name in ("assistant_model", "prompt_lookup_num_tokens") if given(name) is not None]
        if cache not in (None, "dynamic", "offloaded", "quantized"):
            drafting.insert(0, f"cache_implementation={cache!r}")  # (PEFT: "KeyError: 'cache_position'")
        if drafting:
            raise ValueError(f"{', '.join(drafting)} under PEFT's prompt learning (prompt, prefix or p-tuning): PEFT puts "
                             "its virtual tokens in front of the inputs only as the dynamic cache's first step prepares "
                             "them, so a static cache failed and assisted decoding generated other tokens than greedy "
                             "decoding; drop it (LoRA adapters take it)")

    def _prompt_learning(self) -> bool:
        """Whether PEFT's prompt learning prepares this generation's inputs: a ``PeftModel``
        puts its own ``prepare_inputs_for_generation`` on this model for the call, and its
        active config says ``is_prompt_learning`` (LoRA's does not: its inputs are ours)."""
        wrapper = getattr(self.__dict__.get("prepare_inputs_for_generation"), "__self__", None)
        return bool(getattr(getattr(wrapper, "active_peft_config", None), "is_prompt_learning", False))

    def prepare_inputs_for_generation(self, input_ids: Tensor, inputs_embeds: Tensor | None = None, **kwargs) -> dict:
        """transformers' inputs of one ``generate`` step. Under PEFT's prompt or prefix
        tuning, the cache goes under the name that PEFT looks for to tell the first step, where
        it adds its virtual tokens, from the later ones (the forward takes both names): peft
        0.21 looks under ``past_key_values`` only, and under transformers' ``cache`` (5.24+)
        it added them again at every step; peft 0.22 looks under transformers' own name.
        (``inputs_embeds`` is named: ``generate`` takes it only from a method that names it.)"""
        inputs = super().prepare_inputs_for_generation(input_ids, inputs_embeds=inputs_embeds, **kwargs)
        if (inputs.get("cache") is not None and inputs.get("past_key_values") is None
                and self._prompt_learning() and _peft_cache_name() == "past_key_values"):
            inputs["past_key_values"] = inputs.pop("cache")
        return inputs

    def _check_generation_length(self, prompt, kwargs: dict, config) -> None:
        """Refuse, before any compute, a generation that does not fit the context: the prompt
        (``input_ids [B, T]``, or ``inputs_embeds [B, T, d]``) and every new token but the
        last are fed to the model (a dynamic cache refused the token past ``max_seq_len`` at
        the end of the work; a static cache of that size was refused at the prefill, and
        transformers kept its size for every later call)."""
        embeds = isinstance(prompt, Tensor) and prompt.is_floating_point()
        if not isinstance(prompt, Tensor) or prompt.dim() != (3 if embeds else 2):
            return  # (the forward names what is wrong with the prompt)
        t, limit = prompt.shape[1], self.native_config.max_seq_len
        new = kwargs.get("max_new_tokens", config.max_new_tokens)
        max_length = t + new if new is not None else kwargs.get("max_length", config.max_length)
        if max_length is None or max_length - 1 <= limit:
            return
        given, fix = ((f"max_new_tokens={new}", f"max_new_tokens={limit - t + 1} or less") if new is not None
                      else (f"max_length={max_length}", f"max_length={limit + 1} or less"))
        if limit - t + 1 < 1:  # the prompt alone is too long
            fix = (f"a prompt of at most {limit} tokens and max_length={limit + 1} or less" if new is None
                   else f"a prompt of at most {limit + 1 - new} token{'s' * (new != limit)}" if new <= limit
                   else f"a prompt and max_new_tokens that add up to at most {limit + 1}")
        raise ValueError(f"generate: the prompt ({t} token{'s' * (t != 1)}) with {given} needs a context of {max_length - 1} tokens "
                         f"(the last new token is not fed back), beyond the model's max_seq_len={limit}: use {fix}")

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @can_return_tuple  # return_dict=False: (loss, logits, cache), the None ones left out, as transformers' models give
    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        labels: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        logits_to_keep: int | Tensor = 0,
        cache: Cache | None = None,
        num_items_in_batch: int | Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``input_ids [B, T]`` -> logits ``[B, T, vocab]`` (the last ``logits_to_keep``
        positions when > 0, the positions a 1-D tensor of indices names, as in transformers'
        models) and, with ``labels``, the mean next-token cross-entropy
        (labels shifted inside, ``-100`` ignored), as ``AttnResLM`` computes it. Labels that
        are all ``-100`` past the first position (a fully masked batch, or one token per row)
        give a NaN loss with finite, zero gradients, as transformers' causal LMs give (a mean
        over no tokens); with ``num_items_in_batch`` above 0, a loss of 0.

        ``num_items_in_batch``: the predicted tokens of every batch a gradient-accumulation
        step holds, which ``transformers.Trainer`` passes to a forward taking ``**kwargs``;
        the loss is then this batch's summed cross-entropy over it (the Trainer, counting on
        that, does not divide by the accumulation steps)."""
        _refuse_unreturned_outputs(self.config, kwargs)
        _check_logits_to_keep(logits_to_keep)
        if isinstance(num_items_in_batch, (int, float)) and not num_items_in_batch >= 0:  # (a negative one flipped the loss)
            raise ValueError(f"num_items_in_batch must be the number (>= 0) of predicted tokens in the accumulated "
                             f"batches; got {num_items_in_batch!r}")
        if labels is not None:  # (before the forward's work)
            self._refuse_meta_inputs(labels=labels)
            check_labels_type(labels)  # (float labels were cast to ids without a word)
            check_label_values(labels, self.config.vocab_size)
        h, cache = self._hidden(input_ids, attention_mask, _given_cache(past_key_values, cache), use_cache, inputs_embeds)
        h = h[:, slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep]  # 0: all
        logits = self.lm_head(self.norm(h))
        loss = None
        if labels is not None and tuple(labels.shape) != tuple(logits.shape[:2]):
            # (cross-entropy's own error compares flattened sizes, or a 1-D labels fails on its shift)
            kept = "" if isinstance(logits_to_keep, int) and logits_to_keep == 0 else " the positions logits_to_keep keeps of"
            raise ValueError(f"labels of shape {list(labels.shape)}: they must be [batch, seq_len] as{kept} the input ids are, "
                             f"here {list(logits.shape[:2])} (not shifted: the model shifts them to the next token)")
        if labels is not None and num_items_in_batch is None:
            loss = next_token_loss(logits, labels.to(logits.device))
        elif labels is not None:
            total = next_token_loss(logits, labels.to(logits.device), reduction="sum")
            loss = total / (num_items_in_batch.to(total.device) if isinstance(num_items_in_batch, Tensor) else num_items_in_batch)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **_cache_field(CausalLMOutputWithPast, cache))

    # -- conversion ----------------------------------------------------------------------
    @classmethod
    def from_native(cls, model: AttnResLM, **config_kwargs) -> AttnResForCausalLM:
        """An HF copy of a native model (same weights, same device and dtype).
        ``config_kwargs`` set HF fields such as ``eos_token_id``; a ``torch.compile``'d model
        is copied as its original module."""
        model = uncompiled(model)
        if not isinstance(model, AttnResLM):  # (its ModelConfig there failed in "'ModelConfig' object has no attribute 'config'")
            raise TypeError(f"from_native takes an AttnResLM, got {type(model).__name__}"
                            + (": build the model from it, AttnResForCausalLM(AttnResConfig.from_model_config(config))"
                               if isinstance(model, ModelConfig) else ""))
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
