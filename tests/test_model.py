"""The language model: two-phase vs naive end to end, spec facts, config and input validation."""

from __future__ import annotations

import copy
import importlib.util
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    GRAD_TOL,
    TOL,
    assert_fast_matches_naive,
    assert_rel_close,
    make_model,
    twin_with_schedule,
)
from warning_checks import warned
from torch.func import functional_call

import attnres
from attnres import AttnResLM, ModelConfig, registered_residuals
from attnres.nn import BlockAttnRes, FullAttnRes, StandardResidual
from attnres.models.trunk import run_sublayers
from attnres.nn.residual import AttnResAblation, DepthHistory, ResidualConfig, ResidualStream, residual_class
from attnres.train import TrainConfig

# (overrides, batch, seq): S dividing L, S not dividing L, S = 1, S >= L, odd widths, batch 1, seq 1.
SHAPES = [
    (dict(residual={"kind": "attnres_block", "block_size": 2}, n_layers=2), 2, 5),
    (dict(residual={"kind": "attnres_block", "block_size": 4}, n_layers=3), 2, 7),
    (dict(residual={"kind": "attnres_block", "block_size": 1}, n_layers=3), 1, 5),
    pytest.param(dict(residual={"kind": "attnres_block", "block_size": 9}, n_layers=2), 2, 1,  # (one block: warned)
                 marks=pytest.mark.filterwarnings("ignore:model.residual.block_size .* single block")),
    (dict(residual={"kind": "attnres_block", "block_size": 5}, n_layers=3, d_model=36, n_heads=3, n_kv_heads=1, vocab_size=37), 1, 3),
    (dict(residual="attnres_full", n_layers=3), 2, 5),
    (dict(residual={"kind": "attnres_full", "full_group_size": 4}, n_layers=3, d_model=36, n_heads=3, n_kv_heads=3, vocab_size=37), 1, 1),
]


def loss_and_grads(model, ids):
    out = model(ids, labels=ids) if ids.shape[1] > 1 else None
    if out is None:  # a single token has no next-token loss: use a fixed projection of the logits
        logits = model(ids).logits
        g = torch.Generator().manual_seed(5)
        loss = (logits * torch.randn(logits.shape, generator=g).to(logits.dtype)).sum()
        out_logits = logits
    else:
        loss, out_logits = out.loss, out.logits
    names = [n for n, p in model.named_parameters()]
    grads = torch.autograd.grad(loss, [p for p in model.parameters()])
    return out_logits, loss, dict(zip(names, grads))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overrides, batch, seq", SHAPES)
def test_two_phase_model_equals_naive_model(overrides, batch, seq, dtype):
    fast64 = make_model(torch.float64, **overrides)
    ids = torch.randint(0, fast64.config.vocab_size, (batch, seq))
    truth = loss_and_grads(twin_with_schedule(fast64, "naive"), ids)
    fast = copy.deepcopy(fast64).to(dtype)
    naive = twin_with_schedule(fast, "naive")
    lf, loss_f, gf = loss_and_grads(fast, ids)
    ln, loss_n, gn = loss_and_grads(naive, ids)
    assert_fast_matches_naive([lf, loss_f.reshape(1)], [ln, loss_n.reshape(1)], [truth[0], truth[1].reshape(1)], dtype, ["logits", "loss"], TOL[dtype])
    assert gf.keys() == gn.keys()
    assert_fast_matches_naive(gf.values(), gn.values(), truth[2].values(), dtype, [f"grad of {n}" for n in gf], GRAD_TOL[dtype])


@pytest.mark.parametrize("residual", ["standard", "attnres_full", "attnres_block"])
def test_gradcheck_two_layer_model(residual):
    """float64 gradcheck of the loss w.r.t. the residual parameters, the embedding and one
    projection of each sublayer type, on a 2-layer model."""
    cfg = ModelConfig(vocab_size=11, d_model=8, n_layers=2, n_heads=2, mlp_hidden=12, max_seq_len=8, residual={"kind": residual, "block_size": 3})
    torch.manual_seed(0)
    model = AttnResLM(cfg).double()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.startswith("residual."):
                p.add_(torch.randn_like(p))
    ids = torch.randint(0, 11, (2, 4))
    chosen = [n for n, _ in model.named_parameters() if n.startswith("residual.")]
    chosen += ["embed_tokens.weight", "layers.0.attn.q_proj.weight", "layers.1.mlp.down_proj.weight"]
    params = dict(model.named_parameters())
    inputs = tuple(params[n].detach().clone().requires_grad_() for n in chosen)

    def loss_fn(*values):
        return functional_call(model, dict(zip(chosen, values)), (ids,), {"labels": ids}).loss

    assert torch.autograd.gradcheck(loss_fn, inputs)


def test_two_phase_is_the_default_and_faithful_defaults():
    cfg = ModelConfig()
    assert cfg.residual.kind == "attnres_block" and cfg.residual.schedule == "two_phase"
    model = AttnResLM(ModelConfig.preset("tiny"))
    assert isinstance(model.residual, BlockAttnRes) and model.residual.schedule == "two_phase"
    for mixer in model.residual.mixers:
        assert torch.equal(mixer.query, torch.zeros_like(mixer.query))
        assert torch.equal(mixer.key_norm.weight, torch.ones_like(mixer.key_norm.weight))


@pytest.mark.parametrize("residual, cls", [("standard", StandardResidual), ("attnres_full", FullAttnRes), ("attnres_block", BlockAttnRes)])
def test_residual_field_picks_variant_and_param_count(residual, cls):
    model = make_model(residual=residual, randomize=False)
    assert isinstance(model.residual, cls)
    L, d = model.config.n_sublayers, model.config.d_model
    assert model.residual_parameters() == (0 if residual == "standard" else 2 * (L + 1) * d)


def test_zero_queries_survive_global_init_passes():
    """Spec §8: a global init pass must not overwrite the zero pseudo-queries."""
    model = make_model(randomize=False)

    def hf_style(module):
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.02)

    def every_matrix(model):
        for p in model.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)

    model.apply(hf_style)
    every_matrix(model)
    for mixer in model.residual.mixers:
        assert torch.equal(mixer.query, torch.zeros_like(mixer.query))
    # And the model's own init pass re-zeroes queries last.
    with torch.no_grad():
        for mixer in model.residual.mixers:
            mixer.query.fill_(1.0)
    model.init_weights()
    assert all(torch.equal(m.query, torch.zeros_like(m.query)) for m in model.residual.mixers)


def test_conventional_structure_and_top_level_exports():
    assert attnres.AttnResLM is AttnResLM and attnres.ModelConfig is ModelConfig
    model = make_model(randomize=False)
    layer = model.layers[0]
    for name in ("attn_norm", "attn", "mlp_norm", "mlp"):
        assert hasattr(layer, name)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert isinstance(getattr(layer.attn, name), torch.nn.Linear)
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert isinstance(getattr(layer.mlp, name), torch.nn.Linear)
    assert isinstance(model.embed_tokens, torch.nn.Embedding) and isinstance(model.lm_head, torch.nn.Linear)
    assert layer.attn.k_proj.out_features == model.config.kv_heads * model.config.head_dim  # grouped-query


def test_loss_is_shifted_cross_entropy_with_ignore_index():
    model = make_model()
    ids = torch.randint(0, 256, (2, 6))
    labels = ids.clone()
    labels[0, 3] = -100
    out = model(ids, labels=labels)
    ref = F.cross_entropy(out.logits[:, :-1].reshape(-1, 256), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(out.loss, ref)


def test_depth_weights_output():
    model = make_model(residual={"kind": "attnres_block", "block_size": 4}, n_layers=3)
    ids = torch.randint(0, 256, (2, 5))
    out = model(ids, return_depth_weights=True)
    w = out.depth_weights
    assert len(w) == model.config.n_sublayers + 1
    assert [x.shape[0] for x in w] == model.residual.sources_per_mixer()
    assert all(x.shape[1:] == (2, 5) and x.dtype == torch.float32 for x in w)
    assert model(ids).depth_weights is None
    assert make_model(residual="standard")(ids, return_depth_weights=True).depth_weights is None


def test_causality():
    """Changing a later token never changes earlier logits, for every variant."""
    for residual in ("standard", "attnres_full", "attnres_block"):
        model = make_model(residual=residual)
        ids = torch.randint(0, 256, (1, 8))
        other = ids.clone()
        other[0, 5:] = (other[0, 5:] + 1) % 256
        assert torch.allclose(model(ids).logits[:, :5], model(other).logits[:, :5], atol=1e-6)


def test_bf16_autocast_keeps_depth_attention_in_fp32():
    model = make_model(residual="attnres_block")
    ids = torch.randint(0, 256, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=ids, return_depth_weights=True)
    assert torch.isfinite(out.loss)
    assert all(w.dtype == torch.float32 for w in out.depth_weights)
    ref = model(ids, labels=ids)
    assert abs(out.loss.item() - ref.loss.item()) < 0.05


@pytest.mark.parametrize("residual", [k for k in registered_residuals() if residual_class(k).builtin()])
def test_autocast_stream_stores_the_stream_in_the_autocast_dtype(residual):
    """``residual.autocast_stream``: under bf16 autocast every tensor of the stream (the
    history depth attention reads, the running sum, the final hidden state) is bf16, where
    by default it keeps the embedding's float32; the loss moves by rounding only, and every
    depth query still gets a gradient. Outside autocast the option changes nothing, bit for bit."""
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))

    def run(autocast_stream: bool, autocast: bool):
        model = make_model(residual={"kind": residual, "autocast_stream": autocast_stream})
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            h, state = model.decode(ids)
            stream = [h]
            if residual_class(residual).history_layout is not ResidualStream.history_layout:  # (can be cut)
                history = model.residual.history(state)
                stream += [*history.completed, *([history.running] if history.running is not None else [])]
            loss = model(ids, labels=ids).loss
        loss.backward()
        return {t.dtype for t in stream}, loss, model

    dtypes, loss, model = run(True, autocast=True)
    assert dtypes == {torch.bfloat16}
    default_dtypes, default_loss, _ = run(False, autocast=True)
    assert default_dtypes == {torch.float32}
    assert abs(loss.item() - default_loss.item()) < 0.02
    queries = [p for n, p in model.named_parameters() if n.startswith("residual.")]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in queries)
    if model.residual.has_depth_attention:
        assert any(p.grad.abs().sum() > 0 for p in queries)
    _, plain, _ = run(True, autocast=False)
    _, plain_default, _ = run(False, autocast=False)
    assert plain.dtype == torch.float32 and torch.equal(plain, plain_default)
    meta = torch.empty(2, 6, model.config.d_model, device="meta")  # (shape queries: no autocast state to ask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert copy.deepcopy(model.residual).to("meta").start(meta).dtype == torch.float32


@pytest.mark.parametrize("residual", ["standard", "attnres_block", "attnres_full"])
def test_autocast_norm_output_rounds_each_sublayer_input_once(residual):
    """``residual.autocast_norm_output``: under bf16 autocast each sublayer's norm returns
    bf16 - the logits are the default's bit for bit (the linear layers read the same
    values; AttnRes' merges write them, backend ``"torch"``: the same arithmetic), with
    fewer casts in the standard model (the q, k, v projections and the MLP's gate and up
    each cast a float32 input: 5 a layer; now each norm casts its output once) - AttnRes'
    merges write the autocast dtype by default already (one view for each reader:
    test_fused_norms_hand_each_reader_a_bf16_view_and_add_their_gradients_in_float32) -,
    and the gradients are the default's up to the bf16 sums of the projections' input
    gradients. Outside autocast it changes nothing, bit for bit."""
    from test_depth_attention_ops import OperatorLog

    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))

    def run(option: bool, autocast: bool = True):
        model = make_model(residual={"kind": residual, "autocast_norm_output": option, "backend": "torch"})
        log = OperatorLog()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with log:
                logits = model(ids).logits
        logits.float().square().mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return logits, log.names.count("aten._to_copy"), grads

    logits, casts, grads = run(True)
    want_logits, want_casts, want_grads = run(False)
    assert torch.equal(logits, want_logits)
    layers = ModelConfig.preset("tiny").n_layers
    assert want_casts - casts == (3 * layers if residual == "standard" else 0), (want_casts, casts)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        assert_rel_close(g, want_grads[name], GRAD_TOL[torch.bfloat16], name)
    plain, _, _ = run(True, autocast=False)
    assert torch.equal(plain, run(False, autocast=False)[0])


@pytest.mark.parametrize("residual", ["attnres_block", "attnres_full"])
def test_autocast_phase1_sums_stores_phase1_sums_in_bf16(residual, monkeypatch):
    """``residual.autocast_phase1_sums``: under bf16 autocast Phase 1 writes its weighted sums
    in bf16 (the stream stays float32); the loss moves by rounding only, every depth query
    gets a gradient, and the recomputed sums (``recompute_phase1``) are the kept ones bit for
    bit, in bf16 too. Outside autocast, or unfused (each sublayer's norm its own), the option
    changes nothing it should not: the same logits bit for bit without autocast."""
    from attnres.ops.depth_attention import library

    written: list[torch.dtype] = []
    phase1 = library.phase1

    def spy(*args, **kwargs):
        outs, lse = phase1(*args, **kwargs)
        written.append(outs[0].dtype)
        return outs, lse

    monkeypatch.setattr(library, "phase1", spy)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))

    def run(option: bool, autocast: bool = True, recompute: bool = True):
        written.clear()
        model = make_model(residual={"kind": residual, "block_size": 2, "autocast_phase1_sums": option,
                                     "recompute_phase1": recompute})
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        return out, set(written), grads

    out, dtypes, grads = run(True)
    assert dtypes == {torch.bfloat16}
    default, default_dtypes, _ = run(False)
    assert default_dtypes == {torch.float32}
    assert abs(out.loss.item() - default.loss.item()) < 0.02
    queries = {n: g for n, g in grads.items() if n.startswith("residual.")}
    assert all(g is not None and torch.isfinite(g).all() for g in queries.values())
    assert any(g.abs().sum() > 0 for g in queries.values())
    kept, _, kept_grads = run(True, recompute=False)
    assert torch.equal(out.loss, kept.loss)
    for name, g in grads.items():
        assert torch.equal(g, kept_grads[name]), name
    plain, plain_dtypes, _ = run(True, autocast=False)
    assert plain_dtypes == {torch.float32} and torch.equal(plain.logits, run(False, autocast=False)[0].logits)


@pytest.mark.parametrize("residual", ["attnres_block", "attnres_full"])
def test_autocast_phase1_sums_leave_every_sublayer_input_in_the_stream_dtype(residual):
    """Through the residual protocol, unfused (each sublayer's norm its own: an upcycled
    family's) and fused: with Phase 1's sums in bf16 every sublayer input and the final state
    stay float32, each within one bf16 rounding of the option-off value."""
    from attnres.nn.residual import build_residual

    d, L = 16, 8
    g = torch.Generator().manual_seed(0)
    embedding = torch.randn(2, 3, d, generator=g)
    outputs = [torch.randn(2, 3, d, generator=g) for _ in range(L)]
    from attnres.nn import RMSNorm
    from attnres.nn.norm import FusableNormInput

    norm = RMSNorm(d)

    def run(option: bool, fused: bool):
        torch.manual_seed(0)
        module = build_residual(ResidualConfig(kind=residual, block_size=2, autocast_phase1_sums=option), d, L)
        for q in module.parameters():
            torch.nn.init.normal_(q, generator=g.manual_seed(1))
        inputs = []
        with torch.autocast("cpu", dtype=torch.bfloat16):
            state = module.start(embedding, defer_norm=fused)
            for l in range(L):
                h = module.sublayer_input(state, l)
                inputs.append(h.normalized(norm) if isinstance(h, FusableNormInput) else h)
                module.add_output(state, l, outputs[l])
            inputs.append(module.finish(state))
        return inputs

    for fused in (False, True):
        got, want = run(True, fused), run(False, fused)
        for l, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype == torch.float32, (l, fused)
            assert_rel_close(a, b, 2**-8, f"sublayer {l} (fused: {fused})")


@pytest.mark.parametrize("residual, schedule", [("standard", "two_phase"), ("attnres_block", "naive"),
                                                ("mhc", "two_phase")])
def test_autocast_phase1_sums_needs_an_attnres_two_phase_schedule(residual, schedule):
    with pytest.raises(ValueError, match=r"ModelConfig.residual.autocast_phase1_sums applies to Full and Block "
                                         rf"AttnRes' two-phase schedule .* residual '{residual}' with schedule "
                                         rf"'{schedule}' has none"):
        make_model(residual={"kind": residual, "schedule": schedule, "autocast_phase1_sums": True})


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("residual", ["attnres_block", "attnres_full"])
def test_fused_norms_hand_each_reader_a_bf16_view_and_add_their_gradients_in_float32(residual, backend, monkeypatch):
    """Under bf16 autocast with a float32 stream, a merge that applies a sublayer's norm
    writes bf16 - as each of the sublayer's linear layers (q, k, v; gate, up) would round a
    float32 output - and hands each its own view, so that their input gradients reach the
    merge's backward separately and are added there in float32, as autograd adds the
    gradients of the casts of a float32 output. The logits are those of the unfused path
    (one tensor for all readers, cast by each linear) bit for bit, every gradient up to the
    order of the float32 additions. On the CPU the implementations convert the output once
    and its gradient once (the Triton kernels write and read bf16 themselves:
    test_depth_attention_ops): 3 casts a layer fewer each way, and the 3 additions a layer
    of the readers' gradients gone."""
    from test_depth_attention_ops import OperatorLog

    from attnres.nn import transformer

    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    layers = 4

    def run(views: bool):
        if not views:
            monkeypatch.setattr(transformer.Attention, "input_readers", 1)
            monkeypatch.setattr(transformer.SwiGLU, "input_readers", 1)
        model = make_model(residual={"kind": residual, "block_size": 2, "backend": backend}, n_layers=layers)
        forward, backward = OperatorLog(), OperatorLog()
        with torch.autocast("cpu", dtype=torch.bfloat16), forward:
            logits = model(ids).logits
        loss = logits.float().square().mean()
        with backward:
            loss.backward()
        monkeypatch.undo()
        counts = [log.names.count(op) for log in (forward, backward) for op in ("aten._to_copy", "aten.add")]
        return logits, counts, {n: p.grad for n, p in model.named_parameters()}

    logits, counts, grads = run(True)
    want_logits, want_counts, want_grads = run(False)
    assert [a - b for a, b in zip(want_counts, counts)] == [3 * layers, 0, 3 * layers, 3 * layers], (want_counts,
                                                                                                       counts)
    assert torch.equal(logits, want_logits)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        assert_rel_close(g, want_grads[name], 1e-5, name)


@pytest.mark.parametrize("backend", ["auto", "torch", pytest.param("triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"))])
def test_block_merges_read_an_autocast_output_in_its_own_dtype(backend, monkeypatch):
    """Under bf16 autocast with a float32 stream, Block AttnRes (two-phase) hands each output
    that is not a block's first to the next merge as it is (bf16): the merge forms the
    partial sum in float32 - the same sum as after casting the output, so the logits and
    every gradient are those of casting first, bit for bit - without the cast, one
    ``aten._to_copy`` fewer per such output (4 sublayers in blocks of 2: 2). (The Triton
    kernels also write that output's gradient in bf16, which Triton's interpreter converts
    by truncation - a GPU rounds to the nearest, as the cast's backward: there within bf16
    rounding.)"""
    from test_depth_attention_ops import OperatorLog

    from attnres.nn.residual import block

    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))

    def run(as_is: bool):
        if not as_is:
            monkeypatch.setattr(block._TwoPhase, "reads_output_as_is", lambda *args: False)
        model = make_model(residual={"kind": "attnres_block", "block_size": 2, "backend": backend}, n_layers=2)
        log = OperatorLog()
        with torch.autocast("cpu", dtype=torch.bfloat16), log:
            logits = model(ids).logits
        logits.float().square().mean().backward()
        monkeypatch.undo()
        return logits, log.names.count("aten._to_copy"), {n: p.grad for n, p in model.named_parameters()}

    logits, casts, grads = run(True)
    want_logits, want_casts, want_grads = run(False)
    assert torch.equal(logits, want_logits)
    assert want_casts - casts == 2, (want_casts, casts)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        if backend == "triton":  # (the kernels write the output's gradient in bf16: Triton's interpreter
            assert_rel_close(g, want_grads[name], GRAD_TOL[torch.bfloat16], name)  # truncates, a GPU rounds)
        else:
            assert torch.equal(g, want_grads[name]), name


def test_autocast_stream_applies_to_a_resumed_stream():
    """A pipeline stage resumes from a history sent as float32 (its wire dtype): with
    ``autocast_stream`` the resumed stream is bf16 again and continues exactly as the
    unsent one (the bf16 -> float32 -> bf16 round trip is exact)."""
    model = make_model(residual={"kind": "attnres_block", "block_size": 4, "autocast_stream": True}, n_layers=4)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    residual, blocks = model.residual, list(enumerate(model.layers))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        x = model.embed_tokens(ids)
        cos, sin, mask = model.positions(ids, None, 0)
        outs = []
        for sent in (False, True):
            state = residual.start(x)
            run_sublayers(residual, state, blocks[:3], cos, sin, mask)  # (sublayer 6: inside a block)
            if sent:
                history = residual.history(state)
                wire = DepthHistory([t.float() for t in history.completed],
                                    None if history.running is None else history.running.float())
                state = residual.resume(wire, state.next_sublayer)
                assert wire.running is not None
                assert {t.dtype for t in [*residual.history(state).completed, residual.history(state).running]} == \
                    {torch.bfloat16}
            run_sublayers(residual, state, blocks[3:], cos, sin, mask)
            outs.append(residual.finish(state))
    assert outs[1].dtype == torch.bfloat16 and torch.equal(outs[0], outs[1])


def test_tied_embeddings():
    model = make_model(tie_embeddings=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("residual.block_size", 0, "integer >= 1"),
        ("residual.block_size", -2, "integer >= 1"),
        ("residual.block_size", 2.5, "integer >= 1"),
        ("d_model", 90, "divisible by n_heads"),
        ("d_model", 36, "head dimension d_model / n_heads is even"),
        ("residual.kind", "attnres_fancy", "'standard', 'attnres_full', 'attnres_block', 'rezero'"),
        ("residual.schedule", "fast", "'two_phase', 'naive'"),
        ("residual.backend", "cuda", "'auto', 'torch', 'triton', 'reference'"),
        ("residual.eps", 0.0, "> 0"),
        ("residual.hc_streams", 0, "integer >= 1"),
        ("residual.ablation.heads", 5, "divisor of d_model"),
        ("n_kv_heads", 3, "divisor of n_heads=4: 1, 2 or 4 (or null: = n_heads)"),  # (the ones it takes: a preset's
        # n_kv_heads=2 met model.n_heads=3 with no word of what would do)
        ("n_layers", 0, "integer >= 1"),
        ("vocab_size", True, "integer >= 1"),
        ("norm_eps", -1.0, "> 0"),
        ("residual.full_group_size", 0, "integer >= 1"),
        ("tie_embeddings", "yes", "true or false"),
        ("residual.autocast_stream", "yes", "true or false"),
    ],
)
def test_invalid_config_names_field_and_allowed_values(field, value, allowed):
    change = {field.split(".")[-1]: value}
    for part in reversed(field.split(".")[:-1]):  # "residual.ablation.heads" -> {"residual": {"ablation": {"heads": 5}}}
        change = {part: change}
    if field.startswith("residual.ablation"):
        change["residual"]["schedule"] = "naive"
    with pytest.raises(ValueError) as info:
        ModelConfig.preset("tiny", **change)
    msg = str(info.value)
    assert f"ModelConfig.{field}" in msg and allowed in msg and repr(value) in msg


def test_residual_config_takes_numpy_scalars_as_the_python_numbers_they_hold():
    """``residual={"block_size": np.int64(4)}`` (a notebook's sweep over an array) was refused:
    "ModelConfig.residual.block_size must be an integer >= 1 ...; got np.int64(4)", where
    ModelConfig and TrainConfig take them. An array, and a bool for an integer, still are."""
    np = pytest.importorskip("numpy")
    residual = {"block_size": np.int64(3), "eps": np.float32(0.5), "schedule": np.str_("naive"),
                "recompute_phase1": np.bool_(False), "full_group_size": np.int32(2), "ablation": {"heads": np.int64(2)}}
    r = ModelConfig.preset("tiny", residual=residual).residual
    values = (r.block_size, r.eps, r.schedule, r.recompute_phase1, r.full_group_size, r.ablation.heads)
    assert values == (3, 0.5, "naive", False, 2, 2)
    assert [type(v) for v in values] == [int, float, str, bool, int, int]
    options = {"init": np.float32(0.25)}
    user = ResidualConfig(kind="standard", options=options)
    user.check_fields(64)  # (the options of a user's variant: config.json stores them)
    assert type(user.options["init"]) is float and type(options["init"]) is np.float32  # (the caller's mapping kept)
    with pytest.raises(ValueError, match=r"ModelConfig.residual.block_size must be an integer >= 1, or null .*; got True$"):
        ModelConfig.preset("tiny", residual={"block_size": np.bool_(True)})
    with pytest.raises(ValueError, match=r"ModelConfig.residual.recompute_phase1 must be true or false; got 1$"):
        ModelConfig.preset("tiny", residual={"recompute_phase1": np.int64(1)})
    with pytest.raises(ValueError, match=r"ModelConfig.residual.block_size must be an integer .*; got array\(\[4\]\)$"):
        ModelConfig.preset("tiny", residual={"block_size": np.array([4])})


def test_registered_variant_names_are_the_allowed_residuals():
    with pytest.raises(ValueError) as info:
        ModelConfig(residual="nope")
    for name in registered_residuals():
        assert repr(name) in str(info.value)


@pytest.mark.parametrize("kind", ["standard", "attnres_full"])
def test_a_config_read_back_does_not_warn_of_residual_fields_no_one_wrote(kind):
    """``ModelConfig(**config.to_dict())`` and ``TrainConfig(model=config.to_dict())`` of
    ``ModelConfig.preset("tiny", residual=kind)`` warned of the preset's own block size, a field
    the user never wrote (``preset`` keeps it quietly), and ``TrainConfig`` of the defaults
    ``hc_streams=4`` and ``sinkhorn_iters=20`` too: three warnings. A residual mapping of every
    field, as ``to_dict()`` and config.json write it, is a config read back: not warned of. A
    field the user states is, beside it or over it (ModelConfig, TrainConfig, a preset's
    overrides)."""
    def unread(call) -> list[str]:
        return warned(call, " is read only by ")

    config = ModelConfig.preset("tiny", residual=kind)
    assert unread(lambda: ModelConfig(**config.to_dict())) == []
    assert unread(lambda: TrainConfig(model=config.to_dict())) == []
    assert unread(lambda: ModelConfig.preset("tiny", **config.to_dict())) == []
    own = {**config.to_dict(), "residual": {"kind": kind, "block_size": 3}}
    for call in (lambda: ModelConfig(**own), lambda: TrainConfig(model=own), lambda: ModelConfig.preset("tiny", **own),
                 lambda: ModelConfig.preset("tiny", **config.to_dict(), attnres_block_size=3)):
        said = unread(call)
        assert len(said) == 1 and said[0].startswith("model.residual.block_size=3 is read only by attnres_block"), said


def test_a_config_built_again_of_the_same_residual_is_no_new_statement():
    """``dataclasses.replace(config, n_layers=4)`` and ``ModelConfig(residual=config.residual)``
    of ``ModelConfig.preset("tiny", residual="standard")`` warned of the preset's own block size
    (the first at a line of dataclasses.py): the ResidualConfig, checked when the config was
    made, was checked again as the user's statement. Once per object, as the single block; a
    field changed since is warned of."""
    import dataclasses

    def unread(call) -> list[str]:
        return warned(call, " is read only by ")

    config = ModelConfig.preset("tiny", residual="standard")
    assert unread(lambda: dataclasses.replace(config, n_layers=4)) == []
    assert unread(lambda: ModelConfig(residual=config.residual)) == []
    own = ResidualConfig(kind="attnres_full", block_size=4)
    assert len(unread(lambda: ModelConfig(residual=own))) == 1
    assert unread(lambda: ModelConfig(residual=own, n_layers=4)) == []
    own.block_size = 3
    said = unread(lambda: ModelConfig(residual=own))
    assert len(said) == 1 and said[0].startswith("model.residual.block_size=3 is read only by attnres_block"), said


def test_a_printed_config_used_as_a_config_file_warns_only_of_what_its_overrides_state(tmp_path):
    """``attnres train --print-config`` writes every residual field; the printed config given
    back as ``--config`` warned of its ``hc_streams: 4`` and ``sinkhorn_iters: 20`` (defaults no
    one wrote) under the default Block AttnRes. A residual section of every field gives its
    fields other than the defaults; a field its variant does not read that an override states
    still warns, once."""
    from attnres.train.config import load_config, yaml_dump

    def unread(call) -> list[str]:
        return warned(call, " is read only by ")

    printed = tmp_path / "printed.yaml"
    printed.write_text(yaml_dump(load_config(None, []).to_dict()))
    assert unread(lambda: load_config(printed)) == []
    for overrides, name in ((["model.residual.hc_streams=8"], "hc_streams=8"),
                            (["model.residual.kind=attnres_full", "model.residual.block_size=8"], "block_size=8")):
        said = unread(lambda: load_config(printed, overrides))
        assert len(said) == 1 and said[0].startswith(f"model.residual.{name} is read only by "), said


def test_legacy_flat_keys_load_with_a_deprecation_warning():
    """Configs saved by earlier versions (flat residual keys) load into the nested form."""
    old = {"d_model": 64, "n_layers": 2, "n_heads": 4, "residual": "attnres_full", "attnres_impl": "naive",
           "attnres_full_group_size": 2, "attnres_sigmoid_weights": True, "hc_streams": 3, "mhc_sinkhorn_iters": 5}
    with pytest.warns(DeprecationWarning, match="attnres_impl"):
        cfg = ModelConfig.from_dict(old)
    r = cfg.residual
    assert (r.kind, r.schedule, r.full_group_size, r.ablation.sigmoid_weights, r.hc_streams, r.sinkhorn_iters) == (
        "attnres_full", "naive", 2, True, 3, 5)
    with pytest.warns(DeprecationWarning, match=r"^ModelConfig\.attnres_block_size is deprecated: use "
                      r"ModelConfig\.residual\.block_size$"):
        assert ModelConfig(attnres_block_size=4).residual.block_size == 4
    with pytest.warns(DeprecationWarning, match="residual.block_size"):
        assert ModelConfig(residual={"block_size": 3}).attnres_block_size == 3
    with pytest.raises(AttributeError):
        ModelConfig().not_a_field  # noqa: B018


def test_replace_and_preset_change_only_what_they_name():
    cfg = ModelConfig.preset("tiny", residual={"block_size": 3, "ablation": {"key_norm": False}, "schedule": "naive"})
    full = cfg.replace(residual="attnres_full")
    assert (full.residual.kind, full.residual.block_size, full.residual.schedule, full.residual.ablation.key_norm) == (
        "attnres_full", 3, "naive", False)
    assert cfg.replace(residual={"ablation": {"heads": 4}}).residual.ablation == AttnResAblation(key_norm=False, heads=4)
    assert cfg.replace(n_layers=3).residual == cfg.residual
    assert ModelConfig.preset("tiny", residual="attnres_full").residual.block_size == 2  # the preset's S stays


def test_unknown_config_key_and_preset():
    with pytest.raises(ValueError, match="unknown ModelConfig key.*'hidden'"):
        ModelConfig.from_dict({"hidden": 3})
    with pytest.raises(ValueError, match="unknown preset 'huge'; available"):
        ModelConfig.preset("huge")
    with pytest.raises(ValueError, match=r"unknown preset 'tny' \(did you mean 'tiny'\?\); available"):
        ModelConfig.preset("tny")
    # the constructors: Python's bare 'unexpected keyword argument' named no field
    with pytest.raises(TypeError, match=r"ModelConfig: unknown field\(s\) \['dropout'\]; known fields: \['d_model'"):
        ModelConfig(d_model=64, dropout=0.1)
    with pytest.raises(TypeError, match=r"TrainConfig: unknown field\(s\) \['stpes'\] \(did you mean 'steps'\?\)"):
        TrainConfig(stpes=3)
    with pytest.raises(TypeError, match=r"ResidualConfig: unknown field\(s\) \['blocksize'\] \(did you mean 'block_size'"):
        ResidualConfig(blocksize=4)
    with pytest.warns(DeprecationWarning, match=r"^ModelConfig\.residual\.kernels is deprecated: use "
                      r"ModelConfig\.residual\.backend$"):  # a renamed key still migrates first
        assert ResidualConfig(kernels="torch").backend == "torch"


def test_a_residual_field_given_at_the_model_s_top_level_is_named_with_its_section():
    """``ModelConfig(block_size=4)`` (and ``attnres train model.block_size=4``) asked "did you
    mean 'vocab_size'?": the block size is the residual's, ``residual.block_size``."""
    with pytest.raises(TypeError, match=re.escape("ModelConfig: unknown field(s) ['block_size'] "
                                                  "(did you mean 'residual.block_size'?)")):
        ModelConfig(block_size=4)
    with pytest.raises(ValueError, match=re.escape("(did you mean 'residual.schedule' for 'schedule'?)")):
        ModelConfig.from_dict({"schedule": "naive"})
    with pytest.raises(ValueError, match=re.escape("(did you mean 'residual.block_size' for 'block_size'?)")):
        ModelConfig.preset("tiny", block_size=4)


def test_config_round_trip_and_derived_values():
    cfg = ModelConfig.preset("bench-cpu")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    block = cfg.build_residual()
    assert (cfg.n_sublayers, block.block_size, block.n_blocks) == (16, 4, 4)
    auto = ModelConfig(n_layers=16, residual={"block_size": None}).build_residual()
    assert (auto.block_size, auto.n_blocks) == (4, 8)  # about 8 blocks by default
    assert ModelConfig(d_model=512).hidden_size == 1408


@pytest.mark.parametrize(
    "ids, match",
    [
        (torch.tensor([[1, 2, 256]]), "token id 256 is outside the vocabulary"),
        (torch.tensor([[-1, 2]]), "token id -1 is outside the vocabulary"),
        (torch.tensor([[1.0, 2.0]]), "integer tensor"),
        (torch.tensor([1, 2]), r"shape \[batch, seq_len\]"),
        (torch.zeros(1, 0, dtype=torch.long), "non-empty"),
        (torch.zeros(1, 129, dtype=torch.long), "exceeds ModelConfig.max_seq_len=128"),
    ],
)
def test_bad_token_ids_raise_before_any_compute(ids, match):
    model = make_model()
    ran = []
    model.embed_tokens.register_forward_pre_hook(lambda *a: ran.append(True))
    with pytest.raises(ValueError, match=match):
        model(ids)
    assert not ran


def test_a_sequence_of_exactly_max_seq_len_tokens_runs():
    """The context is ``max_seq_len`` tokens: a forward of that many (ids or embeddings) runs;
    one more is refused (above). A check that refused the full context passed every test."""
    model = make_model()
    ids = torch.randint(0, 256, (1, model.config.max_seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert model(ids).logits.shape == (1, 128, 256)
        assert torch.equal(model(inputs_embeds=model.embed_tokens(ids)).logits, model(ids).logits)


def test_bad_labels_shape_raises():
    model = make_model()
    with pytest.raises(ValueError, match="labels must have the shape"):
        model(torch.zeros(2, 4, dtype=torch.long), labels=torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("residual", ["standard", "attnres_block", "attnres_full"])
def test_inputs_embeds_are_taken_as_the_embedding_of_input_ids(residual):
    """``inputs_embeds`` in place of ``input_ids`` (a soft prompt, another modality's
    features): the same logits, loss and depth weights as the ids they embed, bit for bit,
    through a KV cache too (a prompt given as vectors, then tokens); the gradient reaching
    them is the one the embedding's output gets."""
    from attnres.inference import KVCache

    model = make_model(residual=residual)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    seen = []
    hook = model.embed_tokens.register_forward_hook(lambda m, i, out: (out.retain_grad(), seen.append(out))[0])
    by_ids = model(ids, labels=ids, return_depth_weights=True)
    by_ids.loss.backward()
    hook.remove()
    embeds = model.embed_tokens.weight.detach()[ids].requires_grad_()
    by_vectors = model(inputs_embeds=embeds, labels=ids, return_depth_weights=True)
    by_vectors.loss.backward()
    assert torch.equal(by_vectors.logits, by_ids.logits) and torch.equal(by_vectors.loss, by_ids.loss)
    if residual != "standard":
        assert all(torch.equal(a, b) for a, b in zip(by_vectors.depth_weights, by_ids.depth_weights))
    assert len(seen) == 1 and torch.allclose(embeds.grad, seen[0].grad, rtol=1e-6, atol=1e-9)
    with torch.no_grad():
        cache = KVCache(model.config.n_layers)
        model(inputs_embeds=embeds[:, :6].detach(), kv_cache=cache)
        then = model(ids[:, 6:], kv_cache=cache).logits
    assert torch.allclose(then, by_ids.logits[:, 6:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, match", [
    (lambda m, e: m(), "pass exactly one of input_ids"),
    (lambda m, e: m(torch.zeros(2, 3, dtype=torch.long), inputs_embeds=e), "pass exactly one of input_ids"),
    (lambda m, e: m(inputs_embeds=e[..., :-1]), r"\[batch, seq_len, d_model=64\], got \(2, 3, 63\)"),
    (lambda m, e: m(inputs_embeds=e[0]), r"\[batch, seq_len, d_model=64\], got \(3, 64\)"),
    (lambda m, e: m(inputs_embeds=e[:, :0]), "non-empty"),
    (lambda m, e: m(inputs_embeds=e.double()), "must be torch.float32 on cpu, as the embedding's weight .* got torch.float64"),
    (lambda m, e: m(inputs_embeds=e.repeat(1, 50, 1)), "sequence length 150 exceeds ModelConfig.max_seq_len=128"),
    (lambda m, e: m(inputs_embeds=e, labels=torch.zeros(2, 4, dtype=torch.long)),
     r"labels must have the shape \[batch, seq_len\] = \(2, 3\) of the inputs, got \(2, 4\)"),
])
def test_bad_inputs_embeds_are_refused_by_name_before_any_compute(call, match):
    model = make_model()
    assert model.config.d_model == 64
    ran = []
    # (on the first sublayer's norm: a block is never called, and a hook on it never ran)
    model.layers[0].attn_norm.register_forward_pre_hook(lambda *a: ran.append(True))
    with pytest.raises(ValueError, match=match):
        call(model, torch.zeros(2, 3, 64))
    assert not ran


# ------------------------------------------------------------------ float64 end to end
def reference_logits_float64(model: AttnResLM, ids: torch.Tensor) -> torch.Tensor:
    """The model's function written out independently in float64 from its parameters: RoPE
    from the formula, explicit causal softmax attention, SwiGLU, and the depth mixing of
    report §3 (standard sum, Full AttnRes, Block AttnRes) source by source."""
    cfg, r = model.config, model.config.residual
    P = {n: p.detach().double() for n, p in model.named_parameters()}
    d, H, Hkv = cfg.d_model, cfg.n_heads, cfg.kv_heads
    hd, T, L = d // H, ids.shape[1], cfg.n_sublayers
    ang = torch.outer(torch.arange(T, dtype=torch.float64),
                      1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)

    def rms(x, w, eps):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w

    def rope(t):
        return t * cos + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin

    def attention(i, h):
        x = rms(h, P[f"layers.{i}.attn_norm.weight"], cfg.norm_eps)
        q = (x @ P[f"layers.{i}.attn.q_proj.weight"].T).view(*x.shape[:2], H, hd).transpose(1, 2)
        k = (x @ P[f"layers.{i}.attn.k_proj.weight"].T).view(*x.shape[:2], Hkv, hd).transpose(1, 2)
        v = (x @ P[f"layers.{i}.attn.v_proj.weight"].T).view(*x.shape[:2], Hkv, hd).transpose(1, 2)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        s = q @ k.transpose(-1, -2) / hd**0.5
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        o = (s.softmax(-1) @ v).transpose(1, 2).reshape(*x.shape)
        return o @ P[f"layers.{i}.attn.o_proj.weight"].T

    def mlp(i, h):
        x = rms(h, P[f"layers.{i}.mlp_norm.weight"], cfg.norm_eps)
        g, u = x @ P[f"layers.{i}.mlp.gate_proj.weight"].T, x @ P[f"layers.{i}.mlp.up_proj.weight"].T
        return (g * torch.sigmoid(g) * u) @ P[f"layers.{i}.mlp.down_proj.weight"].T

    def mix(l, sources):  # mixer l over its sources
        if r.kind == "standard":
            return sum(sources)
        q, gain = P[f"residual.mixers.{l}.query"], P[f"residual.mixers.{l}.key_norm.weight"]
        logits = torch.stack([rms(s, gain, r.eps) @ q for s in sources])
        return (logits.softmax(0).unsqueeze(-1) * torch.stack(sources)).sum(0)

    def sources_of(l, outputs):  # outputs = [v_0, ..., v_l]
        if r.kind == "standard":
            return [sum(outputs)]
        if r.kind == "attnres_full":
            return list(outputs)
        S = r.resolved_block_size(L)
        blocks = [outputs[0]] + [sum(outputs[1 + j: 1 + j + S]) for j in range(0, l - l % S, S)]
        return blocks + ([sum(outputs[1 + l - l % S: 1 + l])] if l % S else [])

    outputs = [P["embed_tokens.weight"][ids]]
    for l in range(L):
        h = mix(l, sources_of(l, outputs))
        outputs.append(attention(l // 2, h) if l % 2 == 0 else mlp(l // 2, h))
    h = mix(L, sources_of(L, outputs))
    return rms(h, P["norm.weight"], cfg.norm_eps) @ P["lm_head.weight"].T


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("residual", ["standard", {"kind": "attnres_full"}, {"kind": "attnres_block", "block_size": 3},
                                      {"kind": "attnres_block", "block_size": 2, "schedule": "naive"}])
def test_float64_model_matches_an_independent_float64_evaluation(residual, attention):
    """Regression: the RoPE tables and eager attention's scores were float32 in a float64
    model (about 1e-6 in the logits); every computation now follows the model's dtype."""
    model = make_model(torch.float64, residual=residual, n_layers=3)
    for layer in model.layers:
        layer.attn.implementation = attention
    ids = torch.randint(0, 256, (2, 9))
    assert_rel_close(model(ids).logits, reference_logits_float64(model, ids), 1e-10)
    # A float32 model cast to float64 recomputes its RoPE tables exactly.
    cast = make_model(torch.float32, residual=residual, n_layers=3).double()
    assert torch.equal(cast.rope.cos, make_model(torch.float64, residual=residual, n_layers=3).rope.cos)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_a_model_cast_to_half_and_back_computes_as_a_fresh_model_with_its_weights(half):
    """``model.to(torch.bfloat16)`` to try half precision in a notebook, then ``model.float()``
    to go on: the weights are rounded (the cast's own effect), but the RoPE tables stayed
    rounded too - positions off by up to 2e-3, so the model no longer computed what a model
    loaded from its own state_dict computes."""
    model = AttnResLM(ModelConfig.preset("tiny", max_seq_len=1024))
    model.to(half).float()
    fresh = AttnResLM(model.config)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(model.rope.cos, fresh.rope.cos) and torch.equal(model.rope.sin, fresh.rope.sin)
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_rms_norm_on_half_inputs_computes_in_float32_and_rounds_once(half, monkeypatch):
    """``attnres.nn.RMSNorm`` on a half input: the float32 computation rounded once (forward
    and both gradients, bit for bit), whether its gain is of the input's dtype - then one
    ``F.rms_norm`` call on the half tensors (one fused kernel on CUDA) - or float32."""
    from attnres.nn import RMSNorm

    torch.manual_seed(0)
    x = torch.randn(3, 5, 40).to(half)
    g = torch.randn(3, 5, 40).to(half)
    for gain_dtype in (half, torch.float32):
        norm = RMSNorm(40, eps=1e-5).to(gain_dtype)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        xs = x.clone().requires_grad_()
        calls = []
        rms_norm = F.rms_norm
        monkeypatch.setattr(F, "rms_norm", lambda t, *a: calls.append(t.dtype) or rms_norm(t, *a))
        y = norm(xs)
        monkeypatch.undo()
        assert calls == [half if gain_dtype == half else torch.float32]
        xf, wf = x.float().requires_grad_(), norm.weight.detach().float().requires_grad_()
        expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * wf).to(half)
        assert y.dtype == half and torch.equal(y, expected)
        got = torch.autograd.grad(y, (xs, norm.weight), g)
        want = torch.autograd.grad(F.rms_norm(xf, (40,), wf, 1e-5).to(half), (xf, wf), g)
        assert torch.equal(got[0], want[0].to(half)) and torch.equal(got[1], want[1].to(gain_dtype))


def test_a_forward_s_output_shows_in_a_notebook_as_one_line():
    """``out = model(ids, labels=ids, return_depth_weights=True)`` shown in a notebook printed
    the logits and one tensor per sublayer's depth weights: hundreds of lines."""
    model = AttnResLM(ModelConfig.preset("tiny", residual="attnres_block"))
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    out = model(ids, labels=ids, return_depth_weights=True)
    assert repr(out) == (f"LMOutput(logits [2, 40, 256] float32, loss {out.loss.item():.4f}, depth_weights "
                         "5 x [n_sources, 2, 40])")
    assert repr(model(ids)) == "LMOutput(logits [2, 40, 256] float32, loss None, depth_weights None)"


def test_lm_output_flattens_to_its_tensors():
    """``LMOutput`` is a pytree node: FSDP2 flattens a module's output to find the tensors
    whose backward needs its parameters gathered again (torch 2.11 does not look inside a
    plain dataclass: under data parallelism the head's backward then read freed storage)."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    model = AttnResLM(ModelConfig.preset("tiny", residual="attnres_block"))
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    out = model(ids, labels=ids, return_depth_weights=True)
    leaves, spec = tree_flatten(out)
    assert any(t is out.logits for t in leaves) and any(t is out.loss for t in leaves)
    assert all(any(t is w for t in leaves) for w in out.depth_weights)
    assert tree_unflatten(leaves, spec).loss is out.loss


@pytest.mark.parametrize("residual", ["standard", "attnres_block", "attnres_full"])
def test_a_model_built_on_the_meta_device_runs_there_and_materialises_exactly(residual):
    """Deferred initialisation, as large models are built: the forward on the meta device
    (shape inference) asked for the ids' values (``Tensor.item() cannot be called on meta
    tensors``), and ``to_empty`` + ``init_weights`` left the RoPE tables empty - NaN logits
    without a word. Now the meta forward and backward run, and the materialised model equals
    one built on the CPU with the same initialisation."""
    config = ModelConfig.preset("tiny", residual=residual)
    with torch.device("meta"):
        model = AttnResLM(config)
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    out = model(ids, labels=ids)
    out.loss.backward()
    assert out.logits.shape == (2, 8, config.vocab_size) and out.logits.device.type == "meta"
    model.to_empty(device="cpu")
    if residual != "standard":  # (init_weights forgotten: NaN logits without a word; refused at the forward)
        with pytest.raises(ValueError, match=r"hold the uninitialised memory to_empty\(\) left .* "
                                             r"AttnResLM\.init_weights\(\) for the whole model"):
            model(torch.zeros(2, 8, dtype=torch.long))
    torch.manual_seed(0)
    model.init_weights()
    reference = AttnResLM(config)
    torch.manual_seed(0)
    reference.init_weights()
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_built_on_the_meta_device_loads_a_state_dict_by_assignment_exactly(dtype):
    """The other way to materialise a large model: build it on meta, then
    ``load_state_dict(state, assign=True)`` (torchtune's, accelerate's). The RoPE tables are
    not in the state dict (computed, not learnt), so they stayed on meta and the forward failed
    deep in ``apply_rotary`` with "Tensor on device meta is not on the expected device cpu!".
    They are computed where the loaded weights are, in their own dtype: the logits of the model
    whose state dict it was."""
    config = ModelConfig.preset("tiny")
    torch.manual_seed(0)
    reference = AttnResLM(config).to(dtype).eval()
    with torch.device("meta"):
        model = AttnResLM(config).to(dtype)
    model.load_state_dict(reference.state_dict(), assign=True)
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, reference(ids).logits)


def test_attention_and_rope_on_their_own_refuse_what_they_cannot_run_and_take_an_empty_sequence():
    """``attnres.nn.Attention`` in a model of one's own: ``d_model=10, n_heads=4`` ran with
    heads of 2 (q of width 8), ``n_kv_heads=0`` ran, ``n_kv_heads=3`` of 4 failed inside
    ``scaled_dot_product_attention``; ``T = 0``, which the residual takes, failed to reshape;
    ``RotaryEmbedding`` past its ``max_seq_len`` failed later, in a broadcast."""
    from attnres.nn import Attention, RotaryEmbedding

    for args, match in [((10, 4, 2), "^Attention: n_heads=4 must divide d_model=10"),
                        ((16, 4, 3), "^Attention: n_kv_heads=3 must divide n_heads=4"),
                        ((16, 4, 0), "^Attention: n_kv_heads must be an integer >= 1, got 0$"),
                        ((16, 2.0, 1), "^Attention: n_heads must be an integer >= 1, got 2.0$")]:
        with pytest.raises(ValueError, match=match):
            Attention(*args)
    attention, rope = Attention(16, 4, 2), RotaryEmbedding(4, 8)
    assert attention(torch.randn(2, 0, 16), *rope(0)).shape == (2, 0, 16)
    # (positions past the tables: "The size of tensor a (9) must match the size of tensor b (8)" in apply_rotary)
    assert attention(torch.randn(2, 3, 16), *rope(3, offset=5)).shape == (2, 3, 16)
    for seq_len, offset in [(9, 0), (3, 6)]:
        with pytest.raises(ValueError, match=rf"^RotaryEmbedding: positions {offset}\.\.{offset + seq_len - 1} are past "
                                             r"its max_seq_len=8 .*build it with a larger max_seq_len$"):
            rope(seq_len, offset=offset)

