"""Residuals as depth mixing matrices (report §6.2, Fig. 9) and depth-wise attention sinks
(report §5.4.2): every registered variant describes its ``M``, the analysis measures it.

The exact tests run float64 models, so that ``M`` is compared with values computed here
independently from each variant's parameters."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import Tensor

from attnres import AttnResLM, ModelConfig, register_residual, registered_residuals
from attnres.analysis import depth_mixing_matrix, mixing_forward, semiseparable_rank
from attnres.nn.residual import BlockAttnRes, SingleStreamResidual, sinkhorn_knopp

F64 = torch.float64


def model(kind: str, n_layers: int = 3, d: int = 16, perturb: float = 0.0, seed: int = 0, **residual) -> AttnResLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, d_model=d, n_layers=n_layers, n_heads=2, max_seq_len=16,
                      residual={"kind": kind, **residual})
    m = AttnResLM(cfg).to(F64)
    if perturb:
        with torch.no_grad():
            for p in m.residual.parameters():
                p.add_(torch.randn_like(p) * perturb)
    return m


def ids(b: int = 2, t: int = 8, seed: int = 1) -> Tensor:
    return torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(seed))


# -- exact values ------------------------------------------------------------------------
def test_standard_is_exactly_the_all_ones_lower_triangle():
    for n_layers in (1, 3):
        M = depth_mixing_matrix(model("standard", n_layers), ids()).matrix
        L = 2 * n_layers
        assert M.dtype == F64 and M.shape == (L + 1, L + 1)
        assert torch.equal(M, torch.ones(L + 1, L + 1, dtype=F64).tril())


@pytest.mark.parametrize("schedule", ["naive", "two_phase"])
def test_full_attnres_with_zero_queries_averages_its_sources(schedule):
    rec = mixing_forward(model("attnres_full", schedule=schedule), ids())
    L = 6
    expected = torch.zeros(L + 1, L + 1, dtype=F64)
    for r in range(L + 1):
        expected[r, : r + 1] = 1.0 / (r + 1)  # mixer r sees v_0 .. v_r
    W = rec.mixing.weights
    assert W.shape == (2, 8, L + 1, L + 1)
    if schedule == "naive":
        assert torch.equal(W, expected.expand_as(W))
    else:  # the two-phase merge rescales partial softmaxes: equal up to float64 rounding
        assert (W - expected).abs().max() <= 4 * torch.finfo(F64).eps


@pytest.mark.parametrize("schedule", ["naive", "two_phase"])
def test_block_attnres_with_zero_queries_gives_each_member_its_blocks_weight(schedule):
    # 4 transformer blocks = 8 sublayers, S = 3: blocks {1,2,3}, {4,5,6}, {7,8} (report §3.2).
    rec = mixing_forward(model("attnres_block", n_layers=4, block_size=3, schedule=schedule), ids())
    L = 8
    blocks = [[1, 2, 3], [4, 5, 6], [7, 8]]
    expected = torch.zeros(L + 1, L + 1, dtype=F64)
    for r in range(L + 1):  # row r: the input of sublayer r + 1 (0-based r), row L the output
        done = [b for b in blocks if b[-1] <= r]  # blocks complete before this mixer
        partial = [i for i in range(1, r + 1) if not any(i in b for b in done)]
        sources = [[0]] + done + ([partial] if partial and r < L else [])
        if r == L:
            sources = [[0]] + blocks
        for members in sources:
            expected[r, members] = 1.0 / len(sources)  # every member takes its source's weight
    W = rec.mixing.weights
    if schedule == "naive":
        assert torch.equal(W, expected.expand_as(W))
    else:
        assert (W - expected).abs().max() <= 4 * torch.finfo(F64).eps
    assert rec.mixing.source_groups == [range(0, 1), range(1, 4), range(4, 7), range(7, 9)]
    # The row sums count a block's members: 1/n_l per *source*, not per v_i.
    assert torch.equal(expected[3], torch.tensor([0.5, 0.5, 0.5, 0.5, 0, 0, 0, 0, 0], dtype=F64))


def test_highway_matches_the_carry_product_formula():
    m = model("highway", n_layers=3, perturb=0.5)
    rec = mixing_forward(m, ids(), per_channel=True)
    L = 6
    # The gates, recomputed from the recorded sublayer inputs h_l and the gate parameters.
    g = [torch.sigmoid(rec.inputs[l] @ m.residual.gates[l].weight.T + m.residual.gates[l].bias) for l in range(L)]
    pc = rec.mixing.per_channel  # [B, T, L + 1, L + 1, d]
    for r in range(L + 1):
        for i in range(L + 1):
            if i > r:
                assert torch.equal(pc[..., r, i, :], torch.zeros_like(g[0]))
                continue
            w = torch.ones_like(g[0]) if i == 0 else g[i - 1]  # M[0 -> r] = carry, M[i -> r] = g_i carry
            for k in range(i, r):
                w = w * (1 - g[k])
            assert (pc[..., r, i, :] - w).abs().max() <= 1e-14
    # Rows sum to one (stick-breaking, report §6.2), channel by channel.
    assert (pc.sum(-2) - 1).abs().max() <= 1e-14
    assert torch.equal(rec.mixing.weights, pc.mean(-1))
    assert "mean over the d channels" in rec.mixing.reduction


def eq10(alphas: list[Tensor], betas: list[Tensor], transitions: list[Tensor]) -> Tensor:
    """Report Eq. 10 written out: ``M[i -> l] = beta_i^T A_{i+1} ... A_l alpha_l`` (streams as
    columns, ``H_l = H_{l-1} A_l + f beta^T``), one entry at a time."""
    n = len(alphas)
    M = torch.zeros(n, n, dtype=F64)
    for l in range(n):
        for i in range(l + 1):
            A = torch.eye(alphas[0].shape[0], dtype=F64)
            for k in range(i, l):  # the transitions of the sublayers after v_i was written
                A = A @ transitions[k]
            M[l, i] = betas[i] @ A @ alphas[l]
    return M


def test_hyper_connections_match_eq_10():
    m = model("hyper_connections", n_layers=3, hc_streams=3)
    r = m.residual
    torch.manual_seed(3)
    with torch.no_grad():  # random static maps; no dynamic part, so M is a function of the parameters
        for l in range(6):
            r.static_alpha[l].copy_(torch.randn(3, 4, dtype=F64))
            r.static_beta[l].copy_(torch.randn(3, dtype=F64))
            r.dynamic_alpha[l].normal_()
        r.alpha_scale.zero_()
        r.beta_scale.zero_()
    ones = torch.ones(3, dtype=F64)
    alphas = [r.static_alpha[l][:, 0] for l in range(6)] + [ones]  # the output sums the streams
    betas = [ones] + [r.static_beta[l] for l in range(6)]  # the embedding enters every stream
    A = [r.static_alpha[l][:, 1:] for l in range(6)]
    expected = eq10(alphas, betas, A).detach()
    W = mixing_forward(m, ids()).mixing.weights
    assert (W - expected).abs().max() <= 1e-13 * expected.abs().max()


@pytest.mark.parametrize("kind", ["mhc", "mhc_lite"])
def test_mhc_matches_eq_10(kind):
    m = model(kind, n_layers=3, hc_streams=2)
    r = m.residual
    torch.manual_seed(4)
    with torch.no_grad():  # phi = 0: the maps are sigmoid / Sinkhorn of the random biases
        for l in range(6):
            r.bias[l].normal_()
    k = 2
    alphas, betas, A = [], [torch.ones(k, dtype=F64)], []
    for l in range(6):
        b = r.bias[l].detach()
        alphas.append(torch.sigmoid(b[:k]))
        betas.append(2 * torch.sigmoid(b[k : 2 * k]))
        if kind == "mhc":
            res = sinkhorn_knopp(b[2 * k :].reshape(k, k), r.sinkhorn_iters)
        else:
            p = torch.softmax(b[2 * k :], -1)
            res = p[0] * torch.eye(2, dtype=F64) + p[1] * torch.eye(2, dtype=F64).flip(0)
        A.append(res.T)  # H (rows = streams) <- res H is H^T A with A = res^T
    alphas.append(torch.ones(k, dtype=F64))
    expected = eq10(alphas, betas, A)
    W = mixing_forward(m, ids()).mixing.weights
    assert (W - expected).abs().max() <= 1e-13 * expected.abs().max()


def test_parameter_only_variants():
    m = model("rezero", perturb=1.0)
    a = m.residual.alpha.detach()
    expected = torch.ones(7, 7, dtype=F64).tril() * torch.cat([torch.ones(1, dtype=F64), a])
    assert torch.equal(depth_mixing_matrix(m, ids()).matrix, expected)
    ls = model("layerscale", perturb=1.0)
    d = depth_mixing_matrix(ls, ids())
    lam = torch.stack(list(ls.residual.scales)).detach().mean(-1)
    assert torch.allclose(d.matrix, torch.ones(7, 7, dtype=F64).tril() * torch.cat([torch.ones(1, dtype=F64), lam]),
                          rtol=0, atol=1e-15)
    assert d.reduction.startswith("mean over the d channels") and not d.input_dependent
    # DenseFormer at init is the standard residual.
    assert torch.equal(depth_mixing_matrix(model("denseformer"), ids()).matrix, torch.ones(7, 7, dtype=F64).tril())


@pytest.mark.parametrize("kind", registered_residuals())
def test_forward_equals_the_mixing_of_its_recorded_sources(kind):
    if kind not in {"standard", "attnres_full", "attnres_block", "rezero", "layerscale", "highway", "denseformer",
                    "hyper_connections", "mhc", "mhc_lite"}:
        pytest.skip(f"{kind!r} is registered by another test module")
    extra = {"block_size": 2} if kind == "attnres_block" else {}
    rec = mixing_forward(model(kind, perturb=0.3, **extra), ids(), per_channel=True)
    rows = rec.reconstruct()
    for l, (got, h) in enumerate(zip(rows, rec.inputs + [rec.output])):
        err = (got - h).abs().max() / h.abs().max()
        assert err <= 1e-12, f"{kind}: row {l} differs by {err:.2e}"


def test_results_show_in_a_notebook_as_one_line():
    """A notebook shows a cell's result by its repr: a DepthMixing printed both matrices and
    the sink table (125 lines for 12 transformer blocks), a MixingForward every source and
    input tensor (thousands), a MixingMatrix every token's matrix."""
    m = model("attnres_block", n_layers=12, block_size=4)
    mixing = depth_mixing_matrix(m, ids(), per_token=True)
    assert repr(mixing) == ("DepthMixing('attnres_block', 24 sublayers, matrix [25, 25] over 16 tokens, rank "
                            f"{mixing.rank} (largest over every token; of the mean {mixing.rank_of_mean}), "
                            "input-dependent, sinks [], per_token [2, 8, 25, 25])")
    assert repr(mixing_forward(m, ids())) == ("MixingForward(mixing [2, 8, 25, 25], 25 sources and 24 inputs "
                                              "[2, 8, 16], output [2, 8, 16])")
    # (and residual.mixing_matrix(state)'s, a model of one's own: every token's matrix, thousands of lines)
    groups = "v0, v1..v4, v5..v8, v9..v12, v13..v16, v17..v20, v21..v24"
    assert repr(mixing_forward(m, ids()).mixing) == (f"MixingMatrix(weights [2, 8, 25, 25], input-dependent, "
                                                     f"source_groups {groups})")
    assert repr(mixing_forward(model("highway"), ids(), per_channel=True).mixing) == (
        "MixingMatrix(weights [2, 8, 7, 7], input-dependent, per_channel [2, 8, 7, 7, 16], reduction \"mean over the d "
        "channels of the element-wise gates' carry products\")")


@pytest.mark.parametrize("kind,ablation", [
    ("attnres_full", {"window": 2}), ("attnres_full", {"sigmoid_weights": True}),
    ("attnres_block", {"input_independent_mixing": True}), ("attnres_full", {"input_dependent_query": True}),
    ("attnres_block", {"key_norm": False}), ("attnres_full", {"heads": 2}),
])
def test_table4_ablations_describe_their_mixing(kind, ablation):
    extra = {"block_size": 2} if kind == "attnres_block" else {}
    rec = mixing_forward(model(kind, perturb=0.5, schedule="naive", ablation=ablation, **extra), ids())
    err = max(float((a - b).abs().max()) for a, b in zip(rec.reconstruct(), rec.inputs + [rec.output]))
    if "heads" in ablation:  # each head mixes its own channel group: M holds the mean over heads, and says so
        assert "mean over the depth-attention heads" in rec.mixing.reduction and err > 1e-6
    else:
        assert err <= 1e-12 and rec.mixing.reduction is None


# -- the rank estimate -------------------------------------------------------------------
def test_rank_of_standard_and_highway_is_one():
    assert depth_mixing_matrix(model("standard", n_layers=6), ids()).rank == 1
    hw = depth_mixing_matrix(model("highway", n_layers=6, perturb=0.5), ids())
    assert hw.rank == 1 and hw.rank_over == "largest over every token and channel"
    assert hw.rank_of_mean > 1  # an average of rank-one matrices is not rank one


@pytest.mark.parametrize("m_streams", [1, 2, 3])
def test_rank_of_hyper_connections_is_at_most_m(m_streams):
    for kind in ("hyper_connections", "mhc"):
        d = depth_mixing_matrix(model(kind, n_layers=4, hc_streams=m_streams, perturb=0.5), ids(1, 8))
        assert d.rank == m_streams, (kind, d.rank)  # random maps reach the bound


def _block_matrix(L: int, S: int, seed: int = 0) -> Tensor:
    """Block AttnRes with random queries on random sources (the residual alone)."""
    torch.manual_seed(seed)
    r = BlockAttnRes(8, L, S, schedule="naive").to(F64)
    with torch.no_grad():
        for p in r.parameters():
            p.add_(torch.randn_like(p))
    st = r.start(torch.randn(3, 8, dtype=F64), record_weights=True)
    for l in range(L):
        r.sublayer_input(st, l)
        r.add_output(st, l, torch.randn(3, 8, dtype=F64))
    r.finish(st)
    return r.mixing_matrix(st).weights


@pytest.mark.parametrize("L,S", [(16, 4), (24, 6), (30, 10), (12, 12), (40, 5)])
def test_rank_of_block_attnres_lies_between_n_and_n_plus_s(L, S):
    N = math.ceil(L / S)
    ranks = semiseparable_rank(_block_matrix(L, S))
    assert ((N <= ranks) & (ranks <= N + S)).all(), (N, S, ranks)


@pytest.mark.parametrize("L,S", [(16, 2), (24, 3), (16, 1)])
def test_rank_of_block_attnres_with_short_blocks_stays_below_n_plus_s(L, S):
    """With ``S < N - 1`` the lower bound N of report §6.2 can fail (here it does, the long
    preset's S = 3, N = 8 among them): a block ``M[k:, :k + 1]`` has ``L + 1 - k`` rows, too
    few beside enough distinct columns. The upper bound ``N + S`` holds."""
    N = math.ceil(L / S)
    ranks = semiseparable_rank(_block_matrix(L, S))
    assert (ranks <= N + S).all() and (ranks < N).all(), (N, ranks)


def test_full_attnres_is_dense():
    d = depth_mixing_matrix(model("attnres_full", n_layers=6, perturb=0.5), ids())
    assert d.rank == 7  # floor((L + 2) / 2) for L = 12: the largest the blocks' shapes allow


# -- sinks, errors ---------------------------------------------------------------------------
def test_sink_table():
    std = depth_mixing_matrix(model("standard"), ids())
    assert std.sinks() == [] and all(s.relative == 1.0 and s.std == 0 for s in std.sources)
    rz = model("rezero")
    with torch.no_grad():
        rz.residual.alpha.fill_(0.1)
    d = depth_mixing_matrix(rz, ids())
    assert d.sinks() == [0] and d.sources[0].top_rows == 7  # the embedding, weight 1 against 0.1
    full = depth_mixing_matrix(model("attnres_full", perturb=1.0), ids(), per_token=True)
    assert full.per_token.shape == (2, 8, 7, 7)
    assert torch.allclose(full.per_token.reshape(-1, 7, 7).mean(0), full.matrix, rtol=0, atol=1e-15)
    for s in full.sources:
        w = full.per_token[..., s.source:, s.source].mean(-1)
        assert math.isclose(s.mean, float(w.mean()), rel_tol=1e-12)
        assert math.isclose(s.std, float(w.std(correction=0)), rel_tol=1e-9, abs_tol=1e-15)
    assert set(full.to_dict()) >= {"matrix", "rank", "sources", "rtol"}


def test_findings_read_as_prose_not_python_lists():
    """The computed findings said ``semiseparable rank [2]`` and ``sinks [[]] per seed``; now
    ``rank 2`` and ``sinks: none``, per seed only where the seeds differ."""
    from attnres.analysis.mixing_report import mixing_findings

    rz = model("rezero")
    with torch.no_grad():
        rz.residual.alpha.fill_(0.1)
    sink, none = depth_mixing_matrix(rz, ids()), depth_mixing_matrix(model("standard"), ids())
    assert mixing_findings("A", [none], 1, 1) == ["A: semiseparable rank 1 (report §6.2: = 1); fewer than 3 seeds, "
                                                  "no claim.", "A: sinks: none; fewer than 3 seeds, no claim."]
    two = mixing_findings("B", [sink, none], 1, 1)
    assert two[1] == "B: sinks: v0; none (per seed); fewer than 3 seeds, no claim.", two
    assert "semiseparable rank" in two[0] and "[" not in two[0].split("(report")[0], two
    three = mixing_findings("C", [none] * 3, 1, 1)
    assert three[0] == "C: semiseparable rank 1, in every seed (3/3) within report §6.2's = 1.", three


def test_logged_mean_weights_give_the_token_averaged_matrix():
    """Runs without checkpoints: M from the Fig.-8 mean weights ``forward_diagnostics`` logs."""
    from attnres.analysis import forward_diagnostics
    from attnres.analysis.mixing import depth_mixing_from_logged

    for kind, extra in (("attnres_block", {"block_size": 3}), ("attnres_full", {})):
        m = model(kind, n_layers=4, perturb=1.0, **extra)
        x = ids()
        logged = depth_mixing_from_logged(m.residual, forward_diagnostics(m, x)["depth_weights"])
        measured = depth_mixing_matrix(m, x)
        assert (logged.matrix - measured.matrix).abs().max() <= 1e-6  # the logged means are float32
        assert logged.rank == measured.rank_of_mean and logged.n_tokens == 0
        assert logged.sinks() == [] and all(math.isnan(s.std) for s in logged.sources)


def test_diagnostics_of_a_compiled_model_run_its_eager_module():
    """``forward_diagnostics(torch.compile(model), ids)`` (a user's own loop with a compiled
    model) traced the model again with the recording hooks in it: a recompilation and a screen
    of graph-break warnings for each ``.item()`` in a hook. It runs the module compiled now."""
    from attnres.analysis import forward_diagnostics

    traced = []

    def backend(gm, _inputs):  # counts what dynamo hands to a compiler
        traced.append(gm)
        return gm.forward

    m = model("attnres_block", block_size=3, n_layers=4, perturb=1.0)
    x = ids()
    compiled = torch.compile(m, backend=backend)
    assert forward_diagnostics(compiled, x) == forward_diagnostics(m, x)
    assert traced == []


def test_a_variant_without_its_mixing_matrix_says_what_is_missing():
    @register_residual("no_mixing_test", replace=True)
    class NoMixing(SingleStreamResidual):
        def update(self, l, h, out):
            return h + out

    m = model("no_mixing_test")  # (the suite's fixture unregisters it afterwards: registry_isolation)
    with pytest.raises(NotImplementedError, match=r"no_mixing_test.*_mixing_matrix\(state, per_channel=False\)"):
        depth_mixing_matrix(m, ids())


def test_mixing_matrix_needs_a_recorded_finished_forward():
    r = model("standard").residual
    x = torch.randn(2, 16, dtype=F64)
    st = r.start(x)
    with pytest.raises(RuntimeError, match="record_weights=True"):
        r.mixing_matrix(st)
    st = r.start(x, record_weights=True)
    r.sublayer_input(st, 0)
    r.add_output(st, 0, x)
    with pytest.raises(RuntimeError, match="stopped after 1 of 6"):
        r.mixing_matrix(st)
    with pytest.raises(TypeError, match="decoder trunk"):
        depth_mixing_matrix(torch.nn.Linear(2, 2), ids())


class _OwnModel(torch.nn.Module):
    """The README's "AttnRes in your own PyTorch model", small: no ``layers``, no ``config``."""

    def __init__(self, d: int = 16, n_sublayers: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding(64, d)
        self.sublayers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, d))
                                             for _ in range(n_sublayers))
        self.residual = BlockAttnRes(d, n_sublayers, block_size=2)

    def forward(self, input_ids: Tensor, record_weights: bool = False):
        state = self.residual.start(self.embed(input_ids), record_weights=record_weights)
        for l, sublayer in enumerate(self.sublayers):
            self.residual.add_output(state, l, sublayer(self.residual.sublayer_input(state, l)))
        return self.residual.finish(state), state


def test_the_analysis_of_a_model_of_your_own_says_where_its_depth_weights_are():
    """``forward_diagnostics`` and ``block_grad_norms`` of the README's own model ended in
    "'_OwnModel' object has no attribute 'config'" from inside their set-up, and
    ``depth_mixing_matrix`` named the models it runs only; each names the way that works, which
    is followed here to the end."""
    from attnres.analysis import block_grad_norms, depth_entropy, forward_diagnostics

    m = _OwnModel()
    for analyse in (lambda: forward_diagnostics(m, ids()), lambda: block_grad_norms(m)):
        with pytest.raises(TypeError, match=r"_OwnModel; for a model of your own .*record_weights=True.*"
                                            r"forward hook on each of your sublayers"):
            analyse()
    with pytest.raises(TypeError, match=r"_OwnModel; for a model of your own .*residual.mixing_matrix\(state\)"):
        depth_mixing_matrix(m, ids())
    _, state = m(ids(), record_weights=True)
    assert [depth_entropy(w) for w in state.weights] == pytest.approx([math.log(n) for n in m.residual.sources_per_mixer()])
    mm = m.residual.mixing_matrix(state)
    assert tuple(mm.weights.shape) == (2, 8, 5, 5)
    assert semiseparable_rank(mm.weights).shape == (2, 8)


def test_depth_entropy_refuses_every_mixer_s_list_and_weights_that_do_not_sum_to_one_over_the_sources():
    """``depth_entropy(state.weights)`` (the whole list) failed in "'list' object has no attribute
    'detach'"; weights with the sources last (``[B, T, n]``, as a plot takes them) or logits gave
    a number, an entropy over the batch, silently. Each now names the fix."""
    from attnres.analysis import depth_entropy

    _, state = _OwnModel()(ids(), record_weights=True)
    with pytest.raises(ValueError, match=r"one mixer's weights \[n_sources, \.\.\.\], got a list of 5 .*"
                                         r"\[depth_entropy\(w\) for w in weights\]"):
        depth_entropy(state.weights)
    w = state.weights[3].detach()  # [3 sources, B, T]
    with pytest.raises(ValueError, match=r"summing to 1 over the sources \(dim 0\); those given \(2, 8, 3\) .*"
                                         r"weights\.movedim\(-1, 0\)"):
        depth_entropy(w.movedim(0, -1))
    with pytest.raises(ValueError, match="logits\\? pass their softmax"):
        depth_entropy(w.log())
    assert depth_entropy(w.movedim(0, -1).movedim(-1, 0)) == depth_entropy(w) == pytest.approx(math.log(3))
    assert depth_entropy(w.to(torch.bfloat16)) == pytest.approx(math.log(3), rel=1e-2)  # (a bf16 copy's rounding)


def test_the_analysis_of_a_wrapped_model_names_its_module():
    """``depth_mixing_matrix(DistributedDataParallel(model), ids)`` (and ``forward_diagnostics``,
    ``block_grad_norms``) told the user to drive a residual of their own model with
    ``record_weights``; the wrapper's ``.module`` is the way (any module holding the model as
    ``.module`` stands for DDP here, which needs a process group)."""
    from attnres.analysis import block_grad_norms, forward_diagnostics

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    m = model("attnres_block", block_size=2)
    for analyse in (depth_mixing_matrix, forward_diagnostics, lambda w, _: block_grad_norms(w)):
        with pytest.raises(TypeError, match=r"takes the model itself; got Wrapper around AttnResLM: give it the "
                                            r"wrapper's \.module"):
            analyse(Wrapper(m), ids())
    assert depth_mixing_matrix(Wrapper(m).module, ids()).residual == "attnres_block"


def test_the_rank_takes_lower_triangular_square_matrices_only():
    """``semiseparable_rank`` gave a rank of a non-square matrix and of ``M`` transposed (sources
    as rows): the ranks of other blocks than the report's, without a word; a vector failed inside
    ``linalg.matrix_norm``."""
    M = _block_matrix(6, 2)[0]  # (one token's)
    assert int(semiseparable_rank(M)) == int(semiseparable_rank(M.unsqueeze(0))[0]) == 3  # (N = 3 blocks)
    for bad, got in ((M.mT, "entries above the diagonal"), (M[:, :5], r"\(7, 5\)"), (M[0], r"\(7,\)")):
        with pytest.raises(ValueError, match=r"semiseparable_rank takes lower-triangular mixing matrices \[\.\.\., n, "
                                             f"n\\].*got {got}"):
            semiseparable_rank(bad)


def _largest_allocation(fn, of: Tensor) -> int:
    """The bytes of the largest tensor ``fn()`` makes that is not a view of ``of``, op by op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, Tensor) and t.untyped_storage().data_ptr() != of.untyped_storage().data_ptr():
                    Allocations.largest = max(Allocations.largest, t.untyped_storage().nbytes())
            return out

    with Allocations():
        fn()
    return Allocations.largest


def test_the_rank_of_a_stack_copies_a_chunk_at_a_time_and_refuses_one_upper_entry(monkeypatch):
    """``semiseparable_rank`` checked the lower triangle with ``M.triu(1).ne(0)`` - a copy of
    the whole stack, then its booleans - and took its float64 copy and the SVDs' workspace of
    the whole stack too: for Highway's per-channel matrices (``d`` per token) that is several
    times the stack. The check reads views row by row, and the rank is taken RANK_CHUNK
    matrices at a time (split along the leading dims, which need not merge): no tensor it makes
    is larger than a chunk's float64 copy, the ranks are the same, and one entry above the
    diagonal, deep in the stack, is still refused with the same message."""
    from attnres.analysis import mixing

    torch.manual_seed(0)
    M = torch.rand(4, 48, 6, 6).tril()  # (float32: the float64 copy is made a chunk at a time too)
    M[1, 7, :, :2] = 0.5 * torch.ones(6, 2).tril()  # (a block of lower rank)
    whole = semiseparable_rank(M)
    monkeypatch.setattr(mixing, "RANK_CHUNK", 16, raising=False)  # (raising: none before it was chunked)
    chunk = 16 * 6 * 6 * 8  # (bytes: 16 float64 6 x 6 matrices)
    assert _largest_allocation(lambda: semiseparable_rank(M), M) <= chunk
    assert torch.equal(semiseparable_rank(M), whole)
    assert torch.equal(semiseparable_rank(M.transpose(0, 1)), whole.T)  # (leading dims that do not merge)
    assert torch.equal(semiseparable_rank(M[:1]), whole[:1])  # (one index with more than a chunk behind it)
    assert int(semiseparable_rank(M[2, 3])) == int(whole[2, 3])
    M[3, 40, 2, 5] = 1e-30
    with pytest.raises(ValueError, match=r"semiseparable_rank takes lower-triangular mixing matrices \[\.\.\., n, n\]"
                                         r".*got entries above the diagonal \(sources as rows\? M.mT is the report's\)"):
        semiseparable_rank(M)


def test_the_rank_of_an_exact_integer_matrix_is_taken_at_float64s_tolerance():
    """The default tolerance became the dtype's machine epsilon (``rank_rtol``), and an integer
    or boolean ``M`` (``torch.ones(n, n, dtype=torch.long).tril()``, the standard residual's,
    written by hand) failed in ``torch.finfo``, where it had a rank: its entries are exact."""
    standard = torch.ones(5, 5, dtype=torch.long).tril()
    assert int(semiseparable_rank(standard)) == int(semiseparable_rank(standard.bool())) == 1
    assert int(semiseparable_rank(torch.eye(4, dtype=torch.int32))) == 1


def test_the_rank_of_an_empty_mixing_matrix_is_zero():
    """A 0x0 matrix (``[..., 0, 0]``) failed inside ``torch.stack`` (no blocks to rank): it has
    rank 0, of the leading shape, as an n x n matrix's rank is."""
    assert semiseparable_rank(torch.zeros(3, 2, 0, 0, dtype=F64)).tolist() == [[0, 0]] * 3
    assert semiseparable_rank(torch.zeros(0, 0)).shape == ()
    assert semiseparable_rank(torch.zeros(0, 0)).dtype == semiseparable_rank(torch.eye(2)).dtype


def test_the_sink_table_takes_a_mixing_matrixs_weights_as_they_are():
    """``source_stats`` took ``[N, n, n]`` only: a ``MixingMatrix``'s ``[B, T, n, n]`` (or a
    parameter-only variant's ``[n, n]``) failed "too many (not enough) values to unpack"."""
    from attnres.analysis import source_stats

    W = torch.softmax(torch.randn(2, 8, 5, 5, dtype=F64), -1).tril()
    assert source_stats(W) == source_stats(W.reshape(16, 5, 5))
    assert source_stats(W[0, 0]) == source_stats(W[0, 0].unsqueeze(0))
    with pytest.raises(ValueError, match=r"source_stats takes mixing matrices \[\.\.\., n, n\].*got \(5, 4\)"):
        source_stats(W[0, 0, :, :4])


def test_the_rank_and_the_sink_table_take_the_mixing_matrix_itself():
    """The README's own-model way - ``residual.mixing_matrix(state)``, "which semiseparable_rank
    and source_stats measure" - was refused by both ("got MixingMatrix"). They take it: its
    weights, or for a channel-wise variant the largest rank over its per-channel matrices (the
    report's rank, as ``depth_mixing_matrix`` gives it); its weights alone, their mean over the
    channels, are refused for the rank, naming ``per_channel=True``."""
    from attnres.analysis import source_stats

    own = _OwnModel()
    with torch.no_grad():
        for p in own.residual.parameters():
            p.add_(torch.randn_like(p))
    _, state = own(ids(), record_weights=True)
    mm = own.residual.mixing_matrix(state)
    assert torch.equal(semiseparable_rank(mm), semiseparable_rank(mm.weights))
    assert source_stats(mm) == source_stats(mm.weights)
    highway = model("highway", n_layers=3, perturb=0.5)
    per_channel = mixing_forward(highway, ids(1, 2), per_channel=True).mixing
    pc_ranks = semiseparable_rank(per_channel.per_channel.movedim(-1, -3))  # [1, 2, d]
    assert torch.equal(semiseparable_rank(per_channel), pc_ranks.amax(-1))
    assert int(semiseparable_rank(per_channel).max()) == depth_mixing_matrix(highway, ids(1, 2)).rank
    reduced = mixing_forward(highway, ids(1, 2)).mixing
    with pytest.raises(ValueError, match=r"semiseparable_rank of a MixingMatrix whose weights are the mean over the "
                                         r".*residual\.mixing_matrix\(state, per_channel=True\)"):
        semiseparable_rank(reduced)


def test_the_mixing_panels_take_what_the_analysis_gives_and_name_the_fix_for_the_rest():
    """``plot_mixing_panels`` of the README's own-model ``residual.mixing_matrix(state)`` failed
    inside: the MixingMatrix ("no attribute 'detach'"), its per-token weights ("Invalid shape (2,
    8, 5, 5) for image data"), one panel not in a list ("'str' object has no attribute
    'detach'"), a DepthMixing ("cannot unpack"). The first and the last are drawn (the matrix
    averaged over its tokens, as ``depth_mixing_matrix`` does), the others name the fix."""
    pytest.importorskip("matplotlib")
    from attnres.analysis.mixing_report import plot_mixing_panels

    own = _OwnModel()
    _, state = own(ids(), record_weights=True)
    mm = own.residual.mixing_matrix(state)
    own_mean = mm.weights.mean((0, 1))
    drawn = plot_mixing_panels([("own", mm, mm.source_groups)]).axes[0].images[0].get_array()
    assert torch.allclose(torch.as_tensor(drawn.filled(float("nan"))).nan_to_num(), own_mean.tril())
    dm = depth_mixing_matrix(model("attnres_block", block_size=2), ids())
    assert plot_mixing_panels([dm]).axes[0].get_title() == "attnres_block"
    with pytest.raises(ValueError, match=r"panels\[0\] \('own'\) needs one matrix M \[n, n\], got \(2, 8, 5, 5\): .*"
                                         r"M\.reshape\(-1, n, n\)\.mean\(0\)"):
        plot_mixing_panels([("own", mm.weights, None)])
    with pytest.raises(ValueError, match=r"takes a list of panels.*for one, \[\(title, M, source_groups\)\]"):
        plot_mixing_panels(("own", own_mean, None))


@pytest.mark.parametrize("kind", ["attnres_full", "attnres_block", "highway", "layerscale", "mhc", "denseformer"])
def test_the_mixing_matrix_of_a_training_forward_is_a_description_without_its_graph(kind):
    """Every variant built ``M`` from detached tensors but AttnRes, whose recorded depth weights
    carry the forward's graph: its ``M`` kept that graph alive and had a ``grad_fn``. The
    recorded weights themselves stay differentiable."""
    r = model(kind).residual.float()
    x = torch.randn(2, 4, 16, requires_grad=True)
    state = r.start(x, record_weights=True)
    for l in range(r.n_sublayers):
        r.add_output(state, l, torch.tanh(r.sublayer_input(state, l)) * 0.5)
    r.finish(state)
    mm = r.mixing_matrix(state, per_channel=True)
    assert not mm.weights.requires_grad and (mm.per_channel is None or not mm.per_channel.requires_grad)
    assert state.weights is None or all(w.requires_grad for w in state.weights[1:])


# -- attnres analyze -------------------------------------------------------------------------
@pytest.mark.slow  # trains two tiny runs (~25 s); the compare report's section runs in test_experiments
def test_analyze_cli_writes_the_report_and_compares(tmp_path):
    from attnres.cli import main as cli_main

    corpus = tmp_path / "corpus.txt"
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    g = torch.Generator().manual_seed(0)
    corpus.write_text("\n".join(" ".join(words[int(i)] for i in torch.randint(0, 8, (12,), generator=g))
                                for _ in range(200)))
    out = tmp_path / "runs"
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "standard", "block",
                     "--overhead-repeats", "0", f"data.paths=[{corpus}]"]) == 0
    report = tmp_path / "analysis"
    assert cli_main(["analyze", "--checkpoint", str(out / "block" / "seed0"), "--compare", str(out / "standard" / "seed0"),
                     "--out", str(report), "--rows", "2", "--seq-len", "16"]) == 0
    text = (report / "report.md").read_text()
    for needle in ("## Semiseparable rank", "## Sink table", "## Comparison", "A: attnres_block L=8 S=", "B: standard L=8",
                   "averaged over 32 tokens", "![depth mixing matrices](mixing.png)"):
        assert needle in text, needle
    assert (report / "mixing.png").stat().st_size > 0
    data = json.loads((report / "mixing.json").read_text())
    assert [d["residual"] for d in data] == ["attnres_block", "standard"] and data[1]["rank"] == 1
    with pytest.raises(SystemExit, match="'.*nothing' does not exist"):
        cli_main(["analyze", "--checkpoint", str(tmp_path / "nothing")])


def test_analyze_rows_are_capped_at_the_windows_the_text_holds(tmp_path):
    """A text of 100 byte tokens holds 6 windows of 16 that do not overlap: ``--rows 1000``
    analyses those 6, with a warning naming the cap, and the report counts 96 tokens (it took
    1000 windows 0.08 tokens apart and claimed 16000); without ``--rows``, 6 of the default 8."""
    pytest.importorskip("yaml")
    pytest.importorskip("matplotlib")  # (else a second warning: mixing.png is not drawn)
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main
    from attnres.experiments.job.analyze import analysis_tokens
    from attnres.inference.loading import load_run
    from attnres.train import load_config, train

    run = tmp_path / "run"
    train(load_config(None, overrides(write_corpus(tmp_path / "corpus.txt"), run, steps=1, warmup_steps=0,
                                      eval_every=100, diagnostics_every=100)))
    letters = torch.randint(ord("a"), ord("z") + 1, (100,), generator=torch.Generator().manual_seed(0))
    text = "".join(map(chr, letters.tolist()))  # (byte tokenizer: one token a letter)
    (tmp_path / "text.txt").write_text(text)
    args = ["analyze", "--checkpoint", str(run), "--text", str(tmp_path / "text.txt"), "--seq-len", "16"]
    with pytest.warns(UserWarning) as caught:
        assert cli_main([*args, "--rows", "1000", "--out", str(tmp_path / "capped")]) == 0
    # (matplotlib 3.8 calls pyparsing by the names pyparsing 3.3 deprecates)
    ours = [str(w.message) for w in caught if not issubclass(w.category, DeprecationWarning)]
    assert ours == ["--rows 1000 is more than the text holds: its 100 tokens make 6 window(s) of 16 that do not "
                    "overlap; analysing 6"]
    assert "averaged over 96 tokens" in (tmp_path / "capped" / "report.md").read_text()
    assert json.loads((tmp_path / "capped" / "mixing.json").read_text())[0]["n_tokens"] == 96
    assert cli_main([*args, "--out", str(tmp_path / "default")]) == 0
    assert "averaged over 96 tokens" in (tmp_path / "default" / "report.md").read_text()
    windows = analysis_tokens(load_run(run), seq_len=16, text=text)  # spread from the start to the end
    assert windows.tolist() == [letters[s : s + 16].tolist() for s in (0, 17, 34, 50, 67, 84)]
    with pytest.raises(ValueError, match=r"^the text has 100 tokens, fewer than one window of 128: use --seq-len 100 "
                       r"or less, or a longer text$"):
        analysis_tokens(load_run(run), seq_len=128, text=text)
    with pytest.raises(ValueError, match="the text has 0 tokens, fewer than one window of 16: use a text that is not empty"):
        analysis_tokens(load_run(run), seq_len=16, text="")


def test_analyze_without_matplotlib_writes_the_tables_and_says_what_draws_the_picture(tmp_path, monkeypatch):
    """matplotlib draws only ``mixing.png``: without it ``attnres analyze`` failed after the
    whole analysis and wrote nothing; now report.md and mixing.json are written, the report
    and a warning say the picture is left out and what installs it, and an older analysis's
    picture is removed (it would pass for this one's)."""
    import sys

    pytest.importorskip("yaml")
    pytest.importorskip("matplotlib")  # (the older analysis's picture)
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main
    from attnres.train import load_config, train

    run = tmp_path / "run"
    corpus = write_corpus(tmp_path / "corpus.txt")
    train(load_config(None, overrides(corpus, run, steps=1, warmup_steps=0, eval_every=100, diagnostics_every=100)))
    out = tmp_path / "analysis"
    args = ["analyze", str(run), "--out", str(out), "--text", str(corpus), "--seq-len", "16", "--rows", "2"]
    assert cli_main(args) == 0 and (out / "mixing.png").stat().st_size > 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (import matplotlib raises ImportError)
    with pytest.warns(UserWarning, match="mixing.png is not drawn: matplotlib is not installed .*pip install .*"
                      r"\[experiments\].*the tables and mixing.json are written"):
        assert cli_main(args) == 0
    report = (out / "report.md").read_text()
    assert "![depth mixing matrices]" not in report and "mixing.png is not drawn" in report
    assert "## Semiseparable rank" in report and not (out / "mixing.png").exists()
    assert json.loads((out / "mixing.json").read_text())[0]["residual"] == "attnres_block"


def test_an_analysis_that_fails_mid_write_leaves_the_one_before_whole(tmp_path, writes_cut_short, monkeypatch):
    """report.md, mixing.json and mixing.png were written in place: a kill or a full disk mid-write
    left a file cut short where the last analysis was. Each is written beside and renamed
    into place: a failure leaves the earlier files whole, and no temporary file."""
    pytest.importorskip("yaml")
    pytest.importorskip("matplotlib")
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main
    from attnres.train import load_config, train

    cut_short, snapshot = writes_cut_short
    run = tmp_path / "run"
    corpus = write_corpus(tmp_path / "corpus.txt")
    train(load_config(None, overrides(corpus, run, steps=1, warmup_steps=0, eval_every=100, diagnostics_every=100)))
    out = tmp_path / "analysis"
    args = ["analyze", str(run), "--out", str(out), "--text", str(corpus), "--seq-len", "16", "--rows", "2"]
    assert cli_main(args) == 0
    before = snapshot(out)
    assert sorted(before) == ["mixing.json", "mixing.png", "report.md"]
    cut_short(text=True, figures=False)
    with pytest.raises(SystemExit, match=r"the analysis '.*mixing.json' could not be written: no space left"):
        cli_main(args)
    after = snapshot(out)
    assert sorted(after) == sorted(before) and after["mixing.json"] == before["mixing.json"]
    assert after["report.md"] == before["report.md"]
    monkeypatch.undo()
    cut_short(text=True, figures=False, where="report")  # (mixing.json written, the report cut short)
    with pytest.raises(SystemExit, match=r"the analysis '.*report.md' could not be written: no space left"):
        cli_main(args)
    after = snapshot(out)
    assert sorted(after) == sorted(before) and after["report.md"] == before["report.md"]
    monkeypatch.undo()
    cut_short(text=False, figures=True)
    with pytest.raises(SystemExit, match=r"the mixing figure '.*mixing.png' could not be written: no space left"):
        cli_main(args)
    assert snapshot(out) == after


def test_analyze_writes_a_step_directorys_report_beside_the_checkpoints_not_inside_one(tmp_path):
    """A run's ``keep_checkpoints`` rotation deletes old ``step-*`` directories whole: the
    default report of a step directory goes to ``<run>/analysis/step-N``; a run directory's
    (or any other's) to ``<it>/analysis``."""
    from attnres.experiments.job.analyze import default_analysis_dir

    run = tmp_path / "runs" / "block"
    assert default_analysis_dir(run / "checkpoints" / "step-00000040") == run / "analysis" / "step-00000040"
    assert default_analysis_dir(str(run)) == run / "analysis"
    assert default_analysis_dir(tmp_path / "elsewhere") == tmp_path / "elsewhere" / "analysis"
    (tmp_path / "hf-out").mkdir()
    (tmp_path / "hf-out" / "config.json").write_text("{}")  # a transformers directory: beside it, not in it
    assert default_analysis_dir(tmp_path / "hf-out") == tmp_path / "hf-out-analysis"


def test_an_export_is_analysed_as_its_run(tmp_path):
    """``attnres analyze`` read training runs only; a transformers directory (an export, an
    AttnRes model from the Hub) now analyses through its native model and its own tokenizer,
    the same matrices as the run it came from on the same text."""
    pytest.importorskip("yaml")
    pytest.importorskip("transformers")
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main
    from attnres.train import load_config, train

    run = tmp_path / "run"
    corpus = write_corpus(tmp_path / "corpus.txt")
    train(load_config(None, overrides(corpus, run, steps=3, warmup_steps=1, eval_every=100, diagnostics_every=100)))
    assert cli_main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    common = ["--text", str(corpus), "--seq-len", "16", "--rows", "3"]
    assert cli_main(["analyze", str(run), "--out", str(tmp_path / "of-run"), *common]) == 0
    assert cli_main(["analyze", str(tmp_path / "hf"), *common]) == 0
    of_run = json.loads((tmp_path / "of-run" / "mixing.json").read_text())[0]
    of_export = json.loads((tmp_path / "hf-analysis" / "mixing.json").read_text())[0]
    assert torch.allclose(torch.tensor(of_export["matrix"]), torch.tensor(of_run["matrix"]), atol=1e-6)
    assert of_export["step"] is None and of_export["checkpoint"] == str(tmp_path / "hf")
    assert f"- **A**: `{tmp_path / 'hf'}`: attnres_block" in (tmp_path / "hf-analysis" / "report.md").read_text()


def test_analyze_of_a_runs_checkpoints_folder_writes_beside_it_not_among_the_checkpoints(tmp_path):
    """``attnres analyze RUN/checkpoints`` (what tab completion offers) wrote its report into
    ``RUN/checkpoints/analysis``, among the checkpoints; now into ``RUN/analysis``."""
    from attnres.experiments.job.analyze import default_analysis_dir

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    assert default_analysis_dir(run / "checkpoints") == run / "analysis"
    assert default_analysis_dir(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "analysis"  # no run: as is


@pytest.mark.filterwarnings("ignore:model.residual.block_size .* single block")  # (S = 100 on purpose)
def test_rank_bounds_never_exceed_what_the_matrix_allows():
    """Block AttnRes's bounds were N .. N + S as written, past the most an (L+1)×(L+1)
    matrix allows: S = 1 (Full AttnRes, L = 4) had "the lower bound N = 4", which no 5×5
    matrix reaches, and S = 100 on 4 sublayers "N + S = 101"."""
    from attnres.analysis.mixing_report import rank_expectation

    words, low, high = rank_expectation("attnres_block", 4, block_size=1)
    assert (low, high) == (3, 3) and "S = 1 is Full AttnRes" in words
    words, low, high = rank_expectation("attnres_block", 4, block_size=100)
    assert (low, high) == (1, 3) and "N + S = 5" in words and "101" not in words and "one block" in words
    words, low, high = rank_expectation("attnres_block", 8, block_size=2)
    assert (low, high) == (None, 5) and "at most 5 here" in words
    assert rank_expectation("attnres_block", 16, block_size=4)[1:] == (4, 8)  # within what 17×17 allows: as written
    for L, S in ((4, 1), (4, 2), (4, 100), (8, 2), (6, 3)):  # what the measured ranks show
        rank = depth_mixing_matrix(model("attnres_block", n_layers=L // 2, perturb=1.0, block_size=S), ids()).rank
        _, low, high = rank_expectation("attnres_block", L, block_size=S)
        assert (low is None or low <= rank) and rank <= high, (L, S, rank, low, high)


def test_uniform_weights_are_not_set_against_the_bounds_of_learnt_queries():
    """An upcycle at conversion (zero pseudo-queries) has uniform weights, whose M is rank 1
    whatever N and S; attnres analyze set that against report §6.2's "between N = 3 and
    N + S = 4" (a finding "rank 1 (report §6.2: [3, 4])"), as if the conversion were wrong. The
    rank table now says the weights are uniform, and no finding sets them against the bounds."""
    from attnres.analysis.mixing_report import mixing_findings, rank_expectation, uniform_weights

    zero = depth_mixing_matrix(model("attnres_block", n_layers=3, block_size=2), ids())  # L = 6, N = 3, S = 2
    learnt = depth_mixing_matrix(model("attnres_block", n_layers=3, block_size=2, perturb=1.0), ids())
    assert zero.rank == 1 and uniform_weights(zero) and not uniform_weights(learnt)
    words, low, high = rank_expectation("attnres_block", 6, block_size=2, uniform=True)
    assert (low, high) == (None, None) and words.startswith("1: every weight uniform (zero pseudo-queries")
    assert rank_expectation("attnres_block", 6, block_size=2)[1:] == (3, 4)  # learnt queries: as the report says
    assert not any("semiseparable rank" in f for f in mixing_findings("Block", [zero], low, high))
    assert not uniform_weights(depth_mixing_matrix(model("attnres_full", n_layers=2, perturb=0.5), ids()))
    assert uniform_weights(depth_mixing_matrix(model("attnres_full", n_layers=2), ids()))


def test_the_rank_table_says_where_report_6_2_states_no_rank():
    """DenseFormer's row of `attnres analyze`'s rank table (and a residual of the user's own in a
    compare grid) had an empty "report §6.2" cell, read as a value left out by mistake."""
    from attnres.analysis.mixing_report import rank_expectation, rank_table

    for kind, streams in (("denseformer", None), ("scaled", None), ("hyper_connections", None)):
        words, low, high = rank_expectation(kind, 8, n_streams=streams)
        assert (low, high) == (None, None) and words.startswith("none stated (report §6.2 derives"), kind
    row = rank_table([("DenseFormer", [depth_mixing_matrix(model("denseformer"), ids())],
                       rank_expectation("denseformer", 6)[0])]).splitlines()[-1]
    assert row.rstrip(" |").endswith("Highway, (m)HC and AttnRes)")


def test_float32_weights_rounding_counts_for_nothing_in_the_rank():
    """SmolLM2's Block upcycle at conversion (60 sublayers, S = 8): its rank table said "2" beside
    "1: every weight uniform (rank 1 whatever N and S)" - float32 sixths one ulp apart gave a
    second singular value of 4.5e-9 of the largest, above RANK_RTOL = 1e-9, far below float32's
    precision (1.2e-7 a weight). The tolerance is the weights' dtype's (``rank_rtol``: the
    matrix's size times its machine epsilon, as numpy's ``matrix_rank``): rank 1; and a float32
    matrix of rank one per block (products rounded in float32) is rank 1."""
    from attnres.analysis.mixing import RANK_RTOL, rank_rtol
    from attnres.analysis.mixing_report import uniform_weights
    from attnres.experiments.job.analyze import _expect

    torch.manual_seed(0)
    m = AttnResLM(ModelConfig(vocab_size=64, d_model=16, n_layers=30, n_heads=2, max_seq_len=16,
                              residual={"kind": "attnres_block", "block_size": 8})).eval()  # float32, zero queries
    r = depth_mixing_matrix(m, ids())
    assert uniform_weights(r) and r.rank == 1 and r.rtol == rank_rtol(61, torch.float32) == 61 * 2.0**-23
    assert depth_mixing_matrix(m.to(F64), ids()).rtol == RANK_RTOL  # (float64 weights: as before)
    words, low, high = _expect({"residual": "attnres_block", "L": 60, "block_size": 8, "n_streams": None}, [r])
    assert (low, high) == (None, None) and words.startswith("1: every weight uniform (zero pseudo-queries")
    assert "rounding" not in words
    words = _expect({"residual": "attnres_block", "L": 60, "block_size": 8, "n_streams": None},
                    [dataclasses.replace(r, rank=2)])[0]  # (rounding above even that threshold: still said)
    assert "; the 2 measured is rounding: equal weights that differ in their last bits, above the rank's " \
           "threshold; report §6.2's bounds" in words
    a, b = torch.rand(25, dtype=torch.float32) + 0.5, torch.rand(25, dtype=torch.float32) + 0.5
    rank_one = (a[:, None] * b[None, :]).tril()  # (each block M[k:, :k + 1] is rank one, rounded in float32)
    assert int(semiseparable_rank(rank_one)) == 1
    assert int(semiseparable_rank(rank_one, rtol=RANK_RTOL)) > 1  # (the float32 rounding, counted at float64's)
    exact = depth_mixing_matrix(model("attnres_block", n_layers=3, block_size=2), ids())  # float64: rank 1, no word
    words = _expect({"residual": "attnres_block", "L": 6, "block_size": 2, "n_streams": None}, [exact])[0]
    assert exact.rank == 1 and "rounding" not in words


def test_the_sink_table_says_which_sources_it_leaves_out():
    """It showed v0 and each seed's top 4 with no word of the others: of the standard
    residual's 7 sources, v0-v3 (ties) and nothing about v4-v6."""
    from attnres.analysis.mixing_report import sink_table

    table = sink_table("standard", [depth_mixing_matrix(model("standard"), ids())])
    assert table.splitlines()[0] == ("**standard** (1 seed(s)): v0, each seed's 4 sources of highest relative weight "
                                     "and every sink; the other 3 of the 7 sources are in mixing.json")
    assert [line.split(" |")[0] for line in table.splitlines()[4:]] == ["| v0", "| v1", "| v2", "| v3"]
    small = sink_table("full", [depth_mixing_matrix(model("attnres_full", n_layers=1), ids())])
    assert small.splitlines()[0] == "**full** (1 seed(s))"  # all 3 shown


def test_the_rank_table_says_per_seed_what_each_rank_is_over(tmp_path):
    """A seed without checkpoint has only its logged averaged M: the "over" column named the
    first seed's alone ("largest over every token") for both."""
    from attnres.analysis import forward_diagnostics
    from attnres.analysis.mixing import depth_mixing_from_logged
    from attnres.analysis.mixing_report import rank_table

    m = model("attnres_full", perturb=1.0)
    measured = depth_mixing_matrix(m, ids())
    logged = depth_mixing_from_logged(m.residual, forward_diagnostics(m, ids())["depth_weights"])
    row = rank_table([("Full", [measured, logged], "")]).splitlines()[2]
    assert row.split(" | ")[3] == ("largest over every token (16 tokens); the logged token-averaged M only (no "
                                   "checkpoint) (per seed)"), row
    assert rank_table([("Full", [measured, measured], "")]).splitlines()[2].split(" | ")[3] == \
        "largest over every token (16 tokens)"


def test_a_rank_over_fewer_tokens_than_the_matrix_says_so():
    """The rank of an input-dependent M is taken over its first ``rank_tokens`` tokens (256;
    ``attnres analyze`` averages M over 1024 by default): the report said "averaged over 1024
    tokens" and "largest over every token (256 tokens)". It names the first 256 of the 1024."""
    from attnres.analysis.mixing_report import rank_table

    m = model("attnres_full", perturb=1.0)
    part = depth_mixing_matrix(m, ids(), rank_tokens=8)  # ids(): 16 tokens
    assert part.rank_tokens == 8 and part.n_tokens == 16
    assert part.rank_over == "largest over every token of the first 8 of the 16 tokens"
    assert rank_table([("Full", [part], "")]).splitlines()[2].split(" | ")[3] == part.rank_over
    assert "(largest over every token of the first 8 of the 16 tokens;" in repr(part)
    hw = depth_mixing_matrix(model("highway", n_layers=6, perturb=0.5), ids(), rank_tokens=8)
    assert hw.rank_over == "largest over every token and channel of the first 8 of the 16 tokens"


def test_the_mixing_json_of_a_run_without_checkpoint_is_strict_json(tmp_path):
    """A run whose checkpoints are gone is read from its logged depth weights: no spread
    across tokens (NaN), which mixing.json wrote as ``NaN`` - not JSON; now ``null``."""
    pytest.importorskip("matplotlib")
    from attnres.analysis import forward_diagnostics
    from attnres.experiments.job.analyze import mixing_section

    m = model("attnres_full", perturb=1.0)
    run = tmp_path / "full" / "seed0"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": m.config.to_dict()}))
    weights = forward_diagnostics(m, ids())["depth_weights"]
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "diagnostics", "step": 4, "depth_weights": weights}) + "\n")
    assert mixing_section({"full": [run]}, tmp_path) is not None

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    (entry,) = json.loads((tmp_path / "mixing.json").read_text(), parse_constant=refuse)["full"]
    assert entry["n_tokens"] == 0 and entry["std"][0][0] is None and entry["sources"][0]["cv"] is None


def test_analyze_compare_of_models_of_different_depth_says_why_there_is_no_difference(tmp_path):
    """``attnres analyze A --compare B`` of a 2-block and a 3-block model left out its whole
    "Comparison" section (ranks and sinks too) without a word, as the matrices do not line up;
    its sinks were printed as Python lists (``['v3']``)."""
    pytest.importorskip("yaml")
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main
    from attnres.train import load_config, train

    corpus = write_corpus(tmp_path / "corpus.txt")
    for name, layers in (("two", 2), ("three", 3)):
        train(load_config(None, overrides(corpus, tmp_path / name, steps=1, warmup_steps=0, eval_every=100,
                                          diagnostics_every=100, **{"model.n_layers": layers})))
    out = tmp_path / "analysis"
    assert cli_main(["analyze", str(tmp_path / "two"), "--compare", str(tmp_path / "three"), "--out", str(out),
                     "--text", str(corpus), "--seq-len", "16", "--rows", "2"]) == 0
    text = (out / "report.md").read_text()
    comparison = text[text.index("## Comparison"):text.index("## Findings")]
    assert "- No difference of the matrices: A's M is 5×5 and B's 7×7 (models of different depth" in comparison
    assert "- Rank: A " in comparison and "- Sinks: A " in comparison and "[" not in comparison


def test_analyze_compare_draws_both_models_on_one_colour_scale(tmp_path, monkeypatch):
    """``attnres analyze A --compare B`` coloured A's and B's panels each on its own scale: one
    colour was two weights, and two models' matrices looked alike whatever their difference.
    Both now share one norm and one colour bar; the difference A - B keeps its own diverging
    scale (centred on 0) and colour bar."""
    pytest.importorskip("yaml")
    pytest.importorskip("matplotlib")
    import numpy as np
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main
    from attnres.experiments.job import analyze
    from attnres.train import load_config, train

    corpus = write_corpus(tmp_path / "corpus.txt")
    for name, residual in (("block", "attnres_block"), ("full", "attnres_full")):
        train(load_config(None, overrides(corpus, tmp_path / name, steps=1, warmup_steps=0, eval_every=100,
                                          diagnostics_every=100, **{"model.residual": residual})))
    drawn = []
    plot = analyze.plot_mixing_panels
    monkeypatch.setattr(analyze, "plot_mixing_panels", lambda *a, **k: drawn.append(plot(*a, **k)) or drawn[-1])
    out = tmp_path / "analysis"
    assert cli_main(["analyze", str(tmp_path / "block"), "--compare", str(tmp_path / "full"), "--out", str(out),
                     "--text", str(corpus), "--seq-len", "16", "--rows", "2"]) == 0
    (fig,) = drawn
    a, b, diff = (ax.images[0] for ax in fig.axes if ax.images)
    assert a.norm is b.norm and diff.norm is not a.norm
    values = [x for im in (a, b) for x in np.asarray(im.get_array(), dtype=float).ravel() if np.isfinite(x)]
    assert (a.norm.vmin, a.norm.vmax) == pytest.approx((min(values), max(values)))
    assert diff.norm.vmin == -diff.norm.vmax
    assert len(fig.axes) == 5  # three panels, one colour bar for A and B, one for A - B
    assert (out / "mixing.png").stat().st_size > 0
    single = analyze.plot_mixing_panels([("M", torch.eye(3), None), ("N", 2 * torch.eye(3), None)])
    assert single.axes[0].images[0].norm is not single.axes[1].images[0].norm  # (own scales, unless asked)


def test_analyze_compare_of_a_model_with_itself_is_refused(tmp_path, capsys):
    """``attnres analyze A --compare A`` ran both analyses and wrote a report of a zero
    difference without a word. The same model - named as the run, its checkpoints folder or its
    newest step directory - is refused before anything is analysed; an earlier step is another
    model."""
    from attnres.cli import main as cli_main
    from attnres.experiments.job.analyze import write_analysis

    run = tmp_path / "run"
    for step in (1, 2):
        (run / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step-{step}" / "state.json").write_text(json.dumps({"step": step}))
    newest = run / "checkpoints" / "step-2"
    for a, b in ((run, run), (run, newest), (run / "checkpoints", newest), (newest, tmp_path / "." / "run")):
        with pytest.raises(ValueError, match=r"is the model analysed \(.*step-2\): a comparison with itself shows no "
                                             r"difference; give another run's checkpoint"):
            write_analysis(a, b, tmp_path / "out")
    with pytest.raises(SystemExit, match=r"attnres analyze: error: --compare '.*run' is the model analysed"):
        cli_main(["analyze", str(run), "--compare", str(run), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    from attnres.checkpoint import CheckpointError

    # an earlier step is another model: it gets as far as loading (these state.json files are no checkpoint's)
    with pytest.raises(CheckpointError, match="is not an attnres checkpoint manifest"):
        write_analysis(run, run / "checkpoints" / "step-1", tmp_path / "out")


def test_an_all_nan_panel_draws_without_warning_and_says_it_has_nothing_to_show():
    """A diff panel of only NaN (two models whose mixing was not finite) warned numpy's "All-NaN
    slice encountered" and drew a blank panel, as if the difference were drawn and empty. No
    warning now; that panel, and any other without a finite value, says there is nothing to show."""
    pytest.importorskip("matplotlib")
    import warnings

    from attnres.analysis.mixing_report import plot_mixing_panels

    nan = torch.full((3, 3), float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = plot_mixing_panels([("A", torch.eye(3), None), ("B", nan, None)], diff=("A - B", nan))
    said = [[t.get_text() for t in ax.texts] for ax in fig.axes if ax.images]
    assert said == [[], ["nothing to show:\nno finite value"], ["nothing to show:\nno finite value"]]
