"""GPU readiness without a GPU: every Triton kernel variant the launch code can choose
compiles ahead of time for sm_80 and sm_90 with Triton's bundled ``ptxas``, with no spill
and shared memory within the target's limit (``benchmarks/triton_aot_report.py``, run in a
process of its own: the suite runs Triton's interpreter)."""

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


def test_every_kernel_variant_compiles_for_sm80_and_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "aot.json"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_aot_report.py"), "--json", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(out.read_text())
    expected = list(triton_launch.variants())
    assert len(rows) == 2 * len(expected) and {r["arch"] for r in rows} == {80, 90}
    assert {r["kernel"] for r in rows} == set(triton_launch.SIGNATURES)
    assert {r["dtype"] for r in rows} == set(triton_launch.DTYPES)
    for r in rows:
        assert r["registers"] > 0 and r["spill_stores"] == r["spill_loads"] == 0, r


def test_the_listed_signatures_are_the_kernels_parameters():
    """``triton_launch.SIGNATURES`` (what the ahead-of-time compile uses) lists every
    kernel's parameters in order, so the compiled variants are the launched ones."""
    from attnres.ops.depth_attention import triton_kernels

    for name, params in triton_launch.SIGNATURES.items():
        fn = getattr(triton_kernels, name)
        names = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
        assert names == [p.split(":")[0] for p in params], name


def test_launch_geometry():
    assert triton_launch.tile_d(37) == 64 and triton_launch.tile_d(1) == 64 and triton_launch.tile_d(300) == 1024
    assert triton_launch.tile_d(10**6) == 1024  # wide rows are tiled
    assert triton_launch.tile_d(300, rows=4) == 256 and triton_launch.tile_d(300, rows=16) == 64
    assert triton_launch.tile_d(37, block_d=16) == 16
    with pytest.raises(ValueError, match="block_d must be a power of two"):
        triton_launch.tile_d(37, block_d=12)
    assert [triton_launch.s_pad(s) for s in (1, 4, 5, 8, 40)] == [4, 4, 8, 8, 8]
    for rows, cap in [(1, 4), (7, 3), (1000, 1024), (5000, 1024)]:
        programs, per = triton_launch.row_ranges(rows, cap)
        assert programs <= cap and programs * per >= rows and (programs - 1) * per < rows
