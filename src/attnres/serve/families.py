"""Which vLLM classes run each architecture that attnres writes - a table, no vLLM import.

``attnres export`` writes the native ``AttnResForCausalLM``; ``attnres.upcycle`` writes
``AttnRes<Family>ForCausalLM`` for the transformers families of
:data:`attnres.models.families.FAMILIES`. vLLM finds a model class by the ``architectures`` entry of
``config.json``, so the plugin registers one class per name (:func:`architectures`).

For an upcycled family the served model is built from **vLLM's own implementation of that
family**: its decorated model body (embedding, decoder layers with their attention and MLP
modules, final norm) is subclassed, and only the loop over the decoder layers is replaced by
the AttnRes residual (:mod:`attnres.serve.upcycled`), as :mod:`attnres.upcycle` does with the
transformers modules. A :class:`ServedFamily` names that body and the attributes of its decoder
layer; the norms around the two sublayers are the family's :class:`attnres.models.families.Layout`
(vLLM keeps the transformers attribute names).

The mixtures of experts that :mod:`attnres.upcycle` converts are not served yet
(:func:`unserved_families`, with the reason): their architectures are registered all the
same, with :mod:`attnres.serve.refused`, so that loading one fails at once with a message
that names the family, rather than vLLM's "architecture not supported" or a fallback to its
Transformers backend.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ServedFamily", "SERVED_FAMILIES", "unserved_families", "NATIVE_ARCHITECTURE", "architectures"]

#: The ``architectures`` entry of an ``attnres export`` directory.
NATIVE_ARCHITECTURE = "AttnResForCausalLM"


@dataclass(frozen=True)
class ServedFamily:
    """vLLM's implementation of one transformers family.

    vllm_module: the module of ``vllm.model_executor.models`` that implements it.
    body: its model body class there (decorated with ``@support_torch_compile``), which owns
        ``embed_tokens`` (and ``embed_input_ids``), ``layers`` and ``norm``.
    attention / mlp: the attributes of a decoder layer holding the two sublayers' modules
        (``attention(positions=..., hidden_states=...)``, ``mlp(x)``).
    """

    vllm_module: str
    body: str
    attention: str = "self_attn"
    mlp: str = "mlp"

    @property
    def causal_lm(self) -> str:
        """vLLM's causal LM class of the family, beside the body (``LlamaModel`` -> ``LlamaForCausalLM``)."""
        return self.body.removesuffix("Model") + "ForCausalLM"


#: transformers ``model_type`` -> vLLM's implementation (the keys are attnres.upcycle.FAMILIES').
SERVED_FAMILIES: dict[str, ServedFamily] = {
    "llama": ServedFamily("llama", "LlamaModel"),
    "mistral": ServedFamily("mistral", "MistralModel"),
    "qwen2": ServedFamily("qwen2", "Qwen2Model"),
    "qwen3": ServedFamily("qwen3", "Qwen3Model"),
    "gemma": ServedFamily("gemma", "GemmaModel"),
    "gemma2": ServedFamily("gemma2", "Gemma2Model"),
    "gemma3_text": ServedFamily("gemma3", "Gemma3Model"),
}


_MOE_REASON = (
    "vLLM runs a mixture of experts through its own fused-experts layer (FusedMoE), whose weight loading "
    "gathers per-expert tensors into fused ones; the plugin does not yet check an upcycled checkpoint's "
    "experts against that layer, and no mixture-of-experts family has been verified token for token "
    "against transformers under vLLM")


def unserved_families() -> dict[str, str]:
    """Upcycled families (transformers ``model_type``) that the plugin refuses at load time,
    with the reason: the mixtures of experts of :data:`attnres.models.families.FAMILIES`
    (needs transformers)."""
    from ..models.families import FAMILIES

    return {name: _MOE_REASON for name, layout in FAMILIES.items() if layout.router is not None}


def architectures() -> dict[str, str]:
    """``architectures`` name -> the plugin's vLLM class as a lazy ``"module:Class"`` string
    (``vllm.ModelRegistry.register_model`` imports it when a model of that name loads).
    The upcycled names are the class names :mod:`attnres.upcycle` saves (needs transformers);
    those of :func:`unserved_families` point at :mod:`attnres.serve.refused`, which refuses
    them with the reason."""
    from ..models.families import upcycled_classes

    names = {NATIVE_ARCHITECTURE: f"{__package__}.native:{NATIVE_ARCHITECTURE}"}
    for model_type in SERVED_FAMILIES:
        name = upcycled_classes(model_type)[1].__name__
        names[name] = f"{__package__}.upcycled:{name}"
    for model_type in unserved_families():
        name = upcycled_classes(model_type)[1].__name__
        names[name] = f"{__package__}.refused:{name}"
    return names
