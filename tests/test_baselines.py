"""Residual baselines: each starts as its paper says and keeps its defining properties."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from attnres import AttnResLM, ModelConfig
from attnres.nn.residual import (
    MHC,
    DenseFormer,
    Highway,
    HyperConnections,
    LayerScale,
    MHCLite,
    ReZero,
    registered_residuals,
    residual_class,
    sinkhorn_knopp,
)
from attnres.nn.residual.baselines import OneLineParameterList, layerscale_init

# The package's own baselines (other test modules register variants of their own).
BASELINES = tuple(n for n in registered_residuals()
                  if residual_class(n).__module__ == "attnres.nn.residual.baselines")

from conftest import assert_rel_close


def model_pair(residual: str | dict, **overrides):
    """(baseline model, standard model with the same shared weights)."""
    cfg = ModelConfig.preset("tiny", residual=residual, **overrides)
    torch.manual_seed(0)
    model = AttnResLM(cfg)
    standard = AttnResLM(cfg.replace(residual="standard"))
    standard.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("residual.")})
    return model, standard


@pytest.mark.parametrize("residual", BASELINES)
def test_every_baseline_gradient_is_the_losss_derivative(residual):
    """Each parameter tensor's gradient, along a random direction, equals the loss's central
    difference (float64), away from the init (at init mHC's projections are zero, so its gains
    get no gradient at all). A parameter cut from the graph in one of its uses (a stray
    ``.detach()``) still gets a finite gradient, only not the derivative. (``gradcheck``'s
    absolute 1e-5 is about the size of these gradients: it passed mHC's detached res gain.)"""
    assert len(BASELINES) == 7
    cfg = ModelConfig(vocab_size=11, d_model=8, n_layers=2, n_heads=2, mlp_hidden=12, max_seq_len=8,
                      residual={"kind": residual, "hc_streams": 3, "sinkhorn_iters": 4})
    torch.manual_seed(0)
    model = AttnResLM(cfg).double()
    with torch.no_grad():
        for p in model.residual.parameters():
            p.add_(0.5 * torch.randn_like(p))
    ids = torch.randint(0, 11, (2, 4))
    model(ids, labels=ids).loss.backward()
    g, eps, checked = torch.Generator().manual_seed(1), 1e-5, 0
    for name, p in model.residual.named_parameters():
        u = torch.randn(p.shape, generator=g, dtype=p.dtype)
        with torch.no_grad():
            p.add_(eps * u)
            up = model(ids, labels=ids).loss.item()
            p.sub_(2 * eps * u)
            down = model(ids, labels=ids).loss.item()
            p.add_(eps * u)
        numeric, analytic = (up - down) / (2 * eps), (p.grad * u).sum().item()
        assert abs(analytic - numeric) <= 1e-5 * abs(numeric) + 1e-10, (name, analytic, numeric)
        checked += 1
    assert checked == len(list(model.residual.parameters())) > 0


def test_denseformer_starts_as_the_standard_model_exactly():
    model, standard = model_pair("denseformer")
    ids = torch.randint(0, 256, (2, 7))
    assert torch.equal(model(ids).logits, standard(ids).logits)


@pytest.mark.parametrize("residual", ["hyper_connections", "mhc", "mhc_lite"])
def test_multistream_baselines_start_as_the_standard_model(residual):
    """Streams start as copies of the embedding and every static mapping preserves equal
    streams, so each stream is the standard residual stream; the output sums the m streams
    and the final RMSNorm removes the factor m (exactly, up to its eps: tiny here)."""
    model, standard = model_pair(residual, norm_eps=1e-12)
    ids = torch.randint(0, 256, (2, 7))
    assert_rel_close(model(ids).logits, standard(ids).logits, 1e-5)


def test_rezero_starts_as_the_identity():
    model, _ = model_pair("rezero")
    ids = torch.randint(0, 256, (2, 5))
    expected = model.lm_head(model.norm(model.embed_tokens(ids)))
    assert torch.equal(model(ids).logits, expected)


def test_layerscale_init_follows_cait():
    assert (layerscale_init(12), layerscale_init(18), layerscale_init(24), layerscale_init(36)) == (0.1, 0.1, 1e-5, 1e-6)
    m = LayerScale(8, 40)
    assert all(torch.equal(s, torch.full((8,), 1e-5)) for s in m.scales)


def test_highway_gate_starts_carry_biased_and_mixes_convexly():
    m = Highway(6, 2)
    assert all(torch.equal(g.bias, torch.full((6,), -1.0)) for g in m.gates)
    h, out = torch.randn(3, 6), torch.randn(3, 6)
    new = m.update(0, h, out)
    g = torch.sigmoid(m.gates[0](h))
    assert_rel_close(new, (1 - g) * h + g * out, 1e-6)


def test_sinkhorn_is_doubly_stochastic():
    """Rows are normalised last, so they sum to 1 up to rounding; columns converge with the
    iterations (20 is mHC's practical choice: within a few percent for unit-scale logits)."""
    logits = torch.randn(50, 4, 4, generator=torch.Generator().manual_seed(0))
    for iters, col_tol in ((20, 2e-2), (500, 1e-5)):
        M = sinkhorn_knopp(logits, iters)
        assert (M >= 0).all()
        assert torch.allclose(M.sum(-1), torch.ones(50, 4), atol=1e-6)
        assert (M.sum(-2) - 1).abs().max() <= col_tol


def test_mhc_mixing_matrices_doubly_stochastic_and_lite_exact():
    g = torch.Generator().manual_seed(0)
    for cls, col_tol in ((MHC, 2e-2), (MHCLite, 1e-6)):
        m = cls(8, 4, n_streams=4)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        H = torch.randn(2, 3, 4, 8, generator=g)
        pre, post, res = m._mappings(1, H)
        assert res.shape == (2, 3, 4, 4) and (res >= 0).all()
        assert torch.allclose(res.sum(-1), torch.ones(2, 3, 4), atol=1e-6)
        assert torch.allclose(res.sum(-2), torch.ones(2, 3, 4), atol=col_tol)
        assert ((pre > 0) & (pre < 1)).all() and ((post > 0) & (post < 2)).all()


def test_mhc_lite_enumerates_all_permutations():
    m = MHCLite(4, 2, n_streams=3)
    P = m.permutation_matrices(torch.device("cpu"), torch.float32)
    assert P.shape == (6, 3, 3)
    assert torch.equal(P.sum(-1), torch.ones(6, 3)) and torch.equal(P.sum(-2), torch.ones(6, 3))
    assert len({tuple(p.flatten().tolist()) for p in P}) == 6


def test_mhc_lite_kept_permutations_are_not_read_under_a_fake_tensor_mode():
    """mHC-lite keeps its permutation index per device after a forward; under a
    ``FakeTensorMode`` (a shape survey, a memory estimate: fake weights of a model that ran
    before) the kept real index met the fake matrices - "Please convert all Tensors to
    FakeTensors first". Under the mode the index is made for the call, fake, and not kept."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    m = MHCLite(4, 2, n_streams=3)
    logits = torch.randn(2, 6)
    real = m.residual_matrix(logits)  # (keeps the CPU index)
    mode = FakeTensorMode()
    fake = mode.from_tensor(logits)
    with mode:
        out = m.residual_matrix(fake)
    assert isinstance(out, FakeTensor) and out.shape == real.shape
    kept = m.__dict__["_permutation_indices"]
    assert list(kept) == [torch.device("cpu")] and not isinstance(kept[torch.device("cpu")], FakeTensor)
    assert torch.equal(m.residual_matrix(logits), real)


def test_mhc_lite_kept_permutations_are_not_pickled():
    """The kept index is keyed by the device it was made on; pickled with the module and loaded
    with ``map_location="cpu"``, a CUDA model's would be a CPU tensor under ``cuda:0`` (a copy
    at every forward once moved back, a refused CUDA graph capture). Pickles and deep copies
    leave it out; the copy makes its own at its first forward, with the same matrices."""
    import copy
    import io
    import pickle

    m = MHCLite(4, 2, n_streams=3)
    logits = torch.randn(2, 6)
    real = m.residual_matrix(logits)
    assert "_permutation_indices" in m.__dict__
    buffer = io.BytesIO()
    torch.save(m, buffer)
    buffer.seek(0)
    for other in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m), torch.load(buffer, weights_only=False)):
        assert "_permutation_indices" not in other.__dict__
        assert torch.equal(other.residual_matrix(logits), real)
    assert "_permutation_indices" in m.__dict__  # (the original keeps its own)


def test_hyper_connections_static_init_is_pre_norm():
    m = HyperConnections(8, 6, n_streams=4)
    H = torch.randn(2, 4, 8)
    pre, post, res = m._mappings(5, H)
    assert torch.equal(pre, torch.eye(4)[1].expand(2, 4))  # A_m = e_{5 mod 4}
    assert torch.equal(post, torch.ones(2, 4))  # B = 1
    assert torch.equal(res, torch.eye(4).expand(2, 4, 4))  # A_r = I


def test_baseline_zero_init_survives_model_init():
    model, _ = model_pair("rezero")
    model.init_weights()
    assert torch.equal(model.residual.alpha, torch.zeros_like(model.residual.alpha))
    dense = copy.deepcopy(model_pair("denseformer")[0])
    assert all(w[-1] == 1 and (w[:-1] == 0).all() for w in dense.residual.dwa)


def test_bad_stream_count():
    with pytest.raises(ValueError, match="ModelConfig.residual.hc_streams"):
        ModelConfig.preset("tiny", residual={"kind": "mhc_lite", "hc_streams": 7})
    with pytest.raises(ValueError, match="n_streams must be >= 1"):
        MHC(4, 2, n_streams=0)
    assert isinstance(AttnResLM(ModelConfig.preset("tiny", residual="denseformer")).residual, DenseFormer)
    assert isinstance(AttnResLM(ModelConfig.preset("tiny", residual="rezero")).residual, ReZero)


# ------------------------------------------------------------------ Table-4 ablations
from attnres.ops import depth_attention  # noqa: E402
from attnres.ops.depth_attention.ablations import depth_attention_variant  # noqa: E402


def _ablation_model(residual="attnres_full", **ablation):
    cfg = ModelConfig.preset("tiny", residual={"kind": residual, "schedule": "naive", "ablation": ablation}, n_layers=3)
    torch.manual_seed(0)
    return AttnResLM(cfg)


def test_multihead_with_one_head_equals_single_head():
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(2, 3, 8, generator=g) * (i + 1) for i in range(4)]
    q, gain = torch.randn(8, generator=g), torch.rand(8, generator=g) + 0.5
    ref, w = depth_attention(q, srcs, gain, return_weights=True)
    out, wh = depth_attention_variant(q, srcs, gain, heads=1, return_weights=True)
    assert_rel_close(out, ref, 1e-6)
    assert_rel_close(wh[..., 0], w, 1e-6)
    out4, w4 = depth_attention_variant(q, srcs, gain, heads=4, return_weights=True)
    assert w4.shape == (4, 2, 3, 4) and torch.allclose(w4.sum(0), torch.ones(2, 3, 4))


def test_sigmoid_weights_are_not_normalised():
    model = _ablation_model(sigmoid_weights=True)
    w = model(torch.randint(0, 256, (1, 4)), return_depth_weights=True).depth_weights
    # Zero queries: every weight is sigmoid(0) = 1/2, so n sources sum to n/2, not 1.
    for x in w:
        assert torch.equal(x, torch.full_like(x, 0.5))
    assert any(x.sum(0).max() > 1 for x in w)



def test_forward_diagnostics_of_sigmoid_weights_runs():
    """The training loop's diagnostics (``forward_diagnostics``, every ``diag_every`` steps) of
    the Table 4 ablation ``sigmoid_weights`` (the ``full+sigmoid`` experiment preset): its
    weights do not sum to 1, and ``depth_entropy`` refuses such weights, so the run failed at
    its first diagnostics step. They are logged as before, by the same sum over the sources,
    while ``depth_entropy`` itself still refuses them."""
    from attnres.analysis import depth_entropy, forward_diagnostics

    model = _ablation_model(sigmoid_weights=True)
    logged = forward_diagnostics(model, torch.randint(0, 256, (1, 4)))["depth_entropy"]
    # (zero queries: each of n sources weighs 1/2, -n * 1/2 * log(1/2))
    assert logged == pytest.approx([n / 2 * math.log(2) for n in [1, 2, 3, 4, 5, 6, 7]])
    with pytest.raises(ValueError, match="summing to 1 over the sources"):
        depth_entropy(torch.full((3, 1, 4), 0.5))

def test_sliding_window_sees_exactly_its_window():
    model = _ablation_model(window=2)
    w = model(torch.randint(0, 256, (1, 4)), return_depth_weights=True).depth_weights
    assert [x.shape[0] for x in w] == [1, 2, 3, 3, 3, 3, 3]
    # The window is the embedding plus the 2 most recent outputs: an older output has no
    # influence on sublayer 5's input.
    mixer = model.residual.mixers[5]
    srcs = [torch.randn(1, 2, 64) for _ in range(6)]
    changed = list(srcs)
    changed[2] = changed[2] + 10
    assert torch.equal(mixer.attend(model.residual.windowed(srcs)), mixer.attend(model.residual.windowed(changed)))
    assert model.residual.windowed(srcs) == [srcs[0], srcs[4], srcs[5]]


def test_input_independent_mixing_and_input_dependent_query_start_as_attnres():
    ids = torch.randint(0, 256, (2, 5))
    base = _ablation_model()
    for ablation in (dict(input_independent_mixing=True), dict(input_dependent_query=True), dict(key_norm=False)):
        model = _ablation_model(**ablation)
        model.load_state_dict(base.state_dict(), strict=False)
        # Zero queries / zero projections / zero logits: uniform weights, as AttnRes at init.
        assert_rel_close(model(ids).logits, base(ids).logits, 1e-6)
    model = _ablation_model(input_independent_mixing=True)
    assert [m.mixing_logits.numel() for m in model.residual.mixers] == model.residual.sources_per_mixer()


def test_ablation_validation():
    with pytest.raises(ValueError, match="ModelConfig.residual.schedule must be 'naive'"):
        ModelConfig.preset("tiny", residual={"ablation": {"sigmoid_weights": True}})
    with pytest.raises(ValueError, match="ModelConfig.residual.ablation.window must be None unless"):
        ModelConfig.preset("tiny", residual={"kind": "attnres_block", "schedule": "naive", "ablation": {"window": 2}})
    with pytest.raises(ValueError, match="ModelConfig.residual.ablation.heads must be a divisor"):
        ModelConfig.preset("tiny", residual={"schedule": "naive", "ablation": {"heads": 5}})
    with pytest.raises(ValueError, match="exclude each other"):
        ModelConfig.preset("tiny", residual={"schedule": "naive", "ablation": {"input_dependent_query": True,
                                                                             "input_independent_mixing": True}})
    with pytest.raises(ValueError, match="ablation applies to AttnRes variants"):
        ModelConfig.preset("tiny", residual={"kind": "rezero", "ablation": {"key_norm": False}})
    with pytest.raises(ValueError, match=r"unknown ModelConfig.residual.ablation key\(s\) \['keynorm'\] "
                       r"\(did you mean 'key_norm' for 'keynorm'\?\)"):
        ModelConfig.preset("tiny", residual={"ablation": {"keynorm": False}})
    srcs = [torch.randn(2, 8) for _ in range(3)]
    with pytest.raises(ValueError, match=r"weighting must be one of \('softmax', 'sigmoid'\), got 'sigmod' "
                       r"\(did you mean 'sigmoid'\?\)"):
        depth_attention_variant(torch.zeros(8), srcs, torch.ones(8), weighting="sigmod")


def test_multistream_routing_follows_a_float64_model():
    """Regression: HC / mHC / mHC-lite routing and Sinkhorn ran in float32 in float64 models.
    Their mappings now match an independent float64 evaluation to 1e-10."""
    g = torch.Generator().manual_seed(0)
    H = torch.randn(3, 4, 4, 8, generator=g, dtype=torch.float64)  # [B, T, m, d]
    mhc = MHC(8, 3, n_streams=4, sinkhorn_iters=7).double()
    with torch.no_grad():
        for p in mhc.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    pre, post, res = mhc._mappings(1, H)
    flat = H.reshape(3, 4, 32)
    x = flat / torch.sqrt((flat * flat).mean(-1, keepdim=True) + mhc.eps)
    z = x @ mhc.phi[1].detach()
    a, b = mhc.alpha[1].detach(), mhc.bias[1].detach()
    assert_rel_close(pre, torch.sigmoid(a[0] * z[..., :4] + b[:4]), 1e-12)
    assert_rel_close(post, 2 * torch.sigmoid(a[1] * z[..., 4:8] + b[4:8]), 1e-12)
    m = torch.exp(a[2] * z[..., 8:] + b[8:]).reshape(3, 4, 4, 4)
    for _ in range(7):  # plain Sinkhorn-Knopp: columns, then rows
        m = m / m.sum(-2, keepdim=True)
        m = m / m.sum(-1, keepdim=True)
    assert res.dtype == torch.float64
    assert_rel_close(res, m, 1e-10)

    hc = HyperConnections(8, 3, n_streams=4).double()
    with torch.no_grad():
        for p in hc.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    pre, beta, res = hc._mappings(2, H)
    Hn = H / torch.sqrt((H * H).mean(-1, keepdim=True) + hc.eps) * hc.norm_weight[2].detach()
    alpha = hc.static_alpha[2].detach() + hc.alpha_scale[2].detach() * torch.tanh(Hn @ hc.dynamic_alpha[2].detach())
    assert_rel_close(pre, alpha[..., 0], 1e-12)
    assert_rel_close(res, alpha[..., 1:].transpose(-1, -2), 1e-12)

    lite = MHCLite(8, 3, n_streams=3).double()
    logits = torch.randn(5, 6, generator=g, dtype=torch.float64)
    w = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
    import itertools

    perms = torch.stack([torch.eye(3, dtype=torch.float64)[list(p)] for p in itertools.permutations(range(3))])
    assert_rel_close(lite.residual_matrix(logits), torch.einsum("bk,kij->bij", w, perms), 1e-12)


def test_print_model_of_a_per_sublayer_baseline_is_short():
    """``print(model)`` in a notebook: a ParameterList listed each of its per-sublayer
    parameters, so hyper-connections at 24 transformer blocks printed 276 lines (5 lists of 48)."""
    model = AttnResLM(ModelConfig.preset("tiny", n_layers=24, residual="hyper_connections"))
    assert len(repr(model).splitlines()) < 40
    assert "(static_alpha): ParameterList(48 x [4, 5] float32)" in repr(model)
    dense = AttnResLM(ModelConfig.preset("tiny", n_layers=3, residual="denseformer"))
    assert "(dwa): ParameterList(3 x [2] to [4] float32)" in repr(dense)  # one more weight per block
    # (the class that does it is named for it, not ``ParameterList`` as the torch class it extends)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ParameterList)]
    assert lists and all(type(m) is OneLineParameterList for m in lists)
