"""Which ``transformers`` decoder families AttnRes can wrap, and where their pre-norms are.

AttnRes replaces the residual sum *between* sublayers; the sublayers themselves - each
family's own attention and MLP modules with their own pre-norm - stay as they are. That
needs a PreNorm layout: every sublayer reads ``norm(h)`` of the residual stream ``h`` (and
may normalise its own output, as Gemma 2/3 do), so that mixing ``h`` over depth changes
only what the norm sees. A post-norm layout (OLMo 2: ``h + norm(attn(h))``) feeds the raw
stream to the attention, so no choice of weights reproduces the pretrained function.

Each supported family is described by a :class:`Layout` (the attribute names of the two
pre-norms and the optional output norms of its decoder layer); a family is supported only
after its decoder layer's forward was checked to be exactly
``h = h + post(sublayer(pre(h)))`` for both sublayers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout", "FAMILIES", "REFUSED", "layout_of"]


@dataclass(frozen=True)
class Layout:
    """The norms around a decoder layer's two sublayers.

    attn_norm / mlp_norm: the pre-norm of the attention / MLP sublayer (they read the stream);
    attn_post / mlp_post: a norm applied to the sublayer's output (part of the sublayer), or None.
    """

    attn_norm: str
    mlp_norm: str
    attn_post: str | None = None
    mlp_post: str | None = None


_PRENORM = Layout("input_layernorm", "post_attention_layernorm")
_SANDWICH = Layout("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm")

#: ``config.model_type`` -> the layout of its decoder layers.
FAMILIES: dict[str, Layout] = {
    "llama": _PRENORM,
    "mistral": _PRENORM,
    "qwen2": _PRENORM,
    "qwen3": _PRENORM,
    "gemma": _PRENORM,
    "gemma2": _SANDWICH,
    "gemma3_text": _SANDWICH,
}

#: Families refused on purpose, with the reason.
REFUSED: dict[str, str] = {
    "olmo2": "OLMo 2 uses a post-norm layout (h + norm(attn(h))): its attention reads the raw residual stream, "
             "so mixing the stream over depth changes the pretrained function and cannot be upcycled exactly",
    "cohere": "Cohere runs attention and MLP in parallel on one normalised input: there is no residual stream "
              "between the two sublayers to mix over",
    "gemma3": "Gemma 3's multimodal model: upcycle its text model (model_type 'gemma3_text')",
}


def layout_of(model_type: str) -> Layout:
    """The layout of a supported family; ``ValueError`` naming the reason otherwise."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type in REFUSED:
        raise ValueError(f"cannot upcycle model_type {model_type!r}: {REFUSED[model_type]}")
    raise ValueError(f"cannot upcycle model_type {model_type!r}: its decoder layout is not recognised (AttnRes needs "
                     f"a PreNorm layout it knows exactly); supported: {', '.join(sorted(FAMILIES))}")
