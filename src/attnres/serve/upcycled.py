"""``AttnRes<Family>ForCausalLM`` (``attnres upcycle`` directories) as vLLM models, around
vLLM's own implementation of each family.

For a family of :data:`attnres.serve.SERVED_FAMILIES`, the model body is a subclass of vLLM's
body of that family (``LlamaModel``, ``Gemma3Model``, ...): its ``__init__`` builds
everything as vLLM does - ``embed_tokens`` (with Gemma's ``sqrt(d)`` scaling in
``embed_input_ids``), the decoder layers with the family's attention (QK norms, sliding
windows, attention soft-capping, its rotary embedding and vLLM's ``Attention`` over the paged
KV cache) and MLP modules, the final norm - and adds the ``residual``; only ``forward`` is
new: the layers' two sublayers (their own pre-norms, modules and Gemma 2/3's output norms)
run on inputs from the residual stream, as :mod:`attnres.upcycle` does with the transformers
modules. With ``attnres_exact_eps`` the pre-norms and the final norm get ``eps / n^2`` for
their ``n`` depth sources (docs/upcycling.md).

The causal LM subclasses vLLM's causal LM of the family for its weight loading (stacked
``qkv_proj`` / ``gate_up_proj``, tied embeddings) and replaces ``__init__`` only to build the
AttnRes body: ``ParallelLMHead`` (tied when the config says so), ``LogitsProcessor`` with the
family's logit scale and final soft-capping (Gemma 2/3). The classes are made on first use,
one per family (``AttnResLlamaForCausalLM``, ...), by the module's ``__getattr__``, which is
what vLLM's lazy ``"module:Class"`` registration imports.
"""

from __future__ import annotations

import copy
import functools
import importlib
import types
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.model_executor.models.utils import maybe_prefix
from vllm.sequence import IntermediateTensors

from ..models.families import layout_of, upcycled_classes
from ..models.families.modeling import adjust_eps
from .checkpoint import CheckpointMismatch, checked_weights, expected_shapes
from .decoder import (DYNAMIC_ARG_DIMS, FlatRotary, SublayerNames, check_config_class, check_servable, run_decoder,
                      serving_residual)
from .families import SERVED_FAMILIES, ServedFamily

__all__ = ["served_classes"]


def _body_name(model_type: str) -> str:
    return "AttnRes" + SERVED_FAMILIES[model_type].body


def _body_class(model_type: str, family: ServedFamily) -> type:
    """vLLM's body of the family with the residual and the AttnRes forward, compiled by vLLM."""
    base = getattr(importlib.import_module(f"vllm.model_executor.models.{family.vllm_module}"), family.body)
    layout = layout_of(model_type)
    names = SublayerNames(family.attention, family.mlp, layout, family.attention_kwargs)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        if family.flat_rotary:
            for layer in self.layers:
                attention = getattr(layer, family.attention)
                attention.rotary_emb = FlatRotary(attention.rotary_emb)
        config = vllm_config.model_config.hf_config
        self.residual = serving_residual(config.residual_config(), config.hidden_size, 2 * config.num_hidden_layers)
        if config.attnres_exact_eps:
            adjust_eps(self.residual, self.layers, self.norm, layout, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        x = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        if family.embedding_scale is not None:
            x = x * getattr(self, family.embedding_scale)
        # EAGLE-3: vLLM sets aux_hidden_state_layers (EagleModelMixin) on the bodies of the
        # families that declare it; the drafter then gets the depth mixtures there.
        out, aux = run_decoder(self.residual, self.layers, names, positions, x,
                               getattr(self, "aux_hidden_state_layers", ()))
        return (self.norm(out), aux) if aux else self.norm(out)

    body = types.new_class(_body_name(model_type), (base,), exec_body=lambda ns: ns.update(
        __init__=__init__, forward=forward, __module__=__name__, __doc__=_body_class.__doc__))
    return support_torch_compile(dynamic_arg_dims=DYNAMIC_ARG_DIMS)(body)


class UpcycledCausalLM(nn.Module):
    """What every served upcycled family adds to vLLM's causal LM of that family (mixin)."""

    body_class: type
    family: str  # the transformers model_type of the family
    vllm_class: type  # vLLM's causal LM of the family (a base class)
    refused: dict[str, str]  # decoder.check_servable: what the family refuses, with the reason

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)  # the family's __init__ would build its own body
        config_class, causal_lm = upcycled_classes(self.family)
        check_config_class(vllm_config, config_class, causal_lm.__name__)
        config = vllm_config.model_config.hf_config
        for field, value in SERVED_FAMILIES[self.family].config_defaults:
            if getattr(config, field, None) is None:
                setattr(config, field, value)
        self.config, self.vllm_config, self.quant_config = config, vllm_config, vllm_config.quant_config
        self.checkpoint_dir = Path(vllm_config.model_config.model)
        self.model = self.body_class(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=self.quant_config,
                                      bias=getattr(config, "lm_head_bias", False),  # PhiMoE's may have one
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        # Granite divides the logits by logits_scaling; others may multiply by logit_scale.
        scale = 1 / config.logits_scaling if getattr(config, "logits_scaling", None) else getattr(config, "logit_scale", 1.0)
        self.logits_processor = LogitsProcessor(config.vocab_size, scale=scale,
                                                soft_cap=getattr(config, "final_logit_softcapping", None))
        if hasattr(self.model, "make_empty_intermediate_tensors"):  # the families that declare pipeline parallelism
            self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        check_servable(self, vllm_config, self.refused)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Check the tensors against the config, then load them the family's way; the
        residual (``residual.*`` in the checkpoint, ``model.residual.*`` here) loads as plain
        tensors, and those the checkpoint lacks keep their faithful init (zero queries), as
        ``from_pretrained`` gives them."""
        config = self.config
        _, hf_class = upcycled_classes(self.family)
        residual = {"residual." + n for n, _ in self.model.residual.named_parameters()}
        optional = residual | ({"lm_head.weight"} if config.tie_word_embeddings else set())
        checked = checked_weights(weights, expected_shapes(lambda: hf_class(copy.deepcopy(config))), self.checkpoint_dir, optional)
        renamed = (("model." + name if name.startswith("residual.") else name, t) for name, t in checked)
        loaded = set(super().load_weights(renamed)) | {"model." + n for n in residual}
        # vLLM's class of the family may hold parameters the family's transformers config
        # does without (PhiMoE's attention biases): left unset, they would be garbage.
        unset = sorted({name for name, _ in self.named_parameters()} - loaded
                       - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
        if unset:
            shown = ", ".join(unset[:4]) + (f" and {len(unset) - 4} more" if len(unset) > 4 else "")
            raise CheckpointMismatch(
                f"{self.checkpoint_dir / 'config.json'}: vLLM's {self.vllm_class.__name__} has parameters the "
                f"checkpoint does not provide ({shown}): the config describes a variant of the family vLLM's class "
                "does not build")
        return loaded


@functools.cache
def served_classes(model_type: str) -> tuple[type, type]:
    """``(body, causal LM)``: the vLLM classes serving the upcycled ``model_type`` family."""
    family = SERVED_FAMILIES[model_type]
    module = importlib.import_module(f"vllm.model_executor.models.{family.vllm_module}")
    causal = getattr(module, family.causal_lm)
    body = _body_class(model_type, family)
    name = upcycled_classes(model_type)[1].__name__
    refused = {}
    if not supports_eagle3(causal):
        refused["eagle3"] = f"vLLM's {causal.__name__} does not run EAGLE-3 drafters"
    if layout_of(model_type).router is not None:
        refused["lora"] = "LoRA adapters on an upcycled mixture of experts are not tested"
    if family.no_float16:
        refused["float16"] = family.no_float16
    model = types.new_class(name, (UpcycledCausalLM, causal), exec_body=lambda ns: ns.update(
        body_class=body, family=model_type, vllm_class=causal, refused=refused, __module__=__name__,
        __doc__=f"vLLM model for the {name} architecture of attnres.upcycle."))
    return body, model


def __getattr__(name: str) -> type:
    # The generated classes by name: vLLM's lazy registration imports
    # "attnres.serve.upcycled:AttnRes<Family>ForCausalLM", and pickling finds them so.
    for model_type in SERVED_FAMILIES:
        if upcycled_classes(model_type)[1].__name__ == name:
            return served_classes(model_type)[1]
        body = _body_name(model_type)
        if body == name:
            return served_classes(model_type)[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
