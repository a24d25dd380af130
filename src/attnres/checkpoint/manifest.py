"""What every checkpoint shares, whatever its format: where it lives, how it is published,
and how it is verified.

A run's checkpoints are ``<out_dir>/checkpoints/step-<8 digits>/`` directories. Each holds
``state.json`` (the manifest), written last: the format version, the step, the SHA-256 and
size of every other file, the run state the writer adds, and the SHA-256 of all of that
(``state_sha256``, :func:`seal_state`). A checkpoint is written into a hidden temporary
directory and renamed into place only when complete (:func:`publish_checkpoint`; one of the
same step it replaces is moved aside first, and deleted after), so a crash never leaves a
half-written ``step-*`` directory, nor a step written again lost;
:func:`read_checkpoint_state` checks ``state.json`` against its own hash, its step against
the directory's name, and every listed file's size and hash, so a truncated, corrupted or
edited checkpoint is reported clearly instead of being resumed from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..output_paths import honour_umask
from ..user_warning import warn_user

FORMAT_VERSION = 1
STATE_FILE = "state.json"
PREFIX = "step-"
RNG_FILE = "rng.safetensors"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"

#: The files each layout's loader reads (``state.json``'s ``"layout"``: none for a
#: consolidated checkpoint, ``"dcp"`` for a sharded one). Each must be listed in the manifest:
#: a file it does not list would be read without its size and SHA-256 being checked (and a
#: missing one would surface as a bare ``FileNotFoundError``).
REQUIRED_FILES = {None: (MODEL_FILE, OPTIMIZER_FILE, RNG_FILE), "dcp": (RNG_FILE, "dcp/.metadata")}


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted or does not fit the model/config."""


class CheckpointFormatTooNew(CheckpointError):
    """A checkpoint written by a newer attnres (a format this version does not read): not
    damaged, so a run's newest one is not skipped for an older one (see
    :func:`attnres.checkpoint.find_valid_checkpoint`)."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, a read-only file system, a rank's
    shard out of rank 0's sight). Nothing of it was published; the checkpoints written
    before it are untouched (:func:`write_failure` words it)."""


def write_failure(final: Path, cause: BaseException) -> CheckpointWriteError:
    """The :class:`CheckpointWriteError` of checkpoint directory ``final`` failed by ``cause``."""
    return CheckpointWriteError(f"could not write checkpoint {final.name} in {str(final.parent)!r}: "
                                f"{describe_failure(cause)}; nothing of it was kept, and the checkpoints written "
                                "before it are untouched")


def describe_failure(e: BaseException) -> str:
    """The cause of a failed read or write in one line: an ``OSError``'s reason and file,
    the first failing rank's for DCP's ``CheckpointException``, else the message's first line."""
    failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if isinstance(failures, dict) and failures:
        rank, (inner, _) = min(failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {describe_failure(inner)}"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f" ({e.filename})" if e.filename else "")
    text = str(e).strip()
    return text.splitlines()[0].removeprefix("Error while serializing: ") if text else type(e).__name__


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


STATE_HASH = "state_sha256"


def _state_digest(doc: dict[str, Any]) -> str:
    """The SHA-256 of a manifest's content without its own hash: its canonical JSON (sorted
    keys), which a JSON round trip leaves unchanged."""
    body = {k: v for k, v in doc.items() if k != STATE_HASH}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal_state(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (a manifest) with ``state_sha256``, the hash of the rest of it: ``state.json``
    cannot list its own file hash, so it carries the hash of its content."""
    return {**doc, STATE_HASH: _state_digest(doc)}


def step_of_directory(path: Path) -> int | None:
    """The step a ``step-<digits>`` directory's name gives, or a ``.old-step-<digits>`` one's
    (:func:`publish_checkpoint`'s moved aside); ``None`` for any other name."""
    name = path.name[len(REPLACED_PREFIX):] if path.name.startswith(REPLACED_PREFIX) else path.name
    digits = name[len(PREFIX):]
    return int(digits) if name.startswith(PREFIX) and digits.isdigit() else None


def _check_manifest(path: Path, doc: dict[str, Any]) -> None:
    """``state.json`` matches its own hash (a manifest of an earlier version has none) and its
    step is the one the directory's name says. Raises :class:`CheckpointError`."""
    if STATE_HASH in doc and doc[STATE_HASH] != _state_digest(doc):
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupted or was edited: {STATE_FILE} does not match "
                              f"its own SHA-256 ({STATE_HASH})")
    step, named = doc.get("step"), step_of_directory(path)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} holds no valid step ({step!r})")
    if named is not None and step != named:
        raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} says step {step} but the directory's name says "
                              f"step {named}; the checkpoint was edited or moved")


def checkpoint_path(out_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives (once written)."""
    return Path(out_dir) / "checkpoints" / f"{PREFIX}{step:08d}"


def checkpoint_dirs(out_dir: str | Path, replaced: bool = False) -> list[Path]:
    """Complete checkpoint directories under ``<out_dir>/checkpoints``, oldest first.
    ``replaced``: a reader's listing, with a checkpoint a kill left moved aside
    (``.old-step-*``: :func:`publish_checkpoint` writing its step again, killed before the new
    one was renamed in) where its step has no other - it is that step's checkpoint until the
    run's next start renames it back (:func:`remove_partial_checkpoints`), which a reader, writing
    nothing, does not do (generate, eval and status found the step gone, or no checkpoint)."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    if replaced:
        named = {p.name for p in dirs}
        dirs += [p for p in root.glob(REPLACED_PREFIX + PREFIX + "*") if p.is_dir() and step_of_directory(p) is not None
                 and p.name[len(REPLACED_PREFIX):] not in named]
    return sorted(dirs, key=step_of_directory)


def latest_checkpoint(out_dir: str | Path, replaced: bool = False) -> Path | None:
    """The newest of :func:`checkpoint_dirs` (``replaced``: as a reader lists them)."""
    dirs = checkpoint_dirs(out_dir, replaced)
    return dirs[-1] if dirs else None


#: The name :func:`publish_checkpoint` gives a checkpoint while it replaces it (then its name).
REPLACED_PREFIX = ".old-"


def _replaced(final: Path) -> Path:
    """Where :func:`publish_checkpoint` moves the checkpoint ``final`` it replaces."""
    return final.with_name(REPLACED_PREFIX + final.name)


def _restore_replaced(root: Path) -> None:
    """Finish what a kill left of :func:`publish_checkpoint` replacing a checkpoint: one moved
    aside whose successor was renamed into place is deleted; one whose successor never was is
    renamed back (else that step was lost, and a resume went back to the one before it)."""
    for aside in sorted(p for p in root.glob(REPLACED_PREFIX + PREFIX + "*") if p.is_dir()):
        final = aside.with_name(aside.name[len(REPLACED_PREFIX):])
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, final)
            warn_user(f"restored {final.name} in {str(root)!r}: a run killed while writing that step again had "
                      f"moved it aside ({aside.name}) and not yet renamed the new one in")


def remove_partial_checkpoints(out_dir: str | Path) -> list[Path]:
    """Delete temporary checkpoint directories that a crash left half-written (they were
    never renamed into place, so no run can depend on them), and finish a replacement a
    crash interrupted (:func:`_restore_replaced`). Returns what was removed of the first."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    _restore_replaced(root)
    stale = sorted(p for p in root.glob(".tmp-*") if p.is_dir())
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def _fsync(path: Path) -> None:
    """Flush file or directory ``path`` to the disk: a rename is durable before the data it
    names, so a power cut after publishing could leave a checkpoint of empty files while the
    rotation had already deleted the one before it. A directory a platform does not open
    (Windows) is left to it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (PermissionError, IsADirectoryError):
        if path.is_dir():
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_extra_files(files: dict[str, bytes] | None, own: set[str], who: str) -> dict[str, bytes]:
    """``files`` (name -> content, stored beside a checkpoint's own ``own``), or ``ValueError``
    naming ``who`` and the names that are not plain file names of the checkpoint directory
    (``../x`` was written beside it, outside what the manifest vouches for) or are its own."""
    extra = dict(files or {})
    bad = sorted(repr(name) for name in extra if not isinstance(name, str) or name in own | {"", ".", ".."}
                 or Path(name).name != name)
    if bad:
        raise ValueError(f"{who}: files must be plain file names other than the checkpoint's own "
                         f"({', '.join(sorted(own))}); got {', '.join(bad)}")
    return extra


def _not_json_at(value: Any, where: str, within: tuple[int, ...] = ()) -> str | None:
    """Where in ``value`` (``where``: its own place, ``run_state['sampler']``) the first entry
    that ``json.dumps`` cannot write is, or ``None`` where there is none."""
    if id(value) in within:  # (a dict or list holding itself)
        return where
    if isinstance(value, dict):
        for key, item in value.items():
            place = f"{where}[{key!r}]"
            if not (key is None or isinstance(key, (str, int, float, bool))):
                return place
            found = _not_json_at(item, place, (*within, id(value)))
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        return next((found for i, item in enumerate(value)
                     if (found := _not_json_at(item, f"{where}[{i}]", (*within, id(value)))) is not None), None)
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return where
    return None


def run_state_problem(run_state: dict[str, Any], who: str) -> TypeError | None:
    """The ``TypeError`` naming the entry of ``run_state`` (what a writer adds to ``state.json``)
    that JSON cannot hold, or ``None``: checked before anything is written, as
    :func:`publish_checkpoint`, the last step, failed after every file (a sharded checkpoint's:
    every rank's) had been."""
    try:
        json.dumps(run_state)
    except (TypeError, ValueError) as e:
        place = _not_json_at(run_state, "run_state") or "run_state"
        return TypeError(f"{who}: {place} cannot be written to {STATE_FILE} ({e}): run_state must hold JSON values "
                         "only (str, int, float, bool, None, and lists and dicts of them keyed by str)")
    return None


def publish_checkpoint(tmp: Path, final: Path, out_dir: str | Path, names, head: dict, tail: dict, keep: int) -> None:
    """The last steps of every checkpoint writer: hash ``names`` (files under ``tmp``) into
    the state file ``{**head, "files": ..., **tail}``, flush every file to the disk, move
    ``tmp`` to ``final`` in one rename (flushed too; a ``final`` there already is moved aside
    to ``.old-<name>`` first, which :func:`remove_partial_checkpoints` renames back after a
    kill between the two, and this function where the second fails), and keep only the newest ``keep``
    checkpoints of ``out_dir`` up to ``final``'s step (a newer one, of another trajectory, is
    left; it deleted ``final`` itself)."""
    honour_umask(p for p in tmp.rglob("*.safetensors") if p.is_file())
    listing = {name: {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size} for name in names}
    for name in names:
        _fsync(tmp / name)
    with (tmp / STATE_FILE).open("w") as f:
        json.dump(seal_state({**head, "files": listing, **tail}), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for folder in {(tmp / name).parent for name in names} | {tmp}:
        _fsync(folder)
    # (the same step written again - a run resumed from an earlier one - replaces it: the old one
    # is moved aside first, not deleted, so a kill between the two renames leaves it to restore)
    aside = _replaced(final)
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)  # (one left over is older than final)
        os.replace(final, aside)
    _rename_in(tmp, final, aside)
    _fsync(final.parent)  # (the rename, before the rotation deletes what came before it)
    shutil.rmtree(aside, ignore_errors=True)
    step = step_of_directory(final)
    for old in [p for p in checkpoint_dirs(out_dir) if step_of_directory(p) <= step][:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    _warn_of_newer(final, out_dir, step)


def _rename_in(tmp: Path, final: Path, aside: Path) -> None:
    """Rename ``tmp`` to ``final``; where that fails (an I/O error), the checkpoint of the same
    step moved ``aside`` before it is renamed back: the writers' error says the checkpoints
    written before are untouched, and that step was left as ``.old-step-*``, which the
    writers' listing (the rotation, a new run's check) and a checkpoint named by its step do
    not see until the trainer's next start. (A kill is undone there.)"""
    try:
        os.replace(tmp, final)
    except Exception:
        if aside.is_dir() and not final.exists():
            with contextlib.suppress(OSError):  # (the failure said is the first; the next start restores it)
                os.replace(aside, final)
        raise


def _warn_of_newer(final: Path, out_dir: str | Path, step: int) -> None:
    """Warn where ``out_dir`` holds checkpoints newer than ``final`` (of step ``step``, just
    written), which the rotation leaves: the run's newest is what a resume, ``attnres
    generate RUN`` and :func:`~attnres.checkpoint.find_valid_checkpoint` take, so they went on
    from the abandoned trajectory's, without a word, until this one passed it. (Said without
    the step written: Python's filter shows it once, not at every checkpoint until then.)"""
    newer = [p.name for p in checkpoint_dirs(out_dir) if step_of_directory(p) > step]
    if not newer:
        return
    shown = ", ".join(newer[:3]) + (", ..." if len(newer) > 3 else "")
    warn_user(f"a checkpoint was written into {str(out_dir)!r} below its {len(newer)} newer "
              f"checkpoint{'s' * (len(newer) > 1)} ({shown}), of a trajectory abandoned for this one (resumed from "
              "an earlier step?): they are kept, and the run's newest - what attnres train --resume, attnres "
              f"generate of the run and find_valid_checkpoint take - is {newer[-1]} until this run passes it; "
              f"attnres.checkpoint.set_aside_newer({str(out_dir)!r}, STEP), STEP the step resumed from, sets them "
              "aside (superseded-step-*), as attnres train --resume-from does")


def _check_format(path: Path, doc: Any) -> None:
    """``doc`` is a manifest of the format this version reads; a newer or older format says
    which it is, so that a checkpoint of another attnres version is not reported as damaged."""
    version = doc.get("format_version") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict) or isinstance(version, bool) \
            or not isinstance(version, int):
        raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} is not an attnres checkpoint manifest (no "
                              "format_version and files)")
    if version > FORMAT_VERSION:
        raise CheckpointFormatTooNew(f"checkpoint {str(path)!r} was written by a newer attnres (checkpoint format "
                                     f"{version}); this version reads format {FORMAT_VERSION}: upgrade attnres to load it")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {str(path)!r} has checkpoint format {version}; this version reads format "
                              f"{FORMAT_VERSION} only")


def _check_listing(path: Path, doc: dict[str, Any]) -> None:
    """Every entry of the manifest's ``files`` has a size and a SHA-256, and it lists every
    file its layout's loader reads (:data:`REQUIRED_FILES`)."""
    layout = doc.get("layout")
    if layout not in REQUIRED_FILES:
        raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} names an unknown layout {layout!r}; "
                              f"known: {sorted(k for k in REQUIRED_FILES if k)} or none (consolidated)")
    for name, info in doc["files"].items():
        if not (isinstance(info, dict) and isinstance(info.get("sha256"), str) and isinstance(info.get("bytes"), int)):
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupted: {STATE_FILE}'s entry for {name} has no "
                                  f"size and SHA-256 ({info!r})")
    unlisted = [name for name in REQUIRED_FILES[layout] if name not in doc["files"]]
    if unlisted:
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete or was edited: {STATE_FILE} does not list "
                              f"{unlisted}, which loading reads (every file it reads must be listed with its SHA-256)")


def _what_is_there(path: Path) -> str:
    """What a missing checkpoint ``path``'s message adds: where a kill left it moved aside
    (:func:`publish_checkpoint` writing its step again: the run-directory readers take it from
    there; named by its step, it was "does not exist", with the step before it as the run's
    newest), else the checkpoints its run holds (a step the run never checkpointed,
    ``--resume-from runs/x/checkpoints/step-00001000``: which ones it did)."""
    aside = _replaced(path)
    if path.name.startswith(PREFIX) and aside.is_dir():
        return (f": a run killed while writing that step again left it moved aside as {aside.name}, which the run's "
                f"next start renames back; name {str(aside)!r}, or the run directory (its newest checkpoint, read "
                "where it is)")
    there = checkpoint_dirs(path.parent.parent, replaced=True) if path.parent.name == "checkpoints" else []
    return f"; its run's checkpoints: {', '.join(p.name for p in there[-5:])}" if there else ""


def read_checkpoint_state(path: str | Path, optional: tuple[str, ...] = (),
                          only: Collection[str] | None = None) -> dict[str, Any]:
    """``state.json`` of a checkpoint after verifying it (its own hash, its step against the
    directory's name) and every file it lists (size and SHA-256) but those of ``optional`` that
    are absent (inference needs no ``optimizer.safetensors``); ``only``: of the files it lists,
    these alone (what one rank of a sharded load reads, :mod:`attnres.checkpoint.sharded`).
    Raises :class:`CheckpointError` naming the problem."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist{_what_is_there(path)}")
    try:
        doc = json.loads((path / STATE_FILE).read_text())
    except FileNotFoundError:
        if (newest := latest_checkpoint(path)) is not None:  # (a run directory: "incomplete" sent users hunting)
            raise CheckpointError(f"{str(path)!r} is a run directory, not one of its checkpoints: give a checkpoint "
                                  f"(its newest: {str(newest)!r}); attnres.inference.load_run takes a run directory "
                                  "(its newest checkpoint that verifies)") from None
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {STATE_FILE} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupted: {STATE_FILE} is not valid JSON ({e})") from None
    _check_format(path, doc)
    _check_manifest(path, doc)
    _check_listing(path, doc)
    for name, info in doc["files"].items():
        f = path / name
        if (name in optional and not f.exists()) or (only is not None and name not in only):
            continue
        try:
            if not f.is_file():
                raise FileNotFoundError(name)
            size = f.stat().st_size
            if size != info["bytes"]:
                raise CheckpointError(f"checkpoint {str(path)!r} is truncated or corrupted: {name} has {size} bytes, "
                                      f"expected {info['bytes']}")
            if _sha256(f) != info["sha256"]:
                raise CheckpointError(f"checkpoint {str(path)!r} is corrupted: {name} does not match its SHA-256 in "
                                      f"{STATE_FILE}")
        except FileNotFoundError:  # (also one removed since is_file: a run's rotation deleting the checkpoint)
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {name} is missing") from None
    return doc


#: The key prefix of a CUDA device's generator state in ``rng.safetensors`` (then its number).
_CUDA_RNG = "torch_cuda_"


def rng_state() -> dict[str, torch.Tensor]:
    """The torch generator states to store (``rng.safetensors``): the CPU's and each CUDA
    device's."""
    states = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            states[f"{_CUDA_RNG}{i}"] = s
    return states


def restore_rng(path: str | Path, cuda: bool = True) -> None:
    """Set the torch generators from checkpoint ``path``'s ``rng.safetensors``: the CPU's,
    and with ``cuda`` the CUDA devices' where their number matches. :class:`CheckpointError`
    naming the file and the key where it holds no valid CPU state (a file that verifies, as
    one written by another tool, ended in a bare ``KeyError``)."""
    rng = load_file(str(Path(path) / RNG_FILE))
    try:
        torch.set_rng_state(rng["torch_cpu"])
    except (KeyError, TypeError, RuntimeError) as e:  # (missing; not a ByteTensor; not the generator's size)
        problem = f"holds no 'torch_cpu' (holds {sorted(rng)})" if isinstance(e, KeyError) else \
            f"holds an invalid 'torch_cpu' ({e})"
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be resumed: {RNG_FILE} {problem}, the CPU "
                              "generator's state save_checkpoint and save_sharded store") from None
    # (by device number: sorted as strings, device 10 would come before device 2)
    states = [rng[k] for k in sorted((k for k in rng if k.startswith(_CUDA_RNG)), key=lambda k: int(k[len(_CUDA_RNG):]))]
    if cuda and states and torch.cuda.is_available() and len(states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states)
