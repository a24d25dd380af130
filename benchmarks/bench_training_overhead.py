"""Training and forward overhead of Block / Full AttnRes over the standard residual (CPU).

Shape (core issue): d = 512, 8 transformer blocks (L = 16 sublayers), Block AttnRes with
S = 4 (N = 4 blocks), sequence 256, batch 8, float32, vocabulary 8192, on the CPU.

Method: all models are built with the same seed; for every backend (eager, torch.compile)
and mode (train step = forward + backward; forward = inference-mode forward) each model is
warmed up, then the models are timed **interleaved** (one step of each, round after round),
and we report the median step time, the ratio of medians against the standard model, and
the median of the per-round ratios (robust to drifts that hit a whole round). Peak memory is
the largest rise of live CPU allocations above their level at the start of one eager
training step (profiler memory events): activations, gradients and temporaries; the
parameters and inputs, allocated before the step, are not counted. Timings on a shared 2-core machine are noisy; the
ratios are the result, not the absolute times.

The process keeps the memory a step frees for the next step (``--cpu-allocator retain``, as
``attnres train`` does; ``system``: glibc's defaults, which hand large freed blocks back and
page them in again every step, unevenly between the models), and the minor page faults of
one step are reported beside the times (attnres.train.cpu_memory).

    python benchmarks/bench_training_overhead.py            # full run (~15 min on 2 cores)
    python benchmarks/bench_training_overhead.py --quick    # a smoke run
    python benchmarks/bench_training_overhead.py --shape main-job --backends eager --modes train

``*_graph`` variants run the two-phase path as a plain autograd graph (``kernels="torch_graph"``,
the default before issue 17) beside the lean default, ``*_torch`` the lean path's PyTorch
code without the fused CPU merge kernel (``kernels="torch"``); ``--shape main-job`` is the main job's
model (d = 64, 12 blocks, S = 3, 16 x 128 tokens, one thread) and writes
``training_overhead_main_job.{json,md}``.

Writes ``benchmarks/results/training_overhead.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from attnres import AttnResLM, ModelConfig
from attnres.analysis.profiling import paired_summary, peak_memory_bytes, time_interleaved
from attnres.train.cpu_memory import CPU_ALLOCATORS, minor_page_faults, set_cpu_allocator

VARIANTS = {
    "standard": dict(residual="standard"),
    "block": dict(residual="attnres_block"),
    "full": dict(residual="attnres_full"),
    # The lean path in PyTorch only, without the fused CPU merge kernel (kernels="torch").
    "block_torch": dict(residual={"kind": "attnres_block", "kernels": "torch"}),
    "full_torch": dict(residual={"kind": "attnres_full", "kernels": "torch"}),
    # The two-phase path as a plain autograd graph (the default before the lean path).
    "block_graph": dict(residual={"kind": "attnres_block", "kernels": "torch_graph"}),
    "full_graph": dict(residual={"kind": "attnres_full", "kernels": "torch_graph"}),
    "block_naive": dict(residual={"kind": "attnres_block", "impl": "naive"}),
    "full_naive": dict(residual={"kind": "attnres_full", "impl": "naive"}),
}
#: Targets of the paired step-time ratio (issue 17; "forward": the core issue's).
TARGETS = {
    ("eager", "train", "block"): 1.03, ("eager", "train", "full"): 1.08,
    ("compile", "train", "block"): 1.02, ("compile", "train", "full"): 1.05,
    ("eager", "forward", "block"): 1.02,
}
#: Targets of the eager peak-memory ratio (issue 17).
MEMORY_TARGETS = {"block": 1.03, "full": 1.06}
#: ``--shape main-job``: the main job's model (``attnres compare --preset long``: d = 64, 12
#: blocks, S = 3) at its batch (16 x 128 tokens), one thread; issue-17 targets in eager.
MAIN_JOB = dict(vocab_size=4096, d_model=64, n_layers=12, n_heads=4, residual={"block_size": 3})
MAIN_JOB_TARGETS = {("eager", "train", "block"): 1.08, ("eager", "train", "full"): 1.15}


def run_header() -> dict:
    """The ``machine`` and ``command`` fields every benchmark result records."""
    return {
        "machine": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor(),
        },
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_step(model, runner, ids, mode):
    if mode == "train":

        def step():
            out = runner(ids, labels=ids)
            out.loss.backward()
            model.zero_grad(set_to_none=True)

    else:

        def step():
            with torch.inference_mode():
                runner(ids)

    return step


def page_faults(step) -> int:
    """Minor page faults of one call of ``step`` (fresh pages the kernel zero-fills)."""
    before = minor_page_faults()
    step()
    return minor_page_faults() - before


def summarize(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return paired_summary(times, "standard")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats-train", type=int, default=11)
    p.add_argument("--repeats-forward", type=int, default=21)
    p.add_argument("--backends", default="eager,compile")
    p.add_argument("--modes", default="train,forward")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--shape", choices=("bench-cpu", "main-job"), default="bench-cpu",
                   help="bench-cpu: d=512, 8 blocks, S=4 (default); main-job: d=64, 12 blocks, S=3, batch 16 x 128, "
                        "one thread")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; main-job: 1)")
    p.add_argument("--cpu-allocator", choices=CPU_ALLOCATORS, default="retain",
                   help="retain: freed memory stays in the process for the next step, as in `attnres train` "
                        "(default); system: glibc's defaults (attnres.train.cpu_memory)")
    p.add_argument("--quick", action="store_true", help="tiny repeats, no compile: a smoke run")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "training_overhead"))
    args = p.parse_args()
    if args.quick:
        args.repeats_train, args.repeats_forward, args.backends = 2, 2, "eager"
    if args.shape == "main-job":
        args.threads = args.threads or 1
        if args.batch == 8 and args.seq == 256:  # the defaults: the main job's batch instead
            args.batch, args.seq = 16, 128
        if args.out == p.get_default("out"):
            args.out = p.get_default("out") + "_main_job"
    if args.threads:
        torch.set_num_threads(args.threads)

    retained = set_cpu_allocator(args.cpu_allocator)
    torch.manual_seed(0)
    base = ModelConfig.preset("bench-cpu", max_seq_len=max(256, args.seq))
    if args.shape == "main-job":
        base = base.replace(**MAIN_JOB)
    variants = [v for v in args.variants.split(",") if v]
    if "standard" not in variants:
        variants.insert(0, "standard")
    models = {}
    for name in variants:
        torch.manual_seed(0)
        models[name] = AttnResLM(base.replace(**VARIANTS[name]))
    ids = torch.randint(0, base.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    results = {
        "config": {**base.to_dict(), "batch": args.batch, "seq": args.seq, "dtype": "float32", "shape": args.shape},
        **run_header(),
        "cpu_allocator": args.cpu_allocator, "freed_memory_retained": retained,
        "params": {k: m.num_parameters() for k, m in models.items()},
        "residual_params": {k: m.residual_parameters() for k, m in models.items()},
        "timing": {},
        "page_faults_per_step": {},
        "peak_memory_bytes": {},
    }
    for backend in args.backends.split(","):
        for mode in args.modes.split(","):
            names = [n for n in variants if backend == "eager" or not n.endswith("_naive")]
            steps = {}
            for name in names:
                model = models[name]
                runner = model if backend == "eager" else torch.compile(model)
                steps[name] = make_step(model, runner, ids, mode)
                t0 = time.perf_counter()
                steps[name]()
                steps[name]()
                log(f"[{backend}/{mode}] warm-up {name}: {time.perf_counter() - t0:.1f} s")
            repeats = args.repeats_train if mode == "train" else args.repeats_forward
            results["timing"][f"{backend}/{mode}"] = summarize(time_interleaved(steps, repeats, log))
            results["page_faults_per_step"][f"{backend}/{mode}"] = {name: page_faults(steps[name]) for name in names}
            if backend == "eager" and mode == "train":
                for name in names:
                    results["peak_memory_bytes"][name] = peak_memory_bytes(steps[name])
                    log(f"    peak memory {name}: {results['peak_memory_bytes'][name] / 2**20:.0f} MiB")
            torch._dynamo.reset()

    write_results(Path(args.out), results, render_markdown)
    return 0


def write_results(out: Path, results: dict, render) -> None:
    """Write ``out.json`` and the Markdown ``render(results)`` to ``out.md``, and print it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    md = render(results)
    out.with_suffix(".md").write_text(md)
    print(md)


def block_size_of(config: dict) -> int:
    """Block AttnRes' S from a saved config (nested ``residual``, or the flat key of earlier results)."""
    residual = config.get("residual")
    return residual["block_size"] if isinstance(residual, dict) else config["attnres_block_size"]


def allocator_line(r: dict) -> str:
    kind = r.get("cpu_allocator", "system")  # results before the setting: glibc's defaults
    if kind == "retain" and r.get("freed_memory_retained"):
        return ("CPU allocator: `retain` (freed memory stays in the process for the next step, as in "
                "`attnres train`; `--cpu-allocator system` for glibc's defaults).")
    return "CPU allocator: the system's (glibc's defaults: large freed blocks go back to the system)."


def render_markdown(r: dict) -> str:
    c = r["config"]
    lines = [
        "# Training overhead of AttnRes over the standard residual (CPU)",
        "",
        f"Command: `{r['command']}`  ",
        f"Shape: d={c['d_model']}, {c['n_layers']} transformer blocks (L={2 * c['n_layers']}), "
        f"Block S={block_size_of(c)}, seq {c['seq']}, batch {c['batch']}, {c['dtype']}, vocab {c['vocab_size']}.  ",
        f"Machine: {r['machine']['cpu_count']} CPUs, {r['machine']['threads']} torch threads, torch {r['machine']['torch']}.  ",
        allocator_line(r),
        "",
        "Times are medians over interleaved rounds; *ratio* = median / median of the standard model; "
        "*paired* = median over rounds of (this model / standard) in the same round.",
        "",
        "| backend / mode | variant | median ms | ratio | paired ratio | target |",
        "|---|---|---:|---:|---:|---|",
    ]
    targets = MAIN_JOB_TARGETS if c.get("shape") == "main-job" else TARGETS
    for key, rows in r["timing"].items():
        backend, mode = key.split("/")
        for name, s in rows.items():
            tgt = targets.get((backend, mode, name))
            verdict = ""
            if tgt is not None:
                ok = s["median_paired_ratio"] <= tgt
                verdict = f"<= {tgt:.2f}: {'met' if ok else 'missed'}"
            lines.append(
                f"| {key} | {name} | {s['median_ms']:.1f} | {s['ratio_of_medians']:.4f} | {s['median_paired_ratio']:.4f} | {verdict} |"
            )
    faults = r.get("page_faults_per_step", {})
    if faults:
        names = list(next(iter(faults.values())))
        lines += ["", "Minor page faults of one step (fresh 4 KiB pages the kernel zero-fills):", "",
                  "| backend / mode | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        lines += [f"| {key} | " + " | ".join(str(row.get(n, "")) for n in names) + " |" for key, row in faults.items()]
    if r["peak_memory_bytes"]:
        base = r["peak_memory_bytes"]["standard"]
        mem_targets = {} if c.get("shape") == "main-job" else MEMORY_TARGETS
        lines += ["", "Peak memory of one eager training step (rise of live CPU allocations during the step; parameters not counted):", "",
                  "| variant | peak MiB | ratio | target |", "|---|---:|---:|---|"]
        for name, b in r["peak_memory_bytes"].items():
            tgt = mem_targets.get(name)
            verdict = f"<= {tgt:.2f}: {'met' if b / base <= tgt else 'missed'}" if tgt else ""
            lines.append(f"| {name} | {b / 2**20:.0f} | {b / base:.3f} | {verdict} |")
    eager = r["timing"].get("eager/train", {})
    if "block_graph" in eager or "full_graph" in eager:
        lines += ["", "Lean vs graph two-phase path (eager, train step): graph median / lean median", ""]
        for v in ("block", "full"):
            if f"{v}_graph" in eager and v in eager:
                lines.append(f"- {v}: {eager[f'{v}_graph']['median_ms'] / eager[v]['median_ms']:.3f}x")
    if "block_naive" in eager or "full_naive" in eager:
        lines += ["", "Two-phase vs naive (eager, train step): speed-up = naive median / two-phase median", ""]
        for v in ("block", "full"):
            if f"{v}_naive" in eager and v in eager:
                lines.append(f"- {v}: {eager[f'{v}_naive']['median_ms'] / eager[v]['median_ms']:.2f}x")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
