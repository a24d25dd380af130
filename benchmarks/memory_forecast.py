"""Forecast, on the CPU, the peak step memory ratio that `gpu_check.py` measures on a GPU.

The GPU check's training step (bf16 autocast, the models of `gpu_check.build_models`) run on
the CPU at a smaller shape with the GPU shape's proportions: 8 sublayers per block (S = 8
of 64 sublayers there), the head's share of the activations kept by a smaller vocabulary.
Two numbers per model:

* **kept**: the bytes the forward leaves allocated for the backward (what autograd saves,
  the loss): the bulk of a step's peak. They depend on what each operator's autograd saves,
  the same whichever backend runs the depth-attention operators - but not the same for
  PyTorch's RMSNorm: on CUDA it is one fused operator that saves its input and ``1/rms``,
  on the CPU a composite that also keeps its float32 normalised output. The forecast runs
  the standard model's norms as the GPU does (``gpu_like_rms_norm``); without that it had
  forecast 0.967x where the H200 measured 1.121x (benchmarks/results/gpu-h200), the merges
  then keeping each sublayer's Phase-1 sum besides its partial sum - which
  ``ResidualConfig.recompute_phase1`` (default) no longer keeps: the ``block (sums kept)``
  row is the model without it.
* **peak**: the largest rise of live CPU allocations during the step (profiler memory
  events), transients of the CPU kernels included; on the GPU the Triton kernels' transients
  differ (a few `[tokens, d]` buffers at most), so this is the rougher of the two.

    python benchmarks/memory_forecast.py                     # ~1 min on 2 cores
    python benchmarks/memory_forecast.py --layers 8 --blocks 2 --seq 128   # quicker

Writes ``benchmarks/results/memory_forecast.{json,md}`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_check  # noqa: E402
from bench_training_overhead import out_stem, positive_int  # noqa: E402

from attnres import AttnResLM  # noqa: E402
from attnres.analysis.profiling import peak_memory_bytes  # noqa: E402
from attnres.output_paths import strict_json, write_text_atomically  # noqa: E402

#: The GPU check's shape scaled down: d 2048 -> 512 and 4 x 2048 -> 2 x 512 tokens, with its
#: depth (32 transformer blocks, 8 blocks of 8 sublayers: the share of sublayers with a
#: Phase-1 sum is the GPU's) and a vocabulary (32000 -> 2048) that keeps the head near its
#: share of the GPU step's activations.
FORECAST = replace(gpu_check.Sizes(), d=512, layers=32, blocks=8, seq=512, batch=2, vocab=2048)


class _FusedRMSNorm(torch.autograd.Function):
    """``F.rms_norm`` saving what CUDA's fused RMSNorm saves: its input, ``1/rms`` and the
    weight (the backward re-forms the normalised input from them)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = _wide(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        y = xf * rstd
        return (y if weight is None else y * weight).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, rstd, weight = ctx.saved_tensors
        xhat, g = _wide(x) * rstd, _wide(g)
        gy = g if weight is None else g * weight
        gx = rstd * (gy - xhat * (gy * xhat).mean(-1, keepdim=True))
        gw = None if weight is None else (g * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return gx.to(x.dtype), gw, None


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


@contextlib.contextmanager
def gpu_like_rms_norm() -> Iterator[None]:
    """``F.rms_norm`` over the last dimension saving for the backward what it saves on CUDA."""
    composite = F.rms_norm

    def rms_norm(x, shape, weight=None, eps=None):
        if not torch.is_grad_enabled() or len(shape) != 1:
            return composite(x, shape, weight, eps)
        return _FusedRMSNorm.apply(x, weight, torch.finfo(x.dtype).eps if eps is None else eps)

    F.rms_norm = rms_norm
    try:
        yield
    finally:
        F.rms_norm = composite


def models_of(z) -> dict:
    """The GPU check's models, and Block AttnRes keeping its Phase-1 sums."""
    models = gpu_check.build_models(z, "cpu")
    torch.manual_seed(0)
    residual = {**gpu_check.residual_of("block", z), "recompute_phase1": False}
    models["block (sums kept)"] = AttnResLM(gpu_check.model_config(z, residual))
    return models


def measure(z) -> dict:
    """``{"kept": {model: bytes}, "peak": {model: bytes}}`` for the models of :func:`models_of`."""
    torch.manual_seed(0)
    ids = torch.randint(0, z.vocab, (z.batch, z.seq))
    out: dict[str, dict[str, int]] = {"kept": {}, "peak": {}}
    with gpu_like_rms_norm():
        for name, model in models_of(z).items():
            forward = gpu_check.forward_of(model, ids, "cpu")

            def step(model=model, forward=forward):
                forward().backward()
                model.zero_grad(set_to_none=True)

            step()  # warm-up (first-call allocations)
            out["kept"][name] = gpu_check.kept_bytes(forward, "cpu")
            out["peak"][name] = peak_memory_bytes(step)
    return out


def table(result: dict) -> str:
    lines = ["| model | kept for backward MiB | ratio | peak step MiB | ratio |", "|---|---:|---:|---:|---:|"]
    kept, peak = result["kept"], result["peak"]
    for name in kept:
        lines.append(f"| {name} | {kept[name] / 2**20:.1f} | {kept[name] / kept['standard']:.3f} | "
                     f"{peak[name] / 2**20:.1f} | {peak[name] / peak['standard']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in ("d", "layers", "blocks", "seq", "batch", "vocab"):
        parser.add_argument(f"--{field}", type=positive_int, default=getattr(FORECAST, field))
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--out", type=out_stem, default=str(HERE / "results" / "memory_forecast"),
                        help="output path without extension (.json and .md are written)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    z = replace(FORECAST, **{f: getattr(args, f) for f in ("d", "layers", "blocks", "seq", "batch", "vocab")})
    if (2 * z.layers) % z.blocks:
        parser.error(f"argument --blocks: must divide the {2 * z.layers} sublayers (2 x --layers); got {z.blocks}")
    result = measure(z)
    text = (f"# Peak step memory forecast (CPU, bf16 autocast, norms saving as on CUDA)\n\nShape: d = {z.d}, {z.layers} transformer blocks, "
            f"Block AttnRes with {z.blocks} blocks ({2 * z.layers // z.blocks} sublayers each), "
            f"{z.batch} x {z.seq} tokens, vocabulary {z.vocab}.\n\n"
            f"`{' '.join(['python benchmarks/memory_forecast.py', *(argv if argv is not None else sys.argv[1:])])}`\n\n"
            + table(result) + "\n")
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(Path(args.out + ".json"), strict_json({"sizes": asdict(z), **result}, indent=1) + "\n")
    write_text_atomically(Path(args.out + ".md"), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
