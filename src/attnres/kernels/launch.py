"""Launch geometry shared by the kernels: tiles of ``d`` and programs per row range.

No triton import here, so that the geometry can be checked (and the benchmark can plan its
shapes) where triton is not installed.

* **Tiling of d.** A program never holds a whole row: it walks ``d`` in tiles of
  ``BLOCK_D`` elements (a power of two), so any hidden size works, however wide. The tile is
  the next power of two of ``d`` capped so that a program's ``rows x BLOCK_D`` float32 block
  stays within :data:`MAX_TILE_ELEMENTS`; callers (the tests) may force a smaller tile.
* **Programs.** Backward kernels that reduce over token rows (the RMSNorm gain gradient)
  run at most :data:`MAX_PROGRAMS` programs, each over a contiguous range of rows, and
  write one partial sum per program (deterministic; no atomics); the partials are summed
  afterwards.
"""

from __future__ import annotations

#: Largest float32 block ``rows x BLOCK_D`` one program works on at a time (registers).
MAX_TILE_ELEMENTS = 2048
#: Upper bound on the programs of the row-reducing backward kernels.
MAX_PROGRAMS = 1024


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()


def tile_d(d: int, rows: int = 1, block_d: int | None = None) -> int:
    """``BLOCK_D`` for hidden size ``d`` when a program holds ``rows`` rows of a tile.

    ``block_d`` (a power of two) forces the tile, e.g. to test tiling at small ``d``.
    """
    if d < 1:
        raise ValueError(f"hidden size d must be >= 1, got {d}")
    if block_d is not None:
        if block_d < 1 or block_d & (block_d - 1):
            raise ValueError(f"block_d must be a power of two >= 1, got {block_d}")
        return min(block_d, next_power_of_2(d))
    cap = max(16, MAX_TILE_ELEMENTS // next_power_of_2(rows))
    return min(next_power_of_2(d), cap)


def num_warps(block_d: int) -> int:
    """Warps per program: one per 256 elements of the tile, 1 to 8."""
    return min(8, max(1, block_d // 256))


def row_ranges(rows: int, max_programs: int | None = None) -> tuple[int, int]:
    """``(programs, rows_per_program)`` covering ``rows`` token rows with at most
    ``max_programs`` (default :data:`MAX_PROGRAMS`) programs."""
    cap = MAX_PROGRAMS if max_programs is None else max_programs
    if cap < 1:
        raise ValueError(f"max_programs must be >= 1, got {cap}")
    per = -(-max(rows, 1) // cap)
    return -(-max(rows, 1) // per), per


def nonempty(t, placeholder):
    """``t``, or ``placeholder`` when ``t`` has no elements: an empty tensor's data pointer
    may be null, which a kernel launch rejects even where the kernel never reads it."""
    return t if t.numel() else placeholder
