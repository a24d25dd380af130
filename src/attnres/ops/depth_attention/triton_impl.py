"""The Triton implementation of the depth-attention operations (GPUs; on CPU only under
Triton's interpreter, ``TRITON_INTERPRET=1``, which is how the tests run it).

The launchers of :mod:`.triton_kernels`, with the signatures of :mod:`.torch_impl`. A call
allocates its results and launches its kernels - nothing else reaches the device: sources
travel as tuples of tensors (no pointer table, no host-to-device copy), Phase 1's
log-sum-exps may arrive as strided views (the merge takes a row stride), and every device
operation of a call is counted by a test (``tests/test_depth_attention_ops.py``): one kernel
per forward (two for Phase 1 over a few rows, split over sources), a kernel and one sum per
merge backward, two kernels and one sum per Phase-1 backward. Shapes past
:mod:`.triton_launch`'s limits run :mod:`.torch_impl` instead.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor
from triton.runtime.errors import OutOfResources

from . import torch_impl, triton_kernels
from .reference import compute_dtype
from .triton_launch import (DQ_ROWS, backward_holds, backward_programs, dq_grid, held_backward_warps, held_programs,
                            merge_fits, merge_holds, merge_stages, merge_warps, pad, phase1_combine_tile, phase1_fits,
                            phase1_forward_geometry, phase1_group, phase1_rows_geometry, phase1_splits, phase1_tile,
                            phase1_unrolls, phase1_warps, row_pad, rows_backward_warps, rows_warps)

__all__ = ["supports", "check", "unsupported_gpu", "phase1_forward", "phase1_backward", "merge_forward", "merge_backward"]

#: Storage dtypes of the sources the kernels take (computing in float32; float64 in float64).
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: Launch geometry forced by the tests and the GPU check's sweeps (``block_d``: Phase 1's
#: tile; ``programs``: the programs over rows of the merge's backward and of the queries'
#: gradient; ``merge_warps``: the merge programs' warps; ``phase1_split``: whether Phase 1's
#: forward runs split over sources, where it can; ``phase1_rows``: whether Phase 1 over many
#: rows runs over blocks of rows, else one program per row; ``phase1_group``: the sources
#: those kernels load together; ``merge_held``: whether a merge over a few sources holds them,
#: else loops over them; ``merge_stages``: the held merges' pipeline depth); ``None``:
#: :mod:`.triton_launch` chooses.
FORCED = {"block_d": None, "programs": None, "merge_warps": None, "phase1_split": None, "phase1_rows": None,
          "phase1_group": None, "merge_held": None, "merge_stages": None}


def _group(n: int, S: int, rows: int, storage: torch.dtype) -> int:
    """``GROUP`` of the kernels over blocks of ``rows`` rows for ``n`` sources and ``S``
    queries stored in ``storage`` (forced, or chosen)."""
    if FORCED["phase1_group"]:
        return min(n, FORCED["phase1_group"])
    return phase1_group(n, S, rows, storage.itemsize >= 8)


def _over_rows() -> bool:
    """Whether Phase 1 over more rows than a decoding step's runs over blocks of rows."""
    return FORCED["phase1_rows"] is not False


def _held(m: int, d: int) -> bool:
    """Whether a merge of ``m`` sources at hidden size ``d`` runs the kernels that hold them
    (``merge_*_held``; forced ``True``: at any ``d``)."""
    if FORCED["merge_held"] is None:
        return merge_holds(m, d)
    return FORCED["merge_held"] and merge_holds(m)


def _held_programs(rows: int, warps: int, device: torch.device) -> int:
    """Programs of a held merge over ``rows`` rows (forced, or as many as stay resident)."""
    if FORCED["programs"]:
        return min(rows, FORCED["programs"])
    return held_programs(rows, _sms(device), warps)


def _stages(d: int, loads: Sequence[Tensor | None], rows: int, programs: int) -> int:
    """The pipeline depth of a held merge's ``programs`` loading, for each of ``rows`` rows,
    a row of ``d`` elements of each tensor of ``loads`` (``None``: none)."""
    row_bytes = d * sum(t.element_size() for t in loads if t is not None)
    return FORCED["merge_stages"] or merge_stages(row_bytes, -(-rows // programs))


#: The pipeline depths of held merges that the device's shared memory could not hold, by
#: kernel, signature, launch flags and the depth :func:`_stages` chose: each row loaded ahead
#: takes a row of every input in shared memory - at d = 4096 the backward asks 64.1 KiB two
#: deep in float32 and 128 KiB in float64, past the 99 KiB of an RTX 4090, A10, L4 or L40S.
_FITTED_STAGES: dict[tuple, int] = {}


def _launch_held(kernel, programs: int, args: tuple, stages: int, flags: dict) -> None:
    """Launch a held merge pipelined ``stages`` deep, or as deep as the device's shared
    memory allows (Triton checks a kernel's shared memory against the device's before it
    launches anything, and raises ``OutOfResources``; down to 1, not pipelined, which needs
    no more than a few KiB). A depth found too deep is remembered, so it fails once a
    process. A forced depth (``FORCED["merge_stages"]``: a sweep) is run as forced or raises."""
    if FORCED["merge_stages"]:
        kernel[(programs,)](*args, STAGES=stages, **flags)
        return
    key = lambda: (kernel, _signature(args), asked, tuple(sorted(flags.items())))  # noqa: E731 (built if needed)
    asked = stages
    if _FITTED_STAGES:
        stages = _FITTED_STAGES.get(key(), stages)
    while True:
        try:
            kernel[(programs,)](*args, STAGES=stages, **flags)
            return
        except OutOfResources:
            if stages == 1:
                raise
            stages -= 1
            _FITTED_STAGES[key()] = stages


def _signature(args: tuple) -> tuple:
    """What of a launch's arguments decides its kernel's shared memory besides the flags: the
    tensors' dtypes and device, and how many travel in each tuple."""
    return tuple(_signature(a) if isinstance(a, tuple) else (a.dtype, a.device) if isinstance(a, Tensor) else None
                 for a in args)


#: The oldest compute capability Triton compiles for (torch's Inductor refuses older cards,
#: Pascal and before, the same way).
MIN_CAPABILITY = (7, 0)


@functools.cache
def unsupported_gpu(device: torch.device) -> str | None:
    """Why the kernels cannot run on ``device``, a CUDA card older than
    :data:`MIN_CAPABILITY` (Triton fails there at its first compile), or ``None``."""
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) >= MIN_CAPABILITY:
        return None
    return (f"{torch.cuda.get_device_name(device)} ({device}, compute capability {capability[0]}.{capability[1]}) is "
            f"older than Triton compiles for ({MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]})")


def supports(tensors: Sequence[Tensor | None]) -> bool:
    """Whether the kernels take these tensors: the first (a source) in a storage dtype of
    :data:`DTYPES`, all on one device, a device Triton compiles for."""
    present = [t for t in tensors if t is not None]
    device = present[0].device
    return (present[0].dtype in DTYPES and all(t.device == device for t in present)
            and unsupported_gpu(device) is None)


def check(tensors: Sequence[Tensor | None]) -> None:
    """Raise ``ValueError`` unless :func:`supports` (the ``"triton"`` implementation was
    asked for explicitly) on a device the kernels run on: CUDA, or any under Triton's
    interpreter (on CPU without it, Triton said '0 active drivers ([]). There should only be one.')."""
    first = next(t for t in tensors if t is not None)
    too_old = unsupported_gpu(first.device)
    if too_old is not None:
        raise ValueError(f"backend='triton' cannot run here: {too_old}; use backend='auto' (PyTorch on such a GPU) "
                         "or 'torch'")
    if not supports(tensors):
        raise ValueError(f"backend='triton' takes sources in {[str(d) for d in DTYPES]} on one device; got "
                         f"{first.dtype}")
    if first.device.type != "cuda" and type(triton_kernels._bases).__name__ != "InterpretedFunction":
        raise ValueError(f"backend='triton' runs the Triton kernels on CUDA tensors (on others only under Triton's "
                         f"interpreter, TRITON_INTERPRET=1 set before triton is imported); got tensors on "
                         f"{first.device}: use backend='auto' (picks by device) or 'torch'")


@functools.cache
def _device_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # (the interpreter: a few programs, so that the tests cover programs over several rows)


def _sms(device: torch.device) -> int:
    """Multiprocessors to size the grids for: as many as forced programs, if forced."""
    return FORCED["programs"] or _device_sms(device)


#: Bytes every tensor handed to a kernel is aligned to: the kernels tell the compiler so of
#: the pointers they pick from a tuple (``triton_kernels._pointer``), which makes their
#: accesses 16 bytes wide.
ALIGNMENT = 16


def _c(x: Tensor) -> Tensor:
    """``x`` contiguous and :data:`ALIGNMENT`-aligned (a fresh allocation is; a view at an odd
    offset is copied)."""
    if not x.is_contiguous():
        return x.contiguous()
    return x if x.data_ptr() % ALIGNMENT == 0 else x.clone()


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _geometry(x0: Tensor) -> tuple[int, int, torch.dtype]:
    """``(rows, d, compute dtype)`` of sources shaped like ``x0``."""
    d = x0.shape[-1]
    return (x0.numel() // d if d else 0), d, compute_dtype(x0.dtype)


def _first_tensor(args: tuple) -> Tensor:
    """The first tensor among ``args`` or inside their first non-empty sequence."""
    for a in args:
        if isinstance(a, Tensor):
            return a
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], Tensor):
            return a[0]
    raise TypeError("no tensor among the arguments")


def on_the_tensors_device(fn):
    """Run ``fn`` with its tensors' CUDA device current: Triton launches a kernel on the
    current device, whatever device its tensors are on, so a model on ``cuda:1`` - or spread
    over devices (``device_map``, pipeline stages in one process) - would launch on
    ``cuda:0`` with another device's pointers: an error, or wrong numbers. One comparison
    where the device is already current."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        t = _first_tensor(args)
        if t.is_cuda and t.get_device() != torch.cuda.current_device():
            with torch.cuda.device(t.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


# ----------------------------------------------------------------------------------------
# phase1
# ----------------------------------------------------------------------------------------


@on_the_tensors_device
def phase1_forward(qg: Tensor, sources: Sequence[Tensor], eps: float, out_dtype=None) -> tuple[list[Tensor], Tensor]:
    x0 = sources[0]
    rows, d, compute = _geometry(x0)
    S = qg.shape[0]
    if not phase1_fits(S, len(sources)):
        return torch_impl.phase1_forward(qg, sources, eps, out_dtype)
    # (the kernels store the sums through Outs' element type: the sources' or, under
    # autocast_phase1_sums, the autocast dtype)
    outs = tuple(torch.empty(x0.shape, dtype=out_dtype or x0.dtype, device=x0.device) for _ in range(S))
    lse = torch.empty((*x0.shape[:-1], S), dtype=compute, device=x0.device)
    if rows:
        wide, n = compute == torch.float64, len(sources)
        block, warps = phase1_forward_geometry(rows, d, S, FORCED["block_d"], wide)
        q, srcs = _as(qg, compute), tuple(_c(x) for x in sources)
        split = phase1_splits(rows) if FORCED["phase1_split"] is None else FORCED["phase1_split"]
        if split or _over_rows():
            z = torch.empty((rows, S, n), dtype=compute, device=x0.device)
            if split:
                triton_kernels.phase1_logits[(rows, n)](q, srcs, z, S, d, float(eps), BLOCK_D=block, S_PAD=pad(S),
                                                        N_PAD=pad(n), num_warps=warps)
            else:
                block_rows, block = phase1_rows_geometry(d, S, wide, FORCED["block_d"])
                triton_kernels.phase1_logits_rows[(-(-rows // block_rows),)](
                    q, srcs, z, rows, S, d, float(eps), GROUP=_group(n, S, block_rows, x0.dtype), ROWS=block_rows,
                    BLOCK_D=block, S_PAD=pad(S), N_PAD=pad(n), num_warps=rows_warps(S))
            tile = phase1_combine_tile(d, S, wide)
            triton_kernels.phase1_combine[(rows, -(-d // tile))](z, srcs, outs, lse, S, d, BLOCK_D=tile, S_PAD=pad(S),
                                                                 N_PAD=pad(n), UNROLL=phase1_unrolls(n), num_warps=4)
        else:
            triton_kernels.phase1_fwd[(rows,)](q, srcs, outs, lse, d, float(eps), BLOCK_D=block, S_PAD=pad(S),
                                               N_PAD=pad(n), num_warps=warps)
    return list(outs), lse


@on_the_tensors_device
def phase1_backward(qg, lse, sources, g_outs, g_lse, eps: float, needs_qg: bool, needs_sources: Sequence[bool]):
    x0 = sources[0]
    rows, d, compute = _geometry(x0)
    S, n = qg.shape[0], len(sources)
    if not phase1_fits(S, n):
        return torch_impl.phase1_backward(qg, lse, sources, g_outs, g_lse, eps, needs_qg, needs_sources)
    srcs = tuple(_c(x) for x in sources)
    q = _as(qg, compute)
    present = sum(1 << s for s, g in enumerate(g_outs) if g is not None)
    # (in the sums' dtype, which the kernels read them through - GOuts[0]'s pointer type - and
    # convert; an absent one stands in as a present one, never read)
    like = next((g for g in g_outs if g is not None), x0)
    gouts = tuple(like if g is None else _c(_as(g, like.dtype)) for g in g_outs)
    g_src = tuple(torch.empty(x0.shape, dtype=x0.dtype, device=x0.device) for _ in range(n))
    g_qg = None
    if rows and _over_rows():
        g_qg = _phase1_backward_rows(q, lse, g_lse, srcs, gouts, g_src, present, eps, rows, d, needs_qg)
    elif rows:
        w = torch.empty((rows, n, S), dtype=compute, device=x0.device) if needs_qg else lse
        block = phase1_tile(d, S, FORCED["block_d"], compute == torch.float64)
        glse = lse if g_lse is None else _c(_as(g_lse, compute))
        triton_kernels.phase1_bwd[(rows,)](
            q, _c(lse), glse, srcs, gouts, g_src, w, d, float(eps), present, HAS_GLSE=g_lse is not None,
            NEED_W=needs_qg, BLOCK_D=block, S_PAD=pad(S), N_PAD=pad(n), num_warps=phase1_warps(S))
        if needs_qg:
            tiles, programs, per = dq_grid(rows, d, block, _sms(x0.device), FORCED["programs"])
            pq = torch.empty((programs, S, d), dtype=compute, device=x0.device)
            triton_kernels.phase1_dq[(tiles, programs)](w, srcs, pq, rows, d, per, S=S, ROWS=DQ_ROWS, BLOCK_D=block,
                                                         S_PAD=pad(S), N_PAD=pad(n), num_warps=phase1_warps(S))
            g_qg = pq.sum(0) if programs > 1 else pq[0]
    elif needs_qg:
        g_qg = torch.zeros_like(q)
    if g_qg is not None:
        g_qg = _as(g_qg, qg.dtype)
    return g_qg, [g if need else None for g, need in zip(g_src, needs_sources)]


def _phase1_backward_rows(q, lse, g_lse, srcs, gouts, g_src, present: int, eps: float, rows: int, d: int,
                          needs_qg: bool) -> Tensor | None:
    """Phase 1's backward over blocks of rows (``phase1_bwd_rows``, then ``phase1_grads``):
    fills ``g_src`` and returns the queries' gradient (in the compute dtype) if needed."""
    S, n, compute, dev = q.shape[0], len(srcs), q.dtype, q.device
    wide = compute == torch.float64
    block_rows, block = phase1_rows_geometry(d, S, wide, FORCED["block_d"])
    group = _group(n, S, block_rows, srcs[0].dtype)
    p, w = (torch.empty((rows, n, S), dtype=compute, device=dev) for _ in range(2))
    c = torch.empty((rows, n), dtype=compute, device=dev)
    glse = lse if g_lse is None else _c(_as(g_lse, compute))
    narrow = gouts[0].element_size() < srcs[0].element_size()  # (Phase-1 sums narrower than the stream)
    triton_kernels.phase1_bwd_rows[(-(-rows // block_rows),)](
        q, _c(lse), glse, srcs, gouts, p, w, c, rows, d, float(eps), present, HAS_GLSE=g_lse is not None,
        GROUP=group, ROWS=block_rows, BLOCK_D=block, S_PAD=pad(S), N_PAD=pad(n),
        num_warps=rows_backward_warps(S, narrow))
    tiles, programs, per = dq_grid(rows, d, block, _sms(dev), FORCED["programs"], block_rows)
    pq = torch.empty((programs, S, d), dtype=compute, device=dev)
    triton_kernels.phase1_grads[(tiles, programs)](
        q, p, w, c, srcs, gouts, g_src, pq, rows, d, per, present, GROUP=group, ROWS=block_rows, BLOCK_D=block,
        S_PAD=pad(S), N_PAD=pad(n), num_warps=rows_warps(S))
    if not needs_qg:
        return None
    return pq.sum(0) if programs > 1 else pq[0]


# ----------------------------------------------------------------------------------------
# merge
# ----------------------------------------------------------------------------------------


@on_the_tensors_device
def merge_forward(z, sources, computed, qg, norm_weight, eps: float, norm_eps: float, addend=None, out_dtype=None):
    x0 = _stream(sources, computed)
    rows, d, compute = _geometry(x0)
    k, c = len(sources), len(computed)
    if not merge_fits(d, k + c):
        return torch_impl.merge_forward(z, sources, computed, qg, norm_weight, eps, norm_eps, addend, out_dtype)
    lead, dev = x0.shape[:-1], x0.device
    out = torch.empty(x0.shape, dtype=out_dtype or x0.dtype, device=dev)
    total = torch.empty(x0.shape, dtype=x0.dtype, device=dev) if addend is not None else None
    alpha = torch.empty((*lead, k + c), dtype=compute, device=dev)
    rc = torch.empty((*lead, c), dtype=compute, device=dev) if c else None
    zc = torch.empty((*lead, c), dtype=compute, device=dev) if c else None
    rstd = torch.empty((*lead, 1), dtype=compute, device=dev) if norm_weight is not None else None
    if rows:
        zr = _as(z, compute).reshape(rows, k) if k else alpha
        if k > 1 and zr.stride(1) != 1:
            zr = zr.contiguous()
        d_pad = row_pad(d)
        warps = FORCED["merge_warps"] or merge_warps(d_pad)
        held = _held(k + c, d)
        args = (zr, zr.stride(0) if k else 0, _known(sources, x0, held), tuple(_c(x) for x in computed),
                x0 if addend is None else _c(addend), x0 if total is None else total,  # (x0: unread stand-ins)
                alpha if qg is None else _as(qg, compute), alpha if norm_weight is None else _as(norm_weight, compute),
                out, alpha, alpha if rc is None else rc, alpha if zc is None else zc, alpha if rstd is None else rstd)
        flags = dict(HAS_ADDEND=addend is not None, HAS_NORM=norm_weight is not None, D_PAD=d_pad, M_PAD=pad(k + c),
                     num_warps=warps)
        if held:
            programs = _held_programs(rows, warps, dev)
            _launch_held(triton_kernels.merge_fwd_held, programs, (*args, rows, d, float(eps), float(norm_eps)),
                         _stages(d, [*sources, *computed, addend], rows, programs), flags)
        else:
            triton_kernels.merge_fwd[(rows,)](*args, d, float(eps), float(norm_eps), **flags)
    return out, alpha, rc, zc, rstd, total


@on_the_tensors_device
def merge_backward(g, alpha, rc, zc, rstd, sources, computed, qg, norm_weight, needs, g_total=None,
                   addend_dtype=None, g_views=()):
    xs = [*sources, *computed]
    x0 = _stream(sources, computed)
    rows, d, compute = _geometry(x0)
    k, c = len(sources), len(computed)
    if not merge_fits(d, k + c):
        return torch_impl.merge_backward(g, alpha, rc, zc, rstd, sources, computed, qg, norm_weight, needs, g_total,
                                         addend_dtype, g_views)
    gs = (g, *g_views)
    lead, dev = x0.shape[:-1], x0.device
    has_norm = norm_weight is not None
    needs_z, needs_x, (needs_qg, needs_norm) = needs[0], needs[1 : 1 + k + c], needs[1 + k + c :]
    d_pad = row_pad(d)
    # (a gradient read or written narrower than the stream - or Phase-1 sums stored so: twice
    # the warps, if held)
    narrow = any(t is not None and t.element_size() < x0.element_size() for t in (*gs, *sources)) or (
        addend_dtype is not None and addend_dtype.itemsize < x0.element_size())
    held = bool(rows) and _held(k + c, d) and backward_holds(d_pad, narrow)
    # (each source's gradient in its dtype; the looping kernels write every one in the stream's)
    grads = tuple(torch.empty(x0.shape, dtype=x.dtype if held else x0.dtype, device=dev) for x in xs)
    # (the addend's gradient, the last source's in its own dtype: written by the kernel too)
    g_addend = torch.empty(x0.shape, dtype=addend_dtype, device=dev) if addend_dtype is not None else None
    g_z = torch.empty((*lead, k), dtype=compute, device=dev)
    want_qg, want_norm = bool(c and needs_qg), bool(has_norm and needs_norm)
    g_qg = g_norm = None
    if rows:
        warps = FORCED["merge_warps"] or (held_backward_warps(d_pad, narrow) if held else merge_warps(d_pad))
        if held:
            programs = _held_programs(rows, warps, dev)
        else:
            programs = min(rows, FORCED["programs"]) if FORCED["programs"] else backward_programs(
                rows, d_pad, _sms(dev), warps)
        part = torch.empty((programs, 2, d), dtype=compute, device=dev)
        stat = lambda t: alpha if t is None else _c(t)  # noqa: E731
        args = (tuple(_c(t) for t in gs), _c(alpha), stat(rc), stat(zc), stat(rstd), _known(sources, x0, held),
                tuple(_c(x) for x in computed), alpha if qg is None else _as(qg, compute),
                alpha if norm_weight is None else _as(norm_weight, compute),
                grads[-1] if g_total is None else _c(_as(g_total, x0.dtype)), g_z if k else alpha, grads[:k],
                grads[k:], grads[-1] if g_addend is None else g_addend, part, rows, d)
        flags = dict(HAS_TOTAL=g_total is not None, HAS_ADDEND_GRAD=g_addend is not None, HAS_NORM=has_norm,
                     D_PAD=d_pad, M_PAD=pad(k + c), num_warps=warps)
        if held:
            _launch_held(triton_kernels.merge_bwd_held, programs, args,
                         _stages(d, [*xs, *gs, None if g_total is None else x0], rows, programs), flags)
        else:
            triton_kernels.merge_bwd[(programs,)](*args, **flags)
        # (one sum each: an operator's results may not share memory)
        g_qg = _as(part[:, 0].sum(0), qg.dtype) if want_qg else None
        g_norm = _as(part[:, 1].sum(0), norm_weight.dtype) if want_norm else None
    else:
        g_qg = torch.zeros_like(qg) if want_qg else None
        g_norm = torch.zeros_like(norm_weight) if want_norm else None
    grads = [_as(gx, x.dtype) if need else None for gx, x, need in zip(grads, xs, needs_x)]
    return (g_z if needs_z else None), grads[:k], grads[k:], g_qg, g_norm, (g_addend if needs_x[-1] else None)


def _stream(sources: Sequence[Tensor], computed: Sequence[Tensor]) -> Tensor:
    """A merge's source in the stream's dtype (:func:`.reference.stream_dtype`): the launchers
    take the output's, the sums' and the gradients' default dtype from it, and the kernels
    the stream's from the stand-ins made of it."""
    return (list(computed) or list(sources))[0]


def _known(sources: Sequence[Tensor], x0: Tensor, held: bool) -> tuple[Tensor, ...]:
    """The sources of known logit as the kernels take them: the held merges load each through
    its own pointer type (Phase-1 sums narrower than the stream, ``autocast_phase1_sums``,
    read as they are); the looping ones pick every source through the stream's, so narrower
    sums are converted first (exactly)."""
    return tuple(_c(x) if held else _c(_as(x, x0.dtype)) for x in sources)
