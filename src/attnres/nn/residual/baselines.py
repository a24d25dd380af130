"""Residual baselines the report compares against (report Tables 2, 4, 5).

Every class implements the :class:`~attnres.nn.residual.ResidualStream` interface, so the
transformer loop runs them exactly like the AttnRes variants. Each follows its own paper:

* :class:`ReZero` - Bachlechner et al. 2020, "ReZero is All You Need": ``h + alpha_l f(h)``
  with a scalar ``alpha_l`` initialised to 0 (the network starts as the identity map).
* :class:`LayerScale` - Touvron et al. 2021, "Going deeper with Image Transformers" (CaiT):
  ``h + diag(lambda_l) f(h)`` with ``lambda_l`` initialised to ``eps`` = 0.1 up to depth 18,
  1e-5 up to depth 24 and 1e-6 beyond (depth = transformer blocks).
* :class:`Highway` - Srivastava et al. 2015, "Highway Networks":
  ``(1 - g) * h + g * f(h)`` with an element-wise transform gate ``g = sigmoid(W h + b)``
  whose bias starts negative (``-1``) so that the carry path dominates at first.
* :class:`DenseFormer` - Pagliardini et al. 2024, "DenseFormer": after every transformer
  block a depth-weighted average (DWA) of the embedding and all block outputs so far, with
  weights initialised to the identity (the model starts as the standard transformer).
* :class:`HyperConnections` - Zhu et al. 2025, "Hyper-Connections" (dynamic HC, expansion
  rate ``m``): ``m`` residual streams, input ``A_m^T H``, update ``A_r^T H + B^T f``, with
  static parts initialised to the Pre-Norm residual (``A_m = e_{l mod m}``, ``A_r = I``,
  ``B = 1``) and dynamic parts ``s * tanh(norm(H) W)`` with ``W = 0``, ``s = 0.01``.
* :class:`MHC` - Xie et al. 2026, "mHC: Manifold-Constrained Hyper-Connections": from the
  RMS-normalised flattened streams, ``H_pre = sigmoid(.)``, ``H_post = 2 sigmoid(.)`` and
  ``H_res = SinkhornKnopp(.)`` (20 iterations, doubly stochastic); update
  ``H_res x + H_post^T f(H_pre x)``.
* :class:`MHCLite` - Yang & Gao 2026, "mHC-lite": as mHC but ``H_res`` is a convex
  combination (softmax weights) of all ``m!`` permutation matrices, exactly doubly
  stochastic without iterations.

Multi-stream variants start from ``m`` copies of the embedding and end with the sum of
the streams (as in the HC paper); the final RMSNorm removes the factor ``m``.

Every class registers itself under its ``name`` (``ModelConfig.residual.kind``), takes its
settings from ``ModelConfig.residual`` (``hc_streams``, ``sinkhorn_iters``) and counts its
FLOPs per token (``residual_flops_per_token``, as ``attnres.experiments.flops`` documents).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...ops import compute_dtype
from .base import ResidualState, ResidualStream
from .config import ResidualConfig
from .kinds import refuse_other_kind
from .mixing import MIXING_DTYPE, MixingMatrix, carry_products, scaled_columns, stream_products
from .registry import register_residual
from .standard import SingleStreamResidual, StreamState

__all__ = [
    "ReZero",
    "LayerScale",
    "Highway",
    "DenseFormer",
    "HyperConnections",
    "MHC",
    "MHCLite",
    "sinkhorn_knopp",
    "layerscale_init",
]


class OneLineParameterList(nn.ParameterList):
    """``nn.ParameterList`` shown in one line: ``print(model)`` listed every parameter of
    every list, one per sublayer - 276 lines for hyper-connections at 24 transformer blocks."""

    def __repr__(self) -> str:
        shapes = [list(p.shape) for p in self]
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in self})
        size = str(shapes[0]) if all(s == shapes[0] for s in shapes) else f"{shapes[0]} to {shapes[-1]}"
        return f"ParameterList({len(shapes)} x {size} {'/'.join(dtypes)})" if shapes else "ParameterList()"


class _Builtin:
    """Built-in baselines take their settings from ``ModelConfig.residual``, no ``options``."""

    @classmethod
    def check_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> None:
        ResidualStream.check_config.__func__(cls, config, dim, n_sublayers)
        cls._no_options(config)

    @classmethod
    def from_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> ResidualStream:
        refuse_other_kind(cls, config)
        return cls(dim, n_sublayers)


@register_residual("rezero")
class ReZero(_Builtin, SingleStreamResidual):
    """``h_{l+1} = h_l + alpha_l f_l(h_l)``, ``alpha_l`` a scalar initialised to 0."""

    upcycles_exactly = False  # (alpha = 0: the sublayers' outputs are dropped at the start)

    def __init__(self, dim: int, n_sublayers: int) -> None:
        super().__init__(dim, n_sublayers)
        self.alpha = nn.Parameter(torch.zeros(n_sublayers))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.alpha)

    def update(self, l: int, h: Tensor, out: Tensor) -> Tensor:
        return h + self.alpha[l].to(out.dtype) * out

    def residual_flops_per_token(self) -> float:
        return float(self.n_sublayers * (2 * self.dim))

    def _mixing_matrix(self, state: StreamState, per_channel: bool = False) -> MixingMatrix:
        """``M[i -> l] = alpha_{i-1}`` for ``i >= 1``, 1 for the embedding."""
        alpha = self.alpha.detach().to(MIXING_DTYPE)
        return MixingMatrix(scaled_columns(torch.cat([alpha.new_ones(1), alpha])), input_dependent=False)


def layerscale_init(n_layers: int) -> float:
    """CaiT's initial LayerScale value for a network of ``n_layers`` transformer blocks."""
    if n_layers <= 18:
        return 0.1
    if n_layers <= 24:
        return 1e-5
    return 1e-6


@register_residual("layerscale")
class LayerScale(_Builtin, SingleStreamResidual):
    """``h_{l+1} = h_l + diag(lambda_l) f_l(h_l)``; one ``[d]`` vector per sublayer."""

    upcycles_exactly = False  # (lambda small: the sublayers' outputs scaled down at the start)

    def __init__(self, dim: int, n_sublayers: int, init: float | None = None) -> None:
        super().__init__(dim, n_sublayers)
        self.init_value = layerscale_init(math.ceil(n_sublayers / 2)) if init is None else init
        self.scales = OneLineParameterList(nn.Parameter(torch.full((dim,), self.init_value)) for _ in range(n_sublayers))

    def reset_parameters(self) -> None:
        for s in self.scales:
            nn.init.constant_(s, self.init_value)

    def update(self, l: int, h: Tensor, out: Tensor) -> Tensor:
        return h + self.scales[l].to(out.dtype) * out

    def residual_flops_per_token(self) -> float:
        return float(self.n_sublayers * (2 * self.dim))

    def _mixing_matrix(self, state: StreamState, per_channel: bool = False) -> MixingMatrix:
        """``M[i -> l] = lambda_{i-1}`` channel by channel (1 for the embedding); ``weights``
        is the mean over the ``d`` channels."""
        lam = torch.stack([s.detach().to(MIXING_DTYPE) for s in self.scales])  # [L, d]
        full = scaled_columns(torch.cat([lam.new_ones(1, self.dim), lam]))  # [L + 1, L + 1, d]
        return MixingMatrix(full.mean(-1), input_dependent=False, per_channel=full if per_channel else None,
                            reduction="mean over the d channels of diag(lambda_i)")


@register_residual("highway")
class Highway(_Builtin, SingleStreamResidual):
    """``h_{l+1} = (1 - g) * h_l + g * f_l(h_l)`` with ``g = sigmoid(W_l h_l + b_l)``.

    The gate is computed from the sublayer's input ``h_l`` (element-wise, ``d x d`` weights
    per sublayer); ``b_l`` starts at ``gate_bias`` (negative: carry first).
    """

    upcycles_exactly = False  # (a gate that mixes h_l and f_l(h_l), not their sum)

    def __init__(self, dim: int, n_sublayers: int, gate_bias: float = -1.0, init_std: float = 0.02) -> None:
        super().__init__(dim, n_sublayers)
        self.gate_bias = gate_bias
        self.init_std = init_std
        self.gates = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_sublayers))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for g in self.gates:
            nn.init.normal_(g.weight, std=self.init_std)
            nn.init.constant_(g.bias, self.gate_bias)

    def update(self, l: int, h: Tensor, out: Tensor) -> Tensor:
        return self._carry(h, out, self.gate(l, h))

    @staticmethod
    def _carry(h: Tensor, out: Tensor, g: Tensor) -> Tensor:
        """``h + g * (out - h)`` in the stream's dtype (under autocast the gate leaves its
        linear layer in bf16, whatever the stream's dtype)."""
        return torch.lerp(h, out.to(h.dtype), g.to(h.dtype))

    def gate(self, l: int, h: Tensor) -> Tensor:
        """The transform gate ``g_l = sigmoid(W_l h_l + b_l)`` ``[..., d]`` of sublayer ``l``."""
        return torch.sigmoid(self.gates[l](h))

    def _add(self, state: StreamState, l: int, output: Tensor) -> None:
        g = self.gate(l, state.h)
        if state.record_mixing:
            state.mixing_log.append(g.detach())
        state.h = self._carry(state.h, output, g)

    def _mixing_matrix(self, state: StreamState, per_channel: bool = False) -> MixingMatrix:
        """Carry products of the recorded gates (report §6.2), per token; ``weights`` is the
        mean over the ``d`` channels (each channel's matrix is 1-semiseparable)."""
        mean, full = carry_products(state.mixing_log, per_channel)
        return MixingMatrix(mean, input_dependent=True, per_channel=full,
                            reduction="mean over the d channels of the element-wise gates' carry products")

    def residual_flops_per_token(self) -> float:
        return float(self.n_sublayers * (3 * self.dim + 2 * self.dim * self.dim))  # the update and the gate projection


@dataclass
class DenseFormerState(ResidualState):
    """h: the stream; outputs: ``Y_0`` (the embedding) and the block outputs so far."""

    h: Tensor | None = None
    outputs: list[Tensor] | None = None


@register_residual("denseformer")
class DenseFormer(_Builtin, ResidualStream):
    """Depth-weighted averaging after every transformer block (two sublayers).

    Inside a block the residual is standard. After block ``i`` (1-based) the stream becomes
    ``sum_{j=0}^{i} alpha_{i,j} Y_j`` over the embedding ``Y_0`` and the block outputs
    ``Y_1 .. Y_i``; ``alpha_{i,i} = 1`` and all others 0 at init.
    """

    upcycles_exactly = True  # (alpha_{i,i} = 1, the rest 0: the standard residual at the start)

    def __init__(self, dim: int, n_sublayers: int) -> None:
        super().__init__(dim, n_sublayers)
        self.n_blocks = math.ceil(n_sublayers / 2)
        self.dwa = OneLineParameterList(nn.Parameter(torch.zeros(i + 2)) for i in range(self.n_blocks))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in self.dwa:
            with torch.no_grad():
                w.zero_()
                w[-1] = 1.0

    def _start(self, embedding: Tensor, common: dict[str, Any]) -> DenseFormerState:
        return DenseFormerState(h=embedding, outputs=[embedding], **common)

    def _input(self, state: DenseFormerState, l: int) -> Tensor:
        return state.h

    def _add(self, state: DenseFormerState, l: int, output: Tensor) -> None:
        h = state.h + output
        if l % 2 == 1 or l == self.n_sublayers - 1:  # end of a transformer block
            outputs = state.outputs
            outputs.append(h)
            w = self.dwa[len(outputs) - 2].to(h.dtype)
            h = outputs[0] * w[0]
            for j in range(1, len(outputs)):
                h = h + outputs[j] * w[j]
        state.h = h

    def _finish(self, state: DenseFormerState) -> Tensor:
        return state.h

    def residual_flops_per_token(self) -> float:
        L, d = self.n_sublayers, self.dim
        return float(L * d + sum(2 * (i + 2) * d for i in range(self.n_blocks)))  # the adds, then each average

    def _mixing_matrix(self, state: DenseFormerState, per_channel: bool = False) -> MixingMatrix:
        """The forward run on coefficient vectors over ``v_0 .. v_L``: the adds inside a block,
        the learned depth-weighted averages after it."""
        L = self.n_sublayers
        M = torch.zeros(L + 1, L + 1, dtype=MIXING_DTYPE, device=self.dwa[0].device)
        h = torch.zeros(L + 1, dtype=MIXING_DTYPE, device=M.device)
        h[0] = 1.0
        outputs = [h.clone()]
        for l in range(L):
            M[l] = h
            h = h.clone()
            h[l + 1] += 1.0
            if l % 2 == 1 or l == L - 1:
                outputs.append(h)
                w = self.dwa[len(outputs) - 2].detach().to(MIXING_DTYPE)
                h = sum(w[j] * outputs[j] for j in range(len(outputs)))
        M[L] = h
        return MixingMatrix(M, input_dependent=False)


def sinkhorn_knopp(logits: Tensor, iters: int = 20) -> Tensor:
    """Sinkhorn-Knopp projection ``[..., m, m] -> [..., m, m]``: ``exp`` then ``iters``
    alternations of column then row normalisation (mHC eq. 9), computed in log space for
    stability, in float32 or float64 (for float64 logits). Rows sum to 1 exactly (up to
    rounding); columns converge with ``iters``."""
    log_m = logits.to(compute_dtype(logits.dtype))
    for _ in range(iters):
        log_m = log_m - torch.logsumexp(log_m, dim=-2, keepdim=True)  # columns
        log_m = log_m - torch.logsumexp(log_m, dim=-1, keepdim=True)  # rows
    return log_m.exp()


@dataclass
class MultiStreamState(ResidualState):
    """H: the ``m`` streams ``[..., m, d]``; maps: the current sublayer's write-out weights
    and stream mixing, computed with its read-in weights."""

    H: Tensor | None = None
    maps: tuple[Tensor, Tensor] | None = None


class _MultiStream(_Builtin, ResidualStream):
    """``m`` residual streams ``H [..., m, d]``; subclasses give the read-in weights
    ``pre [..., m]``, the write-out weights ``post [..., m]`` and the stream mixing
    ``res [..., m, m]`` (``res[i, j]``: weight of old stream ``j`` in new stream ``i``)."""

    upcycles_exactly = False  # (m equal streams: the final norm reads their sum, its epsilon in effect / m^2)
    reads_fields = frozenset({"hc_streams"})

    def __init__(self, dim: int, n_sublayers: int, n_streams: int) -> None:
        super().__init__(dim, n_sublayers)
        if n_streams < 1:
            raise ValueError(f"n_streams must be >= 1, got {n_streams}")
        self.n_streams = n_streams

    @classmethod
    def from_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> _MultiStream:
        refuse_other_kind(cls, config)
        return cls(dim, n_sublayers, config.hc_streams)

    def _start(self, embedding: Tensor, common: dict[str, Any]) -> MultiStreamState:
        return MultiStreamState(H=embedding.unsqueeze(-2).expand(*embedding.shape[:-1], self.n_streams, self.dim), **common)

    def _input(self, state: MultiStreamState, l: int) -> Tensor:
        H = state.H
        pre, post, res = self._mappings(l, H)
        state.maps = (post, res)
        if state.record_mixing:
            state.mixing_log.append((pre.detach(), post.detach(), res.detach()))
        return torch.einsum("...m,...md->...d", pre.to(H.dtype), H)

    def _add(self, state: MultiStreamState, l: int, output: Tensor) -> None:
        H = state.H
        post, res = state.maps
        mixed = torch.einsum("...ij,...jd->...id", res.to(H.dtype), H)
        state.H = mixed + post.to(H.dtype).unsqueeze(-1) * output.unsqueeze(-2)

    def _finish(self, state: MultiStreamState) -> Tensor:
        return state.H.sum(dim=-2)

    def _mixing_matrix(self, state: MultiStreamState, per_channel: bool = False) -> MixingMatrix:
        """Eq. 10 of the report from the recorded maps, per token: read-in ``pre_l``
        (``alpha_l``), write-out ``post_l`` (``beta``), transitions ``res_l``; the embedding is
        written to every stream and the output aggregation reads their sum."""
        pre, post, res = zip(*state.mixing_log)
        ones = torch.ones_like(pre[0])
        return MixingMatrix(stream_products([*pre, ones], [ones, *post], res), input_dependent=True)

    def _mappings(self, l: int, H: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def _mapping_flops(self) -> int:
        """FLOPs per token of one sublayer's mapping projections."""
        raise NotImplementedError

    def residual_flops_per_token(self) -> float:
        """``2 m d`` to read, ``2 m^2 d`` to mix and ``2 m d`` to write the ``m`` streams, plus
        the mapping projections, per sublayer; the final sum of the streams."""
        m, d = self.n_streams, self.dim
        return float(self.n_sublayers * (2 * m * d + 2 * m * m * d + 2 * m * d + self._mapping_flops()) + m * d)


@register_residual("hyper_connections")
class HyperConnections(_MultiStream):
    """Dynamic Hyper-Connections with expansion rate ``m`` (Zhu et al. 2025)."""

    def __init__(self, dim: int, n_sublayers: int, n_streams: int = 4, eps: float = 1e-6) -> None:
        super().__init__(dim, n_sublayers, n_streams)
        m = n_streams
        self.eps = eps
        self.norm_weight = OneLineParameterList(nn.Parameter(torch.ones(dim)) for _ in range(n_sublayers))
        self.static_alpha = OneLineParameterList(nn.Parameter(torch.zeros(m, m + 1)) for _ in range(n_sublayers))
        self.static_beta = OneLineParameterList(nn.Parameter(torch.ones(m)) for _ in range(n_sublayers))
        self.dynamic_alpha = OneLineParameterList(nn.Parameter(torch.zeros(dim, m + 1)) for _ in range(n_sublayers))
        self.dynamic_beta = OneLineParameterList(nn.Parameter(torch.zeros(dim)) for _ in range(n_sublayers))
        self.alpha_scale = nn.Parameter(torch.full((n_sublayers,), 0.01))
        self.beta_scale = nn.Parameter(torch.full((n_sublayers,), 0.01))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        m = self.n_streams
        with torch.no_grad():
            for l in range(self.n_sublayers):
                a = self.static_alpha[l]
                a.zero_()
                a[l % m, 0] = 1.0  # A_m = e_{l mod m}
                a[:, 1:] = torch.eye(m)  # A_r = I
                self.static_beta[l].fill_(1.0)  # B = 1
                self.dynamic_alpha[l].zero_()
                self.dynamic_beta[l].zero_()
                self.norm_weight[l].fill_(1.0)
            self.alpha_scale.fill_(0.01)
            self.beta_scale.fill_(0.01)

    def _mappings(self, l: int, H: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c = compute_dtype(H.dtype)  # float32, or float64 for a float64 model
        Hn = F.rms_norm(H.to(c), (self.dim,), self.norm_weight[l].to(c), self.eps)  # [..., m, d]
        alpha = self.static_alpha[l] + self.alpha_scale[l] * torch.tanh(Hn @ self.dynamic_alpha[l].to(c))  # [..., m, m+1]
        beta = self.static_beta[l] + self.beta_scale[l] * torch.tanh(Hn @ self.dynamic_beta[l].to(c))  # [..., m]
        pre = alpha[..., 0]  # A_m: [..., m]
        res = alpha[..., 1:].transpose(-1, -2)  # new_i = sum_k A_r[k, i] H_k
        return pre, beta, res

    def _mapping_flops(self) -> int:
        m, d = self.n_streams, self.dim
        return 2 * m * d * (m + 2)  # dynamic alpha [d, m+1] and beta [d] on each stream


@register_residual("mhc")
class MHC(_MultiStream):
    """Manifold-constrained Hyper-Connections (Xie et al. 2026), ``m`` streams."""

    reads_fields = frozenset({"hc_streams", "sinkhorn_iters"})

    def __init__(self, dim: int, n_sublayers: int, n_streams: int = 4, sinkhorn_iters: int = 20, eps: float = 1e-6, alpha_init: float = 0.01) -> None:
        super().__init__(dim, n_sublayers, n_streams)
        m = n_streams
        self.eps = eps
        self.alpha_init = alpha_init
        self.sinkhorn_iters = sinkhorn_iters
        self.n_res = self._n_res_logits()
        # One projection per sublayer from the flattened m*d stream to [pre | post | res].
        self.phi = OneLineParameterList(nn.Parameter(torch.zeros(m * dim, 2 * m + self.n_res)) for _ in range(n_sublayers))
        self.bias = OneLineParameterList(nn.Parameter(torch.zeros(2 * m + self.n_res)) for _ in range(n_sublayers))
        self.alpha = nn.Parameter(torch.full((n_sublayers, 3), alpha_init))
        self.reset_parameters()

    @classmethod
    def from_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> MHC:
        refuse_other_kind(cls, config)
        return cls(dim, n_sublayers, config.hc_streams, sinkhorn_iters=config.sinkhorn_iters)

    def _n_res_logits(self) -> int:
        return self.n_streams**2

    def _mapping_flops(self) -> int:
        m, d = self.n_streams, self.dim
        return 2 * m * d * (2 * m + self.n_res) + 3 * m * d  # phi on the normalised flat stream

    def reset_parameters(self) -> None:
        m = self.n_streams
        with torch.no_grad():
            for l in range(self.n_sublayers):
                self.phi[l].zero_()
                b = self.bias[l]
                b.zero_()
                b[:m] = math.log(1.0 / m) - math.log(1 - 1.0 / m) if m > 1 else 10.0  # sigmoid(b_pre) = 1/m
                # b_post = 0 -> H_post = 2 sigmoid(0) = 1; b_res = 0.
            self.alpha.fill_(self.alpha_init)

    def residual_matrix(self, logits: Tensor) -> Tensor:
        """``[..., n_res] -> [..., m, m]`` doubly stochastic."""
        m = self.n_streams
        return sinkhorn_knopp(logits.reshape(*logits.shape[:-1], m, m), self.sinkhorn_iters)

    def _mappings(self, l: int, H: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        m = self.n_streams
        c = compute_dtype(H.dtype)  # float32, or float64 for a float64 model
        flat = H.to(c).reshape(*H.shape[:-2], m * self.dim)
        x = flat * torch.rsqrt(flat.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        z = x @ self.phi[l].to(c)
        a = self.alpha[l].to(c)
        b = self.bias[l].to(c)
        pre = torch.sigmoid(a[0] * z[..., :m] + b[:m])
        post = 2 * torch.sigmoid(a[1] * z[..., m : 2 * m] + b[m : 2 * m])
        res = self.residual_matrix(a[2] * z[..., 2 * m :] + b[2 * m :])
        return pre, post, res


def _fake_mode() -> bool:
    """Whether a ``FakeTensorMode`` is active: tensors made now are fake (no values to keep)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


@register_residual("mhc_lite")
class MHCLite(MHC):
    """mHC-lite (Yang & Gao 2026): ``H_res = sum_k softmax(logits)_k P_k`` over all ``m!``
    permutation matrices ``P_k`` - doubly stochastic by construction, no iterations."""

    reads_fields = frozenset({"hc_streams"})  # (not mHC's sinkhorn_iters: it has none)

    def __init__(self, dim: int, n_sublayers: int, n_streams: int = 4, eps: float = 1e-6, alpha_init: float = 0.01) -> None:
        if n_streams > 6:
            raise ValueError(f"mHC-lite enumerates m! permutations; n_streams must be <= 6, got {n_streams}")
        # The permutations are rebuilt from this index list where they are needed, not kept
        # as a buffer: a loader that materialises modules from the meta device (transformers)
        # would leave a non-persistent buffer uninitialised.
        self._perms = tuple(itertools.permutations(range(n_streams)))
        super().__init__(dim, n_sublayers, n_streams, sinkhorn_iters=0, eps=eps, alpha_init=alpha_init)

    @classmethod
    def from_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> MHCLite:
        refuse_other_kind(cls, config)
        return cls(dim, n_sublayers, config.hc_streams)

    @classmethod
    def check_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> None:
        super().check_config(config, dim, n_sublayers)
        if config.hc_streams > 6:
            raise ValueError("ModelConfig.residual.hc_streams must be <= 6 for mhc_lite (it enumerates all hc_streams! "
                             f"permutations); got {config.hc_streams}")

    def _n_res_logits(self) -> int:
        return len(self._perms)

    def permutation_matrices(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """All ``m!`` permutation matrices, ``[m!, m, m]``."""
        return torch.eye(self.n_streams, device=device, dtype=dtype)[self._permutation_index(device)]

    def _permutation_index(self, device: torch.device) -> Tensor:
        """The permutations as an index ``[m!, m]`` on ``device``, made once per device and
        kept (not a buffer: see ``__init__``). Made from the Python tuples at every forward,
        it was a host-to-device copy per sublayer: on CUDA a wait for the GPU each time, and
        what a CUDA graph's capture refuses - ``generate``'s default decode there failed. A
        traced forward makes it a constant of its graph. Under a ``FakeTensorMode`` it is made
        fake for the call and not kept, and a kept real one is not read: it met the fake
        matrices ("Please convert all Tensors to FakeTensors first")."""
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or _fake_mode():
            return torch.tensor(self._perms, device=device)
        kept = self.__dict__.get("_permutation_indices", {})
        if device not in kept:
            with torch.inference_mode(False):  # (a plain tensor, read in and out of inference mode)
                index = torch.tensor(self._perms, device=device)
            self.__dict__["_permutation_indices"] = kept = {**kept, device: index}
        return kept[device]

    def __getstate__(self) -> dict[str, Any]:
        # (the kept indices are not saved: unpickled with map_location="cpu", a CUDA model's
        # index would be a CPU tensor under the key cuda:0 - moved back to the GPU, a copy at
        # every forward and a refused CUDA graph capture. Made again at the first forward.)
        state = super().__getstate__()
        state.pop("_permutation_indices", None)
        return state

    def residual_matrix(self, logits: Tensor) -> Tensor:
        weights = torch.softmax(logits.to(compute_dtype(logits.dtype)), dim=-1)  # [..., m!]
        return torch.einsum("...k,kij->...ij", weights, self.permutation_matrices(weights.device, weights.dtype))
