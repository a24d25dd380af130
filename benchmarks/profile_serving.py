"""Where the time of served AttnRes models goes in vLLM on CPU: torch.profiler's operator
table for each model of :mod:`bench_serving`, side by side.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the profiler
sees the model's operators: vLLM's matrix products and attention, the calls into the
compiled graph (``## Call CompiledFxGraph ##``, whose self time is inductor's own kernels -
the residual's elementwise work among them) and any operator the graph calls out to. Each
model serves :mod:`bench_serving`'s workload (same models, same prompts) once as a warm-up,
then ``--rounds`` times under the profiler; twice over: prefill only (one generated token)
and the whole workload. The table gives self CPU time per workload and calls per workload of
the operators that take the most time in any model.

    python benchmarks/profile_serving.py                 # -> benchmarks/results/serving_profile.md
    python benchmarks/profile_serving.py --quick         # tiny models (serving_profile_quick.md)

Profiling adds overhead and one run is noisy: compare operators' call counts and the
larger differences, and take timings from ``bench_serving.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # (the engine core in this process: the profiler sees it)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serving  # noqa: E402

from attnres.output_paths import write_text_atomically  # noqa: E402

PARTS = {"prefill": 1, "workload": None}  # max_tokens (None: bench_serving's --max-tokens)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="standard,block,full", help="models of bench_serving (standard,block,full)")
    p.add_argument("--rounds", type=int, default=2, help="profiled workloads per model and part (2)")
    p.add_argument("--top", type=int, default=12, help="operators in the table (12)")
    p.add_argument("--quick", action="store_true", help="tiny models, a smoke run")
    args = p.parse_args(argv)
    args.variants = args.variants.split(",")
    unknown = sorted(set(args.variants) - set(bench_serving.VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {sorted(bench_serving.VARIANTS)}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def profile(args, llm, prompts, max_tokens: int) -> dict[str, tuple[float, float]]:
    """``{operator: (self CPU ms per workload, calls per workload)}``."""
    import torch
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.rounds):
            llm.generate(prompts, params, use_tqdm=False)
    return {e.key: (e.self_cpu_time_total / 1e3 / args.rounds, e.count / args.rounds) for e in prof.key_averages()}


def markdown(args, tables: dict) -> str:
    lines = ["# Where served models spend their time (vLLM on CPU, torch.profiler)", "",
             f"`python benchmarks/profile_serving.py{' --quick' if args.quick else ''}` - the models and workload of "
             f"`bench_serving.py`, {args.rounds} profiled workloads per model and part; self CPU time (ms) and calls "
             "per workload. Profiling adds overhead: compare call counts and large differences; timings come from "
             "`bench_serving.py`.", ""]
    for part in PARTS:
        rows = {}
        for name in args.variants:
            for op, (ms, _) in tables[name, part].items():
                rows[op] = max(rows.get(op, 0.0), ms)
        top = sorted(rows, key=rows.get, reverse=True)[: args.top]
        lines += [f"## {part}", "", "| operator | " + " | ".join(f"{n}: ms | {n}: calls" for n in args.variants) + " |",
                  "|---|" + "---:|---:|" * len(args.variants)]
        for op in top:
            cells = [tables[n, part].get(op, (0.0, 0.0)) for n in args.variants]
            lines.append(f"| `{op}` | " + " | ".join(f"{ms:.1f} | {calls:.0f}" for ms, calls in cells) + " |")
        totals = [sum(ms for ms, _ in tables[n, part].values()) for n in args.variants]
        lines += ["| total self CPU | " + " | ".join(f"{t:.1f} | " for t in totals) + " |", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    bench_serving.import_vllm()
    bench_args = bench_serving.parse_args(["--quick"] if args.quick else [])
    # (the served models' directories: removed when the run ends, also on an error or Ctrl-C)
    with tempfile.TemporaryDirectory(prefix="attnres-profile-") as root:
        tables = profile_models(args, bench_args, Path(root))
    out = bench_serving.RESULTS / f"serving_profile{'_quick' if args.quick else ''}.md"
    text = markdown(args, tables)
    write_text_atomically(out, text)
    print(text)


def profile_models(args, bench_args, root: Path) -> dict:
    """Write the models of ``args.variants`` into ``root`` and profile each: ``{(model, part):
    its operator table}`` (:func:`profile`)."""
    models = bench_serving.write_models(bench_args, root)
    prompts = bench_serving.workload(bench_args, models["standard"][1].config.vocab_size)
    tables = {}
    for name in args.variants:
        llm = bench_serving.engine(bench_args, models[name][0])
        for part, max_tokens in PARTS.items():
            tables[name, part] = profile(args, llm, prompts, max_tokens or bench_args.max_tokens)
        del llm
    return tables


if __name__ == "__main__":
    main()
