"""GPU readiness without a GPU: every Triton kernel variant the launch code can choose (each
kernel, storage dtype, tile, query padding and class of source counts) compiles ahead of
time with Triton's bundled ``ptxas``, with no spill, shared memory within the target's limit
and - for the backward kernels - at least 16 warps resident per multiprocessor
(``benchmarks/triton_aot_report.py``, run in a process of its own: the suite runs Triton's
interpreter). The default suite compiles for sm_90 (H100 / H200) as launched at an aligned
``d``; the slow suite for sm_80 (A100) too, and at an odd ``d`` (four times the compiles)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from attnres.ops.depth_attention import triton_launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: The Triton whose register allocation the rules were set on. Triton 3.6 (torch 2.11's, the GPU
#: machine's) compiles every variant but spills 4 - 32 bytes in some Phase-1 variants and leaves
#: 8 - 12 warps resident in some backward ones (docs/kernels.md, "On the GPU machine's software"):
#: under it the tests check that every variant compiles, then skip the rules.
RULES_TRITON = (3, 9)


def _triton_version() -> tuple[int, int]:
    import triton

    return tuple(int(part) for part in triton.__version__.split(".")[:2])


def _skip_rules_before_their_triton() -> None:
    if _triton_version() < RULES_TRITON:
        import triton

        pytest.skip(f"every variant compiled; the spill and resident-warp rules are Triton "
                    f"{'.'.join(map(str, RULES_TRITON))}'s, and Triton {triton.__version__} spills a few bytes in "
                    "some variants (docs/kernels.md, \"On the GPU machine's software\")")


def _compile_report(tmp_path: Path, archs: set[int], *options: str) -> list[dict]:
    """``benchmarks/triton_aot_report.py``'s rows (every variant, for each of ``archs``),
    compiled in a process of its own (the suite runs Triton's interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "aot.json"
    arch_options = [f"--arch={arch}" for arch in sorted(archs)]
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_aot_report.py"), "--json", str(out),
                             *arch_options, *options], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    fails = [line for line in result.stderr.splitlines() if line.startswith("FAIL: ")]
    spills_only = bool(fails) and all("spills" in line or "resident warps" in line for line in fails)
    old_triton = _triton_version() < RULES_TRITON and result.returncode == 1 and spills_only
    assert result.returncode == 0 or old_triton, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())
    expected = list(triton_launch.variants())
    assert len(rows) == len(archs) * len(expected) and {r["arch"] for r in rows} == archs
    assert {r["kernel"] for r in rows} == set(triton_launch.SIGNATURES)
    # (the last two: autocast - the merge writing bf16, Phase 1's sums in bf16)
    assert {r["dtype"] for r in rows} == {*triton_launch.DTYPES, "fp32, bf16 out", "fp32, bf16 sums"}
    # (the backward reading the gradients of an attention's three readers and an MLP's two)
    assert {r["counts"].get("g") for r in rows if r["dtype"] == "fp32, bf16 out" and "bwd" in r["kernel"]} == {1, 2, 3}
    return rows


def _check(compiled: dict, r: dict) -> None:
    """No spill; a backward kernel at least 16 warps per SM; a held merge one wave of its
    persistent programs resident."""
    assert compiled["registers"] > 0 and compiled["spill_stores"] == compiled["spill_loads"] == 0, r
    if r["kernel"] in triton_launch.BACKWARD_KERNELS:  # latency-bound below 16 warps per SM
        assert compiled["resident_warps"] >= 16, r
    if r["kernel"].endswith("_held"):  # persistent programs: one wave of them resident
        assert compiled["resident_warps"] >= triton_launch.held_warps(r["num_warps"]), r


def test_every_kernel_variant_compiles_for_sm90_without_spills(tmp_path):
    """Every variant for sm_90 as launched at an aligned ``d`` (the models' widths; what
    docs/kernels.md tables). About 3 CPU-minutes with Triton's cache cold: sm_80 and the
    variants at an odd ``d`` are the slow suite's."""
    rows = _compile_report(tmp_path, {90}, "--aligned-only")
    assert all("unaligned" not in r and r["registers"] > 0 for r in rows)
    _skip_rules_before_their_triton()
    for r in rows:
        _check(r, r)


@pytest.mark.slow
def test_every_kernel_variant_compiles_for_sm80_and_sm90_and_at_an_odd_d_too(tmp_path):
    """Every variant for sm_80 and sm_90, each as launched at an aligned ``d`` and at an odd
    one (no alignment to specialise on), held to the same rules - but the held merges,
    launched only at an aligned ``d``."""
    rows = _compile_report(tmp_path, {80, 90})
    for r in rows:
        held = r["kernel"].endswith("_held")  # (launched only at an aligned d)
        assert held != ("unaligned" in r), r
    _skip_rules_before_their_triton()
    for r in rows:
        for compiled in (r, r.get("unaligned")):  # (as launched at an aligned d, and at an odd one)
            if compiled is not None:
                _check(compiled, r)


@pytest.mark.slow
def test_every_kernel_variant_compiles_for_other_nvidia_and_amd_cards(tmp_path):
    """Every variant compiles for a T4 (sm_75, no ``cp.async``), an RTX 30xx / A10 (sm_86,
    99 KiB of shared memory a program) and an MI300 (gfx942, Triton's AMD backend, 64 KiB of
    LDS), within the card's shared memory (``benchmarks/triton_other_cards.py``; the other
    cards it knows by hand: docs/kernels.md)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "cards.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_other_cards.py"), "--cards",
                             "sm_75,sm_86,gfx942", "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows, n = json.loads(out.read_text()), len(list(triton_launch.variants()))
    assert len(rows) == 3 * n and all("shared" in r for r in rows)
    assert f"| gfx942 | MI300 | {n} of {n} |" in result.stdout


def test_the_merges_access_rows_16_bytes_at_a_time():
    """The merges pick their sources' pointers from a tuple at run time; without the
    alignment hint (``_pointer``) every such load or store of a bf16 row was one element
    wide (8 in the forward, 48 in the backward at d = 2048). Compiled as launched on aligned
    data, none is."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import triton_aot_report as r; "
            "print([r.narrow_row_accesses(k, {'k': 1, 'c': 1, **({'g': 1} if 'bwd' in k else {})}) "
            "for k in ('merge_fwd', 'merge_bwd', 'merge_fwd_held', 'merge_bwd_held')])")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[0, 0, 0, 0]"


def test_the_listed_signatures_are_the_kernels_parameters():
    """``triton_launch.SIGNATURES`` (what the ahead-of-time compile uses) lists every
    kernel's parameters in order, so the compiled variants are the launched ones."""
    from attnres.ops.depth_attention import triton_kernels

    for name, params in triton_launch.SIGNATURES.items():
        fn = getattr(triton_kernels, name)
        names = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
        assert names == [p.split(":")[0] for p in params], name


def test_launch_geometry():
    L = triton_launch
    # Phase 1: S_PAD x BLOCK_D within the tile budget, no wider than d needs, at least 16
    assert L.phase1_tile(37, 3) == 64 and L.phase1_tile(1, 1) == 16 and L.phase1_tile(4096, 8) == 128
    assert L.phase1_tile(4096, 2) == 128 and L.phase1_tile(4096, 9) == 32 and L.phase1_tile(4096, 64) == 16 and L.phase1_tile(4096, 32) == 16
    assert [L.phase1_warps(S) for S in (2, 9, 32, 33)] == [4, 4, 4, 4]
    # decoding (at most FEW_ROWS rows): the forward takes a row in one wide tile, 16 warps
    assert L.phase1_forward_geometry(1, 2048, 8) == (2048, 16) and L.phase1_forward_geometry(1, 37, 3) == (64, 4)
    assert L.phase1_forward_geometry(L.FEW_ROWS + 1, 2048, 8) == (L.phase1_tile(2048, 8), 4)
    assert L.phase1_forward_geometry(1, 2048, 8, block_d=16) == (16, 4)
    assert L.phase1_forward_geometry(1, 2048, 16) == (512, 8) and L.phase1_forward_geometry(1, 2048, 32) == (128, 4)
    assert L.phase1_tile(4096, 8, wide=True) == 64 and L.phase1_tile(37, 3, block_d=16) == 16
    # decoding's few rows: the forward split over the sources, unrolled where they are few
    assert L.phase1_splits(1) and L.phase1_splits(L.SPLIT_ROWS) and not L.phase1_splits(L.SPLIT_ROWS + 1)
    assert not L.phase1_splits(0)
    assert L.phase1_unrolls(L.UNROLL_SOURCES) and not L.phase1_unrolls(L.UNROLL_SOURCES + 1)
    assert L.phase1_combine_tile(2048, 9) == 256 and L.phase1_combine_tile(37, 3) == 64
    assert L.phase1_combine_tile(2048, 9, wide=True) == 128 and L.phase1_combine_tile(4096, 64) == 64
    with pytest.raises(ValueError, match="block_d must be a power of two"):
        L.phase1_tile(37, 3, block_d=12)
    assert [L.pad(s) for s in (1, 2, 4, 5, 9, 33)] == [2, 2, 4, 8, 16, 64]
    # the shapes the kernels take (the PyTorch implementation runs the others)
    assert L.phase1_fits(9, 57) and not L.phase1_fits(65, 2) and not L.phase1_fits(64, 64)
    assert L.merge_fits(4096, 9) and not L.merge_fits(4097, 2)
    # the merge: the whole row, one warp per 256 elements (1 to 16)
    assert [L.row_pad(d) for d in (1, 37, 2048, 3000)] == [16, 64, 2048, 4096]
    assert [L.merge_warps(L.row_pad(d)) for d in (64, 2048, 4096)] == [1, 8, 16]
    # the merge backward fills BACKWARD_WARPS_PER_SM warps per multiprocessor, one wave
    assert L.backward_programs(8192, 2048, 132) == 132 * 16 // 8 and L.backward_programs(5, 2048, 132) == 5
    # the merge over a few sources at an aligned d holds them: persistent programs filling
    # HELD_WARPS_PER_SM warps, pipelined two rows ahead within PIPELINE_BYTES, else one
    assert L.merge_holds(2, 2048) and not L.merge_holds(2, 37) and L.merge_holds(2) and not L.merge_holds(3, 2048)
    assert L.held_programs(8192, 132, 8) == 132 * L.HELD_WARPS_PER_SM // 8 and L.held_programs(3, 132, 8) == 3
    assert L.held_programs(8192, 132, 32) == 132 and L.held_warps(32) == 32
    # (Block at d = 2048: bf16 forward and backward, a float32 forward with its bf16 addend and
    # a float32 backward taking a bf16 gradient two rows ahead; a float32 backward one)
    assert [L.merge_stages(2048 * n) for n in (6, 8, 10, 14, 16)] == [3, 3, 3, 3, 2]
    assert L.merge_stages(3 * 2 * 2048, rows_per_program=1) == 1  # (decoding: a row a program)
    # (a held backward reading a bf16 gradient of float32 sources: twice the warps, half the row each)
    assert L.held_backward_warps(2048) == 8 and L.held_backward_warps(2048, narrow_gradient=True) == 16
    # (or writing a bf16 addend's gradient; past rows of 2048 that would be 32 warps: the looping backward)
    assert L.backward_holds(2048, True) and L.backward_holds(4096) and not L.backward_holds(4096, True)
    for row_bytes in (256, 16384, 32768, 131072):
        stages = L.merge_stages(row_bytes)
        assert 2 <= stages <= 3 and (stages == 2 or (stages - 1) * row_bytes <= L.PIPELINE_BYTES)
    for rows, cap in [(1, 4), (7, 3), (1000, 1024), (5000, 1024)]:
        programs, per = L.row_ranges(rows, cap)
        assert programs <= cap and programs * per >= rows and (programs - 1) * per < rows
    tiles, programs, per = L.dq_grid(8192, 2048, 128, 132)
    assert tiles == 16 and tiles * programs >= 132 * L.PROGRAMS_PER_SM and programs * per >= 8192
    # ... and of phase1_grads: each program's rows a whole number of its blocks of rows
    for rows, multiple in [(8192, 2), (37, 4), (5, 8), (1, 1)]:
        tiles, programs, per = L.dq_grid(rows, 2048, 128, 132, multiple=multiple)
        assert per % multiple == 0 and programs * per >= rows and (programs - 1) * per < rows
    # Phase 1 over blocks of rows: ROWS x S_PAD x BLOCK_D within the budget, tiles up to 128
    # (at most 64 at 2 queries, except in float64: more rows instead)
    assert L.phase1_rows_geometry(2048, 8) == (1, 128) and L.phase1_rows_geometry(2048, 2) == (8, 64)
    assert L.phase1_rows_geometry(2048, 1) == (8, 64) and L.phase1_rows_geometry(2048, 4) == (2, 128)
    assert L.phase1_rows_geometry(2048, 64) == (1, 16) and L.phase1_rows_geometry(20, 3) == (8, 32)
    assert L.phase1_rows_geometry(2048, 2, wide=True) == (2, 128)
    assert L.phase1_rows_geometry(37, 3, block_d=16) == (16, 16)
    # ... loading up to ROWS_GROUP source rows together, one source from 16 queries on
    assert [L.phase1_group(n, 8) for n in (1, 3, 8, 57)] == [1, 2, 2, 2] and L.phase1_group(8, 8, wide=True) == 1
    assert L.phase1_group(8, 2, rows=4) == L.phase1_group(8, 4, rows=2) == L.phase1_group(8, 16) == 1
    assert [L.rows_warps(S) for S in (1, 8, 16, 32, 64)] == [4, 4, 4, 8, 8]
    for d, S in [(1, 1), (37, 17), (4096, 33), (2048, 64)]:
        rows, tile = L.phase1_rows_geometry(d, S)
        assert rows * L.pad(S) * tile <= L.ROWS_TILE_ELEMENTS and 1 <= rows <= L.MAX_ROWS and tile <= L.ROWS_TILE


def test_resident_warps_follow_the_occupancy_rules():
    """Registers per warp in units of 256, the warp and program limits, shared memory."""
    assert triton_launch.resident_warps(90, 80, 4, 0) == 24  # 80 regs: 2560/warp -> 6 programs of 4 warps
    assert triton_launch.resident_warps(90, 32, 8, 0) == 64  # the warp limit
    assert triton_launch.resident_warps(90, 255, 8, 0) == 8
    assert triton_launch.resident_warps(80, 32, 1, 100 * 1024) == 1  # shared memory: one program
