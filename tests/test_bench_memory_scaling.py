"""``benchmarks/bench_memory_scaling.py --quick``: a smoke run writing its three files beside the
committed results (the script had no small setting: checking that it runs took its full
five-minute sweep, which rewrote ``memory_scaling.{json,md,png}``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_memory_scaling as bench


def test_quick_writes_every_file_with_its_rows(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")  # (its figure, drawn after every measurement)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # (the script's one thread: not the suite's)
    out = tmp_path / "scaling"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    r = json.loads(out.with_suffix(".json").read_text())
    assert [(row["sweep"], row["L"], row["S"]) for row in r["rows"]] == [("L", 4, 4), ("L", 8, 4), ("N", 8, 4),
                                                                         ("N", 8, 2)]
    assert out.with_suffix(".png").stat().st_size > 0 and "| L | 8 | 4 | 2 |" in out.with_suffix(".md").read_text()
