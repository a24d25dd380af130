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
    source and runs none. Phase 2: the block's second sublayer merges the weighted sum (the
    first block: the embedding) with the partial sum (the first output): reads 2, writes 1;
    every later one forms the partial sum inside its merge from the previous one and the
    last output: reads 3 (the weighted sum too), writes 2 (the sum and the input); the
    block's last output is added when the block closes (reads 2, writes 1) - for the last
    block, by the output aggregation's merge (reads 3, writes 2)."""
    r = traffic.measure(BlockAttnRes(D, L, S), TOKENS)
    reads1 = sum(range(2, N + 1))
    writes1 = sum(S + (k == N) for k in range(2, N + 1))
    assert r["phase1"] == (pytest.approx(reads1 / L), pytest.approx(writes1 / L))
    reads2, writes2 = N * (2 + 3 * (S - 2) + 2) - 2, N * (1 + 2 * (S - 2) + 1) - 1
    assert r["phase2"] == (pytest.approx(reads2 / L), pytest.approx(writes2 / L))
    assert r["aggregation"] == (pytest.approx(3 / L), pytest.approx(2 / L))


def test_the_command_takes_L_alone_with_the_models_block_size(monkeypatch, capsys):
    """``--L`` alone tables the models' default S = ceil(L / 8) (it raised a TypeError);
    ``--S`` alone is refused with the reason."""
    monkeypatch.setattr(sys, "argv", ["residual_traffic.py", "--L", "16", "--d", "24", "--tokens", "20"])
    assert traffic.main() == 0
    assert "L=16 sublayers, S=2, N=8" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["residual_traffic.py", "--S", "3"])
    with pytest.raises(SystemExit):
        traffic.main()
    assert "--S needs --L" in capsys.readouterr().err
