"""The memory-traffic count of ``benchmarks/residual_traffic.py`` against the per-token
formulas of docs/inference.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import residual_traffic as traffic

from attnres.nn.residual import BlockAttnRes, StandardResidual

L, S, D, TOKENS = 8, 4, 24, 12
N = L // S


def test_standard_reads_two_and_writes_one():
    r = traffic.measure(StandardResidual(D, L), TOKENS)
    assert r == {"phase2": (pytest.approx(2.0), pytest.approx(1.0))}


def test_block_matches_the_derivation():
    """Phase 1 reads every completed block sum once per later block - its logits for the
    block's queries computed in the same pass - and writes one weighted sum per query of the
    block (and the output aggregation's, with the last block); the first block has one
    source and runs none. Phase 2: per sublayer after a block's first, one merge reads the
    weighted sum (the first block: the embedding) and the partial sum and writes the input;
    the partial-sum update reads two and writes one. The output aggregation merges its
    weighted sum with the last partial sum."""
    r = traffic.measure(BlockAttnRes(D, L, S), TOKENS)
    reads1 = sum(range(2, N + 1))
    writes1 = sum(S + (k == N) for k in range(2, N + 1))
    assert r["phase1"] == (pytest.approx(reads1 / L), pytest.approx(writes1 / L))
    assert r["phase2"] == (pytest.approx(4 * (S - 1) * N / L), pytest.approx(2 * (S - 1) * N / L))
    assert r["aggregation"] == (pytest.approx(2 / L), pytest.approx(1 / L))
