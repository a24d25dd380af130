"""The lean training path of the two-phase schedule (``attnres.ops.recompute``): custom
autograd functions that save only the sources and per-token statistics.

* the functions against their plain-autograd references (same signature) and gradcheck in
  float64, including one source, batch 1 and sequence length 1;
* the residual module on the lean path (norm fused, as the trunk runs it) against the naive
  path and the float64 truth, forward and every gradient, under the per-dtype rules of
  ``conftest.fast_path_violations``, and gradcheck through the module;
* what the path saves for the backward (counted with saved-tensor hooks, no timing);
* backend selection, bf16 autocast and activation checkpointing.
"""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

from attnres import AttnResLM, ModelConfig
from attnres.nn import BlockAttnRes, FullAttnRes, RMSNorm
from attnres.kernels.cpu import cpu_kernel
from attnres.ops import (
    depth_merge_reference,
    lean_depth_merge,
    lean_phase1,
    lean_rms_logits,
    phase1_reference,
    rms_logits,
    tap_source,
)

from conftest import GRAD_TOL, OP_TOL_BF16, TOL, assert_fast_matches_naive, assert_rel_close, make_model

# ----------------------------------------------------------------------------------------
# The functions
# ----------------------------------------------------------------------------------------


def merge_inputs(lead, d, n, partial, norm, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()

    sources = [rnd(*lead, d, scale=1 + 2 * j) for j in range(n)]
    z = rnd(*lead, n, scale=2.0)
    b = rnd(*lead, d, scale=3.0) if partial else None
    qg = rnd(d) if partial else None
    w = (1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64)).to(dtype).requires_grad_() if norm else None
    return z, b, qg, w, sources


def call(fn, z, b, qg, w, sources, eps=1e-6, norm_eps=1e-5, **kw):
    return fn(z, sources, b, qg, eps, w, norm_eps, **kw)


@pytest.fixture
def kernel():
    """The CPU kernel, built: a machine with a C compiler must build it (a failed build
    would otherwise pass silently on the PyTorch code); ``ATTNRES_CPU_KERNEL=0`` skips."""
    if os.environ.get("ATTNRES_CPU_KERNEL") == "0":
        pytest.skip("CPU kernel switched off")
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine (the PyTorch code runs instead)")
    assert cpu_kernel() is not None, "the CPU kernel did not build (see the warning)"
    return cpu_kernel()


def lean_merge_kernel(*args, **kw):
    """:func:`lean_depth_merge` on the CPU kernel (the tests' inputs all qualify for it)."""
    return lean_depth_merge(*args, **kw, cpu_kernel=True)


MERGES = {"torch": lean_depth_merge, "kernel": lean_merge_kernel}


@pytest.mark.parametrize("lead", [(2, 3), (1, 1)])  # (b,), (b, 1), more shapes: the hypothesis test
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_lean_depth_merge_gradcheck_and_reference(lead, n, partial, norm, path, request):
    if path == "kernel":
        request.getfixturevalue("kernel")
    merge = MERGES[path]
    z, b, qg, w, sources = merge_inputs(lead, 5, n, partial, norm)
    inputs = [t for t in (z, b, qg, w, *sources) if t is not None]

    def f(*values):
        it = iter(values)
        zz = next(it)
        bb = next(it) if partial else None
        qq = next(it) if partial else None
        ww = next(it) if norm else None
        return call(merge, zz, bb, qq, ww, list(it))

    # The full Jacobian for one token; gradcheck's random-projection mode for six (time).
    assert gradcheck(f, tuple(inputs), fast_mode=lead != (1, 1))
    out = call(merge, z, b, qg, w, sources)
    ref = call(depth_merge_reference, z, b, qg, w, sources)
    assert_rel_close(out, ref, 1e-12, "forward")
    up = torch.randn_like(ref)
    for a, r in zip(torch.autograd.grad((out * up).sum(), inputs), torch.autograd.grad((ref * up).sum(), inputs)):
        assert_rel_close(a, r, 1e-10, "gradient")


@pytest.mark.parametrize("shape", [(), (4,), (1,), (19,)])
@pytest.mark.parametrize("lead", [(2, 3), (1, 1)])
@pytest.mark.parametrize("d", [6, 37])
@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_lean_rms_logits_gradcheck_and_reference(shape, lead, d, path, request):
    """Both paths against the reference and gradcheck: ``K`` = 1 (a ``[d]`` query) to 19 (past
    one block of the kernel's queries), ``d`` below and past its vector blocks, token counts
    that leave a partial block of tokens."""
    if path == "kernel":
        request.getfixturevalue("kernel")
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(*lead, d, generator=g, dtype=torch.float64) * 3).requires_grad_()
    q = torch.randn(*shape, d, generator=g, dtype=torch.float64).requires_grad_()
    fn = lambda a, b: lean_rms_logits(a, b, 1e-6, cpu_kernel=path == "kernel")  # noqa: E731
    out = fn(x, q)
    if path == "kernel":
        assert out.grad_fn.kernel
    assert gradcheck(fn, (x, q), fast_mode=lead != (1, 1) or d > 6)
    ref = rms_logits(x, q, 1e-6)
    assert_rel_close(out, ref, 1e-13, "logits")
    up = torch.randn_like(ref)
    for a, r in zip(torch.autograd.grad((out * up).sum(), (x, q)), torch.autograd.grad((ref * up).sum(), (x, q))):
        assert_rel_close(a, r, 1e-12, "gradient")


def test_lean_rms_logits_kernel_in_float32_against_the_float64_truth(kernel):
    """The kernel's float32 logits and gradients within the per-dtype rule of the
    reference's own float32 error."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 41, 64, generator=g, dtype=torch.float64).requires_grad_()
    q = torch.randn(23, 64, generator=g, dtype=torch.float64).requires_grad_()
    up = torch.randn(3, 41, 23, generator=g, dtype=torch.float64)

    def run(fn, dtype):
        a, b = (t.detach().to(dtype).requires_grad_() for t in (x, q))
        out = fn(a, b)
        return [out, *torch.autograd.grad((out * up.to(dtype)).sum(), (a, b))]

    kernel_logits = lambda a, b: lean_rms_logits(a, b, 1e-6, cpu_kernel=True)  # noqa: E731
    reference = lambda a, b: rms_logits(a, b, 1e-6)  # noqa: E731
    assert_fast_matches_naive(run(kernel_logits, torch.float32), run(reference, torch.float32),
                              run(reference, torch.float64), torch.float32, ["logits", "grad x", "grad q"],
                              TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_lean_merge_low_precision_against_the_float64_truth(dtype, partial, path):
    """Each low-precision path against the float64 truth, the lean one within the
    per-dtype rule of the reference's own error."""
    z, b, qg, w, sources = merge_inputs((2, 7), 24, 4, partial, True)
    inputs = [t for t in (z, b, qg, w, *sources) if t is not None]
    truth_out = call(depth_merge_reference, z, b, qg, w, sources)
    up = torch.randn_like(truth_out)
    truth = [truth_out, *torch.autograd.grad((truth_out * up).sum(), inputs)]

    def low(fn):
        cast = [t.detach().to(dtype if t.dim() > 1 else torch.float32).requires_grad_() for t in inputs]
        it = iter(cast)
        zz, bb = next(it), (next(it) if partial else None)
        qq, ww = (next(it) if partial else None), next(it)
        out = call(fn, zz, bb, qq, ww, list(it))
        return [out, *torch.autograd.grad((out * up.to(out.dtype)).sum(), cast)]

    names = ["output"] + [f"grad {i}" for i in range(len(inputs))]
    tol = TOL[torch.float32] if dtype == torch.float32 else OP_TOL_BF16
    assert_fast_matches_naive(low(MERGES[path]), low(depth_merge_reference), truth, dtype, names, tol)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 5), d=st.integers(1, 9), b=st.integers(1, 3), t=st.integers(1, 4),
    partial=st.booleans(), norm=st.booleans(), seed=st.integers(0, 2**16),
)
def test_lean_merge_matches_the_reference_over_shapes(n, d, b, t, partial, norm, seed):
    z, pb, qg, w, sources = merge_inputs((b, t), d, n, partial, norm, seed=seed)
    inputs = [x for x in (z, pb, qg, w, *sources) if x is not None]
    ref = call(depth_merge_reference, z, pb, qg, w, sources)
    up = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    expected = torch.autograd.grad((ref * up).sum(), inputs)
    for merge in MERGES.values():
        out = call(merge, z, pb, qg, w, sources)
        assert_rel_close(out, ref, 1e-12, "forward")
        for a, r in zip(torch.autograd.grad((out * up).sum(), inputs), expected):
            assert torch.linalg.vector_norm(a - r) <= 1e-10 * max(torch.linalg.vector_norm(r), 1.0)


def test_merge_input_errors():
    z, b, qg, w, sources = merge_inputs((2,), 4, 2, True, False)
    with pytest.raises(ValueError, match="2 sources"):
        lean_depth_merge(z[..., :1], sources)
    with pytest.raises(ValueError, match="come together"):
        lean_depth_merge(z, sources, b, None)
    with pytest.raises(ValueError, match="at least one source"):
        lean_depth_merge(z, [])


# ----------------------------------------------------------------------------------------
# The CPU kernel: Phase 1, gradient slots, fallbacks
# ----------------------------------------------------------------------------------------


def phase1_inputs(lead, d, S, n, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    sources = [(torch.randn(*lead, d, generator=g, dtype=torch.float64) * (1 + j)).to(dtype).requires_grad_()
               for j in range(n)]
    z = (torch.randn(*lead, S, n, generator=g, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    return z, sources


def phase1_loss(fn, z, sources, seed=1):
    """A scalar that reads every output of Phase 1: the weighted sums and the log-sum-exp."""
    outs, lse = fn(z, sources)
    g = torch.Generator().manual_seed(seed)
    total = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)).sum() for o in outs)
    return total + (lse * torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)).sum()


@pytest.mark.parametrize("lead, d, S, n", [((2, 3), 5, 3, 4), ((1, 1), 4, 2, 3), ((2, 1), 3, 1, 2), ((1, 2), 6, 4, 1)])
def test_lean_phase1_gradcheck_and_reference(kernel, lead, d, S, n):
    """Phase 1 of S queries over n sources in the kernel: forward and every gradient against
    the PyTorch reference, and gradcheck in float64 (S = 1, n = 1, batch 1, one token)."""
    z, sources = phase1_inputs(lead, d, S, n)
    outs, lse = lean_phase1(z, sources)
    ref_outs, ref_lse = phase1_reference(z, sources)
    for a, r in zip([*outs, lse], [*ref_outs, ref_lse]):
        assert_rel_close(a, r, 1e-12, "forward")
    inputs = [z, *sources]
    got = torch.autograd.grad(phase1_loss(lean_phase1, z, sources), inputs)
    ref = torch.autograd.grad(phase1_loss(phase1_reference, z, sources), inputs)
    for a, r in zip(got, ref):
        assert_rel_close(a, r, 1e-12, "gradient")
    assert gradcheck(lambda zz, *xs: phase1_loss(lean_phase1, zz, list(xs)), tuple(inputs))


def test_lean_phase1_in_float32_against_the_float64_truth(kernel):
    z, sources = phase1_inputs((4, 16), 32, 3, 5)
    truth = [phase1_loss(phase1_reference, z, sources).reshape(1),
             *torch.autograd.grad(phase1_loss(phase1_reference, z, sources), [z, *sources])]

    def low(fn):
        cast = [t.detach().float().requires_grad_() for t in (z, *sources)]
        loss = phase1_loss(fn, cast[0], cast[1:])
        return [loss.reshape(1), *torch.autograd.grad(loss, cast)]

    names = ["loss", "grad z"] + [f"grad x{i}" for i in range(len(sources))]
    assert_fast_matches_naive(low(lean_phase1), low(phase1_reference), truth, torch.float32, names, TOL[torch.float32])


def test_double_backward_is_refused_clearly(kernel):
    """The lean nodes are differentiable once (their backwards write into scratch buffers
    and run the C kernel); a double backward says so instead of failing inside."""
    z, b, qg, w, sources = merge_inputs((2, 3), 4, 3, True, True)
    for merge in MERGES.values():
        (gz,) = torch.autograd.grad(call(merge, z, b, qg, w, sources).square().sum(), [z], create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            gz.sum().backward()
    pz, psources = phase1_inputs((2, 2), 3, 2, 3)
    (gz,) = torch.autograd.grad(phase1_loss(lean_phase1, pz, psources).square(), [pz], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gz.sum().backward()


def test_gradient_slots_sum_every_merge_of_a_source(kernel):
    """Tapped sources read by several merges, by Phase 1 and by a logits node get their gradient summed in place
    (one slot each); the result equals the untapped computation's, also over a retained
    graph run twice and when only some inputs' gradients are asked for."""
    z, b, qg, w, sources = merge_inputs((2, 3), 6, 3, True, True)

    def loss(tap):
        xs = [tap_source(x) if tap else x for x in sources]
        outs, lse = lean_phase1(torch.stack([z, z * 0.5], dim=-2), xs)
        total = 0
        for s in range(2):  # Phase 2 of two queries, as Block does
            total = total + call(lean_merge_kernel, lse[..., s : s + 1], b, qg, w, [outs[s]]).sum()
        total = total + lean_rms_logits(xs[1], qg.unsqueeze(0) * 0.5, 1e-6, cpu_kernel=True).square().sum()
        return total + call(lean_merge_kernel, z, None, None, w, xs).square().sum()  # and a direct merge

    inputs = [z, b, qg, w, *sources]
    expected = torch.autograd.grad(loss(False), inputs)
    tapped = loss(True)
    for _ in range(2):  # the second pass over the retained graph must not add to the first's sums
        for a, r in zip(torch.autograd.grad(tapped, inputs, retain_graph=True), expected):
            assert_rel_close(a, r, 1e-13)
    for a, r in zip(torch.autograd.grad(loss(True), sources[1:]), expected[5:]):
        assert_rel_close(a, r, 1e-13)


class SubclassedTensor(torch.Tensor):
    pass


def test_kernel_falls_back_to_the_pytorch_code_where_it_does_not_apply(kernel):
    """bf16 sources, a non-contiguous source, a result dtype other than the sources' or a
    tensor subclass run the PyTorch code (same results); the node says which ran."""
    z, b, qg, w, sources = merge_inputs((2, 4), 6, 2, True, True)
    ran = []

    def merged(zz, xs, out_dtype=None):
        out = lean_merge_kernel(zz, xs, b, qg, 1e-6, w, 1e-5, out_dtype=out_dtype)
        ran.append(out.grad_fn.kernel)
        return out

    base = merged(z, sources)
    strided = torch.randn(2, 4, 12, dtype=torch.float64)[..., ::2]
    merged(z, [sources[0], strided])
    merged(z, sources, out_dtype=torch.float32)
    merged(z.float(), [x.bfloat16() for x in sources])
    merged(z, [sources[0].as_subclass(SubclassedTensor), sources[1]])  # (a DTensor has no memory of its own)
    assert ran == [True, False, False, False, False]
    assert_rel_close(merged(z, [x.detach().clone() for x in sources]), base, 0)


def test_kernel_build_failure_warns_and_falls_back(monkeypatch, tmp_path):
    """No working compiler: one warning and ``None`` (the PyTorch code runs);
    ``ATTNRES_CPU_KERNEL=0``: ``None`` without building."""
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    cpu_kernel.cache_clear()
    try:
        with pytest.warns(UserWarning, match="could not be built"):
            assert cpu_kernel() is None
        z, b, qg, w, sources = merge_inputs((2, 3), 4, 2, True, True)
        assert_rel_close(call(lean_merge_kernel, z, b, qg, w, sources), call(lean_depth_merge, z, b, qg, w, sources), 0)
        monkeypatch.setenv("ATTNRES_CPU_KERNEL", "0")
        monkeypatch.delenv("CC")
        cpu_kernel.cache_clear()
        assert cpu_kernel() is None
        assert not list(tmp_path.rglob("*.so"))
    finally:
        cpu_kernel.cache_clear()


def test_kernel_is_built_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path))
    cpu_kernel.cache_clear()
    try:
        if cpu_kernel() is None:
            pytest.skip("no C compiler here")
        built = list(tmp_path.rglob("*.so"))
        assert len(built) == 1 and not [p for p in tmp_path.rglob("*") if p.is_file() and p not in built]
        stamp = built[0].stat().st_mtime_ns
        cpu_kernel.cache_clear()
        assert cpu_kernel() is not None and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    finally:
        cpu_kernel.cache_clear()


# ----------------------------------------------------------------------------------------
# The residual module on the lean path, norm fused as in the trunk
# ----------------------------------------------------------------------------------------


class NormedToySublayers(torch.nn.Module):
    """``f_l(h) = tanh(RMSNorm_l(h) W_l) * c_l``: every input goes through an RMSNorm, so the
    residual may fuse it (``defer_norm=True``, as the trunk runs it)."""

    def __init__(self, d: int, L: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.norms = torch.nn.ModuleList(RMSNorm(d) for _ in range(L))
        with torch.no_grad():
            for norm in self.norms:
                norm.weight.add_(0.3 * torch.randn(d, generator=g))
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5) for _ in range(L)
        )
        self.scales = [0.5 + l for l in range(L)]

    def forward(self, l, h):
        y = self.norms[l](h)
        return torch.tanh(y @ self.weights[l].to(y.dtype)) * self.scales[l]


def run(residual, subs, emb, defer_norm=True):
    state = residual.start(emb, defer_norm=defer_norm)
    for l in range(residual.n_sublayers):
        residual.add_output(state, l, subs(l, residual.sublayer_input(state, l)))
    return residual.finish(state)


def make(kind, d, L, S, dtype=torch.float64, impl="two_phase", kernels="auto"):
    torch.manual_seed(0)
    if kind == "block":
        m = BlockAttnRes(d, L, S, impl=impl, kernels=kernels)
    else:
        m = FullAttnRes(d, L, impl=impl, group_size=S, kernels=kernels)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
    return m.to(dtype), NormedToySublayers(d, L).to(dtype)


def grads(residual, subs, emb, defer_norm=True):
    emb = emb.detach().clone().requires_grad_()
    out = run(residual, subs, emb, defer_norm)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(out.dtype)
    params = list(residual.parameters()) + list(subs.parameters())
    return [out, *torch.autograd.grad((out * up).sum(), [emb, *params])]


CASES = [
    # (kind, d, L, S or group): S dividing L, not dividing L, S = 1, S >= L, one sublayer.
    ("block", 8, 8, 2),
    ("block", 5, 7, 3),
    ("block", 8, 6, 1),
    ("block", 8, 4, 9),
    ("block", 3, 1, 1),
    ("full", 8, 8, None),
    ("full", 5, 7, 3),
    ("full", 8, 6, 1),
    ("full", 8, 5, 8),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind, d, L, S", CASES)
@pytest.mark.parametrize("lead", [(2, 3), (1, 1)])
def test_lean_residual_equals_naive_forward_and_every_gradient(kind, d, L, S, dtype, lead):
    if dtype == torch.bfloat16 and lead == (1, 1):
        # One token through normed toy sublayers in bf16: the query gradients are dominated by
        # cancellation (the naive path is 30 % off the truth); the existing graph path breaks
        # the 2x rule there as well. test_model covers bf16 at batch 1 / sequence length 1.
        pytest.skip("ill-conditioned in bf16 for every path")
    lean64, subs64 = make(kind, d, L, S or 1)
    naive64 = copy.deepcopy(lean64)
    naive64.impl = "naive"
    emb = torch.randn(*lead, d, dtype=torch.float64) * 2
    truth = grads(naive64, subs64, emb)
    lean, naive, subs = (copy.deepcopy(m).to(dtype) for m in (lean64, naive64, subs64))
    assert lean.backend(emb.to(dtype)).name == "torch"
    got = grads(lean, subs, emb.to(dtype))
    ref = grads(naive, subs, emb.to(dtype))
    names = ["output", "grad of embedding"] + [f"grad of residual.{n}" for n, _ in lean.named_parameters()]
    names += [f"grad of sublayer.{n}" for n, _ in subs.named_parameters()]
    assert_fast_matches_naive(got[:1], ref[:1], truth[:1], dtype, names[:1], TOL[dtype])
    assert_fast_matches_naive(got[1:], ref[1:], truth[1:], dtype, names[1:], GRAD_TOL[dtype])


GRADCHECK_CASES = [("block", 4, 5, 2), ("block", 4, 3, 1), ("block", 4, 3, 5), ("full", 4, 5, 2), ("full", 3, 4, None)]


@pytest.mark.parametrize("kind, d, L, S", GRADCHECK_CASES)
@pytest.mark.parametrize("lead, fast", [((1, 1), True), ((2, 2), True),
                                        pytest.param((2, 2), False, marks=pytest.mark.slow)])
def test_gradcheck_through_the_lean_residual(kind, d, L, S, lead, fast):
    """float64 gradcheck of the whole residual on the lean path (logits, merges, fused
    norms) w.r.t. the embedding, every residual parameter and the norm gains: S not
    dividing L, S = 1, S >= L, batch 1 and sequence length 1 (``fast``: gradcheck's
    random-projection mode; the full Jacobian in the slow suite)."""
    module, subs = make(kind, d, L, S or 1)
    both = torch.nn.ModuleDict({"residual": module, "subs": subs})
    names = [n for n, _ in both.named_parameters() if not n.startswith("subs.weights")]
    emb = torch.randn(*lead, d, dtype=torch.float64, requires_grad=True)

    def f(e, *values):
        with torch.nn.utils.stateless._reparametrize_module(both, dict(zip(names, values))):
            return run(module, subs, e)

    params = dict(both.named_parameters())
    assert gradcheck(f, (emb, *[params[n].detach().clone().requires_grad_() for n in names]), fast_mode=fast)


def test_unfused_and_fused_norm_agree():
    """``defer_norm=False`` (a plain tensor into the norm) and ``True`` (the norm fused into
    the merge) give the same result and gradients."""
    module, subs = make("block", 6, 6, 4)
    emb = torch.randn(2, 3, 6, dtype=torch.float64)
    for a, b in zip(grads(module, subs, emb, True), grads(module, subs, emb, False)):
        assert_rel_close(a, b, 1e-12)


def assert_backends_agree(model, kernels: str, logits_tol: float, grad_tol: float) -> None:
    """``model`` (default backend) and a copy with ``residual.kernels = kernels``: the same
    logits and every gradient of the loss."""
    other = copy.deepcopy(model)
    other.residual.kernels = kernels
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    a, b = model(ids, labels=ids), other(ids, labels=ids)
    assert_rel_close(a.logits, b.logits, logits_tol, "logits")
    for (name, _), ga, gb in zip(model.named_parameters(), torch.autograd.grad(a.loss, list(model.parameters())),
                                 torch.autograd.grad(b.loss, list(other.parameters()))):
        assert_rel_close(ga, gb, grad_tol, f"grad of {name}")


def test_lean_and_graph_paths_agree_at_model_level():
    assert_backends_agree(make_model(residual={"kind": "attnres_block", "block_size": 3}, n_layers=3),
                          "torch_graph", 1e-5, 1e-4)


# ----------------------------------------------------------------------------------------
# Backend selection
# ----------------------------------------------------------------------------------------


def test_backend_selection():
    m = BlockAttnRes(8, 4, 2)
    x = torch.randn(2, 3, 8)
    assert m.backend(x).name == "torch"  # under autograd: the lean path
    assert m.backend(x, record_weights=True).name == "torch_graph"  # recording: the graph path
    with torch.no_grad():
        assert m.backend(x).name == "decoding"
        assert m.backend(torch.randn(2, 4096, 32)).name == "torch_graph"
    assert m.backend(x).cpu_kernel  # "auto" on CPU: its merges and Phase 1 in the C kernel
    m.kernels = "torch"
    assert m.backend(x).name == "torch" and not m.backend(x).cpu_kernel
    m.kernels = "torch_graph"
    assert m.backend(x).name == "torch_graph"
    with pytest.raises(ValueError, match="torch_graph"):
        ModelConfig.preset("tiny", residual={"kind": "attnres_block", "kernels": "bogus"})


def test_backend_under_torch_compile(monkeypatch):
    """Traced by torch.compile, Full AttnRes trains on the plain graph (inductor fuses it and
    picks what to save: measured faster than the lean nodes), Block stays on the lean path."""
    x = torch.randn(2, 3, 8)
    full, block = FullAttnRes(8, 4), BlockAttnRes(8, 4, 2)
    assert full.backend(x).name == block.backend(x).name == "torch"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert full.backend(x).name == "torch_graph"
    assert block.backend(x).name == "torch" and not block.backend(x).cpu_kernel  # ctypes calls do not trace


# ----------------------------------------------------------------------------------------
# What the training path keeps for the backward
# ----------------------------------------------------------------------------------------


def saved_bytes(step) -> int:
    """Bytes of the distinct storages autograd saves for the backward while ``step`` runs
    (parameters included; the same for every variant of one shape)."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


@pytest.mark.parametrize("kind, S", [("attnres_block", 4), ("attnres_full", None)])
def test_lean_path_saves_what_the_math_needs(kind, S):
    """The lean path keeps less than the graph path, and its excess over the standard
    residual is at most the sources the standard residual does not keep (N block sums for
    Block, the L outputs for Full: counted as n_sources * d floats per token) plus 3 % of the
    standard model's saved bytes for the per-token statistics and logits."""
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=4, n_heads=4, mlp_hidden=128, max_seq_len=64)
    ids = torch.randint(0, 64, (4, 32))
    res = {"kind": kind, "block_size": S} if S else {"kind": kind}
    sizes = {}
    for name, r in [("standard", "standard"), ("lean", res), ("graph", {**res, "kernels": "torch_graph"})]:
        torch.manual_seed(0)
        model = AttnResLM(cfg.replace(residual=r))
        sizes[name] = saved_bytes(lambda: model(ids, labels=ids).loss)
    residual = AttnResLM(cfg.replace(residual=res)).residual
    extra_sources = residual.n_blocks if kind == "attnres_block" else residual.n_sublayers
    tokens = ids.numel()
    bound = sizes["standard"] * 1.03 + extra_sources * cfg.d_model * tokens * 4
    assert sizes["lean"] < sizes["graph"]
    assert sizes["lean"] <= bound, (sizes, bound)


# ----------------------------------------------------------------------------------------
# bf16 autocast and activation checkpointing
# ----------------------------------------------------------------------------------------


def test_lean_path_under_bf16_autocast_matches_the_graph_path():
    model = make_model(residual={"kind": "attnres_full"}, n_layers=2)
    graph = copy.deepcopy(model)
    graph.residual.kernels = "torch_graph"
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    outs = []
    for m in (model, graph):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(ids, labels=ids)
        outs.append((out.loss, torch.autograd.grad(out.loss, list(m.parameters()))))
    assert_rel_close(outs[0][0].reshape(1), outs[1][0].reshape(1), 2e-2, "loss")
    for (name, p), ga, gb in zip(model.named_parameters(), outs[0][1], outs[1][1]):
        if name.startswith("residual."):
            assert ga.dtype == p.dtype
        assert_rel_close(ga, gb, 5e-2, f"grad of {name}")


@pytest.mark.parametrize("residual", [{"kind": "attnres_block", "block_size": 3}, {"kind": "attnres_full", "full_group_size": 2}])
@pytest.mark.parametrize("batch_phase1", [False, True])
def test_cpu_kernel_and_pytorch_code_agree_at_model_level(kernel, residual, batch_phase1):
    """The whole model in float64 on the kernel (gradient slots; Phase 1 batched or per
    merge - Full's and Block's defaults, and the other way round) and on the lean path's
    PyTorch code: the same loss and every gradient to rounding."""
    model = make_model(torch.float64, residual=residual, n_layers=3)
    model.residual.BATCH_PHASE1_ON_CPU = batch_phase1
    assert model.residual.backend(torch.randn(2, 3, 8, dtype=torch.float64)).batch_phase1 == batch_phase1
    assert_backends_agree(model, "torch", 1e-13, 1e-12)


@pytest.mark.parametrize("kind", ["attnres_block", "attnres_full"])
def test_activation_checkpointing_gives_the_same_gradients(kind):
    """Checkpointed sublayers recompute the fused merge-and-norm inside them; gradients are
    those of the plain step (nothing counted twice, no gradient slot filled twice)."""
    from torch.utils.checkpoint import checkpoint

    model = make_model(torch.float64, residual={"kind": kind, "block_size": 3}, n_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))

    def ckpt(fn, *args):
        return checkpoint(fn, *args, use_reentrant=False)

    def loss_of(**kw):
        h, _ = model.decode(ids, **kw)
        return (model.lm_head(model.norm(h)).float() ** 2).mean()

    plain = torch.autograd.grad(loss_of(), list(model.parameters()))
    ck = torch.autograd.grad(loss_of(sublayer_call=ckpt), list(model.parameters()))
    for (name, _), a, b in zip(model.named_parameters(), ck, plain):
        assert_rel_close(a, b, 1e-12, f"grad of {name}")


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")
def test_reentrant_checkpointing_is_refused_clearly():
    """A reentrant checkpoint runs the sublayer without autograd and would cut its deferred
    (fused-norm) input off the graph: an error, not silently lost gradients."""
    from torch.utils.checkpoint import checkpoint

    model = make_model(residual={"kind": "attnres_block", "block_size": 3}, n_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        model.decode(ids, sublayer_call=lambda fn, *args: checkpoint(fn, *args, use_reentrant=True))


@pytest.mark.parametrize("partial", [False, True])
def test_keeping_the_norm_input_gives_the_same_gradients(partial):
    """``keep_input=True`` (Full AttnRes: save the norm's input instead of recomputing it)."""
    z, b, qg, w, sources = merge_inputs((2, 3), 5, 3, partial, True)
    inputs = [t for t in (z, b, qg, w, *sources) if t is not None]

    def f(*values):
        it = iter(values)
        zz = next(it)
        bb, qq = (next(it), next(it)) if partial else (None, None)
        ww = next(it)
        return lean_depth_merge(zz, list(it), bb, qq, 1e-6, ww, 1e-5, keep_input=True)

    assert gradcheck(f, tuple(inputs), fast_mode=True)
    a, r = f(*inputs), call(lean_depth_merge, z, b, qg, w, sources)
    up = torch.randn_like(r)
    for x, y in zip(torch.autograd.grad((a * up).sum(), inputs), torch.autograd.grad((r * up).sum(), inputs)):
        assert_rel_close(x, y, 1e-12)
