"""The pure ops: reference depth attention and the two-phase building blocks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnres.ops import (
    attend_with_stats,
    depth_attention,
    finalize,
    merge_partials,
    merge_with_sources,
    rms_inverse,
    source_logits,
    weighted_sum,
)

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
        ([torch.zeros(2, 4), "x"], "expected a tensor"),
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
    with pytest.raises(ValueError, match="queries must have shape"):
        attend_with_stats(torch.zeros(2, 5), srcs)


# ---------------------------------------------------------------------- two-phase blocks
def _queries(S, d, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, d, generator=g, dtype=torch.float64), torch.rand(S, d, generator=g, dtype=torch.float64) + 0.5


@pytest.mark.parametrize("n", [1, 3])
def test_attend_with_stats_finalized_equals_reference(n):
    Q, G = _queries(4, 9)
    srcs = rand_sources(n, (2, 3, 9))
    part = attend_with_stats(Q, srcs, G)
    assert part.out.shape == (4, 2, 3, 9) and part.max.shape == part.sumexp.shape == (4, 2, 3)
    h = finalize(part)
    for s in range(4):
        assert_rel_close(h[s], depth_attention(Q[s], srcs, G[s]), 1e-12, f"query {s}")


@pytest.mark.parametrize("split", [1, 2, 4])
def test_merge_of_two_groups_equals_attention_over_the_union(split):
    Q, G = _queries(3, 8)
    srcs = rand_sources(5, (4, 8))
    merged = merge_partials(attend_with_stats(Q, srcs[:split], G), attend_with_stats(Q, srcs[split:], G))
    h = finalize(merged)
    for s in range(3):
        assert_rel_close(h[s], depth_attention(Q[s], srcs, G[s]), 1e-12)


def test_merge_is_commutative_and_associative():
    Q, G = _queries(2, 6)
    a, b, c = (attend_with_stats(Q, [s], G) for s in rand_sources(3, (5, 6)))
    ab_c = finalize(merge_partials(merge_partials(a, b), c))
    a_bc = finalize(merge_partials(a, merge_partials(b, c)))
    ba_c = finalize(merge_partials(merge_partials(b, a), c))
    assert_rel_close(a_bc, ab_c, 1e-13)
    assert_rel_close(ba_c, ab_c, 1e-13)


def test_merge_is_stable_for_huge_logits():
    """Online softmax keeps exp() arguments <= 0 whatever the logit magnitude."""
    Q, G = _queries(2, 6)
    srcs = rand_sources(4, (3, 6), dtype=torch.float32)
    Q32 = (Q * 1e4).float()
    h = finalize(merge_partials(attend_with_stats(Q32, srcs[:2], G.float()), attend_with_stats(Q32, srcs[2:], G.float())))
    assert torch.isfinite(h).all()
    for s in range(2):
        assert_rel_close(h[s], depth_attention(Q32[s], srcs, G[s].float()), 1e-5)


@pytest.mark.parametrize("k", [1, 3])
def test_merge_with_sources_equals_reference(k):
    """Fast-path Phase 2: Phase-1 result over the completed sources merged with ``k``
    more sources equals attention over all of them."""
    Q, G = _queries(1, 10)
    q, gain = Q[0], G[0]
    srcs = rand_sources(3 + k, (2, 5, 10))
    done, extra = srcs[:3], srcs[3:]
    part = attend_with_stats(Q, done, G)
    o_hat = finalize(part)[0]
    zs = [source_logits(x, rms_inverse(x, 1e-6), q * gain) for x in extra]
    h, w = merge_with_sources(o_hat, part.max[0], part.sumexp[0], extra, zs)
    ref, ref_w = depth_attention(q, srcs, gain, return_weights=True)
    assert_rel_close(h, ref, 1e-12)
    # w[..., 0] is the total weight of the completed sources, then one weight per extra source.
    assert_rel_close(w[..., 0], ref_w[:3].sum(0), 1e-12)
    assert_rel_close(w[..., 1:].movedim(-1, 0), ref_w[3:], 1e-12)


@pytest.mark.parametrize("k", [2, 4])
def test_merge_with_sources_lse_decoding_path_equals_fused_path(k):
    """Decoding's merge (no autograd, small: softmax over [lse, z_1..z_k], one stacked matmul)
    equals the fused multiply-add path of prefill and training, and both equal the
    max/sum-exp form of :func:`merge_with_sources`."""
    from attnres.ops import merge_with_sources_lse

    Q, G = _queries(1, 10)
    srcs = rand_sources(3 + k, (2, 5, 10))
    done, extra = srcs[:3], srcs[3:]
    part = attend_with_stats(Q, done, G)
    o_hat = finalize(part)[0]
    lse = part.max[0] + torch.log(part.sumexp[0])
    zs = [source_logits(x, rms_inverse(x, 1e-6), Q[0] * G[0]) for x in extra]
    fused_h, fused_w = merge_with_sources_lse(o_hat.requires_grad_(), lse, extra, zs)
    with torch.no_grad():
        dec_h, dec_w = merge_with_sources_lse(o_hat, lse, extra, zs)
    ref_h, ref_w = merge_with_sources(o_hat.detach(), part.max[0], part.sumexp[0], extra, zs)
    assert fused_h.requires_grad and not dec_h.requires_grad  # the two paths did run
    assert_rel_close(dec_h, fused_h.detach(), 1e-12)
    assert_rel_close(dec_w, fused_w.detach(), 1e-12)
    assert_rel_close(ref_h, dec_h, 1e-12)


def test_fast_helpers_match_formulas():
    x = torch.randn(3, 4, 12, dtype=torch.float64)
    r = rms_inverse(x, 1e-6)
    assert_rel_close(r, 1 / torch.sqrt((x * x).mean(-1) + 1e-6), 1e-14)
    qg = torch.randn(5, 12, dtype=torch.float64)
    z = source_logits(x, r, qg)
    assert_rel_close(z, torch.einsum("btd,kd->btk", x * r.unsqueeze(-1), qg), 1e-13)
    assert_rel_close(source_logits(x, r, qg[2]), z[..., 2], 1e-13)
    srcs = rand_sources(4, (3, 4, 12))
    w = torch.rand(3, 4, 4, dtype=torch.float64)
    assert_rel_close(weighted_sum(w, srcs), sum(w[..., j, None] * s for j, s in enumerate(srcs)), 1e-14)


# ------------------------------------------------------------------------------ gradcheck
def test_gradcheck_depth_attention():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    gain = (torch.rand(5, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    srcs = [t.requires_grad_() for t in rand_sources(3, (2, 5))]
    assert torch.autograd.gradcheck(lambda q, gain, *s: depth_attention(q, list(s), gain), (q, gain, *srcs))


def test_gradcheck_attend_with_stats_and_merge():
    Q, G = _queries(2, 4)
    Q.requires_grad_(), G.requires_grad_()
    srcs = [t.requires_grad_() for t in rand_sources(4, (3, 4))]

    def f(Q, G, *s):
        merged = merge_partials(attend_with_stats(Q, list(s[:2]), G), attend_with_stats(Q, list(s[2:]), G))
        return merged.out, merged.max, merged.sumexp, finalize(merged)

    assert torch.autograd.gradcheck(f, (Q, G, *srcs))


def test_gradcheck_fast_phase2_merge():
    Q, G = _queries(1, 4)
    srcs = [t.requires_grad_() for t in rand_sources(4, (3, 4))]
    qg = (Q[0] * G[0]).requires_grad_()

    def f(qg, *s):
        done, extra = list(s[:2]), list(s[2:])
        logits = torch.stack([source_logits(x, rms_inverse(x, 1e-6), qg) for x in done], -1)
        m = logits.amax(-1)
        e = torch.exp(logits - m.unsqueeze(-1))
        o_hat = weighted_sum(e / e.sum(-1, keepdim=True), done)
        zs = [source_logits(x, rms_inverse(x, 1e-6), qg) for x in extra]
        return merge_with_sources(o_hat, m, e.sum(-1), extra, zs)

    assert torch.autograd.gradcheck(f, (qg, *srcs))


# ------------------------------------------------------------------------------- property
@settings(max_examples=40, deadline=None)
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
    part = attend_with_stats(q[None], srcs[:k], gain[None])
    if k < n:
        part = merge_partials(part, attend_with_stats(q[None], srcs[k:], gain[None]))
    assert_rel_close(finalize(part)[0], ref, 1e-11)
    assert math.isfinite(out.abs().max().item())


@pytest.mark.parametrize("shape", [(1, 1, 7), (2, 3, 5), (1, 1, 1)])
def test_weighted_sums_small_path_equals_per_source_passes(shape, monkeypatch):
    """Decoding's stacked-matmul path (small sources, no autograd) gives what the per-source
    multiply-add passes give."""
    from attnres.ops import two_phase

    g = torch.Generator().manual_seed(0)
    n, K = 4, 3
    sources = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(n)]
    weights = torch.softmax(torch.randn(*shape[:-1], K, n, generator=g, dtype=torch.float64), -1)
    expected = [two_phase.weighted_sum(weights[..., k, :], sources) for k in range(K)]
    monkeypatch.setattr(two_phase, "weighted_sum", None)  # the small path must not use it
    with torch.no_grad():
        small = two_phase.weighted_sums(weights, sources)
    assert len(small) == K
    for a, b in zip(small, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("K", [None, 1, 5])
def test_rms_logits_small_path_equals_rms_factor_path(K):
    """Decoding's RMSNorm-then-product logits (small sources, no autograd) equal the logits
    from the RMS factor (the path of prefill and training)."""
    from attnres.ops import rms_inverse, rms_logits, source_logits

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, generator=g, dtype=torch.float64) * 3
    qg = torch.randn(7, generator=g, dtype=torch.float64) if K is None else torch.randn(K, 7, generator=g, dtype=torch.float64)
    expected = source_logits(x, rms_inverse(x, 1e-6), qg)
    with torch.no_grad():
        small = rms_logits(x, qg, 1e-6)
    assert small.shape == expected.shape
    torch.testing.assert_close(small, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lead", [(1,), (3, 2)])
def test_merge_partial_sum_equals_logit_then_merge(lead):
    """Block decoding's one-go Phase 2 equals :func:`rms_logits` then
    :func:`merge_with_one_source`, including for logits far from the Phase-1 log-sum-exp."""
    from attnres.ops import merge_partial_sum, merge_with_one_source, rms_logits

    g = torch.Generator().manual_seed(3)
    d = 11
    o_hat = torch.randn(*lead, d, generator=g, dtype=torch.float64)
    x = torch.randn(*lead, d, generator=g, dtype=torch.float64) * 5
    qg = torch.randn(d, generator=g, dtype=torch.float64)
    for lse in (torch.randn(lead, generator=g, dtype=torch.float64), torch.full(lead, 80.0, dtype=torch.float64)):
        expected, _ = merge_with_one_source(o_hat, lse, x, rms_logits(x, qg, 1e-6))
        with torch.no_grad():
            got = merge_partial_sum(o_hat, lse, x, qg, 1e-6)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
