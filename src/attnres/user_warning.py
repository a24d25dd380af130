"""Warnings that point at the user's call, not at the line of the package that raised them.

``warnings.warn(..., stacklevel=N)`` names the frame ``N`` calls up, which for a warning raised
deep in the package (the C kernel built on a model's first forward, a checkpoint skipped while
``train`` starts) is another of the package's lines: Python's display then shows our source,
and a ``DeprecationWarning`` there is hidden by Python's default filters, which show it only in
the user's ``__main__``. :func:`warn_user` names the first frame outside the package instead,
what ``warnings.warn(skip_file_prefixes=...)`` does on Python 3.12 (we support 3.10 on). Frames of
the libraries the package is called through (``torch.nn.Module.__call__`` runs a model's
forward, ``transformers`` loads a saved directory) and of Python's import machinery and context
managers are passed over as well.

The ``attnres`` command has no user's line to name: within :func:`at_the_raise_site` (which
``attnres.cli`` enters) each warning names the line that raised it, so that the command prints
it as its own, ``attnres: warning: ...``, once.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import warnings
from collections.abc import Iterator

__all__ = ["at_the_raise_site", "warn_user"]

#: The top-level modules whose frames are not the user's call.
LIBRARY_MODULES = frozenset({"attnres", "torch", "transformers", "importlib", "contextlib"})

_raise_site: list[bool] = []  # (non-empty within at_the_raise_site)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's call: the innermost frame
    outside :data:`LIBRARY_MODULES` (the outermost frame when every one is inside), or, within
    :func:`at_the_raise_site`, the caller's own line."""
    frame = sys._getframe(1)
    while not _raise_site and frame.f_back is not None and _in_library(frame):
        frame = frame.f_back
    module_globals = frame.f_globals
    # (what warnings.warn does with the frame its stacklevel names)
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=module_globals.get("__name__", "<string>"),
                           registry=module_globals.setdefault("__warningregistry__", {}),
                           module_globals=_with_a_source_loader(module_globals))


def _with_a_source_loader(module_globals: dict) -> dict | None:
    """``module_globals``, through whose ``__loader__`` ``warn_explicit`` reads the line it
    shows, or ``None`` where that loader is the built-in importer: the ``__main__`` of
    ``python -c``, of a script on standard input and of the interactive interpreter, whose
    ``get_source('__main__')`` raises ImportError out of ``warn_explicit`` (the warning was
    lost to "'__main__' is not a built-in module")."""
    return None if module_globals.get("__loader__") is importlib.machinery.BuiltinImporter else module_globals


def _in_library(frame) -> bool:
    # (by the module, not the file: a dataclass's generated __init__ runs in its module's globals)
    return str(frame.f_globals.get("__name__", "")).partition(".")[0] in LIBRARY_MODULES


@contextlib.contextmanager
def at_the_raise_site() -> Iterator[None]:
    """Within: :func:`warn_user` names the line of the package that raised the warning (the
    ``attnres`` command's, which prints the package's warnings as its own)."""
    _raise_site.append(True)
    try:
        yield
    finally:
        _raise_site.pop()
