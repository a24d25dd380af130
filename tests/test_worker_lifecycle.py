"""What the workers of a multi-process run do around their launcher and rank 0:

- a torchrun agent killed with SIGKILL (a job scheduler, ``kill -9``) takes its workers with
  it (they got SIGTERM from the kernel: ``exit_with_launcher``; a stalled one ends itself a
  grace period later), where they were left running as orphans, holding their memory and
  stuck in collectives;
- ranks waiting for rank 0's long set-up say so every ``WAIT_REPORT_S``, and the wait ends
  after ``TrainConfig.setup_timeout_s``, which the error names;
- ``inputs_embeds`` under tensor parallelism give the single-process logits and gradients
  (they were taken whole where each rank holds its shard of the sequence: a shape error).

Run as a script (``worker TASK ROOT``) this file is the workers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distributed_utils import LAUNCH_TIMEOUT_S, worker_env

from attnres.distributed.local_spawn import rendezvous_env

WAIT_REPORT_S = 1.0
RANK_0_SLOW_S = 3.5


def run_args(corpus: Path, out: Path, **extra) -> list[str]:
    base = {"model": "tiny", "model.d_model": 16, "model.n_layers": 2, "data.paths": f"[{corpus}]",
            "data.tokenizer": "byte", "seq_len": 8, "batch_size": 2, "steps": 2, "warmup_steps": 1,
            "out_dir": str(out), "progress": "false", "tensorboard": "false", "eval_every": 100,
            "log_every": 1, "diagnostics_every": 100, "checkpoint_every": 100}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def write_corpus(root: Path) -> Path:
    corpus = root / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog.\n" * 40, encoding="utf-8")
    return corpus


# -- the workers --------------------------------------------------------------------------

def slow_rank_0_trains(root: Path, rank: int) -> None:
    """A run whose rank 0 prepares the data for RANK_0_SLOW_S while rank 1 waits, reporting
    every WAIT_REPORT_S."""
    from attnres.distributed import launch
    from attnres.train import setup, train
    from attnres.train.config import load_config

    launch.WAIT_REPORT_S = WAIT_REPORT_S
    if rank == 0:
        prepare = setup.prepare_data
        setup.prepare_data = lambda *a, **k: (time.sleep(RANK_0_SLOW_S), prepare(*a, **k))[1]
    train(load_config(None, run_args(root / "corpus.txt", root / "slow")))
    if rank == 0:
        setup.prepare_data = prepare


def tp_inputs_embeds(root: Path, rank: int) -> None:
    """Logits, loss and the gradient of ``inputs_embeds`` of a tp=2 model against the same
    model in this one process."""
    from attnres import AttnResLM, ModelConfig
    from attnres.distributed import ParallelConfig, build_layout
    from attnres.distributed.mesh_model import build_parallel_model

    config = ModelConfig.preset("tiny", residual="attnres_block", d_model=32)
    torch.manual_seed(0)
    whole = AttnResLM(config)
    pm = build_parallel_model(config, ParallelConfig(tp=2), build_layout(ParallelConfig(tp=2)), torch.device("cpu"),
                              seed=0)
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    embeds = whole.embed_tokens(ids).detach() * 1.5  # (not what the ids give: a soft prompt)
    outs = {}
    for name, model in (("whole", whole), ("tp", pm.model)):
        x = embeds.clone().requires_grad_()
        out = model(inputs_embeds=x, labels=ids)
        out.loss.backward()
        outs[name] = (out.logits.detach(), x.grad)
    errors = {"logits": (outs["tp"][0] - outs["whole"][0]).abs().max().item() / outs["whole"][0].abs().max().item(),
              "grad": (outs["tp"][1] - outs["whole"][1]).abs().max().item() / outs["whole"][1].abs().max().item()}
    try:
        pm.model(inputs_embeds=embeds[:, :7])
    except ValueError as e:
        errors["odd_length"] = str(e)
    (root / f"tp-rank{rank}.json").write_text(json.dumps(errors))


def setup_timeout(root: Path, rank: int) -> None:
    """Rank 0 works past a 2 s setup_timeout_s: rank 1's error (last: the group is spent)."""
    from attnres.distributed.launch import main_first, patient, process_context

    group = patient(process_context("cpu", timeout_s=1.0), timeout_s=2.0)
    try:
        main_first(lambda: time.sleep(4), group, what="tokenising the corpus")
        outcome = "no error"
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = f"{type(e).__name__}: {e}"
    (root / f"timeout-rank{rank}.txt").write_text(outcome)


def worker(task: str, root: Path) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    if task == "ranks":
        slow_rank_0_trains(root, rank)
        tp_inputs_embeds(root, rank)
        setup_timeout(root, rank)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # (the timed-out group cannot be torn down cleanly)
    if task == "wait":  # a worker that has started (it set its process context up) and waits
        from attnres.distributed import process_context

        process_context("cpu")
        (root / f"pid-{rank}").write_text(str(os.getpid()))
        time.sleep(300)
    if task in ("train-until-killed", "stall"):  # each step waits (or step 2 forever): the agent is killed meanwhile
        from attnres.cli import main
        from attnres.data import BatchSampler
        from attnres.distributed import launch

        # the stalled rank ends 1 s after its SIGTERM; the training one stops after its step and
        # checkpoint (1.5-2 s on a loaded 2-core machine: 1 s raced it) well within 10 s
        launch.LAUNCHER_GRACE_S = 1.0 if task == "stall" else 10.0
        next_batch, calls = BatchSampler.next_batch, []

        def slow_next_batch(self):
            calls.append(1)
            if task == "stall" and len(calls) == 2:
                (root / f"pid-{rank}").write_text(str(os.getpid()))
                time.sleep(300)  # alive, but never finishes the step
            time.sleep(0.5)
            return next_batch(self)

        if task == "train-until-killed":
            (root / f"pid-{rank}").write_text(str(os.getpid()))
        BatchSampler.next_batch = slow_next_batch
        sys.exit(main(["train", *run_args(root / "corpus.txt", root / "run", steps=1000, checkpoint_every=1000)]))


# -- a killed launcher --------------------------------------------------------------------

def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


# What torchrun gives a worker (the agent's store, a run id); one rank here.
TORCHRUN_ENV = {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1"}
# A stand-in for the agent: starts the worker as torchrun does (a session of its own) and waits.
AGENT = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:], start_new_session=True); time.sleep(300)"


def kill_launcher_of(task: str, root: Path) -> tuple[bool, str]:
    """Start the ``task`` worker under a process that stands for torchrun's agent, SIGKILL
    that process once the worker has written its pid, and return whether the worker was gone
    within 10 s, and its output."""
    with rendezvous_env() as rendezvous:
        return _kill_launcher_of(task, root, worker_env(**{**TORCHRUN_ENV, **rendezvous}))


def _kill_launcher_of(task: str, root: Path, env: dict[str, str]) -> tuple[bool, str]:
    pid_file, pid = root / "pid-0", None
    with open(root / "log.txt", "w") as log:
        agent = subprocess.Popen([sys.executable, "-c", AGENT, sys.executable, __file__, task, str(root)], env=env,
                                 stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: pid_file.exists() and pid_file.read_text(), LAUNCH_TIMEOUT_S), \
            (root / "log.txt").read_text()
        pid = int(pid_file.read_text())
        agent.kill()
        agent.wait()
        return wait_until(lambda: not alive(pid), 10), (root / "log.txt").read_text()
    finally:
        agent.kill()
        agent.wait()
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_worker_ends_when_its_launcher_is_killed(tmp_path):
    """A process that stands for torchrun's agent starts a worker the way torchrun does and is
    killed with SIGKILL once the worker runs attnres: the worker is gone within seconds (it
    was left running, reparented)."""
    gone, log = kill_launcher_of("wait", tmp_path)
    assert gone, f"the worker outlived its killed launcher:\n{log}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_stalled_training_worker_ends_a_grace_period_after_its_launcher(tmp_path):
    """A training worker stalled inside a step when its launcher is killed never reaches the
    end of the step that SIGTERM waits for: it ends itself after the grace period the agent
    would have given it (1 s here; 30 s, torchrun's, by default)."""
    write_corpus(tmp_path)
    gone, log = kill_launcher_of("stall", tmp_path)
    assert gone, f"the stalled worker outlived its killed launcher:\n{log}"
    assert "rank 0: torchrun's agent is gone and this rank did not stop within 1 s of its SIGTERM: exiting" in log, log


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_worker_whose_launcher_died_before_it_asked_ends_at_once():
    """The agent died while the worker was starting (importing torch), before it asked for
    the signal: its parent is no longer the one it started under, and it ends at once."""
    code = ("import os, attnres; attnres._started = (os.getpid(), -1); from attnres.distributed import "
            "process_context; process_context('cpu'); print('still running')")
    proc = subprocess.run([sys.executable, "-c", code], env=worker_env(**TORCHRUN_ENV, MASTER_PORT="1"),
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == -signal.SIGTERM and "still running" not in proc.stdout, proc


def test_no_parent_death_signal_without_torchrun_or_off_linux(monkeypatch):
    from attnres.distributed.launch import exit_with_launcher

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert exit_with_launcher() is False
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(sys, "platform", "darwin")
    assert exit_with_launcher() is False


@pytest.mark.slow  # a 2-rank torchrun launch: 20-40 s on a loaded 2-core machine
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_sigkilled_torchrun_takes_its_training_workers_with_it(tmp_path):
    """``kill -9`` of the torchrun agent during training: both ranks stop after the same step
    (SIGTERM through the trainer's stop handling: the step's checkpoint written) and exit
    within seconds. (They trained on, orphaned, for the 1000 steps.)"""
    from attnres.train import latest_checkpoint

    write_corpus(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "train-until-killed", str(tmp_path)]
    with open(tmp_path / "log.txt", "w") as log:
        agent = subprocess.Popen(cmd, env=worker_env(), stdout=log, stderr=subprocess.STDOUT)
    pids: list[int] = []
    try:
        started = lambda: (tmp_path / "run" / "metrics.jsonl").exists() and '"train"' in (  # noqa: E731
            tmp_path / "run" / "metrics.jsonl").read_text()
        assert wait_until(started, LAUNCH_TIMEOUT_S), (tmp_path / "log.txt").read_text()
        pids = [int((tmp_path / f"pid-{r}").read_text()) for r in (0, 1)]
        agent.kill()
        agent.wait()
        killed = time.monotonic()
        gone = wait_until(lambda: not any(alive(p) for p in pids), 30)
        print(f"the workers were gone {time.monotonic() - killed:.1f} s after the agent's SIGKILL")
        log = (tmp_path / "log.txt").read_text()
        assert gone, f"workers {[p for p in pids if alive(p)]} outlived their killed launcher:\n{log[-3000:]}"
        assert "stopped by SIGTERM after step" in log, log[-3000:]
        assert latest_checkpoint(tmp_path / "run") is not None, log[-3000:]
    finally:
        agent.kill()
        agent.wait()
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


# -- two ranks: waiting for rank 0, inputs_embeds under tp --------------------------------

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, list[str]]:
    """One 2-rank launch of the ``ranks`` worker: its directory and every rank's output."""
    from attnres.distributed.local_spawn import run_local

    root = tmp_path_factory.mktemp("ranks")
    write_corpus(root)
    outs = run_local([__file__, "ranks", str(root)], 2, timeout=LAUNCH_TIMEOUT_S, env=worker_env())
    return root, outs


def test_ranks_say_what_they_wait_for_while_rank_0_prepares_the_data(two_ranks):
    """Rank 0 prepares the data for 3.5 s: rank 1 says, every second, that it waits for it
    and what it does (it waited in silence, up to 24 h); rank 0 says nothing. The run trains."""
    root, (out0, out1) = two_ranks
    lines = [line for line in out1.splitlines() if "still waiting" in line]
    assert len(lines) >= 2, out1
    assert lines[0].startswith("rank 1: still waiting for rank 0 (preparing the data: training the tokenizer, "
                               "tokenising the corpus) after 1 s; the wait ends with an error after 24 h "
                               "(TrainConfig.setup_timeout_s)"), lines
    assert "still waiting" not in out0, out0
    assert (root / "slow" / "checkpoints").is_dir()


def test_setup_timeout_ends_the_wait_and_is_named(two_ranks):
    root, _ = two_ranks
    error = (root / "timeout-rank1.txt").read_text()
    assert error.startswith("DistributedError: rank 1 of 2: a collective failed"), error
    assert "the process-group timeout is 2 s (TrainConfig.setup_timeout_s)" in error, error


def test_setup_timeout_s_is_a_setting_of_each_launch():
    """It is checked like dist_timeout_s, and a resumed run may change it."""
    from attnres.train import TrainConfig
    from attnres.train.resume import PER_LAUNCH

    with pytest.raises(ValueError, match=r"TrainConfig.setup_timeout_s must be a finite number > 0"):
        TrainConfig(setup_timeout_s=0)
    assert TrainConfig().setup_timeout_s == 24 * 3600 and "setup_timeout_s" in PER_LAUNCH


def test_inputs_embeds_under_tensor_parallelism_match_one_process(two_ranks):
    root, _ = two_ranks
    for rank in (0, 1):
        got = json.loads((root / f"tp-rank{rank}.json").read_text())
        assert got["logits"] < 1e-5 and got["grad"] < 1e-5, got
        assert got["odd_length"].startswith("inputs_embeds of 7 positions under tensor parallelism: the sequence length "
                                            "must be divisible by parallel.tp=2"), got


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]))
