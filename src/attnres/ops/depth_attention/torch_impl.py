"""The PyTorch implementation of the depth-attention operations: forward functions that
return what the backward needs, and analytic backward functions - the decomposition every
implementation shares (docs/kernels.md, "One backward decomposition").

Saved, per operation (report §4.2; docs/design.md "What is saved for the backward"):

* ``rms_logits``: the source ``x`` (kept anyway: later sublayers read it), the queries and
  one RMS factor ``r`` per token; ``d x = r u - (r^3 (x . u) / d) x`` with
  ``u = sum_k gz_k qg_k``, ``d qg_k = sum_t gz_tk r_t x_t``.
* ``phase1``: the logits, the log-sum-exp and references to the sources; the weights are
  recomputed as ``exp(z - lse)``; ``d x_i = sum_s p_si g_s`` and
  ``d z_si = p_si (g_s . x_i - sum_j p_sj g_s . x_j + g_lse_s)``.
* ``merge``: the softmax weights ``alpha`` over the ``n (+1)`` sources, the partial sum's
  logit and RMS factor, the norm's ``1/rms`` and references to the inputs; the norm's input
  ``h`` is recomputed from the sources (one pass per source).
  With ``g_h`` the gradient reaching ``h`` through the norm: ``d z_j = alpha_j (g_h . x_j -
  g_h . h)``, ``d x_j = alpha_j g_h``; the partial sum's logit adds
  ``d zb (r_b qg - (r_b^2 zb / d) b)`` to its gradient and ``d zb r_b b`` to ``qg``'s.

The functions take and return plain tensors (``None`` where absent or not needed); the
custom operators of :mod:`.library` call them. The backward functions write every
``[..., d]`` product that is not returned into one scratch buffer: on CPU a fresh buffer per
dot product costs more than the product.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference import compute_dtype, full_precision, rms_inverse, weighted_sum

__all__ = [
    "rms_logits_forward",
    "rms_logits_backward",
    "phase1_forward",
    "phase1_backward",
    "merge_forward",
    "merge_backward",
]


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _dot(a: Tensor, b: Tensor, scratch: Tensor, out: Tensor | None = None) -> Tensor:
    """``sum(a * b, -1)`` in ``a``'s dtype (``b`` is cast to it): ``[..., d] -> [...]``,
    the product in ``scratch``."""
    torch.mul(a, _as(b, a.dtype), out=scratch)
    return torch.sum(scratch, dim=-1) if out is None else torch.sum(scratch, dim=-1, out=out)


def _token_sum(weights: Tensor, x: Tensor) -> Tensor:
    """``sum over tokens of weights[...] * x[..., d]`` -> ``[d]``: one matrix-vector product."""
    return weights.reshape(-1) @ x.reshape(-1, x.shape[-1])


# ----------------------------------------------------------------------------------------
# rms_logits
# ----------------------------------------------------------------------------------------


def rms_logits_forward(x: Tensor, qg: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``x [..., d]``, ``qg [K, d]`` -> ``z [..., K]`` and ``r = 1 / rms(x)`` ``[...]``."""
    compute = compute_dtype(x.dtype)
    with full_precision(x):
        xc = _as(x, compute)
        r = rms_inverse(xc, eps)
        return F.linear(xc, _as(qg, compute)) * r.unsqueeze(-1), r


def rms_logits_backward(gz: Tensor, x: Tensor, qg: Tensor, r: Tensor, needs_x: bool, needs_qg: bool):
    compute = r.dtype
    with full_precision(x):
        gz, xc, q = _as(gz, compute), _as(x, compute), _as(qg, compute)
        gr = gz * r.unsqueeze(-1)  # [..., K]
        gx = gq = None
        if needs_x:
            u = gr @ q  # [..., d]: r sum_k gz_k q_k
            gx = _as(u.addcmul_(xc, (r * r * _dot(u, xc, torch.empty_like(u)) / x.shape[-1]).unsqueeze(-1), value=-1),
                     x.dtype)
        if needs_qg:
            gq = _as(gr.reshape(-1, gr.shape[-1]).t() @ xc.reshape(-1, x.shape[-1]), qg.dtype)
    return gx, gq


# ----------------------------------------------------------------------------------------
# phase1
# ----------------------------------------------------------------------------------------


def phase1_forward(z: Tensor, sources: Sequence[Tensor]) -> tuple[list[Tensor], Tensor]:
    """``z [..., S, n]`` -> ``S`` weighted sums ``[..., d]`` (sources' dtype) and ``lse [..., S]``."""
    with full_precision(z):
        z = _as(z, compute_dtype(sources[0].dtype))
        lse = torch.logsumexp(z, dim=-1)
        p = torch.exp(z - lse.unsqueeze(-1))
        return [_as(weighted_sum(p[..., s, :], sources), sources[0].dtype) for s in range(z.shape[-2])], lse


def phase1_backward(z, lse, sources, g_outs, g_lse, needs_z: bool, needs_sources: Sequence[bool]):
    compute, z_dtype, n = compute_dtype(sources[0].dtype), z.dtype, len(sources)
    with full_precision(z):
        p = torch.exp(_as(z, compute) - _as(lse, compute).unsqueeze(-1))  # [..., S, n]
        present = [(s, _as(g, compute)) for s, g in enumerate(g_outs) if g is not None]
        g_src = []
        for i, x in enumerate(sources):
            if not needs_sources[i] or not present:
                g_src.append(torch.zeros_like(x) if needs_sources[i] else None)
                continue
            gx = present[0][1] * p[..., present[0][0], i : i + 1]
            for s, g in present[1:]:
                gx.addcmul_(g, p[..., s, i : i + 1])
            g_src.append(_as(gx, x.dtype))
        g_z = None
        if needs_z:
            dots = torch.zeros_like(p)  # [..., S, n]: g_s . x_i
            if present:
                scratch = torch.empty_like(present[0][1])
                for s, g in present:
                    for i, x in enumerate(sources):
                        _dot(g, x, scratch, out=dots[..., s, i])
            g_z = p * (dots - (p * dots).sum(dim=-1, keepdim=True))
            if g_lse is not None:
                g_z.addcmul_(p, _as(g_lse, compute).unsqueeze(-1))
            g_z = _as(g_z, z_dtype)
    return g_z, g_src


# ----------------------------------------------------------------------------------------
# merge
# ----------------------------------------------------------------------------------------


def merge_forward(z, sources, partial, qg, norm_weight, eps: float, norm_eps: float):
    """``(out, alpha, r_b, zb, rstd)``, ``None`` where absent (see the module docstring and
    :func:`.reference.merge`)."""
    compute, dtype = compute_dtype(sources[0].dtype), sources[0].dtype
    with full_precision(sources[0]):
        zc, srcs = _as(z, compute), list(sources)
        r_b = zb = rstd = None
        if partial is not None:  # the partial sum's logit for this query, and its RMS factor
            pc = _as(partial, compute)
            r_b = rms_inverse(pc, eps)
            zb = (pc @ _as(qg, compute)) * r_b
            zc = torch.cat([zc, zb.unsqueeze(-1)], dim=-1)
            srcs.append(partial)
        alpha = torch.softmax(zc, dim=-1)  # [..., n (+1)]
        h = weighted_sum(alpha, srcs)
        if norm_weight is not None:
            if dtype != compute:  # the norm reads the stream's value, rounded to its dtype
                h = h.to(dtype).to(compute)
            rstd = torch.rsqrt(torch.linalg.vector_norm(h, dim=-1, keepdim=True).square_().div_(h.shape[-1]).add_(norm_eps))
            h = h * rstd * _as(norm_weight, compute)
    return _as(h, dtype), alpha, r_b, zb, rstd


def _norm_backward(g, h, rstd, norm_weight, need_weight: bool, scratch):
    """Through ``y = h rstd w``: ``(d h, d w)`` with ``d h = rstd (u - (rstd^2 / d) (u . h) h)``,
    ``u = g w``."""
    g_norm = _token_sum(rstd, torch.mul(g, h, out=scratch)).to(norm_weight.dtype) if need_weight else None
    u = g * _as(norm_weight, g.dtype)
    gh = u.addcmul_(h, rstd * rstd * _dot(u, h, scratch).unsqueeze(-1) / h.shape[-1], value=-1).mul_(rstd)
    return gh, g_norm


def merge_backward(g, alpha, r_b, zb, rstd, sources, partial, qg, norm_weight, needs: Sequence[bool]):
    """``needs``: whether ``(z, *sources, partial, qg, norm_weight)`` need their gradient.
    Returns ``(g_z, [g_source...], g_partial, g_qg, g_norm)``, ``None`` where not needed."""
    compute, dtype, n = alpha.dtype, sources[0].dtype, len(sources)
    needs_z, needs_src, (needs_partial, needs_qg, needs_norm) = needs[0], needs[1 : n + 1], needs[n + 1 :]
    srcs = list(sources) + ([partial] if partial is not None else [])
    with full_precision(g):
        gh = _as(g, compute)
        scratch = torch.empty_like(gh)
        g_norm = None
        if norm_weight is not None:  # recompute h, the norm's input
            h = weighted_sum(alpha, srcs)
            if dtype != compute:
                h = h.to(dtype).to(compute)
            gh, g_norm = _norm_backward(gh, h, rstd, norm_weight, needs_norm, scratch)
            if dtype != compute:  # the backward of that rounding
                gh = gh.to(dtype).to(compute)
        # softmax: dz_j = alpha_j (gh . x_j - gh . h), gh . h = sum_j alpha_j (gh . x_j)
        s = alpha.new_empty((len(srcs), *alpha.shape[:-1]))  # [m, ...]: one row per source, no stack
        for j, x in enumerate(srcs):
            _dot(gh, x, scratch, out=s[j])
        s = s.movedim(0, -1)
        gz_all = alpha * (s - (alpha * s).sum(dim=-1, keepdim=True))
        g_src = [_as(gh * alpha[..., j : j + 1], x.dtype) if needs_src[j] else None for j, x in enumerate(sources)]
        g_partial = g_qg = None
        if partial is not None:
            gr = gz_all[..., -1] * r_b  # d zb r_b
            pc = _as(partial, compute)
            if needs_partial:  # d zb / d b = r q - (r^2 zb / d) b, plus the direct weight alpha_b
                g_partial = (gh * alpha[..., -1:]).addcmul_(gr.unsqueeze(-1), _as(qg, compute))
                g_partial = _as(g_partial.addcmul_(pc, (gr * r_b * zb / pc.shape[-1]).unsqueeze(-1), value=-1),
                                partial.dtype)
            if needs_qg:
                g_qg = _as(_token_sum(gr, pc), qg.dtype)
            gz_all = gz_all[..., :-1].contiguous()
    return (gz_all if needs_z else None), g_src, g_partial, g_qg, g_norm
