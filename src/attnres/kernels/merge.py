"""Full AttnRes Phase 2 as one fused kernel: merge a Phase-1 result with ``k`` sources,
optionally with the next sublayer's RMSNorm fused in.

For every token row, given the normalised Phase-1 result ``o_hat`` with statistics ``m`` and
``sumexp``, and ``k >= 0`` intra-group sources ``X[j]`` with their logits ``z[:, j]``
(computed by one matmul when each source was produced):

    t_0 = m + log(sumexp),  t_j = z_j;   w = softmax(t)   (over 1 + k entries)
    h = w_0 o_hat + sum_j w_j X[j]
    y = RMSNorm(h) * gain                   # only with ``norm_weight``: the sublayer's input

(``k = 0`` is the first sublayer of a group: ``h = o_hat``, and the kernel is the norm.)
Backward, with ``g`` the gradient reaching ``h`` (through the norm, see
:mod:`attnres.kernels.norm_tiles`), ``u_0 = g . o_hat``, ``u_j = g . X[j]`` and
``u = sum_i w_i u_i``: ``d o_hat = w_0 g``, ``d X[j] = w_j g``, ``d z_j = w_j (u_j - u)``,
``d m = w_0 (u_0 - u)``, ``d sumexp = d m / sumexp``. The PyTorch reference is
``attnres.ops.merge_with_sources`` followed by :class:`attnres.nn.RMSNorm`; ``h`` is never
written (the backward recomputes it from the inputs it reads anyway).

Shapes: ``o_hat [M, d]`` (float32), ``m, sumexp [M]``, ``X [k, M, d]``, ``z [M, k]``,
``norm_weight [d]``; returns ``h`` (or ``y``) ``[M, d]`` and ``w [M, 1 + k]``.
Tiling and programs: as in :mod:`attnres.kernels.phase2`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .launch import next_power_of_2, nonempty, num_warps, row_ranges, tile_d
from .norm_tiles import (
    gain_dy_h,
    inverse_rms,
    load_f32,
    norm_backward_tile,
    norm_grad_coef,
    tile_of,
)

__all__ = ["merge_sources"]


@triton.jit
def _merged_tile(O, X, Wt, row, cols, mask, k, stride_o, stride_xk, stride_xm, stride_w):
    """``h`` on one tile of one row, from the weights ``Wt [M, 1 + k]``."""
    h = tl.load(Wt + row * stride_w) * load_f32(O + row * stride_o, cols, mask)
    for j in range(k):
        x = load_f32(X + j * stride_xk + row * stride_xm, cols, mask)
        h += tl.load(Wt + row * stride_w + 1 + j) * x
    return h


@triton.jit
def _merge_weights(Zs, Mx, Lx, Wt, row, k, stride_z, stride_w):
    """Softmax over ``[m + log(sumexp), z_1 .. z_k]`` of one row, written to ``Wt``."""
    t0 = tl.load(Mx + row).to(tl.float32) + tl.log(tl.load(Lx + row).to(tl.float32))
    mx = t0
    for j in range(k):
        mx = tl.maximum(mx, tl.load(Zs + row * stride_z + j).to(tl.float32))
    den = tl.exp(t0 - mx)
    for j in range(k):
        den += tl.exp(tl.load(Zs + row * stride_z + j).to(tl.float32) - mx)
    tl.store(Wt + row * stride_w, tl.exp(t0 - mx) / den)
    for j in range(k):
        tl.store(Wt + row * stride_w + 1 + j, tl.exp(tl.load(Zs + row * stride_z + j).to(tl.float32) - mx) / den)


@triton.jit
def _merge_fwd(
    O, X, Zs, Mx, Lx, Gain, Out, Wt, Rstd, d, k, norm_eps,
    stride_o, stride_xk, stride_xm, stride_z, stride_out, stride_w,
    BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
):
    row = tl.program_id(0)
    _merge_weights(Zs, Mx, Lx, Wt, row, k, stride_z, stride_w)
    # The tiles below read back the weights this program just wrote.
    tl.debug_barrier()
    rstd = 1.0
    if HAS_NORM:
        sum_hh = tl.zeros([BLOCK_D], dtype=tl.float32)
        for start in range(0, d, BLOCK_D):
            cols, mask = tile_of(start, d, BLOCK_D)
            h = _merged_tile(O, X, Wt, row, cols, mask, k, stride_o, stride_xk, stride_xm, stride_w)
            sum_hh += h * h
        rstd = inverse_rms(tl.sum(sum_hh, axis=0), d, norm_eps)
        tl.store(Rstd + row, rstd)
    for start in range(0, d, BLOCK_D):
        cols, mask = tile_of(start, d, BLOCK_D)
        h = _merged_tile(O, X, Wt, row, cols, mask, k, stride_o, stride_xk, stride_xm, stride_w)
        if HAS_NORM:
            h = h * rstd * load_f32(Gain, cols, mask)
        tl.store(Out + row * stride_out + cols, h.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _merge_bwd(
    G, O, X, Wt, Gain, Rstd, Lx, GO, GX, GZ, GM, GL, PGain, rows, d, k, rows_per_program,
    stride_g, stride_o, stride_xk, stride_xm, stride_w, stride_go, stride_gxk, stride_gxm, stride_gz,
    K_PAD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
):
    pid = tl.program_id(0)
    ks = tl.arange(0, K_PAD)
    kmask = ks < k
    first = pid * rows_per_program
    for row in range(first, tl.minimum(first + rows_per_program, rows)):
        g_row = G + row * stride_g
        w0 = tl.load(Wt + row * stride_w)
        wk = tl.load(Wt + row * stride_w + 1 + ks, mask=kmask, other=0.0)
        rstd = 1.0
        coef = 0.0
        if HAS_NORM:
            rstd = tl.load(Rstd + row)
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for start in range(0, d, BLOCK_D):
                cols, mask = tile_of(start, d, BLOCK_D)
                h = _merged_tile(O, X, Wt, row, cols, mask, k, stride_o, stride_xk, stride_xm, stride_w)
                acc += gain_dy_h(Gain, g_row, h, cols, mask)
            coef = norm_grad_coef(tl.sum(acc, axis=0), rstd, d)
        # u_0 = g . o_hat and u_j = g . X[j], with g the gradient reaching h; dX, d o_hat.
        acc_u0 = tl.zeros([BLOCK_D], dtype=tl.float32)
        uk = tl.zeros([K_PAD], dtype=tl.float32)
        for start in range(0, d, BLOCK_D):
            cols, mask = tile_of(start, d, BLOCK_D)
            g = load_f32(g_row, cols, mask)
            if HAS_NORM:
                h = _merged_tile(O, X, Wt, row, cols, mask, k, stride_o, stride_xk, stride_xm, stride_w)
                g = norm_backward_tile(g, h, Gain, PGain + pid * d, cols, mask, rstd, coef)
            acc_u0 += g * load_f32(O + row * stride_o, cols, mask)
            tl.store(GO + row * stride_go + cols, (w0 * g).to(GO.dtype.element_ty), mask=mask)
            for j in range(k):
                x = load_f32(X + j * stride_xk + row * stride_xm, cols, mask)
                uk += tl.where(ks == j, tl.sum(g * x, axis=0), 0.0)
                wj = tl.load(Wt + row * stride_w + 1 + j)
                tl.store(GX + j * stride_gxk + row * stride_gxm + cols, (wj * g).to(GX.dtype.element_ty), mask=mask)
        u0 = tl.sum(acc_u0, axis=0)
        ubar = w0 * u0 + tl.sum(wk * uk, axis=0)
        tl.store(GZ + row * stride_gz + ks, wk * (uk - ubar), mask=kmask)
        gm = w0 * (u0 - ubar)
        tl.store(GM + row, gm)
        tl.store(GL + row, gm / tl.load(Lx + row).to(tl.float32))


@torch.library.custom_op("attnres::merge_sources_fwd", mutates_args=())
def _fwd_op(
    o_hat: Tensor, m: Tensor, sumexp: Tensor, X: Tensor, z: Tensor, gain: Tensor | None,
    norm_eps: float, out_dtype: torch.dtype, block_d: int, max_programs: int,
) -> tuple[Tensor, Tensor, Tensor]:
    # max_programs (0: the default) bounds the backward's programs; unused here.
    k, rows, d = X.shape
    out = torch.empty(rows, d, device=o_hat.device, dtype=out_dtype)
    w = torch.empty(rows, 1 + k, device=o_hat.device, dtype=torch.float32)
    rstd = torch.empty(rows, device=o_hat.device, dtype=torch.float32)
    _merge_fwd[(rows,)](
        o_hat, nonempty(X, o_hat), nonempty(z, m), m, sumexp, o_hat if gain is None else gain, out, w, rstd, d, k, norm_eps,
        o_hat.stride(0), X.stride(0), X.stride(1), z.stride(0), out.stride(0), w.stride(0),
        BLOCK_D=block_d, HAS_NORM=gain is not None, num_warps=num_warps(block_d),
    )
    return out, w, rstd


@_fwd_op.register_fake
def _(o_hat, m, sumexp, X, z, gain, norm_eps, out_dtype, block_d, max_programs):
    k, rows, d = X.shape
    f32 = torch.float32
    return o_hat.new_empty(rows, d, dtype=out_dtype), o_hat.new_empty(rows, 1 + k, dtype=f32), o_hat.new_empty(rows, dtype=f32)


@torch.library.custom_op("attnres::merge_sources_bwd", mutates_args=())
def _bwd_op(
    g: Tensor, o_hat: Tensor, X: Tensor, w: Tensor, gain: Tensor | None, rstd: Tensor, sumexp: Tensor,
    block_d: int, max_programs: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    k, rows, d = X.shape
    go = torch.empty(rows, d, device=g.device, dtype=torch.float32)
    gx = torch.empty_like(X)
    gz = torch.empty(rows, k, device=g.device, dtype=torch.float32)
    gm, gl = (torch.empty(rows, device=g.device, dtype=torch.float32) for _ in range(2))
    programs, per_program = row_ranges(rows, max_programs or None)
    # One row of partial sums of the gain gradient per program (none without the norm).
    partial = torch.zeros(programs if gain is not None else 0, d, device=g.device, dtype=torch.float32)
    _merge_bwd[(programs,)](
        g, o_hat, nonempty(X, o_hat), w, o_hat if gain is None else gain, rstd, sumexp, go, nonempty(gx, go), nonempty(gz, gm),
        gm, gl, nonempty(partial, go), rows, d, k, per_program,
        g.stride(0), o_hat.stride(0), X.stride(0), X.stride(1), w.stride(0), go.stride(0), gx.stride(0), gx.stride(1), gz.stride(0),
        K_PAD=max(2, next_power_of_2(k)), BLOCK_D=block_d, HAS_NORM=gain is not None, num_warps=num_warps(block_d),
    )
    return go, gx, gz, gm, gl, partial.sum(0)


@_bwd_op.register_fake
def _(g, o_hat, X, w, gain, rstd, sumexp, block_d, max_programs):
    k, rows, d = X.shape
    f32 = torch.float32
    return (
        g.new_empty(rows, d, dtype=f32), torch.empty_like(X), g.new_empty(rows, k, dtype=f32),
        g.new_empty(rows, dtype=f32), g.new_empty(rows, dtype=f32), g.new_empty(d, dtype=f32),
    )


class _MergeSources(torch.autograd.Function):
    """The kernels' autograd: saves ``o_hat``, the weights and statistics, and references to
    the merged sources - not their stacked copy, which the backward rebuilds."""

    @staticmethod
    def forward(ctx, o_hat, m, sumexp, z, gain, norm_eps, out_dtype, block_d, max_programs, *xs):
        rows, d = o_hat.shape
        X = torch.stack(xs) if xs else o_hat.new_empty(0, rows, d)
        out, w, rstd = _fwd_op(o_hat, m, sumexp, X, z, gain, norm_eps, out_dtype, block_d, max_programs)
        ctx.save_for_backward(o_hat, w, gain, rstd, sumexp, *xs)
        ctx.dtypes = (o_hat.dtype, m.dtype, sumexp.dtype, z.dtype, None if gain is None else gain.dtype)
        ctx.launch = (block_d, max_programs)
        ctx.mark_non_differentiable(w, rstd)
        return out, w, rstd

    @staticmethod
    def backward(ctx, grad_out, _grad_w, _grad_rstd):
        o_hat, w, gain, rstd, sumexp, *xs = ctx.saved_tensors
        o_dtype, m_dtype, l_dtype, z_dtype, gain_dtype = ctx.dtypes
        X = torch.stack(xs) if xs else o_hat.new_empty(0, *o_hat.shape)
        go, gx, gz, gm, gl, ggain = _bwd_op(grad_out.contiguous(), o_hat, X, w, gain, rstd, sumexp, *ctx.launch)
        grad_gain = None if gain is None else ggain.to(gain_dtype)
        return (go.to(o_dtype), gm.to(m_dtype), gl.to(l_dtype), gz.to(z_dtype), grad_gain, None, None, None, None,
                *gx.unbind(0))


def merge_sources(
    o_hat: Tensor, m: Tensor, sumexp: Tensor, xs: list[Tensor], zs: list[Tensor], *,
    norm_weight: Tensor | None = None, norm_eps: float = 1e-6, out_dtype: torch.dtype | None = None,
    block_d: int | None = None, max_programs: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused ``merge_with_sources`` (then ``RMSNorm(.) * norm_weight`` with ``norm_weight``):
    ``o_hat [..., d]``, ``m``/``sumexp`` ``[...]``, ``k >= 0`` sources ``[..., d]`` with
    logits ``[...]``. Returns the output ``[..., d]`` in ``out_dtype`` (default: ``o_hat``'s)
    and the weights ``w [..., 1 + k]`` (detached, for analysis). ``block_d`` /
    ``max_programs`` force the launch geometry (:mod:`attnres.kernels.launch`)."""
    if len(xs) != len(zs):
        raise ValueError(f"merge_sources needs as many logits as sources; got {len(xs)} sources and {len(zs)} logits")
    lead, d = o_hat.shape[:-1], o_hat.shape[-1]
    if norm_weight is not None and norm_weight.shape != (d,):
        raise ValueError(f"merge_sources: norm_weight must be ({d},), got {tuple(norm_weight.shape)}")
    rows = o_hat[..., 0].numel()
    z = torch.stack([t.reshape(-1) for t in zs], dim=-1).float() if zs else o_hat.new_empty(rows, 0, dtype=torch.float32)
    out, w, _ = _MergeSources.apply(
        o_hat.reshape(-1, d).contiguous(), m.reshape(-1).contiguous(), sumexp.reshape(-1).contiguous(), z,
        None if norm_weight is None else norm_weight.contiguous(), float(norm_eps), out_dtype or o_hat.dtype,
        tile_d(d, block_d=block_d), max_programs or 0, *(x.reshape(-1, d) for x in xs),
    )
    return out.view(*lead, d), w.detach().view(*lead, len(xs) + 1)
