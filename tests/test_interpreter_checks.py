"""The memory-access checks every interpreted kernel runs under (:mod:`interpreter_checks`,
switched on for the whole suite by ``conftest``) catch what a GPU would fault on or race
over: a masked load or store past a tensor's last element - of a view too, whose storage
goes on -, an alignment hint that does not hold, two programs of one launch storing to one
address or one loading what another stores; and they let correct accesses through."""

from __future__ import annotations

import pytest
import torch
from conftest import TRITON_DEVICE

triton = pytest.importorskip("triton")
if TRITON_DEVICE != "cpu":
    pytest.skip("the checks run under Triton's interpreter", allow_module_level=True)

import triton.language as tl  # noqa: E402
from interpreter_checks import AccessError, checked_accesses  # noqa: E402


@pytest.fixture(autouse=True)
def _checked():
    """On here too, where ``ATTNRES_CHECK_KERNEL_ACCESSES=0`` switched the suite's off."""
    with checked_accesses():
        yield


@triton.jit
def _copy(X, Y, n, BLOCK: tl.constexpr, READ_PAST: tl.constexpr, WRITE_PAST: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(X + i, mask=i < n + READ_PAST, other=0.0)
    tl.store(Y + i, x, mask=i < n + WRITE_PAST)


@triton.jit
def _hinted(X, Y, SHIFT: tl.constexpr):
    p = tl.multiple_of(X + SHIFT, 16)  # (a pointer's divisibility: in bytes)
    tl.store(Y, tl.load(p))


@triton.jit
def _shifted(X, Y, SHIFT: tl.constexpr, STORE: tl.constexpr):
    """Program ``p`` stores ``X[p + SHIFT]`` to ``Y[p]`` (``STORE``) or else to ``X[p]``."""
    p = tl.program_id(0)
    x = tl.load(X + p + SHIFT)
    if STORE:
        tl.store(Y + p, x)
    else:
        tl.store(X + p, x)


def _raises(fn, *words):
    with pytest.raises(Exception) as info:  # (the interpreter wraps it in its own error)
        fn()
    text = repr(info.value) + repr(info.value.__cause__)
    assert "AccessError" in text and all(w in text for w in words), text


def test_in_bounds_accesses_pass_and_run():
    x, y = torch.randn(10), torch.empty(10)
    _copy[(1,)](x, y, 10, BLOCK=16, READ_PAST=0, WRITE_PAST=0)
    assert torch.equal(x, y)
    z = torch.zeros(8)
    _hinted[(1,)](x, z, SHIFT=4)  # (x is 64-byte aligned: x + 4 elements is 16-byte aligned)
    assert z[0] == x[4]


def test_a_load_or_store_past_the_last_element_is_an_error():
    x, y = torch.randn(10), torch.empty(10)
    _raises(lambda: _copy[(1,)](x, y, 10, BLOCK=16, READ_PAST=1, WRITE_PAST=0), "_copy", "1 of 11 load",
            "40 bytes past the start of X")
    _raises(lambda: _copy[(1,)](x, y, 10, BLOCK=16, READ_PAST=0, WRITE_PAST=1), "store", "past the start of Y")


def test_a_view_is_its_own_span_not_its_storage():
    storage = torch.randn(12)
    view, y = storage[1:10], torch.empty(12)
    _copy[(1,)](view, y, 9, BLOCK=16, READ_PAST=0, WRITE_PAST=0)
    _raises(lambda: _copy[(1,)](view, y, 9, BLOCK=16, READ_PAST=1, WRITE_PAST=0), "36 bytes past the start of X")


def test_a_wrong_alignment_hint_is_an_error():
    x, z = torch.randn(10), torch.zeros(1)
    _raises(lambda: _hinted[(1,)](x, z, SHIFT=1), "multiple_of(16)", "4 past a multiple")


def test_programs_that_race_on_a_gpu_are_an_error():
    x, y = torch.randn(8), torch.empty(8)
    _shifted[(4,)](x, y, SHIFT=1, STORE=True)  # (reads X, writes Y: no program reads what another writes)
    _shifted[(4,)](x, y, SHIFT=0, STORE=False)  # (each program reads and writes its own element)
    _raises(lambda: _shifted[(4,)](x, y, SHIFT=1, STORE=False), "program 0 loads an address program 1",
            "3 such loads")
    _raises(lambda: _copy[(2,)](x, y, 8, BLOCK=8, READ_PAST=0, WRITE_PAST=0), "programs 1 and 0",
            "8 such addresses")


def test_leaving_the_checks_restores_the_interpreter():
    from triton.runtime import interpreter

    checked = interpreter.InterpreterBuilder.create_masked_load
    with checked_accesses():  # (nested: on, then restored to what it was)
        assert interpreter.InterpreterBuilder.create_masked_load is not checked
    assert interpreter.InterpreterBuilder.create_masked_load is checked
    assert isinstance(AccessError("x"), AssertionError)
