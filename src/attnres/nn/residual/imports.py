"""Which modules a run needs imported for its residual: what its checkpoints record, and the
error that names them where they are missing.

A residual of the user's own is registered by importing its module (``attnres --import
MODULE``, ``import MODULE`` in Python). A later ``train --resume``, ``generate``, ``eval``,
``export`` or ``analyze`` of the run, in a process that has not imported it, cannot build the
model; it does not import the module itself (that would run code a run directory names), but
says which one to import, from the ``"imports"`` of the checkpoint's ``state.json``::

    {"given": ["my_pkg.residuals"], "residual": "my_res", "residual_module": "my_pkg.residuals"}

``given``: the command's ``--import`` values as typed; ``residual``: the run's residual kind;
``residual_module``: the module of its class (``None`` for a built-in variant). Checkpoints of earlier versions have no
``"imports"``: their error is the registry's own.
"""

from __future__ import annotations

import shlex
from typing import Any

from .registry import UnregisteredResidual, residual_class

__all__ = ["imports_record", "set_given_imports", "unregistered_residual_error"]

_GIVEN: list[str] = []


def set_given_imports(values: list[str]) -> None:
    """The ``--import`` values of this process's command, as given (``attnres.cli`` sets them)."""
    _GIVEN[:] = values


def imports_record(kind: str) -> dict[str, Any]:
    """The ``"imports"`` a checkpoint of a model with residual ``kind`` records."""
    cls = residual_class(kind)
    return {"given": list(_GIVEN), "residual": kind, "residual_module": None if cls.builtin() else cls.__module__}


def unregistered_residual_error(error: Exception, record: Any) -> str | None:
    """The message of ``error`` when it says that the run's residual (``error.kind``) is not
    registered here, for a run whose checkpoint recorded ``record`` (its ``"imports"``);
    ``None`` for another error, or where the record names no module (a checkpoint of an
    earlier version, a built-in variant; a kind other than the run's, given on the command
    line): the error's own message says what there is to say."""
    ours = isinstance(error, UnregisteredResidual) and isinstance(record, dict) and record.get("residual") == error.kind
    if not ours:
        return None
    given = [g for g in record.get("given") or () if isinstance(g, str)]
    module = record.get("residual_module")
    module = module if isinstance(module, str) else None
    missing = f"residual {error.kind!r} is not registered"
    in_python = f"; in Python, `import {module}` first" if module not in (None, "__main__") else ""
    if given:
        flags = " ".join(f"--import {shlex.quote(g)}" for g in given)
        return (f"{missing}: this run was trained with {flags}; add {flags} (`attnres {flags} <command> ...`"
                f"{in_python})")
    if module == "__main__":
        return (f"{missing}: this run was trained by a script that defined it (its __main__), which nothing can "
                "import; move the class into a module and pass --import MODULE (`attnres --import MODULE <command> "
                "...`; in Python, `import MODULE` first)")
    if module is not None:
        return (f"{missing}: this run's residual class is in module {module!r}; add --import {module} (`attnres "
                f"--import {module} <command> ...`{in_python})")
    return None
