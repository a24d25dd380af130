"""Finding a token cache without reading the text, and removing what crashed writers left.

A cache is named by the text's digest (``<digest[:16]>-<kind><vocab>``, ``-cleancut`` for a BPE, see
:mod:`attnres.data.dataset`); its ``meta.json`` holds that digest and the keys of the files
it was made from or found for (:func:`attnres.data.corpus.files_key`: paths, sizes, times,
inodes, ``val_fraction``, ``text_field``). A run whose files have a recorded key takes the
digest from there and reads no text when its tokenizer's cache exists.

A cache is written in ``.<name>.tmp-<host>-<pid>`` and renamed into place when complete; a
writer killed outright leaves that directory behind (and :func:`record_files` its
``.meta.json.tmp-<host>-<pid>`` inside a cache). :func:`remove_stale_temporaries` removes
those of this host whose process is gone; another host's are left alone (on a shared
file system its live writer would look dead from here), as are the ``.<name>.tmp-<pid>`` of
earlier versions, which name no host.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path

#: How many files keys a cache's meta.json keeps (the newest): the same text found at as
#: many places, or after as many copies, without reading it.
MAX_FILES_KEYS = 16

_TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp-(?P<host>.+)-(?P<pid>[0-9]+)")


def _host() -> str:
    """This host's name as it goes into a temporary directory's name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "unknown"


def temporary_dir(cache: Path) -> Path:
    """Where this process writes ``cache`` before renaming it into place."""
    return cache.with_name(f".{cache.name}.tmp-{_host()}-{os.getpid()}")


def _metas(root: Path):
    """The meta.json of every readable cache in ``root``, as dicts."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith("."):
            continue
        try:
            meta = json.loads(Path(entry.path, "meta.json").read_text())
        except (OSError, ValueError):  # (not a cache, or a damaged one: said when it is opened)
            continue
        if isinstance(meta, dict):
            yield meta


def _files_keys(meta: dict) -> list[str]:
    keys = meta.get("files")
    return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []


def recorded_digest(root: Path, key: str) -> str | None:
    """The text digest that the caches in ``root`` recorded for the files key ``key``; ``None``
    when none did, or when caches disagree (the text changed behind the same key: see
    docs/data.md), so that the text is read."""
    digests = {meta.get("digest") for meta in _metas(root) if key in _files_keys(meta)}
    digests.discard(None)
    return digests.pop() if len(digests) == 1 else None


def record_files(cache: Path, key: str) -> None:
    """Add ``key`` to the files keys in ``cache``'s meta.json (atomically; the oldest go past
    :data:`MAX_FILES_KEYS`). Silent where the cache cannot be written (a shared read-only
    cache): the next run then reads the text again, as without the key."""
    path = cache / "meta.json"
    try:
        meta = json.loads(path.read_text())
        keys = _files_keys(meta)
        if key in keys:
            return
        meta["files"] = (keys + [key])[-MAX_FILES_KEYS:]
        tmp = temporary_dir(path)
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, path)
    except (OSError, ValueError, TypeError):
        return


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (or might: when it cannot be told, yes)."""
    if pid <= 0 or os.name != "posix":  # (os.kill(pid, 0) is no probe on Windows; 0 is the process group)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's live process
        return True
    return True


def _stale(name: str, host: str) -> bool:
    """Whether ``name`` is a temporary that a process of this host left and that is gone."""
    match = _TEMPORARY.fullmatch(name)
    return bool(match) and match["host"] == host and not _alive(int(match["pid"]))


def remove_stale_temporaries(root: Path) -> list[Path]:
    """Remove the temporary cache directories in ``root``, and the temporary meta.json files
    in its caches (:func:`record_files` killed before its rename), that a process of this
    host left and that process is gone (killed outright); returns them."""
    try:
        entries = [e for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    host, removed = _host(), []
    for entry in entries:
        if entry.name.startswith("."):
            if _stale(entry.name, host):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
            continue
        try:
            inside = [e for e in os.scandir(entry.path) if e.name.startswith(".") and e.is_file(follow_symlinks=False)]
        except OSError:
            continue
        for file in inside:
            if _stale(file.name, host):
                try:
                    os.remove(file.path)
                except OSError:  # (a shared read-only cache: left, as record_files leaves it)
                    continue
                removed.append(Path(file.path))
    return removed
