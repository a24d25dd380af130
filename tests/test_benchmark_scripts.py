"""Every benchmark script answers ``--help`` with its usage and does nothing else:
``bench_seq_prefill.py --help`` ran the whole benchmark and overwrote its committed results."""

from __future__ import annotations

import contextlib
import io
import os
import re
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


def run_in_this_process(script: Path) -> None:
    """``script`` run as ``__main__`` in this process (``runpy``), what it changed in the
    environment undone after: triton_aot_report.py and triton_other_cards.py pop
    ``TRITON_INTERPRET`` as they are imported (to compile for real), which left the test
    worker's Triton without its interpreter switch - the worker's first interpreted launch
    after it that imported Triton's gluon failed its assertion (CI on 2026-12-06: the 9
    interpreted tests of test_kernels.py and test_triton_interpreter.py that ran there)."""
    saved = dict(os.environ)
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        if dict(os.environ) != saved:
            os.environ.clear()
            os.environ.update(saved)


@pytest.mark.parametrize("script", ["triton_aot_report.py", "triton_other_cards.py"])
def test_a_script_run_in_this_process_leaves_the_environment_as_it_was(script, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), "--help"])
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    before = dict(os.environ)
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit):
        run_in_this_process(BENCHMARKS / script)
    assert dict(os.environ) == before


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_the_usage_and_writes_nothing(script, monkeypatch):
    if script.name in NEEDS_TRANSFORMERS:
        pytest.importorskip("transformers")
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their siblings
    before = snapshot(BENCHMARKS / "results")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        run_in_this_process(script)
    assert exit_.value.code == 0 and out.getvalue().startswith("usage: "), out.getvalue()[:500]
    assert snapshot(BENCHMARKS / "results") == before


#: The benchmarks whose results are committed under benchmarks/results/ (``--out`` defaults there).
RESULT_WRITERS = sorted(p for p in BENCHMARKS.glob("bench_*.py") if "results" in p.read_text())


def test_the_shared_writer_says_the_paths_it_wrote_last(tmp_path, monkeypatch, capsys):
    """A benchmark replaced its committed results (benchmarks/results/X.json, .md, .png) without
    saying where it wrote: the run's last line now names each file."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_training_overhead import write_results

    out = tmp_path / "memory_scaling"
    write_results(out, {"rows": [1]}, lambda r: f"# rows {r['rows']}", lambda r, path: path.write_bytes(b"png"))
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["# rows [1]", f"wrote {out}.json, {out}.md, {out}.png"]
    assert (out.with_suffix(".md").read_text(), out.with_suffix(".png").read_bytes()) == ("# rows [1]", b"png")


@pytest.mark.parametrize("failing", [".json", ".md", ".png"])
def test_the_shared_writer_stopped_mid_write_keeps_the_committed_file(tmp_path, monkeypatch, failing):
    """A run stopped while writing its results (Ctrl-C, a full disk) left the committed
    benchmarks/results/X.json / .md / .png cut short: each is now written beside its place and
    renamed over it, so the file being written keeps its old content and no temporary file stays."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_training_overhead import write_results

    out = tmp_path / "memory_scaling"
    old = {suffix: f"old {suffix}, the committed result" for suffix in (".json", ".md", ".png")}
    for suffix, text in old.items():
        out.with_suffix(suffix).write_text(text)
    write_text = Path.write_text

    def half_then_interrupted(path, data, *args, **kwargs):
        if not path.name.endswith(failing):
            return write_text(path, data, *args, **kwargs)
        write_text(path, data[: len(data) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", half_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_results(out, {"rows": list(range(50))}, lambda r: f"# rows {r['rows']}",
                      lambda r, path: path.write_text("png " * 100))
    assert out.with_suffix(failing).read_text() == old[failing]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"memory_scaling{suffix}" for suffix in (".json", ".md", ".png")]


@pytest.mark.parametrize("script", RESULT_WRITERS, ids=lambda p: p.name)
def test_each_benchmark_writes_its_results_through_the_shared_writer(script):
    """Each one writes its .json / .md through ``write_results`` (which prints the paths), none
    on its own (bench_memory_scaling.py and bench_serving.py did, and said nothing)."""
    text = script.read_text()
    assert "write_results(" in text
    assert not re.search(r"""with_suffix\("\.(json|md)"\)\.write_text|\{stem\}\.(json|md)""", text)


#: The committed experiments whose results.json the study scripts' writers are given below.
RESULTS = BENCHMARKS.parent / "results"


def _bf16_stream_loss(out: Path, monkeypatch) -> None:
    import bf16_stream_loss as study

    monkeypatch.setattr(study, "train", lambda *args: 4.0)  # (the runs, not what this checks)
    monkeypatch.setattr(study, "curve", lambda run_dir: [(1, 4.5), (2, 4.0)])
    monkeypatch.setattr(sys, "argv", ["bf16_stream_loss.py", "--out", str(out.parent / "runs"), "--results", str(out),
                                      "--models", "block", "--seeds", "0", "1", "--settings", "bf16 stream"])
    study.main()


def _upcycle_moe(out: Path, monkeypatch) -> None:
    import json

    import upcycle_moe as bench

    results = json.loads((RESULTS / "upcycle-moe" / "results.json").read_text())
    monkeypatch.setattr(bench, "run_all", lambda args, work, out: {**results, "configs": {"model": "config"}})
    monkeypatch.setattr(bench.torch, "set_num_threads", lambda n: None)  # (this process's, not the script's)
    bench.main(["--out", str(out), "--work", str(out.parent / "work")])


def _upcycle_moe_report(out: Path, monkeypatch) -> None:
    import json

    from upcycle_moe_report import write_report

    write_report(out, json.loads((RESULTS / "upcycle-moe" / "results.json").read_text()))


def _upcycle_smollm2(out: Path, monkeypatch) -> None:
    import json

    pytest.importorskip("transformers")
    from upcycle_smollm2 import save

    save(out, json.loads((RESULTS / "upcycle-smollm2" / "results.json").read_text()), None)


#: The study scripts that write their results themselves, not through ``write_results``, each
#: run on its committed results (or stand-ins), and the files each writes.
STUDY_WRITERS = {"bf16_stream_loss.py": (_bf16_stream_loss, ("bf16_stream_loss.md", "bf16_stream_loss.json",
                                                             "bf16_stream_loss.png")),
                 "upcycle_moe.py": (_upcycle_moe, ("config.json", "results.json")),
                 "upcycle_moe_report.py": (_upcycle_moe_report, ("loss.png", "experts.png", "report.md")),
                 "upcycle_smollm2.py": (_upcycle_smollm2, ("results.json", "loss.png", "report.md"))}


@pytest.mark.parametrize(("script", "failing"), [(script, name) for script, (_, names) in STUDY_WRITERS.items()
                                                 for name in names])
def test_a_study_stopped_mid_write_keeps_its_committed_file(script, failing, tmp_path, monkeypatch, capsys):
    """bf16_stream_loss.py, upcycle_moe.py (and its report) and upcycle_smollm2.py saved their
    plots (``fig.savefig``) and wrote their .json / .md in place, into the committed results: a
    run stopped while writing left the file cut short. Each now goes through output_paths'
    helpers: written beside its place and renamed over it, the old file kept, no temporary one."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    run, names = STUDY_WRITERS[script]
    out = tmp_path / "results"
    out.mkdir()
    for name in names:
        (out / name).write_text(f"old {name}, the committed result")
    write_text = Path.write_text

    def text_cut_short(path, data, *args, **kwargs):
        if failing not in path.name:
            return write_text(path, data, *args, **kwargs)
        write_text(path, data[: len(data) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    def figure_cut_short(fig, path, *args, **kwargs):
        if failing not in Path(path).name:
            return Path(path).write_bytes(b"new png")  # (rendering is not what this checks)
        Path(path).write_bytes(b"\x89PNG\r\n half a plot")
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", text_cut_short)
    monkeypatch.setattr(Figure, "savefig", figure_cut_short)
    with pytest.raises(KeyboardInterrupt):
        run(out, monkeypatch)
    assert (out / failing).read_text() == f"old {failing}, the committed result"
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
