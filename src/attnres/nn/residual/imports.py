"""Which modules a run needs imported for its residual: what its checkpoints record, and the
error that names them where they are missing.

A residual of the user's own is registered by importing its module (``attnres --import
MODULE``, ``import MODULE`` in Python). A later ``train --resume``, ``generate``, ``eval``,
``export`` or ``analyze`` of the run, in a process that has not imported it, cannot build the
model; it does not import the module itself (that would run code a run directory names), but
says which one to import, from the ``"imports"`` of the checkpoint's ``state.json``::

    {"given": ["my_pkg.residuals"], "residual": "my_res", "residual_module": "my_pkg.residuals"}

``given``: the command's ``--import`` values as typed (a ``.py`` file's path made absolute);
``residual``: the run's residual kind; ``residual_module``: the module of its class (``None``
for a built-in variant). Checkpoints of earlier versions have no ``"imports"``: their error is
the registry's own.

A saved Hugging Face directory names the module in its ``config.json``
(:mod:`attnres.hf.families.residual_module`); under ``trust_remote_code`` its module file imports
it (:func:`import_residual_module`, which imports nothing of transformers: a failed import
leaves the process as it was, and the load can be tried again).
"""

from __future__ import annotations

import importlib
import shlex
import sys
from typing import Any

from .registry import UnregisteredResidual, registered_residuals, residual_class

__all__ = ["MAIN", "import_residual_module", "imports_record", "not_registered_by", "recorded_import_flags",
           "set_given_imports", "unimportable_residual", "unregistered_residual_error"]

#: The module of a class a script defined: no other process can import it.
MAIN = "__main__"

_GIVEN: list[str] = []


def set_given_imports(values: list[str]) -> None:
    """The ``--import`` values of this process's command, as given (``attnres.cli`` sets them)."""
    _GIVEN[:] = values


def imports_record(kind: str) -> dict[str, Any]:
    """The ``"imports"`` a checkpoint of a model with residual ``kind`` records."""
    cls = residual_class(kind)
    return {"given": list(_GIVEN), "residual": kind, "residual_module": None if cls.builtin() else cls.__module__}


def recorded_import_flags(record: Any) -> str:
    """The ``--import`` options another ``attnres`` command of a run needs, from its
    checkpoint's ``record`` (its ``"imports"``): the run's own ``--import`` values, else the
    module of its residual class; ``""`` for a built-in variant, a class of a script's
    ``__main__`` (nothing can import it) or a checkpoint without the record."""
    if not isinstance(record, dict):
        return ""
    given = [g for g in record.get("given") or () if isinstance(g, str)]
    module = record.get("residual_module")
    if not given and isinstance(module, str) and module != MAIN:
        given = [module]
    return " ".join(f"--import {shlex.quote(g)}" for g in given)


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


def unimportable_residual(module: str, kind: str, key: str) -> str:
    """Why residual ``kind`` of a script's ``__main__`` cannot be registered elsewhere."""
    return (f"residual {kind!r} was registered by the script that saved this directory (its {key} is {module!r}), "
            "which no other process can import: move the class into a module, import that module, and save the "
            "directory again")


def import_residual_module(module: str, kind: str, key: str) -> None:
    """Import ``module``, which registers residual ``kind`` (what a saved directory's module
    file calls under ``trust_remote_code``, before its config is read); ``ImportError`` in one
    line naming the module and how to make it importable where it cannot be found. A
    script's class (``"__main__"``) is there only where the script registered it again."""
    if module == MAIN:
        if kind in registered_residuals():
            return
        raise ImportError(unimportable_residual(module, kind, key))
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
            raise  # (a module the user's module imports is missing: its own error says which)
        raise ImportError(f"residual {kind!r} is registered by module {module!r} (config.json's {key}), which "
                          f"cannot be imported here ({e}): put the folder that holds it on PYTHONPATH, or pip "
                          "install the package that has it") from None
    if kind not in registered_residuals():
        raise ImportError(not_registered_by(module, kind, key))


def not_registered_by(module: str, kind: str, key: str) -> str:
    """Why residual ``kind`` is missing though ``module``, which config.json's ``key`` says
    registers it, was imported (renamed since, or another module of that name found first)."""
    found = getattr(sys.modules.get(module), "__file__", None)
    where = f" ({found})" if found else ""
    return (f"residual {kind!r} is not registered, though module {module!r}{where} - which config.json's {key} says "
            f"registers it - was imported: the class was renamed or moved since the directory was saved, or another "
            f"module of that name comes first on sys.path; registered here: {', '.join(registered_residuals())}")
