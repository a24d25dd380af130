"""The residual-stream protocol every variant implements.

The transformer loop talks to a :class:`ResidualStream` through four calls and never learns
which variant it runs::

    state = residual.start(embedding)
    for l, sublayer in enumerate(sublayers):          # L = 2 * n_layers sublayers
        out = sublayer(residual.sublayer_input(state, l))
        residual.add_output(state, l, out)
    h = residual.finish(state)                        # then final norm and LM head

Code that cuts the loop somewhere (a pipeline stage, sequence-sharded prefill, a traffic
count) uses two more public calls instead of the state's fields:

* ``residual.history(state)`` -> :class:`DepthHistory`: the completed depth sources and the
  running tensor in front of the next sublayer, in the layout ``history_layout`` describes;
* ``residual.resume(history, at_sublayer)`` -> a state that continues from there.

A variant also describes itself without running: ``sources_per_mixer()``,
``history_layout(sublayer)`` and ``residual_flops_per_token()``; the config, the FLOP count,
the pipeline and the communication accounting read them from it.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from ...validation import Int, did_you_mean_each
from ..driven import DrivenModule
from .config import ResidualConfig
from .kinds import refuse_other_kind
from .mixing import MixingMatrix

__all__ = ["ResidualState", "DepthHistory", "HistoryLayout", "ResidualStream", "PHASES"]

#: Values of :attr:`ResidualState.phase`.
PHASES = ("phase1", "phase2", "aggregation")


@dataclass
class ResidualState:
    """Per-forward bookkeeping shared by all variants; each variant subclasses it with its
    own typed fields.

    dtype: the residual stream's dtype (the embedding's); outputs are cast to it.
    device: the residual stream's device, where every sublayer output must be.
    shape: the embedding's shape, which every sublayer output must have (in a resumed state
        the history's, ``None`` where its tensors differ: there only ``d`` is checked).
    next_sublayer: the sublayer whose input comes next (``L`` once all outputs are in).
    expecting_output: ``sublayer_input`` was called and ``add_output`` has not been yet.
    weights: when recording, the depth weights of every mixer so far, ``[n_sources, ...]``.
    defer_norm: the caller feeds every sublayer input to an :class:`attnres.nn.RMSNorm`, so
        a fused kernel may return a :class:`~attnres.nn.norm.FusableNormInput` whose norm
        it computes itself.
    phase: which part of the schedule runs now - ``"phase1"``, ``"phase2"`` or
        ``"aggregation"`` (report §4.2); read by the memory-traffic count.
    record_mixing: the forward was started (not resumed) with ``record_weights=True``, so
        variants keep what :meth:`ResidualStream.mixing_matrix` needs in ``mixing_log``
        (Highway its gates, the multi-stream variants their maps); nothing is kept otherwise.
    mixing_log: what a variant kept for its mixing matrix, one entry per sublayer.
    finished: ``finish`` has run.
    owner: ``id`` of the residual module whose ``start`` or ``resume`` began it: a state serves
        that module's calls only.
    """

    dtype: Any
    device: torch.device | None = None
    shape: tuple[int, ...] | None = None
    next_sublayer: int = 0
    expecting_output: bool = False
    weights: list[Tensor] | None = None
    defer_norm: bool = False
    phase: str = "phase2"
    record_mixing: bool = False
    mixing_log: list[Any] = field(default_factory=list)
    finished: bool = False
    owner: int | None = None

    def record(self, weights: Tensor, sources_last: bool = True) -> None:
        """Store one mixer's weights as ``[n_sources, ...]`` (given ``[..., n]``, or
        ``[n, ...]`` with ``sources_last=False``) when recording."""
        if self.weights is not None:
            self.weights.append(weights.movedim(-1, 0) if sources_last else weights)


class DepthHistory(NamedTuple):
    """The residual stream in front of a sublayer, as tensors ``[..., d]``.

    completed: the history depth attention attends over - Block AttnRes the embedding and
        the completed block sums ``b_0 .. b_{n-1}``, Full AttnRes ``v_0 .. v_l``; empty for
        single-stream variants.
    running: the tensor that is still changing - Block AttnRes' partial sum inside a block,
        the standard residual's hidden state - or ``None``.
    """

    completed: list[Tensor]
    running: Tensor | None


class HistoryLayout(NamedTuple):
    """How many completed entries, and whether a running tensor, a :class:`DepthHistory`
    holds in front of a sublayer."""

    completed: int
    running: bool


def _option_spellings(name: str) -> str:
    """How the commands set residual option ``name``: ``attnres train``'s override and
    ``attnres upcycle``'s flag (an error under upcycle named train's spelling only)."""
    return f"model.residual.options.{name}=VALUE (attnres train), --residual-option {name}=VALUE (attnres upcycle)"


def _one_shape(history: DepthHistory) -> tuple[int, ...] | None:
    """The shape every tensor of ``history`` has, which each later output must have; ``None``
    where they differ (then only ``d`` is checked). A resumed state checked ``d`` alone: an
    output ``[1, T, d]`` of a stream ``[B, T, d]`` broadcast into Block AttnRes' partial sum,
    silently."""
    tensors = [*history.completed, *([] if history.running is None else [history.running])]
    if not tensors:
        return None
    # (compared, not hashed into a set: under torch.compile with dynamic shapes - vLLM's - hashing a
    # symbolic size made it a constant, and the compile failed, "marked as dynamic but your code
    # specialized it to be a constant")
    first = tuple(tensors[0].shape)
    return first if all(tuple(t.shape) == first for t in tensors[1:]) else None


class ResidualStream(DrivenModule, ABC):
    """How the outputs of ``n_sublayers`` sublayers are combined into their inputs.

    Call order per forward: ``start`` (or ``resume``), then for each sublayer ``l``
    ``sublayer_input(state, l)`` followed by ``add_output(state, l, out)``, then ``finish``.
    Tensors are ``[..., d]`` (``[B, T, d]`` in the model); sublayer outputs are cast to the
    embedding's dtype, so the residual stream keeps the embedding's precision under autocast.

    Subclasses implement ``_start``, ``_input``, ``_add``, ``_finish`` on their own state
    type (built with the ``common`` fields ``_start`` and ``_resume`` are given:
    ``MyState(h=embedding, **common)``), and optionally ``_history``/``_resume`` (for pipelines), and register with
    :func:`attnres.register_residual`.

    The stream is never called as a module: a hook on it warns that it never runs.
    """

    hook_instead = ("the depth weights come from AttnResLM's return_depth_weights=True (or start(x, "
                    "record_weights=True): state.weights), the sublayers' inputs and outputs from hooks on the "
                    "sublayers' modules")
    name: ClassVar[str] = ""
    #: Whether the variant computes depth-attention weights (``record_weights`` is ignored otherwise).
    has_depth_attention: ClassVar[bool] = False
    #: Whether a pretrained model upcycled with the variant (:func:`attnres.upcycle`) computes the
    #: pretrained function at conversion, up to rounding: ``True``, ``False`` (it starts from its
    #: own init, and its text differs until fine-tuned), ``None`` where the class does not say.
    upcycles_exactly: ClassVar[bool | None] = None
    #: The fields of :data:`~attnres.nn.residual.config.VARIANT_FIELDS` the variant builds from
    #: (Block AttnRes ``{"block_size"}``; a subclass inherits its parent's): a resume or an
    #: ``init_from`` at another value of one is another model, said as such; one it does not
    #: name is not compared.
    reads_fields: ClassVar[frozenset[str]] = frozenset()
    #: ``ResidualConfig.autocast_stream`` (set by :func:`attnres.nn.residual.build_residual`):
    #: under autocast, ``start`` and ``resume`` store the stream in the autocast dtype.
    autocast_stream: bool = False

    def __init__(self, dim: int, n_sublayers: int) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("n_sublayers", n_sublayers)):
            if not Int(1).ok(value):
                raise ValueError(f"{type(self).__name__}: {name} must be an integer >= 1, got {value!r}")
        self.dim = dim
        self.n_sublayers = n_sublayers

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_sublayers={self.n_sublayers}"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Not a layer: a model drives the stream through :meth:`start`, :meth:`sublayer_input`,
        :meth:`add_output` and :meth:`finish` (nn.Module's own error said only that
        ``forward`` was missing)."""
        raise TypeError(f"{type(self).__name__} is not called like a layer: drive it from your model's forward - "
                        "state = residual.start(x); then for each sublayer l: h = residual.sublayer_input(state, l); "
                        "residual.add_output(state, l, sublayer(h)); finally residual.finish(state) (README 'AttnRes "
                        "in your own PyTorch model')")

    def _label(self) -> str:
        """This residual in messages: its registered name, or its class (a class not registered
        has the name '', which read "residual ''")."""
        return repr(self.name) if self.name else f"{type(self).__qualname__} (not registered)"

    # -- construction from a config ------------------------------------------------------
    @classmethod
    def from_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> ResidualStream:
        """The module described by ``config`` (``ModelConfig.residual``); by default
        ``cls(dim, n_sublayers, **config.options)``, for a config of this variant's kind only
        (each built-in variant's refuses another kind: a user's variant built from an
        ``attnres_block`` config was built, its options read as its own)."""
        refuse_other_kind(cls, config)
        try:
            return cls(dim, n_sublayers, **config.options)
        except (TypeError, ValueError) as e:
            if not config.options:
                raise
            # (a value __init__ cannot take, e.g. options.init=abc, was a traceback ending in torch.full)
            raise ValueError(f"ModelConfig.residual.options {config.options!r}: {cls.__qualname__}.__init__ of residual "
                             f"{config.kind!r} refused them ({type(e).__name__}: {e}); set values it takes, e.g. "
                             f"{_option_spellings(next(iter(config.options)))}") from e

    @classmethod
    def check_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> None:
        """Raise ``ValueError`` naming the field if this variant cannot take ``config``. By
        default: no Table-4 ablation, and ``options`` must be keyword arguments of ``__init__``
        (and set those without a default, when the default ``from_config`` builds it)."""
        if config.ablation.active:
            raise ValueError(f"ModelConfig.residual.ablation applies to AttnRes variants; residual {config.kind!r} "
                             "takes none")
        cls._check_options(config)

    @classmethod
    def _check_options(cls, config: ResidualConfig) -> None:
        """``options`` as keyword arguments of ``__init__`` (those without a default set, when
        the default ``from_config`` builds it). Names it does not take are refused first: a
        misspelt required one (``gama``) was answered that ``gamma`` must be set."""
        params = list(inspect.signature(cls.__init__).parameters.values())[3:]  # after self, dim, n_sublayers
        accepted = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = sorted(set(config.options) - accepted)
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in params):
            raise ValueError(f"ModelConfig.residual.options {unknown} are not options of residual {config.kind!r}"
                             f"{did_you_mean_each(unknown, accepted)}; it takes {sorted(accepted) or 'none'}")
        required = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                    and p.name not in config.options]
        if required and cls.from_config.__func__ is ResidualStream.from_config.__func__:
            # the default from_config passes only options: else a TypeError from __init__ at build time
            raise ValueError(f"ModelConfig.residual.options must set {required} for residual {config.kind!r} (arguments "
                             f"of {cls.__qualname__}.__init__ without a default): e.g. "
                             f"{_option_spellings(required[0])}, or give them defaults")

    @classmethod
    def describe(cls, config: ResidualConfig, n_sublayers: int) -> str:
        """``config`` in a few words for logs: the name, and the options that are set."""
        options = ", ".join(f"{k}={v!r}" for k, v in config.options.items())
        return f"{cls.name} ({options})" if options else cls.name

    @classmethod
    def _no_options(cls, config: ResidualConfig) -> None:
        if config.options:
            raise ValueError(f"ModelConfig.residual.options must be empty for residual {config.kind!r} (its settings "
                             f"are fields of ModelConfig.residual); got {config.options!r}")

    # -- the protocol --------------------------------------------------------------------
    def start(self, embedding: Tensor, record_weights: bool = False, defer_norm: bool = False) -> ResidualState:
        """Begin a forward pass from the token embedding ``[..., d]``. ``record_weights``:
        keep every mixer's depth weights in ``state.weights``. ``defer_norm``: the caller
        passes each sublayer input through an :class:`attnres.nn.RMSNorm` first (see
        :class:`ResidualState`)."""
        self._check_stream_tensor("start", "the embedding", embedding)
        embedding = self._stored(embedding)
        common = self._common(embedding, record_weights, defer_norm)
        state = self._start(embedding, dict(common, shape=tuple(embedding.shape), record_mixing=record_weights))
        return self._checked_state(state, common, "_start(embedding, common)")

    def _checked_state(self, state: Any, common: dict[str, Any], method: str) -> ResidualState:
        """``state`` as a variant's ``_start``/``_resume`` returned it, which must carry ``common``
        (a user's variant that left it out failed at the first add_output, "the stream is on None")."""
        if not isinstance(state, ResidualState) or state.device != common["device"]:
            got = type(state).__name__ if not isinstance(state, ResidualState) else f"one with device={state.device}"
            raise TypeError(f"residual {self._label()}: {type(self).__qualname__}.{method} must return a ResidualState "
                            f"built with the fields it is given, e.g. MyState(h=embedding, **common); got {got}")
        return state

    def _check_stream_tensor(self, call: str, what: str, x: Any) -> None:
        """``x`` (the embedding, an entry of a history) as the stream's: a floating-point tensor
        ``[..., dim]`` on the device of this module's parameters, a meta ``x`` (a shape query)
        too: most kinds failed inside on the device mismatch of some operation."""
        where = f"{type(self).__name__}.{call}: {what}"
        if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[-1] != self.dim:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{where} must have shape [..., {self.dim}] (this residual's dim), got {got}")
        if not x.is_floating_point():  # (an integer stream truncated every sublayer output)
            raise ValueError(f"{where} must be a floating-point tensor (it sets the stream's dtype), got {x.dtype}: "
                             "pass it as float32, bfloat16, float16 or float64")
        param = next(self.parameters(), None)
        if param is not None and param.device != x.device:
            if x.device.type == "meta":
                raise ValueError(f"{where} is on meta but the parameters of residual {self.name!r} are on "
                                 f"{param.device}; a shape query runs on a copy there, "
                                 "copy.deepcopy(residual).to('meta'), or on a model built under torch.device('meta')")
            fix = ("materialise them: residual.to_empty(device=...) then residual.reset_parameters()"
                   if param.device.type == "meta" else f"move one to the other's device (residual.to({str(x.device)!r}))")
            raise ValueError(f"{where} is on {x.device} but this residual's parameters are on {param.device}; {fix}")
        if param is not None and type(param) is not nn.Parameter:
            self._refuse_sharded(where, param, x)
        if "_materialised" in self.__dict__:  # (one lookup a forward: set by to_empty, gone once each is written)
            self._refuse_unwritten(f"{type(self).__name__}.{call}")

    def _apply(self, fn, recurse: bool = True):
        # `to_empty(device=...)` of a residual built on meta gives its parameters uninitialised memory (queries
        # of ~1e24 or NaN, a NaN output without a word) until reset_parameters() or a load writes them: each
        # one's version and storage as materialised are kept, and the first forward refuses while one is
        # unchanged (_refuse_unwritten). (A parameter written through `.data` bumps no version: refused too.)
        was_meta = any(p.is_meta for p in self.parameters())
        out = super()._apply(fn, recurse)
        if was_meta and not any(p.is_meta for p in self.parameters()):
            self._materialised = {name: (p._version, p.data_ptr()) for name, p in self.named_parameters()
                                  if type(p) is nn.Parameter and not p.is_inference()}  # (which track no version)
        return out

    def _refuse_unwritten(self, where: str) -> None:
        """``ValueError`` where a parameter still holds what ``to_empty`` left (:meth:`_apply`);
        else the record goes, and no later forward looks."""
        marks = self._materialised
        unwritten = [name for name, p in self.named_parameters()
                     if type(p) is nn.Parameter and name in marks and not p.is_inference()
                     and marks[name] == (p._version, p.data_ptr())]
        if unwritten:
            raise ValueError(f"{where}: parameter(s) {unwritten[:3]} of residual {self._label()} hold the uninitialised "
                             "memory to_empty() left (pseudo-queries of ~1e24 or NaN: a NaN output); initialise them "
                             "after to_empty with residual.reset_parameters() (the report's init: zero queries, unit "
                             "key-norm gains; AttnResLM.init_weights() for the whole model), or load weights into them "
                             "(load_state_dict, or in place under torch.no_grad(): a write through .data is not seen)")
        del self._materialised

    def _refuse_sharded(self, where: str, param: Tensor, x: Tensor) -> None:
        """``ValueError`` where ``param`` is a DTensor and ``x`` a plain tensor: FSDP2 applied to
        the residual itself (``fully_shard(model.residual)``, as a loop over every module does)
        gathers its parameters when it is called, and the residual is never called; the forward
        failed deep in the depth attention ("aten.mm.default got mixed torch.Tensor and DTensor")."""
        if not torch.distributed.is_available():  # (a build without it has no DTensor; a fake tensor passes)
            return
        from torch.distributed.tensor import DTensor  # (only for a parameter that is a tensor subclass)

        if isinstance(param, DTensor) and not isinstance(x, DTensor):
            raise ValueError(f"{where} is a plain tensor but the parameters of residual {self._label()} are sharded "
                             f"DTensors ({param.placements}), as fully_shard(residual) leaves them: FSDP2 gathers a "
                             "module's parameters when the module is called, and the residual is driven through "
                             "start/sublayer_input/add_output/finish, never called. Leave it out of fully_shard and "
                             "shard the module whose forward drives it (fully_shard(model): the residual's parameters "
                             "join the root's unit)")

    def _stored(self, x: Tensor) -> Tensor:
        """``x`` in the stream's storage dtype: the autocast dtype where ``autocast_stream``
        is set and autocast is on for ``x``'s device (half a float32 stream's bytes), else
        ``x`` as it is (under autocast, the embedding's float32)."""
        # (meta tensors - shape and FLOP counts - have no autocast state to ask)
        if not self.autocast_stream or x.device.type == "meta" or not torch.is_autocast_enabled(x.device.type):
            return x
        dtype = torch.get_autocast_dtype(x.device.type)
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x

    def _common(self, ref: Tensor, record_weights: bool, defer_norm: bool) -> dict[str, Any]:
        record = record_weights and self.has_depth_attention
        return {"dtype": ref.dtype, "device": ref.device, "weights": [] if record else None, "defer_norm": defer_norm,
                "owner": id(self)}

    def _check_state(self, state: Any, call: str) -> None:
        """``state`` as this module's :meth:`start` or :meth:`resume` returned it. The hidden
        state given for it (``sublayer_input(h, l)``) failed in "'Tensor' object has no attribute
        'next_sublayer'"; another residual module's state (a model with two) ran on with that
        module's sources and queries, silently where both are of one class."""
        if not isinstance(state, ResidualState):
            raise TypeError(f"{type(self).__name__}.{call}: state must be what residual.start(x) returned (a "
                            f"ResidualState), got {type(state).__name__}: state = residual.start(x) begins a forward, "
                            "then h = residual.sublayer_input(state, l) and residual.add_output(state, l, sublayer(h))")
        if state.owner is not None and state.owner != id(self):
            raise ValueError(f"{type(self).__name__}.{call}: this state was begun by another residual module "
                             f"({type(state).__name__}); each residual module drives the states its own start(x) "
                             "begins (a model with two residuals keeps one state for each)")

    def sublayer_input(self, state: ResidualState, l: int):
        """The input ``h_l`` of sublayer ``l`` (0-based), ``[..., d]``: a tensor, or with
        ``state.defer_norm`` possibly a :class:`~attnres.nn.norm.FusableNormInput` that the
        sublayer's RMSNorm turns into ``norm(h_l)`` in one fused kernel."""
        self._check_state(state, "sublayer_input(state, l)")
        if l != state.next_sublayer or state.expecting_output or l >= self.n_sublayers:
            self._refuse_finished(state, f"sublayer_input({l})")
            if l == state.next_sublayer and not state.expecting_output:  # (one past the last: it read the output
                # aggregation's query as its own, and one more failed with an IndexError deep inside)
                raise RuntimeError(f"sublayer_input({l}): this {type(self).__name__} was built for n_sublayers="
                                   f"{self.n_sublayers} (sublayers 0..{self.n_sublayers - 1}); build it with the "
                                   "number of sublayers your model has")
            raise RuntimeError(
                f"sublayer_input({l}) called out of order: expected sublayer {state.next_sublayer}"
                + (" to return its output first" if state.expecting_output else "")
            )
        state.expecting_output = True
        return self._input(state, l)

    @staticmethod
    def _refuse_finished(state: ResidualState, call: str) -> None:
        """A state kept from the last forward, or calls an activation checkpoint's recompute repeats
        in the backward: both said "out of order: expected sublayer L"."""
        if state.finished:
            raise RuntimeError(f"{call}: this state's forward has ended (finish() ran); a state serves one forward: "
                               "begin each with state = residual.start(x), and checkpoint a sublayer alone "
                               "(checkpoint(sublayer, h)): a recompute repeats the residual calls inside it")

    def add_output(self, state: ResidualState, l: int, output: Tensor) -> None:
        """Record the raw output ``v_{l+1} = f_l(h_l)`` of sublayer ``l``: ``[..., d]``, the
        embedding's shape (after ``resume``, the history's) on its device; cast to the stream's
        dtype."""
        self._check_state(state, "add_output(state, l, output)")
        if l != state.next_sublayer or not state.expecting_output:
            self._refuse_finished(state, f"add_output({l})")
            if l == state.next_sublayer:  # ("called out of order: expected sublayer l" named the l it was given)
                raise RuntimeError(f"add_output({l}) called before sublayer_input({l}): first h = "
                                   f"residual.sublayer_input(state, {l}), then add_output(state, {l}, sublayer(h))")
            raise RuntimeError(f"add_output({l}) called out of order: expected sublayer {state.next_sublayer}")
        # (a wrong shape would broadcast into a sum, or reach a kernel that trusts its sizes)
        fits = isinstance(output, Tensor) and (tuple(output.shape) == state.shape if state.shape is not None
                                               else output.dim() >= 1 and output.shape[-1] == self.dim)
        if not fits:
            got = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
            want = list(state.shape) if state.shape is not None else f"[..., {self.dim}]"
            raise ValueError(f"add_output({l}): sublayer {l}'s output must have the stream's shape {want} (the "
                             f"embedding's), got {got}")
        if output.device != state.device:  # (was refused inside a merge, naming its internal arguments)
            raise ValueError(f"add_output({l}): sublayer {l}'s output is on {output.device} but the stream is on "
                             f"{state.device} (the embedding's): move it there, output.to({str(state.device)!r})")
        state.expecting_output = False
        state.next_sublayer += 1
        if output.dtype != state.dtype and not self._reads_output_as_is(state, output):
            output = output.to(state.dtype)
        self._add(state, l, output)

    def finish(self, state: ResidualState) -> Tensor:
        """The final hidden state (before the final norm), ``[..., d]``."""
        self._check_state(state, "finish(state)")
        if state.finished:
            raise RuntimeError("finish() called twice: start a new forward with start()")
        if state.next_sublayer != self.n_sublayers or state.expecting_output:
            # (a residual built for more sublayers than the model runs - n_layers given for n_sublayers - was told
            # only the count)
            raise RuntimeError(f"finish() called after {state.next_sublayer} of the {self.n_sublayers} sublayers this "
                               f"{type(self).__name__} was built for (n_sublayers={self.n_sublayers}): run them all, or "
                               "build it with the number of sublayers your model has (2 per transformer block)")
        state.phase = "aggregation"
        out = self._finish(state)
        state.finished = True
        return out

    def history(self, state: ResidualState) -> DepthHistory:
        """The stream in front of sublayer ``state.next_sublayer`` as tensors, in the layout
        of :meth:`history_layout` (after ``finish``: every source as completed)."""
        self._check_state(state, "history(state)")
        if state.expecting_output:
            raise RuntimeError(f"history() called between sublayer_input({state.next_sublayer}) and its add_output")
        return self._history(state)

    def resume(self, history: DepthHistory, at_sublayer: int, record_weights: bool = False,
               defer_norm: bool = False) -> ResidualState:
        """A state in front of sublayer ``at_sublayer`` rebuilt from ``history`` (what
        :meth:`history` returned there, possibly on another process)."""
        if not Int(0, self.n_sublayers).ok(at_sublayer):
            raise ValueError(f"at_sublayer must be an integer in [0, {self.n_sublayers}], got {at_sublayer!r}")
        if not isinstance(history, DepthHistory):  # (a plain (completed, running) pair: an AttributeError)
            if not isinstance(history, (tuple, list)) or len(history) != 2:
                raise ValueError("history must be a DepthHistory(completed, running) (what history() returns) or a "
                                 f"(completed, running) pair, got {type(history).__name__}")
            history = DepthHistory(list(history[0]), history[1])
        expected = self.history_layout(at_sublayer)
        got = HistoryLayout(len(history.completed), history.running is not None)
        if got != expected:
            raise ValueError(f"a {self._label()} history in front of sublayer {at_sublayer} holds {expected.completed} "
                             f"completed entries{' and a running tensor' if expected.running else ''}; got "
                             f"{got.completed}{' and a running tensor' if got.running else ''}")
        for i, entry in enumerate([*history.completed, *([] if history.running is None else [history.running])]):
            self._check_stream_tensor("resume", f"history.completed[{i}]" if i < len(history.completed)
                                      else "history.running", entry)
        if self.autocast_stream:  # (a pipeline sends the stream up-cast: float32 on the wire)
            history = DepthHistory([self._stored(t) for t in history.completed],
                                   None if history.running is None else self._stored(history.running))
        ref = history.running if history.running is not None else history.completed[0]
        common = self._common(ref, record_weights, defer_norm)
        state = self._checked_state(self._resume(history, at_sublayer, common), common,
                                    "_resume(history, at_sublayer, common)")
        state.next_sublayer = at_sublayer
        state.shape = _one_shape(history)
        return state

    # -- what a variant describes --------------------------------------------------------
    def sources_per_mixer(self) -> list[int]:
        """Number of depth sources each sublayer (then the output aggregation) attends over;
        empty for variants without depth attention."""
        return []

    @classmethod
    def builtin(cls) -> bool:
        """Whether this is one of attnres's own variants (not a user's registered one)."""
        return cls.__module__.split(".")[0] == "attnres"

    def history_layout(self, sublayer: int) -> HistoryLayout:
        """The :class:`HistoryLayout` in front of ``sublayer`` (``L``: after the last one).
        Variants that cannot be cut (and so not pipelined) raise ``ValueError``."""
        own = "" if self.builtin() else (
            " (to cut it, define history_layout(sublayer), _history(state) and _resume(history, at_sublayer, common): "
            "docs/design.md, 'The registry, and how to add a variant')")
        raise ValueError(f"residual {self._label()} does not describe its history between sublayers, so it cannot be "
                         f"cut into pipeline stages{own}")

    def residual_flops_per_token(self) -> float:
        """Forward FLOPs per token of the residual mechanism alone (a multiply-add is 2), as
        ``attnres.experiments.flops`` counts them. Variants registered without it raise."""
        raise NotImplementedError(f"residual {self._label()} does not count its FLOPs: define residual_flops_per_token()")

    def reset_parameters(self) -> None:
        """Re-initialise this module's own parameters (none for the standard residual)."""

    def mixing_matrix(self, state: ResidualState, per_channel: bool = False) -> MixingMatrix:
        """The depth mixing matrix ``M`` of the forward ``state`` ran (report §6.2, Fig. 9), a
        :class:`~attnres.nn.residual.mixing.MixingMatrix`: ``M[..., r, i]`` is the weight of
        source ``v_i`` (``v_0`` the embedding, ``v_i`` the raw output of sublayer ``i``) in
        the input of sublayer ``r + 1``, row ``L`` the output aggregation, so that every
        sublayer input and the final hidden state are ``sum_i M[..., r, i] v_i``, token by
        token. ``state`` must come from ``start(..., record_weights=True)`` (not ``resume``)
        and have run every sublayer and ``finish``. ``per_channel``: variants that weight
        channel by channel (Highway, LayerScale) also fill ``MixingMatrix.per_channel``.
        Variants registered without ``_mixing_matrix`` raise ``NotImplementedError``."""
        self._check_state(state, "mixing_matrix(state)")
        if type(self)._mixing_matrix is ResidualStream._mixing_matrix:
            ResidualStream._mixing_matrix(self, state)  # raises, naming the variant and the missing method
        if not state.record_mixing or not state.finished:
            raise RuntimeError(f"mixing_matrix() of residual {self._label()} needs the state of a forward started with "
                               "start(..., record_weights=True) (not resume) that ran every sublayer and finish(); got "
                               + ("one that recorded nothing" if not state.record_mixing else
                                  f"one stopped after {state.next_sublayer} of {self.n_sublayers} sublayers"
                                  + ("" if state.next_sublayer < self.n_sublayers else " before finish()")))
        return self._mixing_matrix(state, per_channel)

    # -- what each variant implements ----------------------------------------------------
    @abstractmethod
    def _start(self, embedding: Tensor, common: dict[str, Any]) -> ResidualState: ...

    @abstractmethod
    def _input(self, state: ResidualState, l: int): ...

    @abstractmethod
    def _add(self, state: ResidualState, l: int, output: Tensor) -> None: ...

    def _reads_output_as_is(self, state: ResidualState, output: Tensor) -> bool:
        """Whether ``_add`` takes ``output`` in its own dtype (one that promotes to the
        stream's: an autocast sublayer's bf16), adding it in the stream's dtype itself -
        otherwise it is cast to the stream's dtype first (a pass over it, which a consumer
        that reads it once anyway can spare)."""
        return False

    @abstractmethod
    def _finish(self, state: ResidualState) -> Tensor: ...

    def _history(self, state: ResidualState) -> DepthHistory:
        self.history_layout(state.next_sublayer)  # raises for variants that cannot be cut
        raise NotImplementedError(f"residual {self._label()} describes a history layout but does not implement _history")

    def _resume(self, history: DepthHistory, at_sublayer: int, common: dict[str, Any]) -> ResidualState:
        raise NotImplementedError(f"residual {self._label()} describes a history layout but does not implement _resume")

    def _mixing_matrix(self, state: ResidualState, per_channel: bool = False) -> MixingMatrix:
        raise NotImplementedError(
            f"residual {self._label()} ({type(self).__qualname__}) does not describe its depth mixing matrix: define "
            "_mixing_matrix(state, per_channel=False) returning an attnres.nn.residual.mixing.MixingMatrix from what its forward "
            "recorded, e.g. MixingMatrix(scaled_columns(weights), input_dependent=False) for fixed per-sublayer "
            "weights (attnres.nn.residual.mixing; the README's 'Bring your own residual' example, docs/design.md)")
