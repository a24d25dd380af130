"""Block AttnRes Phase 2 as one fused kernel per direction, optionally with the next
sublayer's RMSNorm fused in.

For every token row, given the Phase-1 result of a sublayer (``o_hat`` normalised, with its
max ``m`` and sum-exp ``sumexp``) and the block's partial sum ``x = b_n^{i-1}``:

    r = 1 / sqrt(mean(x^2) + eps)          # RMS factor of the partial sum
    z = r * (x . qg)                        # its logit; qg = query * key-norm gain
    w = e^(z-M) / (sumexp e^(m-M) + e^(z-M)),  M = max(m, z)
    h = o_hat + w (x - o_hat)               # online-softmax merge
    y = RMSNorm(h) * gain                   # only with ``norm_weight``: the sublayer's input

The PyTorch reference is ``attnres.ops`` (``rms_inverse``, ``source_logits``,
``merge_with_sources``) followed by :class:`attnres.nn.RMSNorm`: one pass over each input
here instead of five separate ones, and ``h`` is never written (the backward recomputes it
from ``o_hat``, ``x`` and ``w``, which it reads anyway). Backward, with ``g`` the gradient
reaching ``h`` (through the norm, see :mod:`attnres.kernels.norm_tiles`),
``s = sum_d g (x - o_hat)`` and ``gz = s w (1 - w)``:

    d o_hat = g (1 - w);   d x = g w + gz (r qg - z r^2 / d x)
    d m = -gz;   d sumexp = -gz / sumexp;   d qg = sum_rows gz r x

Shapes: ``o_hat [..., d]`` (float32), ``m, sumexp [...]``, ``x [..., d]`` (any float dtype),
``qg [d]``, ``norm_weight [d]``; returns ``h`` (or ``y``) ``[..., d]`` and ``w [...]``.

Tiling: every kernel walks ``d`` in tiles (:mod:`attnres.kernels.launch`), so the row
reductions (``mean(x^2)``, ``x . qg``, ``mean(h^2)``, ``s``) are separate walks over the
row; the forward runs one program per row, the backward a bounded number of programs over
row ranges, each writing its partial sums of the gradients reduced over rows (``qg``'s and
the norm gain's), which are added afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .launch import nonempty, num_warps, row_ranges, tile_d
from .norm_tiles import (
    add_to_partial,
    gain_dy_h,
    inverse_rms,
    load_f32,
    norm_backward_tile,
    norm_grad_coef,
    norm_input_grad,
    tile_of,
)

__all__ = ["phase2_merge"]


@triton.jit
def _merged(o_row, x_row, cols, mask, w):
    """One tile of ``o_hat``, ``x`` and the merge ``h = o_hat + w (x - o_hat)`` (float32)."""
    o = load_f32(o_row, cols, mask)
    x = load_f32(x_row, cols, mask)
    return o, x, o + w * (x - o)


@triton.jit
def _phase2_fwd(
    O, X, Mx, Lx, Q, Gain, Out, W, R, Z, Rstd, d, eps, norm_eps, stride_o, stride_x, stride_out,
    BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
):
    row = tl.program_id(0)
    o_row = O + row * stride_o
    x_row = X + row * stride_x
    sum_xx = tl.zeros([BLOCK_D], dtype=tl.float32)
    sum_xq = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, d, BLOCK_D):
        cols, mask = tile_of(start, d, BLOCK_D)
        x = load_f32(x_row, cols, mask)
        sum_xx += x * x
        sum_xq += x * load_f32(Q, cols, mask)
    r = inverse_rms(tl.sum(sum_xx, axis=0), d, eps)
    z = r * tl.sum(sum_xq, axis=0)
    m = tl.load(Mx + row).to(tl.float32)
    mx = tl.maximum(m, z)
    a = tl.load(Lx + row).to(tl.float32) * tl.exp(m - mx)
    c = tl.exp(z - mx)
    w = c / (a + c)
    rstd = 1.0
    if HAS_NORM:
        sum_hh = tl.zeros([BLOCK_D], dtype=tl.float32)
        for start in range(0, d, BLOCK_D):
            cols, mask = tile_of(start, d, BLOCK_D)
            _, _, h = _merged(o_row, x_row, cols, mask, w)
            sum_hh += h * h
        rstd = inverse_rms(tl.sum(sum_hh, axis=0), d, norm_eps)
        tl.store(Rstd + row, rstd)
    for start in range(0, d, BLOCK_D):
        cols, mask = tile_of(start, d, BLOCK_D)
        _, _, h = _merged(o_row, x_row, cols, mask, w)
        if HAS_NORM:
            h = h * rstd * load_f32(Gain, cols, mask)
        tl.store(Out + row * stride_out + cols, h.to(Out.dtype.element_ty), mask=mask)
    tl.store(W + row, w)
    tl.store(R + row, r)
    tl.store(Z + row, z)


@triton.jit
def _phase2_bwd(
    G, O, X, Q, Gain, W, R, Z, Rstd, Lx, GO, GX, GM, GL, PQ, PGain,
    rows, d, rows_per_program, stride_g, stride_o, stride_x, stride_go, stride_gx,
    BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr,
):
    pid = tl.program_id(0)
    first = pid * rows_per_program
    for row in range(first, tl.minimum(first + rows_per_program, rows)):
        g_row = G + row * stride_g
        o_row = O + row * stride_o
        x_row = X + row * stride_x
        w = tl.load(W + row)
        r = tl.load(R + row)
        z = tl.load(Z + row)
        rstd = 1.0
        coef = 0.0
        if HAS_NORM:
            rstd = tl.load(Rstd + row)
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for start in range(0, d, BLOCK_D):
                cols, mask = tile_of(start, d, BLOCK_D)
                _, _, h = _merged(o_row, x_row, cols, mask, w)
                acc += gain_dy_h(Gain, g_row, h, cols, mask)
            coef = norm_grad_coef(tl.sum(acc, axis=0), rstd, d)
        # s = sum_d g (x - o_hat), with g the gradient reaching h.
        acc_s = tl.zeros([BLOCK_D], dtype=tl.float32)
        for start in range(0, d, BLOCK_D):
            cols, mask = tile_of(start, d, BLOCK_D)
            o, x, h = _merged(o_row, x_row, cols, mask, w)
            g = load_f32(g_row, cols, mask)
            if HAS_NORM:
                g = norm_backward_tile(g, h, Gain, PGain + pid * d, cols, mask, rstd, coef)
            acc_s += g * (x - o)
        gz = tl.sum(acc_s, axis=0) * w * (1.0 - w)
        for start in range(0, d, BLOCK_D):
            cols, mask = tile_of(start, d, BLOCK_D)
            _, x, h = _merged(o_row, x_row, cols, mask, w)
            g = load_f32(g_row, cols, mask)
            if HAS_NORM:
                g = norm_input_grad(g, h, load_f32(Gain, cols, mask), rstd, coef)
            tl.store(GO + row * stride_go + cols, (g * (1.0 - w)).to(GO.dtype.element_ty), mask=mask)
            gx = g * w + gz * (r * load_f32(Q, cols, mask) - (z * r * r / d) * x)
            tl.store(GX + row * stride_gx + cols, gx.to(GX.dtype.element_ty), mask=mask)
            add_to_partial(PQ + pid * d, cols, mask, gz * r * x)
        tl.store(GM + row, -gz)
        tl.store(GL + row, -gz / tl.load(Lx + row).to(tl.float32))


def _rows(t: Tensor) -> Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


# Opaque custom ops (torch.library): torch.compile traces around them with the fake
# implementations below, and autograd uses the backward op. ``gain`` is the fused norm's
# weight (None: no norm, the output is h).
@torch.library.custom_op("attnres::phase2_merge_fwd", mutates_args=())
def _fwd_op(
    o_hat: Tensor, m: Tensor, sumexp: Tensor, x: Tensor, qg: Tensor, gain: Tensor | None,
    eps: float, norm_eps: float, out_dtype: torch.dtype, block_d: int, max_programs: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # max_programs (0: the default) bounds the backward's programs; unused here.
    rows, d = o_hat.shape
    out = torch.empty(rows, d, device=o_hat.device, dtype=out_dtype)
    w, r, z, rstd = (torch.empty(rows, device=o_hat.device, dtype=torch.float32) for _ in range(4))
    _phase2_fwd[(rows,)](
        o_hat, x, m, sumexp, qg, qg if gain is None else gain, out, w, r, z, rstd, d, eps, norm_eps,
        o_hat.stride(0), x.stride(0), out.stride(0),
        BLOCK_D=block_d, HAS_NORM=gain is not None, num_warps=num_warps(block_d),
    )
    return out, w, r, z, rstd


@_fwd_op.register_fake
def _(o_hat, m, sumexp, x, qg, gain, eps, norm_eps, out_dtype, block_d, max_programs):
    rows = o_hat.shape[0]
    return o_hat.new_empty(o_hat.shape, dtype=out_dtype), *(o_hat.new_empty(rows, dtype=torch.float32) for _ in range(4))


@torch.library.custom_op("attnres::phase2_merge_bwd", mutates_args=())
def _bwd_op(
    g: Tensor, o_hat: Tensor, x: Tensor, qg: Tensor, gain: Tensor | None, w: Tensor, r: Tensor, z: Tensor,
    rstd: Tensor, sumexp: Tensor, block_d: int, max_programs: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    rows, d = o_hat.shape
    go = torch.empty_like(o_hat)
    gx = torch.empty_like(x)
    gm, gl = (torch.empty(rows, device=o_hat.device, dtype=torch.float32) for _ in range(2))
    programs, per_program = row_ranges(rows, max_programs or None)
    # One row of partial sums per program of the qg gradient and of the gain gradient
    # (none without the norm).
    partial_q = torch.zeros(programs, d, device=o_hat.device, dtype=torch.float32)
    partial_gain = torch.zeros(programs if gain is not None else 0, d, device=o_hat.device, dtype=torch.float32)
    _phase2_bwd[(programs,)](
        g, o_hat, x, qg, qg if gain is None else gain, w, r, z, rstd, sumexp, go, gx, gm, gl, partial_q,
        nonempty(partial_gain, partial_q),
        rows, d, per_program, g.stride(0), o_hat.stride(0), x.stride(0), go.stride(0), gx.stride(0),
        BLOCK_D=block_d, HAS_NORM=gain is not None, num_warps=num_warps(block_d),
    )
    return go, gx, gm, gl, partial_q.sum(0), partial_gain.sum(0)


@_bwd_op.register_fake
def _(g, o_hat, x, qg, gain, w, r, z, rstd, sumexp, block_d, max_programs):
    rows, d = o_hat.shape
    f32 = torch.float32
    return (
        torch.empty_like(o_hat), torch.empty_like(x), *(o_hat.new_empty(rows, dtype=f32) for _ in range(2)),
        o_hat.new_empty(d, dtype=f32), o_hat.new_empty(d, dtype=f32),
    )


def _setup(ctx, inputs, output):
    o_hat, m, sumexp, x, qg, gain, _eps, _norm_eps, _out_dtype, block_d, max_programs = inputs
    _out, w, r, z, rstd = output
    ctx.save_for_backward(o_hat, x, qg, gain, w, r, z, rstd, sumexp)
    ctx.dtypes = (m.dtype, sumexp.dtype, qg.dtype, None if gain is None else gain.dtype)
    ctx.launch = (block_d, max_programs)


def _backward(ctx, grad_out, _gw, _gr, _gz, _grstd):
    o_hat, x, qg, gain, w, r, z, rstd, sumexp = ctx.saved_tensors
    m_dtype, l_dtype, q_dtype, gain_dtype = ctx.dtypes
    go, gx, gm, gl, gqg, ggain = _bwd_op(grad_out.contiguous(), o_hat, x, qg, gain, w, r, z, rstd, sumexp, *ctx.launch)
    grad_gain = None if gain is None else ggain.to(gain_dtype)
    return go, gm.to(m_dtype), gl.to(l_dtype), gx, gqg.to(q_dtype), grad_gain, None, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup)


def phase2_merge(
    o_hat: Tensor, m: Tensor, sumexp: Tensor, x: Tensor, qg: Tensor, eps: float = 1e-6, *,
    norm_weight: Tensor | None = None, norm_eps: float = 1e-6, out_dtype: torch.dtype | None = None,
    block_d: int | None = None, max_programs: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused Block AttnRes Phase 2 (see the module docstring): returns ``(h, w)``, or
    ``(RMSNorm(h) * norm_weight, w)`` with ``norm_weight``; ``w`` (the weight of ``x``, for
    analysis) is detached. The output is in ``out_dtype`` (default: ``o_hat``'s).
    ``block_d`` / ``max_programs`` force the launch geometry (:mod:`attnres.kernels.launch`)."""
    d = x.shape[-1]
    if o_hat.shape != x.shape or o_hat.shape[:-1] != m.shape or m.shape != sumexp.shape or qg.shape != (d,):
        raise ValueError(
            f"phase2_merge: o_hat {tuple(o_hat.shape)} and x {tuple(x.shape)} must match, m/sumexp must be "
            f"{tuple(o_hat.shape[:-1])} and qg ({d},); got m {tuple(m.shape)}, sumexp "
            f"{tuple(sumexp.shape)}, qg {tuple(qg.shape)}"
        )
    if norm_weight is not None and norm_weight.shape != (d,):
        raise ValueError(f"phase2_merge: norm_weight must be ({d},), got {tuple(norm_weight.shape)}")
    # qg is passed as a copy ([d], cheap): handing the op a view into the stacked queries made
    # torch.compile (torch 2.13) drop the gradient the op returns for it, which
    # tests/test_kernels.py::test_torch_compile_traces_around_the_kernels catches.
    out, w, _, _, _ = _fwd_op(
        _rows(o_hat), m.reshape(-1).contiguous(), sumexp.reshape(-1).contiguous(), _rows(x), qg.clone(),
        None if norm_weight is None else norm_weight.contiguous(), float(eps), float(norm_eps),
        out_dtype or o_hat.dtype, tile_d(d, block_d=block_d), max_programs or 0,
    )
    return out.view(o_hat.shape), w.detach().view(m.shape)
