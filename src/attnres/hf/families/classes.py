"""The AttnRes version of every supported family, written out: for family ``X`` a config class
``AttnResXConfig`` (``X``'s config plus ``attnres_residual`` and ``attnres_exact_eps``, with
``model_type = "attnres_X"``) and a causal-LM class ``AttnResXForCausalLM`` (``X``'s causal LM
plus the ``residual``), each a short class statement over the mixins of :mod:`.modeling`.
These names are what an upcycled or family-trained directory's ``config.json`` says
(``architectures``), what vLLM's plugin serves, and how the classes pickle."""

from __future__ import annotations

from transformers.models.llama import LlamaConfig, LlamaForCausalLM
from transformers.models.mistral import MistralConfig, MistralForCausalLM
from transformers.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from transformers.models.gemma import GemmaConfig, GemmaForCausalLM
from transformers.models.gemma2 import Gemma2Config, Gemma2ForCausalLM
from transformers.models.gemma3 import Gemma3TextConfig, Gemma3ForCausalLM
from transformers.models.mixtral import MixtralConfig, MixtralForCausalLM
from transformers.models.qwen2_moe import Qwen2MoeConfig, Qwen2MoeForCausalLM
from transformers.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.olmoe import OlmoeConfig, OlmoeForCausalLM
from transformers.models.gpt_oss import GptOssConfig, GptOssForCausalLM
from transformers.models.deepseek_v2 import DeepseekV2Config, DeepseekV2ForCausalLM
from transformers.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.models.dots1 import Dots1Config, Dots1ForCausalLM
from transformers.models.ernie4_5_moe import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM
from transformers.models.hunyuan_v1_moe import HunYuanMoEV1Config, HunYuanMoEV1ForCausalLM
from transformers.models.minimax_m2 import MiniMaxM2Config, MiniMaxM2ForCausalLM
from transformers.models.phimoe import PhimoeConfig, PhimoeForCausalLM
from transformers.models.granitemoe import GraniteMoeConfig, GraniteMoeForCausalLM

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig

from ...nn.residual import ResidualConfig
from .layout import FAMILIES, layout_of
from .modeling import PREFIX, UpcycledConfigMixin, UpcycledModelMixin

__all__ = [
    "upcycled_classes", "name_causal_lm", "register_families", "upcycled_config", "AttnResLlamaConfig",
    "AttnResLlamaForCausalLM", "AttnResMistralConfig", "AttnResMistralForCausalLM", "AttnResQwen2Config",
    "AttnResQwen2ForCausalLM", "AttnResQwen3Config", "AttnResQwen3ForCausalLM", "AttnResGemmaConfig",
    "AttnResGemmaForCausalLM", "AttnResGemma2Config", "AttnResGemma2ForCausalLM", "AttnResGemma3TextConfig",
    "AttnResGemma3ForCausalLM", "AttnResMixtralConfig", "AttnResMixtralForCausalLM", "AttnResQwen2MoeConfig",
    "AttnResQwen2MoeForCausalLM", "AttnResQwen3MoeConfig", "AttnResQwen3MoeForCausalLM",
    "AttnResOlmoeConfig", "AttnResOlmoeForCausalLM", "AttnResGptOssConfig", "AttnResGptOssForCausalLM",
    "AttnResDeepseekV2Config", "AttnResDeepseekV2ForCausalLM", "AttnResDeepseekV3Config",
    "AttnResDeepseekV3ForCausalLM", "AttnResGlm4MoeConfig", "AttnResGlm4MoeForCausalLM",
    "AttnResDots1Config", "AttnResDots1ForCausalLM", "AttnResErnie4_5_MoeConfig",
    "AttnResErnie4_5_MoeForCausalLM", "AttnResHunYuanMoEV1Config", "AttnResHunYuanMoEV1ForCausalLM",
    "AttnResMiniMaxM2Config", "AttnResMiniMaxM2ForCausalLM", "AttnResPhimoeConfig",
    "AttnResPhimoeForCausalLM", "AttnResGraniteMoeConfig", "AttnResGraniteMoeForCausalLM", "CLASSES",
]


class AttnResLlamaConfig(UpcycledConfigMixin, LlamaConfig):
    model_type, architecture = PREFIX + "llama", "AttnResLlamaForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResLlamaForCausalLM(UpcycledModelMixin, LlamaForCausalLM):
    config_class = AttnResLlamaConfig


class AttnResMistralConfig(UpcycledConfigMixin, MistralConfig):
    model_type, architecture = PREFIX + "mistral", "AttnResMistralForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResMistralForCausalLM(UpcycledModelMixin, MistralForCausalLM):
    config_class = AttnResMistralConfig


class AttnResQwen2Config(UpcycledConfigMixin, Qwen2Config):
    model_type, architecture = PREFIX + "qwen2", "AttnResQwen2ForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResQwen2ForCausalLM(UpcycledModelMixin, Qwen2ForCausalLM):
    config_class = AttnResQwen2Config


class AttnResQwen3Config(UpcycledConfigMixin, Qwen3Config):
    model_type, architecture = PREFIX + "qwen3", "AttnResQwen3ForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResQwen3ForCausalLM(UpcycledModelMixin, Qwen3ForCausalLM):
    config_class = AttnResQwen3Config


class AttnResGemmaConfig(UpcycledConfigMixin, GemmaConfig):
    model_type, architecture = PREFIX + "gemma", "AttnResGemmaForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResGemmaForCausalLM(UpcycledModelMixin, GemmaForCausalLM):
    config_class = AttnResGemmaConfig


class AttnResGemma2Config(UpcycledConfigMixin, Gemma2Config):
    model_type, architecture = PREFIX + "gemma2", "AttnResGemma2ForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResGemma2ForCausalLM(UpcycledModelMixin, Gemma2ForCausalLM):
    config_class = AttnResGemma2Config


class AttnResGemma3TextConfig(UpcycledConfigMixin, Gemma3TextConfig):
    model_type, architecture = PREFIX + "gemma3_text", "AttnResGemma3ForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResGemma3ForCausalLM(UpcycledModelMixin, Gemma3ForCausalLM):
    config_class = AttnResGemma3TextConfig


class AttnResMixtralConfig(UpcycledConfigMixin, MixtralConfig):
    model_type, architecture = PREFIX + "mixtral", "AttnResMixtralForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResMixtralForCausalLM(UpcycledModelMixin, MixtralForCausalLM):
    config_class = AttnResMixtralConfig


class AttnResQwen2MoeConfig(UpcycledConfigMixin, Qwen2MoeConfig):
    model_type, architecture = PREFIX + "qwen2_moe", "AttnResQwen2MoeForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResQwen2MoeForCausalLM(UpcycledModelMixin, Qwen2MoeForCausalLM):
    config_class = AttnResQwen2MoeConfig


class AttnResQwen3MoeConfig(UpcycledConfigMixin, Qwen3MoeConfig):
    model_type, architecture = PREFIX + "qwen3_moe", "AttnResQwen3MoeForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResQwen3MoeForCausalLM(UpcycledModelMixin, Qwen3MoeForCausalLM):
    config_class = AttnResQwen3MoeConfig


class AttnResOlmoeConfig(UpcycledConfigMixin, OlmoeConfig):
    model_type, architecture = PREFIX + "olmoe", "AttnResOlmoeForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResOlmoeForCausalLM(UpcycledModelMixin, OlmoeForCausalLM):
    config_class = AttnResOlmoeConfig


class AttnResGptOssConfig(UpcycledConfigMixin, GptOssConfig):
    model_type, architecture = PREFIX + "gpt_oss", "AttnResGptOssForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResGptOssForCausalLM(UpcycledModelMixin, GptOssForCausalLM):
    config_class = AttnResGptOssConfig


class AttnResDeepseekV2Config(UpcycledConfigMixin, DeepseekV2Config):
    model_type, architecture = PREFIX + "deepseek_v2", "AttnResDeepseekV2ForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResDeepseekV2ForCausalLM(UpcycledModelMixin, DeepseekV2ForCausalLM):
    config_class = AttnResDeepseekV2Config


class AttnResDeepseekV3Config(UpcycledConfigMixin, DeepseekV3Config):
    model_type, architecture = PREFIX + "deepseek_v3", "AttnResDeepseekV3ForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResDeepseekV3ForCausalLM(UpcycledModelMixin, DeepseekV3ForCausalLM):
    config_class = AttnResDeepseekV3Config


class AttnResGlm4MoeConfig(UpcycledConfigMixin, Glm4MoeConfig):
    model_type, architecture = PREFIX + "glm4_moe", "AttnResGlm4MoeForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResGlm4MoeForCausalLM(UpcycledModelMixin, Glm4MoeForCausalLM):
    config_class = AttnResGlm4MoeConfig


class AttnResDots1Config(UpcycledConfigMixin, Dots1Config):
    model_type, architecture = PREFIX + "dots1", "AttnResDots1ForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResDots1ForCausalLM(UpcycledModelMixin, Dots1ForCausalLM):
    config_class = AttnResDots1Config


class AttnResErnie4_5_MoeConfig(UpcycledConfigMixin, Ernie4_5_MoeConfig):
    model_type, architecture = PREFIX + "ernie4_5_moe", "AttnResErnie4_5_MoeForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResErnie4_5_MoeForCausalLM(UpcycledModelMixin, Ernie4_5_MoeForCausalLM):
    config_class = AttnResErnie4_5_MoeConfig


class AttnResHunYuanMoEV1Config(UpcycledConfigMixin, HunYuanMoEV1Config):
    model_type, architecture = PREFIX + "hunyuan_v1_moe", "AttnResHunYuanMoEV1ForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResHunYuanMoEV1ForCausalLM(UpcycledModelMixin, HunYuanMoEV1ForCausalLM):
    config_class = AttnResHunYuanMoEV1Config


class AttnResMiniMaxM2Config(UpcycledConfigMixin, MiniMaxM2Config):
    model_type, architecture = PREFIX + "minimax_m2", "AttnResMiniMaxM2ForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResMiniMaxM2ForCausalLM(UpcycledModelMixin, MiniMaxM2ForCausalLM):
    config_class = AttnResMiniMaxM2Config


class AttnResPhimoeConfig(UpcycledConfigMixin, PhimoeConfig):
    model_type, architecture = PREFIX + "phimoe", "AttnResPhimoeForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResPhimoeForCausalLM(UpcycledModelMixin, PhimoeForCausalLM):
    config_class = AttnResPhimoeConfig


class AttnResGraniteMoeConfig(UpcycledConfigMixin, GraniteMoeConfig):
    model_type, architecture = PREFIX + "granitemoe", "AttnResGraniteMoeForCausalLM"
    attnres_residual: dict | None = None
    attnres_exact_eps: bool = False


class AttnResGraniteMoeForCausalLM(UpcycledModelMixin, GraniteMoeForCausalLM):
    config_class = AttnResGraniteMoeConfig


#: family ``model_type`` -> ``(config class, causal-LM class)`` of its AttnRes version.
CLASSES: dict[str, tuple[type, type]] = {model.config_class.model_type.removeprefix(PREFIX): (model.config_class, model)
                                         for model in UpcycledModelMixin.__subclasses__()}


def upcycled_classes(model_type: str) -> tuple[type, type]:
    """``(config class, causal-LM class)`` of the AttnRes version of family ``model_type``."""
    layout_of(model_type)  # refuses unsupported families with the reason
    return CLASSES[model_type]


class _CausalLMOnly:
    """``AutoModel``'s entry for an AttnRes family: a refusal that says what to load instead
    (else transformers lists every configuration class it knows). The base model alone has no
    residual: it belongs to the causal LM, whose parameters it is among."""

    config_class: type

    @classmethod
    def _refusal(cls, what: str) -> ValueError:
        family = cls.config_class.model_type.removeprefix(PREFIX)
        return ValueError(f"{what} is an AttnRes {family} model: it loads as a causal LM only (its residual belongs "
                          "to the whole model), with AutoModelForCausalLM; for what AutoModel gives, call it with "
                          "output_hidden_states=True: hidden_states[-1] is the final norm's output (AutoModel's "
                          "last_hidden_state)")

    @classmethod
    def from_pretrained(cls, path=None, *args, **kwargs):
        raise cls._refusal(repr(str(path)))

    @classmethod
    def _from_config(cls, config, *args, **kwargs):
        raise cls._refusal(f"a model of {type(config).__name__}")


def register_families() -> None:
    """Register every supported family's AttnRes classes with the Auto classes (``AutoModel``
    with a refusal that names ``AutoModelForCausalLM``), and the family's checkpoint
    conversion (idempotent)."""
    for model_type in FAMILIES:
        config_cls, model_cls = upcycled_classes(model_type)
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
        name_causal_lm(config_cls, model_cls)
        refusal = type(config_cls.__name__.removesuffix("Config") + "Model", (_CausalLMOnly,), {"config_class": config_cls})
        AutoModel.register(config_cls, refusal, exist_ok=True)
        _share_weight_conversion(model_type)


def name_causal_lm(config_cls: type, model_cls: type) -> None:
    """Add ``model_cls`` to transformers' names of causal LMs (``AutoModelForCausalLM.register``
    does not): ``Trainer`` shifts the labels of the loss it computes itself (with
    ``label_smoothing_factor``) only for a class named there - otherwise each position was
    scored against its own token - and the text-generation pipeline checks the name too."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config_cls.model_type] = model_cls.__name__


def _share_weight_conversion(model_type: str) -> None:
    """Give ``attnres_X`` the weight conversion of family ``X``. transformers 5 keeps the
    experts of a mixture of experts fused in memory (one ``[n_experts, ...]`` tensor) and
    converts them from and to the per-expert tensors of the family's checkpoints by
    ``model_type``; without this, an original checkpoint would not fill the AttnRes model's
    experts, and an AttnRes model would save experts it cannot load back."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
    except ImportError:  # releases before checkpoint conversions convert nothing
        return
    mapping = get_checkpoint_conversion_mapping(model_type)
    if mapping:
        register_checkpoint_conversion_mapping(PREFIX + model_type, mapping, overwrite=True)


def upcycled_config(base: PretrainedConfig, residual: ResidualConfig, exact_eps: bool) -> PretrainedConfig:
    """The AttnRes version of ``base`` (a supported family's config)."""
    config_cls, _ = upcycled_classes(base.model_type)
    fields = {k: v for k, v in base.to_dict().items() if k not in ("model_type", "transformers_version", "architectures")}
    return config_cls(**fields, attnres_residual=residual.to_dict(), attnres_exact_eps=exact_eps)
