"""The memory-traffic count of ``benchmarks/residual_traffic.py`` against the per-token
formulas of docs/inference.md, on both code paths of the two-phase schedule."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import residual_traffic as traffic

from attnres.nn.residual import BlockAttnRes, StandardResidual
from attnres.ops import two_phase

L, S, D, TOKENS = 8, 4, 24, 12
N = L // S


def test_standard_reads_two_and_writes_one():
    r = traffic.measure(StandardResidual(D, L), TOKENS)
    assert r == {"phase2": (pytest.approx(2.0), pytest.approx(1.0))}


def test_block_prefill_path_matches_the_derivation():
    r = traffic.measure(BlockAttnRes(D, L, S), TOKENS, "prefill")
    assert r["phase1"] == (pytest.approx(2 / S + (N * N - 1) / N), pytest.approx((N * (N + 1) / 2 - 1) / N))
    assert r["phase2"] == (pytest.approx(6 * (S - 1) / S), pytest.approx(2 * (S - 1) / S))


def test_decode_path_reads_each_completed_block_once_per_block():
    """Phase 1 on the decode path reads every completed source once per block (the stacked
    copy, then the matmul over it) plus its RMS pass when it completes, instead of once per
    query; the forced path is restored afterwards."""
    before = two_phase.SMALL_SOURCE_NUMEL
    prefill = traffic.measure(BlockAttnRes(D, L, S), TOKENS, "prefill")
    decode = traffic.measure(BlockAttnRes(D, L, S), TOKENS, "decode")
    assert two_phase.SMALL_SOURCE_NUMEL == before
    assert decode["phase1"][0] < prefill["phase1"][0]
    assert decode["phase2"] == prefill["phase2"]  # the same bytes, in fewer operations
