"""Depth attention (report §3.1) and the operations of its two-phase schedule (report §4.2).

* :mod:`.reference`: the readable reference - :func:`depth_attention` (one query over its
  sources), and the two operations of the two-phase schedule, :func:`~.reference.phase1`
  and :func:`~.reference.merge`, as plain autograd graphs;
* :mod:`.library`: the same operations as ``torch.library`` custom operators
  (``attnres::phase1``, ``attnres::merge`` and their backward operators), with fake
  implementations and registered autograd, dispatched by device to one of the
  implementations:
* :mod:`.torch_impl` (PyTorch, any device), :mod:`.cpu_kernel` (a C kernel, CPU float32 /
  float64), :mod:`.triton_impl` (Triton kernels, GPUs; optional);
* :mod:`.ablations`: the report's Table-4 ablations of depth attention (the naive path only).

:func:`operations` hands a residual module one of these families by its backend (one of
:data:`BACKENDS`, ``ResidualConfig.backend``): the schedules of Full and Block AttnRes call
nothing else.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from ...validation import did_you_mean
from . import library, reference
from .reference import check_sources, compute_dtype, depth_attention

__all__ = ["depth_attention", "check_sources", "compute_dtype", "Operations", "operations", "OPERATIONS", "BACKENDS"]


class Operations(NamedTuple):
    """One family of the operations, with the signatures of :mod:`.reference`."""

    name: str
    phase1: Callable
    merge: Callable


def _custom_ops(backend: str) -> Operations:
    def phase1(qg, sources, eps=1e-6, out_dtype=None):
        return library.phase1(qg, sources, eps, backend, out_dtype)

    def merge(z, sources, computed=(), qg=None, eps=1e-6, norm_weight=None, norm_eps=1e-6, addend=None,
              out_dtype=None, readers=1):
        return library.merge(z, sources, computed, qg, eps, norm_weight, norm_eps, backend, addend, out_dtype,
                             readers)

    return Operations(backend, phase1, merge)


#: The backends of the operations: the custom operators' (``"auto"``: by device, ``"torch"``,
#: ``"triton"``) and ``"reference"`` (the plain autograd graphs of :mod:`.reference`).
BACKENDS = (*library.BACKENDS, "reference")
#: The families by backend.
OPERATIONS = {**{backend: _custom_ops(backend) for backend in library.BACKENDS},
              "reference": Operations("reference", reference.phase1, reference.merge)}


def operations(backend: str) -> Operations:
    """The family of ``backend`` (one of :data:`BACKENDS`)."""
    if backend not in OPERATIONS:
        raise ValueError(f"depth-attention backend must be one of {BACKENDS}, got {backend!r}"
                         f"{did_you_mean(backend, BACKENDS)}")
    return OPERATIONS[backend]
