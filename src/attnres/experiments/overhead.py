"""Per-variant cost of an experiment grid, measured side by side: the step time and peak
memory of one training step of every variant against the baseline.

The step times that the training runs log come from runs minutes or hours apart on a shared
machine, so their ratios mix the variants' cost with the load of the moment. Here every
variant is built at the grid's shape and timed **interleaved** with the others (one
training step of each per round, median of the per-round ratios to the baseline; see
:mod:`attnres.analysis.profiling`), and the peak memory of one step is taken from the
profiler. Written to ``<out>/overhead.json``; the report's tables read it.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..analysis.profiling import paired_summary, peak_memory_bytes, time_interleaved
from ..models import AttnResLM
from ..train.cpu_memory import retains_freed_memory
from .presets import Experiment
from .layout import OVERHEAD_FILE
from .runner import run_config


def _train_step(model: AttnResLM, ids: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def measure_overhead(experiment: Experiment, out: str | Path, overrides: list[str] = (), repeats: int = 10,
                     log: Callable[[str], None] = print) -> dict[str, Any]:
    """Time one training step of every variant of ``experiment`` interleaved (``repeats``
    rounds after two warm-up steps each) and take each step's peak memory; write and return
    ``{"repeats", "threads", "batch", "seq_len", "baseline", "freed_memory_retained",
    "variants": {name: {median_ms, step_ratio, peak_memory_bytes, peak_ratio}}}``. Ratios are
    against the grid's first ``baseline``-family variant. The steps run under this
    process's allocator, which the ``attnres`` command set from the runs' ``cpu_allocator``
    before they trained (:mod:`attnres.train.cpu_memory`)."""
    baseline = next((v.name for v in experiment.variants if v.family == "baseline"), None)
    if baseline is None:
        raise ValueError(f"experiment {experiment.name!r} has no baseline variant to measure overheads against")
    steps, batch, retained = {}, None, False
    with tempfile.TemporaryDirectory() as tmp:
        for v in experiment.variants:
            config = run_config(experiment, v, 0, Path(tmp) / v.name, overrides)
            retained = retains_freed_memory()
            torch.manual_seed(0)
            model = AttnResLM(config.model)
            if batch is None:  # the same tokens for every variant
                batch = torch.randint(0, config.model.vocab_size, (config.batch_size, config.seq_len))
            steps[v.name] = _train_step(model, batch)
    log(f"overhead: {len(steps)} variants, batch {tuple(batch.shape)}, {repeats} interleaved rounds")
    for step in steps.values():
        for _ in range(2):
            step()
    timing = paired_summary(time_interleaved(steps, repeats), baseline)
    memory = {name: peak_memory_bytes(step) for name, step in steps.items()}
    result = {
        "repeats": repeats, "threads": torch.get_num_threads(), "batch": batch.shape[0], "seq_len": batch.shape[1],
        "baseline": baseline, "freed_memory_retained": retained,
        "variants": {name: {"median_ms": timing[name]["median_ms"], "step_ratio": timing[name]["median_paired_ratio"],
                            "peak_memory_bytes": memory[name], "peak_ratio": memory[name] / max(memory[baseline], 1)}
                     for name in steps},
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / OVERHEAD_FILE).write_text(json.dumps(result, indent=1))
    return result
