"""Triton's interpreter without a step it repeats for nothing: on every call of a device
function (a ``@triton.jit`` helper) inside a kernel, triton 3.x's ``InterpretedFunction``
patches ``triton.language`` for the interpreter again - ``inspect.getmembers`` over the
language's modules, about 2 ms a call - although the launch (``GridExecutor``) or an earlier
call in it patched those same module objects already (the launch restores its own patch after
its last program; a device function's is never restored). The kernels' helpers and
``tl.sum`` / ``tl.zeros`` are called per program and per row.

:func:`spare_repeated_patching` makes a device function's patch a no-op while a launch runs
and every language module the function sees was patched since it began; anything else runs
as Triton wrote it. Only the suite's interpreter runs use it (tests/conftest.py); where Triton's
interpreter lacks the two functions it wraps, nothing is changed.
"""

from __future__ import annotations

import inspect


def spare_repeated_patching() -> bool:
    """Wrap ``triton.runtime.interpreter._patch_lang`` (see the module's docstring); whether it
    was wrapped."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original, scope_class = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_class is None or getattr(original, "spares_repeats", False):
        return False
    patched: set[int] = set()  # the language modules (ids) patched since the running launch began
    launching = False
    seen_by: dict = {}  # function -> the language modules (ids) in its globals

    def languages(fn) -> frozenset[int]:
        if fn not in seen_by:
            seen_by[fn] = frozenset(id(value) for value in fn.__globals__.values()
                                    if inspect.ismodule(value) and value in (tl, tl.core))
        return seen_by[fn]

    def patch_lang(fn):
        nonlocal launching
        seen = languages(fn)
        if launching and seen <= patched:
            return scope_class()  # (nothing patched, nothing to restore)
        scope = original(fn)
        patched.update(seen)
        if launching:  # (a device function's patch: Triton never restores it)
            return scope
        launching = True  # a launch's patch, restored once its programs have run
        restore = scope.restore

        def restore_then_end():
            nonlocal launching
            launching = False
            patched.clear()
            restore()

        scope.restore = restore_then_end
        return scope

    patch_lang.spares_repeats = True
    interpreter._patch_lang = patch_lang
    return True
