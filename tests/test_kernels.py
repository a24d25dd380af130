"""Triton kernels against the PyTorch reference, run by Triton's interpreter on CPU.

Every kernel is checked forward and through every gradient, in float32 and bfloat16, over
odd shapes, with and without the fused RMSNorm, and with ``d`` tiled: a forced tile
(``block_d``) smaller than ``d`` and not dividing it, and row-reducing backward programs
forced to cover several rows each (``max_programs``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")  # conftest.py sets TRITON_INTERPRET=1 unless ATTNRES_GPU_TESTS is set

from attnres.kernels import launch  # noqa: E402
from attnres.kernels.merge import merge_sources  # noqa: E402
from attnres.kernels.phase1 import phase1_attention  # noqa: E402
from attnres.kernels.phase2 import phase2_merge  # noqa: E402
from attnres.ops import merge_with_sources, rms_inverse, source_logits, weighted_sum  # noqa: E402

from conftest import GRAD_TOL, OP_TOL_BF16, TOL, assert_fast_matches_naive, assert_rel_close, randomize_residual  # noqa: E402


def op_tol(dtype: torch.dtype) -> float:
    return TOL[torch.float32] if dtype == torch.float32 else OP_TOL_BF16


def reference_norm(h: torch.Tensor, weight: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """What the PyTorch path feeds a sublayer: ``h`` in the stream's dtype, then its RMSNorm
    (:class:`attnres.nn.RMSNorm`: float32 inside); ``h`` itself without a norm."""
    h = h.to(out_dtype)
    if weight is None:
        return h
    return F.rms_norm(h.float(), (h.shape[-1],), weight.float(), 1e-6).to(out_dtype)


def check_grads(out, ref, inputs, names, upstream, tol):
    """Forward, and the gradient of ``sum(out * upstream)`` with respect to every input."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert_rel_close(out.float(), ref.float(), tol, "output")
    grads = torch.autograd.grad((out.float() * upstream).sum(), inputs)
    grads_r = torch.autograd.grad((ref.float() * upstream).sum(), inputs)
    for name, a, b in zip(names, grads, grads_r):
        assert a.dtype == b.dtype, name
        assert_rel_close(a, b, tol, f"grad {name}")


# (lead, d, block_d, max_programs): d = 1, odd d in one tile, d tiled by a tile that does not
# divide it, with backward programs of several rows (7 rows over 3 programs).
SHAPES = [((1,), 1, None, None), ((2, 3), 37, None, None), ((7,), 100, 32, 3), ((2, 5), 64, 16, 4)]


@pytest.mark.parametrize("lead, d, block_d, max_programs", SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [False, True], ids=["merge", "merge+norm"])
def test_phase2_kernel_matches_reference_forward_and_every_gradient(lead, d, block_d, max_programs, x_dtype, with_norm):
    if with_norm and d == 1:
        pytest.skip("RMSNorm of a single channel is sign(h) * gain: no gradient to compare")
    g = torch.Generator().manual_seed(d)
    o_hat = torch.randn(*lead, d, generator=g).requires_grad_()
    m = torch.randn(*lead, generator=g).requires_grad_()
    sumexp = (torch.rand(*lead, generator=g) * 3 + 1).requires_grad_()
    x = (torch.randn(*lead, d, generator=g) * 3).to(x_dtype).requires_grad_()
    qg = torch.randn(d, generator=g).requires_grad_()
    gain = (torch.rand(d, generator=g) + 0.5).requires_grad_() if with_norm else None
    upstream = torch.randn(*lead, d, generator=g)
    inputs = [o_hat, m, sumexp, x, qg] + ([gain] if with_norm else [])

    out, w = phase2_merge(
        o_hat, m, sumexp, x, qg, norm_weight=gain, out_dtype=x_dtype, block_d=block_d, max_programs=max_programs
    )
    h_r, w_r = merge_with_sources(o_hat, m, sumexp, [x], [source_logits(x, rms_inverse(x, 1e-6), qg)])
    assert_rel_close(w, w_r[..., 1].detach(), op_tol(x_dtype), "w")
    names = ["o_hat", "m", "sumexp", "x", "qg", "norm gain"]
    check_grads(out, reference_norm(h_r, gain, x_dtype), inputs, names, upstream, op_tol(x_dtype))


def test_phase2_kernel_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="must match"):
        phase2_merge(torch.zeros(2, 4), torch.zeros(2), torch.ones(2), torch.zeros(2, 5), torch.zeros(4))
    with pytest.raises(ValueError, match="norm_weight must be"):
        phase2_merge(torch.zeros(2, 4), torch.zeros(2), torch.ones(2), torch.zeros(2, 4), torch.zeros(4), norm_weight=torch.ones(3))


@pytest.mark.parametrize(
    "lead, d, k, block_d, max_programs",
    [((1,), 1, 1, None, None), ((2, 3), 37, 3, None, None), ((5,), 64, 2, 16, 2), ((7,), 21, 0, 8, 3)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [False, True], ids=["merge", "merge+norm"])
def test_merge_kernel_matches_reference_forward_and_every_gradient(lead, d, k, block_d, max_programs, dtype, with_norm):
    if with_norm and d == 1:
        pytest.skip("RMSNorm of a single channel is sign(h) * gain: no gradient to compare")
    if k == 0 and not with_norm:
        pytest.skip("k = 0 without a norm is the identity (the model never launches it)")
    g = torch.Generator().manual_seed(d + k)
    o_hat = torch.randn(*lead, d, generator=g).requires_grad_()
    m = torch.randn(*lead, generator=g).requires_grad_()
    sumexp = (torch.rand(*lead, generator=g) * 3 + 1).requires_grad_()
    xs = [(torch.randn(*lead, d, generator=g) * 2).to(dtype).requires_grad_() for _ in range(k)]
    zs = [torch.randn(*lead, generator=g).requires_grad_() for _ in range(k)]
    gain = (torch.rand(d, generator=g) + 0.5).requires_grad_() if with_norm else None
    upstream = torch.randn(*lead, d, generator=g)
    inputs = [o_hat, *xs, *zs] + ([gain] if with_norm else [])

    out, w = merge_sources(
        o_hat, m, sumexp, xs, zs, norm_weight=gain, out_dtype=dtype, block_d=block_d, max_programs=max_programs
    )
    if k:
        inputs += [m, sumexp]  # with k = 0 the output does not depend on the statistics
        h_r, w_r = merge_with_sources(o_hat, m, sumexp, [x.float() for x in xs], zs)
        assert_rel_close(w, w_r.detach(), 1e-5, "w")
    else:
        h_r = o_hat
        assert torch.equal(w, torch.ones(*lead, 1))
    names = ["o_hat"] + [f"x{j}" for j in range(k)] + [f"z{j}" for j in range(k)] + (["norm gain"] if with_norm else []) + ["m", "sumexp"]
    check_grads(out, reference_norm(h_r, gain, dtype), inputs, names, upstream, op_tol(dtype))


@pytest.mark.parametrize(
    "M, S, n, d, block_d",
    [(1, 1, 1, 1, None), (6, 4, 3, 37, None), (5, 3, 5, 64, None), (3, 2, 9, 16, None), (4, 3, 4, 37, 16)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_phase1_attention_kernel_matches_reference(M, S, n, d, block_d, dtype):
    """Outputs and statistics, and gradients through all three (as Phase 2 uses them)."""
    g = torch.Generator().manual_seed(M * 10 + n)
    z = (torch.randn(M, S, n, generator=g) * 2).requires_grad_()
    V = (torch.randn(n, M, d, generator=g) * 2).to(dtype).requires_grad_()
    up_o, up_m, up_l = torch.randn(S, M, d, generator=g), torch.randn(M, S, generator=g), torch.randn(M, S, generator=g)

    def loss(O, m, l):
        return (O * up_o).sum() + (m * up_m).sum() + (l * up_l).sum()

    O, m, l, p = phase1_attention(z, V, block_d=block_d)
    grads = torch.autograd.grad(loss(O, m, l), (z, V))
    m_r = z.amax(dim=-1)
    e = torch.exp(z - m_r.unsqueeze(-1))
    l_r = e.sum(-1)
    p_r = e / l_r.unsqueeze(-1)
    O_r = torch.stack([weighted_sum(p_r[:, s, :], list(V.unbind(0))) for s in range(S)])
    grads_r = torch.autograd.grad(loss(O_r, m_r, l_r), (z, V))
    for name, a, b in (("O", O, O_r), ("m", m, m_r), ("l", l, l_r), ("p", p, p_r)):
        assert_rel_close(a, b.detach(), 1e-5, name)
    for name, a, b in zip(["z", "V"], grads, grads_r):
        assert a.dtype == b.dtype
        assert_rel_close(a, b, op_tol(dtype), f"grad {name}")


def _saved_tensors(fn) -> list[torch.Tensor]:
    """Every tensor autograd saves while ``fn()`` runs."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_kernels_save_sources_by_reference_not_a_stacked_copy():
    """Issue 17's saving policy on the kernel path: Phase 1 and the Phase-2 merge save
    references to their sources (kept anyway) and per-row statistics; the stacked copy the
    kernels read lives only during the forward (the backward rebuilds it)."""
    M, S, n, d = 6, 3, 4, 16
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(M, d, generator=g).requires_grad_() for _ in range(n)]
    z = torch.randn(M, S, n, generator=g).requires_grad_()
    out = {}
    saved = _saved_tensors(lambda: out.update(zip("Omlp", phase1_attention(z, sources))))
    ptrs = {x.data_ptr() for x in sources}
    big = [t for t in saved if t.shape[-1] == d]
    assert len(big) == n and {t.data_ptr() for t in big} == ptrs, [tuple(t.shape) for t in saved]
    assert sum(t.numel() for t in saved if t.data_ptr() not in ptrs) <= 3 * M * S * n  # z, p and the statistics
    # ... and the gradients are those of the stacked call (test_phase1_attention_kernel_matches_reference).
    up = torch.randn(S, M, d, generator=g)
    grads = torch.autograd.grad((out["O"] * up).sum() + out["l"].sum(), [z, *sources])
    V = torch.stack([x.detach() for x in sources]).requires_grad_()
    z2 = z.detach().requires_grad_()
    O2, _, l2, _ = phase1_attention(z2, V)
    grads2 = torch.autograd.grad((O2 * up).sum() + l2.sum(), [z2, V])
    assert torch.equal(grads[0], grads2[0]) and torch.equal(torch.stack(grads[1:]), grads2[1])

    o_hat = torch.randn(M, d, generator=g).requires_grad_()
    m, sumexp = torch.randn(M, generator=g), torch.rand(M, generator=g) + 1
    xs = sources[:2]
    zs = [torch.randn(M, generator=g) for _ in xs]
    saved = _saved_tensors(lambda: merge_sources(o_hat, m, sumexp, xs, zs, norm_weight=torch.ones(d)))
    big = [t for t in saved if t.dim() == 2 and t.shape[-1] == d]
    assert {t.data_ptr() for t in big} <= {o_hat.data_ptr()} | {x.data_ptr() for x in xs}, [tuple(t.shape) for t in saved]


def test_launch_geometry():
    assert launch.tile_d(37) == 64 and launch.tile_d(1) == 1
    assert launch.tile_d(10**6) == launch.MAX_TILE_ELEMENTS  # wide models are tiled
    assert launch.tile_d(10**6, rows=8) == launch.MAX_TILE_ELEMENTS // 8
    assert launch.tile_d(37, block_d=16) == 16 and launch.tile_d(5, block_d=16) == 8
    with pytest.raises(ValueError, match="block_d must be a power of two"):
        launch.tile_d(37, block_d=12)
    for rows, cap in [(1, 4), (7, 3), (1000, 1024), (5000, 1024)]:
        programs, per = launch.row_ranges(rows, cap)
        assert programs <= cap and programs * per >= rows and (programs - 1) * per < rows


@pytest.mark.parametrize(
    "residual, dtype, small_tiles",
    [
        ("attnres_block", torch.float32, True),
        ("attnres_full", torch.float32, False),
        ("attnres_block", torch.bfloat16, False),
        ("attnres_full", torch.bfloat16, False),
    ],
)
def test_model_with_kernels_equals_pytorch_path(residual, dtype, small_tiles, monkeypatch):
    """The whole model with attnres_kernels='triton' (interpreted on CPU) against 'torch':
    logits, depth weights and the gradient of every parameter (the sublayers' norm gains
    included, which the kernels' fused RMSNorm computes), held to the core issue's per-dtype
    acceptance against a float64 run of the PyTorch path (``assert_fast_matches_naive``)."""
    import copy

    from attnres import AttnResLM, ModelConfig
    from attnres.kernels import merge, phase2

    if small_tiles:  # tile d = 36 in 16-wide tiles, backward programs over several rows
        monkeypatch.setattr(launch, "MAX_TILE_ELEMENTS", 16)
        monkeypatch.setattr(launch, "MAX_PROGRAMS", 3)
    fused_calls = []

    def spy_on(fn):
        def spy(*args, **kwargs):
            fused_calls.append(kwargs.get("norm_weight") is not None)
            return fn(*args, **kwargs)

        return spy

    monkeypatch.setattr(phase2, "phase2_merge", spy_on(phase2.phase2_merge))
    monkeypatch.setattr(merge, "merge_sources", spy_on(merge.merge_sources))

    cfg = ModelConfig.preset("tiny", residual={"kind": residual, "block_size": 3}, n_layers=2, d_model=36, n_heads=3,
                             n_kv_heads=3)
    torch.manual_seed(0)
    fast = AttnResLM(cfg.replace(residual={"kernels": "triton"}))
    randomize_residual(fast)
    with torch.no_grad():  # non-trivial norm gains, so that their gradients are tested
        for layer in fast.layers:
            layer.attn_norm.weight.uniform_(0.5, 1.5)
            layer.mlp_norm.weight.uniform_(0.5, 1.5)
    ref = AttnResLM(cfg.replace(residual={"kernels": "torch"}))
    ref.load_state_dict(fast.state_dict())
    fast, ref = fast.to(dtype), ref.to(dtype)
    # The truth runs the parameters as rounded to dtype: what is measured is the rounding of
    # the two computations, not that of the parameters they share.
    truth = copy.deepcopy(ref).double()
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    out_k = fast(ids, labels=ids, return_depth_weights=True)
    out_r = ref(ids, labels=ids, return_depth_weights=True)
    # Every sublayer input came from a fused merge + norm kernel.
    assert fused_calls == [True] * 2 * cfg.n_layers
    out_t = truth(ids, labels=ids, return_depth_weights=True)
    outputs = [out_k.logits, *out_k.depth_weights], [out_r.logits, *out_r.depth_weights], [out_t.logits, *out_t.depth_weights]
    names = ["logits"] + [f"depth weights {i}" for i in range(len(out_k.depth_weights))]
    assert_fast_matches_naive(*outputs, dtype, names, TOL[dtype])
    grads = [torch.autograd.grad(out.loss, list(model.parameters())) for out, model in ((out_k, fast), (out_r, ref), (out_t, truth))]
    names = [f"grad of {name}" for name, _ in fast.named_parameters()]
    assert any("norm.weight" in name for name in names)
    assert_fast_matches_naive(*grads, dtype, names, GRAD_TOL[dtype])


@pytest.mark.compile
@pytest.mark.parametrize("residual", ["attnres_block", pytest.param("attnres_full", marks=pytest.mark.slow)])
def test_torch_compile_traces_around_the_kernels(residual):
    """The kernels are opaque torch.library custom ops: torch.compile runs a model that uses
    them and matches eager, gradients included (Full: a minute of compilation, slow suite)."""
    from attnres import AttnResLM, ModelConfig

    torch._dynamo.reset()
    cfg = ModelConfig.preset("tiny", residual={"kind": residual, "block_size": 3, "kernels": "triton"}, n_layers=2)
    torch.manual_seed(0)
    model = AttnResLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    eager = model(ids, labels=ids)
    ge = torch.autograd.grad(eager.loss, list(model.parameters()))
    compiled = torch.compile(model)(ids, labels=ids)
    gc = torch.autograd.grad(compiled.loss, list(model.parameters()))
    assert_rel_close(compiled.logits, eager.logits, 1e-5)
    for a, b in zip(gc, ge):
        assert_rel_close(a, b, 1e-4)


def test_float16_storage_through_every_kernel():
    """float16 sources (float32 accumulation) through each kernel, tiled, with the norm."""
    test_phase1_attention_kernel_matches_reference(4, 3, 4, 37, 16, torch.float16)
    test_phase2_kernel_matches_reference_forward_and_every_gradient((7,), 100, 32, 3, torch.float16, True)
    test_merge_kernel_matches_reference_forward_and_every_gradient((5,), 64, 2, 16, 2, torch.float16, True)


def test_norm_is_fused_only_where_the_kernels_run():
    """CPU tensors under "auto", the naive schedule, the standard residual and callers that
    do not defer the norm get tensors (the sublayers apply their own norm); the kernels
    with a deferring caller hand the norm a FusableNormInput."""
    from attnres import AttnResLM, ModelConfig
    from attnres.nn.norm import FusableNormInput

    x = torch.zeros(1, 2, 64)
    cfg = ModelConfig.preset("tiny")

    def first_input(config, defer_norm=True):
        residual = AttnResLM(config).residual
        return residual.sublayer_input(residual.start(x, defer_norm=defer_norm), 0)

    assert isinstance(first_input(cfg), torch.Tensor)  # "auto" on CPU
    assert isinstance(first_input(cfg.replace(residual={"kernels": "triton"})), FusableNormInput)
    assert isinstance(first_input(cfg.replace(residual={"kernels": "triton"}), defer_norm=False), torch.Tensor)
    assert isinstance(first_input(cfg.replace(residual={"kernels": "triton", "impl": "naive"})), torch.Tensor)
    assert isinstance(first_input(cfg.replace(residual="standard")), torch.Tensor)
    assert AttnResLM(cfg).residual.backend(x).name == "torch"
    assert AttnResLM(cfg.replace(residual={"kernels": "triton"})).residual.backend(x).name == "triton"


@pytest.mark.parametrize("residual", ["attnres_block", "attnres_full"])
def test_diagnostics_and_norm_hooks_on_the_fused_kernel_path(residual):
    """Regression: with the fused kernels the blocks' pre-norms were never called, so
    ``forward_diagnostics`` failed with ``KeyError: 0``. The norm module now runs the fused
    kernel itself: its hooks fire, and the diagnostics equal the PyTorch path's."""
    from attnres import AttnResLM, ModelConfig
    from attnres.analysis import forward_diagnostics

    cfg = ModelConfig.preset("tiny", residual={"kind": residual, "block_size": 3}, n_layers=2)
    torch.manual_seed(0)
    fused = AttnResLM(cfg.replace(residual={"kernels": "triton"}))
    randomize_residual(fused)
    ref = AttnResLM(cfg.replace(residual={"kernels": "torch"}))
    ref.load_state_dict(fused.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    calls = []
    for layer in fused.layers:
        for norm in (layer.attn_norm, layer.mlp_norm):
            norm.register_forward_hook(lambda m, args, out: calls.append(out.shape))
    fused(ids)
    assert calls == [(2, 6, 64)] * 2 * cfg.n_layers
    got, want = forward_diagnostics(fused, ids), forward_diagnostics(ref, ids)
    for key in ("block_output_rms", "block_input_rms"):
        assert got[key] == pytest.approx(want[key], rel=1e-5)
    for g, w in zip(got["depth_weights"], want["depth_weights"]):
        assert g == pytest.approx(w, rel=1e-5, abs=1e-7)
