"""How the process's C allocator hands CPU memory back between training steps.

A training step allocates and frees the same activations every step. glibc's ``malloc``
serves large blocks with ``mmap`` above a dynamic threshold (128 KiB rising to at most
32 MiB) and returns the top of its heap to the system above twice that, so every step pages
those blocks in again: the kernel zero-fills each fresh 4 KiB page on first touch, a cost
that grows with the activations (docs/training-overhead.md measures it).

``"retain"`` raises both thresholds (``mallopt``) to the largest value glibc takes, so
freed blocks stay in the process and the next step reuses them without faulting. This is
what tcmalloc and jemalloc (PyTorch's CPU tuning guide recommends either for training) and
PyTorch's own CUDA caching allocator do. The resident memory stays at the step's peak
instead of falling between steps. ``"system"`` leaves the allocator as it is.

The setting is process-wide and cannot be undone: glibc has no call that restores its
dynamic threshold. So only the ``attnres`` command applies it (``TrainConfig.cpu_allocator``,
to its own process, before it trains); the library never does - building a
:class:`~attnres.train.loop.Trainer` or calling :func:`attnres.train.train` leaves malloc as
it is, and a program that wants the setting calls :func:`set_cpu_allocator` itself. On
other C libraries (musl, macOS) there is nothing to set and :func:`set_cpu_allocator`
returns ``False``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
import sys

__all__ = ["CPU_ALLOCATORS", "set_cpu_allocator", "retains_freed_memory", "minor_page_faults", "peak_rss_bytes"]

#: ``TrainConfig.cpu_allocator``: keep freed memory for reuse, or leave malloc as it is.
CPU_ALLOCATORS = ("retain", "system")

# glibc's mallopt parameters (malloc.h) and the largest value its ``int`` argument holds.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_LARGEST = 2**31 - 1


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return libc
    except (OSError, AttributeError, TypeError):
        return None


_retained = False


def set_cpu_allocator(kind: str) -> bool:
    """Apply ``kind`` (one of :data:`CPU_ALLOCATORS`) to this process; return whether the
    allocator now retains freed memory (``"system"`` after ``"retain"`` in the same process
    still does: glibc cannot go back). Idempotent; see the module docstring for what
    ``"retain"`` changes and why."""
    global _retained
    if kind not in CPU_ALLOCATORS:
        raise ValueError(f"cpu_allocator must be one of {list(CPU_ALLOCATORS)}; got {kind!r}")
    libc = _glibc()
    if kind == "retain" and not _retained and libc is not None:
        # Blocks up to 2 GiB come from the heap (not mmap), and the heap's top goes back to
        # the system only when more than 2 GiB of it are free.
        mmap_set = libc.mallopt(_M_MMAP_THRESHOLD, _LARGEST)
        trim_set = libc.mallopt(_M_TRIM_THRESHOLD, _LARGEST)
        _retained = bool(mmap_set and trim_set)
    return _retained


def retains_freed_memory() -> bool:
    """Whether :func:`set_cpu_allocator` made this process's allocator retain freed memory."""
    return _retained


def minor_page_faults() -> int:
    """Minor page faults of this process so far (``getrusage``); ``-1`` where unavailable."""
    try:
        import resource
    except ImportError:  # not on Windows
        return -1
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (``getrusage``'s ``ru_maxrss``: KiB on
    Linux, bytes on macOS); ``-1`` where unavailable."""
    try:
        import resource
    except ImportError:  # not on Windows
        return -1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
