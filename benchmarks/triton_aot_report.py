"""Compile every Triton kernel variant ahead of time for sm_80 and sm_90 - no GPU needed -
and report registers, spills and shared memory per kernel.

Triton compiles a kernel for a given GPU target with its bundled ``ptxas``:
``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32))``,
``attrs`` the specialisation Triton's launcher gives a launch (:func:`aligned_attrs`: every
pointer 16-byte aligned and ``d`` a multiple of 16, as the models' widths are - the
accesses 16 bytes wide, Triton's pipelining of loads into shared memory; and without, as an
odd ``d`` launches).
The variants are those the launch code can choose (``attnres.ops.depth_attention.
triton_launch.variants``: every storage dtype, tile and Phase-1 query padding). Registers,
spills and shared memory come from ``ptxas -v`` - the log of the run that produced the
cubin; Triton's own shared-memory allocation from the compiled metadata.

    python benchmarks/triton_aot_report.py                 # prints the table
    python benchmarks/triton_aot_report.py --write-docs    # and replaces it in docs/kernels.md

``tests/test_triton_aot.py`` runs the same compile in the default suite: a compile failure,
a spill, or shared memory over the target's limit fails it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real (set before triton is imported)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from attnres.output_paths import write_text_atomically  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "kernels.md"
ARCHS = (80, 90)
#: Shared memory one block may use, per target (bytes): A100 (sm_80) and H100 (sm_90).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
BEGIN, END = "<!-- triton-aot-report: begin -->", "<!-- triton-aot-report: end -->"


def ptxas_path(arch: int) -> str:
    """The ``ptxas`` Triton compiles ``sm_<arch>`` with (it bundles two)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(arch).path


def ptxas_usage(ptx: str, arch: int) -> dict[str, int]:
    """Registers, spill stores/loads and shared memory of the one kernel in ``ptx``, from
    ``ptxas -v``."""
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        # (the options Triton's own compile gives ptxas: triton/backends/nvidia/compiler.py)
        cmd = [ptxas_path(arch), "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={target}", str(src),
               "-o", str(Path(tmp) / "k.cubin")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return usage_in(out.stdout + out.stderr)


def usage_in(log: str) -> dict[str, int]:
    """Registers, spill stores/loads and shared memory of the one kernel ``ptxas -v``'s ``log``
    describes."""
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, log)) else 0  # noqa: E731
    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "smem": number(r"(\d+) bytes smem")}


def compile_with_usage(source, arch: int, options: dict) -> tuple[object, dict[str, int]]:
    """``triton.compile`` of ``source`` for ``sm_<arch>``, and the resource usage its own
    ``ptxas -v`` printed (Triton runs ``ptxas -v`` to make the cubin and prints the log when
    asked: half the compile's ``ptxas`` time spared). A compile Triton took from its cache
    runs no ``ptxas``: its PTX is given to ``ptxas -v`` here."""
    import contextlib
    import io

    import triton
    from triton.backends.compiler import GPUTarget

    log = io.StringIO()
    knobs = triton.knobs.nvidia
    before, knobs.dump_ptxas_log = knobs.dump_ptxas_log, True
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    finally:
        knobs.dump_ptxas_log = before
    text = log.getvalue()
    return compiled, usage_in(text) if "Used" in text else ptxas_usage(compiled.asm["ptx"], arch)


def compile_variant(kernel: str, dtype: str, counts: dict, signature: dict, constexprs: dict, options: dict,
                    arch: int, unaligned: bool = True) -> dict:
    """Compile one variant for ``sm_<arch>`` with its launch ``options`` (``num_warps``) - and,
    with ``unaligned``, as launched at an odd ``d`` too; its resource usage and the warps it
    leaves resident per multiprocessor (raises if it does not compile)."""
    from triton.compiler import ASTSource

    from attnres.ops.depth_attention import triton_kernels
    from attnres.ops.depth_attention.triton_launch import resident_warps

    def usage(attrs: dict) -> dict:
        source = ASTSource(getattr(triton_kernels, kernel), signature, constexprs=constexprs, attrs=attrs)
        compiled, resources = compile_with_usage(source, arch, options)
        return {"triton_shared": compiled.metadata.shared, **resources}

    # (as launched at an aligned d - the models' widths; an odd d compiles another variant,
    # held to the same rules but not tabled - except the held merges', which run only at an
    # aligned d: triton_launch.merge_holds)
    row = {"kernel": kernel, "arch": arch, "dtype": dtype, "counts": counts, **constexprs, **options,
           **usage(aligned_attrs(signature))}
    if unaligned and not kernel.endswith("_held"):
        row["unaligned"] = usage({})
    for r in (row, row.get("unaligned", {})):
        if r:
            r["resident_warps"] = resident_warps(arch, r["registers"], options["num_warps"], max(r["smem"], r["triton_shared"]))
    return row


def aligned_attrs(signature: dict) -> dict:
    """The specialisation Triton's launcher gives a launch at an aligned ``d`` (``d % 16 ==
    0``, every pointer - tuple entries too - 16-byte aligned): what the model's shapes run."""
    attrs = {}
    for i, (name, kind) in enumerate(signature.items()):
        if isinstance(kind, tuple):
            attrs.update({(i, j): [["tt.divisibility", 16]] for j in range(len(kind))})
        elif kind.startswith("*") or name == "d":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def narrow_row_accesses(kernel: str, counts: dict, arch: int = 90) -> int:
    """Global loads and stores of single bf16 elements in ``kernel``'s bf16 variant at
    ``counts`` and the widest row class, compiled as launched on aligned data: each is one
    where a 16-byte access would do (a pointer whose alignment the compiler cannot see)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from attnres.ops.depth_attention import triton_kernels, triton_launch

    matches = [v for v in triton_launch.variants() if v[0] == kernel and v[1] == "bf16" and v[2] == counts]
    if not matches:
        raise ValueError(f"no bf16 variant of {kernel} at {counts}")
    _, _, _, signature, constexprs, options = max(matches, key=lambda v: v[4].get("D_PAD", v[4].get("BLOCK_D", 0)))
    source = ASTSource(getattr(triton_kernels, kernel), signature, constexprs=constexprs,
                       attrs=aligned_attrs(signature))
    ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]
    return len(re.findall(r"(ld|st)\.global\.b16", ptx))


def _compile_job(job: tuple) -> dict:
    return compile_variant(*job)


def all_variants(archs=ARCHS, unaligned: bool = True) -> list[tuple]:
    from attnres.ops.depth_attention.triton_launch import variants

    return [(*variant, arch, unaligned) for arch in archs for variant in variants()]


def compile_all(archs=ARCHS, workers: int | None = None, unaligned: bool = True) -> list[dict]:
    """Every variant for every target (in ``workers`` processes); with ``unaligned``, each
    also as launched at an odd ``d``."""
    jobs = all_variants(archs, unaligned)
    with ProcessPoolExecutor(max_workers=workers or min(2, os.cpu_count() or 1)) as pool:
        return list(pool.map(_compile_job, jobs))


#: The backward kernels must leave at least this many warps resident per multiprocessor
#: (they are latency-bound below it).
MIN_BACKWARD_WARPS = 16


def problems(row: dict) -> list[str]:
    """What fails a variant, compiled as launched at an aligned ``d`` or at an odd one: a
    spill, shared memory over its target's limit, a backward kernel leaving fewer than
    :data:`MIN_BACKWARD_WARPS` warps resident, or a held merge fewer than its launch fills
    (``triton_launch.HELD_WARPS_PER_SM``: its persistent programs would run in two waves)."""
    from attnres.ops.depth_attention.triton_launch import BACKWARD_KERNELS, held_warps

    bad = []
    kernel = row["kernel"]
    for spec, r in (("", row), ("at an odd d: ", row.get("unaligned"))):
        if not r:
            continue
        if kernel in BACKWARD_KERNELS and r["resident_warps"] < MIN_BACKWARD_WARPS:
            bad.append(f"{spec}{r['resident_warps']} resident warps per multiprocessor (< {MIN_BACKWARD_WARPS})")
        need = held_warps(row["num_warps"]) if kernel.endswith("_held") else 0
        if r["resident_warps"] < need:
            bad.append(f"{spec}{r['resident_warps']} resident warps per multiprocessor (its launch fills {need})")
        if r["spill_stores"] or r["spill_loads"]:
            bad.append(f"{spec}spills {r['spill_stores']} B stored / {r['spill_loads']} B loaded")
        shared = max(r["smem"], r["triton_shared"])
        if shared > SHARED_LIMIT[row["arch"]]:
            bad.append(f"{spec}shared memory {shared} B over the sm_{row['arch']} limit {SHARED_LIMIT[row['arch']]} B")
    return bad


def _shape(r: dict) -> str:
    """The variant's tuple counts and block: ``S=8 n=9, 8x256`` / ``S=2 n=2, 4x2x128`` (rows x
    queries x tile) / ``k=1 c=1, row 2048`` (``, 3 stages``: a held merge's pipelining;
    ``, bf16 addend grad``: a merge backward writing the addend's gradient too)."""
    counts = " ".join(f"{k}={v}" for k, v in r["counts"].items())
    rows = f"{r['ROWS']}x" if "ROWS" in r and "S" not in r else ""  # (phase1_dq's ROWS: rows an iteration)
    block = f"{rows}{r['S_PAD']}x{r['BLOCK_D']}" if "BLOCK_D" in r else f"row {r['D_PAD']}"
    stages = f", {r['STAGES']} stage{'s' * (r['STAGES'] > 1)}" if "STAGES" in r else ""  # (held merges' pipelining)
    addend = ", bf16 addend grad" if r.get("HAS_ADDEND_GRAD") else ""
    return f"{counts}, {block}{stages}{addend}"


def table(rows: list[dict]) -> str:
    lines = ["| kernel | target | dtype | shape, block | warps | registers | spills (B) | shared (B) | warps/SM |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    order = lambda r: (r["kernel"], r["arch"], r["dtype"], r.get("S_PAD", 0), r.get("D_PAD", 0),  # noqa: E731
                       sorted(r["counts"].items()))
    for r in sorted(rows, key=order):
        lines.append(f"| {r['kernel']} | sm_{r['arch']} | {r['dtype']} | {_shape(r)} | {r['num_warps']} | "
                     f"{r['registers']} | {r['spill_stores'] + r['spill_loads']} | "
                     f"{max(r['smem'], r['triton_shared'])} | {r['resident_warps']} |")
    return "\n".join(lines)


def write_docs(text: str) -> None:
    doc = DOCS.read_text()
    if BEGIN not in doc:
        raise SystemExit(f"{DOCS} has no {BEGIN} ... {END} section to replace")
    head, rest = doc.split(BEGIN, 1)
    write_text_atomically(DOCS, head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1], "--write-docs")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write-docs", action="store_true", help=f"replace the table in {DOCS.relative_to(REPO)}")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--json", help="also write every variant's numbers to this file")
    p.add_argument("--aligned-only", action="store_true",
                   help="only as launched at an aligned d (half the compiles: the default test suite's check)")
    p.add_argument("--arch", type=int, action="append", choices=ARCHS,
                   help=f"compile for sm_<ARCH> only (repeatable; default: {', '.join(map(str, ARCHS))})")
    args = p.parse_args(argv)
    if args.workers is not None and args.workers < 1:  # (0 ran with the default number without a word)
        p.error(f"argument --workers: must be an integer >= 1, got {args.workers}")
    if args.json and not Path(args.json).resolve().parent.is_dir():  # (else a traceback after every compile)
        p.error(f"argument --json: {Path(args.json).parent} is not a directory")
    archs = tuple(sorted(set(args.arch))) if args.arch else ARCHS
    if args.write_docs and (args.aligned_only or archs != ARCHS):
        p.error("--write-docs states that every target and the variants at an odd d were checked: run it without "
                "--aligned-only and --arch")
    rows = compile_all(archs, workers=args.workers, unaligned=not args.aligned_only)
    if args.json:
        write_text_atomically(Path(args.json), json.dumps(rows, indent=1), "--json")
    import triton

    text = (f"Generated by `python benchmarks/triton_aot_report.py --write-docs` (triton {triton.__version__}, "
            f"{len(rows)} variants; `ptxas -v`), each as launched at an aligned `d` (a multiple of 16, every "
            f"pointer 16-byte aligned: the models' widths); "
            + ("the variants at an odd `d` are held to the same rules, not tabled.\n\n" if not args.aligned_only
               else "the variants at an odd `d` were not compiled (--aligned-only).\n\n") + table(rows))
    print(text)
    bad = [f"{r['kernel']} sm_{r['arch']} {r['dtype']}: {p}" for r in rows for p in problems(r)]
    for line in bad:
        print("FAIL:", line, file=sys.stderr)
    if args.write_docs:
        write_docs(text)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
