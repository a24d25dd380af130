"""The depth-attention operations (``attnres.ops.depth_attention``): every implementation -
PyTorch, the CPU kernel (``backend="auto"`` on CPU float32 / float64) and Triton (compiled on
a CUDA device where there is one, else under Triton's interpreter: ``conftest.TRITON_DEVICE``;
inputs are made on the CPU and moved there) - as ``torch.library`` custom operators.

* ``torch.library.opcheck`` of every operator, forward and backward operators, float32 and
  float64, for each implementation;
* every implementation against the plain-graph reference, forward and every gradient: in
  float64 to rounding, with ``gradcheck``; in float32 and bfloat16 under the per-dtype rule
  of ``conftest.fast_path_violations`` against the float64 truth; over random shapes;
* the dispatch by device and dtype, what the operators save for the backward, the Triton
  kernels' tiling, and the CPU kernel's build and checked binding.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import stat
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from torch.autograd import gradcheck
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from attnres import machine
from attnres.ops import operations
from attnres.ops.depth_attention import cpu_kernel, library, reference, torch_impl

from conftest import (OP_TOL_BF16, TOL, TRITON_DEVICE, assert_fast_matches_naive, assert_rel_close, to_cpu, to_triton_device,
                      triton_device)

BACKENDS = ["auto", "torch", pytest.param("triton", marks=pytest.mark.triton)]


def triton_or_skip(backend: str) -> None:
    if backend == "triton":
        triton_device()


@pytest.fixture
def kernel():
    """The CPU kernel, built: a machine with a C compiler must build it (a failed build
    would otherwise pass silently on the PyTorch implementation)."""
    if cpu_kernel.switched_off():
        pytest.skip("CPU kernel switched off")
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine (the PyTorch implementation runs instead)")
    assert cpu_kernel.cpu_kernel() is not None, "the CPU kernel did not build (see the warning)"
    return cpu_kernel.cpu_kernel()


# ----------------------------------------------------------------------------------------
# Inputs and the functions under test, by operation
# ----------------------------------------------------------------------------------------


def rnd(g, *shape, scale=1.0, dtype=torch.float64):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()


def merge_inputs(lead=(2, 3), d=5, k=1, c=1, norm=True, dtype=torch.float64, seed=0):
    """``(z, sources, computed, qg, norm_weight)``: ``k`` sources of known logit, ``c`` whose
    logits the merge computes; logits and queries in the compute dtype."""
    g = torch.Generator().manual_seed(seed)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    sources = [rnd(g, *lead, d, scale=1 + 2 * j, dtype=dtype) for j in range(k)]
    computed = [rnd(g, *lead, d, scale=3.0 + j, dtype=dtype) for j in range(c)]
    z = rnd(g, *lead, k, scale=2.0, dtype=compute)
    qg = rnd(g, d, dtype=compute) if c else None
    w = (1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64)).to(compute).requires_grad_() if norm else None
    return z, sources, computed, qg, w


def run_merge(backend, z, sources, computed, qg, w):
    if backend == "reference":
        return reference.merge(z, sources, computed, qg, 1e-6, w, 1e-5)
    if backend == "triton":
        return to_cpu(library.merge(*to_triton_device((z, sources, computed, qg)), 1e-6, to_triton_device(w), 1e-5,
                                    backend))
    return library.merge(z, sources, computed, qg, 1e-6, w, 1e-5, backend)


def phase1_inputs(lead=(2, 3), d=5, S=3, n=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return rnd(g, S, d, dtype=compute), [rnd(g, *lead, d, scale=1 + j, dtype=dtype) for j in range(n)]


def run_phase1(backend, qg, sources):
    if backend == "reference":
        return reference.phase1(qg, sources, 1e-6)
    if backend == "triton":
        return to_cpu(library.phase1(*to_triton_device((qg, sources)), 1e-6, backend))
    return library.phase1(qg, sources, 1e-6, backend)


def outputs_and_grads(fn, inputs, seed=1):
    """``fn(*inputs)`` (a tensor or a tuple/list of them) and the gradient of a random
    projection of every output with respect to every input."""
    out = fn(*inputs)
    flat = [t for t in (out if isinstance(out, (tuple, list)) else [out]) for t in (t if isinstance(t, list) else [t])]
    g = torch.Generator().manual_seed(seed)
    loss = sum((t.double() * torch.randn(t.shape, generator=g, dtype=torch.float64)).sum() for t in flat)
    return [*flat, *torch.autograd.grad(loss, inputs, allow_unused=True)]


def merge_flat(z, sources, computed, qg, w):
    return [z, *sources, *computed, *([qg] if qg is not None else []), *([w] if w is not None else [])]


def merge_fn(backend, k, c, norm):
    """``run_merge`` over the flat inputs of :func:`merge_flat`."""
    def f(z, *rest):
        rest = list(rest)
        w = rest.pop() if norm else None
        qg = rest.pop() if c else None
        return run_merge(backend, z, rest[:k], rest[k:], qg, w)[0]

    return f


def phase1_fn(backend):
    return lambda qg, *xs: run_phase1(backend, qg, list(xs))


# ----------------------------------------------------------------------------------------
# opcheck
# ----------------------------------------------------------------------------------------


def op_cases(dtype):
    z, sources, computed, qg, w = merge_inputs((2, 3), 6, 1, 2, True, dtype)
    pq, psrc = phase1_inputs((2, 2), 6, 2, 3, dtype)
    return {
        "phase1": (torch.ops.attnres.phase1.default, (pq, psrc, 1e-6)),
        "merge": (torch.ops.attnres.merge.default, (z, sources, computed, qg, w, 1e-6, 1e-5)),
        "merge_computed_only": (torch.ops.attnres.merge.default, (z[..., :0], [], computed, qg, None, 1e-6, 1e-5)),
        "merge_known_only": (torch.ops.attnres.merge.default, (z, sources, [], None, w, 1e-6, 1e-5)),
    }


def backward_args(op, args, backend):
    """The backward operator of ``op`` and its arguments, from a forward run."""
    with torch.no_grad():
        if op is torch.ops.attnres.phase1.default:
            qg, sources, eps = args
            outs, lse = op(qg, sources, eps, backend)
            g_outs = [torch.randn_like(outs[0]), None]
            return torch.ops.attnres.phase1_backward.default, (qg, lse, sources, g_outs, torch.randn_like(lse), eps,
                                                                [True] * (1 + len(sources)))
        z, sources, computed, qg, w, eps, norm_eps = args
        out, alpha, rc, zc, rstd, _total = op(*args, backend)
        stats = [rc if computed else None, zc if computed else None, rstd if w is not None else None]
        needs = [True] * (1 + len(sources) + len(computed)) + [qg is not None, w is not None]
        return torch.ops.attnres.merge_backward.default, (torch.randn_like(out), [], alpha, *stats, sources, computed,
                                                          qg, w, needs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["phase1", "merge", "merge_computed_only", "merge_known_only"])
def test_opcheck_every_operator_forward_and_backward(case, dtype, backend, kernel):
    triton_or_skip(backend)
    op, args = op_cases(dtype)[case]
    if backend == "triton":
        args = tree_map_only(torch.Tensor, lambda t: to_triton_device(t.detach()).requires_grad_(t.requires_grad), args)
    torch.library.opcheck(op, (*args, backend))
    bop, bargs = backward_args(op, args, backend)
    torch.library.opcheck(bop, (*tree_map_only(torch.Tensor, torch.Tensor.detach, bargs), backend))


# ----------------------------------------------------------------------------------------
# Every implementation against the reference
# ----------------------------------------------------------------------------------------

MERGE_CASES = [  # (lead, d, k, c, norm): one token, one source, known / computed sources only
    ((2, 3), 5, 1, 1, True),
    ((1, 1), 4, 1, 1, True),
    ((2, 3), 5, 1, 3, True),
    ((2, 1), 6, 2, 0, False),
    ((3,), 7, 0, 2, True),
    ((3,), 7, 0, 1, True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lead, d, k, c, norm", MERGE_CASES)
def test_merge_float64_equals_the_reference_and_gradchecks(lead, d, k, c, norm, backend, kernel):
    triton_or_skip(backend)
    inputs = merge_flat(*merge_inputs(lead, d, k, c, norm))
    got = outputs_and_grads(merge_fn(backend, k, c, norm), inputs)
    want = outputs_and_grads(merge_fn("reference", k, c, norm), inputs)
    for a, b in zip(got, want):
        assert_rel_close(a, b, 1e-12)
    assert gradcheck(merge_fn(backend, k, c, norm), tuple(inputs), fast_mode=lead != (1, 1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lead, d, S, n", [((2, 3), 5, 3, 4), ((1, 1), 4, 2, 3), ((2, 1), 3, 1, 2), ((1, 2), 6, 5, 1),
                                           ((3,), 37, 19, 2)])
def test_phase1_float64_equals_the_reference_and_gradchecks(lead, d, S, n, backend, kernel):
    """``S`` = 1 to 19 queries (past two Triton chunks of 8), ``d`` below and past the CPU
    kernel's vector blocks, one source, batch 1 and one token."""
    triton_or_skip(backend)
    qg, sources = phase1_inputs(lead, d, S, n)
    got = outputs_and_grads(phase1_fn(backend), [qg, *sources])
    want = outputs_and_grads(phase1_fn("reference"), [qg, *sources])
    for a, b in zip(got, want):
        assert_rel_close(a, b, 1e-12)
    flat = lambda *xs: tuple(t for o in phase1_fn(backend)(*xs) for t in (o if isinstance(o, list) else [o]))  # noqa: E731
    if S > 8:  # (one output: the cotangents of single outputs, and absent ones, are checked at the smaller S -
        # gradcheck runs a backward per output, 30 s under Triton's interpreter at S = 19)
        flat = lambda *xs, _f=flat: torch.cat([t.reshape(-1) for t in _f(*xs)])  # noqa: E731
    assert gradcheck(flat, (qg, *sources), fast_mode=True)


def addend_fn(backend):
    """The merge with an addend (the sum formed inside: Block AttnRes' partial sum plus the
    last output) over flat inputs ``(z, x, partial, addend, qg, w)`` -> ``(out, sum)``; for
    ``"unfused"``, the reference's add and merge."""
    def f(z, x, partial, addend, qg, w):
        if backend == "unfused":
            total = partial + addend
            return reference.merge(z, [x], [total], qg, 1e-6, w, 1e-5)[0], total
        if backend == "reference":
            out, _, total = reference.merge(z, [x], [partial], qg, 1e-6, w, 1e-5, addend=addend)
            return out, total
        args = (z, [x], [partial], qg, 1e-6, w, 1e-5, backend)
        if backend == "triton":
            z, x, partial, addend, qg, w = to_triton_device((z, x, partial, addend, qg, w))
            args = (z, [x], [partial], qg, 1e-6, w, 1e-5, backend)
            out, _, total = library.merge(*args, addend=addend)
            return to_cpu(out), to_cpu(total)
        out, _, total = library.merge(*args, addend=addend)
        return out, total

    return f


def addend_inputs(dtype=torch.float64, addend_dtype=None, lead=(2, 3), d=6):
    z, sources, computed, qg, w = merge_inputs(lead, d, 1, 1, True, dtype)
    g = torch.Generator().manual_seed(7)
    addend = rnd(g, *lead, d, scale=2.0, dtype=addend_dtype or dtype)
    return [z, sources[0], computed[0], addend, qg, w]


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_merge_with_an_addend_equals_the_add_then_the_merge_and_gradchecks(backend, kernel):
    """The sum formed inside the merge: the output, the sum and every gradient (the sum's
    own gradient from downstream reaching both terms) equal an add followed by the merge,
    in float64 to rounding with ``gradcheck``; in float32 with a bfloat16 addend (a
    sublayer's output under autocast), the sum exactly and the rest to float32 rounding."""
    triton_or_skip(backend)
    inputs = addend_inputs()
    for a, b in zip(outputs_and_grads(addend_fn(backend), inputs), outputs_and_grads(addend_fn("unfused"), inputs)):
        assert_rel_close(a, b, 1e-12)
    assert gradcheck(addend_fn(backend), tuple(inputs), fast_mode=True)
    mixed = addend_inputs(torch.float32, torch.bfloat16)
    got, want = outputs_and_grads(addend_fn(backend), mixed), outputs_and_grads(addend_fn("unfused"), mixed)
    assert torch.equal(got[1], want[1]) and got[1].dtype == torch.float32  # the sum, as the add forms it
    assert got[5].dtype == torch.bfloat16  # the addend's gradient in its dtype (written so by the Triton kernels)
    for a, b in zip(got, want):  # (Triton's interpreter converts to bf16 by truncation, a GPU to the nearest)
        assert_rel_close(a, b, OP_TOL_BF16 if backend == "triton" and a.dtype == torch.bfloat16 else TOL[torch.float32])


def test_merge_addend_errors():
    z, x, partial, addend, qg, w = addend_inputs()
    with pytest.raises(ValueError, match="computed must not be empty"):
        library.merge(z, [x], [], None, addend=addend)
    with pytest.raises(ValueError, match="promotes to its torch.float32"):
        library.merge(z, [x.float()], [partial.float()], qg.float(), addend=addend)
    with pytest.raises(ValueError, match="shape"):
        library.merge(z, [x], [partial], qg, addend=addend[..., :3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_merge_with_an_addend(backend, kernel):
    triton_or_skip(backend)
    z, x, partial, addend, qg, w = addend_inputs(torch.float32)
    args = (z, [x], [partial], qg, w, 1e-6, 1e-5)
    if backend == "triton":
        args, addend = tree_map_only(torch.Tensor, lambda t: to_triton_device(t.detach()).requires_grad_(), (args, addend))
    torch.library.opcheck(torch.ops.attnres.merge.default, (*args, backend, addend))
    torch.library.opcheck(torch.ops.attnres.merge.default, (*args, backend, addend, torch.bfloat16))  # (out_dtype)
    with torch.no_grad():
        out, alpha, rc, zc, rstd, total = torch.ops.attnres.merge(*args, backend, addend)
    bargs = (torch.randn_like(out), [], alpha, rc, zc, rstd, args[1], [total], args[3], args[4], [True] * 5, backend,
             torch.randn_like(total))
    torch.library.opcheck(torch.ops.attnres.merge_backward.default, tree_map_only(torch.Tensor, torch.Tensor.detach, bargs))
    # (the gradients of two more readers of the output, added to the first's)
    views = [torch.randn_like(out), torch.randn_like(out)]
    torch.library.opcheck(torch.ops.attnres.merge_backward.default,
                          tree_map_only(torch.Tensor, torch.Tensor.detach, (bargs[0], views, *bargs[2:])))
    # (a bf16 addend on a float32 stream: its gradient returned in bf16 as well)
    torch.library.opcheck(torch.ops.attnres.merge_backward.default,
                          (*tree_map_only(torch.Tensor, torch.Tensor.detach, bargs), torch.bfloat16))


def out_dtype_run(backend, inputs, out_dtype, grads):
    """The merge over ``inputs = (z, sources, computed, qg, w, addend)`` writing ``out_dtype``
    (``None``: the default), with the gradient ``grads = (g_out, g_total)`` given to its
    output (and sum): ``[out, *every input's gradient]``."""
    z, sources, computed, qg, w, addend = inputs
    leaves = [t for t in (z, *sources, *computed, qg, w, addend) if t is not None]
    if backend == "reference":
        results = reference.merge(z, sources, computed, qg, 1e-6, w, 1e-5, addend, out_dtype)
    elif backend == "triton":
        args = to_triton_device((z, sources, computed, qg))
        results = to_cpu(library.merge(*args, 1e-6, to_triton_device(w), 1e-5, backend, to_triton_device(addend),
                                       out_dtype))
    else:
        results = library.merge(z, sources, computed, qg, 1e-6, w, 1e-5, backend, addend, out_dtype)
    outputs = [results[0], *results[2:]]
    return [results[0], *torch.autograd.grad(outputs, leaves, grads[: len(outputs)])]


def to_bf16(x: torch.Tensor, backend: str) -> torch.Tensor:
    """Float32 ``x`` rounded to bfloat16 as ``backend`` rounds a cast: to nearest even, but
    toward zero in Triton's interpreter (its float32 -> bf16 cast drops the low bits; a GPU
    rounds to nearest even)."""
    if backend == "triton" and TRITON_DEVICE == "cpu":
        return (x.detach().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    return x.detach().to(torch.bfloat16)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("k, c, with_addend", [(1, 1, True), (1, 1, False), (0, 2, False), (2, 0, False)])
@pytest.mark.parametrize("d", [37, 48])
def test_merge_writes_out_dtype_rounded_once_and_takes_its_gradient_in_that_dtype(backend, k, c, with_addend, d,
                                                                                 kernel):
    """``out_dtype=bfloat16`` over float32 sources (``ResidualConfig.autocast_norm_output``:
    the sublayer's norm output in the autocast dtype its linear layers compute in): the
    output is the default output rounded to bf16 (as the backend rounds a cast), bit for
    bit, and given its gradient in bf16, every gradient equals the default's given that
    gradient in float32, exactly - the kernels read the gradient in its dtype, nothing else
    changes. On the CPU (``"auto"``) the C kernel writes the sources' dtype and the result
    is converted after it, and it reads a bf16 gradient converted to float32 (exact). An odd
    ``d`` and an aligned one (Triton: the looping and the held merges), rows over several
    programs."""
    triton_or_skip(backend)
    z, sources, computed, qg, w = merge_inputs((3, 5), d, k, c, True, torch.float32, seed=3)
    g = torch.Generator().manual_seed(4)
    addend = rnd(g, 3, 5, d, dtype=torch.bfloat16) if with_addend else None
    inputs = (z, sources, computed, qg, w, addend)
    g_out = torch.randn(3, 5, d, generator=g).to(torch.bfloat16)
    g_total = torch.randn(3, 5, d, generator=g)
    want = out_dtype_run(backend, inputs, None, (g_out.float(), g_total))
    got = out_dtype_run(backend, inputs, torch.bfloat16, (g_out, g_total))
    assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], to_bf16(want[0], backend))
    assert len(got) == len(want)
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # (and the other way: bf16 sources writing float32 - the norm's output not rounded to bf16)
    low = (z, [x.detach().bfloat16().requires_grad_() for x in sources],
           [x.detach().bfloat16().requires_grad_() for x in computed], qg, w, None)
    wide = out_dtype_run(backend, low, torch.float32, (g_out.float(), g_total))
    truth = out_dtype_run("reference", low, torch.float32, (g_out.float(), g_total))
    assert wide[0].dtype == torch.float32
    for a, b in zip(wide, truth):
        assert_rel_close(a, b, OP_TOL_BF16)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("k, c, with_addend", [(1, 1, True), (0, 2, False)])
@pytest.mark.parametrize("d", [37, 48])
@pytest.mark.parametrize("readers", [2, 3])
def test_merge_readers_views_add_their_gradients_in_float32(backend, k, c, with_addend, d, readers, kernel):
    """``readers``: the bf16 output as one view for each reader (an attention's q, k, v; an
    MLP's gate and up), their bf16 gradients added by the backward in float32 - every
    gradient equals that of the float32 output given the float32 sum of those gradients,
    exactly (added in the readers' order, as the kernels do), and each view is that output
    rounded to bf16. Triton: the looping (odd ``d``) and the held kernels reading a tuple
    of gradients."""
    triton_or_skip(backend)
    z, sources, computed, qg, w = merge_inputs((3, 5), d, k, c, True, torch.float32, seed=5)
    g = torch.Generator().manual_seed(6)
    addend = rnd(g, 3, 5, d, dtype=torch.bfloat16) if with_addend else None
    leaves = [t for t in (z, *sources, *computed, qg, w, addend) if t is not None]
    g_outs = [torch.randn(3, 5, d, generator=g).to(torch.bfloat16) for _ in range(readers)]
    g_total = torch.randn(3, 5, d, generator=g)

    def run(readers: int, g_outs: list[torch.Tensor], out_dtype=torch.bfloat16):
        args = (z, sources, computed, qg, 1e-6, w, 1e-5)
        if backend == "reference":
            results = reference.merge(*args, addend, out_dtype, readers)
        elif backend == "triton":
            results = to_cpu(library.merge(*to_triton_device(args), backend, to_triton_device(addend), out_dtype,
                                           readers))
        else:
            results = library.merge(*args, backend, addend, out_dtype, readers)
        outs = list(results[0]) if readers > 1 else [results[0]]
        outputs = [*outs, *results[2:]]
        return outs, torch.autograd.grad(outputs, leaves, [*g_outs, g_total][: len(outputs)])

    outs, grads = run(readers, g_outs)
    summed = g_outs[0].float()
    for g_out in g_outs[1:]:
        summed = summed + g_out.float()
    one, want = run(1, [summed], None)
    assert len(outs) == readers
    assert all(o.dtype == torch.bfloat16 and torch.equal(o, to_bf16(one[0], backend)) for o in outs)
    for a, b in zip(grads, want):
        assert a.dtype == b.dtype
        if backend == "reference":  # (autograd adds the readers' gradients in an order of its own)
            assert_rel_close(a, b, 1e-6)
        else:
            assert torch.equal(a, b)


def _rounded_alike(narrow: torch.Tensor, wide: torch.Tensor) -> bool:
    """Whether ``narrow`` (bf16) is ``wide`` (float32) rounded to bf16 - to nearest even, or
    toward zero as Triton's interpreter casts (see :func:`to_bf16`)."""
    return torch.equal(narrow, wide.to(narrow.dtype)) or torch.equal(narrow, to_bf16(wide, "triton"))


def sums_run(backend, inputs, narrow: bool):
    """The merge over ``inputs = (z, sources, computed, qg, w, addend, grads)`` with its sources
    of known logit as given (``narrow``: in bf16, Phase-1 sums stored so) or converted to the
    stream's float32 (exactly): ``[out, *every input's gradient]``."""
    z, sources, computed, qg, w, addend, grads = inputs
    sources = [x.detach().to(torch.bfloat16 if narrow else torch.float32).requires_grad_() for x in sources]
    out_dtype = torch.float32 if not computed else None  # (Phase-1 sums alone: the stream's dtype asked for)
    return out_dtype_run(backend, (z, sources, computed, qg, w, addend), out_dtype, grads)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("k, c, with_addend", [(1, 1, True), (1, 0, False), (1, 2, False)])
@pytest.mark.parametrize("d", [37, 48])
def test_merge_reads_phase1_sums_narrower_than_the_stream(backend, k, c, with_addend, d, kernel):
    """``autocast_phase1_sums``: the sources of known logit (Phase-1 sums) in bf16, the
    computed ones (the stream) in float32. The output, in the stream's dtype, and every
    gradient equal the merge of those sums converted to float32 bit for bit, except each
    sum's gradient, which is that merge's rounded to bf16 (rounded once, by the backend).
    Triton: at an aligned ``d`` the held merges read the sums through their own pointer type;
    at an odd one (and over three sources) the looping kernels take them converted. On the
    CPU (``"auto"``) the C kernel takes them converted too (it ran the PyTorch
    implementation, within float32 rounding of its float32 merge); the sums alone (``c = 0``)
    are a bf16 merge, which runs in PyTorch there."""
    triton_or_skip(backend)
    z, sources, computed, qg, w = merge_inputs((2, 3), d, k, c, True, torch.float32, seed=7)
    g = torch.Generator().manual_seed(8)
    addend = rnd(g, 2, 3, d, dtype=torch.bfloat16) if with_addend else None
    grads = (torch.randn(2, 3, d, generator=g), torch.randn(2, 3, d, generator=g))
    inputs = (z, [x.detach().bfloat16().float() for x in sources], computed, qg, w, addend, grads)
    got, want = sums_run(backend, inputs, True), sums_run(backend, inputs, False)
    assert len(got) == len(want) and got[0].dtype == torch.float32
    for i, (a, b) in enumerate(zip(got, want)):
        sums = 2 <= i < 2 + k  # (each sum's gradient)
        assert a.dtype == (torch.bfloat16 if sums else b.dtype), i
        if backend == "auto" and not c:
            assert_rel_close(a.float(), b, 2**-8 if sums else 1e-5)
        else:
            assert _rounded_alike(a, b) if sums else torch.equal(a, b), i


@pytest.mark.parametrize("other", [torch.float64, torch.bfloat16])
def test_a_query_or_norm_gain_in_another_dtype_runs_the_c_kernel_as_the_reference_reads_it(other, kernel,
                                                                                           monkeypatch):
    """A query or norm gain in another dtype than the float32 stream's (float64, bf16) made the
    whole operator run in PyTorch on the CPU, silently: the C kernel takes one dtype. They are
    converted as the reference reads them (in its compute dtype): the C kernel runs, forward
    and backward, with the reference's outputs and gradients, each in its argument's dtype."""
    picked = []
    pick = library.pick
    monkeypatch.setattr(library, "pick", lambda *args: picked.append(pick(*args)) or picked[-1])
    qg, sources = phase1_inputs(d=6, dtype=torch.float32)
    qg = qg.detach().to(other).requires_grad_()
    got = outputs_and_grads(lambda q, *xs: run_phase1("auto", q, list(xs)), [qg, *sources])
    want = outputs_and_grads(lambda q, *xs: run_phase1("reference", q, list(xs)), [qg, *sources])
    z, sources, computed, qg, w = merge_inputs((2, 3), 6, 1, 2, True, torch.float32)
    qg, w = (t.detach().to(other).requires_grad_() for t in (qg, w))
    got += outputs_and_grads(merge_fn("auto", 1, 2, True), merge_flat(z, sources, computed, qg, w))
    want += outputs_and_grads(merge_fn("reference", 1, 2, True), merge_flat(z, sources, computed, qg, w))
    assert picked and all(m is cpu_kernel for m in picked), picked
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype, i
        assert_rel_close(a.double(), b.double(), TOL[torch.float32] if a.dtype != torch.bfloat16 else 2**-7, str(i))


@pytest.mark.parametrize("backend", ["auto", "torch", pytest.param("triton", marks=[pytest.mark.triton, pytest.mark.xfail(
    strict=True, reason="the Triton kernels' log-sum-exps of an infinite query are NaN (docs/kernels.md)")])])
def test_phase1_of_an_infinite_query_gives_the_references_log_sum_exps(backend, kernel):
    """A diverged model's query with an infinite entry: every logit is infinite (or NaN where
    the source's entry is 0), so the weighted sums are NaN in the reference too, and so is
    the model's output with any backend; but the reference's log-sum-exps are those of
    ``torch.logsumexp`` - the infinite maximum, NaN with a NaN logit - where the C kernel's
    were NaN everywhere (``inf - inf`` before the exp)."""
    triton_or_skip(backend)
    g = torch.Generator().manual_seed(0)
    positive = torch.rand(2, 5, 8, generator=g) + 0.1
    sources = [positive, torch.randn(2, 5, 8, generator=g), positive.flip(1)]
    sources[1][0, 0, 2] = 0.0  # (0 * inf: a NaN logit at that row)
    qg = torch.randn(2, 8, generator=g)
    qg[0, 2], qg[1, 2] = -float("inf"), float("inf")
    _, lse = run_phase1(backend, qg, sources)
    _, want = reference.phase1(qg, sources)
    assert torch.isnan(want).any() and (want == -float("inf")).any() and (want == float("inf")).any()
    assert torch.equal(torch.isnan(lse), torch.isnan(want)), lse
    assert torch.equal(lse.nan_to_num(0.0), want.nan_to_num(0.0)), lse


PHASE1_PATHS = [pytest.param({}, id="by-default"),  # (Triton: over blocks of rows)
                pytest.param({"phase1_rows": False, "phase1_split": False}, id="a-program-a-row", marks=pytest.mark.triton),
                pytest.param({"phase1_rows": False, "phase1_split": True}, id="split", marks=pytest.mark.triton)]


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("forced", PHASE1_PATHS)
def test_phase1_writes_its_sums_in_out_dtype_and_reads_their_gradients_so(backend, forced, kernel, monkeypatch):
    """``phase1(..., out_dtype=bfloat16)`` over float32 sources: the sums are the default
    ones rounded to bf16 (as the backend rounds), the log-sum-exps the same, and given their
    gradients in bf16 (one absent), every gradient equals the default's given them in float32,
    bit for bit - every kernel reads a gradient through its own pointer type and converts it.
    Triton: each forward and backward path (over blocks of rows, one program per row, split
    over sources)."""
    triton_or_skip(backend)
    if forced and backend != "triton":
        pytest.skip("the Triton kernels' paths")
    if backend == "triton":
        from attnres.ops.depth_attention import triton_impl
        for key, value in forced.items():
            monkeypatch.setitem(triton_impl.FORCED, key, value)
    qg, sources = phase1_inputs((2, 3), 24, 3, 3, torch.float32, seed=2)
    g = torch.Generator().manual_seed(3)
    g_outs = [None, *(torch.randn(2, 3, 24, generator=g).bfloat16() for _ in range(2))]
    g_lse = torch.randn(2, 3, 3, generator=g)

    def run(out_dtype, g_outs):
        if backend == "reference":
            outs, lse = reference.phase1(qg, sources, 1e-6, out_dtype)
        elif backend == "triton":
            outs, lse = to_cpu(library.phase1(*to_triton_device((qg, sources)), 1e-6, backend, out_dtype))
        else:
            outs, lse = library.phase1(qg, sources, 1e-6, backend, out_dtype)
        used = [(o, go) for o, go in zip(outs, g_outs) if go is not None]
        grads = torch.autograd.grad([o for o, _ in used] + [lse], [qg, *sources], [go for _, go in used] + [g_lse])
        return outs, lse, grads

    outs, lse, grads = run(torch.bfloat16, g_outs)
    want_outs, want_lse, want_grads = run(None, [None if go is None else go.float() for go in g_outs])
    assert all(o.dtype == torch.bfloat16 and _rounded_alike(o, w) for o, w in zip(outs, want_outs))
    assert torch.equal(lse, want_lse)
    for a, b in zip(grads, want_grads):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_phase1_sums_in_bf16(backend, kernel):
    """The operators with Phase-1 sums in bf16 (``autocast_phase1_sums``): Phase 1 writing
    them and its backward reading their gradients; a merge reading them beside a float32
    partial sum and its backward writing their gradients - the fake implementations' dtypes
    are the kernels'."""
    triton_or_skip(backend)
    on = (lambda t: to_triton_device(t.detach())) if backend == "triton" else torch.Tensor.detach  # noqa: E731
    pq, psrc = tree_map_only(torch.Tensor, on, phase1_inputs((2, 2), 16, 2, 3, torch.float32))
    torch.library.opcheck(torch.ops.attnres.phase1.default, (pq, psrc, 1e-6, backend, torch.bfloat16))
    with torch.no_grad():
        outs, lse = torch.ops.attnres.phase1(pq, psrc, 1e-6, backend, torch.bfloat16)
    torch.library.opcheck(torch.ops.attnres.phase1_backward.default,
                          (pq, lse, psrc, [torch.randn_like(outs[0]), None], None, 1e-6, [True] * 4, backend))
    z, x, partial, addend, qg, w = tree_map_only(torch.Tensor, on, addend_inputs(torch.float32, d=16))
    args = (z, [x.bfloat16()], [partial], qg, w, 1e-6, 1e-5, backend, addend)
    torch.library.opcheck(torch.ops.attnres.merge.default, args)
    with torch.no_grad():
        out, alpha, rc, zc, rstd, total = torch.ops.attnres.merge(*args)
    torch.library.opcheck(torch.ops.attnres.merge_backward.default,
                          (torch.randn_like(out), [], alpha, rc, zc, rstd, args[1], [total], qg, w, [True] * 5,
                           backend, torch.randn_like(total)))


def test_phase1_sums_dtype_errors():
    z, sources, computed, qg, w = merge_inputs(dtype=torch.float32)
    wide = [x.detach().double() for x in sources]
    with pytest.raises(ValueError, match="may be narrower than the computed sources"):
        library.merge(z, wide, computed, qg)
    with pytest.raises(ValueError, match=r"computed\[1\] has dtype torch.bfloat16 but computed\[0\] has torch.float32"):
        library.merge(z, sources, [computed[0], computed[0].detach().bfloat16()], qg)
    pq, psrc = phase1_inputs()
    with pytest.raises(ValueError, match="out_dtype must be a floating-point torch.dtype or None"):
        library.phase1(pq, psrc, out_dtype=torch.int8)


def test_merge_out_dtype_errors():
    z, sources, computed, qg, w = merge_inputs()
    for bad in (torch.int32, "bfloat16"):
        with pytest.raises(ValueError, match="out_dtype must be a floating-point torch.dtype or None"):
            library.merge(z, sources, computed, qg, out_dtype=bad)


def low_precision_check(run, inputs, storage, dtype, tol):
    """``run(backend, *inputs)`` with the ``storage`` inputs (sources) in ``dtype`` and the rest
    (logits, queries, gains) in float32, on each implementation against the float64 truth,
    under the per-dtype rule relative to the reference's own low-precision error."""
    truth = outputs_and_grads(lambda *xs: run("reference", *xs), inputs)

    def low(backend):
        cast = [t.detach().to(dtype if i in storage else torch.float32).requires_grad_() for i, t in enumerate(inputs)]
        return outputs_and_grads(lambda *xs: run(backend, *xs), cast)

    ref = low("reference")
    names = [f"tensor {i}" for i in range(len(truth))]
    for backend in ["auto", "torch"] + (["triton"] if _has_triton() and TRITON_DEVICE else []):
        assert_fast_matches_naive(low(backend), ref, truth, dtype, names, tol)


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, c", [(1, 1), (1, 3), (0, 2)])
def test_merge_low_precision_against_the_float64_truth(dtype, k, c, kernel):
    z, sources, computed, qg, w = merge_inputs((2, 7), 24, k, c, True)
    tol = TOL[torch.float32] if dtype == torch.float32 else OP_TOL_BF16
    low_precision_check(lambda backend, *xs: merge_fn(backend, k, c, True)(*xs), merge_flat(z, sources, computed, qg, w),
                        set(range(1, 1 + k + c)), dtype, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_phase1_low_precision_against_the_float64_truth(dtype, kernel):
    qg, sources = phase1_inputs((4, 16), 32, 3, 5)
    tol = TOL[torch.float32] if dtype == torch.float32 else OP_TOL_BF16
    low_precision_check(lambda backend, *xs: phase1_fn(backend)(*xs), [qg, *sources], set(range(1, len(sources) + 1)), dtype,
                        tol)


def _merge_rounding_h_truth(computed, qg, w, eps=1e-6, norm_eps=1e-5):
    """The merge of ``computed`` sources with a norm in float64, the norm reading ``h``
    rounded to bfloat16 as the bfloat16 merge does, the gradient passing that rounding
    straight through."""
    z = torch.stack([reference.rms_logits(x, qg.unsqueeze(0), eps)[..., 0] for x in computed], dim=-1)
    alpha = torch.softmax(z, dim=-1)
    h = sum(alpha[..., j : j + 1] * x for j, x in enumerate(computed))
    h = h + (h.to(torch.bfloat16).double() - h).detach()
    return torch.nn.functional.rms_norm(h, (h.shape[-1],), w, norm_eps)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
def test_merge_bf16_keeps_the_gradient_through_the_norm_in_float32(backend, kernel):
    """bf16 sources, a fused norm: the gradient reaching ``h`` through the norm stays in
    float32. Rounding it to bf16 (as an unfused bf16 graph would) put noise of bf16's
    2^-9 along ``h`` into it, which the softmax's gradient ``alpha_j g_h . (x_j - h)`` turns
    into a large error where the sources are nearly parallel (zero along ``h`` in the true
    gradient): the query's gradient was 1.1e-2 from the truth here, now 5e-6. In a bf16 FSDP
    run it showed as a 10x larger drift of one depth query over 10 steps."""
    triton_or_skip(backend)
    if backend == "triton" and TRITON_DEVICE == "cpu":
        pytest.skip("Triton's interpreter rounds float32 to bf16 toward zero (a GPU to nearest): a shrink of h "
                    "along itself, the one direction this case is sensitive to")
    g = torch.Generator().manual_seed(0)
    v = torch.randn(4, 16, 64, generator=g, dtype=torch.float64)
    computed = [((1 + 0.5 * j) * v + 0.05 * torch.randn(v.shape, generator=g, dtype=torch.float64)).bfloat16().double()
                for j in range(3)]
    qg = torch.randn(64, generator=g, dtype=torch.float64)
    w = torch.ones(64, dtype=torch.float64)
    up = torch.randn(v.shape, generator=g, dtype=torch.float64).bfloat16().double()

    def query_grad(fn, dtype, compute):
        xs = [x.detach().to(dtype).requires_grad_() for x in computed]
        q = qg.detach().to(compute).requires_grad_()
        (fn(xs, q, w.to(dtype)).double() * up).sum().backward()
        return q.grad.double(), [x.grad.double() for x in xs]

    truth = query_grad(lambda xs, q, w: _merge_rounding_h_truth(xs, q, w), torch.float64, torch.float64)
    empty = torch.zeros(4, 16, 0)
    got = query_grad(lambda xs, q, w: run_merge(backend, empty, [], xs, q, w)[0], torch.bfloat16, torch.float32)
    assert_rel_close(got[0], truth[0], 1e-4, "d qg")
    for j, (a, b) in enumerate(zip(got[1], truth[1])):
        assert_rel_close(a, b, 1e-2, f"d computed[{j}]")  # (bf16 results: 2^-9 relative)


@settings(max_examples=examples(25))
@given(k=st.integers(0, 3), c=st.integers(0, 3), d=st.integers(1, 9), b=st.integers(1, 3), t=st.integers(1, 4),
       norm=st.booleans(), seed=st.integers(0, 2**16))
def test_merge_matches_the_reference_over_shapes(k, c, d, b, t, norm, seed):
    if k + c == 0:
        c = 1
    inputs = merge_flat(*merge_inputs((b, t), d, k, c, norm, seed=seed))
    want = outputs_and_grads(merge_fn("reference", k, c, norm), inputs, seed)
    for backend in ("auto", "torch"):
        for a, r in zip(outputs_and_grads(merge_fn(backend, k, c, norm), inputs, seed), want):
            assert torch.linalg.vector_norm(a - r) <= 1e-10 * max(torch.linalg.vector_norm(r), 1.0)


def _laid_out(x, layout: str):
    """``x`` as the same values in another memory layout: ``"contiguous"``, ``"transposed"``
    (the last dimension strided, as a channels-last view) or ``"expanded"`` (its first row
    repeated with stride 0 over the first dimension)."""
    if layout == "transposed":
        return x.detach().movedim(-1, 0).contiguous().movedim(0, -1).requires_grad_()
    if layout == "expanded":
        return x.detach()[:1].clone().requires_grad_()
    return x


@settings(max_examples=examples(25))
@given(S=st.integers(1, 3), n=st.integers(1, 3), d=st.integers(1, 9), b=st.integers(0, 3), t=st.integers(1, 3),
       layout=st.sampled_from(["contiguous", "transposed", "expanded"]), seed=st.integers(0, 2**16))
def test_phase1_matches_the_reference_over_shapes_and_layouts(S, n, d, b, t, layout, seed):
    """Phase 1 of every backend equals the reference, forward and every gradient, over edge
    shapes - no rows, one row, ``d = 1``, one query, one source - and sources that are
    strided or expanded views (stride 0: its gradient sums over the repeats)."""
    qg, sources = phase1_inputs((b, t), d, S, n, seed=seed)
    leaves = [_laid_out(x, layout) for x in sources]
    expand = (lambda x: x.expand(b, t, d)) if layout == "expanded" else (lambda x: x)
    want = outputs_and_grads(lambda q, *xs: run_phase1("reference", q, [expand(x) for x in xs]), [qg, *leaves], seed)
    for backend in ("auto", "torch"):
        got = outputs_and_grads(lambda q, *xs: run_phase1(backend, q, [expand(x) for x in xs]), [qg, *leaves], seed)
        for a, r in zip(got, want):
            assert torch.linalg.vector_norm(a - r) <= 1e-10 * max(torch.linalg.vector_norm(r), 1.0)


def test_merge_input_errors():
    z, sources, computed, qg, _ = merge_inputs((2,), 4, 2, 1, False)
    for merge in (library.merge, reference.merge):
        with pytest.raises(ValueError, match="2 sources"):
            merge(z[..., :1], sources)
        with pytest.raises(ValueError, match="need the query"):
            merge(z, sources, computed, None)
        with pytest.raises(ValueError, match="at least one source"):
            merge(z[..., :0], [])
    with pytest.raises(ValueError, match="backend must be one of .*, got 'cuda'$"):
        library.merge(z, sources, backend="cuda")
    with pytest.raises(ValueError, match=r"got 'trition' \(did you mean 'triton'\?\)"):
        library.merge(z, sources, backend="trition")
    with pytest.raises(ValueError, match=r"qg must have shape \[S, 4\]"):
        library.phase1(qg, sources)


@pytest.mark.parametrize("backend", ["auto", "torch", "reference"])
def test_every_size_the_kernels_trust_is_checked_first(backend):
    """The kernels take the row count and ``d`` from the first source and trust the rest: a
    shorter source segfaulted the C kernel (a longer first one read past the others), and a
    mismatched ``z``, ``qg`` or ``norm_weight`` gave a finite wrong answer. Every backend
    now refuses them, naming the argument (float32: the C kernel's dtype)."""
    z, sources, computed, qg, w = merge_inputs((2, 5), 8, 2, 1, True, dtype=torch.float32)
    qg1 = torch.randn(3, 8)
    if backend == "reference":
        merge, phase1 = reference.merge, reference.phase1
    else:
        merge = functools.partial(library.merge, backend=backend)
        phase1 = functools.partial(library.phase1, backend=backend)
    short = torch.randn(2, 4, 8)
    for args, match in [(([sources[0], short],), r"sources\[1\] has shape \(2, 4, 8\)"),
                        (([],), "non-empty"), (((sources[0], short[:1]),), "same shape")]:
        with pytest.raises(ValueError, match=match):
            phase1(qg1, *args)
    with pytest.raises(ValueError, match=r"qg must have shape \[S, 8\]"):
        phase1(torch.randn(3, 9), sources)
    with pytest.raises(ValueError, match=r"qg must have shape \[S, 8\] .*got \(8,\); one query: qg\[None\]$"):
        phase1(torch.randn(8), sources)  # (one query as depth_attention takes it: was the shape alone)
    bad = [((z, [sources[0], short], computed, qg), r"sources\[1\] has shape \(2, 4, 8\)"),
           ((z, sources, [short], qg), r"computed\[0\] has shape \(2, 4, 8\)"),
           ((z[:, :4], sources, computed, qg), r"z must have shape \[2, 5, 2\]"),
           # (one logit more than sources: a softmax over a logit of no source, a finite wrong answer)
           ((torch.cat([z, z[..., :1]], -1), sources, computed, qg), r"^z has 3 logits for 2 sources$"),
           ((z, sources, computed, torch.randn(9)), r"qg must have shape \(8,\)"),
           ((z, sources, computed, torch.randn(3, 8)), r"qg must have shape \(8,\)"),
           ((z, sources, computed, qg, 1e-6, torch.ones(9)), r"norm_weight must have shape \(8,\)")]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            merge(*args)


@pytest.mark.parametrize("backend", ["auto", "torch", "reference"])
def test_merge_refuses_z_and_addend_on_another_device_by_name(backend):
    """``z`` or ``addend`` on another device than the sources: the C kernel refused ``z`` naming
    its own parameter (``attnres_merge_forward: z must be a contiguous CPU tensor``), the
    PyTorch paths failed inside a ``cat`` or an add ("Tensor on device meta is not on the
    expected device cpu!"); every backend now names the argument."""
    z, sources, computed, qg, _ = merge_inputs((2, 5), 8, 1, 1, False, dtype=torch.float32)
    merge = reference.merge if backend == "reference" else functools.partial(library.merge, backend=backend)
    with pytest.raises(ValueError, match=r"^z is on meta but the sources are on cpu$"):
        merge(z.to("meta"), sources, computed, qg)
    with pytest.raises(ValueError, match=r"^addend is on meta but the sources are on cpu$"):
        merge(z, sources, computed, qg, addend=torch.empty_like(computed[0], device="meta"))
    with pytest.raises(ValueError, match=r"^addend must be a tensor \[\.\.\., d\] or None, got float$"):
        merge(z, sources, computed, qg, addend=1.0)


def test_every_bad_list_of_merge_sources_is_refused_by_name():
    """The merge checks its sources in one pass without building messages (a merge per
    sublayer; Full AttnRes' 32 sources took 30 us of checks) and explains what failed on the
    slow path: every case is named there, none reaches its internal consistency assertion."""
    z, sources, computed, qg, _ = merge_inputs((2, 3), 4, 2, 1, False, dtype=torch.float32)
    x = sources[0]
    bad = [((z, x, computed), "sources must be a list or tuple of tensors, got Tensor"),
           ((z, sources, computed[0]), "computed must be a list or tuple of tensors, got Tensor"),
           ((z, [x, "v"], computed), r"sources\[1\] must be a tensor of shape \[..., d\], got str"),
           ((z, [torch.tensor(1.0), x], computed), r"sources\[0\] must be a tensor of shape \[..., d\], got Tensor"),
           ((z, [x, x.to("meta")], computed), r"sources\[1\] has shape \(2, 3, 4\) on meta but sources\[0\] has"),
           ((z, [x, x.double()], computed), r"sources\[1\] has dtype torch.float64 but sources\[0\] has torch.float32"),
           ((z, [x.long(), x.long()], computed), r"sources\[0\] has dtype torch.int64 .* floating-point dtype"),
           ((z, sources, [computed[0].half(), computed[0]]),
            r"computed\[1\] has dtype torch.float32 but computed\[0\] has torch.float16"),
           ((z[..., :0], [], []), "at least one source")]
    for args, match in bad:
        for merge in (library.merge, reference.merge):
            with pytest.raises(ValueError, match=match):
                merge(*args, qg)
    assert reference._merge_sources_agree(sources, computed) and reference._merge_sources_agree([], computed)


def test_double_backward_is_refused_clearly():
    """It was refused by PyTorch's 'no autograd formula was registered. Please use
    register_autograd to add one', a fix for the package, not for its user: the message now
    names the backend that supports it. ``create_graph=True`` alone still works."""
    z, sources, computed, qg, w = merge_inputs((2, 3), 4, 1, 1, True)
    out, _ = library.merge(z, sources, computed, qg, 1e-6, w)
    (gz,) = torch.autograd.grad(out.square().sum(), [z], create_graph=True)
    outs, _ = library.phase1(qg.unsqueeze(0).detach(), sources + computed)
    (gs,) = torch.autograd.grad(outs[0].square().sum(), [sources[0]], create_graph=True)
    for grad in (gz, gs):
        with pytest.raises(RuntimeError, match=r"a double backward .* reached AttnRes' depth-attention operators, "
                                               r"which do not implement one: build the residual with "
                                               r"backend='reference'"):
            grad.sum().backward()


def test_backend_triton_on_cpu_tensors_without_the_interpreter_says_what_to_use():
    """``BlockAttnRes(..., backend="triton")`` on CPU tensors (Triton's interpreter off) ended
    in Triton's '0 active drivers ([]). There should only be one.'; ``attnres train`` refused
    it already, the Python API did not. (In a subprocess: the tests may run the interpreter.)"""
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = ("import torch\nfrom attnres.nn import BlockAttnRes\nm = BlockAttnRes(8, 2, 2, backend='triton')\n"
            "state = m.start(torch.randn(2, 8))\nm.add_output(state, 0, m.sublayer_input(state, 0))\n"
            "try:\n    m.sublayer_input(state, 1)\nexcept ValueError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert ("backend='triton' runs the Triton kernels on CUDA tensors (on others only under Triton's interpreter, "
            "TRITON_INTERPRET=1 set before triton is imported); got tensors on cpu: use backend='auto'") in out.stdout, \
        out.stdout + out.stderr


# ----------------------------------------------------------------------------------------
# Dispatch, saving policy, the Triton kernels' tiling
# ----------------------------------------------------------------------------------------


class SubclassedTensor(torch.Tensor):
    pass


def test_dispatch_by_device_dtype_and_layout(kernel):
    x = torch.randn(2, 3, 8)
    assert library.pick("auto", [x]) is cpu_kernel  # CPU float32 / float64: the C kernel
    assert library.pick("auto", [x.double()]) is cpu_kernel
    assert library.pick("torch", [x]) is torch_impl
    for other in (x.bfloat16(), x[..., ::2], x.as_subclass(SubclassedTensor)):  # (a DTensor has no memory of its own)
        assert library.pick("auto", [other]) is torch_impl
    assert library.pick("auto", [x, x.double()]) is torch_impl  # mixed dtypes
    if _has_triton():
        from attnres.ops.depth_attention import triton_impl

        assert library.pick("triton", [x]) is triton_impl
        with pytest.raises(ValueError, match="backend='triton' takes sources"):
            library.pick("triton", [torch.zeros(2, 3, dtype=torch.int32)])

def test_without_triton_cuda_runs_pytorch_after_one_warning_and_triton_is_refused(monkeypatch, kernel):
    """Where triton cannot be imported (a CUDA build without it), ``backend="auto"`` on CUDA
    tensors runs the PyTorch implementation after one warning saying why; asking for
    ``backend="triton"`` is a ``ValueError`` naming the package; the CPU keeps its C kernel."""
    import sys
    from types import SimpleNamespace

    from attnres.ops.depth_attention import library as lib

    package = sys.modules["attnres.ops.depth_attention"]
    for name in ("triton_impl", "triton_kernels"):
        monkeypatch.delitem(sys.modules, f"attnres.ops.depth_attention.{name}", raising=False)
        monkeypatch.delattr(package, name, raising=False)
    monkeypatch.setitem(sys.modules, "triton", None)  # (import triton: ImportError)
    monkeypatch.setattr(lib, "_warned_without_triton", [])
    lib._triton_impl.cache_clear()
    try:
        on_cuda = [SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)]
        with pytest.warns(RuntimeWarning, match="triton cannot be imported .* runs in PyTorch on CUDA"):
            assert lib.pick("auto", on_cuda) is torch_impl
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert lib.pick("auto", on_cuda) is torch_impl  # (once)
        with pytest.raises(ValueError, match="backend='triton' needs the triton package"):
            lib.pick("triton", [torch.randn(2, 8)])
        assert lib.pick("auto", [torch.randn(2, 8)]) is cpu_kernel
    finally:
        lib._triton_impl.cache_clear()


def test_a_gpu_older_than_triton_compiles_for_runs_pytorch_and_triton_is_refused(monkeypatch):
    """On a card older than compute capability 7.0 (a P100), Triton fails at its first
    compile, deep in a training step. ``backend="auto"`` runs PyTorch there after one warning
    naming the card, ``"triton"`` is refused naming it, and ``triton_unavailable`` (what a
    run checks at its start) says why; a 7.0+ card gets the kernels."""
    from types import SimpleNamespace

    if not _has_triton():
        pytest.skip("triton is not installed")
    from attnres.ops.depth_attention import library as lib, triton_impl

    capability = [(6, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla P100-PCIE-16GB")
    monkeypatch.setattr(lib, "_warned_without_triton", [])
    triton_impl.unsupported_gpu.cache_clear()
    try:
        on_cuda = [SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)]
        old = r"Tesla P100-PCIE-16GB \(cuda:0, compute capability 6.0\) is older than Triton compiles for \(7.0\)"
        with pytest.warns(RuntimeWarning, match="depth attention runs in PyTorch: " + old):
            assert lib.pick("auto", on_cuda) is torch_impl
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert lib.pick("auto", on_cuda) is torch_impl  # (once)
        with pytest.raises(ValueError, match="backend='triton' cannot run here: " + old):
            lib.pick("triton", on_cuda)
        assert re.fullmatch(old, lib.triton_unavailable(torch.device("cuda", 0)))
        capability[0] = (7, 0)
        triton_impl.unsupported_gpu.cache_clear()
        assert lib.pick("auto", on_cuda) is triton_impl and lib.triton_unavailable(torch.device("cuda", 0)) is None
    finally:
        triton_impl.unsupported_gpu.cache_clear()


class OperatorLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad", [True, False])
def test_eager_calls_skip_the_dispatcher_unless_asked_with_the_same_results(grad, kernel):
    """Eager calls run the operators' implementations directly; ``through_dispatcher`` puts
    them through the dispatcher (a dispatch mode then sees ``attnres::*``); same numbers."""
    z, sources, computed, qg, w = merge_inputs((2, 3), 8, 1, 1, True, dtype=torch.float32)
    results = {}
    for dispatched in (False, True):
        log = OperatorLog()
        with torch.set_grad_enabled(grad), (library.through_dispatcher() if dispatched else contextlib.nullcontext()):
            with log:
                out, alpha = library.merge(z, sources, computed, qg, 1e-6, w)
                outs, lse = library.phase1(torch.stack([qg, -qg]), [*sources, *computed])
                if grad:
                    torch.autograd.backward([out, outs[0]], [torch.ones_like(out), torch.ones_like(out)])
        attnres_ops = {n for n in log.names if n.startswith("attnres.")}
        want = {"attnres.merge", "attnres.phase1"} | ({"attnres.merge_backward", "attnres.phase1_backward"} if grad else set())
        assert attnres_ops == (want if dispatched else set())
        results[dispatched] = [out, alpha, *outs, lse] + ([w.grad.clone(), qg.grad.clone()] if grad else [])
        for t in (w, qg):
            t.grad = None
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)



class _StubKernel:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` records the launch, runs nothing."""

    def __init__(self, name: str, launches: list[str]):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(self.name)


#: Operators that move no data on the device: allocations, views, metadata.
FREE_OPERATORS = {"aten.empty", "aten.empty_strided", "aten.empty_like", "aten.new_empty", "aten.view",
                  "aten._unsafe_view", "aten.as_strided", "aten.select", "aten.slice", "aten.unsqueeze", "aten.squeeze",
                  "aten.unbind", "aten.t", "aten.permute", "aten.expand", "aten.detach", "aten.alias",
                  "aten.promote_types"}
#: Operators that copy between devices (or from host data): none may run in a call.
COPIES = {"aten._to_copy", "aten.copy_", "aten.lift_fresh", "aten.lift_fresh_copy", "aten._pin_memory"}


def _device_operations(run, launches: list[str]) -> list[str]:
    """The device operations ``run()`` dispatches (launches stubbed): the aten operators
    that are not in :data:`FREE_OPERATORS`, then the kernels launched."""
    log, before = OperatorLog(), len(launches)
    with log:
        run()
    return [n for n in log.names if n not in FREE_OPERATORS] + [f"triton.{k}" for k in launches[before:]]


def test_triton_calls_launch_their_kernels_and_nothing_else(monkeypatch):
    """The host side of a Triton call, with the kernels stubbed: a forward allocates its
    results and launches one kernel (Phase 1 over a few rows two, split over the sources); a
    merge backward dispatches at most 3 device operations
    (its kernel and the sums of the query's and the norm gain's per-program partials), a
    Phase-1 backward 3 (two kernels, one sum); no call copies anything to the device (no
    pointer table: tuple arguments), zero-fills a buffer, copies a slice of Phase 1's
    log-sum-exps (the merge takes a strided column), casts an output or its gradient (a
    bf16 addend's, and bf16 Phase-1 sums', included) or adds the gradients of an output's
    readers."""
    pytest.importorskip("triton")
    from attnres.ops.depth_attention import triton_impl, triton_kernels

    launches: list[str] = []
    for name in ("phase1_fwd", "phase1_logits", "phase1_combine", "phase1_bwd", "phase1_dq", "phase1_logits_rows",
                 "phase1_bwd_rows", "phase1_grads", "merge_fwd", "merge_bwd", "merge_fwd_held", "merge_bwd_held"):
        monkeypatch.setattr(triton_kernels, name, _StubKernel(name, launches))
    g = torch.Generator().manual_seed(0)
    d, S = 64, 8
    # Block AttnRes' merge: a Phase-1 weighted sum (its logit a column of lse) and the partial
    # sum, the norm fused
    lse = rnd(g, 4, 5, S, dtype=torch.float32)
    z = lse.unbind(-1)[3].unsqueeze(-1)
    x, partial = rnd(g, 4, 5, d, dtype=torch.float32), rnd(g, 4, 5, d, dtype=torch.float32)
    qg, w = rnd(g, d, dtype=torch.float32), rnd(g, d, dtype=torch.float32)
    result = {}
    grad = torch.randn(4, 5, d, generator=g)
    for held, suffix in [(None, "_held"), (False, "")]:  # (two sources: held; forced, looped over)
        monkeypatch.setitem(triton_impl.FORCED, "merge_held", held)
        forward = _device_operations(
            lambda: result.update(out=library.merge(z, [x], [partial], qg, 1e-6, w, 1e-5, "triton")[0]), launches)
        assert forward == [f"triton.merge_fwd{suffix}"], forward
        backward = _device_operations(lambda: torch.autograd.grad(result["out"], [z, x, partial, qg, w], grad),
                                      launches)
        assert len(backward) <= 3 and not set(backward) & COPIES, backward
        assert set(backward) <= {f"triton.merge_bwd{suffix}", "aten.sum"}, backward
    monkeypatch.setitem(triton_impl.FORCED, "merge_held", None)
    # the same merge forming the partial sum from its addend (the last output); the sum's
    # gradient from downstream added inside the kernel
    addend = rnd(g, 4, 5, d, dtype=torch.float32)
    forward = _device_operations(lambda: result.update(
        fused=library.merge(z, [x], [partial], qg, 1e-6, w, 1e-5, "triton", addend=addend)), launches)
    assert forward == ["triton.merge_fwd_held"], forward
    out, _, total = result["fused"]
    backward = _device_operations(lambda: torch.autograd.grad([out, total], [z, x, partial, addend, qg, w],
                                                              [grad, grad]), launches)
    assert len(backward) <= 3 and set(backward) <= {"triton.merge_bwd_held", "aten.sum"}, backward
    # the addend in bf16 (an autocast sublayer's output on a float32 stream): read as it is,
    # its gradient written in bf16 by the kernel - no cast either way
    low_addend = addend.bfloat16()
    forward = _device_operations(lambda: result.update(
        mixed=library.merge(z, [x], [partial], qg, 1e-6, w, 1e-5, "triton", addend=low_addend)), launches)
    assert forward == ["triton.merge_fwd_held"], forward
    out, _, total = result["mixed"]
    backward = _device_operations(lambda: result.update(g=torch.autograd.grad(
        [out, total], [z, x, partial, low_addend, qg, w], [grad, grad])), launches)
    assert len(backward) <= 3 and set(backward) <= {"triton.merge_bwd_held", "aten.sum"}, backward
    assert result["g"][3].dtype == torch.bfloat16
    # the same writing bf16 (autocast_norm_output): the kernel writes it and reads its bf16
    # gradient, no cast either way
    forward = _device_operations(lambda: result.update(
        low=library.merge(z, [x], [partial], qg, 1e-6, w, 1e-5, "triton", addend=addend, out_dtype=torch.bfloat16)),
        launches)
    assert forward == ["triton.merge_fwd_held"] and result["low"][0].dtype == torch.bfloat16, forward
    out, _, total = result["low"]
    low_grad = grad.bfloat16()
    backward = _device_operations(lambda: torch.autograd.grad([out, total], [z, x, partial, addend, qg, w],
                                                              [low_grad, grad]), launches)
    assert len(backward) <= 3 and set(backward) <= {"triton.merge_bwd_held", "aten.sum"}, backward
    # ... and handing a view of it to each of three readers (autocast's q, k, v): the kernel
    # reads their three gradients - no addition of them, no cast
    forward = _device_operations(lambda: result.update(
        views=library.merge(z, [x], [partial], qg, 1e-6, w, 1e-5, "triton", addend=low_addend,
                            out_dtype=torch.bfloat16, readers=3)), launches)
    assert forward == ["triton.merge_fwd_held"], forward
    outs, _, total = result["views"]
    backward = _device_operations(lambda: torch.autograd.grad([*outs, total], [z, x, partial, low_addend, qg, w],
                                                              [low_grad, low_grad, low_grad, grad]), launches)
    assert len(backward) <= 3 and set(backward) <= {"triton.merge_bwd_held", "aten.sum"}, backward
    # ... and reading its Phase-1 sum in bf16 (autocast_phase1_sums): read as it is, its
    # gradient written in bf16 by the kernel - no cast either way
    low_x = x.detach().bfloat16().requires_grad_()
    forward = _device_operations(lambda: result.update(
        sums=library.merge(z, [low_x], [partial], qg, 1e-6, w, 1e-5, "triton", addend=low_addend)), launches)
    assert forward == ["triton.merge_fwd_held"] and result["sums"][0].dtype == torch.float32, forward
    out, _, total = result["sums"]
    backward = _device_operations(lambda: result.update(g=torch.autograd.grad(
        [out, total], [z, low_x, partial, low_addend, qg, w], [grad, grad])), launches)
    assert len(backward) <= 3 and set(backward) <= {"triton.merge_bwd_held", "aten.sum"}, backward
    assert result["g"][1].dtype == torch.bfloat16
    # Phase 1 of S queries over 3 sources: 20 rows (decoding's few) split over the sources,
    # two kernels; over blocks of rows otherwise (many rows), two kernels; or one program per
    # row, one kernel. Its backward: two kernels and one sum either way.
    qs, sources = phase1_inputs((4, 5), d, S, 3, torch.float32)
    forward = _device_operations(lambda: result.update(p1=library.phase1(qs, sources, 1e-6, "triton")), launches)
    assert forward == ["triton.phase1_logits", "triton.phase1_combine"], forward
    monkeypatch.setitem(triton_impl.FORCED, "phase1_split", False)
    forward = _device_operations(lambda: result.update(p1=library.phase1(qs, sources, 1e-6, "triton")), launches)
    assert forward == ["triton.phase1_logits_rows", "triton.phase1_combine"], forward
    outs, lse1 = result["p1"]
    grads = [torch.randn(o.shape, generator=g) for o in outs] + [torch.randn(lse1.shape, generator=g)]
    backward = _device_operations(lambda: torch.autograd.grad([*outs, lse1], [qs, *sources], grads), launches)
    assert sorted(backward) == ["aten.sum", "triton.phase1_bwd_rows", "triton.phase1_grads"], backward
    # (its sums in bf16, autocast_phase1_sums: written and their gradients read so by the kernels)
    forward = _device_operations(lambda: result.update(
        p1=library.phase1(qs, sources, 1e-6, "triton", torch.bfloat16)), launches)
    assert forward == ["triton.phase1_logits_rows", "triton.phase1_combine"], forward
    outs, lse1 = result["p1"]
    low_grads = [gr.bfloat16() for gr in grads[:-1]] + grads[-1:]
    backward = _device_operations(lambda: torch.autograd.grad([*outs, lse1], [qs, *sources], low_grads), launches)
    assert sorted(backward) == ["aten.sum", "triton.phase1_bwd_rows", "triton.phase1_grads"], backward
    monkeypatch.setitem(triton_impl.FORCED, "phase1_rows", False)
    forward = _device_operations(lambda: result.update(p1=library.phase1(qs, sources, 1e-6, "triton")), launches)
    assert forward == ["triton.phase1_fwd"], forward
    outs, lse1 = result["p1"]
    backward = _device_operations(lambda: torch.autograd.grad([*outs, lse1], [qs, *sources], grads), launches)
    assert len(backward) <= 3 and set(backward) <= {"triton.phase1_bwd", "triton.phase1_dq", "aten.sum"}, backward


def saved_tensors(fn) -> list[torch.Tensor]:
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("backend", BACKENDS)
def test_operators_save_sources_by_reference_and_per_token_statistics(backend, kernel):
    """The saving policy of report §4.2 (docs/design.md): references to the sources (kept
    anyway) and per-token statistics; no copy of the sources, of ``h`` or of the logits."""
    triton_or_skip(backend)
    z, sources, computed, qg, w = merge_inputs((4, 5), 16, 1, 2, True, torch.float32)
    if backend == "triton":
        z, sources, computed, qg, w = to_triton_device((z, sources, computed, qg, w))
    d, tokens = 16, 20
    ptrs = {x.data_ptr() for x in (*sources, *computed)}
    saved = saved_tensors(lambda: library.merge(z, sources, computed, qg, 1e-6, w, 1e-5, backend))
    big = [t for t in saved if t.shape[-1] == d and t.numel() >= tokens * d]
    assert {t.data_ptr() for t in big} == ptrs, [tuple(t.shape) for t in saved]
    assert sum(t.numel() for t in saved if t.data_ptr() not in ptrs) <= tokens * 8 + 2 * d  # alpha, rc, zc, rstd
    pq, psrc = phase1_inputs((4, 5), 16, 3, 4, torch.float32)
    if backend == "triton":
        pq, psrc = to_triton_device((pq, psrc))
    saved = saved_tensors(lambda: library.phase1(pq, psrc, 1e-6, backend))
    assert {t.data_ptr() for t in saved if t.shape[-1] == d and t.numel() >= tokens * d} == {x.data_ptr() for x in psrc}
    assert sum(t.numel() for t in saved if t.data_ptr() not in {x.data_ptr() for x in psrc}) <= tokens * 3 + 3 * d


@pytest.mark.triton
def test_triton_inputs_are_handed_over_aligned():
    """The kernels tell the compiler every tuple entry is 16-byte aligned (``_pointer``), so
    the launch code copies a view at an odd offset and passes aligned contiguous tensors as
    they are; a merge over such a view equals the PyTorch implementation's."""
    triton_device()
    from attnres.ops.depth_attention import triton_impl

    flat = torch.randn(5 * 40 + 1, dtype=torch.float64)
    odd = flat[1:].view(5, 40)  # 8 bytes past an aligned allocation
    assert odd.data_ptr() % triton_impl.ALIGNMENT
    copy = triton_impl._c(odd)
    assert copy.data_ptr() % triton_impl.ALIGNMENT == 0 and torch.equal(copy, odd)
    aligned = torch.randn(5, 40)
    assert triton_impl._c(aligned) is aligned
    inputs = merge_flat(*merge_inputs((5,), 40, 1, 1, True, torch.float64))
    shifted = torch.empty(5 * 40 + 1, dtype=torch.float64)[1:].view(5, 40).copy_(inputs[1].detach())  # a source
    inputs_odd = [*inputs[:1], shifted.requires_grad_(), *inputs[2:]]
    for a, b in zip(outputs_and_grads(merge_fn("triton", 1, 1, True), inputs_odd),
                    outputs_and_grads(merge_fn("torch", 1, 1, True), inputs)):
        assert_rel_close(a, b, 1e-12)


@pytest.mark.triton
def test_triton_kernels_tile_d_and_split_rows_over_programs(monkeypatch):
    """``d`` walked in tiles that do not divide it, backward programs over several rows
    (the merge's persistent programs, the queries' gradient's row ranges), and Phase 1's
    queries padded (S = 17 in a block of 32): against the PyTorch implementation."""
    triton_device()
    from attnres.ops.depth_attention import triton_impl

    monkeypatch.setitem(triton_impl.FORCED, "block_d", 16)
    monkeypatch.setitem(triton_impl.FORCED, "programs", 3)
    inputs = merge_flat(*merge_inputs((7,), 37, 1, 2, True, torch.float64))
    for a, b in zip(outputs_and_grads(merge_fn("triton", 1, 2, True), inputs),
                    outputs_and_grads(merge_fn("torch", 1, 2, True), inputs)):
        assert_rel_close(a, b, 1e-12)
    qg, sources = phase1_inputs((7,), 37, 17, 3)
    for a, b in zip(outputs_and_grads(phase1_fn("triton"), [qg, *sources]),
                    outputs_and_grads(phase1_fn("torch"), [qg, *sources])):
        assert_rel_close(a, b, 1e-12)


@pytest.mark.triton
@pytest.mark.parametrize("rows, d, S, n, dtype", [(1, 37, 3, 4, torch.float32), (5, 64, 9, 8, torch.float64),
                                                  (3, 40, 17, 2, torch.bfloat16), (2, 20, 1, 1, torch.float32),
                                                  (7, 33, 2, 16, torch.float32), (2, 24, 5, 19, torch.float32)])
def test_phase1_split_over_sources_equals_one_kernel_and_the_truth(rows, d, S, n, dtype, monkeypatch):
    """Phase 1's forward over a few rows (decoding) runs split over the sources
    (``phase1_logits`` + ``phase1_combine``): the same numbers as the one-kernel forward, bit
    for bit (the same sums in the same order), and the float64 truth within the dtype's
    tolerance: one and many rows, odd ``d``, padded queries, one source to the most it
    unrolls, and more (Full AttnRes: a loop over them)."""
    device = triton_device()
    from attnres.ops.depth_attention import triton_impl, triton_launch

    assert triton_launch.phase1_splits(rows) and triton_launch.phase1_unrolls(n) == (n <= 16)
    monkeypatch.setitem(triton_impl.FORCED, "phase1_rows", False)  # (unsplit: the one kernel)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(0)
    qg = torch.randn(S, d, generator=g, dtype=compute).to(device)
    sources = [torch.randn(rows, d, generator=g, dtype=compute).to(dtype).to(device) for _ in range(n)]
    results = {}
    for split in (True, False):
        monkeypatch.setitem(triton_impl.FORCED, "phase1_split", split)
        outs, lse = triton_impl.phase1_forward(qg, sources, 1e-6)
        results[split] = [*outs, lse]
    for a, b in zip(results[True], results[False], strict=True):
        assert torch.equal(a, b)
    want_outs, want_lse = reference.phase1(qg.cpu().double(), [x.cpu().double() for x in sources], 1e-6)
    tol = 1e-12 if dtype == torch.float64 else TOL[torch.float32] if dtype == torch.float32 else OP_TOL_BF16
    for a, b in zip(results[True], [*want_outs, want_lse]):
        assert_rel_close(a.cpu().double(), b, tol)


@pytest.mark.triton
@pytest.mark.parametrize("rows, d, S, n, dtype", [(11, 40, 3, 4, torch.float32), (5, 64, 8, 9, torch.bfloat16),
                                                  (5, 33, 17, 2, torch.float64), (5, 24, 5, 19, torch.float32),
                                                  (19, 20, 1, 1, torch.float32), (9, 80, 2, 5, torch.bfloat16)])
def test_phase1_over_blocks_of_rows_equals_one_program_per_row_and_the_truth(rows, d, S, n, dtype, monkeypatch):
    """Phase 1 over many rows runs over blocks of rows (``phase1_logits_rows`` +
    ``phase1_combine``; backward ``phase1_bwd_rows`` + ``phase1_grads``): its outputs and every
    gradient (the queries', each source's; one query's gradient absent, the log-sum-exps'
    present) against the float64 truth within the dtype's tolerance, as one program per row
    (``phase1_fwd``, ``phase1_bwd`` + ``phase1_dq``) is: rows that do not fill the last block,
    odd ``d``, ``d`` over tiles the last of which it does not fill, padded queries, 1 to 19
    sources in groups that do not divide them (the default group, and 8 sources at once)."""
    device = triton_device()
    from attnres.ops.depth_attention import triton_impl, triton_launch

    # (few rows - under the interpreter every program costs - so the forward is forced unsplit,
    # as it runs past SPLIT_ROWS; each case still has several blocks of rows, the last ragged
    # where a block holds more than one)
    rows_per_program = triton_launch.phase1_rows_geometry(d, S, dtype == torch.float64)[0]
    assert rows > rows_per_program and (rows_per_program == 1 or rows % rows_per_program), (rows, rows_per_program)
    monkeypatch.setitem(triton_impl.FORCED, "phase1_split", False)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(0)
    qg = torch.randn(S, d, generator=g, dtype=compute)
    sources = [torch.randn(rows, d, generator=g, dtype=compute).to(dtype) for _ in range(n)]
    g_outs = [None if s == 0 and S > 1 else torch.randn(rows, d, generator=g, dtype=compute).to(dtype)
              for s in range(S)]
    g_lse = torch.randn(rows, S, generator=g, dtype=compute)
    want_outs, want_lse = torch_impl.phase1_forward(qg.double(), [x.double() for x in sources], 1e-6)
    want_gq, want_gx = torch_impl.phase1_backward(
        qg.double(), want_lse, [x.double() for x in sources], [None if t is None else t.double() for t in g_outs],
        g_lse.double(), 1e-6, True, [True] * n)
    tol = OP_TOL_BF16 if dtype == torch.bfloat16 else TOL[dtype]
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    for over_rows, group in [(True, None), (True, 8), (False, None)]:  # (8: all of Block's sources together)
        monkeypatch.setitem(triton_impl.FORCED, "phase1_rows", over_rows)
        monkeypatch.setitem(triton_impl.FORCED, "phase1_group", group)
        outs, lse = triton_impl.phase1_forward(qg.to(device), [on(x) for x in sources], 1e-6)
        g_q, g_x = triton_impl.phase1_backward(qg.to(device), lse, [on(x) for x in sources], [on(t) for t in g_outs],
                                               on(g_lse), 1e-6, True, [True] * n)
        for what, a, b in [("lse", lse, want_lse), ("queries' gradient", g_q, want_gq),
                           *((f"output {s}", o, w) for s, (o, w) in enumerate(zip(outs, want_outs))),
                           *((f"source {j}'s gradient", x, w) for j, (x, w) in enumerate(zip(g_x, want_gx)))]:
            assert_rel_close(a.cpu().double(), b, tol, f"{what} (over rows: {over_rows}, group {group})")


@pytest.mark.triton
@pytest.mark.parametrize("rows, d, k, c, norm, addend, dtype", [
    (7, 37, 1, 1, True, True, torch.float32), (5, 64, 0, 2, True, False, torch.bfloat16),
    (6, 40, 1, 1, False, False, torch.float64), (3, 33, 1, 0, True, False, torch.float32),
    (9, 16, 0, 1, True, True, torch.bfloat16), (4, 24, 2, 0, False, False, torch.float32)])
def test_merge_holding_its_sources_equals_looping_over_them_and_the_truth(rows, d, k, c, norm, addend, dtype,
                                                                          monkeypatch):
    """A merge of at most ``MERGE_HELD`` sources holds them (``merge_fwd_held``,
    ``merge_bwd_held``: each loaded once, a pipelined loop over rows): its outputs, statistics
    and every gradient (the logits', each source's, the query's, the norm gain's; the sum
    formed with an addend, its gradient from downstream, and in float32 the addend's gradient
    in bf16, written by the kernel: the last source's converted) against the float64 truth
    within the dtype's tolerance, as the kernels looping over the sources are - odd ``d``, known and
    computed sources alone and together, with and without the norm, one program a row (not
    pipelined) and programs walking several rows, pipelined two and three deep and not at
    all."""
    device = triton_device()
    from attnres.ops.depth_attention import triton_impl, triton_launch

    assert triton_launch.merge_holds(k + c) and not triton_launch.merge_holds(triton_launch.MERGE_HELD + 1)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(0)
    z = torch.randn(rows, k, generator=g, dtype=compute)
    sources = [torch.randn(rows, d, generator=g, dtype=compute).to(dtype) for _ in range(k)]
    computed = [torch.randn(rows, d, generator=g, dtype=compute).to(dtype) for _ in range(c)]
    qg = torch.randn(d, generator=g, dtype=compute) if c else None
    w = (1 + 0.1 * torch.randn(d, generator=g, dtype=compute)) if norm else None
    add = torch.randn(rows, d, generator=g, dtype=compute).to(dtype) if addend else None
    grad = torch.randn(rows, d, generator=g, dtype=compute).to(dtype)
    g_total = torch.randn(rows, d, generator=g, dtype=compute).to(dtype) if addend else None
    needs = [k > 0] + [True] * (k + c) + [c > 0, norm]
    addend_dtype = torch.bfloat16 if addend and dtype == torch.float32 else None  # (an autocast output's)

    def run(impl, to):
        on = lambda t: None if t is None else to(t)  # noqa: E731
        out, alpha, rc, zc, rstd, total = impl.merge_forward(on(z), [to(x) for x in sources], [to(x) for x in computed],
                                                             on(qg), on(w), 1e-6, 1e-5, on(add))
        comp = [to(x) for x in computed[:-1]] + [total] if addend else [to(x) for x in computed]
        grads = impl.merge_backward(to(grad), alpha, rc, zc, rstd, [to(x) for x in sources], comp, on(qg), on(w),
                                    needs, on(g_total), addend_dtype)
        g_z, g_src, g_comp, g_q, g_w, g_addend = grads
        if addend_dtype is not None:  # (the addend's gradient: the last source's, converted - by the interpreter
            assert g_addend.dtype == addend_dtype  # truncated, by a GPU and torch rounded to the nearest)
            assert_rel_close(g_addend.cpu().double(), g_comp[-1].cpu().double(), OP_TOL_BF16, "the addend's gradient")
        named = [("out", out), ("alpha", alpha), ("total", total), ("rc", rc), ("zc", zc), ("rstd", rstd),
                 ("g_z", g_z if k else None), ("g_qg", g_q), ("g_norm", g_w),
                 *((f"source {j}'s gradient", x) for j, x in enumerate(g_src)),
                 *((f"computed {j}'s gradient", x) for j, x in enumerate(g_comp))]
        return {name: t for name, t in named if t is not None}

    want = run(torch_impl, lambda t: t.double())
    tol = 1e-12 if dtype == torch.float64 else TOL[torch.float32] if dtype == torch.float32 else OP_TOL_BF16
    for held, programs, stages in [(True, None, None), (True, 2, None), (True, 2, 2), (True, 3, 1),
                                   (False, None, None)]:  # (2 programs: several rows each, pipelined)
        monkeypatch.setitem(triton_impl.FORCED, "merge_held", held)
        monkeypatch.setitem(triton_impl.FORCED, "programs", programs)
        monkeypatch.setitem(triton_impl.FORCED, "merge_stages", stages)
        got = run(triton_impl, lambda t: t.to(device))
        assert got.keys() == want.keys()
        for name, b in want.items():
            assert_rel_close(got[name].cpu().double(), b, tol, f"{name} (held {held}, programs {programs}, "
                                                               f"stages {stages})")


@pytest.mark.triton
@pytest.mark.parametrize("current", [0, 1])
def test_triton_launches_on_the_device_of_the_tensors_not_the_current_one(current, monkeypatch):
    """Triton launches on the current CUDA device: every entry point of the Triton
    implementation makes its tensors' device current first (a model on ``cuda:1``, or
    spread over devices), and leaves it alone where it is current already. Fake CUDA
    tensors; the device switch recorded."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from attnres.ops.depth_attention import triton_impl

    entered, seen = [], []

    @contextlib.contextmanager
    def switch(device):
        entered.append(torch.device(device))
        yield

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "device", switch)
    launch = triton_impl.on_the_tensors_device(lambda z, sources, computed: seen.append(list(entered)) or "ran")
    with FakeTensorMode():
        x = torch.empty(3, 8, device="cuda:1")
    assert launch(None, [], [x]) == "ran"  # (the first tensor: inside the first non-empty sequence)
    assert seen == [[torch.device("cuda", 1)] if current == 0 else []]
    assert launch(torch.empty(3, 1), [torch.empty(3, 8)], []) == "ran" and len(entered) == (current == 0)  # (CPU)
    for name in ("phase1_forward", "phase1_backward", "merge_forward", "merge_backward"):
        assert getattr(triton_impl, name).__wrapped__.__name__ == name  # (each entry point guarded)


class _SharedMemoryBound:
    """A held merge kernel on a card whose shared memory holds it only ``fits`` deep: deeper,
    Triton's ``OutOfResources`` before anything runs (an RTX 4090's 99 KiB against the float64
    backward at d = 4096, 128 KiB two deep); the depths asked, in order."""

    def __init__(self, kernel, fits: int):
        self.kernel, self.fits, self.asked = kernel, fits, []

    def __getitem__(self, grid):
        def launch(*args, STAGES, **flags):
            from triton.runtime.errors import OutOfResources

            self.asked.append(STAGES)
            if STAGES > self.fits:
                raise OutOfResources(131188, 101376, "shared memory")
            return self.kernel[grid](*args, STAGES=STAGES, **flags)
        return launch


@pytest.mark.triton
@pytest.mark.parametrize("fits", [1, 2])
def test_a_held_merge_too_deep_for_the_cards_shared_memory_runs_as_deep_as_fits(fits, monkeypatch):
    """Where the device's shared memory cannot hold a held merge's pipeline (float64 at
    d = 4096 on an RTX 4090), the merge runs less deep - the same numbers -
    and remembers it: the next call asks the device once; a forced depth raises."""
    triton_device()
    from triton.runtime.errors import OutOfResources

    from attnres.ops.depth_attention import triton_impl, triton_kernels

    fwd = _SharedMemoryBound(triton_kernels.merge_fwd_held, fits)
    bwd = _SharedMemoryBound(triton_kernels.merge_bwd_held, fits)
    monkeypatch.setattr(triton_kernels, "merge_fwd_held", fwd)
    monkeypatch.setattr(triton_kernels, "merge_bwd_held", bwd)
    monkeypatch.setattr(triton_impl, "_FITTED_STAGES", {})
    monkeypatch.setitem(triton_impl.FORCED, "programs", 2)  # (5 rows a program: pipelined 3 deep)
    inputs = merge_flat(*merge_inputs((2, 5), 48, 1, 1, True, dtype=torch.float32))  # (an aligned d: held)
    want = outputs_and_grads(merge_fn("torch", 1, 1, True), inputs)
    for call in range(2):
        got = outputs_and_grads(merge_fn("triton", 1, 1, True), inputs)
        for a, b in zip(got, want):
            assert_rel_close(a, b, TOL[torch.float32])
    assert fwd.asked == bwd.asked == [*range(3, fits - 1, -1), fits]  # (then straight to the depth that fits)
    monkeypatch.setitem(triton_impl.FORCED, "merge_stages", 3)
    with pytest.raises(OutOfResources):
        merge_fn("triton", 1, 1, True)(*inputs)


@pytest.mark.triton
def test_triton_float16_storage(kernel):
    triton_device()
    inputs = merge_flat(*merge_inputs((2, 5), 40, 1, 1, True))
    cast = [t.detach().to(torch.float16 if t.dim() > 1 else torch.float32).requires_grad_() for t in inputs]
    cast[0] = inputs[0].detach().float().requires_grad_()
    for a, b in zip(outputs_and_grads(merge_fn("triton", 1, 1, True), cast),
                    outputs_and_grads(merge_fn("torch", 1, 1, True), cast)):
        assert_rel_close(a, b, OP_TOL_BF16)


# ----------------------------------------------------------------------------------------
# The CPU kernel: checked binding, build
# ----------------------------------------------------------------------------------------


def test_binding_checks_names_types_and_tensors(kernel):
    xs = [torch.randn(3, 8), torch.randn(3, 8)]
    q = torch.randn(2, 8)
    outs, lse = [torch.empty(3, 8), torch.empty(3, 8)], torch.empty(3, 2)
    args = dict(tokens=3, d=8, n=2, S=2, src=xs, q=q, eps=1e-6, out=outs, lse=lse, threads=1)
    kernel.call("phase1_forward", torch.float32, **args)
    want_outs, want_lse = reference.phase1(q, xs, 1e-6)
    assert_rel_close(lse, want_lse, 1e-6)
    assert_rel_close(outs[1], want_outs[1], 1e-6)
    with pytest.raises(TypeError, match=r"missing arguments \['threads'\]"):
        kernel.call("phase1_forward", torch.float32, **{k: v for k, v in args.items() if k != "threads"})
    with pytest.raises(TypeError, match=r"unknown arguments \['bogus'\]"):
        kernel.call("phase1_forward", torch.float32, **args, bogus=1)
    with pytest.raises(TypeError, match="q must be a contiguous CPU tensor of torch.float32"):
        kernel.call("phase1_forward", torch.float32, **{**args, "q": q.double()})
    with pytest.raises(TypeError, match="src must be a contiguous CPU tensor"):
        kernel.call("phase1_forward", torch.float32, **{**args, "src": [xs[0], torch.randn(3, 16)[:, ::2]]})
    with pytest.raises(TypeError, match="lse must not be None"):
        kernel.call("phase1_forward", torch.float32, **{**args, "lse": None})
    with pytest.raises(TypeError, match="tokens must be int64_t"):
        kernel.call("phase1_forward", torch.float32, **{**args, "tokens": 3.0})
    assert set(kernel.params) == {f"{op}_{way}" for op in ("merge", "phase1") for way in ("forward", "backward")}


def test_binding_refuses_a_library_of_another_abi_version(kernel, monkeypatch):
    monkeypatch.setattr(cpu_kernel, "ABI_VERSION", cpu_kernel.ABI_VERSION + 1)
    with pytest.raises(OSError, match="ABI version"):
        cpu_kernel.KernelLibrary(kernel.path)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path))
    cpu_kernel.cpu_kernel.cache_clear()
    yield tmp_path
    cpu_kernel.cpu_kernel.cache_clear()


def test_build_failure_warns_once_and_falls_back(monkeypatch, fresh_build):
    """No working compiler: one warning and ``None`` (the PyTorch implementation runs);
    ``ATTNRES_CPU_KERNEL=0``: ``None`` without building."""
    monkeypatch.setenv("CC", "/bin/false")
    # (the warning says how to build, and how to run PyTorch without it)
    with pytest.warns(UserWarning, match=r"could not be built .*: set \$CC to a working C compiler \(or "
                                         r"ATTNRES_CPU_KERNEL=0 to run it without building, and without this warning\)$"):
        assert cpu_kernel.cpu_kernel() is None
    z, sources, computed, qg, w = merge_inputs((2, 3), 4, 1, 1, True)
    assert library.pick("auto", [*sources, z]) is torch_impl
    assert_rel_close(library.merge(z, sources, computed, qg, 1e-6, w)[0],
                     reference.merge(z, sources, computed, qg, 1e-6, w)[0], 1e-13)
    monkeypatch.setenv("ATTNRES_CPU_KERNEL", "0")
    monkeypatch.delenv("CC")
    cpu_kernel.cpu_kernel.cache_clear()
    assert cpu_kernel.cpu_kernel() is None
    assert not list(fresh_build.rglob("*.so"))


def test_the_kernel_is_switched_off_as_the_variable_is_spelt(monkeypatch, fresh_build):
    """Only ``ATTNRES_CPU_KERNEL=0`` switched the kernel off: ``false`` (or ``off``) built it and
    ran it without a word. The usual spellings of off and on are read; another value is warned of,
    naming both, and leaves the kernel on."""
    import warnings

    monkeypatch.setenv("CC", "/bin/false")  # (a build would warn: none may run here)
    for off in ("0", "false", "Off", "no"):
        monkeypatch.setenv("ATTNRES_CPU_KERNEL", off)
        cpu_kernel.cpu_kernel.cache_clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu_kernel.cpu_kernel() is None
    for on in ("1", "true", ""):
        monkeypatch.setenv("ATTNRES_CPU_KERNEL", on)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not cpu_kernel.switched_off()
    monkeypatch.setenv("ATTNRES_CPU_KERNEL", "flase")
    with pytest.warns(UserWarning, match=r"^ATTNRES_CPU_KERNEL='flase' is neither 0 \(the PyTorch implementation; also "
                                         r"false, off, no\) nor 1 \(the C kernel, as unset; also true, on, yes\): the C "
                                         r"kernel runs$"):
        assert not cpu_kernel.switched_off()
    assert not list(fresh_build.rglob("*.so"))


def test_kernel_is_built_once_into_the_cache(kernel, fresh_build):
    assert cpu_kernel.cpu_kernel() is not None
    built = list(fresh_build.rglob("*.so"))
    assert len(built) == 1 and not [p for p in fresh_build.rglob("*") if p.is_file() and p not in built]
    stamp = built[0].stat().st_mtime_ns
    cpu_kernel.cpu_kernel.cache_clear()
    assert cpu_kernel.cpu_kernel() is not None and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


def test_a_compiler_command_with_arguments_builds(kernel, fresh_build, monkeypatch):
    """$CC may be a command line (``ccache cc``); it was taken as one file name: 'No such file
    or directory: ...'."""
    real = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    monkeypatch.setenv("CC", f"env LC_ALL=C {real}")
    assert cpu_kernel.cpu_kernel() is not None and len(list(fresh_build.rglob("*.so"))) == 1


def test_build_retries_without_the_flags_a_compiler_refuses(kernel, fresh_build, monkeypatch):
    """A compiler that rejects ``-march=native`` and ``-fopenmp`` (here: a wrapper around the
    real one) still gets the kernel built - one warning, and the results are the same."""
    real = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    wrapper = fresh_build / "picky-cc"
    # (-O0 last: the build at -O3, 2 CPU-s, is not what this checks)
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in -march=native|-fopenmp) exit 1;; esac; done\n'
                       f'exec {real} "$@" -O0\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(wrapper))
    with pytest.warns(UserWarning, match="built without -march=native -fopenmp"):
        lib = cpu_kernel.cpu_kernel()
    assert lib is not None
    z, sources, computed, qg, w = merge_inputs((2, 3), 8, 1, 2, True)
    assert_rel_close(library.merge(z, sources, computed, qg, 1e-6, w)[0],
                     reference.merge(z, sources, computed, qg, 1e-6, w)[0], 1e-13)



@pytest.mark.parametrize("refused", ["-fopenmp", "-march=native"])
def test_build_drops_only_the_flag_a_compiler_refuses(kernel, fresh_build, monkeypatch, refused):
    """Apple's clang refuses ``-fopenmp`` but takes ``-march=native`` (older clang on arm64 the
    other way round): the build dropped both, and the warning said both were refused; now it
    keeps the other flag and names only the refused one."""
    real = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    wrapper, log = fresh_build / "picky-cc", fresh_build / "args.log"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in {refused}) exit 1;; esac; done\n'
                       f'echo "$@" >> {log}\nexec {real} "$@" -O0\n')  # (-O0: the flags are checked, not the code)
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(wrapper))
    with pytest.warns(UserWarning) as caught:
        assert cpu_kernel.cpu_kernel() is not None
    kept = ({"-fopenmp", "-march=native"} - {refused}).pop()
    assert [str(w.message).split(" (")[0] for w in caught] == [f"attnres: the CPU kernel was built without {refused}"]
    assert kept in log.read_text().splitlines()[-1].split()


def test_kernel_cache_tells_arm_cpus_apart(monkeypatch, tmp_path):
    """Linux on aarch64 has no "model name" or "flags" in /proc/cpuinfo: every ARM CPU had the
    same cache key, so a cache shared by a Graviton and a Grace node (an NFS home) loaded the
    other's -march=native build (illegal instruction). Now the implementer, part and features
    are in the key."""
    ids = []
    for part, features in (("0xd40", "fp asimd sve"), ("0xd4f", "fp asimd sve sve2 bf16")):
        info = tmp_path / f"cpuinfo-{part}"
        info.write_text(f"processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: {features}\nCPU implementer\t: 0x41\n"
                        f"CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: {part}\nCPU revision\t: 1\n")
        monkeypatch.setattr(machine, "CPUINFO", info)
        ids.append(cpu_kernel._cpu_id())
    assert ids[0] != ids[1] and all("CPU part" in i for i in ids)

@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_torch_func_transforms_of_the_operations_run_the_reference(backend):
    """``torch.func.grad`` / ``vmap`` / ``jvp`` of ``operations(backend).phase1`` or ``.merge``
    failed in the operators' autograd Functions ("it must override the setup_context
    staticmethod"); under a transform they now run the reference, the same function."""
    from torch.func import grad, jvp, vmap

    ops, ref = operations(backend), operations("reference")
    z, sources, computed, qg, w = merge_inputs((2, 3), 8, 1, 2, True)
    q1 = torch.randn(2, 8, dtype=torch.float64)

    def merged(op, qg):
        return op.merge(z, sources, computed, qg, norm_weight=w)[0].square().sum()

    def summed(op, q):
        outs, lse = op.phase1(q, [*sources, *computed])
        return outs[1].square().sum() + lse.sum()

    for run in (lambda op: grad(lambda q: merged(op, q))(qg), lambda op: grad(lambda q: summed(op, q))(q1),
                lambda op: vmap(lambda x: op.merge(z[0], [x], [computed[0][0]], qg)[0])(sources[0]),
                lambda op: vmap(lambda x: op.phase1(q1, [x, sources[0][0]])[1])(computed[0]),
                lambda op: jvp(lambda q: op.phase1(q, sources)[1], (q1,), (torch.ones_like(q1),))[1]):
        assert_rel_close(run(ops), run(ref), TOL[torch.float64])


@pytest.mark.parametrize("addend", [False, True])
@pytest.mark.parametrize("call", ["wrapper", "operator"])
def test_the_merges_weights_and_statistics_carry_no_gradient(call, addend):
    """The merge's ``alpha`` (and its statistics) are not differentiable, but without an addend
    they were returned requiring grad (a second ``mark_non_differentiable`` call replaced the
    first's set): a loss on ``alpha`` ran a backward that dropped its gradient in silence (no
    gradient reached the query, where the reference's sends one). They are now marked, for the
    wrapper and the operator alike: autograd says such a loss has no gradient."""
    z, sources, computed, qg, _ = merge_inputs((2, 3), 8, 1, 1, False, dtype=torch.float32)
    extra = [computed[0].detach().clone().requires_grad_()] if addend else []
    if call == "wrapper":
        out, alpha, *_ = library.merge(z, sources, computed, qg, addend=extra[0] if addend else None)
        stats = []
    else:
        out, alpha, *stats, total = torch.ops.attnres.merge(z, sources, computed, qg, None, 1e-6, 1e-6, "auto", *extra)
        assert total.requires_grad == addend
    assert out.requires_grad and not alpha.requires_grad and not any(t.requires_grad for t in stats)
    with pytest.raises(RuntimeError, match="does not require grad"):
        alpha.square().sum().backward()
