"""Every benchmark script answers ``--help`` with its usage and does nothing else:
``bench_seq_prefill.py --help`` ran the whole benchmark and overwrote its committed results."""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())
#: The scripts that import the transformers wing as they load (the hf extra), before their parser.
NEEDS_TRANSFORMERS = {"upcycle_exactness.py", "upcycle_smollm2.py"}


def snapshot(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_the_usage_and_writes_nothing(script, monkeypatch):
    if script.name in NEEDS_TRANSFORMERS:
        pytest.importorskip("transformers")
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their siblings
    before = snapshot(BENCHMARKS / "results")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code == 0 and out.getvalue().startswith("usage: "), out.getvalue()[:500]
    assert snapshot(BENCHMARKS / "results") == before
