"""Phase 1 as one fused kernel per direction (Algorithm 1's ``ATTNWITHSTATS``).

From the logits ``z [M, S, n]`` of ``S`` queries over ``n`` completed sources ``V [n, M, d]``
(computed by one matmul per source, with the source's RMS factor taken once, when it
completed), return the normalised outputs of all ``S`` queries with their softmax
statistics, reading each source row once for all ``S`` queries (report Algorithm 1, line 3):

    m = max_j z;   l = sum_j e^(z_j - m);   p = e^(z - m) / l
    O[s, m, :] = sum_j p[m, s, j] * V[j, m, :]                 -> O [S, M, d] (float32)

Backward: ``dV[j] = sum_s p[:, s, j] dO[s]``; with ``gp_sj = dO_s . V_j`` and
``c_s = sum_j p_sj gp_sj``: ``dz_sj = p_sj (gp_sj - c_s) + dl_s l_s p_sj + (dm_s - dl_s l_s) [j = argmax]``.
The PyTorch reference is ``attnres.ops.weighted_sum`` over the softmax of ``z``.

Tiling (see :mod:`attnres.kernels.launch`): the forward runs one program per (token row,
tile of ``d``), since the weights depend on ``z`` only; the backward runs one program per
token row that walks the tiles of ``d`` once, accumulating ``gp`` for the ``dz`` it writes
at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from .launch import next_power_of_2, num_warps, tile_d

__all__ = ["phase1_attention"]


@triton.jit
def _attn_fwd(
    Z, V, O, Mx, Lx, Pw, d, n, S, stride_zm, stride_zs, stride_vn, stride_vm, stride_os, stride_om, stride_mm,
    S_PAD: tl.constexpr, N_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    cols = tile * BLOCK_D + tl.arange(0, BLOCK_D)
    qs = tl.arange(0, S_PAD)
    js = tl.arange(0, N_PAD)
    cmask = cols < d
    qmask = qs < S
    # The statistics and weights are written once per row, by the first tile's program
    # (a [S_PAD] mask: the interpreter rejects a scalar one combined with a vector).
    stats_mask = qmask & ((qs * 0 + tile) == 0)
    z = tl.load(Z + row * stride_zm + qs[:, None] * stride_zs + js[None, :], mask=qmask[:, None] & (js[None, :] < n), other=float("-inf"))
    z = z.to(tl.float32)
    m = tl.max(z, axis=1)
    m = tl.where(qmask, m, 0.0)
    l = tl.sum(tl.exp(z - m[:, None]), axis=1)
    l = tl.where(qmask, l, 1.0)
    acc = tl.zeros([S_PAD, BLOCK_D], dtype=tl.float32)
    for j in range(n):
        zj = tl.load(Z + row * stride_zm + qs * stride_zs + j, mask=qmask, other=0.0).to(tl.float32)
        pj = tl.exp(zj - m) / l
        tl.store(Pw + row * stride_zm + qs * stride_zs + j, pj, mask=stats_mask)
        v = tl.load(V + j * stride_vn + row * stride_vm + cols, mask=cmask, other=0.0).to(tl.float32)
        acc += pj[:, None] * v[None, :]
    tl.store(O + qs[:, None] * stride_os + row * stride_om + cols[None, :], acc, mask=qmask[:, None] & cmask[None, :])
    tl.store(Mx + row * stride_mm + qs, m, mask=stats_mask)
    tl.store(Lx + row * stride_mm + qs, l, mask=stats_mask)


@triton.jit
def _attn_bwd(
    Z, V, Pw, Mx, Lx, G, GM, GL, GZ, GV, d, n, S,
    stride_zm, stride_zs, stride_vn, stride_vm, stride_gs, stride_gm, stride_mm, stride_gvn, stride_gvm,
    S_PAD: tl.constexpr, N_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    qs = tl.arange(0, S_PAD)
    js = tl.arange(0, N_PAD)
    qmask = qs < S
    zmask = qmask[:, None] & (js[None, :] < n)
    zoffs = row * stride_zm + qs[:, None] * stride_zs + js[None, :]
    p = tl.load(Pw + zoffs, mask=zmask, other=0.0)
    z = tl.load(Z + zoffs, mask=zmask, other=float("-inf")).to(tl.float32)
    m = tl.load(Mx + row * stride_mm + qs, mask=qmask, other=0.0)
    l = tl.load(Lx + row * stride_mm + qs, mask=qmask, other=1.0)
    gm = tl.load(GM + row * stride_mm + qs, mask=qmask, other=0.0)
    gl = tl.load(GL + row * stride_mm + qs, mask=qmask, other=0.0)
    # One walk over the tiles of d: dV, and gp_sj = dO_s . V_j summed over the tiles.
    gp = tl.zeros([S_PAD, N_PAD], dtype=tl.float32)
    for start in range(0, d, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        cmask = cols < d
        g = tl.load(G + qs[:, None] * stride_gs + row * stride_gm + cols[None, :], mask=qmask[:, None] & cmask[None, :], other=0.0)
        g = g.to(tl.float32)
        for j in range(n):
            pj = tl.load(Pw + row * stride_zm + qs * stride_zs + j, mask=qmask, other=0.0)
            v = tl.load(V + j * stride_vn + row * stride_vm + cols, mask=cmask, other=0.0).to(tl.float32)
            tl.store(GV + j * stride_gvn + row * stride_gvm + cols, tl.sum(pj[:, None] * g, axis=0).to(GV.dtype.element_ty), mask=cmask)
            gp += tl.where(js[None, :] == j, tl.sum(g * v[None, :], axis=1)[:, None], 0.0)
    c = tl.sum(p * gp, axis=1)
    # The max's gradient goes to the first source that attains it (as in the reference).
    first_max = tl.min(tl.where((z == m[:, None]) & zmask, js[None, :], N_PAD), axis=1)
    is_max = js[None, :] == first_max[:, None]
    gz = p * (gp - c[:, None]) + (gl * l)[:, None] * p + tl.where(is_max, (gm - gl * l)[:, None], 0.0)
    tl.store(GZ + zoffs, gz, mask=zmask)


def _s_pad(S: int) -> int:
    return max(2, next_power_of_2(S))  # tl.arange needs at least 2 elements here


@torch.library.custom_op("attnres::phase1_attention_fwd", mutates_args=())
def _attn_fwd_op(z: Tensor, V: Tensor, block_d: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n, M, d = V.shape
    S = z.shape[1]
    O = torch.empty(S, M, d, device=V.device, dtype=torch.float32)
    m = torch.empty(M, S, device=V.device, dtype=torch.float32)
    l = torch.empty_like(m)
    p = torch.empty_like(z)
    _attn_fwd[(M, triton.cdiv(d, block_d))](
        z, V, O, m, l, p, d, n, S, z.stride(0), z.stride(1), V.stride(0), V.stride(1), O.stride(0), O.stride(1), m.stride(0),
        S_PAD=_s_pad(S), N_PAD=_s_pad(n), BLOCK_D=block_d, num_warps=num_warps(block_d),
    )
    return O, m, l, p


@_attn_fwd_op.register_fake
def _(z, V, block_d):
    _, M, d = V.shape
    S = z.shape[1]
    f32 = torch.float32
    return V.new_empty(S, M, d, dtype=f32), V.new_empty(M, S, dtype=f32), V.new_empty(M, S, dtype=f32), torch.empty_like(z)


@torch.library.custom_op("attnres::phase1_attention_bwd", mutates_args=())
def _attn_bwd_op(
    z: Tensor, V: Tensor, p: Tensor, m: Tensor, l: Tensor, G: Tensor, gm: Tensor, gl: Tensor, block_d: int
) -> tuple[Tensor, Tensor]:
    n, M, d = V.shape
    S = z.shape[1]
    GZ = torch.empty_like(z)
    GV = torch.empty_like(V)
    _attn_bwd[(M,)](
        z, V, p, m, l, G, gm, gl, GZ, GV, d, n, S,
        z.stride(0), z.stride(1), V.stride(0), V.stride(1), G.stride(0), G.stride(1), m.stride(0), GV.stride(0), GV.stride(1),
        S_PAD=_s_pad(S), N_PAD=_s_pad(n), BLOCK_D=block_d, num_warps=num_warps(block_d),
    )
    return GZ, GV


@_attn_bwd_op.register_fake
def _(z, V, p, m, l, G, gm, gl, block_d):
    return torch.empty_like(z), torch.empty_like(V)


class _Phase1Attention(torch.autograd.Function):
    """The kernels' autograd: saves the logits, the weights and statistics, and references to
    the sources - not their stacked copy, which the backward rebuilds (the sources are kept
    anyway; the copy would add ``n [M, d]`` per block until the backward)."""

    @staticmethod
    def forward(ctx, z: Tensor, block_d: int, *sources: Tensor):
        O, m, l, p = _attn_fwd_op(z, torch.stack(sources), block_d)
        ctx.save_for_backward(z, p, m, l, *sources)
        ctx.block_d = block_d
        ctx.mark_non_differentiable(p)
        return O, m, l, p

    @staticmethod
    def backward(ctx, gO, gm, gl, _gp):
        z, p, m, l, *sources = ctx.saved_tensors
        zeros = torch.zeros_like(m)
        gO = torch.zeros(z.shape[1], m.shape[0], sources[0].shape[-1], device=z.device) if gO is None else gO.contiguous()
        gm = zeros if gm is None else gm.contiguous()
        gl = zeros if gl is None else gl.contiguous()
        GZ, GV = _attn_bwd_op(z, torch.stack(sources), p, m, l, gO, gm, gl, ctx.block_d)
        return GZ, None, *GV.unbind(0)


def phase1_attention(
    z: Tensor, sources: Tensor | Sequence[Tensor], *, block_d: int | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``z [M, S, n]`` logits, ``sources``: ``n`` tensors ``[M, d]`` (or one stacked
    ``[n, M, d]``) -> ``O [S, M, d]`` normalised outputs, ``m [M, S]`` max, ``l [M, S]``
    sum-exp, and the weights ``p [M, S, n]`` (detached, for analysis); all float32.
    ``block_d`` forces the tile of ``d`` (a power of two; default: see
    :func:`attnres.kernels.launch.tile_d`). The kernel reads the sources stacked; the stacked
    copy lives only during the forward and again during the backward (issue 17's saving
    policy: the backward keeps references to the sources, not a copy)."""
    srcs = list(sources.unbind(0)) if isinstance(sources, Tensor) else list(sources)
    if z.dim() != 3 or not srcs or any(x.dim() != 2 or x.shape != srcs[0].shape for x in srcs) \
            or z.shape[0] != srcs[0].shape[0] or z.shape[2] != len(srcs):
        shapes = [tuple(x.shape) for x in srcs]
        raise ValueError(f"phase1_attention: z must be [M, S, n] and the n sources [M, d]; got z {tuple(z.shape)}, "
                         f"sources {shapes}")
    block = tile_d(srcs[0].shape[1], rows=z.shape[1], block_d=block_d)
    O, m, l, p = _Phase1Attention.apply(z.float().contiguous(), block, *srcs)
    return O, m, l, p.detach()
