"""``benchmarks/gpu_check.py``: the prepared GPU check runs every part on the CPU at toy sizes
(``--cpu-smoke``: the Triton kernels under the interpreter) and writes its tables and the
summary the GPU targets are judged on; its byte bounds and summary logic."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _all_parts() -> list[str]:
    """The parts of the prepared run (``--parts``' default), in its order."""
    import gpu_check

    return gpu_check.parse_args(["--out", "x"]).parts.split(",")


#: Runs a script (``sys.argv[1]``, its arguments after it) as a machine with only PyTorch,
#: Triton and NumPy installed - the GPU machine of the prepared check - would: every module of
#: an installed distribution outside theirs and their dependencies' (the project's own
#: aside) is absent, as ``None`` in ``sys.modules`` (``import`` raises ModuleNotFoundError,
#: ``importlib.util.find_spec`` finds nothing).
ONLY_TORCH_TRITON_NUMPY = """
import importlib.metadata as md, re, runpy, sys
def name(requirement):
    return re.split(r"[\\s;<>=!~\\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")
allowed, todo = set(), ["torch", "triton", "numpy"]
while todo:
    dist = todo.pop()
    if dist not in allowed:
        allowed.add(dist)
        try:
            todo += [name(r) for r in md.requires(dist) or () if "extra ==" not in r]
        except md.PackageNotFoundError:
            pass
for module, dists in md.packages_distributions().items():
    if module != "attnres" and module not in sys.modules and not allowed & {d.lower().replace("_", "-") for d in dists}:
        sys.modules[module] = None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def only_torch_triton_numpy(script: Path, *args: str) -> list[str]:
    """The command line that runs ``script`` with ``args`` as :data:`ONLY_TORCH_TRITON_NUMPY`."""
    return [sys.executable, "-c", ONLY_TORCH_TRITON_NUMPY, str(script), *args]


def test_the_check_imports_on_a_machine_with_only_torch_triton_and_numpy(tmp_path):
    """The GPU machine has only PyTorch, Triton and NumPy: until 2026-12-07 the check failed
    there before it measured anything - bench_training_overhead (whose helpers it imports)
    imported attnres.train, and attnres.inference its run loading, both the checkpoints'
    safetensors (the train extra); the warm-up's workers, which import the check, failed so
    too. (The smoke, :func:`test_cpu_smoke_runs_every_part_and_writes_the_summary`, runs every
    part so.)"""
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(only_torch_triton_numpy(ROOT / "benchmarks" / "gpu_check.py", "--source-digest"), cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.stdout.strip()) == 16
    # (the blocking itself: a module of the train extra is absent, torch's own dependencies are not)
    probe = tmp_path / "probe.py"
    probe.write_text("import importlib.util, sympy\nassert importlib.util.find_spec('pytest') is None\n"
                     "try:\n    import pytest\nexcept ModuleNotFoundError:\n    print('absent')\n")
    result = subprocess.run(only_torch_triton_numpy(probe), env=env, capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "absent", result.stderr[-3000:]


def test_the_check_imports_its_own_trees_attnres_without_pythonpath(tmp_path):
    """The GPU session's command may leave out ``PYTHONPATH=src``: the check then failed on the
    GPU machine (no attnres installed) before it measured anything, or imported an installed
    attnres other than the tree whose sources it records (``code.source_digest``). It puts
    its tree's ``src`` first itself."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import runpy, sys; runpy.run_path(sys.argv[1]); import attnres, bench_kernels_gpu; "
            "print(attnres.__file__)")
    result = subprocess.run([sys.executable, "-c", code, str(ROOT / "benchmarks" / "gpu_check.py")], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert Path(result.stdout.strip()) == ROOT / "src" / "attnres" / "__init__.py"


def test_cpu_smoke_runs_every_part_and_writes_the_summary(tmp_path):
    pytest.importorskip("triton")
    import gpu_check
    # (one thread, as the suite's other subprocesses: the toy sizes gain nothing from more, whose waiting
    # threads spun - 33.5 -> 23.2 CPU-s for the smoke, measured back to back)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    # (as on the GPU machine, with only PyTorch, Triton and NumPy: what a part imports as it runs)
    result = subprocess.run(only_torch_triton_numpy(ROOT / "benchmarks" / "gpu_check.py", "--cpu-smoke", "--out",
                                                    str(tmp_path)), cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("train_eager", "train_compiled", "decode_b1", "decode_b8", "decode_eager_b1", "decode_eager_b8",
                "memory"):
        assert isinstance(summary[key], float) and isinstance(summary["full"][key], float), key
    assert set(summary["ops"]) == {"phase1_fwd", "phase1_bwd", "merge_fwd", "merge_bwd", "merge_add_fwd", "merge_add_bwd"}
    assert summary["targets"]["train_eager"] == 1.04 and summary["targets"]["decode_b1"] == 1.02
    assert set(summary["met"]) >= {"train_eager", "train_compiled", "memory", "ops_within_2x_bound", "host"}
    md = (tmp_path / "gpu_check.md").read_text()
    assert set(summary["bf16_stream"]) == {"block", "full", gpu_check.SUMS_KEPT}
    for heading in ("## Parity", "## Ops at", "## The ops at other launch settings", "## train_eager", "## train_compiled", "## train_bf16", "## decode step",
                    "## Where a training step's time goes", "## What a graphed decode step replays"):
        assert heading in md
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["sizes"]["d"] == 16 and result["errors"] == {}
    assert result["command"] == f"PYTHONPATH=src python benchmarks/gpu_check.py --cpu-smoke --out {tmp_path}"
    # (which code and software ran, and nothing left running; the sweep against its own defaults)
    assert result["code"]["source_digest"] and result["torch"] == summary["software"]["torch"] and "running" not in result
    assert {"warm_up_s", "ms", "compile_s"} <= set(result["train_compiled"]) and not result["skipped"]
    assert "merge_bwd@default" in result["sweep"]
    # (the sweep, a part of its own: each setting's row beside its default's time)
    assert {key.split("@")[0] for key in result["sweep"]} == set(summary["ops"])
    assert "| merge_bwd@merge_warps=4 |" in md
    # parity: the interpreter's kernels equal the torch backend, and each op float64's
    assert summary["met"]["parity"] and max(summary["parity"]["ops"].values()) < 1e-5
    assert 1e-4 < max(summary["parity"]["ops_bf16"].values()) < gpu_check.OP_PARITY_TOLERANCE_BF16
    # (the training step's layout: its bf16 outputs rounded, the rest as float32)
    autocast = summary["parity"]["ops_autocast"]
    assert set(autocast) == set(gpu_check.AUTOCAST_OPS) == set(summary["ops_autocast"])
    assert 1e-4 < max(autocast.values()) < gpu_check.OP_PARITY_TOLERANCE_AUTOCAST
    assert max(autocast["phase1_fwd"], autocast["phase1_bwd"]) < 1e-5
    assert "| merge_add_bwd (training step's layout) |" in md
    kept = result["train_eager"]["kept_MiB"]
    paired = [name for _, variants in gpu_check.PAIRED.values() for name in variants]
    assert set(kept) == {"standard", "block", "full", gpu_check.SUMS_KEPT, *paired, gpu_check.SUMS_BF16}
    assert kept[gpu_check.SUMS_KEPT] > kept["block"]  # (the recipe measured: the sums not kept)
    assert set(summary["block_sums_kept"]) == {"train_eager", "memory"}
    assert set(summary["block_bf16_sums"]) == {"train_eager", "memory", "block_vs_default"}
    for key in ("bf16_norm_out", "autocast_stream"):  # (the pairs with an option on: Block against the standard)
        assert set(summary[key]) == {"train_eager", "memory", "standard_vs_default", "block_vs_default",
                                     "block_vs_standard_default"}
    assert set(paired) <= set(result["train_eager"]["ms"])
    assert set(summary["block_phase1_one_kernel"]) == {"decode_b1", "decode_b8"}
    assert gpu_check.ONE_KERNEL in result["decode"]["b1"]["graphed"]
    depth_attention = {"_Merge", "_MergeBackward", "_Phase1", "_Phase1Backward"}
    assert {e["op"] for e in result["profile"]["block"]["top"]} & depth_attention
    decode = result["profile_decode"]
    assert set(decode) == {"standard", "block", "full"} and all(v["kernels"] is None for v in decode.values())
    assert all(v["total_ms"] > 0 and v["top"] for v in decode.values())
    assert "decode_kernels" not in summary  # (not counted on the CPU)
    compiled = result["train_compiled"]["profile"]  # (the compiled steps profiled after timing)
    assert set(compiled) == {"standard", "block"} and all(v["total_ms"] > 0 and v["top"] for v in compiled.values())
    assert "Where a compiled step's time goes" in md
    host = result["ops"]["host_us"]  # (on the CPU: the Triton path's host work, its launches stubbed)
    assert host["kernels"] == "stubbed" and host["ours"] > host["ours_forward"] > 0 and "launches stubbed" in md


def test_op_bytes_count_each_input_and_output_once():
    import gpu_check

    z = gpu_check.Sizes(tokens=10, d=4, n=3, S=2)
    row, f32 = 10 * 4 * 2, 10 * 4
    b = gpu_check.op_bytes(z)
    assert b["phase1_fwd"] == 3 * row + 2 * (row + f32)
    assert b["phase1_bwd"] == (3 + 2) * row + 2 * 2 * f32 + 3 * row
    assert b["merge_fwd"] == 3 * row + 6 * f32 and b["merge_bwd"] == 5 * row + 6 * f32
    assert b["merge_add_fwd"] == 5 * row + 6 * f32 and b["merge_add_bwd"] == 6 * row + 6 * f32


def test_the_training_step_layouts_bytes_and_parity_see_each_readers_gradient():
    """The ops in the default training step's layout: float32 sources, bf16 sublayer outputs
    and readers' gradients - their byte bounds count each at its size; their parity against
    float64 passes for a correct implementation (bf16 outputs rounded once) and fails one
    that reads only the first reader's gradient."""
    import gpu_check
    from attnres.ops.depth_attention import torch_impl

    z = gpu_check.Sizes(tokens=10, d=4, n=3, S=2)
    wide, narrow, f32 = 10 * 4 * 4, 10 * 4 * 2, 10 * 4
    b = gpu_check.autocast_op_bytes(z)
    assert b["phase1_fwd"] == gpu_check.op_bytes(z, 4)["phase1_fwd"]
    assert b["merge_add_fwd"] == 3 * wide + 2 * narrow + 6 * f32
    assert b["merge_add_bwd"] == 5 * wide + 4 * narrow + 6 * f32  # (3 readers' gradients and the addend's in bf16)

    z = gpu_check.Sizes(tokens=16, d=24, n=3, S=2)
    reference = gpu_check.autocast_op_calls(z, "cpu", torch_impl, reference=True)
    good = gpu_check.worst_errors(gpu_check.autocast_op_calls(z, "cpu", torch_impl), reference)
    assert set(good) == set(gpu_check.AUTOCAST_OPS)
    assert 1e-4 < good["merge_add_fwd"] and max(good.values()) < gpu_check.OP_PARITY_TOLERANCE_AUTOCAST

    class FirstReaderOnly:
        phase1_forward, phase1_backward = torch_impl.phase1_forward, torch_impl.phase1_backward
        merge_forward = torch_impl.merge_forward

        @staticmethod
        def merge_backward(*args):
            return torch_impl.merge_backward(*args[:-1], ())

    bad = gpu_check.worst_errors(gpu_check.autocast_op_calls(z, "cpu", FirstReaderOnly), reference)
    assert bad["merge_add_bwd"] > 10 * gpu_check.OP_PARITY_TOLERANCE_AUTOCAST


def test_summary_judges_each_target_and_skipped_parts():
    import gpu_check

    result = {"device": "GPU", "train_eager": {"ms": {"standard": 100.0, "block": 103.0, "full": 110.0},
                                               "peak_memory_MiB": {"standard": 10.0, "block": 10.6, "full": 11.0}},
              "decode": {"b1": {"graphed": {"standard": 1.0, "block": 1.01, "full": 1.2}}},
              "skipped": {"train_compiled": "10 s of the 450 s budget left"}}
    s = gpu_check.summarize(result)
    assert s["train_eager"] == pytest.approx(1.03) and s["full"]["train_eager"] == pytest.approx(1.1)
    assert s["met"] == {"train_eager": True, "decode_b1": True, "memory": False}
    assert "train_compiled" not in s and s["skipped"] == result["skipped"]
    assert "device_busy" not in s  # (no profile)


def test_the_compiled_part_drops_full_attnres_before_it_is_skipped():
    """Short of the compiled part's time, the standard model and Block are compiled without
    Full AttnRes (no target), and that is named; shorter still, the part is skipped."""
    import gpu_check

    models = {"standard": 0, "block": 1, "full": 2}
    whole = gpu_check.MIN_SECONDS["train_compiled"]
    assert gpu_check.fitting_models("train_compiled", models, whole) == (models, None)
    fit, note = gpu_check.fitting_models("train_compiled", models, gpu_check.COMPILED_WITHOUT_FULL_S)
    assert fit == {"standard": 0, "block": 1} and "without Full AttnRes" in note
    assert gpu_check.fitting_models("train_compiled", models, gpu_check.COMPILED_WITHOUT_FULL_S - 1) == (models, None)
    assert gpu_check.fitting_models("train_eager", models, 50) == (models, None)
    order = gpu_check.parse_args(["--out", "x"]).parts.split(",")
    assert set(order) == set(gpu_check.MIN_SECONDS)  # (the default runs every part: the targets' first)
    # (the targets' parts first, the bf16 stream - an option the training target may need - before the diagnostics)
    diagnostics = min(order.index(p) for p in ("profile", "profile_decode"))
    assert order.index("train_compiled") < order.index("train_bf16") < diagnostics


def test_the_prepared_run_measures_every_target_part_before_any_diagnostic():
    """The target parts come first in the prepared run (``--parts``' default): a run short of
    its budget skips diagnostics, named in ``skipped``, not a target. The sweep - launch
    settings no default uses - ran before the compiled part: its compiles, where the warm-up
    had not made them, and the fresh process after a fault came out of the compiled part's
    time (on the H200's estimate it started with 160 to 230 s left and dropped Full; less,
    and it is skipped)."""
    import gpu_check

    order = _all_parts()
    assert set(gpu_check.TARGET_PARTS) <= set(order)
    targets_end = max(order.index(p) for p in gpu_check.TARGET_PARTS)
    assert all(order.index(p) > targets_end for p in order if p not in gpu_check.TARGET_PARTS), order
    assert order.index("train_bf16") == targets_end + 1  # (the option the training target may need)


class _VariantLog:
    """Stands in for a Triton kernel: a launch records its variant - the kernel, each argument's
    dtype (a tuple's length and dtypes), how Triton specialises an int (1, a multiple of 16,
    other) and the keyword arguments' values (the constexprs, the launch's warps) - and runs
    nothing."""

    def __init__(self, name: str, variants: set):
        self.name, self.variants = name, variants

    @classmethod
    def key(cls, a):
        if isinstance(a, torch.Tensor):
            return str(a.dtype)
        if isinstance(a, (tuple, list)):
            return tuple(cls.key(x) for x in a)
        if isinstance(a, int) and not isinstance(a, bool):
            return "1" if a == 1 else "16k" if a % 16 == 0 else "int"
        return type(a).__name__ if isinstance(a, float) else repr(a)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.variants.add((self.name, self.key(args), tuple(sorted(kwargs.items()))))
        return launch


def test_the_models_warm_up_compiles_each_variant_the_parts_launch_one_worker_a_stage(monkeypatch):
    """The warm-up compiles each AttnRes model's variants (the standard model runs none of our
    kernels) in one process per stage - the float32-stream step, the bf16 decode, the bf16
    step - with a model of the parts' depth and width but small sublayers: together its stages
    launch exactly the kernel variants that the parts' model launches over the same steps
    (kernels stubbed, at the check's depth of 8 blocks). An unknown stage is refused, naming
    the stages."""
    pytest.importorskip("triton")
    import gpu_check

    from attnres.inference import decode_step, prefill
    from attnres.ops.depth_attention import triton_kernels, triton_launch

    assert gpu_check.WARMED_MODELS == tuple(f"models:{name}:{stage}" for name in ("block", "full")
                                            for stage in ("train", "decode", "bf16"))
    variants: set = set()
    for name in triton_launch.SIGNATURES:  # (every kernel)
        monkeypatch.setattr(triton_kernels, name, _VariantLog(name, variants))
    residual_of = gpu_check.residual_of  # (the Triton kernels on the CPU: stubbed, so any backend's variants)
    monkeypatch.setattr(gpu_check, "residual_of", lambda name, z: {**residual_of(name, z), "backend": "triton"})
    z = gpu_check.Sizes(d=32, layers=8, blocks=4, seq=48, batch=1, vocab=64)
    for name in ("block", "full"):
        variants.clear()
        for stage in gpu_check.WARM_UP_STAGES:
            assert gpu_check.warm_up_worker(f"models:{name}:{stage}", z, "cpu") == 0
        warmed = set(variants)
        variants.clear()  # the parts' model over the same steps
        model = gpu_check.build_models(z, "cpu", names=(name,))[name]
        ids = torch.randint(0, z.vocab, (1, z.seq))
        step = gpu_check.train_steps({name: model}, ids, "cpu")[name]
        step()
        model.to(torch.bfloat16)
        for batch in gpu_check.DECODE_BATCHES:
            _, cache = prefill(model, ids.expand(batch, -1))
            decode_step(model, cache, ids[:, -1].expand(batch))
            with gpu_check.phase1_in_one_kernel():
                decode_step(model, cache, ids[:, -1].expand(batch))
        step()
        assert len(variants) > 20 and warmed == variants, (name, sorted(variants ^ warmed))
    with pytest.raises(ValueError, match="'train', 'decode', 'bf16'"):
        gpu_check.warm_up_worker("models:block:fp8", gpu_check.SMOKE, "cpu")


def test_the_warm_up_compiles_the_full_shapes_variants_on_a_gpu_of_many_multiprocessors(monkeypatch):
    """On a GPU the held merges run as many persistent programs as its multiprocessors keep
    resident (an H200's 132: hundreds), and a program of one row runs them unpipelined
    (``STAGES`` = 1, decoding's variant): the warm-up's training steps and its sweeps run
    enough rows to launch the variants of the parts' full shape (batch 4 x 2048 tokens, the
    ops' 8192 rows) - at the 48 rows it once ran, none of the training step's held merges
    was compiled there. Counted on the CPU with the kernels stubbed and 132 multiprocessors."""
    pytest.importorskip("triton")
    import gpu_check

    from attnres.ops.depth_attention import triton_impl, triton_kernels, triton_launch

    monkeypatch.setattr(triton_impl, "_device_sms", lambda device: 132)
    assert gpu_check.warm_up_rows("cpu", 2048, 8192) == 1856  # (the check's shape on an H200: 264 programs)
    assert gpu_check.warm_up_rows("cpu", 2048, 8192, warps=4) == 1856  # (the sweep's 4 warps: 528)
    monkeypatch.setattr(triton_impl, "_device_sms", lambda device: 24)  # (fewer rows than 8192 at d = 64)
    variants: set = set()
    for name in triton_launch.SIGNATURES:
        monkeypatch.setattr(triton_kernels, name, _VariantLog(name, variants))
    residual_of = gpu_check.residual_of
    monkeypatch.setattr(gpu_check, "residual_of", lambda name, z: {**residual_of(name, z), "backend": "triton"})
    z = gpu_check.Sizes(tokens=8192, d=64, layers=2, blocks=2, seq=2048, batch=4, vocab=64)
    assert gpu_check.warm_up_rows("cpu", z.d, 8192) == 1552  # (64 wide: one warp a program, 16 of them an SM)
    for stage in ("train", "bf16"):
        variants.clear()
        assert gpu_check.warm_up_worker(f"models:block:{stage}", z, "cpu") == 0
        warmed = set(variants)
        variants.clear()
        model = gpu_check.build_models(z, "cpu", names=("block",))["block"]
        if stage == "bf16":
            model.to(torch.bfloat16)
        gpu_check.train_steps({"block": model}, torch.randint(0, z.vocab, (z.batch, z.seq)), "cpu")["block"]()
        held = {v for v in variants if v[0].endswith("_held")}
        assert held and all(dict(v[2])["STAGES"] > 1 for v in held), sorted(held)
        assert warmed == variants, (stage, sorted(variants ^ warmed))
    variants.clear()
    assert gpu_check.warm_up_worker("sweeps", z, "cpu") == 0
    warmed = set(variants)
    variants.clear()
    calls = gpu_check.op_calls(z, "cpu")
    for setting, value, names in gpu_check.sweep_settings("cpu"):  # (as the worker on this device)
        with gpu_check.forced(setting, value):
            for name in names:
                calls[name]()
    for fn in gpu_check.autocast_op_calls(z, "cpu").values():
        fn()
    assert variants <= warmed, sorted(variants - warmed)


def test_device_busy_is_the_profiled_device_time_over_the_step():
    import gpu_check

    result = {"device": "GPU", "command": "gpu_check.py", "torch": "2.11", "triton": "3.6",
              "train_eager": {"ms": {"standard": 100.0, "block": 104.0}, "warm_up_s": 1.0,
                              "peak_memory_MiB": {"standard": 1.0, "block": 1.0}},
              "profile": {"standard": {"total_ms": 97.0, "top": []}, "block": {"total_ms": 78.0, "top": []}}}
    assert gpu_check.device_busy(result) == pytest.approx({"standard": 0.97, "block": 0.75})
    assert "75% of its eager step's 104.0 ms" in gpu_check.render(result)
    result["train_compiled"] = {"ms": {"standard": 80.0, "block": 90.0}, "warm_up_s": 1.0,
                                "profile": {"standard": {"total_ms": 80.0, "top": []}, "block": {"total_ms": 72.0, "top": []}}}
    assert gpu_check.device_busy(result, compiled=True) == pytest.approx({"standard": 1.0, "block": 0.8})
    assert gpu_check.summarize(result)["device_busy_compiled"] == pytest.approx({"standard": 1.0, "block": 0.8})
    assert "80% of its compiled step's 90.0 ms" in gpu_check.render(result)
    assert gpu_check.device_busy({**result, "device": "CPU (smoke)"}) == {}


def test_decode_kernels_are_summarised_and_rendered():
    import gpu_check

    top = [{"op": "attnres::merge", "ms": 0.1, "calls": 17}]
    result = {"device": "GPU", "command": "gpu_check.py", "torch": "2.11", "triton": "3.6",
              "profile_decode": {"standard": {"total_ms": 2.0, "kernels": 600, "top": []},
                                 "block": {"total_ms": 2.05, "kernels": 560, "top": top}}}
    assert gpu_check.summarize(result)["decode_kernels"] == {"standard": 600, "block": 560}
    md = gpu_check.render(result)
    assert "| block | 560 | 2.050 | 1.025 |" in md and "| `attnres::merge` | 0.100 | 17 |" in md


def test_memory_forecast_block_and_full_keep_no_more_than_the_standard_model(tmp_path):
    """``benchmarks/memory_forecast.py`` at a toy shape: what a bf16-autocast forward keeps
    for the backward (the bulk of the GPU check's peak memory), with the norms saving what
    they save on CUDA, is within the 5 % memory target for Block and Full AttnRes; Block
    keeping its Phase-1 sums is not (the H200's 1.12x), so the count sees them; and the
    CUDA-like norm gives the composite's values and gradients."""
    import torch
    import torch.nn.functional as F

    import gpu_check
    import memory_forecast

    z = memory_forecast.FORECAST.__class__(d=128, layers=4, blocks=2, seq=64, batch=2, vocab=256)
    kept = memory_forecast.measure(z)["kept"]
    assert kept["block"] <= 1.05 * kept["standard"] and kept["full"] <= 1.05 * kept["standard"], kept
    assert kept["block (sums kept)"] > 1.05 * kept["standard"], kept
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    expected = F.rms_norm(x, (16,), w, 1e-6)
    with memory_forecast.gpu_like_rms_norm():
        got = F.rms_norm(x, (16,), w, 1e-6)
    assert torch.allclose(got, expected, rtol=1e-12, atol=0)
    g = torch.randn(3, 16, dtype=torch.float64)
    assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(
        torch.autograd.grad(got, (x, w), g), torch.autograd.grad(expected, (x, w), g)))
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    assert gpu_check.kept_bytes(lambda: layer(x).exp().sum(), "cpu") == 4 * 8 * 4 + 4  # exp's output (saved), the loss
    memory_forecast.main(["--d", "64", "--layers", "1", "--blocks", "2", "--seq", "16", "--vocab", "128",
                          "--out", str(tmp_path / "f")])
    assert "| block |" in (tmp_path / "f.md").read_text() and json.loads((tmp_path / "f.json").read_text())["kept"]


@pytest.mark.triton
def test_timed_launches_forward_each_launch_and_time_it():
    """The host-overhead part's split: with the merge's kernels wrapped, a merge (forward and
    backward) gives the same values as without, and each kernel's launches took host time;
    the kernels are restored afterwards."""
    from conftest import triton_device

    import gpu_check
    from attnres.ops.depth_attention import library, triton_kernels

    device = triton_device()
    g = torch.Generator().manual_seed(0)
    x, partial, v = (torch.randn(3, 16, generator=g).to(device).requires_grad_() for _ in range(3))
    z = torch.randn(3, 1, generator=g).to(device).requires_grad_()
    q, w = (torch.randn(16, generator=g).to(device).requires_grad_() for _ in range(2))

    def merge():
        out, _, total = library.merge(z, [x], [partial], q, 1e-6, w, 1e-6, "triton", addend=v)
        return [out, total, *torch.autograd.grad(out.sum() + total.sum(), [z, x, partial, v, q, w])]

    plain = merge()
    before = (triton_kernels.merge_fwd_held, triton_kernels.merge_bwd_held)  # (Block's merges: held)
    with gpu_check.timed_launches(("merge_fwd_held", "merge_bwd_held")) as timed:
        wrapped = merge()
    assert all(t.seconds > 0 for t in timed)
    assert all(torch.equal(a, b) for a, b in zip(plain, wrapped))
    assert (triton_kernels.merge_fwd_held, triton_kernels.merge_bwd_held) == before


def test_the_sweep_times_each_forced_setting_and_restores_the_default(monkeypatch):
    """The ops part's sweep runs each operation it names with the launch setting forced (the
    merges see the warps the sweep asks for) and leaves ``FORCED`` as it found it."""
    pytest.importorskip("triton")
    import gpu_check
    from attnres.ops.depth_attention import triton_impl

    seen = []
    calls = {name: (lambda name=name: seen.append((name, dict(triton_impl.FORCED))))
             for _, names in gpu_check.SWEEPS.values() for name in names}

    class Clock:
        def replayed(self, fn, repeats):
            fn()
            return 1e-6

    bytes_ = dict.fromkeys(calls, 1e5)
    result = gpu_check.sweep(gpu_check.SMOKE, Clock(), "cuda", calls, bytes_, 1e11)
    assert result.pop("errors") == {}
    assert set(result) == {f"{n}@{s}={v}" for s, (values, names) in gpu_check.SWEEPS.items() for v in values
                           for n in names} | {f"{n}@default" for n in calls}
    unforced = dict.fromkeys(triton_impl.FORCED)
    # (each setting against its default timed in the same part, first: not the ops part's, minutes before)
    assert seen[:len(calls)] == [(n, unforced) for n in calls]
    md = gpu_check.render({"device": "GPU", "command": "c", "torch": "t", "triton": "t", "sweep": {
        **result, "merge_fwd@default": {"us": 0.5, "x_bound": 0.5}}})
    assert "| merge_fwd@merge_warps=4 | 1.0 | 1.00 | 2.00 |" in md
    assert ("merge_bwd", {**unforced, "merge_warps": 16}) in seen
    assert ("phase1_fwd", {**unforced, "block_d": 64}) in seen
    assert triton_impl.FORCED == unforced
    assert result["merge_fwd@merge_warps=4"]["x_bound"] == pytest.approx(1.0)


def test_a_sweep_setting_that_fails_is_recorded_and_the_sweep_goes_on(monkeypatch):
    """The sweep launches settings no default uses: one that fails an operation on the GPU
    (Triton's "out of resources" at a forced pipeline depth) is recorded under the part's
    ``errors`` as ``name@setting=value`` and the other rows are timed. A failure that left
    the device unusable ends the sweep with the rows measured (the run then continues in a
    fresh process); on the CPU (the smoke) it fails the part."""
    pytest.importorskip("triton")
    import gpu_check
    from attnres.ops.depth_attention import triton_impl

    failing = ["merge_stages", 2]

    def call():
        if triton_impl.FORCED[failing[0]] == failing[1]:
            raise RuntimeError("triton.runtime.errors.OutOfResources: out of resource: shared memory")

    calls = {name: call for _, names in gpu_check.SWEEPS.values() for name in names}
    bytes_ = dict.fromkeys(calls, 1e5)
    clock = gpu_check.Clock("cuda", strict=False)
    monkeypatch.setattr(clock, "replayed", lambda fn, repeats: (fn(), 1e-6)[1])
    monkeypatch.setattr(gpu_check, "device_usable", lambda device: True)
    result = gpu_check.sweep(gpu_check.SMOKE, clock, "cuda", calls, bytes_, 1e11)
    failed = {f"{name}@merge_stages=2" for name in gpu_check.MERGES}
    assert set(result["errors"]) == failed and "out of resource" in result["errors"]["merge_fwd@merge_stages=2"]
    assert "merge_fwd@merge_stages=1" in result and not failed & set(result)
    assert triton_impl.FORCED == dict.fromkeys(triton_impl.FORCED)
    monkeypatch.setattr(gpu_check, "device_usable", lambda device: False)
    failing[:] = ["merge_warps", 16]
    lost = gpu_check.sweep(gpu_check.SMOKE, clock, "cuda", calls, bytes_, 1e11)
    assert set(lost.pop("errors")) == {"merge_fwd@merge_warps=16"}
    assert "merge_bwd@merge_warps=4" in lost and not {k for k in lost if "merge_held" in k or "merge_stages" in k}
    assert triton_impl.FORCED == dict.fromkeys(triton_impl.FORCED)
    with pytest.raises(RuntimeError, match="shared memory"):
        gpu_check.sweep(gpu_check.SMOKE, gpu_check.Clock("cpu"), "cuda", calls, bytes_, 1e11)


def test_force_sets_a_launch_setting_for_the_run_and_refuses_what_it_cannot_take(monkeypatch, tmp_path):
    """``--force SETTING=VALUE`` sets ``triton_impl.FORCED`` for the whole run (so that the
    next run can time the training step with another default), a sweep inside it restores
    the forced value rather than the default, and a bad setting or value is refused, naming
    it."""
    pytest.importorskip("triton")
    import gpu_check
    from attnres.ops.depth_attention import triton_impl

    monkeypatch.setattr(triton_impl, "FORCED", dict.fromkeys(triton_impl.FORCED))
    assert gpu_check.apply_force(["phase1_rows=false", "phase1_group=8", "block_d=None"]) == {
        "phase1_rows": False, "phase1_group": 8, "block_d": None}
    assert triton_impl.FORCED["phase1_rows"] is False and triton_impl.FORCED["phase1_group"] == 8
    with gpu_check.forced("phase1_rows", True):
        assert triton_impl.FORCED["phase1_rows"] is True
    assert triton_impl.FORCED["phase1_rows"] is False
    for bad, named in [("phase1_rowz=false", "SETTING one of"), ("phase1_rows", "SETTING=VALUE"),
                       ("phase1_group=many", "integer, true, false or none")]:
        with pytest.raises(ValueError, match=named):
            gpu_check.apply_force([bad])
    assert gpu_check.main(["--out", str(tmp_path), "--cpu-smoke", "--force", "bogus=1"]) == 2


@pytest.mark.triton
def test_merges_at_forced_warps_equal_the_default(monkeypatch):
    """A merge forward and backward at the sweep's warps (and the programs the backward
    sizes for them) give what they give at the default."""
    from conftest import triton_device

    import gpu_check
    from attnres.ops.depth_attention import triton_impl

    device = triton_device()
    z = gpu_check.Sizes(**{**gpu_check.asdict(gpu_check.SMOKE), "tokens": 12})
    results = {}
    for warps in (None, 4):
        monkeypatch.setitem(triton_impl.FORCED, "merge_warps", warps)
        calls = gpu_check.op_calls(z, device)
        leaves = torch.utils._pytree.tree_leaves([calls[name]() for name in gpu_check.SWEEPS["merge_warps"][1]])
        results[warps] = [t for t in leaves if isinstance(t, torch.Tensor)]
    assert len(results[None]) == len(results[4]) > 20
    for a, b in zip(results[None], results[4]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    # the warm-up worker that compiles the sweep's variants runs them all
    monkeypatch.setitem(triton_impl.FORCED, "merge_warps", None)
    assert gpu_check.warm_up_worker("sweeps", z, device) == 0
    assert triton_impl.FORCED["merge_warps"] is None and triton_impl.FORCED["block_d"] is None


def test_model_options_reach_every_model_and_the_warm_up_workers(monkeypatch):
    """``--autocast-stream`` and ``--autocast-norm-output`` switch their ``ResidualConfig``
    setting on in every model of the run and in the warm-up workers' models (their flags on
    the workers' command lines, beside ``--force``)."""
    import gpu_check

    args = gpu_check.parse_args(["--out", "x", "--autocast-stream", "--autocast-norm-output"])
    options = gpu_check.model_options(args)
    assert options == ["autocast_norm_output", "autocast_stream"]
    sums = gpu_check.model_options(gpu_check.parse_args(["--out", "x", "--autocast-phase1-sums"]))
    assert sums == ["autocast_phase1_sums"]
    models = gpu_check.build_models(gpu_check.SMOKE, "cpu", names=("standard", "block"))
    gpu_check.apply_model_options(models, sums)
    assert models["block"].residual.autocast_phase1_sums and not hasattr(models["standard"].residual,
                                                                          "autocast_phase1_sums")
    models = gpu_check.build_models(gpu_check.SMOKE, "cpu", names=("standard", "block"))
    gpu_check.apply_model_options(models, options)
    for model in models.values():
        assert model.residual.autocast_stream and model.layers[0].attn_norm.autocast_output
    model = gpu_check.build_models(gpu_check.SMOKE, "cpu", names=("block",))["block"]
    for option, on in (("autocast_stream", lambda: model.residual.autocast_stream),
                       ("autocast_norm_output", lambda: model.layers[0].mlp_norm.autocast_output)):
        assert gpu_check.with_option(on, model, option)() is True and on() is False  # (on for the step only)

    commands = []
    monkeypatch.setattr(gpu_check.subprocess, "Popen", lambda command, **kwargs: commands.append(command))
    gpu_check.start_warm_up(_all_parts(), {}, ["phase1_rows=false"], options)
    assert len(commands) == len(gpu_check.WARMED_MODELS) + len(gpu_check.KERNEL_WORKERS)  # (and the sweeps, the ops)
    for command in commands:
        assert command[-4:] == ["--force", "phase1_rows=false", "--autocast-norm-output", "--autocast-stream"]

    seen = []

    def train_steps(models, ids, device):
        seen.extend(model.residual.autocast_stream for model in models.values())
        return {name: (lambda: None) for name in models}

    monkeypatch.setattr(gpu_check, "train_steps", train_steps)
    assert gpu_check.warm_up_worker("models:block:train", gpu_check.SMOKE, "cpu", options=["autocast_stream"]) == 0
    assert seen == [True]


def test_the_warm_up_workers_command_lines_are_read_by_the_workers_parser(monkeypatch):
    """Each warm-up worker is this script run again: its command line must pass the script's
    own parser. They were started with ``--out /dev/null``, which ``--out``'s check refuses as
    a file, so every worker exited with argparse's error at once and the parts compiled every
    kernel in their first steps, on the budget's time."""
    import gpu_check

    commands = []
    monkeypatch.setattr(gpu_check.subprocess, "Popen", lambda command, **kwargs: commands.append(command))
    gpu_check.start_warm_up(_all_parts(), {"a peer": None}, ["phase1_rows=false"], ["autocast_stream"])
    workers = []
    for command in commands:
        assert command[:2] == [sys.executable, gpu_check.__file__]
        args = gpu_check.parse_args(command[2:])
        workers.append(args.warm_up_worker)
        assert args.force == ["phase1_rows=false"]
        assert gpu_check.model_options(args) == ["autocast_stream"] and not args.cpu_smoke
    assert workers == [*gpu_check.WARMED_MODELS, "sweeps", "ops", "a peer"]


def test_a_run_of_some_parts_starts_only_their_warm_up_workers():
    """The prepared run's parts start every worker (the peers' with ``ops``); a follow-up of
    one part starts only the workers of its kernels: ``--parts train_compiled``, on a fresh
    machine, waited for all eight - up to 35 % of its 240 s budget - and could skip the part it
    was run for. (That each part's workers compile all it launches: the slow test below.)"""
    import gpu_check

    peers = {"a peer": None}
    assert gpu_check.warm_up_workers(_all_parts(), peers) == [*gpu_check.WARMED_MODELS, *gpu_check.KERNEL_WORKERS,
                                                               "a peer"]
    assert set(gpu_check.WARM_UP_OF_PART) == set(_all_parts()) == set(gpu_check.MIN_SECONDS)
    assert gpu_check.warm_up_workers(["train_compiled"], peers) == ["models:block:train", "models:full:train"]
    assert gpu_check.warm_up_workers(["ops"], peers) == ["sweeps", "ops", "a peer"]
    assert gpu_check.warm_up_workers(["decode", "train_bf16"], {}) == [
        "models:block:decode", "models:block:bf16", "models:full:decode", "models:full:bf16"]


def test_a_run_of_the_parts_that_build_their_own_inputs_builds_no_models(tmp_path, monkeypatch):
    """The peers' follow-up (``--parts ops``) built the check's three 1.6B-parameter models and
    held them, unused, through its op-level timings."""
    pytest.importorskip("triton")
    import gpu_check

    built = []
    monkeypatch.setattr(gpu_check, "build_models", lambda *args, **kwargs: built.append(args) or {})
    monkeypatch.setattr(gpu_check, "copy_bandwidth", lambda device: 1.0)
    for parts, models in ((",".join(gpu_check.MODEL_FREE_PARTS), 0), ("parity,decode", 1)):
        argv = ["--cpu-smoke", "--parts", parts, "--out", str(tmp_path)]
        gpu_check.prepare(gpu_check.parse_args(argv), argv, gpu_check.Clock("cpu"), gpu_check.SMOKE, {}, [], 0.0, {})
        assert len(built) == models
        built.clear()


class _FakeCuda:
    """The ``torch.cuda`` calls of the check's timing and memory code, recorded in ``log``:
    streams, a graph's capture and replays, events (each ``elapsed_ms`` apart) and the
    allocator's counters (``allocated`` bytes, their ``peak`` since the last reset)."""

    def __init__(self, monkeypatch, elapsed_ms: float = 2.0):
        self.log, self.allocated, self.peak = [], 0, 0
        fake = self

        class Stream:
            def wait_stream(self, other):
                fake.log.append("wait")

        class Graph:
            def replay(self):
                fake.log.append("replay")

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing

            def record(self):
                fake.log.append("event")

            def elapsed_time(self, end):
                return elapsed_ms

        @contextlib.contextmanager
        def scope(begin, end):
            self.log.append(begin)
            yield
            self.log.append(end)

        def reset_peak_memory_stats():
            self.peak = self.allocated

        for name, value in {"Stream": Stream, "current_stream": Stream, "CUDAGraph": Graph, "Event": Event,
                            "stream": lambda s: scope("side stream", "side stream end"),
                            "graph": lambda g: scope("capture", "capture end"),
                            "synchronize": lambda: self.log.append("sync"),
                            "memory_allocated": lambda: self.allocated, "max_memory_allocated": lambda: self.peak,
                            "reset_peak_memory_stats": reset_peak_memory_stats}.items():
            monkeypatch.setattr(torch.cuda, name, value)

    def allocate(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)


def test_a_replayed_timing_warms_up_outside_the_capture_and_times_the_replays_alone(monkeypatch):
    """The ops' timing on a GPU (``Clock.replayed``, CUDA calls faked): the operation runs once
    on a side stream first (its kernels compiled and loaded, which a capture cannot do), then
    once inside the capture; the graph is replayed once untimed, then each timed replay sits
    alone between its two events, and the median of their spans is returned."""
    import gpu_check

    cuda = _FakeCuda(monkeypatch)
    seconds = gpu_check.Clock("cuda").replayed(lambda: cuda.log.append("op"), 3)
    assert cuda.log == ["wait", "side stream", "op", "side stream end", "wait", "capture", "op", "capture end",
                        "replay", "sync", *["event", "replay", "event", "sync"] * 3]
    assert seconds == pytest.approx(2e-3)


def test_a_steps_memory_on_a_gpu_is_its_own_peak_and_what_its_forward_keeps(monkeypatch):
    """The training part's memory on a GPU (the allocator's counters faked): a step's peak is
    counted from what was allocated before it, with the peak of the steps before it reset;
    the forward's kept bytes are what it leaves allocated."""
    import gpu_check

    cuda = _FakeCuda(monkeypatch)
    cuda.allocate(1000)
    cuda.allocate(-900)  # (an earlier step's peak of 1000, 100 still allocated)

    def step():
        cuda.allocate(70)
        cuda.allocate(-70)

    assert gpu_check.peak_memory(step, "cuda") == 70
    assert gpu_check.kept_bytes(lambda: cuda.allocate(30), "cuda") == 30


def test_the_profiles_device_branch_reads_what_this_torch_profiler_gives(monkeypatch):
    """The profiles on a GPU read each average's ``self_device_time_total`` and each event's
    ``device_type`` (names torch has renamed before: ``cuda_time``): run here with the CUDA
    activity asked for and no device, they read zero device time and no kernels, and the
    operations are still listed."""
    import gpu_check

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    x = torch.randn(16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the profiler's: CUDA asked for, none here)
        result = gpu_check.profiled(lambda: (x @ x).relu(), "cuda", 2)
    assert result["total_ms"] == 0 and result["kernels"] == 0
    assert len(result["top"]) == 2 and {"aten::relu", "aten::mm"} & {e["op"] for e in result["top"]}


def _run_losing_the_device(monkeypatch, gpu_check, run_part, tmp_path) -> tuple[list[str], list]:
    """``main`` of the smoke's profile, decode and profile_decode parts (``run_part``) with the
    device lost after any failure and ``os.execv`` recorded: ``(its arguments, the execs)``."""
    execs = []
    monkeypatch.setattr(gpu_check, "run_part", run_part)
    monkeypatch.setattr(gpu_check, "build_models", lambda z, device: {})
    monkeypatch.setattr(gpu_check, "device_usable", lambda device: False)
    monkeypatch.setattr(gpu_check.os, "execv", lambda path, command: execs.append(command))
    argv = ["--out", str(tmp_path), "--cpu-smoke", "--budget", "300", "--parts", "profile,decode,profile_decode"]
    assert gpu_check.main(argv) == 0
    return argv, execs


def test_a_part_that_loses_the_device_leaves_the_parts_after_it_to_a_fresh_process(monkeypatch, tmp_path):
    """A kernel's memory fault is sticky: every later CUDA call of the process fails. A part
    that raises and leaves the device unusable is recorded, the results are written, and the
    run replaces itself by a fresh process (``--continue``) that runs the parts after it
    within what is left of the budget and adds their results to the same files."""
    pytest.importorskip("triton")
    import gpu_check

    ran = []

    def run_part(part, *args):
        ran.append(part)
        if part == "decode":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {}  # (profile, decode, profile_decode: an empty result renders and summarises)

    argv, execs = _run_losing_the_device(monkeypatch, gpu_check, run_part, tmp_path)
    assert ran == ["profile", "decode"] and len(execs) == 1
    command = execs[0]
    assert command[1].endswith("gpu_check.py") and command[2:2 + len(argv)] == argv
    rest = gpu_check.parse_args(command[2:])  # (argparse keeps the last --parts and --budget)
    assert rest.parts == "profile_decode" and rest.resume and 0 < rest.budget <= 300
    first = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "profile" in first and "illegal memory access" in first["errors"]["decode"]
    assert "context was lost" in first["errors"]["decode"]

    ran.clear()
    monkeypatch.setattr(gpu_check, "device_usable", lambda device: True)
    assert gpu_check.main(command[2:]) == 0
    assert ran == ["profile_decode"]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {"profile", "profile_decode"} <= set(result) and set(result["errors"]) == {"decode"}
    assert result["continued"] == ["profile_decode"] and result["elapsed_s"] >= first["elapsed_s"]
    assert result["command"] == first["command"]  # (the run's own command, not the continuation's)
    assert json.loads((tmp_path / "summary.json").read_text())["errors"] == ["decode"]
    assert "Continued by another process (`--continue`): profile_decode" in (tmp_path / "gpu_check.md").read_text()
    # nothing to continue: refused, naming the file
    assert gpu_check.main(["--out", str(tmp_path / "none"), "--cpu-smoke", "--continue"]) == 2


def test_a_piece_that_loses_the_device_leaves_the_parts_after_it_to_a_fresh_process(monkeypatch, tmp_path):
    """A part's optional piece (its memory, a profile, the host time) is recorded where it
    raises, and the part's timings kept; a memory fault there is as sticky as anywhere, so
    where the device is unusable after the part, its results are written and the parts
    after it run in a fresh process - in this one each failed in turn."""
    pytest.importorskip("triton")
    import gpu_check

    ran = []

    def run_part(part, *args):
        ran.append(part)
        return {"errors": {"host": "CUDA error: an illegal memory access was encountered"}} if part == "profile" else {}

    argv, execs = _run_losing_the_device(monkeypatch, gpu_check, run_part, tmp_path)
    assert ran == ["profile"] and len(execs) == 1
    assert gpu_check.parse_args(execs[0][2:]).parts == "decode,profile_decode"
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["profile"] == {} and "context was lost" in result["errors"]["profile.host"]
    # (a piece that failed with the device still usable: the run goes on in this process)
    ran.clear()
    monkeypatch.setattr(gpu_check, "device_usable", lambda device: True)
    assert gpu_check.main([*argv[:-1], "profile,decode"]) == 0
    assert ran == ["profile", "decode"] and len(execs) == 1


def test_a_failing_part_of_the_smoke_raises(monkeypatch, tmp_path):
    """On the CPU the device is never lost, and a part of the smoke that raises fails the
    run (the tests see it) rather than being recorded."""
    pytest.importorskip("triton")
    import gpu_check

    def run_part(part, *args):
        raise ValueError(f"{part} is broken")

    monkeypatch.setattr(gpu_check, "run_part", run_part)
    monkeypatch.setattr(gpu_check, "build_models", lambda z, device: {})
    with pytest.raises(ValueError, match="profile is broken"):
        gpu_check.main(["--out", str(tmp_path), "--cpu-smoke", "--parts", "profile"])


def test_parts_skipped_for_the_budget_after_the_last_part_are_named_in_the_summary(monkeypatch, tmp_path):
    """A part that does not fit the budget is skipped and named in ``summary.json``, also
    when no part runs after it (the files are written once more at the end). On a GPU only:
    the device is faked here, the parts stubbed."""
    pytest.importorskip("triton")
    import gpu_check

    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.torch.cuda, "get_device_name", lambda: "a faked GPU")
    monkeypatch.setattr(gpu_check, "copy_bandwidth", lambda device: None)
    monkeypatch.setattr(gpu_check, "start_warm_up", lambda *args: {})
    monkeypatch.setattr(gpu_check, "build_models", lambda z, device: {})
    monkeypatch.setattr(gpu_check, "run_part", lambda part, *args: {})
    assert gpu_check.main(["--out", str(tmp_path), "--no-peers", "--budget", "100", "--parts", "profile,train_compiled"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["device"] == "a faked GPU" and set(summary["skipped"]) == {"train_compiled"}
    assert "of the 100 s budget left" in summary["skipped"]["train_compiled"]
    assert "Skipped **train_compiled**" in (tmp_path / "gpu_check.md").read_text()


def _fake_gpu(monkeypatch, gpu_check, run_part=lambda part, *args: {}):
    """``main`` on a faked GPU: its device calls and the parts stubbed (``run_part``)."""
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.torch.cuda, "get_device_name", lambda: "a faked GPU")
    monkeypatch.setattr(gpu_check, "copy_bandwidth", lambda device: None)
    monkeypatch.setattr(gpu_check, "start_warm_up", lambda *args: {})
    monkeypatch.setattr(gpu_check, "build_models", lambda z, device: {})
    monkeypatch.setattr(gpu_check, "run_part", run_part)
    monkeypatch.setattr(gpu_check, "device_usable", lambda device: True)  # (its synchronize would fail here)


def test_a_run_names_the_part_it_is_in_so_that_one_killed_by_its_time_limit_says_where(monkeypatch, tmp_path):
    """The files are written before each part too, naming it ``running`` (and before the
    models are built, with the card, the versions and the code): a run that its command's time
    limit kills (rc 124/137) leaves what it measured and where it stopped. A finished part
    leaves no ``running``."""
    import gpu_check

    seen = {}

    def run_part(part, *args):
        seen[part] = json.loads((tmp_path / "summary.json").read_text()).get("running")
        return {}

    _fake_gpu(monkeypatch, gpu_check, run_part)

    def build_models(z, device):
        seen["models"] = json.loads((tmp_path / "gpu_check.json").read_text())
        return {}

    monkeypatch.setattr(gpu_check, "build_models", build_models)
    assert gpu_check.main(["--out", str(tmp_path), "--no-peers", "--parts", "profile,decode"]) == 0
    assert seen["profile"]["part"] == "profile" and seen["decode"]["part"] == "decode"
    early = seen["models"]
    assert early["running"]["part"] == "building the models" and early["device"] == "a faked GPU"
    assert early["torch"] == torch.__version__ and early["code"]["source_digest"] and "python" in early
    assert "Still running building the models" in gpu_check.render(early)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "running" not in summary and summary["software"]["torch"] == torch.__version__
    assert "Still running" not in (tmp_path / "gpu_check.md").read_text()


def test_the_budget_counts_from_the_process_start_and_a_hang_past_it_dumps_the_stacks(monkeypatch, tmp_path):
    """``--budget`` counts from the process's start (``STARTED``, before the imports) when
    run as a command, so that it and the command's time limit measure the same span; past the
    budget by ``HANG_DUMP_S`` every thread's stack goes to the log (cancelled at the end)."""
    import gpu_check

    ran, dumps = [], []
    _fake_gpu(monkeypatch, gpu_check, lambda part, *args: ran.append(part) or {})
    monkeypatch.setattr(gpu_check.faulthandler, "dump_traceback_later", lambda timeout: dumps.append(timeout))
    monkeypatch.setattr(gpu_check.faulthandler, "cancel_dump_traceback_later", lambda: dumps.append("cancelled"))
    argv = ["--out", str(tmp_path), "--no-peers", "--budget", "100", "--parts", "profile"]
    assert gpu_check.main(argv, started=gpu_check.time.perf_counter() - 90) == 0
    assert ran == [] and "of the 100 s budget left" in json.loads((tmp_path / "summary.json").read_text())[
        "skipped"]["profile"]
    assert 0 < dumps[0] <= 10 + gpu_check.HANG_DUMP_S and dumps[-1] == "cancelled"
    assert gpu_check.main(argv) == 0 and ran == ["profile"]  # (from now: the part fits)


def test_the_warm_up_is_waited_for_until_its_share_of_the_budget_then_stopped(monkeypatch, tmp_path):
    """A warm-up worker still running at its deadline (a share of the budget) is stopped
    rather than waited for without end; each worker's exit code (or that it was stopped) is
    recorded, and a failed one named."""
    import gpu_check

    def worker(code: str):
        return subprocess.Popen([sys.executable, "-c", code])

    workers = {"quick": worker("pass"), "failing": worker("raise SystemExit(3)"),
               "hung": worker("import time; time.sleep(120)")}
    start = gpu_check.time.perf_counter()
    status = gpu_check.wait_for_warm_up(workers, start, start + 3)
    assert status["workers"]["quick"] == 0 and status["workers"]["failing"] == 3
    assert "stopped at the warm-up's deadline" in status["workers"]["hung"] and workers["hung"].poll() is not None
    assert 3 <= status["s"] < 20 and set(status["finished_s"]) == {"quick", "failing"}

    _fake_gpu(monkeypatch, gpu_check)
    monkeypatch.setattr(gpu_check, "start_warm_up", lambda *args: {"hung": worker("import time; time.sleep(120)")})
    monkeypatch.setattr(gpu_check, "WARM_UP_SHARE", 0.02)  # (2 s of 100)
    assert gpu_check.main(["--out", str(tmp_path), "--no-peers", "--budget", "100", "--parts", "profile"]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "stopped" in result["warm_up"]["workers"]["hung"] and "profile" in result


def _nvidia_smi(monkeypatch, gpu_check, stdout: str | None) -> None:
    """``nvidia-smi`` stubbed: it prints ``stdout``; ``None``: there is none."""
    real = subprocess.run

    def run(command, *args, **kwargs):
        if command[0] != "nvidia-smi":
            return real(command, *args, **kwargs)
        if stdout is None:
            raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")
        return subprocess.CompletedProcess(command, 0, stdout, "")

    monkeypatch.setattr(gpu_check.subprocess, "run", run)


def test_a_gpu_in_an_exclusive_compute_mode_runs_no_parallel_warm_up(monkeypatch, tmp_path):
    """In the EXCLUSIVE_PROCESS compute mode the device takes one process at a time: the
    warm-up's workers would take it from the main process (or fail to get it). The mode is
    read before they start (``nvidia-smi``; none - or ``[N/A]`` - is read as before, in
    parallel), and in a mode other than Default none starts: the parts compile their kernels
    in their untimed first steps, and ``warm_up`` in gpu_check.json says so."""
    import gpu_check

    started = []
    _fake_gpu(monkeypatch, gpu_check)
    monkeypatch.setattr(gpu_check, "start_warm_up", lambda *args: started.append(args) or {})
    argv = ["--out", str(tmp_path), "--no-peers", "--parts", "profile"]
    _nvidia_smi(monkeypatch, gpu_check, "Exclusive_Process\n")
    assert gpu_check.gpu_compute_mode() == "Exclusive_Process"
    assert gpu_check.main(argv) == 0 and not started
    warm_up = json.loads((tmp_path / "gpu_check.json").read_text())["warm_up"]
    assert warm_up["compute_mode"] == "Exclusive_Process" and "untimed first steps" in warm_up["skipped"]
    for stdout, mode in (("Default\n", "Default"), (None, None), ("[N/A]\n", None)):
        _nvidia_smi(monkeypatch, gpu_check, stdout)
        assert gpu_check.gpu_compute_mode() == mode
        assert gpu_check.main(argv) == 0 and len(started) == 1
        started.clear()
        assert json.loads((tmp_path / "gpu_check.json").read_text())["warm_up"] == {"compute_mode": mode}


def test_a_run_that_raises_before_the_warm_up_is_waited_for_stops_its_workers(monkeypatch, tmp_path):
    """The models are built while the warm-up's workers compile: a run that raises there (out
    of memory building them) stops its workers rather than leaving them compiling on the
    device - holding its memory for the next call on a warm machine."""
    import gpu_check

    workers = {"compiling": subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])}

    def build_models(z, device):
        raise RuntimeError("CUDA out of memory")

    _fake_gpu(monkeypatch, gpu_check)
    monkeypatch.setattr(gpu_check, "start_warm_up", lambda *args: workers)
    monkeypatch.setattr(gpu_check, "build_models", build_models)
    with pytest.raises(RuntimeError, match="out of memory"):
        gpu_check.main(["--out", str(tmp_path), "--no-peers", "--budget", "100"])
    assert workers["compiling"].poll() is not None
    assert json.loads((tmp_path / "summary.json").read_text())["running"]["part"] == "warm-up"


def test_a_parts_optional_piece_that_fails_keeps_the_parts_timings(monkeypatch):
    """The training part's memory, kept bytes and (compiled) profile are optional pieces:
    one that raises on the GPU is recorded under the part's ``errors`` and its timings kept
    (the compiled part's come after minutes of compiling); on the CPU - the smoke - it fails
    the part."""
    import gpu_check

    models = gpu_check.build_models(gpu_check.SMOKE, "cpu", names=("standard", "block"))

    def broken(*args, **kwargs):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr(gpu_check, "peak_memory", broken)
    monkeypatch.setattr(gpu_check, "profiled", broken)
    lenient = gpu_check.Clock("cpu", strict=False)
    eager = gpu_check.part_train(gpu_check.SMOKE, lenient, models, "cpu", compiled=False)
    assert set(eager["ms"]) >= {"standard", "block"} and eager["kept_MiB"] and eager["peak_memory_MiB"] == {}
    assert set(eager["errors"]) == {f"peak_memory {name}" for name in eager["ms"]}
    assert "CUPTI_ERROR_NOT_INITIALIZED" in eager["errors"]["peak_memory block"]
    compiled = gpu_check.part_train(gpu_check.SMOKE, lenient, models, "cpu", compiled=True)
    assert set(compiled["ms"]) == {"standard", "block"} and set(compiled["errors"]) == {"profile"}
    with pytest.raises(RuntimeError, match="CUPTI"):
        gpu_check.part_train(gpu_check.SMOKE, gpu_check.Clock("cpu"), models, "cpu", compiled=False)
    # the summary and tables of a part without its memory
    result = {"device": "GPU", "command": "c", "torch": "t", "triton": "t", "train_eager": eager}
    assert gpu_check.summarize(result)["memory"] is None and "## train_eager" in gpu_check.render(result)


def test_a_failure_timing_tritons_launcher_keeps_the_host_times_of_the_merge_and_the_standard(monkeypatch):
    """The ops part's host time on a GPU: the part of our merge call inside Triton's launcher
    (``triton_launch``, timed through stand-ins for the kernels) is a piece of its own - one
    that raises there is recorded as ``host_launch`` and the merge's and the standard
    model's host times kept (they shared one piece: all three were lost). Faked: the one-token
    merge on the CPU, reported as running our Triton kernels."""
    import gpu_check

    real_merge, real_pick = gpu_check.one_token_merge, gpu_check.library.pick
    triton = types.SimpleNamespace(__name__="attnres.ops.depth_attention.triton_impl")
    monkeypatch.setattr(gpu_check, "one_token_merge", lambda device, backend: real_merge("cpu", "torch"))
    monkeypatch.setattr(gpu_check.library, "pick",
                        lambda backend, tensors: triton if backend == "auto" else real_pick(backend, tensors))

    def unlaunchable(names):
        raise RuntimeError("Triton Error [CUDA]: invalid argument")

    monkeypatch.setattr(gpu_check, "timed_launches", unlaunchable)
    monkeypatch.setattr(gpu_check.kernels_bench, "peak_bandwidth", lambda: (3.35e12, "datasheet"))
    monkeypatch.setattr(gpu_check, "op_calls", lambda z, device: {})
    monkeypatch.setattr(gpu_check, "autocast_ops", lambda *args: {})
    monkeypatch.setattr(gpu_check, "block_against_peers", lambda *args: ({}, {}))
    clock = gpu_check.Clock("cuda", strict=False)
    monkeypatch.setattr(clock, "sync", lambda: None)
    ops = gpu_check.part_ops(gpu_check.SMOKE, clock, "cuda", {}, {})
    assert ops["host_us"]["ours"] > 0 and ops["host_us"]["standard"] > 0 and "triton_launch" not in ops["host_us"]
    assert set(ops["errors"]) == {"host_launch"} and "invalid argument" in ops["errors"]["host_launch"]


def test_a_diagnostic_steps_memory_that_fails_keeps_the_memory_targets_rows(monkeypatch):
    """The eager part's memory is measured step by step, each an attempt of its own: Full's
    peak (or an option's) out of memory is recorded as ``peak_memory full`` and the standard
    model's and Block's rows - the memory target's - kept; one attempt over every step lost
    them all. The same for the bytes the forward keeps."""
    import gpu_check

    models = gpu_check.build_models(gpu_check.SMOKE, "cpu")
    full_step, full_forward = [], []
    steps, forward_of = gpu_check.train_steps, gpu_check.forward_of

    def marking_steps(models_, ids, device, compiled=False):
        made = steps(models_, ids, device, compiled)
        full_step.append(made["full"])
        return made

    def marking_forward(model, ids, device):
        made = forward_of(model, ids, device)
        if model is models["full"]:
            full_forward.append(made)
        return made

    def peak_memory(step, device):
        if step in full_step:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return 2**20

    def kept_bytes(forward, device):
        if forward in full_forward:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return 2**20

    monkeypatch.setattr(gpu_check, "train_steps", marking_steps)
    monkeypatch.setattr(gpu_check, "forward_of", marking_forward)
    monkeypatch.setattr(gpu_check, "peak_memory", peak_memory)
    monkeypatch.setattr(gpu_check, "kept_bytes", kept_bytes)
    eager = gpu_check.part_train(gpu_check.SMOKE, gpu_check.Clock("cpu", strict=False), models, "cpu",
                                 compiled=False, paired=True)
    assert set(eager["peak_memory_MiB"]) == set(eager["kept_MiB"]) == set(eager["ms"]) - {"full"}
    assert set(eager["errors"]) == {"peak_memory full", "kept full"} and "out of memory" in eager["errors"]["kept full"]
    summary = gpu_check.summarize({"device": "GPU", "train_eager": eager})
    assert summary["memory"] == 1.0 and summary["met"]["memory"] and summary["full"]["memory"] is None


def test_an_op_that_fails_keeps_the_other_ops_rows(monkeypatch):
    """The ops part times each operation against its bound, each row an attempt of its own:
    one whose capture fails on the GPU is recorded as ``op NAME`` and the others' rows - and
    the pieces after them - kept (one failure failed the part); the op-level target is not
    met without every row. A failure that loses the device ends the part with the rows
    measured."""
    import gpu_check

    real = gpu_check.op_calls

    def calls(z, device, *args, **kwargs):
        made = real(z, device, *args, **kwargs)
        made["merge_bwd"] = lambda: (_ for _ in ()).throw(RuntimeError("Triton Error [CUDA]: invalid argument"))
        return made

    monkeypatch.setattr(gpu_check, "op_calls", calls)
    lenient = gpu_check.Clock("cpu", strict=False)
    ops = gpu_check.part_ops(gpu_check.SMOKE, lenient, "cpu", {}, {})
    assert set(ops["ops"]) == set(gpu_check.op_bytes(gpu_check.SMOKE)) - {"merge_bwd"} and ops["host_us"]
    assert set(ops["errors"]) == {"op merge_bwd"} and "invalid argument" in ops["errors"]["op merge_bwd"]
    summary = gpu_check.summarize({"device": "GPU", "ops": {**ops, "ops": {k: {**v, "x_bound": 1.0}
                                                                         for k, v in ops["ops"].items()}}})
    assert summary["met"]["ops_within_2x_bound"] is False
    monkeypatch.setattr(gpu_check, "device_usable", lambda device: False)
    lost = gpu_check.part_ops(gpu_check.SMOKE, lenient, "cpu", {}, {})
    assert list(lost["ops"]) == ["phase1_fwd", "phase1_bwd", "merge_fwd"] and set(lost["errors"]) == {"op merge_bwd"}
    with pytest.raises(RuntimeError, match="invalid argument"):
        gpu_check.part_ops(gpu_check.SMOKE, gpu_check.Clock("cpu"), "cpu", {}, {})


def test_a_step_that_fails_its_first_run_is_recorded_and_the_parts_other_steps_timed(monkeypatch):
    """The parts' steps that no GPU has run yet - the eager part's options (the stream in
    bf16), a decode graph's capture, Phase 1 in one kernel, a model's compile - are run once
    each before the timing: one that raises on the GPU is recorded under the part's
    ``errors`` and left out, and the others - the targets' among them - are timed; on the
    CPU (the smoke) it fails the part."""
    import contextlib

    import gpu_check

    models = gpu_check.build_models(gpu_check.SMOKE, "cpu")
    lenient = gpu_check.Clock("cpu", strict=False)

    def bf16_stream(model, on):
        if on:  # (after a backward that made some gradients)
            model.lm_head.weight.grad = torch.ones_like(model.lm_head.weight)
            raise RuntimeError("Triton Error [CUDA]: out of resources")
        return False

    monkeypatch.setitem(gpu_check.MODEL_OPTIONS, "autocast_stream", bf16_stream)
    timed = lenient.interleaved
    leftover = []  # (the gradients the timing starts with: a failed step's would be added to)

    def interleaved(steps, repeats):
        leftover.extend(p for m in models.values() for p in m.parameters() if p.grad is not None)
        return timed(steps, repeats)

    monkeypatch.setattr(lenient, "interleaved", interleaved)
    eager = gpu_check.part_train(gpu_check.SMOKE, lenient, models, "cpu", compiled=False, paired=True)
    assert not leftover
    stream, norm_out = (set(gpu_check.PAIRED[option][1]) for option in ("autocast_stream", "autocast_norm_output"))
    assert {"standard", "block", "full", *norm_out} <= set(eager["ms"]) and not stream & set(eager["ms"])
    assert set(eager["errors"]) == stream and "out of resources" in eager["errors"]["block (bf16 stream)"]
    assert set(eager["peak_memory_MiB"]) == set(eager["kept_MiB"]) == set(eager["ms"])
    with pytest.raises(RuntimeError, match="out of resources"):
        gpu_check.part_train(gpu_check.SMOKE, gpu_check.Clock("cpu"), models, "cpu", compiled=False, paired=True)

    # decode: Full's graph capture and Block's step with Phase 1 in one kernel fail
    static = gpu_check.StaticDecoder

    def decoder(model, batch, capacity, mode):
        if model is models["full"]:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return static(model, batch, capacity=capacity, mode=mode)

    @contextlib.contextmanager
    def unlaunchable():
        raise RuntimeError("Triton Error [CUDA]: invalid argument")
        yield

    monkeypatch.setattr(gpu_check, "StaticDecoder", decoder)
    monkeypatch.setattr(gpu_check, "phase1_in_one_kernel", unlaunchable)
    decode = gpu_check.part_decode(gpu_check.SMOKE, lenient, models, "cpu")
    for batch in gpu_check.DECODE_BATCHES:
        assert set(decode[f"b{batch}"]["eager"]) == {"standard", "block", "full"}
        assert set(decode[f"b{batch}"]["graphed"]) == {"standard", "block"}
    assert set(decode["errors"]) == {f"b{b} {name}|graphed" for b in gpu_check.DECODE_BATCHES
                                     for name in ("full", gpu_check.ONE_KERNEL)}
    assert "stream is capturing" in decode["errors"]["b1 full|graphed"]

    # compiled: Full's compile fails
    steps = gpu_check.train_steps

    def compiling(models, ids, device, compiled=False):
        made = steps(models, ids, device, compiled)
        made["full"] = lambda: (_ for _ in ()).throw(RuntimeError("InductorError: LoweringException"))
        return made

    monkeypatch.setattr(gpu_check, "train_steps", compiling)
    compiled = gpu_check.part_train(gpu_check.SMOKE, lenient, models, "cpu", compiled=True)
    assert set(compiled["ms"]) == set(compiled["compile_s"]) == {"standard", "block"}
    assert set(compiled["errors"]) == {"full"} and "LoweringException" in compiled["errors"]["full"]


def test_runnable_records_a_failed_first_run_and_raises_device_lost_where_the_device_is_gone(monkeypatch):
    """:func:`gpu_check.runnable` as every part calls it: a step whose first run raises is
    recorded and left out, the others kept; one that left the device unusable is recorded and
    raises :class:`gpu_check.DeviceLost` (its part keeps the rows measured before), not its
    own error, which would fail the part; on a strict clock (the smoke) the error itself."""
    import gpu_check

    def failing():
        raise RuntimeError("Triton Error [CUDA]: out of resources")

    steps = {"standard": lambda: None, "full": failing, "block": lambda: None}
    clock, errors = gpu_check.Clock("cpu", strict=False), {}
    monkeypatch.setattr(gpu_check, "device_usable", lambda device: True)
    assert list(gpu_check.runnable(clock, errors, steps, prefix="b1 ")) == ["standard", "block"]
    assert set(errors) == {"b1 full"} and "out of resources" in errors["b1 full"]
    monkeypatch.setattr(gpu_check, "device_usable", lambda device: False)
    errors.clear()
    with pytest.raises(gpu_check.DeviceLost, match="full"):
        gpu_check.runnable(clock, errors, steps)
    assert set(errors) == {"full"}
    with pytest.raises(RuntimeError, match="out of resources"):
        gpu_check.runnable(gpu_check.Clock("cpu"), {}, steps)


def test_the_summary_takes_an_eager_part_whose_default_steps_failed():
    """A step that fails its first run is left out (:func:`gpu_check.runnable`), the default
    ones too: the summary of the option's rows holds ``None`` where the default's row is
    missing, rather than failing (``summary_failed``, every ratio lost)."""
    import gpu_check

    ms = {"standard (bf16 stream)": 2.0, "block (bf16 stream)": 2.1, "block (bf16 sums)": 1.1}
    summary = gpu_check.summarize({"device": "GPU", "train_eager": {"ms": ms, "peak_memory_MiB": {}}})
    assert summary["train_eager"] is None and summary["block_bf16_sums"]["block_vs_default"] is None
    assert summary["autocast_stream"]["train_eager"] == pytest.approx(1.05)
    assert summary["autocast_stream"]["block_vs_default"] is None
    assert summary["autocast_stream"]["standard_vs_default"] is None


def test_main_files_a_parts_piece_errors_and_dropped_models(monkeypatch, tmp_path):
    """A part's pieces that failed are filed under ``errors`` as ``part.piece`` (the summary
    names them), the models it dropped under ``skipped``."""
    import gpu_check

    def run_part(part, *args):
        return {"ms": {"standard": 1.0, "block": 1.1}, "warm_up_s": 1.0, "errors": {"profile": "Traceback: CUPTI"},
                "dropped": {"full": "40 s to the deadline"}}

    _fake_gpu(monkeypatch, gpu_check, run_part)
    assert gpu_check.main(["--out", str(tmp_path), "--no-peers", "--budget", "1000", "--parts", "train_compiled"]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["errors"] == {"train_compiled.profile": "Traceback: CUPTI"} and "errors" not in result["train_compiled"]
    assert result["skipped"] == {"train_compiled full": "40 s to the deadline"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["errors"] == ["train_compiled.profile"] and summary["train_compiled"] == pytest.approx(1.1)


def test_the_compiled_part_compiles_each_model_only_while_one_more_compile_fits(monkeypatch):
    """Each model's first compiled step compiles it: the part takes them in order (the
    standard model, Block, Full) while the time to the deadline fits one more compile - the
    assumed ``COMPILE_S``, or 1.2 times the slowest so far - and drops the rest, saying why,
    rather than being killed by the command's time limit midway."""
    import gpu_check

    now = [0.0]
    monkeypatch.setattr(gpu_check, "time", type("T", (), {"perf_counter": staticmethod(lambda: now[0])}))
    monkeypatch.setattr(gpu_check, "COMPILE_S", 50)
    compiled = []

    def compiling(name):
        def step():
            compiled.append(name)
            now[0] += 60
        return step

    steps = {name: compiling(name) for name in ("standard", "block", "full")}
    monkeypatch.setattr(gpu_check, "COMPILED_TIMING_S", 20)  # (kept for timing the compiled steps)
    kept, seconds, dropped = gpu_check.compile_within(steps, gpu_check.Clock("cpu", deadline=212.0), {})
    assert list(kept) == ["standard", "block", "full"] and seconds == {"standard": 60, "block": 60, "full": 60}
    now[0], compiled[:] = 0.0, []
    kept, seconds, dropped = gpu_check.compile_within(steps, gpu_check.Clock("cpu", deadline=211.0), {})
    assert compiled == ["standard", "block"] and list(kept) == ["standard", "block"]
    assert set(dropped) == {"full"} and "91 s to the deadline" in dropped["full"] and "92 s" in dropped["full"]


def test_the_compiled_part_without_full_has_the_time_to_compile_block_after_the_standard_model(monkeypatch):
    """Short of the whole compiled part's time, Full is left out so that the standard model
    and Block - the target's ratio - compile. At ``COMPILED_WITHOUT_FULL_S`` left, each
    compile taking the assumed ``COMPILE_S``, :func:`compile_within` compiles both: at 160 s,
    as it was, Block's compile (1.2 times the standard model's) and the timing no longer fit
    after the standard model's, which compiled alone - no ratio for 70 s of the budget."""
    import gpu_check

    now = [0.0]
    monkeypatch.setattr(gpu_check, "time", type("T", (), {"perf_counter": staticmethod(lambda: now[0])}))

    def compiling():
        now[0] += gpu_check.COMPILE_S

    models = {"standard": 0, "block": 1, "full": 2}
    fit, _ = gpu_check.fitting_models("train_compiled", models, gpu_check.COMPILED_WITHOUT_FULL_S)
    clock = gpu_check.Clock("cpu", deadline=float(gpu_check.COMPILED_WITHOUT_FULL_S))
    kept, _, dropped = gpu_check.compile_within({name: compiling for name in fit}, clock, {})
    assert list(kept) == ["standard", "block"] and not dropped


def test_block_compiles_after_a_slow_standard_compile_without_the_margin(monkeypatch):
    """A standard model's compile of 90 s with 202 s left (a warm-up of 154 s and the eager
    parts before): Block needs the standard model's 90 s and the timing, 110 s of the 112
    left - with the margin (128 s) it was dropped, and the 90 s bought a ratio-less row.
    Full, after them, keeps the margin."""
    import gpu_check

    now = [0.0]
    monkeypatch.setattr(gpu_check, "time", type("T", (), {"perf_counter": staticmethod(lambda: now[0])}))

    def compiling(seconds):
        def step():
            now[0] += seconds
        return step

    clock = gpu_check.Clock("cpu", deadline=202.0)
    kept, seconds, dropped = gpu_check.compile_within(
        {"standard": compiling(90), "block": compiling(100)}, clock, {})
    assert list(kept) == ["standard", "block"] and not dropped
    now[0] = 0.0
    clock = gpu_check.Clock("cpu", deadline=221.0)  # Full after both: 1.2 x 100 + 20 > 221 - 90 - 100
    kept, seconds, dropped = gpu_check.compile_within(
        {"standard": compiling(90), "block": compiling(100), "full": compiling(100)}, clock, {})
    assert list(kept) == ["standard", "block"] and set(dropped) == {"full"}


def test_the_files_are_written_when_the_summary_or_tables_fail(tmp_path):
    """A result the summary or the tables cannot read (a part's result without a key) still
    leaves every number in ``gpu_check.json`` and a summary saying what failed; the smoke
    (``strict``) raises instead."""
    import gpu_check

    result = {"device": "GPU", "command": "c", "torch": "t", "triton": "t", "train_eager": {"warm_up_s": 1.0},
              "errors": {"decode": "trace"}}
    md = gpu_check.write(tmp_path, result)
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == result
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "KeyError: 'ms'" in summary["summary_failed"] and summary["errors"] == ["decode"]
    assert "The tables failed" in md and (tmp_path / "gpu_check.md").read_text() == md
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(KeyError):
        gpu_check.write(tmp_path, result, strict=True)


def test_a_run_records_which_code_it_measured_with_or_without_git(monkeypatch, tmp_path, capsys):
    """The GPU machine gets a copy of the working tree without ``.git``: a run records the
    commit where it can, and always a digest of the sources that a checkout of the commit
    reproduces (``--source-digest``); a changed source changes it. The card's facts are
    recorded, and what cannot be read is said, not raised."""
    import shutil

    import gpu_check

    code = gpu_check.code_version(ROOT)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert code["commit"] == head and isinstance(code["dirty"], bool)
    assert gpu_check.main(["--source-digest"]) == 0 and capsys.readouterr().out.strip() == code["source_digest"]
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "src" / "attnres", copy / "src" / "attnres", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "benchmarks").mkdir()
    for f in (ROOT / "benchmarks").glob("*.py"):
        shutil.copy(f, copy / "benchmarks")
    copied = gpu_check.code_version(copy)
    assert copied == {"source_digest": code["source_digest"], "commit": None, "dirty": None}
    (copy / "src" / "attnres" / "ops" / "depth_attention" / "triton_impl.py").write_text("# changed\n")
    assert gpu_check.source_digest(copy) != code["source_digest"]

    class Props:
        name, major, minor, total_memory, multi_processor_count = "NVIDIA H200", 9, 0, 141 * 2**30, 132

    monkeypatch.setattr(gpu_check.torch.cuda, "get_device_properties", lambda index: Props)
    facts = gpu_check.gpu_facts()
    assert facts["capability"] == "9.0" and facts["sms"] == 132 and facts["memory_GiB"] == 141.0 and "driver" in facts
    monkeypatch.setattr(gpu_check.torch.cuda, "get_device_properties", lambda index: 1 / 0)
    assert "ZeroDivisionError" in gpu_check.gpu_facts()["error"]


#: The CUDA-only modules whose names the check and the code it graphs call (on the CPU never
#: reached): each ``torch.cuda.X``, ``torch.profiler.X``, ``torch.autograd.DeviceType.X`` must
#: exist in the torch installed (the GPU machine's is older than this one's: torch 2.11).
CUDA_ONLY_FILES = ("benchmarks/gpu_check.py", "benchmarks/bench_kernels_gpu.py", "src/attnres/inference/static.py")


def test_the_cuda_only_calls_name_what_this_torch_has():
    import ast
    import importlib

    def dotted(node):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None

    names = set()
    for path in CUDA_ONLY_FILES:
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            name = dotted(node) if isinstance(node, ast.Attribute) else None
            if name and name.startswith(("torch.cuda.", "torch.profiler.", "torch.autograd.DeviceType.")):
                names.add(name)
    assert {"torch.cuda.graph", "torch.cuda.CUDAGraph", "torch.cuda.Event", "torch.cuda.reset_peak_memory_stats",
            "torch.cuda.get_device_properties"} <= names
    missing = []
    for name in sorted(names):
        module, *attrs = name.split(".")
        obj = importlib.import_module(module)
        for attr in attrs:
            if not hasattr(obj, attr):
                missing.append(name)
                break
            obj = getattr(obj, attr)
    assert not missing, f"torch {torch.__version__} has none of {missing}"
    # (what the profiled pieces read of a profile's events: on the CPU the CUDA ones are zero)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(4).sum()
    assert all(e.self_device_time_total == 0 and e.self_cpu_time_total >= 0 for e in prof.key_averages())
    assert {e.device_type for e in prof.events()} == {torch.autograd.DeviceType.CPU}


def test_a_stderr_without_a_file_descriptor_runs_without_the_stack_dump(monkeypatch, tmp_path):
    """Where stderr has no file descriptor (a notebook's), the stack dump past the budget is
    left out, said in the log, and the run goes on."""
    import io

    import gpu_check

    _fake_gpu(monkeypatch, gpu_check)
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    assert gpu_check.main(["--out", str(tmp_path), "--no-peers", "--parts", "profile"]) == 0
    assert "no stack dump past the budget" in stderr.getvalue() and (tmp_path / "summary.json").is_file()


# ------------------------------------------------ the warm-up's coverage at the GPU run's sizes
_TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def _triton_key(arg):
    """How Triton 3.6 specialises a kernel argument in its cache key (``specialize_impl``): a
    tensor by its pointer's dtype and whether its address is a multiple of 16, an integer by
    its width and whether it is 1 (then a constant) or a multiple of 16, a float or a bool by
    its type alone, a tuple entry by entry."""
    if isinstance(arg, torch.Tensor):
        return "*" + _TRITON_DTYPES[arg.dtype], "D" if arg.data_ptr() % 16 == 0 else ""
    if isinstance(arg, (tuple, list)):
        return tuple(zip(*(_triton_key(a) for a in arg))) or ((), ())
    if isinstance(arg, bool):
        return ("u1", None)
    if isinstance(arg, int):
        if arg == 1:
            return ("constexpr", 1)
        return ("i32" if -2**31 <= arg < 2**31 else "i64", "D" if arg % 16 == 0 else "")
    if isinstance(arg, float):
        return ("fp32", None)
    return ("constexpr", arg)


class _SpecialisationLog:
    """Stands in for a Triton kernel: a launch records its specialisation - the kernel, each
    argument's key as Triton's (:func:`_triton_key`), the constexprs and the launch options
    (``num_warps``, ``num_stages``) - and runs nothing."""

    def __init__(self, name: str, launched: set):
        self.name, self.launched = name, launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.add((self.name, _triton_key(args), tuple(sorted(kwargs.items()))))
        return launch


def test_the_specialisation_key_is_tritons_own():
    """:func:`_triton_key` gives what Triton's own ``specialize_impl`` gives for each kind of
    argument the kernels take (where this Triton has it)."""
    libtriton = pytest.importorskip("triton._C.libtriton")
    if not hasattr(libtriton, "native_specialize_impl"):
        pytest.skip("this Triton keys its cache otherwise")
    from triton.backends.compiler import BaseBackend

    x = torch.zeros(64)
    for arg in (x, x[1:], x[4:], x.bfloat16(), x.double(), 1, 2, 16, 0, 8192, 2**31, 1e-6, (x, x[1:])):
        native = libtriton.native_specialize_impl(BaseBackend, arg, False, True, True)
        assert _triton_key(arg) == native, (arg, native)


class _CudaOnCpu(types.ModuleType):
    """``torch`` for the GPU check's modules with ``"cuda"`` meaning the CPU (under a
    ``FakeTensorMode``: tensors without storage), bf16 autocast on it for CUDA's, eager
    steps for ``torch.compile``'s and the CUDA calls faked: the check's code as it runs on
    the GPU - each ``device == "cuda"`` choice of dtypes, autocast and launch settings."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _on_cpu(kwargs):
        return {**kwargs, "device": "cpu"} if "device" in kwargs else kwargs

    def device(self, *args):
        return torch.device("cpu") if str(args[0]).startswith("cuda") else torch.device(*args)

    def Generator(self, device="cpu"):  # noqa: N802 - torch's name
        return torch.Generator()

    def randn(self, *shape, **kwargs):
        return torch.randn(*shape, **self._on_cpu(kwargs))

    def randint(self, low, high, shape, **kwargs):
        return torch.randint(low, high, shape, **self._on_cpu(kwargs))

    def autocast(self, device_type, dtype=None, **kwargs):
        return torch.autocast("cpu" if device_type == "cuda" else device_type, dtype=dtype, **kwargs)

    def compile(self, model, **kwargs):  # (the compiled steps' launches: the eager steps')
        return model

    cuda = types.SimpleNamespace(synchronize=lambda: None, is_available=lambda: True)


class _OnceClock:
    """The check's clock on the GPU with its timing faked: each step run once."""

    cuda, strict, deadline = True, True, None

    def left(self):
        return float("inf")

    def sync(self):
        pass

    def replayed(self, fn, repeats):
        fn()
        return 1e-3

    def interleaved(self, steps, repeats):
        return {k: (step(), 1e-3)[1] for k, step in steps.items()}


def _gpu_run_recorded(monkeypatch) -> set:
    """The GPU check's parts and workers run as on a GPU (:class:`_CudaOnCpu`, 132
    multiprocessors as an H100's or H200's, ``"auto"`` picking our kernels) on tensors without
    storage, every Triton kernel stubbed by :class:`_SpecialisationLog`: the set it fills.
    (A fake tensor's address is its offset from an aligned base, as a fresh allocation's;
    what needs the values - the token ids' range, the parity's errors, the memory and
    profiler counters - is faked, and a CUDA graph's capture is the eager step it records.)"""
    from torch._subclasses.fake_tensor import FakeTensor

    import bench_kernels_gpu
    import gpu_check

    from attnres.models import trunk
    from attnres.ops.depth_attention import library, torch_impl, triton_impl, triton_kernels, triton_launch

    on_cpu = _CudaOnCpu()
    monkeypatch.setattr(gpu_check, "torch", on_cpu)
    monkeypatch.setattr(bench_kernels_gpu, "torch", on_cpu)
    monkeypatch.setattr(bench_kernels_gpu, "peak_bandwidth", lambda: (3.35e12, "faked"))
    monkeypatch.setattr(triton_impl, "_device_sms", lambda device: 132)
    monkeypatch.setattr(library, "pick", lambda backend, tensors: torch_impl if backend == "torch" else triton_impl)
    monkeypatch.setattr(FakeTensor, "data_ptr", lambda t: 1024 + t.storage_offset() * t.element_size(),
                        raising=False)
    # (a model's dtype changed in place: FakeTensorMode holds a weakref to each fake tensor,
    # which torch.utils.swap_tensors refuses)
    monkeypatch.setattr(torch.utils, "swap_tensors", lambda old, new: setattr(old, "data", new))
    monkeypatch.setattr(trunk, "check_token_values", lambda ids, vocab: None)
    monkeypatch.setattr(gpu_check, "relative_error", lambda a, b: 0.0)
    monkeypatch.setattr(gpu_check, "parity_errors", lambda run, reference: {"logits": 0.0, "grads": 0.0,
                                                                            "finite": True})
    monkeypatch.setattr(gpu_check, "peak_memory", lambda step, device: 1)  # (a step as the others)
    monkeypatch.setattr(gpu_check, "kept_bytes", lambda forward, device: 1)
    monkeypatch.setattr(gpu_check, "profiled", lambda fn, device, top: (fn(), {"total_ms": 1.0, "kernels": 1})[1])
    static = gpu_check.StaticDecoder
    monkeypatch.setattr(gpu_check, "StaticDecoder", lambda model, batch, capacity, mode: static(
        model, batch, capacity=capacity, mode="eager"))
    launched: set = set()
    for name in triton_launch.SIGNATURES:
        monkeypatch.setattr(triton_kernels, name, _SpecialisationLog(name, launched))
    return launched


def _parts_and_workers(monkeypatch, parts: list[str], workers: tuple[str, ...]) -> tuple[set, set]:
    """The specialisations ``parts`` launch and those the warm-up's ``workers`` launch, on the
    GPU run's sizes (``Sizes()``) as on the GPU (:func:`_gpu_run_recorded`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import gpu_check

    launched = _gpu_run_recorded(monkeypatch)
    z, clock = gpu_check.Sizes(), _OnceClock()
    with FakeTensorMode(allow_non_fake_inputs=True):
        models = gpu_check.build_models(z, "cuda") if set(parts) - set(gpu_check.MODEL_FREE_PARTS) else {}
        for part in parts:
            gpu_check.run_part(part, z, clock, models, "cuda", {}, {})
        by_parts = set(launched)
        del models
        launched.clear()
        for what in workers:
            assert gpu_check.warm_up_worker(what, z, "cuda") == 0
    return by_parts, set(launched)


def _assert_warmed(parts: set, warmed: set) -> None:
    missing = parts - warmed
    assert parts and not missing, "\n".join(
        [f"the warm-up misses {len(missing)} of the parts' {len(parts)} specialisations:",
         *map(str, sorted(missing, key=str))])


def test_the_warm_up_compiles_every_specialisation_the_parts_launch_outside_the_models_steps(monkeypatch):
    """Every kernel specialisation - Triton's cache key: the kernel, its constexprs and warps,
    its pointers' dtypes and 16-byte alignment, its integers' 1 / multiple-of-16
    specialisation - that the parity, ops and sweep parts launch is launched by the warm-up's
    workers other than the models' stages (``KERNEL_WORKERS``), on the GPU run's sizes as on
    the GPU. A specialisation the workers miss compiles in a part's untimed first step, on
    the budget's time: the parity part's float32 models without autocast and its ops, the
    host time's merge at one token and the ops at their defaults did, before the ``ops``
    worker."""
    pytest.importorskip("triton")
    import gpu_check

    _assert_warmed(*_parts_and_workers(monkeypatch, ["parity", "ops", "sweep"], gpu_check.KERNEL_WORKERS))


@pytest.mark.slow  # (two and a half minutes: every part's steps of three 1.6B-parameter models, on fake tensors)
def test_the_warm_up_compiles_every_specialisation_every_part_launches(monkeypatch):
    """:func:`test_the_warm_up_compiles_every_specialisation_the_parts_launch_outside_the_models_steps`
    for every part of the prepared run - the models' training, decode and profiled steps
    too (the compiled part's as its eager steps) - against every worker of the warm-up."""
    pytest.importorskip("triton")
    import gpu_check

    parts = gpu_check.parse_args(["--out", "x"]).parts.split(",")
    _assert_warmed(*_parts_and_workers(monkeypatch, parts, (*gpu_check.WARMED_MODELS, *gpu_check.KERNEL_WORKERS)))


@pytest.mark.slow  # (about three minutes: each part alone, on fresh models, then each worker)
def test_each_parts_own_warm_up_workers_compile_every_specialisation_it_launches(monkeypatch):
    """A run of some parts starts only their workers (:data:`gpu_check.WARM_UP_OF_PART`): each
    part run alone, as a follow-up runs it (fresh models), launches no specialisation its
    workers miss."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    import gpu_check

    launched = _gpu_run_recorded(monkeypatch)
    z, clock, by_part, by_worker = gpu_check.Sizes(), _OnceClock(), {}, {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        for part in _all_parts():
            models = gpu_check.build_models(z, "cuda") if part not in gpu_check.MODEL_FREE_PARTS else {}
            gpu_check.run_part(part, z, clock, models, "cuda", {}, {})
            by_part[part], models = set(launched), None
            launched.clear()
        for what in gpu_check.warm_up_workers(_all_parts(), {}):
            assert gpu_check.warm_up_worker(what, z, "cuda") == 0
            by_worker[what] = set(launched)
            launched.clear()
    for part in _all_parts():
        _assert_warmed(by_part[part], set().union(*(by_worker[w] for w in gpu_check.warm_up_workers([part], {}))))


def _documented_commands(script: str = "benchmarks/gpu_check.py") -> list[tuple[str, list[str]]]:
    """Every ``SCRIPT ...`` command line docs/kernels.md and README.md quote
    (in code spans, which may run over lines, and code blocks), and every code span of the
    prepared check's section made of gpu_check.py's flags alone (a follow-up's flags):
    ``(as quoted, its arguments)``, ``$OUT`` standing for the lent machine's directory and
    any other variable set in the same line (pasted as quoted, the line runs with it). The
    arguments end where the shell line does (``&&``, ``|``, ``;``, ``2>&1``, a comment)."""
    import re
    import shlex

    found = []
    for doc in (ROOT / "docs" / "kernels.md", ROOT / "README.md"):
        text = doc.read_text()
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
        spans = re.findall(r"(?<!`)`([^`]+)`(?!`)", re.sub(r"```.*?```", "", text, flags=re.S))
        section = text.split("## The prepared GPU check", 1)[-1].split("\n## ", 1)[0] if doc.name == "kernels.md" else ""
        pieces = [line for block in blocks for line in block.splitlines()] + spans
        for piece in pieces:
            piece = " ".join(piece.split())
            if script in piece and piece != script:  # (not its name alone)
                rest = piece.split(script, 1)[1]
            elif script.endswith("gpu_check.py") and piece.startswith("--") and f"`{piece}`" in " ".join(section.split()):
                rest = piece
            else:
                continue
            rest = re.split(r"\s(?:&&|\|\|?|;|2>&1|#)\s?", rest + " ", maxsplit=1)[0]
            before = piece[:piece.find(rest)] if rest.strip() else piece
            for name in set(re.findall(r"\$(\w+)", rest)) - {"OUT"}:  # ($OUT is the lent machine's)
                assert re.search(rf"(^|\s){name}=\S", before), f"`{piece}`: ${name} is set nowhere in it"
                rest = rest.replace(f"${name}", f"/tmp/{name}")
            found.append((piece, shlex.split(rest.replace("$OUT", "/tmp/OUT"))))
    return found


#: What the docs quote as refused: the warm-up workers' command line until 2026-12-05.
REFUSED_AS_DOCUMENTED = {"--out /dev/null"}


def test_every_command_line_the_docs_quote_is_one_the_script_takes(tmp_path, capsys):
    """A session lent a GPU for minutes runs docs/kernels.md's prepared check and follow-ups as
    written: each flag must be the script's, each ``--parts`` name a part and each ``--force``
    a launch setting, or the device time goes to argparse's error. The flags alone that the
    docs quote are parsed with an ``--out``; a placeholder (``SETTING=VALUE``) is not checked."""
    import re

    import gpu_check
    from attnres.ops.depth_attention import triton_impl

    commands = _documented_commands()
    assert len(commands) >= 8 and any("--continue" in args for _, args in commands)
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--help"])
    flags = set(re.findall(r"--[a-z0-9-]+", capsys.readouterr().out))
    for quoted, args in commands:
        if quoted in REFUSED_AS_DOCUMENTED:
            continue
        if len(args) == 1 and args[0].startswith("--"):  # (a flag named in prose: one of the script's)
            assert args[0] in flags, f"`{quoted}`: the script has no such flag"
            continue
        if not any(a in args for a in ("--out", "--source-digest")):
            args = ["--out", str(tmp_path), *args]
        try:
            parsed = gpu_check.parse_args(args)
        except SystemExit:
            pytest.fail(f"the script's parser refuses the documented `{quoted}`")
        unknown = set(parsed.parts.split(",")) - set(gpu_check.MIN_SECONDS)
        assert not unknown, f"`{quoted}`: no such part {sorted(unknown)}"
        for setting in parsed.force:
            name = setting.partition("=")[0]
            assert name == "SETTING" or name in triton_impl.FORCED, f"`{quoted}`: no launch setting {name!r}"


def test_a_continued_part_is_no_longer_named_skipped_or_failed(monkeypatch, tmp_path):
    """docs/kernels.md's follow-up 5 reruns the parts the prepared run skipped for its budget
    with ``--continue`` into the same files, and says to read ``skipped`` and ``errors`` for
    what to rerun: a part run again must leave what the earlier run said of it (skipped, its
    models dropped, failed, its pieces' failures), which still named ``train_bf16`` and
    ``profile`` skipped after they ran. Other parts' entries stay."""
    import gpu_check

    _fake_gpu(monkeypatch, gpu_check, lambda part, *args: {"ran": part})
    earlier = {"command": "PYTHONPATH=src python benchmarks/gpu_check.py --out OUT", "device": "a faked GPU",
               "elapsed_s": 400.0, "decode": {},
               "skipped": {"train_bf16": "25 s of the 440 s budget left", "train_compiled full": "170 s left",
                           "profile": "25 s of the 440 s budget left", "profile_decode": "10 s left"},
               "errors": {"profile": "Traceback: the profiler broke", "train_compiled.profile": "Traceback",
                          "decode": "Traceback: decode broke", "copy": "Traceback: no copy"}}
    (tmp_path / "gpu_check.json").write_text(json.dumps(earlier))
    argv = ["--out", str(tmp_path), "--continue", "--no-peers", "--parts", "train_bf16,profile,train_compiled",
            "--budget", "440"]
    assert gpu_check.main(argv) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["train_bf16"] == {"ran": "train_bf16"} and result["profile"] == {"ran": "profile"}
    assert result["skipped"] == {"profile_decode": "10 s left"}
    assert set(result["errors"]) == {"decode", "copy"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["skipped"] == {"profile_decode": "10 s left"} and summary["errors"] == ["copy", "decode"]


def test_every_gpu_benchmark_command_line_the_docs_quote_is_one_it_takes():
    """docs/kernels.md's "GPU benchmark" is followed as written on a lent GPU too: each
    ``benchmarks/bench_kernels_gpu.py`` command line it quotes passes that script's parser."""
    import bench_kernels_gpu

    commands = _documented_commands("benchmarks/bench_kernels_gpu.py")
    assert len(commands) >= 4 and any("--out" in args for _, args in commands)
    for quoted, args in commands:
        try:
            bench_kernels_gpu.parse_args(args)
        except SystemExit:
            pytest.fail(f"bench_kernels_gpu.py's parser refuses the documented `{quoted}`")


def test_each_sweep_rows_setting_is_one_force_takes(monkeypatch):
    """docs/kernels.md's follow-up 3 reads ``SETTING=VALUE`` off a row of the sweep's table
    (``op@SETTING=VALUE``, a bool as Python writes it) into ``--force``: each must be taken."""
    import gpu_check
    from attnres.ops.depth_attention import triton_impl

    class Clock:
        def replayed(self, fn, repeats):
            return 1e-6

    calls = {name: None for _, names in gpu_check.SWEEPS.values() for name in names}
    rows = gpu_check.sweep(gpu_check.SMOKE, Clock(), "cuda", calls, dict.fromkeys(calls, 1e5), 1e11)
    assert rows.pop("errors") == {}  # (the part's failed rows, filed by run_one_part)
    settings = {row.split("@", 1)[1] for row in rows} - {"default"}
    assert len(settings) == sum(len(values) for values, _ in gpu_check.SWEEPS.values())
    monkeypatch.setattr(triton_impl, "FORCED", dict.fromkeys(triton_impl.FORCED))
    for text in settings:
        name, _, value = text.partition("=")
        assert gpu_check.apply_force([text]) == {name: triton_impl.FORCED[name]}, text
        assert str(triton_impl.FORCED[name]) == value  # (the value the row was timed at)


def test_a_decode_batch_that_loses_the_device_keeps_the_batches_measured_before(monkeypatch, tmp_path):
    """Batch 8's graph capture losing the device (a sticky fault) made ``runnable`` raise, and
    the decode part lost its batch-1 rows with it. The part returns them, the failure recorded
    under its ``errors``; its models' weights, not restored on the lost device, are left; the
    parts after it run in a fresh process, as after a sweep that lost the device."""
    pytest.importorskip("triton")
    import gpu_check

    lost = []

    def decode_steps(model, batch, z, device, dtype, mode, tokens):
        def graphed():
            if batch == 8:
                lost.append(batch)
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

        return {"eager": lambda: None, "graphed": graphed}

    class Unrestorable(torch.nn.Linear):  # (its weights back in float32: a kernel on the lost device)
        def float(self):
            if lost:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return super().float()

    monkeypatch.setattr(gpu_check, "decode_steps", decode_steps)
    models = {"standard": Unrestorable(2, 2)}
    ran = []

    def run_part(part, z, clock, *args):
        ran.append(part)
        if part != "decode":
            return {}
        return gpu_check.part_decode(z, gpu_check.Clock("cpu", strict=False), models, "cpu")  # (a GPU's clock)

    argv, execs = _run_losing_the_device(monkeypatch, gpu_check, run_part, tmp_path)
    assert ran == ["profile", "decode"] and len(execs) == 1
    assert gpu_check.parse_args(execs[0][2:]).parts == "profile_decode"
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(result["decode"]) == {"b1"} and set(result["decode"]["b1"]) == {"eager", "graphed"}
    said = result["errors"]["decode.b8 standard|graphed"]
    assert "illegal memory access" in said and "context was lost" in said and "decode" not in result["errors"]
    # (the smoke's clock is strict: there the failure fails the part, as before)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        gpu_check.part_decode(gpu_check.SMOKE, gpu_check.Clock("cpu"), {"standard": torch.nn.Linear(2, 2)}, "cpu")


def _losing_the_device_at(monkeypatch, gpu_check) -> list:
    """The device lost once a step has failed with a sticky fault (appended to the list
    returned) - on the CPU, with a GPU's lenient clock."""
    lost = []
    monkeypatch.setattr(gpu_check, "device_usable", lambda device: not lost)
    return lost


def test_an_option_that_loses_the_device_at_its_first_run_keeps_the_eager_targets_rows(monkeypatch):
    """Every step of the eager part made its first run before any timing: an option's step
    (the bf16 stream: none has run on a GPU yet) that lost the device there (a sticky fault)
    left nothing to time, and the part failed, the standard model's and Block's rows - the
    training and memory targets' - lost with it. Their steps now run, are timed and their
    memory measured first; the part returns their rows with the failure recorded (the parts
    after it run in a fresh process: ``run_one_part``)."""
    pytest.importorskip("triton")
    import gpu_check

    lost = _losing_the_device_at(monkeypatch, gpu_check)

    def losing(model, on):
        if on:
            lost.append(model)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return False

    monkeypatch.setitem(gpu_check.MODEL_OPTIONS, "autocast_stream", losing)
    models = gpu_check.build_models(gpu_check.SMOKE, "cpu")
    lenient = gpu_check.Clock("cpu", strict=False)  # (a GPU's clock)
    eager = gpu_check.part_train(gpu_check.SMOKE, lenient, models, "cpu", compiled=False, paired=True)
    assert list(eager["ms"]) == ["standard", "block"] and len(lost) == 1
    assert set(eager["peak_memory_MiB"]) == set(eager["kept_MiB"]) == {"standard", "block"}  # (the memory target's)
    assert set(eager["errors"]) == {"standard (bf16 stream)"}
    assert "illegal memory access" in eager["errors"]["standard (bf16 stream)"]


def test_phase1_in_one_kernel_losing_the_device_at_its_first_run_keeps_every_batchs_targets_rows(monkeypatch):
    """As in the eager part: Block's decode step with Phase 1 in one kernel (not run on a GPU
    yet) losing the device at its first run at batch 1 lost that batch's rows - the decode
    target's - and, run before batch 8's, those too. The standard model's and Block's steps
    of every batch are run and timed first: their rows are kept, the failure recorded, and
    the part ends there (until 2026-12-07 batch 8's targets came after batch 1's other steps)."""
    pytest.importorskip("triton")
    import gpu_check

    lost = _losing_the_device_at(monkeypatch, gpu_check)

    @contextlib.contextmanager
    def losing_kernel():
        lost.append("one kernel")
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
        yield

    monkeypatch.setattr(gpu_check, "phase1_in_one_kernel", losing_kernel)
    models = gpu_check.build_models(gpu_check.SMOKE, "cpu")
    decode = gpu_check.part_decode(gpu_check.SMOKE, gpu_check.Clock("cpu", strict=False), models, "cpu")
    assert set(decode) == {"b1", "b8", "errors"} and len(lost) == 1
    for batch in ("b1", "b8"):
        assert {mode: set(rows) for mode, rows in decode[batch].items()} == {"eager": {"standard", "block"},
                                                                            "graphed": {"standard", "block"}}
    assert set(decode["errors"]) == {f"b1 {gpu_check.ONE_KERNEL}|graphed"}


def test_a_step_timed_after_the_targets_keeps_its_ratio_to_the_standard_model_of_its_own_rounds():
    """The steps timed after the targets' (Full, the options', Phase 1 in one kernel) are
    timed beside the standard model's step again, and their rows scaled to its first timing:
    each ratio to it is that of their shared rounds (the summary's ratios by name), not one
    across two timings the device drifted between."""
    import gpu_check

    class Clock:
        def __init__(self, drift):
            self.drift = drift

        def interleaved(self, steps, repeats):
            return {k: self.drift * step() for k, step in steps.items()}

    steps = {"standard|graphed": lambda: 2.0, "block|graphed": lambda: 2.2, "full|graphed": lambda: 3.0,
             "full|eager": lambda: 5.0}  # (no standard eager step: Full's eager one timed as it is)

    def reference_of(key):
        return "standard|" + key.split("|")[1]

    targets, others = gpu_check.targets_first(steps, lambda key: key.split("|")[0])
    assert list(targets) == ["standard|graphed", "block|graphed"] and list(others) == ["full|graphed", "full|eager"]
    first = gpu_check.timed_beside(Clock(1.0), targets, targets, {}, reference_of, 3)
    assert first == {"standard|graphed": 2.0, "block|graphed": 2.2}
    later = gpu_check.timed_beside(Clock(2.0), others, targets, first, reference_of, 3)  # (the device twice as slow)
    assert later == pytest.approx({"full|graphed": 3.0, "full|eager": 10.0})


ILLEGAL = "CUDA error: an illegal memory access was encountered"


def _dying_train_steps(monkeypatch, gpu_check, lost: list, losing) -> None:
    """The training steps of a device lost (``lost`` not empty) once ``losing(name, calls)``
    says so at a step's call: that call and every step's after it raise a sticky fault."""
    made = gpu_check.train_steps

    def train_steps(models, ids, device, compiled=False):
        def dying(name, step):
            calls = []

            def run():
                calls.append(name)
                if not lost and losing(name, len(calls)):
                    lost.append(name)
                if lost:
                    raise RuntimeError(ILLEGAL)
                step()

            return run

        return {name: dying(name, step) for name, step in made(models, ids, device, compiled).items()}

    monkeypatch.setattr(gpu_check, "train_steps", train_steps)


def test_full_losing_the_device_at_its_compile_keeps_the_compiled_targets_rows(monkeypatch):
    """The compiled part compiled the standard model, Block and Full (each first run
    unprotected) before any timing: Full's compile losing the device (a sticky fault) lost the
    minutes of compiling before it and the compiled training target's rows. The standard
    model and Block are compiled, timed and profiled first, then Full compiled and timed
    beside the standard model: its loss is recorded, their rows kept."""
    pytest.importorskip("triton")
    import gpu_check

    lost = _losing_the_device_at(monkeypatch, gpu_check)
    _dying_train_steps(monkeypatch, gpu_check, lost, lambda name, calls: name == "full")
    timed = []
    lenient = gpu_check.Clock("cpu", strict=False)  # (a GPU's clock)
    interleaved = lenient.interleaved
    monkeypatch.setattr(lenient, "interleaved", lambda steps, repeats: timed.append(list(steps)) or interleaved(
        steps, repeats))
    models = gpu_check.build_models(gpu_check.SMOKE, "cpu")
    compiled = gpu_check.part_train(gpu_check.SMOKE, lenient, models, "cpu", compiled=True)
    assert timed == [["standard", "block"]] and lost == ["full"]
    assert list(compiled["ms"]) == list(compiled["compile_s"]) == ["standard", "block"]
    assert set(compiled["profile"]) == {"standard", "block"}
    assert set(compiled["errors"]) == {"full"} and ILLEGAL in compiled["errors"]["full"]


def test_the_compiled_parts_targets_rows_are_in_the_files_before_fulls_compile(monkeypatch, tmp_path):
    """The files were written before and after each part only: a run its time limit killed in
    the compiled part - Full's compile, the last of minutes of compiling, running past the
    deadline - lost the compiled targets' rows measured before it. A part hands its rows as
    it measures each group (:meth:`Clock.measured`: the compiled part's targets before Full's
    compile, the eager part's, decode's batch 1), and the run writes them, filed as at the
    part's end and still naming it running."""
    import gpu_check

    seen = []
    lenient = gpu_check.Clock("cpu", strict=False)  # (a GPU's clock)
    lenient.on_measured = lambda rows: seen.append(json.loads(json.dumps(rows, default=str)))
    models = gpu_check.build_models(gpu_check.SMOKE, "cpu")
    gpu_check.part_train(gpu_check.SMOKE, lenient, models, "cpu", compiled=True)
    # (each group's timings before its profile, then with it: a kill in the targets' profile
    # step kept nothing of the compiled part before 2026-12-07's second session)
    assert [set(rows["ms"]) for rows in seen] == [{"standard", "block"}] * 2 + [{"standard", "block", "full"}] * 2
    assert set(seen[0]["compile_s"]) == {"standard", "block"} and not seen[0]["profile"]
    assert set(seen[1]["profile"]) == {"standard", "block"}
    seen.clear()
    gpu_check.part_decode(gpu_check.SMOKE, lenient, models, "cpu")
    assert [sorted(rows) for rows in seen] == [["b1", "errors"], *[["b1", "b8", "errors"]] * 3]

    in_files = {}

    def run_part(part, z, clock, *args):  # (the rows of the targets' group, then killed in Full's compile)
        clock.measured({"errors": {"profile": "a traceback"}, "dropped": {}, "compile_s": {"standard": 1.0},
                        "warm_up_s": 1.0, "ms": {"standard": 100.0, "block": 103.0}, "profile": {}})
        in_files.update(summary=json.loads((tmp_path / "summary.json").read_text()),
                        md=(tmp_path / "gpu_check.md").read_text())
        raise KeyboardInterrupt

    _fake_gpu(monkeypatch, gpu_check, run_part)
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(["--out", str(tmp_path), "--no-peers", "--parts", "train_compiled"])
    summary = in_files["summary"]
    assert summary["train_compiled"] == pytest.approx(1.03) and summary["met"]["train_compiled"]
    assert summary["running"]["part"] == "train_compiled" and summary["errors"] == ["train_compiled.profile"]
    assert "## train_compiled" in in_files["md"] and "Still running train_compiled" in in_files["md"]


def test_rows_measured_before_a_part_fails_stay_in_the_files(monkeypatch, tmp_path):
    """A part that raised after handing its rows so far (:meth:`Clock.measured`: the compiled
    targets, then Full's compile failing outside its pieces - an out-of-memory while building
    its step) had them in the files until the part's end wrote the run again without them:
    only the traceback was left. They stay filed, beside the part's failure."""
    import gpu_check

    def run_part(part, z, clock, *args):
        clock.measured({"errors": {}, "dropped": {}, "compile_s": {"standard": 1.0, "block": 1.0},
                        "warm_up_s": 1.0, "ms": {"standard": 100.0, "block": 103.0}, "profile": {}})
        raise RuntimeError("CUDA out of memory (building Full's compiled step)")

    _fake_gpu(monkeypatch, gpu_check, run_part)
    gpu_check.main(["--out", str(tmp_path), "--no-peers", "--parts", "train_compiled"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["train_compiled"] == pytest.approx(1.03) and "running" not in summary
    assert summary["errors"] == ["train_compiled"]
    run = json.loads((tmp_path / "gpu_check.json").read_text())
    assert run["train_compiled"]["ms"] == {"standard": 100.0, "block": 103.0}
    assert "CUDA out of memory" in run["errors"]["train_compiled"]


def test_rows_so_far_that_cannot_be_written_keep_the_part_going(monkeypatch):
    """Writing a part's rows so far (:meth:`Clock.measured`) that fails - a full disk - is
    said in the log and the part measures on (its end writes them again): on a GPU's clock
    it does not fail the part, whose rows would be lost with it; on the smoke's it raises."""
    import gpu_check

    def full_disk(rows):
        raise OSError(28, "No space left on device")

    models = {"standard": torch.nn.Linear(2, 2)}
    monkeypatch.setattr(gpu_check, "decode_steps", lambda *args: {"eager": lambda: None, "graphed": lambda: None})
    lenient = gpu_check.Clock("cpu", strict=False)  # (a GPU's clock)
    lenient.on_measured = full_disk
    decode = gpu_check.part_decode(gpu_check.SMOKE, lenient, models, "cpu")
    assert set(decode) == {"b1", "b8", "errors"} and not decode["errors"]
    strict = gpu_check.Clock("cpu")
    strict.on_measured = full_disk
    with pytest.raises(OSError):
        gpu_check.part_decode(gpu_check.SMOKE, strict, models, "cpu")


def test_full_compiled_after_the_targets_timing_is_timed_beside_the_standard_model_within_the_deadline(monkeypatch):
    """Full's compile, now after the targets' timing, is still held to the deadline with the
    slowest compile before it (the standard model's, Block's): dropped, and said why, where it
    no longer fits; compiled and timed beside the standard model where it does."""
    import gpu_check

    now = [0.0]
    monkeypatch.setattr(gpu_check, "time", type("T", (), {"perf_counter": staticmethod(lambda: now[0])}))
    monkeypatch.setattr(gpu_check, "COMPILE_S", 50)
    monkeypatch.setattr(gpu_check, "COMPILED_TIMING_S", 20)
    monkeypatch.setattr(gpu_check, "profiled", lambda step, device, top: {})

    def compiling(name):
        compiled = []

        def step():
            if not compiled:
                compiled.append(name)
                now[0] += 60
        return step

    class Clock(gpu_check.Clock):
        def interleaved(self, steps, repeats):
            timed.append(list(steps))
            return {k: 1.0 for k in steps}

    for deadline, full in ((212.0, True), (211.0, False)):
        now[0], timed = 0.0, []
        steps = {name: compiling(name) for name in ("standard", "block", "full")}
        monkeypatch.setattr(gpu_check, "train_steps", lambda *args, **kwargs: steps)
        result = gpu_check.part_train(gpu_check.SMOKE, Clock("cpu", deadline=deadline), {}, "cpu", compiled=True)
        assert result["compile_s"] == {"standard": 60, "block": 60, **({"full": 60} if full else {})}
        assert timed == [["standard", "block"], ["standard", "full"] if full else []]
        assert list(result["ms"]) == ["standard", "block", *(["full"] if full else [])]
        assert full != ("full" in result["dropped"]) and not result["errors"]


def test_a_step_that_loses_the_device_in_its_timing_rounds_keeps_the_targets_rows(monkeypatch):
    """A step that ran once but lost the device in its timing rounds (not its first run)
    failed the whole part, with it the targets' rows measured before: the eager part's, the
    compiled part's, and decode's earlier batches. The loss is recorded under ``timing`` and
    the steps timed then; the rows before it are kept."""
    pytest.importorskip("triton")
    import gpu_check

    lost = _losing_the_device_at(monkeypatch, gpu_check)
    _dying_train_steps(monkeypatch, gpu_check, lost, lambda name, calls: name == "full" and calls > 1)
    models = gpu_check.build_models(gpu_check.SMOKE, "cpu")
    lenient = gpu_check.Clock("cpu", strict=False)  # (a GPU's clock)
    eager = gpu_check.part_train(gpu_check.SMOKE, lenient, models, "cpu", compiled=False)
    others = f"timing full, {gpu_check.SUMS_KEPT}"
    assert list(eager["ms"]) == ["standard", "block"] and lost == ["full"]
    assert set(eager["peak_memory_MiB"]) == set(eager["kept_MiB"]) == {"standard", "block"}
    assert set(eager["errors"]) == {others} and ILLEGAL in eager["errors"][others]
    lost.clear()
    compiled = gpu_check.part_train(gpu_check.SMOKE, lenient, models, "cpu", compiled=True)
    assert list(compiled["ms"]) == ["standard", "block"] and set(compiled["compile_s"]) == {"standard", "block", "full"}
    assert set(compiled["errors"]) == {"timing full"}

    def decode_steps(model, batch, z, device, dtype, mode, tokens):
        calls = []

        def graphed():
            calls.append(batch)
            if batch == 8 and len(calls) > 1:
                lost.append(batch)
                raise RuntimeError(ILLEGAL)

        return {"eager": lambda: None, "graphed": graphed}

    monkeypatch.setattr(gpu_check, "decode_steps", decode_steps)
    lost.clear()
    decode = gpu_check.part_decode(gpu_check.SMOKE, lenient, {"standard": torch.nn.Linear(2, 2)}, "cpu")
    assert set(decode) == {"b1", "errors"} and set(decode["b1"]) == {"eager", "graphed"}
    assert set(decode["errors"]) == {"b8 timing standard|eager, standard|graphed"}


def test_the_targets_memory_losing_the_device_ends_the_eager_part_there(monkeypatch):
    """Block's memory losing the device (a sticky fault) left the part going on: the
    standard model's kept bytes and Full's first run failed next on the dead device, each
    recorded as if its own fault. The part ends at the loss, recorded as Block's memory's,
    the rows before it kept."""
    pytest.importorskip("triton")
    import gpu_check

    lost = _losing_the_device_at(monkeypatch, gpu_check)
    _dying_train_steps(monkeypatch, gpu_check, lost, lambda name, calls: False)
    measured = []

    def peak_memory(step, device):
        measured.append(step)
        if len(measured) == 2:  # (Block's, after the standard model's)
            lost.append("block")
        if lost:
            raise RuntimeError(ILLEGAL)
        return 1

    def kept_bytes(forward, device):
        if lost:
            raise RuntimeError(ILLEGAL)
        return 1

    monkeypatch.setattr(gpu_check, "peak_memory", peak_memory)
    monkeypatch.setattr(gpu_check, "kept_bytes", kept_bytes)
    models = gpu_check.build_models(gpu_check.SMOKE, "cpu")
    eager = gpu_check.part_train(gpu_check.SMOKE, gpu_check.Clock("cpu", strict=False), models, "cpu",
                                 compiled=False, paired=True)
    assert list(eager["ms"]) == ["standard", "block"] and list(eager["peak_memory_MiB"]) == ["standard"]
    assert set(eager["errors"]) == {"peak_memory block"} and ILLEGAL in eager["errors"]["peak_memory block"]


def test_the_eager_parts_least_time_covers_its_steps_at_the_measured_step_times(monkeypatch):
    """``MIN_SECONDS["train_eager"]`` (40 s, set for three models' steps timed together) fell
    short of what the part now runs: the targets' rounds, then seven other steps' first runs,
    rounds beside the standard model's step again, and each step's memory. The part's calls
    of each model's step (an option's step calls its model's), counted on the CPU with a GPU's
    memory pieces (a step, a forward: about a third of one), weighed by the H200's step
    times (benchmarks/results/gpu-h200: standard, Block, Full) plus that run's first-step
    overhead (its warm-up less its three steps), on an H100 (its standard step over the
    H200's: benchmarks/results/gpu-h100), fit within it."""
    import gpu_check

    measured = json.loads((ROOT / "benchmarks/results/gpu-h200/gpu_check.json").read_text())["train_eager"]
    h100 = json.loads((ROOT / "benchmarks/results/gpu-h100/kernels_gpu_e2e.json").read_text())["e2e"]["train"]
    step_s = {name: ms / 1e3 for name, ms in measured["ms"].items()}
    overhead = measured["warm_up_s"] - sum(step_s.values())
    calls = {"step": [], "forward": []}

    def counted(kind, name):
        return lambda: calls[kind].append(name) or 1

    def train_steps(models, ids, device, compiled=False):
        return {name: counted("step", name) for name in models}

    def forward_of(model, ids, device):
        return counted("forward", next(k for k, m in models.items() if m is model))

    monkeypatch.setattr(gpu_check, "train_steps", train_steps)
    monkeypatch.setattr(gpu_check, "forward_of", forward_of)
    monkeypatch.setattr(gpu_check, "peak_memory", lambda step, device: step())  # (as on a GPU: one step)
    monkeypatch.setattr(gpu_check, "kept_bytes", lambda forward, device: forward())
    models = gpu_check.build_models(gpu_check.SMOKE, "cpu")
    z = gpu_check.replace(gpu_check.SMOKE, repeats=gpu_check.Sizes().repeats)
    eager = gpu_check.part_train(z, gpu_check.Clock("cpu"), models, "cpu", compiled=False, paired=True)
    assert len(eager["ms"]) == 9 and not eager["errors"]
    h200_s = overhead + sum(step_s[n] for n in calls["step"]) + sum(step_s[n] / 3 for n in calls["forward"])
    assert gpu_check.MIN_SECONDS["train_eager"] >= h200_s * h100["standard"] / step_s["standard"]
