"""An exclusive lock on a run directory, so that two training processes never share an
``out_dir`` (interleaved metrics, overwritten or deleted checkpoints).

The lock is the file ``<out_dir>/run.lock`` holding the owner's PID, host, process start
time and command line as JSON. It is created atomically (written under a temporary name,
then hard-linked into place, which fails if the file exists), removed when the run ends,
and taken over when it is *stale*: left by a process that no longer runs (a killed run).
Where the file system has no hard links the lock is created empty, then written: a process
killed between the two leaves it empty, and its temporary file names it.
Only the host that ran the process can tell, so a job on several nodes
(:func:`lock_run_dir`) has the holder checked by its ranks on the holder's host: a crashed
run launched again takes its lock back wherever the rendezvous puts rank 0. A lock of a host
that runs no rank of the job cannot be checked; the error says when and how to remove it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..distributed.launch import DistContext, broadcast_object, gather_objects
from ..user_warning import warn_user

LOCK_FILE = "run.lock"


class RunLocked(ValueError):
    """The run directory is locked by another live run."""


#: Where Linux describes processes (macOS and the BSDs have no /proc: ``ps`` tells there).
PROC = Path("/proc")


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (Linux: field 22 of /proc/<pid>/stat; elsewhere
    ``ps -o lstart``), to tell a live owner from a new process that reused its PID - after a
    reboot, say; ``None`` where unknown."""
    if not PROC.is_dir():
        return _ps_start_time(pid)
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _ps_start_time(pid: int) -> str | None:
    try:
        done = subprocess.run(["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True, timeout=30,
                              env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError):
        return None
    return " ".join(done.stdout.split()) or None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _host() -> str:
    return socket.gethostname()


def stale_here(holder: dict[str, Any]) -> bool:
    """Whether ``holder`` (a lock file's content) was left by a process of this host that no
    longer runs (or whose PID now names another process)."""
    if holder.get("host") != _host() or not isinstance(holder.get("pid"), int):
        return False
    pid = holder["pid"]
    if not _alive(pid):
        return True
    recorded, now = holder.get("proc_start"), _start_time(pid)
    return recorded is not None and now is not None and recorded != now


def _describe(holder: dict[str, Any]) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"PID {holder.get('pid')} on host {holder.get('host')!r} (started {when}: {holder.get('command', '?')})"


class RunLock:
    """``with RunLock(out_dir):`` holds the lock of ``out_dir`` (created if missing) for the
    block; raises :class:`RunLocked` naming the holder when another live run has it."""

    def __init__(self, out_dir: str | Path) -> None:
        self.path = Path(out_dir) / LOCK_FILE
        self.held = False

    def _me(self) -> dict[str, Any]:
        pid = os.getpid()
        return {"pid": pid, "host": _host(), "proc_start": _start_time(pid), "started": time.time(),
                "command": " ".join(sys.argv)[:500]}

    def holder(self) -> dict[str, Any] | None:
        """The lock file's content (``{}`` when unreadable), ``None`` when there is none."""
        return self._read()

    def _read(self) -> dict[str, Any] | None:
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def _create(self, tmp: Path) -> None:
        """Put the complete lock file in place, or raise ``FileExistsError``."""
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: exclusive create, then write
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(tmp.read_text())
            except BaseException:  # (a full disk, Ctrl-C: no lock left that nobody can read)
                self.path.unlink(missing_ok=True)
                raise

    def _killed_while_locking(self, mine: Path) -> list[tuple[Path, dict[str, Any]]]:
        """Where the lock file cannot be read: the temporary files (``.run.lock.<pid>.<id>``, each
        holding its process's lock content; every acquisition removes its own as it ends) of
        processes killed while taking the lock - one of which left it empty (:meth:`_create`
        without hard links) - when every temporary file but ``mine`` names a process of this
        host that no longer runs (:func:`stale_here`), so that no live process can be writing
        the lock now. ``[]`` where one may be, or none names the lock's writer: the lock holds
        what none of them began to write (it is not empty or cut short, but unreadable for want
        of permission, or another program's file), which is not taken over."""
        try:
            written = self.path.read_text()
        except (OSError, ValueError):
            return []
        killed, contents = [], []
        for other in sorted(self.path.parent.glob(f".{LOCK_FILE}.*")):
            if other == mine:
                continue
            try:
                content = other.read_text()
                holder = json.loads(content)
            except FileNotFoundError:  # (its acquisition ended meanwhile)
                continue
            except (OSError, ValueError):  # (being written now, or not one of ours: cannot tell)
                return []
            if not isinstance(holder, dict) or not stale_here(holder):
                return []
            killed.append((other, holder))
            contents.append(content)
        return killed if any(content.startswith(written) for content in contents) else []

    def _refusal(self, holder: dict[str, Any], job_hosts: frozenset[str]) -> RunLocked:
        if holder.get("host") in job_hosts | {_host()}:
            return RunLocked(f"{str(self.path.parent)!r} is in use by another run: {_describe(holder)}. Wait for it to "
                             "finish, stop it, or pick another out_dir")
        return RunLocked(
            f"{str(self.path.parent)!r} is locked by {_describe(holder)}, a host that runs no rank of this job, so "
            "whether that run is still alive cannot be checked from here. If it is not (it crashed or was killed, and "
            f"this is a new launch of the same run), delete {str(self.path)!r} and launch again; if it is, wait for "
            "it, stop it, or pick another out_dir")

    def acquire(self, proven_stale: dict[str, Any] | None = None, job_hosts: frozenset[str] = frozenset()) -> None:
        """Take the lock, taking over a stale one (:func:`stale_here`, or ``proven_stale``: a
        holder a rank on its host found stale); :class:`RunLocked` otherwise. ``job_hosts``:
        the hosts of this job's ranks (for the error's advice)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # (a name of its own, not the PID alone: a run restarted under its killed run's PID - a container's PID 1 -
        # wrote over the temporary file that named the killed run, and a process of the same PID on another host
        # sharing the directory wrote over this one's)
        tmp = self.path.with_name(f".{LOCK_FILE}.{os.getpid()}.{uuid.uuid4().hex[:12]}")
        tmp.write_text(json.dumps(self._me()))
        try:
            for _ in range(3):
                try:
                    self._create(tmp)
                    self.held = True
                    return
                except FileExistsError:
                    pass
                holder = self._read()
                if holder is None:  # released meanwhile: try again
                    continue
                killed = [] if holder else self._killed_while_locking(tmp)
                if not holder and not killed:
                    raise RunLocked(f"{str(self.path.parent)!r} is locked by an unreadable lock file {str(self.path)!r}; "
                                    "if no run uses this directory, delete that file")
                if holder and not (stale_here(holder) or holder == proven_stale):
                    raise self._refusal(holder, job_hosts)
                if self._read() != holder:  # another process took it over meanwhile: look again
                    continue
                warn_user("removing the stale lock of a run that no longer runs: " + (
                    _describe(holder) if holder else f"{_describe(killed[0][1])}, killed while taking the lock, "
                                                     "which it left unwritten"))
                self.path.unlink(missing_ok=True)
                for other, _ in killed:
                    other.unlink(missing_ok=True)
            raise RunLocked(f"could not lock {str(self.path.parent)!r}: the lock file {str(self.path)!r} keeps changing")
        finally:
            tmp.unlink(missing_ok=True)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = self._read()
        if holder and holder.get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_run_dir(out_dir: str | Path, ctx: DistContext, main_first: Callable[[Callable[[], Any]], Any]) -> RunLock | None:
    """Take ``out_dir``'s lock for this job: rank 0 holds it (the returned lock; ``None`` on
    the other ranks). A lock file already there is checked by every rank on the host that
    wrote it (a collective), so a crashed run launched again takes it over even when the
    rendezvous put its rank 0 on another node. ``main_first``: runs the acquisition on rank 0
    and stops every rank when it fails."""
    lock = RunLock(out_dir) if ctx.is_main else None
    holder = broadcast_object(lock.holder() if lock is not None else None, ctx)
    verdicts = gather_objects((_host(), bool(holder) and stale_here(holder)), ctx)
    proven = holder if any(stale for _, stale in verdicts) else None
    hosts = frozenset(host for host, _ in verdicts)
    main_first(lambda: lock.acquire(proven, hosts) if lock is not None else None)
    return lock
