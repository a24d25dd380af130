"""Residuals as depth mixing matrices (report §6.2, Fig. 9) and depth-wise attention sinks
(report §5.4.2).

Every residual variant writes the input of sublayer ``l`` as ``h_l = sum_i M[i -> l] v_i``
over the embedding ``v_0`` and the raw sublayer outputs ``v_1 .. v_L``. Each variant describes
its own ``M`` (:meth:`attnres.nn.residual.ResidualStream.mixing_matrix`); this module runs a
model on some tokens, collects it and measures it:

* :func:`depth_mixing_matrix` - ``M`` ``[L + 1, L + 1]`` averaged over tokens (rows: sublayers
  ``1 .. L``, then the output aggregation; columns: ``v_0 .. v_L``), optionally per token,
  with its semiseparable rank and the per-source statistics of the sink table.
* :func:`semiseparable_rank` - the largest numerical rank of the blocks ``M[k:, :k + 1]``
  (every block on and below the diagonal lies in one of them), the rank the report uses.
* :func:`mixing_forward` - the same forward keeping the sources ``v_i`` and the sublayer
  inputs, to check ``h_l = sum_i M[i -> l] v_i``.

Rank tolerance: a singular value counts when it exceeds :func:`rank_rtol` times the largest
singular value of the whole matrix (all in float64): :data:`RANK_RTOL`, but no less than the
matrix's size times the machine epsilon of the dtype its weights were computed in (as
``numpy.linalg.matrix_rank``): a float32 model's weights carry rounding of ~1e-7, which a
float64 SVD resolves - equal weights one ulp apart gave a second singular value of 4.5e-9.
Input-dependent variants have one ``M``
per token; their rank is the largest over the tokens looked at (and, for variants that weight
channel by channel - Highway, LayerScale - over the channels too), since an average of
low-rank matrices need not be low-rank. The rank of the token-averaged matrix is reported
beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..nn.norm import norm_input_value
from ..ops import compute_dtype
from ..nn.residual.mixing import MIXING_DTYPE, MixingMatrix, scatter_source_weights

__all__ = [
    "RANK_RTOL",
    "rank_rtol",
    "SINK_RATIO",
    "SINK_MAX_CV",
    "DepthMixing",
    "SourceStats",
    "MixingForward",
    "depth_mixing_matrix",
    "mixing_forward",
    "semiseparable_rank",
    "source_stats",
    "depth_mixing_from_logged",
]

#: Singular values above ``RANK_RTOL * sigma_max(M)`` count toward the rank, for weights
#: computed in float64 (in a lower precision :func:`rank_rtol` raises it).
RANK_RTOL = 1e-9
#: A sink takes at least this many times the average weight of the sources beside it ...
SINK_RATIO = 2.0
#: ... with a coefficient of variation across tokens and inputs of at most this.
SINK_MAX_CV = 0.5


def rank_rtol(n: int, precision: torch.dtype) -> float:
    """The rank tolerance of an ``n x n`` mixing matrix whose weights were computed in
    ``precision``: :data:`RANK_RTOL`, or ``n`` times ``precision``'s machine epsilon where
    that is more (float32: 1.2e-7 a weight; ``numpy.linalg.matrix_rank``'s default) - below it
    a singular value can be the weights' rounding, not a direction of the mixing."""
    return max(RANK_RTOL, n * torch.finfo(precision).eps)


def semiseparable_rank(M: Tensor, rtol: float | None = None) -> Tensor:
    """The semiseparable rank of lower-triangular ``M [..., n, n]``: the largest numerical
    rank over ``k`` of ``M[..., k:, :k + 1]`` (rows ``k ..``, columns ``.. k``: every block on
    and below the diagonal lies in one of these). Singular values count above ``rtol`` times
    ``M``'s largest (default: :func:`rank_rtol` of ``M``'s dtype - a float32 ``M``'s rounding
    counts for nothing; a float64 ``M`` of float32 weights needs ``rank_rtol(n,
    torch.float32)``, as :func:`depth_mixing_matrix` gives it). Returns an integer tensor ``[...]``
    (zeros for ``n = 0``: a 0x0 matrix has rank 0).
    A stack is ranked :data:`RANK_CHUNK` matrices at a time: its float64 copy and the SVDs'
    workspace are those matrices', not the stack's (Highway's per-channel stack is ``d``
    times the per-token one).

    ``M`` may be a :class:`MixingMatrix` (``residual.mixing_matrix(state)``): its ``weights``,
    or for a variant that mixes channel by channel the largest rank over its ``per_channel``
    matrices (the report's rank; its ``weights`` are their mean, refused without them)."""
    if isinstance(M, MixingMatrix):
        if M.per_channel is not None:  # [..., n, n, d] -> the largest over the channels, [...]
            return semiseparable_rank(M.per_channel.movedim(-1, -3), rtol).amax(-1)
        M = _exact_weights(M, "semiseparable_rank")
    _refuse_unless_lower_triangular(M)
    n = M.shape[-1]
    # (integer or boolean entries are exact: float64's tolerance; torch.finfo refused their dtype)
    rtol = rank_rtol(n, M.dtype if M.is_floating_point() else MIXING_DTYPE) if rtol is None else rtol
    if n == 0:  # (a 0x0 mixing matrix - no sources - has rank 0: there are no blocks to stack the ranks of)
        return torch.zeros(M.shape[:-2], dtype=torch.long, device=M.device)
    return _ranks_in_chunks(M.detach(), rtol)


def _exact_weights(mm: MixingMatrix, reader: str) -> Tensor:
    """``mm.weights`` where they are what the variant applies; a reduction of per-channel
    weights (Highway, LayerScale) is refused, naming the call that keeps them."""
    if mm.reduction is not None:
        raise ValueError(f"{reader} of a MixingMatrix whose weights are the {mm.reduction} of what the variant applies: "
                         "record it with residual.mixing_matrix(state, per_channel=True) (the rank is the largest over "
                         "the channels), or pass its .weights for the reduced matrix")
    return mm.weights


#: How many matrices of a stack :func:`semiseparable_rank` ranks at once.
RANK_CHUNK = 1024


def _refuse_unless_lower_triangular(M: Tensor) -> None:
    """``ValueError`` unless ``M`` is a stack of square lower-triangular matrices. Row by row on
    views, no copy: ``M.triu(1).ne(0)`` copied the whole stack, and again as booleans."""
    # (a non-square or upper-triangular M - sources as rows, M transposed - had a rank all the same, of
    # other blocks than the report's; a vector failed inside linalg.matrix_norm)
    square = isinstance(M, Tensor) and M.dim() >= 2 and M.shape[-1] == M.shape[-2]
    if not square or any(bool(M[..., i, i + 1:].detach().any()) for i in range(M.shape[-1] - 1)):
        got = (tuple(M.shape) if not square else "entries above the diagonal (sources as rows? M.mT is the "
               "report's)") if isinstance(M, Tensor) else type(M).__name__
        raise ValueError(f"semiseparable_rank takes lower-triangular mixing matrices [..., n, n] (rows: the sublayers "
                         f"and the output, columns: the sources; a MixingMatrix's weights), got {got}")


def _ranks_in_chunks(M: Tensor, rtol: float) -> Tensor:
    """:func:`_ranks` of ``M [..., n, n]``, at most :data:`RANK_CHUNK` matrices at a time, split
    along the leading dims as views (a reshape of dims that do not merge would copy the stack)."""
    if M.shape[:-2].numel() <= RANK_CHUNK:
        return _ranks(M.to(MIXING_DTYPE), rtol)
    if M.shape[0] == 1:  # (more than RANK_CHUNK matrices behind the first index: split the next dim)
        return _ranks_in_chunks(M[0], rtol).unsqueeze(0)
    step = max(1, RANK_CHUNK // M.shape[1:-2].numel())
    return torch.cat([_ranks_in_chunks(part, rtol) for part in M.split(step)])


def _ranks(M: Tensor, rtol: float) -> Tensor:
    """:func:`semiseparable_rank` of float64 ``M [..., n, n]``, all at once."""
    scale = torch.linalg.matrix_norm(M, ord=2).unsqueeze(-1)  # [..., 1]
    ranks = [(torch.linalg.svdvals(M[..., k:, : k + 1]) > rtol * scale).sum(-1) for k in range(M.shape[-1])]
    return torch.stack(ranks, -1).amax(-1)


@dataclass
class SourceStats:
    """One source ``v_i`` in the sink table (report §5.4.2).

    mean: its weight averaged over the rows that see it (``r >= i``), tokens and inputs.
    std: the standard deviation across tokens and inputs of that per-token average.
    relative: ``mean`` over the average weight of all sources in the same rows - 1 for the
        standard residual, above 1 for a source that draws more than its share.
    top_rows: in how many rows (of the token-averaged ``M``) it takes the largest weight.
    sink: ``relative >= SINK_RATIO`` and ``std / mean <= SINK_MAX_CV`` - a high weight
        whatever the input.
    """

    source: int
    mean: float
    std: float
    relative: float
    top_rows: int
    sink: bool

    @property
    def cv(self) -> float:
        return self.std / self.mean if self.mean > 0 else float("inf")


def _shape(t: Tensor) -> str:
    """``[2, 16, 64]``: how a tensor is named in a summary (its values stay in the object)."""
    return str(list(t.shape))


@dataclass(repr=False)
class DepthMixing:
    """What :func:`depth_mixing_matrix` measured.

    matrix: ``[L + 1, L + 1]`` float64, ``M`` averaged over the tokens (see module doc).
    std: ``[L + 1, L + 1]``, each entry's standard deviation over the tokens (0 for
        input-independent variants).
    per_token: ``[B, T, L + 1, L + 1]`` when asked for, else ``None``.
    rank: the semiseparable rank (largest over the tokens, and channels, looked at).
    rank_of_mean: the semiseparable rank of ``matrix``.
    rank_tokens: how many tokens the rank was taken over (1 for input-independent variants).
    rank_over: what the rank's maximum runs over, in words.
    rtol: the rank tolerance (:func:`rank_rtol` of the dtype the model computed its weights in).
    reduction: how a variant that weights vectors was reduced to scalars, or ``None``.
    input_dependent: whether ``M`` depends on the input.
    source_groups: sources entering as one sum (Block AttnRes' blocks), or ``None``.
    sources: the sink table, one :class:`SourceStats` per source ``v_0 .. v_L``.
    residual: the variant's registered name; n_tokens: tokens averaged over.
    """

    residual: str
    matrix: Tensor
    std: Tensor
    rank: int
    rank_of_mean: int
    rank_tokens: int
    rank_over: str
    rtol: float
    reduction: str | None
    input_dependent: bool
    source_groups: list[range] | None
    sources: list[SourceStats]
    n_tokens: int
    per_token: Tensor | None = None

    @property
    def n_sublayers(self) -> int:
        return self.matrix.shape[-1] - 1

    def __repr__(self) -> str:
        """One line (a notebook shows the result so): what was measured, not the matrices'
        entries (``.matrix``, ``.sources``, ``.to_dict()`` hold them)."""
        per_token = f", per_token {_shape(self.per_token)}" if self.per_token is not None else ""
        return (f"DepthMixing({self.residual!r}, {self.n_sublayers} sublayers, matrix {_shape(self.matrix)} over "
                f"{self.n_tokens} tokens, rank {self.rank} ({self.rank_over}; of the mean {self.rank_of_mean}), "
                f"{'input-dependent' if self.input_dependent else 'input-independent'}, sinks {self.sinks()}"
                f"{per_token})")

    def sinks(self) -> list[int]:
        """The sources flagged as sinks."""
        return [s.source for s in self.sources if s.sink]

    def to_dict(self) -> dict:
        """JSON-ready summary (the matrix as nested lists)."""
        return {
            "residual": self.residual, "matrix": self.matrix.tolist(), "std": self.std.tolist(),
            "rank": self.rank, "rank_of_mean": self.rank_of_mean, "rank_tokens": self.rank_tokens,
            "rank_over": self.rank_over, "rtol": self.rtol, "reduction": self.reduction,
            "input_dependent": self.input_dependent, "n_tokens": self.n_tokens,
            "source_groups": None if self.source_groups is None else [[g.start, g.stop] for g in self.source_groups],
            "sources": [{**vars(s), "cv": s.cv} for s in self.sources],
        }


@dataclass(repr=False)
class MixingForward:
    """One recorded forward: the variant's :class:`MixingMatrix`, the sources ``v_0 .. v_L``
    (``[B, T, d]`` each), the sublayer inputs ``h_1 .. h_L`` and the output aggregation
    (the hidden state before the final norm)."""

    mixing: MixingMatrix
    sources: list[Tensor]
    inputs: list[Tensor]
    output: Tensor

    def __repr__(self) -> str:
        """One line: the shapes, not the tensors' values (hundreds of lines of them)."""
        return (f"MixingForward(mixing {_shape(self.mixing.weights)}, {len(self.sources)} sources and "
                f"{len(self.inputs)} inputs {_shape(self.output)}, output {_shape(self.output)})")

    def reconstruct(self) -> list[Tensor]:
        """``sum_i M[r, i] v_i`` for every row ``r`` (the ``L`` inputs, then the output), in
        float64, channel by channel where the variant provides per-channel weights."""
        v = torch.stack([s.to(MIXING_DTYPE) for s in self.sources], dim=-2)  # [B, T, L + 1, d]
        pc = self.mixing.per_channel
        if pc is not None:
            if pc.dim() == 3:
                pc = pc.expand(*v.shape[:-2], *pc.shape)
            rows = (pc * v.unsqueeze(-3)).sum(-2)  # [B, T, L + 1, d]
        else:
            W = self.mixing.weights
            if W.dim() == 2:
                W = W.expand(*v.shape[:-2], *W.shape)
            rows = W @ v
        return list(rows.unbind(-2))


#: How a model of the user's own (the README's "AttnRes in your own PyTorch model") gets what the
#: analysis of an attnres model reads: the functions here run attnres's decoders, whose layout they
#: know, and refused such a model without saying where its depth weights are.
OWN_MODEL_WAY = ("for a model of your own that drives a residual module (README 'AttnRes in your own PyTorch model'), "
                 "start its forward with state = residual.start(x, record_weights=True): after residual.finish(state), "
                 "state.weights holds each mixer's depth weights [n_sources, ...] (depth_entropy takes each) and "
                 "residual.mixing_matrix(state) the depth mixing matrix (semiseparable_rank and source_stats measure "
                 "it)")


def refuse_wrapper(model: object, who: str) -> None:
    """``TypeError`` where ``model`` is a wrapper of the model (``DistributedDataParallel``, any
    module holding it as ``.module``), naming ``.module``: ``depth_mixing_matrix(ddp_model, ids)``
    was told to start a forward of its own with ``record_weights`` - the way for a model of
    one's own, not for an AttnResLM behind DDP."""
    wrapped = getattr(model, "module", None) if isinstance(model, nn.Module) else None
    if isinstance(wrapped, nn.Module) and hasattr(wrapped, "residual"):  # (an attnres model, or a compiled one)
        raise TypeError(f"{who} takes the model itself; got {type(model).__name__} around {type(wrapped).__name__}: "
                        f"give it the wrapper's .module (the model it wraps)")


def _trunk(model: nn.Module):
    if not all(hasattr(model, a) for a in ("decode", "residual", "embed_tokens")):
        refuse_wrapper(model, "depth mixing analysis")
        raise TypeError(f"depth mixing analysis runs models with the attnres decoder trunk (AttnResLM, the attnres.hf "
                        f"models) and transformers models of attnres.upcycle; got {type(model).__name__}; "
                        f"{OWN_MODEL_WAY}")
    return model


@torch.no_grad()
def mixing_forward(model: nn.Module, input_ids: Tensor, per_channel: bool = False) -> MixingForward:
    """Run ``model`` (eval mode, no grad) on ``input_ids [B, T]`` recording its depth mixing
    matrix, its sources and its sublayer inputs. ``per_channel``: see
    :meth:`~attnres.nn.residual.ResidualStream.mixing_matrix`."""
    model = _trunk(model)
    model.check_input_ids(input_ids)
    outputs: list[Tensor] = []
    inputs: list[Tensor] = []

    def keep(fn, *args):
        inputs.append(norm_input_value(args[0]))
        out = fn(*args)
        outputs.append(out)
        return out

    was_training = model.training
    model.eval()
    try:
        h, state = model.decode(input_ids, record_weights=True, sublayer_call=keep)
        embedding = model.embed_tokens(input_ids).to(h.dtype)
    finally:
        model.train(was_training)
    mixing = model.residual.mixing_matrix(state, per_channel=per_channel)
    return MixingForward(mixing, [embedding] + [o.to(h.dtype) for o in outputs], inputs, h)


def _recorded_mixing(model: nn.Module, input_ids: Tensor, per_channel: bool = False) -> MixingMatrix:
    """The :class:`MixingMatrix` of an eval-mode forward of ``model`` on ``input_ids``: an
    attnres decoder (:func:`mixing_forward`) or a ``transformers`` family model of
    ``attnres.upcycle`` (its ``depth_mixing``)."""
    if not hasattr(model, "depth_mixing"):
        return mixing_forward(model, input_ids, per_channel).mixing
    was_training = model.training
    model.eval()
    try:
        return model.depth_mixing(input_ids, per_channel)
    finally:
        model.train(was_training)


def source_stats(per_token: Tensor) -> list[SourceStats]:
    """The sink table of per-token matrices ``[N, n, n]`` (``N`` tokens, or 1): a
    :class:`MixingMatrix`'s ``weights`` as they are, ``[B, T, n, n]`` or ``[n, n]`` (one
    matrix for every token), whose leading dimensions count the tokens; or the
    :class:`MixingMatrix` itself."""
    if isinstance(per_token, MixingMatrix):  # (its weights: a sink is a source's weight, per token)
        per_token = per_token.weights
    if not isinstance(per_token, Tensor) or per_token.dim() < 2 or per_token.shape[-1] != per_token.shape[-2]:
        got = tuple(per_token.shape) if isinstance(per_token, Tensor) else type(per_token).__name__
        raise ValueError(f"source_stats takes mixing matrices [..., n, n] (a MixingMatrix's weights), got {got}")
    # (a MixingMatrix's [B, T, n, n] or [n, n] failed unpacking the shape, "too many values to unpack")
    per_token = per_token.detach().reshape(-1, *per_token.shape[-2:])
    N, n, _ = per_token.shape
    visible = torch.ones(n, n, dtype=torch.bool, device=per_token.device).tril()
    row_avg = (per_token * visible).sum(-1) / visible.sum(-1)  # [N, n]: average weight of a row's sources
    mean_M = per_token.mean(0)
    masked = torch.where(visible, mean_M, torch.full_like(mean_M, float("-inf")))
    top = masked.argmax(-1)  # [n]: the strongest source of each row
    stats = []
    for i in range(n):
        w = per_token[:, i:, i].mean(-1)  # [N]: the source's mean weight over the rows that see it
        mean = float(w.mean())
        std = float(w.std(correction=0)) if N > 1 else 0.0
        base = float(row_avg[:, i:].mean())
        relative = mean / base if base != 0 else float("nan")
        cv = std / mean if mean > 0 else float("inf")
        stats.append(SourceStats(i, mean, std, relative, int((top == i).sum()),
                                 bool(relative >= SINK_RATIO and cv <= SINK_MAX_CV)))
    return stats


def _rank_over(input_dependent: bool, per_channel: bool, rank_tokens: int, n_tokens: int) -> str:
    """What the rank's maximum runs over, in words. The first ``rank_tokens`` of the
    ``n_tokens`` analysed where that is fewer (``attnres analyze``'s default 1024 tokens: 256),
    named as such: "every token" beside "averaged over 1024 tokens" read as all of them."""
    if not input_dependent:
        return "largest over every channel" if per_channel else "the matrix (input-independent)"
    channel = " and channel" if per_channel else ""
    if rank_tokens < n_tokens:
        return f"largest over every token{channel} of the first {rank_tokens} of the {n_tokens} tokens"
    return f"largest over every token{channel}"


@torch.no_grad()
def depth_mixing_matrix(model: nn.Module, input_ids: Tensor, per_token: bool = False, rank_tokens: int = 256,
                        rtol: float | None = None) -> DepthMixing:
    """The depth mixing matrix of ``model`` (an attnres decoder, or a ``transformers`` family
    model of ``attnres.upcycle``) on ``input_ids [B, T]`` (report §6.2, Fig. 9).

    Works for every registered residual variant that describes its mixing weights
    (:meth:`~attnres.nn.residual.ResidualStream.mixing_matrix`; a variant without it raises
    ``NotImplementedError`` naming the missing ``_mixing_matrix``). ``per_token``: keep the
    ``[B, T, L + 1, L + 1]`` matrices. ``rank_tokens``: the rank of an input-dependent ``M``
    is the largest over the first ``rank_tokens`` tokens (row-major over ``[B, T]``).
    ``rtol``: the rank tolerance (default: :func:`rank_rtol` of the precision the model
    computes its weights in - float32, or float64 for a float64 model).
    """
    mm = _recorded_mixing(model, input_ids)
    B, T = input_ids.shape
    W = mm.weights
    if rtol is None:  # (the weights are float64 here, but hold the model's rounding)
        rtol = rank_rtol(W.shape[-1], _weights_precision(model))
    if W.dim() == 2:
        tokens = W.unsqueeze(0)  # [1, n, n]: the same for every token
    else:
        tokens = W.reshape(-1, *W.shape[-2:])
    mean = tokens.mean(0)
    std = tokens.std(0, correction=0) if tokens.shape[0] > 1 else torch.zeros_like(mean)
    # The rank: per token (input-dependent), per channel (channel-wise variants, from a second
    # forward of the first rows only: their per-channel matrices are d times larger).
    pc = None
    if mm.reduction is not None:
        rows = input_ids[: max(1, -(-rank_tokens // T))] if W.dim() > 2 else input_ids[:1, :1]
        pc = _recorded_mixing(model, rows, per_channel=True).per_channel
    if pc is not None:
        pc = pc.reshape(-1, *pc.shape[-3:])[:rank_tokens]  # [N', n, n, d]
        rank_mats = pc.movedim(-1, 1).reshape(-1, *pc.shape[1:3])
    else:
        rank_mats = tokens[:rank_tokens]
    n_rank_tokens = rank_mats.shape[0] if pc is None else pc.shape[0]
    rank = int(semiseparable_rank(rank_mats, rtol).max())
    return DepthMixing(
        residual=model.residual.name, matrix=mean, std=std, rank=rank,
        rank_of_mean=int(semiseparable_rank(mean, rtol)), rank_tokens=n_rank_tokens if W.dim() > 2 else 1,
        rank_over=_rank_over(W.dim() > 2, pc is not None, n_rank_tokens, B * T),
        rtol=rtol, reduction=mm.reduction, input_dependent=mm.input_dependent, source_groups=mm.source_groups,
        sources=source_stats(tokens), n_tokens=B * T,
        per_token=(W if W.dim() > 2 else W.expand(B, T, *W.shape)).clone() if per_token else None,
    )


def _weights_precision(model: nn.Module) -> torch.dtype:
    """The dtype ``model`` computes its mixing weights in: depth attention's (float32, or
    float64 for a float64 model) - at least float32 for a bf16 one too."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return compute_dtype(dtype)


def depth_mixing_from_logged(residual, depth_weights: list[list[float]]) -> DepthMixing:
    """The token-averaged ``M`` of an AttnRes variant from mean depth weights logged during
    training (``forward_diagnostics``' ``depth_weights``: per mixer, the mean weight of each
    source), for runs whose checkpoints are gone. ``M`` is linear in the weights, so this is
    exactly the mean over the logged batch; what needs single tokens - the rank of each
    token's ``M``, the spread across tokens, and so the sink flag - is unknown (``rank`` is
    the averaged ``M``'s, ``std`` NaN, no source flagged). ``residual``: the variant's module,
    e.g. built from the run's config (only its layout is read)."""
    if not hasattr(residual, "source_members"):
        raise ValueError(f"logged depth weights describe AttnRes variants; {residual.name!r} logs none")
    members = residual.source_members()
    weights = [torch.tensor(w, dtype=MIXING_DTYPE) for w in depth_weights]
    M = scatter_source_weights(weights, members)
    groups = [range(m[0], m[-1] + 1) for m in members[-1]] if any(len(m) > 1 for c in members for m in c) else None
    stats = source_stats(M.unsqueeze(0))
    for st in stats:
        st.std, st.sink = float("nan"), False
    rtol = rank_rtol(M.shape[-1], torch.float32)  # (the logged means: a float32 model's)
    rank = int(semiseparable_rank(M, rtol))
    return DepthMixing(residual=residual.name, matrix=M, std=torch.full_like(M, float("nan")), rank=rank,
                       rank_of_mean=rank, rank_tokens=0, rank_over="the logged token-averaged M only (no checkpoint)",
                       rtol=rtol, reduction=None, input_dependent=True, source_groups=groups, sources=stats,
                       n_tokens=0)
