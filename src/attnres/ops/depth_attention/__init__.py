"""Depth attention (report §3.1) and the operations of its two-phase schedule (report §4.2).

* :mod:`.reference`: the readable reference - :func:`depth_attention` (one query over its
  sources), and the two operations of the two-phase schedule, :func:`~.reference.phase1`
  and :func:`~.reference.merge`, as plain autograd graphs;
* :mod:`.library`: the same operations as ``torch.library`` custom operators
  (``attnres::phase1``, ``attnres::merge`` and their backward operators), with fake
  implementations and registered autograd, dispatched by device to one of the
  implementations:
* :mod:`.torch_impl` (PyTorch, any device), :mod:`.cpu_kernel` (a C kernel, CPU float32 /
  float64), :mod:`.triton_impl` (Triton kernels, GPUs; optional).

:func:`operations` hands a residual module one of these families by name: the schedules of
Full and Block AttnRes call nothing else.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from . import library, reference
from .library import IMPLS
from .reference import check_sources, compute_dtype, depth_attention

__all__ = ["depth_attention", "check_sources", "compute_dtype", "Operations", "operations", "OPERATIONS", "IMPLS"]


class Operations(NamedTuple):
    """One family of the operations, with the signatures of :mod:`.reference`."""

    name: str
    phase1: Callable
    merge: Callable


def _custom_ops(impl: str) -> Operations:
    def phase1(qg, sources, eps=1e-6):
        return library.phase1(qg, sources, eps, impl)

    def merge(z, sources, computed=(), qg=None, eps=1e-6, norm_weight=None, norm_eps=1e-6, addend=None):
        return library.merge(z, sources, computed, qg, eps, norm_weight, norm_eps, impl, addend)

    return Operations(impl, phase1, merge)


#: The families by name: the custom operators with ``impl`` ``"auto"``, ``"torch"`` or
#: ``"triton"``, and ``"reference"`` (the plain autograd graphs of :mod:`.reference`).
OPERATIONS = {**{impl: _custom_ops(impl) for impl in IMPLS},
              "reference": Operations("reference", reference.phase1, reference.merge)}


def operations(name: str) -> Operations:
    """The family ``name`` (a key of :data:`OPERATIONS`)."""
    if name not in OPERATIONS:
        raise ValueError(f"depth-attention operations must be one of {sorted(OPERATIONS)}, got {name!r}")
    return OPERATIONS[name]
