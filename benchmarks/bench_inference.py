"""Inference latency of Block / Full AttnRes against the standard residual (CPU; eager, or ``--compile``).

Shape (issue 4): preset ``bench-infer`` - d = 1024, 16 transformer blocks (L = 32
sublayers), Block AttnRes with S = 4 (N = 8 blocks), vocabulary 8192, float32.

* **Prefill**: one-shot prefill of a ``--prompt`` (1024) token prompt at batch 1, last-position
  logits only, KV cache filled.
* **Decode**: one cached decode step (one new token per sequence) at batch 1 and 8 with
  ``--context`` (1024) cached positions. The cache holds random keys/values (decode cost does
  not depend on their values) and is cropped back after every step, so every step sees the
  same context.
* **Two-phase vs naive**: the same models with ``residual.schedule = "naive"`` (same weights).
* **Peak memory**: largest rise of live CPU allocations during one prefill of the two-phase
  models (profiler memory events; parameters not counted, the KV cache is), one-shot and
  chunked (``--chunk``).

All variants are timed **interleaved** (one step of each per round) after a warm-up, and we
report medians, the ratio of medians to the standard model, and the median of per-round
ratios. Timings on a shared 2-core machine are noisy; the ratios are the result.

    python benchmarks/bench_inference.py            # full run (~6 min on 2 cores)
    python benchmarks/bench_inference.py --quick    # a smoke run (smaller model and prompt)

Writes ``benchmarks/results/inference.{json,md}`` (``--quick`` writes ``inference_quick``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from bench_training_overhead import (block_size_of, log, out_stem, positive_int, positive_ints, run_header, summarize,
                                     write_results)

from attnres.analysis.profiling import CLOCKS, peak_memory_bytes, time_interleaved

from attnres import AttnResLM, ModelConfig
from attnres.inference import KVCache, decode_step, prefill

# `standard_twin` is a second standard model with the same weights: an A/A control whose ratio
# to `standard` shows the measurement's noise floor.
RESIDUALS = {"standard": "standard", "block": "attnres_block", "full": "attnres_full", "standard_twin": "standard"}


def with_schedule(model: AttnResLM, schedule: str, fn):
    """``fn`` run with the model's AttnRes module switched to ``schedule`` (same weights)."""

    def step():
        model.residual.schedule = schedule
        try:
            fn()
        finally:
            model.residual.schedule = "two_phase"

    return step


def variant_steps(models: dict[str, AttnResLM], make, naive: bool = True) -> dict:
    """``make(model)`` -> step, for every model and (``naive``) for the naive twins of the
    AttnRes ones."""
    steps = {name: make(m) for name, m in models.items()}
    for name in ("block", "full"):
        if naive and name in models:
            steps[f"{name}_naive"] = with_schedule(models[name], "naive", make(models[name]))
    return steps


def filled_cache(cfg: ModelConfig, batch: int, context: int) -> KVCache:
    cache = KVCache(cfg.n_layers, capacity=context + 1)
    g = torch.Generator().manual_seed(0)
    shape = (batch, cfg.kv_heads, context, cfg.head_dim)
    for layer in range(cfg.n_layers):
        cache.update(layer, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    return cache


def warm(steps: dict, what: str, times: int = 1) -> None:
    for name, step in steps.items():
        t0 = time.perf_counter()
        for _ in range(times):
            step()
        log(f"[{what}] warm-up {name}: {time.perf_counter() - t0:.2f} s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=positive_int, default=1024)
    p.add_argument("--context", type=positive_int, default=1024)
    p.add_argument("--batches", type=positive_ints, default="1,8")
    p.add_argument("--chunk", type=positive_int, default=256)
    p.add_argument("--repeats-prefill", type=positive_int, default=3)
    p.add_argument("--repeats-decode", type=positive_int, default=15)
    p.add_argument("--repeats-naive-prefill", type=int, default=2,
                   help="rounds of the two-phase vs naive prefill comparison, timed apart from the main one (a naive "
                   "Full AttnRes prefill of 1024 tokens takes several times the standard model on CPU); 0 = skip")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time, or CPU time of the process (steadier on a shared machine; use with --threads 1)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true",
                   help="time torch.compile'd models (inductor; compiling takes minutes per model and shape). "
                   "The naive schedule is not timed then (it is the eager reference)")
    p.add_argument("--quick", action="store_true", help="4 blocks, prompt/context 128, 2 rounds: a smoke run")
    p.add_argument("--out", type=out_stem, default=None,
                   help="output path without suffix (default: benchmarks/results/inference[_compiled][_quick])")
    args = p.parse_args(argv)
    if args.repeats_naive_prefill < 0:
        p.error(f"argument --repeats-naive-prefill: must be an integer >= 0, got {args.repeats_naive_prefill}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    overrides = {}
    if args.quick:
        overrides = dict(n_layers=4)
        args.prompt = args.context = 128
        args.chunk = 32
        args.repeats_prefill = args.repeats_decode = 2
    name = "inference" + ("_compiled" if args.compile else "") + ("_quick" if args.quick else "")
    out = Path(args.out or Path(__file__).parent / "results" / name)

    base = ModelConfig.preset("bench-infer", **overrides)
    models = {}
    for name, residual in RESIDUALS.items():
        torch.manual_seed(0)
        models[name] = AttnResLM(base.replace(residual=residual)).eval()
    # dynamic=False: one static graph per shape (prefill, decode b=1, b=8), the fastest code for each.
    # All variants compile the same `forward`, whose graphs share one per-function cache: 3 residuals
    # x 3 shapes exceed Dynamo's default limit of 8, past which it silently runs eager.
    if args.compile:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    runners = {name: torch.compile(m, dynamic=False) if args.compile else m for name, m in models.items()}
    prompt = torch.randint(0, base.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    results = {
        "config": {**base.to_dict(), "prompt": args.prompt, "context": args.context, "chunk": args.chunk, "dtype": "float32"},
        **run_header(),
        "clock": args.clock,
        "compiled": args.compile,
        "timing": {},
        "peak_memory_bytes": {},
    }

    # -- prefill -------------------------------------------------------------------------
    steps = variant_steps(runners, lambda m: lambda: prefill(m, prompt), naive=False)
    warm(steps, "prefill", times=2 if args.compile else 1)
    results["timing"]["prefill"] = summarize(time_interleaved(steps, args.repeats_prefill, log, args.clock))
    if args.repeats_naive_prefill and not args.compile:
        steps = variant_steps({k: models[k] for k in ("standard", "block", "full")}, lambda m: lambda: prefill(m, prompt))
        warm({k: v for k, v in steps.items() if k.endswith("_naive")}, "prefill naive")
        results["timing"]["prefill vs naive"] = summarize(
            time_interleaved(steps, args.repeats_naive_prefill, log, args.clock))
    for name, m in models.items():  # the two-phase models (the naive path is the test reference)
        if name == "standard_twin":
            continue
        results["peak_memory_bytes"][name] = peak_memory_bytes(lambda m=m: prefill(m, prompt))
    for name, m in models.items():
        if name == "standard_twin":
            continue
        results["peak_memory_bytes"][f"{name} (chunk {args.chunk})"] = peak_memory_bytes(
            lambda m=m: prefill(m, prompt, chunk_size=args.chunk)
        )
    log("peak memory (MiB): " + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in results["peak_memory_bytes"].items()))

    # -- decode --------------------------------------------------------------------------
    for batch in (int(b) for b in args.batches.split(",")):
        cache = filled_cache(base, batch, args.context)
        tokens = torch.randint(0, base.vocab_size, (batch,), generator=torch.Generator().manual_seed(1))

        def make(m, cache=cache, tokens=tokens):
            def step():
                decode_step(m, cache, tokens)
                cache.crop(args.context)

            return step

        steps = variant_steps(runners, make, naive=not args.compile)
        warm(steps, f"decode b={batch}", times=2)
        results["timing"][f"decode b={batch}"] = summarize(time_interleaved(steps, args.repeats_decode, log, args.clock))
        del cache, steps

    write_results(out, results, render_markdown)
    return 0


def render_markdown(r: dict) -> str:
    c = r["config"]
    lines = [
        f"# Inference latency of AttnRes over the standard residual (CPU, {'torch.compile' if r.get('compiled') else 'eager'})",
        "",
        f"Command: `{r['command']}`  ",
        f"Shape: d={c['d_model']}, {c['n_layers']} transformer blocks (L={2 * c['n_layers']}), Block S={block_size_of(c)} "
        f"(N={-(-2 * c['n_layers'] // block_size_of(c))}), vocab {c['vocab_size']}, {c['dtype']}; prefill: batch 1, "
        f"prompt {c['prompt']}; decode: one token per sequence with {c['context']} cached positions.  ",
        f"Machine: {r['machine']['cpu_count']} CPUs, {r['machine']['threads']} torch threads, torch {r['machine']['torch']}.",
        "",
        f"Clock: {r.get('clock', 'wall')} ({'CPU time of the process: waiting for a core taken by another process does not count' if r.get('clock') == 'cpu' else 'elapsed wall time'}).",
        "",
        "Times are medians over interleaved rounds; *ratio* = median / median of the standard model; "
        "*paired* = median over rounds of (this / standard) in the same round. `standard_twin` is the same "
        "standard model timed as if it were another variant: its distance from 1 is the noise floor.",
        "",
        "| phase | variant | median ms | ratio | paired ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for phase, rows in r["timing"].items():
        for name, s in rows.items():
            lines.append(f"| {phase} | {name} | {s['median_ms']:.2f} | {s['ratio_of_medians']:.4f} | {s['median_paired_ratio']:.4f} |")
    with_naive = {phase: rows for phase, rows in r["timing"].items() if any(k.endswith("_naive") for k in rows)}
    if with_naive:
        lines += ["", "Two-phase vs naive: speed-up = naive median / two-phase median", "", "| phase | block | full |",
                  "|---|---:|---:|"]
    else:
        lines += ["", "The naive schedule is not timed here (compiled runs time the two-phase path only; the eager "
                  "results have the two-phase vs naive speed-up)."]
    for phase, rows in with_naive.items():
        cells = [f"{rows[f'{v}_naive']['median_ms'] / rows[v]['median_ms']:.2f}x" if f"{v}_naive" in rows else "not run"
                 for v in ("block", "full")]
        lines.append(f"| {phase} | {' | '.join(cells)} |")
    base = r["peak_memory_bytes"]["standard"]
    lines += ["", "Peak memory of one prefill (rise of live CPU allocations; parameters not counted, KV cache counted):", "",
              "| variant | peak MiB | ratio to standard one-shot |", "|---|---:|---:|"]
    for name, b in r["peak_memory_bytes"].items():
        lines.append(f"| {name} | {b / 2**20:.1f} | {b / base:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
