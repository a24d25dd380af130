"""The static decoders that :func:`~attnres.inference.stream` keeps per model, so that
generating again at a batch size and capacity it generated at reuses the decoder: no new
CUDA graph capture (``decode="graph"``, the default on CUDA) and no new compilation or
re-recording of Inductor's CUDA graphs (``decode="compiled"``) per call.

A capture costs more than its ``warmup + 1`` steps: ``torch.cuda.graph`` synchronizes the
device and empties the CUDA caching allocator before it records (and collects Python's
garbage with ``TORCH_CUDAGRAPH_GC=1``), so an evaluation loop that calls ``generate`` once
per batch paid for that at every call, where the steps of a short generation cost less. A
decoder holds a static KV cache of its capacity (GPU memory) until :func:`release_decoders`
frees it, a newer one pushes it out (at most :data:`KEPT_PER_MODEL` are kept per model), or
the model is freed (an idle decoder holds no reference to its model: no cycle).

Each kept decoder serves one generation at a time: a stream borrows it (two streams of one
model at once, or from two threads, each get their own) and gives it back when it ends, is
closed or is collected (dropped when it ends in an error: it may be mid-step). A model
moved to another device or dtype gets new decoders, the old ones dropped at its next call;
generating under another autocast state, or in training mode, gets decoders of its own
beside them.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from ..models.lm import require_attnres_lm
from ..nn.compiled import uncompiled
from . import static as _static  # (its cuda_graphs looked up at each call: the tests replace it)
from .static import StaticDecoder

__all__ = ["KEPT_PER_MODEL", "borrowed_decoder", "freeing_kept_on_oom", "release_decoders"]

T = TypeVar("T")

#: The most idle decoders kept for one model (the least recently used goes first).
KEPT_PER_MODEL = 4
#: The model attribute that holds its :class:`_KeptDecoders` (in its ``__dict__``, not a module).
_ATTRIBUTE = "_attnres_kept_decoders"
#: Borrowing from several threads (a server's): one decoder, one generation. A give-back
#: does not wait for it (:func:`_give_back`).
_LOCK = threading.Lock()


class _KeptDecoders:
    """One model's idle decoders, by what they were built for (:func:`_key`). A copy or a
    pickle of the model (``copy.deepcopy``, ``torch.save(model)``) gets none: a CUDA graph
    can be neither copied nor pickled, and its cache belongs to the model it was made for."""

    def __init__(self) -> None:
        #: Each decoder with the CUDA event of its last step's stream (``None`` off CUDA).
        self.idle: OrderedDict[tuple, tuple[StaticDecoder, Any]] = OrderedDict()
        #: ``(key, (decoder, event))`` given back and not yet in ``idle`` (appended without the lock).
        self.returned: list[tuple[tuple, tuple[StaticDecoder, Any]]] = []

    def __reduce__(self):
        return _KeptDecoders, ()

    def settle(self) -> None:
        """The decoders given back into ``idle``, the most recent last, and the least recently
        used ones out past :data:`KEPT_PER_MODEL`; the caller holds :data:`_LOCK`."""
        while self.returned:
            key, entry = self.returned.pop(0)
            self.idle[key] = entry
            self.idle.move_to_end(key)
        while len(self.idle) > KEPT_PER_MODEL:
            self.idle.popitem(last=False)


def _key(model, mode: str, batch_size: int, capacity: int) -> tuple:
    """What a decoder is made for: its mode, batch size and capacity, and the model's state
    that a captured graph or compiled step holds - the parameters' device and dtype, the
    autocast state of that device (a graph captured under autocast replays its casts) and
    training mode (dropout)."""
    parameter = next(model.parameters())
    device = parameter.device
    autocast = torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type)
    return mode, batch_size, capacity, device, parameter.dtype, autocast, model.training


def _kept(model) -> _KeptDecoders:
    """``model``'s kept decoders (made on first use); the caller holds :data:`_LOCK`."""
    state = vars(model)
    if not isinstance(state.get(_ATTRIBUTE), _KeptDecoders):
        state[_ATTRIBUTE] = _KeptDecoders()
    return state[_ATTRIBUTE]


@contextlib.contextmanager
def borrowed_decoder(model, batch_size: int, capacity: int, mode: str) -> Iterator[StaticDecoder]:
    """A :class:`StaticDecoder` of ``model`` for ``batch_size`` rows, ``capacity`` positions
    and ``mode`` ("eager", "compiled" or "graph"): a kept one when there is one, else a new
    one; kept for the next call when the block ends (or the generator holding it is closed),
    not when it ends in an error (the decoder may be mid-step)."""
    owner = uncompiled(model)
    key = _key(owner, mode, batch_size, capacity)
    with _LOCK:
        kept = _kept(owner)
        kept.settle()
        for other in [k for k in kept.idle if k[3:5] != key[3:5]]:  # (the model moved: their caches are the old device's)
            del kept.idle[other]
        decoder, done = kept.idle.pop(key, (None, None))
    if decoder is None:
        decoder = freeing_kept_on_oom(model, lambda: StaticDecoder(model, batch_size, capacity, mode=mode))
    else:
        decoder.model = model  # (an idle one holds none: _give_back)
        if done is not None:  # (a stream closed early left its next step queued: on another CUDA stream,
            # this thread's, the load would overwrite the cache that step reads)
            torch.cuda.current_stream(decoder.device).wait_event(done)
    try:
        yield decoder
    except GeneratorExit:  # (a stream closed early, or collected: the decoder is between steps)
        _give_back(kept, key, decoder)
        raise
    else:
        _give_back(kept, key, decoder)


def freeing_kept_on_oom(model, run: Callable[[], T]) -> T:
    """``run()`` - a prefill, a new decoder -; out of memory while ``model`` keeps decoders
    (their static caches: GPU memory a generation of another shape cannot use), they are
    freed and it runs again."""
    try:
        return run()
    except torch.OutOfMemoryError:
        if not _release(uncompiled(model)):
            raise
    # (run again after the except clause: the error's traceback held what the failed run had
    # allocated - a cache's first layers - through the retry)
    return run()


def _give_back(kept: _KeptDecoders, key: tuple, decoder: StaticDecoder) -> None:
    # An idle decoder holds no model: the model's __dict__ holds the decoder, whose reference back
    # made a cycle that only the garbage collector frees - after `del model` its weights, the kept
    # caches and their graphs stayed in (GPU) memory until a collection. (A graph reads the
    # parameters by address: it goes with the model, the only way to it.)
    decoder.model = None
    # Appended without the lock: a stream in a reference cycle is closed by the garbage collector,
    # which runs at whatever allocation comes next - under _LOCK too, in the thread holding it,
    # where waiting for it hung that thread and every later borrow. Settled now if the lock is
    # free, else by the next borrow (or release_decoders).
    kept.returned.append((key, (decoder, _steps_queued(decoder))))
    if _LOCK.acquire(blocking=False):
        try:
            kept.settle()
        finally:
            _LOCK.release()


def _steps_queued(decoder: StaticDecoder):
    """On CUDA, an event recorded after the steps queued on the stream they run on (the last
    one of a stream closed early may still run), for the next borrower to wait on; ``None`` off
    CUDA. Not the current stream: a stream in a reference cycle is closed by the garbage
    collector in whatever thread and CUDA stream context it runs - a capture's, where the event
    recorded into the graph failed the next borrower's wait (``cudaErrorCapturedEvent``)."""
    if not _static.cuda_graphs(decoder.device):
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(decoder.device) if decoder.stream is None else decoder.stream)
    return event


def release_decoders(model) -> int:
    """Free the static decoders that ``generate`` / ``stream`` keep for ``model`` (an
    ``AttnResLM``, compiled or not): their KV caches and CUDA graphs, GPU memory that
    ``torch.cuda.empty_cache()`` then returns. Returns how many were freed; one in use by a
    running stream is kept when that stream ends. Another object is a ``TypeError`` (a DDP or
    FSDP wrapper named with its ``.module``, which generated: it returned 0, freeing nothing)."""
    require_attnres_lm(model, "release_decoders")
    return _release(uncompiled(model))


def _release(owner) -> int:
    """:func:`release_decoders` of the module ``owner`` (uncompiled)."""
    with _LOCK:
        kept = vars(owner).get(_ATTRIBUTE)
        if not isinstance(kept, _KeptDecoders):
            return 0
        kept.settle()
        freed = len(kept.idle)
        kept.idle.clear()
    return freed
