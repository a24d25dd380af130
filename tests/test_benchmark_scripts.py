"""Every benchmark script answers ``--help`` with its usage and does nothing else:
``bench_seq_prefill.py --help`` ran the whole benchmark and overwrote its committed results."""

from __future__ import annotations

import ast
import contextlib
import io
import json
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


@contextlib.contextmanager
def environment_kept():
    """What the block changes in the environment undone after: triton_aot_report.py and
    triton_other_cards.py pop ``TRITON_INTERPRET`` as they are imported (to compile for real),
    profile_serving.py sets vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING``. Without it the test
    worker's Triton was left without its interpreter switch - the worker's first interpreted
    launch after it that imported Triton's gluon failed its assertion (CI on 2026-12-06: the 9
    interpreted tests of test_kernels.py and test_triton_interpreter.py that ran there)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        if dict(os.environ) != saved:
            os.environ.clear()
            os.environ.update(saved)


def run_in_this_process(script: Path) -> None:
    """``script`` run as ``__main__`` in this process (``runpy``), the environment kept."""
    with environment_kept():
        runpy.run_path(str(script), run_name="__main__")


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


def _bf16_stream_loss(out: Path, monkeypatch, loss=lambda out, model, setting, seed, steps: 4.0) -> None:
    """The study run on stand-in losses (``loss``: each run's last loss; the runs, not what this checks)."""
    import bf16_stream_loss as study

    monkeypatch.setattr(study, "train", loss)
    monkeypatch.setattr(study, "curve", lambda run_dir: [(1, 4.5), (2, 4.0)])
    monkeypatch.setattr(sys, "argv", ["bf16_stream_loss.py", "--out", str(out.parent / "runs"), "--results", str(out),
                                      "--models", "block", "--seeds", "0", "1", "--settings", "bf16 stream"])
    study.main()


def test_bf16_stream_loss_reports_a_diverged_run(tmp_path, monkeypatch):
    """A diverged run's NaN loss stopped bf16_stream_loss.py after the whole grid, before it
    wrote anything (``statistics.stdev`` raises an AttributeError on NaN), and its .json would
    have held ``NaN``, which JSON does not have (``jq`` and JavaScript refuse the file): the
    table now shows nan and the .json ``null``."""
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(BENCHMARKS))

    def diverged(out, model, setting, seed, steps):
        return float("nan") if (setting, seed) == ("bf16 stream", 1) else 4.0

    _bf16_stream_loss(tmp_path / "results", monkeypatch, diverged)

    def refused(constant):
        raise ValueError(f"{constant} is not JSON")

    written = json.loads((tmp_path / "results" / "bf16_stream_loss.json").read_text(), parse_constant=refused)
    assert written["block"]["bf16 stream"] == {"0": 4.0, "1": None}
    table = (tmp_path / "results" / "bf16_stream_loss.md").read_text()
    assert "| block | bf16 stream (FSDP2, 2 ranks) | 4.0000 | nan | nan | +nan ± nan |" in table


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


def _merge_backward_from_output(out: Path, monkeypatch) -> None:
    import merge_backward_from_output as study

    errors = {name: dict.fromkeys(study.COLUMNS, 1e-3) for name in study.NAMES}
    monkeypatch.setattr(study, "measure", lambda *args: {"mean largest weight": 0.8, "errors": errors})
    study.main(["--out", str(out)])


def _memory_forecast(out: Path, monkeypatch) -> None:
    import memory_forecast as study

    monkeypatch.setattr(study, "measure", lambda sizes: {"kept": {"standard": 2**20, "block": 2**21},
                                                         "peak": {"standard": 2**22, "block": 2**23}})
    monkeypatch.setattr(study.torch, "set_num_threads", lambda n: None)  # (this process's, not the script's)
    study.main(["--out", str(out / "memory_forecast")])


def _upcycle_exactness(out: Path, monkeypatch) -> None:
    pytest.importorskip("transformers")
    import upcycle_exactness as study

    rows = {"Full | float32 | small h": {"logits": 1e-7, "logits_without_eps_adjustment": 1e-3},
            "Full | float64 | as built": {"logits": 1e-12}}
    monkeypatch.setattr(study, "run", lambda: {"transformers": "4", "checked_with": "4", "torch": "2",
                                               "families": {"llama": rows}})
    monkeypatch.setattr(study.torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(sys, "argv", ["upcycle_exactness.py", "--out", str(out)])
    study.main()


def _demo_under_load(out: Path, monkeypatch) -> None:
    """(``out`` is the grid's under-load/: the script writes there, beside the grid's report.)"""
    import demo_under_load as study

    def compare(preset, grid, repeats, overrides, busy):
        measured = {"baseline": "standard", "twin": {"step_ratio": 1.0},
                    "variants": {"standard": {"step_ratio": 1.0, "step_ratio_noise": 0.01},
                                 "block": {"step_ratio": 1.1 + busy / 1000, "step_ratio_noise": 0.01}}}
        (grid / "overhead.json").write_text(json.dumps(measured))
        (grid / "report.md").write_text(f"# the grid's report, {busy} busy loops")
        return measured, (grid / "report.md").read_text()

    monkeypatch.setattr(study, "run_compare", compare)
    study.main(["--preset", "tiny", "--out", str(out.parent), "--loaded-runs", "1", "--busy", "2"])


def _profile_serving(out: Path, monkeypatch) -> None:
    from types import SimpleNamespace

    with environment_kept():
        import profile_serving as study
    served = SimpleNamespace(config=SimpleNamespace(vocab_size=16))
    monkeypatch.setattr(study.bench_serving, "import_vllm", lambda: None)  # (vLLM's runs, not what this checks)
    monkeypatch.setattr(study.bench_serving, "write_models", lambda args, root: {"standard": ("model", served)})
    monkeypatch.setattr(study.bench_serving, "workload", lambda args, vocab: ["prompt"])
    monkeypatch.setattr(study.bench_serving, "engine", lambda args, model: None)
    monkeypatch.setattr(study.bench_serving, "RESULTS", out)
    monkeypatch.setattr(study, "profile", lambda args, llm, prompts, max_tokens: {"aten::mm": (1.5, 2.0)})
    study.main(["--quick", "--variants", "standard"])


def _triton_aot_report(out: Path, monkeypatch) -> None:
    pytest.importorskip("triton")
    with environment_kept():  # (it pops TRITON_INTERPRET as it is imported)
        import triton_aot_report as study
    monkeypatch.setattr(study, "compile_all", lambda *args, **kwargs: [])  # (the compiles, not what this checks)
    # the doc whose table --write-docs replaces: the stand-in committed one, its section
    # between two of its words
    monkeypatch.setattr(study, "REPO", out.parent)
    monkeypatch.setattr(study, "DOCS", out / "kernels.md")
    monkeypatch.setattr(study, "BEGIN", "old")
    monkeypatch.setattr(study, "END", "committed")
    study.main(["--write-docs", "--json", str(out / "variants.json")])


def _triton_other_cards(out: Path, monkeypatch) -> None:
    pytest.importorskip("triton")
    with environment_kept():
        import triton_other_cards as study
    monkeypatch.setattr(study, "compile_all", lambda cards, workers: [])
    study.main(["--cards", "sm_75", "--json", str(out / "other_cards.json")])


#: The study scripts that write their results themselves, not through ``write_results``, each
#: run on its committed results (or stand-ins), and the files each writes.
STUDY_WRITERS = {"bf16_stream_loss.py": (_bf16_stream_loss, ("bf16_stream_loss.md", "bf16_stream_loss.json",
                                                             "bf16_stream_loss.png")),
                 "upcycle_moe.py": (_upcycle_moe, ("config.json", "results.json")),
                 "upcycle_moe_report.py": (_upcycle_moe_report, ("loss.png", "experts.png", "report.md")),
                 "upcycle_smollm2.py": (_upcycle_smollm2, ("results.json", "loss.png", "report.md")),
                 "merge_backward_from_output.py": (_merge_backward_from_output, ("merge_backward_from_output.md",
                                                                                 "merge_backward_from_output.json")),
                 "memory_forecast.py": (_memory_forecast, ("memory_forecast.json", "memory_forecast.md")),
                 "upcycle_exactness.py": (_upcycle_exactness, ("exactness.json", "exactness.md")),
                 "demo_under_load.py": (_demo_under_load, ("quiet-overhead.json", "quiet-report.md",
                                                           "loaded1-overhead.json", "loaded1-report.md", "summary.md")),
                 "profile_serving.py": (_profile_serving, ("serving_profile_quick.md",)),
                 "triton_aot_report.py": (_triton_aot_report, ("variants.json", "kernels.md")),
                 "triton_other_cards.py": (_triton_other_cards, ("other_cards.json",))}


@pytest.mark.parametrize(("script", "failing"), [(script, name) for script, (_, names) in STUDY_WRITERS.items()
                                                 for name in names])
def test_a_study_stopped_mid_write_keeps_its_committed_file(script, failing, tmp_path, monkeypatch, capsys):
    """The study scripts (bf16_stream_loss.py, upcycle_moe.py and its report, upcycle_smollm2.py,
    merge_backward_from_output.py, memory_forecast.py, upcycle_exactness.py, demo_under_load.py's
    summary.md and its copies of each run's report, profile_serving.py, triton_aot_report.py's
    docs/kernels.md and --json, triton_other_cards.py's --json) saved their plots
    (``fig.savefig``) and wrote their .json / .md in place, into the committed results: a run
    stopped while writing left the file cut short. Each now goes through output_paths'
    helpers: written beside its place and renamed over it, the old file kept, no temporary one."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    run, names = STUDY_WRITERS[script]
    out = tmp_path / "under-load"  # (demo_under_load.py writes into its --out's under-load/)
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


#: What writes a file in place: ``Path.write_text`` / ``write_bytes``, matplotlib's ``savefig``,
#: ``json.dump``, ``torch.save``, safetensors' ``save_file``, ``shutil``'s copies; ``open`` for
#: writing is told by its mode.
_WRITES = {"write_text", "write_bytes", "savefig", "save_file"}
_MODULE_WRITES = {("json", "dump"), ("torch", "save"), ("shutil", "copy"), ("shutil", "copy2"), ("shutil", "copyfile")}


def _opens_for_writing(call: ast.Call) -> bool:
    builtin = isinstance(call.func, ast.Name)  # open(path, mode), else path.open(mode)
    mode = next((k.value for k in call.keywords if k.arg == "mode"), None)
    if mode is None and len(call.args) > int(builtin):
        mode = call.args[int(builtin)]
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and bool(set(mode.value) & set("wax+"))


def direct_writes(script: Path) -> set[tuple[str, str]]:
    """(the function, the call) of each write in place in ``script``, its lines apart."""
    found = set()

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            owner = getattr(func.value, "id", None) if isinstance(func, ast.Attribute) else None
            if name in _WRITES or (owner, name) in _MODULE_WRITES or (name == "open" and _opens_for_writing(node)):
                found.add((function, f"{owner}.{name}" if owner else name))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(script.read_text()), "<module>")
    return found


def assert_only_listed_writes(root: Path, files: list[Path], listed: dict[tuple[str, str, str], str]) -> None:
    """Every write in place of ``files`` is one of ``listed`` (the file, by its path under
    ``root``, the function and the call), and each of ``listed`` is still written there."""
    found = {(str(file.relative_to(root)), *write) for file in files for write in direct_writes(file)}
    in_place = sorted(found - set(listed))
    assert not in_place, f"write these (file, function, call) through attnres.output_paths' helpers: {in_place}"
    assert set(listed) <= found, f"no longer written there: {set(listed) - found}"


#: The writes in place that write no result, by script, function and call, and why.
SCRATCH_WRITES = {
    ("bench_memory_scaling.py", "plot", "fig.savefig"): "draws into the temporary file write_results gives it",
    ("bench_parallel_memory.py", "worker", "write_text"): "a worker's rows, into its parent's temporary directory",
    ("bench_parallel_memory.py", "main", "write_text"): "a worker's spec, into a temporary directory",
    ("bench_pipeline.py", "worker", "write_text"): "a worker's result, into its parent's temporary directory",
    ("bench_pipeline.py", "main", "write_text"): "a worker's spec, into a temporary directory",
    ("bench_seq_prefill.py", "worker", "out.write_text"): "a worker's rows, into its parent's temporary directory",
    ("bit_identity.py", "dump", "data.write_text"): "the training text of one side, into compare's temporary directory",
    ("bit_identity.py", "dump", "save_file"): "the tensors of one side, into compare's temporary directory",
    ("triton_aot_report.py", "ptxas_usage", "src.write_text"): "the PTX ptxas reads, into a temporary directory",
    ("upcycle_moe.py", "write_models", "write_text"): "the tokenizer of the models it trains, in the --work directory",
}


def test_no_benchmark_writes_its_results_in_place():
    """A benchmark that wrote its results with ``write_text`` / ``savefig`` / ``json.dump`` left
    the committed file cut short when stopped while writing (merge_backward_from_output.py,
    memory_forecast.py, ... gpu_check.py's own rename left its temporary file): each writes
    through output_paths' write_text_atomically / save_figure_atomically (or write_results), so
    a new script that writes in place fails here. Writes of scratch files are listed above."""
    assert_only_listed_writes(BENCHMARKS, sorted(BENCHMARKS.glob("*.py")), SCRATCH_WRITES)


def test_the_write_finder_tells_writes_from_reads(tmp_path):
    script = tmp_path / "study.py"
    script.write_text("import json, shutil\n"
                      "def main(out, fig):\n"
                      "    out.write_text('x'); fig.savefig(out); json.dump({}, open(out, 'w'))\n"
                      "    shutil.copy(out, out); out.open(mode='a')\n"
                      "    open(out).read(); out.open(); json.dumps({}); out.read_text()\n"
                      "write_text_atomically(out, 'x')\n")
    assert direct_writes(script) == {("main", "out.write_text"), ("main", "fig.savefig"), ("main", "json.dump"),
                                     ("main", "open"), ("main", "shutil.copy"), ("main", "out.open")}
