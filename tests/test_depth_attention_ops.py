"""The depth-attention operations (``attnres.ops.depth_attention``): every implementation -
PyTorch, the CPU kernel (``impl="auto"`` on CPU float32 / float64) and Triton (under
Triton's interpreter) - as ``torch.library`` custom operators.

* ``torch.library.opcheck`` of every operator, forward and backward operators, float32 and
  float64, for each implementation;
* every implementation against the plain-graph reference, forward and every gradient: in
  float64 to rounding, with ``gradcheck``; in float32 and bfloat16 under the per-dtype rule
  of ``conftest.fast_path_violations`` against the float64 truth; over random shapes;
* the dispatch by device and dtype, what the operators save for the backward, the Triton
  kernels' tiling, and the CPU kernel's build and checked binding.
"""

from __future__ import annotations

import os
import shutil
import stat

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck
from torch.utils._pytree import tree_map_only

from attnres.ops.depth_attention import cpu_kernel, library, reference, torch_impl

from conftest import OP_TOL_BF16, TOL, assert_fast_matches_naive, assert_rel_close

IMPLS = ["auto", "torch", pytest.param("triton", marks=pytest.mark.triton)]


def triton_or_skip(impl: str) -> None:
    if impl == "triton":
        pytest.importorskip("triton")


@pytest.fixture
def kernel():
    """The CPU kernel, built: a machine with a C compiler must build it (a failed build
    would otherwise pass silently on the PyTorch implementation)."""
    if os.environ.get("ATTNRES_CPU_KERNEL") == "0":
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


def merge_inputs(lead=(2, 3), d=5, n=3, partial=True, norm=True, dtype=torch.float64, seed=0):
    """``(z, sources, partial, qg, norm_weight)``; logits and queries in the compute dtype."""
    g = torch.Generator().manual_seed(seed)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    sources = [rnd(g, *lead, d, scale=1 + 2 * j, dtype=dtype) for j in range(n)]
    z = rnd(g, *lead, n, scale=2.0, dtype=compute)
    b = rnd(g, *lead, d, scale=3.0, dtype=dtype) if partial else None
    qg = rnd(g, d, dtype=compute) if partial else None
    w = (1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64)).to(compute).requires_grad_() if norm else None
    return z, sources, b, qg, w


def run_merge(impl, z, sources, b, qg, w):
    if impl == "reference":
        return reference.merge(z, sources, b, qg, 1e-6, w, 1e-5)
    return library.merge(z, sources, b, qg, 1e-6, w, 1e-5, impl)


def phase1_inputs(lead=(2, 3), d=5, S=3, n=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return rnd(g, *lead, S, n, scale=2.0, dtype=compute), [rnd(g, *lead, d, scale=1 + j, dtype=dtype) for j in range(n)]


def run_phase1(impl, z, sources):
    return reference.phase1(z, sources) if impl == "reference" else library.phase1(z, sources, impl)


def run_logits(impl, x, qg):
    return reference.rms_logits(x, qg, 1e-6) if impl == "reference" else library.rms_logits(x, qg, 1e-6, impl)


def outputs_and_grads(fn, inputs, seed=1):
    """``fn(*inputs)`` (a tensor or a tuple/list of them) and the gradient of a random
    projection of every output with respect to every input."""
    out = fn(*inputs)
    flat = [t for t in (out if isinstance(out, (tuple, list)) else [out]) for t in (t if isinstance(t, list) else [t])]
    g = torch.Generator().manual_seed(seed)
    loss = sum((t.double() * torch.randn(t.shape, generator=g, dtype=torch.float64)).sum() for t in flat)
    return [*flat, *torch.autograd.grad(loss, inputs, allow_unused=True)]


def merge_fn(impl, partial, norm):
    def f(z, *rest):
        rest = list(rest)
        w = rest.pop() if norm else None
        qg = rest.pop() if partial else None
        b = rest.pop() if partial else None
        return run_merge(impl, z, rest, b, qg, w)[0]

    return f


def merge_flat(z, sources, b, qg, w):
    return [z, *sources, *([b, qg] if b is not None else []), *([w] if w is not None else [])]


# ----------------------------------------------------------------------------------------
# opcheck
# ----------------------------------------------------------------------------------------


def op_cases(dtype):
    z, sources, b, qg, w = merge_inputs((2, 3), 6, 2, True, True, dtype)
    pz, psrc = phase1_inputs((2, 2), 6, 2, 3, dtype)
    g = torch.Generator().manual_seed(3)
    x = rnd(g, 2, 3, 6, dtype=dtype)
    q = rnd(g, 4, 6, dtype=z.dtype)
    return {
        "rms_logits": (torch.ops.attnres.rms_logits.default, (x, q, 1e-6)),
        "phase1": (torch.ops.attnres.phase1.default, (pz, psrc)),
        "merge": (torch.ops.attnres.merge.default, (z, sources, b, qg, w, 1e-6, 1e-5)),
        "merge_norm": (torch.ops.attnres.merge.default, (z, sources, None, None, w, 1e-6, 1e-5)),
        "merge_plain": (torch.ops.attnres.merge.default, (z, sources, None, None, None, 1e-6, 1e-5)),
    }


def backward_args(op, args, impl):
    """The backward operator of ``op`` and its arguments, from a forward run."""
    with torch.no_grad():
        if op is torch.ops.attnres.rms_logits.default:
            x, q, eps = args
            z, r = op(x, q, eps, impl)
            return torch.ops.attnres.rms_logits_backward.default, (torch.randn_like(z), x, q, r, [True, True])
        if op is torch.ops.attnres.phase1.default:
            z, sources = args
            outs, lse = op(z, sources, impl)
            g_outs = [torch.randn_like(outs[0]), None]
            return torch.ops.attnres.phase1_backward.default, (z, lse, sources, g_outs, torch.randn_like(lse),
                                                                [True] * (1 + len(sources)))
        z, sources, b, qg, w, eps, norm_eps = args
        out, alpha, r_b, zb, rstd = op(*args, impl)
        stats = [r_b if b is not None else None, zb if b is not None else None, rstd if w is not None else None]
        needs = [True] * (1 + len(sources)) + [b is not None, qg is not None, w is not None]
        return torch.ops.attnres.merge_backward.default, (torch.randn_like(out), alpha, *stats, sources, b, qg, w,
                                                          needs)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["rms_logits", "phase1", "merge", "merge_norm", "merge_plain"])
def test_opcheck_every_operator_forward_and_backward(case, dtype, impl, kernel):
    triton_or_skip(impl)
    op, args = op_cases(dtype)[case]
    torch.library.opcheck(op, (*args, impl))
    bop, bargs = backward_args(op, args, impl)
    torch.library.opcheck(bop, (*tree_map_only(torch.Tensor, torch.Tensor.detach, bargs), impl))


# ----------------------------------------------------------------------------------------
# Every implementation against the reference
# ----------------------------------------------------------------------------------------

MERGE_CASES = [  # (lead, d, n, partial, norm): one token, one source, k = 0 and more
    ((2, 3), 5, 3, True, True),
    ((1, 1), 4, 1, True, True),
    ((2, 3), 5, 3, False, True),
    ((2, 1), 6, 2, False, False),
    ((3,), 7, 1, False, True),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lead, d, n, partial, norm", MERGE_CASES)
def test_merge_float64_equals_the_reference_and_gradchecks(lead, d, n, partial, norm, impl, kernel):
    triton_or_skip(impl)
    inputs = merge_flat(*merge_inputs(lead, d, n, partial, norm))
    got = outputs_and_grads(merge_fn(impl, partial, norm), inputs)
    want = outputs_and_grads(merge_fn("reference", partial, norm), inputs)
    for a, b in zip(got, want):
        assert_rel_close(a, b, 1e-12)
    assert gradcheck(merge_fn(impl, partial, norm), tuple(inputs), fast_mode=lead != (1, 1))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lead, d, S, n", [((2, 3), 5, 3, 4), ((1, 1), 4, 2, 3), ((2, 1), 3, 1, 2), ((1, 2), 6, 5, 1)])
def test_phase1_float64_equals_the_reference_and_gradchecks(lead, d, S, n, impl, kernel):
    triton_or_skip(impl)
    z, sources = phase1_inputs(lead, d, S, n)
    fn = lambda zz, *xs: run_phase1(impl, zz, list(xs))  # noqa: E731
    got = outputs_and_grads(fn, [z, *sources])
    want = outputs_and_grads(lambda zz, *xs: run_phase1("reference", zz, list(xs)), [z, *sources])
    for a, b in zip(got, want):
        assert_rel_close(a, b, 1e-12)
    assert gradcheck(lambda zz, *xs: tuple(t for o in fn(zz, *xs) for t in (o if isinstance(o, list) else [o])),
                     (z, *sources), fast_mode=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("K, lead, d", [(1, (1, 1), 6), (4, (2, 3), 37), (19, (3,), 70)])
def test_rms_logits_float64_equals_the_reference_and_gradchecks(K, lead, d, impl, kernel):
    """``K`` = 1 to 19 (past one block of the CPU kernel's queries), ``d`` below and past its
    vector blocks, token counts that leave a partial block of tokens."""
    triton_or_skip(impl)
    g = torch.Generator().manual_seed(1)
    x, q = rnd(g, *lead, d, scale=3.0), rnd(g, K, d)
    got = outputs_and_grads(lambda a, b: run_logits(impl, a, b), [x, q])
    want = outputs_and_grads(lambda a, b: run_logits("reference", a, b), [x, q])
    for a, b in zip(got, want):
        assert_rel_close(a, b, 1e-12)
    assert gradcheck(lambda a, b: run_logits(impl, a, b), (x, q), fast_mode=lead != (1, 1))


def low_precision_check(run, inputs, storage, dtype, tol):
    """``run(impl, *inputs)`` with the ``storage`` inputs (sources) in ``dtype`` and the rest
    (logits, queries, gains) in float32, on each implementation against the float64 truth,
    under the per-dtype rule relative to the reference's own low-precision error."""
    truth = outputs_and_grads(lambda *xs: run("reference", *xs), inputs)

    def low(impl):
        cast = [t.detach().to(dtype if i in storage else torch.float32).requires_grad_() for i, t in enumerate(inputs)]
        return outputs_and_grads(lambda *xs: run(impl, *xs), cast)

    ref = low("reference")
    names = [f"tensor {i}" for i in range(len(truth))]
    for impl in ["auto", "torch"] + (["triton"] if _has_triton() else []):
        assert_fast_matches_naive(low(impl), ref, truth, dtype, names, tol)


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [False, True])
def test_merge_low_precision_against_the_float64_truth(dtype, partial, kernel):
    z, sources, b, qg, w = merge_inputs((2, 7), 24, 4, partial, True)

    def run(impl, zz, *rest):
        rest = list(rest)
        ww = rest.pop()
        qq = rest.pop() if partial else None
        bb = rest.pop() if partial else None
        return run_merge(impl, zz, rest, bb, qq, ww)[0]

    tol = TOL[torch.float32] if dtype == torch.float32 else OP_TOL_BF16
    storage = set(range(1, len(sources) + 1)) | ({len(sources) + 1} if partial else set())
    low_precision_check(run, merge_flat(z, sources, b, qg, w), storage, dtype, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_phase1_and_logits_low_precision_against_the_float64_truth(dtype, kernel):
    z, sources = phase1_inputs((4, 16), 32, 3, 5)
    tol = TOL[torch.float32] if dtype == torch.float32 else OP_TOL_BF16
    low_precision_check(lambda impl, zz, *xs: run_phase1(impl, zz, list(xs)), [z, *sources],
                        set(range(1, len(sources) + 1)), dtype, tol)
    g = torch.Generator().manual_seed(2)
    x, q = rnd(g, 3, 41, 64), rnd(g, 23, 64)
    low_precision_check(run_logits, [x, q], {0}, dtype, tol)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 5), d=st.integers(1, 9), b=st.integers(1, 3), t=st.integers(1, 4),
       partial=st.booleans(), norm=st.booleans(), seed=st.integers(0, 2**16))
def test_merge_matches_the_reference_over_shapes(n, d, b, t, partial, norm, seed):
    inputs = merge_flat(*merge_inputs((b, t), d, n, partial, norm, seed=seed))
    want = outputs_and_grads(merge_fn("reference", partial, norm), inputs, seed)
    for impl in ("auto", "torch"):
        for a, r in zip(outputs_and_grads(merge_fn(impl, partial, norm), inputs, seed), want):
            assert torch.linalg.vector_norm(a - r) <= 1e-10 * max(torch.linalg.vector_norm(r), 1.0)


def test_merge_input_errors():
    z, sources, b, qg, _ = merge_inputs((2,), 4, 2, True, False)
    for merge in (library.merge, reference.merge):
        with pytest.raises(ValueError, match="2 sources"):
            merge(z[..., :1], sources)
        with pytest.raises(ValueError, match="come together"):
            merge(z, sources, b, None)
        with pytest.raises(ValueError, match="at least one source"):
            merge(z, [])
    with pytest.raises(ValueError, match="impl must be one of"):
        library.merge(z, sources, impl="cuda")
    with pytest.raises(ValueError, match=r"qg must have shape \[K, 4\]"):
        library.rms_logits(sources[0], qg, 1e-6)


def test_double_backward_is_refused_clearly():
    z, sources, b, qg, w = merge_inputs((2, 3), 4, 3, True, True)
    out, _ = library.merge(z, sources, b, qg, 1e-6, w)
    (gz,) = torch.autograd.grad(out.square().sum(), [z], create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd"):
        gz.sum().backward()


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
        with pytest.raises(ValueError, match="impl='triton' takes sources"):
            library.pick("triton", [torch.zeros(2, 3, dtype=torch.int32)])


def saved_tensors(fn) -> list[torch.Tensor]:
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("impl", IMPLS)
def test_operators_save_sources_by_reference_and_per_token_statistics(impl, kernel):
    """The saving policy of report §4.2 (docs/design.md): references to the sources (kept
    anyway), per-token statistics, no copy of the sources or of ``h`` unless kept."""
    triton_or_skip(impl)
    z, sources, b, qg, w = merge_inputs((4, 5), 16, 3, True, True, torch.float32)
    d, tokens = 16, 20
    ptrs = {x.data_ptr() for x in (*sources, b)}
    saved = saved_tensors(lambda: library.merge(z, sources, b, qg, 1e-6, w, 1e-5, impl))
    big = [t for t in saved if t.shape[-1] == d and t.numel() >= tokens * d]
    assert {t.data_ptr() for t in big} == ptrs, [tuple(t.shape) for t in saved]
    assert sum(t.numel() for t in saved if t.data_ptr() not in ptrs) <= tokens * 8 + 2 * d  # alpha, r_b, zb, rstd
    pz, psrc = phase1_inputs((4, 5), 16, 3, 4, torch.float32)
    saved = saved_tensors(lambda: library.phase1(pz, psrc, impl))
    assert {t.data_ptr() for t in saved if t.shape[-1] == d} == {x.data_ptr() for x in psrc}


@pytest.mark.triton
def test_triton_kernels_tile_d_and_split_rows_over_programs(monkeypatch):
    """``d`` walked in tiles that do not divide it, backward programs over several rows,
    and Phase 1's queries in chunks (S = 17 > 16): against the PyTorch implementation."""
    pytest.importorskip("triton")
    from attnres.ops.depth_attention import triton_impl

    monkeypatch.setitem(triton_impl.FORCED, "block_d", 16)
    monkeypatch.setitem(triton_impl.FORCED, "max_programs", 3)
    inputs = merge_flat(*merge_inputs((7,), 37, 3, True, True, torch.float64))
    for a, b in zip(outputs_and_grads(merge_fn("triton", True, True), inputs),
                    outputs_and_grads(merge_fn("torch", True, True), inputs)):
        assert_rel_close(a, b, 1e-12)
    z, sources = phase1_inputs((3,), 37, 17, 3)
    fn = lambda impl: lambda zz, *xs: run_phase1(impl, zz, list(xs))  # noqa: E731
    for a, b in zip(outputs_and_grads(fn("triton"), [z, *sources]), outputs_and_grads(fn("torch"), [z, *sources])):
        assert_rel_close(a, b, 1e-12)


@pytest.mark.triton
def test_triton_float16_storage(kernel):
    pytest.importorskip("triton")
    inputs = merge_flat(*merge_inputs((2, 5), 40, 2, True, True))
    cast = [t.detach().to(torch.float16 if t.dim() > 1 else torch.float32).requires_grad_() for t in inputs]
    cast[0] = inputs[0].detach().float().requires_grad_()
    for a, b in zip(outputs_and_grads(merge_fn("triton", True, True), cast),
                    outputs_and_grads(merge_fn("torch", True, True), cast)):
        assert_rel_close(a, b, OP_TOL_BF16)


# ----------------------------------------------------------------------------------------
# The CPU kernel: checked binding, build
# ----------------------------------------------------------------------------------------


def test_binding_checks_names_types_and_tensors(kernel):
    x = torch.randn(3, 8)
    q = torch.randn(2, 8)
    z, r = torch.empty(3, 2), torch.empty(3)
    args = dict(tokens=3, d=8, K=2, x=x, q=q, eps=1e-6, z=z, r=r, threads=1)
    kernel.call("logits_forward", torch.float32, **args)
    assert_rel_close(z, reference.rms_logits(x, q, 1e-6), 1e-6)
    with pytest.raises(TypeError, match=r"missing arguments \['threads'\]"):
        kernel.call("logits_forward", torch.float32, **{k: v for k, v in args.items() if k != "threads"})
    with pytest.raises(TypeError, match=r"unknown arguments \['bogus'\]"):
        kernel.call("logits_forward", torch.float32, **args, bogus=1)
    with pytest.raises(TypeError, match="x must be a contiguous CPU tensor of torch.float32"):
        kernel.call("logits_forward", torch.float32, **{**args, "x": x.double()})
    with pytest.raises(TypeError, match="x must be a contiguous CPU tensor"):
        kernel.call("logits_forward", torch.float32, **{**args, "x": torch.randn(3, 16)[:, ::2]})
    with pytest.raises(TypeError, match="z must not be None"):
        kernel.call("logits_forward", torch.float32, **{**args, "z": None})
    with pytest.raises(TypeError, match="tokens must be int64_t"):
        kernel.call("logits_forward", torch.float32, **{**args, "tokens": 3.0})
    params = {name: [p for p, _, _ in ps] for name, ps in kernel.params.items()}
    assert set(params) == {f"{op}_{way}" for op in ("merge", "phase1", "logits") for way in ("forward", "backward")}


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
    with pytest.warns(UserWarning, match="could not be built"):
        assert cpu_kernel.cpu_kernel() is None
    z, sources, b, qg, w = merge_inputs((2, 3), 4, 2, True, True)
    assert library.pick("auto", [*sources, z]) is torch_impl
    assert_rel_close(library.merge(z, sources, b, qg, 1e-6, w)[0], reference.merge(z, sources, b, qg, 1e-6, w)[0], 1e-13)
    monkeypatch.setenv("ATTNRES_CPU_KERNEL", "0")
    monkeypatch.delenv("CC")
    cpu_kernel.cpu_kernel.cache_clear()
    assert cpu_kernel.cpu_kernel() is None
    assert not list(fresh_build.rglob("*.so"))


def test_kernel_is_built_once_into_the_cache(kernel, fresh_build):
    assert cpu_kernel.cpu_kernel() is not None
    built = list(fresh_build.rglob("*.so"))
    assert len(built) == 1 and not [p for p in fresh_build.rglob("*") if p.is_file() and p not in built]
    stamp = built[0].stat().st_mtime_ns
    cpu_kernel.cpu_kernel.cache_clear()
    assert cpu_kernel.cpu_kernel() is not None and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


def test_build_retries_without_the_flags_a_compiler_refuses(kernel, fresh_build, monkeypatch):
    """A compiler that rejects ``-march=native`` and ``-fopenmp`` (here: a wrapper around the
    real one) still gets the kernel built - one warning, and the results are the same."""
    real = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    wrapper = fresh_build / "picky-cc"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in -march=native|-fopenmp) exit 1;; esac; done\n'
                       f'exec {real} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(wrapper))
    with pytest.warns(UserWarning, match="built without -march=native -fopenmp"):
        lib = cpu_kernel.cpu_kernel()
    assert lib is not None
    z, sources, b, qg, w = merge_inputs((2, 3), 8, 2, True, True)
    assert_rel_close(library.merge(z, sources, b, qg, 1e-6, w)[0], reference.merge(z, sources, b, qg, 1e-6, w)[0], 1e-13)
