"""Exactness of the upcycling conversion, per supported family (docs/upcycling.md).

For every family of ``attnres.upcycle.FAMILIES``, its tiny random model
(``tests/fixtures/tiny_families.py``: 3 decoder layers, L = 6) is converted to Full AttnRes and to Block
AttnRes with S = 2 (dividing L) and S = 4 (ragged: blocks of 4 and 2 sublayers), in float32
and float64, once as built and once with the embedding shrunk by 1e-3 (``mean(h^2)`` far below
the norms' epsilon, where the epsilon adjustment matters). Measured: the largest logit
difference relative to the largest logit, and for mixtures of experts the same for the router
logits of every MoE layer (worst layer). For reference, the float32 small-hidden-state error
without the epsilon adjustment. Writes ``--out/exactness.json`` and ``exactness.md``.

    python benchmarks/upcycle_exactness.py --out results/upcycle-exactness
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from bench_training_overhead import out_dir

from attnres.output_paths import strict_json, write_text_atomically
from attnres.upcycle import CHECKED_WITH, FAMILIES, upcycle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny models are test fixtures
from fixtures.tiny_families import VOCAB, tiny_model  # noqa: E402

RESIDUALS = {"Full": ("attnres_full", None), "Block S=2": ("attnres_block", 2), "Block S=4": ("attnres_block", 4)}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
BOUNDS = {"float32": 1e-5, "float64": 1e-6}


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@torch.no_grad()
def measure(model_type: str, kind: str, block_size: int | None, dtype: torch.dtype, shrink: bool) -> dict:
    base = tiny_model(model_type, dtype)
    if shrink:
        base.model.embed_tokens.weight.mul_(1e-3)
    x = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    moe = FAMILIES[model_type].router is not None
    kw = {"output_router_logits": True} if moe else {}
    want = base(x, **kw)
    got = upcycle(base, kind, block_size=block_size).eval()(x, **kw)
    row = {"logits": max_rel(got.logits, want.logits)}
    if moe:
        row["router_logits"] = max(max_rel(g, w) for g, w in zip(got.router_logits, want.router_logits))
    if shrink and dtype == torch.float32:
        row["logits_without_eps_adjustment"] = max_rel(upcycle(base, kind, block_size=block_size, exact_eps=False)(x).logits,
                                                       want.logits)
    return row


def run() -> dict:
    import transformers

    results = {"transformers": transformers.__version__, "checked_with": CHECKED_WITH, "torch": torch.__version__,
               "families": {}}
    for model_type in FAMILIES:
        rows = {}
        for rname, (kind, S) in RESIDUALS.items():
            for dname, dtype in DTYPES.items():
                for shrink in (False, True):
                    rows[f"{rname} | {dname} | {'small h' if shrink else 'as built'}"] = measure(model_type, kind, S, dtype,
                                                                                                 shrink)
        results["families"][model_type] = rows
        worst = {d: max(v["logits"] for k, v in rows.items() if f"| {d} |" in k) for d in DTYPES}
        print(f"{model_type}: worst relative logit error float32 {worst['float32']:.1e}, float64 {worst['float64']:.1e}",
              flush=True)
    return results


def table(results: dict) -> str:
    """Per family, the worst over {Full, Block S=2, Block S=4} x {as built, small h} per dtype."""
    lines = ["| family | kind | logits float32 | logits float64 | router logits float32 | router logits float64 | "
             "float32, small h, no eps adjustment |", "|---|---|---:|---:|---:|---:|---:|"]
    for model_type, rows in results["families"].items():
        def worst(key: str, dtype: str) -> str:
            values = [v[key] for k, v in rows.items() if f"| {dtype} |" in k and key in v]
            return f"{max(values):.1e}" if values else "—"

        unadjusted = min(v["logits_without_eps_adjustment"] for v in rows.values() if "logits_without_eps_adjustment" in v)
        kind = "MoE" if FAMILIES[model_type].router is not None else "dense"
        lines.append(f"| {model_type} | {kind} | {worst('logits', 'float32')} | {worst('logits', 'float64')} | "
                     f"{worst('router_logits', 'float32')} | {worst('router_logits', 'float64')} | >= {unadjusted:.1e} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=out_dir, default="results/upcycle-exactness")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = run()
    failed = [(f, k, d) for f, rows in results["families"].items() for k, v in rows.items()
              for d, bound in BOUNDS.items() if f"| {d} |" in k
              for key in ("logits", "router_logits") if key in v and v[key] > bound]
    write_text_atomically(out / "exactness.json", strict_json(results, indent=1))
    write_text_atomically(out / "exactness.md",
        "# Upcycling exactness per family\n\n"
        "Command: `python benchmarks/upcycle_exactness.py --out results/upcycle-exactness`; "
        f"transformers {results['transformers']}, torch {results['torch']}, one thread.\n\n"
        "Tiny random model of each family (`tests/fixtures/tiny_families.py`: 3 decoder layers, L = 6, d = 32), converted to "
        "Full AttnRes, Block S = 2 and Block S = 4 (ragged), each as built and with the embedding shrunk by 1e-3 "
        "(small h). Entries: the worst over those six of the largest difference relative to the largest value, of "
        "the logits and of the router logits (worst MoE layer). Bounds: float32 1e-5, float64 1e-6. Last column: "
        "the smallest error, over the three residuals, of the float32 small-h conversion without the epsilon "
        "adjustment.\n\n" + table(results) + "\n\n"
        + (f"Over the bounds: {failed}\n" if failed else "Every entry is within its bound.\n"))
    print(f"wrote {out / 'exactness.md'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
