"""Compile every Triton kernel variant ahead of time for other GPUs than the A100 and H100 -
NVIDIA's from the V100 to the RTX 50xx, AMD's MI200 and MI300 - no GPU needed, and report
what compiled and the most shared memory a program asks against what the card gives one.

``benchmarks/triton_aot_report.py`` holds the variants for sm_80 and sm_90 to the kernels'
rules (no spill, resident warps); this checks that the same variants compile elsewhere and
fit the card's shared memory (AMD's LDS): Triton refuses a kernel that asks more before it
runs anything. A held merge asking more is run less deep (``triton_impl._launch_held``: at
most 16 KiB unpipelined), so it is counted, not failed; any other kernel over the limit,
and any compile failure, fails the run (exit status 1).

    python benchmarks/triton_other_cards.py                     # every card below
    python benchmarks/triton_other_cards.py --cards sm_75,gfx942 --json other-cards.json

``tests/test_triton_aot.py`` runs it in the slow suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real (set before triton is imported)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_aot_report import aligned_attrs  # noqa: E402

from attnres.output_paths import write_text_atomically  # noqa: E402

KIB = 1024
#: Each card's Triton target and the shared memory (AMD: LDS) one program may use, in bytes.
CARDS = {
    "sm_70": (("cuda", 70, 32), 96 * KIB, "V100"),
    "sm_75": (("cuda", 75, 32), 64 * KIB, "T4, RTX 20xx"),
    "sm_86": (("cuda", 86, 32), 99 * KIB, "A10, A40, RTX 30xx, RTX A6000"),
    "sm_89": (("cuda", 89, 32), 99 * KIB, "L4, L40S, RTX 40xx"),
    "sm_100": (("cuda", 100, 32), 227 * KIB, "B200"),
    "sm_120": (("cuda", 120, 32), 99 * KIB, "RTX 50xx, RTX PRO 6000"),
    "gfx90a": (("hip", "gfx90a", 64), 64 * KIB, "MI200"),
    "gfx942": (("hip", "gfx942", 64), 64 * KIB, "MI300"),
}


def compile_for(job: tuple) -> dict:
    """One variant compiled for one card (as launched at an aligned ``d``): its shared memory,
    or why it did not compile."""
    card, kernel, dtype, counts, signature, constexprs, options = job
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from attnres.ops.depth_attention import triton_kernels

    row = {"card": card, "kernel": kernel, "dtype": dtype, "counts": counts, **constexprs, **options}
    source = ASTSource(getattr(triton_kernels, kernel), signature, constexprs=constexprs, attrs=aligned_attrs(signature))
    try:
        row["shared"] = triton.compile(source, target=GPUTarget(*CARDS[card][0]), options=options).metadata.shared
    except Exception as e:  # noqa: BLE001 - a compile failure is the finding: reported, and the run fails
        row["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
    return row


def compile_all(cards: list[str], workers: int | None = None) -> list[dict]:
    from attnres.ops.depth_attention.triton_launch import variants

    jobs = [(card, *variant) for card in cards for variant in variants()]
    with ProcessPoolExecutor(max_workers=workers or min(2, os.cpu_count() or 1)) as pool:
        return list(pool.map(compile_for, jobs, chunksize=8))


def summary(rows: list[dict], cards: list[str]) -> tuple[str, list[str]]:
    """The table (a card a line) and what fails the run."""
    lines = ["| card | | variants compiled | most shared memory a program asks | the card gives | held merges "
             "run less deep |", "|---|---|---:|---|---:|---:|"]
    bad = []
    for card in cards:
        mine = [r for r in rows if r["card"] == card]
        limit = CARDS[card][1]
        compiled = [r for r in mine if "shared" in r]
        bad += [f"{card} {r['kernel']} {r['dtype']} {r['counts']}: {r['error']}" for r in mine if "error" in r]
        over = [r for r in compiled if r["shared"] > limit]
        held_over = [r for r in over if r["kernel"].endswith("_held")]
        bad += [f"{card} {r['kernel']} {r['dtype']} {r['counts']}: {r['shared']} B of shared memory, the card gives "
                f"{limit}" for r in over if not r["kernel"].endswith("_held")]
        top = max(compiled, key=lambda r: r["shared"], default=None)
        most = f"{top['shared']} B ({top['kernel']}, {top['dtype']})" if top else "-"
        lines.append(f"| {card} | {CARDS[card][2]} | {len(compiled)} of {len(mine)} | {most} | {limit} B | "
                     f"{len(held_over)} |")
    return "\n".join(lines), bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cards", default=",".join(CARDS),
                   help=f"comma-separated, of {', '.join(CARDS)} (default: all)")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--json", help="also write every variant's numbers to this file")
    args = p.parse_args(argv)
    if args.workers is not None and args.workers < 1:  # (0 ran with the default number without a word)
        p.error(f"argument --workers: must be an integer >= 1, got {args.workers}")
    cards = [c.strip() for c in args.cards.split(",") if c.strip()]
    unknown = [c for c in cards if c not in CARDS]
    if unknown or not cards:
        p.error(f"argument --cards: {', '.join(map(repr, unknown)) or 'none given'}; known cards: {', '.join(CARDS)}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        p.error(f"argument --json: {Path(args.json).parent} is not a directory")
    rows = compile_all(cards, args.workers)
    if args.json:
        write_text_atomically(Path(args.json), json.dumps(rows, indent=1), "--json")
    import triton

    text, bad = summary(rows, cards)
    print(f"Generated by `python benchmarks/triton_other_cards.py` (triton {triton.__version__}; each variant as "
          f"launched at an aligned `d`)\n\n{text}")
    for line in bad:
        print("FAIL:", line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
