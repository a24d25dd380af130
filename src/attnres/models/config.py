"""``ModelConfig``: the one validated description of an LM, and named presets."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..migrations import (FLAT_RESIDUAL_KEYS, accept_old_keys, migrate_model_keys, reading_stored, renamed_attribute,
                          stored_config)
from ..nn.residual import (ResidualConfig, build_residual, registered_residuals, residual_class,
                           validate_residual_config)
from ..nn.residual.config import VARIANT_FIELDS, merge_residual
from ..user_warning import warn_user
from ..validation import Choice, Converted, Fields, Nullable, did_you_mean, flatten, python_scalars

__all__ = ["ModelConfig", "ResidualConfig", "PRESETS", "HF_ARCHITECTURES", "READ_BY_SOME_KINDS", "read_quietly",
           "as_read_back", "read_back", "readers_in_words", "residual_fields_given", "residual_fields_stated", "stated",
           "warn_unread_residual_fields"]

#: ``transformers`` decoder families whose own modules an AttnRes model can be built from
#: (``ModelConfig.hf_architecture``; ``attnres.hf.families.FAMILIES`` describes their layouts).
HF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                    # mixtures of experts
                    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe",
                    "dots1", "ernie4_5_moe", "hunyuan_v1_moe", "minimax_m2", "phimoe", "granitemoe")

_CHECK = Fields("ModelConfig")

#: Residual fields that only some variants read (flattened; ``VARIANT_FIELDS``), those whose
#: class names them in ``reads_fields`` (Block AttnRes and its subclasses the block size, a
#: variant of the user's what it declares): to another variant the model is the same whatever
#: they hold.
READ_BY_SOME_KINDS = frozenset(f"residual.{name}" for name in VARIANT_FIELDS)


def residual_fields_given(spec: Any) -> set[str]:
    """The fields of :data:`VARIANT_FIELDS` that a model section (a config file's ``model``
    mapping with the overrides applied) gives a value: in ``residual`` or by the flat keys of
    earlier versions (``attnres_block_size``). ``null`` (the derived default) is not a value;
    nor is a default in a ``residual`` of every field (:func:`read_back`: a ``--print-config``
    dump used as a config file warned of its ``hc_streams: 4`` and ``sinkhorn_iters: 20``), whose
    fields are those other than the defaults, as a ``ResidualConfig``'s."""
    if not isinstance(spec, dict):
        return set()
    residual = spec.get("residual")
    if isinstance(residual, ResidualConfig):  # (preset("tiny", residual=ResidualConfig(...)) in Python)
        return _fields_set(residual)
    if read_back(residual):
        residual = {name: value for name, value in residual.items() if value != _RESIDUAL_DEFAULTS.get(name)}
    given = {name for name in VARIANT_FIELDS if isinstance(residual, dict) and residual.get(name) is not None}
    return given | {path[0] for key, path in FLAT_RESIDUAL_KEYS.items()
                    if path[0] in VARIANT_FIELDS and spec.get(key) is not None}


def read_back(residual: Any) -> bool:
    """Whether ``residual`` (a model's ``residual`` as given) is a mapping of every
    ``ResidualConfig`` field, as ``to_dict()``, a ``config.json`` and ``--print-config`` write it:
    in Python, a config read back (``ModelConfig(**config.to_dict())``, ``TrainConfig(model=
    config.to_dict())``), whose fields were warned of where it was stated, and which holds those
    no one wrote: the preset's block size under ``preset("tiny", residual="standard")``,
    ``hc_streams=4``. A mapping of every field written by hand is taken for one too, and not
    warned of: a user writes the fields they mean (an ``options`` and an ``ablation`` of their
    own besides). (A config file of every field is the user's file: :func:`residual_fields_given`
    counts its fields other than the defaults.)"""
    return isinstance(residual, dict) and _RESIDUAL_DEFAULTS.keys() <= residual.keys()


def residual_fields_stated(spec: Any) -> set[str]:
    """:func:`residual_fields_given` of a model section stated in Python (``preset(name,
    **overrides)``, ``TrainConfig(model={...})``, ``from_pretrained(dir, residual={...})``),
    without the fields of a residual mapping read back (:func:`read_back`); the flat keys of
    earlier versions given beside it are the user's. (A config file's are the file's:
    ``load_config`` takes :func:`residual_fields_given`.)"""
    if isinstance(spec, dict) and read_back(spec.get("residual")):
        spec = {k: v for k, v in spec.items() if k != "residual"}
    return residual_fields_given(spec)


def warn_unread_residual_fields(given: set[str], config: ModelConfig | ResidualConfig) -> None:
    """Warn once for each of ``given`` (:func:`residual_fields_given`) that ``config``'s variant
    does not read: ``residual.kind=attnres_full`` with ``residual.block_size=4`` trained as if
    the block size were not there. A warning, not a refusal: the field is kept in the run's
    config, and a run may be resumed as a variant that reads it (allow_residual_change).

    The one warning of it, given where the user states the config: ``ModelConfig(...)`` built
    in Python (the fields it holds other than their defaults; once per ``ResidualConfig``
    object, :data:`_SAID_UNREAD`: not again by ``dataclasses.replace(config, ...)``), ``preset(name, **overrides)``
    and ``TrainConfig(model={...})`` (the fields the overrides or the mapping give, not the
    preset's own: :func:`stated`), ``load_config`` (the config file's and the overrides'
    fields), ``attnres train`` (the same, checked against the config it trains: a resume
    without a config file the run's own), ``AttnResConfig(...)``, ``upcycle(...)`` and
    ``AttnResConfig.from_pretrained(dir, residual={...})`` (the keyword's fields). In Python, a
    residual mapping of every field is a config read back (``ModelConfig(**config.to_dict())``,
    ``TrainConfig(model=config.to_dict())``, ``AttnResConfig(**config.to_dict())``): none of its
    fields is the user's statement (:func:`read_back`).
    ``from_dict`` and ``replace`` say nothing (:func:`read_quietly`): they read stored configs
    and config files, and keep the fields a change of variant leaves, as documented.
    ``config``: a ``ModelConfig``, or the ``ResidualConfig`` alone (``upcycle``'s)."""
    residual = config.residual if isinstance(config, ModelConfig) else config
    kind = residual.kind
    for name in sorted(given - residual_class(kind).reads_fields):
        warn_user(f"model.residual.{name}={getattr(residual, name)!r} is read only by "
                  f"{readers_in_words(name, 'and') or 'no registered variant'}: residual.kind {kind!r} builds the "
                  f"same model whatever it holds, so it is not used (leave it out, or set model.residual.kind to "
                  f"{readers_in_words(name, 'or') or 'the variant that reads it'})")


def readers_in_words(name: str, conjunction: str) -> str:
    """The registered variants whose class reads residual field ``name`` (``reads_fields``),
    in words: ``hyper_connections, mhc and mhc_lite`` (``conjunction`` ``"and"``); ``""`` for none."""
    return _listed([k for k in registered_residuals() if name in residual_class(k).reads_fields], conjunction)


def _listed(names: list[str], conjunction: str) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return f" {conjunction} ".join(filter(None, (", ".join(names[:-1]), *names[-1:])))


# True within read_quietly, in its own thread (or asyncio task) only, as migrations.stored_config.
_reading: contextvars.ContextVar[bool] = contextvars.ContextVar("attnres_model_config_reading", default=False)


@contextlib.contextmanager
def read_quietly() -> Iterator[None]:
    """Within it, a ``ModelConfig`` built does not warn of the residual fields its variant does
    not read (``from_dict`` and what builds on it, ``TrainConfig.from_dict``): a stored config
    was warned of when its run started, a config file is by ``load_config`` (of the fields the
    user gave, which it knows), and ``preset("tiny", residual="standard")`` keeps the preset's
    block size as ``replace`` documents."""
    token = _reading.set(True)
    try:
        yield
    finally:
        _reading.reset(token)


def _read_back_in_python(residual: Any) -> bool:
    """Whether ``residual``, a model's ``residual`` as given, is a config read back in Python
    (:func:`read_back`: ``ModelConfig(**config.to_dict())``, ``TrainConfig(model=config.to_dict())``)
    and not a config file's (read within :func:`read_quietly`, where a mapping of every field is
    the file's: a ``--print-config`` dump of the user's)."""
    return read_back(residual) and not _reading.get()


def _as_read_back(again: bool) -> contextlib.AbstractContextManager:
    """Where ``again`` (:func:`_read_back_in_python`), checked as a stored config is
    (``migrations.stored_config``): Block AttnRes' single block was warned of where the config
    was stated, and its reading back said it again; marked said, without a word."""
    return stored_config() if again else contextlib.nullcontext()


def as_read_back(residual: Any) -> contextlib.AbstractContextManager:
    """What a config built of a model's ``residual`` as given is checked within: where it is
    read back in Python (:func:`_read_back_in_python`), as a stored config, its single block
    not said again (:func:`_as_read_back`). For the builders of a ``ModelConfig`` of their own
    fields (``AttnResConfig(**config.to_dict())``), which hand it a ``ResidualConfig``."""
    return _as_read_back(_read_back_in_python(residual))


def _quiet() -> bool:
    """Whether a config built now is not the user's statement: read within :func:`read_quietly`,
    or within ``migrations.stored_config()`` (a stored config, whose warnings were given when
    its run started: the deprecated keys' and the single block's too)."""
    return _reading.get() or reading_stored()


def stated(build: Callable[[], ModelConfig], given: set[str]) -> ModelConfig:
    """``build()``, a config the user states in Python over one of the package's
    (``preset("tiny", residual={"kind": "standard", "block_size": 4})``, ``TrainConfig(model={...})``),
    built within :func:`read_quietly` and then warned of the residual fields ``given`` (those
    the user wrote, not the preset's own) that its variant does not read, once. Within
    :func:`read_quietly` itself (a config file read by ``load_config``, which warns of its
    own) or a stored config's reading, nothing is said."""
    quiet = _quiet()
    with read_quietly():
        built = build()
    if not quiet:
        warn_unread_residual_fields(given, built)
    return built


def _fields_set(residual: ResidualConfig) -> set[str]:
    """The fields of :data:`VARIANT_FIELDS` that ``residual`` holds other than their defaults
    (``block_size=None`` the derived one, ``hc_streams=4``): those a ``ModelConfig(...)`` built
    in Python gave."""
    return {name for name in VARIANT_FIELDS if getattr(residual, name) != _RESIDUAL_DEFAULTS[name]}


#: The attribute a ``ResidualConfig`` holds once a ``ModelConfig`` of it was checked for the
#: residual fields its variant does not read (warned of, or read quietly): its kind and those
#: fields' values. Another ``ModelConfig`` built of the same object - ``dataclasses.replace(config,
#: n_layers=4)``, ``ModelConfig(residual=config.residual)`` - is no new statement: they warned of
#: the preset's own block size under ``preset("tiny", residual="standard")``. A field changed
#: since is (the mark no longer matches), as Block AttnRes' single-block mark.
_SAID_UNREAD = "_attnres_unread_said"


def _unread_checked(residual: ResidualConfig) -> tuple[Any, ...]:
    """What :data:`_SAID_UNREAD` records of ``residual``."""
    return (residual.kind, *(getattr(residual, name) for name in VARIANT_FIELDS))


@dataclass
class ModelConfig:
    """Configuration of :class:`attnres.AttnResLM`, a Llama-style decoder.

    Architecture: token embedding, ``n_layers`` transformer blocks (pre-norm attention with
    RoPE and grouped-query heads, pre-norm SwiGLU MLP), final RMSNorm, LM head. Each block
    holds two sublayers, so the residual mechanism sees ``L = 2 * n_layers`` sublayers.

    Fields: ``vocab_size``; ``d_model`` (the width ``d``); ``n_layers`` (transformer
    blocks); ``n_heads`` and ``n_kv_heads`` (key/value heads for grouped-query attention,
    ``None``: ``n_heads``); ``mlp_hidden`` (the SwiGLU width, ``None``: about ``8/3 d``
    rounded up to a multiple of 64); ``max_seq_len`` (the RoPE tables and the longest
    input); ``rope_theta``; ``norm_eps`` (every RMSNorm's epsilon); ``tie_embeddings`` (the
    LM head shares the embedding); ``init_std`` (the normal init of the weight matrices and
    the embedding); ``residual``, ``hf_architecture`` and ``hf_config`` below.
    ``ModelConfig.preset(name, **changes)`` starts from a named size (``PRESETS``).

    ``residual`` is a :class:`ResidualConfig`: the variant (``residual.kind``, any name in
    ``attnres.registered_residuals()``) and its settings (``block_size``, ``schedule``,
    ``backend``, the Table-4 ``ablation``, ...). It may be given as a ``ResidualConfig``, a
    mapping of its fields, or a variant name alone. ``replace`` and ``preset`` change only
    what they name: ``replace(residual="attnres_full")`` keeps the block size and the other
    settings, ``replace(residual={"block_size": 4})`` changes the block size only.

    The keys of earlier versions (the flat ``attnres_block_size=4``, ``hc_streams=...``;
    ``residual.impl`` / ``residual.kernels``) are still accepted, by the constructor,
    ``from_dict`` and as attributes, with a ``DeprecationWarning`` (:mod:`attnres.migrations`).

    ``hf_architecture``: build the decoder from a ``transformers`` family's own modules
    (``"llama"``, ``"qwen3"``, ... see ``HF_ARCHITECTURES``) with this residual, instead of
    the native one (:func:`attnres.models.build_model`); ``hf_config`` holds that family's
    config fields beyond the ones above (``head_dim``, biases, sliding windows, ...).
    """

    vocab_size: int = 8192
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int | None = None
    mlp_hidden: int | None = None
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02
    # (a mapping of its fields or a variant's name is converted by __post_init__)
    residual: Converted[ResidualConfig, ResidualConfig | dict[str, Any] | str] = dataclasses.field(
        default_factory=ResidualConfig)
    hf_architecture: str | None = None
    hf_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        given = self.residual  # (a mapping read back is no statement: ModelConfig(**config.to_dict()))
        self.residual = ResidualConfig.from_value(self.residual)
        with _as_read_back(_read_back_in_python(given)):
            self.validate()
        checked = _unread_checked(self.residual)
        said = vars(self.residual).get(_SAID_UNREAD) == checked  # (vars: ResidualConfig.__getattr__ answers old names)
        if not _quiet() and not read_back(given) and not said:  # (built in Python: the user's own statement)
            warn_unread_residual_fields(_fields_set(self.residual), self)
        vars(self.residual)[_SAID_UNREAD] = checked  # (after it: a warning raised as an error is raised again)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes that do not exist: the deprecated flat residual keys.
        return renamed_attribute(self, name, _FLAT_ATTRIBUTES, "ModelConfig")

    # -- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and the allowed values on bad input."""
        python_scalars(self)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            _CHECK.integer(name, getattr(self, name))
        _CHECK.integer("n_kv_heads", self.n_kv_heads, allow_none="= n_heads")
        _CHECK.integer("mlp_hidden", self.mlp_hidden, allow_none="8/3 d rounded up to 64")
        for name in ("rope_theta", "norm_eps", "init_std"):
            _CHECK.positive(name, getattr(self, name))
        _CHECK.boolean("tie_embeddings", self.tie_embeddings)
        own_head_dim = self.hf_architecture is not None and "head_dim" in (self.hf_config or {})
        if self.d_model % self.n_heads and not own_head_dim:  # a family model may set its head_dim (GPT-OSS)
            _CHECK.fail("d_model", f"divisible by n_heads={self.n_heads}", self.d_model)
        if (self.d_model // self.n_heads) % 2 and not own_head_dim:
            _CHECK.fail("d_model", f"such that the head dimension d_model / n_heads is even (RoPE); n_heads={self.n_heads} "
                        f"gives {self.d_model // self.n_heads}", self.d_model)
        if self.n_heads % self.kv_heads:
            divisors = [str(k) for k in range(1, self.n_heads + 1) if self.n_heads % k == 0]
            listed = " or ".join(filter(None, (", ".join(divisors[:-1]), divisors[-1])))
            _CHECK.fail("n_kv_heads", f"a divisor of n_heads={self.n_heads}: {listed} (or null: = n_heads)",
                        self.n_kv_heads)
        if not isinstance(self.residual, ResidualConfig):
            _CHECK.fail("residual", "a ResidualConfig, a mapping of its fields or a residual name", self.residual)
        validate_residual_config(self.residual, self.d_model, self.n_sublayers)
        _CHECK.rule("hf_architecture", Nullable(Choice(HF_ARCHITECTURES), "the native decoder"), self.hf_architecture)
        if not isinstance(self.hf_config, dict):
            _CHECK.fail("hf_config", "a mapping of the transformers family's config fields", self.hf_config)
        if self.hf_config and self.hf_architecture is None:  # the native decoder has none of them: unused
            _CHECK.fail("hf_config", "empty unless hf_architecture names the transformers family whose config fields "
                        "it holds; set model.hf_architecture, or leave hf_config out", self.hf_config)

    # -- derived quantities --------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        """The key/value heads: ``n_kv_heads``, or ``n_heads`` when it is ``None``."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """The width of one attention head, ``d_model // n_heads``."""
        return self.d_model // self.n_heads

    @property
    def hidden_size(self) -> int:
        """SwiGLU hidden size: ``mlp_hidden``, or ``8/3 * d_model`` rounded up to a multiple of 64."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    @property
    def n_sublayers(self) -> int:
        """``L = 2 * n_layers``: every attention and every MLP is one sublayer."""
        return 2 * self.n_layers

    def resolved_fields(self) -> dict[str, Any]:
        """The fields, flattened (``residual.kind``), as the model reads them: a ``None`` that
        stands for a value derived from other fields as that value (``n_kv_heads``,
        ``mlp_hidden``, ``residual.block_size``, ``residual.full_group_size``), and the fields
        of :data:`READ_BY_SOME_KINDS` only for a variant that reads them (its class's
        ``reads_fields``: Block AttnRes and a subclass of it registered as ``"my_block"``
        the block size, a variant of the user's what it declares). A field left unset and one
        spelled as what it resolves to give the same fields: the same model."""
        fields = flatten(self.to_dict())
        fields.update(n_kv_heads=self.kv_heads, mlp_hidden=self.hidden_size)
        fields["residual.block_size"] = self.residual.resolved_block_size(self.n_sublayers)
        fields["residual.full_group_size"] = self.residual.resolved_full_group_size(self.n_sublayers)
        reads = {f"residual.{name}" for name in residual_class(self.residual.kind).reads_fields}
        return {k: v for k, v in fields.items() if k not in READ_BY_SOME_KINDS - reads}

    def describe_residual(self) -> str:
        """The residual in words, as its variant describes it (e.g. ``attnres_block (S=2, N=2)``)."""
        return residual_class(self.residual.kind).describe(self.residual, self.n_sublayers)

    def build_residual(self):
        """The residual module this config describes (``attnres.nn.residual.ResidualStream``);
        build it under ``torch.device("meta")`` to ask it about its layout for free."""
        return build_residual(self.residual, self.d_model, self.n_sublayers)

    # -- (de)serialisation and presets ---------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields as a nested mapping (``residual`` too), as config.json stores them;
        ``from_dict`` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a mapping (``residual`` nested, or the deprecated flat keys); an
        unknown key raises ``ValueError`` listing the known ones."""
        if not isinstance(data, dict):
            raise ValueError(f"ModelConfig.from_dict takes a mapping of ModelConfig fields; got {data!r} (a preset by "
                             "name: ModelConfig.preset(name))")
        data = migrate_model_keys(data)
        _CHECK.known_keys(data, _FIELDS, SECTIONS)
        with read_quietly():
            return cls(**data)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated); ``residual`` changes only what it names, and
        so does ``hf_config`` where ``hf_architecture`` stays (a mapping in it, ``rope_parameters``,
        too, unless it names another ``rope_type``). A key is not removed so (``None`` is given to the
        family's config as ``None``, not its default): ``dataclasses.replace(config, hf_config={...})``
        sets the whole mapping.
        A copy whose residual and depth are this config's is not warned of a single block again
        (this config was, where it was made: ``replace(vocab_size=...)`` said it once more)."""
        changes = migrate_model_keys(changes)
        restated = changes.keys() & {"residual", "n_layers"}  # (what the single-block warning reads)
        with contextlib.nullcontext() if restated else stored_config():
            return self.from_dict(_merge(self.to_dict(), changes))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset (see ``PRESETS``), optionally with fields overridden (as ``replace``); a
        residual field the overrides give that their variant does not read is warned of.
        A name of :data:`RENAMED_PRESETS` gives its new preset, with a ``DeprecationWarning``."""
        if isinstance(name, str) and name in RENAMED_PRESETS:
            warn_user(f"model preset {name!r} is now called {RENAMED_PRESETS[name]!r} ({name!r} names the "
                      "`attnres compare` / `make demo` grid); the old name will be removed", DeprecationWarning)
            name = RENAMED_PRESETS[name]
        if not isinstance(name, str) or name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; available: {sorted(PRESETS)}")
        changes = migrate_model_keys(overrides)
        again = _read_back_in_python(overrides.get("residual"))  # (TrainConfig(model=config.to_dict()))

        def build() -> ModelConfig:
            with _as_read_back(again):
                return cls.from_dict(_merge(PRESETS[name], changes))

        # (the user's statement: the residual fields the overrides give are warned of, not the preset's block size)
        return stated(build, residual_fields_stated(overrides))


def require_model_config(config: Any, who: str) -> None:
    """Raise ``TypeError`` unless ``config`` is a :class:`ModelConfig`, saying how to make one
    (``who``: the callable given it; a mapping or a preset's name failed with "'dict' object
    has no attribute 'validate'")."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"{who} takes a ModelConfig, got {type(config).__name__}: build one with "
                        "ModelConfig(**fields), ModelConfig.from_dict(mapping) or ModelConfig.preset(name) (a "
                        "transformers AttnResConfig: config.to_model_config())")


_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
_RESIDUAL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ResidualConfig)}
#: The nested section's fields, named as such when given at the top level (``block_size=4``,
#: whose nearest top-level spelling, ``vocab_size``, was the hint).
SECTIONS = {"residual": [f.name for f in dataclasses.fields(ResidualConfig)]}
_FLAT_ATTRIBUTES = {key: ("residual", *path) for key, path in FLAT_RESIDUAL_KEYS.items()}
accept_old_keys(ModelConfig, migrate_model_keys, SECTIONS)


def _merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes``; the ``residual`` entry merged (see ``ModelConfig.replace``), and
    the ``hf_config`` one of the same architecture: ``model.from_hf=DIR model.hf_config.X=...``
    dropped every other field of the directory's family config (its activation, scaled RoPE,
    expert counts), building the family's defaults from its weights."""
    out = {**base, **changes}
    if "residual" in changes:
        out["residual"] = merge_residual(base.get("residual"), changes["residual"])
    same_architecture = changes.get("hf_architecture", base.get("hf_architecture")) == base.get("hf_architecture")
    if same_architecture and isinstance(changes.get("hf_config"), dict) and isinstance(base.get("hf_config"), dict):
        out["hf_config"] = _merge_hf_config(base["hf_config"], changes["hf_config"])
    return out


def _merge_hf_config(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``base`` (a family config's fields) with ``changes``, a mapping within it (``rope_parameters``)
    changed in the keys it names too: ``model.from_hf=DIR model.hf_config.rope_parameters.factor=8``
    replaced a YaRN directory's RoPE mapping with ``{factor: 8}``, which the family read as the
    default RoPE, without a word. A mapping naming another ``rope_type`` than the base's is a
    RoPE of another kind: its keys are that kind's, and it replaces the base's whole."""
    out = dict(base)
    for key, value in changes.items():
        old = base.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and value.get("rope_type", old.get("rope_type")) == \
                old.get("rope_type"):
            value = _merge_hf_config(old, value)
        out[key] = value
    return out


PRESETS: dict[str, dict[str, Any]] = {
    # Unit tests: a few milliseconds per forward.
    "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128,
                 residual={"block_size": 2}),
    # configs/train-cpu.yaml: a small model for a first training run on CPU.
    "train-cpu": dict(vocab_size=512, d_model=128, n_layers=4, n_heads=4, max_seq_len=256, residual={"block_size": 2}),
    # The core issue's CPU overhead benchmark: d=512, 8 transformer blocks, S=4 (N=4).
    "bench-cpu": dict(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, max_seq_len=256, residual={"block_size": 4}),
    # The inference benchmark shape: d=1024, 16 transformer blocks, S=4 (N=8).
    "bench-infer": dict(vocab_size=8192, d_model=1024, n_layers=16, n_heads=16, max_seq_len=2048,
                        residual={"block_size": 4}),
}

#: Presets renamed, old name -> new: ``demo`` was both this model and the main job's grid.
RENAMED_PRESETS: dict[str, str] = {"demo": "train-cpu"}
