"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): what runs on several
ranks write (every layout of the ``(pp, dp, tp)`` mesh, ``TrainConfig.parallel``).

Layout of ``<out_dir>/checkpoints/step-00000100/``::

    dcp/                   DCP files: every rank writes the shards it holds
                           (``__<rank>_0.distcp``) and rank 0 the metadata
    rng.safetensors        rank 0's torch generator states
    tokenizer.json         as in a consolidated checkpoint
    state.json             run state as in a consolidated checkpoint, ``"layout": "dcp"``,
                           and the SHA-256 of every file above (the DCP files included)

The keys are layout-free: ``model.<full parameter name>`` (``model.layers.3.attn.q_proj.weight``)
and ``optim.<full parameter name>.<state name>`` (``exp_avg``, ``exp_avg_sq``, ``step``,
``momentum_buffer``), whatever stage, tensor or data-parallel shard holds them. So a
checkpoint written at one layout loads at any other (``pp=2 -> pp=1``, ``tp=2 -> dp=2``,
``dp=2 -> dp=4``, or one process): each rank asks DCP for its own shards by key and reads only
those. No rank ever gathers the whole model.

As with consolidated checkpoints, the files are written into a hidden directory renamed into
place when complete (every rank must see the same file system: a shared one across nodes).
:func:`load_sharded_weights` loads one into a whole model in one process (generation,
export and evaluation do so through :func:`attnres.inference.load_run`);
:func:`attnres.checkpoint.consolidation.consolidate` writes the consolidated
``model.safetensors`` that other tools read.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import Tensor, nn

from .manifest import (
    FORMAT_VERSION,
    RNG_FILE,
    STATE_FILE,
    CheckpointError,
    CheckpointWriteError,
    check_extra_files,
    checkpoint_path,
    describe_failure,
    publish_checkpoint,
    read_checkpoint_state,
    rng_state,
    run_state_problem,
    write_failure,
)
from .manifest import restore_rng as _restore_rng
from .module import load_weights
from .residual import refuse_residual_change, residual_hint
from ..nn.compiled import by_own_names, uncompiled, uncompiled_name
from ..validation import check_sizes

__all__ = ["DCP_LAYOUT", "is_sharded", "save_sharded", "load_sharded", "load_sharded_weights", "read_sharded_tensors",
           "verify_dcp_files", "verify_files_on_every_rank"]

DCP_LAYOUT = "dcp"
DCP_DIR = "dcp"


def is_sharded(state: dict[str, Any]) -> bool:
    """Whether a checkpoint's ``state.json`` describes a sharded (DCP) checkpoint."""
    return state.get("layout") == DCP_LAYOUT


def _optimizer_entries(params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    out = {}
    for name, p in params.items():
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, Tensor):
                out[f"optim.{name}.{key}"] = value
    return out


def _state_dict(params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer | None) -> dict[str, Tensor]:
    sd: dict[str, Tensor] = {f"model.{n}": p.detach() for n, p in params.items()}
    if optimizer is not None:
        sd.update(_optimizer_entries(params, optimizer))
    return sd


def _several_ranks() -> bool:
    """Whether this process is one of several ranks of the default process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agree_on_default_group(error: Exception | None) -> None:
    """The default ``agree`` of :func:`save_sharded`: every rank of the default process group
    raises when any rank passes an error (that rank its own, the others the lowest failing
    rank's as a :class:`CheckpointWriteError`); a rank that raised alone left the others
    waiting in the next collective. In one process: ``error`` itself, if any."""
    if not _several_ranks():
        if error is not None:
            raise error
        return
    reports: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, None if error is None else str(error))
    if error is not None:
        raise error
    first = next((report for report in reports if report is not None), None)
    if first is not None:
        raise CheckpointWriteError(first)


def _attempt(fn: Callable[[], None], final: Path) -> CheckpointWriteError | None:
    """``fn()``'s failure to write checkpoint ``final``, if any."""
    try:
        fn()
    except (OSError, SafetensorError, CheckpointError) as e:
        return write_failure(final, e)
    return None


def _check_shards_in_sight(tmp: Path) -> None:
    """Every data file the freshly written DCP metadata names is here, complete: rank 0
    lists and hashes only what it sees, so a shard written into another directory under
    the same name (an ``out_dir`` the nodes do not share) must stop the checkpoint here."""
    from .dcp_metadata import dcp_file_sizes, read_dcp_metadata

    sizes = dcp_file_sizes(read_dcp_metadata(tmp / DCP_DIR))
    missing = sorted(f"{DCP_DIR}/{name}" for name, size in sizes.items()
                     if not (tmp / DCP_DIR / name).is_file() or (tmp / DCP_DIR / name).stat().st_size < size)
    if missing:
        raise CheckpointError(f"rank 0 cannot see {missing}, which the other ranks wrote into {str(tmp)!r}: their "
                              "out_dir is another directory under the same name (out_dir must be on a file system "
                              "every node shares)")


def save_sharded(out_dir: str | Path, step: int, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer,
                 run_state: dict[str, Any], keep: int, files: dict[str, bytes] | None = None,
                 main: bool | None = None,
                 agree: Callable[[Exception | None], None] = _agree_on_default_group) -> Path:
    """Write the sharded checkpoint of ``step`` (every rank calls this, with its own
    ``params``: full-model names to this rank's parameters, DTensors where sharded, stored
    without ``torch.compile``'s ``_orig_mod.`` as :func:`~attnres.checkpoint.write_checkpoint`
    stores them); returns its directory. ``main``: this rank writes the run state (rank 0), after checking that
    it sees every file the DCP metadata names; ``None``: rank 0 of the default process group
    (every rank was main by default, each removing the others' files and publishing). ``agree(error)``:
    a collective that raises on every rank when any rank passes an error (the default's on the default
    process group; the trainer's, on its own: every rank stops together).

    Raises :class:`CheckpointWriteError` when it cannot be written or completed (nothing is
    published, the earlier checkpoints stay, the temporary files are removed on every rank), and
    ``TypeError`` naming the entry of ``run_state`` that JSON cannot hold (passed to ``agree``
    before any file is written: every rank stops)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_sizes("save_sharded", keep=keep)  # (0 kept every checkpoint, -1 deleted the oldest: by accident)
    if main is None:
        main = not _several_ranks() or dist.get_rank() == 0
    files = check_extra_files(files, {DCP_DIR, RNG_FILE, STATE_FILE}, "save_sharded")
    final = checkpoint_path(out_dir, step)
    tmp = final.parent / f".tmp-{final.name}-dcp"

    def prepare() -> None:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / DCP_DIR).mkdir(parents=True)

    def complete() -> None:
        _check_shards_in_sight(tmp)
        save_file(rng_state(), str(tmp / RNG_FILE))
        for name, content in (files or {}).items():
            (tmp / name).write_bytes(content)
        names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        publish_checkpoint(tmp, final, out_dir, names,
                           {"format_version": FORMAT_VERSION, "layout": DCP_LAYOUT, "step": step}, run_state, keep)

    # (the names without torch.compile's '_orig_mod.' of a part compiled whole: the checkpoint's, as
    # write_checkpoint's, which a model with nothing compiled resumes from)
    params = by_own_names(params, "save_sharded")
    # (a run_state that JSON cannot hold failed rank 0 alone, writing state.json last, with a TypeError that
    # agree was never told of: the other ranks waited for it until the process group's timeout)
    problem = run_state_problem(run_state, "save_sharded")
    try:
        agree(problem or (_attempt(prepare, final) if main else None))  # (a problem: before any file is written)
        try:
            dcp.save(_state_dict(params, optimizer), checkpoint_id=str(tmp / DCP_DIR))  # raises on every rank alike
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a full disk, a read-only file system, ...
            raise write_failure(final, e) from None
        agree(_attempt(complete, final) if main else None)
    finally:
        # Failed, whatever the error: this rank's view of the temporary directory goes. Published: rank 0
        # renamed it, so only a rank with another directory under out_dir's name can still see one.
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def init_optimizer_state(params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    """Create every parameter's optimiser state (zero gradients, a step at learning rate 0,
    so the parameters do not move), so that a checkpoint's state can be loaded into it in
    place, in this layout's shards."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    grads = {n: p.grad for n, p in params.items()}
    for p in params.values():
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for n, p in params.items():
        p.grad = grads[n]


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    """DCP warns on every load without a process group that it assumes one process: that is
    what loading in one process means here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        yield


def _reader(path: Path):
    """DCP's reader of checkpoint ``path``, with its metadata read safely
    (:mod:`attnres.checkpoint.dcp_metadata`: DCP's own reader unpickles it)."""
    from .dcp_metadata import VerifiedReader

    return VerifiedReader(path / DCP_DIR)


def verify_dcp_files(path: str | Path, state: dict[str, Any]) -> None:
    """Check that every data file the DCP metadata of the sharded checkpoint ``path`` names
    is in its manifest (``state``: its verified ``state.json``), at least as large as the
    index needs: a checkpoint whose writer could not see every rank's shard (an ``out_dir``
    the nodes do not share) fails here, not later with a missing file."""
    from .dcp_metadata import dcp_file_sizes, read_dcp_metadata

    listed = state.get("files", {})
    for name, size in sorted(dcp_file_sizes(read_dcp_metadata(Path(path) / DCP_DIR)).items()):
        entry = listed.get(f"{DCP_DIR}/{name}")
        if entry is None or entry.get("bytes", 0) < size:
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {DCP_DIR}/{name}, which its DCP metadata "
                                  "names, is missing (written by a rank whose out_dir was another directory: out_dir "
                                  "must be on a file system every node shares)")


def _as_stored(sd: dict[str, Tensor], stored: Mapping[str, object]) -> dict[str, Tensor]:
    """``sd`` (keyed by the weights' own names) under the keys the checkpoint holds (``stored``):
    an earlier version's ``save_sharded`` stored the names its caller passed, a compiled part's
    with ``torch.compile``'s ``_orig_mod.`` (``model.layers.0._orig_mod.<name>``,
    ``optim.layers.0._orig_mod.<name>.exp_avg``), which DCP, asked for the own names, did not find."""
    theirs = {uncompiled_name(key): key for key in stored}
    return {key if key in stored else theirs.get(key, key): value for key, value in sd.items()}


def _verify(path: Path) -> dict[str, Any]:
    """The verified ``state.json`` of the sharded checkpoint ``path`` (every file's size and
    SHA-256, every file its DCP metadata names among them)."""
    state = read_checkpoint_state(path)
    if not is_sharded(state):
        raise CheckpointError(f"checkpoint {str(path)!r} is consolidated, not sharded: load it with "
                              "attnres.checkpoint.load_checkpoint(path, model, optimizer)")
    verify_dcp_files(path, state)
    return state


def _files_read(path: Path, names: Collection[str], optimizer: bool, rng: bool) -> set[str]:
    """The files of the sharded checkpoint ``path`` that a rank loading the parameters ``names``
    (their own names; their optimiser state too where ``optimizer``) reads: the DCP metadata, the
    data files holding any piece of those entries (of a sharded one, every piece: what DCP
    reads is among them) and, where ``rng``, the generator states."""
    own = {f"model.{name}" for name in names}
    states = tuple(f"optim.{name}." for name in names) if optimizer else ()
    index = _reader(path).read_metadata().storage_data
    return {f"{DCP_DIR}/.metadata", *([RNG_FILE] if rng else []),
            *(f"{DCP_DIR}/{info.relative_path}" for key, info in index.items()
              if uncompiled_name(key.fqn) in own or (states and uncompiled_name(key.fqn).startswith(states)))}


def _verify_on_every_rank(path: Path, reads: Callable[[], set[str]], verified: dict[str, Any] | None = None) -> None:
    """:func:`_verify` of ``path`` on rank 0 (every file hashed, once) and, on each other rank,
    of the files it reads (``reads()``, :func:`_files_read`): what rank 0 saw of them, a rank of
    another node sees only where out_dir is on a file system every node shares, and a damaged
    copy of its own failed in DCP's words, or loaded as it was. ``verified``: the ``state.json``
    rank 0 has verified already (the trainer's, found by ``find_valid_checkpoint`` on rank 0 and
    handed to every rank): rank 0 hashes nothing again, the others still check what they read,
    against it. Every rank raises the same :class:`CheckpointError`, the lowest failing rank's,
    when any fails: a rank that raised alone left the others waiting in DCP's first collective.
    In one process: :func:`_verify`, unless ``verified``."""
    if not _several_ranks():
        if verified is None:
            _verify(path)
        return
    rank = dist.get_rank()
    _agree_on_verification(path, lambda: _verify_files_read(path, reads(), verified) if rank else
                           None if verified is not None else _verify(path))


def verify_files_on_every_rank(path: str | Path, names: Collection[str], verified: dict[str, Any]) -> None:
    """Of a consolidated checkpoint rank 0 verified (``verified``: its ``state.json``, found by
    ``find_valid_checkpoint`` on rank 0 and handed to every rank), each other rank verifies the
    files ``names`` it reads (size and SHA-256, as :func:`_verify_on_every_rank` does a sharded
    one's) against the ``state.json`` it sees and rank 0's: every rank reads the whole
    ``model.safetensors`` (and, resuming, the optimiser's and generators' files) from its own
    out_dir, and a damaged copy of its own (an out_dir the nodes do not share) loaded silently.
    Every rank raises the same :class:`CheckpointError`, the lowest failing rank's. Every rank
    must call it (a collective); nothing in one process (rank 0 verified it)."""
    if not _several_ranks():
        return
    path, rank = Path(path), dist.get_rank()
    _agree_on_verification(path, lambda: rank and _same_as_verified(path, read_checkpoint_state(path, only=names), names,
                                                                    verified))


def _agree_on_verification(path: Path, check: Callable[[], Any]) -> None:
    """``check()`` of ``path`` on this rank; every rank raises the same :class:`CheckpointError`,
    the lowest failing rank's, when any fails: a rank that raised alone left the others
    waiting in their next collective."""
    try:
        check()
        problem = None
    except Exception as e:  # noqa: BLE001 - any failure (an unreadable file's OSError too) is every rank's
        problem = str(e) if isinstance(e, CheckpointError) else \
            f"checkpoint {str(path)!r} cannot be verified: {describe_failure(e)}"
    reports: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, problem)
    failed = next((r for r, report in enumerate(reports) if report is not None), None)
    if failed is not None:
        raise CheckpointError(reports[failed] + ("" if failed == 0 else f" (as rank {failed} sees it)"))


def _verify_files_read(path: Path, names: set[str], verified: dict[str, Any] | None) -> None:
    """Verify the files ``names`` of the sharded checkpoint ``path`` against its ``state.json``
    as this rank reads it and, where rank 0 verified one (``verified``), against that
    (:func:`_same_as_verified`)."""
    state = read_checkpoint_state(path, only=names)
    verify_dcp_files(path, state)
    if verified is not None:
        _same_as_verified(path, state, names, verified)


def _same_as_verified(path: Path, state: dict[str, Any], names: Collection[str], verified: dict[str, Any]) -> None:
    """:class:`CheckpointError` where one of the files ``names`` of ``state`` (the ``state.json``
    this rank reads) is listed otherwise in ``verified`` (rank 0's): a copy of its own that
    verifies by itself but is of another checkpoint (another run's ``step-*`` of the same name,
    in an out_dir the nodes do not share) is not what rank 0 checked."""
    theirs = verified.get("files") or {}
    other = sorted(name for name in names if state["files"].get(name) != theirs.get(name))
    if other:
        raise CheckpointError(f"checkpoint {str(path)!r} is not the one rank 0 verified: {other[0]} differs from "
                              "rank 0's copy (out_dir must be on a file system every node shares)")


def _leave_fresh_where_none_was_saved(params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer,
                                      stored: Mapping[str, object]) -> None:
    """Drop the optimiser state :func:`init_optimizer_state` made for each parameter the
    checkpoint holds none of (frozen - ``requires_grad`` False - or never stepped when it was
    saved: DCP was asked for its ``optim.<name>.exp_avg`` and failed, 'Missing key'): it starts
    fresh, as it would have gone on. One whose state is there under other names (another
    optimiser's) is still asked for its own, and fails."""
    # (state names have no dot - exp_avg, step, momentum_buffer: what precedes the last one is the parameter's key)
    held = {uncompiled_name(key).rpartition(".")[0] for key in stored if key.startswith("optim.")}
    for name, p in params.items():
        if f"optim.{name}" not in held:
            optimizer.state.pop(p, None)


def load_sharded(path: str | Path, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer | None = None,
                 restore_rng: bool = True, verified: dict[str, Any] | None = None) -> None:
    """Load a sharded checkpoint into ``params`` (this rank's, in this run's layout; a compiled
    part's ``_orig_mod.`` names are read as their own, and so are those an earlier version
    stored) and ``optimizer`` in place: each rank reads its own shards. Every rank calls this.
    ``verified``: the checkpoint's ``state.json``, where the caller has verified it (as the
    trainer has on rank 0, :func:`~attnres.checkpoint.find_valid_checkpoint`: rank 0 does not
    hash its files again); without it it is verified first (every file's SHA-256: a damaged
    shard loaded as it was, without a word) by rank 0. Either way each other rank verifies the
    files it reads (against ``verified`` too, where given: :func:`_verify_on_every_rank`), and
    every rank raises the same :class:`CheckpointError` if any fails.
    A parameter that had no optimiser state when the checkpoint was saved (frozen, or never
    stepped) keeps a fresh one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    params = by_own_names(params, "load_sharded")  # (the checkpoint's names: save_sharded's)
    # (verified by the caller: on rank 0, where it found it; each other rank still checks the files it reads)
    _verify_on_every_rank(path, lambda: _files_read(path, params, optimizer is not None, restore_rng), verified)
    reader = _reader(path)
    stored = reader.read_metadata().state_dict_metadata
    if optimizer is not None:  # (a checkpoint written before the optimiser's first step holds none: all fresh)
        init_optimizer_state(params, optimizer)
        _leave_fresh_where_none_was_saved(params, optimizer, stored)
    sd = _as_stored(_state_dict(params, optimizer), stored)
    try:
        with torch.no_grad(), _one_process_quietly():
            dcp.load(sd, storage_reader=reader)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded into this model/optimiser: "
                              f"{describe_failure(e)}") from None
    if restore_rng:
        _restore_rng(path, cuda=False)


def read_sharded_tensors(path: str | Path, prefix: str = "model.") -> dict[str, Tensor]:
    """The whole tensors of the sharded checkpoint ``path`` whose keys start with ``prefix``
    (``"model."``: the weights; ``"optim."``: the optimiser state), keys without the prefix,
    read in one process (no process group, no gather across ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = _reader(Path(path))
    meta = reader.read_metadata()  # tensors only (checked)
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
          if k.startswith(prefix)}
    try:
        with _one_process_quietly():
            dcp.load(sd, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
        # (a shard changed since it was verified - cut short, deleted by its run's rotation - went past
        # every `except Exception` as DCP's CheckpointException)
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read: {describe_failure(e)}; its files changed "
                              "since it was verified (cut short, or removed by its run's keep_checkpoints rotation): "
                              "copy it again, or name a newer one") from None
    return {k[len(prefix):]: v for k, v in sd.items()}


def load_sharded_weights(path: str | Path, model: nn.Module, state: dict[str, Any] | None = None, *,
                         allow_residual_change: bool = False) -> None:
    """Load the weights of the sharded checkpoint ``path`` into the whole ``model`` (one
    process: generation, export, evaluation). A tied weight is stored once, under the name
    ``named_parameters`` gives it; its other names are filled by the tie.
    :class:`CheckpointError` when the checkpoint does not fit the model, or when ``model``
    tells its residual (an ``AttnResLM``) and it is not the one the checkpoint's run config
    stores while the weights fit, unless ``allow_residual_change``
    (:func:`attnres.checkpoint.load_checkpoint`'s rule). ``state``: its ``state.json``, where
    the caller has verified the checkpoint (:func:`~attnres.checkpoint.read_checkpoint_state`);
    without it the checkpoint is verified here, as ``load_checkpoint`` verifies one."""
    if state is None:  # (a shard cut short or damaged loaded as it was, without a word)
        state = read_checkpoint_state(path)
        verify_dcp_files(path, state)
    model = uncompiled(model)
    refuse_residual_change(path, state, model, allow_residual_change)
    try:
        load_weights(path, model, read_sharded_tensors(path))
    except CheckpointError as e:  # weights that do not fit: of a model with another residual, said so
        raise CheckpointError(f"{e}{residual_hint(path, state, model)}") from None
