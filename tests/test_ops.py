"""The pure ops: reference depth attention, and the two-phase schedule's reformulation of it
(Phase 1's log-sum-exp merged as a source's logit) through the three operations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from attnres.ops import OPERATIONS, depth_attention

from conftest import OP_TOL_BF16, assert_rel_close


def formula_float64(query, sources, gain=None, eps=1e-6, scale=1.0):
    """The report §3.1 formula, evaluated independently in float64 with Python loops over the
    sources and explicit sums over the hidden dimension (no use of the package)."""
    q = query.double()
    g = torch.ones_like(q) if gain is None else gain.double()
    vals = [s.double() for s in sources]
    d = q.shape[0]
    logits = []
    for v in vals:
        rms = torch.sqrt((v * v).sum(-1) / d + eps)
        logits.append(scale * ((v / rms.unsqueeze(-1)) * g * q).sum(-1))
    mx = logits[0]
    for z in logits[1:]:
        mx = torch.maximum(mx, z)
    exps = [torch.exp(z - mx) for z in logits]
    total = sum(exps)
    weights = [e / total for e in exps]
    out = sum(w.unsqueeze(-1) * v for w, v in zip(weights, vals))
    return out, torch.stack(weights)


def rand_sources(n, shape, dtype=torch.float64, seed=0, spread=True):
    g = torch.Generator().manual_seed(seed)
    # Different magnitudes per source, as block sums have (the RMSNorm must handle them).
    return [
        (torch.randn(shape, generator=g, dtype=torch.float64) * (1 + 3 * i if spread else 1)).to(dtype)
        for i in range(n)
    ]


# --------------------------------------------------------------------------- reference op
@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("shape", [(7,), (3, 7), (2, 3, 7)])
def test_depth_attention_matches_independent_formula(n, shape):
    d = shape[-1]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(d, generator=g, dtype=torch.float64)
    gain = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    srcs = rand_sources(n, shape)
    out, w = depth_attention(q, srcs, gain, return_weights=True)
    ref_out, ref_w = formula_float64(q, srcs, gain)
    assert_rel_close(out, ref_out, 1e-12, "output")
    assert_rel_close(w, ref_w, 1e-12, "weights")
    assert w.shape == (n, *shape[:-1])


def test_depth_attention_scale_and_eps_follow_formula():
    q = torch.randn(5, dtype=torch.float64)
    srcs = rand_sources(3, (4, 5))
    out = depth_attention(q, srcs, eps=0.3, scale=0.25)
    assert_rel_close(out, formula_float64(q, srcs, eps=0.3, scale=0.25)[0], 1e-12)


def test_zero_query_gives_exactly_uniform_weights():
    srcs = rand_sources(6, (2, 3, 8), dtype=torch.float32)
    out, w = depth_attention(torch.zeros(8), srcs, torch.rand(8) + 0.5, return_weights=True)
    assert torch.equal(w, torch.full_like(w, 1 / 6))


def test_single_source_is_returned_exactly():
    (x,) = rand_sources(1, (3, 4, 16), dtype=torch.float32)
    assert torch.equal(depth_attention(torch.randn(16), [x], torch.rand(16)), x)


def test_values_are_raw_and_keys_normalised():
    """Scaling one source changes neither its key (RMSNorm) nor the weights, but the output
    mixes the raw, scaled value."""
    q = torch.randn(6, dtype=torch.float64)
    a, b = rand_sources(2, (4, 6))
    out2, w2 = depth_attention(q, [a, 10 * b], return_weights=True, eps=0.0)
    _, w1 = depth_attention(q, [a, b], return_weights=True, eps=0.0)
    assert_rel_close(w2, w1, 1e-12)
    assert_rel_close(out2, w1[0, :, None] * a + w1[1, :, None] * 10 * b, 1e-12)


def test_bf16_output_dtype_and_fp32_weights():
    srcs = rand_sources(4, (3, 5, 32), dtype=torch.bfloat16)
    q = torch.randn(32, dtype=torch.bfloat16)
    out, w = depth_attention(q, srcs, return_weights=True)
    assert out.dtype == torch.bfloat16 and w.dtype == torch.float32
    ref, _ = formula_float64(q, srcs)
    assert_rel_close(out, ref, OP_TOL_BF16)


def test_autocast_does_not_lower_depth_attention_precision():
    srcs = rand_sources(4, (3, 5, 32), dtype=torch.float32)
    q = torch.randn(32)
    plain = depth_attention(q, srcs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = depth_attention(q, srcs)
    assert under.dtype == torch.float32
    assert_rel_close(under, plain, 1e-6)


@pytest.mark.parametrize(
    "bad, match",
    [
        ([], "non-empty"),
        ([torch.zeros(2, 4), torch.zeros(3, 4)], "same shape"),
        ([torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.float64)], "same dtype"),
        (torch.zeros(2, 2, 4), "list or tuple"),
        # (a stacked tensor and a generator were named by their type alone, "got Tensor")
        (torch.zeros(3, 2, 4), r"got a tensor of shape \(3, 2, 4\): for sources stacked along dim 0 pass "
                               r"list\(sources\.unbind\(0\)\); for one source, \[source\]"),
        ((torch.zeros(2, 4) for _ in range(2)), r"got generator: pass list\(\.\.\.\) of it"),
        ([torch.zeros(2, 4), "x"], "expected a tensor"),
        ([torch.zeros(2, 4, dtype=torch.long)] * 2, "floating-point"),  # (it returned truncated integers)
    ],
)
def test_bad_sources_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        depth_attention(torch.zeros(4), bad)


def test_bad_query_or_gain_shape_raises():
    srcs = rand_sources(2, (3, 4), dtype=torch.float32)
    with pytest.raises(ValueError, match="query must have shape"):
        depth_attention(torch.zeros(5), srcs)
    with pytest.raises(ValueError, match="key_norm_weight must have shape"):
        depth_attention(torch.zeros(4), srcs, torch.ones(3))
    with pytest.raises(ValueError, match="query is on meta but the sources are on cpu"):
        depth_attention(torch.zeros(4, device="meta"), srcs)
    for kwargs, match in [({"eps": -1.0}, "eps must be a number >= 0"), ({"eps": float("inf")}, "eps must be"),
                          ({"scale": float("nan")}, "scale must be a finite number")]:
        with pytest.raises(ValueError, match=match):  # (NaN weights, with no word of why)
            depth_attention(torch.zeros(4), srcs, **kwargs)
    with pytest.raises(ValueError, match=r"query must have shape \(4,\) .*got NoneType"):
        depth_attention(None, srcs)  # (was an AttributeError: 'NoneType' object has no attribute 'to')


@pytest.mark.parametrize("ops", ["reference", "auto", "torch"])
def test_the_operations_refuse_a_negative_eps_and_logits_of_another_dtype(ops):
    """A negative or NaN RMS epsilon gave NaN sums and weights with no word of why (only
    ``depth_attention`` checked it); logits ``z`` of another dtype than the compute dtype
    reached the C kernel, which refused them naming itself (``attnres_merge_forward``), while
    the reference took them: every backend now refuses them at the boundary, saying the fix."""
    ops = OPERATIONS[ops]
    srcs = rand_sources(3, (2, 4), dtype=torch.float32)
    qg, z = torch.randn(2, 4), torch.zeros(2, 1)
    for eps in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="eps must be a number >= 0"):
            ops.phase1(qg, srcs, eps)
        with pytest.raises(ValueError, match="eps must be a number >= 0"):
            ops.merge(z, srcs[:1], srcs[1:], qg[0], eps)
        with pytest.raises(ValueError, match="norm_eps must be a number >= 0"):
            ops.merge(z, srcs[:1], srcs[1:], qg[0], norm_weight=torch.ones(4), norm_eps=eps)
    for dtype in (torch.float16, torch.float64, torch.long):
        with pytest.raises(ValueError, match=rf"z must be in the compute dtype torch.float32 .*got {dtype}: pass "
                                             r"z.to\(torch.float32\)"):
            ops.merge(z.to(dtype), srcs[:1], srcs[1:], qg[0])
    assert torch.isfinite(ops.merge(z, srcs[:1], srcs[1:], qg[0], 0.0)[0]).all()  # (eps = 0 stays allowed)


@pytest.mark.parametrize("ops", ["reference", "auto", "torch"])
def test_depth_attention_and_the_operations_run_on_meta_tensors(ops):
    """Shape inference on the ``meta`` device (a model built under ``torch.device("meta")``):
    asking meta tensors for their autocast state raised 'unknown device type for autocast'
    (the operations) and 'unsupported scalarType' (``depth_attention``)."""
    srcs = [torch.empty(2, 3, 8, device="meta") for _ in range(3)]
    q = torch.empty(8, device="meta")
    out, w = depth_attention(q, srcs, return_weights=True)
    assert (out.shape, out.device.type, w.shape) == ((2, 3, 8), "meta", (3, 2, 3))
    outs, lse = OPERATIONS[ops].phase1(torch.empty(2, 8, device="meta"), srcs)
    assert [o.shape for o in outs] == [(2, 3, 8)] * 2 and lse.shape == (2, 3, 2)
    h, alpha = OPERATIONS[ops].merge(lse[..., :1], outs[:1], srcs[:1], q, norm_weight=torch.empty(8, device="meta"))
    assert (h.shape, alpha.shape, h.device.type) == ((2, 3, 8), (2, 3, 2), "meta")


# --------------------------------------------------------------- the two-phase reformulation
def _queries(S, d, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, d, generator=g, dtype=torch.float64), torch.rand(S, d, generator=g, dtype=torch.float64) + 0.5


def two_phase(ops, Q, G, srcs, split):
    """Every query of ``Q`` (gains ``G``) over ``srcs`` the two-phase way: Phase 1 over the
    first ``split`` sources, then each query's merge of Phase 1's weighted sum (logit: its
    log-sum-exp) with the other sources, whose logits the merge computes."""
    qg = Q * G
    outs, lse = ops.phase1(qg, srcs[:split])
    return [ops.merge(lse[..., s : s + 1], [outs[s]], srcs[split:], qg[s])[0] for s in range(Q.shape[0])]


@pytest.mark.parametrize("ops", ["reference", "auto", "torch"])
@pytest.mark.parametrize("split", [1, 2, 5])
def test_phase1_then_merge_equals_attention_over_all_sources(split, ops):
    """Report §4.2: the two-phase computation is exact up to rounding."""
    Q, G = _queries(3, 8)
    srcs = rand_sources(5, (4, 8))
    for s, h in enumerate(two_phase(OPERATIONS[ops], Q, G, srcs, split)):
        assert_rel_close(h, depth_attention(Q[s], srcs, G[s]), 1e-12)


def test_two_phase_is_stable_for_huge_logits():
    """The softmax keeps exp() arguments <= 0 whatever the logit magnitude."""
    Q, G = _queries(2, 6)
    srcs = rand_sources(4, (3, 6), dtype=torch.float32)
    Q32 = (Q * 1e4).float()
    for ops in ("reference", "auto"):
        for s, h in enumerate(two_phase(OPERATIONS[ops], Q32, G.float(), srcs, 2)):
            assert torch.isfinite(h).all()
            assert_rel_close(h, depth_attention(Q32[s], srcs, G[s].float()), 1e-5)


# ------------------------------------------------------------------------------ gradcheck
def test_gradcheck_depth_attention():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    gain = (torch.rand(5, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    srcs = [t.requires_grad_() for t in rand_sources(3, (2, 5))]
    assert torch.autograd.gradcheck(lambda q, gain, *s: depth_attention(q, list(s), gain), (q, gain, *srcs))


# ------------------------------------------------------------------------------- property
@settings(max_examples=examples(40))
@given(
    n=st.integers(1, 6),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    d=st.integers(1, 9),
    split=st.integers(0, 6),
    seed=st.integers(0, 2**16),
)
def test_property_shapes_reference_and_two_phase(n, lead, d, split, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (*lead, d)
    srcs = [torch.randn(shape, generator=g, dtype=torch.float64) * (i + 1) for i in range(n)]
    q = torch.randn(d, generator=g, dtype=torch.float64)
    gain = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    out, w = depth_attention(q, srcs, gain, return_weights=True)
    ref, ref_w = formula_float64(q, srcs, gain)
    assert out.shape == shape and w.shape == (n, *lead)
    assert_rel_close(out, ref, 1e-11)
    assert_rel_close(w.sum(0), torch.ones_like(w[0]), 1e-14)
    k = min(max(split, 1), n)
    assert_rel_close(two_phase(OPERATIONS["reference"], q[None], gain[None], srcs, k)[0], ref, 1e-11)
    assert math.isfinite(out.abs().max().item())
