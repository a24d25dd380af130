"""A ``ModelConfig`` with ``hf_architecture`` as a ``transformers`` family's AttnRes model,
and back: what training and loading build for such configs, and how a saved directory
becomes one (``model.from_hf=DIR``)."""

from __future__ import annotations

import copy
import functools
from typing import Any

from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from ...migrations import stored_config
from ...nn.residual import ResidualConfig
from ...validation import did_you_mean_each
from .classes import register_families, upcycled_classes
from .modeling import PREFIX

try:  # (transformers' configs are strict dataclasses from huggingface_hub 1.0 on: a wrong type is refused so)
    from huggingface_hub.errors import StrictDataclassError as _FieldRefused
except ImportError:  # pragma: no cover - an older huggingface_hub
    _FieldRefused = TypeError

__all__ = ["build_hf_model", "check_hf_config", "hf_config_of", "model_fields_of", "model_fields_from_directory"]

#: ModelConfig field -> the family config field it sets (the rest go through hf_config).
FIELD_HF_NAMES = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "mlp_hidden": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
    "init_std": "initializer_range",
}
# Bookkeeping of a saved config that is not the architecture.
_SKIPPED = {"model_type", "architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
            "attnres_residual", "id2label", "label2id", "return_dict", "output_attentions", "output_hidden_states"}


@functools.cache
def _family_fields(family: str) -> tuple[frozenset[str], dict[str, str]]:
    """The config fields of ``family`` (its config class's defaults, as saved) and the
    aliases its config class maps to them (``num_experts`` -> ``num_local_experts``)."""
    config_cls, _ = upcycled_classes(family)
    return frozenset(config_cls().to_dict()), dict(config_cls.attribute_map)


@functools.cache
def _float_fields(family: str) -> frozenset[str]:
    """The config fields of ``family`` whose defaults are floats (``router_aux_loss_coef``):
    transformers' strict configs refuse an integer there, which YAML makes of ``0``."""
    config_cls, _ = upcycled_classes(family)
    return frozenset(k for k, v in config_cls().to_dict().items() if isinstance(v, float))


def _in_family_types(family: str, hf_config: dict[str, Any]) -> dict[str, Any]:
    """``hf_config`` with an integer given for a float field as that float: the docs' "set
    router_aux_loss_coef to 0" (``model.hf_config.router_aux_loss_coef=0``) ended the run's
    set-up in a traceback, "expected float, got int". An alias is given as the field it
    names (``num_experts``: Mixtral's ``num_local_experts``), which the strict config checks:
    an alias's value was set unchecked, and ``num_experts=4.0`` failed where the model was
    built ("empty() takes 1 positional argument"). (Given both, the later one wins, as the
    alias did.)"""
    floats = _float_fields(family)
    return {field: float(value) if field in floats and isinstance(value, int) and not isinstance(value, bool) else value
            for field, value in _named_as_fields(family, hf_config).items()}


def _named_as_fields(family: str, hf_config: dict[str, Any]) -> dict[str, Any]:
    """``hf_config`` with each alias of ``family``'s config given as the field it names
    (``num_experts``: Mixtral's ``num_local_experts``), the later of an alias and its field
    winning (a change merged over a directory's)."""
    aliases = _family_fields(family)[1]
    named: dict[str, Any] = {}
    for key, value in hf_config.items():
        field = aliases.get(key, key)
        named.pop(field, None)
        named[field] = value
    return named


def check_hf_config(config) -> dict[str, Any]:
    """Raise ``ValueError`` when ``config.hf_config`` (a ``ModelConfig`` with
    ``hf_architecture``) holds a key its family's config does not know (a misspelt field
    would be kept as an unused attribute), or one a ``ModelConfig`` field sets. Returns it
    with each alias given as its field (:func:`_named_as_fields`), what a run saves: given
    both (``model.from_hf=DIR model.hf_config.num_experts=8`` over a directory's
    ``num_local_experts``), its config.json kept both, and which one counted depended on
    their order."""
    fields, aliases = _family_fields(config.hf_architecture)
    ours = {hf: ours for ours, hf in FIELD_HF_NAMES.items()}
    for key in config.hf_config:
        field = ours.get(aliases.get(key, key), "residual" if key == "attnres_residual" else None)
        if field is not None:
            raise ValueError(f"ModelConfig.hf_config.{key} is set by ModelConfig.{field}: use model.{field} instead")
    known = (fields | set(aliases)) - set(ours) - _SKIPPED
    unknown = sorted(set(config.hf_config) - known)
    if unknown:
        # the nearest field, among those a ModelConfig field sets too (named with that field)
        hint = did_you_mean_each(unknown, sorted(known | set(ours)),
                                 lambda near: f" (set by model.{ours[near]})" if near in ours else "")
        raise ValueError(f"unknown ModelConfig.hf_config key(s) {unknown} for hf_architecture="
                         f"{config.hf_architecture!r}{hint}; known keys: {sorted(known)}")
    try:  # (the values: a type the family's config refuses was a traceback where the model was built)
        _family_config(config)
    except (_FieldRefused, TypeError) as e:
        raise ValueError(f"ModelConfig.hf_config: the {config.hf_architecture!r} config refuses it: "
                         f"{' '.join(str(e).split())}") from None
    return _named_as_fields(config.hf_architecture, config.hf_config)


def hf_config_of(config) -> PretrainedConfig:
    """The AttnRes family config that ``config`` (a ``ModelConfig`` with ``hf_architecture``)
    describes: the family's defaults, then ``config``'s fields, then ``config.hf_config``
    (its keys checked, :func:`check_hf_config`)."""
    if config.hf_architecture is None:
        raise ValueError("ModelConfig.hf_architecture is None: this is a native model (attnres.AttnResLM)")
    check_hf_config(config)
    return _family_config(config)


def _family_config(config) -> PretrainedConfig:
    """:func:`hf_config_of` ``config``, its ``hf_config`` keys not checked."""
    config_cls, _ = upcycled_classes(config.hf_architecture)
    fields: dict[str, Any] = {hf: getattr(config, ours) for ours, hf in FIELD_HF_NAMES.items()}
    fields["num_key_value_heads"] = config.kv_heads
    fields["intermediate_size"] = config.hidden_size
    fields["head_dim"] = config.head_dim
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta}
    fields.update(_in_family_types(config.hf_architecture, copy.deepcopy(config.hf_config)))
    rope = fields["rope_parameters"]
    if isinstance(rope, dict) and "rope_type" in rope:  # (one RoPE; Gemma 3's per layer type are mappings of them)
        # (a scaled RoPE's mapping, kept whole in hf_config, held its own rope_theta: model.rope_theta=X beside a
        # YaRN directory's model.from_hf was said to train X and built the directory's)
        fields["rope_parameters"] = {**rope, "rope_theta": config.rope_theta}
    fields["attnres_residual"] = config.residual.to_dict()
    with stored_config():  # (config's residual was checked, and a single block warned of, when config was made)
        return config_cls(**fields)


def build_hf_model(config) -> PreTrainedModel:
    """A freshly initialised ``AttnRes<Family>ForCausalLM`` for ``config`` (the family's own
    init; the residual's faithful one: zero queries, unit gains). A mixture of experts'
    ``output_router_logits`` is off by default: training forwards ask for the router logits
    (``training_forward_kwargs``), so that evaluation losses are the cross-entropy alone."""
    _, model_cls = upcycled_classes(config.hf_architecture)
    hf_config = hf_config_of(config)
    if getattr(hf_config, "output_router_logits", False):
        hf_config.output_router_logits = False
    return model_cls(hf_config)


def model_fields_of(hf_config: PretrainedConfig) -> dict[str, Any]:
    """The ``ModelConfig`` fields (a mapping) of a saved family model, plain or AttnRes:
    ``hf_architecture`` and the mapped fields, everything else of the family's config in
    ``hf_config`` (attributes the family's config does not define are dropped), the residual
    from an AttnRes config (a plain family model: the standard residual, which is the
    family's own function)."""
    data = hf_config.to_dict()
    family = data["model_type"].removeprefix(PREFIX)
    upcycled_classes(family)  # refuses unsupported families with the reason
    out: dict[str, Any] = {ours: data[hf] for ours, hf in FIELD_HF_NAMES.items() if hf in data}
    out["mlp_hidden"] = data["intermediate_size"]
    rope = data.get("rope_parameters") or {}
    if "rope_theta" in rope:
        out["rope_theta"] = float(rope["rope_theta"])
    out["residual"] = ResidualConfig.from_value(data.get("attnres_residual") or "standard").to_dict()
    out["hf_architecture"] = family
    # Only what the family's config defines is architecture: a loader may leave other attributes
    # in a saved config (transformers' GGUF loading: `_model_name_or_path`, `unk_token_id`),
    # which `check_hf_config` would refuse as misspelt fields.
    fields, aliases = _family_fields(family)
    extra = {k: v for k, v in data.items() if k not in _SKIPPED and k not in FIELD_HF_NAMES.values() and k != "rope_parameters"
             and (k in fields or k in aliases)}
    if set(rope) - {"rope_type", "rope_theta"} or rope.get("rope_type", "default") != "default":
        extra["rope_parameters"] = rope  # scaled RoPE (YaRN: GPT-OSS, Kimi K2) or partial rotation (GLM-4.5), kept whole
    if extra.get("head_dim") == out["d_model"] // out["n_heads"]:
        extra.pop("head_dim")
    out["hf_config"] = extra
    return out


def model_fields_from_directory(path: str) -> dict[str, Any]:
    """:func:`model_fields_of` the ``config.json`` in ``path`` (a plain family's, or an
    AttnRes one's: the families are registered first)."""
    register_families()
    return model_fields_of(AutoConfig.from_pretrained(path))
