"""The run directory (``out_dir``) before a run writes anything: rank 0 can create and write
it, and every rank sees the same directory under that name.

Every rank writes its shards of each sharded checkpoint into ``out_dir``, and rank 0 lists
and hashes what it sees there; on nodes that do not share the directory, every checkpoint
would lack the other nodes' shards. So at start-up rank 0 writes a file with a random value
into ``out_dir``, every other rank must find that value there and write a file of its own,
and the run stops on every rank with one error naming the ranks (and hosts) that could not.
The same start refuses an ``out_dir`` that is a file, read-only or on a full disk with one
line naming the path and the cause.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from ..distributed.launch import DistContext, broadcast_object, gather_objects, raise_on_every_rank
from ..checkpoint.locate import RUN_LOG
from ..output_paths import file_in_the_way, not_a_directory, os_cause

__all__ = ["OutDirError", "check_out_dir", "os_cause"]

TOKEN = ".attnres-out-dir-check"

#: What a run writes into out_dir, and whether it is a folder. One of these names taken by
#: the other kind failed only when first written: a file named ``checkpoints`` at the first
#: checkpoint, the steps before it lost.
RUN_ENTRIES = {"checkpoints": "its checkpoints (a folder)", "tensorboard": "its TensorBoard events (a folder)",
               "config.json": "its config (a file)", RUN_LOG: "its metrics log (a file)"}


class OutDirError(ValueError):
    """``out_dir`` cannot be used: not a directory, not writable, or not the same directory on every rank."""


def create_out_dir(out_dir: Path) -> None:
    """Create ``out_dir`` (and its parents); :class:`OutDirError` naming the path and the cause."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise OutDirError(str(not_a_directory("out_dir", out_dir, file_in_the_way(out_dir)))) from None
    except OSError as e:
        raise OutDirError(f"out_dir {str(out_dir)!r} cannot be created: {os_cause(e)}") from None


def refuse_entries_in_the_way(out_dir: Path) -> None:
    """:class:`OutDirError` when a name of :data:`RUN_ENTRIES` in ``out_dir`` is a folder where
    the run writes a file, or the other way round."""
    for name, what in RUN_ENTRIES.items():
        path = out_dir / name
        if path.exists() and path.is_dir() != what.endswith("(a folder)"):
            kind = "a folder" if path.is_dir() else "a file"
            raise OutDirError(f"out_dir {str(out_dir)!r} cannot be used: {str(path)!r} is {kind}, where the run writes "
                              f"{what}; move it away or pick another out_dir")


def write_token(path: Path, value: str) -> None:
    """Write ``value`` into ``path`` and flush it to the file system (a shared one included)."""
    with path.open("w") as f:
        f.write(value)
        f.flush()
        os.fsync(f.fileno())


def _prepare(out_dir: Path, value: str) -> OutDirError | None:
    """Rank 0: create ``out_dir`` and write the token; the error, if any."""
    try:
        create_out_dir(out_dir)
        refuse_entries_in_the_way(out_dir)
        write_token(out_dir / TOKEN, value)
    except OutDirError as e:
        return e
    except OSError as e:
        return OutDirError(f"out_dir {str(out_dir)!r} is not writable: {os_cause(e)}")
    return None


def _see_and_write(out_dir: Path, value: str, rank: int) -> str | None:
    """Another rank: find rank 0's token and write one of its own; what went wrong, if anything."""
    try:
        seen = (out_dir / TOKEN).read_text()
    except OSError:
        seen = None
    if seen != value:
        return "unseen"
    mine = out_dir / f"{TOKEN}.rank{rank}"
    try:
        write_token(mine, value)
        mine.unlink()
    except OSError as e:
        return f"cannot write there ({os_cause(e)})"
    return None


def _ranks(ranks: list[int]) -> str:
    """``[1]`` -> "rank 1"; ``[8, 9, 10, 12]`` -> "ranks 8-10, 12"."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _by_host(reports: list[tuple[int, str, str | None]]) -> str:
    hosts: dict[str, list[int]] = {}
    for rank, host, _ in reports:
        hosts.setdefault(host, []).append(rank)
    return "; ".join(f"{_ranks(ranks)} on host {host!r}" for host, ranks in hosts.items())


def _describe(out_dir: Path, reports: list[tuple[int, str, str | None]]) -> str | None:
    """One message for every rank's report ``(rank, host, problem)``, or ``None``."""
    unseen = [r for r in reports if r[2] == "unseen"]
    unwritable = [f"rank {rank} on host {host!r} {problem}" for rank, host, problem in reports
                  if problem not in (None, "unseen")]
    parts = []
    if unseen:
        verb = "does" if len(unseen) == 1 else "do"
        parts.append(f"out_dir {str(out_dir)!r} is not the same directory on every rank: {_by_host(unseen)} {verb} "
                     f"not see the file rank 0 (on host {reports[0][1]!r}) wrote there. Every rank writes its shards "
                     "of each checkpoint into out_dir: put it on a file system every node shares (docs/scale-out.md, "
                     "multi-node launch)")
    if unwritable:
        parts.append(f"out_dir {str(out_dir)!r} is not writable everywhere: {'; '.join(unwritable)}")
    return "; ".join(parts) or None


def check_out_dir(out_dir: Path, ctx: DistContext) -> None:
    """Create ``out_dir`` on rank 0 and check that every rank sees it and can write there (a
    collective; see the module docstring). Raises :class:`OutDirError` on every rank."""
    value = secrets.token_hex(16) if ctx.is_main else None
    raise_on_every_rank(_prepare(out_dir, value) if ctx.is_main else None, ctx)
    try:
        value = broadcast_object(value, ctx)
        problem = None if ctx.is_main else _see_and_write(out_dir, value, ctx.rank)
        reports = gather_objects((ctx.rank, socket.gethostname(), problem), ctx)
    finally:
        if ctx.is_main:
            (out_dir / TOKEN).unlink(missing_ok=True)
    message = _describe(out_dir, reports)
    raise_on_every_rank(OutDirError(message) if message and ctx.is_main else None, ctx)
