"""Named experiment grids: which runs the report's Table 4, Fig. 6, Table 2 and Fig. 7 need.

Every experiment has presets (:data:`PRESETS` lists which): ``tiny`` (seconds, for tests),
``small`` (minutes per run on one CPU core: the committed ablation and block-size results),
``cpu`` (a real run on a few CPU cores), and for ``compare`` (the main job, ``attnres
compare`` / ``make demo``) ``demo`` (minutes) and ``long`` (the committed comparison: 12
transformer blocks, at least 30 minutes per run on one core). A preset is a base training
config (``TrainConfig`` fields as a mapping, the ``model`` a mapping of ``ModelConfig``
fields) and a list of :class:`Variant` s, each changing only model fields (and, for
``scaling``, the number of steps and warm-up steps), so that all variants share data, hyper-parameters and
seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...validation import did_you_mean

EXPERIMENTS = ("compare", "ablation", "block-size", "scaling", "arch-sweep", "multiplier")
#: The presets of each experiment.
PRESETS: dict[str, tuple[str, ...]] = {
    "compare": ("tiny", "demo", "long"),
    "ablation": ("tiny", "small", "cpu"),
    "block-size": ("tiny", "small", "cpu"),
    "scaling": ("tiny", "cpu"),
    "arch-sweep": ("tiny", "cpu"),
    "multiplier": ("tiny", "cpu"),
}
PRESET_NAMES = tuple(dict.fromkeys(p for names in PRESETS.values() for p in names))

# Shared training settings. `tiny`: a few steps of a toy model; `cpu`: the configs/train-cpu.yaml recipe.
_TRAIN: dict[str, dict[str, Any]] = {
    "tiny": dict(steps=4, seq_len=16, batch_size=2, warmup_steps=1, eval_every=4, eval_batches=1, log_every=1,
                 diagnostics_every=1000, checkpoint_every=1000, optimizer="adamw", lr=3e-3, schedule="cosine",
                 data={"tokenizer": "byte"}),
    # One CPU core, about a minute per baseline run: 400 steps of 1024 tokens.
    "small": dict(steps=400, seq_len=64, batch_size=16, warmup_steps=40, eval_every=100, eval_batches=16,
                  log_every=10, diagnostics_every=10_000, checkpoint_every=100, optimizer="muon", lr=3e-3,
                  schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0, data={"tokenizer": "bpe", "vocab_size": 4096}),
    # The main job's presets (`compare`): diagnostics logged along the way for the Fig. 5 / Fig. 8 plots.
    # `demo`: `make demo` within 15 minutes on 2 cores, set-up included; `long`: 3600 steps of 2048
    # tokens, about 30 minutes for the standard model on one quiet core (0.5 s per step).
    "demo": dict(steps=240, seq_len=128, batch_size=16, warmup_steps=30, eval_every=40, eval_batches=8,
                 log_every=10, diagnostics_every=80, checkpoint_every=100, optimizer="muon", lr=3e-3,
                 schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0, data={"tokenizer": "bpe", "vocab_size": 4096}),
    "long": dict(steps=3600, seq_len=128, batch_size=16, warmup_steps=200, eval_every=200, eval_batches=16,
                 log_every=20, diagnostics_every=400, checkpoint_every=200, optimizer="muon", lr=3e-3,
                 schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0, data={"tokenizer": "bpe", "vocab_size": 4096}),
    "cpu": dict(steps=1000, seq_len=128, batch_size=16, warmup_steps=100, eval_every=250, eval_batches=16,
                log_every=10, diagnostics_every=10_000, checkpoint_every=250, optimizer="muon", lr=3e-3,
                schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0, data={"tokenizer": "bpe", "vocab_size": 4096}),
}
_COMMON = dict(progress=False, tensorboard=False, keep_checkpoints=1)
# The Table-4 / Fig. 6 model: the report's is 16 layers deep; ours is scaled to the preset.
_MODEL: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, d_model=32, n_layers=4, n_heads=4, max_seq_len=64),
    "small": dict(vocab_size=4096, d_model=64, n_layers=8, n_heads=4, max_seq_len=128),
    "cpu": dict(vocab_size=4096, d_model=128, n_layers=8, n_heads=4, max_seq_len=256),
    # `compare`: depth over width. demo: 8 transformer blocks; long: 12 (24 sublayers, Block S = 3, N = 8).
    "demo": dict(vocab_size=4096, d_model=64, n_layers=8, n_heads=4, max_seq_len=256),
    "long": dict(vocab_size=4096, d_model=64, n_layers=12, n_heads=4, max_seq_len=256),
}


@dataclass(frozen=True)
class Variant:
    """One point of a grid.

    name: directory-safe label, unique in the experiment.
    model: ``ModelConfig`` fields changed from the experiment's base model.
    train: ``TrainConfig`` fields changed from the base (``scaling`` only: the steps and warm-up).
    family: ``"baseline"``, ``"block"``, ``"full"`` or another label the tables group by.
    coords: the grid coordinates (e.g. ``{"S": 4}`` or ``{"size": "s1"}``).
    """

    name: str
    model: dict[str, Any]
    family: str
    coords: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Experiment:
    """A named grid: ``base`` (TrainConfig mapping) and its ``variants``."""

    name: str
    preset: str
    base: dict[str, Any]
    variants: list[Variant]
    #: the most passes over the training split a run may make (``None``: no limit); the
    #: runner refuses a grid with a run beyond it before the first run starts
    max_data_passes: float | None = None


def _residual(kind: str, **settings: Any) -> dict[str, Any]:
    """The model fields of a residual variant: ``{"residual": {"kind": kind, **settings}}``."""
    return {"residual": {"kind": kind, **settings}}


def _ablated(kind: str, settings: dict[str, Any] | None = None, **ablation: Any) -> dict[str, Any]:
    """An AttnRes Table-4 ablation (they run on the naive path)."""
    return _residual(kind, **(settings or {}), schedule="naive", ablation=ablation)


def _compare(preset: str) -> list[Variant]:
    L = 2 * _MODEL[preset]["n_layers"]
    S = block_size_for(L)
    return [
        Variant("standard", _residual("standard"), "baseline"),
        Variant("block", _residual("attnres_block", block_size=S), "block", {"S": S, "N": math.ceil(L / S)}),
        Variant("full", _residual("attnres_full"), "full"),
    ]


def _ablation(preset: str) -> list[Variant]:
    m = _MODEL[preset]
    L = 2 * m["n_layers"]
    window = max(1, L // 4)  # the report's W = 8 on its 32-sublayer model, scaled to depth
    heads = 16 if m["d_model"] % 16 == 0 else 4  # the report's H = 16 where d allows
    full, block = "attnres_full", "attnres_block"
    s4 = {"block_size": 4}
    return [
        Variant("baseline", _residual("standard"), "baseline"),
        Variant("denseformer", _residual("denseformer"), "other"),
        Variant("mhc", _residual("mhc", hc_streams=4), "other"),
        Variant("full", _residual(full), "full"),
        Variant("full+input_dependent_query", _ablated(full, input_dependent_query=True), "full"),
        Variant("full+input_independent_mixing", _ablated(full, input_independent_mixing=True), "full"),
        Variant("full+sigmoid", _ablated(full, sigmoid_weights=True), "full"),
        Variant("full-key_norm", _ablated(full, key_norm=False), "full"),
        Variant(f"swa_w{window}", _ablated(full, window=window), "full", {"W": window}),
        Variant("block_s4", _residual(block, **s4), "block"),
        Variant(f"block+multihead_h{heads}", _ablated(block, s4, heads=heads), "block", {"H": heads}),
        Variant("block-key_norm", _ablated(block, s4, key_norm=False), "block"),
    ]


def _block_size(preset: str) -> list[Variant]:
    L = 2 * _MODEL[preset]["n_layers"]
    out = [Variant("baseline", _residual("standard"), "baseline")]
    S = 1
    while S <= L:
        model = _residual("attnres_full") if S == 1 else _residual("attnres_block", block_size=S)
        out.append(Variant(f"s{S}", model, "full" if S == 1 else "block", {"S": S, "N": math.ceil(L / S)}))
        S *= 2
    return out


# Scaling laws (report §5.1, Table 2). The report grows depth and width together, with as many
# heads as transformer blocks (H = L_b) and d / L_b ≈ 75, i.e. a fixed head dimension, and trains
# about 200 tokens per activated non-embedding parameter at every size (188-225 over its five
# sizes). Ours keeps that shape rule at CPU scale: d = width_per_block * L_b, H = L_b (head
# dimension = width_per_block), and a fixed number of tokens per non-embedding parameter, so the
# steps grow with the model; learning rate and batch stay fixed across sizes (the report retunes
# them per size under the baseline; we have no budget to tune). How `cpu` was sized:
# docs/experiments.md ("Scaling laws").
@dataclass(frozen=True)
class ScalingGrid:
    """blocks: the sizes' numbers of transformer blocks L_b; width_per_block: d / L_b;
    tokens_per_param: training tokens per non-embedding parameter; step_multiple: steps are
    rounded to a multiple of this; min_steps: the fewest steps of a size."""

    blocks: tuple[int, ...]
    width_per_block: int
    tokens_per_param: float
    step_multiple: int = 10
    min_steps: int = 2


_SCALING = {
    "tiny": ScalingGrid(blocks=(1, 2, 3), width_per_block=8, tokens_per_param=0.01, step_multiple=1),
    # 5 sizes, 83K-1.10M non-embedding parameters (13x), 410-5390 steps of 2048 tokens; about
    # 6.3 CPU core-hours for 3 families x 2 seeds at one thread (measured per step, see the docs).
    "cpu": ScalingGrid(blocks=(3, 4, 5, 6, 7), width_per_block=16, tokens_per_param=10.0),
}
_FAMILIES = {"baseline": _residual("standard"), "block": _residual("attnres_block"), "full": _residual("attnres_full")}


def block_size_for(n_sublayers: int) -> int:
    """Block AttnRes's S (in sublayers) for a stack of ``n_sublayers``: N ≈ 8 blocks (the
    report's choice) where depth allows, and S >= 2 (S = 1 would be Full AttnRes)."""
    return max(2, math.ceil(n_sublayers / 8))


def scaling_steps(model: dict[str, Any], grid: ScalingGrid, tokens_per_step: int) -> int:
    """Steps of a scaling-grid size: ``grid.tokens_per_param`` tokens per non-embedding parameter
    of ``model`` (``ModelConfig`` fields), rounded to ``grid.step_multiple``, at least
    ``grid.min_steps``."""
    from ...models.config import ModelConfig
    from ..flops import non_embedding_parameters

    tokens = grid.tokens_per_param * non_embedding_parameters(ModelConfig.from_dict(model))
    steps = round(tokens / tokens_per_step / grid.step_multiple) * grid.step_multiple
    return max(grid.min_steps, steps)


def _scaling(preset: str) -> list[Variant]:
    grid, base = _SCALING[preset], _TRAIN[preset]
    out = []
    for i, n_layers in enumerate(grid.blocks, 1):
        d = grid.width_per_block * n_layers
        size = dict(d_model=d, n_layers=n_layers, n_heads=n_layers)
        steps = scaling_steps({**_MODEL[preset], **size}, grid, base["seq_len"] * base["batch_size"])
        # warm-up and WSD decay are fixed fractions of each run's own schedule
        train = {"steps": steps, "warmup_steps": max(1, steps // 20)}
        S = block_size_for(2 * n_layers)
        for family, residual in _FAMILIES.items():
            model = {**size, **residual}
            coords = {"size": f"s{i}", "L_b": n_layers, "d": d, "H": n_layers}
            if family == "block":
                model["residual"] = {**residual["residual"], "block_size": S}
                coords.update(S=S, N=math.ceil(2 * n_layers / S))
            out.append(Variant(f"{family}_s{i}", model, family, coords, train))
    return out


# Architecture sweep at fixed compute: (d/L_b ratios, H/L_b ratios, non-embedding parameter
# budget, head dimension granularity). The report sweeps 5 x 5 cells; we sweep fewer.
_SWEEP = {
    "tiny": ((8.0, 16.0), (1.0, 2.0), 12 * 2 * 32**2),
    "cpu": ((15.0, 30.0, 45.0, 60.0), (0.5, 1.0, 2.0), 12 * 8 * 128**2),
}


def arch_shape(d_over_lb: float, h_over_lb: float, budget: int) -> tuple[int, int, int]:
    """``(n_layers L_b, d_model, n_heads)`` with ``d / L_b ~ d_over_lb``, ``H / L_b ~ h_over_lb``
    and ``12 L_b d^2 ~ budget`` non-embedding parameters (4 d^2 attention + 8 d^2 SwiGLU).
    ``d`` is rounded to a multiple of ``2 H`` (even head dimension, for RoPE)."""
    if d_over_lb <= 0 or h_over_lb <= 0 or budget <= 0:
        raise ValueError(f"d/L_b, H/L_b and the budget must be > 0; got {d_over_lb!r}, {h_over_lb!r}, {budget!r}")
    n_layers = max(1, round((budget / (12 * d_over_lb**2)) ** (1 / 3)))
    heads = max(1, round(h_over_lb * n_layers))
    d = max(2 * heads, round(d_over_lb * n_layers / (2 * heads)) * 2 * heads)
    return n_layers, d, heads


# Block AttnRes with S = 2 in every cell: the default ceil(L / 8) would be S = 1 (= Full) on the
# shallow models here.
_ARCH_BLOCK = _residual("attnres_block", block_size=2)


def _arch_sweep(preset: str) -> list[Variant]:
    ratios_d, ratios_h, budget = _SWEEP[preset]
    out = []
    for rd in ratios_d:
        for rh in ratios_h:
            n_layers, d, heads = arch_shape(rd, rh, budget)
            shape = dict(d_model=d, n_layers=n_layers, n_heads=heads)
            coords = {"d/L_b": rd, "H/L_b": rh, "L_b": n_layers, "d": d, "H": heads}
            for family, residual in (("baseline", _residual("standard")), ("block", _ARCH_BLOCK)):
                out.append(Variant(f"{family}_d{rd:g}_h{rh:g}", {**shape, **residual}, family, coords))
    return out


# The compute multiplier measured directly (report §5.1, Table 2 / Fig. 4: "Block AttnRes matches
# the baseline trained with 1.25x the compute"). Per shape, Block and Full AttnRes train to a
# budget of T steps and the standard model to a ladder of budgets around it, each run with its own
# WSD schedule (warm-up fixed in steps, decay over the last decay_fraction of its own steps) and
# the same seed-fixed data order; the runs of a seed therefore agree up to the first decay. How
# `cpu` was sized: docs/experiments.md ("The compute multiplier").
@dataclass(frozen=True)
class Shape:
    """A model shape of the multiplier grid: ``name`` labels its variants."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int


@dataclass(frozen=True)
class MultiplierGrid:
    """shapes: the model shapes (each with the standard ladder and both AttnRes arms);
    budget: AttnRes's steps T; ladder: the standard model's budgets as multiples of T (each
    rounded to a whole step); warmup_steps: the same for every run; seeds: how many seeds
    the plan calls for (the report marks results on fewer as partial)."""

    shapes: tuple[Shape, ...]
    budget: int
    ladder: tuple[float, ...]
    warmup_steps: int
    seeds: int

    def ladder_steps(self) -> list[int]:
        return [round(self.budget * f) for f in self.ladder]


_MULTIPLIER = {
    "tiny": MultiplierGrid((Shape("deep", 4, 32, 4), Shape("shallow", 2, 48, 4)), budget=4, ladder=(1.0, 1.5, 2.0),
                           warmup_steps=1, seeds=2),
    # 12 x 64 (24 sublayers, Block S = 3: N = 8 blocks, the report's structure) and 6 x 96 (about the
    # same non-embedding parameters, S = 2: N = 6); the longest run (1.6 T) stays within one pass
    # over big.txt's training split at 16 x 128 tokens a step.
    "cpu": MultiplierGrid((Shape("deep", 12, 64, 4), Shape("shallow", 6, 96, 6)), budget=560,
                          ladder=(0.8, 1.0, 1.25, 1.6), warmup_steps=50, seeds=6),
}
#: The multiplier grid's training settings beyond the `cpu` recipe: evaluation on 18 fixed
#: batches at the end (and along the way, for the curves), checkpoints for resuming.
_MULTIPLIER_TRAIN = {"tiny": {}, "cpu": dict(eval_every=112, eval_batches=18, log_every=20, checkpoint_every=100)}


def multiplier_grid(preset: str) -> MultiplierGrid:
    """The multiplier grid's plan at ``preset`` (one of ``PRESETS["multiplier"]``)."""
    if preset not in _MULTIPLIER:
        raise ValueError(f"unknown preset {preset!r}{did_you_mean(preset, _MULTIPLIER)} for experiment 'multiplier'; "
                         f"available: {', '.join(_MULTIPLIER)}")
    return _MULTIPLIER[preset]


def _multiplier(preset: str) -> list[Variant]:
    grid = _MULTIPLIER[preset]
    out = []
    for shape in grid.shapes:
        size = dict(d_model=shape.d_model, n_layers=shape.n_layers, n_heads=shape.n_heads)
        coords = {"shape": shape.name, "L_b": shape.n_layers, "d": shape.d_model, "H": shape.n_heads}
        for factor, steps in zip(grid.ladder, grid.ladder_steps()):
            train = {"steps": steps, "warmup_steps": grid.warmup_steps}
            out.append(Variant(f"{shape.name}_standard_x{factor:g}", {**size, **_residual("standard")}, "baseline",
                               {**coords, "budget": factor}, train))
        attnres_train = {"steps": grid.budget, "warmup_steps": grid.warmup_steps}
        S = block_size_for(2 * shape.n_layers)
        out.append(Variant(f"{shape.name}_block", {**size, **_residual("attnres_block", block_size=S)}, "block",
                           {**coords, "budget": 1.0, "S": S, "N": math.ceil(2 * shape.n_layers / S)}, attnres_train))
        out.append(Variant(f"{shape.name}_full", {**size, **_residual("attnres_full")}, "full",
                           {**coords, "budget": 1.0}, attnres_train))
    return out


_BUILDERS = {"compare": _compare, "ablation": _ablation, "block-size": _block_size, "scaling": _scaling, "arch-sweep": _arch_sweep,
             "multiplier": _multiplier}


def get_experiment(name: str, preset: str) -> Experiment:
    """The grid ``name`` (one of :data:`EXPERIMENTS`) at ``preset`` (one of ``PRESETS[name]``)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown experiment {name!r}{did_you_mean(name, _BUILDERS)}; "
                         f"available: {', '.join(EXPERIMENTS)}")
    if preset not in PRESETS[name]:
        raise ValueError(f"unknown preset {preset!r}{did_you_mean(preset, PRESETS[name])} for experiment {name!r}; "
                         f"available: {', '.join(PRESETS[name])}")
    base = {**_TRAIN[preset], **_COMMON, "model": dict(_MODEL[preset])}
    if name == "compare" and preset == "tiny":  # the compare report plots diagnostics: log some
        base["diagnostics_every"] = 2
    if name == "compare" and preset == "demo":  # `make demo` runs for minutes: show a progress bar per run
        base["progress"] = True
    if name == "multiplier":
        base.update(_MULTIPLIER_TRAIN[preset])
        return Experiment(name, preset, base, _multiplier(preset), max_data_passes=1.0)
    return Experiment(name, preset, base, _BUILDERS[name](preset))
