"""``attnres train`` over the ``(pp, dp, tp)`` mesh: pipeline (torch's schedules,
with and without the cross-stage cache), tensor parallel, FSDP2 over dp and their
combinations, against single-process training; sharded (DCP) checkpoints that resume at
another layout; a rank killed with SIGKILL under pp=2; config errors.

Everything runs on CPU with gloo (this file run as a script is the worker: one launch trains
a list of runs, the process group reused). Model: 4 transformer blocks, d=32, sequences of
16 tokens, batch 4, 10 steps of AdamW on a real (byte-tokenised) corpus, checkpoints every 5.

Tolerance (measured, then bounded): with Block AttnRes, every layout here matched
single-process training within 4.9e-6 relative error per tensor on the final weights and 3e-7
on every step's loss and gradient norm (the sums run in another order: micro-batches, reduce-scatters, the
sequence-sharded norms). The bound is 1e-5, the issue's. A gradient lost or counted twice,
or a stage training on the wrong rows, gives errors of 1e-3 and more (a tp-Partial gradient
left unreduced gave 5e-4 on the weights and 4e-5 on the first step's gradient norm).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors")

from conftest import tensor_errors  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from attnres.train import load_config, train  # noqa: E402
from attnres.checkpoint import checkpoint_path, latest_checkpoint, read_checkpoint_state  # noqa: E402
from attnres.checkpoint import consolidate  # noqa: E402

TOL = 1e-5
STEPS = 10
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every daft zebra".split()
RESIDUALS = {
    "standard": {"model.residual": "standard"},
    "block": {"model.residual.kind": "attnres_block", "model.residual.block_size": 4},
    "full": {"model.residual.kind": "attnres_full"},
}
PP = {"parallel.pp": 2}
# name -> (ranks, overrides)
LAYOUTS = {
    "pp2-gpipe": (2, {**PP, "parallel.pp_schedule": "gpipe"}),
    "pp2-1f1b": (2, {**PP, "parallel.pp_schedule": "1f1b"}),
    "pp2-gpipe-v2": (2, {**PP, "parallel.pp_schedule": "gpipe", "parallel.pp_virtual": 2}),
    "pp2-gpipe-v2-cache": (2, {**PP, "parallel.pp_schedule": "gpipe", "parallel.pp_virtual": 2, "parallel.pp_cache": "true"}),
    "pp2-interleaved": (2, {**PP, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual": 2}),
    "pp2-interleaved-cache": (2, {**PP, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_virtual": 2,
                                  "parallel.pp_cache": "true"}),
    "tp2": (2, {"parallel.tp": 2}),
    "dp2-pp2": (4, {**PP, "parallel.dp": 2}),
    "dp2-tp2": (4, {"parallel.tp": 2, "parallel.dp": 2}),
    "tp2-pp2": (4, {**PP, "parallel.tp": 2}),
}


def write_corpus(path: Path) -> Path:
    rng = np.random.default_rng(0)
    lines = [" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=12)) + "." for _ in range(400)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_args(corpus: Path, out: Path, **extra) -> list[str]:
    base = {"model": "tiny", "model.d_model": 32, "model.n_layers": 4, "model.tie_embeddings": "false",
            # val_fraction 1/12: the split (and so the batches) these runs were first measured on
            "data.paths": f"[{corpus}]", "data.tokenizer": "byte", "data.val_fraction": 0.0833, "seq_len": 16,
            "batch_size": 4, "steps": STEPS,
            "warmup_steps": 2, "out_dir": str(out), "progress": "false", "tensorboard": "false", "eval_every": 5,
            "eval_batches": 2, "log_every": 1, "diagnostics_every": 100, "checkpoint_every": 5}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


# -- the worker ---------------------------------------------------------------------------

def worker(root: Path, runs: list[list]) -> None:
    """``runs``: ``[out_dir name, overrides, resume_at]``: train to ``resume_at`` (stop_after),
    then resume in the same layout to the end; ``resume_at`` 0: straight through. A run
    named ``kill``: rank 1 SIGKILLs itself at its 8th batch."""
    torch.set_num_threads(1)
    corpus = root / "corpus.txt"
    for name, extra, resume_at in runs:
        if name == "kill" and os.environ["RANK"] == "1":
            from attnres.data import BatchSampler

            next_batch, calls = BatchSampler.next_batch, []

            def killing_next_batch(self):
                calls.append(1)
                if len(calls) == 8:
                    (root / "killed.txt").write_text(str(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                return next_batch(self)

            BatchSampler.next_batch = killing_next_batch
        if resume_at:
            train(load_config(None, run_args(corpus, root / name, stop_after=resume_at, **extra)))
            train(load_config(None, run_args(corpus, root / name, resume="true", **extra)))
        else:
            train(load_config(None, run_args(corpus, root / name, **extra)))
        # (nothing of the run's model outlives train: FSDP2 keeps a sharded one in reference
        # cycles, otherwise released only while the interpreter shuts down; the classes are
        # ours - torch.compile's caches keep graph modules of their own)
        alive = {t.__name__ for t in map(type, gc.get_objects())
                 if issubclass(t, torch.nn.Module) and t.__module__.startswith("attnres.")}
        assert not alive, f"{name}: modules alive after train returned: {sorted(alive)}"


def launch(root: Path, n: int, runs: list[list], timeout: float = 600) -> None:
    from attnres.distributed.local_spawn import run_local

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {"PYTHONPATH": os.pathsep.join([src, str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    run_local([__file__, str(root), json.dumps(runs)], n, timeout, env=env)


def reference(root: Path, name: str, **extra) -> Path:
    """A single-process run, once per root."""
    out = root / name
    if latest_checkpoint(out) is None:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            train(load_config(None, run_args(root / "corpus.txt", out, **extra)))
        finally:
            torch.set_num_threads(before)
    return out


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    """The model weights of checkpoint ``step`` (a sharded one consolidated first)."""
    path = checkpoint_path(run, step)
    if read_checkpoint_state(path).get("layout") == "dcp":
        return load_file(str(consolidate(path, run)))
    return load_file(str(path / "model.safetensors"))


def assert_matches(got: Path, want: Path, step: int = STEPS) -> tuple[float, float]:
    """Final weights, and every logged step's loss and gradient norm, within TOL; returns
    the largest errors (weights, per-step)."""
    a, b = weights(got, step), weights(want, step)
    assert a.keys() == b.keys()
    keys = sorted(a)
    errs = tensor_errors([a[k] for k in keys], [b[k] for k in keys])
    worst = max(zip(errs, keys))
    assert worst[0] <= TOL, f"{got.name}: {worst[1]} relative error {worst[0]:.2e} > {TOL}"

    def logged(run: Path) -> list[tuple[int, float, float]]:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r["grad_norm"]) for r in records if r["kind"] == "train"]

    la, lb = logged(got), logged(want)
    assert [s for s, _, _ in la] == [s for s, _, _ in lb] == list(range(1, step + 1))
    step_err = 0.0
    for (s, x, gx), (_, y, gy) in zip(la, lb):
        step_err = max(step_err, abs(x - y) / abs(y), abs(gx - gy) / abs(gy))
    assert step_err <= TOL, f"{got.name}: loss or gradient norm off by {step_err:.2e}"
    print(f"{got.name}: weights {worst[0]:.1e}, loss/grad-norm per step {step_err:.1e}")
    return worst[0], step_err


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mesh")
    write_corpus(root / "corpus.txt")
    return root


# -- default suite: pipeline with the cache, resumed in one process -------------------------

def test_pipeline_cached_matches_and_resumes_in_one_process(root):
    """``parallel.pp=2`` on torch's interleaved 1F1B schedule with the cross-stage cache,
    Block AttnRes, trains as one process does; its sharded step-5 checkpoint resumes in one
    process (``pp=2 -> pp=1``) and ends where uninterrupted single-process training ends;
    each stage holds only its parameters."""
    ref = reference(root, "ref-block", **RESIDUALS["block"])
    _, extra = LAYOUTS["pp2-interleaved-cache"]
    launch(root, 2, [["pp2", {**RESIDUALS["block"], **extra}, 0]])
    assert_matches(root / "pp2", ref)
    state = read_checkpoint_state(checkpoint_path(root / "pp2", 5))
    assert state["layout"] == "dcp" and any(f.startswith("dcp/") for f in state["files"])
    out = root / "pp2-to-1"
    shutil.copytree(root / "pp2", out)
    shutil.rmtree(checkpoint_path(out, STEPS))
    train(load_config(None, run_args(root / "corpus.txt", out, resume="true", **RESIDUALS["block"])))
    assert_matches(out, ref)


def test_fsdp_data_parallel_writes_sharded_checkpoints(root):
    """A plain 2-rank launch (no ``parallel.*``: every rank data parallel, FSDP2) writes DCP
    checkpoints (each rank its shards, no consolidated files), matches one process, and its
    step-5 checkpoint resumes in one process; a consolidated single-process checkpoint
    resumes on 2 FSDP2 ranks; generation's loader reads the DCP checkpoint directly."""
    block = RESIDUALS["block"]
    ref = reference(root, "ref-block", **block)
    fsdp = dict(block)
    _resume_copy(root, "ref-block", "cons-to-fsdp")
    launch(root, 2, [["fsdp", fsdp, 0], ["cons-to-fsdp", {**fsdp, "resume": "true"}, 0]])
    for step in (5, STEPS):
        state = read_checkpoint_state(checkpoint_path(root / "fsdp", step))
        assert state["layout"] == "dcp" and "model.safetensors" not in state["files"]
        assert {f for f in state["files"] if f.endswith(".distcp")} == {"dcp/__0_0.distcp", "dcp/__1_0.distcp"}
        assert state["launch"] == {"world_size": 2, "local_world_size": 2}  # (attnres status repeats the launch)
    assert_matches(root / "fsdp", ref)
    assert read_checkpoint_state(checkpoint_path(root / "cons-to-fsdp", STEPS))["layout"] == "dcp"
    assert_matches(root / "cons-to-fsdp", ref)
    out = _resume_copy(root, "fsdp", "fsdp-to-1")
    train(load_config(None, run_args(root / "corpus.txt", out, resume="true", **block)))
    assert_matches(out, ref)
    from attnres.inference.loading import load_run

    loaded = load_run(root / "fsdp").model.state_dict()
    for name, value in weights(root / "fsdp", STEPS).items():
        assert torch.equal(loaded[name], value), name


@pytest.mark.parametrize("cases", [
    [("pp2-1f1b", "block"), ("tp2", "selective")],
    pytest.param([("pp2-1f1b", "selective"), ("tp2", "block")], marks=pytest.mark.slow),
], ids=["pp2-block,tp2-selective", "pp2-selective,tp2-block"])
def test_activation_checkpointing_under_the_mesh(root, cases):
    """``activation_checkpoint=block`` and ``selective`` under ``pp=2`` (1F1B) and ``tp=2``
    (Block AttnRes) give the losses, gradient norms and weights of ``none``: the
    single-process run without recomputation (1e-5). Two cases in the default suite (one
    2-rank launch, about 15 s), the other two in the slow one."""
    block = RESIDUALS["block"]
    ref = reference(root, "ref-block", **block)
    runs = [[f"ac-{layout}-{mode}", {**block, **LAYOUTS[layout][1], "activation_checkpoint": mode}, 0]
            for layout, mode in cases]
    launch(root, 2, runs)
    for name, _, _ in runs:
        assert_matches(root / name, ref)


def test_bf16_over_the_mesh(root):
    """``dtype=bfloat16`` with ``parallel.dp=2``: FSDP2's
    ``MixedPrecisionPolicy`` (bf16 parameters and gradients, float32 reductions); with
    ``parallel.pp=2``: autocast on each
    stage, what crosses stages cast to the pipeline's float32 wire dtype. Both train, stay
    close to the single-process bf16 autocast run, and the master weights and optimiser
    state stay float32.

    Tolerance: not the float32 runs' 1e-5. Every run computes in bfloat16 (8-bit mantissa:
    2^-9 = 2e-3 relative rounding) but not the same ops: under FSDP2's policy the parameters
    themselves are bf16 (the embedding, the norm gains and the depth queries too, so the
    residual stream is bf16), under autocast only the matmuls' inputs are; across pipeline
    stages the history's bf16 sublayer outputs arrive as float32 (with
    ``model.residual.autocast_stream``, each stage stores them in bf16 again, and the run is
    compared with the single-process run that sets it). Measured over 10 steps:
    every step's loss within 1.5e-4 (dp=2) and 4e-5 (pp=2) of autocast's (bound 2e-3, one
    bf16 rounding). The weights differ at bf16's noise level, largest on the small,
    zero-initialised depth queries; so the bound is relative to float32: each run ends no
    further from the float32 run than autocast does, within a factor 2 (measured 3.9e-2 (dp=2,
    largest on mixers.1's query) and 2.5e-2 (pp=2) against autocast's 3.0e-2)."""
    block = RESIDUALS["block"]
    stream = {"model.residual.autocast_stream": "true"}  # (a bf16 stream in every stage: resumed from float32)
    ref = reference(root, "ref-block-bf16", **block, dtype="bfloat16")
    refs = {"bf16-dp2": ref, "bf16-pp2": ref,
            "bf16-stream-pp2": reference(root, "ref-block-bf16-stream", **block, **stream, dtype="bfloat16")}
    ref32 = reference(root, "ref-block", **block)
    runs = [["bf16-dp2", {**block, "parallel.dp": 2, "dtype": "bfloat16"}, 0],
            ["bf16-pp2", {**block, **PP, "dtype": "bfloat16"}, 0],
            ["bf16-stream-pp2", {**block, **PP, **stream, "dtype": "bfloat16"}, 0]]
    launch(root, 2, runs)
    from attnres.checkpoint import read_sharded_tensors

    def losses(run: Path) -> list[float]:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in records if r["kind"] == "train"]

    auto, f32 = weights(ref, STEPS), weights(ref32, STEPS)
    keys = sorted(f32)
    autocast = max(tensor_errors([auto[k] for k in keys], [f32[k] for k in keys]))
    for name, _, _ in runs:
        path = checkpoint_path(root / name, STEPS)
        state = {**read_sharded_tensors(path), **read_sharded_tensors(path, "optim.")}
        assert {v.dtype for v in state.values()} == {torch.float32}  # the master weights and Adam's moments
        la, lb = losses(root / name), losses(refs[name])
        assert len(la) == len(lb) == STEPS
        loss_err = max(abs(x - y) / abs(y) for x, y in zip(la, lb))
        got = weights(root / name, STEPS)
        mixed = max(tensor_errors([got[k] for k in keys], [f32[k] for k in keys]))
        print(f"{name}: losses {loss_err:.1e} from autocast's; weights {mixed:.1e} from float32 (autocast "
              f"{autocast:.1e})")
        assert loss_err <= 2e-3
        assert mixed <= 2 * autocast


def _step_seconds(run: Path) -> list[float]:
    """Each logged step's wall time (from its tokens/s; every step is logged here)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["tokens"] / r["step"] / r["tokens_per_s"] for r in records if r["kind"] == "train"]


@pytest.mark.slow
def test_compiled_blocks_under_the_mesh(root):
    """``compile=true`` under ``parallel.dp=2``, ``parallel.tp=2`` and ``parallel.pp=2``
    (interleaved 1F1B with the cross-stage cache): each block's attention and MLP compiled
    (regional ``torch.compile``, FSDP2's and tp's hooks eager around them) train as the eager
    single-process run does (1e-5). Slow: inductor compiles on the first step (about 25 s
    here) and again for the first evaluation (no autograd)."""
    block = RESIDUALS["block"]
    ref = reference(root, "ref-block", **block)
    runs = [["compile-dp2", {**block, "parallel.dp": 2, "compile": "true"}, 0],
            ["compile-tp2", {**block, "parallel.tp": 2, "compile": "true"}, 0],
            ["compile-pp2", {**block, **LAYOUTS["pp2-interleaved-cache"][1], "compile": "true"}, 0]]
    launch(root, 2, runs)
    for name, _, _ in runs:
        assert_matches(root / name, ref)
        steps = _step_seconds(root / name)
        print(f"{name}: first step (compiling) {steps[0]:.1f} s, step 6 (after the first evaluation) {steps[5]:.1f} s, "
              f"median step {sorted(steps)[len(steps) // 2]:.2f} s")


@pytest.mark.slow
def test_dp_tp_pp_on_eight_ranks(root):
    """``parallel.dp=2 x tp=2 x pp=2`` (8 gloo processes, 1F1B), Block AttnRes, stopped at
    step 5 and resumed in the same layout, matches single-process training (1e-5). About a
    minute on 2 cores."""
    block = RESIDUALS["block"]
    ref = reference(root, "ref-block", **block)
    launch(root, 8, [["dp2-tp2-pp2", {**block, **PP, "parallel.tp": 2, "parallel.dp": 2}, 5]], timeout=1200)
    assert_matches(root / "dp2-tp2-pp2", ref)


@pytest.mark.parametrize("layout", ["tp2", pytest.param("dp2-tp2", marks=pytest.mark.slow)])
def test_tied_embeddings_under_tp(root, layout):
    """``model.tie_embeddings=true`` under ``tp=2`` (and, slow, ``dp=2 x tp=2``): the
    embedding and the LM head stay one parameter, split by vocabulary rows, and training
    matches the tied single-process run (1e-5)."""
    tied = {**RESIDUALS["block"], "model.tie_embeddings": "true"}
    ref = reference(root, "ref-block-tied", **tied)
    ranks, extra = LAYOUTS[layout]
    launch(root, ranks, [[f"tied-{layout}", {**tied, **extra}, 0]])
    assert_matches(root / f"tied-{layout}", ref)


@pytest.mark.slow
def test_sigkilled_rank_ends_pipeline_job(root):
    """Under ``pp=2`` (two processes, no torchrun agent to tear them down), rank 1 SIGKILLs
    itself at step 8: rank 0 stops with an error within 60 s, and the step-5 checkpoint
    verifies and resumes."""
    from distributed_utils import worker_env

    from attnres.distributed.local_spawn import rendezvous_env

    runs = json.dumps([["kill", {**PP, "dist_timeout_s": 30}, 0]])
    with rendezvous_env() as rendezvous:
        env = {**worker_env(), **rendezvous, "WORLD_SIZE": "2"}
        procs = [subprocess.Popen([sys.executable, __file__, str(root), runs],
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        try:
            out0, _ = procs[0].communicate(timeout=240)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
    ended = time.time()
    killed = float((root / "killed.txt").read_text())
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode != 0, out0[-3000:]
    print(f"rank 0 ended {ended - killed:.1f} s after rank 1 was killed")
    assert ended - killed < 60
    assert latest_checkpoint(root / "kill") == checkpoint_path(root / "kill", 5)
    state = read_checkpoint_state(checkpoint_path(root / "kill", 5))  # every file's size and SHA-256
    assert state["step"] == 5 and state["layout"] == "dcp"


def test_invalid_layouts_name_the_field(root):
    from attnres.distributed import ParallelConfig

    with pytest.raises(ValueError, match="pp_virtual"):
        ParallelConfig(pp=2, pp_schedule="1f1b", pp_virtual=2)
    with pytest.raises(ValueError, match="pp_cache"):
        ParallelConfig(pp=2, pp_cache=True)
    with pytest.raises(ValueError, match="pp_schedule"):
        ParallelConfig(pp=2, pp_schedule="zero_bubble")
    with pytest.raises(ValueError, match="torchrun"):  # degrees > 1 in one process
        train(load_config(None, run_args(root / "corpus.txt", root / "bad", **PP)))
    from attnres.distributed.mesh_model import check_parallel_config
    from attnres.models import ModelConfig

    cfg = ModelConfig.preset("tiny", n_layers=4, tie_embeddings=False)
    with pytest.raises(ValueError, match="n_heads"):
        check_parallel_config(cfg, ParallelConfig(tp=3), 16, 4, 1)
    with pytest.raises(ValueError, match="tie_embeddings"):
        check_parallel_config(cfg.replace(tie_embeddings=True), ParallelConfig(pp=2), 16, 4, 1)
    check_parallel_config(cfg.replace(tie_embeddings=True), ParallelConfig(tp=2), 16, 4, 1)  # allowed
    with pytest.raises(ValueError, match=r"^model.residual.kind='mhc' cannot run with parallel.pp=2: residual 'mhc' "
                                         r"does not describe its history"):
        check_parallel_config(cfg.replace(residual="mhc"), ParallelConfig(pp=2), 16, 4, 1)
    with pytest.raises(ValueError, match=r"= 4\) must be divisible by parallel.pp_microbatches=3: set batch_size=6 \(or "
                       r"another multiple of dp x pp_microbatches = 3\), or parallel.pp_microbatches to a divisor of 4"):
        check_parallel_config(cfg, ParallelConfig(pp=2, pp_microbatches=3), 16, 4, 1)
    with pytest.raises(ValueError, match=r"set batch_size=12 \(or another multiple of dp x pp_microbatches = 6\)"):
        check_parallel_config(cfg, ParallelConfig(pp=2, pp_microbatches=3), 16, 8, 2)
    with pytest.raises(ValueError, match=r"batch_size=4 .* divisible by parallel.dp=3 .*: set batch_size=6 \(or "
                       r"another multiple of 3\), or launch a number of data-parallel ranks that divides 4"):
        check_parallel_config(cfg, ParallelConfig(), 16, 4, 3)
    family = cfg.replace(hf_architecture="llama")
    with pytest.raises(ValueError, match="data parallelism only"):
        check_parallel_config(family, ParallelConfig(tp=2), 16, 4, 1)
    check_parallel_config(family, ParallelConfig(), 16, 4, 1, "block")  # (its own checkpointing: test below)


def test_a_resume_that_the_layout_cannot_split_is_not_told_to_change_batch_size_or_the_model():
    """A one-process run of batch_size=3 resumed on 2 ranks was told to "set batch_size=4",
    which the resume then refused (the config differs in batch_size). A resume is told the
    data-parallel degrees that divide its batch, and under a pipeline the micro-batches, that
    the checkpoint's batch_size stays; a new run still hears of batch_size too. A tied model
    resumed under a pipeline was told the tie "must be false", a model change no resume takes:
    it is told to continue without the pipeline."""
    from types import SimpleNamespace

    from attnres.distributed import ParallelConfig
    from attnres.distributed.mesh_model import check_parallel_config
    from attnres.models import ModelConfig
    from attnres.train import TrainConfig
    from attnres.train.loop import check_layout

    two_ranks = SimpleNamespace(backend="gloo", world_size=2)
    kept = r" \(batch_size is the checkpoint's: a resume keeps it\)$"
    with pytest.raises(ValueError, match=r"batch_size=3 \(the global batch\) must be divisible by parallel.dp=2 \(each "
                                         r"data-parallel rank trains on batch_size / dp rows\): launch a number of "
                                         r"data-parallel ranks that divides 3 \(parallel.dp = 1 or 3\)" + kept):
        check_layout(TrainConfig(batch_size=3, resume=True), two_ranks)
    with pytest.raises(ValueError, match=r"\): set batch_size=4 \(or another multiple of 2\), or launch a number of "
                                         r"data-parallel ranks that divides 3 \(parallel.dp = 1 or 3\)$"):
        check_layout(TrainConfig(batch_size=3), two_ranks)
    with pytest.raises(ValueError, match=r"parallel.dp = 1, 2, 3, 4, 6 or 12\)" + kept):
        check_parallel_config(ModelConfig.preset("tiny"), ParallelConfig(), 16, 12, 5, resuming=True)
    pipeline = ModelConfig.preset("tiny", n_layers=4)
    with pytest.raises(ValueError, match=r"= 4\) must be divisible by parallel.pp_microbatches=3: set "
                                         r"parallel.pp_microbatches to a divisor of 4 that the schedule takes" + kept):
        check_parallel_config(pipeline, ParallelConfig(pp=2, pp_microbatches=3), 16, 4, 1, resuming=True)
    with pytest.raises(ValueError, match=r"tie_embeddings must be false with parallel.pp > 1 \(the embedding and the LM "
                                         r"head live on different stages\): this resume keeps the checkpoint's tied "
                                         r"model, so continue it with parallel.pp=1"):
        check_parallel_config(pipeline.replace(tie_embeddings=True), ParallelConfig(pp=2), 16, 4, 1, resuming=True)


def test_a_consolidated_init_from_under_a_pipeline_is_told_how_to_start():
    """init_from a consolidated checkpoint under parallel.pp > 1 was told to "continue it with
    parallel.pp=1 first", a resume's way: this run has nothing to continue. It is told how to
    start (pp=1 to a first sharded checkpoint, then --resume under the pipeline, or a sharded
    checkpoint to start from); a resume keeps its own."""
    from types import SimpleNamespace

    from attnres.checkpoint import CheckpointError
    from attnres.distributed.parallel import ParallelConfig
    from attnres.train.loop import Trainer
    from attnres.train.setup import Start

    def refusal(start: Start) -> str:
        trainer = object.__new__(Trainer)
        trainer.config, trainer.start = SimpleNamespace(parallel=ParallelConfig(pp=2)), start
        with pytest.raises(CheckpointError) as refused:
            trainer._whole_model_weights()
        return str(refused.value)

    source = SimpleNamespace(path=Path("/runs/a/checkpoints/step-00000004"), state={"step": 4})
    said = refusal(Start(init=source))
    assert said == ("'/runs/a/checkpoints/step-00000004' is a consolidated checkpoint; pipeline-parallel runs "
                    "(parallel.pp > 1) start from sharded (DCP) checkpoints only: start this run with parallel.pp=1 and "
                    "stop_after=1 on the same ranks (its checkpoint is sharded), then resume it with --resume and "
                    "parallel.pp > 1; or give init_from a sharded checkpoint")
    assert refusal(Start(resume=source)).endswith(": continue it with parallel.pp=1 first (a run on several ranks "
                                                   "then writes sharded checkpoints)")


def test_layout_line_says_the_diagnostics_are_not_recorded_under_tp_or_pp():
    """Under tp or pp the per-block diagnostics (they need the whole model on a rank) are not
    recorded: the start-up's layout line says so where the run would record them (a run
    with diagnostics_every found no diagnostics in its metrics.jsonl, unannounced)."""
    from types import SimpleNamespace

    from attnres.distributed.parallel import ParallelConfig, ParallelLayout
    from attnres.train.loop import Trainer

    def layout_line(tp: int, pp: int, diagnostics_every: int = 5, whole: bool | None = None) -> str:
        trainer = object.__new__(Trainer)
        trainer.config = SimpleNamespace(parallel=ParallelConfig(tp=tp, pp=pp), diagnostics_every=diagnostics_every,
                                         steps=STEPS)
        trainer.layout = ParallelLayout(dp=1, tp=tp, pp=pp, dp_rank=0, tp_rank=0, pp_rank=0)
        trainer.pm = SimpleNamespace(holds_whole_model=tp == pp == 1, local_parameter_bytes=lambda: 8)
        return trainer._describe_layout()

    said = "no per-block diagnostics (diagnostics_every: they need the whole model on a rank, tp = pp = 1"
    assert said in layout_line(tp=2, pp=1) and said in layout_line(tp=1, pp=2)
    assert said not in layout_line(tp=1, pp=1)  # data parallel: FSDP2 gathers what it shards
    assert said not in layout_line(tp=2, pp=1, diagnostics_every=STEPS + 1)  # none asked for in this run


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_activation_checkpointing_gives_equal_gradients(mode):
    """``activation_checkpoint=block|selective`` recomputes activations in the backward
    pass: for standard, Block and Full AttnRes, the loss and every gradient equal the plain
    model's (float32, 1e-6 relative)."""
    for residual in ("standard", "attnres_block", "attnres_full"):
        _check_checkpointed_gradients(mode, residual)


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_a_family_models_activation_checkpointing_gives_equal_gradients(mode):
    """``activation_checkpoint=block|selective`` of a transformers family's model
    (``model.hf_architecture``: it was refused) turns on its own checkpointing, per
    sublayer, with the native model's options: the loss and every gradient equal the
    plain model's (float32, 1e-6 relative), and each sublayer runs again in the backward."""
    from attnres.distributed.mesh_model import build_parallel_model
    from attnres.distributed.parallel import ParallelConfig, ParallelLayout
    from attnres.models import ModelConfig

    config = ModelConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, max_seq_len=16, hf_architecture="llama",
                         residual={"kind": "attnres_block", "block_size": 2})
    layout = ParallelLayout(dp=1, tp=1, pp=1, dp_rank=0, tp_rank=0, pp_rank=0)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for checkpointing in ("none", mode):
        model = build_parallel_model(config, ParallelConfig(), layout, torch.device("cpu"), 0, checkpointing).model
        with torch.no_grad():
            for p in model.residual.parameters():
                p.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape))  # non-uniform depth attention
        model.train()
        runs = []  # each run of a checkpointed sublayer, in the forward and again in the backward
        for layer in model.model.layers:
            if checkpointing != "none":
                given = layer._gradient_checkpointing_func
                options = given.keywords  # (a partial of torch's checkpoint)
                layer._gradient_checkpointing_func = lambda fn, *args, given=given, **kw: given(
                    lambda *x: runs.append(1) or fn(*x), *args, **kw)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()], len(runs)))
    assert options["use_reentrant"] is False and ("context_fn" in options) == (mode == "selective")
    assert [r[2] for r in results] == [0, 2 * 2 * config.n_layers]  # both sublayers, recomputed in the backward
    assert abs(results[0][0] - results[1][0]) <= 1e-6 * abs(results[0][0])
    assert max(tensor_errors(results[1][1], results[0][1])) <= 1e-6


def _check_checkpointed_gradients(mode: str, residual: str) -> None:
    from attnres import AttnResLM, ModelConfig
    from attnres.models.trunk import sublayer_caller

    torch.manual_seed(0)
    model = AttnResLM(ModelConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=3, max_seq_len=16, residual=residual))
    with torch.no_grad():
        for p in model.residual.parameters():
            p.normal_()  # non-zero pseudo-queries: the depth attention is not uniform
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for call in (None, sublayer_caller(mode)):
        model.zero_grad(set_to_none=True)
        if call is not None:
            model.sublayer_call = call
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.equal(grads[0][0], grads[1][0]) or abs(grads[0][0] - grads[1][0]) <= 1e-6 * abs(grads[0][0])
    errs = tensor_errors(grads[1][1], grads[0][1])
    assert max(errs) <= 1e-6, max(errs)


# -- slow: every layout, every residual; the reshard layouts ------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("residual", list(RESIDUALS))
def test_every_layout_matches_single_process(root, residual):
    """Each layout of LAYOUTS, for ``residual``, stopped at step 5 and resumed in the same
    layout, matches uninterrupted single-process training."""
    ref = reference(root, f"ref-{residual}", **RESIDUALS[residual])
    for n in (2, 4):
        runs = [[f"{residual}-{name}", {**RESIDUALS[residual], **extra}, 5] for name, (k, extra) in LAYOUTS.items()
                if k == n]
        launch(root, n, runs, timeout=1200)
    for name in LAYOUTS:
        assert_matches(root / f"{residual}-{name}", ref)


def _resume_copy(root: Path, run: str, name: str) -> Path:
    out = root / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(root / run, out)
    shutil.rmtree(checkpoint_path(out, STEPS))
    return out


@pytest.mark.slow
def test_checkpoints_reshard(root):
    """Sharded checkpoints written at one layout resume at another: ``pp=2 -> pp=1`` (one
    process), ``tp=2 -> dp=2``, ``dp=2 -> dp=4``, ``dp=2 x pp=2 -> dp=4`` and
    ``dp=2 x pp=2 -> dp=1, pp=1``; a consolidated (one-process) checkpoint resumes at
    ``tp=2``; each ends where single-process training ends."""
    block = RESIDUALS["block"]
    ref = reference(root, "ref-block", **block)
    launch(root, 2, [["rs-pp2", {**block, **PP}, 0], ["rs-tp2", {**block, "parallel.tp": 2}, 0],
                     ["rs-dp2", {**block, "parallel.dp": 2}, 0]])
    launch(root, 4, [["rs-dp2pp2", {**block, **PP, "parallel.dp": 2}, 0]])
    out = _resume_copy(root, "rs-pp2", "rs-pp2-to-1")
    train(load_config(None, run_args(root / "corpus.txt", out, resume="true", **block)))
    assert_matches(out, ref)
    out = _resume_copy(root, "rs-dp2pp2", "rs-dp2pp2-to-1")
    train(load_config(None, run_args(root / "corpus.txt", out, resume="true", **block)))
    assert_matches(out, ref)
    _resume_copy(root, "rs-tp2", "rs-tp2-to-dp2")
    _resume_copy(root, "ref-block", "rs-cons-to-tp2")  # a consolidated checkpoint: into the whole model, then split
    launch(root, 2, [["rs-tp2-to-dp2", {**block, "parallel.dp": 2, "resume": "true"}, 0],
                     ["rs-cons-to-tp2", {**block, "parallel.tp": 2, "resume": "true"}, 0]])
    assert_matches(root / "rs-tp2-to-dp2", ref)
    assert_matches(root / "rs-cons-to-tp2", ref)
    _resume_copy(root, "rs-dp2", "rs-dp2-to-dp4")
    _resume_copy(root, "rs-dp2pp2", "rs-dp2pp2-to-dp4")
    launch(root, 4, [["rs-dp2-to-dp4", {**block, "parallel.dp": 4, "resume": "true"}, 0],
                     ["rs-dp2pp2-to-dp4", {**block, "parallel.dp": 4, "resume": "true"}, 0]])
    assert_matches(root / "rs-dp2-to-dp4", ref)
    assert_matches(root / "rs-dp2pp2-to-dp4", ref)


if __name__ == "__main__":
    worker(Path(sys.argv[1]), json.loads(sys.argv[2]))


def test_a_family_models_training_and_validation_forwards_build_no_kv_cache(caplog):
    """A transformers family's model built a KV cache in every training and validation
    forward (its config's ``use_cache``, which generation wants): every layer's keys and
    values held to the end of a validation forward, and, under activation checkpointing,
    transformers' "use_cache=True is incompatible with gradient checkpointing" at every run.
    Both forwards now pass ``use_cache=False``; the losses are unchanged."""
    from attnres.distributed.mesh_model import build_parallel_model
    from attnres.distributed.parallel import ParallelConfig, ParallelLayout
    from attnres.models import ModelConfig

    config = ModelConfig(vocab_size=64, d_model=32, n_heads=2, n_layers=2, max_seq_len=16, hf_architecture="llama")
    layout = ParallelLayout(dp=1, tp=1, pp=1, dp_rank=0, tp_rank=0, pp_rank=0)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    pm = build_parallel_model(config, ParallelConfig(), layout, torch.device("cpu"), 0, "block")
    assert pm.model.config.use_cache  # generation's default, kept for the exported model
    caches = []
    pm.model.register_forward_hook(lambda module, args, out: caches.append(out.past_key_values))
    loss, _ = pm.forward_backward(ids, 1)
    val = pm.loss(ids)
    assert caches == [None, None]
    assert abs(loss - val) <= 1e-5 * val  # the same weights, the same batch
    assert "use_cache" not in caplog.text
