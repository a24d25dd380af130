"""The computer this process runs on, in words: its CPU's model name, and what a timing on
the CPU depends on (which ``attnres env`` shows and ``overhead.json`` records); and the one
reader of Linux's ``/proc/cpuinfo`` (the CPU kernel's build is keyed by its lines too)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

__all__ = ["cpu_machine", "cpu_name", "cpuinfo_lines"]

#: Where Linux describes the CPU (macOS and Windows have no such file).
CPUINFO = Path("/proc/cpuinfo")

#: What names an ARM CPU in ``/proc/cpuinfo``: Linux on aarch64 has no "model name" line
#: (as ``attnres.ops.depth_attention.cpu_kernel`` keys its build).
_ARM_ID = ("CPU implementer", "CPU variant", "CPU part", "CPU revision")


#: What names a Mac's CPU ("Apple M2 Pro", "Intel(R) Core(TM) i7-9750H ..."): macOS has no
#: ``/proc/cpuinfo``, and ``platform.processor()`` there is only "arm" or "i386".
_DARWIN_BRAND = ("sysctl", "-n", "machdep.cpu.brand_string")


def cpuinfo_lines() -> list[str] | None:
    """The lines of :data:`CPUINFO`, or ``None`` where it cannot be read (not Linux)."""
    try:
        return CPUINFO.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None


def _darwin_cpu_brand() -> str | None:
    """A Mac's CPU model name, or ``None`` where ``sysctl`` cannot say (missing, slow, failed)."""
    try:
        done = subprocess.run(_DARWIN_BRAND, capture_output=True, text=True, timeout=2, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; an ARM CPU's implementer, variant, part and
    revision, the values of its cores joined where they differ; a Mac's brand string), or what
    ``platform`` knows."""
    arm: dict[str, list[str]] = {}
    for line in cpuinfo_lines() or ():
        key, _, value = line.partition(":")
        if line.startswith("model name"):
            return value.strip()
        if key.strip() in _ARM_ID and value.strip() not in arm.setdefault(key.strip(), []):
            arm[key.strip()].append(value.strip())
    if arm:  # (every ARM CPU was "aarch64": another one of as many cores was the same machine)
        return ", ".join(f"{key} {'/'.join(arm[key])}" for key in _ARM_ID if key in arm)
    if platform.system() == "Darwin":  # (else two Macs of as many cores, an M1 and an M3, were one machine)
        brand = _darwin_cpu_brand()
        if brand:
            return brand
    return platform.processor() or platform.machine()


def cpu_machine() -> dict[str, str | int | None]:
    """What tells the machine a CPU timing was taken on from another: the CPU's model name,
    its number of cores and the architecture. A timing taken elsewhere is not this machine's."""
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "architecture": platform.machine()}
