"""Launch geometry of the Triton kernels, and every variant the launch code can choose.

No triton import here: the geometry can be checked (and the GPU benchmark plan its shapes)
where triton is not installed, and :func:`variants` lists what the ahead-of-time compile
test (``tests/test_triton_aot.py``) and ``benchmarks/triton_aot_report.py`` compile.

* **Phase 1** (``phase1_fwd``, ``phase1_bwd``): one program per token row, holding the rows
  of ``S_PAD`` queries (the next power of two of ``S``, at most :data:`MAX_QUERIES`) and
  walking ``d`` in tiles of ``BLOCK_D``, the largest power of two that keeps a program's
  ``S_PAD x BLOCK_D`` block within :data:`MAX_TILE_ELEMENTS` (and not wider than ``d``
  needs); :func:`phase1_warps` warps a program.
* **Phase 1 over a few rows** (decoding; :func:`phase1_splits`): the forward in two
  launches, ``phase1_logits`` over (row, source) and ``phase1_combine`` over (row, tile of
  ``d``, :func:`phase1_combine_tile`; a few sources unrolled, :func:`phase1_unrolls`), so
  that a step's latency is not one program walking every source in turn.
* **Phase 1 over blocks of rows** (many rows: training, prefill; :func:`phase1_rows_geometry`):
  ``phase1_logits_rows`` (then ``phase1_combine``) and, backward, ``phase1_bwd_rows`` over
  blocks of ``ROWS`` rows, then ``phase1_grads`` over (tile of ``d``, range of rows, about
  :data:`PROGRAMS_PER_SM` programs per multiprocessor in all): a tile of the queries and of
  the gradients is read once per block of rows, not once per row and source.
* **The queries' gradient** (``phase1_dq``, beside ``phase1_bwd``): a grid of (tile of ``d``,
  range of rows) with about :data:`PROGRAMS_PER_SM` programs per multiprocessor in all, each
  summing its rows.
* **The merge** (``merge_fwd``, ``merge_bwd``): the whole row in registers (``D_PAD``, the
  next power of two of ``d``, at most :data:`MAX_ROW`), one warp per 256 elements of it (1
  to 16). The forward runs one program per row; the backward runs persistent programs,
  enough for :data:`BACKWARD_WARPS_PER_SM` warps on every multiprocessor, each summing the
  query's and the norm gain's gradients over its rows in registers.
* **The merge over a few sources** (``merge_fwd_held``, ``merge_bwd_held``; at most
  :data:`MERGE_HELD` sources, an aligned ``d``: :func:`merge_holds`): the same rows and
  warps, persistent programs forward and backward (:func:`held_programs`, filling
  :data:`HELD_WARPS_PER_SM`), each source of a row loaded once and held, the loop over rows
  pipelined :func:`merge_stages` deep by Triton (the next rows' loads in flight into shared
  memory while a row is computed).

Shapes past these limits (more than :data:`MAX_QUERIES` queries in one Phase 1 or more
than :data:`MAX_STATS` query-source pairs, ``d`` above :data:`MAX_ROW` in a merge, more
than :data:`MAX_SOURCES` sources) run the PyTorch implementation on the GPU
(:func:`phase1_fits`, :func:`merge_fits`).
"""

from __future__ import annotations

from collections.abc import Iterator

#: Largest ``S_PAD x BLOCK_D`` block of a Phase-1 program (float32 compute; half of it in
#: float64), and its widest tile: larger blocks cost registers (each element of a block
#: of pointers takes two) and left fewer programs resident.
MAX_TILE_ELEMENTS = 1024
MAX_TILE = 128
#: Up to this many rows, the Phase-1 forward walks a row in wide tiles with up to 16 warps
#: (:func:`phase1_forward_geometry`), within this many elements of an ``S_PAD x BLOCK_D``
#: block (half in float64).
FEW_ROWS = 128
FEW_ROWS_TILE_ELEMENTS = 16384
#: Up to this many rows the Phase-1 forward runs split over sources (:func:`phase1_splits`);
#: ``phase1_combine`` unrolls up to this many sources (:func:`phase1_unrolls`).
SPLIT_ROWS = 32
UNROLL_SOURCES = 16
#: Largest ``S_PAD x BLOCK_D`` block of a ``phase1_combine`` program (4 warps).
COMBINE_TILE_ELEMENTS = 4096
#: Largest ``ROWS x S_PAD x BLOCK_D`` block of the kernels over blocks of rows (half in
#: float64), their widest tile of ``d``, most rows, and their warps. (Larger blocks - 2048 or
#: 4096, at 4 or 8 warps - spilled or left 8 warps resident with Triton 3.9.)
ROWS_TILE_ELEMENTS = 1024
ROWS_TILE = 128
#: Their widest tile at 2 queries (``S_PAD == 2``), except in float64: more rows of a narrower
#: tile. As launched at an aligned ``d`` (the models' widths), 128 wide, Triton 3.6 (the GPU
#: machine's) took 153 - 164 registers in the backward whatever the rows (12 warps resident),
#: 64 wide 96 - 117 (16 - 20); Triton 3.9 64 - 109 (16 - 32) against 64 - 96 (20 - 32). (At an
#: odd ``d`` Triton 3.6 took more at 64: 148 - 186 against 64; at 4 queries 64 wide cost
#: Triton 3.9 more registers on sm_80, and in float64 it spilled there: 128 kept for both.)
FEW_QUERIES_TILE = 64
MAX_ROWS = 16
ROWS_WARPS = 4
#: Sources whose loads the kernels over blocks of rows issue together (:func:`phase1_group`).
ROWS_GROUP = 2
#: Most queries one Phase-1 launch takes (``S_PAD``).
MAX_QUERIES = 64
#: Widest row the merge holds in registers (``D_PAD``): at 8192 its backward spills.
MAX_ROW = 4096
#: Most sources (tuple entries) one launch takes.
MAX_SOURCES = 128
#: Largest ``S_PAD x N_PAD`` block of a Phase-1 program's per-source statistics.
MAX_STATS = 2048

#: Programs per multiprocessor the queries' gradient aims at (its compiled variants leave
#: 8 to 16 resident), and the rows each of its iterations takes (unrolled).
PROGRAMS_PER_SM = 8
DQ_ROWS = 4
#: Warps per multiprocessor the merge's backward programs fill (one wave of them).
BACKWARD_WARPS_PER_SM = 16
#: Most sources a merge holds in registers (``merge_fwd_held``, ``merge_bwd_held``: Block
#: AttnRes' merges; more loop over them, Full AttnRes' groups): at 3 sources and d = 2048
#: the backward took 166 registers, 8 warps resident.
MERGE_HELD = 2
#: Warps per multiprocessor the held merges' persistent programs fill, forward and
#: backward (the ahead-of-time compile test holds their variants to leaving that many
#: resident: at d = 2048 the backward takes 120 - 128 registers, the forward up to 104 with
#: Triton 3.6), and the shared memory a program's pipelined loads may take (at d = 2048:
#: two rows ahead of Block's forward, one of its float32 backward - 32 KiB a row -, two of
#: that backward taking a bf16 gradient, 28 KiB, whose one program of 16 warps a
#: multiprocessor then has as many bytes in flight as two of 8 warps one row ahead).
HELD_WARPS_PER_SM = 16
PIPELINE_BYTES = 56 * 1024
#: The backward kernels, latency-bound with fewer than 16 warps resident per multiprocessor
#: (the ahead-of-time compile test holds them to it).
BACKWARD_KERNELS = ("phase1_bwd", "phase1_dq", "phase1_bwd_rows", "phase1_grads", "merge_bwd", "merge_bwd_held")
#: Storage dtypes of the sources (and results) the kernels take, each with its compute
#: dtype (that of the logits, weights and statistics).
DTYPES = {"fp32": "fp32", "bf16": "fp32", "fp16": "fp32", "fp64": "fp64"}


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()


def _check_power_of_2(name: str, value: int) -> None:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 1, got {value}")


def pad(n: int) -> int:
    """The padded size of an axis of ``n`` entries in a program's block: a power of two, at
    least 2."""
    return max(2, next_power_of_2(n))


def phase1_fits(S: int, n: int) -> bool:
    """Whether the Phase-1 kernels take ``S`` queries over ``n`` sources."""
    return S <= MAX_QUERIES and n <= MAX_SOURCES and pad(S) * pad(n) <= MAX_STATS


def merge_fits(d: int, m: int) -> bool:
    """Whether the merge kernels take ``m`` sources at hidden size ``d``."""
    return d <= MAX_ROW and m <= MAX_SOURCES


def phase1_tile(d: int, S: int, block_d: int | None = None, wide: bool = False) -> int:
    """``BLOCK_D`` of a Phase-1 program over ``S`` queries at hidden size ``d`` (``wide``:
    computing in float64); ``block_d`` (a power of two) forces it, e.g. to test tiling at
    small ``d``."""
    if d < 1:
        raise ValueError(f"hidden size d must be >= 1, got {d}")
    if block_d is not None:
        _check_power_of_2("block_d", block_d)
        return block_d
    # (half the block in float64, and from 16 queries on: Triton 3.6 left 12 warps resident
    # with 16 x 64 backward blocks and spilled at 64 x 16 with 4 warps, see phase1_warps)
    budget = MAX_TILE_ELEMENTS // (2 if wide or pad(S) >= 16 else 1)
    return max(16, min(next_power_of_2(d), MAX_TILE, budget // pad(S)))


def phase1_forward_geometry(rows: int, d: int, S: int, block_d: int | None = None,
                            wide: bool = False) -> tuple[int, int]:
    """``(BLOCK_D, num_warps)`` of the Phase-1 forward over ``rows`` token rows. At most
    :data:`FEW_ROWS` rows (decoding: one program per sequence, the machine otherwise idle)
    a program takes the row in tiles of up to :data:`FEW_ROWS_TILE_ELEMENTS` / ``S_PAD``
    with up to 16 warps, so that a source costs one iteration of each pass rather than
    ``d / 128`` dependent ones (the latency of one program is the step's); otherwise
    :func:`phase1_tile` and :func:`phase1_warps`. ``block_d`` forces the tile."""
    if block_d is not None or rows > FEW_ROWS:
        return phase1_tile(d, S, block_d, wide), phase1_warps(S)
    # (from 16 queries on, a half, from 32 a quarter: the statistics blocks take the
    # registers, and 16 warps leave 128 a thread - Triton 3.9 spilled at 32 x 512, and at
    # 16 x 1024 as launched on aligned rows)
    budget = FEW_ROWS_TILE_ELEMENTS // (2 if wide else 1) // (4 if pad(S) >= 32 else 2 if pad(S) >= 16 else 1)
    tile = max(16, min(next_power_of_2(d), budget // pad(S)))
    return tile, min(16, max(4, pad(S) * tile // 1024))


def phase1_splits(rows: int) -> bool:
    """Whether the Phase-1 forward over ``rows`` token rows runs split (``phase1_logits`` +
    ``phase1_combine``): a few rows - decoding, where one program per row leaves the machine
    idle and the step waits on its latency."""
    return 0 < rows <= SPLIT_ROWS


def phase1_unrolls(n: int) -> bool:
    """Whether ``phase1_combine`` unrolls its ``n`` sources (their loads in flight together)
    rather than loop over them (code that does not grow with Full AttnRes' many)."""
    return n <= UNROLL_SOURCES


def phase1_combine_tile(d: int, S: int, wide: bool = False) -> int:
    """``BLOCK_D`` of a ``phase1_combine`` program (4 warps): ``S_PAD x BLOCK_D`` within
    :data:`COMBINE_TILE_ELEMENTS` (half in float64), at least 16, no wider than ``d`` needs."""
    budget = COMBINE_TILE_ELEMENTS // (2 if wide else 1)
    return max(16, min(next_power_of_2(d), budget // pad(S)))


def phase1_rows_geometry(d: int, S: int, wide: bool = False, block_d: int | None = None) -> tuple[int, int]:
    """``(ROWS, BLOCK_D)`` of the Phase-1 kernels over blocks of rows: tiles of ``d`` up to
    :data:`ROWS_TILE` wide (:data:`FEW_QUERIES_TILE` at 2 queries, except in float64; no wider
    than ``d`` needs; ``block_d`` forces it), as many rows
    (a power of two, at most :data:`MAX_ROWS`) as keep ``ROWS x S_PAD x BLOCK_D`` within
    :data:`ROWS_TILE_ELEMENTS` (half in float64); where one row's block is larger, a
    narrower tile and one row."""
    if d < 1:
        raise ValueError(f"hidden size d must be >= 1, got {d}")
    # (half from 16 queries on, as phase1_tile: their blocks took more registers)
    budget = ROWS_TILE_ELEMENTS // (2 if wide or pad(S) >= 16 else 1)
    widest = ROWS_TILE if pad(S) > 2 or wide else FEW_QUERIES_TILE
    if block_d is not None:
        _check_power_of_2("block_d", block_d)
        tile = block_d
    else:
        tile = max(16, min(next_power_of_2(d), widest, budget // pad(S)))
    return max(1, min(MAX_ROWS, budget // (pad(S) * tile))), tile


def phase1_group(n: int, S: int, rows: int = 1, wide: bool = False) -> int:
    """``GROUP`` of the kernels over blocks of ``rows`` rows: how many of the ``n`` sources
    a program's loop takes an iteration, their loads in flight together - up to
    :data:`ROWS_GROUP` (half with 8-byte storage, ``wide``) where a program takes one row of
    at most 8 queries, else one (Triton 3.6 took 140 to 190 registers for all of Block's 8
    sources at once, and spilled for groups beside several rows or 16 queries, and for 4
    bf16 sources as launched on aligned rows; one at a time leaves a load's latency per
    source)."""
    if rows > 1 or pad(S) > 8:
        return 1
    return max(1, min(n, ROWS_GROUP // (2 if wide else 1)))


def rows_warps(S: int) -> int:
    """Warps of a program of the kernels over blocks of rows: :data:`ROWS_WARPS`, twice that
    from 32 queries on (``phase1_grads`` spilled at 32 x 16 with 4 on sm_80)."""
    return ROWS_WARPS * (2 if pad(S) >= 32 else 1)


def rows_backward_warps(S: int, narrow: bool) -> int:
    """Warps of a ``phase1_bwd_rows`` program: :func:`rows_warps`, or twice :data:`ROWS_WARPS`
    where it reads gradients narrower than its sources (``autocast_phase1_sums``: with 4, at
    4 queries, Triton 3.9 spilled 4 bytes on sm_80 at an odd ``d``; with 8 none spills, 24 - 64
    warps resident)."""
    return 2 * ROWS_WARPS if narrow else rows_warps(S)


def phase1_warps(S: int) -> int:
    """Warps of a Phase-1 program over ``S`` queries: 4 (at 64 queries, 8 warps made ptxas
    cap the backward at 64 registers and spill on sm_80)."""
    return 4


def row_pad(d: int) -> int:
    """``D_PAD``, the merge's register row for hidden size ``d`` (at least 16)."""
    if d < 1:
        raise ValueError(f"hidden size d must be >= 1, got {d}")
    return max(16, next_power_of_2(d))


def merge_warps(d_pad: int) -> int:
    """Warps of a merge program: one per 256 elements of its row, 1 to 16."""
    return min(16, max(1, d_pad // 256))


def held_backward_warps(d_pad: int, narrow_gradient: bool = False) -> int:
    """Warps of a held merge backward's program: :func:`merge_warps`, twice that where a
    gradient it reads or writes is narrower than its sources (a float32 stream's merge
    writing bf16, ``autocast_norm_output``; or writing a bf16 addend's gradient, an autocast
    sublayer's output). A 16-byte access takes 8 bf16 elements, 4 float32 ones, and the two
    layouts in one program took 142 - 157 registers at d = 2048 with Triton 3.6 (8 warps
    resident; with the addend's gradient, 128 and a 16-byte spill with Triton 3.9); twice the
    warps, each thread holding half the row, 98 - 102."""
    return min(32, merge_warps(d_pad) * (2 if narrow_gradient else 1))


def backward_holds(d_pad: int, narrow_gradient: bool = False) -> bool:
    """Whether a merge backward that :func:`merge_holds` runs the held kernel: unless a
    narrow gradient would take it past 16 warps (rows over 2048: at 32 warps a thread has 64
    registers, and the held backward writing a bf16 addend's gradient at d = 4096 spilled 48
    bytes there) - those run the looping kernel."""
    return held_backward_warps(d_pad, narrow_gradient) <= 16


def backward_programs(rows: int, d_pad: int, sms: int, warps: int | None = None) -> int:
    """The merge backward's persistent programs on ``sms`` multiprocessors, of ``warps``
    warps each (default :func:`merge_warps`)."""
    return max(1, min(rows, sms * max(1, BACKWARD_WARPS_PER_SM // (warps or merge_warps(d_pad)))))


def merge_holds(m: int, d: int | None = None) -> bool:
    """Whether a merge of ``m`` sources (at most :data:`MERGE_HELD`) at hidden size ``d``
    holds them: at an aligned ``d`` (a multiple of 16), the variant compiled ahead of time
    (at an odd one, without the alignment, they took more registers; the looping kernels
    run those)."""
    return m <= MERGE_HELD and (d is None or d % 16 == 0)


def held_warps(warps: int) -> int:
    """Warps the held merges' programs of ``warps`` warps fill a multiprocessor with: as many
    programs as fit in :data:`HELD_WARPS_PER_SM`, at least one."""
    return max(1, HELD_WARPS_PER_SM // warps) * warps


def held_programs(rows: int, sms: int, warps: int) -> int:
    """The held merges' persistent programs over ``rows`` rows on ``sms`` multiprocessors:
    :func:`held_warps` on each, at most one a row."""
    return max(1, min(rows, sms * held_warps(warps) // warps))


def merge_stages(row_bytes: int, rows_per_program: int = 2) -> int:
    """The depth Triton pipelines a held merge's loop over rows to (``num_stages``): the
    ``row_bytes`` one row's loads take, for one or two rows ahead, within
    :data:`PIPELINE_BYTES` of shared memory; 1 (not pipelined) where a program takes one row
    (decoding: nothing to load ahead, and the copy through shared memory would only add to
    the step's latency)."""
    if rows_per_program <= 1:
        return 1
    return 1 + max(1, min(2, PIPELINE_BYTES // max(1, row_bytes)))


def row_ranges(rows: int, programs: int) -> tuple[int, int]:
    """``(programs, rows_per_program)`` covering ``rows`` token rows with at most
    ``programs`` contiguous ranges."""
    if programs < 1:
        raise ValueError(f"programs must be >= 1, got {programs}")
    per = -(-max(rows, 1) // programs)
    return -(-max(rows, 1) // per), per


def dq_grid(rows: int, d: int, block_d: int, sms: int, programs: int | None = None,
            multiple: int = 1) -> tuple[int, int, int]:
    """``(tiles of d, programs over rows, rows per program)`` of ``phase1_dq`` and
    ``phase1_grads`` (``programs``: force the programs over rows; ``multiple``: each program's
    rows a multiple of it, the blocks of rows it walks)."""
    tiles = -(-d // block_d)
    programs, per = row_ranges(rows, programs or max(1, -(-sms * PROGRAMS_PER_SM // tiles)))
    if per % multiple:
        per += multiple - per % multiple
        programs = -(-max(rows, 1) // per)
    return tiles, programs, per


# The kernels' parameters in order, with their types ("*T": a pointer to the storage dtype,
# "*C" to the compute dtype, "C" a scalar of it, "*A" to the addend's dtype and its gradient's
# (bf16: a bf16 sublayer output added to a float32 stream under autocast), "*O" to the merge's output's
# (and its gradient's) dtype - the storage dtype, or the autocast dtype under autocast -, "*P" to
# Phase 1's weighted sums' (and their gradients') - the storage dtype, or the autocast dtype under
# autocast_phase1_sums -, "[n]" a tuple of n of them ("g": the gradients of the output's readers),
# "constexpr": chosen at launch). Kept beside the kernels' definitions by a test.
SIGNATURES = {
    "phase1_fwd": ["Q:*C", "Srcs:*T[n]", "Outs:*P[S]", "LSE:*C", "d:i32", "eps:fp32", "BLOCK_D:constexpr",
                   "S_PAD:constexpr", "N_PAD:constexpr"],
    "phase1_logits": ["Q:*C", "Srcs:*T[n]", "Z:*C", "S:i32", "d:i32", "eps:fp32", "BLOCK_D:constexpr",
                      "S_PAD:constexpr", "N_PAD:constexpr"],
    "phase1_combine": ["Z:*C", "Srcs:*T[n]", "Outs:*P[S]", "LSE:*C", "S:i32", "d:i32", "BLOCK_D:constexpr",
                       "S_PAD:constexpr", "N_PAD:constexpr", "UNROLL:constexpr"],
    "phase1_bwd": ["Q:*C", "LSE:*C", "GLse:*C", "Srcs:*T[n]", "GOuts:*P[S]", "GSrcs:*T[n]", "W:*C", "d:i32",
                   "eps:fp32", "g_present:i32", "HAS_GLSE:constexpr", "NEED_W:constexpr", "BLOCK_D:constexpr",
                   "S_PAD:constexpr", "N_PAD:constexpr"],
    "phase1_logits_rows": ["Q:*C", "Srcs:*T[n]", "Z:*C", "rows:i32", "S:i32", "d:i32", "eps:fp32",
                           "GROUP:constexpr", "ROWS:constexpr", "BLOCK_D:constexpr", "S_PAD:constexpr",
                           "N_PAD:constexpr"],
    "phase1_bwd_rows": ["Q:*C", "LSE:*C", "GLse:*C", "Srcs:*T[n]", "GOuts:*P[S]", "P:*C", "W:*C", "C:*C", "rows:i32",
                        "d:i32", "eps:fp32", "g_present:i32", "HAS_GLSE:constexpr", "GROUP:constexpr",
                        "ROWS:constexpr", "BLOCK_D:constexpr", "S_PAD:constexpr", "N_PAD:constexpr"],
    "phase1_grads": ["Q:*C", "P:*C", "W:*C", "C:*C", "Srcs:*T[n]", "GOuts:*P[S]", "GSrcs:*T[n]", "PQ:*C", "rows:i32",
                     "d:i32", "rows_per_program:i32", "g_present:i32", "GROUP:constexpr", "ROWS:constexpr",
                     "BLOCK_D:constexpr", "S_PAD:constexpr", "N_PAD:constexpr"],
    "phase1_dq": ["W:*C", "Srcs:*T[n]", "PQ:*C", "rows:i32", "d:i32", "rows_per_program:i32", "S:constexpr",
                  "ROWS:constexpr", "BLOCK_D:constexpr", "S_PAD:constexpr", "N_PAD:constexpr"],
    "merge_fwd": ["Z:*C", "stride_z:i32", "Known:*P[k]", "Comp:*T[c]", "Addend:*A", "Total:*T", "Qg:*C", "NormW:*C",
                  "Out:*O", "Alpha:*C", "Rc:*C", "Zc:*C", "Rstd:*C", "d:i32", "eps:fp32", "norm_eps:fp32",
                  "HAS_ADDEND:constexpr", "HAS_NORM:constexpr", "D_PAD:constexpr", "M_PAD:constexpr"],
    "merge_fwd_held": ["Z:*C", "stride_z:i32", "Known:*P[k]", "Comp:*T[c]", "Addend:*A", "Total:*T", "Qg:*C",
                       "NormW:*C", "Out:*O", "Alpha:*C", "Rc:*C", "Zc:*C", "Rstd:*C", "rows:i32", "d:i32", "eps:fp32",
                       "norm_eps:fp32", "HAS_ADDEND:constexpr", "HAS_NORM:constexpr", "D_PAD:constexpr",
                       "M_PAD:constexpr", "STAGES:constexpr"],
    "merge_bwd_held": ["Gs:*O[g]", "Alpha:*C", "Rc:*C", "Zc:*C", "Rstd:*C", "Known:*P[k]", "Comp:*T[c]", "Qg:*C",
                       "NormW:*C", "GTotal:*T", "GZ:*C", "GKnown:*P[k]", "GComp:*T[c]", "GAddend:*A", "Part:*C",
                       "rows:i32", "d:i32", "HAS_TOTAL:constexpr", "HAS_ADDEND_GRAD:constexpr", "HAS_NORM:constexpr",
                       "D_PAD:constexpr", "M_PAD:constexpr", "STAGES:constexpr"],
    "merge_bwd": ["Gs:*O[g]", "Alpha:*C", "Rc:*C", "Zc:*C", "Rstd:*C", "Known:*P[k]", "Comp:*T[c]", "Qg:*C", "NormW:*C",
                  "GTotal:*T", "GZ:*C", "GKnown:*P[k]", "GComp:*T[c]", "GAddend:*A", "Part:*C", "rows:i32", "d:i32",
                  "HAS_TOTAL:constexpr", "HAS_ADDEND_GRAD:constexpr", "HAS_NORM:constexpr", "D_PAD:constexpr",
                  "M_PAD:constexpr"],
}

#: The shapes the ahead-of-time compile covers: Phase 1's ``(S, n)`` (every query padding,
#: from two to many sources) and the merge's ``(d, k, c)`` (every row width class; Block's
#: merges, one known and one computed source, and Full's, up to eight computed).
PHASE1_SHAPES = ((2, 2), (4, 5), (8, 9), (16, 9), (16, 57), (32, 33), (64, 9))
MERGE_SHAPES = ((64, 1, 1), (512, 1, 1), (2048, 1, 1), (2048, 0, 2), (2048, 1, 8), (4096, 1, 1))
#: Storage dtypes compiled at every shape; the others at one shape per kernel.
FULL_DTYPES = ("fp32", "bf16")


def _expand(params: list[str], dtype: str, compute: str, counts: dict[str, int], out: str | None = None,
            sums: str | None = None) -> dict:
    """A kernel's signature for Triton's ahead-of-time compile: tuples of ``counts``; the
    merge's output in ``out``, Phase 1's sums in ``sums`` (default: the storage dtype)."""
    signature = {}
    for param in params:
        name, kind = param.split(":")
        if kind == "constexpr":
            signature[name] = kind
            continue
        count = None
        if kind.endswith("]"):
            kind, count = kind[:-1].split("[")
        addend = "bf16" if dtype == "fp32" else dtype
        kind = kind.replace("*T", f"*{dtype}").replace("*A", f"*{addend}").replace("*O", f"*{out or dtype}")
        kind = kind.replace("*P", f"*{sums or dtype}")
        kind = kind.replace("C", compute)
        signature[name] = kind if count is None else (kind,) * counts[count]
    return signature


def launch_shapes(kernel: str, wide: bool = False, wide_storage: bool = False, out_bytes: int | None = None,
                  readers: int = 1, sums_bytes: int | None = None) -> Iterator[tuple[dict[str, int], dict[str, int], int]]:
    """``(tuple counts, constexprs, num_warps)`` of each compiled shape of ``kernel``
    (``wide``: computing in float64; ``wide_storage``: sources of 4 or 8 bytes;
    ``out_bytes``: a merge's output and its gradient of that size, by default the
    sources'; ``readers``: the gradients of the merge's output its backward reads;
    ``sums_bytes``: a merge's sources of known logit, Phase-1 sums, and their gradients of
    that size, by default the sources')."""
    if kernel in ("phase1_logits", "phase1_combine"):  # (decoding: the split forward)
        for S, n in PHASE1_SHAPES:
            constexprs = {"S_PAD": pad(S), "N_PAD": pad(n)}
            if kernel == "phase1_logits":
                block, warps = phase1_forward_geometry(1, 4096, S, wide=wide)
            else:
                block, warps = phase1_combine_tile(4096, S, wide), 4
                constexprs["UNROLL"] = phase1_unrolls(n)
            yield {"S": S, "n": n}, {"BLOCK_D": block, **constexprs}, warps
    elif kernel in ("phase1_logits_rows", "phase1_bwd_rows", "phase1_grads"):  # (many rows)
        for S, n in PHASE1_SHAPES:
            rows, block = phase1_rows_geometry(4096, S, wide)
            constexprs = {"GROUP": phase1_group(n, S, rows, wide), "ROWS": rows, "BLOCK_D": block,
                          "S_PAD": pad(S), "N_PAD": pad(n)}
            warps = rows_warps(S)
            if kernel == "phase1_bwd_rows":
                constexprs = {"HAS_GLSE": 1, **constexprs}
                warps = rows_backward_warps(S, sums_bytes is not None and sums_bytes < (8 if wide else 4))
            yield {"S": S, "n": n}, constexprs, warps
    elif kernel.startswith("phase1"):
        for S, n in PHASE1_SHAPES:
            block, s_pad = phase1_tile(4096, S, wide=wide), pad(S)
            constexprs = {"BLOCK_D": block, "S_PAD": s_pad, "N_PAD": pad(n)}
            if kernel == "phase1_dq":
                constexprs.update(S=S, ROWS=DQ_ROWS)
            if kernel == "phase1_bwd":
                constexprs.update(HAS_GLSE=1, NEED_W=1)
            yield {"S": S, "n": n}, constexprs, phase1_warps(S)
            if kernel == "phase1_fwd":  # (the few-rows geometry: decoding)
                block, warps = phase1_forward_geometry(1, 4096, S, wide=wide)
                yield {"S": S, "n": n}, {**constexprs, "BLOCK_D": block}, warps
    else:
        held = kernel.endswith("_held")
        for d, k, c in MERGE_SHAPES:
            if held and not merge_holds(k + c):
                continue  # (the looping kernels take every shape: forced, they run Block's too)
            d_pad = row_pad(d)
            forward = kernel.startswith("merge_fwd")
            item = 8 if wide else 4 if wide_storage else 2  # (bytes of a source's element)
            flag = {"HAS_ADDEND": 1} if forward else {"HAS_TOTAL": 1, "HAS_ADDEND_GRAD": 0}
            constexprs = {**flag, "HAS_NORM": 1, "D_PAD": d_pad, "M_PAD": pad(k + c)}
            addend = 2 if item == 4 else item  # (as _expand's "*A": bf16 on a float32 stream)
            if held:  # (a row's loads: the sources, and the addend, or the readers' gradients and g_total)
                others = addend if forward else readers * (out_bytes or item) + item
                constexprs["STAGES"] = merge_stages(d * (k * (sums_bytes or item) + c * item + others))
            narrow = not forward and ((out_bytes or item) < item or (k > 0 and (sums_bytes or item) < item))
            counts = {"k": k, "c": c} if forward else {"k": k, "c": c, "g": readers}
            if forward or not held or backward_holds(d_pad, narrow):
                yield counts, constexprs, held_backward_warps(d_pad, narrow) if held else merge_warps(d_pad)
            if not forward and addend < item and (not held or backward_holds(d_pad, True)):
                # (the backward writing a bf16 addend's gradient too: autocast)
                yield (counts, {**constexprs, "HAS_ADDEND_GRAD": 1},
                       held_backward_warps(d_pad, True) if held else merge_warps(d_pad))
            if held and forward and d == 2048 and k:  # (decoding: a row a program, not pipelined)
                yield counts, {**constexprs, "STAGES": 1}, merge_warps(d_pad)


def variants() -> Iterator[tuple[str, str, dict[str, int], dict, dict[str, int], dict[str, int]]]:
    """The ``(kernel, storage dtype, tuple counts, signature, constexprs, launch options)``
    the ahead-of-time compile covers: every kernel at every shape class of
    :func:`launch_shapes` in the storage dtypes of :data:`FULL_DTYPES`, and at its first shape
    in the others."""
    for dtype, compute in DTYPES.items():
        for kernel, params in SIGNATURES.items():
            shapes = launch_shapes(kernel, compute == "fp64", dtype in ("fp32", "fp64"))
            for i, (counts, constexprs, warps) in enumerate(shapes):
                if i and dtype not in FULL_DTYPES:
                    break
                yield kernel, dtype, counts, _expand(params, dtype, compute, counts), constexprs, {"num_warps": warps}
            if dtype == "fp32" and kernel.startswith("merge"):  # (a float32 stream's merge writing bf16: autocast)
                # (its backward reading the gradients of one reader, or of an attention's three
                # projections or an MLP's two, each of its own view of the output)
                for readers in (1, 2, 3) if kernel.startswith("merge_bwd") else (1,):
                    for counts, constexprs, warps in launch_shapes(kernel, False, True, out_bytes=2, readers=readers):
                        if (counts["k"], counts["c"]) == (1, 1) and constexprs["D_PAD"] == 2048:
                            signature = _expand(params, dtype, compute, counts, out="bf16")
                            yield kernel, "fp32, bf16 out", counts, signature, constexprs, {"num_warps": warps}
            if dtype == "fp32":
                yield from _phase1_sums_variants(kernel, params)


#: The kernels that write or read Phase 1's sums or their gradients where they may be
#: narrower than the stream (``autocast_phase1_sums``): the looping merges take them
#: converted (``triton_impl._known``).
SUMS_KERNELS = ("phase1_fwd", "phase1_combine", "phase1_bwd", "phase1_bwd_rows", "phase1_grads", "merge_fwd_held",
                "merge_bwd_held")


def _phase1_sums_variants(kernel: str, params: list[str]) -> Iterator[tuple]:
    """A float32 stream's variants with Phase 1's sums in bf16 (``autocast_phase1_sums``): the
    kernels over many rows (training's) at every shape, the others at their first; the held
    merges at Block's training shape (one sum and the partial sum, ``d`` = 2048), their output
    in float32 or - with ``autocast_norm_output`` - in bf16 for an attention's three readers."""
    if kernel not in SUMS_KERNELS:
        return
    if kernel.startswith("phase1"):
        for i, (counts, constexprs, warps) in enumerate(launch_shapes(kernel, False, True, sums_bytes=2)):
            if i and kernel in ("phase1_fwd", "phase1_bwd"):
                break
            yield (kernel, "fp32, bf16 sums", counts, _expand(params, "fp32", "fp32", counts, sums="bf16"), constexprs,
                   {"num_warps": warps})
        return
    for out, readers in (("fp32", 1), ("bf16", 3)) if kernel == "merge_bwd_held" else (("fp32", 1),):
        out_bytes = 2 if out == "bf16" else None
        for counts, constexprs, warps in launch_shapes(kernel, False, True, out_bytes, readers, sums_bytes=2):
            if (counts["k"], counts["c"]) == (1, 1) and constexprs["D_PAD"] == 2048:
                signature = _expand(params, "fp32", "fp32", counts, out=out, sums="bf16")
                yield kernel, "fp32, bf16 sums", counts, signature, constexprs, {"num_warps": warps}


#: Per multiprocessor, by target: registers, resident warps and programs, shared memory
#: (bytes, the most one program may use) - NVIDIA's occupancy tables for sm_80 and sm_90.
SM_LIMITS = {80: {"registers": 65536, "warps": 64, "programs": 32, "shared": 164 * 1024},
             90: {"registers": 65536, "warps": 64, "programs": 32, "shared": 228 * 1024}}


def resident_warps(arch: int, registers: int, warps: int, shared: int) -> int:
    """Warps resident on one multiprocessor of ``sm_<arch>`` for programs of ``warps`` warps
    using ``registers`` per thread and ``shared`` bytes: registers are allocated per warp in
    units of 256 (8 a thread); each program's shared memory comes with 1 KiB the runtime
    reserves for it."""
    limits = SM_LIMITS[arch]
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    programs = min(limits["registers"] // (per_warp * warps), limits["warps"] // warps, limits["programs"])
    if shared:
        programs = min(programs, limits["shared"] // (shared + 1024))
    return programs * warps
