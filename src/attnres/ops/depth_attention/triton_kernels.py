"""The Triton kernels of Phase 1 and of the merge (report §4.2), forward and backward.

They compute what :mod:`.torch_impl` computes, with the same saved statistics and the same
backward decomposition (see its docstring), in the compute dtype - that of the logits ``Z``
or weights ``Alpha``: float32, or float64 for float64 sources - whatever the storage dtype. Sources
and per-query results are passed as tables of data pointers (int64 tensors), so no stacked
copy of the sources is made; ``X0`` (the first source) gives the kernels their storage
dtype. Every kernel walks ``d`` in tiles of ``BLOCK_D`` (:mod:`.triton_launch`); row
reductions are extra walks over the row, whose re-reads come from the cache on a GPU.

Parameters are listed in :data:`.triton_launch.SIGNATURES` (a test keeps the two equal).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _source(Table, j, X0):
    """The base pointer of source ``j`` of a pointer table (the storage dtype of ``X0``)."""
    return tl.load(Table + j).to(tl.pointer_type(X0.dtype.element_ty))


@triton.jit
def _tile(start, d, BLOCK_D: tl.constexpr):
    cols = start + tl.arange(0, BLOCK_D)
    return cols, cols < d


@triton.jit
def _load(ptr, cols, mask, dt):
    """One tile of a row in the compute dtype ``dt``, zero outside the row."""
    return tl.load(ptr + cols, mask=mask, other=0.0).to(dt)


@triton.jit
def _rows_of(Table, qs, qmask, X0):
    """Base pointers ``[S_PAD]`` of the tables' first ``S`` entries (masked rows: source 0)."""
    return tl.load(Table + qs, mask=qmask, other=0).to(tl.pointer_type(X0.dtype.element_ty))


# ----------------------------------------------------------------------------------------
# Phase 1: out_s = sum_j softmax(z_s)_j x_j, lse_s = logsumexp(z_s)
# ----------------------------------------------------------------------------------------


@triton.jit
def _phase1_stats(Z, row, qs, qmask, n, stride_zr, stride_zs):
    dt = Z.dtype.element_ty
    """Each query's log-sum-exp over its ``n`` logits (two passes: max, then sum)."""
    zrow = Z + row * stride_zr + qs * stride_zs
    m = tl.full(qs.shape, float("-inf"), dt)
    for j in range(n):
        m = tl.maximum(m, tl.load(zrow + j, mask=qmask, other=0.0))
    s = tl.zeros(qs.shape, dt)
    for j in range(n):
        s += tl.exp(tl.load(zrow + j, mask=qmask, other=0.0) - m)
    return m + tl.log(s)


@triton.jit
def phase1_fwd(Z, LSE, SrcTable, OutTable, X0, d, n, S, stride_zr, stride_zs, stride_lr,
               BLOCK_D: tl.constexpr, S_PAD: tl.constexpr):
    dt = Z.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    qs = tl.arange(0, S_PAD)
    qmask = qs < S
    lse = _phase1_stats(Z, row, qs, qmask, n, stride_zr, stride_zs)
    tl.store(LSE + row * stride_lr + qs, lse, mask=qmask & ((qs * 0 + tile) == 0))  # once per row
    cols, cmask = _tile(tile * BLOCK_D, d, BLOCK_D)
    acc = tl.zeros([S_PAD, BLOCK_D], dt)
    for j in range(n):
        p = tl.exp(tl.load(Z + row * stride_zr + qs * stride_zs + j, mask=qmask, other=0.0) - lse)
        acc += p[:, None] * _load(_source(SrcTable, j, X0) + row * d, cols, cmask, dt)[None, :]
    outs = _rows_of(OutTable, qs, qmask, X0)
    tl.store(outs[:, None] + row * d + cols[None, :], acc.to(X0.dtype.element_ty),
             mask=qmask[:, None] & cmask[None, :])


@triton.jit
def phase1_bwd(Z, LSE, GLse, SrcTable, GOutTable, GSrcTable, GZ, X0, d, n, S, stride_zr, stride_zs, stride_lr,
               BLOCK_D: tl.constexpr, S_PAD: tl.constexpr):
    """dz_sj = p_sj (g_s . x_j - g_s . out_s + glse_s), dx_j = sum_s p_sj g_s."""
    dt = Z.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    qs = tl.arange(0, S_PAD)
    qmask = qs < S
    gmask = qmask[:, None]
    lse = tl.load(LSE + row * stride_lr + qs, mask=qmask, other=0.0)
    glse = tl.load(GLse + row * stride_lr + qs, mask=qmask, other=0.0)
    zrow = Z + row * stride_zr + qs * stride_zs
    grows = _rows_of(GOutTable, qs, qmask, X0)[:, None] + row * d
    c = tl.zeros([S_PAD], dt)  # g_s . out_s, out_s recomputed tile by tile
    for start in range(0, d, BLOCK_D):
        cols, cmask = _tile(start, d, BLOCK_D)
        g = tl.load(grows + cols[None, :], mask=gmask & cmask[None, :], other=0.0).to(dt)
        o = tl.zeros([S_PAD, BLOCK_D], dt)
        for j in range(n):
            p = tl.exp(tl.load(zrow + j, mask=qmask, other=0.0) - lse)
            o += p[:, None] * _load(_source(SrcTable, j, X0) + row * d, cols, cmask, dt)[None, :]
        c += tl.sum(g * o, axis=1)
    for j in range(n):
        p = tl.exp(tl.load(zrow + j, mask=qmask, other=0.0) - lse)
        x_row = _source(SrcTable, j, X0) + row * d
        gx_row = _source(GSrcTable, j, X0) + row * d
        dot = tl.zeros([S_PAD], dt)
        for start in range(0, d, BLOCK_D):
            cols, cmask = _tile(start, d, BLOCK_D)
            g = tl.load(grows + cols[None, :], mask=gmask & cmask[None, :], other=0.0).to(dt)
            dot += tl.sum(g * _load(x_row, cols, cmask, dt)[None, :], axis=1)
            tl.store(gx_row + cols, tl.sum(p[:, None] * g, axis=0).to(X0.dtype.element_ty), mask=cmask)
        tl.store(GZ + row * stride_zr + qs * stride_zs + j, p * (dot - c + glse), mask=qmask)


# ----------------------------------------------------------------------------------------
# The merge: alpha = softmax(z, zb), h = sum_j alpha_j x_j (+ alpha_b partial), RMSNorm(h)
# ----------------------------------------------------------------------------------------


@triton.jit
def _merge_softmax(Z, row, n, zb):
    """The max and the denominator of the softmax over ``[z_0 .. z_{n-1}, zb]`` (``zb =
    -inf``: no partial sum)."""
    zrow = Z + row * n
    mx = zb
    for j in range(n):
        mx = tl.maximum(mx, tl.load(zrow + j))
    den = tl.exp(zb - mx)
    for j in range(n):
        den += tl.exp(tl.load(zrow + j) - mx)
    return mx, den


@triton.jit
def _merged_tile(Alpha, row, m, SrcTable, X0, Partial, n, has_partial, cols, cmask, d):
    """One tile of ``h = sum_j alpha_j x_j (+ alpha_b partial)``, in the compute dtype."""
    dt = Alpha.dtype.element_ty
    h = tl.zeros(cols.shape, dt)
    for j in range(n):
        h += tl.load(Alpha + row * m + j) * _load(_source(SrcTable, j, X0) + row * d, cols, cmask, dt)
    if has_partial:
        h += tl.load(Alpha + row * m + n) * _load(Partial + row * d, cols, cmask, dt)
    return h


@triton.jit
def _norm_input_tile(Alpha, row, m, SrcTable, X0, Partial, n, has_partial, cols, cmask, d):
    """The norm's input on one tile: the merge recomputed and rounded to the storage dtype
    (as the norm of the stream reads it)."""
    dt = Alpha.dtype.element_ty
    h = _merged_tile(Alpha, row, m, SrcTable, X0, Partial, n, has_partial, cols, cmask, d)
    return h.to(X0.dtype.element_ty).to(dt)


@triton.jit
def merge_fwd(Z, SrcTable, X0, Partial, Qg, NormW, Out, Alpha, Rb, Zb, Rstd, d, n, eps, norm_eps,
              has_partial, has_norm, BLOCK_D: tl.constexpr):
    dt = Z.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    m = n + has_partial
    zb = tl.full([], float("-inf"), dt)
    if has_partial:  # the partial sum's RMS factor and logit
        sxx = tl.zeros([BLOCK_D], dt)
        sxq = tl.zeros([BLOCK_D], dt)
        for start in range(0, d, BLOCK_D):
            cols, cmask = _tile(start, d, BLOCK_D)
            x = _load(Partial + row * d, cols, cmask, dt)
            sxx += x * x
            sxq += x * _load(Qg, cols, cmask, dt)
        rb = 1.0 / tl.sqrt(tl.sum(sxx, axis=0) / d + eps)
        zb = rb * tl.sum(sxq, axis=0)
        tl.store(Rb + row, rb)
        tl.store(Zb + row, zb)
    mx, den = _merge_softmax(Z, row, n, zb)
    for j in range(n):
        tl.store(Alpha + row * m + j, tl.exp(tl.load(Z + row * n + j) - mx) / den)
    if has_partial:
        tl.store(Alpha + row * m + n, tl.exp(zb - mx) / den)
    tl.debug_barrier()  # the tiles below read the weights back
    rstd = tl.full([], 1.0, dt)
    if has_norm:
        shh = tl.zeros([BLOCK_D], dt)
        for start in range(0, d, BLOCK_D):
            cols, cmask = _tile(start, d, BLOCK_D)
            h = _merged_tile(Alpha, row, m, SrcTable, X0, Partial, n, has_partial, cols, cmask, d)
            h = h.to(X0.dtype.element_ty).to(dt)
            shh += h * h
        rstd = 1.0 / tl.sqrt(tl.sum(shh, axis=0) / d + norm_eps)
        tl.store(Rstd + row, rstd)
    for start in range(0, d, BLOCK_D):
        cols, cmask = _tile(start, d, BLOCK_D)
        h = _merged_tile(Alpha, row, m, SrcTable, X0, Partial, n, has_partial, cols, cmask, d)
        if has_norm:
            h = h.to(X0.dtype.element_ty).to(dt) * rstd * _load(NormW, cols, cmask, dt)
        tl.store(Out + row * d + cols, h.to(X0.dtype.element_ty), mask=cmask)


@triton.jit
def _merge_bwd_norm(G, GH, Alpha, Rstd, SrcTable, X0, Partial, NormW, PW, pid, row, m, n, d, has_partial,
                    BLOCK_D: tl.constexpr):
    """Through the norm: ``g_h = rstd w g - (rstd^3 / d) (w g . h) h``, rounded to the
    storage dtype, into ``GH``; this program's row of the gain's gradient gets ``g h rstd``."""
    dt = Alpha.dtype.element_ty
    rstd = tl.load(Rstd + row)
    acc = tl.zeros([BLOCK_D], dt)
    for start in range(0, d, BLOCK_D):
        cols, cmask = _tile(start, d, BLOCK_D)
        h = _norm_input_tile(Alpha, row, m, SrcTable, X0, Partial, n, has_partial, cols, cmask, d)
        g = _load(G + row * d, cols, cmask, dt)
        acc += _load(NormW, cols, cmask, dt) * g * h
        tl.store(PW + pid * d + cols, _load(PW + pid * d, cols, cmask, dt) + g * h * rstd, mask=cmask)
    coef = tl.sum(acc, axis=0) * rstd * rstd * rstd / d
    for start in range(0, d, BLOCK_D):
        cols, cmask = _tile(start, d, BLOCK_D)
        h = _norm_input_tile(Alpha, row, m, SrcTable, X0, Partial, n, has_partial, cols, cmask, d)
        gh = rstd * _load(NormW, cols, cmask, dt) * _load(G + row * d, cols, cmask, dt) - coef * h
        tl.store(GH + row * d + cols, gh.to(X0.dtype.element_ty), mask=cmask)


@triton.jit
def _dot_row(A, B, row, d, dt, BLOCK_D: tl.constexpr):
    acc = tl.zeros([BLOCK_D], dt)
    for start in range(0, d, BLOCK_D):
        cols, cmask = _tile(start, d, BLOCK_D)
        acc += _load(A + row * d, cols, cmask, dt) * _load(B + row * d, cols, cmask, dt)
    return tl.sum(acc, axis=0)


@triton.jit
def merge_bwd(G, GH, Alpha, Rb, Zb, Rstd, SrcTable, X0, Partial, Qg, NormW, GSrcTable, GZ, GPartial, PQ, PW,
              rows, d, n, rows_per_program, has_partial, has_norm, BLOCK_D: tl.constexpr):
    """With g_h the gradient reaching h (GH; G itself without a norm): dz_j = alpha_j (s_j -
    sum_i alpha_i s_i), s_j = g_h . x_j; dx_j = alpha_j g_h; the partial sum's logit adds
    gr (q - (r_b zb / d) b) to its gradient (gr = dzb r_b) and gr b to the query's."""
    dt = Alpha.dtype.element_ty
    pid = tl.program_id(0)
    m = n + has_partial
    first = pid * rows_per_program
    for r in range(first, tl.minimum(first + rows_per_program, rows)):
        row = tl.cast(r, tl.int64)
        if has_norm:
            _merge_bwd_norm(G, GH, Alpha, Rstd, SrcTable, X0, Partial, NormW, PW, pid, row, m, n, d, has_partial,
                            BLOCK_D)
            tl.debug_barrier()  # the walks below read GH back
        mean = tl.zeros([], dt)
        for j in range(n):  # s_j into GZ for now, and their mean under alpha
            s = _dot_row(GH, _source(SrcTable, j, X0), row, d, dt, BLOCK_D)
            mean += tl.load(Alpha + row * m + j) * s
            tl.store(GZ + row * n + j, s)
        sb = tl.zeros([], dt)
        if has_partial:
            sb = _dot_row(GH, Partial, row, d, dt, BLOCK_D)
            mean += tl.load(Alpha + row * m + n) * sb
        tl.debug_barrier()
        for j in range(n):
            aj = tl.load(Alpha + row * m + j)
            tl.store(GZ + row * n + j, aj * (tl.load(GZ + row * n + j) - mean))
            gx_row = _source(GSrcTable, j, X0) + row * d
            for start in range(0, d, BLOCK_D):
                cols, cmask = _tile(start, d, BLOCK_D)
                tl.store(gx_row + cols, (aj * _load(GH + row * d, cols, cmask, dt)).to(X0.dtype.element_ty), mask=cmask)
        if has_partial:
            ab = tl.load(Alpha + row * m + n)
            rb = tl.load(Rb + row)
            gr = ab * (sb - mean) * rb
            c = gr * rb * tl.load(Zb + row) / d
            for start in range(0, d, BLOCK_D):
                cols, cmask = _tile(start, d, BLOCK_D)
                b = _load(Partial + row * d, cols, cmask, dt)
                gb = ab * _load(GH + row * d, cols, cmask, dt) + gr * _load(Qg, cols, cmask, dt) - c * b
                tl.store(GPartial + row * d + cols, gb.to(X0.dtype.element_ty), mask=cmask)
                tl.store(PQ + pid * d + cols, _load(PQ + pid * d, cols, cmask, dt) + gr * b, mask=cmask)
