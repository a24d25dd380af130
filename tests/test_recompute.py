"""The two-phase residual on the depth-attention operations (``attnres.ops.depth_attention``),
as the training path runs it: the sublayers' norms fused into the merges.

* the residual module against the naive path and the float64 truth, forward and every
  gradient, under the per-dtype rules of ``conftest.fast_path_violations``, and gradcheck
  through the module (the operators themselves: ``test_depth_attention_ops.py``);
* the operations a residual runs on, by ``backend``; the implementations agreeing at model
  level; what the path saves for the backward (counted with saved-tensor hooks, no timing);
* bf16 autocast and activation checkpointing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.autograd import gradcheck

from attnres import AttnResLM, ModelConfig
from attnres.nn import BlockAttnRes, FullAttnRes, RMSNorm
from attnres.ops.depth_attention import cpu_kernel

from conftest import GRAD_TOL, TOL, assert_fast_matches_naive, assert_rel_close, make_model

# ----------------------------------------------------------------------------------------
# The residual module on the training path, norm fused as in the trunk
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


def make(kind, d, L, S, dtype=torch.float64, schedule="two_phase", backend="auto"):
    torch.manual_seed(0)
    if kind == "block":
        m = BlockAttnRes(d, L, S, schedule=schedule, backend=backend, warn_single_block=False)  # (S >= L too)
    else:
        m = FullAttnRes(d, L, schedule=schedule, group_size=S, backend=backend)
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
    naive64.schedule = "naive"
    emb = torch.randn(*lead, d, dtype=torch.float64) * 2
    truth = grads(naive64, subs64, emb)
    lean, naive, subs = (copy.deepcopy(m).to(dtype) for m in (lean64, naive64, subs64))
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


def assert_backends_agree(model, backend: str, logits_tol: float, grad_tol: float) -> None:
    """``model`` (default backend) and a copy with ``residual.backend = backend``: the same
    logits and every gradient of the loss."""
    other = copy.deepcopy(model)
    other.residual.backend = backend
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    a, b = model(ids, labels=ids), other(ids, labels=ids)
    assert_rel_close(a.logits, b.logits, logits_tol, "logits")
    for (name, _), ga, gb in zip(model.named_parameters(), torch.autograd.grad(a.loss, list(model.parameters())),
                                 torch.autograd.grad(b.loss, list(other.parameters()))):
        assert_rel_close(ga, gb, grad_tol, f"grad of {name}")


def test_lean_and_graph_paths_agree_at_model_level():
    assert_backends_agree(make_model(residual={"kind": "attnres_block", "block_size": 3}, n_layers=3),
                          "reference", 1e-5, 1e-4)


# ----------------------------------------------------------------------------------------
# The operations a residual runs on
# ----------------------------------------------------------------------------------------


def test_backend_names_the_operations():
    """``backend`` picks the family once per forward: the custom operators (``"auto"``: by
    device; ``"torch"``; ``"triton"``) or the plain-graph reference (``"reference"``) -
    whatever the grad mode, recording or ``torch.compile``."""
    m = BlockAttnRes(8, 4, 2)
    assert m.operations().name == "auto"
    for backend, name in [("torch", "torch"), ("triton", "triton"), ("reference", "reference")]:
        m.backend = backend
        assert m.operations().name == name
    with pytest.raises(ValueError, match="reference"):
        ModelConfig.preset("tiny", residual={"kind": "attnres_block", "backend": "bogus"})


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
    for name, r in [("standard", "standard"), ("lean", res), ("graph", {**res, "backend": "reference"})]:
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
    graph.residual.backend = "reference"
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
def test_cpu_kernel_and_pytorch_implementation_agree_at_model_level(residual):
    """The whole model in float64 on the CPU kernel (``"auto"``) and on the operators'
    PyTorch implementation: the same loss and every gradient to rounding."""
    if cpu_kernel.cpu_kernel() is None:
        pytest.skip("no CPU kernel on this machine")
    model = make_model(torch.float64, residual=residual, n_layers=3)
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


# ----------------------------------------------------------------------------------------
# Phase 1's sums recomputed for the backward (ResidualConfig.recompute_phase1)
# ----------------------------------------------------------------------------------------


def _phase1_calls(monkeypatch) -> list[bool]:
    """Every ``library.phase1`` call from now on, as whether autograd was on."""
    from attnres.ops.depth_attention import library

    calls, phase1 = [], library.phase1

    def spy(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return phase1(*args, **kwargs)

    monkeypatch.setattr(library, "phase1", spy)
    return calls


def _recompute_twins(kind: str, backend: str, dtype=torch.float32, **overrides):
    """A model recomputing Phase 1's sums and its twin keeping them (same weights)."""
    residual = {"kind": kind, "backend": backend, **({"block_size": 4} if kind == "attnres_block" else {})}
    model = make_model(dtype, residual=residual, n_layers=3, d_model=36, n_heads=3, n_kv_heads=3, **overrides)
    keeping = copy.deepcopy(model)
    keeping.residual.recompute_phase1 = False
    return model, keeping


@pytest.mark.parametrize("kind, backend, dtype", [
    ("attnres_block", "auto", torch.float32),  # (the C kernel)
    ("attnres_block", "torch", torch.float64),
    ("attnres_full", "auto", torch.float32),
    pytest.param("attnres_block", "triton", torch.float32, marks=pytest.mark.triton),
    pytest.param("attnres_full", "triton", torch.float32, marks=pytest.mark.triton),
])
def test_recomputed_phase1_sums_give_the_same_loss_and_gradients_bit_for_bit(kind, backend, dtype, monkeypatch):
    """The backward runs each Phase 1 once more (without autograd) and then equals, bit for
    bit, the backward of the twin that kept the sums: the same call on the same tensors.
    Ragged blocks (6 sublayers in blocks of 4), an odd width, the output aggregation's sum."""
    from conftest import triton_device

    device = triton_device() if backend == "triton" else "cpu"
    model, keeping = (m.to(device) for m in _recompute_twins(kind, backend, dtype))
    shape = (1, 3) if backend == "triton" else (2, 7)  # (the interpreter runs a program per token)
    ids = torch.randint(0, model.config.vocab_size, shape, device=device)
    results = {}
    for name, m in (("recomputing", model), ("keeping", keeping)):
        calls = _phase1_calls(monkeypatch)
        loss = m(ids, labels=ids).loss
        forward_calls = len(calls)
        loss.backward()
        results[name] = (loss.detach(), [p.grad for p in m.parameters()], forward_calls, calls[forward_calls:])
        monkeypatch.undo()
    loss, grads, forward_calls, backward_calls = results["recomputing"]
    assert forward_calls >= 1 and backward_calls == [False] * forward_calls  # (one per block or group, no autograd)
    assert results["keeping"][3] == []
    assert torch.equal(loss, results["keeping"][0])
    assert all(torch.equal(a, b) for a, b in zip(grads, results["keeping"][1]))


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_recomputed_sums_under_bf16_autocast_equal_the_kept_ones(backend):
    """The forward under bf16 autocast, the backward (and so the recompute) outside it: the
    operators switch autocast off inside, so the recomputed sums are the forward's."""
    model, keeping = _recompute_twins("attnres_block", backend)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    grads = []
    for m in (model, keeping):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(ids, labels=ids).loss
        grads.append(torch.autograd.grad(loss, list(m.parameters())))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("kind", ["attnres_block", "attnres_full"])
def test_recomputing_phase1_keeps_one_tensor_less_per_merge_of_a_phase1_sum(kind):
    """What a training forward leaves allocated for its backward (allocations, not saved-tensor
    hooks, which turn the recipe off): one ``[tokens, d]`` float32 tensor less for every merge
    of a Phase-1 sum (the sublayers past the first block or group, and the output
    aggregation's), to the byte."""
    from attnres.analysis.profiling import kept_bytes

    model, keeping = _recompute_twins(kind, "auto")
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    kept = {}
    for name, m in (("recomputing", model), ("keeping", keeping)):
        m(ids, labels=ids).loss.backward()  # (warm-up: first-call allocations)
        kept[name] = kept_bytes(lambda m=m: m(ids, labels=ids).loss)
    residual = model.residual
    first_group = residual.block_size if kind == "attnres_block" else residual.group_size
    merges = residual.n_sublayers - first_group + 1
    assert kept["keeping"] - kept["recomputing"] == merges * ids.numel() * model.config.d_model * 4, kept


def test_recomputing_refuses_sources_modified_in_place():
    """A Phase-1 source changed in place after the forward cannot give its sums back: the
    backward says so, naming the setting that keeps them."""
    model, _ = _recompute_twins("attnres_block", "auto")
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    state = {}
    embed = model.embed_tokens.forward

    def keep_embedding(x):
        state["h"] = embed(x)
        return state["h"]

    model.embed_tokens.forward = keep_embedding
    loss = model(ids, labels=ids).loss
    with torch.no_grad():
        state["h"].mul_(2)
    with pytest.raises(RuntimeError, match="recompute_phase1=False"):
        loss.backward()


def test_recomputed_sums_serve_a_second_backward_and_step_aside_for_checkpointing(monkeypatch):
    """``retain_graph``: a second backward recomputes again and gives the same gradients;
    under an activation checkpoint (its saved-tensor hooks in force) the merges keep their
    sums (the checkpoint recomputes them) and no Phase 1 runs in the backward for the recipe."""
    from torch.utils.checkpoint import checkpoint

    model, keeping = _recompute_twins("attnres_block", "auto")
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    loss = model(ids, labels=ids).loss
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    second = torch.autograd.grad(loss, list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    calls = _phase1_calls(monkeypatch)
    loss = checkpoint(lambda i: model(i, labels=i).loss, ids, use_reentrant=False)
    forward_calls = len(calls)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert calls[forward_calls:] == [True] * forward_calls  # (the checkpoint's recompute, with autograd)
    reference = torch.autograd.grad(keeping(ids, labels=ids).loss, list(keeping.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))


def test_recompute_phase1_is_validated():
    with pytest.raises(ValueError, match="recompute_phase1"):
        ModelConfig.preset("tiny", residual={"kind": "attnres_block", "recompute_phase1": "yes"}).validate()


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("device", ["fake", "meta"])
def test_the_recipe_finds_each_sum_of_tensors_without_storage(device):
    """The recipe found a merge's saved sum by its data_ptr(): under ``FakeTensorMode``
    (shapes without storage, as the GPU check's launch survey runs a model) that is 0 for
    every tensor, with a deprecation warning a later PyTorch makes an error, and a meta
    tensor's is its offset from 0 - every sum was found as the last one. Each sum is found as
    itself now (by its storage and offset), without the warning; another tensor of the same
    shape is saved as it is."""
    from contextlib import nullcontext

    from torch._subclasses.fake_tensor import FakeTensorMode

    from attnres.ops.depth_attention.recompute import Phase1Recompute

    with FakeTensorMode() if device == "fake" else nullcontext():
        where = "cpu" if device == "fake" else "meta"
        qg, source = torch.empty(3, 4, device=where), torch.empty(2, 5, 4, device=where)
        outs = [torch.empty(2, 5, 4, device=where) for _ in range(3)]
        recipe = Phase1Recompute(lambda *args: None, qg, [source], 1e-6, outs)
        assert [recipe._pack(o).index for o in outs] == [0, 1, 2]
        assert recipe._pack(outs[1].view(2, 5, 4)).index == 1  # (a view of the same memory, the same layout)
        other, shorter = torch.empty(2, 5, 4, device=where), outs[0][:1]  # (another tensor; another layout)
        assert recipe._pack(other) is other and recipe._pack(shorter) is shorter


@pytest.mark.filterwarnings("error")
def test_a_training_step_on_fake_tensors_recomputes_phase1_without_a_warning(monkeypatch):
    """The GPU check's launch survey runs the models' training steps on fake tensors: the
    recipe's data_ptr() warned at every Phase 1 and merge (an error in a later PyTorch). The
    step runs without it, its backward running each Phase 1 once more, without autograd, and
    gives every parameter a gradient of its shape."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    def refused(tensor):  # (as a later PyTorch: the warning is PyTorch's warn-once, given once per process)
        raise RuntimeError("data_ptr() of a fake tensor")

    monkeypatch.setattr(FakeTensor, "data_ptr", refused, raising=False)
    model, _ = _recompute_twins("attnres_block", "auto")
    calls = _phase1_calls(monkeypatch)
    with FakeTensorMode(allow_non_fake_inputs=True):
        ids = torch.randint(0, model.config.vocab_size, (2, 7))
        loss = model(ids, labels=ids).loss
        forward_calls = len(calls)
        grads = torch.autograd.grad(loss, list(model.parameters()))
    assert forward_calls >= 1 and calls[forward_calls:] == [False] * forward_calls
    assert [g.shape for g in grads] == [p.shape for p in model.parameters()]
