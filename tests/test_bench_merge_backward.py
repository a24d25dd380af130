"""``benchmarks/merge_backward_from_output.py``'s command line: its report names the options it
ran with (it always said the bare command), writes under ``benchmarks/results`` wherever it
is started from (the default was relative to the working directory), and refuses sizes
that make no table (``--tokens 0`` wrote a table of nan)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import merge_backward_from_output as bench


def test_a_small_run_records_its_command_and_writes_to_out(tmp_path, capsys):
    argv = ["--tokens", "8", "--d", "16", "--seeds", "1", "--out", str(tmp_path)]
    bench.main(argv)
    md = (tmp_path / "merge_backward_from_output.md").read_text()
    assert f"`python benchmarks/merge_backward_from_output.py {' '.join(argv)}` - one Block merge, 8 tokens" in md
    r = json.loads((tmp_path / "merge_backward_from_output.json").read_text())
    assert (r["tokens"], r["d"], r["seeds"]) == (8, 16, 1)
    assert all(v == v for case in r["results"].values() for row in case["errors"].values() for v in row.values())


def test_the_default_out_is_the_results_directory_wherever_it_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "measure", lambda *a: pytest.fail("sizes checked before measuring"))
    with pytest.raises(SystemExit):
        bench.main(["--tokens", "0"])
    assert "argument --tokens: must be an integer >= 1, got '0'" in capsys.readouterr().err
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path / "f")])
    assert f"argument --out: {tmp_path / 'f'} is a file" in capsys.readouterr().err
    results = Path(bench.__file__).resolve().parent / "results"
    assert bench.build_parser().get_default("out") == results
    assert (results / "merge_backward_from_output.md").exists()  # the committed result is where it writes
