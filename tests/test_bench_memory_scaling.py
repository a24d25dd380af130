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
    # (its reading: no conclusion from four small points, not the full sweep's text and numbers)
    quick = out.with_suffix(".md").read_text()
    assert r["quick"] is True and "A quick run (`--quick`" in quick and "draw no conclusion" in quick
    assert "Reading it" not in quick and "5.4 to 7.7" not in quick


def test_the_commentary_follows_the_numbers_measured():
    """The .md's reading was one fixed text, written for the full sweep's numbers ("5.4 to
    7.7 units from L = 8 to 64, below the N d line from L = 32 on"): a --quick run's .md said
    it beside its L = 4, 8 table (test_quick_writes_every_file_with_its_rows), and a rerun
    whose numbers moved kept the old ones. A full run's reading quotes its own rows."""
    committed = Path(bench.__file__).parent / "results" / "memory_scaling"
    full = json.loads(committed.with_suffix(".json").read_text())
    assert bench.render(full) == committed.with_suffix(".md").read_text()  # (its reading: its own numbers)
    unit = full["unit_bytes"]
    for row in full["rows"]:
        if row["sweep"] == "L":
            row["block_lean"] = (row["N"] + 1) * unit  # above the N d line at every depth
    reading = bench.render(full).splitlines()[-1]
    assert "S = 4: 3.0 to 17.0 units from L = 8 to 64, above the N d line throughout" in reading
    assert "at L = 32, S = 16 to 2: 18.5 to 4.2" in reading and "S = 1 (N = L, every sublayer a block): 42.7 units" in reading
