"""Forecast, on the CPU, the peak step memory ratio that `gpu_check.py` measures on a GPU.

The GPU check's training step (bf16 autocast, the models of `gpu_check.build_models`) run on
the CPU at a smaller shape with the GPU shape's proportions: 8 sublayers per block (S = 8
of 64 sublayers there), the head's share of the activations kept by a smaller vocabulary.
Two numbers per model:

* **saved**: the bytes of the tensors autograd saves for the backward (storage-deduplicated,
  parameters not counted) - what stays alive from the forward to the backward, the bulk of a
  step's peak. They depend only on what each operator's autograd saves, the same whichever
  backend runs it (the depth-attention operators save their inputs and softmax statistics,
  not their outputs: `ops/depth_attention/library.py`), so the CPU's figure should be the
  GPU's. **It did not predict the GPU's peak**: on an H200 the Block step's peak was 1.121x
  the standard's (benchmarks/results/gpu-h200) where this forecasts 0.967x; `gpu_check.py`
  now records the saved bytes on the GPU too, to tell whether the gap is in what is saved
  or in the backward's transients.
* **peak**: the largest rise of live CPU allocations during the step (profiler memory
  events), transients of the CPU kernels included; on the GPU the Triton kernels' transients
  differ (a few `[tokens, d]` buffers at most), so this is the rougher of the two.

    python benchmarks/memory_forecast.py                     # ~1 min on 2 cores
    python benchmarks/memory_forecast.py --d 512 --layers 4 --seq 128   # quicker

Writes ``benchmarks/results/memory_forecast.{json,md}`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_check  # noqa: E402

from attnres.analysis.profiling import peak_memory_bytes  # noqa: E402

#: The GPU check's shape scaled down: d 2048 -> 1024, 32 -> 8 transformer blocks with 8
#: sublayers per block, 4 x 2048 -> 2 x 512 tokens, and a vocabulary (32000 -> 4096) that
#: keeps the head near its share of the GPU step's activations (~3 %).
FORECAST = replace(gpu_check.Sizes(), d=1024, layers=8, blocks=2, seq=512, batch=2, vocab=4096)


def measure(z) -> dict:
    """``{"saved": {model: bytes}, "peak": {model: bytes}}`` for the GPU check's models."""
    torch.manual_seed(0)
    ids = torch.randint(0, z.vocab, (z.batch, z.seq))
    models = gpu_check.build_models(z, "cpu")
    out: dict[str, dict[str, int]] = {"saved": {}, "peak": {}}
    for name, model in models.items():
        def step(model=model):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        step()  # warm-up (first-call allocations)
        out["saved"][name] = gpu_check.saved_bytes(model, step)
        out["peak"][name] = peak_memory_bytes(step)
    return out


def table(result: dict) -> str:
    lines = ["| model | saved for backward MiB | ratio | peak step MiB | ratio |", "|---|---:|---:|---:|---:|"]
    saved, peak = result["saved"], result["peak"]
    for name in saved:
        lines.append(f"| {name} | {saved[name] / 2**20:.1f} | {saved[name] / saved['standard']:.3f} | "
                     f"{peak[name] / 2**20:.1f} | {peak[name] / peak['standard']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in ("d", "layers", "blocks", "seq", "batch", "vocab"):
        parser.add_argument(f"--{field}", type=int, default=getattr(FORECAST, field))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(HERE / "results" / "memory_forecast"),
                        help="output path without extension (.json and .md are written)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    z = replace(FORECAST, **{f: getattr(args, f) for f in ("d", "layers", "blocks", "seq", "batch", "vocab")})
    if (2 * z.layers) % z.blocks:
        parser.error(f"--blocks must divide the {2 * z.layers} sublayers; got {z.blocks}")
    result = measure(z)
    text = (f"# Peak step memory forecast (CPU, bf16 autocast)\n\nShape: d = {z.d}, {z.layers} transformer blocks, "
            f"Block AttnRes with {z.blocks} blocks ({2 * z.layers // z.blocks} sublayers each), "
            f"{z.batch} x {z.seq} tokens, vocabulary {z.vocab}.\n\n"
            f"`{' '.join(['python benchmarks/memory_forecast.py', *(argv if argv is not None else sys.argv[1:])])}`\n\n"
            + table(result) + "\n")
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"sizes": asdict(z), **result}, indent=1) + "\n")
    Path(args.out + ".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
