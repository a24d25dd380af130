"""``AttnResConfig``: the Hugging Face config of an :class:`attnres.AttnResLM`.

Its fields *are* :class:`attnres.ModelConfig`'s - generated from that dataclass, with the
same names and defaults, so ``config.json`` reads like ``ModelConfig.to_dict()`` (the
residual settings nested under ``residual``) - plus the usual HF generation fields;
``attribute_map`` exposes the HF names (``hidden_size``, ``num_hidden_layers``, ...) that
generic code such as lm-evaluation-harness reads. A ``config.json`` written by an earlier
version, with flat residual keys (``attnres_block_size``, ...), still loads, migrated
without a warning (the user never wrote them); one without any residual settings, or whose
``model_type`` or ``architectures`` name another model, is refused
(:func:`attnres.models.saved_config.check_saved_config`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import types

from transformers import PretrainedConfig

from ..checkpoint.locate import refuse_loading_training_output
from ..models.config import ModelConfig, as_read_back, read_back, read_quietly, residual_fields_stated, stated
from ..models.saved_config import check_saved_config, config_source, naming_source
from ..migrations import FLAT_RESIDUAL_KEYS, migrate_model_keys, stored_config
from .families.layout import NATIVE_MODEL_TYPE
from .families.remote_code import SavesAutoMap
from .families.residual_module import NATIVE_KEY, naming_residual_module, saved_residual_module
from ..nn.residual.block import naming_block_size
from ..nn.residual.config import ResidualConfig, keep_marks, marks_of, merge_residual
from .families.build import FIELD_HF_NAMES

__all__ = ["AttnResConfig"]

_MODEL_FIELDS = [f.name for f in dataclasses.fields(ModelConfig)]
#: Fields with a mutable default (a factory): None in the HF config means ModelConfig's default.
_FACTORY_FIELDS = {f.name for f in dataclasses.fields(ModelConfig) if f.default_factory is not dataclasses.MISSING}
#: The transformers names of fields (``attribute_map``) that :meth:`AttnResConfig.to_dict` adds.
HF_NAMES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
#: A property ``attribute_map`` points at -> the field it reads and sets (:attr:`AttnResConfig.kv_heads`).
_PROPERTY_FIELDS = {"kv_heads": "n_kv_heads"}
#: The architectures a saved AttnResConfig may name.
ARCHITECTURES = ("AttnResForCausalLM", "AttnResModel")


class _AttnResConfigMethods(SavesAutoMap):
    """The behaviour of :class:`AttnResConfig` (its fields are generated below)."""

    RESIDUAL_MODULE_KEY = NATIVE_KEY
    # What was warned of this config's residual (nn.residual.config.marks_of: Block AttnRes'
    # single block, the fields its variant does not read, at the values said): to_model_config()
    # builds a new ResidualConfig each time, which warned again of what the user stated once
    # (AutoModelForCausalLM.from_config(config) twice, from_pretrained twice), or, read quietly,
    # said nothing of a field changed since. A slot, not an attribute: transformers' to_dict,
    # __eq__ and config.json read __dict__, and this is no field of the model.
    __slots__ = ("_said",)

    @classmethod
    def auto_classes(cls) -> tuple[str, dict[str, str]]:
        """What a saved directory's ``auto_map`` names (:class:`~attnres.hf.families.remote_code.SavesAutoMap`)."""
        return "attnres.hf", {"AutoConfig": "AttnResConfig", "AutoModel": "AttnResModel",
                              "AutoModelForCausalLM": "AttnResForCausalLM"}

    def residual_kind(self) -> str:
        return self.residual["kind"]

    def __post_init__(self, **kwargs) -> None:
        # (a ResidualConfig given, from_model_config's native one, was warned of where it was stated)
        self._said = marks_of(self.residual) if isinstance(self.residual, ResidualConfig) else {}
        module = saved_residual_module(kwargs, NATIVE_KEY)
        legacy = {k: kwargs.pop(k) for k in list(kwargs) if k in FLAT_RESIDUAL_KEYS}
        # (before it is completed: AttnResConfig(**config.to_dict()) is a config read back, whose residual fields - the
        # preset's block size under residual="standard" - were warned of where it was stated, if they were the user's)
        read = read_back(self.residual) and not legacy
        # (and read back in Python, not from_dict's config.json: its single block was said where it was stated, and
        # AttnResConfig(**config.to_dict()) said it again - from_pretrained(dir) says it once, as a load of the export)
        again = as_read_back(self.residual if read else None)
        _check_extra_keys(self, kwargs)
        if legacy:
            self.residual = migrate_model_keys({"residual": self.residual, **legacy}, "AttnResConfig")["residual"]
        merged = merge_residual(None, self.residual or {})
        # (ResidualConfig refuses a kind not registered here: named with the module config.json records)
        with naming_residual_module(module, merged.get("kind", ResidualConfig.kind), NATIVE_KEY):
            self.residual = ResidualConfig.from_value(merged).to_dict()
        if self.tie_word_embeddings is None:
            self.tie_word_embeddings = self.tie_embeddings
        elif self.tie_word_embeddings != self.tie_embeddings:
            raise ValueError(
                f"tie_word_embeddings={self.tie_word_embeddings} contradicts tie_embeddings={self.tie_embeddings}; "
                "set tie_embeddings (the attnres field) only"
            )
        super().__post_init__(**kwargs)
        with naming_residual_module(module, self.residual["kind"], NATIVE_KEY), \
                read_quietly() if read else contextlib.nullcontext(), again:
            # (validates every field, naming the bad one; built as ModelConfig(...) is, it warns of a residual field
            # its variant does not read, as the user's statement - from_dict's config.json and from_model_config's
            # native config, read quietly, were warned of where they were stated)
            self._native()

    @property
    def kv_heads(self) -> int:
        """The key/value heads (``num_key_value_heads``, the transformers name): ``n_kv_heads``,
        or ``n_heads`` where it is None. Readers of the transformers name want a count, as
        every transformers config of a family gives: vLLM takes the attribute whenever the
        config has it, and an export's None (as many heads as ``n_heads``, the presets'
        default) stopped ``vllm serve`` with a validation error about ``total_num_kv_heads``."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @kv_heads.setter
    def kv_heads(self, value: int | None) -> None:
        self.n_kv_heads = value

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """As ``PretrainedConfig.from_pretrained``, naming the directory in the refusals of
        :meth:`from_dict`."""
        refuse_loading_training_output(pretrained_model_name_or_path)
        kwargs.setdefault("name_or_path", str(pretrained_model_name_or_path))
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """As ``PretrainedConfig.from_dict`` (what every loader calls with a ``config.json``'s
        contents), refusing a config without residual settings or naming another model.
        A stored residual ``backend="triton"`` (a ``save_pretrained`` of a model trained on
        a GPU) is read as ``"auto"``: the same function, whose implementation is picked by
        device - the Triton kernels on CUDA - where ``"triton"`` failed the first forward on a
        CPU; ``residual={"backend": "triton"}`` among the ``kwargs`` keeps it.
        The keys of earlier versions a ``config.json`` stores (an old export's flat
        ``attnres_block_size``, ...) are migrated without a warning: the user never wrote
        them. Flat residual keys among the ``kwargs`` (``from_pretrained(dir,
        attnres_block_size=2)``, the user's own) join the stored fields, which migrate them
        with a ``DeprecationWarning``, instead of reaching the model's ``__init__``. A
        ``residual`` among the ``kwargs`` changes what it names of the stored residual, as :meth:`attnres.ModelConfig.replace` does (``residual={"backend": "torch"}``
        keeps the kind and the block size; ``residual="attnres_full"`` the block size). The
        stored config is read quietly (:func:`~attnres.models.config.read_quietly`); a residual
        field the ``kwargs`` give that the variant does not read is warned of, once."""
        legacy = {k: kwargs.pop(k) for k in list(kwargs) if k in FLAT_RESIDUAL_KEYS}
        flat = legacy or any(k in FLAT_RESIDUAL_KEYS for k in config_dict)  # residual settings of earlier versions
        source = config_source(kwargs)
        check_saved_config(config_dict, model_type=cls.model_type, architectures=ARCHITECTURES,
                           required={"residual": "the AttnRes residual settings: kind, block_size, ..."},
                           source=source, given=[*kwargs, *(["residual"] if flat else [])])
        with stored_config():  # (an old export's spellings: no warning about what it stores)
            stored = {**migrate_model_keys(config_dict, "AttnResConfig"), **legacy}
        stored = _stored_backend_runnable(stored)
        # (the residual fields the kwargs give are the user's statement: from_pretrained(dir, residual={"block_size":
        # 8}) of a Full AttnRes export loaded as if S were not there, read quietly with the stored config.json)
        given = residual_fields_stated({"residual": kwargs.get("residual"), **legacy})
        if "residual" in kwargs:  # (transformers sets a kwarg as the whole attribute, unchecked: the stored block
            # size went back to its default without a word, into weights of the same shapes, or a KeyError 'kind')
            stored["residual"] = merge_residual(stored.get("residual"), kwargs.pop("residual"))
        with read_quietly():  # (a stored config.json: its residual fields were warned of when it was stated)
            config = naming_source(source, lambda: super(_AttnResConfigMethods, cls).from_dict(stored, **kwargs))
        if isinstance(config, tuple):  # (from_pretrained's kwargs that are no field go on to the model's __init__, which
            # takes none: "unexpected keyword argument 'rope_scaling'"; a near miss or an option the decoder lacks is named)
            _check_extra_keys(*config)
        if given:
            stated(config[0].to_model_config if isinstance(config, tuple) else config.to_model_config, given)
        return config

    def to_dict(self) -> dict:
        """As ``PretrainedConfig.to_dict``, with the transformers names of :data:`HF_NAMES`
        added: tools that read a config as a dict look for them (PEFT's prompt and prefix
        tuning size their prompts by ``num_attention_heads`` and ``num_key_value_heads``).
        ``n_kv_heads=None`` (as many as ``n_heads``) adds no ``num_key_value_heads``, which
        such tools then take as ``num_attention_heads``."""
        names = {alias: getattr(self, alias) for alias in HF_NAMES}
        names["num_key_value_heads"] = self.n_kv_heads  # None stays out: it loads back as None, not as n_heads
        return {**super().to_dict(), **{alias: value for alias, value in names.items() if value is not None}}

    def to_diff_dict(self) -> dict:
        """What ``config.json`` holds: the fields under their attnres names only (an HF name
        there would be a second copy of a field, which a hand edit could make disagree)."""
        return {k: v for k, v in super().to_diff_dict().items() if k not in HF_NAMES}

    def to_model_config(self) -> ModelConfig:
        """The native :class:`attnres.ModelConfig` (raises ``ValueError`` on a bad field). Its
        single block and the residual fields its variant does not read are not warned of again
        where this config was; a field changed since is (``config.residual["block_size"] = 4``
        of a Full AttnRes config: read quietly, it was built as if S were not there)."""
        return self._native()

    def _native(self) -> ModelConfig:
        """:meth:`_checked` of the ``ModelConfig`` this config holds, its single block warned of
        naming the field as written here (``AttnResConfig(residual={"block_size": 4})``)."""
        with naming_block_size(f"{type(self).__name__}.residual['block_size']"):
            return self._checked(ModelConfig(**self._model_fields()))

    def _model_fields(self) -> dict:
        """The :class:`attnres.ModelConfig` fields this config holds; ``residual`` as a
        ``ResidualConfig`` that keeps what was warned of this config (:meth:`_checked`)."""
        fields = {name: getattr(self, name) for name in _MODEL_FIELDS}
        fields = {k: v for k, v in fields.items() if not (k in _FACTORY_FIELDS and v is None)}
        if "residual" in fields:
            fields["residual"] = residual = ResidualConfig.from_value(merge_residual(None, fields["residual"]))
            keep_marks(residual, getattr(self, "_said", {}))
        return fields

    def _checked(self, native: ModelConfig) -> ModelConfig:
        """``native`` (built of :meth:`_model_fields`), whose warnings, given or not, this
        config keeps for the next one built."""
        self._said = marks_of(native.residual)
        return native

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs) -> AttnResConfig:
        """Build from a native config; ``kwargs`` set HF fields (e.g. ``eos_token_id``)."""
        with read_quietly():  # (the native config was warned of where it was stated: its residual keeps the mark)
            return cls(**{**config.to_dict(), "residual": config.residual}, **kwargs)


def _stored_backend_runnable(stored: dict) -> dict:
    """``stored`` (a ``config.json``'s fields) with a residual ``backend="triton"`` as
    ``"auto"`` (see :meth:`AttnResConfig.from_dict`): the backend names the implementation of
    one function, not the weights, and a loader cannot tell yet on which device the model
    will run. (A native checkpoint's loader knows it, and warns: ``runnable_backend``.)"""
    residual = stored.get("residual")
    if not isinstance(residual, dict) or residual.get("backend") != "triton":
        return stored
    return {**stored, "residual": {**residual, "backend": "auto"}}


def _check_extra_keys(config, extra: dict) -> None:
    """Refuse what ``PretrainedConfig`` would keep silently as an extra attribute while the
    model is built with the default: a near miss of a field or of an HF name (``d_modle=64``,
    ``num_hidden_layer=2``), an HF name that is no alias here (a Llama config's
    ``intermediate_size``), and an HF name that contradicts its field (``hidden_size=64,
    d_model=128``: the alias won)."""
    defaults = ModelConfig()
    for alias, target in config.attribute_map.items():
        name = _PROPERTY_FIELDS.get(target, target)
        if alias in extra and getattr(config, name) not in (getattr(defaults, name), extra[alias]):
            raise ValueError(f"AttnResConfig: {alias}={extra[alias]!r} (the HF name of {name}) contradicts "
                             f"{name}={getattr(config, name)!r}; set {name} only")
    unaliased = {hf: name for name, hf in FIELD_HF_NAMES.items() if hf != name and hf not in config.attribute_map}
    for key in extra:
        _check_absent_option(config, key, extra[key])
        if key in unaliased:
            raise ValueError(f"AttnResConfig: {key} is the transformers name of {unaliased[key]}, which the config "
                             f"takes under its own name only: set {unaliased[key]}={extra[key]!r}")
        if key in config.attribute_map or hasattr(PretrainedConfig, key) or key.endswith("_token_id"):
            continue
        near = difflib.get_close_matches(key, [*_MODEL_FIELDS, *config.attribute_map], n=1, cutoff=0.8)
        if near:
            raise ValueError(f"AttnResConfig got an unknown field {key!r} - did you mean {near[0]!r}? The fields are "
                             f"ModelConfig's: {', '.join(_MODEL_FIELDS)}")


#: transformers architecture options the native decoder does not have, with what it does
#: instead: the value it matches is accepted (a Llama config's defaults), another one refused.
_ABSENT_OPTIONS = {
    "hidden_act": (lambda c, v: v == "silu", lambda c: "its MLP is SwiGLU: 'silu'"),
    "attention_bias": (lambda c, v: v is False, lambda c: "its projections have no bias: False"),
    "mlp_bias": (lambda c, v: v is False, lambda c: "its projections have no bias: False"),
    "attention_dropout": (lambda c, v: v == 0, lambda c: "it has no dropout: 0.0"),
    "sliding_window": (lambda c, v: v is None, lambda c: "its attention is global: None"),
    "head_dim": (lambda c, v: v in (None, c.d_model // c.n_heads),
                 lambda c: f"its heads are d_model // n_heads: {c.d_model // c.n_heads}"),
    "rope_scaling": (lambda c, v: v is None, lambda c: f"its RoPE is unscaled, of base rope_theta={c.rope_theta}: None"),
    "rope_parameters": (lambda c, v: v is None or (v.get("rope_type", "default") == "default"
                                                   and v.get("rope_theta", c.rope_theta) == c.rope_theta),
                        lambda c: f"its RoPE is unscaled, of base rope_theta={c.rope_theta}: rope_type 'default'"),
}


def _check_absent_option(config, key: str, value) -> None:
    """Refuse a transformers option the native decoder does not have (kept as an extra
    attribute, the model would be built without it: ``head_dim=8`` gave heads of
    ``d_model // n_heads``, ``rope_parameters`` with a scaling unscaled RoPE)."""
    accepts, does = _ABSENT_OPTIONS.get(key, (None, None))
    if accepts is not None and not accepts(config, value):
        raise ValueError(f"AttnResConfig: {key}={value!r} is an option the AttnRes decoder does not have "
                         f"({does(config)}); drop it. A transformers family's decoder takes its own options in "
                         "hf_config, with hf_architecture")


def _body(ns: dict) -> None:
    annotations, defaults = {}, ModelConfig()
    for f in dataclasses.fields(ModelConfig):
        factory = f.name in _FACTORY_FIELDS  # residual, hf_config: None = ModelConfig's default
        annotations[f.name] = "dict | str | None" if factory else f.type
        ns[f.name] = None if factory else getattr(defaults, f.name)
    annotations.update(use_cache="bool", tie_word_embeddings="bool | None", pad_token_id="int | None",
                       bos_token_id="int | None", eos_token_id="int | list[int] | None")
    ns.update(use_cache=True, tie_word_embeddings=None, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    ns.update(
        __annotations__=annotations,
        __module__=__name__,
        __qualname__="AttnResConfig",
        __doc__="HF config with the fields of :class:`attnres.ModelConfig` (same names, same defaults, validated "
        "by ``ModelConfig`` when the config is built).",
        model_type=NATIVE_MODEL_TYPE,
        # (the Trainer's evaluation gathers every other output: the cache's name from transformers 5.24 on, and before)
        keys_to_ignore_at_inference=["cache", "past_key_values"],
        attribute_map={
            "hidden_size": "d_model",
            "num_hidden_layers": "n_layers",
            "num_attention_heads": "n_heads",
            "num_key_value_heads": "kv_heads",
            "max_position_embeddings": "max_seq_len",
            "initializer_range": "init_std",
        },
    )


AttnResConfig = types.new_class("AttnResConfig", (_AttnResConfigMethods, PretrainedConfig), exec_body=_body)
