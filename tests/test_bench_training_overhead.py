"""The CPU training-overhead benchmark's command line: ``--quick`` is a small smoke run that
writes beside the committed results (it ran the full shape for tens of minutes and overwrote
``training_overhead.{json,md}``), ``--out`` is written as given (with ``--baseline`` it had
``_versus_baseline`` appended, so the committed ``*_recompute_phase1`` commands wrote other
files), and a bad argument is a one-line error naming it (it was a ``KeyError`` traceback, or
``--backends bogus`` silently timed ``torch.compile``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_training_overhead as bench

from attnres import ModelConfig

RESULTS = Path(bench.__file__).parent / "results"


def test_quick_is_small_and_writes_beside_the_committed_results():
    args = bench.parse_args(["--quick"])
    assert (args.batch, args.seq, args.repeats_train, args.backends) == (2, 32, 2, "eager")
    assert Path(args.out) == RESULTS / "training_overhead_quick"
    assert Path(bench.parse_args(["--quick", "--shape", "main-job"]).out) == RESULTS / "training_overhead_main_job_quick"
    full = bench.parse_args([])
    assert (full.batch, full.seq, Path(full.out)) == (8, 256, RESULTS / "training_overhead")
    main_job = bench.parse_args(["--shape", "main-job"])
    assert (main_job.batch, main_job.seq, main_job.threads) == (16, 128, 1)
    assert Path(main_job.out) == RESULTS / "training_overhead_main_job"


def test_a_quick_run_writes_its_tables_where_out_says(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # main-job's one thread: not for the other tests
    out = tmp_path / "sub" / "quick"
    argv = ["--quick", "--shape", "main-job", "--variants", "standard,block", "--modes", "train", "--out", str(out)]
    assert bench.main(argv) == 0
    r = json.loads(out.with_suffix(".json").read_text())
    assert (r["config"]["batch"], r["config"]["seq"], r["config"]["d_model"]) == (2, 32, 64)
    assert set(r["timing"]["eager/train"]) == {"standard", "block"}
    assert "| eager/train | block |" in out.with_suffix(".md").read_text()


class FakeWorker:
    """A version's worker process, answering at once (the coordinator's bookkeeping only)."""

    def __init__(self, src, argv):
        self.header = {"config": ModelConfig.preset("bench-cpu").to_dict(), "variants": ["standard", "block"]}

    def ask(self, cmd, **_):
        return {"setup": {"ok": True}, "step": {"seconds": 1.0}, "memory": {"bytes": 100}}[cmd]

    def close(self):
        pass


def test_baseline_writes_to_out_as_given(tmp_path, monkeypatch, capsys):
    """The committed ``training_overhead_recompute_phase1.md`` names
    ``--baseline 4ff07f4 ... --out benchmarks/results/training_overhead_recompute_phase1``."""
    monkeypatch.setattr(bench, "Worker", FakeWorker)
    monkeypatch.setattr(bench, "baseline_source", lambda spec, tmp: tmp)
    out = tmp_path / "recompute"
    assert bench.main(["--baseline", "abc", "--modes", "train", "--backends", "eager", "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recompute.json", "recompute.md"]
    assert "| eager/train | block | 1.0000 | 1.0000 | 1.0000 |" in out.with_suffix(".md").read_text()
    default = bench.parse_args(["--baseline", "abc", "--shape", "main-job"]).out
    assert Path(default) == RESULTS / "training_overhead_main_job_versus_baseline"  # the committed name
    quick = Path(bench.parse_args(["--baseline", "abc", "--quick"]).out)
    assert quick == RESULTS / "training_overhead_versus_baseline_quick"  # git-ignored, as every *_quick.*


@pytest.mark.parametrize("argv, named", [
    (["--variants", "standard,bogus"], "argument --variants: unknown 'bogus'; allowed"),
    (["--backends", "eagre"], "argument --backends: unknown 'eagre'"),
    (["--modes", ""], "argument --modes: unknown empty list"),
    (["--batch", "0"], "argument --batch: must be an integer >= 1, got '0'"),
    (["--out", "{file}/x"], "argument --out: {file} is a file, not a directory"),
    (["--out", "{dir}"], "argument --out: {dir}.json is a directory"),
])
def test_bad_arguments_are_one_line_errors_naming_them(argv, named, tmp_path, capsys):
    (tmp_path / "f").write_text("")
    (tmp_path / "d.json").mkdir()
    fill = dict(file=tmp_path / "f", dir=tmp_path / "d")
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args([a.format(**fill) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and err.startswith("bench_training_overhead.py: error: ")
    assert named.format(**fill) in err


def test_an_unknown_baseline_revision_says_so(tmp_path):
    with pytest.raises(SystemExit, match="--baseline 'no-such-rev' is neither a directory holding an attnres"):
        bench.baseline_source("no-such-rev", tmp_path)


def test_the_documented_baseline_revision_starts_its_worker(tmp_path):
    """``--baseline ad2ee06`` (docs/training-overhead.md's command) stopped with 'benchmark
    worker exited with 1': the worker runs this script against the baseline's package, and the
    script imported ``attnres.output_paths``, which that revision (and 331a2fd) predates."""
    try:
        src = bench.baseline_source("ad2ee06", tmp_path)
    except SystemExit:
        pytest.skip("revision ad2ee06 is not in this clone's history (a shallow clone)")
    worker = bench.Worker(src, bench.worker_argv(bench.parse_args(["--quick", "--variants", "standard"])))
    try:
        assert worker.header["variants"] == ["standard"]
    finally:
        worker.close()


def test_the_recorded_command_runs_from_the_repository_root(monkeypatch):
    """Results record ``python benchmarks/<script> ...`` even when the script was started from
    ``benchmarks/`` (``inference.md`` said ``python bench_inference.py``)."""
    monkeypatch.chdir(RESULTS.parent)
    monkeypatch.setattr(sys, "argv", ["bench_inference.py", "--quick"])
    assert bench.run_header()["command"].split()[1:] == ["benchmarks/bench_inference.py", "--quick"]
    monkeypatch.setattr(sys, "argv", ["/elsewhere/x.py"])  # a script outside the repository: as given
    assert bench.run_header()["command"].split()[1:] == ["/elsewhere/x.py"]
