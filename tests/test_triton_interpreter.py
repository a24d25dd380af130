"""The suite's Triton interpreter patches the language once per launch (tests/triton_interpreter.py),
not again on every call of a device function, and computes the same."""

from __future__ import annotations

import pytest
import torch

from conftest import TRITON_DEVICE

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

pytestmark = pytest.mark.skipif(TRITON_DEVICE != "cpu", reason="the interpreter runs only where there is no GPU")


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _calls_a_helper(x_ptr, out_ptr, CALLS: tl.constexpr):
    offsets = tl.arange(0, 8)
    x = tl.load(x_ptr + offsets)
    for _ in tl.static_range(CALLS):
        x = _twice(x)
    tl.store(out_ptr + tl.program_id(0) * 8 + offsets, tl.sum(x, axis=0) + tl.zeros([8], dtype=tl.float32))


def test_the_language_is_patched_once_a_launch_however_often_device_functions_run(monkeypatch):
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "spares_repeats", False), "tests/conftest.py did not wrap _patch_lang"
    patches = []
    real = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *args: patches.append(1) or real(*args))
    x = torch.arange(8, dtype=torch.float32)
    _calls_a_helper[(3,)](x, torch.empty(3 * 8), CALLS=1)  # (the first launch leaves tl.core patched: Triton's own)
    counts = {}
    for calls in (1, 6, 1):  # (counts[1]: the launch after one of 6 calls)
        out = torch.empty(3 * 8)
        before = len(patches)
        _calls_a_helper[(3,)](x, out, CALLS=calls)
        counts[calls] = len(patches) - before
        torch.testing.assert_close(out, torch.full((3 * 8,), 28.0 * 2**calls))
    assert counts[1] == counts[6] > 0, counts
