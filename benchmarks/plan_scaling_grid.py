"""Plan a scaling grid before running it: per-step CPU time of every variant, the grid's cost
and a balanced split over processes.

Every variant of ``attnres experiment scaling --preset P`` is built at its size with its
optimiser; one training step of each (random tokens, the preset's batch) is timed in
**process CPU time** at one thread, the variants interleaved round after round, and the
median is taken. CPU time, unlike wall time, barely moves with the load of other processes
on a shared machine, which is what a grid's budget in core-hours is counted in. The cost of
a run is ``steps x step time x (1 + overhead)`` (``--overhead``: evaluations, logging and
checkpoints, about 3-5 % at the `cpu` preset's cadence); the split assigns variants (all their
seeds) to ``--processes`` processes, largest first, each to the least loaded process.

    python benchmarks/plan_scaling_grid.py --preset cpu --seeds 2 --processes 2
    python benchmarks/plan_scaling_grid.py --quick        # the tiny preset, one round

Prints a table and the ``--variants`` lists; nothing is written.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from attnres.experiments import get_experiment
from attnres.experiments.job.runner import run_config
from attnres.models import AttnResLM
from attnres.train.optim import build_optimizer


def _step(config):
    torch.manual_seed(0)
    model = AttnResLM(config.model)
    opt = build_optimizer(model, config)
    ids = torch.randint(0, config.model.vocab_size, (config.batch_size, config.seq_len))

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def step_cpu_seconds(preset: str, rounds: int) -> dict[str, tuple[float, int]]:
    """``{variant: (median CPU seconds per step, steps)}`` for the scaling grid ``preset``."""
    exp = get_experiment("scaling", preset)
    configs = {v.name: run_config(exp, v, 0, Path("unused")) for v in exp.variants}
    steps = {name: _step(c) for name, c in configs.items()}
    for step in steps.values():  # warm-up: first-call allocations, kernel builds
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t = time.process_time()
            step()
            times[name].append(time.process_time() - t)
    return {name: (statistics.median(ts), configs[name].steps) for name, ts in times.items()}


def split(costs: dict[str, float], processes: int) -> list[list[str]]:
    """Variants over ``processes`` lists with nearly equal summed cost (largest first, each
    to the least loaded list)."""
    parts: list[list[str]] = [[] for _ in range(processes)]
    load = [0.0] * processes
    for name in sorted(costs, key=costs.get, reverse=True):
        i = load.index(min(load))
        parts[i].append(name)
        load[i] += costs[name]
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cpu", help="scaling preset (default cpu)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per variant (default 2)")
    parser.add_argument("--processes", type=int, default=2, help="processes to split the grid over (default 2)")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds (default 6)")
    parser.add_argument("--overhead", type=float, default=0.04, help="evaluation/logging/checkpoint share (default 0.04)")
    parser.add_argument("--quick", action="store_true", help="tiny preset, one round (a smoke run)")
    args = parser.parse_args()
    try:
        get_experiment("scaling", args.preset)
    except ValueError as e:
        parser.error(f"argument --preset: {e}")
    for name in ("seeds", "processes", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name}: must be an integer >= 1, got {getattr(args, name)}")
    if not 0 <= args.overhead < 1:  # (a share of the run: a negative one planned less than the steps alone)
        parser.error(f"argument --overhead: must be a share in [0, 1), got {args.overhead}")
    torch.set_num_threads(1)
    preset, rounds = ("tiny", 1) if args.quick else (args.preset, args.rounds)
    measured = step_cpu_seconds(preset, rounds)
    costs = {name: t * steps * args.seeds * (1 + args.overhead) for name, (t, steps) in measured.items()}
    print(f"| variant | steps | CPU s/step | CPU h ({args.seeds} seeds) |\n|---|---|---|---|")
    for name, (t, steps) in measured.items():
        print(f"| {name} | {steps} | {t:.3f} | {costs[name] / 3600:.2f} |")
    print(f"\ngrid: {sum(costs.values()) / 3600:.2f} CPU core-hours ({args.seeds} seeds, overhead {args.overhead:.0%})")
    for i, part in enumerate(split(costs, args.processes), 1):
        print(f"process {i} ({sum(costs[n] for n in part) / 3600:.2f} h): --variants {' '.join(part)}")


if __name__ == "__main__":
    main()
