"""The CPU-side logic of the GPU kernel benchmark: shapes, byte accounting, peer selection,
``--dry-run``, and our block implementation (Triton: compiled on a CUDA device where there
is one, else interpreted) against its PyTorch
reference on a tiny shape."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_kernels_gpu as bench
from conftest import OP_TOL_BF16, assert_rel_close, triton_device


def test_block_bytes_count_every_tensor_once():
    s = bench.OpShape(tokens=10, d=6, n=3, S=4)
    row, f32 = 10 * 6 * 2, 10 * 4
    b = bench.block_bytes(s)
    assert b["min"] == (3 + 3 + 4) * row
    phase1 = 3 * row + 4 * (row + f32)
    later = 3 * (3 * row + 6 * f32)
    assert b["ours"] == phase1 + 2 * row + f32 + later
    assert b["ours"] > b["min"]


def test_shapes_cover_a_non_power_of_two_width():
    for quick in (False, True):
        shapes = bench.op_shapes(quick)
        assert any(s.d & (s.d - 1) for s in shapes)
        assert all(s.S >= 2 and s.n >= 1 for s in shapes)


def test_peer_selection_skips_missing_or_broken_packages_with_the_reason(monkeypatch):
    def missing():
        raise ImportError("No module named 'nothing'")

    def broken():  # (flash-attn-res 0.1.12 under Triton 3.9: its autotuner's key names no argument)
        raise ValueError("key contains names that are not kernel arguments")

    monkeypatch.setattr(bench, "PEERS", {"present": ("pkg-a", lambda: ("run", "check")), "absent": ("pkg-b", missing),
                                         "broken": ("pkg-c", broken)})
    available, skipped = bench.select_peers()
    assert available == {"present": ("run", "check")}
    assert list(skipped) == ["absent", "broken"] and "pip install pkg-b" in skipped["absent"]
    assert skipped["broken"] == "installed but fails to load: ValueError: key contains names that are not kernel arguments"


def test_peer_adapters_reject_the_shapes_their_packages_cannot_run(monkeypatch):
    """The shape checks of the adapters, without the packages (their imports are faked)."""
    fake = type(sys)("flash_attn_res")
    fake.phase_1_batched_attention_triton_op = fake.phase_2_online_softmax_merge_triton_op = None
    monkeypatch.setitem(sys.modules, "flash_attn_res", fake)
    _, unsupported = bench.flash_attn_res_adapter()
    assert unsupported(bench.OpShape(8, 2048, 2, 4)) is None
    assert "power-of-two" in unsupported(bench.OpShape(8, 3000, 2, 4))


def test_dry_run_plans_without_a_gpu(capsys):
    assert bench.main(["--dry-run", "--quick"]) == 0
    err = capsys.readouterr().err
    assert "[dry-run] M=4096 d=1000" in err and "peer fla fused_attnres" in err
    args = bench.parse_args([])
    cfg = bench.e2e_config(args)  # the shape: d = 2048, 32 blocks, N = 8
    assert (cfg.d_model, cfg.n_layers, 2 * cfg.n_layers // cfg.residual.block_size) == (2048, 32, 8)
    assert bench.parse_args(["--e2e-blocks", "16"]).e2e_blocks == 16  # (a divisor of the 64 sublayers)
    for refused in ("5", "6", "128"):  # (6: even, and no divisor)
        with pytest.raises(SystemExit):
            bench.parse_args(["--e2e-blocks", refused])
        assert f"error: --e2e-blocks must divide the 64 sublayers, got {refused}" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (--quick: 8 layers)
        bench.parse_args(["--quick", "--e2e-blocks", "32"])
    assert "error: --e2e-blocks must divide the 16 sublayers, got 32" in capsys.readouterr().err


def test_our_block_implementation_matches_its_reference():
    """``ours_triton`` against ``ours_torch``: outputs and every gradient."""
    s = bench.OpShape(tokens=3, d=20, n=2, S=3)
    x = bench.make_inputs(s, device=triton_device())
    fast, ref = bench.ours_triton(x), bench.ours_torch(x)
    for a, b in zip(fast, ref):
        assert a.dtype == torch.bfloat16
        assert_rel_close(a.float(), b.float(), OP_TOL_BF16, "output")
    loss = lambda outs: sum((o.float() * u.float()).sum() for o, u in zip(outs, x["upstream"]))
    grads = torch.autograd.grad(loss(fast), bench.leaves(x))
    grads_r = torch.autograd.grad(loss(ref), bench.leaves(x))
    for a, b in zip(grads, grads_r):
        assert_rel_close(a.float(), b.float(), 2 * OP_TOL_BF16, "grad")


def test_markdown_report_renders_every_row():
    """The report is rendered at the very end of a GPU run: it must not fail there."""
    impl = {"fwd_us": 100.0, "fwd+bwd_us": 300.0, "min_bytes_fraction_of_peak": 0.5, "fwd_over_bandwidth_bound": 2.0}
    result = {
        "device": "GPU", "command": "bench_kernels_gpu.py", "torch": "x", "triton": "y",
        "ops": {
            "peak_GBps": 3350.0, "peak_source": "datasheet (H100)", "skipped_peers": {"fast-attnres": "not installed"},
            "shapes": [{"shape": {"tokens": 8, "d": 16, "n": 2, "S": 4}, "impls": {"ours (triton)": impl}, "unsupported": {"flash-attn-res": "power-of-two d"}}],
        },
        "e2e": {
            "config": {"d_model": 2048, "n_layers": 32, "block_size": 8, "seq": 2048, "batch": 4},
            "train": {"standard": 1.0, "block (triton)": 1.02},
            "decode b=1": {"standard": 0.010, "block (triton)": 0.0103},
        },
    }
    md = bench.render_markdown(result)
    assert "| M=8 d=16 n=2 S=4 | ours (triton) | 100 | 300 | 0.50 | 2.00 |" in md
    assert "power-of-two d" in md and "Skipped peer **fast-attnres**" in md
    assert "| train | block (triton) | 1020.00 | 1.020 | <= 1.04: met |" in md
    assert "| decode b=1 | block (triton) | 10.30 | 1.030 | <= 1.02: MISSED |" in md


def test_markdown_report_of_a_run_cut_short_says_what_is_missing():
    """The op-level rows are written after every shape, before the end-to-end part runs, so
    that a run stopped by a time limit keeps what it measured."""
    base = {"device": "GPU", "command": "bench_kernels_gpu.py", "torch": "x", "triton": "y"}
    ops = {"peak_GBps": 3350.0, "peak_source": "datasheet (H100)", "skipped_peers": {}, "shapes": []}
    assert "End to end: not measured in this run." in bench.render_markdown({**base, "ops": ops})
    e2e = {"config": {"d_model": 64, "n_layers": 2, "block_size": 2, "seq": 8, "batch": 1}, "train": {"standard": 1.0}}
    md = bench.render_markdown({**base, "e2e": e2e})
    assert "Op level: not measured in this run." in md and "| train | standard | 1000.00 | 1.000 |  |" in md
