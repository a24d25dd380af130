"""Other distributions that install a top-level package named ``attnres`` too.

PyPI's ``fast-attnres`` (CUDA operators for Attention Residuals) installs its code as the
import package ``attnres``: installed into one environment with this package, one overwrites
the other's files and either may break in ways that do not name the cause. The ``attnres``
command finds them from the installed distributions' metadata, every distribution's file list
(``importlib.metadata.packages_distributions``, a fraction of a second), when a command runs;
``import attnres`` reads no distributions.
"""

from __future__ import annotations

import importlib.metadata as metadata
from collections.abc import Callable

from .user_warning import warn_user

__all__ = ["KNOWN_CLASHES", "clashing_distributions", "warn_about_clashes"]

OURS = "attnres"
#: Distributions known to install a top-level ``attnres`` package of their own.
KNOWN_CLASHES = ("fast-attnres",)
_warned: set[str] = set()


def _normalised(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _provides_attnres(dist: metadata.Distribution) -> bool:
    files = dist.files
    if files is None:  # no file list: its name says enough
        return True
    return any(f.parts and f.parts[0] in (OURS, f"{OURS}.py") for f in files)


def clashing_distributions() -> dict[str, str]:
    """``{name: version}`` of the installed distributions other than this one that provide
    a top-level ``attnres``: every distribution that lists such a file, and the
    :data:`KNOWN_CLASHES` (found by name, as one installed without a file list is)."""
    names = set(KNOWN_CLASHES) | set(metadata.packages_distributions().get(OURS, ()))
    found = {}
    for name in sorted(n for n in names if _normalised(n) != OURS):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if _provides_attnres(dist):
            found[dist.metadata["Name"] or name] = dist.version
    return found


def warn_about_clashes(reinstall: Callable[[], str]) -> None:
    """One ``UserWarning`` per clashing distribution (see :func:`clashing_distributions`),
    each at most once per process. ``reinstall()`` gives the command that installs attnres
    again as it was installed (``attnres.extras.reinstall_command``: no package index serves
    it), called only where there is a clash to warn of."""
    for name, version in clashing_distributions().items():
        if name in _warned:
            continue
        _warned.add(name)
        warn_user(f"the installed distribution {name!r} ({version}) also installs a top-level package named "
                  "'attnres': which one `import attnres` gets depends on sys.path, and installed into one "
                  "environment one overwrites the other's files, so either may break. Keep them in separate "
                  f"virtual environments (here: pip uninstall {name} attnres, then {reinstall()})",
                  UserWarning)
