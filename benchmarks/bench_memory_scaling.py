"""Extra peak memory of the AttnRes residual over the standard one, against depth and blocks.

For a small decoder (d = 128, vocab 256, batch 4 x 64 tokens, float32, CPU) we take the peak
memory of one eager training step (``attnres.analysis.profiling.peak_memory_bytes``: the rise
of live allocations during forward + backward; parameters not counted) of the standard
model and of Block and Full AttnRes, on the lean training path (the default) and on the
plain-graph path (``backend="reference"``, the default before issue 17), and plot the
difference to the standard model

* against L = 8 .. 64 sublayers (Block with S = 4, so N = L / 4 blocks), and
* against N = 2 .. 32 blocks at L = 32 (S = L / N; N = L is Full AttnRes),

beside the lines ``N d`` (Block: the block sums the standard residual does not keep) and
``L d`` (Full: the sublayer outputs), in bytes per step (x tokens x 4 bytes). Every norm
saves for the backward what PyTorch's fused RMSNorm saves on CUDA, its input and ``1/rms``
(``memory_forecast.gpu_like_rms_norm``; the CPU's composite ``F.rms_norm`` also keeps its
normalised output, which flattered the AttnRes residuals, whose norms are fused into the
merges).

    python benchmarks/bench_memory_scaling.py          # ~5 min on 2 cores
    python benchmarks/bench_memory_scaling.py --quick  # a smoke run (memory_scaling_quick.*)

Writes ``benchmarks/results/memory_scaling.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_training_overhead import log, out_stem, run_header, write_results  # noqa: E402
from memory_forecast import gpu_like_rms_norm  # noqa: E402

from attnres import AttnResLM, ModelConfig  # noqa: E402
from attnres.analysis.profiling import peak_memory_bytes  # noqa: E402

D, VOCAB, BATCH, SEQ = 128, 256, 4, 64


def peak(residual, n_layers: int, ids) -> int:
    cfg = ModelConfig(vocab_size=VOCAB, d_model=D, n_layers=n_layers, n_heads=4, max_seq_len=SEQ, residual=residual)
    torch.manual_seed(0)
    model = AttnResLM(cfg)

    def step():
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    return min(peak_memory_bytes(step) for _ in range(2))


#: The sweeps: L at S = 4, then N at L = 32 (``--quick``: two points each, at L = 8 for N -
#: every code path and the three files in seconds, beside the committed results).
SWEEPS = {"L": (8, 16, 32, 48, 64), "N": (2, 4, 8, 16, 32), "N at L": 32}
QUICK_SWEEPS = {"L": (4, 8), "N": (2, 4), "N at L": 8}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=out_stem, default=None,
                   help="output path without suffix (.json, .md and .png are written; default "
                        "benchmarks/results/memory_scaling[_quick])")
    p.add_argument("--quick", action="store_true", help="a smoke run: L = 4, 8 and N = 2, 4 at L = 8")
    args = p.parse_args(argv)
    sweeps = QUICK_SWEEPS if args.quick else SWEEPS
    args.out = args.out or str(Path(__file__).parent / "results" / f"memory_scaling{'_quick' if args.quick else ''}")
    torch.set_num_threads(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    tokens = BATCH * SEQ
    unit = tokens * D * 4  # one [tokens, d] float32 tensor
    rows = []
    paths = {"lean": {}, "graph": {"backend": "reference"}}

    def measure(sweep, L, S):
        n_layers = L // 2
        std = peak("standard", n_layers, ids)
        row = {"sweep": sweep, "L": L, "S": S, "N": -(-L // S), "standard": std}
        for path, extra in paths.items():
            row[f"block_{path}"] = peak({"kind": "attnres_block", "block_size": S, **extra}, n_layers, ids) - std
            if sweep == "L":
                row[f"full_{path}"] = peak({"kind": "attnres_full", **extra}, n_layers, ids) - std
        log(f"{row}")
        rows.append(row)

    with gpu_like_rms_norm():
        for L in sweeps["L"]:
            measure("L", L, 4)
        for N in sweeps["N"]:
            measure("N", sweeps["N at L"], sweeps["N at L"] // N)

    results = {**run_header(), "quick": args.quick, "d": D, "tokens": tokens, "unit_bytes": unit, "rows": rows}
    write_results(Path(args.out), results, render, plot)
    return 0


def render(r: dict) -> str:
    unit = r["unit_bytes"]
    lines = [
        "# Extra peak memory of the AttnRes residual over the standard residual",
        "",
        f"Command: `{r['command']}`  ",
        f"d = {r['d']}, {r['tokens']} tokens, float32; one eager training step; in units of one "
        f"[tokens, d] float32 tensor ({unit / 2**10:.0f} KiB); norms saving as on CUDA (their input and 1/rms). "
        "*lean*: the default training path; *graph*: the two-phase path as a plain autograd graph.",
        "",
        "| sweep | L | S | N | standard MiB | Block lean | Block graph | N (= N d line) | Full lean | Full graph | L (= L d line) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        full = [f"{row[k] / unit:.1f}" if k in row else "" for k in ("full_lean", "full_graph")]
        lines.append(
            f"| {row['sweep']} | {row['L']} | {row['S']} | {row['N']} | {row['standard'] / 2**20:.1f} | "
            f"{row['block_lean'] / unit:.1f} | {row['block_graph'] / unit:.1f} | {row['N']} | {full[0]} | {full[1]} | "
            f"{row['L'] if row['sweep'] == 'L' else ''} |"
        )
    lines += ["", _reading(r) if not r.get("quick") else (
        "A quick run (`--quick`: L = 4 and 8, N = 2 and 4 at L = 8): it checks that every path runs and writes its "
        "files; at these few, small depths its numbers draw no conclusion about the scaling (the full sweep's "
        "reading: memory_scaling.md).")]
    return "\n".join(lines) + "\n"


def _reading(r: dict) -> str:
    """What the full sweep's table says, its numbers taken from the rows measured: the
    mechanism (graph path against lean path) and where Block's extra lies against the N d line."""
    unit = r["unit_bytes"]
    depth = [x for x in r["rows"] if x["sweep"] == "L"]
    blocks = [x for x in r["rows"] if x["sweep"] == "N" and x["S"] > 1]
    every = [x for x in r["rows"] if x["sweep"] == "N" and x["S"] == 1]
    below = next((x["L"] for k, x in enumerate(depth) if all(y["block_lean"] / unit < y["N"] for y in depth[k:])), None)
    where = f"below the N d line from L = {below} on" if below is not None else "above the N d line throughout"
    s = depth[0]["S"] if depth else None
    numbers = (f"S = {s}: {depth[0]['block_lean'] / unit:.1f} to {depth[-1]['block_lean'] / unit:.1f} units from "
               f"L = {depth[0]['L']} to {depth[-1]['L']}, {where}" if depth else "")
    if blocks:
        numbers += (f"; at L = {blocks[0]['L']}, S = {blocks[0]['S']} to {blocks[-1]['S']}: "
                    f"{blocks[0]['block_lean'] / unit:.1f} to {blocks[-1]['block_lean'] / unit:.1f}")
    last = (f" At S = 1 (N = L, every sublayer a block): {every[0]['block_lean'] / unit:.1f} units against the N d "
            f"line's {every[0]['N']}." if every else "")
    return ("Reading it: the graph path keeps about 2 extra [tokens, d] tensors per sublayer (the Phase-1 weighted sum "
            "and the partial sum beside the norm's input) and grows with L well above the N d line. The lean path (the "
            "default) keeps one [tokens, d] tensor per sublayer, as the standard model keeps its norm's input: Block its "
            "partial sums (the block sums among them), Full its outputs; the merge's fused norm saves only 1/rms, and "
            "Phase 1's weighted sums are recomputed in the backward, once per block or group (recompute_phase1). What "
            "remains is per-token statistics and the backward's transients, chiefly the S weighted sums of the block "
            f"being differentiated: Block's extra is about S + 2 units whatever L ({numbers}).{last}")


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = r["unit_bytes"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = [x for x in r["rows"] if x["sweep"] == "L"]
    Ls = [x["L"] for x in rows]
    for key, style, label in [("block_lean", "o-", "Block (S=4), lean"), ("block_graph", "o--", "Block (S=4), graph"),
                              ("full_lean", "s-", "Full, lean"), ("full_graph", "s--", "Full, graph")]:
        a.plot(Ls, [x[key] / unit for x in rows], style, label=label)
    a.plot(Ls, [x["N"] for x in rows], "k:", label="N d (N = L/4)")
    a.plot(Ls, Ls, "k-.", label="L d")
    a.set_xlabel("L (sublayers)")
    a.set_ylabel("extra peak memory / (tokens x d x 4 B)")
    a.set_title("against depth")
    a.legend(fontsize=8)
    rows = [x for x in r["rows"] if x["sweep"] == "N"]
    Ns = [x["N"] for x in rows]
    for key, style, label in [("block_lean", "o-", "Block, lean"), ("block_graph", "o--", "Block, graph")]:
        b.plot(Ns, [x[key] / unit for x in rows], style, label=label)
    b.plot(Ns, Ns, "k:", label="N d")
    b.set_xscale("log", base=2)
    b.set_xlabel("N (blocks), L = 32 (N = 32: Full AttnRes)")
    b.set_title("against the number of blocks")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
