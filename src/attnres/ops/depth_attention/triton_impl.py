"""The Triton implementation of the depth-attention operations (GPUs; on CPU only under
Triton's interpreter, ``TRITON_INTERPRET=1``, which is how the tests run it).

``phase1`` and ``merge`` run the kernels of :mod:`.triton_kernels`; ``rms_logits`` - two
skinny matrix products, ``[tokens, d] x [d, K]`` and their transposes - runs the PyTorch
implementation, i.e. cuBLAS on a GPU. Sources and results are passed to the kernels as
tables of data pointers. The functions have the signatures of :mod:`.torch_impl`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
from torch import Tensor

from . import torch_impl, triton_kernels
from .reference import compute_dtype
from .triton_launch import num_warps, row_ranges, s_pad, tile_d

__all__ = ["supports", "check", "rms_logits_forward", "rms_logits_backward", "phase1_forward", "phase1_backward",
           "merge_forward", "merge_backward"]

#: Storage dtypes of the sources the kernels take (computing in float32; float64 in float64).
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: Launch geometry forced by the tests (``block_d``: the tile; ``max_programs``: the
#: merge backward's programs); ``None``: :mod:`.triton_launch` chooses.
FORCED = {"block_d": None, "max_programs": None}

rms_logits_forward = torch_impl.rms_logits_forward
rms_logits_backward = torch_impl.rms_logits_backward


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


def _table(tensors: Sequence[Tensor]) -> Tensor:
    """The data pointers of ``tensors`` as an int64 tensor on their device (through pinned
    memory on a GPU: a copy that does not wait for the device)."""
    device = tensors[0].device
    table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, pin_memory=device.type == "cuda")
    return table.to(device, non_blocking=True)


def _rows(x: Tensor) -> Tensor:
    """``x [..., d]`` as contiguous rows ``[tokens, d]``."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def _vector(x: Tensor | None, like: Tensor) -> Tensor:
    """A ``[d]`` parameter in ``like``'s (the compute) dtype, contiguous; a dummy for ``None``."""
    return (x if x is not None else like.new_zeros(1)).to(like.dtype).contiguous()


def phase1_forward(z: Tensor, sources: Sequence[Tensor]) -> tuple[list[Tensor], Tensor]:
    x0 = sources[0]
    d, S, n = x0.shape[-1], z.shape[-2], len(sources)
    srcs = [_rows(x) for x in sources]
    rows = srcs[0].shape[0]
    zr = z.reshape(rows, S, n).to(compute_dtype(x0.dtype)).contiguous()
    lse = torch.empty(rows, S, device=x0.device, dtype=zr.dtype)
    outs = [torch.empty_like(srcs[0]) for _ in range(S)]
    pad = s_pad(S)
    block = FORCED["block_d"] or tile_d(d, pad)
    for s0 in range(0, S, pad):  # queries in chunks of the largest padding
        count = min(pad, S - s0)
        triton_kernels.phase1_fwd[(rows, triton.cdiv(d, block))](
            zr[:, s0:], lse[:, s0:], _table(srcs), _table(outs[s0 : s0 + count]), srcs[0], d, n, count,
            zr.stride(0), zr.stride(1), lse.stride(0), BLOCK_D=block, S_PAD=pad, num_warps=num_warps(block * pad))
    lead = x0.shape[:-1]
    return [o.view(*lead, d) for o in outs], lse.view(*lead, S).to(z.dtype)


def phase1_backward(z, lse, sources, g_outs, g_lse, needs_z: bool, needs_sources: Sequence[bool]):
    x0 = sources[0]
    d, S, n = x0.shape[-1], z.shape[-2], len(sources)
    srcs = [_rows(x) for x in sources]
    rows = srcs[0].shape[0]
    zr = z.reshape(rows, S, n).to(compute_dtype(x0.dtype)).contiguous()
    lr = lse.reshape(rows, S).to(zr.dtype).contiguous()
    zero = torch.zeros_like(srcs[0]) if any(g is None for g in g_outs) else None
    gouts = [zero if g is None else _rows(g.to(x0.dtype)) for g in g_outs]
    glse = torch.zeros_like(lr) if g_lse is None else g_lse.reshape(rows, S).to(lr.dtype).contiguous()
    gz = torch.empty_like(zr)
    gsrc = [torch.empty_like(srcs[0]) for _ in range(n)]
    pad = s_pad(S)
    block = FORCED["block_d"] or tile_d(d, pad)
    for s0 in range(0, S, pad):
        count = min(pad, S - s0)
        part = [torch.empty_like(srcs[0]) for _ in range(n)] if s0 else gsrc
        triton_kernels.phase1_bwd[(rows,)](
            zr[:, s0:], lr[:, s0:], glse[:, s0:], _table(srcs), _table(gouts[s0 : s0 + count]), _table(part), gz[:, s0:],
            srcs[0], d, n, count, zr.stride(0), zr.stride(1), lr.stride(0), BLOCK_D=block, S_PAD=pad,
            num_warps=num_warps(block * pad))
        if s0:  # every chunk of queries adds to the sources' gradients
            for g, p in zip(gsrc, part):
                g.add_(p)
    lead = x0.shape[:-1]
    g_src = [g.view(*lead, d) if need else None for g, need in zip(gsrc, needs_sources)]
    return (gz.view(z.shape).to(z.dtype) if needs_z else None), g_src


def merge_forward(z, sources, partial, qg, norm_weight, eps: float, norm_eps: float):
    x0 = sources[0]
    d, n = x0.shape[-1], len(sources)
    srcs = [_rows(x) for x in sources]
    rows, dev = srcs[0].shape[0], x0.device
    has_partial, has_norm = partial is not None, norm_weight is not None
    f32 = compute_dtype(x0.dtype)
    out = torch.empty_like(srcs[0])
    alpha = torch.empty(rows, n + has_partial, device=dev, dtype=f32)
    r_b, zb, rstd = (torch.empty(rows, device=dev, dtype=f32) for _ in range(3))
    block = FORCED["block_d"] or tile_d(d)
    triton_kernels.merge_fwd[(rows,)](
        z.reshape(rows, n).to(f32).contiguous(), _table(srcs), srcs[0], _rows(partial) if has_partial else srcs[0],
        _vector(qg, alpha), _vector(norm_weight, alpha), out, alpha, r_b, zb, rstd, d, n, float(eps), float(norm_eps),
        int(has_partial), int(has_norm), BLOCK_D=block, num_warps=num_warps(block))
    lead = x0.shape[:-1]
    return (out.view(x0.shape), alpha.view(*lead, -1), r_b.view(lead) if has_partial else None,
            zb.view(lead) if has_partial else None, rstd.view(*lead, 1) if has_norm else None)


def merge_backward(g, alpha, r_b, zb, rstd, sources, partial, qg, norm_weight, needs):
    x0 = sources[0]
    d, n = x0.shape[-1], len(sources)
    srcs = [_rows(x) for x in sources]
    rows, dev = srcs[0].shape[0], x0.device
    has_partial, has_norm = partial is not None, norm_weight is not None
    f32 = compute_dtype(x0.dtype)
    gr = _rows(g.to(x0.dtype))
    gh = torch.empty_like(gr) if has_norm else gr
    al = alpha.reshape(rows, -1).to(f32).contiguous()
    stat = lambda t: t.reshape(rows).to(f32).contiguous() if t is not None else al  # noqa: E731
    gsrc = [torch.empty_like(srcs[0]) for _ in range(n)]
    gz = torch.empty(rows, n, device=dev, dtype=f32)
    g_partial = torch.empty_like(srcs[0]) if has_partial else gr
    programs, per = row_ranges(rows, FORCED["max_programs"])
    pq = torch.zeros(programs, d, device=dev, dtype=f32)
    pw = torch.zeros(programs, d, device=dev, dtype=f32)
    block = FORCED["block_d"] or tile_d(d)
    triton_kernels.merge_bwd[(programs,)](
        gr, gh, al, stat(r_b), stat(zb), stat(rstd), _table(srcs),
        srcs[0], _rows(partial) if has_partial else srcs[0], _vector(qg, al), _vector(norm_weight, al), _table(gsrc), gz,
        g_partial, pq, pw, rows, d, n, per, int(has_partial), int(has_norm),
        BLOCK_D=block, num_warps=num_warps(block))
    needs_z, needs_src, (needs_partial, needs_qg, needs_norm) = needs[0], needs[1 : n + 1], needs[n + 1 :]
    lead = x0.shape[:-1]
    return ((gz.view(*lead, n).to(alpha.dtype) if needs_z else None),
            [gx.view(x0.shape) if need else None for gx, need in zip(gsrc, needs_src)],
            g_partial.view(x0.shape).to(partial.dtype) if has_partial and needs_partial else None,
            pq.sum(0).to(qg.dtype) if has_partial and needs_qg else None,
            pw.sum(0).to(norm_weight.dtype) if has_norm and needs_norm else None)
