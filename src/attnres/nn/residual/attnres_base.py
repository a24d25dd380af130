"""What Full and Block AttnRes share: the mixers, the naive reference and the two-phase
bookkeeping.

Two-phase bookkeeping (report §4.2, Algorithm 1): at the first sublayer of a block (Block)
or of an Appendix-B group (Full), ``phase1`` takes the block's queries - and the output
aggregation's, with the last block - over the completed sources (the embedding, the
finished block sums, the outputs of earlier groups) in one pass: each source's RMS factor
and logits once for all those queries, their weighted sums and log-sum-exps. Each
sublayer's input is then one ``merge`` (Phase 2): its Phase-1 weighted sum, whose logit is
its log-sum-exp, with the sources whose logits the merge computes itself - Block's partial
sum, Full's outputs of the current group - and the next sublayer's RMSNorm fused in. With
a single completed source (the first block or group) there is no Phase 1: the source joins
the merge's computed sources.

The operations come from :mod:`attnres.ops.depth_attention`, picked once per forward by
``backend`` (``"reference"``: the plain-graph reference; otherwise the custom operators,
which pick their implementation by device). Each variant picks its *schedule* - naive or
two-phase - when ``schedule`` is set: a stateless strategy object whose
``start/input/add/finish/history/resume`` the module calls.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from ...ops import Operations, compute_dtype, operations
from ...ops.depth_attention import BACKENDS, reference
from ...ops.depth_attention.recompute import Phase1Recompute, recipes_unusable
from ...validation import did_you_mean
from ..norm import FusableNormInput
from .base import DepthHistory, ResidualState, ResidualStream
from .config import SCHEDULES, AttnResAblation, ResidualConfig
from .mixing import MixingMatrix, scatter_source_weights
from .query import DepthQuery

__all__ = ["AttnResBase", "CompletedSources", "Schedule", "Phase1"]


@dataclass
class Phase1:
    """Phase 1 of queries ``first .. first + count - 1`` over the completed sources: their
    weighted sums ``outs`` (``count`` tensors ``[..., d]``) and log-sum-exps ``lse`` (``count``
    views ``[..., 1]`` of one tensor: a merge's backward then hands back a gradient of its
    own column, and the columns are stacked once - no per-merge slice backward); ``None``
    over a single source, which the merges then take themselves. ``recompute``: the sums'
    recipe, which the merges save instead of the sums (``recompute_phase1``), else ``None``."""

    first: int
    count: int
    outs: list[Tensor] | None = None
    lse: list[Tensor] | None = None
    recompute: Phase1Recompute | None = None


@dataclass
class CompletedSources:
    """The two-phase schedule's completed sources.

    queries: every mixer's query with its key-norm gain folded in, ``L + 1`` tensors
    ``[d]`` (:meth:`AttnResBase.folded_queries`): a merge takes its own, so that its
    gradient needs no select backward.
    stacked: the same as one ``[L + 1, d]`` tensor where it is kept (no autograd), else
    ``None``.
    sources: the completed sources ``[..., d]``.
    p1: Phase 1 of the current block or group.
    """

    queries: list[Tensor]
    stacked: Tensor | None
    sources: list[Tensor]
    p1: Phase1 | None = None

    def block(self, first: int, count: int) -> Tensor:
        """Queries ``first .. first + count - 1`` as one ``[count, d]`` tensor."""
        if self.stacked is not None:
            return self.stacked[first : first + count]
        return torch.stack(self.queries[first : first + count])


class Schedule:
    """How a variant runs: the naive reference or the two-phase schedule. Stateless; every
    method takes the residual module ``m`` and the forward's state."""

    name = ""

    def start(self, m: AttnResBase, embedding: Tensor, common: dict[str, Any]) -> ResidualState:
        raise NotImplementedError

    def input(self, m: AttnResBase, state: ResidualState, l: int):
        raise NotImplementedError

    def add(self, m: AttnResBase, state: ResidualState, l: int, output: Tensor) -> None:
        raise NotImplementedError

    def reads_output_as_is(self, m: AttnResBase, state: ResidualState, output: Tensor) -> bool:
        """:meth:`ResidualStream._reads_output_as_is` for this schedule."""
        return False

    def finish(self, m: AttnResBase, state: ResidualState) -> Tensor:
        raise NotImplementedError

    def history(self, m: AttnResBase, state: ResidualState) -> DepthHistory:
        raise NotImplementedError

    def resume(self, m: AttnResBase, history: DepthHistory, at: int, common: dict[str, Any]) -> ResidualState:
        raise NotImplementedError


def _differentiable(alpha: Tensor, z: Tensor, computed: list[Tensor], qg: Tensor | None, eps: float) -> Tensor:
    """A merge's weights ``alpha`` (from the custom operators, whose ``alpha`` is not
    differentiable) as recorded depth weights that a loss may use: a loss on
    ``return_depth_weights`` sent the queries a wrong gradient (the reference's a right one).
    The same values, with the gradient of the reference's softmax over ``z`` and the
    ``computed`` sources' logits; only where autograd records (training does not record)."""
    alpha = alpha.detach()
    if not torch.is_grad_enabled():
        return alpha
    logits = [z.to(alpha.dtype), *(reference.rms_logits(x, qg.unsqueeze(0), eps) for x in computed)]
    soft = torch.softmax(torch.cat(logits, dim=-1), dim=-1)
    return alpha + (soft - soft.detach()) if soft.requires_grad else alpha


def _keeps_nothing() -> bool:
    """Whether the folded queries are built in the forward rather than kept: where autograd
    records, and where a graph is traced (torch.compile; torch.jit.trace, which made a kept
    tensor a constant of its graph - the queries at trace time, whatever was loaded later)."""
    return torch.is_grad_enabled() or torch.compiler.is_compiling() or torch.jit.is_tracing()


#: Optimizer steps taken in this process (any ``torch.optim.Optimizer``), counted from the first
#: kept queries on: part of their key (:meth:`AttnResBase.folded_queries`). A fused optimizer
#: (``AdamW(..., fused=True)``) updates the parameters in place without bumping their version
#: counters, and the next no-grad forward (a sample or a validation loss inside the training loop,
#: without ``model.eval()``) ran on the queries from before the step, silently.
_optimizer_steps = [0]
_step_hook: Any = None


def _count_step(_optimizer, _args, _kwargs) -> None:
    _optimizer_steps[0] += 1


def _steps_so_far() -> int:
    """:data:`_optimizer_steps`, counting from the first call on (the hook is registered then:
    importing attnres adds no global optimizer hook)."""
    global _step_hook
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _step_hook = register_optimizer_step_post_hook(_count_step)
    return _optimizer_steps[0]


def _fake(weight: Tensor | None) -> bool:
    """Whether ``weight`` is a fake tensor or the forward runs under a ``FakeTensorMode``."""
    return isinstance(weight, FakeTensor) or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


class AttnResBase(ResidualStream):
    """Shared parameters (``mixers[l]`` feeds sublayer ``l``, ``mixers[L]`` is the output
    aggregation: ``L + 1`` :class:`DepthQuery` in all) and machinery of Full and Block AttnRes.

    Args (of both):
        dim: the model width ``d``; the embedding and every sublayer output are ``[..., d]``.
        n_sublayers: ``L``, the sublayers the stream feeds (2 per transformer block).
        eps: the keys' RMSNorm epsilon (> 0).
        schedule: ``"two_phase"`` (report §4.2, the default) or ``"naive"`` (one depth
            attention per sublayer over all its sources; the ablations need it).
        ablation: an :class:`AttnResAblation` of the report's Table 4 (``None``: none).
        backend: ``"auto"`` (the C kernel on CPU float32 and float64, Triton on CUDA, else
            PyTorch), ``"torch"``, ``"triton"`` or ``"reference"`` (the readable autograd graph:
            the one that supports double backward, ``create_graph=True``; torch.func transforms
            use it whatever the backend).
        recompute_phase1: the backward recomputes Phase 1's sums instead of keeping them
            (less memory, the same values bit for bit).

    Use it through the protocol of :class:`ResidualStream` (``start``, then per sublayer
    ``sublayer_input`` and ``add_output``, then ``finish``; docs/design.md)."""

    has_depth_attention = True
    upcycles_exactly = True  # (zero queries: the uniform average, which the pre-norm rescales; docs/upcycling.md)
    #: ``ResidualConfig.autocast_phase1_sums`` (set by :func:`attnres.nn.residual.build_residual`):
    #: under autocast, Phase 1 stores its weighted sums in the autocast dtype.
    autocast_phase1_sums: bool = False
    #: The variant's schedules by name (``ResidualConfig.schedule``); set by subclasses.
    SCHEDULES: dict[str, Schedule] = {}

    def __init__(
        self, dim: int, n_sublayers: int, eps: float = 1e-6, schedule: str = "two_phase",
        ablation: AttnResAblation | None = None, backend: str = "auto", recompute_phase1: bool = True,
    ) -> None:
        super().__init__(dim, n_sublayers)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}{did_you_mean(backend, BACKENDS)}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
            raise ValueError(f"{type(self).__name__}: eps (the keys' RMSNorm epsilon) must be a positive number, "
                             f"got {eps!r}")
        if not isinstance(recompute_phase1, bool):  # (a string such as "no" was taken as true)
            raise ValueError(f"{type(self).__name__}: recompute_phase1 must be True or False, got {recompute_phase1!r}")
        self.ablation = ablation if ablation is not None and ablation.active else None
        self.eps = eps
        self.backend = backend
        self.recompute_phase1 = recompute_phase1
        self.schedule = schedule
        counts = self.sources_per_mixer()
        self.mixers = nn.ModuleList(DepthQuery(dim, eps, self.ablation, counts[l]) for l in range(n_sublayers + 1))

    def extra_repr(self) -> str:
        ablation = f", ablation={self.ablation}" if self.ablation is not None else ""
        return (f"{super().extra_repr()}, schedule={self.schedule!r}, backend={self.backend!r}, eps={self.eps}"
                f"{ablation}")

    # -- configuration -------------------------------------------------------------------
    @property
    def schedule(self) -> str:
        """``"two_phase"`` or ``"naive"``; setting it switches the schedule (same function)."""
        return self._schedule

    @schedule.setter
    def schedule(self, value: str) -> None:
        # (the variant's own: a user's subclass may give only "naive", and a KeyError was all it got)
        names = tuple(n for n in SCHEDULES if n in self.SCHEDULES) or tuple(self.SCHEDULES)
        if value not in self.SCHEDULES:
            raise ValueError(f"schedule must be one of {names} for {type(self).__name__}, got {value!r}"
                             f"{did_you_mean(value, names)}")
        if self.ablation is not None and value != "naive":
            raise ValueError("AttnRes ablations run on the naive path: use schedule='naive' "
                             "(ModelConfig.residual.schedule)")
        self._schedule = value
        self._strategy = self.SCHEDULES[value]

    @classmethod
    def check_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> None:
        if cls.from_config.__func__ is ResidualStream.from_config.__func__:
            # a variant of the user's built by the default from_config: options are its __init__'s arguments (they
            # were refused as "fields of ModelConfig.residual", which Full and Block read in their own from_config)
            cls._check_options(config)
        else:
            cls._no_options(config)
        if config.ablation.active and config.schedule != "naive":
            raise ValueError("ModelConfig.residual.schedule must be 'naive' when an AttnRes ablation is set (the "
                             f"two-phase schedule needs static queries and a softmax); got {config.schedule!r}")

    @classmethod
    def describe(cls, config: ResidualConfig, n_sublayers: int) -> str:
        words = cls._layout_words(config, n_sublayers)
        if config.schedule != "two_phase":
            words.append(config.schedule)
        if config.ablation.active:
            default = AttnResAblation()
            words += [f"{k}={v}" for k, v in vars(config.ablation).items() if v != getattr(default, k)]
        return f"{cls.name} ({', '.join(words)})" if words else cls.name

    @classmethod
    def _layout_words(cls, config: ResidualConfig, n_sublayers: int) -> list[str]:
        return []

    def reset_parameters(self) -> None:
        for m in self.mixers:
            m.reset_parameters()

    def train(self, mode: bool = True) -> AttnResBase:
        """``nn.Module.train``; also drops the folded queries kept for no-grad forwards
        (:meth:`folded_queries`): a hand-written update through ``.data`` bumps no version
        counter, and the evaluation after it (``model.eval()``) read the queries from before."""
        self.__dict__.pop("_folded_cache", None)
        return super().train(mode)

    def operations(self) -> Operations:
        """The depth-attention operations of the two-phase schedule that ``backend`` names
        (under torch.func transforms the custom operators' wrappers run the reference
        themselves: :func:`attnres.ops.depth_attention.library.under_transforms`)."""
        return operations(self.backend)

    # -- the protocol, delegated to the schedule -----------------------------------------
    def _start(self, embedding: Tensor, common: dict[str, Any]) -> ResidualState:
        return self._strategy.start(self, embedding, common)

    def _input(self, state: ResidualState, l: int):
        return self._strategy.input(self, state, l)

    def _add(self, state: ResidualState, l: int, output: Tensor) -> None:
        self._strategy.add(self, state, l, output)

    def _reads_output_as_is(self, state: ResidualState, output: Tensor) -> bool:
        return self._strategy.reads_output_as_is(self, state, output)

    def _finish(self, state: ResidualState) -> Tensor:
        return self._strategy.finish(self, state)

    def _history(self, state: ResidualState) -> DepthHistory:
        return self._strategy.history(self, state)

    def _resume(self, history: DepthHistory, at_sublayer: int, common: dict[str, Any]) -> ResidualState:
        return self._strategy.resume(self, history, at_sublayer, common)

    # -- the naive reference -------------------------------------------------------------
    def attend_naive(self, state: ResidualState, l: int, sources: list[Tensor]) -> Tensor:
        """Mixer ``l`` over ``sources`` with the reference depth attention (recording)."""
        if state.weights is None:
            return self.mixers[l].attend(sources)
        h, w = self.mixers[l].attend(sources, return_weights=True)
        state.record(w, sources_last=False)
        return h

    # -- two-phase bookkeeping -----------------------------------------------------------
    def folded_queries(self, dtype: torch.dtype) -> Tensor:
        """``[L + 1, d]``: every mixer's query with its key-norm gain folded in.

        Without autograd (inference, decoding) the result is kept until a query or gain
        changes (their version counters and storage are the key, and the count of optimizer
        steps taken: a fused optimizer bumps no version counter): decoding runs the residual
        once per token, and rebuilding this costs ~3 small ops per sublayer each time. A change
        through ``.data`` (``p.data -= lr * p.grad``) bumps no version counter: it is seen
        after the module's ``train()`` or ``eval()``, which drop what was kept."""
        if _keeps_nothing():
            return torch.stack(self._fold(dtype))
        return self._kept_queries(dtype)[0]

    def _fold(self, dtype: torch.dtype) -> list[Tensor]:
        compute = compute_dtype(dtype)
        try:
            folded = [m.folded_query(compute) for m in self.mixers]
        except RuntimeError:  # (a query and gain that do not broadcast: "The size of tensor a (4) must match ...")
            self._refuse_bad_queries()
            raise
        if any(f.shape != (self.dim,) for f in folded):  # (else "stack expects each tensor to be equal size")
            self._refuse_bad_queries()
        return folded

    def _refuse_bad_queries(self) -> None:
        """``ValueError`` naming the first mixer whose query or key-norm gain is not ``[dim]``
        (one assigned or loaded by hand, ``mixers[2].query = nn.Parameter(torch.zeros(1, d))``)."""
        for i, m in enumerate(self.mixers):
            for what, t in (("query", m.query), ("key_norm.weight", m.key_norm.weight)):
                if tuple(t.shape) != (self.dim,):
                    raise ValueError(f"{type(self).__name__}: mixers[{i}].{what} must have shape ({self.dim},) (this "
                                     f"residual's dim: one vector per mixer), got {tuple(t.shape)}; assign a "
                                     f"parameter of that shape, or load a checkpoint of a residual of dim {self.dim}")

    def _kept_queries(self, dtype: torch.dtype) -> tuple[Tensor, list[Tensor]]:
        """The kept ``[L + 1, d]`` folded queries and their rows (see :meth:`folded_queries`)."""
        # Fake tensors have no values to keep: a model built under FakeTensorMode (the GPU check's launch survey),
        # whose data_ptr() is 0 for all, with a warning a later PyTorch makes an error; and real weights run under
        # it (a shape survey of an existing model), whose stack kept gave every later forward outside the mode fake
        # logits. Both tested before any data_ptr(), in 0.2 us (torch._guards.detect_fake_mode took 3 us, on each
        # step of a graphed decode).
        if _fake(self.mixers[0]._parameters.get("query")):
            return self._stacked(dtype)
        key: list[Any] = [compute_dtype(dtype), _steps_so_far()]
        for m in self.mixers:  # direct dict reads: nn.Module.__getattr__ would make this 4x slower
            q, g = m._parameters.get("query"), m._modules["key_norm"]._parameters.get("weight")
            if q is None or g is None:  # (parametrized, torch.nn.utils.parametrize: a value computed at each read
                # from tensors the key cannot name - nothing kept; it was a KeyError in every no-grad forward)
                return self._stacked(dtype)
            try:
                key += (q._version, q.data_ptr(), g._version, g.data_ptr())
            except RuntimeError:  # (parameters made under torch.inference_mode() - a model built or loaded there -
                # track no version: "Inference tensors do not track version counter" in every forward; nothing
                # kept. Asked of the version itself, not by is_inference() on each: this loop runs every decode step)
                return self._stacked(dtype)
        key.append(q.device)
        cached = self.__dict__.get("_folded_cache")
        if cached is None or cached[0] != key:
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable in and out of inference mode
                cached = (key, *self._stacked(dtype))
            self.__dict__["_folded_cache"] = cached
        return cached[1], cached[2]

    def _stacked(self, dtype: torch.dtype) -> tuple[Tensor, list[Tensor]]:
        """The ``[L + 1, d]`` folded queries built now, and their rows."""
        stacked = torch.stack(self._fold(dtype))
        return stacked, list(stacked.unbind(0))

    def new_sources(self, dtype: torch.dtype) -> CompletedSources:
        """A forward's empty :class:`CompletedSources`, holding the folded queries in ``dtype``."""
        if _keeps_nothing():
            # (rows of one stacked tensor: every query stays in the graph - a query that no
            # merge reads, such as the first sublayer's over the embedding alone, gets a zero
            # gradient rather than none, as data parallelism expects - and the backward
            # gathers the rows' gradients in one stack instead of a select per merge)
            return CompletedSources(list(torch.stack(self._fold(dtype)).unbind(0)), None, [])
        stacked, rows = self._kept_queries(dtype)
        return CompletedSources(rows, stacked, [])

    def phase1(self, state: ResidualState, first_query: int, end: int) -> None:
        """Phase 1 of queries ``first_query .. end - 1`` over the completed sources - and of the
        output aggregation's query ``L`` when ``end`` is ``L``: the same pass - into
        ``state.sources.p1``."""
        tp = state.sources
        count = end - first_query + (end == self.n_sublayers)
        tp.p1 = Phase1(first_query, count)
        if len(tp.sources) > 1:
            qg, out_dtype = tp.block(first_query, count), self._sums_dtype(tp.sources[0])
            tp.p1.outs, lse = state.ops.phase1(qg, tp.sources, self.eps, out_dtype)
            tp.p1.lse = [column.unsqueeze(-1) for column in lse.unbind(-1)]
            if self._recomputes(state, tp.p1.outs):
                tp.p1.recompute = Phase1Recompute(state.ops.phase1, qg, tp.sources, self.eps, tp.p1.outs, out_dtype)

    def _sums_dtype(self, x: Tensor) -> torch.dtype | None:
        """The dtype Phase 1 stores its weighted sums in: the autocast dtype where
        ``autocast_phase1_sums`` is set, autocast is on for ``x``'s device and its dtype is
        narrower than the stream's ``x``; else ``None`` (the stream's)."""
        if not self.autocast_phase1_sums or x.device.type == "meta" or not torch.is_autocast_enabled(x.device.type):
            return None
        dtype = torch.get_autocast_dtype(x.device.type)
        return dtype if dtype.itemsize < x.dtype.itemsize else None

    def _recomputes(self, state: ResidualState, outs: list[Tensor]) -> bool:
        """Whether the merges save Phase 1's sums as their recipe (:mod:`~attnres.ops.depth_attention.recompute`):
        with ``recompute_phase1``, in eager autograd (torch.compile's partitioner decides what
        its graphs save), on the custom operators (the reference stays a plain graph; they run
        it under torch.func transforms, :func:`~attnres.ops.depth_attention.recompute.recipes_unusable`)."""
        return (self.recompute_phase1 and state.ops.name != "reference" and torch.is_grad_enabled()
                and not torch.compiler.is_compiling() and outs[0].requires_grad and not recipes_unusable())

    def covers_aggregation(self, state: ResidualState) -> bool:
        """Whether the last Phase 1 ran the output aggregation's query too."""
        p1 = state.sources.p1
        return p1 is not None and p1.first + p1.count > self.n_sublayers

    def phase2_input(self, state: ResidualState, l: int, computed: list[Tensor], fusable: bool = True,
                     addend: Tensor | None = None, on_total=None):
        """Query ``l``'s input (Phase 2, report §4.2): its Phase-1 weighted sum - a source
        whose logit is its log-sum-exp - merged with ``computed`` (Block AttnRes' partial
        sum, Full AttnRes' outputs of the current group), whose logits the merge computes.
        Recording, the weighted sum's weight in the merge is spread over the Phase-1
        sources by their softmax weights. ``addend``, ``on_total``: see
        :meth:`merged_input`."""
        tp = state.sources
        p1, s = tp.p1, l - tp.p1.first
        if p1.outs is None:  # a single completed source: one more computed source
            x = tp.sources[0]
            z = torch.empty((*x.shape[:-1], 0), dtype=compute_dtype(x.dtype), device=x.device)
            return self.merged_input(state, z, [], [x, *computed], tp.queries[l], fusable, None, addend, on_total)
        record = None
        if state.weights is not None:
            qg = tp.queries[l].unsqueeze(0)
            p = torch.softmax(torch.cat([reference.rms_logits(x, qg, self.eps) for x in tp.sources], -1), -1)
            record = lambda alpha: torch.cat([p * alpha[..., :1], alpha[..., 1:]], dim=-1)  # noqa: E731
        return self.merged_input(state, p1.lse[s], [p1.outs[s]], computed, tp.queries[l] if computed else None,
                                 fusable, record, addend, on_total, p1.recompute, tp.sources[0].dtype)

    def merged_input(self, state: ResidualState, z: Tensor, sources: list[Tensor], computed: list[Tensor],
                     qg: Tensor | None, fusable: bool = True, record=None, addend: Tensor | None = None,
                     on_total=None, recompute: Phase1Recompute | None = None, stream: torch.dtype | None = None):
        """A sublayer's input: the merge of ``sources`` (logits ``z [..., k]``) and ``computed``
        (logits from ``qg``), a tensor - or, when the caller defers the norm and ``fusable``, a
        :class:`~attnres.nn.norm.FusableNormInput` whose norm the merge applies (one source
        too: its weight is exactly 1, and the merge is then the norm in one pass). Records the
        weights once (``record(alpha)`` maps the merge's weights to the mixer's sources).
        ``addend``: added to the last computed source by the merge itself (Block AttnRes'
        partial sum and the last output, one pass instead of an add and a merge);
        ``on_total(sum)`` receives the sum the first time the merge runs. ``recompute``: the
        recipe of ``sources`` (Phase-1 sums), saved instead of them unless other saved-tensor
        hooks are in force (an activation checkpoint's: it recomputes the merge itself).
        ``stream``: the stream's dtype, the input's (default: the computed sources', else the
        sources'; Phase-1 sums may be narrower, ``autocast_phase1_sums``)."""
        fuse = state.defer_norm and fusable
        stream = stream or reference.stream_dtype(sources, computed)
        if len(sources) + len(computed) == 1 and not fuse and addend is None:  # one source: weight exactly 1
            x = (sources or computed)[0]
            if state.weights is not None:
                ones = torch.ones((*x.shape[:-1], 1), dtype=compute_dtype(x.dtype), device=x.device)
                state.record(ones if record is None else record(ones))
            return x if x.dtype == stream else x.to(stream)
        # (snapshots: activation checkpointing may recompute the input later)
        sources, computed, recorded, formed = list(sources), list(computed), [], []

        def compute(norm_weight, norm_eps, out_dtype=None, readers=1):
            saving = recompute.saving() if recompute is not None and not recipes_unusable() else nullcontext()
            out_dtype = out_dtype or stream  # (a merge of narrower Phase-1 sums alone writes the stream's)
            # (a view for each reader where they read another dtype than the stream's - autocast:
            # their gradients added up by the merge's backward as autograd adds them, in float32;
            # else one tensor, as they would read the stream's)
            views = readers if out_dtype != stream else 1
            with saving:
                out, alpha, *total = state.ops.merge(z, sources, computed, qg, self.eps, norm_weight,
                                                     0.0 if norm_eps is None else norm_eps, addend, out_dtype, views)
            if not recorded and state.weights is not None:
                recorded.append(True)
                if state.ops.name != "reference":
                    alpha = _differentiable(alpha, z, [*computed[:-1], total[0]] if total else computed, qg, self.eps)
                state.record(alpha if record is None else record(alpha))
            if total and not formed:
                formed.append(True)
                on_total(total[0])
            return out if views == readers else (out,) * readers

        return FusableNormInput(compute) if fuse else compute(None, None)

    # -- the depth mixing matrix (report §6.2) --------------------------------------------
    def source_members(self) -> list[list[list[int]]]:
        """For every mixer (sublayers, then the output aggregation), its sources in the order
        it attends over them, each as the indices ``i`` of the ``v_i`` it sums."""
        raise NotImplementedError

    def _mixing_matrix(self, state: ResidualState, per_channel: bool = False) -> MixingMatrix:
        """Each mixer's recorded weights placed on the ``v_i`` its sources sum: a source that
        is a sum (a block, a partial sum) gives its weight to every member (report §6.2)."""
        members = self.source_members()
        # (detached, as every other variant's: the recorded weights carry the forward's graph, which a
        # float64 copy kept alive, and float() of its entries warned in source_stats)
        M = scatter_source_weights([w.detach() for w in state.weights], members)
        groups = None
        if any(len(m) > 1 for cols in members for m in cols):
            groups = [range(m[0], m[-1] + 1) for m in members[-1]]
        heads = self.ablation is not None and self.ablation.heads is not None
        return MixingMatrix(M, input_dependent=True, source_groups=groups,
                            reduction="mean over the depth-attention heads (the sublayer inputs mix per-head channel "
                            "groups with their own weights)" if heads else None)

    # -- description ---------------------------------------------------------------------
    def residual_flops_per_token(self) -> float:
        """Per mixer over ``n`` sources: ``2 n d`` for the weighted sum and ``2 n d`` for the
        logits; ``3 d`` per source for its key RMSNorm (once per source); ``2 d^2`` per
        input-dependent query projection."""
        d, L = self.dim, self.n_sublayers
        ab = self.ablation or AttnResAblation()
        counts = self.sources_per_mixer()
        total = 0.0
        for l in range(L + 1):
            n = counts[l]
            total += 2 * n * d  # weighted sum
            if not ab.input_independent_mixing:
                total += 2 * n * d  # logits
            if ab.input_dependent_query and l < L:
                total += 2 * d * d
        if not ab.input_independent_mixing and ab.key_norm:
            total += 3 * d * (L + 1)  # each source's key RMSNorm, once per source (upper bound for Block)
        return total
