"""Start a few local worker processes the way ``torchrun`` does, with a hard time limit.

Tests and benchmarks use this instead of ``torchrun``: one Python process fewer to start
(importing torch costs seconds on a loaded CPU), and a worker that fails or hangs ends all
of them within ``timeout`` instead of blocking CI.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

__all__ = ["rendezvous_env", "run_local"]


@contextlib.contextmanager
def rendezvous_env() -> Iterator[dict[str, str]]:
    """Serve a ``TCPStore`` from this process on 127.0.0.1 while the block runs, and give the
    environment that makes each worker's ``init_process_group`` a client of it
    (``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE``), as torchrun's agent
    serves its workers' store.

    The store is bound to the port the kernel gives it (port 0), so no other process can take
    that port first. A port found free here and bound later by rank 0 could be: other
    processes' sockets took it in the seconds rank 0 spent importing torch (another test's
    gloo connections, a second pytest-xdist worker), and the launch failed."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store  # (the last reference: the server stops)


def run_local(argv: Sequence[str], n_procs: int, timeout: float, env: dict[str, str] | None = None) -> list[str]:
    """Run ``python argv...`` ``n_procs`` times with torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; one thread each; the
    store served from this process, :func:`rendezvous_env`) and return their stdouts. Raises
    ``RuntimeError`` with the failing worker's output if one exits non-zero or the group is
    not done within ``timeout`` seconds (all are killed)."""
    with rendezvous_env() as rendezvous:
        return _run_workers(argv, n_procs, timeout, {**os.environ, **(env or {}), **rendezvous})


def _run_workers(argv: Sequence[str], n_procs: int, timeout: float, base: dict[str, str]) -> list[str]:
    base = {**base, "WORLD_SIZE": str(n_procs), "OMP_NUM_THREADS": "1"}
    procs, logs = [], []
    for rank in range(n_procs):
        log = tempfile.TemporaryFile(mode="w+")
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv],
                env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        logs.append(log)
    deadline = time.monotonic() + timeout
    failure = None
    try:
        while failure is None and any(p.poll() is None for p in procs):
            bad = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if bad:
                failure = f"worker {bad[0]} exited with code {procs[bad[0]].returncode}"
            elif time.monotonic() > deadline:
                failure = f"workers not done after {timeout:.0f} s"
            else:
                time.sleep(0.05)
        if failure is None:
            bad = [r for r, p in enumerate(procs) if p.returncode != 0]
            failure = f"worker {bad[0]} exited with code {procs[bad[0]].returncode}" if bad else None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if failure is not None:
        shown = "\n".join(f"--- worker {r} ---\n{out[-4000:]}" for r, out in enumerate(outputs))
        raise RuntimeError(f"{failure}\n{shown}")
    return outputs
