"""The computer this process runs on, in words: its CPU's model name, and what a timing on
the CPU depends on (which ``attnres env`` shows and ``overhead.json`` records)."""

from __future__ import annotations

import os
import platform

__all__ = ["cpu_machine", "cpu_name"]

#: What names an ARM CPU in ``/proc/cpuinfo``: Linux on aarch64 has no "model name" line
#: (as ``attnres.ops.depth_attention.cpu_kernel`` keys its build).
_ARM_ID = ("CPU implementer", "CPU variant", "CPU part", "CPU revision")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; an ARM CPU's implementer, variant, part and
    revision, the values of its cores joined where they differ), or what ``platform`` knows."""
    arm: dict[str, list[str]] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                key, _, value = line.partition(":")
                if line.startswith("model name"):
                    return value.strip()
                if key.strip() in _ARM_ID and value.strip() not in arm.setdefault(key.strip(), []):
                    arm[key.strip()].append(value.strip())
    except OSError:
        pass
    if arm:  # (every ARM CPU was "aarch64": another one of as many cores was the same machine)
        return ", ".join(f"{key} {'/'.join(arm[key])}" for key in _ARM_ID if key in arm)
    return platform.processor() or platform.machine()


def cpu_machine() -> dict[str, str | int | None]:
    """What tells the machine a CPU timing was taken on from another: the CPU's model name,
    its number of cores and the architecture. A timing taken elsewhere is not this machine's."""
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "architecture": platform.machine()}
