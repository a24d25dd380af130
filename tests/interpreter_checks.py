"""Memory-access checks for the Triton kernels under Triton's interpreter.

A GPU faults on what the interpreter lets pass: a load or store outside every tensor the
kernel was handed (the interpreter reads or writes the host's memory there, and a masked-out
value hides it from a parity test), or a pointer the kernel declares aligned
(``tl.multiple_of``) that is not (a 16-byte access at a misaligned address); and it runs
programs one by one, so a race between them cannot show. A memory fault is sticky on a GPU:
every later kernel of the process fails with it, so one such bug would cost a whole GPU
session. :func:`checked_accesses` makes each an error under the interpreter:

* every address a kernel loads or stores (where its mask is on) must lie, with its whole
  element, inside one of the kernel's tensor arguments (tuples of tensors included) - the
  span from the tensor's first element to its last, not the rest of its storage;
* every value given to ``tl.multiple_of`` must be a multiple of what it claims;
* no program of a launch may store to an address another program of the same launch loads
  or stores: the interpreter runs the programs one after the other, a GPU at once - such a
  pair is a race there (the kernels use no atomics).

The default suite runs every interpreted kernel under it (``tests/conftest.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


class AccessError(AssertionError):
    """A kernel accessed memory outside its tensor arguments, hinted a wrong alignment, or
    has two programs of a launch touching one address, one of them storing."""


def _spans(value, name: str, out: list) -> None:
    """``(start, end, name)`` of each tensor in ``value`` (tuples searched): the bytes from its
    first element to the end of its last."""
    if isinstance(value, tuple):
        for i, v in enumerate(value):
            _spans(v, f"{name}[{i}]", out)
        return
    t = getattr(value, "base", value)  # (triton's TensorWrapper: a reinterpreted tensor)
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.data_ptr()
    out.append((start, start + (last + 1) * t.element_size(), name))


class _Checker:
    def __init__(self) -> None:
        self.stack: list[tuple[str, np.ndarray, np.ndarray, np.ndarray, list[str]]] = []
        #: Per running launch, ``{"load"/"store": [(addresses, program), ...]}``.
        self.accesses: list[dict[str, list]] = []

    def enter(self, kernel: str, arguments: dict) -> None:
        spans: list = []
        for name, value in arguments.items():
            _spans(value, name, spans)
        spans.sort()
        starts = np.array([s for s, _, _ in spans], dtype=np.uint64)
        ends = np.array([e for _, e, _ in spans], dtype=np.uint64)
        # (an address is inside some span iff the furthest end of the spans starting at or
        # before it reaches past its element: one binary search an address)
        reach = np.maximum.accumulate(ends) if len(spans) else ends
        self.stack.append((kernel, starts, ends, reach, [n for _, _, n in spans]))
        self.accesses.append({"load": [], "store": []})

    def leave(self, ok: bool) -> None:
        kernel = self.stack.pop()[0]
        accesses = self.accesses.pop()
        if ok:
            _check_races(kernel, accesses)

    def check(self, what: str, ptrs, mask) -> None:
        if not self.stack:
            return
        kernel, starts, ends, reach, names = self.stack[-1]
        addresses = np.broadcast_to(ptrs.data, np.shape(mask.data))[np.asarray(mask.data, dtype=bool)]
        if addresses.size == 0:
            return
        size = np.uint64(ptrs.get_element_ty().primitive_bitwidth // 8)
        addresses = addresses.astype(np.uint64).ravel()
        self.accesses[-1][what].append((addresses, _program()))
        at = np.searchsorted(starts, addresses, side="right") - 1
        inside = (at >= 0) & (addresses + size <= reach[np.maximum(at, 0)])
        if inside.all():
            return
        bad = int(addresses[~inside][0])
        below = [(bad - int(s), n) for s, n in zip(starts, names) if int(s) <= bad]
        where = (f"{min(below)[0]} bytes past the start of {min(below)[1]} (which ends at byte "
                 f"{int(ends[names.index(min(below)[1])]) - int(starts[names.index(min(below)[1])])})"
                 if below else "below every argument")
        raise AccessError(f"{kernel}: {int((~inside).sum())} of {addresses.size} {what} addresses lie outside its "
                          f"tensor arguments; the first at {where}")


def _program() -> int:
    """The running program's index in its launch's grid, as one number."""
    from triton.runtime.interpreter import interpreter_builder as b

    (x, y, z), (nx, ny, _) = b.grid_idx, b.grid_dim
    return (z * ny + y) * nx + x


def _joined(pairs: list) -> tuple[np.ndarray, np.ndarray]:
    """``(addresses, program)`` pairs as two aligned arrays."""
    if not pairs:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    return (np.concatenate([a for a, _ in pairs]),
            np.concatenate([np.full(a.size, p, np.int64) for a, p in pairs]))


def _check_races(kernel: str, accesses: dict) -> None:
    """Raise :class:`AccessError` where two programs of one launch store to one address, or
    one loads what another stores."""
    stored, writers = _joined(accesses["store"])
    if stored.size == 0:
        return
    order = np.argsort(stored, kind="stable")
    stored, writers = stored[order], writers[order]
    # (among the entries of one address, two programs make some neighbouring pair differ)
    twice = (stored[1:] == stored[:-1]) & (writers[1:] != writers[:-1])
    if twice.any():
        raise AccessError(f"{kernel}: programs {writers[1:][twice][0]} and {writers[:-1][twice][0]} of one launch "
                          f"store to the same address ({int(np.unique(stored[1:][twice]).size)} such addresses): "
                          "a race on a GPU")
    loaded, readers = _joined(accesses["load"])
    at = np.clip(np.searchsorted(stored, loaded), 0, stored.size - 1)  # (one writer an address, checked above)
    clash = (stored[at] == loaded) & (writers[at] != readers)
    if clash.any():
        raise AccessError(f"{kernel}: program {readers[clash][0]} loads an address program {writers[at][clash][0]} "
                          f"of the same launch stores ({int(np.unique(loaded[clash]).size)} such loads): "
                          "a race on a GPU")


_checker = _Checker()


@contextmanager
def checked_accesses() -> Iterator[None]:
    """Within the block, every kernel Triton's interpreter runs has its loads, stores and
    alignment hints checked (see the module docstring); an :class:`AccessError` (through
    the interpreter's error) names the kernel and the first bad address."""
    from triton.runtime import interpreter

    builder, executor, handle = interpreter.InterpreterBuilder, interpreter.GridExecutor, interpreter.TensorHandle
    load, store, call, set_attr = (builder.create_masked_load, builder.create_masked_store, executor.__call__,
                                   handle.set_attr)

    def checked_load(self, ptrs, mask, other, *args, **kwargs):
        _checker.check("load", ptrs, mask)
        return load(self, ptrs, mask, other, *args, **kwargs)

    def checked_store(self, ptrs, value, mask, *args, **kwargs):
        _checker.check("store", ptrs, mask)
        return store(self, ptrs, value, mask, *args, **kwargs)

    def checked_call(self, *args, **kwargs):
        names = self.arg_names
        arguments = {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}
        _checker.enter(getattr(self.fn, "__name__", "a kernel"), arguments)
        ok = False
        try:
            result = call(self, *args, **kwargs)
            ok = True
            return result
        finally:
            _checker.leave(ok)

    def checked_set_attr(self, name, values):
        if name == "tt.divisibility" and _checker.stack:
            multiple = int(values[0]) if len(values) == 1 else None
            data = np.asarray(self.data)
            if multiple and data.dtype.kind in "iu":
                off = data.astype(np.uint64).ravel() % np.uint64(multiple)
                if off.any():
                    raise AccessError(f"{_checker.stack[-1][0]}: tl.multiple_of({multiple}) of a value that is "
                                      f"{int(off[off != 0][0])} past a multiple of it")
        return set_attr(self, name, values)

    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
    executor.__call__, handle.set_attr = checked_call, checked_set_attr
    try:
        yield
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store
        executor.__call__, handle.set_attr = call, set_attr
