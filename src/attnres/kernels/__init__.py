"""Fused kernels for the two-phase schedule.

* ``phase1``, ``phase2``, ``merge`` (with ``launch``, ``norm_tiles``): Triton kernels for
  GPUs (optional: needs ``triton``, not a dependency of the package; import them only where
  it is installed). On CPU they run under Triton's interpreter (``TRITON_INTERPRET=1``),
  which is how the tests check them without a GPU.
* ``cpu`` (``cpu_merge.c``): the training path's merge, Phase 1 and logits on CPU, a C kernel
  compiled on first use and called through ``ctypes`` (no dependency beyond a C compiler).
"""

from __future__ import annotations


def triton_available() -> bool:
    """Whether ``triton`` can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["triton_available"]
