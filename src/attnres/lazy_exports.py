"""A package's public names, each imported from its module on first use (PEP 562): what
``attnres`` and ``attnres.distributed`` use so that importing them stays cheap (their
modules import torch._dynamo, DTensor or pipeline parallelism, which a command checking its
arguments need not wait for)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any],
                 extra: Iterable[str] = ()) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose globals are ``namespace``:
    ``exports`` maps each public name to the module (relative to ``package``) that defines it;
    a name is imported once, then kept in ``namespace``. ``__dir__`` lists the public names,
    ``extra`` and the submodules imported so far - not what the package imports for itself."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        loaded = (n for n, v in namespace.items() if isinstance(v, ModuleType) and v.__name__.startswith(f"{package}."))
        return sorted({*exports, *extra, *loaded})

    return __getattr__, __dir__
