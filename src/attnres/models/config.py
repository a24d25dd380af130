"""``ModelConfig``: the one validated description of an LM, and named presets."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..nn.residual import IMPLEMENTATIONS, KERNEL_BACKENDS, AttnResAblation

RESIDUALS = ("standard", "attnres_full", "attnres_block")
#: Baselines of the report's comparisons (spec §7), see ``attnres.nn.baselines``.
BASELINES = ("rezero", "layerscale", "highway", "denseformer", "hyper_connections", "mhc", "mhc_lite")


def _fail(name: str, allowed: str, value: Any) -> None:
    raise ValueError(f"ModelConfig.{name} must be {allowed}; got {value!r}")


def _check_int(name: str, value: Any, minimum: int = 1, allow_none: bool = False, none_means: str = "") -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = f" or None ({none_means})" if allow_none else ""
        _fail(name, f"an integer >= {minimum}{extra}", value)


def _check_float(name: str, value: Any, positive: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (positive and value <= 0):
        _fail(name, "a finite number > 0" if positive else "a finite number", value)


@dataclass
class ModelConfig:
    """Configuration of :class:`attnres.AttnResLM`, a Llama-style decoder.

    Architecture: token embedding, ``n_layers`` transformer blocks (pre-norm attention with
    RoPE and grouped-query heads, pre-norm SwiGLU MLP), final RMSNorm, LM head. Each block
    holds two sublayers, so the residual mechanism sees ``L = 2 * n_layers`` sublayers.

    Residual fields:
        residual: ``"standard"`` (PreNorm baseline), ``"attnres_full"`` or ``"attnres_block"``.
        attnres_block_size: ``S``, the Block AttnRes block size **in sublayers** (a
            transformer block is 2 sublayers); ``None`` picks ``ceil(L / 8)``, i.e. about
            8 blocks as the report recommends. The last block may be shorter.
        attnres_impl: ``"two_phase"`` (the fast schedule, default) or ``"naive"`` (the
            per-sublayer reference the tests compare against). Same function, same weights.
        attnres_full_group_size: Appendix-B scheduling group of Full AttnRes' two-phase
            path; ``None`` = ``round(sqrt(L))``. Scheduling only, not a model change.
        attnres_eps: epsilon of the RMSNorm on the depth-attention keys.
        attnres_kernels: backend of the two-phase path: ``"auto"`` (fused Triton kernels for
            CUDA tensors when triton is installed, PyTorch otherwise), ``"triton"`` or ``"torch"``.

    Table-4 ablations of AttnRes (all off by default; any of them needs
    ``attnres_impl="naive"``, see ``attnres.nn.residual.AttnResAblation``):
    ``attnres_input_dependent_query``, ``attnres_input_independent_mixing``,
    ``attnres_sigmoid_weights``, ``attnres_key_norm`` (``False``: raw keys), ``attnres_heads``
    (multihead depth attention), ``attnres_window`` (Full only: embedding + W recent outputs).

    Baselines (``residual`` in ``BASELINES``, see ``attnres.nn.baselines``): ``hc_streams`` is
    the number of residual streams ``m`` of Hyper-Connections, mHC and mHC-lite (4 in the
    report), ``mhc_sinkhorn_iters`` the Sinkhorn-Knopp iterations of mHC (20).
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
    residual: str = "attnres_block"
    attnres_block_size: int | None = None
    attnres_impl: str = "two_phase"
    attnres_full_group_size: int | None = None
    attnres_eps: float = 1e-6
    attnres_kernels: str = "auto"
    attnres_input_dependent_query: bool = False
    attnres_input_independent_mixing: bool = False
    attnres_sigmoid_weights: bool = False
    attnres_key_norm: bool = True
    attnres_heads: int | None = None
    attnres_window: int | None = None
    hc_streams: int = 4
    mhc_sinkhorn_iters: int = 20

    def __post_init__(self) -> None:
        self.validate()

    # -- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and the allowed values on bad input."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            _check_int(name, getattr(self, name))
        _check_int("n_kv_heads", self.n_kv_heads, allow_none=True, none_means="= n_heads")
        _check_int("mlp_hidden", self.mlp_hidden, allow_none=True, none_means="8/3 d rounded up to 64")
        for name in ("rope_theta", "norm_eps", "init_std", "attnres_eps"):
            _check_float(name, getattr(self, name))
        if not isinstance(self.tie_embeddings, bool):
            _fail("tie_embeddings", "True or False", self.tie_embeddings)
        if self.d_model % self.n_heads:
            _fail("d_model", f"divisible by n_heads={self.n_heads}", self.d_model)
        if (self.d_model // self.n_heads) % 2:
            _fail("d_model", f"such that the head dimension d_model / n_heads is even (RoPE); n_heads={self.n_heads} gives {self.d_model // self.n_heads}", self.d_model)
        if self.n_heads % self.kv_heads:
            _fail("n_kv_heads", f"a divisor of n_heads={self.n_heads}", self.n_kv_heads)
        if self.residual not in RESIDUALS + BASELINES:
            _fail("residual", "one of " + ", ".join(repr(r) for r in RESIDUALS + BASELINES), self.residual)
        for name in ("attnres_input_dependent_query", "attnres_input_independent_mixing", "attnres_sigmoid_weights", "attnres_key_norm"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, "True or False", getattr(self, name))
        _check_int("attnres_heads", self.attnres_heads, allow_none=True, none_means="single head")
        if self.attnres_heads is not None and self.d_model % self.attnres_heads:
            _fail("attnres_heads", f"a divisor of d_model={self.d_model}", self.attnres_heads)
        _check_int("attnres_window", self.attnres_window, allow_none=True, none_means="no window")
        if self.attnres_window is not None and self.residual != "attnres_full":
            _fail("attnres_window", "None unless residual='attnres_full' (the sliding window ablates Full AttnRes)", self.attnres_window)
        if self.attnres_input_dependent_query and self.attnres_input_independent_mixing:
            _fail("attnres_input_independent_mixing", "False when attnres_input_dependent_query is True (they exclude each other)", True)
        if self.ablation.active and self.attnres_impl != "naive":
            _fail("attnres_impl", "'naive' when an AttnRes ablation is set (the two-phase schedule needs static queries and a softmax)", self.attnres_impl)
        _check_int("hc_streams", self.hc_streams)
        _check_int("mhc_sinkhorn_iters", self.mhc_sinkhorn_iters)
        if self.residual == "mhc_lite" and self.hc_streams > 6:
            _fail("hc_streams", "<= 6 for mhc_lite (it enumerates all hc_streams! permutations)", self.hc_streams)
        _check_int("attnres_block_size", self.attnres_block_size, allow_none=True, none_means="about 8 blocks")
        _check_int("attnres_full_group_size", self.attnres_full_group_size, allow_none=True, none_means="round(sqrt(L))")
        if self.attnres_kernels not in KERNEL_BACKENDS:
            _fail("attnres_kernels", "one of " + ", ".join(repr(k) for k in KERNEL_BACKENDS), self.attnres_kernels)
        if self.attnres_impl not in IMPLEMENTATIONS:
            _fail("attnres_impl", "one of " + ", ".join(repr(i) for i in IMPLEMENTATIONS), self.attnres_impl)

    # -- derived quantities --------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
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

    @property
    def block_size(self) -> int:
        """The resolved Block AttnRes block size ``S`` in sublayers."""
        if self.attnres_block_size is not None:
            return self.attnres_block_size
        return max(1, math.ceil(self.n_sublayers / 8))

    @property
    def ablation(self) -> AttnResAblation:
        """The Table-4 ablation settings as one object."""
        return AttnResAblation(
            input_dependent_query=self.attnres_input_dependent_query,
            input_independent_mixing=self.attnres_input_independent_mixing,
            sigmoid_weights=self.attnres_sigmoid_weights,
            key_norm=self.attnres_key_norm,
            heads=self.attnres_heads,
            window=self.attnres_window,
        )

    @property
    def n_blocks(self) -> int:
        """``N = ceil(L / S)``, the number of blocks (embedding not counted)."""
        return math.ceil(self.n_sublayers / self.block_size)

    # -- (de)serialisation and presets ---------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a mapping; an unknown key raises ``ValueError`` listing the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**data)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated)."""
        return self.from_dict({**self.to_dict(), **changes})

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset (see ``PRESETS``), optionally with fields overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})


PRESETS: dict[str, dict[str, Any]] = {
    # Unit tests: a few milliseconds per forward.
    "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128, attnres_block_size=2),
    # configs/train-cpu.yaml: a small model for a first training run on CPU.
    "demo": dict(vocab_size=512, d_model=128, n_layers=4, n_heads=4, max_seq_len=256, attnres_block_size=2),
    # The core issue's CPU overhead benchmark: d=512, 8 transformer blocks, S=4 (N=4).
    "bench-cpu": dict(vocab_size=8192, d_model=512, n_layers=8, n_heads=8, max_seq_len=256, attnres_block_size=4),
    # The inference benchmark shape: d=1024, 16 transformer blocks, S=4 (N=8).
    "bench-infer": dict(vocab_size=8192, d_model=1024, n_layers=16, n_heads=16, max_seq_len=2048, attnres_block_size=4),
}
