"""Per-variant cost of an experiment grid, measured side by side: the step time and peak
memory of one training step of every variant against the baseline.

The step times that the training runs log come from runs minutes or hours apart on a shared
machine, so their ratios mix the variants' cost with the load of the moment. Here every
variant is built at the grid's shape and timed **interleaved** with the others (one
training step of each per round, median of the per-round ratios to the baseline; see
:mod:`attnres.analysis.profiling`) on the **CPU time of this process at one thread**: time
spent waiting for a core that another process holds does not count, so other load on the
machine cannot bias the ratio the way it biases wall-clock time. Each ratio comes with its
noise (:func:`timing_noise`): the 95 % interval of the median, widened to how far an
identical copy of the baseline (an A/A twin, timed alike) lands from 1. The peak memory of
one step is taken from the profiler. Written to ``<out>/overhead.json``; the report's
tables read it. It records what its numbers depend on (``settings``: each variant's model,
the batch, the rounds, the allocator, torch's version, the machine, what runs depth attention
on the CPU), so that a grid's command
run again over finished runs keeps it (:func:`stored_overhead`) rather than report other
numbers of the same models - and measures again on another computer (a finished grid copied
there).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...analysis.profiling import median_interval_coverage, paired_summary, peak_memory_bytes, time_interleaved
from ...machine import cpu_machine
from ...models import AttnResLM
from ...ops.depth_attention import cpu_kernel
from ...output_paths import read_json_object, strict_json, write_text_atomically
from ...train import TrainConfig
from ...train.cpu_memory import retains_freed_memory
from .presets import Experiment
from ..layout import OVERHEAD_FILE
from .runner import run_config


def _train_step(model: AttnResLM, ids: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    return step


#: The A/A twin's name in the timing: a second copy of the baseline, timed like the others.
TWIN = "twin"


def interval_label(repeats: int) -> str:
    """What the interval of the median step-time ratio over ``repeats`` rounds is, in words:
    "95 % interval" from 6 rounds; fewer give the range of the rounds, which covers less (2
    rounds: 50 %), and was called a 95 % interval all the same."""
    coverage = median_interval_coverage(repeats)
    if coverage >= 0.95:
        return "95 % interval"
    if repeats < 2:
        return "no interval (1 round; 6 rounds give a 95 % one)"
    return f"{coverage * 100:g} % interval (the range of {repeats} rounds; 6 rounds give 95 %)"


def timing_noise(interval: tuple[float, float], ratio: float, twin_interval: tuple[float, float]) -> float:
    """How far a measured step-time ``ratio`` may be from the truth: the larger of the half
    width of its own interval (around the ratio) and the largest distance of the twin's
    interval from 1 (an identical model measured as faster or slower: what the machine's
    state adds that the variant's own spread does not show)."""
    own = max(ratio - interval[0], interval[1] - ratio)
    floor = max(abs(twin_interval[0] - 1.0), abs(twin_interval[1] - 1.0))
    return max(own, floor)


def _one_thread(fn: Callable[[], Any]) -> Any:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(previous)


def _variant_configs(experiment: Experiment, overrides: list[str], tmp: str) -> dict[str, TrainConfig]:
    """Each variant's run config (of seed 0, in a throwaway directory ``tmp``): what is timed."""
    return {v.name: run_config(experiment, v, 0, Path(tmp) / v.name, overrides) for v in experiment.variants}


def _settings(configs: dict[str, TrainConfig], repeats: int) -> dict[str, Any]:
    """What a measurement's numbers depend on, as ``overhead.json`` stores them (its JSON
    form): each variant's model, the batch's shape (the first variant's), the rounds, whether
    the allocator keeps freed memory, torch's version, the machine (its CPU, cores and
    architecture: a grid copied to another computer kept the first one's timings), and what
    runs the AttnRes variants' depth attention (:func:`_depth_attention_on_cpu`)."""
    first = next(iter(configs.values()))
    settings = {"models": {name: c.model.to_dict() for name, c in configs.items()}, "batch_size": first.batch_size,
                "seq_len": first.seq_len, "repeats": repeats, "freed_memory_retained": retains_freed_memory(),
                "torch": torch.__version__, "machine": cpu_machine(), "depth_attention_cpu": _depth_attention_on_cpu()}
    return json.loads(strict_json(settings))


def _depth_attention_on_cpu() -> str | None:
    """What runs depth attention in the timed steps (on the CPU, float32): the C kernel's build,
    by its file name (a hash of the kernel's source, flags, compiler and CPU), or ``None`` for
    the PyTorch implementation (``ATTNRES_CPU_KERNEL=0``, no compiler). A grid timed again with
    the kernel switched off (to compare the two) kept the kernel's step times."""
    library = cpu_kernel.cpu_kernel()
    return None if library is None else library.path.name


def stored_overhead(experiment: Experiment, out: str | Path, overrides: list[str] = (),
                    repeats: int = 10) -> dict[str, Any] | None:
    """``out/overhead.json``'s measurements where :func:`measure_overhead` with these arguments
    would measure the same (its ``settings``); ``None`` where there are none, they cannot be
    read, they are of an earlier version (no ``settings``) or of other settings."""
    stored, _ = read_json_object(Path(out) / OVERHEAD_FILE)
    if stored is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        settings = _settings(_variant_configs(experiment, list(overrides), tmp), repeats)
    return stored if stored.get("settings") == settings else None


def measure_overhead(experiment: Experiment, out: str | Path, overrides: list[str] = (), repeats: int = 10,
                     log: Callable[[str], None] = print) -> dict[str, Any]:
    """Time one training step of every variant of ``experiment`` and of an A/A twin of the
    baseline interleaved, on the process's CPU time at one thread (``repeats`` rounds after
    two warm-up steps each), and take each step's peak memory; write and return ``{"repeats",
    "threads", "clock", "batch", "seq_len", "baseline", "freed_memory_retained", "twin":
    {step_ratio, step_ratio_interval}, "variants": {name: {median_ms, step_ratio,
    step_ratio_interval, step_ratio_noise, peak_memory_bytes, peak_ratio}}, "settings"}``
    (what the numbers depend on, which :func:`stored_overhead` compares). Ratios are
    against the grid's first ``baseline``-family variant. The steps run under this
    process's allocator, which the ``attnres`` command set from the runs' ``cpu_allocator``
    before they trained (:mod:`attnres.train.cpu_memory`); this function leaves it alone."""
    baseline = next((v for v in experiment.variants if v.family == "baseline"), None)
    if baseline is None:
        raise ValueError(f"experiment {experiment.name!r} has no baseline variant to measure overheads against")
    steps, batch = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        configs = _variant_configs(experiment, list(overrides), tmp)
    settings = _settings(configs, repeats)
    for name, config in [*configs.items(), (TWIN, configs[baseline.name])]:
        torch.manual_seed(0)
        model = AttnResLM(config.model)
        if batch is None:  # the same tokens for every variant
            batch = torch.randint(0, config.model.vocab_size, (config.batch_size, config.seq_len))
        steps[name] = _train_step(model, batch)
    log(f"overhead: {len(steps) - 1} variants and an A/A twin of {baseline.name!r}, batch {tuple(batch.shape)}, "
        f"{repeats} interleaved rounds, CPU time at one thread")

    def timed():
        for step in steps.values():
            for _ in range(2):
                step()
        return paired_summary(time_interleaved(steps, repeats, clock="cpu"), baseline.name)

    timing = _one_thread(timed)
    twin = timing.pop(TWIN)
    steps.pop(TWIN)
    memory = {name: peak_memory_bytes(step) for name, step in steps.items()}
    variants = {}
    for name in steps:
        ratio, interval = timing[name]["median_paired_ratio"], timing[name]["paired_ratio_interval"]
        variants[name] = {"median_ms": timing[name]["median_ms"], "step_ratio": ratio, "step_ratio_interval": interval,
                          "step_ratio_noise": timing_noise(interval, ratio, twin["paired_ratio_interval"]),
                          "peak_memory_bytes": memory[name], "peak_ratio": memory[name] / max(memory[baseline.name], 1)}
        if name != baseline.name:
            log(f"overhead: {name} step time {ratio:.3f} x {baseline.name} ± {variants[name]['step_ratio_noise']:.3f} "
                f"({interval_label(repeats)} {interval[0]:.3f}-{interval[1]:.3f})")
    log(f"overhead: A/A twin {twin['median_paired_ratio']:.3f} ({interval_label(repeats)} "
        f"{twin['paired_ratio_interval'][0]:.3f}-{twin['paired_ratio_interval'][1]:.3f}; an identical model: 1 is exact)")
    result = {
        "repeats": repeats, "threads": 1, "clock": "cpu", "batch": batch.shape[0], "seq_len": batch.shape[1],
        "baseline": baseline.name, "freed_memory_retained": settings["freed_memory_retained"],
        "twin": {"step_ratio": twin["median_paired_ratio"], "step_ratio_interval": twin["paired_ratio_interval"]},
        "variants": variants, "settings": settings,
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    write_text_atomically(Path(out) / OVERHEAD_FILE, strict_json(result, indent=1), "the overhead measurements")
    return result
