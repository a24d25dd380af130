"""The computer this process runs on, in words: its CPU's model name, and what a timing on
the CPU depends on (which ``attnres env`` shows and ``overhead.json`` records)."""

from __future__ import annotations

import os
import platform

__all__ = ["cpu_machine", "cpu_name"]


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_machine() -> dict[str, str | int | None]:
    """What tells the machine a CPU timing was taken on from another: the CPU's model name,
    its number of cores and the architecture. A timing taken elsewhere is not this machine's."""
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "architecture": platform.machine()}
