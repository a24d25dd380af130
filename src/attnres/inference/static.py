"""Decoding over a :class:`StaticKVCache`: a step with static shapes and no host sync, run
eagerly, compiled (``torch.compile(fullgraph=True)``) or replayed as a CUDA graph.

A decode step of one token does little arithmetic, so on a GPU its time goes to launching
kernels from Python (the host), not to the kernels. A CUDA graph records the step's kernel
launches once and replays them with one call; that needs a step whose shapes and memory
addresses never change and that never waits for the GPU: the cache has a fixed capacity,
its fill level and each row's padding are tensors on the device, and the step validates
nothing (the prompt is validated once, before prefill).

>>> logits, cache = prefill(model, input_ids, attention_mask)   # eager, any prompt length
>>> decoder = StaticDecoder(model, batch_size=input_ids.shape[0], capacity=512, mode="graph")
>>> decoder.load(cache, attention_mask)
>>> new_tokens = decoder.decode(logits.argmax(-1), 32)         # [B, 32], greedy

The residual needs no cache (it mixes over depth, token by token), so the step is the
model's ordinary decoder pass on the new token; only self-attention reads the cache.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import Tensor

from ..models.lm import AttnResLM
from ..models.trunk import check_device
from ..nn.compiled import uncompiled
from ..nn.kv_cache import KVCache, StaticKVCache
from ..user_warning import warn_user
from ..validation import Int, did_you_mean

__all__ = ["STATIC_MODES", "StaticDecoder", "static_decode_step"]

#: How :class:`StaticDecoder` runs its step.
STATIC_MODES = ("eager", "compiled", "graph")
#: The token ids' dtypes that the embedding takes.
TOKEN_DTYPES = (torch.long, torch.int32)


def cuda_graphs(device: torch.device) -> bool:
    """Whether decoding on ``device`` runs CUDA graphs: ``mode="graph"`` captures one there,
    ``"compiled"`` compiles with ``mode="reduce-overhead"``, and ``decode="auto"`` picks
    ``"graph"``. One predicate for every such branch, so that the tests drive the graphed path
    on the CPU (the CUDA calls faked) - no GPU runs the test suite."""
    return device.type == "cuda"


def static_decode_step(model, cache: StaticKVCache, tokens: Tensor) -> Tensor:
    """One token per sequence, ``tokens [B]`` (int64), through ``model`` (an ``AttnResLM``)
    over ``cache``: the next-token logits ``[B, vocab]`` in float32. Validates nothing and reads nothing back to the host, so that it can be
    compiled with ``fullgraph=True`` or captured in a CUDA graph; ``cache`` advances by one."""
    h, _ = model.decode(tokens[:, None], None, cache)
    return model.lm_head(model.norm(h[:, -1])).float()


def check_native(model, what: str, call: str = "(model, input_ids, ...)") -> None:
    """Refuse a model other than an :class:`AttnResLM` (or one under ``torch.compile``): a
    transformers model's forward takes ``kv_cache`` into its ``**kwargs`` and ignores it, so
    every decode step saw its one new token without the prompt. ``call``: the arguments in
    their order, for the message when another argument stands where the model should."""
    if isinstance(model, (Tensor, KVCache, StaticKVCache)):  # (the arguments in another order failed in model.parameters())
        raise ValueError(f"{what} takes the model first, got a {type(model).__name__} there: call it as {call}")
    if not isinstance(uncompiled(model), AttnResLM):
        raise ValueError(f"{what} runs attnres's own model (an AttnResLM), got {type(model).__name__}: convert an "
                         "AttnResForCausalLM with .to_native(), or decode a transformers model with its own generate "
                         "or attnres.inference.stream_transformers")


def model_device(model) -> torch.device | None:
    """The device of ``model``'s first parameter (``None``: it has none)."""
    return next((p.device for p in model.parameters()), None)


def check_tokens(tokens: Tensor, name: str, device: torch.device | None) -> None:
    """Refuse token ids ``tokens`` of a dtype the embedding does not take (float ids,
    ``torch.tensor([[1., 2.]])``) or on a device other than ``device`` (:func:`check_device`)."""
    if tokens.dtype not in TOKEN_DTYPES:
        raise ValueError(f"{name} must be token ids of dtype torch.long or torch.int32, got {tokens.dtype}: "
                         f"use {name}.long()")
    check_device(tokens, name, device)


#: One CUDA graph capture at a time in the process: ``torch.cuda.graph`` captures on one side
#: stream shared by every thread (its ``default_capture_stream``), and a second thread's capture
#: began on that stream while the first captured - which the ``"thread_local"`` capture mode
#: (:meth:`StaticDecoder._record`) no longer stopped at its device sync - and failed, the first
#: capture with it. Held around the capture only: the warm-up runs on a stream of its own.
_CAPTURE_LOCK = threading.Lock()

#: One compiled step per ``torch.compile`` mode, shared by every decoder: Dynamo guards on
#: the model and the cache's shapes, so decoders of the same model and shapes reuse a graph.
_COMPILED: dict[str | None, object] = {}


def _compiled_step(mode: str | None):
    if mode not in _COMPILED:
        _COMPILED[mode] = torch.compile(static_decode_step, fullgraph=True, dynamic=False, mode=mode)
    return _COMPILED[mode]


class StaticDecoder:
    """Decoding at a fixed batch size and capacity over a :class:`StaticKVCache`.

    ``model``: an ``AttnResLM`` in eval mode, decoding in the dtype of its parameters (under
    ``torch.autocast``, autocast's, over a cache in the parameters' dtype; a graph captured
    under it casts the weights at each replay) (the Hugging Face model decodes through
    transformers' ``StaticCache`` instead).
    ``capacity``: the most positions the cache holds, prompt included (default: the model's
    ``max_seq_len``); every step attends over all of them (masked), so a tight capacity is
    faster. ``mode``:

    * ``"eager"``: the step runs operator by operator (any device);
    * ``"compiled"``: the step under ``torch.compile(fullgraph=True, dynamic=False)``, with
      ``mode="reduce-overhead"`` (Inductor's own CUDA graphs) on CUDA;
    * ``"graph"`` (CUDA only): the eager step captured in a ``torch.cuda.CUDAGraph`` at
      construction (after ``warmup`` >= 1 eager steps on a side stream) and replayed. Capture
      costs about ``warmup + 1`` steps, where compiling costs seconds to minutes, and it
      replays the very kernels the eager step runs; ``"compiled"`` may also fuse them.

    Use: ``load(cache, attention_mask)`` copies a prefilled :class:`KVCache` in, then
    ``step(tokens)`` returns the next logits (in ``"graph"`` mode a buffer that the next step
    overwrites), or ``decode(tokens, n)`` runs ``n`` greedy steps with no host sync.
    ``rewind(seq_len)`` forgets positions (benchmarks decode at a fixed context this way).
    ``stream``: on CUDA, the stream current at the last ``load``, which its steps run on.

    A captured graph reads the parameters at the addresses they had at capture: ``load``
    captures again when a parameter or buffer was replaced (``model.to(...)``) or the
    AttnRes folded queries were recomputed after an in-place update; in-place updates of
    other weights (``load_state_dict``) are seen as they are.
    """

    def __init__(self, model, batch_size: int, capacity: int | None = None, mode: str = "graph", warmup: int = 2) -> None:
        if mode not in STATIC_MODES:
            # (generate's decode="static" - the eager step over a static cache - is mode="eager" here)
            hint = " (generate's decode='static' is mode='eager' here)" if mode == "static" else did_you_mean(mode, STATIC_MODES)
            raise ValueError(f"mode must be one of {STATIC_MODES}, got {mode!r}{hint}")
        check_native(model, "StaticDecoder", "StaticDecoder(model, batch_size, capacity, ...)")
        self.model, self.mode, self.warmup = model, mode, warmup
        with torch.inference_mode(False):  # buffers updated in place, inside inference mode or not
            self.cache = StaticKVCache.for_model(model, batch_size, capacity)
            # (the graph's input, which each step copies its tokens into: built as an inference tensor, a
            # step outside that mode failed in "Inplace update to inference tensor outside InferenceMode")
            self._tokens = torch.zeros(batch_size, dtype=torch.long, device=self.cache.end.device)
        self.device = self.cache.end.device
        if mode == "graph" and not cuda_graphs(self.device):
            raise ValueError(f"mode='graph' captures a CUDA graph: the model is on {self.device}; use 'compiled' or 'eager'")
        if mode == "graph" and not Int(1).ok(warmup):  # (0: the first kernels compiled, workspaces allocated, in the capture)
            raise ValueError(f"StaticDecoder: warmup (the eager steps before a CUDA graph's capture) must be an integer "
                             f">= 1 for mode='graph', got {warmup!r}: a capture can neither compile kernels nor allocate "
                             "their first workspaces")
        self.length = 0  # filled positions, counted on the host (the device's cache.end is not read)
        self.stream = None  # (the CUDA stream of the steps since the last load: load)
        self._graph = self._logits = self._captured_with = None
        # (the compiled step, None for the eager one: not the bound self._run_compiled, a cycle through the
        # decoder that kept its cache in memory, after release_decoders or the last reference, until a collection)
        self._compiled = None
        if mode == "compiled":
            for t in (*self.cache.k, *self.cache.v, self.cache.end, self.cache.start, self.cache.slots):
                torch._dynamo.mark_static_address(t)  # buffers updated in place: CUDA graphs must keep them
            self._compiled = self._compiled_step()
        if mode == "graph":
            self._capture()

    @property
    def batch_size(self) -> int:
        """The rows its step decodes, fixed at construction."""
        return self.cache.batch_size

    @property
    def capacity(self) -> int:
        """The positions its static cache holds, prompt included."""
        return self.cache.capacity

    # -- filling and rewinding the cache ---------------------------------------------------
    def load(self, cache: KVCache, attention_mask: Tensor | None = None) -> None:
        """Take over a prefilled cache (``prefill(model, input_ids, attention_mask)``'s) and
        the prompt's left padding, ``attention_mask [B, T]`` (``None``: none)."""
        self._check_prefilled(cache)  # (before a stale graph is captured again)
        if self.mode == "graph" and self._stale():
            self._capture()
        self.cache.load_(cache, attention_mask)
        self.length = cache.seq_len
        # (the CUDA stream its steps run on, which a give-back records its event on: the current one where
        # the give-back runs - the garbage collector's thread, a capture's stream - was not theirs)
        self.stream = torch.cuda.current_stream(self.device) if cuda_graphs(self.device) else None
        if self.mode == "compiled":  # (past the recompile limit, a generation ran eagerly: this one tries again)
            self._compiled = self._compiled_step()

    def _check_prefilled(self, cache: KVCache) -> None:
        """Refuse a ``cache`` this decoder cannot take over: not a :class:`KVCache` (prefill's
        pair of logits and cache), or of another batch size or depth. The batch size is the
        decoder's for good (its buffers, compiled graph or CUDA graph are made for it), so a
        batch of another size needs a decoder of its own."""
        if not isinstance(cache, KVCache):
            got = "a tuple (prefill returns logits and the cache: logits, cache = prefill(...))" \
                if isinstance(cache, tuple) else f"a {type(cache).__name__}"
            raise TypeError(f"StaticDecoder.load takes the KVCache a prefill filled, got {got}")
        if cache.n_layers != self.cache.n_layers:
            raise ValueError(f"StaticDecoder.load: the cache holds {cache.n_layers} layers, this decoder's model "
                             f"{self.cache.n_layers}: it was prefilled by another model")
        rows = cache.keys(0).shape[0]
        if rows != self.batch_size:
            raise ValueError(f"StaticDecoder.load: the cache holds a batch of {rows} sequence{'s' * (rows != 1)}, and "
                             f"this decoder decodes {self.batch_size} (its batch_size, fixed when it was built: its "
                             f"buffers and graphs are made for it): build a StaticDecoder(model, batch_size={rows}, ...) "
                             f"for that batch (one per batch size), or prefill a batch of {self.batch_size}")

    def rewind(self, seq_len: int) -> None:
        """Forget the positions from ``seq_len`` on (``0 <= seq_len <=`` the filled length)."""
        if not 0 <= seq_len <= self.length:
            raise ValueError(f"seq_len must be in [0, {self.length}], got {seq_len}")
        self.cache.crop_(seq_len)
        self.length = seq_len

    # -- decoding -------------------------------------------------------------------------
    def step(self, tokens: Tensor) -> Tensor:
        """Feed ``tokens [B]``; return the next-token logits ``[B, vocab]`` (float32). Their
        shape, dtype and device are checked (comparisons on the host, about a microsecond: in
        ``"graph"`` mode one token would be copied to every row, and float tokens or tokens on
        another device copied over without a word); their values are not (that would read
        the device): ids in the vocabulary."""
        if tokens.shape != self._tokens.shape:
            raise ValueError(f"tokens must have shape [batch_size] = [{self.batch_size}] (one token per sequence), "
                             f"got {list(tokens.shape)}")
        if tokens.dtype not in TOKEN_DTYPES or tokens.device != self.device:
            check_tokens(tokens, "tokens", self.device)
        if self.length >= self.capacity:
            raise ValueError(f"the static cache is full ({self.capacity} positions): build the decoder with a larger "
                             "capacity")
        self.length += 1
        if self._graph is not None:
            self._tokens.copy_(tokens)
            self._graph.replay()
            return self._logits
        with torch.no_grad():
            if self.mode == "compiled" and cuda_graphs(self.device):
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs may be overwritten
            if self._compiled is None:
                return static_decode_step(self.model, self.cache, tokens)
            return self._run_compiled(self.model, self.cache, tokens)

    def _compiled_step(self):
        """The compiled step of this decoder's device (``mode="reduce-overhead"`` for CUDA graphs)."""
        return _compiled_step("reduce-overhead" if cuda_graphs(self.device) else None)

    def _run_compiled(self, model, cache: StaticKVCache, tokens: Tensor) -> Tensor:
        """The compiled step; past Dynamo's recompile limit (one graph per model class, dtype,
        batch size, capacity and grad mode, shared by every decoder: ``fullgraph=True`` makes
        the limit an error) this decoder runs the eager step instead, with a warning, until its
        next ``load`` tries the compiled step again (a kept decoder: the limit may have been raised)."""
        try:
            return self._compiled(model, cache, tokens)
        except torch._dynamo.exc.FailOnRecompileLimitHit:  # raised before the step runs: the cache is as it was
            warn_user("decode='compiled': torch.compile reached its recompile limit "
                      f"(torch._dynamo.config.recompile_limit={torch._dynamo.config.recompile_limit}) for the "
                      "decode step - one graph per model class, dtype, batch size, capacity and grad mode - so "
                      "this generation decodes eagerly; raise the limit, or use decode='static'",
                      RuntimeWarning)
            self._compiled = None
            return static_decode_step(model, cache, tokens)

    def decode(self, tokens: Tensor, n: int) -> Tensor:
        """``n`` greedy steps from ``tokens [B]`` (fed first); returns the ``n`` tokens chosen,
        ``[B, n]``. Nothing is read back to the host."""
        if not Int(1).ok(n):  # (n=0 ended in torch.stack's "stack expects a non-empty TensorList")
            raise ValueError(f"StaticDecoder.decode: n (the steps to decode) must be an integer >= 1, got {n!r}")
        if self.length + n > self.capacity:  # (step's own refusal came after the steps that fit: their tokens lost)
            room = self.capacity - self.length
            fits = f"decode at most {room} step{'s' * (room != 1)}, " if room else ""
            raise ValueError(f"StaticDecoder.decode: {n} steps from {self.length} positions need {self.length + n}, "
                             f"beyond the decoder's capacity of {self.capacity}: {fits}rewind it, or build it with "
                             f"capacity >= {self.length + n}")
        out = []
        for _ in range(n):
            tokens = self.step(tokens).argmax(dim=-1)
            out.append(tokens)
        return torch.stack(out, dim=1)

    # -- CUDA graph capture -----------------------------------------------------------------
    def _weights(self) -> tuple:
        """What a captured graph reads beyond the cache: the model's parameters and buffers
        (their addresses) and the AttnRes folded queries that the eager step reuses (the
        tensor itself, held so that its memory stays the graph's)."""
        addresses = tuple(t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers()))
        folded = getattr(self.model.residual, "folded_queries", None)
        if folded is None:
            return addresses, None
        # (outside inference mode: a model whose parameters are inference tensors keeps no queries, and
        # those stacked under the mode would be an inference tensor, which _refold's in-place copy outside
        # it refuses - "Inplace update to inference tensor outside InferenceMode")
        with torch.inference_mode(False), torch.no_grad():
            return addresses, folded(self.model.embed_tokens.weight.dtype)

    def _stale(self) -> bool:
        """Whether the captured graph reads parameters that are no longer the model's. New
        folded queries of the same parameters (an in-place update: an optimiser step) are
        copied into the ones the graph reads instead (:meth:`_refold`)."""
        addresses, folded = self._weights()
        if self._captured_with is None or addresses != self._captured_with[0]:
            return True
        return not self._refold(folded)

    def _refold(self, folded: Tensor | None) -> bool:
        """Bring the folded queries the graph reads up to ``folded`` (the residual's now) in
        place; ``False`` where they cannot be (a capture is needed). The residual keeps them
        until a query changes or any optimiser in the process takes a step (a fused step bumps
        no version counter: attnres_base's ``_optimizer_steps``), so another model trained in
        the same process (a distilled student, a reward model) gave new ones at each
        generate, and a capture each time; their values are what matters, at the same address."""
        captured = self._captured_with[1]
        if folded is captured:
            return True
        if folded is None or captured is None or folded.shape != captured.shape or folded.dtype != captured.dtype \
                or folded.device != captured.device:
            return False
        with torch.no_grad():
            captured.copy_(folded)
        return True

    def _capture(self) -> None:
        """Warm up (kernels compiled, workspaces allocated) on a side stream, each step on the
        empty cache, then record one step into a CUDA graph; the cache is left empty. On the model's device made
        current: ``torch.cuda.graph`` captures a stream of the current device, which the
        step's operations on another device (a model on ``cuda:1``) would not run on. Under
        ``torch.autocast`` without autocast's cache of cast weights (:func:`_uncached_autocast`)."""
        with torch.cuda.device(self.device), _uncached_autocast(self.device.type):
            self._record()

    def _record(self) -> None:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(self.warmup):
                # (each at slot 0: a decoder captured again by load wrote on from its last length, and steps
                # past a capacity smaller than warmup wrote past its end - on CUDA a device-side assert)
                self.cache.crop_(0)
                static_decode_step(self.model, self.cache, self._tokens)
        current.wait_stream(side)
        self.cache.crop_(0)
        # (what the capture reads, taken before it: taken after, an optimizer step in another thread between
        # the two gave new folded queries - the graph's own, then referenced by nothing, were freed under it)
        weights = self._weights()
        graph = torch.cuda.CUDAGraph()
        # ("thread_local": the capture refuses what this thread does that a graph cannot hold; the
        # default, "global", refused it in every thread - another thread's generate, whose host sync per
        # token or allocation then failed, and broke this capture - and generate keeps a decoder per thread)
        with _CAPTURE_LOCK, torch.no_grad(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = static_decode_step(self.model, self.cache, self._tokens)
        self._graph, self._logits = graph, logits
        self._captured_with = weights
        if self._weights()[1] is not weights[1]:
            self._drop_folded_made_in_capture()
        # (capture records the kernels without running them: the cache is still empty)
        self.length = 0

    def _drop_folded_made_in_capture(self) -> None:
        """The residual's kept folded queries are not those taken before the capture: an
        optimizer step in another thread during it made the capture build them (the graph
        builds its own at each replay), and the residual kept them - on a GPU never computed
        outside a replay, so the model's next eager forward read whatever that memory held.
        ``train()`` in the residual's own mode drops them (built again at the next forward)."""
        residual = self.model.residual
        residual.train(residual.training)


def _uncached_autocast(device_type: str):
    """Autocast as it is, without its cache of cast weights, while a graph is captured under
    it: a capture reading that cache records no cast, only the cached copies' addresses -
    copies that autocast frees when its block ends, so a graph kept for a later call
    (``generate`` keeps them) read freed memory there, and on the CPU's fake graphs the weights
    of the capture's time (an in-place update of a weight was not seen). Without the cache
    the graph casts the weights at each replay, as ``torch.cuda.make_graphed_callables``
    requires (``cache_enabled=False``)."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)
