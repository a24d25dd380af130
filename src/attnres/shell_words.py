"""Paths as words of the commands attnres prints for the user to paste into a shell."""

from __future__ import annotations

import os
import shlex


def shell_path(path: str | os.PathLike) -> str:
    """``path`` as one shell word that reads back as that path: quoted where it holds a space,
    a quote or another character the shell reads (``runs/my run`` split in two when pasted),
    and a relative one that starts with ``-`` written ``./-x`` (argparse took ``-x`` for an
    option). Fits a positional argument, an option's value and a ``key=VALUE`` override alike."""
    text = os.fspath(path)
    return shlex.quote(f"./{text}" if text.startswith("-") else text)
