"""Residual variants behind one small interface.

The transformer loop talks to a :class:`ResidualStream` only through four calls and never
learns which variant it runs::

    state = residual.start(embedding)
    for l, sublayer in enumerate(sublayers):          # L = 2 * n_layers sublayers
        out = sublayer(residual.sublayer_input(state, l))
        residual.add_output(state, l, out)
    h = residual.finish(state)                        # then final norm and LM head

Variants:

* :class:`StandardResidual` - PreNorm, ``h_{l+1} = h_l + f_l(h_l)`` (the baseline).
* :class:`FullAttnRes` - every sublayer attends over the embedding and all earlier raw
  sublayer outputs (spec §2).
* :class:`BlockAttnRes` - sublayers are cut into blocks of ``S``; every sublayer attends
  over the completed block sums and the current block's partial sum (spec §3).

Both AttnRes variants own one :class:`DepthQuery` per sublayer plus one for the output
aggregation (``L + 1`` in all), and run either the two-phase schedule (the default, spec
§4) or the naive per-sublayer reference (``impl="naive"``), which the tests compare against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import (
    compute_dtype,
    decoding,
    depth_attention,
    merge_partial_sum,
    merge_with_one_source,
    merge_with_sources_lse,
    rms_logits,
    weighted_sums,
)
from ..ops.ablations import depth_attention_variant
from .norm import RMSNorm

__all__ = [
    "ResidualStream",
    "StandardResidual",
    "FullAttnRes",
    "BlockAttnRes",
    "DepthQuery",
    "AttnResAblation",
    "IMPLEMENTATIONS",
    "KERNEL_BACKENDS",
]

IMPLEMENTATIONS = ("two_phase", "naive")
#: Backends of the two-phase path: "auto" = Triton kernels for CUDA tensors when triton is
#: installed, else PyTorch; "triton" = always the kernels; "torch" = always PyTorch.
KERNEL_BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class AttnResAblation:
    """The AttnRes ablations of the report's Table 4; all off by default (= AttnRes).

    input_dependent_query: the query is ``w_l + W_l RMSNorm(x)`` with ``x`` the most recent
        source (Full: the previous sublayer's output; Block: the partial sum, or the last
        block at a block's first sublayer) and ``W_l`` a ``d x d`` projection, zero at init.
    input_independent_mixing: query and keys replaced by one learned scalar per source
        (zero at init: uniform weights).
    sigmoid_weights: unnormalised sigmoid weights instead of the softmax.
    key_norm: ``False`` uses raw keys (no RMSNorm).
    heads: multihead depth attention with ``H`` channel groups (``None``: single head).
    window: Full AttnRes only: the embedding plus the ``W`` most recent outputs.

    Any ablation runs on the naive path (the two-phase schedule needs input-independent
    queries and a softmax).
    """

    input_dependent_query: bool = False
    input_independent_mixing: bool = False
    sigmoid_weights: bool = False
    key_norm: bool = True
    heads: int | None = None
    window: int | None = None

    @property
    def active(self) -> bool:
        return self != AttnResAblation()


class DepthQuery(nn.Module):
    """One sublayer's depth-attention parameters: the pseudo-query ``w_l`` ``[d]`` (zero at
    init) and the RMSNorm gain on its keys ``[d]`` (one at init).

    The query is a plain 1-D parameter, not an ``nn.Linear``: global init passes that
    re-initialise ``nn.Linear`` weights, or every parameter with ``dim() >= 2``, leave it at
    zero (spec §8).
    """

    def __init__(self, dim: int, eps: float = 1e-6, ablation: AttnResAblation | None = None, n_sources: int = 1) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(dim))
        self.key_norm = RMSNorm(dim, eps)
        self.ablation = ablation if ablation is not None and ablation.active else None
        # Table-4 ablations only: a zero-initialised query projection, or per-source logits.
        self.query_proj = nn.Linear(dim, dim, bias=False) if self.ablation and self.ablation.input_dependent_query else None
        self.mixing_logits = (
            nn.Parameter(torch.zeros(n_sources)) if self.ablation and self.ablation.input_independent_mixing else None
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.query)
        self.key_norm.reset_parameters()
        if self.query_proj is not None:
            nn.init.zeros_(self.query_proj.weight)
        if self.mixing_logits is not None:
            nn.init.zeros_(self.mixing_logits)

    def folded_query(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``w_l * g_l`` in ``dtype``: the key-norm gain folded into the query (``[d]``).
        The product is taken in ``dtype`` (float32), not in the parameters' precision."""
        return self.query.to(dtype) * self.key_norm.weight.to(dtype)

    def attend(self, sources: list[Tensor], scale: float = 1.0, return_weights: bool = False):
        """Reference depth attention of this query over ``sources`` (see ``depth_attention``),
        or its Table-4 ablation when one is configured."""
        if self.ablation is None:
            return depth_attention(
                self.query, sources, self.key_norm.weight, eps=self.key_norm.eps, scale=scale,
                return_weights=return_weights,
            )
        ab = self.ablation
        query = self.query
        if self.query_proj is not None:
            last = sources[-1]
            x = F.rms_norm(last.float(), (last.shape[-1],), eps=self.key_norm.eps)
            query = self.query.float() + self.query_proj(x.to(self.query_proj.weight.dtype)).float()
        result = depth_attention_variant(
            query, sources, self.key_norm.weight, self.key_norm.eps,
            normalize_keys=ab.key_norm, weighting="sigmoid" if ab.sigmoid_weights else "softmax",
            heads=ab.heads, mixing_logits=self.mixing_logits, return_weights=return_weights,
        )
        if return_weights and ab.heads is not None:
            return result[0], result[1].mean(dim=-1)  # recorded weights: mean over heads
        return result


@dataclass
class _State:
    """Per-forward bookkeeping shared by all variants."""

    dtype: torch.dtype
    next_sublayer: int = 0
    expecting_output: bool = False
    weights: list[Tensor] | None = None  # per mixer [n_sources, ...] when recording
    extra: dict[str, Any] = field(default_factory=dict)


def _triton_available() -> bool:
    from ..kernels import triton_available

    return triton_available()


class ResidualStream(nn.Module, ABC):
    """How the outputs of ``n_sublayers`` sublayers are combined into their inputs.

    Call order per forward: ``start``, then for ``l = 0 .. L-1`` ``sublayer_input(state, l)``
    followed by ``add_output(state, l, out)``, then ``finish``. Tensors are ``[..., d]``
    (``[B, T, d]`` in the model); sublayer outputs are cast to the embedding's dtype, so the
    residual stream keeps the embedding's precision under autocast.
    """

    name: str = ""
    #: Whether the variant computes depth-attention weights (``record_weights`` is ignored otherwise).
    has_depth_attention: bool = False

    def __init__(self, dim: int, n_sublayers: int) -> None:
        super().__init__()
        if n_sublayers < 1:
            raise ValueError(f"n_sublayers must be >= 1, got {n_sublayers}")
        self.dim = dim
        self.n_sublayers = n_sublayers

    # -- the interface -------------------------------------------------------------------
    def start(self, embedding: Tensor, record_weights: bool = False) -> _State:
        """Begin a forward pass from the token embedding ``[..., d]``."""
        record = record_weights and self.has_depth_attention
        state = _State(dtype=embedding.dtype, weights=[] if record else None)
        self._start(state, embedding)
        return state

    def sublayer_input(self, state: _State, l: int, norm: RMSNorm | None = None) -> Tensor:
        """The input ``h_l`` of sublayer ``l`` (0-based), ``[..., d]``; with ``norm`` (the
        sublayer's pre-norm), ``norm(h_l)`` instead, which variants that compute ``h_l`` in a
        fused kernel fold into that kernel (see :meth:`fuses_norm`)."""
        if l != state.next_sublayer or state.expecting_output:
            raise RuntimeError(
                f"sublayer_input({l}) called out of order: expected sublayer {state.next_sublayer}"
                + (" to return its output first" if state.expecting_output else "")
            )
        state.expecting_output = True
        if norm is None:
            return self._input(state, l)
        return self._normed_input(state, l, norm)

    def fuses_norm(self, x: Tensor) -> bool:
        """Whether ``sublayer_input(..., norm=...)`` fuses the norm into the kernel that
        computes ``h_l``, for tensors like ``x``; the model then asks for normalised inputs
        and its sublayers skip their own pre-norm."""
        return False

    def add_output(self, state: _State, l: int, output: Tensor) -> None:
        """Record the raw output ``v_{l+1} = f_l(h_l)`` of sublayer ``l``."""
        if l != state.next_sublayer or not state.expecting_output:
            raise RuntimeError(f"add_output({l}) called out of order: expected sublayer {state.next_sublayer}")
        state.expecting_output = False
        state.next_sublayer += 1
        if output.dtype != state.dtype:
            output = output.to(state.dtype)
        self._add(state, l, output)

    def finish(self, state: _State) -> Tensor:
        """The final hidden state (before the final norm), ``[..., d]``."""
        if state.next_sublayer != self.n_sublayers or state.expecting_output:
            raise RuntimeError(
                f"finish() called after {state.next_sublayer} of {self.n_sublayers} sublayers"
            )
        return self._finish(state)

    # -- what each variant implements ----------------------------------------------------
    @abstractmethod
    def _start(self, state: _State, embedding: Tensor) -> None: ...

    @abstractmethod
    def _input(self, state: _State, l: int) -> Tensor: ...

    def _normed_input(self, state: _State, l: int, norm: RMSNorm) -> Tensor:
        """``norm(h_l)``; the unfused default."""
        return norm(self._input(state, l))

    @abstractmethod
    def _add(self, state: _State, l: int, output: Tensor) -> None: ...

    @abstractmethod
    def _finish(self, state: _State) -> Tensor: ...

    def reset_parameters(self) -> None:
        """Re-initialise this module's own parameters (none for the standard residual)."""

    def sources_per_mixer(self) -> list[int]:
        """Number of depth sources each sublayer (then the output aggregation) attends over;
        empty for variants without depth attention."""
        return []


class StandardResidual(ResidualStream):
    """PreNorm residual: the input of sublayer ``l`` is ``v_0 + v_1 + ... + v_l``."""

    name = "standard"

    def _start(self, state: _State, embedding: Tensor) -> None:
        state.extra["h"] = embedding

    def _input(self, state: _State, l: int) -> Tensor:
        return state.extra["h"]

    def _add(self, state: _State, l: int, output: Tensor) -> None:
        state.extra["h"] = state.extra["h"] + output

    def _finish(self, state: _State) -> Tensor:
        return state.extra["h"]


class _AttnResBase(ResidualStream):
    """Shared parameters and the Phase-1 machinery of Full and Block AttnRes.

    Two-phase bookkeeping: every *completed* source (the embedding, a finished block sum,
    or - for Full - an output of an earlier group) is read once when it completes to get
    its RMS factor and its logits against **every later query at once** (one matmul); the
    RMS factor is never recomputed. Phase 1 of a group then only gathers those logits,
    takes the softmax statistics of the group's queries together and forms their weighted
    sums; Phase 2 merges in what the group produced so far, sublayer by sublayer.
    """

    has_depth_attention = True

    def __init__(
        self, dim: int, n_sublayers: int, eps: float = 1e-6, impl: str = "two_phase", ablation: AttnResAblation | None = None
    ) -> None:
        super().__init__(dim, n_sublayers)
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
        self.ablation = ablation if ablation is not None and ablation.active else None
        if self.ablation is not None and impl != "naive":
            raise ValueError("AttnRes ablations run on the naive path: use impl='naive' (attnres_impl='naive')")
        self.impl = impl
        self.eps = eps
        self.kernels = "auto"  # see KERNEL_BACKENDS; set by the model from its config
        # mixers[l] feeds sublayer l; mixers[L] is the output aggregation.
        counts = self.sources_per_mixer()
        self.mixers = nn.ModuleList(DepthQuery(dim, eps, self.ablation, counts[l]) for l in range(n_sublayers + 1))

    def reset_parameters(self) -> None:
        for m in self.mixers:
            m.reset_parameters()

    # -- helpers shared by both schedules -------------------------------------------------
    def _use_kernels(self, x: Tensor) -> bool:
        """Whether the two-phase path runs the fused Triton kernels for tensors like ``x``."""
        if self.kernels == "torch":
            return False
        if self.kernels == "triton":
            return True
        return x.is_cuda and _triton_available()

    def fuses_norm(self, x: Tensor) -> bool:
        return self.impl == "two_phase" and self._use_kernels(x)

    def _normed_input(self, state: _State, l: int, norm: RMSNorm) -> Tensor:
        return self._input(state, l, norm)

    def _record(self, state: _State, weights: Tensor, sources_last: bool = True) -> None:
        """Store one mixer's weights as ``[n_sources, ...]`` (given ``[..., n]``)."""
        if state.weights is not None:
            state.weights.append(weights.movedim(-1, 0) if sources_last else weights)

    def _attend_naive(self, state: _State, l: int, sources: list[Tensor]) -> Tensor:
        if state.weights is None:
            return self.mixers[l].attend(sources)
        h, w = self.mixers[l].attend(sources, return_weights=True)
        self._record(state, w, sources_last=False)
        return h

    def _folded_queries(self, dtype: torch.dtype) -> Tensor:
        """``[L + 1, d]``: every mixer's query with its key-norm gain folded in.

        Without autograd (inference, decoding) the result is kept until a query or gain
        changes (their version counters and storage are the key): decoding runs the residual
        once per token, and rebuilding this costs ~3 small ops per sublayer each time."""
        compute = compute_dtype(dtype)
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return torch.stack([m.folded_query(compute) for m in self.mixers])
        key = [compute, self.mixers[0].query.device]
        for m in self.mixers:  # direct dict reads: nn.Module.__getattr__ would make this 4x slower
            q, g = m._parameters["query"], m._modules["key_norm"]._parameters["weight"]
            key += (q._version, q.data_ptr(), g._version, g.data_ptr())
        cached = self.__dict__.get("_folded_cache")
        if cached is None or cached[0] != key:
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable in and out of inference mode
                cached = (key, torch.stack([m.folded_query(compute) for m in self.mixers]))
            self.__dict__["_folded_cache"] = cached
        return cached[1]

    def _complete(self, st: dict, x: Tensor, first_query: int) -> None:
        """Register ``x`` as a completed source visible to queries ``first_query .. L``."""
        st["sources"].append(x)
        st["logits"].append(rms_logits(x, st["qg"][first_query:], self.eps))
        st["offsets"].append(first_query)

    def _phase1(self, st: dict, first_query: int, count: int) -> None:
        """Softmax statistics and weighted sums of queries ``first_query ..`` over the
        completed sources: stores ``o_hat`` (list of ``[..., d]``), ``m``, ``sumexp``
        (``[..., count]``) and the weights ``p`` (``[..., count, n]``)."""
        cols = [z[..., first_query - off : first_query - off + count] for z, off in zip(st["logits"], st["offsets"])]
        z = torch.stack(cols, dim=-1)  # [..., count, n]
        sources = st["sources"]
        if len(sources) == 1:
            # One source: its weight is exactly 1, so Phase 1 returns it as it is (no pass).
            x = sources[0].to(compute_dtype(sources[0].dtype))
            st["p1"] = {"first": first_query, "o_hat": [x] * count, "m": z[..., 0], "sumexp": torch.ones_like(z[..., 0]),
                        "p": torch.ones_like(z), "lse": z[..., 0]}
            return
        if self._use_kernels(sources[0]):
            from ..kernels.phase1 import phase1_attention

            lead, d, n = sources[0].shape[:-1], sources[0].shape[-1], len(sources)
            O, m, sumexp, p = phase1_attention(z.reshape(-1, count, n), torch.stack(sources).reshape(n, -1, d))
            st["p1"] = {
                "first": first_query,
                "o_hat": [O[s].reshape(*lead, d) for s in range(count)],
                "m": m.reshape(*lead, count),
                "sumexp": sumexp.reshape(*lead, count),
                "p": p.reshape(*lead, count, n),
            }
            return
        m = z.amax(dim=-1)
        e = torch.exp(z - m.unsqueeze(-1))
        sumexp = e.sum(dim=-1)
        p = e / sumexp.unsqueeze(-1)
        # lse: PyTorch's Phase 2 needs only the log-sum-exp (the kernels' Phase 2 takes m and sumexp).
        st["p1"] = {"first": first_query, "o_hat": weighted_sums(p, sources), "p": p, "lse": m + torch.log(sumexp)}

    def _phase2(
        self, state: _State, st: dict, l: int, intra: list[Tensor], intra_logits: list[Tensor], norm: RMSNorm | None = None
    ) -> Tensor:
        """Input of sublayer ``l``: its Phase-1 result merged with the ``intra`` sources
        (then ``norm``-ed when given: in the fused kernel, which is also the norm alone when
        there is nothing to merge)."""
        p1 = st["p1"]
        s = l - p1["first"]
        o_hat = p1["o_hat"][s]
        if norm is not None and self._use_kernels(o_hat):
            from ..kernels.merge import merge_sources

            out, w = merge_sources(
                o_hat, p1["m"][..., s], p1["sumexp"][..., s], intra, intra_logits,
                norm_weight=norm.weight, norm_eps=norm.eps, out_dtype=state.dtype,
            )
        elif not intra:
            self._record(state, p1["p"][..., s, :])
            h = o_hat if o_hat.dtype == state.dtype else o_hat.to(state.dtype)
            return h if norm is None else norm(h)
        elif len(intra) == 1 and not self._use_kernels(o_hat):
            h, w_x = merge_with_one_source(o_hat, p1["lse"][..., s], intra[0], intra_logits[0])
            h = h if h.dtype == state.dtype else h.to(state.dtype)
            if state.weights is not None:
                self._record(state, torch.cat([p1["p"][..., s, :] * (1 - w_x).unsqueeze(-1), w_x.unsqueeze(-1)], dim=-1))
            return h if norm is None else norm(h)
        elif self._use_kernels(o_hat):
            from ..kernels.merge import merge_sources

            out, w = merge_sources(o_hat, p1["m"][..., s], p1["sumexp"][..., s], intra, intra_logits, out_dtype=state.dtype)
        else:
            h, w = merge_with_sources_lse(o_hat, p1["lse"][..., s], intra, intra_logits)
            out = h.to(state.dtype) if norm is None else norm(h.to(state.dtype))
        if state.weights is not None:
            inter = p1["p"][..., s, :] * w[..., :1]
            self._record(state, torch.cat([inter, w[..., 1:]], dim=-1))
        return out

    def _aggregate(self, state: _State, st: dict) -> Tensor:
        """Output aggregation: query ``L`` over all completed sources."""
        self._phase1(st, self.n_sublayers, 1)
        return self._phase2(state, st, self.n_sublayers, [], [])

    def _new_two_phase_state(self, state: _State, embedding: Tensor) -> dict:
        st = {"qg": self._folded_queries(embedding.dtype), "sources": [], "logits": [], "offsets": []}
        self._complete(st, embedding, 0)
        return st


class FullAttnRes(_AttnResBase):
    """Full AttnRes (spec §2): sublayer ``l`` attends over ``[v_0, v_1, ..., v_l]``.

    ``group_size`` is the Appendix-B scheduling group ``S`` of the two-phase path (it does
    not change the function): Phase 1 batches a group's queries over all outputs of earlier
    groups, Phase 2 walks the group's own earlier outputs. ``None`` picks ``round(sqrt(L))``,
    which minimises the ``(S + N) d`` per-layer I/O of Appendix B.
    """

    name = "attnres_full"

    def __init__(
        self,
        dim: int,
        n_sublayers: int,
        eps: float = 1e-6,
        impl: str = "two_phase",
        group_size: int | None = None,
        ablation: AttnResAblation | None = None,
    ) -> None:
        self.window = ablation.window if ablation is not None else None
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1 (or None), got {self.window}")
        super().__init__(dim, n_sublayers, eps, impl, ablation)
        if group_size is None:
            group_size = max(1, round(n_sublayers**0.5))
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1 (or None for automatic), got {group_size}")
        self.group_size = group_size

    def sources_per_mixer(self) -> list[int]:
        counts = [l + 1 for l in range(self.n_sublayers + 1)]
        return counts if self.window is None else [min(c, 1 + self.window) for c in counts]

    def _windowed(self, sources: list[Tensor]) -> list[Tensor]:
        """The embedding plus the ``window`` most recent outputs (all sources without one)."""
        if self.window is None or len(sources) <= 1 + self.window:
            return sources
        return [sources[0]] + sources[-self.window :]

    def _start(self, state: _State, embedding: Tensor) -> None:
        if self.impl == "naive":
            state.extra["sources"] = [embedding]
            return
        st = self._new_two_phase_state(state, embedding)
        st["group"] = []  # (output, logits vs later queries, first query) of the current group
        state.extra["tp"] = st

    def _input(self, state: _State, l: int, norm: RMSNorm | None = None) -> Tensor:
        if self.impl == "naive":
            h = self._attend_naive(state, l, self._windowed(state.extra["sources"]))
            return h if norm is None else norm(h)
        st = state.extra["tp"]
        if l % self.group_size == 0:
            for x, z, off in st["group"]:  # the previous group's outputs become completed
                st["sources"].append(x)
                st["logits"].append(z)
                st["offsets"].append(off)
            st["group"] = []
            self._phase1(st, l, min(self.group_size, self.n_sublayers - l))
        intra = [x for x, _, _ in st["group"]]
        intra_logits = [z[..., l - off] for _, z, off in st["group"]]
        return self._phase2(state, st, l, intra, intra_logits, norm)

    def _add(self, state: _State, l: int, output: Tensor) -> None:
        if self.impl == "naive":
            state.extra["sources"].append(output)
            return
        st = state.extra["tp"]
        st["group"].append((output, rms_logits(output, st["qg"][l + 1 :], self.eps), l + 1))

    def _finish(self, state: _State) -> Tensor:
        if self.impl == "naive":
            return self._attend_naive(state, self.n_sublayers, self._windowed(state.extra["sources"]))
        st = state.extra["tp"]
        for x, z, off in st["group"]:
            st["sources"].append(x)
            st["logits"].append(z)
            st["offsets"].append(off)
        return self._aggregate(state, st)


class BlockAttnRes(_AttnResBase):
    """Block AttnRes (spec §3) with block size ``S`` counted in sublayers.

    Sublayer ``l`` (0-based) is at position ``i = l % S + 1`` of block ``n = l // S + 1``; it
    attends over ``[b_0, ..., b_{n-1}]`` when ``i = 1`` and over
    ``[b_0, ..., b_{n-1}, b_n^{i-1}]`` otherwise. The output aggregation attends over
    ``[b_0, ..., b_N]``; the last block may be shorter. ``S = 1`` is Full AttnRes and
    ``S >= L`` a single block.
    """

    name = "attnres_block"

    def __init__(
        self,
        dim: int,
        n_sublayers: int,
        block_size: int,
        eps: float = 1e-6,
        impl: str = "two_phase",
        ablation: AttnResAblation | None = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if ablation is not None and ablation.window is not None:
            raise ValueError("the sliding-window ablation applies to Full AttnRes only")
        self.block_size = block_size
        super().__init__(dim, n_sublayers, eps, impl, ablation)

    @property
    def n_blocks(self) -> int:
        return -(-self.n_sublayers // self.block_size)

    def sources_per_mixer(self) -> list[int]:
        counts = []
        for l in range(self.n_sublayers):
            n, i = l // self.block_size + 1, l % self.block_size + 1
            counts.append(n if i == 1 else n + 1)
        return counts + [self.n_blocks + 1]

    def _start(self, state: _State, embedding: Tensor) -> None:
        state.extra["partial"] = None
        if self.impl == "naive":
            state.extra["blocks"] = [embedding]
            return
        state.extra["tp"] = self._new_two_phase_state(state, embedding)

    def _input(self, state: _State, l: int, norm: RMSNorm | None = None) -> Tensor:
        at_block_start = l % self.block_size == 0
        if self.impl == "naive":
            if at_block_start and state.extra["partial"] is not None:
                state.extra["blocks"].append(state.extra["partial"])
                state.extra["partial"] = None
            partial = state.extra["partial"]
            sources = state.extra["blocks"] + ([partial] if partial is not None else [])
            h = self._attend_naive(state, l, sources)
            return h if norm is None else norm(h)
        st = state.extra["tp"]
        if at_block_start:
            if state.extra["partial"] is not None:
                self._complete(st, state.extra["partial"], l)
                state.extra["partial"] = None
            self._phase1(st, l, min(self.block_size, self.n_sublayers - l))
            return self._phase2(state, st, l, [], [], norm)
        partial = state.extra["partial"]
        if self._use_kernels(partial):
            return self._phase2_kernel(state, st, l, partial, norm)
        if state.weights is None and decoding(partial):
            p1 = st["p1"]
            s = l - p1["first"]
            h = merge_partial_sum(p1["o_hat"][s], p1["lse"][..., s], partial, st["qg"][l], self.eps)
            h = h if h.dtype == state.dtype else h.to(state.dtype)
            return h if norm is None else norm(h)
        return self._phase2(state, st, l, [partial], [rms_logits(partial, st["qg"][l], self.eps)], norm)

    def _phase2_kernel(self, state: _State, st: dict, l: int, partial: Tensor, norm: RMSNorm | None) -> Tensor:
        """Phase 2 of a block's later sublayer as one fused Triton kernel: the partial
        sum's logit, the merge and, with ``norm``, the sublayer's pre-norm."""
        from ..kernels.phase2 import phase2_merge

        p1 = st["p1"]
        s = l - p1["first"]
        fused_norm = {} if norm is None else {"norm_weight": norm.weight, "norm_eps": norm.eps}
        out, w = phase2_merge(
            p1["o_hat"][s], p1["m"][..., s], p1["sumexp"][..., s], partial, st["qg"][l], self.eps,
            out_dtype=state.dtype, **fused_norm,
        )
        if state.weights is not None:
            inter = p1["p"][..., s, :] * (1 - w).unsqueeze(-1)
            self._record(state, torch.cat([inter, w.unsqueeze(-1)], dim=-1))
        return out

    def _add(self, state: _State, l: int, output: Tensor) -> None:
        partial = state.extra["partial"]
        state.extra["partial"] = output if partial is None else partial + output

    def _finish(self, state: _State) -> Tensor:
        partial = state.extra["partial"]
        if self.impl == "naive":
            return self._attend_naive(state, self.n_sublayers, state.extra["blocks"] + [partial])
        st = state.extra["tp"]
        self._complete(st, partial, self.n_sublayers)
        return self._aggregate(state, st)
