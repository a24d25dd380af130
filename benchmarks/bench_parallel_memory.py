"""Per-rank parameter memory under pipeline (``pp=2``) and tensor (``tp=2``) parallelism,
against one process holding the whole model (CPU, gloo).

Each layout is built the way ``attnres train`` builds it
(:func:`attnres.distributed.mesh_model.build_parallel_model`: under pp the model is built on
the ``meta`` device and only the stage's parameters are materialised; under tp the
projections, embedding and LM head are DTensor shards). Reported per rank: the bytes of the
parameters it holds (local shards), of the AdamW state after one step (two float32 moments
per parameter), and the resident set size of the process after that step (``ru_maxrss``;
includes torch itself, about the same in every process). Model: Block AttnRes, d=512,
8 transformer blocks, 8 heads, vocabulary 16384, float32.

    python benchmarks/bench_parallel_memory.py      # ~1 min on 2 cores

Writes ``benchmarks/results/parallel_memory.{json,md}`` (``--out PATH`` for another place).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from bench_training_overhead import log, out_stem, run_header, write_results

from attnres.distributed.local_spawn import run_local
from attnres.models import ModelConfig
from attnres.train.cpu_memory import peak_rss_bytes

MODEL = dict(vocab_size=16384, d_model=512, n_heads=8, n_layers=8, max_seq_len=64, tie_embeddings=False,
             residual={"kind": "attnres_block", "block_size": 4})
LAYOUTS = {"one process": (1, {}), "pp=2": (2, {"pp": 2}), "tp=2": (2, {"tp": 2})}


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def measure(parallel: dict) -> dict:
    from attnres.distributed import ParallelConfig, build_layout
    from attnres.distributed.mesh_model import build_parallel_model

    torch.set_num_threads(1)
    pc = ParallelConfig(**parallel)
    layout = build_layout(pc)
    pm = build_parallel_model(ModelConfig(**MODEL), pc, layout, torch.device("cpu"), seed=0)
    params = pm.parameters()
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    ids = torch.randint(0, MODEL["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))
    pm.forward_backward(pm.rows(ids), 1.0)
    pm.finish_grads()
    opt.step()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"param_bytes": pm.local_parameter_bytes(), "optimizer_bytes": local_bytes(state),
            "max_rss_bytes": peak_rss_bytes()}


def worker(spec: dict) -> None:
    dist.init_process_group("gloo")
    r = measure(spec["parallel"])
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, r)
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(rows))
    dist.destroy_process_group()


def render(res: dict) -> str:
    full = res["layouts"]["one process"][0]
    lines = [
        "# Per-rank parameter memory under pp=2 and tp=2 (CPU, gloo)",
        "",
        f"Command: `{res['command']}`  ",
        f"Model: Block AttnRes (S=4), d={MODEL['d_model']}, {MODEL['n_layers']} transformer blocks, {MODEL['n_heads']} heads, "
        f"vocabulary {MODEL['vocab_size']}, untied embedding and LM head, float32; built as `attnres train` builds it "
        f"(`build_parallel_model`). torch {res['machine']['torch']}.",
        "",
        "| layout | rank | parameters (MiB) | share of one process | AdamW state (MiB) | max RSS (MiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, rows in res["layouts"].items():
        for rank, r in enumerate(rows):
            lines.append(f"| {name} | {rank} | {r['param_bytes'] / 2**20:.2f} | {r['param_bytes'] / full['param_bytes']:.3f} | "
                         f"{r['optimizer_bytes'] / 2**20:.2f} | {r['max_rss_bytes'] / 2**20:.0f} |")
    lines += [
        "",
        "Under pp=2 each stage holds its own transformer blocks and depth queries (stage 0 the embedding, stage 1 "
        "the final norm and LM head); the other stage's parameters are never materialised (meta device). Under "
        "tp=2 the attention/MLP projections, the embedding (vocabulary rows) and the LM head are split; the "
        "norms' gains and the depth queries (2 d per sublayer) are replicated. The RSS (peak, whole process) also counts torch itself, "
        "the activations of the step and, in one process, the full build.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=out_stem, default=str(Path(__file__).parent / "results" / "parallel_memory"),
                        help="output path without suffix (default: benchmarks/results/parallel_memory)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return 0
    results = {**run_header(), "model": MODEL, "layouts": {}}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {"PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    for name, (n, parallel) in LAYOUTS.items():
        log(f"{name} ...")
        with tempfile.TemporaryDirectory() as tmp:
            spec = {"parallel": parallel, "out": str(Path(tmp) / "rows.json")}
            Path(tmp, "spec.json").write_text(json.dumps(spec))
            run_local([str(Path(__file__).resolve()), "--worker", str(Path(tmp) / "spec.json")], n, timeout=600, env=env)
            results["layouts"][name] = json.loads(Path(spec["out"]).read_text())
    write_results(Path(args.out), results, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
