"""The Triton kernels of Phase 1 and of the merge (report §4.2), forward and backward.

They compute what :mod:`.torch_impl` computes, with the same saved statistics and the same
backward decomposition (see its docstring), in the compute dtype - that of the queries
``Q`` / ``Qg`` or the weights ``Alpha``: float32, or float64 for float64 sources - whatever
the storage dtype of the sources.

**Arguments.** Sources, per-query results and their gradients are passed as *tuples of
tensors* (``Srcs``, ``Outs``, ...): Triton passes each tuple element's data pointer as a
kernel parameter, so there is no pointer table to build and copy to the device per call,
and a CUDA graph captures the call as it is. A tuple's length is a compile-time constant
(one compiled variant per number of sources). Where a program needs the rows of several
tuple entries as one block (the ``S`` queries' gradients or outputs), it builds a vector of
their base pointers in registers (:func:`_bases`). Every ``[rows, d]`` tensor is contiguous.

**Parallelisation** (:mod:`.triton_launch` chooses the geometry):

* ``phase1_logits_rows`` (then ``phase1_combine``) / ``phase1_bwd_rows`` then
  ``phase1_grads``: Phase 1 over many rows (training, prefill), one program per block of
  ``ROWS`` rows with ``d`` the outer loop and the sources the inner one (``GROUP`` of them
  an iteration), so that a tile of the queries and of the gradients is read once for the
  block's rows and every source; the backward's per-row statistics (``[rows, n, S]``) go
  through memory to ``phase1_grads``, which writes each source's gradient once and sums the
  queries' gradient in registers.
* ``phase1_fwd`` / ``phase1_bwd``: one program per token row (``FORCED["phase1_rows"] =
  False``: the kernels before those over blocks of rows), walking ``d`` in tiles of
  ``BLOCK_D``; a first pass over the row gathers each source's statistics (RMS factor,
  logits against the ``S`` queries, dot products with the ``S`` gradients) into small
  ``[S_PAD, N_PAD]`` register blocks - source by source, products summed elementwise over
  the tiles and reduced once per source (:func:`_phase1_stats`) - the second writes each
  result once. The two passes read the row's sources twice; the second read comes from
  the cache. The loops over the
  sources run at run time (their pointers picked from a vector of the tuple's addresses),
  so that a Phase 1 over many sources (Full AttnRes) compiles to code of the same size.
* ``phase1_logits`` / ``phase1_combine``: Phase 1's forward over a few rows (decoding),
  split in two so that the machine is not left to one program per row: one program per
  (row, source) for the logits, then one per (row, tile of ``d``) for the softmax and the
  weighted sums, its sources unrolled where they are few.
* ``phase1_dq``: the queries' gradient ``dQ = sum_rows W^T X`` over a grid of (tile of
  ``d``, range of rows), each program summing its rows in registers and writing its own
  row of partial sums once (added afterwards: deterministic, no atomics).
* ``merge_fwd``: one program per row holding the whole row (``D_PAD``) in registers: an
  online softmax over the sources reads each of them once.
* ``merge_bwd``: persistent programs, each walking rows ``pid, pid + P, ...`` with the
  whole row in registers and the query's and the norm gain's gradients summed in registers
  over its rows, written once per program into ``Part [P, 2, d]``.
* ``merge_fwd_held`` / ``merge_bwd_held``: the merge over a few sources (Block AttnRes'
  two), forward and backward as persistent programs whose loop over rows Triton pipelines
  (``tl.range(..., num_stages=STAGES)``: the next rows' loads copied asynchronously into
  shared memory while a row is computed); each source of a row is loaded once, all of them
  together, and held in registers for every pass (a tuple, the sources unrolled). The
  looping kernels above re-read the sources in each pass and wait on each load in turn.

Parameters are listed in :data:`.triton_launch.SIGNATURES` (a test keeps the two equal).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _bases(Table, idx):
    """The base pointers of the tuple ``Table``'s entries as a vector indexed by ``idx``
    (entries past the tuple's end repeat its first; callers mask them)."""
    base = Table[0] + idx * 0
    for s in tl.static_range(1, len(Table)):
        base = tl.where(idx == s, Table[s], base)
    return base


@triton.jit
def _addresses(Table, idx):
    """The tuple ``Table``'s data pointers as an int64 vector indexed by ``idx`` (0 past its
    end), for :func:`_pointer`: the kernels loop over their sources at run time, so that
    their code does not grow with the number of sources."""
    addresses = tl.zeros(idx.shape, tl.int64)
    for s in tl.static_range(len(Table)):
        addresses = tl.where(idx == s, Table[s].to(tl.int64), addresses)
    return addresses


@triton.jit
def _pointer(addresses, idx, j, Like):
    """Entry ``j`` of :func:`_addresses` as a pointer to ``Like``'s element type, 16-byte
    aligned (the launch code makes every tuple entry so: ``triton_impl._c``). Without the
    hint the compiler knows nothing of a pointer built from an integer, and every access
    through it is one element wide (8 loads of 2 bytes where one of 16 does)."""
    address = tl.sum(tl.where(idx == j, addresses, 0), axis=0)
    return tl.multiple_of(address.to(tl.pointer_type(Like.dtype.element_ty)), 16)


@triton.jit
def _column(block, idx, j):
    """Column ``j`` of ``block [R, C]`` (``idx``: ``arange(C)``) as a vector ``[R]``."""
    return tl.sum(tl.where(idx[None, :] == j, block, 0.0), axis=1)


@triton.jit
def _entry(vector, idx, j):
    """Entry ``j`` of ``vector`` (``idx``: its ``arange``) as a scalar."""
    return tl.sum(tl.where(idx == j, vector, 0.0), axis=0)


@triton.jit
def _add_to_column(block, idx, j, values):
    """``block`` with ``values [R]`` added to column ``j``."""
    return tl.where(idx[None, :] == j, block + values[:, None], block)


# ----------------------------------------------------------------------------------------
# Phase 1: z_si = r_i (x_i . q_s), out_s = sum_i softmax(z_s)_i x_i, lse_s = logsumexp(z_s)
# ----------------------------------------------------------------------------------------


@triton.jit
def _phase1_stats(Q, Srcs, G, gmask, row, d, qs, qmask, js, HAS_G: tl.constexpr, BLOCK_D: tl.constexpr,
                  S_PAD: tl.constexpr, N_PAD: tl.constexpr):
    """One pass over the row: each source's sum of squares ``[N_PAD]``, its dot products
    with the queries ``[S_PAD, N_PAD]`` and (``HAS_G``) with the gradients ``G`` (base
    pointers ``[S_PAD]``, rows ``gmask``).

    Source by source, the products are summed elementwise over the tiles of ``d`` and
    reduced across the program's threads once per source: a reduction inside the tile loop
    (one per source and tile, each with its barriers) left the loop latency-bound, one
    2-byte load per thread between barriers (42x the byte bound on an H200,
    benchmarks/results/gpu-h200). The query (and gradient) tiles are read again for each
    source: from the cache, the row's ``S`` rows being a few KiB."""
    dt = Q.dtype.element_ty
    srcs = _addresses(Srcs, js)
    xx = tl.zeros([N_PAD], dt)
    xq = tl.zeros([S_PAD, N_PAD], dt)
    xg = tl.zeros([S_PAD, N_PAD], dt)
    for j in range(len(Srcs)):
        src = _pointer(srcs, js, j, Srcs[0]) + row * d
        sq, aq, ag = _source_stats(Q, src, G, gmask, row, d, qs, qmask, HAS_G, BLOCK_D, S_PAD)
        xx = tl.where(js == j, xx + sq, xx)
        xq = _add_to_column(xq, js, j, aq)
        if HAS_G:
            xg = _add_to_column(xg, js, j, ag)
    return xx, xq, xg


@triton.jit
def _source_stats(Q, src, G, gmask, row, d, qs, qmask, HAS_G: tl.constexpr, BLOCK_D: tl.constexpr,
                  S_PAD: tl.constexpr):
    """One source's row (at ``src``) in tiles of ``BLOCK_D``: its sum of squares, its dot
    products with the queries ``[S_PAD]`` and (``HAS_G``) with the gradients ``G`` (base
    pointers ``[S_PAD]``, rows ``gmask``; else zeros) - summed elementwise over the tiles,
    reduced once."""
    dt = Q.dtype.element_ty
    sq = tl.zeros([BLOCK_D], dt)
    aq = tl.zeros([S_PAD, BLOCK_D], dt)
    ag = tl.zeros([S_PAD, BLOCK_D], dt)
    for start in range(0, d, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        cmask = cols < d
        x = tl.load(src + cols, mask=cmask, other=0.0).to(dt)
        q = tl.load(Q + qs[:, None] * d + cols[None, :], mask=qmask[:, None] & cmask[None, :], other=0.0).to(dt)
        sq += x * x
        aq += q * x[None, :]
        if HAS_G:
            g = tl.load(G[:, None] + row * d + cols[None, :], mask=gmask[:, None] & cmask[None, :],
                        other=0.0).to(dt)
            ag += g * x[None, :]
    return tl.sum(sq, axis=0), tl.sum(aq, axis=1), tl.sum(ag, axis=1)


@triton.jit
def _softmax_over_sources(z, valid, qmask, LSE, row, S, qs, write_lse):
    """The weights ``softmax(z)`` over the sources of each query row of ``z [S_PAD, N_PAD]``
    (``valid``: the real entries; padded queries get weights 0), with the queries'
    log-sum-exps written to ``LSE [rows, S]`` where ``write_lse``."""
    z = tl.where(valid, z, float("-inf"))
    mx = tl.where(qmask, tl.max(z, axis=1), 0.0)
    p = tl.where(valid, tl.exp(z - mx[:, None]), 0.0)
    total = tl.where(qmask, tl.sum(p, axis=1), 1.0)
    tl.store(LSE + row * S + qs, mx + tl.log(total), mask=qmask & write_lse)
    return p / total[:, None]


@triton.jit
def phase1_fwd(Q, Srcs, Outs, LSE, d, eps, BLOCK_D: tl.constexpr, S_PAD: tl.constexpr, N_PAD: tl.constexpr):
    """``Q [S, d]``, ``Srcs``: ``n`` sources ``[rows, d]``; writes ``Outs`` (``S`` tensors
    ``[rows, d]``) and ``LSE [rows, S]``."""
    dt = Q.dtype.element_ty
    S: tl.constexpr = len(Outs)
    n: tl.constexpr = len(Srcs)
    row = tl.program_id(0).to(tl.int64)
    qs = tl.arange(0, S_PAD)
    qmask = qs < S
    js = tl.arange(0, N_PAD)
    valid = qmask[:, None] & (js[None, :] < n)
    xx, xq, _ = _phase1_stats(Q, Srcs, Q, qmask, row, d, qs, qmask, js, False, BLOCK_D, S_PAD, N_PAD)
    r = 1.0 / tl.sqrt(xx / d + eps)
    p = _softmax_over_sources(xq * r[None, :], valid, qmask, LSE, row, S, qs, qmask)
    srcs = _addresses(Srcs, js)
    outs = _bases(Outs, qs)
    for start in range(0, d, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        cmask = cols < d
        acc = tl.zeros([S_PAD, BLOCK_D], dt)
        for j in range(n):
            x = tl.load(_pointer(srcs, js, j, Srcs[0]) + row * d + cols, mask=cmask, other=0.0).to(dt)
            acc += _column(p, js, j)[:, None] * x[None, :]
        tl.store(outs[:, None] + row * d + cols[None, :], acc.to(Outs[0].dtype.element_ty),
                 mask=qmask[:, None] & cmask[None, :])


@triton.jit
def phase1_logits(Q, Srcs, Z, S, d, eps, BLOCK_D: tl.constexpr, S_PAD: tl.constexpr, N_PAD: tl.constexpr):
    """The split forward's first half (a few rows: decoding): program ``(row, j)`` walks
    source ``j``'s row once and writes its logits against the ``S`` queries,
    ``Z[row, s, j] = r_j (x_j . q_s)`` (``Z [rows, S, n]``): the sources' statistics in
    parallel, where one program per row gathers them one after the other."""
    n: tl.constexpr = len(Srcs)
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    qs = tl.arange(0, S_PAD)
    qmask = qs < S
    js = tl.arange(0, N_PAD)
    src = _pointer(_addresses(Srcs, js), js, j, Srcs[0]) + row * d
    sq, aq, _ = _source_stats(Q, src, Q, qmask, row, d, qs, qmask, False, BLOCK_D, S_PAD)
    r = 1.0 / tl.sqrt(sq / d + eps)
    tl.store(Z + (row * S + qs) * n + j, aq * r, mask=qmask)


@triton.jit
def phase1_combine(Z, Srcs, Outs, LSE, S, d, BLOCK_D: tl.constexpr, S_PAD: tl.constexpr, N_PAD: tl.constexpr,
                   UNROLL: tl.constexpr):
    """The split forward's second half: program ``(row, t)`` takes the softmax of
    ``Z[row]`` over the sources and writes tile ``t`` of the ``S`` weighted sums (and, tile
    0, the log-sum-exps ``LSE [rows, S]``). ``UNROLL`` (a few sources: Block AttnRes): the
    sources unrolled (``Srcs[j]`` directly), their loads independent, in flight together;
    else a loop over them at run time (Full AttnRes' many: code that does not grow)."""
    dt = Z.dtype.element_ty
    n: tl.constexpr = len(Srcs)
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    qs = tl.arange(0, S_PAD)
    qmask = qs < S
    js = tl.arange(0, N_PAD)
    valid = qmask[:, None] & (js[None, :] < n)
    z = tl.load(Z + (row * S + qs[:, None]) * n + js[None, :], mask=valid, other=float("-inf"))
    p = _softmax_over_sources(z, valid, qmask, LSE, row, S, qs, qs * 0 + tile == 0)
    cols = tile * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < d
    acc = tl.zeros([S_PAD, BLOCK_D], dt)
    if UNROLL:
        for j in tl.static_range(n):
            x = tl.load(Srcs[j] + row * d + cols, mask=cmask, other=0.0).to(dt)
            acc += _column(p, js, j)[:, None] * x[None, :]
    else:
        srcs = _addresses(Srcs, js)
        for j in range(n):
            x = tl.load(_pointer(srcs, js, j, Srcs[0]) + row * d + cols, mask=cmask, other=0.0).to(dt)
            acc += _column(p, js, j)[:, None] * x[None, :]
    outs = _bases(Outs, qs)
    tl.store(outs[:, None] + row * d + cols[None, :], acc.to(Outs[0].dtype.element_ty),
             mask=qmask[:, None] & cmask[None, :])


@triton.jit
def phase1_bwd(Q, LSE, GLse, Srcs, GOuts, GSrcs, W, d, eps, g_present, HAS_GLSE: tl.constexpr,
               NEED_W: tl.constexpr, BLOCK_D: tl.constexpr, S_PAD: tl.constexpr, N_PAD: tl.constexpr):
    """dz_sj = p_sj (g_s . x_j - g_s . out_s + glse_s), with g_s . out_s = sum_j p_sj g_s . x_j;
    d x_j = sum_s p_sj g_s + r_j sum_s dz_sj q_s - (r_j^2 / d) (sum_s dz_sj z_sj) x_j into
    ``GSrcs``; ``W [rows, n, S] = dz r`` for :func:`phase1_dq` (``NEED_W``). ``GOuts``: the
    ``S`` gradients (bit ``s`` of ``g_present`` unset: absent, read as zero)."""
    dt = Q.dtype.element_ty
    S: tl.constexpr = len(GOuts)
    n: tl.constexpr = len(Srcs)
    row = tl.program_id(0).to(tl.int64)
    qs = tl.arange(0, S_PAD)
    qmask = qs < S
    js = tl.arange(0, N_PAD)
    valid = qmask[:, None] & (js[None, :] < n)
    gmask = qmask & (((g_present >> qs) & 1) == 1)
    grows = _bases(GOuts, qs)
    xx, xq, xg = _phase1_stats(Q, Srcs, grows, gmask, row, d, qs, qmask, js, True, BLOCK_D, S_PAD, N_PAD)
    r = 1.0 / tl.sqrt(xx / d + eps)
    z = xq * r[None, :]
    lse = tl.load(LSE + row * S + qs, mask=qmask, other=0.0)
    p = tl.where(valid, tl.exp(z - lse[:, None]), 0.0)
    shift = tl.sum(p * xg, axis=1)  # g_s . out_s
    if HAS_GLSE:
        shift -= tl.load(GLse + row * S + qs, mask=qmask, other=0.0)
    dz = p * (xg - shift[:, None])
    wr = dz * r[None, :]
    coef = r * r * tl.sum(dz * z, axis=0) / d  # [N_PAD]
    if NEED_W:
        tl.store(W + (row * n + js[None, :]) * S + qs[:, None], wr, mask=valid)
    srcs = _addresses(Srcs, js)
    gsrcs = _addresses(GSrcs, js)
    for j in range(n):  # source by source (as in _phase1_stats): its weights picked out once
        pj, wj, cj = _column(p, js, j)[:, None], _column(wr, js, j)[:, None], _entry(coef, js, j)
        src = _pointer(srcs, js, j, Srcs[0]) + row * d
        gsrc = _pointer(gsrcs, js, j, GSrcs[0]) + row * d
        for start in range(0, d, BLOCK_D):
            cols = start + tl.arange(0, BLOCK_D)
            cmask = cols < d
            x = tl.load(src + cols, mask=cmask, other=0.0).to(dt)
            q = tl.load(Q + qs[:, None] * d + cols[None, :], mask=qmask[:, None] & cmask[None, :], other=0.0).to(dt)
            g = tl.load(grows[:, None] + row * d + cols[None, :], mask=gmask[:, None] & cmask[None, :],
                        other=0.0).to(dt)
            gx = tl.sum(pj * g + wj * q, axis=0) - cj * x
            tl.store(gsrc + cols, gx.to(GSrcs[0].dtype.element_ty), mask=cmask)


@triton.jit
def phase1_dq(W, Srcs, PQ, rows, d, rows_per_program, S: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
              S_PAD: tl.constexpr, N_PAD: tl.constexpr):
    """``PQ [programs, S, d]``: program ``(t, p)``'s sum of ``W[r, j, :]^T x_j[r, tile t]``
    over its rows ``r`` and the sources ``j`` (the queries' gradient is ``PQ.sum(0)``).
    Source by source (its pointer picked out once), ``ROWS`` rows an iteration, unrolled:
    their loads are independent, so they are in flight together."""
    dt = W.dtype.element_ty
    n: tl.constexpr = len(Srcs)
    pid = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < d
    qs = tl.arange(0, S_PAD)
    qmask = qs < S
    js = tl.arange(0, N_PAD)
    srcs = _addresses(Srcs, js)
    acc = tl.zeros([S_PAD, BLOCK_D], dt)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, rows)
    for j in range(n):
        src = _pointer(srcs, js, j, Srcs[0])
        for r0 in range(first, last, ROWS):
            for u in tl.static_range(ROWS):
                row = tl.cast(r0 + u, tl.int64)
                w = tl.load(W + (row * n + j) * S + qs, mask=qmask & (qs * 0 + row < last), other=0.0)
                x = tl.load(src + row * d + cols, mask=cmask & (cols * 0 + row < last), other=0.0).to(dt)
                acc += w[:, None] * x[None, :]
    tl.store(PQ + (pid * S + qs[:, None]) * d + cols[None, :], acc, mask=qmask[:, None] & cmask[None, :])


# ----------------------------------------------------------------------------------------
# Phase 1 over blocks of rows (many rows: training, prefill)
# ----------------------------------------------------------------------------------------


@triton.jit
def _add_to_source(block, js, j, values):
    """``block [..., N_PAD]`` with ``values [...]`` added to its source ``j``."""
    return tl.where(js == j, block + tl.expand_dims(values, len(values.shape)), block)


@triton.jit
def _rows_source(src, rows_at, rmask, cols, cmask, q, g, HAS_G: tl.constexpr):
    """One source's tile ``[ROWS, BLOCK_D]`` (``src``: its data pointer; ``rows_at``: the
    rows' offsets ``row * d``): its sums of squares ``[ROWS]``, its products with the query
    tile ``q [S_PAD, BLOCK_D]`` and (``HAS_G``) with the gradients' tile ``g [ROWS, S_PAD,
    BLOCK_D]``, each ``[ROWS, S_PAD]``."""
    dt = q.dtype
    x = tl.load(src + rows_at[:, None] + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(dt)
    xq = tl.sum(x[:, None, :] * q[None, :, :], axis=2)
    xg = tl.sum(x[:, None, :] * g, axis=2) if HAS_G else xq
    return tl.sum(x * x, axis=1), xq, xg


@triton.jit
def _rows_stats(Q, Srcs, Gs, gmask, rows_at, rmask, d, qs, qmask, js, HAS_G: tl.constexpr, GROUP: tl.constexpr,
                ROWS: tl.constexpr, BLOCK_D: tl.constexpr, S_PAD: tl.constexpr, N_PAD: tl.constexpr):
    """One pass over a block of ``ROWS`` rows (offsets ``rows_at``): each source's sums of
    squares ``[ROWS, N_PAD]``, its dot products with the ``S`` queries and (``HAS_G``) with
    the rows' ``S`` gradients (base pointers ``Gs [S_PAD]``, present where ``gmask``), each
    ``[ROWS, S_PAD, N_PAD]``. ``d`` in tiles, the sources inside a tile: a tile of the
    queries (and of the gradients) is read once for all the block's rows and sources, each
    source's tile once - ``GROUP`` sources an iteration, their loads independent (in flight
    together; all of them at once took too many registers with Triton 3.6)."""
    dt = Q.dtype.element_ty
    n: tl.constexpr = len(Srcs)
    xx = tl.zeros([ROWS, N_PAD], dt)
    xq = tl.zeros([ROWS, S_PAD, N_PAD], dt)
    xg = tl.zeros([ROWS, S_PAD, N_PAD], dt)
    srcs = _addresses(Srcs, js)
    for start in range(0, d, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        cmask = cols < d
        q = tl.load(Q + qs[:, None] * d + cols[None, :], mask=qmask[:, None] & cmask[None, :], other=0.0).to(dt)
        g = q[None, :, :]
        if HAS_G:
            g = tl.load(Gs[None, :, None] + rows_at[:, None, None] + cols[None, None, :],
                        mask=rmask[:, None, None] & gmask[None, :, None] & cmask[None, None, :], other=0.0).to(dt)
        for j0 in range(0, n, GROUP):
            for u in tl.static_range(GROUP):
                j = j0 + u  # (past the last source: its loads masked, its column past n)
                live = rmask & (rows_at * 0 + j < n)
                sq, aq, ag = _rows_source(_pointer(srcs, js, j, Srcs[0]), rows_at, live, cols, cmask, q, g, HAS_G)
                xx, xq = _add_to_source(xx, js, j, sq), _add_to_source(xq, js, j, aq)
                if HAS_G:
                    xg = _add_to_source(xg, js, j, ag)
    return xx, xq, xg


@triton.jit
def phase1_logits_rows(Q, Srcs, Z, rows, S, d, eps, GROUP: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_D: tl.constexpr, S_PAD: tl.constexpr, N_PAD: tl.constexpr):
    """The forward's first half over many rows: program ``b`` reads rows ``b * ROWS ...`` of
    every source once and writes their logits ``Z[row, s, j] = r_j (x_j . q_s)``
    (``Z [rows, S, n]``), which ``phase1_combine`` turns into the weighted sums."""
    n: tl.constexpr = len(Srcs)
    ridx = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = ridx < rows
    qs = tl.arange(0, S_PAD)
    qmask = qs < S
    js = tl.arange(0, N_PAD)
    xx, xq, _ = _rows_stats(Q, Srcs, qs, qmask, ridx * d, rmask, d, qs, qmask, js, False, GROUP, ROWS, BLOCK_D,
                            S_PAD, N_PAD)
    r = 1.0 / tl.sqrt(xx / d + eps)
    valid = rmask[:, None, None] & qmask[None, :, None] & (js[None, None, :] < n)
    tl.store(Z + (ridx[:, None, None] * S + qs[None, :, None]) * n + js[None, None, :], xq * r[:, None, :],
             mask=valid)


@triton.jit
def phase1_bwd_rows(Q, LSE, GLse, Srcs, GOuts, P, W, C, rows, d, eps, g_present, HAS_GLSE: tl.constexpr,
                    GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, S_PAD: tl.constexpr,
                    N_PAD: tl.constexpr):
    """The backward's first half over many rows: program ``b`` reads its ``ROWS`` rows of the
    sources and of the ``S`` gradients ``GOuts`` once (bit ``s`` of ``g_present`` unset:
    absent, read as zero) and writes each row's weights ``P [rows, n, S] = p``, logit
    gradients ``W [rows, n, S] = dz r`` and ``C [rows, n] = r^2 sum_s dz z / d`` (the
    formulas of ``phase1_bwd``), from which ``phase1_grads`` forms every gradient."""
    S: tl.constexpr = len(GOuts)
    n: tl.constexpr = len(Srcs)
    ridx = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = ridx < rows
    qs = tl.arange(0, S_PAD)
    qmask = qs < S
    js = tl.arange(0, N_PAD)
    gmask = qmask & (((g_present >> qs) & 1) == 1)
    xx, xq, xg = _rows_stats(Q, Srcs, _bases(GOuts, qs), gmask, ridx * d, rmask, d, qs, qmask, js, True, GROUP,
                             ROWS, BLOCK_D, S_PAD, N_PAD)
    r = 1.0 / tl.sqrt(xx / d + eps)  # [ROWS, N_PAD]
    z = xq * r[:, None, :]
    at = ridx[:, None] * S + qs[None, :]
    lse = tl.load(LSE + at, mask=rmask[:, None] & qmask[None, :], other=0.0)
    valid = rmask[:, None, None] & qmask[None, :, None] & (js[None, None, :] < n)
    p = tl.where(valid, tl.exp(z - lse[:, :, None]), 0.0)
    shift = tl.sum(p * xg, axis=2)  # g_s . out_s
    if HAS_GLSE:
        shift -= tl.load(GLse + at, mask=rmask[:, None] & qmask[None, :], other=0.0)
    dz = p * (xg - shift[:, :, None])
    coef = r * r * tl.sum(dz * z, axis=1) / d
    by_source = (ridx[:, None, None] * n + js[None, None, :]) * S + qs[None, :, None]
    tl.store(P + by_source, p, mask=valid)
    tl.store(W + by_source, dz * r[:, None, :], mask=valid)
    tl.store(C + ridx[:, None] * n + js[None, :], coef, mask=rmask[:, None] & (js[None, :] < n))


@triton.jit
def _grads_source(src, gsrc, j, rows_at, rmask, cols, cmask, at, S, q, g, P, W, C, qs, qmask, acc):
    """Source ``j``'s gradient on a block of rows and tile of ``d``, written once, and the
    block's contribution ``sum_rows W[row, j]^T x_j`` added to the queries' gradient ``acc``."""
    dt = q.dtype
    rs = rmask[:, None] & qmask[None, :]
    p = tl.load(P + (at[:, None] + j) * S + qs[None, :], mask=rs, other=0.0)  # [ROWS, S_PAD]
    w = tl.load(W + (at[:, None] + j) * S + qs[None, :], mask=rs, other=0.0)
    c = tl.load(C + at + j, mask=rmask, other=0.0)
    xmask = rmask[:, None] & cmask[None, :]
    x = tl.load(src + rows_at[:, None] + cols[None, :], mask=xmask, other=0.0).to(dt)
    acc += tl.sum(w[:, :, None] * x[:, None, :], axis=0)
    gx = tl.sum(p[:, :, None] * g + w[:, :, None] * q[None, :, :], axis=1) - c[:, None] * x
    tl.store(gsrc + rows_at[:, None] + cols[None, :], gx.to(gsrc.dtype.element_ty), mask=xmask)
    return acc


@triton.jit
def phase1_grads(Q, P, W, C, Srcs, GOuts, GSrcs, PQ, rows, d, rows_per_program, g_present, GROUP: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_D: tl.constexpr, S_PAD: tl.constexpr, N_PAD: tl.constexpr):
    """The backward's second half: program ``(t, b)`` walks its range of rows in blocks of
    ``ROWS`` at tile ``t`` of ``d``, reading the sources' and the gradients' tiles once:
    each source's gradient ``d x_j = sum_s p_sj g_s + sum_s w_sj q_s - c_j x_j`` written once,
    and the queries' gradient ``sum_rows sum_j W[row, j]^T x_j`` summed in registers, written
    as the program's row of ``PQ [programs, S, d]`` (added afterwards: no atomics)."""
    dt = Q.dtype.element_ty
    S: tl.constexpr = len(GOuts)
    n: tl.constexpr = len(Srcs)
    pid = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < d
    qs = tl.arange(0, S_PAD)
    qmask = qs < S
    js = tl.arange(0, N_PAD)
    gmask = qmask & (((g_present >> qs) & 1) == 1)
    gbases = _bases(GOuts, qs)
    q = tl.load(Q + qs[:, None] * d + cols[None, :], mask=qmask[:, None] & cmask[None, :], other=0.0).to(dt)
    srcs = _addresses(Srcs, js)
    gsrcs = _addresses(GSrcs, js)
    acc = tl.zeros([S_PAD, BLOCK_D], dt)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, rows)
    for r0 in range(first, last, ROWS):
        ridx = tl.cast(r0, tl.int64) + tl.arange(0, ROWS)
        rmask = ridx < last
        rows_at = ridx * d
        g = tl.load(gbases[None, :, None] + rows_at[:, None, None] + cols[None, None, :],
                    mask=rmask[:, None, None] & gmask[None, :, None] & cmask[None, None, :], other=0.0).to(dt)
        for j0 in range(0, n, GROUP):
            for u in tl.static_range(GROUP):
                j = j0 + u  # (past the last source: masked)
                acc = _grads_source(_pointer(srcs, js, j, Srcs[0]), _pointer(gsrcs, js, j, GSrcs[0]), j, rows_at,
                                    rmask & (ridx * 0 + j < n), cols, cmask, ridx * n, S, q, g, P, W, C, qs, qmask,
                                    acc)
    tl.store(PQ + (pid * S + qs[:, None]) * d + cols[None, :], acc, mask=qmask[:, None] & cmask[None, :])


# ----------------------------------------------------------------------------------------
# The merge: alpha = softmax(z, zc), h = sum_j alpha_j x_j, RMSNorm(h)
# ----------------------------------------------------------------------------------------


@triton.jit
def _rms_logit(x, qg, d, eps):
    """A computed source's RMS factor ``r = 1 / rms(x)`` and logit ``r (x . qg)``."""
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
    return r, r * tl.sum(x * qg, axis=0)


@triton.jit
def _through_norm(g, h, w, rstd, d):
    """The gradient ``g`` reaching the norm's output ``h * rstd * w``, passed back to ``h``."""
    g = g * w
    return rstd * g - (rstd * rstd * rstd * tl.sum(g * h, axis=0) / d) * h


@triton.jit
def _merge_addresses(Known, Comp, ms):
    """The data pointers of the ``k`` known then the ``c`` computed sources (or of their
    gradients) as one int64 vector indexed by ``ms``."""
    k: tl.constexpr = len(Known)
    addresses = tl.zeros(ms.shape, tl.int64)
    for j in tl.static_range(k):
        addresses = tl.where(ms == j, Known[j].to(tl.int64), addresses)
    for j in tl.static_range(len(Comp)):
        addresses = tl.where(ms == k + j, Comp[j].to(tl.int64), addresses)
    return addresses


@triton.jit
def merge_fwd(Z, stride_z, Known, Comp, Addend, Total, Qg, NormW, Out, Alpha, Rc, Zc, Rstd, d, eps, norm_eps,
              HAS_ADDEND: tl.constexpr, HAS_NORM: tl.constexpr, D_PAD: tl.constexpr, M_PAD: tl.constexpr):
    """``Known``: ``k`` sources of known logit ``Z [rows, k]`` (row stride ``stride_z``);
    ``Comp``: ``c`` sources whose logits ``r (x . qg)`` it computes (into ``Zc``, their RMS
    factors into ``Rc``); ``HAS_ADDEND``: the last of them is ``Comp[-1] + Addend``, written
    to ``Total`` (in the sources' dtype) and read back from registers. Writes the weights
    ``Alpha [rows, k + c]``, ``h`` or its RMSNorm into ``Out`` (in its own dtype: the
    sources', or the autocast dtype a sublayer's linear layers read) and the norm's ``1/rms``
    into ``Rstd``: an online softmax over the sources, each read once, the row in registers.
    ``Total`` has the sources' dtype (without an addend it stands in, unread, for the
    sources' pointer type and the stream's dtype): every source is read through it, so Phase-1
    sums narrower than the stream come converted (``triton_impl._known``)."""
    dt = Alpha.dtype.element_ty
    k: tl.constexpr = len(Known)
    c: tl.constexpr = len(Comp)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, D_PAD)
    cmask = cols < d
    ms = tl.arange(0, M_PAD)
    sources = _merge_addresses(Known, Comp, ms)
    known = tl.load(Z + row * stride_z + ms, mask=ms < k, other=float("-inf")).to(dt)
    logits = tl.full([M_PAD], float("-inf"), dt)
    mx = tl.full([], float("-inf"), dt)
    den = tl.zeros([], dt)
    h = tl.zeros([D_PAD], dt)
    for j in range(k + c):
        x = tl.load(_pointer(sources, ms, j, Total) + row * d + cols, mask=cmask, other=0.0).to(dt)
        if HAS_ADDEND:
            if j == k + c - 1:  # Block AttnRes' partial sum, formed here: the sum as stored
                x = (x + tl.load(Addend + row * d + cols, mask=cmask, other=0.0).to(dt)).to(Total.dtype.element_ty)
                tl.store(Total + row * d + cols, x, mask=cmask)
                x = x.to(dt)
        if j >= k:  # a computed source: its logit and RMS factor
            rj, zj = _rms_logit(x, tl.load(Qg + cols, mask=cmask, other=0.0).to(dt), d, eps)
            tl.store(Rc + row * c + j - k, rj)
            tl.store(Zc + row * c + j - k, zj)
        else:
            zj = _entry(known, ms, j)
        logits = tl.where(ms == j, zj, logits)
        new = tl.maximum(mx, zj)
        scale = tl.exp(mx - new)
        e = tl.exp(zj - new)
        h = h * scale + e * x
        den = den * scale + e
        mx = new
    tl.store(Alpha + row * (k + c) + ms, tl.exp(logits - mx) / den, mask=ms < k + c)
    h = h / den
    if HAS_NORM:
        h = h.to(Total.dtype.element_ty).to(dt)  # the norm reads the stream's value, rounded to its dtype
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / d + norm_eps)
        tl.store(Rstd + row, rstd)
        h = h * rstd * tl.load(NormW + cols, mask=cmask, other=0.0).to(dt)
    tl.store(Out + row * d + cols, h.to(Out.dtype.element_ty), mask=cmask)


@triton.jit
def merge_bwd(Gs, Alpha, Rc, Zc, Rstd, Known, Comp, Qg, NormW, GTotal, GZ, GKnown, GComp, GAddend, Part, rows, d,
              HAS_TOTAL: tl.constexpr, HAS_ADDEND_GRAD: tl.constexpr, HAS_NORM: tl.constexpr, D_PAD: tl.constexpr,
              M_PAD: tl.constexpr):
    """With g_h the gradient reaching h (the sum of ``Gs``, through the norm where there is one):
    dz_j = alpha_j (s_j - sum_i alpha_i s_i), s_j = g_h . x_j; dx_j = alpha_j g_h; a computed
    source's logit adds gr (qg - (r zc / d) x) to its gradient (gr = dzc r) and gr x to the
    query's; ``HAS_TOTAL``: the last source's gradient from elsewhere, ``GTotal``, is added
    to its own; ``HAS_ADDEND_GRAD``: the last source's gradient (the sum's, which is the
    addend's) also written to ``GAddend`` in its dtype (a bf16 addend on a float32 stream: no
    cast of it afterwards). ``Part [P, 2, d]``: each program's sums over its rows of the
    query's gradient (row 0) and the norm gain's (row 1). ``Gs``: the gradients of ``Out``'s
    readers (one, or one per view of it handed to a reader), in ``Out``'s dtype, added up in
    the compute dtype; ``GTotal`` has the sources' dtype (without ``HAS_TOTAL`` it stands in,
    unread, for their pointer type)."""
    dt = Alpha.dtype.element_ty
    st = GTotal.dtype.element_ty
    k: tl.constexpr = len(Known)
    c: tl.constexpr = len(Comp)
    m: tl.constexpr = k + c
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, D_PAD)
    cmask = cols < d
    ms = tl.arange(0, M_PAD)
    sources = _merge_addresses(Known, Comp, ms)
    grads = _merge_addresses(GKnown, GComp, ms)
    g_qg = tl.zeros([D_PAD], dt)
    g_w = tl.zeros([D_PAD], dt)
    for r in range(pid, rows, programs):
        row = tl.cast(r, tl.int64)
        alpha = tl.load(Alpha + row * m + ms, mask=ms < m, other=0.0)
        gh = _rows_sum(Gs, row, d, cols, cmask, dt)
        if HAS_NORM:  # h recomputed, rounded as the forward rounded it; then through the norm
            h = tl.zeros([D_PAD], dt)
            for j in range(m):
                h += _entry(alpha, ms, j) * tl.load(_pointer(sources, ms, j, GTotal) + row * d + cols, mask=cmask,
                                                    other=0.0).to(dt)
            h = h.to(st).to(dt)
            rstd = tl.load(Rstd + row)
            g_w += gh * h * rstd
            gh = _through_norm(gh, h, tl.load(NormW + cols, mask=cmask, other=0.0).to(dt), rstd, d)
        s = tl.zeros([M_PAD], dt)  # s_j = g_h . x_j
        for j in range(m):
            x = tl.load(_pointer(sources, ms, j, GTotal) + row * d + cols, mask=cmask, other=0.0).to(dt)
            s = tl.where(ms == j, tl.sum(gh * x, axis=0), s)
        dz = alpha * (s - tl.sum(alpha * s, axis=0))
        if k > 0:
            tl.store(GZ + row * k + ms, dz, mask=ms < k)
        for j in range(m):
            gx = _entry(alpha, ms, j) * gh
            if j >= k:  # d zc / d x = r qg - (r^2 zc / d) x, plus the direct weight
                x = tl.load(_pointer(sources, ms, j, GTotal) + row * d + cols, mask=cmask, other=0.0).to(dt)
                rj = tl.load(Rc + row * c + j - k)
                gr = _entry(dz, ms, j) * rj
                gx += gr * tl.load(Qg + cols, mask=cmask, other=0.0).to(dt)
                gx -= (gr * rj * tl.load(Zc + row * c + j - k) / d) * x
                g_qg += gr * x
            if HAS_TOTAL:
                if j == m - 1:
                    gx += tl.load(GTotal + row * d + cols, mask=cmask, other=0.0).to(dt)
            tl.store(_pointer(grads, ms, j, GTotal) + row * d + cols, gx.to(st), mask=cmask)
            if HAS_ADDEND_GRAD:
                if j == m - 1:
                    tl.store(GAddend + row * d + cols, gx.to(GAddend.dtype.element_ty), mask=cmask)
    tl.store(Part + pid * 2 * d + cols, g_qg, mask=cmask)
    tl.store(Part + (pid * 2 + 1) * d + cols, g_w, mask=cmask)


# ----------------------------------------------------------------------------------------
# The merge over a few sources, each read once and held: persistent programs whose loop
# over rows Triton pipelines (the next rows' loads in flight while a row is computed)
# ----------------------------------------------------------------------------------------


@triton.jit
def _row(Ptr, row, d, cols, cmask, dt):
    """Row ``row`` of the ``[rows, d]`` tensor at ``Ptr``, in ``dt`` (0 past ``d``)."""
    return tl.load(Ptr + row * d + cols, mask=cmask, other=0.0).to(dt)


@triton.jit
def _rows_sum(Ptrs, row, d, cols, cmask, dt):
    """The sum in ``dt`` of row ``row`` of each ``[rows, d]`` tensor of the tuple ``Ptrs``
    (the gradients of a merge's readers: each read once, added in the compute dtype)."""
    total = _row(Ptrs[0], row, d, cols, cmask, dt)
    for i in tl.static_range(1, len(Ptrs)):
        total += _row(Ptrs[i], row, d, cols, cmask, dt)
    return total


@triton.jit
def _vector(Ptr, cols, cmask, dt, PRESENT: tl.constexpr):
    """The ``[d]`` vector at ``Ptr`` in ``dt`` if ``PRESENT`` (else zeros: ``Ptr`` stands in
    for an absent one and is not read)."""
    if PRESENT:
        v = tl.load(Ptr + cols, mask=cmask, other=0.0).to(dt)
    else:
        v = tl.zeros(cols.shape, dt)
    return v


@triton.jit
def _held_sources(Known, Comp, Addend, Total, row, d, cols, cmask, dt, HAS_ADDEND: tl.constexpr):
    """The row's ``k`` known then ``c`` computed sources as a tuple, each loaded once (the
    loads unrolled, in flight together); with an addend, the last computed source is its
    sum with ``Addend``, rounded to the stream's dtype and written to ``Total``."""
    xs = ()
    for j in tl.static_range(len(Known)):
        xs = xs + (_row(Known[j], row, d, cols, cmask, dt),)
    for j in tl.static_range(len(Comp)):
        x = _row(Comp[j], row, d, cols, cmask, dt)
        if HAS_ADDEND:
            if j == len(Comp) - 1:  # Block AttnRes' partial sum, formed here: the sum as stored
                x = (x + _row(Addend, row, d, cols, cmask, dt)).to(Total.dtype.element_ty)
                tl.store(Total + row * d + cols, x, mask=cmask)
                x = x.to(dt)
        xs = xs + (x,)
    return xs


@triton.jit
def _weighted_sum(alpha, ms, xs, dt, D_PAD: tl.constexpr):
    """``sum_j alpha_j xs[j]``, the sources in order."""
    h = tl.zeros([D_PAD], dt)
    for j in tl.static_range(len(xs)):
        h += _entry(alpha, ms, j) * xs[j]
    return h


@triton.jit
def merge_fwd_held(Z, stride_z, Known, Comp, Addend, Total, Qg, NormW, Out, Alpha, Rc, Zc, Rstd, rows, d, eps,
                   norm_eps, HAS_ADDEND: tl.constexpr, HAS_NORM: tl.constexpr, D_PAD: tl.constexpr,
                   M_PAD: tl.constexpr, STAGES: tl.constexpr):
    """:func:`merge_fwd` over a few sources, held: a program walks rows ``pid, pid + P,
    ...`` in a loop Triton pipelines ``STAGES`` deep, loads each source of a row once (all of
    them in flight together), computes the logits, the weights (a softmax over the ``k + c``
    logits at once), ``h = sum_j alpha_j x_j`` - the sum the backward recomputes - and the
    norm."""
    dt = Alpha.dtype.element_ty
    k: tl.constexpr = len(Known)
    c: tl.constexpr = len(Comp)
    cols = tl.arange(0, D_PAD)
    cmask = cols < d
    ms = tl.arange(0, M_PAD)
    qg = _vector(Qg, cols, cmask, dt, c > 0)
    w = _vector(NormW, cols, cmask, dt, HAS_NORM)
    for r in tl.range(tl.program_id(0), rows, tl.num_programs(0), num_stages=STAGES):
        row = tl.cast(r, tl.int64)
        xs = _held_sources(Known, Comp, Addend, Total, row, d, cols, cmask, dt, HAS_ADDEND)
        logits = tl.load(Z + row * stride_z + ms, mask=ms < k, other=float("-inf")).to(dt)
        for j in tl.static_range(c):  # the computed sources' logits and RMS factors
            rj, zj = _rms_logit(xs[k + j], qg, d, eps)
            tl.store(Rc + row * c + j, rj)
            tl.store(Zc + row * c + j, zj)
            logits = tl.where(ms == k + j, zj, logits)
        e = tl.exp(logits - tl.max(logits, axis=0))  # (padding: exp(-inf) = 0)
        alpha = e / tl.sum(e, axis=0)
        tl.store(Alpha + row * (k + c) + ms, alpha, mask=ms < k + c)
        h = _weighted_sum(alpha, ms, xs, dt, D_PAD)
        if HAS_NORM:
            h = h.to(Total.dtype.element_ty).to(dt)  # the norm reads the stream's value, rounded to its dtype
            rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / d + norm_eps)
            tl.store(Rstd + row, rstd)
            h = h * rstd * w
        tl.store(Out + row * d + cols, h.to(Out.dtype.element_ty), mask=cmask)


@triton.jit
def merge_bwd_held(Gs, Alpha, Rc, Zc, Rstd, Known, Comp, Qg, NormW, GTotal, GZ, GKnown, GComp, GAddend, Part, rows,
                   d, HAS_TOTAL: tl.constexpr, HAS_ADDEND_GRAD: tl.constexpr, HAS_NORM: tl.constexpr,
                   D_PAD: tl.constexpr, M_PAD: tl.constexpr, STAGES: tl.constexpr):
    """:func:`merge_bwd` over a few sources, held: the same math and ``Part``, each source of
    a row loaded once (with the gradients ``Gs`` and ``GTotal``, in flight together) and kept in registers
    for every pass, in a loop over rows Triton pipelines ``STAGES`` deep."""
    dt = Alpha.dtype.element_ty
    st = GTotal.dtype.element_ty
    k: tl.constexpr = len(Known)
    c: tl.constexpr = len(Comp)
    m: tl.constexpr = k + c
    cols = tl.arange(0, D_PAD)
    cmask = cols < d
    ms = tl.arange(0, M_PAD)
    qg = _vector(Qg, cols, cmask, dt, c > 0)
    w = _vector(NormW, cols, cmask, dt, HAS_NORM)
    g_qg = tl.zeros([D_PAD], dt)
    g_w = tl.zeros([D_PAD], dt)
    for r in tl.range(tl.program_id(0), rows, tl.num_programs(0), num_stages=STAGES):
        row = tl.cast(r, tl.int64)
        alpha = tl.load(Alpha + row * m + ms, mask=ms < m, other=0.0)
        gh = _rows_sum(Gs, row, d, cols, cmask, dt)
        xs = _held_sources(Known, Comp, Gs[0], Gs[0], row, d, cols, cmask, dt, False)
        if HAS_TOTAL:
            g_total = _row(GTotal, row, d, cols, cmask, dt)
        if HAS_NORM:  # h recomputed, rounded as the forward rounded it; then through the norm
            h = _weighted_sum(alpha, ms, xs, dt, D_PAD).to(st).to(dt)
            rstd = tl.load(Rstd + row)
            g_w += gh * h * rstd
            gh = _through_norm(gh, h, w, rstd, d)
        s = tl.zeros([M_PAD], dt)  # s_j = g_h . x_j
        for j in tl.static_range(m):
            s = tl.where(ms == j, tl.sum(gh * xs[j], axis=0), s)
        dz = alpha * (s - tl.sum(alpha * s, axis=0))
        if k > 0:
            tl.store(GZ + row * k + ms, dz, mask=ms < k)
        for j in tl.static_range(m):
            gx = _entry(alpha, ms, j) * gh
            if j >= k:  # d zc / d x = r qg - (r^2 zc / d) x, plus the direct weight
                rj = tl.load(Rc + row * c + j - k)
                gr = _entry(dz, ms, j) * rj
                gx += gr * qg - (gr * rj * tl.load(Zc + row * c + j - k) / d) * xs[j]
                g_qg += gr * xs[j]
            if HAS_TOTAL:
                if j == m - 1:
                    gx += g_total
            if j < k:  # (in its own dtype: Phase-1 sums may be stored narrower than the stream)
                tl.store(GKnown[j] + row * d + cols, gx.to(GKnown[j].dtype.element_ty), mask=cmask)
            else:
                tl.store(GComp[j - k] + row * d + cols, gx.to(st), mask=cmask)
            if HAS_ADDEND_GRAD:
                if j == m - 1:
                    tl.store(GAddend + row * d + cols, gx.to(GAddend.dtype.element_ty), mask=cmask)
    pid = tl.program_id(0)
    tl.store(Part + pid * 2 * d + cols, g_qg, mask=cmask)
    tl.store(Part + (pid * 2 + 1) * d + cols, g_w, mask=cmask)
