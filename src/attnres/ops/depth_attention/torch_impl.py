"""The PyTorch implementation of the depth-attention operations: forward functions that
return what the backward needs, and analytic backward functions - the decomposition every
implementation shares (docs/kernels.md, "One backward decomposition").

Logits (report §3.1, key-norm gain folded into the query): ``z = r (x . qg)`` with
``r = 1 / rms(x)``; through them ``d x += dz (r qg - (r^2 z / d) x)`` and ``d qg += dz r x``.

* ``phase1``: saves the queries, the log-sum-exp and references to the sources (kept
  anyway: later sublayers read them). The backward recomputes the RMS factors, logits and
  weights ``p = exp(z - lse)`` from them; ``d x_i = sum_s p_si g_s`` (plus the logits' term)
  and ``d z_si = p_si (g_s . x_i - sum_j p_sj g_s . x_j + g_lse_s)``.
* ``merge``: saves the softmax weights ``alpha`` over the ``k + c`` sources, the computed
  sources' logits and RMS factors, the norm's ``1/rms`` and references to the inputs; the
  norm's input ``h`` is recomputed from the sources (one pass per source). With ``g_h`` the
  gradient reaching ``h`` through the norm: ``d z_j = alpha_j (g_h . x_j - g_h . h)``,
  ``d x_j = alpha_j g_h`` (plus the logits' term for a computed source).

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

from .reference import compute_dtype, full_precision, rms_inverse, stream_dtype, weighted_sum

__all__ = ["phase1_forward", "phase1_backward", "merge_forward", "merge_backward"]


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


def _logits(x: Tensor, qg: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``x [..., d]`` against ``qg [K, d]`` -> ``(z [..., K], r [...])`` in the compute dtype."""
    xc = _as(x, compute_dtype(x.dtype))
    r = rms_inverse(xc, eps)
    return F.linear(xc, _as(qg, xc.dtype)) * r.unsqueeze(-1), r


def _logits_grad(gz: Tensor, x: Tensor, z: Tensor, r: Tensor, qg: Tensor, scratch: Tensor) -> Tensor:
    """Through ``z [..., K] = r (x . qg_k)``: ``d x = r (gz @ qg) - (r^2 / d) (gz . z) x``, in
    the compute dtype (``scratch`` unused by the result)."""
    xc = _as(x, r.dtype)
    gx = (gz * r.unsqueeze(-1)) @ _as(qg, r.dtype)
    coef = r * r * (gz * z).sum(dim=-1) / x.shape[-1]
    return gx.addcmul_(xc, coef.unsqueeze(-1), value=-1)


# ----------------------------------------------------------------------------------------
# phase1
# ----------------------------------------------------------------------------------------


def phase1_forward(qg: Tensor, sources: Sequence[Tensor], eps: float, out_dtype=None) -> tuple[list[Tensor], Tensor]:
    """``qg [S, d]`` over ``n`` sources -> ``S`` weighted sums ``[..., d]`` (in ``out_dtype``,
    by default the sources') and ``lse [..., S]``."""
    with full_precision(sources[0]):
        z = torch.stack([_logits(x, qg, eps)[0] for x in sources], dim=-1)  # [..., S, n]
        lse = torch.logsumexp(z, dim=-1)
        p = torch.exp(z - lse.unsqueeze(-1))
        dtype = out_dtype or sources[0].dtype
        return [_as(weighted_sum(p[..., s, :], sources), dtype) for s in range(z.shape[-2])], lse


def phase1_backward(qg, lse, sources, g_outs, g_lse, eps: float, needs_qg: bool, needs_sources: Sequence[bool]):
    """``(d qg, [d source...])``, ``None`` where not needed."""
    compute = compute_dtype(sources[0].dtype)
    with full_precision(sources[0]):
        zr = [_logits(x, qg, eps) for x in sources]
        z = torch.stack([zi for zi, _ in zr], dim=-1)  # [..., S, n]
        p = torch.exp(z - _as(lse, compute).unsqueeze(-1))
        present = [(s, _as(g, compute)) for s, g in enumerate(g_outs) if g is not None]
        dots = torch.zeros_like(p)  # [..., S, n]: g_s . x_i
        scratch = torch.empty_like(_as(sources[0], compute))
        for s, g in present:
            for i, x in enumerate(sources):
                _dot(g, x, scratch, out=dots[..., s, i])
        dz = p * (dots - (p * dots).sum(dim=-1, keepdim=True))
        if g_lse is not None:
            dz.addcmul_(p, _as(g_lse, compute).unsqueeze(-1))
        g_src = []
        for i, x in enumerate(sources):
            if not needs_sources[i]:
                g_src.append(None)
                continue
            gx = _logits_grad(dz[..., :, i], x, zr[i][0], zr[i][1], qg, scratch)
            for s, g in present:
                gx.addcmul_(g, p[..., s, i : i + 1])
            g_src.append(_as(gx, x.dtype))
        g_qg = None
        if needs_qg:
            g_qg = sum((dz[..., :, i] * r.unsqueeze(-1)).reshape(-1, qg.shape[0]).t()
                       @ _as(x, compute).reshape(-1, qg.shape[1]) for i, (x, (_, r)) in enumerate(zip(sources, zr)))
            g_qg = _as(g_qg, qg.dtype)
    return g_qg, g_src


# ----------------------------------------------------------------------------------------
# merge
# ----------------------------------------------------------------------------------------


def merge_forward(z, sources, computed, qg, norm_weight, eps: float, norm_eps: float, addend=None, out_dtype=None):
    """``(out, alpha, rc, zc, rstd, total)``, ``None`` where absent (see the module docstring
    and :func:`.reference.merge`; ``total``: the last computed source plus ``addend``, which
    replaces it; ``out`` in ``out_dtype``, by default the stream's)."""
    total = None
    if addend is not None:
        total = computed[-1] + addend
        computed = [*computed[:-1], total]
    x0, dtype = (list(sources) + list(computed))[0], stream_dtype(sources, computed)
    compute = compute_dtype(dtype)
    with full_precision(x0):
        logits, rc = [_as(z, compute)], []
        for x in computed:  # each computed source's logit for this query, and its RMS factor
            zj, rj = _logits(x, qg.unsqueeze(0), eps)
            logits.append(zj)
            rc.append(rj)
        alpha = torch.softmax(torch.cat(logits, dim=-1), dim=-1)  # [..., k + c]
        h = weighted_sum(alpha, [*sources, *computed])
        rstd = None
        if norm_weight is not None:
            if dtype != compute:  # the norm reads the stream's value, rounded to its dtype
                h = h.to(dtype).to(compute)
            rstd = torch.rsqrt(torch.linalg.vector_norm(h, dim=-1, keepdim=True).square_().div_(h.shape[-1]).add_(norm_eps))
            h = h * rstd * _as(norm_weight, compute)
    zc = torch.cat(logits[1:], dim=-1) if computed else None
    return _as(h, out_dtype or dtype), alpha, (torch.stack(rc, dim=-1) if computed else None), zc, rstd, total


def _norm_backward(g, h, rstd, norm_weight, need_weight: bool, scratch):
    """Through ``y = h rstd w``: ``(d h, d w)`` with ``d h = rstd (u - (rstd^2 / d) (u . h) h)``,
    ``u = g w``."""
    g_norm = _token_sum(rstd, torch.mul(g, h, out=scratch)).to(norm_weight.dtype) if need_weight else None
    u = g * _as(norm_weight, g.dtype)
    gh = u.addcmul_(h, rstd * rstd * _dot(u, h, scratch).unsqueeze(-1) / h.shape[-1], value=-1).mul_(rstd)
    return gh, g_norm


def merge_backward(g, alpha, rc, zc, rstd, sources, computed, qg, norm_weight, needs: Sequence[bool],
                   g_total=None, addend_dtype=None, g_views: Sequence[Tensor] = ()):
    """``needs``: whether ``(z, *sources, *computed, qg, norm_weight)`` need their gradient.
    Returns ``(g_z, [g_source...], [g_computed...], g_qg, g_norm, g_addend)``, ``None``
    where not needed. ``g_total``: the gradient reaching the last computed source from
    elsewhere (the sum the forward formed with an addend), added to its gradient;
    ``addend_dtype``: the addend's dtype where it differs from the sources' - ``g_addend`` is
    then the last computed source's gradient in it (else ``None``); ``g_views``: the
    gradients of the views of ``out`` handed to its other readers, added to ``g`` in the
    compute dtype."""
    compute, k, c = alpha.dtype, len(sources), len(computed)
    srcs = [*sources, *computed]
    needs_z, needs_x, (needs_qg, needs_norm) = needs[0], needs[1 : 1 + k + c], needs[1 + k + c :]
    with full_precision(g):
        gh = readers_grad(g, g_views, compute)
        scratch = torch.empty_like(gh)
        g_norm = None
        if norm_weight is not None:  # recompute h, the norm's input
            h = weighted_sum(alpha, srcs)
            stream = stream_dtype(sources, computed)
            if stream != compute:
                h = h.to(stream).to(compute)
            # (the rounding of h passes the gradient straight through, in the compute dtype:
            # rounding g_h too would put bf16 noise into every logit's and query's gradient)
            gh, g_norm = _norm_backward(gh, h, rstd, norm_weight, needs_norm, scratch)
        # softmax: dz_j = alpha_j (gh . x_j - gh . h), gh . h = sum_j alpha_j (gh . x_j)
        s = alpha.new_empty((len(srcs), *alpha.shape[:-1]))  # [m, ...]: one row per source, no stack
        for j, x in enumerate(srcs):
            _dot(gh, x, scratch, out=s[j])
        s = s.movedim(0, -1)
        gz_all = alpha * (s - (alpha * s).sum(dim=-1, keepdim=True))
        grads = [gh * alpha[..., j : j + 1] if needs_x[j] else None for j in range(k + c)]
        g_qg = None
        for j, x in enumerate(computed):
            gr = gz_all[..., k + j] * rc[..., j]  # d zc_j r_j
            if needs_x[k + j]:  # d zc / d x = r qg - (r^2 zc / d) x, plus the direct weight
                grads[k + j].addcmul_(gr.unsqueeze(-1), _as(qg, compute))
                grads[k + j].addcmul_(_as(x, compute), (gr * rc[..., j] * zc[..., j] / x.shape[-1]).unsqueeze(-1),
                                      value=-1)
            if needs_qg:
                g_qg = _token_sum(gr, _as(x, compute)) + (0 if g_qg is None else g_qg)
    grads = [None if gx is None else _as(gx, x.dtype) for gx, x in zip(grads, srcs)]
    if g_total is not None and grads[-1] is not None:
        grads[-1] = grads[-1] + g_total
    g_z = gz_all[..., :k].contiguous() if needs_z else None
    return (g_z, grads[:k], grads[k:], (None if g_qg is None else _as(g_qg, qg.dtype)), g_norm,
            addend_grad(grads[-1], addend_dtype))


def readers_grad(g: Tensor, g_views: Sequence[Tensor], compute: torch.dtype) -> Tensor:
    """The gradient of a merge's output: ``g`` and the other readers' ``g_views`` added in
    ``compute`` (``g`` itself, converted, without views)."""
    total = _as(g, compute)
    for gv in g_views:
        total = total + gv if total is g else total.add_(gv)  # (never in place on g)
    return total


def addend_grad(g_last: Tensor | None, addend_dtype: torch.dtype | None) -> Tensor | None:
    """The addend's gradient, the last computed source's ``g_last`` in ``addend_dtype``
    (``None`` without one of them)."""
    return None if g_last is None or addend_dtype is None else g_last.to(addend_dtype)
