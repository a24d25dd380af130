"""Multi-node runs, reproduced on one host: two torchrun agents joined by a c10d rendezvous on
127.0.0.1 are two "nodes" of one job. The documented recipe (docs/scale-out.md) as written;
an ``out_dir`` that the nodes do not share (refused at start-up; a checkpoint missing a rank's
shard is never published); a crashed run launched again: the run lock its rank 0 left on the
other node taken over, a consolidated checkpoint resumed across the nodes (refused, naming
the way on, under a pipeline); errors and the final line printed once. Where the nodes' host
names matter (the run lock), each agent's ranks see a host name of their own
(``tests/node_host.py``).

The runs are tiny (a 2-block d=32 model, byte tokenizer, sequences of 16, 4 steps) on CPU
(gloo); every launch has a timeout (``distributed_utils``). A true mount namespace (one agent
in ``unshare -m`` with the run directory bind-mounted elsewhere) needs root: that test is
opt-in (``-m mount_namespace``); the tests that run everywhere simulate the unshared
directory by giving rank 1 another directory under the same name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("yaml")

from distributed_utils import (  # noqa: E402
    LAUNCH_TIMEOUT_S,
    mount_namespaces_work,
    torchrun,
    torchrun_agents,
    worker_env,
)

from attnres.checkpoint import find_valid_checkpoint, is_sharded  # noqa: E402
from attnres.train import load_config, train  # noqa: E402
from attnres.train.lock import LOCK_FILE, RunLock, RunLocked  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "scale-out.md"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every daft zebra".split()
CONFIG = """\
model:
  d_model: 32
seq_len: 16
batch_size: 4
steps: 4
warmup_steps: 1
checkpoint_every: 2
eval_every: 2
eval_batches: 1
log_every: 1
progress: false
tensorboard: false
data:
  paths: [{corpus}]
  tokenizer: byte
"""


def write_run_files(root: Path) -> Path:
    """``corpus.txt`` and ``config.yaml`` (the tiny run) in ``root``; returns the config."""
    rng = np.random.default_rng(0)
    lines = [" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=12)) + "." for _ in range(300)]
    (root / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    config = root / "config.yaml"
    config.write_text(CONFIG.format(corpus=root / "corpus.txt"))
    return config


def documented_train_arguments() -> list[str]:
    """What the multi-node recipe of docs/scale-out.md passes to ``-m attnres train``."""
    text = DOCS.read_text()
    block = text.split("## Multi-node launch", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    command = " ".join(line.rstrip("\\").strip() for line in block.splitlines() if line.strip() and not line.startswith("#"))
    assert command.startswith("torchrun --nnodes 2"), command
    return command.split("-m attnres train", 1)[1].split()


def combined_output(agents: list[subprocess.CompletedProcess]) -> str:
    return "\n".join(a.stdout for a in agents)


def test_documented_multinode_recipe_runs_as_written(tmp_path):
    """The recipe's command line - a positional ``config.yaml``, then overrides - on two
    agents (one rank each: the pipeline's two stages on two "nodes"; the recipe's tp=8 needs 8
    ranks per node). It trains, prints its final line once, and its checkpoints verify with
    every rank's shard."""
    write_run_files(tmp_path)
    documented = documented_train_arguments()
    assert documented[0] == "config.yaml" and "parallel.pp=2" in documented, documented
    out = tmp_path / "shared" / "run"
    args = ["config.yaml", "parallel.pp=2", f"out_dir={out}"]
    agents = torchrun_agents(["-m", "attnres", "train", *args], cwd=tmp_path)
    text = combined_output(agents)
    assert all(a.returncode == 0 for a in agents), text[-6000:]
    assert text.count("attnres train: finished at step 4") == 1, text[-3000:]
    source = find_valid_checkpoint(out)
    assert source.step == 4 and {"dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(source.state["files"])


@pytest.mark.slow
@pytest.mark.mount_namespace
def test_out_dir_unshared_in_a_mount_namespace_is_refused(tmp_path):
    """The issue's reproduction: the second agent runs in a mount namespace of its own, where
    the run directory is another directory bind-mounted over it. Before any step both nodes
    stop, each printing the error once; nothing is written anywhere (before the check, both
    "finished", every checkpoint lacked the second node's shard, and its temporary
    directories piled up in the other directory)."""
    if not mount_namespaces_work():
        pytest.skip("unshare -m (a mount namespace) needs root")
    write_run_files(tmp_path)
    shared, other = tmp_path / "shared", tmp_path / "other"
    shared.mkdir()
    other.mkdir()
    wrap = {1: ["unshare", "-m", "sh", "-c", f'mount --bind "{other}" "{shared}" && exec "$@"', "agent"]}
    agents = torchrun_agents(["-m", "attnres", "train", "config.yaml", f"out_dir={shared / 'run'}"], cwd=tmp_path,
                             wrap=wrap)
    text = combined_output(agents)
    assert all(a.returncode != 0 for a in agents), text[-4000:]
    assert text.count("is not the same directory on every rank: rank 1 on host ") == 2, text[-4000:]  # once per node
    assert "finished" not in text
    assert not any("attnres" in line for line in text.splitlines() if line.strip().startswith("File ")), text  # no traceback of ours (torchrun prints its own)
    assert [p.name for p in shared.rglob("*")] == ["run"] and list(other.iterdir()) == []


# -- a crashed run launched again on two agents ---------------------------------------------

NODE_HOST = Path(__file__).resolve().parent / "node_host.py"
CRASH_HOLDING_THE_LOCK = """\
import os, signal, socket, sys
socket.gethostname = lambda: sys.argv[2]
from attnres.train.lock import RunLock
RunLock(sys.argv[1]).acquire()
os.kill(os.getpid(), signal.SIGKILL)
"""


def crash_holding_the_lock(out_dir: Path, host: str) -> dict:
    """A process of host ``host`` takes ``out_dir``'s run lock (the code's own lock file), then
    is killed (SIGKILL: nothing released), as rank 0 of a crashed launch leaves it; returns the
    lock file's content."""
    crashed = subprocess.run([sys.executable, "-c", CRASH_HOLDING_THE_LOCK, str(out_dir), host], env=worker_env(),
                             capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert crashed.returncode == -9, crashed.stderr
    return json.loads((out_dir / LOCK_FILE).read_text())


def no_traceback_of_ours(text: str) -> bool:
    """Whether no traceback line names a file of the attnres package (torchrun prints its own
    on a failure; its files may sit under a clone whose folder is called attnres too)."""
    import attnres

    package = str(Path(attnres.__file__).resolve().parent)
    return not any(package in line for line in text.splitlines() if line.strip().startswith("File "))


def losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> Path:
    """A one-process reference run (4 steps, consolidated checkpoints at 2 and 4) and a copy
    of it, ``crashed``, as a run that crashed after step 2 (its step-4 checkpoint removed)."""
    root = tmp_path_factory.mktemp("crashed")
    train(load_config(write_run_files(root), [f"out_dir={root / 'reference'}"]))
    shutil.copytree(root / "reference", root / "crashed")
    shutil.rmtree(root / "crashed" / "checkpoints" / "step-00000004")
    return root


def launch_again(crashed: Path, name: str, args: list[str]) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """The copy ``<name>`` of the crashed run launched again on two agents: ``args`` (the
    script or ``-m attnres``, then its arguments), then ``out_dir=<the copy> --resume
    stop_after=3``. The caller checks how the agents ended."""
    run = crashed / name
    return run, torchrun_agents([*args, f"out_dir={run}", "--resume", "stop_after=3"], cwd=crashed)


@pytest.fixture(scope="module")
def relaunched_after_a_crash_on_node_1(crashed) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """The crashed run, whose rank 0 left its lock on host "node-1", launched again in
    torchrun's plain layout (FSDP2 over both ranks) on two agents, the nodes "node-0" (where
    the rendezvous puts rank 0 now) and "node-1"."""
    shutil.copytree(crashed / "crashed", crashed / "plain-after-a-crash-on-node-1")
    crash_holding_the_lock(crashed / "plain-after-a-crash-on-node-1", "node-1")
    return launch_again(crashed, "plain-after-a-crash-on-node-1",
                        [str(NODE_HOST), "node-0,node-1", "train", "config.yaml"])


@pytest.fixture(scope="module")
def relaunched_under_dp2(crashed) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """The crashed run launched again under ``parallel.dp=2`` on two agents."""
    shutil.copytree(crashed / "crashed", crashed / "dp2")
    return launch_again(crashed, "dp2", ["-m", "attnres", "train", "config.yaml", "parallel.dp=2"])


def test_two_agents_take_over_the_lock_of_a_crash_whose_rank_0_was_on_the_other_node(relaunched_after_a_crash_on_node_1):
    """Rank 0 now runs on node-0, the lock names a dead process of node-1: rank 1 (on node-1)
    finds it stale, rank 0 takes it over with one warning naming it, the run goes on and
    releases the lock when it stops."""
    run, agents = relaunched_after_a_crash_on_node_1
    text = combined_output(agents)
    assert all(a.returncode == 0 for a in agents), text[-6000:]
    taken_over = [line for line in text.splitlines() if "removing the stale lock of a run that no longer runs" in line]
    assert len(taken_over) == 1 and "on host 'node-1'" in taken_over[0], text[-4000:]
    assert text.count("attnres train: stopped at step 3 of 4 (stop_after)") == 1, text[-3000:]
    assert not (run / LOCK_FILE).exists()


# (each two-agent launch costs about half a CPU-minute: the default suite relaunches once, in
# the plain layout; the scenarios launched once more each - under parallel.dp=2, under a
# pipeline, with a lock of a host outside the job - are also checked on one two-rank launch
# below, and across two agents in the slow suite)
@pytest.mark.parametrize("launch", ["relaunched_after_a_crash_on_node_1",
                                    pytest.param("relaunched_under_dp2", marks=pytest.mark.slow)])
def test_two_agents_resume_a_consolidated_checkpoint(crashed, launch, request):
    """The consolidated step-2 checkpoint resumes across the two nodes, in torchrun's plain
    layout and under ``parallel.dp=2``: step 3 continues the one-process run (float rounding
    apart; the log's later steps, from before the crash, dropped), and its checkpoint is
    sharded, with both ranks' shards."""
    run, agents = request.getfixturevalue(launch)
    text = combined_output(agents)
    assert all(a.returncode == 0 for a in agents), text[-6000:]
    assert f"resuming {str(run / 'checkpoints' / 'step-00000002')!r} at step 2" in text, text[-4000:]
    source = find_valid_checkpoint(run / "checkpoints" / "step-00000003")
    assert is_sharded(source.state) and {"dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(source.state["files"])
    resumed, reference = losses(run), losses(crashed / "reference")
    assert sorted(resumed) == [1, 2, 3] and resumed[3] == pytest.approx(reference[3], rel=1e-5)


@pytest.mark.slow
def test_two_agents_refuse_a_consolidated_checkpoint_under_a_pipeline_with_the_workaround(crashed, tmp_path):
    """``parallel.pp=2`` across the two nodes cannot load the consolidated checkpoint: both
    nodes stop before any step, each printing the error (with the way on) once, and no
    traceback of ours; nothing is written."""
    run = tmp_path / "run"
    shutil.copytree(crashed / "crashed", run)
    agents = torchrun_agents(["-m", "attnres", "train", "config.yaml", f"out_dir={run}", "--resume", "parallel.pp=2"],
                             cwd=crashed)
    text = combined_output(agents)
    assert all(a.returncode != 0 for a in agents), text[-4000:]
    refusal = (f"attnres train: error: {str(run / 'checkpoints' / 'step-00000002')!r} is a consolidated checkpoint; "
               "pipeline-parallel runs (parallel.pp > 1) start from sharded (DCP) checkpoints only: continue it with "
               "parallel.pp=1 first")
    assert text.count(refusal) == 2, text[-4000:]  # once per node
    assert no_traceback_of_ours(text), text[-4000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]
    assert (run / "metrics.jsonl").read_text() == (crashed / "crashed" / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_two_agents_refuse_a_lock_of_a_host_outside_the_job_saying_what_to_do(crashed, tmp_path):
    """The lock names a host where neither node runs: whether its process is alive cannot be
    checked, so both nodes stop with the documented instruction (delete run.lock if that run
    is gone, and launch again), once per node; the lock stays."""
    run = tmp_path / "run"
    run.mkdir()
    holder = crash_holding_the_lock(run, "node-c")
    agents = torchrun_agents([str(NODE_HOST), "node-0,node-1", "train", "config.yaml", f"out_dir={run}"], cwd=crashed)
    text = combined_output(agents)
    assert all(a.returncode != 0 for a in agents), text[-4000:]
    assert text.count(f"attnres train: error: {str(run)!r} is locked by PID {holder['pid']} on host 'node-c'") == 2, text[-4000:]
    assert text.count(f"If it is not (it crashed or was killed, and this is a new launch of the same run), delete "
                      f"{str(run / LOCK_FILE)!r} and launch again") == 2
    assert no_traceback_of_ours(text) and "finished" not in text
    assert json.loads((run / LOCK_FILE).read_text()) == holder


# -- one 2-rank launch, several scenarios -------------------------------------------------

def cli_exit(argv: list[str]) -> int | str:
    """What ``attnres`` exits with: its status, or the message it would print (SystemExit)."""
    from attnres.cli import main

    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@contextlib.contextmanager
def patched(module, name: str, value):
    """``module.name = value`` for the block (set even where the module has no such name)."""
    before = getattr(module, name, None)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


def worker(root: Path) -> None:
    """Every scenario in turn on both ranks (``torchrun --nproc-per-node 2 this-file root``);
    each records, per rank, how ``attnres train`` ended in ``<root>/<scenario>.rank<r>.json``.
    An "unshared" out_dir is simulated by giving rank 1 another directory under its name."""
    import torch

    from attnres.cli import common
    from attnres.train import lock, loop

    torch.set_num_threads(1)
    # (each scenario ends in-process and the next starts: rank 1 need not wait for rank 0's
    # message to end the launch)
    common.SILENT_RANK_WAIT_S = 0.0
    rank = int(os.environ["RANK"])
    config = str(root / "config.yaml")
    view = "run" if rank == 0 else "rank1-view"

    def record(name: str, argv: list[str]) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ended = cli_exit(["train", config, *argv])
        (root / f"{name}.rank{rank}.json").write_text(json.dumps({"exit": ended, "warnings": [str(w.message) for w in caught]}))

    record("config-error", ["optimizer=sgd"])  # before the ranks join
    # after they join: every rank reads the same out_dir and finds the same fault
    record("missing-data", [f"out_dir={root / 'missing-data'}", f"data.paths=[{root / 'nothing.txt'}]"])
    record("holds-checkpoints", [f"out_dir={root / 'reference'}"])
    record("resume-changed", [f"out_dir={root / 'reference'}", "--resume", "model.d_model=48"])
    record("unshared", [f"out_dir={root / 'unshared' / view}"])
    with patched(loop, "check_out_dir", lambda out_dir, ctx: None):  # the first checkpoint is where it fails then
        record("unshared-checkpoint", [f"out_dir={root / 'unshared-checkpoint' / view}"])
    with patched(lock, "_host", (lambda: "node-b") if rank == 1 else lock.socket.gethostname):
        record("stale-lock", [f"out_dir={root / 'locked'}", "steps=2"])  # rank 1 runs on the crashed rank 0's host
    for name, extra in (("consolidated-dp2", ["parallel.dp=2"]), ("consolidated-plain", []),
                        ("consolidated-pp2", ["parallel.pp=2"])):
        record(name, [f"out_dir={root / name}", "--resume", "stop_after=3", *extra])
    record("sharded-resume", [f"out_dir={root / 'consolidated-dp2'}", "--resume"])
    for name, source in (("init-misfit-consolidated", root / "reference"),
                         ("init-misfit-sharded", root / "consolidated-dp2" / "checkpoints" / "step-00000003")):
        record(name, [f"out_dir={root / name}", f"init_from={source}", "model.d_model=48"])


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> Path:
    """The worker's launch. Before it: a single-process reference run (4 steps, consolidated
    checkpoints at 2 and 4), two copies of it at step 2, and a lock left by a dead process
    of host "node-b"."""
    root = tmp_path_factory.mktemp("multinode")
    config = write_run_files(root)
    train(load_config(config, [f"out_dir={root / 'reference'}"]))
    for name in ("consolidated-dp2", "consolidated-plain", "consolidated-pp2"):
        shutil.copytree(root / "reference", root / name)
        shutil.rmtree(root / name / "checkpoints" / "step-00000004")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (root / "locked").mkdir()
    (root / "locked" / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": "node-b", "started": 0,
                                                         "command": "attnres train (crashed)"}))
    torchrun(2, __file__, str(root))
    return root


def ended(root: Path, name: str) -> tuple[dict, dict]:
    return tuple(json.loads((root / f"{name}.rank{r}.json").read_text()) for r in (0, 1))


def test_errors_before_the_ranks_join_are_printed_once(scenarios):
    """Both ranks refuse the same config; only the node's first rank prints it."""
    rank0, rank1 = ended(scenarios, "config-error")
    assert rank0["exit"].startswith("attnres train: error: TrainConfig.optimizer must be one of"), rank0
    assert rank1["exit"] == 1  # the same error, not printed again


@pytest.mark.parametrize("name,error", [
    ("missing-data", "does not exist"),
    ("holds-checkpoints", "already holds checkpoints; set resume=true (--resume) to continue"),
    ("resume-changed", "the config differs in ['model.d_model'] (model.d_model: 32 there, 48 here"),
    # (the sharded one said only DCP's "Size mismatch ... for model.embed_tokens.weight")
    *((f"init-misfit-{kind}", "its weights do not fit this run's model, which differs from the checkpoint's in "
       "['model.d_model'] (model.d_model: 32 there, 48 here)") for kind in ("consolidated", "sharded")),
])
def test_errors_after_the_ranks_join_are_printed_once(scenarios, name, error):
    """A missing data file, a new run into an out_dir with checkpoints, a resume with a changed
    model, an init_from whose weights do not fit (consolidated or sharded): every rank stops,
    only the node's first rank prints the error (every rank printed it, eight lines on a node
    of eight), and the sharded misfit names the model fields that differ, as the consolidated
    one does."""
    rank0, rank1 = ended(scenarios, name)
    assert isinstance(rank0["exit"], str) and error in rank0["exit"], rank0
    assert rank1["exit"] == 1, rank1


def test_unshared_out_dir_is_refused_at_start_up(scenarios):
    """Rank 1 sees another directory under out_dir's name: every rank stops before any work
    with one error (printed by rank 0) naming rank 1 and the cause; nothing is written."""
    rank0, rank1 = ended(scenarios, "unshared")
    assert "is not the same directory on every rank: rank 1 on host " in rank0["exit"], rank0
    assert "does not see the file rank 0" in rank0["exit"] and "file system every node shares" in rank0["exit"]
    assert rank1["exit"] == 1
    assert [p.name for p in (scenarios / "unshared" / "run").iterdir()] == []
    assert not (scenarios / "unshared" / "rank1-view").exists()


def test_checkpoint_missing_a_rank_shard_is_not_published(scenarios):
    """Without the start-up check, rank 1's shard of the first checkpoint lands in its own
    directory: rank 0 sees that the DCP metadata names a file it cannot see, and every rank
    stops with that error; no checkpoint is published and no temporary directory is left in
    either directory (they used to pile up on the other node)."""
    rank0, rank1 = ended(scenarios, "unshared-checkpoint")
    assert "could not write checkpoint step-00000002" in rank0["exit"], rank0
    assert "rank 0 cannot see ['dcp/__1_0.distcp']" in rank0["exit"]
    assert "No checkpoint of this run was written yet" in rank0["exit"]
    assert rank1["exit"] == 1
    for view in ("run", "rank1-view"):
        ckpts = scenarios / "unshared-checkpoint" / view / "checkpoints"
        assert not ckpts.exists() or list(ckpts.iterdir()) == [], list(ckpts.iterdir())


def test_stale_lock_of_a_crashed_run_on_another_node_is_taken_over(scenarios):
    """The lock names a dead process of host "node-b", where rank 1 runs now (rank 0 is on
    another host): rank 1 checks it, and rank 0 takes the lock over with a warning."""
    rank0, rank1 = ended(scenarios, "stale-lock")
    assert rank0["exit"] == 0 and rank1["exit"] == 0, (rank0, rank1)
    assert any("removing the stale lock" in w and "on host 'node-b'" in w for w in rank0["warnings"]), rank0
    assert not (scenarios / "locked" / LOCK_FILE).exists()


def test_out_dir_error_names_ranks_by_host():
    """What every rank reported, in one line: the ranks that do not see rank 0's file and
    those that cannot write, by host (ranges for a node's ranks)."""
    from attnres.train.out_dir import _describe

    reports = [(0, "a", None), (1, "a", None), *((r, "b", "unseen") for r in range(2, 10)),
               (10, "c", "cannot write there (read-only file system)")]
    assert _describe(Path("/runs/x"), reports) == (
        "out_dir '/runs/x' is not the same directory on every rank: ranks 2-9 on host 'b' do not see the file rank 0 "
        "(on host 'a') wrote there. Every rank writes its shards of each checkpoint into out_dir: put it on a file "
        "system every node shares (docs/scale-out.md, multi-node launch); out_dir '/runs/x' is not writable "
        "everywhere: rank 10 on host 'c' cannot write there (read-only file system)")
    assert _describe(Path("/runs/x"), reports[:2]) is None


def test_lock_of_a_host_outside_the_job_says_what_to_do(tmp_path):
    """A lock of a host where no rank runs cannot be checked: the error says when and how
    to remove it."""
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 12, "host": "node-c", "started": 0}))
    with pytest.raises(RunLocked, match=r"locked by PID 12 on host 'node-c' .*, a host that runs no rank of this job, "
                       r"so whether that run is still alive cannot be checked from here\. If it is not \(it crashed "
                       r"or was killed, and this is a new launch of the same run\), delete '.*run\.lock' and launch "
                       r"again"):
        RunLock(tmp_path).acquire()


@pytest.mark.parametrize("name", ["consolidated-dp2", "consolidated-plain"])
def test_consolidated_checkpoint_resumes_under_parallel_dp_and_plain(scenarios, name):
    """A one-process (consolidated) checkpoint resumes on 2 ranks given as ``parallel.dp=2``
    and as a plain launch, and continues the single-process run (float rounding apart); its
    next checkpoint is sharded."""
    rank0, rank1 = ended(scenarios, name)
    assert rank0["exit"] == 0 and rank1["exit"] == 0, (rank0, rank1)
    source = find_valid_checkpoint(scenarios / name / "checkpoints" / "step-00000003")
    assert is_sharded(source.state)
    reference, resumed = losses(scenarios / "reference"), losses(scenarios / name)
    assert resumed[3] == pytest.approx(reference[3], rel=1e-5)


def test_consolidated_checkpoint_under_a_pipeline_is_refused_with_the_workaround(scenarios):
    """A pipeline (``parallel.pp=2``) cannot load a consolidated checkpoint: every rank stops
    before any step with one error that says how to go on (resume it without a pipeline
    first); nothing is written."""
    rank0, rank1 = ended(scenarios, "consolidated-pp2")
    assert "is a consolidated checkpoint; pipeline-parallel runs (parallel.pp > 1) start from sharded" in rank0["exit"], rank0
    assert "continue it with parallel.pp=1 first" in rank0["exit"]
    assert rank1["exit"] == 1
    assert sorted(p.name for p in (scenarios / "consolidated-pp2" / "checkpoints").iterdir()) == ["step-00000002"]


def test_sharded_checkpoint_resumes_on_two_ranks(scenarios):
    """The sharded step-3 checkpoint (its metadata read by the restricted unpickler on each
    rank) resumes on 2 ranks to the end of the reference run."""
    rank0, rank1 = ended(scenarios, "sharded-resume")
    assert rank0["exit"] == 0 and rank1["exit"] == 0, (rank0, rank1)
    assert losses(scenarios / "consolidated-dp2")[4] == pytest.approx(losses(scenarios / "reference")[4], rel=1e-5)


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
