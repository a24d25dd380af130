"""How to install one of attnres's extras (``pyproject.toml``'s optional dependencies) into
this environment, in the words of how attnres itself was installed.

attnres is installed from a clone (``pip install -e .``), a wheel or a source archive (an
sdist, ``attnres-<version>.tar.gz``); no package index serves it, so ``pip install
"attnres[train]"`` would fail (or install another project of that name). The command names the
clone, the wheel or the sdist this installation came from, as pip recorded it
(``direct_url.json``, PEP 610).
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

__all__ = ["install_command", "installed_from", "pip_command", "reinstall_command", "require_extra"]

#: The endings of the source archives pip installs from (an sdist is a ``.tar.gz``).
SDIST_SUFFIXES = (".tar.gz", ".zip")


def installed_from() -> tuple[str, Path] | None:
    """``("clone", directory)``, ``("wheel", file)`` or ``("sdist", file)`` this installation
    came from, where pip recorded it and it is still there; ``None`` otherwise."""
    from importlib import metadata

    try:
        record = metadata.distribution("attnres").read_text("direct_url.json")
        origin = json.loads(record) if record else None
    except (metadata.PackageNotFoundError, json.JSONDecodeError):
        return None
    if not isinstance(origin, dict) or not str(origin.get("url", "")).startswith("file:"):
        return None
    path = Path(unquote(urlparse(origin["url"]).path))
    if "dir_info" in origin and path.is_dir():
        return "clone", path
    if path.suffix == ".whl" and path.is_file():
        return "wheel", path
    if path.name.endswith(SDIST_SUFFIXES) and path.is_file():  # (installed from it, it read as "unknown")
        return "sdist", path
    return None


def install_command(extra: str, beside: str = "") -> str:
    """The command that installs ``extra`` (``"train"``, ``"hf"``, ...) for this
    installation: ``pip install -e "<clone>[extra]"``, or ``pip install "<wheel>[extra]"`` (an
    sdist's likewise); where the origin is unknown, both forms, to run in a clone or beside
    the wheel. ``beside``: requirements installed with it (``"vllm==0.32.0"``), which pip
    then resolves together with the extra's."""
    return _install(f"[{extra}]", beside)


def require_extra(extra: str, module: str, feature: str) -> None:
    """Raise ``ModuleNotFoundError`` (its ``name`` the missing module, as an import's) naming
    ``extra`` and the command that installs it where ``module`` is not importable: ``import
    attnres.hf`` without transformers said "No module named 'transformers'" from deep inside
    the package, and nothing of the extra that brings it."""
    from importlib.util import find_spec

    if find_spec(module) is None:
        raise ModuleNotFoundError(f"{feature} needs the {extra!r} extra: {install_command(extra)} (the module "
                                  f"{module!r} is not installed)", name=module)


def reinstall_command() -> str:
    """The command that installs attnres again as this installation was installed (after
    ``pip uninstall attnres``): from its clone, wheel or sdist, never ``pip install attnres``,
    which no index serves."""
    return _install("")


def pip_command() -> str:
    """``pip`` where the ``pip`` on ``PATH`` is this environment's (an activated virtual
    environment), else this interpreter's ``python -m pip``: the command run as
    ``venv/bin/attnres`` without activating its environment (or by pipx, a job script) would
    otherwise name a ``pip`` that installs into another environment."""
    found = shutil.which("pip")
    if found is not None and Path(found).parent == Path(sys.executable).parent:
        return "pip"
    return f"{shlex.quote(sys.executable)} -m pip"


def _install(extras: str, beside: str = "") -> str:
    pip = f"{pip_command()} install " + (f"{beside} " if beside else "")
    origin = installed_from()
    if origin is None:
        return (f'{pip}-e ".{extras}" in a clone of attnres (or {pip}"attnres-<version>-py3-none-any.whl'
                f'{extras}" beside its wheel)')
    kind, path = origin
    shown = "." if path == Path.cwd() else str(path)
    return f'{pip}-e "{shown}{extras}"' if kind == "clone" else f'{pip}"{shown}{extras}"'
