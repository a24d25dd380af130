"""``benchmarks/upcycle_moe.py --quick`` keeps the committed experiment: without ``--out`` it
wrote its smoke run's report over ``results/upcycle-moe``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import upcycle_moe as bench


def test_quick_writes_beside_the_committed_results():
    quick = bench.parse_args(["--quick"])
    assert (quick.out, quick.work, quick.steps) == ("results/upcycle-moe-quick", "runs/upcycle-moe-quick", 4)
    full = bench.parse_args([])
    assert (full.out, full.work) == ("results/upcycle-moe", "runs/upcycle-moe")
    assert (Path(__file__).resolve().parents[1] / full.out / "report.md").exists()  # the committed run
    assert bench.parse_args(["--quick", "--out", "elsewhere"]).out == "elsewhere"
