"""Residual modules on their own, driven by toy sublayers: two-phase vs naive, report §3.2 facts."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from attnres.nn import BlockAttnRes, FullAttnRes, StandardResidual
from attnres.nn.residual import ResidualConfig, build_residual, registered_residuals, residual_class

from conftest import GRAD_TOL, TOL, assert_fast_matches_naive, assert_rel_close, fast_path_violations


class ToySublayers(torch.nn.Module):
    """``L`` sublayers ``f_l(h) = tanh(h W_l) * c_l`` with different output scales, so that
    block sums and partial sums differ in magnitude as in a real network."""

    def __init__(self, d: int, L: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5) for _ in range(L)
        )
        self.scales = [0.5 + l for l in range(L)]

    def forward(self, l: int, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.weights[l].to(h.dtype)) * self.scales[l]


def run(residual, sublayers, emb, record=False):
    state = residual.start(emb, record_weights=record)
    for l in range(residual.n_sublayers):
        residual.add_output(state, l, sublayers(l, residual.sublayer_input(state, l)))
    return residual.finish(state), state.weights


def make_pair(kind: str, d: int, L: int, S: int = 2, group: int | None = None, dtype=torch.float64, seed: int = 0):
    """(two-phase module, naive twin with identical parameters, toy sublayers)."""
    if kind == "block":
        fast = BlockAttnRes(d, L, S, warn_single_block=False)  # (S >= L on purpose too)
    else:
        fast = FullAttnRes(d, L, group_size=group)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
    fast = fast.to(dtype)
    naive = copy.deepcopy(fast)
    naive.schedule = "naive"
    return fast, naive, ToySublayers(d, L, seed).to(dtype)


def grads_of(residual, sublayers, emb, seed=0):
    emb = emb.detach().clone().requires_grad_()
    out, _ = run(residual, sublayers, emb)
    g = torch.Generator().manual_seed(seed)
    upstream = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    params = list(residual.parameters()) + list(sublayers.parameters())
    grads = torch.autograd.grad((out * upstream).sum(), [emb, *params])
    return out, grads


CASES = [
    # (kind, d, L, S or group): S dividing L, S not dividing L, S = 1, S >= L, S = L, odd d.
    ("block", 8, 8, 2),
    ("block", 8, 6, 4),
    ("block", 5, 7, 3),
    ("block", 8, 6, 1),
    ("block", 8, 6, 6),
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
def test_two_phase_equals_naive_forward_and_every_gradient(kind, d, L, S, dtype, lead):
    fast64, naive64, subs64 = make_pair(kind, d, L, S=S or 1, group=S, dtype=torch.float64)
    emb = torch.randn(*lead, d, dtype=torch.float64) * 2
    truth = grads_of(naive64, subs64, emb)
    fast, naive, subs = (copy.deepcopy(m).to(dtype) for m in (fast64, naive64, subs64))
    out_f, grads_f = grads_of(fast, subs, emb.to(dtype))
    out_n, grads_n = grads_of(naive, subs, emb.to(dtype))
    assert_fast_matches_naive([out_f], [out_n], [truth[0]], dtype, ["output"], TOL[dtype])
    names = ["embedding"] + [f"residual.{n}" for n, _ in fast.named_parameters()] + [f"sublayer.{n}" for n, _ in subs.named_parameters()]
    assert_fast_matches_naive(grads_f, grads_n, truth[1], dtype, [f"grad of {n}" for n in names], GRAD_TOL[dtype])


@pytest.mark.parametrize("kind, d, L, S", [c for c in CASES if c[0] == "block"])
def test_block_sources_per_sublayer_follow_spec(kind, d, L, S):
    """First sublayer of block n sees n sources, the others n + 1, the output N + 1."""
    expected = []
    for l in range(L):
        n, i = l // S + 1, l % S + 1
        expected.append(n if i == 1 else n + 1)
    N = -(-L // S)
    expected.append(N + 1)
    for schedule in ("two_phase", "naive"):
        fast, naive, subs = make_pair(kind, d, L, S=S)
        module = fast if schedule == "two_phase" else naive
        _, weights = run(module, subs, torch.randn(2, 3, d, dtype=torch.float64), record=True)
        assert [w.shape[0] for w in weights] == expected, schedule
        assert module.sources_per_mixer() == expected
        for w in weights:
            assert w.shape[1:] == (2, 3)
            assert_rel_close(w.sum(0), torch.ones(2, 3, dtype=w.dtype), 1e-12)


def test_full_sources_per_sublayer():
    """Sublayer l sees v_0 .. v_{l-1}; the output aggregation all L + 1 sources (report §3.1) -
    in the recorded weights and in ``sources_per_mixer``, which the FLOP count and the
    input-independent-mixing ablation's per-source logits are sized by."""
    fast, naive, subs = make_pair("full", 6, 7, group=3)
    for module in (fast, naive):
        _, weights = run(module, subs, torch.randn(2, 6, dtype=torch.float64), record=True)
        assert [w.shape[0] for w in weights] == list(range(1, 9))
        assert module.sources_per_mixer() == list(range(1, 9))


def test_block_size_one_is_exactly_full_attnres():
    d, L = 8, 6
    full = FullAttnRes(d, L, schedule="naive")
    with torch.no_grad():
        for p in full.parameters():
            p.add_(torch.randn_like(p))
    block = BlockAttnRes(d, L, 1, schedule="naive")
    block.load_state_dict(full.state_dict())
    subs = ToySublayers(d, L).float()
    emb = torch.randn(3, 4, d)
    out_full, w_full = run(full, subs, emb, record=True)
    out_block, w_block = run(block, subs, emb, record=True)
    assert torch.equal(out_full, out_block)
    assert all(torch.equal(a, b) for a, b in zip(w_full, w_block))
    # The two-phase schedules of both agree with it too.
    full.schedule = block.schedule = "two_phase"
    assert_rel_close(run(full, subs, emb)[0], out_full, 1e-5)
    assert_rel_close(run(block, subs, emb)[0], out_full, 1e-5)


@pytest.mark.parametrize("schedule", ["naive", "two_phase"])
@pytest.mark.parametrize("module", [lambda: BlockAttnRes(8, 7, 3), lambda: FullAttnRes(8, 7)])
def test_zero_queries_give_uniform_weights(schedule, module):
    m = module()
    m.schedule = schedule
    with torch.no_grad():  # gains other than 1 must not matter when the query is zero
        for mixer in m.mixers:
            mixer.key_norm.weight.uniform_(0.5, 2.0)
    _, weights = run(m, ToySublayers(8, 7).float(), torch.randn(2, 5, 8), record=True)
    for w in weights:
        uniform = torch.full_like(w, 1.0 / w.shape[0])
        if schedule == "naive":
            assert torch.equal(w, uniform)
        else:
            assert_rel_close(w, uniform, 1e-6)


@pytest.mark.parametrize("schedule", ["naive", "two_phase"])
@pytest.mark.parametrize("module", [lambda: BlockAttnRes(8, 4, 2), lambda: FullAttnRes(8, 4)])
def test_first_sublayer_input_is_exactly_the_embedding(schedule, module):
    m = module()
    m.schedule = schedule
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p))
    emb = torch.randn(2, 3, 8)
    state = m.start(emb)
    assert torch.equal(m.sublayer_input(state, 0), emb)


def test_standard_residual_is_the_plain_sum():
    m = StandardResidual(4, 3)
    emb = torch.randn(2, 4)
    outs = [torch.randn(2, 4) for _ in range(3)]
    state = m.start(emb)
    inputs = []
    for l in range(3):
        inputs.append(m.sublayer_input(state, l))
        m.add_output(state, l, outs[l])
    assert torch.equal(inputs[2], emb + outs[0] + outs[1])
    assert torch.equal(m.finish(state), emb + outs[0] + outs[1] + outs[2])
    assert list(m.parameters()) == []


def test_parameters_and_zero_init():
    d, L = 16, 6
    for m in (BlockAttnRes(d, L, 4), FullAttnRes(d, L)):
        assert sum(p.numel() for p in m.parameters()) == 2 * (L + 1) * d
        assert len(m.mixers) == L + 1
        assert all(torch.equal(x.query, torch.zeros(d)) for x in m.mixers)
        assert all(torch.equal(x.key_norm.weight, torch.ones(d)) for x in m.mixers)


def test_calls_out_of_order_raise():
    m = BlockAttnRes(4, 2, 1)
    state = m.start(torch.randn(1, 4))
    with pytest.raises(RuntimeError, match="out of order"):
        m.sublayer_input(state, 1)
    m.sublayer_input(state, 0)
    with pytest.raises(RuntimeError, match="out of order"):
        m.sublayer_input(state, 0)
    with pytest.raises(RuntimeError, match="finish"):
        m.finish(state)
    m.add_output(state, 0, torch.randn(1, 4))
    with pytest.raises(RuntimeError, match=r"^finish\(\) called after 1 of the 2 sublayers this BlockAttnRes was built "
                                           r"for \(n_sublayers=2\): run them all, or build it with the number of"):
        m.finish(state)


@pytest.mark.parametrize("make", [lambda: StandardResidual(4, 2), lambda: BlockAttnRes(4, 2, 1), lambda: FullAttnRes(4, 2)])
def test_a_state_kept_from_the_last_forward_and_an_output_before_its_input_say_what_to_call(make):
    """Both said "called out of order: expected sublayer ..." - the second naming the very
    sublayer it was given."""
    m = make()
    state = m.start(torch.randn(1, 4))
    with pytest.raises(RuntimeError, match=r"^add_output\(0\) called before sublayer_input\(0\): first h = residual"):
        m.add_output(state, 0, torch.randn(1, 4))
    for l in range(2):
        m.add_output(state, l, m.sublayer_input(state, l))
    m.finish(state)
    for call in (lambda: m.sublayer_input(state, 0), lambda: m.add_output(state, 0, torch.randn(1, 4))):
        with pytest.raises(RuntimeError, match=r"forward has ended \(finish\(\) ran\).*state = residual.start\(x\)"):
            call()


@pytest.mark.parametrize("reentrant", [False, True])
def test_an_activation_checkpoint_around_the_residual_calls_says_to_checkpoint_the_sublayer_alone(reentrant):
    """The backward's recompute of a checkpoint that holds ``sublayer_input`` and ``add_output``
    repeats them on the finished state: "called out of order: expected sublayer 4"."""
    from torch.utils.checkpoint import checkpoint

    m, sublayer = BlockAttnRes(4, 4, 2), torch.nn.Linear(4, 4)
    state = m.start(torch.randn(1, 4))

    def step(l, carry):  # (carry: a tensor that needs grad, so that the reentrant variant records)
        m.add_output(state, l, sublayer(m.sublayer_input(state, l)))
        return carry * 1

    carry = torch.zeros((), requires_grad=True)
    for l in range(4):
        carry = checkpoint(step, l, carry, use_reentrant=reentrant)
    loss = m.finish(state).sum() + carry
    with pytest.raises(RuntimeError, match=r"checkpoint a sublayer alone \(checkpoint\(sublayer, h\)\)"):
        loss.backward()


@pytest.mark.parametrize("variant", ["standard", "block", "full", "block_naive", "hyper_connections"])
def test_a_sublayer_past_the_last_is_refused_naming_n_sublayers(variant):
    """A model with more sublayers than the residual was built for: sublayer ``L`` of Block or
    Full AttnRes read the output aggregation's query as its own, the next one failed with an
    IndexError deep in the schedule, and the standard residual said nothing before ``finish``.
    ``sublayer_input(L)`` now refuses, naming ``n_sublayers``."""
    m = {"standard": lambda: StandardResidual(8, 4), "block": lambda: BlockAttnRes(8, 4, 2),
         "full": lambda: FullAttnRes(8, 4), "block_naive": lambda: BlockAttnRes(8, 4, 2, schedule="naive"),
         "hyper_connections": lambda: build_residual(ResidualConfig(kind="hyper_connections"), 8, 4)}[variant]()
    state = m.start(torch.randn(2, 3, 8))
    for l in range(4):
        m.add_output(state, l, m.sublayer_input(state, l) * 0.5)
    with pytest.raises(RuntimeError, match=rf"^sublayer_input\(4\): this {type(m).__name__} was built for "
                                           r"n_sublayers=4 \(sublayers 0\.\.3\); build it with the number"):
        m.sublayer_input(state, 4)
    assert m.finish(state).shape == (2, 3, 8)  # (the state is left as it was)


@pytest.mark.parametrize("variant", ["standard", "block", "full", "block_naive", "hyper_connections"])
def test_a_sublayer_output_of_the_wrong_shape_is_refused_before_it_is_used(variant):
    """A wrong-shaped output broadcast into a sum (a finite wrong answer), or reached a
    kernel that took its sizes from another tensor (the C kernel read past it: a segfault).
    It is refused at ``add_output``, naming the shape, and the state is left as it was."""
    m = {"standard": lambda: StandardResidual(8, 4), "block": lambda: BlockAttnRes(8, 4, 2),
         "full": lambda: FullAttnRes(8, 4), "block_naive": lambda: BlockAttnRes(8, 4, 2, schedule="naive"),
         "hyper_connections": lambda: build_residual(ResidualConfig(kind="hyper_connections"), 8, 4)}[variant]()
    state = m.start(torch.randn(2, 5, 8))
    for bad in (torch.randn(2, 1, 8), torch.randn(5, 8), torch.randn(2, 5, 9), torch.randn(1, 2, 5, 8)):
        m.sublayer_input(state, 0)
        with pytest.raises(ValueError, match=r"add_output\(0\): sublayer 0's output must have the stream's shape "
                                             r"\[2, 5, 8\]"):
            m.add_output(state, 0, bad)
        state.expecting_output = False  # (the refused call changed nothing else)
        assert state.next_sublayer == 0
    with pytest.raises(ValueError, match=r"the embedding must have shape \[\.\.\., 8\]"):
        m.start(torch.randn(2, 5, 12))


@pytest.mark.parametrize("make", [lambda: StandardResidual(8, 4), lambda: BlockAttnRes(8, 4, 2),
                                  lambda: FullAttnRes(8, 4), lambda: BlockAttnRes(8, 4, 2, schedule="naive")])
def test_start_resume_and_add_output_refuse_a_stream_they_cannot_keep(make):
    """An integer embedding truncated every sublayer output (standard) or failed naming an
    internal ``out_dtype`` (AttnRes); an embedding or output on another device than the
    residual failed naming the kernels' arguments (``qg``, ``computed[1]``); ``resume`` of a
    plain ``(completed, running)`` pair raised an AttributeError, of a history of another
    width went on, and of ``at_sublayer='0'`` failed comparing str with int."""
    m = make()
    with pytest.raises(ValueError, match=r"\.start: the embedding must be a floating-point tensor .*got torch.int64"):
        m.start(torch.ones(2, 8, dtype=torch.long))
    state = m.start(torch.randn(2, 8))
    m.sublayer_input(state, 0)
    with pytest.raises(ValueError, match=r"^add_output\(0\): sublayer 0's output is on meta but the stream is on "
                                         r"cpu \(the embedding's\): move it there, output.to\('cpu'\)$"):
        m.add_output(state, 0, torch.empty(2, 8, device="meta"))
    if m.has_depth_attention:
        with pytest.raises(ValueError, match=r"the embedding is on cpu but this residual's parameters are on meta; "
                                             r"materialise them: residual.to_empty\(device=...\) then "
                                             r"residual.reset_parameters\(\)"):
            copy.deepcopy(m).to("meta").start(torch.randn(2, 8))
    at, x = 2, torch.randn(2, 8)
    history = m.history(_run_to(m, x, at))
    for bad, match in [((history.completed, history.running), None), (history, None),
                       (history._replace(completed=[c[..., :5] for c in history.completed],
                                         running=None if history.running is None else history.running[..., :5]),
                        r"history\.(completed\[0\]|running) must have shape \[\.\.\., 8\]"),
                       ("h", "history must be a DepthHistory")]:
        if match is None:  # a plain pair resumes as the history does
            resumed = m.resume(bad, at)
            for l in range(at, 4):
                m.add_output(resumed, l, torch.tanh(m.sublayer_input(resumed, l)))
            assert torch.equal(m.finish(resumed), m.finish(_run_to(m, x, 4)))
        else:
            with pytest.raises(ValueError, match=match):
                m.resume(bad, at)
    with pytest.raises(ValueError, match=r"at_sublayer must be an integer in \[0, 4\], got '2'"):
        m.resume(history, "2")


@pytest.mark.parametrize("make", [lambda: StandardResidual(8, 4), lambda: BlockAttnRes(8, 4, 2),
                                  lambda: FullAttnRes(8, 4), lambda: BlockAttnRes(8, 4, 2, schedule="naive")])
def test_a_resumed_stream_refuses_an_output_of_another_shape_than_its_history(make):
    """A resumed state checked only ``d``: an output ``[1, 8]`` of a ``[2, 8]`` stream broadcast
    into Block AttnRes' partial sum and finished, silently (Full failed later, naming its
    sources). It is refused at ``add_output``, as before the cut."""
    m = make()
    resumed = m.resume(m.history(_run_to(m, torch.randn(2, 8), 2)), 2)
    m.sublayer_input(resumed, 2)
    with pytest.raises(ValueError, match=r"^add_output\(2\): sublayer 2's output must have the stream's shape \[2, 8\]"):
        m.add_output(resumed, 2, torch.randn(1, 8))


@pytest.mark.parametrize("make", [lambda: BlockAttnRes(8, 4, 2), lambda: FullAttnRes(8, 4)])
def test_a_query_of_another_shape_is_named_by_its_mixer(make):
    """A query or gain assigned by hand in another shape failed inside the two-phase schedule,
    "stack expects each tensor to be equal size" or "The size of tensor a (4) must match",
    naming neither the mixer nor the shape; each is named, with the dim it must have."""
    for what, bad in [("query", torch.zeros(1, 8)), ("query", torch.zeros(4)), ("key_norm.weight", torch.ones(2, 8))]:
        m = make()
        owner = m.mixers[2] if what == "query" else m.mixers[2].key_norm
        setattr(owner, what.split(".")[-1], torch.nn.Parameter(bad))
        with pytest.raises(ValueError, match=rf"^{type(m).__name__}: mixers\[2\]\.{re.escape(what)} must have shape "
                                             rf"\(8,\) \(this residual's dim: one vector per mixer\), got "
                                             rf"{re.escape(str(tuple(bad.shape)))}"):
            _run_to(m, torch.randn(2, 3, 8), 4)


def _run_to(m, x, at):
    state = m.start(x)
    for l in range(at):
        m.add_output(state, l, torch.tanh(m.sublayer_input(state, l)))
    return state


def test_finish_twice_and_bad_sizes_are_refused():
    m = BlockAttnRes(4, 2, 1)
    state = m.start(torch.randn(1, 4))
    for l in range(2):
        m.add_output(state, l, torch.randn(1, 4) + 0 * m.sublayer_input(state, l))
    m.finish(state)
    with pytest.raises(RuntimeError, match=r"finish\(\) called twice"):
        m.finish(state)
    for args, match in [((0, 2, 1), "dim must be an integer >= 1"), ((4, 0, 1), "n_sublayers must be an integer"),
                        ((4.0, 2, 1), "dim must be an integer"),
                        ((4, 2, 0), "^BlockAttnRes: block_size must be an integer >= 1, got 0$"),
                        ((4, 2, True), "block_size must be an integer >= 1, got True"),  # not a size of 1
                        ((4, 2, 1.0), "block_size must be an integer >= 1, got 1.0")]:
        with pytest.raises(ValueError, match=match):
            BlockAttnRes(*args)
    for eps in (-1.0, 0.0, float("nan"), "1e-6"):
        with pytest.raises(ValueError, match="eps .* must be a positive number"):
            BlockAttnRes(4, 2, 1, eps=eps)
    assert "dim=4, n_sublayers=2, schedule='two_phase', backend='auto', eps=1e-06, block_size=1" in repr(m)


def test_module_arguments_of_the_wrong_type_are_refused_naming_them():
    """``group_size=1.5`` was built (a schedule of fractional groups), ``group_size='2'`` failed
    comparing a str with an int; ``recompute_phase1="no"`` was taken as true; ``RMSNorm(0)``
    was built and a negative epsilon gave NaN."""
    for bad in (1.5, "2", 0, True):
        with pytest.raises(ValueError, match=rf"^FullAttnRes: group_size must be an integer >= 1, or None for "
                                             rf"round\(sqrt\(n_sublayers\)\); got {bad!r}$"):
            FullAttnRes(4, 4, group_size=bad)
    for make in (lambda v: BlockAttnRes(4, 4, 2, recompute_phase1=v), lambda v: FullAttnRes(4, 4, recompute_phase1=v)):
        for bad in ("no", 0, None):
            with pytest.raises(ValueError, match=rf"AttnRes: recompute_phase1 must be True or False, got {bad!r}$"):
                make(bad)
    from attnres.nn import RMSNorm

    for dim in (0, 4.0, None):
        with pytest.raises(ValueError, match=rf"^RMSNorm: dim \(the normalised last dimension\) must be an integer >= 1, "
                                             rf"got {dim!r}$"):
            RMSNorm(dim)
    for eps in (-1e-6, float("nan"), "1e-6"):
        with pytest.raises(ValueError, match=r"^RMSNorm: eps must be a finite number >= 0"):
            RMSNorm(4, eps)
    assert FullAttnRes(4, 9).group_size == 3 and RMSNorm(4, 0.0).eps == 0.0


def test_a_full_group_size_above_the_depth_is_one_group_of_all_sublayers():
    """``FullAttnRes(d, 4, group_size=10)`` was kept as 10 (its repr, and the first group a
    caller reads from ``group_size``) though it runs one group of the 4 sublayers: it is
    ``group_size=4``, the same function, as a config's ``full_group_size`` of 10 builds it.
    Below 1 it is refused (test_module_arguments_of_the_wrong_type_are_refused_naming_them)."""
    wide, exact = FullAttnRes(8, 4, group_size=10), FullAttnRes(8, 4, group_size=4)
    assert wide.group_size == 4 and "group_size=4" in repr(wide)
    assert build_residual({"kind": "attnres_full", "full_group_size": 10}, 8, 4).group_size == 4
    # (and the resolved config - what a run's resolved fields say - is the group the model runs)
    from attnres.models import ModelConfig

    assert ResidualConfig(kind="attnres_full", full_group_size=10).resolved_full_group_size(4) == 4
    assert ModelConfig(vocab_size=16, d_model=8, n_layers=2, n_heads=2, residual={
        "kind": "attnres_full", "full_group_size": 10}).resolved_fields()["residual.full_group_size"] == 4
    exact.load_state_dict(wide.state_dict())
    emb = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    sublayers = ToySublayers(8, 4, 0)
    assert torch.equal(run(wide, sublayers, emb)[0], run(exact, sublayers, emb)[0])


@pytest.mark.parametrize("make", [lambda: BlockAttnRes(8, 4, 2), lambda: FullAttnRes(8, 4),
                                  lambda: BlockAttnRes(8, 4, 2, schedule="naive"),
                                  lambda: FullAttnRes(8, 4, backend="reference")])
@pytest.mark.parametrize("defer_norm", [False, True])
def test_a_model_built_on_the_meta_device_runs_its_forward_and_backward_there(make, defer_norm):
    """Shape inference of a model built under ``torch.device("meta")``, with and without
    autocast: the operations asked the meta device for its autocast state ('unknown device
    type for autocast'); the reference, 'unsupported scalarType'."""
    from attnres.nn import RMSNorm

    with torch.device("meta"):
        m, norm, x = make(), RMSNorm(8), torch.empty(2, 3, 8, requires_grad=True)
        for autocast in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                state = m.start(x, defer_norm=defer_norm)
                for l in range(4):
                    m.add_output(state, l, torch.tanh(norm(m.sublayer_input(state, l))))
                out = m.finish(state)
            assert (out.shape, out.dtype, out.device.type) == ((2, 3, 8), torch.float32, "meta")
        out.sum().backward()
    assert m.mixers[1].query.grad.shape == (8,) and x.grad.device.type == "meta"


@pytest.mark.parametrize("kind", [k for k in registered_residuals() if residual_class(k).builtin()])
def test_a_residual_materialised_by_to_empty_refuses_its_first_forward_until_its_parameters_are_written(kind):
    """``to_empty(device=...)`` of a residual built on meta, then the forward without
    ``reset_parameters()``: its pseudo-queries held uninitialised memory (~1e24 or NaN) and the
    output was NaN, without a word. The first forward refuses, naming the fix, until each
    parameter is written: by ``reset_parameters()`` (the same function as a residual built on
    the CPU) or by a load; the refusal is then gone."""
    config = ResidualConfig(kind=kind, block_size=2)
    reference = build_residual(config, 8, 4)
    x = torch.randn(2, 3, 8)

    def output(residual):
        state = residual.start(x)
        for l in range(4):
            residual.add_output(state, l, torch.tanh(residual.sublayer_input(state, l)))
        return residual.finish(state)

    def reset(residual):  # (highway's and others' init draws: the same draws as the reference's)
        torch.manual_seed(0)
        residual.reset_parameters()

    reset(reference)
    for write in (reset, lambda r: r.load_state_dict(reference.state_dict())):
        with torch.device("meta"):
            residual = build_residual(config, 8, 4)
        residual.to_empty(device="cpu")
        if next(residual.parameters(), None) is not None:
            with pytest.raises(ValueError, match=rf"\.start: parameter\(s\) \[.*\] of residual '{kind}' hold the "
                                                 r"uninitialised memory to_empty\(\) left .* residual\.reset_parameters\(\)"):
                output(residual)
        write(residual)
        torch.testing.assert_close(output(residual), output(reference), rtol=0, atol=0)
        assert "_materialised" not in residual.__dict__  # (no later forward looks)


@pytest.mark.parametrize("kind", ["attnres_block", "attnres_full"])
def test_a_residual_materialised_by_to_empty_under_inference_mode_runs_once_written(kind):
    """``to_empty`` under ``torch.inference_mode()`` (a model set up for serving there) gives
    inference tensors, which track no version counter: marking them for the refusal above
    failed ("Inference tensors do not track version counter"), so no such model could be
    materialised. They go unmarked (a write to them cannot be seen), and the residual runs once
    written, as the one built on the CPU."""
    config = ResidualConfig(kind=kind, block_size=2)
    reference = build_residual(config, 8, 4)
    torch.manual_seed(0)
    reference.reset_parameters()
    x = torch.randn(2, 3, 8)
    with torch.inference_mode():
        with torch.device("meta"):
            residual = build_residual(config, 8, 4)
        residual.to_empty(device="cpu")
        residual.load_state_dict(reference.state_dict())
        state = residual.start(x)
        for l in range(4):
            residual.add_output(state, l, torch.tanh(residual.sublayer_input(state, l)))
        out = residual.finish(state)
    with torch.no_grad():
        state = reference.start(x)
        for l in range(4):
            reference.add_output(state, l, torch.tanh(reference.sublayer_input(state, l)))
        torch.testing.assert_close(out, reference.finish(state), rtol=0, atol=0)


@pytest.mark.parametrize("kind", [k for k in registered_residuals() if residual_class(k).builtin()])
def test_a_meta_embedding_runs_on_a_residual_on_meta_and_is_refused_by_name_by_one_with_parameters_elsewhere(kind):
    """A meta embedding (a shape query) was let through ``start`` whatever the parameters'
    device: Full and Block AttnRes, layerscale, highway and the hyper-connection kinds then
    failed inside naming an internal argument ('qg is on cpu but the sources are on meta',
    'Tensor on device cpu is not on the expected device meta!'), rezero and denseformer in the
    backward ('Cannot copy out of meta tensor'). Now a residual with parameters elsewhere
    refuses it at ``start`` naming its kind and the way (a copy on meta), which runs forward
    and backward; one without parameters runs it as it is."""
    residual = build_residual(ResidualConfig(kind=kind, block_size=2), 8, 4)
    x = torch.empty(2, 3, 8, device="meta", requires_grad=True)
    if next(residual.parameters(), None) is not None:
        with pytest.raises(ValueError, match=rf"\.start: the embedding is on meta but the parameters of residual "
                                             rf"'{kind}' are on cpu; a shape query runs on a copy there, "
                                             r"copy\.deepcopy\(residual\)\.to\('meta'\)"):
            residual.start(x)
        residual = copy.deepcopy(residual).to("meta")
    state = residual.start(x)
    for l in range(4):
        residual.add_output(state, l, torch.tanh(residual.sublayer_input(state, l)))
    out = residual.finish(state)
    out.sum().backward()
    assert (out.shape, out.device.type, x.grad.device.type) == ((2, 3, 8), "meta", "meta")


@pytest.mark.parametrize("kind", ["block", "full"])
def test_torch_func_transforms_of_a_forward_run_with_the_default_backend(kind):
    """``torch.func.vmap`` / ``grad`` of a model's forward failed inside the custom operators
    ('an autograd.Function ... must override the setup_context staticmethod'): under a
    transform the module runs the reference operations - the forward of each example and
    the gradients that plain autograd gives."""
    from torch.func import functional_call, grad, vmap

    fast, _, sublayers = make_pair(kind, 6, 5, S=2, group=2)
    emb = torch.randn(4, 3, 6, dtype=torch.float64)
    batched, _ = run(fast, sublayers, emb)
    assert_rel_close(vmap(lambda x: run(fast, sublayers, x)[0])(emb), batched, TOL[torch.float64], "vmap")
    driver = _Driver(fast, sublayers)
    params = dict(driver.named_parameters())
    grads = grad(lambda p: functional_call(driver, p, (emb,)).square().sum())(params)
    expected = torch.autograd.grad(batched.square().sum(), list(params.values()))
    for (name, g), e in zip(grads.items(), expected):
        assert_rel_close(g, e, GRAD_TOL[torch.float64], name)


@pytest.mark.parametrize("kind", ["block", "full"])
def test_a_vmap_over_a_forward_warns_of_no_missing_batching_rule(kind):
    """A ``vmap`` over a model with AttnRes warned "There is a performance drop because we
    have not yet implemented the batching rule for aten::addcmul_" (the reference's weighted
    sum added in place): under a transform it adds out of place, the same values."""
    from torch.func import vmap

    fast, _, sublayers = make_pair(kind, 6, 5, S=2, group=2)
    emb = torch.randn(4, 3, 6, dtype=torch.float64)
    said = _warnings_of(lambda: vmap(lambda x: run(fast, sublayers, x)[0])(emb))
    assert [m for m in said if "batching rule" in m] == []


@pytest.mark.parametrize("kind, backend", [("block", "auto"), ("block", "torch"), ("full", "auto")])
def test_a_loss_on_the_recorded_depth_weights_has_the_naive_references_gradient(kind, backend):
    """The operators' merge weights are not differentiable: a loss on the recorded depth
    weights (a regulariser of ``return_depth_weights``) sent the queries a wrong gradient with
    the default backend, silently (the reference backend's was right). The two-phase schedule
    now records weights with the reference's gradient, the same values."""
    fast, naive, sublayers = make_pair(kind, 6, 6, S=2, group=2)
    fast.backend = backend
    emb = torch.randn(2, 3, 6, dtype=torch.float64)
    grads = []
    for m in (fast, naive):
        _, weights = run(m, sublayers, emb, record=True)
        loss = sum((w * torch.linspace(-1, 1, w.numel(), dtype=w.dtype).reshape(w.shape)).sum() for w in weights)
        grads.append(torch.autograd.grad(loss, [*m.parameters(), *sublayers.parameters()]))
    for a, b in zip(*grads):
        assert_rel_close(a, b, GRAD_TOL[torch.float64])


class _Driver(torch.nn.Module):
    """A model's forward over ``residual`` and fixed toy sublayers (for ``functional_call``)."""

    def __init__(self, residual, sublayers):
        super().__init__()
        self.residual, self.sublayers = residual, [sublayers]

    def forward(self, emb):
        return run(self.residual, self.sublayers[0], emb)[0]


@pytest.mark.parametrize("kind", ["block", "full"])
def test_an_update_through_data_is_seen_by_the_no_grad_forward_after_eval(kind):
    """A hand-written SGD step, ``p.data -= lr * p.grad``, bumps no version counter: the
    no-grad evaluation after it (``model.eval()``, ``torch.no_grad()``) ran with the folded
    queries kept from the evaluation before - the old parameters, silently."""
    fast, _, sublayers = make_pair(kind, 6, 5)
    emb = torch.randn(2, 3, 6, dtype=torch.float64)
    with torch.no_grad():
        before, _ = run(fast, sublayers, emb)
    fast.train()
    run(fast, sublayers, emb)[0].square().sum().backward()
    for p in fast.parameters():
        p.data -= 0.5 * p.grad
    fast.eval()
    _assert_the_no_grad_forward_sees_the_update(fast, sublayers, emb, before)


def _assert_the_no_grad_forward_sees_the_update(fast, sublayers, emb, before) -> None:
    """A no-grad forward of ``fast`` now: not ``before``, and what a forward with autograd (which
    keeps nothing) computes."""
    with torch.no_grad():
        after, _ = run(fast, sublayers, emb)
    with torch.enable_grad():
        expected, _ = run(fast, sublayers, emb)
    assert not torch.equal(after, before)
    assert_rel_close(after, expected.detach(), TOL[torch.float64])


@pytest.mark.parametrize("kind", ["block", "full"])
def test_a_fused_optimizer_step_is_seen_by_the_next_no_grad_forward(kind):
    """``AdamW(..., fused=True)`` updates the parameters in place without bumping their version
    counters: the no-grad forward after its step inside the training loop (a sample, a
    validation loss, no ``model.eval()`` in between) ran with the folded queries kept from the
    no-grad forward before it - the old queries, silently."""
    fast, _, sublayers = make_pair(kind, 6, 5)
    emb = torch.randn(2, 3, 6, dtype=torch.float64)
    opt = torch.optim.AdamW(fast.parameters(), lr=0.5, fused=True)
    with torch.no_grad():
        before, _ = run(fast, sublayers, emb)
    run(fast, sublayers, emb)[0].square().sum().backward()
    versions = [p._version for p in fast.parameters()]
    opt.step()
    assert [p._version for p in fast.parameters()] == versions  # (what the queries kept were keyed on)
    _assert_the_no_grad_forward_sees_the_update(fast, sublayers, emb, before)


class _Doubled(torch.nn.Module):
    def forward(self, x):
        return 2 * x


@pytest.mark.parametrize("kind", ["block", "full"])
def test_parametrized_queries_and_gains_run_without_grad_and_follow_their_originals(kind):
    """``torch.nn.utils.parametrize`` on a pseudo-query or a key-norm gain: every no-grad
    forward (evaluation, ``model.eval()`` + ``torch.no_grad()``) was a ``KeyError: 'query'``."""
    from torch.nn.utils import parametrize

    fast, _, sublayers = make_pair(kind, 6, 4)
    parametrize.register_parametrization(fast.mixers[1], "query", _Doubled())
    parametrize.register_parametrization(fast.mixers[2].key_norm, "weight", _Doubled())
    emb = torch.randn(2, 3, 6, dtype=torch.float64)
    for _ in range(2):  # the second after a change of an original, which nothing must have kept
        with torch.no_grad():
            got, _ = run(fast, sublayers, emb)
        expected, _ = run(fast, sublayers, emb)
        assert_rel_close(got, expected.detach(), TOL[torch.float64])
        with torch.no_grad():
            fast.mixers[1].parametrizations.query.original.add_(1.0)
    assert not torch.equal(got, run(fast, sublayers, emb)[0].detach())


class _OwnModel(torch.nn.Module):
    """The README's own-model loop around ``residual``, ``Linear`` sublayers."""

    def __init__(self, residual):
        super().__init__()
        self.residual = residual
        self.sublayers = torch.nn.ModuleList(torch.nn.Linear(residual.dim, residual.dim)
                                             for _ in range(residual.n_sublayers))

    def forward(self, x):
        state = self.residual.start(x)
        for l, sublayer in enumerate(self.sublayers):
            self.residual.add_output(state, l, sublayer(self.residual.sublayer_input(state, l)))
        return self.residual.finish(state)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("make", [lambda b: BlockAttnRes(8, 4, 2, backend=b), lambda b: FullAttnRes(8, 4, backend=b)])
def test_a_jit_trace_without_grad_runs_and_reads_the_parameters_it_runs_with(make, backend):
    """``torch.jit.trace`` under ``torch.no_grad()``: the C kernel failed inside the trace
    ("tokens must be int64_t, got Tensor"), and the reference's trace kept the folded queries
    of a forward before it as a constant - the parameters at trace time, silently."""
    import warnings

    model = _OwnModel(make(backend))
    x = torch.randn(2, 5, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)  # (torch 2.13 deprecates torch.jit.trace; it still runs)
        model(x)  # (a forward before the trace, as in evaluation)
        traced = torch.jit.trace(model, (x,))
        for p in model.residual.parameters():
            p.normal_()
        x = torch.randn(3, 7, 8)
        assert_rel_close(traced(x), model(x), TOL[torch.float32])


def test_a_deferred_input_handed_to_another_norm_says_what_to_do():
    """``start(..., defer_norm=True)`` hands sublayers an input whose norm the residual's
    kernel applies; a sublayer starting with another layer failed deep in PyTorch ('must be
    Tensor, not FusableNormInput')."""
    m = BlockAttnRes(8, 4, 2)
    state = m.start(torch.randn(2, 3, 8), defer_norm=True)
    x = m.sublayer_input(state, 0)
    for layer in (torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.RMSNorm(8)):
        with pytest.raises(TypeError, match=r"first pass its input to an attnres.nn.RMSNorm.*defer_norm=False"):
            layer(x)
    # (a sublayer that reads its input as a tensor before the norm, batch, seq, _ = x.shape: "'FusableNormInput'
    # object has no attribute 'shape'")
    for read in (lambda: x.shape, lambda: x.view(-1, 8)):
        with pytest.raises(AttributeError, match=r"^\.(shape|view) was read from a deferred sublayer input .*"
                                                 r"attnres.nn.RMSNorm.*defer_norm=False"):
            read()
    assert not hasattr(x, "__deepcopy__") and not hasattr(x, "shape")
    # (one that scales or slices it first, h * 0.5 or h[..., :4]: "unsupported operand type(s) for *:
    # 'FusableNormInput' and 'float'", "'FusableNormInput' object is not subscriptable")
    for op in (lambda: x * 0.5, lambda: 2 + x, lambda: -x, lambda: x[..., :4], lambda: x @ torch.eye(8)):
        with pytest.raises(TypeError, match=r"operator .* was applied to a deferred sublayer input .*defer_norm=False"):
            op()


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_bad_block_size_raises(bad):
    with pytest.raises(ValueError, match="block_size"):
        BlockAttnRes(4, 4, bad)


def test_bad_impl_raises():
    with pytest.raises(ValueError, match="schedule must be one of"):
        FullAttnRes(4, 4, schedule="fast")
    with pytest.raises(ValueError, match=r"got 'two-phase' \(did you mean 'two_phase'\?\)"):
        FullAttnRes(4, 4, schedule="two-phase")
    with pytest.raises(ValueError, match=r"backend must be one of .*, got 'trition' \(did you mean 'triton'\?\)"):
        BlockAttnRes(4, 4, 2, backend="trition")


def test_float32_rule_accepts_an_equally_accurate_path_whatever_its_rounding_direction():
    """Regression (an AVX-512 machine): two float32 paths equally far from the float64 truth
    but in opposite directions differ by twice that distance. The old rule,
    ``err(fast, naive) <= max(1e-5, 2 err(naive, truth))``, failed such a pair; the rule held
    against the truth passes it - and still fails a path that is less accurate."""
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(1000, generator=g, dtype=torch.float64)
    direction = torch.randn(1000, generator=g, dtype=torch.float64)
    direction *= 5.4e-6 * truth.norm() / direction.norm()
    naive, fast = truth + direction, truth - 1.04 * direction  # 5.4e-6 and 5.6e-6 from the truth
    old_rule_err = (fast - naive).norm() / naive.norm()
    assert old_rule_err > 2 * (naive - truth).norm() / truth.norm() and old_rule_err > 1e-5  # the old rule fails
    assert fast_path_violations([fast.float()], [naive.float()], [truth], torch.float32, ["x"], 1e-5) == []
    worse = truth - 3 * 1.04 * direction  # three times less accurate than the reference path
    assert fast_path_violations([worse.float()], [naive.float()], [truth], torch.float32, ["x"], 1e-5)


def test_float32_rule_measures_small_tensors_at_the_scale_of_the_largest():
    """A small gradient (a depth query at 1e-2 of the largest) may be several times less
    accurate than the naive path's relative to its own norm, as long as its error is within
    the tolerance at the largest tensor's scale; a wrong small gradient still fails."""
    g = torch.Generator().manual_seed(1)
    big, small = torch.randn(1000, generator=g, dtype=torch.float64), torch.randn(10, generator=g, dtype=torch.float64)
    small *= 1e-2 * big.norm() / small.norm()
    noise = torch.randn(10, generator=g, dtype=torch.float64)
    noise *= 1e-6 * small.norm() / noise.norm()  # naive: 1e-6 of its own norm
    truth = [big, small]
    naive = [big.float(), (small + noise).float()]
    loose = [big.float(), (small - 7 * noise).float()]  # 7x the naive error: 7e-8 of the largest tensor
    assert fast_path_violations(loose, naive, truth, torch.float32, ["big", "small"], 1e-5) == []
    wrong = [big.float(), (small * 1.01).float()]  # 1 % off: 1e-4 of the largest tensor's norm
    assert fast_path_violations(wrong, naive, truth, torch.float32, ["big", "small"], 1e-5)


@pytest.mark.parametrize("n_layers, block_size, warns", [(3, 5, False), (3, 6, True), (3, 100, True), (3, None, False),
                                                         (1, 1, False)])
def test_a_block_size_of_the_whole_model_warns_naming_the_field_and_the_largest_of_two_blocks(n_layers, block_size,
                                                                                             warns):
    """``model.residual.block_size=100`` (or 8 of a 3-layer model, S counted in layers) was
    accepted without a word: S >= L is one block (report §3.2), which Block AttnRes defines, but
    rarely what was meant. It warns, naming the field, the sublayers and the largest S of 2+
    blocks; S < L, the default and a 1-layer model's S = 1 say nothing."""
    import warnings

    from attnres.models import ModelConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ModelConfig.preset("tiny", n_layers=n_layers, residual={"kind": "attnres_block", "block_size": block_size})
    said = [str(w.message) for w in caught]
    if not warns:
        assert said == []
        return
    assert said == [f"ModelConfig.residual.block_size = {block_size} is at least the model's "
                    "6 sublayers (3 layers of 2): Block AttnRes has a single block (N = 1), no completed block to attend "
                    "over; block_size counts sublayers - at most 5 gives 2 or more blocks; unset, it is 1: 6 blocks (about "
                    "8 where the depth allows, as the report recommends, §3.2)"]


@pytest.mark.parametrize("make", [lambda: BlockAttnRes(8, 4, 2), lambda: FullAttnRes(8, 4), lambda: StandardResidual(8, 4)])
def test_a_state_serves_the_module_that_began_it_and_a_tensor_is_no_state(make):
    """``residual.sublayer_input(h, l)`` - the hidden state given for the state - failed in
    "'Tensor' object has no attribute 'next_sublayer'"; in a model with two residual modules, the
    state of one given to the other failed in an AttributeError from inside the schedule, or,
    between two of one class, ran on with the first one's sources and queries without a word."""
    residual, x = make(), torch.randn(2, 3, 8)
    for call in (lambda: residual.sublayer_input(x, 0), lambda: residual.add_output(x, 0, x),
                 lambda: residual.finish(x), lambda: residual.history(x), lambda: residual.mixing_matrix(x)):
        with pytest.raises(TypeError, match=r"\.(sublayer_input|add_output|finish|history|mixing_matrix)\(state.*: state "
                                            r"must be what residual.start\(x\) returned \(a ResidualState\), got Tensor"):
            call()
    for other in (make(), BlockAttnRes(8, 4, 2), StandardResidual(8, 4)):
        state = other.start(x)
        with pytest.raises(ValueError, match=r"sublayer_input\(state, l\): this state was begun by another residual "
                                             "module"):
            residual.sublayer_input(state, 0)
    state = residual.resume(residual.history(residual.start(x)), 0)  # (resumed: its own too)
    for l in range(4):
        residual.add_output(state, l, residual.sublayer_input(state, l))
    assert residual.finish(state).shape == x.shape


def test_the_folded_query_of_bfloat16_parameters_is_their_float32_product():
    """The two-phase path folds the key-norm gain into the query (report §3.1); of bfloat16
    parameters the product is taken in float32, as the naive path's keys * gain and query
    product are - folded in bfloat16 first, the two schedules differed by the product's rounding."""
    from attnres.nn import DepthQuery

    g = torch.Generator().manual_seed(0)
    mixer = DepthQuery(64)
    with torch.no_grad():
        mixer.query.copy_(torch.randn(64, generator=g))
        mixer.key_norm.weight.copy_(1 + torch.rand(64, generator=g))
    mixer = mixer.to(torch.bfloat16)
    exact = mixer.query.float() * mixer.key_norm.weight.float()  # (8-bit mantissas: exact in float32)
    assert torch.equal(mixer.folded_query(torch.float32), exact)


@pytest.mark.parametrize("schedule", ["two_phase", "naive"])
def test_an_output_wider_than_the_stream_is_cast_to_the_streams_dtype(schedule):
    """Block AttnRes' merge reads a narrower output (an autocast sublayer's bf16) as it is; a
    wider one - float32 into a bfloat16 stream - is cast to the stream's dtype first, as every
    variant casts it: the forward equals the one given the outputs cast by hand, bit for bit."""
    fast, naive, _ = make_pair("block", 8, 5, S=2)
    m = fast if schedule == "two_phase" else naive
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(2, 3, 8, generator=g).to(torch.bfloat16)
    outs = [torch.randn(2, 3, 8, generator=g) for _ in range(5)]

    def forward(cast):
        state = m.start(emb)
        for l, out in enumerate(outs):
            m.sublayer_input(state, l)
            m.add_output(state, l, out.to(torch.bfloat16) if cast else out)
        return m.finish(state)

    with torch.no_grad():
        assert torch.equal(forward(cast=False), forward(cast=True))


def test_a_depth_query_of_ones_own_is_called_like_a_layer():
    """``DepthQuery(d)(sources)`` - one mixer in a model of one's own - ended in nn.Module's
    "missing the required forward function": it runs :meth:`attend`."""
    from attnres.nn import DepthQuery

    query, sources = DepthQuery(8), [torch.randn(2, 3, 8) for _ in range(3)]
    with torch.no_grad():
        query.query.normal_()
    h, w = query(sources, return_weights=True)
    assert torch.equal(h, query.attend(sources)) and w.shape == (3, 2, 3)


def _warnings_of(call) -> list[str]:
    """The messages of the warnings ``call()`` gives, every one."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught]


def test_build_residual_takes_a_variant_by_name_or_mapping_as_a_model_config_does():
    """``build_residual("highway", d, L)`` - any registered variant in a model of one's own -
    ended in "'str' object has no attribute 'kind'" (a mapping likewise): it takes what
    ``ModelConfig.residual`` takes, checked as a model's config is."""
    assert type(build_residual("highway", 8, 4)).__name__ == "Highway"
    block = build_residual({"kind": "attnres_block", "block_size": 2}, 8, 4)
    assert (block.name, block.block_size, block.n_sublayers) == ("attnres_block", 2, 4)
    with pytest.raises(ValueError, match=r"unknown ModelConfig.residual key\(s\) \['blok_size'\] \(did you mean "
                                         "'block_size'"):
        build_residual({"kind": "attnres_block", "blok_size": 2}, 8, 4)
    with pytest.raises(ValueError, match="ModelConfig.residual.kind must be one of .*got 'attnres_blok'"):
        build_residual("attnres_blok", 8, 4)
    said = _warnings_of(lambda: build_residual({"kind": "attnres_block", "block_size": 8}, 8, 4))
    assert [m.split(" = ")[0] for m in said] == ["ModelConfig.residual.block_size"]


def test_build_residual_takes_the_fields_of_a_name_or_mapping_as_keywords():
    """``build_residual("attnres_block", d, L, block_size=2)`` was a TypeError, "unexpected
    keyword argument 'block_size'": the keywords are fields, checked as a mapping's; a
    ``ResidualConfig`` (complete) is refused with them, naming ``dataclasses.replace``."""
    block = build_residual("attnres_block", 8, 4, block_size=2)
    assert (block.name, block.block_size) == ("attnres_block", 2)
    assert build_residual({"kind": "attnres_block", "block_size": 1}, 8, 4, block_size=4).block_size == 4
    with pytest.raises(ValueError, match=r"\['blok_size'\] \(did you mean 'block_size'"):
        build_residual("attnres_block", 8, 4, blok_size=2)
    with pytest.raises(ValueError, match=r"a ResidualConfig takes no more fields \(\['block_size'\]\): .*"
                                         r"dataclasses\.replace\(config, \.\.\.\)"):
        build_residual(ResidualConfig(kind="attnres_block"), 8, 4, block_size=2)


def test_a_variants_from_config_refuses_a_config_of_another_kind():
    """``BlockAttnRes.from_config(ResidualConfig(kind="attnres_full"), d, L)`` built a Block
    AttnRes and ignored the kind (Full's of an ``attnres_block`` config a Full, a baseline's of
    any config itself): each built-in variant's refuses another kind, naming it and
    ``build_residual``; its own kind builds as before."""
    from attnres.nn.residual.baselines import MHCLite

    for cls, kind in [(BlockAttnRes, "attnres_full"), (FullAttnRes, "attnres_block"), (StandardResidual, "highway"),
                      (residual_class("highway"), "standard"), (residual_class("mhc"), "hyper_connections"),
                      (MHCLite, "mhc"), (residual_class("hyper_connections"), "mhc_lite")]:
        with pytest.raises(ValueError, match=rf"{cls.__qualname__}.from_config builds residual '{cls.name}'; the "
                                             rf"config's kind is '{kind}' .*build_residual\(config, dim, n_sublayers"):
            cls.from_config(ResidualConfig(kind=kind, block_size=2), 8, 4)
        assert type(cls.from_config(ResidualConfig(kind=cls.name, block_size=2), 8, 4)) is cls


@pytest.mark.parametrize("n_sublayers, block_size, warns", [(8, 7, False), (8, 8, True), (4, 100, True), (1, 1, False)])
def test_a_block_attnres_built_as_one_block_in_ones_own_model_warns_once(n_sublayers, block_size, warns):
    """``BlockAttnRes(d, 8, block_size=8)`` in a model of one's own (8 blocks meant, the report's N)
    built a single block without a word, where a config's ``block_size`` warns. It warns, once,
    in words for the module's arguments; a model built from a config says it once, as the config
    is checked (its residual is built without a second warning)."""
    from attnres.models import ModelConfig

    said = _warnings_of(lambda: BlockAttnRes(8, n_sublayers, block_size))
    if not warns:
        assert said == []
        return
    assert said == [f"BlockAttnRes: block_size={block_size} is at least its n_sublayers={n_sublayers}: Block AttnRes has a "
                    "single block (N = 1), no completed block to attend over; block_size counts sublayers - at most "
                    f"{n_sublayers - 1} gives 2 or more blocks (a block size, not a number of blocks); 1 gives "
                    f"{n_sublayers} blocks (about 8 where the depth allows, as the report recommends, §3.2)"]
    said = _warnings_of(lambda: (
        ModelConfig(d_model=8, n_layers=n_sublayers // 2, n_heads=2, residual={"kind": "attnres_block", "block_size": block_size}),
        build_residual(ResidualConfig(kind="attnres_block", block_size=block_size), 8, n_sublayers)))
    assert [m.split(" = ")[0] for m in said] == ["ModelConfig.residual.block_size"]


def test_the_single_block_warning_of_a_one_layer_model_gives_its_own_default():
    """``attnres experiment scaling --preset tiny`` (docs/experiments.md, "seconds") warned of
    its one-layer Block model that unset, block_size "is 1: about 8 blocks" (it is 2: Full
    AttnRes) of "1 layers of 2". The default's own count of blocks is given, and one layer is one."""
    import warnings

    from attnres.models import ModelConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ModelConfig.preset("tiny", n_layers=1, residual={"kind": "attnres_block", "block_size": 2})
    said = " ".join(str(w.message) for w in caught)
    assert "the model's 2 sublayers (1 layer of 2)" in said
    assert "unset, it is 1: 2 blocks (about 8 where the depth allows" in said


def test_a_single_block_config_read_back_is_not_warned_of_again(tmp_path):
    """``ModelConfig(**config.to_dict())`` and ``TrainConfig(model=config.to_dict())`` of a Block
    AttnRes config of a single block repeated the warning that building ``config`` gave: a new
    ResidualConfig object, which its mark did not cover. A config read back says nothing, as of
    the residual fields its variant does not read; a config stated anew, or a config file of
    every field (a ``--print-config`` dump: the user's file), still warns."""
    yaml = pytest.importorskip("yaml")
    from attnres.models import ModelConfig
    from attnres.train import TrainConfig, load_config

    def single(call) -> int:
        return sum("single block" in m for m in _warnings_of(call))

    block = {"kind": "attnres_block", "block_size": 8}  # (the tiny preset: 4 sublayers)
    with pytest.warns(UserWarning, match="single block"):  # (said once, where it is stated)
        config = ModelConfig.preset("tiny", residual=dict(block))
    assert single(lambda: ModelConfig(**config.to_dict())) == 0
    assert single(lambda: TrainConfig(model=config.to_dict())) == 0
    assert single(lambda: ModelConfig.preset("tiny", **config.to_dict())) == 0
    assert single(lambda: ModelConfig(**{**config.to_dict(), "residual": dict(block)})) == 1
    (tmp_path / "every-field.yaml").write_text(yaml.safe_dump({"model": config.to_dict()}))
    assert single(lambda: load_config(str(tmp_path / "every-field.yaml"), [])) == 1


def test_the_single_block_warning_names_the_block_size_as_each_path_writes_it():
    """A single block was warned of as "model.residual.block_size (attnres upcycle's
    --block-size) = 8" whatever the path: a plain ``ModelConfig(...)`` or ``AttnResConfig(...)``
    was pointed at a flag of a command the user never ran. Each path now names the field as
    the user wrote it there; upcycle keeps its flag."""
    from attnres.models import ModelConfig
    from attnres.train import TrainConfig, load_config

    block = {"kind": "attnres_block", "block_size": 8}  # (the tiny preset: 2 layers, 4 sublayers)

    def named(call):
        return [m.split(" = ")[0] for m in _warnings_of(call) if "single block" in m]

    assert named(lambda: ModelConfig.preset("tiny", residual=dict(block))) == ["ModelConfig.residual.block_size"]
    assert named(lambda: TrainConfig(model={"preset": "tiny", "residual": dict(block)})) == ["model.residual.block_size"]
    assert named(lambda: load_config(None, ["model=tiny", "model.residual.block_size=8"])) == \
        ["model.residual.block_size"]
    pytest.importorskip("transformers")
    from attnres.hf import AttnResConfig
    from attnres.upcycle import upcycle
    from fixtures.tiny_families import tiny_model

    fields = {**ModelConfig.preset("tiny").to_dict(), "residual": dict(block)}
    assert named(lambda: AttnResConfig(**fields)) == ["AttnResConfig.residual['block_size']"]
    assert named(lambda: upcycle(tiny_model("llama"), block_size=8)) == \
        ["model.residual.block_size (attnres upcycle's --block-size)"]


@pytest.mark.parametrize("make", [lambda: BlockAttnRes(8, 4, 2), lambda: FullAttnRes(8, 4)])
def test_a_resume_compiles_with_a_dynamic_batch(make):
    """``resume`` under ``torch.compile`` with the history's first dimension dynamic (vLLM's
    pipeline stages mark the token count so): checking that the history's tensors share one
    shape hashed the symbolic sizes into a set, which made them constants, and the compile
    failed ("marked as dynamic but your code specialized it to be a constant")."""
    m = make()
    history = m.history(_run_to(m, torch.randn(6, 8), 2))

    def resumed_output(completed, running):
        state = m.resume(type(history)(completed, running), 2)
        return m.sublayer_input(state, 2)

    completed = [t.clone() for t in history.completed]
    for t in (*completed, *([history.running] if history.running is not None else [])):
        torch._dynamo.mark_dynamic(t, 0)
    torch._dynamo.reset()
    compiled = torch.compile(resumed_output, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(completed, history.running), resumed_output(completed, history.running))
