"""Launching multi-process workers from tests: ``torchrun`` in a subprocess, always with a
timeout, so that a distributed bug fails the test instead of hanging CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
# Generous: a launch imports torch in every process, 10-40 s on a loaded 2-core machine.
LAUNCH_TIMEOUT_S = 300


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a worker: this checkout's ``attnres`` and the test helpers
    importable, one thread per process."""
    path = os.pathsep.join([str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def torchrun(nproc: int, *args: str, timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc args`` (a script and its arguments, or
    ``-m module ...``) on the CPU (gloo); raise with the output unless every rank exits 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc
