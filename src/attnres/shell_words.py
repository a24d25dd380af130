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


def launched(command: str, world: int, per_node: int | None) -> str:
    """``command`` (``attnres ...``) as launched on ``world`` ranks: itself for one process,
    else as a module under torchrun, ``torchrun --standalone --nproc-per-node WORLD -m attnres
    ...`` where they were one node's (``per_node`` ranks a node); the launch options of several
    nodes are the user's to repeat (``torchrun ...``)."""
    if world <= 1:
        return command
    launcher = f"torchrun --standalone --nproc-per-node {world}" if per_node == world else "torchrun ..."
    return f"{launcher} -m {command}"
