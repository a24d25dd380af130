"""The no-free-lunch study (``python -m studies.no_free_lunch``): does AttnRes trade memorisation for structure?

A critique of AttnRes argues that a win on language modelling must be paid for somewhere.
Its toy experiment mixes a structured task (a linear teacher) with a memorisation task (a
random lookup table) by ``lam`` (:mod:`.tasks`) and trains standard and AttnRes
residual MLP stacks (:mod:`.models`) at several depths, with and without PreNorm. This
module runs that grid, one small self-contained training loop per run (no LM trainer):

    lam in {0, 0.25, 0.5, 0.75, 1} x depth in {4, 8, 16, 30} x {prenorm, no_norm}
        x {standard, full, block, full_sigmoid} x seeds

Every run writes ``out/records/<norm>-<variant>-depth<D>-lam<lam>-seed<k>.json`` when it
finishes; a re-run skips runs that have their file (runs take seconds, so an interrupted
run simply starts again). ``out/experiment.json`` holds the preset and configuration: a
re-run with another one is refused, so results of different grids never mix. The report
(:mod:`.report`) is written from every finished run in ``out``.

Pairing: for one seed, every model sees the same task (inputs, teacher, table), the same
mini-batches, and the same initial MLP weights (the AttnRes parameters are deterministic:
zero queries, unit key-norm gains), so ``AttnRes - standard`` gaps are paired by seed.
"""

from __future__ import annotations

import ast
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from attnres.nn.residual import SCHEDULES
from attnres.progress import progress_bar

from .models import VARIANTS, ResidualMLP, block_size_for
from .tasks import TaskSpec, make_task

__all__ = [
    "NAME", "NORMS", "NFL_PRESETS", "NFLConfig", "get_config", "apply_config_overrides", "Run", "grid_runs",
    "run_path", "train_run", "run_grid", "load_results", "run_cli",
]

NAME = "no-free-lunch"
#: How the study is run (from the repository root): its messages and the report's command.
PROG = "python -m studies.no_free_lunch"
#: Normalisation settings: PreNorm (RMSNorm before every sublayer and before the head) or none.
NORMS = ("prenorm", "no_norm")
#: Where the per-run JSON records live inside ``out`` (not ``runs/``, which .gitignore skips).
RECORDS_DIR = "records"
# Seed offsets: the task uses the seed itself; the initial weights and the batch order use
# their own streams, so the teacher and the first layer are not drawn from one sequence.
_INIT_SEED, _BATCH_SEED = 10_000, 20_000


@dataclass(frozen=True)
class NFLConfig:
    """Everything that defines the grid and its runs (the seeds are given separately).

    lams, depths, variants, norms: the grid. depths count blocks of one sublayer each.
    width: the residual stream's width d; hidden_mult: each sublayer is d -> hidden_mult*d -> d.
    d_in, d_out, n_train, n_test: the task (:class:`~.tasks.TaskSpec`).
    steps, batch_size, lr, warmup_steps, grad_clip, weight_decay: AdamW with linear warmup
    then cosine decay to zero, mini-batches drawn with replacement from the training set,
    gradient-norm clipping (0 = off).
    impl: AttnRes's schedule: "naive" (default here: the same function as "two_phase", and
    faster at d = 64 and batch 64 on a CPU) or "two_phase". The sigmoid variant always runs naive.
    """

    lams: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    depths: tuple[int, ...] = (4, 8, 16, 30)
    variants: tuple[str, ...] = VARIANTS
    norms: tuple[str, ...] = NORMS
    width: int = 64
    hidden_mult: int = 2
    d_in: int = 16
    d_out: int = 8
    n_train: int = 512
    n_test: int = 1024
    steps: int = 200
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    impl: str = "naive"

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"no-free-lunch: {name} must be an integer >= 1, got {v!r}")

        for name in ("width", "hidden_mult", "d_in", "d_out", "n_train", "n_test", "steps", "batch_size"):
            positive_int(name)
        if not self.lams or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1
                                for x in self.lams):
            raise ValueError(f"no-free-lunch: lams must be a non-empty list of numbers in [0, 1], got {self.lams!r}")
        if not self.depths or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in self.depths):
            raise ValueError(f"no-free-lunch: depths must be a non-empty list of integers >= 1, got {self.depths!r}")
        if "standard" not in self.variants or any(v not in VARIANTS for v in self.variants):
            raise ValueError(f"no-free-lunch: variants must be names from {VARIANTS} including 'standard' "
                             f"(the reference of every gap), got {self.variants!r}")
        if not self.norms or any(n not in NORMS for n in self.norms):
            raise ValueError(f"no-free-lunch: norms must be a non-empty list from {NORMS}, got {self.norms!r}")
        for name in ("lams", "depths", "variants", "norms"):
            if len(set(getattr(self, name))) != len(getattr(self, name)):
                raise ValueError(f"no-free-lunch: {name} has duplicates: {getattr(self, name)!r}")
        if not self.lr > 0:
            raise ValueError(f"no-free-lunch: lr must be > 0, got {self.lr!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"no-free-lunch: warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError(f"no-free-lunch: grad_clip and weight_decay must be >= 0, got "
                             f"{self.grad_clip!r} and {self.weight_decay!r}")
        if self.impl not in SCHEDULES:
            raise ValueError(f"no-free-lunch: impl must be one of {SCHEDULES}, got {self.impl!r}")

    @property
    def task_spec(self) -> TaskSpec:
        return TaskSpec(d_in=self.d_in, d_out=self.d_out, n_train=self.n_train, n_test=self.n_test)


#: ``cpu``: the committed grid (about 40 minutes on one quiet core; see docs/experiments.md);
#: ``tiny``: seconds, for the tests.
NFL_PRESETS: dict[str, NFLConfig] = {
    "cpu": NFLConfig(),
    "tiny": NFLConfig(lams=(0.0, 1.0), depths=(2, 3), width=8, d_in=4, d_out=2, n_train=16, n_test=16, steps=3,
                      batch_size=8, warmup_steps=1),
}


def get_config(preset: str) -> NFLConfig:
    """The configuration of ``preset`` (:data:`NFL_PRESETS`)."""
    if preset not in NFL_PRESETS:
        raise ValueError(f"no-free-lunch: preset must be one of {tuple(NFL_PRESETS)}, got {preset!r}")
    return NFL_PRESETS[preset]


def apply_config_overrides(config: NFLConfig, overrides: Iterable[str]) -> NFLConfig:
    """``config`` with ``key=value`` overrides of its fields applied; values are Python
    literals (``steps=100``, ``depths=[4,8]``, ``impl=two_phase``: a bare word is a string).
    An unknown key or a bad value raises ``ValueError`` naming it."""
    known = {f.name: f for f in fields(NFLConfig)}
    changes: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or key not in known:
            raise ValueError(f"no-free-lunch: override {item!r} must be key=value with key one of {sorted(known)}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        if isinstance(getattr(config, key), tuple):
            value = tuple(value) if isinstance(value, (list, tuple)) else (value,)
        elif isinstance(getattr(config, key), float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        changes[key] = value
    return replace(config, **changes)


@dataclass(frozen=True)
class Run:
    """One cell of the grid for one seed."""

    norm: str
    variant: str
    depth: int
    lam: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.norm}-{self.variant}-depth{self.depth}-lam{self.lam:.2f}-seed{self.seed}"


def grid_runs(config: NFLConfig, seeds: Iterable[int], variants: Iterable[str] | None = None) -> list[Run]:
    """Every run, seed-major (a stopped grid still holds whole comparisons for its first
    seeds), then lam, depth, norm, variant. ``variants``: only these."""
    chosen = config.variants if variants is None else tuple(v for v in config.variants if v in set(variants))
    return [Run(n, v, d, float(lam), s) for s in seeds for lam in config.lams for d in config.depths
            for n in config.norms for v in chosen]


def run_path(out: str | Path, run: Run) -> Path:
    return Path(out) / RECORDS_DIR / f"{run.name}.json"


def _lr_factor(step: int, config: NFLConfig) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay to zero at ``steps``."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * (step - config.warmup_steps) / span))


def build_model(config: NFLConfig, run: Run) -> ResidualMLP:
    """The run's model with its seed's initial weights (shared by every variant)."""
    torch.manual_seed(_INIT_SEED + run.seed)
    model = ResidualMLP(run.variant, config.d_in, config.d_out, config.width, run.depth,
                        prenorm=run.norm == "prenorm", hidden_mult=config.hidden_mult, impl=config.impl)
    return model


def train_run(config: NFLConfig, run: Run) -> dict[str, Any]:
    """Train one run and return its record (not written; see :func:`run_grid`).

    Record: the run's coordinates, ``train_loss`` (MSE on the whole training set: how much
    of it was fitted, the memorisation part included), ``test_loss`` (MSE on fresh inputs
    against the structured part: generalisation), ``diverged`` (a non-finite loss stopped
    the run; both losses are then ``None``), ``hidden_rms`` (RMS of every sublayer's input
    and of the residual's output after training, on the training set), parameter counts,
    block size (Block AttnRes) and wall time.
    """
    task = make_task(run.lam, run.seed, config.task_spec)
    model = build_model(config, run)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay, foreach=True)
    batches = torch.Generator().manual_seed(_BATCH_SEED + run.seed)
    t0 = time.perf_counter()
    diverged_at = None
    model.train()
    for step in range(config.steps):
        for group in opt.param_groups:
            group["lr"] = config.lr * _lr_factor(step, config)
        idx = torch.randint(0, config.n_train, (config.batch_size,), generator=batches)
        loss = F.mse_loss(model(task.x_train[idx]), task.y_train[idx])
        if not torch.isfinite(loss):
            diverged_at = step
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip, foreach=True)
        opt.step()
    model.eval()
    with torch.no_grad():
        pred_train, rms = model(task.x_train, return_rms=True)
        train_loss = F.mse_loss(pred_train, task.y_train).item()
        test_loss = F.mse_loss(model(task.x_test), task.y_test).item()
    diverged = diverged_at is not None or not (math.isfinite(train_loss) and math.isfinite(test_loss))
    residual_params = sum(p.numel() for p in model.residual.parameters())
    return {
        "experiment": NAME, "norm": run.norm, "variant": run.variant, "depth": run.depth, "lam": run.lam,
        "seed": run.seed, "block_size": block_size_for(run.depth) if run.variant == "block" else None,
        "steps": config.steps, "train_loss": None if diverged else train_loss,
        "test_loss": None if diverged else test_loss, "diverged": diverged, "diverged_at_step": diverged_at,
        "hidden_rms": None if diverged else [round(x, 5) for x in rms],
        "params": sum(p.numel() for p in model.parameters()), "residual_params": residual_params,
        "wall_s": round(time.perf_counter() - t0, 3),
    }


def _write_json(path: Path, data: Any) -> None:
    """Write atomically: a run's file exists only once it is complete."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _check_header(out: Path, preset: str, config: NFLConfig) -> None:
    header = {"experiment": NAME, "preset": preset, "config": asdict(config)}
    header = json.loads(json.dumps(header))  # tuples -> lists, as saved
    marker = out / "experiment.json"
    if marker.exists():
        saved = json.loads(marker.read_text())
        if saved.get("experiment") != NAME:
            raise ValueError(f"{str(out)!r} holds another experiment ({saved.get('experiment')!r}); pick another --out")
        differing = sorted(k for k in set(saved.get("config", {})) | set(header["config"])
                           if saved.get("config", {}).get(k) != header["config"].get(k))
        if saved.get("preset") != preset:
            differing.insert(0, "preset")
        if differing:
            raise ValueError(f"{str(out)!r} holds a no-free-lunch grid with another configuration (differs in "
                             f"{differing}); pick another --out")
    out.mkdir(parents=True, exist_ok=True)
    _write_json(marker, header)


def run_grid(config: NFLConfig, out: str | Path, seeds: Iterable[int], preset: str = "cpu",
             variants: Iterable[str] | None = None, progress: bool = True,
             train: Callable[[NFLConfig, Run], dict[str, Any]] = train_run) -> list[dict[str, Any]]:
    """Run every run of the grid under ``out`` that has no result yet (finished runs are
    skipped); returns the records of this grid's runs (finished earlier or now). ``variants``
    restricts the runs, e.g. to split the grid over processes sharing ``out``
    (``standard`` must be run by one of them)."""
    seeds = list(seeds)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise ValueError(f"seeds must be a non-empty list of integers >= 0; got {seeds!r}")
    if variants is not None:
        unknown = [v for v in variants if v not in config.variants]
        if unknown or not list(variants):
            raise ValueError(f"variants must be names of the no-free-lunch grid {list(config.variants)}; "
                             f"got {list(variants)!r}")
    out = Path(out)
    _check_header(out, preset, config)
    (out / RECORDS_DIR).mkdir(exist_ok=True)
    runs = grid_runs(config, seeds, variants)
    todo = [r for r in runs if not run_path(out, r).exists()]
    bar = _progress(len(runs), len(runs) - len(todo), progress)
    try:
        for run in todo:
            if bar is not None:
                bar.set_postfix_str(run.name, refresh=False)
            _write_json(run_path(out, run), train(config, run))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return [json.loads(run_path(out, r).read_text()) for r in runs]


def _progress(total: int, done: int, enabled: bool):
    return progress_bar(enabled, total=total, initial=done, unit="run", desc=NAME)


def load_results(out: str | Path) -> list[dict[str, Any]]:
    """Every finished run's record under ``out`` (sorted by file name)."""
    return [json.loads(p.read_text()) for p in sorted((Path(out) / RECORDS_DIR).glob("*.json"))]


def run_cli(preset: str, out: str, seeds: list[int], overrides: list[str], report_only: bool = False,
            variants: list[str] | None = None, progress: bool = True) -> int:
    """``python -m studies.no_free_lunch``: run the grid (resumable) and write the report.
    Bad presets, overrides, seeds or variants end the process with a one-line message."""
    from .report import write_nfl_report

    try:
        config = apply_config_overrides(get_config(preset), overrides)
        if not report_only:
            t0 = time.perf_counter()
            run_grid(config, out, seeds, preset, variants, progress)
            print(f"{PROG}: grid done in {time.perf_counter() - t0:.0f} s")
        records = load_results(out)
        if not records:
            raise ValueError(f"no finished no-free-lunch runs in {out!r}")
        # The command that reproduces every run in `out` (its seeds, not only this invocation's).
        all_seeds = sorted({int(r["seed"]) for r in records})
        path = write_nfl_report(records, out, command=_command(preset, out, all_seeds, overrides))
    except ValueError as e:
        raise SystemExit(f"{PROG}: error: {e}") from None
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; run the same command again to resume (finished runs are kept)")
        return 130
    print(f"{PROG}: {len(records)} runs; report {path}")
    return 0


def _command(preset: str, out: str, seeds: list[int], overrides: list[str]) -> str:
    parts = [PROG, "--preset", preset, "--out", str(out), "--seeds", *map(str, seeds), *overrides]
    return " ".join(parts)
