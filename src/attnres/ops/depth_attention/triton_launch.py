"""Launch geometry of the Triton kernels, and every variant the launch code can choose.

No triton import here: the geometry can be checked (and the GPU benchmark plan its shapes)
where triton is not installed, and :func:`variants` lists what the ahead-of-time compile
test (``tests/test_triton_aot.py``) and ``benchmarks/triton_aot_report.py`` compile.

* **Tiles of d.** A program never holds a whole row: it walks ``d`` in tiles of ``BLOCK_D``
  elements, so any hidden size works. The tile is the smallest of :data:`TILES` that covers
  ``d``, capped so that a program's ``rows x BLOCK_D`` float32 block stays within
  :data:`MAX_TILE_ELEMENTS`. Three tile sizes keep the compiled variants few.
* **Queries of Phase 1.** A Phase-1 program holds the rows of ``S_PAD`` queries
  (:data:`S_PADS`); more queries run in chunks of the largest.
* **Programs.** The forward kernels run one program per token row; the backward kernels
  reduce the gradients of the queries and of the norm's gain over token rows: they run at
  most :data:`MAX_PROGRAMS` programs, each over a contiguous range of rows, each writing one
  row of partial sums that are added afterwards (deterministic; no atomics).
"""

from __future__ import annotations

from collections.abc import Iterator

#: Largest float32 block ``rows x BLOCK_D`` one program works on at a time (registers).
MAX_TILE_ELEMENTS = 2048
#: The tile sizes the launch code chooses from.
TILES = (64, 256, 1024)
#: Query rows of a Phase-1 program.
S_PADS = (4, 8)
#: Upper bound on the programs of the merge's backward.
MAX_PROGRAMS = 1024
#: Storage dtypes of the sources (and results) the kernels take, each with its compute
#: dtype (that of the logits, weights and statistics).
DTYPES = {"fp32": "fp32", "bf16": "fp32", "fp16": "fp32", "fp64": "fp64"}


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()


def tile_d(d: int, rows: int = 1, block_d: int | None = None) -> int:
    """``BLOCK_D`` for hidden size ``d`` when a program holds ``rows`` rows of a tile.

    ``block_d`` (a power of two) forces the tile, e.g. to test tiling at small ``d``."""
    if d < 1:
        raise ValueError(f"hidden size d must be >= 1, got {d}")
    if block_d is not None:
        if block_d < 1 or block_d & (block_d - 1):
            raise ValueError(f"block_d must be a power of two >= 1, got {block_d}")
        return block_d
    fits = [t for t in TILES if t * rows <= MAX_TILE_ELEMENTS] or [TILES[0]]
    return next((t for t in fits if t >= d), fits[-1])


def s_pad(S: int) -> int:
    """The query rows of the Phase-1 program for ``S`` queries (chunks of ``S_PADS[-1]``)."""
    return next((p for p in S_PADS if p >= S), S_PADS[-1])


def num_warps(elements: int) -> int:
    """Warps per program: one per 256 elements of its block, 1 to 8."""
    return min(8, max(1, elements // 256))


#: Registers a Phase-1 program may use: it holds several ``[S_PAD, BLOCK_D]`` blocks at once
#: (weights, gradients, queries), and ``ptxas``'s default budget spills some of them (the
#: ahead-of-time compile checks that none spill).
PHASE1_MAXNREG = 255


def launch_options(kernel: str, block_d: int, pad: int = 1) -> dict[str, int]:
    """The launch options of ``kernel`` (``"phase1_fwd"``, ...) for its tile and padding."""
    if kernel.startswith("phase1"):
        return {"num_warps": num_warps(block_d * pad), "maxnreg": PHASE1_MAXNREG}
    return {"num_warps": num_warps(block_d)}


def row_ranges(rows: int, max_programs: int | None = None) -> tuple[int, int]:
    """``(programs, rows_per_program)`` covering ``rows`` token rows with at most
    ``max_programs`` (default :data:`MAX_PROGRAMS`) programs."""
    cap = MAX_PROGRAMS if max_programs is None else max_programs
    if cap < 1:
        raise ValueError(f"max_programs must be >= 1, got {cap}")
    per = -(-max(rows, 1) // cap)
    return -(-max(rows, 1) // per), per


# The kernels' parameters in order, with their types ("*T": a pointer to the storage dtype,
# "*C" to the compute dtype, "C" a scalar of it, "constexpr": chosen at launch). Kept beside
# the kernels' definitions by a test.
SIGNATURES = {
    "phase1_fwd": ["Q:*C", "LSE:*C", "SrcTable:*i64", "OutTable:*i64", "X0:*T", "Zs:*C", "Rs:*C", "d:i32", "n:i32",
                   "S:i32", "stride_lr:i32", "eps:fp32", "BLOCK_D:constexpr", "S_PAD:constexpr"],
    "phase1_bwd": ["Q:*C", "LSE:*C", "GLse:*C", "SrcTable:*i64", "GOutTable:*i64", "GSrcTable:*i64", "X0:*T", "Zs:*C",
                   "Rs:*C", "PQ:*C", "rows:i32", "d:i32", "n:i32", "S:i32", "stride_lr:i32", "eps:fp32",
                   "rows_per_program:i32", "BLOCK_D:constexpr", "S_PAD:constexpr"],
    "merge_fwd": ["Z:*C", "SrcTable:*i64", "CompTable:*i64", "X0:*T", "Qg:*C", "NormW:*C", "Out:*T", "Alpha:*C",
                  "Rc:*C", "Zc:*C", "Rstd:*C", "d:i32", "k:i32", "c:i32", "eps:fp32", "norm_eps:fp32", "has_norm:i32",
                  "BLOCK_D:constexpr"],
    "merge_bwd": ["G:*T", "GH:*C", "Alpha:*C", "Rc:*C", "Zc:*C", "Rstd:*C", "SrcTable:*i64", "CompTable:*i64", "X0:*T",
                  "Qg:*C", "NormW:*C", "GSrcTable:*i64", "GCompTable:*i64", "GZ:*C", "PQ:*C", "PW:*C", "rows:i32",
                  "d:i32", "k:i32", "c:i32", "rows_per_program:i32", "has_norm:i32", "BLOCK_D:constexpr"],
}


def variants() -> Iterator[tuple[str, dict[str, str], dict[str, int], dict[str, int]]]:
    """Every ``(kernel, signature, constexprs, launch options)`` the launch code can choose:
    each storage dtype, each tile, and for Phase 1 each query padding with the tiles that
    fit it."""
    for dtype, compute in DTYPES.items():
        for kernel, params in SIGNATURES.items():
            signature = dict(p.split(":") for p in params)
            signature = {k: v.replace("*T", f"*{dtype}").replace("C", compute) if v != "constexpr" else v
                         for k, v in signature.items()}
            pads = S_PADS if kernel.startswith("phase1") else (1,)
            for pad in pads:
                for tile in sorted({tile_d(d, pad) for d in TILES}):
                    constexprs = {"BLOCK_D": tile, **({"S_PAD": pad} if "S_PAD" in signature else {})}
                    yield kernel, signature, constexprs, launch_options(kernel, tile, pad)
