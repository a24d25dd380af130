"""Data-parallel training (FSDP2 on gloo, every launched rank data parallel by default)
against single-process training; the deprecated ``distributed`` key; resume on another number
of ranks; a rank that dies; backend selection and config errors.

Launches (this file run as a script is the worker): 2 ranks train several runs, 4 ranks
resume one of them, and 2 hand-launched processes (no torchrun, so only the process-group
timeout can end the wait) test rank death. The single-process references run in the test
process. Everything is CPU, gloo, a 2-block d=32 model, sequences of 16 tokens.

Tolerance: data-parallel training is not bitwise single-process training. Each rank
averages the loss over its B/K rows, and the gradients are averaged over ranks (reduce-scatter
or all-reduce), so float32 additions happen in another order; Adam divides by
sqrt(second moment), which amplifies the rounding where gradients are tiny. After 20 steps we
measure <= 1e-6 relative error per tensor (normwise); the bound is 1e-4. A rank training on
the wrong rows, or a gradient or loss not averaged over ranks, gives errors of 1e-2 and more.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("yaml")

from conftest import tensor_errors  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from attnres.distributed import DistributedError, ParallelConfig, backend_for_device  # noqa: E402
from attnres.train import TrainConfig, latest_checkpoint, load_config, train  # noqa: E402
from attnres.checkpoint import checkpoint_path  # noqa: E402

DP_TOL = 1e-4
STEPS = 20
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every daft zebra".split()
# Single-process reference runs (checkpoints every 10 steps) ...
# (the Muon runs also tie the embedding and the head: one tensor in the checkpoint, as in one process)
REFERENCES = {"adamw": {}, "muon": {"optimizer": "muon", "grad_accum": 2, "stop_after": 10, "model.tie_embeddings": "true"}}
# ... and the 2-rank runs: name -> (overrides, reference). A plain launch is data parallel
# (FSDP2); "legacy-ddp-muon" is a config of earlier versions (distributed=ddp), which still
# trains, with a DeprecationWarning, as FSDP2 data parallelism.
RUNS = {
    "fsdp-adamw": ({}, "adamw"),
    "fsdp-muon": (dict(REFERENCES["muon"]), "muon"),
    "legacy-ddp-muon": (dict(distributed="ddp", **REFERENCES["muon"]), "muon"),
}


def write_corpus(path: Path) -> Path:
    rng = np.random.default_rng(0)
    lines = [" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=12)) + "." for _ in range(400)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_args(corpus: Path, out: Path, **extra) -> list[str]:
    base = {"model": "tiny", "model.d_model": 32, "data.paths": f"[{corpus}]", "data.tokenizer": "byte", "seq_len": 16,
            "batch_size": 4, "steps": STEPS, "warmup_steps": 2, "out_dir": str(out), "progress": "false",
            "tensorboard": "false", "eval_every": 10, "eval_batches": 2, "log_every": 1, "diagnostics_every": 10,
            "checkpoint_every": 10}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


# -- the worker ---------------------------------------------------------------------------

def worker(task: str, root: Path) -> None:
    """``train``: every run of RUNS; ``die``: train through the CLI, rank 1 exiting abruptly
    at its 3rd batch (``stall``: stopping to call collectives there)."""
    torch.set_num_threads(1)
    corpus = root / "corpus.txt"
    if task == "train":  # the first train() creates the process group, the others reuse it
        for name, (extra, _) in RUNS.items():
            train(load_config(None, run_args(corpus, root / name, **extra)))
    elif task == "slow-rank-0":  # rank 0 prepares the data, and publishes a checkpoint, for longer than dist_timeout_s
        from attnres.checkpoint import sharded
        from attnres.cli import main
        from attnres.train import setup

        if os.environ["RANK"] == "0":
            prepare, publish = setup.prepare_data, sharded.publish_checkpoint
            setup.prepare_data = lambda *a, **k: (time.sleep(SLOW_RANK_0_S), prepare(*a, **k))[1]
            sharded.publish_checkpoint = lambda *a, **k: (time.sleep(SLOW_RANK_0_S), publish(*a, **k))[1]
        sys.exit(main(["train", *run_args(corpus, root / task, dist_timeout_s=SLOW_RANK_0_S / 2.5, steps=2)]))
    elif task in ("die", "stall", "sigterm"):
        from attnres.cli import main
        from attnres.data import BatchSampler

        if os.environ["RANK"] == "1":
            next_batch, calls = BatchSampler.next_batch, []

            def failing_next_batch(self):
                calls.append(1)
                if len(calls) == 3:
                    (root / f"{task}.txt").write_text(str(time.time()))
                    if task == "die":
                        os._exit(1)
                    if task == "sigterm":  # only this rank is signalled
                        os.kill(os.getpid(), signal.SIGTERM)
                    else:
                        time.sleep(3600)  # alive, but never joins another collective
                return next_batch(self)

            BatchSampler.next_batch = failing_next_batch
        sys.exit(main(["train", *run_args(corpus, root / task, dist_timeout_s=DIE_TIMEOUT_S)]))


# -- launches -----------------------------------------------------------------------------

DIE_TIMEOUT_S = 15
SLOW_RANK_0_S = 7.0


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dp")
    write_corpus(root / "corpus.txt")
    return root


@pytest.fixture(scope="module")
def dp_runs(root) -> Path:
    from distributed_utils import torchrun

    torchrun(2, __file__, "train", str(root))
    return root


@pytest.fixture(scope="module")
def references(root) -> Path:
    """The single-process runs of REFERENCES (out_dir ``<root>/ref-<name>``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, extra in REFERENCES.items():
            train(load_config(None, run_args(root / "corpus.txt", root / f"ref-{name}", **extra)))
    finally:
        torch.set_num_threads(before)
    return root


def checkpoint_tensors(path: Path, part: str) -> dict[str, torch.Tensor]:
    """The ``model`` weights or the ``optimizer`` state of a checkpoint, consolidated (one
    process) or sharded (several ranks, DCP), keyed by parameter name (``<name>.<state>`` for the
    optimiser: a consolidated optimiser state is keyed by position in the optimiser's groups,
    mapped here to names through the optimiser the run's config builds)."""
    from attnres import AttnResLM, ModelConfig
    from attnres.train import build_optimizer
    from attnres.checkpoint import read_checkpoint_state
    from attnres.checkpoint import is_sharded, read_sharded_tensors

    state = read_checkpoint_state(path)
    if is_sharded(state):
        return read_sharded_tensors(path, "model." if part == "model" else "optim.")
    tensors = load_file(str(path / f"{part}.safetensors"))
    if part == "model":
        return tensors
    config = TrainConfig.from_dict(state["config"])
    model = AttnResLM(ModelConfig.from_dict(state["config"]["model"]))
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in build_optimizer(model, config).param_groups for p in g["params"]]
    return {f"{order[int(k.split('.', 1)[0])]}.{k.split('.', 1)[1]}": v for k, v in tensors.items()}


def assert_close_runs(got: Path, want: Path, step: int) -> None:
    """Weights and optimiser state of checkpoint ``step``, and the logged loss and gradient
    norm of every step, within DP_TOL. Prints the largest errors (shown with ``-s``)."""
    for name in ("model", "optimizer"):
        a, b = checkpoint_tensors(checkpoint_path(got, step), name), checkpoint_tensors(checkpoint_path(want, step), name)
        assert a.keys() == b.keys(), name
        keys = sorted(a)
        errs = tensor_errors([a[k] for k in keys], [b[k] for k in keys])
        worst = max(zip(errs, keys))
        assert worst[0] <= DP_TOL, f"{got.name} {name}: {worst[1]} relative error {worst[0]:.2e} > {DP_TOL}"
        print(f"{got.name} step {step} {name}: largest relative error {worst[0]:.1e} ({worst[1]})")

    def logged(run: Path) -> list[tuple[int, float, float]]:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r["grad_norm"]) for r in records if r["kind"] == "train" and r["step"] <= step]

    a, b = logged(got), logged(want)
    assert [s for s, _, _ in a] == [s for s, _, _ in b] == list(range(1, step + 1))
    for (s, la, ga), (_, lb, gb) in zip(a, b):
        assert abs(la - lb) <= DP_TOL * abs(lb) and abs(ga - gb) <= DP_TOL * abs(gb), f"step {s}: {la, ga} vs {lb, gb}"


# -- acceptance: training matches one process, resume on another world size -------------

@pytest.mark.parametrize("name", list(RUNS))
def test_data_parallel_matches_single_process(dp_runs, references, name):
    """2 ranks x batch 2 == 1 process x batch 4: FSDP2 with AdamW for 20 steps; FSDP2 with
    Muon (Newton-Schulz on gathered matrices) and gradient accumulation (gradients reduced
    once per step), given as today's config and as a deprecated ``distributed=ddp`` one."""
    extra, ref = RUNS[name]
    step = extra.get("stop_after", STEPS)
    assert latest_checkpoint(dp_runs / name) == checkpoint_path(dp_runs / name, step)
    assert_close_runs(dp_runs / name, references / f"ref-{ref}", step)


def copy_at_step_10(run: Path, out: Path) -> None:
    """``run`` as it was after its step-10 checkpoint (the resume truncates the metrics)."""
    shutil.copytree(run, out)
    shutil.rmtree(checkpoint_path(out, STEPS))
    assert latest_checkpoint(out) == checkpoint_path(out, 10)


def test_resume_on_one_rank(dp_runs, references, one_thread):
    """A checkpoint written by 2 FSDP2 ranks resumes in one process; the end matches the
    uninterrupted single-process run."""
    out = dp_runs / "resume-1"
    copy_at_step_10(dp_runs / "fsdp-adamw", out)
    train(load_config(None, run_args(dp_runs / "corpus.txt", out, resume="true")))
    assert_close_runs(out, references / "ref-adamw", STEPS)


def test_resume_on_four_ranks(dp_runs, references):
    """The same checkpoint resumed by 4 ranks (batch 1 each) through the documented command,
    ``torchrun --nproc-per-node 4 -m attnres train ... --resume`` (every rank data parallel)."""
    from distributed_utils import torchrun

    out = dp_runs / "resume-4"
    copy_at_step_10(dp_runs / "fsdp-adamw", out)
    proc = torchrun(4, "-m", "attnres", "train", "--resume", *run_args(dp_runs / "corpus.txt", out))
    assert "attnres train: finished at step 20" in proc.stdout
    assert_close_runs(dp_runs / "resume-4", references / "ref-adamw", STEPS)


# -- acceptance: a rank that dies ---------------------------------------------------------

@contextlib.contextmanager
def launched_by_hand(task: str, root: Path) -> Iterator[list[subprocess.Popen]]:
    """The ``task`` worker on 2 ranks launched by hand (no torchrun agent; their store served
    from this process), killed if still running when the block ends."""
    from distributed_utils import worker_env

    from attnres.distributed.local_spawn import rendezvous_env

    with rendezvous_env() as rendezvous:
        procs = [subprocess.Popen([sys.executable, __file__, task, str(root)], text=True,
                                  env=worker_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", **rendezvous),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(2)]
        try:
            yield procs
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()


def launch_failing(task: str, root: Path) -> tuple[int, str, float]:
    """Start the ``die``/``stall``/``sigterm`` worker on 2 hand-launched ranks; return rank
    0's exit status and output, and the seconds from rank 1's failure to rank 0's exit."""
    with launched_by_hand(task, root) as procs:
        out0, _ = procs[0].communicate(timeout=240)
        exited = time.time()
    out1, _ = procs[1].communicate(timeout=60)
    failed_at = root / f"{task}.txt"
    assert failed_at.exists(), f"rank 1 never reached its failure point:\n{out0}\n{out1}"
    return procs[0].returncode, out0, exited - float(failed_at.read_text())


def assert_clear_distributed_error(status: int, out: str) -> None:
    assert status == 1, out
    assert "attnres train: error: rank 0 of 2: a collective failed" in out, out
    assert "Another rank has probably died or stalled" in out and "Traceback" not in out, out


def test_dead_rank_makes_the_others_exit_with_a_clear_error(root):
    """Rank 1 calls ``os._exit(1)`` in its third step. Launched by hand (no torchrun agent to
    tear the group down), rank 0 is left inside a collective. gloo sees the closed connection
    at once (a few seconds here); the bound asserted is the process-group timeout plus slack."""
    status, out, waited = launch_failing("die", root)
    assert_clear_distributed_error(status, out)
    assert waited < DIE_TIMEOUT_S + 30, f"rank 0 exited {waited:.1f} s after rank 1 died"


def test_waits_for_rank_0s_set_up_and_checkpoints_are_not_bounded_by_dist_timeout_s(root):
    """Rank 0 prepares the data (trains the BPE, tokenises the corpus: as long as the corpus
    is large) and then publishes the checkpoint (hashes every rank's shards: as long as the
    model is large), each for 2.5 x dist_timeout_s, while rank 1 waits: the run trains. (Rank 1
    stopped at dist_timeout_s with "another rank has probably died or stalled": with
    `dist_timeout_s=60`, as docs/distributed.md suggests, a first run on a large corpus failed.)"""
    with launched_by_hand("slow-rank-0", root) as procs:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "attnres train: finished at step 2" in outs[0], outs[0]


@pytest.mark.slow  # waits out the timeout: about 40 s
def test_stalled_rank_makes_the_others_exit_after_the_timeout(root):
    """Rank 1 stays alive but stops calling collectives: nothing closes a connection, so only
    the process-group timeout (``dist_timeout_s``) ends rank 0's wait."""
    status, out, waited = launch_failing("stall", root)
    assert_clear_distributed_error(status, out)
    assert "Timed out" in out or "timed out" in out, out
    assert DIE_TIMEOUT_S - 5 <= waited < DIE_TIMEOUT_S + 30, f"rank 0 exited {waited:.1f} s after rank 1 stalled"


@pytest.mark.slow  # one more 2-process launch, about 15 s
def test_torchrun_tears_down_the_group_when_a_rank_dies(tmp_path):
    """Under torchrun the agent notices the dead worker and stops the others (SIGTERM) at
    once; the launch fails naming rank 1's exit. (As the root cause or beside it: rank 0
    sees the closed connection within milliseconds and exits with its error, and when both
    exits fall in one of the agent's polls, torchrun calls the lower rank the root cause.)"""
    from distributed_utils import worker_env

    write_corpus(tmp_path / "corpus.txt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, "die",
           str(tmp_path)]
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=240)
    waited = time.time() - float((tmp_path / "die.txt").read_text())
    assert proc.returncode != 0
    report = proc.stderr[proc.stderr.rfind("Failures:"):]
    assert "Root Cause" in report and re.search(r"rank +: 1 \(local_rank: 1\)\s+exitcode +: 1 ", report), report
    assert waited < 30, f"torchrun exited {waited:.1f} s after rank 1 died"


@pytest.mark.slow  # waits out the timeout and torchrun's grace period: about 70 s
def test_torchrun_ends_a_job_with_a_stalled_rank_after_its_grace_period(tmp_path):
    """Under torchrun, a stalled rank 1 (alive, outside any collective) makes rank 0 stop after
    ``dist_timeout_s``; the agent then sends rank 1 SIGTERM, which only asks for a checkpoint
    after the current step (it never ends), and kills it after its 30 s grace period. So the
    job ends about ``dist_timeout_s`` + 30 s after the stall, as the error message says."""
    from distributed_utils import worker_env

    write_corpus(tmp_path / "corpus.txt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, "stall",
           str(tmp_path)]
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=300)
    waited = time.time() - float((tmp_path / "stall.txt").read_text())
    print(f"torchrun ended the job {waited:.1f} s after rank 1 stalled (dist_timeout_s={DIE_TIMEOUT_S})")
    assert proc.returncode != 0
    assert "torchrun's 30 s grace period" in proc.stdout + proc.stderr
    assert DIE_TIMEOUT_S + 25 <= waited < DIE_TIMEOUT_S + 30 + 30, f"the job ended {waited:.1f} s after the stall"


@pytest.mark.slow  # one more 2-process launch, about 25 s
def test_signal_to_one_rank_stops_all_ranks_after_the_same_step(root):
    """SIGTERM reaches rank 1 only (in step 3): the ranks agree after that step, write one
    checkpoint together and both exit with 128 + SIGTERM."""
    status, out, _ = launch_failing("sigterm", root)
    assert status == 128 + signal.SIGTERM, out
    assert "stopped by SIGTERM after step 3" in out, out
    assert latest_checkpoint(root / "sigterm") == checkpoint_path(root / "sigterm", 3)


# -- backend, modes, config ---------------------------------------------------------------

def test_backend_follows_the_device():
    assert backend_for_device("cpu") == "gloo"
    assert backend_for_device(torch.device("cuda", 1)) == "nccl"
    with pytest.raises(ValueError, match="no torch.distributed backend for device type 'meta'"):
        backend_for_device("meta")


def test_deprecated_distributed_key_keeps_working_with_a_warning():
    """``distributed`` of earlier versions: every value still loads (constructor, mapping,
    ``key=value`` override) with a DeprecationWarning saying what it now is; ``fsdp``,
    ``ddp`` and ``auto`` are the default layout (all ranks data parallel, FSDP2), ``none``
    is ``parallel.dp=1``; the key is gone from the config itself."""
    for value in ("fsdp", "ddp", "auto"):
        with pytest.warns(DeprecationWarning, match=f"distributed={value!r} is"):
            config = TrainConfig(distributed=value)
        assert config.parallel == ParallelConfig() and "distributed" not in config.to_dict()
    with pytest.warns(DeprecationWarning,
                      match=r"distributed='ddp' is now data parallelism with FSDP2 over parallel.dp \(DDP was removed;"):
        load_config(None, ["distributed=ddp"])
    with pytest.warns(DeprecationWarning, match=r"distributed='none' is now parallel.dp=1"):
        assert TrainConfig.from_dict({"distributed": "none"}).parallel.dp == 1
    # a given parallel.dp wins, and the warning says so (it said "is now parallel.dp=1", which did not hold)
    with pytest.warns(DeprecationWarning, match=r"distributed='none' is ignored: parallel.dp=2 is given\. Remove it"):
        assert TrainConfig.from_dict({"distributed": "none", "parallel": {"dp": 2}}).parallel.dp == 2
    with pytest.warns(DeprecationWarning, match=r"distributed='none' is ignored: parallel.dp=2 is given"):
        assert TrainConfig(distributed="none", parallel=ParallelConfig(dp=2)).parallel.dp == 2
    with pytest.raises(ValueError, match=r"TrainConfig.distributed must be one of 'auto', 'fsdp', 'ddp', 'none'"):
        TrainConfig(distributed="zero")


def test_config_validates_distributed_fields():
    with pytest.raises(ValueError, match=r"TrainConfig.dist_timeout_s must be a finite number > 0"):
        TrainConfig(dist_timeout_s=0)


def test_one_process_is_the_mesh_of_size_one(monkeypatch):
    """Without a launcher, a run is one process: world size 1, no process group, a layout
    of 1 x 1 x 1 whose collectives are no-ops; degrees > 1 ask for torchrun."""
    from attnres.distributed import build_layout, process_context
    from attnres.distributed.launch import any_rank, mean_over_ranks

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    ctx = process_context("cpu")
    assert (ctx.rank, ctx.world_size, ctx.backend) == (0, 1, None) and not torch.distributed.is_initialized()
    assert mean_over_ranks(0.1, ctx) == 0.1 and any_rank(True, ctx) and not any_rank(False, ctx)
    layout = build_layout(ParallelConfig())
    assert (layout.dp, layout.tp, layout.pp, layout.size, layout.mesh) == (1, 1, 1, 1, None)
    with pytest.raises(ValueError, match=r"dp 2 x tp 1 x pp 1 = 2 ranks; launch them with `torchrun --nproc-per-node 2 "
                                         r".*or set parallel.dp=1 parallel.tp=1 parallel.pp=1 to train \(or resume\)"):
        build_layout(ParallelConfig(dp=2))


def test_a_layout_that_does_not_fit_the_ranks_names_the_product_and_the_fix():
    """'parallel.pp=3' on 2 ranks blamed parallel.tp (never set); a dp that does not fit read
    'must be world size / (tp * pp) = 2 / 2 with 2 launched ranks; got 2'."""
    from attnres.distributed.parallel import resolve_degrees

    with pytest.raises(ValueError, match=r"^TrainConfig.parallel: tp x pp = 1 x 3 = 3 does not divide the 2 launched "
                                         r"ranks; launch a multiple of 3 ranks \(torchrun --nproc-per-node 3\)"):
        resolve_degrees(ParallelConfig(pp=3), 2)
    with pytest.raises(ValueError, match=r"^TrainConfig.parallel: dp x tp x pp = 2 x 2 x 1 = 4 ranks, but 2 were "
                                         r"launched; launch 4 .* leave parallel.dp unset .* \(here 1\)"):
        resolve_degrees(ParallelConfig(dp=2, tp=2), 2)
    assert resolve_degrees(ParallelConfig(tp=2), 4) == (2, 2, 1)


def test_collect_garbage_frees_a_cycle_held_from_an_autograd_graph():
    """A cycle that a hook in an autograd graph holds (from C++, invisible to the collector)
    survives the pass that frees the graph's owner; collect_garbage runs passes until one
    frees nothing - what train does after a multi-rank run, whose FSDP2 and pipeline hooks
    hold the model so."""
    import gc
    import weakref

    from attnres.distributed.launch import collect_garbage

    class Cycle:
        def __init__(self):
            self.me = self

    def garbage() -> weakref.ref:
        held = Cycle()
        x = torch.ones(1, requires_grad=True)
        y = x * 2
        y.grad_fn.register_hook(lambda *_, held=held: None)
        owner = Cycle()
        owner.y = y
        return weakref.ref(held)

    gc.disable()  # (no automatic pass in between)
    try:
        held = garbage()
        gc.collect()
        assert held() is not None  # (one pass: the graph's owner freed, the cycle it held not yet)
        held = garbage()
        assert collect_garbage() >= 2 and held() is None
    finally:
        gc.enable()


def test_distributed_error_names_the_rank():
    from attnres.distributed.launch import DistContext, collective_errors

    ctx = DistContext(rank=3, world_size=4, device=torch.device("cpu"), backend="gloo", timeout_s=7.0)
    with pytest.raises(DistributedError, match=r"rank 3 of 4: a collective failed .*timeout is 7 s \(TrainConfig\."
                       r"dist_timeout_s\)\. Under torchrun the job ends once its agent has stopped every rank: a rank "
                       r"that does not exit on SIGTERM is killed after torchrun's 30 s grace period\."):
        with collective_errors(ctx):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    with pytest.raises(DistributedError, match=r"rank 3 of 4: a collective failed \(RuntimeError: Application timeout"):
        with collective_errors(ctx):  # what a rank waiting past the timeout got: a traceback, no message
            raise RuntimeError("Application timeout caused pair closure")
    with pytest.raises(KeyError):  # anything else passes through unchanged
        with collective_errors(ctx):
            raise KeyError("x")


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]))


def test_fsdp2s_view_warning_is_silenced_for_our_modules_only():
    """`torchrun ... parallel.dp=2 parallel.tp=2` printed 12 warnings that gradients may be
    wrong (FSDP2 on the tp sublayers' to_local() views); they are not (test_parallel_train)."""
    import warnings

    from attnres import AttnResLM, ModelConfig
    from attnres.distributed.mesh_model import _silence_fsdp_view_warning

    model = AttnResLM(ModelConfig.preset("tiny"))
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        _silence_fsdp_view_warning([model])
        for cls in ("FSDPAttention", "FSDPSwiGLU", "FSDPAttnResLM", "FSDPUsersModule"):
            warnings.warn(f"FSDP2-wrapped module ({cls}) returned a view tensor. An in-place op ...", UserWarning)
    assert [str(w.message).split(")")[0] for w in shown] == ["FSDP2-wrapped module (FSDPUsersModule"]


def test_fully_shard_of_the_residual_itself_is_refused_naming_the_unit_that_works():
    """``fully_shard(model.residual)`` (a loop that shards every module of a model of your own)
    left its parameters sharded DTensors through the forward - FSDP2 gathers them when the
    module is called, and a residual never is - and the forward failed deep in the depth
    attention, "aten.mm.default got mixed torch.Tensor and DTensor". ``start`` names the fix;
    sharding the model around it trains as one process (a one-rank group, in this process)."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from attnres.nn import BlockAttnRes

    class Own(torch.nn.Module):  # the README's "AttnRes in your own PyTorch model", small
        def __init__(self, d: int = 8, n: int = 4):
            super().__init__()
            self.embed = torch.nn.Embedding(16, d)
            self.sublayers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
            self.residual = BlockAttnRes(d, n, block_size=2)

        def forward(self, ids):
            state = self.residual.start(self.embed(ids))
            for l, sublayer in enumerate(self.sublayers):
                self.residual.add_output(state, l, sublayer(self.residual.sublayer_input(state, l)))
            return self.residual.finish(state)

    ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(0))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        ref = Own()
        with torch.no_grad():
            for p in ref.residual.parameters():
                p.add_(torch.randn_like(p))
        each, root = Own(), Own()
        each.load_state_dict(ref.state_dict()), root.load_state_dict(ref.state_dict())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the hook on the residual that never runs: warned, test_python_api)
            for module in (*each.sublayers, each.residual, each):
                fully_shard(module, mesh=mesh)
        with pytest.raises(ValueError, match=r"^FSDPBlockAttnRes\.start: the embedding is a plain tensor but the "
                                             r"parameters of residual 'attnres_block' are sharded DTensors .*"
                                             r"fully_shard\(residual\).*never called\. Leave it out of fully_shard "
                                             r"and shard the module whose forward drives it \(fully_shard\(model\)"):
            each(ids)
        for module in (*root.sublayers, root):
            fully_shard(module, mesh=mesh)
        assert torch.allclose(root(ids), ref(ids), atol=1e-6)
    finally:
        dist.destroy_process_group()
