"""Launching multi-process workers from tests: ``torchrun`` in a subprocess, always with a
timeout, so that a distributed bug fails the test instead of hanging CI; a launch that runs
past it is stopped with its workers (:func:`stop_agent`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
# Generous: a launch imports torch in every process, 10-40 s on a loaded 2-core machine.
LAUNCH_TIMEOUT_S = 300
# How long a torchrun agent gets to stop its workers after SIGTERM (it gives them 30 s itself).
AGENT_STOP_S = 45


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a worker: this checkout's ``attnres`` and the test helpers
    importable, one thread per process."""
    path = os.pathsep.join([str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def torchrun(nproc: int, *args: str, timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc args`` (a script and its arguments, or
    ``-m module ...``) on the CPU (gloo); raise with the output unless every rank exits 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    agent = subprocess.Popen(cmd, env=worker_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = agent.communicate(timeout=timeout)
    finally:
        stop_agent(agent)
    proc = subprocess.CompletedProcess(cmd, agent.returncode, out, err)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def run_doc_example(doc: str, name: str, checks: str, tmp_path: Path) -> str:
    """Run the ``python`` block of ``docs/<doc>`` as its first line says (``# NAME - run it as:
    torchrun --nproc-per-node 2 NAME``), saved as ``NAME`` with ``checks`` (Python run after
    it) appended; the launch's standard output."""
    import re

    block = re.search(r"```python\n(.*?)```", (SRC.parent / "docs" / doc).read_text(), re.S).group(1)
    assert block.startswith(f"# {name} - run it as: torchrun --nproc-per-node 2 {name}\n"), block[:200]
    script = tmp_path / name
    script.write_text(block + checks)
    return torchrun(2, str(script)).stdout


def torchrun_agents(args: list[str], nnodes: int = 2, nproc: int = 1, cwd: Path | None = None,
                    wrap: dict[int, list[str]] | None = None, timeout: float = LAUNCH_TIMEOUT_S,
                    env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """``nnodes`` torchrun agents on this host, joined by a c10d rendezvous on 127.0.0.1, as
    the nodes of a multi-node job are: every agent runs ``torchrun --nnodes N --nproc-per-node
    nproc --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID --rdzv-conf
    is_host=false args``, the rendezvous store served from this process on a port bound at
    once (:func:`~attnres.distributed.local_spawn.rendezvous_env`: a port found free and
    bound later by the first agent could be taken in between). ``wrap[i]`` is put in front of
    agent ``i``'s command (e.g. ``unshare -m sh -c '... exec "$@"' agent``: in a mount
    namespace of its own). Returns every agent's completed process (output merged, under
    ``stdout``); the caller checks the exit statuses."""
    from attnres.distributed.local_spawn import rendezvous_env

    with rendezvous_env() as rendezvous:
        port = rendezvous["MASTER_PORT"]
        base = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=job{port}",
                "--rdzv-conf=is_host=false", *args]
        return _run_agents(base, nnodes, cwd, wrap, timeout, env)


def _run_agents(base: list[str], nnodes: int, cwd: Path | None, wrap: dict[int, list[str]] | None, timeout: float,
                env: dict[str, str] | None) -> list[subprocess.CompletedProcess]:
    procs = []
    for i in range(nnodes):
        cmd = [*wrap[i], *base] if wrap and i in wrap else base
        procs.append(subprocess.Popen(cmd, env={**worker_env(), **(env or {})}, cwd=cwd, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    done = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    finally:
        for p in procs:
            stop_agent(p)
    return done


def stop_agent(agent: subprocess.Popen) -> None:
    """Stop a torchrun agent that still runs, and its workers: SIGTERM, which the agent passes
    on to them, then SIGKILL if it has not ended in :data:`AGENT_STOP_S`. (SIGKILL alone would
    leave the workers running: each is the leader of a session of its own.)"""
    if agent.poll() is not None:
        return
    agent.terminate()
    try:
        agent.communicate(timeout=AGENT_STOP_S)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.communicate()


def mount_namespaces_work() -> bool:
    """Whether ``unshare -m`` (a private mount namespace: root) works here."""
    try:
        return subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
