"""Paths as words of the commands attnres prints for the user to paste into a shell."""

from __future__ import annotations

import os
import shlex


def path_argument(path: str | os.PathLike) -> str:
    """``path`` as an argument that argparse reads as a path: a relative one that starts with
    ``-`` written ``./-x`` (``--out -x`` was refused as a missing value, ``-x`` taken for an
    option)."""
    text = os.fspath(path)
    return f"./{text}" if text.startswith("-") else text


def shell_path(path: str | os.PathLike) -> str:
    """``path`` as one shell word that reads back as that path (:func:`path_argument`), quoted
    where it holds a space, a quote or another character the shell reads (``runs/my run``
    split in two when pasted). Fits a positional argument, an option's value and a
    ``key=VALUE`` override alike."""
    return shlex.quote(path_argument(path))
