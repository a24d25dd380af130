"""Which ``transformers`` decoder families AttnRes can wrap, described as data.

AttnRes replaces the residual sum *between* sublayers; the sublayers themselves - each
family's own attention and MLP (or mixture-of-experts) modules with their own pre-norm - stay
as they are. That needs a PreNorm layout: every sublayer reads ``norm(h)`` of the residual
stream ``h`` (and may normalise or scale its own output, as Gemma 2/3 and Granite do), so
that mixing ``h`` over depth changes only what the norm sees. A post-norm layout (OLMo 2:
``h + norm(attn(h))``) feeds the raw stream to the attention - or, in a mixture of experts,
to the router - so no choice of weights reproduces the pretrained function.

Each supported family is described by a :class:`Layout`: the attribute names, inside its
decoder layer, of the two sublayers, their pre-norms and optional output norms, and for a
mixture of experts its :class:`Router` (where the router sits, how the family trains it). A
family is supported only after its decoder layer's forward was read and found to be exactly
``h = h + post(sublayer(pre(h)))`` for both sublayers, with nothing else reading ``h``
(the transformers release each was checked against: :data:`CHECKED_WITH`). The
descriptions are plain data, so other integrations (serving engines) can reuse them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...models.hf_registry import NATIVE_MODEL_TYPE

__all__ = ["Layout", "Router", "FAMILIES", "REFUSED", "PREFIX", "CHECKED_WITH", "layout_of", "family_of"]

#: ``model_type`` of the AttnRes version of family ``X``: ``"attnres_" + X``.
PREFIX = "attnres_"
#: The ``transformers`` release whose decoder layers the layouts below were read from.
CHECKED_WITH = "5.24.0"


@dataclass(frozen=True)
class Router:
    """The router of a mixture-of-experts family's sparse MLP blocks.

    path: the router module relative to a decoder layer (``"mlp.gate"``); decoder layers
        without it are dense (DeepSeek's first ``first_k_dense_replace`` layers, Qwen's
        ``mlp_only_layers``). Every router's forward returns ``(router_logits [tokens,
        n_experts], routing weights [tokens, top_k], selected experts [tokens, top_k])``,
        and the family records ``router_logits`` with a forward hook on it
        (``output_router_logits``), which the wrap leaves in place.
    aux_loss_coef: the config field weighting the load-balancing loss that the family's
        causal LM adds to its loss under ``output_router_logits=True``; ``None`` for families
        whose causal LM trains without one (DeepSeek-V3's routing bias, which its report
        updates outside the gradient, stays fixed in ``transformers``).
    """

    path: str
    aux_loss_coef: str | None = "router_aux_loss_coef"


@dataclass(frozen=True)
class Layout:
    """A decoder layer's two sublayers and the norms around them.

    attn_norm / mlp_norm: the pre-norm of the attention / MLP sublayer (they read the stream).
    attn_post / mlp_post: a norm applied to the sublayer's output (part of the sublayer), or None.
    attn / mlp: the sublayer modules (the MLP may be a mixture of experts).
    mlp_output: where the MLP returns a tuple, the index of its output in it (GPT-OSS:
        ``(hidden states, router scores)``); None where it returns a tensor (a tuple, as
        some releases' sparse blocks return ``(hidden states, router logits)``, is then read
        at index 0).
    output_scale: a decoder-layer attribute every sublayer output is multiplied by (Granite's
        ``residual_multiplier``: ``h + m * f(norm(h))``), or None.
    router: the mixture-of-experts router, None for dense families.
    """

    attn_norm: str
    mlp_norm: str
    attn_post: str | None = None
    mlp_post: str | None = None
    attn: str = "self_attn"
    mlp: str = "mlp"
    mlp_output: int | None = None
    output_scale: str | None = None
    router: Router | None = None


_PRENORM = Layout("input_layernorm", "post_attention_layernorm")
_SANDWICH = Layout("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm")


def _moe(router: str = "mlp.gate", aux_loss_coef: str | None = "router_aux_loss_coef", **layout) -> Layout:
    """A PreNorm layer whose MLP is a mixture of experts with its router at ``router``."""
    return Layout("input_layernorm", "post_attention_layernorm", router=Router(router, aux_loss_coef), **layout)


#: ``config.model_type`` -> the layout of its decoder layers.
FAMILIES: dict[str, Layout] = {
    "llama": _PRENORM,
    "mistral": _PRENORM,
    "qwen2": _PRENORM,
    "qwen3": _PRENORM,
    "gemma": _PRENORM,
    "gemma2": _SANDWICH,
    "gemma3_text": _SANDWICH,
    # Mixtures of experts: the router reads the MLP's pre-norm output, like the experts.
    "mixtral": _moe(),
    "qwen2_moe": _moe(),  # plus a gated shared expert on the same input
    "qwen3_moe": _moe(),
    "olmoe": _moe(),  # q/k norms inside the attention
    "gpt_oss": _moe("mlp.router", mlp_output=0),  # attention sinks, sliding-window layers inside the attention
    "deepseek_v2": _moe(aux_loss_coef=None),  # multi-head latent attention, shared experts, first dense layers
    "deepseek_v3": _moe(aux_loss_coef=None),  # the same, with sigmoid group-limited routing (Kimi K2, Moonlight)
    "glm4_moe": _moe(aux_loss_coef=None),
    "dots1": _moe(aux_loss_coef=None),
    "ernie4_5_moe": _moe(),
    "hunyuan_v1_moe": _moe(aux_loss_coef=None),
    "minimax_m2": _moe(),
    "phimoe": _moe("mlp.router"),  # LayerNorm pre-norms (the epsilon argument holds for them too)
    "granitemoe": _moe("block_sparse_moe.router", mlp="block_sparse_moe", output_scale="residual_multiplier"),
}

#: Families refused on purpose, with the reason.
REFUSED: dict[str, str] = {
    "olmo2": "OLMo 2 uses a post-norm layout (h + norm(attn(h))): its attention reads the raw residual stream, "
             "so mixing the stream over depth changes the pretrained function and cannot be upcycled exactly",
    "flex_olmo": "FlexOlmo uses OLMo 2's post-norm layout (h + norm(f(h))): its attention and its router read the "
                 "raw residual stream, so mixing the stream over depth changes the pretrained function",
    "cohere": "Cohere runs attention and MLP in parallel on one normalised input: there is no residual stream "
              "between the two sublayers to mix over",
    "cohere2_moe": "Cohere 2 MoE runs attention and the mixture of experts in parallel on one normalised input: "
                   "there is no residual stream between the two sublayers to mix over",
    "minimax": "MiniMax carries the normalised stream, not the raw one (h' = a * norm(h) + b * f(norm(h))): "
               "there is no residual sum of sublayer outputs for AttnRes to replace",
    "longcat_flash": "LongCat-Flash's decoder layer holds two attention and two MLP sublayers plus a mixture of "
                     "experts whose output skips the second pair (a shortcut): not the two-sublayer PreNorm layout",
    "gemma3": "Gemma 3's multimodal model: upcycle its text model (model_type 'gemma3_text')",
    NATIVE_MODEL_TYPE: "it is attnres's own model (an `attnres export` of a training run), AttnRes already: use it as "
                       "it is (attnres generate / eval / analyze), or train on from its run with the run's config "
                       "(`attnres train --config RUN/config.json init_from=RUN out_dir=DIR`; init_from=RUN alone builds "
                       "the default model)",
}


def family_of(model_type: str) -> str:
    """The family name of a ``model_type``, plain or AttnRes (``"attnres_qwen3_moe"`` -> ``"qwen3_moe"``)."""
    return model_type.removeprefix(PREFIX)


def layout_of(model_type: str) -> Layout:
    """The layout of a supported family; ``ValueError`` naming the reason otherwise."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type in REFUSED:
        raise ValueError(f"cannot upcycle model_type {model_type!r}: {REFUSED[model_type]}")
    if model_type.startswith(PREFIX) and family_of(model_type) in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is already an AttnRes model (an upcycled "
                         f"{family_of(model_type)!r}): train it on with `attnres train model.from_hf=DIR init_from=DIR`, "
                         "or upcycle the original model")
    raise ValueError(f"cannot upcycle model_type {model_type!r}: its decoder layout is not recognised (AttnRes needs "
                     f"a PreNorm layout it knows exactly); supported: {', '.join(sorted(FAMILIES))}")
