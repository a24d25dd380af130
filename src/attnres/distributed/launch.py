"""Process groups: who we are (rank, world size, device), which backend, how long to wait.

Everything distributed in ``attnres`` starts here. :func:`backend_for_device` is the one place
that maps a device to a ``torch.distributed`` backend (``nccl`` for CUDA, ``gloo`` for CPU),
so the same code runs on GPUs and on a laptop. :func:`init_distributed` reads what
``torchrun`` (or any launcher that sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT``) puts into the environment, picks the device (``cuda:LOCAL_RANK`` or the CPU),
and creates the default process group with a timeout, so that a collective whose peer died
fails with :class:`DistributedError` instead of waiting forever. :func:`process_context` is
what a training run calls: the group when several ranks were launched, else this one
process alone (a :class:`DistContext` of world size 1, no group); the collectives here
(:func:`mean_over_ranks`, :func:`any_rank`, :func:`barrier`, :func:`gather_objects`,
:func:`raise_on_every_rank`, :func:`agree`, :func:`main_first`) are no-ops for it.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(RuntimeError):
    """A collective failed or timed out (typically: another rank died), or the process
    group could not be set up as asked."""


def backend_for_device(device: torch.device | str) -> str:
    """The ``torch.distributed`` backend for tensors on ``device``: ``"nccl"`` for CUDA,
    ``"gloo"`` for the CPU. Raises ``ValueError`` for other device types."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "nccl"
    if kind == "cpu":
        return "gloo"
    raise ValueError(f"no torch.distributed backend for device type {kind!r}; use 'cuda' (nccl) or 'cpu' (gloo)")


def launched_world_size() -> int | None:
    """``WORLD_SIZE`` when a launcher (``torchrun``) started this process, else ``None``."""
    if not all(k in os.environ for k in LAUNCH_ENV):
        return None
    return int(os.environ["WORLD_SIZE"])


@dataclass(frozen=True)
class DistContext:
    """This process's place in the default process group (``world_size`` 1 and ``backend``
    ``None``: one process, no group)."""

    rank: int
    world_size: int
    device: torch.device
    backend: str | None
    timeout_s: float
    #: the process group of this context's object collectives (None: the default group)
    group: Any = None
    #: the setting that gave ``timeout_s`` (named when a collective fails)
    timeout_setting: str = "TrainConfig.dist_timeout_s"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def no_cuda_reason() -> str:
    """Why PyTorch sees no CUDA device, in words: a CPU build of torch, or a CUDA build that
    finds none."""
    if sys.platform == "darwin":
        return f"PyTorch {torch.__version__} on macOS has no CUDA, and attnres does not run on Apple's GPU (mps)"
    if torch.version.cuda is None and torch.version.hip is None:
        return f"this PyTorch ({torch.__version__}) is a CPU build; a GPU needs a CUDA build of torch"
    return (f"PyTorch {torch.__version__} is built for CUDA but finds no device (no GPU, a driver it cannot use, or "
            "CUDA_VISIBLE_DEVICES hiding them)")


def _pick_device(device: str) -> torch.device:
    """:func:`training_device`, a GPU made the current device."""
    picked = training_device(device)
    if picked.type == "cuda":
        torch.cuda.set_device(picked.index)
    return picked


def training_device(device: str) -> torch.device:
    """The device a training process of ``TrainConfig.device`` runs on: ``"auto"`` ->
    ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU; ``"cuda:N"`` (one process) ->
    that GPU. Raises ``ValueError`` for a GPU this machine or launch cannot give; sets nothing."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"TrainConfig.device={device!r} but no CUDA device is available: {no_cuda_reason()}; use "
                         "device=cpu (or auto: CUDA where there is one)")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda:"):
        if (launched_world_size() or 1) > 1:
            raise ValueError(f"TrainConfig.device={device!r} picks one GPU, but torchrun started several ranks, each "
                             "on its own GPU (cuda:LOCAL_RANK): use device=cuda, and CUDA_VISIBLE_DEVICES to choose "
                             "the GPUs")
        index = int(device.split(":")[1])
        if index >= torch.cuda.device_count():
            raise ValueError(f"TrainConfig.device={device!r}: this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    else:
        _check_a_gpu_per_rank(device)
    return torch.device("cuda", index)


def _check_a_gpu_per_rank(device: str) -> None:
    """``ValueError`` where torchrun started more ranks on this node than it has GPUs: rank
    ``LOCAL_RANK`` takes ``cuda:LOCAL_RANK``, and a rank past the last GPU would stop alone in
    ``set_device`` on CUDA's "invalid device ordinal", a traceback that names no fix. Checked
    from ``LOCAL_WORLD_SIZE``, the same on every rank of the node (``LOCAL_RANK`` is not), so
    that every rank stops alike and the node's first rank prints it once."""
    if launched_world_size() is None:  # (one process: a LOCAL_WORLD_SIZE left in the environment is not its launch)
        return
    ranks_here, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
    if ranks_here > gpus:
        raise ValueError(f"TrainConfig.device={device!r}: torchrun started {ranks_here} ranks on this node, each on "
                         f"its own GPU (cuda:LOCAL_RANK), but the node shows {gpus} CUDA device(s); launch at most "
                         f"{gpus} per node (torchrun --nproc-per-node {gpus}), or train on the CPU (device=cpu)")


def init_distributed(device: str = "auto", timeout_s: float = 600.0) -> DistContext:
    """Join the default process group, creating it on first use; ``device`` is ``"auto"``,
    ``"cpu"`` or ``"cuda"``. The backend follows the device (:func:`backend_for_device`);
    ``timeout_s`` bounds how long any collective waits for a missing peer (it is fixed when
    the group is created).

    A group created here lives until the process exits: later calls (another
    :func:`~attnres.train.train` in the same process) reuse it, because destroying the
    default group and creating it again through the launcher's store is not reliable. Under
    ``torchrun`` this process ends when the agent dies (:func:`exit_with_launcher`)."""
    dev = _pick_device(device)
    backend = backend_for_device(dev)
    exit_with_launcher()
    if not dist.is_initialized():
        if launched_world_size() is None:
            raise ValueError("no process group: launch with `torchrun --nproc-per-node K ...`")
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
        atexit.register(destroy_process_group)
    elif dist.get_backend() != backend:
        raise DistributedError(f"the existing process group uses {dist.get_backend()!r}, but device {dev} needs {backend!r}")
    return DistContext(dist.get_rank(), dist.get_world_size(), dev, backend, timeout_s)


def process_context(device: str = "auto", timeout_s: float = 600.0) -> DistContext:
    """This process's :class:`DistContext`: :func:`init_distributed` when a process group
    exists or a launcher started more than one rank, else the single process on ``device``
    (``"auto"``: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU). Under ``torchrun``
    (one rank too) this process ends when the agent dies (:func:`exit_with_launcher`)."""
    exit_with_launcher()
    if (dist.is_available() and dist.is_initialized()) or (launched_world_size() or 1) > 1:
        return init_distributed(device, timeout_s)
    return DistContext(0, 1, _pick_device(device), None, timeout_s)


#: How long a rank waits for rank 0's long local work by default (seconds;
#: ``TrainConfig.setup_timeout_s``), whatever ``dist_timeout_s`` is: rank 0 trains the BPE and
#: tokenises the corpus (or verifies the checkpoint to resume), as long as the corpus is large,
#: and publishes each checkpoint (hashes every rank's shards), as long as the model is large,
#: while the others wait. A rank that dies meanwhile is noticed at once (its connection
#: closes); only a stalled one is waited for this long.
SETUP_TIMEOUT_S = 24 * 3600.0

#: How often a rank waiting for rank 0's long local work says so (seconds).
WAIT_REPORT_S = 300.0

#: ``(the default group, the timeout, its patient group)`` once made (the default group held: compared by identity)
_patient_group: list[tuple[Any, float, Any]] = []


def patient(ctx: DistContext, timeout_s: float = SETUP_TIMEOUT_S) -> DistContext:
    """``ctx`` for the object collectives that wait for rank 0's long local work (the set-up,
    publishing a checkpoint): a gloo group over every rank with a timeout of ``timeout_s``
    (``TrainConfig.setup_timeout_s``; at least ``ctx.timeout_s``), created on first use (every
    rank must call this) and kept with the default group. ``ctx`` itself in one process."""
    if ctx.world_size == 1:
        return ctx
    world, timeout_s = dist.group.WORLD, max(ctx.timeout_s, timeout_s)
    # (one of a destroyed default group is unusable)
    if not _patient_group or _patient_group[0][0] is not world or _patient_group[0][1] != timeout_s:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        _patient_group[:] = [(world, timeout_s, group)]
    return replace(ctx, group=_patient_group[0][2], timeout_s=timeout_s, timeout_setting="TrainConfig.setup_timeout_s")


def _duration(seconds: float) -> str:
    """``seconds`` in words: ``"45 s"``, ``"10 min"``, ``"24 h"``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.3g} h"


@contextlib.contextmanager
def waiting_for_rank_0(ctx: DistContext, what: str) -> Iterator[None]:
    """Around a collective in which the other ranks wait for rank 0's long local work
    (``what``: that work, in words): every :data:`WAIT_REPORT_S` they wait, they say so on
    stderr, so that a stalled rank 0 is not waited for in silence (up to ``ctx.timeout_s``).
    Nothing in one process, nor on rank 0."""
    if ctx.world_size == 1 or ctx.is_main:
        yield
        return
    done, start = threading.Event(), time.monotonic()

    def report() -> None:
        while not done.wait(WAIT_REPORT_S):
            print(f"rank {ctx.rank}: still waiting for rank 0 ({what}) after {_duration(time.monotonic() - start)}; "
                  f"the wait ends with an error after {_duration(ctx.timeout_s)} ({ctx.timeout_setting})",
                  file=sys.stderr, flush=True)

    reporter = threading.Thread(target=report, name="attnres-wait-report", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()


#: Linux ``prctl`` option: the signal the calling process gets when its parent dies.
_PR_SET_PDEATHSIG = 1

#: How long a worker whose launcher died has to stop after its SIGTERM before it ends itself
#: (seconds): the grace period torchrun's agent would have given it before SIGKILL.
LAUNCHER_GRACE_S = 30.0


def exit_with_launcher() -> bool:
    """Under ``torchrun``, on Linux: have the kernel send this worker SIGTERM when its agent
    (its parent) dies - a job scheduler's SIGKILL of the launcher, ``kill -9`` - which would
    otherwise leave the workers running as orphans, holding their memory (a GPU's), stuck in
    collectives. The SIGTERM ends the run as the agent's own does: at once during the set-up,
    after the current step (and its checkpoint) while training (:func:`end_if_orphaned`). An
    agent already gone (it died while this process started, before the request: nothing would
    send the signal) ends the process now, by the same SIGTERM. Returns whether the kernel
    took the request: not without torchrun (``TORCHELASTIC_RUN_ID`` unset) nor on other
    systems."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return False
    if launcher_gone():
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def launcher_gone() -> bool:
    """Whether this ``torchrun`` worker's agent has died: its parent is no longer the one
    ``import attnres`` saw (before importing torch). False outside torchrun, and in a process
    forked since (its parent is another by birth)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    import attnres

    pid, parent = attnres._started
    return pid == os.getpid() and os.getppid() != parent


def end_if_orphaned() -> None:
    """On a SIGTERM that asks a training run to stop: if it came because the launcher died,
    end this process :data:`LAUNCHER_GRACE_S` later unless the run has stopped by then, as the
    agent would have killed it (a stalled rank never finishes its step)."""
    if not launcher_gone():
        return

    def end() -> None:
        print(f"rank {os.environ.get('RANK', '?')}: torchrun's agent is gone and this rank did not stop within "
              f"{LAUNCHER_GRACE_S:g} s of its SIGTERM: exiting", file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)

    timer = threading.Timer(LAUNCHER_GRACE_S, end)
    timer.daemon = True
    timer.start()


def mean_over_ranks(value: float, ctx: DistContext) -> float:
    """The mean of a Python float over all ranks (every rank gets the result; ``value``
    itself in one process)."""
    if ctx.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.item() / ctx.world_size


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """True on every rank if ``flag`` is true on any rank."""
    if ctx.world_size == 1:
        return flag
    t = torch.tensor([int(flag)], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier(ctx: DistContext) -> None:
    """Wait for every rank (nothing to wait for in one process)."""
    if ctx.world_size > 1:
        with collective_errors(ctx):
            dist.barrier(group=ctx.group)


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank (``[obj]`` in one process)."""
    if ctx.world_size == 1:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    with collective_errors(ctx):  # (a failure names ctx's timeout: the patient group's its own)
        dist.all_gather_object(out, obj, group=ctx.group)
    return out


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's picklable ``obj`` on every rank (``obj`` in one process)."""
    if ctx.world_size == 1:
        return obj
    box = [obj]
    with collective_errors(ctx):
        dist.broadcast_object_list(box, src=0, group=ctx.group)
    return box[0]


#: The attribute that marks an error every rank raised alike (:func:`raise_on_every_rank`).
ON_EVERY_RANK = "attnres_on_every_rank"


def raised_on_every_rank(error: BaseException) -> bool:
    """Whether every rank raised ``error`` alike (then a command prints it once per node)."""
    return bool(getattr(error, ON_EVERY_RANK, False))


def on_every_rank(error: BaseException) -> BaseException:
    """``error``, marked as raised alike on every rank (:func:`raised_on_every_rank`)."""
    setattr(error, ON_EVERY_RANK, True)
    return error


def raise_on_every_rank(error: Exception | None, ctx: DistContext) -> None:
    """Stop every rank together when any rank has an ``error`` (a collective: every rank
    calls it, ``None`` where all went well). The error of the lowest failing rank is raised on
    every rank: that rank raises its own, the others one of the same type and message (a
    ``ValueError`` where the type takes more than a message); all are marked
    (:func:`raised_on_every_rank`). In one process: ``error`` itself, if any."""
    if ctx.world_size == 1:
        if error is not None:
            raise error
        return
    reports = gather_objects(None if error is None else (_portable_type(error), str(error)), ctx)
    first = next((r for r in reports if r is not None), None)
    if first is None:
        return
    if error is None or reports.index(first) != ctx.rank:
        kind, message = first
        try:
            error = kind(message)
        except Exception:  # noqa: BLE001 - a type that needs other arguments
            error = ValueError(message)
    raise on_every_rank(error)


def _attempt(fn):
    """``(fn(), None)``, or ``(None, the error)``."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - handed to raise_on_every_rank
        return None, e


def agree(fn, ctx: DistContext):
    """``fn()`` on every rank; an error on any rank stops every rank with it, marked as every
    rank's (:func:`raise_on_every_rank`)."""
    result, error = _attempt(fn)
    raise_on_every_rank(error, ctx)
    return result


def main_first(fn, ctx: DistContext, shared: bool = False, what: str = "its part of the set-up"):
    """``fn()`` on rank 0 first, then on the others (which may then read what rank 0 wrote:
    a token cache, checkpoints set aside). With ``shared`` the others take rank 0's
    (picklable) result instead of running ``fn``: work whose answer is every rank's, done once
    (hashing every file of the checkpoint a run resumes would read it once per rank from the
    shared file system - and the ranks could not disagree on which one verifies). An error on
    any rank stops every rank with that error (:func:`raise_on_every_rank`). The others say
    what they wait for (``what``: rank 0's work) while it takes long (:func:`waiting_for_rank_0`)."""
    result, error = _attempt(fn) if ctx.is_main else (None, None)
    with waiting_for_rank_0(ctx, what):
        raise_on_every_rank(error, ctx)  # a collective: also the barrier
    if shared:
        return broadcast_object(result, ctx)
    if not ctx.is_main:
        result, error = _attempt(fn)
    raise_on_every_rank(error, ctx)
    return result


def _portable_type(error: BaseException) -> type:
    """``type(error)`` where the other ranks can unpickle it (a class defined at module level), else ``ValueError``."""
    import pickle

    try:
        pickle.loads(pickle.dumps(type(error)))
    except Exception:  # noqa: BLE001 - a local class, a class of __main__ elsewhere, ...
        return ValueError
    return type(error)


def destroy_process_group() -> None:
    """Destroy the default process group (and every other), if there is one; also run at
    exit once :func:`init_distributed` has created it.

    Then collect garbage: a trained model (FSDP2's modules, their device mesh) sits in
    reference cycles, and whatever of the groups' state it holds is otherwise released while
    the interpreter shuts down, when a backend's threads can no longer take the GIL - the
    likely cause of a gloo abort ("terminate called without an active exception") seen once
    at the exit of a run that had succeeded."""
    if dist.is_initialized():
        dist.destroy_process_group()
        collect_garbage()


def collect_garbage(passes: int = 4) -> int:
    """Run the cyclic garbage collector until a pass frees nothing (at most ``passes``);
    returns the passes run. One pass is not always enough: a cycle held from C++ (a hook in
    an autograd graph, as FSDP2 and the pipeline schedules register) is freed only once an
    earlier pass has freed the Python object that owned that graph."""
    for done in range(1, passes + 1):
        if gc.collect() == 0:
            return done
    return passes


#: What a backend's ``RuntimeError`` of a failed collective says (lower case).
_COLLECTIVE_FAILURE_WORDS = ("gloo", "nccl", "timed out", "timeout", "connection")


@contextlib.contextmanager
def collective_errors(ctx: DistContext) -> Iterator[None]:
    """Turn a failed collective into a :class:`DistributedError` that says which rank saw it
    and what the likely cause is. Backends report a dead peer as a closed connection or, at
    the latest after the process-group timeout, as a timeout; both surface as ``DistError``
    (or a plain ``RuntimeError`` from the backend). In one process there is no collective
    to fail, and nothing is translated."""
    if ctx.world_size == 1:
        yield
        return
    try:
        yield
    except DistributedError:
        raise
    except (dist.DistError, RuntimeError) as e:
        # (gloo's words for a peer gone: "Connection reset by peer", "Timed out waiting ...ms",
        # "Application timeout caused pair closure")
        if not isinstance(e, dist.DistError) and not any(w in str(e).lower() for w in _COLLECTIVE_FAILURE_WORDS):
            raise
        raise DistributedError(
            f"rank {ctx.rank} of {ctx.world_size}: a collective failed ({type(e).__name__}: {str(e).strip().splitlines()[0]}). "
            f"Another rank has probably died or stalled; the process-group timeout is {ctx.timeout_s:g} s "
            f"({ctx.timeout_setting}). Under torchrun the job ends once its agent has stopped every rank: a rank "
            "that does not exit on SIGTERM is killed after torchrun's 30 s grace period."
        ) from e
