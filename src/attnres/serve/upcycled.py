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
family's logit scale and final soft-capping (Gemma 2/3). The classes are made from the table
:data:`attnres.serve.families.SERVED_FAMILIES` when vLLM first asks for one, one body and one
causal LM per family (``AttnResLlamaModel``, ``AttnResLlamaForCausalLM``, ...; DeepSeek-V2 and
V3 share vLLM's body, and so share ours): vLLM's lazy ``"module:Class"`` registration gets them
by the names :mod:`attnres.upcycle` saves (:func:`attnres.serve.families.architectures`), and
only this vLLM's modules of the family asked for are imported, so that a family whose module a
vLLM release dropped is refused by itself (:func:`served_class`) while the others load.

Pipeline parallelism, where vLLM's class of the family declares it: vLLM's body builds each
rank's range of the decoder layers (and the embedding and final norm where they belong), the
head is built on the last rank, the residual on every rank; the stream crosses the stages as
:func:`attnres.serve.decoder.run_decoder` describes.
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Iterable
from itertools import islice
from pathlib import Path

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.model_executor.models.utils import PPMissingLayer, maybe_prefix
from vllm.sequence import IntermediateTensors

from ..hf.families import layout_of, upcycled_classes
from ..hf.families.modeling import adjust_eps
from .checkpoint import CheckpointMismatch, checked_weights, expected_shapes
from .decoder import (DYNAMIC_ARG_DIMS, FlatRotary, SublayerNames, check_config_class, check_servable, empty_stream,
                      last_stage_head, run_decoder, serving_residual, stage_embedding)
from .families import SERVED_FAMILIES, TESTED_VLLM, ServedFamily
from .refused import refusing_class

__all__ = ["served_class", "UpcycledBody", "UpcycledCausalLM"]


class UpcycledBody(nn.Module):
    """What every served upcycled family's body adds to vLLM's body of that family (mixin):
    the residual and the AttnRes forward; each body below is compiled by vLLM
    (``support_torch_compile``) as the family's own is."""

    family: str  # the transformers model_type of the family

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)  # vLLM's body of the family builds everything
        family, layout = SERVED_FAMILIES[self.family], layout_of(self.family)
        self._names = SublayerNames(family.attention, family.mlp, layout, family.attention_kwargs)
        self._embedding_scale = family.embedding_scale
        self._stage = range(self.start_layer, self.end_layer)  # (vLLM's body: this pipeline stage's layers)
        if family.flat_rotary:
            for layer in islice(self.layers, self.start_layer, self.end_layer):
                attention = getattr(layer, family.attention)
                attention.rotary_emb = FlatRotary(attention.rotary_emb)
        config = vllm_config.model_config.hf_config
        self.residual = serving_residual(config.residual_config(), config.hidden_size, 2 * config.num_hidden_layers)
        if config.attnres_exact_eps:
            held = [layer if i in self._stage else None for i, layer in enumerate(self.layers)]
            adjust_eps(self.residual, held, None if isinstance(self.norm, PPMissingLayer) else self.norm, layout,
                       config.rms_norm_eps)
        self.make_empty_intermediate_tensors = empty_stream(self.residual, self.start_layer, config.hidden_size)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None, inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        x = stage_embedding(self, input_ids, inputs_embeds)
        if x is not None and self._embedding_scale is not None:
            x = x * getattr(self, self._embedding_scale)
        # EAGLE-3: vLLM sets aux_hidden_state_layers (EagleModelMixin) on the bodies of the
        # families that declare it; the drafter then gets the depth mixtures there.
        out, aux = run_decoder(self.residual, self.layers, self._names, positions, x,
                               getattr(self, "aux_hidden_state_layers", ()), self._stage, intermediate_tensors)
        if isinstance(out, IntermediateTensors):
            return out
        return (self.norm(out), aux) if aux else self.norm(out)


_compiled = support_torch_compile(dynamic_arg_dims=DYNAMIC_ARG_DIMS)


class UpcycledCausalLM(nn.Module):
    """What every served upcycled family adds to vLLM's causal LM of that family (mixin)."""

    body_class: type  # the family's UpcycledBody
    family: str  # the transformers model_type of the family
    vllm_class: type  # vLLM's causal LM of the family (the base class after this one)
    refused: dict[str, str]  # decoder.check_servable: what the family refuses, with the reason

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "family" not in cls.__dict__:
            return
        causal = cls.vllm_class = cls.__bases__[cls.__bases__.index(UpcycledCausalLM) + 1]
        cls.refused = {}
        if not supports_eagle3(causal):
            cls.refused["eagle3"] = f"vLLM's {causal.__name__} does not run EAGLE-3 drafters"
        if layout_of(cls.family).router is not None:
            cls.refused["lora"] = "LoRA adapters on an upcycled mixture of experts are not tested"
        if SERVED_FAMILIES[cls.family].no_float16:
            cls.refused["float16"] = SERVED_FAMILIES[cls.family].no_float16
        if cls.__doc__ is None:
            cls.__doc__ = f"vLLM model for the {cls.__name__} architecture of attnres.upcycle."

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
        self.lm_head = last_stage_head(config.vocab_size, config.hidden_size, self.quant_config,
                                       maybe_prefix(prefix, "lm_head"),
                                       tied_to=self.model.embed_tokens if config.tie_word_embeddings else None,
                                       bias=getattr(config, "lm_head_bias", False))  # PhiMoE's may have one
        # Granite divides the logits by logits_scaling; others may multiply by logit_scale.
        scale = 1 / config.logits_scaling if getattr(config, "logits_scaling", None) else getattr(config, "logit_scale", 1.0)
        self.logits_processor = LogitsProcessor(config.vocab_size, scale=scale,
                                                soft_cap=getattr(config, "final_logit_softcapping", None))
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors  # (pipeline parallelism)
        check_servable(self, vllm_config, self.refused)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Check the tensors against the config, then load them the family's way; the
        residual (``residual.*`` in the checkpoint, ``model.residual.*`` here) loads as plain
        tensors. A checkpoint without the residual's tensors is refused (vLLM refuses missing
        weights; they would be served at zero queries), where ``from_pretrained`` gives them
        their faithful init and lists them in its load report."""
        config = self.config
        _, hf_class = upcycled_classes(self.family)
        optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
        checked = checked_weights(weights, expected_shapes(lambda: hf_class(copy.deepcopy(config))), self.checkpoint_dir, optional)
        renamed = (("model." + name if name.startswith("residual.") else name, t) for name, t in checked)
        loaded = set(super().load_weights(renamed))
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


def _vllm_classes(family: ServedFamily) -> tuple[type, type]:
    """vLLM's body and causal LM of ``family`` (ImportError or AttributeError where this vLLM
    has no such module or class)."""
    module = importlib.import_module(f"vllm.model_executor.models.{family.vllm_module}")
    return getattr(module, family.body), getattr(module, family.causal_lm)


@functools.cache
def _body_class(vllm_module: str, body: str) -> type:
    """``AttnRes<Body>``: vLLM's body ``body`` with the residual and the AttnRes forward,
    compiled by vLLM as the family's own is. One per vLLM body: DeepSeek-V2 and V3 share
    vLLM's (and their layout), and so share ours, whose family is the first table row
    naming it."""
    model_type = next(t for t, f in SERVED_FAMILIES.items() if (f.vllm_module, f.body) == (vllm_module, body))
    base, _ = _vllm_classes(SERVED_FAMILIES[model_type])
    return _compiled(type(f"AttnRes{body}", (UpcycledBody, base), {"family": model_type, "__module__": __name__}))


@functools.cache
def served_class(model_type: str) -> type:
    """The vLLM causal LM serving the upcycled ``model_type`` family, named as
    :mod:`attnres.upcycle` saves it (``AttnResLlamaForCausalLM``): vLLM's causal LM of the
    family with :class:`UpcycledCausalLM` and our body. Where this vLLM lacks the family's
    module or classes (vLLM 0.34 serves Gemma and OLMoE through its Transformers backend, with
    no class of its own), a class that refuses the model when vLLM builds it, with the reason
    (:func:`attnres.serve.refused.refusing_class`), so that the other families still load."""
    family, name = SERVED_FAMILIES[model_type], upcycled_classes(model_type)[1].__name__
    try:
        _, causal = _vllm_classes(family)
        body = _body_class(family.vllm_module, family.body)
    except (ImportError, AttributeError) as missing:
        import vllm

        return refusing_class(name, (
            f"attnres.serve: {name} (the upcycled {model_type!r} family) is not served on vLLM {vllm.__version__}: "
            f"it has no {family.body} and {family.causal_lm} in vllm.model_executor.models.{family.vllm_module} "
            f"({type(missing).__name__}: {missing}), which the plugin builds the family on. Serve it with vLLM "
            f"{TESTED_VLLM} (pip install vllm=={TESTED_VLLM}.0; docs/serving.md), or run it with transformers "
            "(AutoModelForCausalLM.from_pretrained after `import attnres.hf`)"))
    return type(name, (UpcycledCausalLM, causal), {"family": model_type, "body_class": body, "__module__": __name__})


#: ``AttnRes<Family>ForCausalLM`` -> the family's transformers model_type.
_FAMILY_OF = {upcycled_classes(model_type)[1].__name__: model_type for model_type in SERVED_FAMILIES}


def __getattr__(name: str) -> type:
    """The served classes by the names ``attnres.upcycle`` saves in ``config.json``'s
    ``architectures``: vLLM's lazy ``"module:Class"`` registration gets them here
    (:func:`attnres.serve.families.architectures`), each built on first use."""
    if name not in _FAMILY_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return served_class(_FAMILY_OF[name])
