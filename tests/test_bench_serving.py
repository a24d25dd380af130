"""The vLLM serving benchmark's bookkeeping (no vLLM needed): paired ratios per round, their
quartiles, and the verdict on the paired ratio."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_serving as bench


def rounds_with_drift() -> dict[str, list[dict]]:
    """Three rounds; the machine runs 2x slower in the last one. Block is 1.04x the standard
    model in every round, Full 1.20x."""
    speed = [1.0, 1.0, 2.0]
    run = lambda t, s: {"wall_s": t * s, "tokens": 100, "itl_s": 0.01 * t * s, "prefill_s": 0.5 * t * s}  # noqa: E731
    return {name: [run(t, s) for s in speed] for name, t in (("standard", 1.0), ("block", 1.04), ("full", 1.2))}


def test_paired_ratios_cancel_the_machines_drift():
    out = bench.summarize(rounds_with_drift())
    assert out["block"]["paired_ratio"] == pytest.approx(1.04)
    assert out["block"]["paired_ratio_quartiles"] == pytest.approx([1.04, 1.04])
    assert out["full"]["paired_prefill_ratio"] == pytest.approx(1.2)
    assert out["standard"]["paired_ratio"] == 1.0


def test_paired_ratio_quartiles_show_the_spread():
    rounds = rounds_with_drift()
    for r, factor in zip(rounds["block"], (1.0, 1.1, 1.2)):
        r["wall_s"] *= factor
    q1, q3 = bench.summarize(rounds)["block"]["paired_ratio_quartiles"]
    assert q1 == pytest.approx(1.04 * 1.05) and q3 == pytest.approx(1.04 * 1.15)


def test_markdown_judges_the_target_on_the_paired_ratio():
    args = bench.parse_args(["--quick"])
    results = {"vllm": "0.0", "machine": "x86_64, 2 cores", "vllm_runs": bench.summarize(rounds_with_drift())}
    md = bench.markdown(args, results, {"standard": 1.0, "block": 1.0, "full": 1.0}, bench.model_config(args, {"kind": "standard"}))
    block = next(line for line in md.splitlines() if line.startswith("| block |"))
    full = next(line for line in md.splitlines() if line.startswith("| full |"))
    assert "1.040 [1.040, 1.040]" in block and block.endswith("<= 1.05: met |")
    assert full.endswith("<= 1.10: missed by 0.100 |")


def test_profile_table_lists_the_top_operators_of_any_model_side_by_side(capsys):
    import profile_serving as prof

    args = prof.parse_args(["--variants", "standard,block", "--top", "2"])
    tables = {("standard", part): {"mm": (100.0, 66), "graph": (10.0, 2)} for part in prof.PARTS}
    tables.update({("block", part): {"mm": (101.0, 66), "graph": (12.0, 2), "aten::mm": (15.0, 25)}
                   for part in prof.PARTS})
    text = prof.markdown(args, tables)
    assert "| `mm` | 100.0 | 66 | 101.0 | 66 |" in text
    assert "| `aten::mm` | 0.0 | 0 | 15.0 | 25 |" in text  # block's own operator, absent in standard
    assert "`graph`" not in text  # the third largest, beyond --top 2
    assert "| total self CPU | 110.0 |  | 128.0 |  |" in text
    with pytest.raises(SystemExit):
        prof.parse_args(["--variants", "standard,hyper"])
    assert "error: --variants: unknown ['hyper']; choose from ['block', 'full', 'standard']" in capsys.readouterr().err


def test_moe_models_are_judged_against_their_own_standard_model(capsys):
    """The upcycled mixture of experts' ratios are against the mixture of experts, not the
    native standard model; --models takes a subset and adds each model's baseline."""
    rounds = rounds_with_drift()
    rounds["moe-standard"] = [dict(r, wall_s=2 * r["wall_s"], prefill_s=2 * r["prefill_s"]) for r in rounds["standard"]]
    rounds["moe-block"] = [dict(r, wall_s=1.03 * r["wall_s"], prefill_s=1.03 * r["prefill_s"])
                           for r in rounds["moe-standard"]]
    out = bench.summarize(rounds)
    assert out["moe-block"]["paired_ratio"] == pytest.approx(1.03)
    assert out["moe-standard"]["paired_ratio"] == pytest.approx(1.0)
    args = bench.parse_args(["--quick", "--models", "moe-block"])
    assert args.models == ["moe-standard", "moe-block"]
    md = bench.markdown(args, {"vllm": "0.0", "machine": "x86_64, 2 cores", "vllm_runs": out}, {},
                        bench.model_config(args, {"kind": "standard"}))
    assert "| moe-block |" in md and "1.030 [1.030, 1.030]" in md
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "moe-full"])
    assert ("error: --models: unknown ['moe-full']; choose from standard, block, full, moe-standard, moe-block"
            in capsys.readouterr().err)


@pytest.mark.parametrize("argv, named", [
    (["--preset", "bench-cpux"], "argument --preset: unknown preset 'bench-cpux'"),
    (["--out", "{file}/serving"], "argument --out: {file} is a file, not a directory"),
])
def test_bad_preset_or_out_is_a_usage_error_before_vllm_starts(argv, named, tmp_path, capsys):
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args([a.format(file=tmp_path / "f") for a in argv])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and err.startswith("bench_serving.py: error: ")
    assert named.format(file=tmp_path / "f") in err


def test_without_vllm_it_says_how_to_get_it(monkeypatch):
    """In the default .venv (no vLLM) both scripts were a ModuleNotFoundError traceback."""
    import profile_serving as prof

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError, installed or not
    for script, main in (("bench_serving.py", bench.main), ("profile_serving.py", prof.main)):
        monkeypatch.setattr(sys, "argv", [script])
        with pytest.raises(SystemExit, match=rf"{script} needs vLLM .*make serve-env"):
            main(["--quick"])


def test_the_recorded_command_reproduces_the_run():
    """Every option away from its default is in the report's command, ``--out`` too."""
    assert bench.command_line(bench.parse_args([])) == "python benchmarks/bench_serving.py"
    args = bench.parse_args(["--models", "moe-block", "--rounds", "9", "--out", "benchmarks/results/serving_moe"])
    assert bench.command_line(args) == ("python benchmarks/bench_serving.py --models moe-standard,moe-block "
                                       "--rounds 9 --out benchmarks/results/serving_moe")


def _served_models_kept(monkeypatch, tmp_path, module) -> list[Path]:
    """``module.write_models`` (bench_serving's, which profile_serving calls) stood in for by
    one that writes a served model's file into the folder it is given, kept in the list
    returned; temporary folders made under ``tmp_path`` (a test without the fix leaves none in
    /tmp)."""
    import tempfile
    from types import SimpleNamespace

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    roots: list[Path] = []

    def write_models(args, root):
        roots.append(root)
        (root / "standard").mkdir()
        (root / "standard" / "model.safetensors").write_bytes(b"weights")
        return {"standard": (root / "standard", SimpleNamespace(config=SimpleNamespace(vocab_size=16)))}

    monkeypatch.setattr(module, "write_models", write_models)
    return roots


@pytest.mark.parametrize("fails", [False, True])
def test_bench_serving_removes_the_served_models_folder(fails, tmp_path, monkeypatch):
    """bench_serving.py wrote its served models (Hugging Face directories) into
    tempfile.mkdtemp(prefix="bench-serving-") and left them under /tmp after every run. The
    folder is removed when the run ends, also when it fails (vLLM stood in for)."""
    from types import ModuleType

    roots = _served_models_kept(monkeypatch, tmp_path, bench)
    vllm = ModuleType("vllm")
    vllm.__version__, vllm.SamplingParams = "0.0", lambda **kw: kw
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setattr(bench, "import_vllm", lambda: vllm)
    monkeypatch.setattr(bench, "engine", lambda args, directory, **options: directory)
    monkeypatch.setattr(bench, "workload", lambda args, vocab: ["prompt"])
    monkeypatch.setattr(bench, "time_attnres_generate", lambda args, model: 0.001)

    def run_once(llm, prompts, params):
        assert (llm / "model.safetensors").is_file()  # (served while the run lasts)
        if fails:
            raise RuntimeError("the engine failed")
        return {"wall_s": 1.0, "tokens": 10, "itl_s": 0.1}

    monkeypatch.setattr(bench, "run_once", run_once)
    argv = ["--quick", "--models", "standard", "--rounds", "1", "--out", str(tmp_path / "results" / "serving")]
    if fails:
        with pytest.raises(RuntimeError, match="the engine failed"):
            bench.main(argv)
    else:
        bench.main(argv)
        assert (tmp_path / "results" / "serving.json").is_file()
    (root,) = roots
    assert root.name.startswith("bench-serving-") and not root.exists()


@pytest.mark.parametrize("fails", [False, True])
def test_profile_serving_removes_the_served_models_folder(fails, tmp_path, monkeypatch):
    """profile_serving.py left its served models under /tmp (mkdtemp(prefix="attnres-profile-"))
    after every run: removed when the run ends, also when it fails (vLLM stood in for)."""
    import profile_serving as prof

    roots = _served_models_kept(monkeypatch, tmp_path, prof.bench_serving)
    monkeypatch.setattr(prof.bench_serving, "import_vllm", lambda: None)
    monkeypatch.setattr(prof.bench_serving, "workload", lambda args, vocab: ["prompt"])
    monkeypatch.setattr(prof.bench_serving, "engine", lambda args, directory: directory)
    monkeypatch.setattr(prof.bench_serving, "RESULTS", tmp_path / "results")
    (tmp_path / "results").mkdir()

    def profile(args, llm, prompts, max_tokens):
        assert (llm / "model.safetensors").is_file()  # (served while the run lasts)
        if fails:
            raise RuntimeError("the profiler failed")
        return {"aten::mm": (1.5, 2.0)}

    monkeypatch.setattr(prof, "profile", profile)
    if fails:
        with pytest.raises(RuntimeError, match="the profiler failed"):
            prof.main(["--quick", "--variants", "standard"])
    else:
        prof.main(["--quick", "--variants", "standard"])
        assert (tmp_path / "results" / "serving_profile_quick.md").is_file()
    (root,) = roots
    assert root.name.startswith("attnres-profile-") and not root.exists()
