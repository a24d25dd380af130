"""The Triton implementation of the depth-attention operations (GPUs; on CPU only under
Triton's interpreter, ``TRITON_INTERPRET=1``, which is how the tests run it).

The launchers of :mod:`.triton_kernels`, with the signatures of :mod:`.torch_impl`. Sources
and results are passed to the kernels as tables of data pointers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
from torch import Tensor

from . import triton_kernels
from .reference import compute_dtype
from .triton_launch import launch_options, row_ranges, s_pad, tile_d

__all__ = ["supports", "check", "phase1_forward", "phase1_backward", "merge_forward", "merge_backward"]

#: Storage dtypes of the sources the kernels take (computing in float32; float64 in float64).
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: Launch geometry forced by the tests (``block_d``: the tile; ``max_programs``: the
#: backward kernels' programs); ``None``: :mod:`.triton_launch` chooses.
FORCED = {"block_d": None, "max_programs": None}


def supports(tensors: Sequence[Tensor | None]) -> bool:
    """Whether the kernels take these tensors: the first (a source) in a storage dtype of
    :data:`DTYPES`, all on one device."""
    present = [t for t in tensors if t is not None]
    return present[0].dtype in DTYPES and all(t.device == present[0].device for t in present)


def check(tensors: Sequence[Tensor | None]) -> None:
    """Raise ``ValueError`` unless :func:`supports` (the ``"triton"`` implementation was
    asked for explicitly)."""
    if not supports(tensors):
        raise ValueError(f"impl='triton' takes sources in {[str(d) for d in DTYPES]} on one device; got "
                         f"{next(t for t in tensors if t is not None).dtype}")


def _table(tensors: Sequence[Tensor], like: Tensor) -> Tensor:
    """The data pointers of ``tensors`` as an int64 tensor on ``like``'s device (through
    pinned memory on a GPU: a copy that does not wait for the device); a null entry for
    none."""
    cuda = like.device.type == "cuda"
    table = torch.tensor([t.data_ptr() for t in tensors] or [0], dtype=torch.int64, pin_memory=cuda)
    return table.to(like.device, non_blocking=True)


def _rows(x: Tensor) -> Tensor:
    """``x [..., d]`` as contiguous rows ``[tokens, d]``."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def _vector(x: Tensor | None, like: Tensor) -> Tensor:
    """A parameter in ``like``'s (the compute) dtype, contiguous; a dummy for ``None``."""
    return (x if x is not None else like.new_zeros(1)).to(like.dtype).contiguous()


def _chunks(S: int, d: int):
    """The Phase-1 query chunks ``(start, count)``, their padding and tile."""
    pad = s_pad(S)
    return [(s0, min(pad, S - s0)) for s0 in range(0, S, pad)], pad, FORCED["block_d"] or tile_d(d, pad)


def phase1_forward(qg: Tensor, sources: Sequence[Tensor], eps: float) -> tuple[list[Tensor], Tensor]:
    x0 = sources[0]
    d, S, n = x0.shape[-1], qg.shape[0], len(sources)
    srcs = [_rows(x) for x in sources]
    rows, compute = srcs[0].shape[0], compute_dtype(x0.dtype)
    q = qg.to(compute).contiguous()
    lse = torch.empty(rows, S, device=x0.device, dtype=compute)
    outs = [torch.empty_like(srcs[0]) for _ in range(S)]
    chunks, pad, block = _chunks(S, d)
    zs, rs = torch.empty(rows, pad, n, device=x0.device, dtype=compute), torch.empty(rows, n, device=x0.device, dtype=compute)
    for s0, count in chunks:
        triton_kernels.phase1_fwd[(rows,)](
            q[s0:], lse[:, s0:], _table(srcs, x0), _table(outs[s0 : s0 + count], x0), srcs[0], zs, rs, d, n, count,
            lse.stride(0), float(eps), BLOCK_D=block, S_PAD=pad, **launch_options("phase1_fwd", block, pad))
    lead = x0.shape[:-1]
    return [o.view(*lead, d) for o in outs], lse.view(*lead, S)


def phase1_backward(qg, lse, sources, g_outs, g_lse, eps: float, needs_qg: bool, needs_sources: Sequence[bool]):
    x0 = sources[0]
    d, S, n = x0.shape[-1], qg.shape[0], len(sources)
    srcs = [_rows(x) for x in sources]
    rows, compute = srcs[0].shape[0], compute_dtype(x0.dtype)
    q, lr = qg.to(compute).contiguous(), lse.reshape(rows, S).to(compute).contiguous()
    zero = torch.zeros_like(srcs[0]) if any(g is None for g in g_outs) else None
    gouts = [zero if g is None else _rows(g.to(x0.dtype)) for g in g_outs]
    glse = torch.zeros_like(lr) if g_lse is None else g_lse.reshape(rows, S).to(compute).contiguous()
    gsrc = [torch.zeros_like(srcs[0]) for _ in range(n)]
    chunks, pad, block = _chunks(S, d)
    programs, per = row_ranges(rows, FORCED["max_programs"])
    zs, rs = torch.empty(rows, pad, n, device=x0.device, dtype=compute), torch.empty(rows, n, device=x0.device, dtype=compute)
    g_qg = torch.zeros(S, d, device=x0.device, dtype=compute)
    for s0, count in chunks:
        part = [torch.empty_like(srcs[0]) for _ in range(n)]  # every chunk of queries adds to the sources' gradients
        pq = torch.zeros(programs, pad, d, device=x0.device, dtype=compute)
        triton_kernels.phase1_bwd[(programs,)](
            q[s0:], lr[:, s0:], glse[:, s0:], _table(srcs, x0), _table(gouts[s0 : s0 + count], x0), _table(part, x0),
            srcs[0], zs, rs, pq, rows, d, n, count, lr.stride(0), float(eps), per, BLOCK_D=block, S_PAD=pad,
            **launch_options("phase1_bwd", block, pad))
        for g, p in zip(gsrc, part):
            g.add_(p)
        g_qg[s0 : s0 + count] = pq.sum(0)[:count]
    lead = x0.shape[:-1]
    g_src = [g.view(*lead, d) if need else None for g, need in zip(gsrc, needs_sources)]
    return (g_qg.to(qg.dtype) if needs_qg else None), g_src


def merge_forward(z, sources, computed, qg, norm_weight, eps: float, norm_eps: float):
    xs = [_rows(x) for x in (*sources, *computed)]
    x0, k, c = xs[0], len(sources), len(computed)
    rows, d, dev, compute = x0.shape[0], x0.shape[1], x0.device, compute_dtype(x0.dtype)
    out = torch.empty_like(x0)
    alpha = torch.empty(rows, k + c, device=dev, dtype=compute)
    rc, zc = (torch.empty(rows, max(c, 1), device=dev, dtype=compute) for _ in range(2))
    rstd = torch.empty(rows, device=dev, dtype=compute)
    block = FORCED["block_d"] or tile_d(d)
    triton_kernels.merge_fwd[(rows,)](
        z.reshape(rows, k).to(compute).contiguous() if k else alpha, _table(xs[:k], x0), _table(xs[k:], x0), x0,
        _vector(qg, alpha), _vector(norm_weight, alpha), out, alpha, rc, zc, rstd, d, k, c, float(eps),
        float(norm_eps), int(norm_weight is not None), BLOCK_D=block, **launch_options("merge_fwd", block))
    lead = (list(sources) + list(computed))[0].shape[:-1]
    return (out.view(*lead, d), alpha.view(*lead, -1), rc.view(*lead, -1) if c else None,
            zc.view(*lead, -1) if c else None, rstd.view(*lead, 1) if norm_weight is not None else None)


def merge_backward(g, alpha, rc, zc, rstd, sources, computed, qg, norm_weight, needs):
    xs = [_rows(x) for x in (*sources, *computed)]
    x0, k, c = xs[0], len(sources), len(computed)
    rows, d, dev, compute = x0.shape[0], x0.shape[1], x0.device, compute_dtype(x0.dtype)
    has_norm = norm_weight is not None
    gr = _rows(g.to(x0.dtype))
    # g_h, the gradient reaching h, in the compute dtype (the norm's result is not rounded)
    gh = torch.empty(rows, d, device=dev, dtype=compute) if has_norm else gr.to(compute)
    al = alpha.reshape(rows, -1).to(compute).contiguous()
    stat = lambda t: t.reshape(rows, -1).to(compute).contiguous() if t is not None else al  # noqa: E731
    grads = [torch.empty_like(x0) for _ in range(k + c)]
    gz = torch.empty(rows, max(k, 1), device=dev, dtype=compute)
    programs, per = row_ranges(rows, FORCED["max_programs"])
    pq = torch.zeros(programs, d, device=dev, dtype=compute)
    pw = torch.zeros(programs, d, device=dev, dtype=compute)
    block = FORCED["block_d"] or tile_d(d)
    triton_kernels.merge_bwd[(programs,)](
        gr, gh, al, stat(rc), stat(zc), stat(rstd), _table(xs[:k], x0), _table(xs[k:], x0), x0, _vector(qg, al),
        _vector(norm_weight, al), _table(grads[:k], x0), _table(grads[k:], x0), gz, pq, pw, rows, d, k, c, per,
        int(has_norm), BLOCK_D=block, **launch_options("merge_bwd", block))
    needs_z, needs_x, (needs_qg, needs_norm) = needs[0], needs[1 : 1 + k + c], needs[1 + k + c :]
    shapes = [x.shape for x in (*sources, *computed)]
    grads = [gx.view(shape) if need else None for gx, shape, need in zip(grads, shapes, needs_x)]
    lead = shapes[0][:-1]
    return ((gz[:, :k].reshape(*lead, k).to(alpha.dtype) if needs_z else None), grads[:k], grads[k:],
            pq.sum(0).to(qg.dtype) if c and needs_qg else None,
            pw.sum(0).to(norm_weight.dtype) if has_norm and needs_norm else None)
