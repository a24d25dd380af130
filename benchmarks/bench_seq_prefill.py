"""Sequence-sharded prefill (report §4.2): per-rank bytes of depth sources, measured, for P = 1, 2, 4.

    python benchmarks/bench_seq_prefill.py            # launches torchrun for each P (CPU, gloo)
    python benchmarks/bench_seq_prefill.py --out runs/seq_prefill   # the same, not over the committed results

Each rank runs :func:`attnres.distributed.sequence_parallel.sharded_prefill` on its T/P
positions and measures the bytes of the depth sources its residual holds (the embedding and
every completed block for Block AttnRes, every sublayer output for Full AttnRes). Rank 0 also
checks the gathered logits against a one-process forward. Results go to
``benchmarks/results/seq_prefill.{json,md}``, the committed results, which the bare command
rewrites on purpose (``--out PATH`` for another place).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnres import AttnResLM, ModelConfig

HERE = Path(__file__).resolve().parent
WORLD_SIZES = (1, 2, 4)
SEQ, BATCH = 2048, 1
SHAPES = {
    "attnres_block": dict(vocab_size=512, d_model=256, n_layers=8, n_heads=4, max_seq_len=SEQ,
                          residual={"kind": "attnres_block", "block_size": 4}),
    "attnres_full": dict(vocab_size=512, d_model=256, n_layers=8, n_heads=4, max_seq_len=SEQ),
}


def worker(out: Path) -> None:
    import torch.distributed as dist

    from attnres.distributed.sequence_parallel import gather_sequence, sharded_prefill

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for residual, shape in SHAPES.items():
        torch.manual_seed(0)
        model = AttnResLM(ModelConfig(**{"residual": residual, **shape})).eval()
        ids = torch.randint(0, shape["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        dist.barrier()
        t0 = time.perf_counter()
        res = sharded_prefill(model, ids)
        seconds = time.perf_counter() - t0
        logits = gather_sequence(res.logits)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, res.source_bytes)
        if rank == 0:
            with torch.no_grad():
                want = model(ids).logits
            err = ((logits - want).norm() / want.norm()).item()
            rows.append(dict(residual=residual, P=world, n_sources=res.n_sources, d_model=shape["d_model"],
                             source_bytes_per_rank=per_rank, formula_bytes=res.n_sources * BATCH * (SEQ // world) * shape["d_model"] * 4,
                             seconds_rank0=seconds, logits_rel_err=err))
    if rank == 0:
        out.write_text(json.dumps(rows))
    dist.destroy_process_group()


def render(r: dict) -> str:
    lines = [
        "# Sequence-sharded prefill: depth-source memory per rank (CPU, gloo)",
        "",
        f"Command: `{r['command']}`  ",
        f"Prompt: batch {BATCH} x T={SEQ} tokens, float32; d=256, 8 transformer blocks (L=16 sublayers); "
        "Block AttnRes with S=4 (N=4 blocks + the embedding = 5 sources), Full AttnRes (L+1 = 17 sources).  ",
        f"Machine: {r['machine']}.",
        "",
        "*bytes/rank* is measured from the tensors the residual holds after the prefill (max over ranks); "
        "*formula* = sources x B x (T/P) x d x 4 bytes; *error* = relative error of the gathered logits "
        "against a one-process forward; *time* = rank 0's prefill wall time (2 shared CPU cores, so not a speed-up measurement).",
        "",
        "| residual | P | sources | bytes / rank | formula | vs P=1 | error | time s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {row["residual"]: max(row["source_bytes_per_rank"]) for row in r["rows"] if row["P"] == 1}
    for row in r["rows"]:
        held = max(row["source_bytes_per_rank"])
        lines.append(f"| {row['residual']} | {row['P']} | {row['n_sources']} | {held:,} | {row['formula_bytes']:,} | "
                     f"{held / base[row['residual']]:.3f} | {row['logits_rel_err']:.1e} | {row['seconds_rank0']:.2f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from bench_training_overhead import out_stem

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # (the bare command reproduces the committed results, as the other benchmarks' do)
    parser.add_argument("--out", type=out_stem, default=str(HERE / "results" / "seq_prefill"),
                        help="output path without suffix (default: benchmarks/results/seq_prefill, the committed "
                             "results, rewritten)")
    return parser.parse_args(argv)


def main() -> None:
    from bench_training_overhead import run_header, write_results

    args = parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in WORLD_SIZES:
            out = Path(tmp) / f"p{world}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   __file__, str(out)]
            subprocess.run(cmd, check=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
            rows += json.loads(out.read_text())
    rows.sort(key=lambda row: (row["residual"], row["P"]))
    machine = f"{os.cpu_count()} CPUs, 1 torch thread per rank, torch {torch.__version__}, {platform.machine()}"
    # The command as run, --out included (it always said the bare command).
    results = {"command": run_header()["command"], "machine": machine, "rows": rows}
    write_results(Path(args.out), results, render)


if __name__ == "__main__":
    if "RANK" in os.environ:
        worker(Path(sys.argv[1]))
    else:
        main()
