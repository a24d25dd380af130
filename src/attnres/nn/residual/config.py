"""``ResidualConfig``: which residual variant a model uses, and its settings.

``ModelConfig.residual`` holds one of these. In YAML and JSON it is a mapping::

    residual:
      kind: attnres_block      # any registered variant (attnres.registered_residuals())
      block_size: 4

or just the variant's name (``residual: standard``), which keeps every other setting.
The keys of earlier versions (``impl``, ``kernels``, the flat ``attnres_*`` keys) still load,
with a ``DeprecationWarning``: :mod:`attnres.migrations` migrates them.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

from ...migrations import RESIDUAL_RENAMES, accept_old_keys, migrate_residual_keys, renamed_attribute
from ...ops.depth_attention import BACKENDS
from ...validation import Fields, python_scalars
from .kinds import residual_class

__all__ = [
    "AttnResAblation",
    "ResidualConfig",
    "SCHEDULES",
    "BACKENDS",
    "VARIANT_FIELDS",
    "default_full_group_size",
]

#: The schedules of Full and Block AttnRes: the fast two-phase one and the per-sublayer reference.
SCHEDULES = ("two_phase", "naive")

#: The fields of :class:`ResidualConfig` that only some variants build from (Block AttnRes the
#: block size, Full AttnRes its Appendix-B group, Hyper-Connections, mHC and mHC-lite their
#: streams, mHC its Sinkhorn iterations): a variant names those it reads in
#: ``ResidualStream.reads_fields``, and to any other the model is the same whatever they hold.
VARIANT_FIELDS = ("block_size", "full_group_size", "hc_streams", "sinkhorn_iters")


@dataclass(frozen=True)
class AttnResAblation:
    """The AttnRes ablations of the report's Table 4; all off by default (= AttnRes).

    input_dependent_query: the query is ``w_l + W_l RMSNorm(x)`` with ``x`` the most recent
        source (Full: the previous sublayer's output; Block: the partial sum, or the last
        block at a block's first sublayer) and ``W_l`` a ``d x d`` projection, zero at init.
    input_independent_mixing: query and keys replaced by one learned scalar per source
        (zero at init: uniform weights).
    sigmoid_weights: unnormalised sigmoid weights instead of the softmax.
    key_norm: ``False`` uses raw keys (no RMSNorm).
    heads: multihead depth attention with ``H`` channel groups (``None``: single head).
    window: Full AttnRes only: the embedding plus the ``W`` most recent outputs.

    Any ablation runs on the naive path (the two-phase schedule needs input-independent
    queries and a softmax).
    """

    input_dependent_query: bool = False
    input_independent_mixing: bool = False
    sigmoid_weights: bool = False
    key_norm: bool = True
    heads: int | None = None
    window: int | None = None

    @property
    def active(self) -> bool:
        """Whether any ablation is on (the model then differs from AttnRes)."""
        return self != AttnResAblation()

    def validate(self, dim: int, prefix: str = "ModelConfig.residual.ablation") -> None:
        """Raise ``ValueError`` naming the field (under ``prefix``) and its allowed values, for a
        model of width ``dim``."""
        python_scalars(self)
        check = Fields(prefix)
        for name in ("input_dependent_query", "input_independent_mixing", "sigmoid_weights", "key_norm"):
            check.boolean(name, getattr(self, name))
        check.integer("heads", self.heads, allow_none="single head")
        if self.heads is not None and dim % self.heads:
            check.fail("heads", f"a divisor of d_model={dim}", self.heads)
        check.integer("window", self.window, allow_none="no window")
        if self.input_dependent_query and self.input_independent_mixing:
            check.fail("input_independent_mixing", "False when input_dependent_query is True (they exclude each other)", True)


def default_full_group_size(n_sublayers: int) -> int:
    """Full AttnRes' Appendix-B scheduling group where none is given: ``round(sqrt(L))``, at least 1."""
    return max(1, round(n_sublayers**0.5))


@dataclass
class ResidualConfig:
    """The residual mechanism of a model.

    kind: a registered variant: ``"standard"`` (PreNorm baseline), ``"attnres_full"``,
        ``"attnres_block"`` (default), the baselines (``"rezero"``, ``"layerscale"``,
        ``"highway"``, ``"denseformer"``, ``"hyper_connections"``, ``"mhc"``, ``"mhc_lite"``)
        or any variant registered with :func:`attnres.register_residual` (before the config
        is built: another name is refused as it is given).
    block_size: Block AttnRes ``S`` **in sublayers** (a transformer block is 2 sublayers);
        ``None`` picks ``ceil(L / 8)``, about 8 blocks as the report recommends.
    schedule: ``"two_phase"`` (the fast schedule, default) or ``"naive"`` (the per-sublayer
        reference). Same function, same weights.
    backend: the implementation of the two-phase schedule's operators
        (:mod:`attnres.ops.depth_attention`): ``"auto"`` (by device: the C kernel for CPU
        float32 / float64 tensors, the Triton kernels for CUDA tensors when triton is
        installed, the PyTorch implementation otherwise), ``"triton"``, ``"torch"`` (the
        PyTorch implementation of the same custom operators) or ``"reference"`` (their
        readable reference as a plain autograd graph, no custom operators).
    eps: epsilon of the RMSNorm on the depth-attention keys.
    recompute_phase1: Full and Block AttnRes' two-phase schedule in eager training: each
        merge saves the recipe of its Phase-1 weighted sum instead of the sum, and the
        backward runs each Phase 1 again, once per block (or group) - one ``[tokens, d]``
        tensor per sublayer less to keep, about a standard model's memory (``True``,
        default; same values). ``False`` keeps the sums. Memory only, not a model change.
    autocast_stream: under autocast (``TrainConfig.dtype="bfloat16"``), store the residual
        stream in the autocast dtype: the embedding, the running sums, AttnRes' block sums and
        every sublayer input, and their gradients. By default (``False``) the stream keeps
        the embedding's float32 and each bf16 sublayer output is added in float32; ``True``
        halves the bytes of the stream, which Block AttnRes reads at every sublayer on a
        GPU (by a byte count, its traffic at the bandwidth bound falls from about 3 % of a
        standard step to 1.5 %). Its effect on the loss is measured in docs/kernels.md ("A
        bf16 stream"). Nothing changes outside
        autocast; FSDP2's bf16 parameters (``dtype="bfloat16"`` on several data-parallel
        ranks) give a bf16 stream either way. A rounding choice, not a model change: the
        parameters and checkpoints are the same. For GPUs: on the CPU, the C kernel takes
        float32 and float64 sources, and a bf16 stream runs the slower PyTorch implementation.
    autocast_norm_output: under autocast, each sublayer's RMSNorm returns the autocast dtype
        (``RMSNorm.autocast_output``): its output rounded once, as the linear layers reading
        it would round it, instead of by each of them - a float32 stream's sublayer input is
        otherwise rounded again by the q, k and v projections (the MLP's gate and up), and
        their input gradients converted back and added in float32. AttnRes' merges write the
        rounded value directly and read its gradient as it comes. The same forward values;
        the projections' input gradients add up in the autocast dtype. Off by default; with
        ``autocast_stream`` the norms' outputs have that dtype already. A rounding choice,
        not a model change.
    autocast_phase1_sums: under autocast, Full and Block AttnRes' two-phase schedule stores
        Phase 1's weighted sums (report §4.2) in the autocast dtype, and their gradients: each
        is written once, read by its sublayer's merge (twice with the backward), its gradient
        written and read once - on a GPU about two thirds of the bytes Block AttnRes adds to
        a training step at a float32 stream (docs/kernels.md), half of them saved. The stream
        itself keeps its dtype; a sublayer's input is formed from its sum rounded to bf16,
        which its linear layers round to bf16 anyway. Off by default; needs the two-phase
        schedule of an AttnRes variant. A rounding choice, not a model change. For GPUs:
        Block AttnRes' merges read the narrower sums as they are (at a ``d`` that is a
        multiple of 16); the merges over more sources (Full AttnRes) convert them first.
    full_group_size: Appendix-B scheduling group of Full AttnRes' two-phase path; ``None`` =
        ``round(sqrt(L))``. Scheduling only, not a model change.
    ablation: the Table-4 ablations (:class:`AttnResAblation`), off by default.
    hc_streams: ``m``, the residual streams of Hyper-Connections, mHC and mHC-lite (4).
    sinkhorn_iters: Sinkhorn-Knopp iterations of mHC (20).
    options: keyword arguments for a variant registered from user code (its
        ``from_config`` receives them); built-in variants take none.
    """

    kind: str = "attnres_block"
    block_size: int | None = None
    schedule: str = "two_phase"
    backend: str = "auto"
    eps: float = 1e-6
    recompute_phase1: bool = True
    autocast_stream: bool = False
    autocast_norm_output: bool = False
    autocast_phase1_sums: bool = False
    full_group_size: int | None = None
    ablation: AttnResAblation = field(default_factory=AttnResAblation)
    hc_streams: int = 4
    sinkhorn_iters: int = 20
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A kind that is not registered is refused here, as ModelConfig refuses it, not first
        # where a model is built of this config (the variant's module is imported before).
        residual_class(self.kind)
        if isinstance(self.ablation, dict):
            Fields("ModelConfig.residual.ablation").known_keys(self.ablation, _ABLATION_FIELDS)
            self.ablation = AttnResAblation(**self.ablation)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes that do not exist: the renamed ``impl`` and ``kernels``.
        return renamed_attribute(self, name, _RENAMED_ATTRIBUTES, "ResidualConfig")

    def check_fields(self, dim: int) -> None:
        """Raise ``ValueError`` naming the field and the allowed values on a bad field value.
        What only the variant knows (is ``kind`` registered, does it accept these settings)
        :func:`attnres.nn.residual.validate_residual_config` checks on top. NumPy scalars
        (``block_size=np.int64(4)``) become the Python numbers they hold first."""
        python_scalars(self)
        check = Fields("ModelConfig.residual")
        check.integer("block_size", self.block_size, allow_none="about 8 blocks")
        check.choice("schedule", self.schedule, SCHEDULES)
        check.choice("backend", self.backend, BACKENDS)
        check.positive("eps", self.eps)
        check.boolean("recompute_phase1", self.recompute_phase1)
        check.boolean("autocast_stream", self.autocast_stream)
        check.boolean("autocast_norm_output", self.autocast_norm_output)
        check.boolean("autocast_phase1_sums", self.autocast_phase1_sums)
        check.integer("full_group_size", self.full_group_size, allow_none="round(sqrt(L))")
        if not isinstance(self.ablation, AttnResAblation):
            check.fail("ablation", "a mapping of AttnResAblation fields", self.ablation)
        self.ablation.validate(dim)
        check.integer("hc_streams", self.hc_streams)
        check.integer("sinkhorn_iters", self.sinkhorn_iters)
        if not isinstance(self.options, dict) or not all(isinstance(k, str) for k in self.options):
            check.fail("options", "a mapping of option names to values", self.options)

    def resolved_block_size(self, n_sublayers: int) -> int:
        """Block AttnRes' ``S``: ``block_size``, or ``ceil(L / 8)`` (at least 1)."""
        if self.block_size is not None:
            return self.block_size
        return max(1, -(-n_sublayers // 8))

    def resolved_full_group_size(self, n_sublayers: int) -> int:
        """Full AttnRes' Appendix-B group: ``full_group_size``, or :func:`default_full_group_size`;
        at most ``L`` (a larger group is one group of all ``L`` sublayers, as ``FullAttnRes``
        keeps it: the resolved config said the 10 given for 4 sublayers)."""
        size = default_full_group_size(n_sublayers) if self.full_group_size is None else self.full_group_size
        return min(size, n_sublayers)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a mapping (``ablation`` nested), as ``ModelConfig.to_dict`` stores them."""
        return dataclasses.asdict(self)

    @classmethod
    def from_value(cls, value: Any) -> ResidualConfig:
        """A ``ResidualConfig`` from one, from a mapping of its fields, or from a name (the kind)."""
        if isinstance(value, ResidualConfig):
            return value
        if isinstance(value, str):
            return cls(kind=value)
        if isinstance(value, dict):
            value = migrate_residual_keys(value)
            Fields("ModelConfig.residual").known_keys(value, _FIELDS, {"options": _own_options(value.get("kind"))})
            return cls(**value)
        raise ValueError(f"ModelConfig.residual must be a residual name, a mapping of ResidualConfig fields or a "
                         f"ResidualConfig; got {value!r}")


_FIELDS = {f.name for f in dataclasses.fields(ResidualConfig)}


def _own_options(kind: Any) -> list[str]:
    """The keyword arguments of the ``__init__`` of ``kind``, a variant of the user's own: its
    ``options``. One given beside ``kind`` (``{"kind": "scaled", "init": 0.5}``) was refused as
    an unknown key, the nearest field named; it is named as ``options.init``. (Built-in variants
    take their settings as fields, and no options.)"""
    try:
        variant = residual_class(kind)
    except ValueError:  # (a kind not registered is refused, naming the registered ones, by the config)
        return []
    if variant.builtin():
        return []
    params = list(inspect.signature(variant.__init__).parameters.values())[3:]  # after self, dim, n_sublayers
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
_ABLATION_FIELDS = {f.name for f in dataclasses.fields(AttnResAblation)}

_RENAMED_ATTRIBUTES = {old: (new,) for old, new in RESIDUAL_RENAMES.items()}
accept_old_keys(ResidualConfig, migrate_residual_keys)


def marks_of(config: ResidualConfig) -> dict[str, Any]:
    """What the checks of ``config`` noted on the object beyond its fields: Block AttnRes'
    single block and ``ModelConfig``'s residual fields its variant does not read, each with
    the values it was warned of (or read quietly at), so that a field changed since is warned
    again. For a config that builds another ``ResidualConfig`` of the same statement (the
    Hugging Face ``AttnResConfig``, whose ``to_model_config()`` builds a new one each time),
    to hand on with :func:`keep_marks`."""
    return {k: v for k, v in vars(config).items() if k not in _FIELDS}


def keep_marks(config: ResidualConfig, marks: dict[str, Any]) -> None:
    """Note on ``config`` the ``marks`` (:func:`marks_of`) of the config it was built from."""
    vars(config).update(marks)


def residual_as_dict(value: Any) -> dict[str, Any]:
    """``value`` (a name, a mapping or a ``ResidualConfig``) as a nested mapping, for merging."""
    if isinstance(value, ResidualConfig):
        return value.to_dict()
    if isinstance(value, str):
        return {"kind": value}
    if isinstance(value, dict):
        out = dict(value)
        if isinstance(out.get("ablation"), AttnResAblation):
            out["ablation"] = dataclasses.asdict(out["ablation"])
        return out
    return ResidualConfig.from_value(value).to_dict()  # raises the error naming the field


def merge_residual(base: Any, change: Any) -> dict[str, Any]:
    """``change`` applied to ``base``: a name changes the kind only, a mapping the fields it
    names (its ``ablation`` mapping likewise), a ``ResidualConfig`` replaces everything."""
    if isinstance(change, ResidualConfig):
        return change.to_dict()
    merged = residual_as_dict(base) if base is not None else {}
    for key, value in residual_as_dict(change).items():
        if key == "ablation" and isinstance(merged.get("ablation"), dict) and isinstance(value, dict):
            value = {**merged["ablation"], **value}
        merged[key] = value
    return merged
