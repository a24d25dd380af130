"""A merge backward that needs no Phase-1 sum: what it would cost in precision, on the CPU.

A lever for the GPU training step that is measured here and not built (docs/kernels.md, "A
merge backward from its output"). Block AttnRes' merge (report §4.2, Algorithm 1) forms
``h = alpha_1 o_1 + alpha_c x_c`` from its Phase-1 sum ``o_1`` (logit: its log-sum-exp) and the
block's partial sum ``x_c`` (logit computed), and returns ``y = RMSNorm(h)``. Its backward
today re-forms ``h`` from ``o_1`` and ``x_c``, so in eager training every block's Phase 1
forward runs again to give the merges their sums (``ResidualConfig.recompute_phase1``) and
every merge backward reads its sum. Two facts make ``o_1`` unnecessary there:

* softmax gradients add up to zero: ``dz_1 = -sum_{j computed} dz_j``, so ``g_h . o_1`` is never
  needed;
* the norm's backward and the weight gradient need ``h / rms(h)``, which is ``y / w`` - and
  ``y`` is alive anyway: the next sublayer's linear layers keep it for their own backward.
  Then ``g_h . h = (g_h . y / w) / rstd``.

The catch: under bf16 autocast ``y`` is bf16 (the merge writes what the linear layers read),
so ``h / rms(h)`` comes back rounded to bf16, where today's backward re-forms it in float32.
This measures that on one merge at the GPU check's width (d = 2048, 4096 tokens, float32
stream, a bf16 sublayer output added to the partial sum, a bf16 output and its bf16 incoming
gradient): every gradient of both backwards against float64 autograd through the reference
merge on the same inputs, beside the yardstick that autocast already sets - how far the
float64 gradients move when the incoming gradient is rounded to bf16 once (as autocast's
backward rounds it anyway). Cases: norm gains near 1 (as trained), gains spread over two
decades, and larger queries and logits that make the weights sharp (each token's largest
weight 0.95 on average, against 0.81). Beside it, the other ways to store fewer bytes, at the
same inputs: the Phase-1 sum stored in bf16 (a lever not built), and the whole stream in bf16
(``autocast_stream``).

    python benchmarks/merge_backward_from_output.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from bench_training_overhead import out_dir, positive_int

from attnres.ops.depth_attention import reference, torch_impl
from attnres.output_paths import strict_json, write_text_atomically

EPS = 1e-6
NAMES = ("z (the sum's logit)", "Phase-1 sum", "partial sum", "sublayer output", "query", "norm gain")


def inputs(case: str, tokens: int, d: int, seed: int) -> dict:
    """One Block merge's inputs as a training step has them: float32 stream, bf16 sublayer
    output, bf16 incoming gradient (the float32 one before rounding kept as ``g_exact``)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    o1 = randn(tokens, d, scale=2.0)
    partial = randn(tokens, d, scale=4.0)
    v = randn(tokens, d).to(torch.bfloat16)
    query_scale = {"trained": 0.05, "spread gains": 0.05, "sharp weights": 0.25}[case]
    qg = randn(d, scale=query_scale)
    if case == "spread gains":  # log-uniform over [0.03, 3]
        w = torch.exp(torch.empty(d).uniform_(-3.5, 1.1, generator=gen))
    else:
        w = 1.0 + randn(d, scale=0.1)
    z = randn(tokens, 1, scale=3.0 if case == "sharp weights" else 1.0)
    g_exact = randn(tokens, d, scale=1e-3)
    return dict(z=z, o1=o1, partial=partial, v=v, qg=qg, w=w, g_exact=g_exact, g=g_exact.to(torch.bfloat16))


def truth(x: dict, g: torch.Tensor) -> list[torch.Tensor]:
    """Float64 autograd through the reference merge: the gradients of (z, o1, partial, v,
    qg, w) for the incoming gradient ``g``."""
    leaves = [x[k].to(torch.float64, copy=True).requires_grad_() for k in ("z", "o1", "partial", "v", "qg", "w")]
    z, o1, partial, v, qg, w = leaves
    out = reference.merge(z, [o1], [partial], qg, EPS, w, EPS, addend=v)[0]
    return list(torch.autograd.grad(out, leaves, g.double()))


def today(x: dict):
    """The current backward (``torch_impl``, what every implementation computes): ``h``
    re-formed from the Phase-1 sum and the partial sum, in float32. Also returns the
    forward's results for :func:`from_output`."""
    addend_dtype = None if x["v"].dtype == x["o1"].dtype else x["v"].dtype
    fwd = torch_impl.merge_forward(x["z"], [x["o1"]], [x["partial"]], x["qg"], x["w"], EPS, EPS,
                                   addend=x["v"], out_dtype=x["g"].dtype)
    y, alpha, rc, zc, rstd, total = fwd
    g_z, (g_o1,), (g_total,), g_qg, g_w, g_v = torch_impl.merge_backward(
        x["g"], alpha, rc, zc, rstd, [x["o1"]], [total], x["qg"], x["w"], [True] * 5,
        addend_dtype=addend_dtype)
    return [g_z, g_o1, g_total, g_total if g_v is None else g_v, g_qg, g_w], fwd


def from_output(x: dict, fwd) -> list[torch.Tensor]:
    """The same gradients without the Phase-1 sum: the normalised ``h`` from the saved output
    ``y`` (``y / w``), the sum's logit gradient from the others' (softmax gradients add up to
    zero)."""
    y, alpha, rc, zc, rstd, total = fwd
    d = y.shape[-1]
    g, w, qg = x["g"].to(rstd.dtype), x["w"], x["qg"]
    h = y.to(rstd.dtype) / w / rstd  # the norm's input, as rounded into y
    gh, g_w = torch_impl._norm_backward(g, h, rstd, w, True, torch.empty_like(h))  # (today's, from this h)
    s_h = (gh * h).sum(-1, keepdim=True)  # g_h . h
    s_c = (gh * total).sum(-1, keepdim=True)  # g_h . x_c
    dz_c = alpha[..., 1:] * (s_c - s_h)
    g_z = -dz_c  # softmax gradients add up to zero
    gr = dz_c * rc  # through z_c = rc (x_c . qg)
    g_total = alpha[..., 1:] * gh + gr * qg - (gr * rc * zc / d) * total
    g_qg = (gr * total).sum(0)
    return [g_z, alpha[..., :1] * gh, g_total, g_total.to(x["v"].dtype), g_qg, g_w]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


COLUMNS = ("today", "from output", "bf16 Phase-1 sum", "bf16 stream", "bf16 rounding of g")


def rounded(x: dict, keys: tuple[str, ...], keep_float32: bool) -> dict:
    """``x`` with the inputs ``keys`` rounded to bf16 (kept as float32 values, or stored as bf16)."""
    out = dict(x)
    for k in keys:
        out[k] = x[k].to(torch.bfloat16).float() if keep_float32 else x[k].to(torch.bfloat16)
    return out


def measure(case: str, tokens: int, d: int, seeds: int) -> dict:
    """The largest relative error over the seeds of each gradient in each column, all against
    float64 autograd at the unrounded inputs with the bf16 incoming gradient."""
    rows = {name: {c: [] for c in COLUMNS} for name in NAMES}
    largest = []
    for seed in range(seeds):
        x = inputs(case, tokens, d, seed)
        t = truth(x, x["g"])
        now, fwd = today(x)
        largest.append(float(fwd[1].max(-1).values.mean()))
        bf16_sum = today(rounded(x, ("o1",), keep_float32=True))[0]  # stored bf16, read as float32
        bf16_sum[1] = bf16_sum[1].to(torch.bfloat16)  # its gradient stored so too
        columns = {
            "today": now,
            "from output": from_output(x, fwd),
            "bf16 Phase-1 sum": bf16_sum,
            "bf16 stream": today(rounded(x, ("o1", "partial"), keep_float32=False))[0],
            "bf16 rounding of g": truth(x, x["g_exact"]),
        }
        for c, grads in columns.items():
            for name, ti, gi in zip(NAMES, t, grads):
                rows[name][c].append(rel(gi, ti))
    errors = {name: {c: max(v) for c, v in r.items()} for name, r in rows.items()}
    return {"mean largest weight": sum(largest) / len(largest), "errors": errors}


def command_line(argv: list[str]) -> str:
    """The command as run from the repository root, with its options (the report named none,
    whatever the run's sizes)."""
    return " ".join(["python benchmarks/merge_backward_from_output.py", *argv])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=lambda v: Path(out_dir(v)), default=Path(__file__).resolve().parent / "results",
                        help="directory for merge_backward_from_output.{md,json} (default: benchmarks/results, "
                             "wherever it is run from)")
    parser.add_argument("--tokens", type=positive_int, default=4096)
    parser.add_argument("--d", type=positive_int, default=2048)
    parser.add_argument("--seeds", type=positive_int, default=3)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    cases = ("trained", "spread gains", "sharp weights")
    results = {case: measure(case, args.tokens, args.d, args.seeds) for case in cases}
    lines = [
        "# A merge backward from its output: precision against float64 (CPU)",
        "",
        f"`{command_line(argv)}` - one Block merge, {args.tokens} tokens, "
        f"d = {args.d}, float32 stream and Phase-1 sum, bf16 sublayer output, output and incoming "
        f"gradient; relative error (Frobenius) against float64 autograd through the reference "
        f"merge at the unrounded inputs, the largest over {args.seeds} seeds. *today*: the current backward "
        "(h re-formed from the Phase-1 sum); *from output*: h / rms(h) taken from the bf16 output "
        "(y / w), the sum's logit gradient from the others'; *bf16 Phase-1 sum*: today's backward "
        "with the Phase-1 sum and its gradient stored in bf16 (the stream float32); *bf16 stream*: "
        "today's backward with the sum and the partial sum in bf16 (`autocast_stream`); *bf16 "
        "rounding of g*: the float64 gradients with the incoming gradient before its rounding to "
        "bf16 - the noise autocast's backward sets anyway.",
        "",
    ]
    for case in cases:
        lines += [f"## {case}", "", f"Mean of each token's largest weight: {results[case]['mean largest weight']:.2f}.", "",
                  "| gradient of | " + " | ".join(COLUMNS) + " |",
                  "|---|" + "---:|" * len(COLUMNS)]
        for name, r in results[case]["errors"].items():
            lines.append(f"| {name} | " + " | ".join(f"{r[c]:.1e}" for c in COLUMNS) + " |")
        lines.append("")
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomically(args.out / "merge_backward_from_output.md", "\n".join(lines))
    write_text_atomically(args.out / "merge_backward_from_output.json", strict_json(
        {"tokens": args.tokens, "d": args.d, "seeds": args.seeds, "results": results}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
