"""The Triton kernels of Phase 1 and of the merge (report §4.2), forward and backward.

They compute what :mod:`.torch_impl` computes, with the same saved statistics and the same
backward decomposition (see its docstring), in the compute dtype - that of the queries
``Q`` / ``Qg`` or the weights ``Alpha``: float32, or float64 for float64 sources - whatever
the storage dtype. Sources and per-query results are passed as tables of data pointers
(int64 tensors), so no stacked copy of the sources is made; ``X0`` (the first source) gives
the kernels their storage dtype. Every kernel runs one program per token row (the backward
ones over ranges of rows, each writing its own row of the partial sums of the gradients
reduced over rows) and walks ``d`` in tiles of ``BLOCK_D`` (:mod:`.triton_launch`); row
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
    """Base pointers ``[S_PAD]`` of the table's first entries (masked rows: null)."""
    return tl.load(Table + qs, mask=qmask, other=0).to(tl.pointer_type(X0.dtype.element_ty))


@triton.jit
def _logits_row(x_row, Q, qs, qmask, d, eps, dt, BLOCK_D: tl.constexpr):
    """One source row's RMS factor ``r`` and its logits ``r (x . q_s)`` against the
    ``[S_PAD]`` queries of ``Q`` (rows of ``d``)."""
    xx = tl.zeros([BLOCK_D], dt)
    xq = tl.zeros([qs.shape[0]], dt)
    for start in range(0, d, BLOCK_D):
        cols, cmask = _tile(start, d, BLOCK_D)
        x = _load(x_row, cols, cmask, dt)
        xx += x * x
        q = tl.load(Q + qs[:, None] * d + cols[None, :], mask=qmask[:, None] & cmask[None, :], other=0.0).to(dt)
        xq += tl.sum(q * x[None, :], axis=1)
    r = 1.0 / tl.sqrt(tl.sum(xx, axis=0) / d + eps)
    return r, r * xq


# ----------------------------------------------------------------------------------------
# Phase 1: z_si = r_i (x_i . q_s), out_s = sum_i softmax(z_s)_i x_i, lse_s = logsumexp(z_s)
# ----------------------------------------------------------------------------------------


@triton.jit
def _phase1_logits(Q, SrcTable, X0, Zs, Rs, row, qs, qmask, d, n, S_PAD: tl.constexpr, eps, BLOCK_D: tl.constexpr):
    """Every source's logits into the row's scratch ``Zs [S_PAD, n]`` (and its RMS factor
    into ``Rs [n]``); returns the log-sum-exp of each query's logits."""
    dt = Q.dtype.element_ty
    m = tl.full([S_PAD], float("-inf"), dt)
    for j in range(n):
        r, z = _logits_row(_source(SrcTable, j, X0) + row * d, Q, qs, qmask, d, eps, dt, BLOCK_D)
        tl.store(Zs + (row * S_PAD + qs) * n + j, z)
        tl.store(Rs + row * n + j, r)
        m = tl.maximum(m, z)
    tl.debug_barrier()  # the sums below read the logits back
    s = tl.zeros([S_PAD], dt)
    for j in range(n):
        s += tl.exp(tl.load(Zs + (row * S_PAD + qs) * n + j) - m)
    return m + tl.log(s)


@triton.jit
def phase1_fwd(Q, LSE, SrcTable, OutTable, X0, Zs, Rs, d, n, S, stride_lr, eps,
               BLOCK_D: tl.constexpr, S_PAD: tl.constexpr):
    dt = Q.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    qs = tl.arange(0, S_PAD)
    qmask = qs < S
    lse = _phase1_logits(Q, SrcTable, X0, Zs, Rs, row, qs, qmask, d, n, S_PAD, eps, BLOCK_D)
    tl.store(LSE + row * stride_lr + qs, lse, mask=qmask)
    outs = _rows_of(OutTable, qs, qmask, X0)[:, None] + row * d
    for start in range(0, d, BLOCK_D):
        cols, cmask = _tile(start, d, BLOCK_D)
        acc = tl.zeros([S_PAD, BLOCK_D], dt)
        for j in range(n):
            p = tl.exp(tl.load(Zs + (row * S_PAD + qs) * n + j) - lse)
            acc += p[:, None] * _load(_source(SrcTable, j, X0) + row * d, cols, cmask, dt)[None, :]
        tl.store(outs + cols[None, :], acc.to(X0.dtype.element_ty), mask=qmask[:, None] & cmask[None, :])


@triton.jit
def _phase1_bwd_row(Q, LSE, GLse, SrcTable, GOutTable, GSrcTable, X0, Zs, Rs, PQ, pid, row, d, n, S, stride_lr, eps,
                    BLOCK_D: tl.constexpr, S_PAD: tl.constexpr):
    dt = Q.dtype.element_ty
    qs = tl.arange(0, S_PAD)
    qmask = qs < S
    gmask = qmask[:, None]
    _phase1_logits(Q, SrcTable, X0, Zs, Rs, row, qs, qmask, d, n, S_PAD, eps, BLOCK_D)
    lse = tl.load(LSE + row * stride_lr + qs, mask=qmask, other=0.0)
    glse = tl.load(GLse + row * stride_lr + qs, mask=qmask, other=0.0)
    grows = _rows_of(GOutTable, qs, qmask, X0)[:, None] + row * d
    c = tl.zeros([S_PAD], dt)  # g_s . out_s, out_s recomputed tile by tile
    for start in range(0, d, BLOCK_D):
        cols, cmask = _tile(start, d, BLOCK_D)
        g = tl.load(grows + cols[None, :], mask=gmask & cmask[None, :], other=0.0).to(dt)
        o = tl.zeros([S_PAD, BLOCK_D], dt)
        for j in range(n):
            p = tl.exp(tl.load(Zs + (row * S_PAD + qs) * n + j) - lse)
            o += p[:, None] * _load(_source(SrcTable, j, X0) + row * d, cols, cmask, dt)[None, :]
        c += tl.sum(g * o, axis=1)
    for j in range(n):
        z = tl.load(Zs + (row * S_PAD + qs) * n + j)
        p = tl.exp(z - lse)
        r = tl.load(Rs + row * n + j)
        x_row = _source(SrcTable, j, X0) + row * d
        dot = tl.zeros([S_PAD], dt)
        for start in range(0, d, BLOCK_D):
            cols, cmask = _tile(start, d, BLOCK_D)
            g = tl.load(grows + cols[None, :], mask=gmask & cmask[None, :], other=0.0).to(dt)
            dot += tl.sum(g * _load(x_row, cols, cmask, dt)[None, :], axis=1)
        dz = tl.where(qmask, p * (dot - c + glse), 0.0)
        coef = r * r * tl.sum(dz * z, axis=0) / d
        gx_row = _source(GSrcTable, j, X0) + row * d
        for start in range(0, d, BLOCK_D):  # d x_j = sum_s p_sj g_s + r (dz . q) - coef x_j; d q += dz r x_j
            cols, cmask = _tile(start, d, BLOCK_D)
            g = tl.load(grows + cols[None, :], mask=gmask & cmask[None, :], other=0.0).to(dt)
            q = tl.load(Q + qs[:, None] * d + cols[None, :], mask=gmask & cmask[None, :], other=0.0).to(dt)
            x = _load(x_row, cols, cmask, dt)
            gx = tl.sum(p[:, None] * g + (dz * r)[:, None] * q, axis=0) - coef * x
            tl.store(gx_row + cols, gx.to(X0.dtype.element_ty), mask=cmask)
            pq, pmask = PQ + (pid * S_PAD + qs[:, None]) * d + cols[None, :], gmask & cmask[None, :]
            tl.store(pq, tl.load(pq, mask=pmask, other=0.0) + (dz * r)[:, None] * x[None, :], mask=pmask)


@triton.jit
def phase1_bwd(Q, LSE, GLse, SrcTable, GOutTable, GSrcTable, X0, Zs, Rs, PQ, rows, d, n, S, stride_lr, eps,
               rows_per_program, BLOCK_D: tl.constexpr, S_PAD: tl.constexpr):
    """dz_sj = p_sj (g_s . x_j - g_s . out_s + glse_s); d x_j = sum_s p_sj g_s plus the
    logits' term; this program's row of d q's partial sums (``PQ [programs, S_PAD, d]``)."""
    pid = tl.program_id(0)
    first = pid * rows_per_program
    for r in range(first, tl.minimum(first + rows_per_program, rows)):
        _phase1_bwd_row(Q, LSE, GLse, SrcTable, GOutTable, GSrcTable, X0, Zs, Rs, PQ, pid, tl.cast(r, tl.int64),
                        d, n, S, stride_lr, eps, BLOCK_D, S_PAD)


# ----------------------------------------------------------------------------------------
# The merge: alpha = softmax(z, zc), h = sum_j alpha_j x_j, RMSNorm(h)
# ----------------------------------------------------------------------------------------


@triton.jit
def _merged_tile(Alpha, row, k, c, SrcTable, CompTable, X0, cols, cmask, d):
    """One tile of ``h = sum_j alpha_j x_j`` over the known then the computed sources, in the
    compute dtype."""
    dt = Alpha.dtype.element_ty
    m = k + c
    h = tl.zeros(cols.shape, dt)
    for j in range(k):
        h += tl.load(Alpha + row * m + j) * _load(_source(SrcTable, j, X0) + row * d, cols, cmask, dt)
    for j in range(c):
        h += tl.load(Alpha + row * m + k + j) * _load(_source(CompTable, j, X0) + row * d, cols, cmask, dt)
    return h


@triton.jit
def _merge_logits(Z, CompTable, X0, Qg, Rc, Zc, row, k, c, d, eps, BLOCK_D: tl.constexpr):
    """The computed sources' RMS factors and logits (written to ``Rc``, ``Zc``); returns the
    softmax's max and denominator over all ``k + c`` logits."""
    dt = Z.dtype.element_ty
    mx = tl.full([], float("-inf"), dt)
    for j in range(k):
        mx = tl.maximum(mx, tl.load(Z + row * k + j))
    qs = tl.arange(0, 2)  # (one query: row 0 of a 2-row block, the other masked off)
    for j in range(c):
        r, z = _logits_row(_source(CompTable, j, X0) + row * d, Qg, qs, qs < 1, d, eps, dt, BLOCK_D)
        zj = tl.sum(tl.where(qs < 1, z, 0.0), axis=0)
        tl.store(Rc + row * c + j, r)
        tl.store(Zc + row * c + j, zj)
        mx = tl.maximum(mx, zj)
    den = tl.zeros([], dt)
    for j in range(k):
        den += tl.exp(tl.load(Z + row * k + j) - mx)
    for j in range(c):
        den += tl.exp(tl.load(Zc + row * c + j) - mx)
    return mx, den


@triton.jit
def merge_fwd(Z, SrcTable, CompTable, X0, Qg, NormW, Out, Alpha, Rc, Zc, Rstd, d, k, c, eps, norm_eps, has_norm,
              BLOCK_D: tl.constexpr):
    dt = Z.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    m = k + c
    mx, den = _merge_logits(Z, CompTable, X0, Qg, Rc, Zc, row, k, c, d, eps, BLOCK_D)
    tl.debug_barrier()
    for j in range(k):
        tl.store(Alpha + row * m + j, tl.exp(tl.load(Z + row * k + j) - mx) / den)
    for j in range(c):
        tl.store(Alpha + row * m + k + j, tl.exp(tl.load(Zc + row * c + j) - mx) / den)
    tl.debug_barrier()  # the tiles below read the weights back
    rstd = tl.full([], 1.0, dt)
    if has_norm:
        shh = tl.zeros([BLOCK_D], dt)
        for start in range(0, d, BLOCK_D):
            cols, cmask = _tile(start, d, BLOCK_D)
            h = _merged_tile(Alpha, row, k, c, SrcTable, CompTable, X0, cols, cmask, d)
            h = h.to(X0.dtype.element_ty).to(dt)
            shh += h * h
        rstd = 1.0 / tl.sqrt(tl.sum(shh, axis=0) / d + norm_eps)
        tl.store(Rstd + row, rstd)
    for start in range(0, d, BLOCK_D):
        cols, cmask = _tile(start, d, BLOCK_D)
        h = _merged_tile(Alpha, row, k, c, SrcTable, CompTable, X0, cols, cmask, d)
        if has_norm:
            h = h.to(X0.dtype.element_ty).to(dt) * rstd * _load(NormW, cols, cmask, dt)
        tl.store(Out + row * d + cols, h.to(X0.dtype.element_ty), mask=cmask)


@triton.jit
def _merge_bwd_norm(G, GH, Alpha, Rstd, SrcTable, CompTable, X0, NormW, PW, pid, row, k, c, d, BLOCK_D: tl.constexpr):
    """Through the norm: ``g_h = rstd w g - (rstd^3 / d) (w g . h) h`` into ``GH`` (compute
    dtype: not rounded to the storage dtype); this program's row of the gain's gradient gets ``g h rstd``."""
    dt = Alpha.dtype.element_ty
    rstd = tl.load(Rstd + row)
    acc = tl.zeros([BLOCK_D], dt)
    for start in range(0, d, BLOCK_D):
        cols, cmask = _tile(start, d, BLOCK_D)
        h = _merged_tile(Alpha, row, k, c, SrcTable, CompTable, X0, cols, cmask, d).to(X0.dtype.element_ty).to(dt)
        g = _load(G + row * d, cols, cmask, dt)
        acc += _load(NormW, cols, cmask, dt) * g * h
        tl.store(PW + pid * d + cols, _load(PW + pid * d, cols, cmask, dt) + g * h * rstd, mask=cmask)
    coef = tl.sum(acc, axis=0) * rstd * rstd * rstd / d
    for start in range(0, d, BLOCK_D):
        cols, cmask = _tile(start, d, BLOCK_D)
        h = _merged_tile(Alpha, row, k, c, SrcTable, CompTable, X0, cols, cmask, d).to(X0.dtype.element_ty).to(dt)
        gh = rstd * _load(NormW, cols, cmask, dt) * _load(G + row * d, cols, cmask, dt) - coef * h
        tl.store(GH + row * d + cols, gh, mask=cmask)


@triton.jit
def _dot_row(A, B, row, d, dt, BLOCK_D: tl.constexpr):
    acc = tl.zeros([BLOCK_D], dt)
    for start in range(0, d, BLOCK_D):
        cols, cmask = _tile(start, d, BLOCK_D)
        acc += _load(A + row * d, cols, cmask, dt) * _load(B + row * d, cols, cmask, dt)
    return tl.sum(acc, axis=0)


@triton.jit
def _merge_bwd_row(G, GH, Alpha, Rc, Zc, Rstd, SrcTable, CompTable, X0, Qg, NormW, GSrcTable, GCompTable, GZ, PQ, PW,
                   pid, row, d, k, c, has_norm, BLOCK_D: tl.constexpr):
    dt = Alpha.dtype.element_ty
    m = k + c
    if has_norm:
        _merge_bwd_norm(G, GH, Alpha, Rstd, SrcTable, CompTable, X0, NormW, PW, pid, row, k, c, d, BLOCK_D)
        tl.debug_barrier()  # the walks below read GH back
    mean = tl.zeros([], dt)
    for j in range(k):  # s_j (into GZ for now) and their mean under alpha
        s = _dot_row(GH, _source(SrcTable, j, X0), row, d, dt, BLOCK_D)
        mean += tl.load(Alpha + row * m + j) * s
        tl.store(GZ + row * k + j, s)
    for j in range(c):  # (the computed sources' s_j are recomputed below)
        s = _dot_row(GH, _source(CompTable, j, X0), row, d, dt, BLOCK_D)
        mean += tl.load(Alpha + row * m + k + j) * s
    tl.debug_barrier()
    for j in range(k):
        aj = tl.load(Alpha + row * m + j)
        tl.store(GZ + row * k + j, aj * (tl.load(GZ + row * k + j) - mean))
        gx_row = _source(GSrcTable, j, X0) + row * d
        for start in range(0, d, BLOCK_D):
            cols, cmask = _tile(start, d, BLOCK_D)
            tl.store(gx_row + cols, (aj * _load(GH + row * d, cols, cmask, dt)).to(X0.dtype.element_ty), mask=cmask)
    for j in range(c):  # d zc / d x = r qg - (r^2 zc / d) x, plus the direct weight
        x_row = _source(CompTable, j, X0) + row * d
        aj = tl.load(Alpha + row * m + k + j)
        r = tl.load(Rc + row * c + j)
        gr = aj * (_dot_row(GH, _source(CompTable, j, X0), row, d, dt, BLOCK_D) - mean) * r
        coef = gr * r * tl.load(Zc + row * c + j) / d
        gx_row = _source(GCompTable, j, X0) + row * d
        for start in range(0, d, BLOCK_D):
            cols, cmask = _tile(start, d, BLOCK_D)
            x = _load(x_row, cols, cmask, dt)
            gx = aj * _load(GH + row * d, cols, cmask, dt) + gr * _load(Qg, cols, cmask, dt) - coef * x
            tl.store(gx_row + cols, gx.to(X0.dtype.element_ty), mask=cmask)
            tl.store(PQ + pid * d + cols, _load(PQ + pid * d, cols, cmask, dt) + gr * x, mask=cmask)


@triton.jit
def merge_bwd(G, GH, Alpha, Rc, Zc, Rstd, SrcTable, CompTable, X0, Qg, NormW, GSrcTable, GCompTable, GZ, PQ, PW,
              rows, d, k, c, rows_per_program, has_norm, BLOCK_D: tl.constexpr):
    """With g_h the gradient reaching h (GH; G itself without a norm): dz_j = alpha_j (s_j -
    sum_i alpha_i s_i), s_j = g_h . x_j; dx_j = alpha_j g_h; a computed source's logit adds
    gr (qg - (r zc / d) x) to its gradient (gr = dzc r) and gr x to the query's."""
    pid = tl.program_id(0)
    first = pid * rows_per_program
    for r in range(first, tl.minimum(first + rows_per_program, rows)):
        _merge_bwd_row(G, GH, Alpha, Rc, Zc, Rstd, SrcTable, CompTable, X0, Qg, NormW, GSrcTable, GCompTable, GZ,
                       PQ, PW, pid, tl.cast(r, tl.int64), d, k, c, has_norm, BLOCK_D)
