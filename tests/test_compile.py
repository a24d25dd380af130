"""``torch.compile(model)`` runs for every variant and matches eager (forward and gradients)."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import assert_rel_close, make_model

pytestmark = pytest.mark.compile


@pytest.mark.slow  # (the input check in front of the compiled graph: also the test below's)
@pytest.mark.parametrize("residual", ["standard", "attnres_full", "attnres_block"])
def test_compiled_model_matches_eager(residual):
    """(AttnRes's compiled step against eager and the float64 truth, operator by operator:
    test_compiled_training_runs_the_depth_attention_operators; here the baseline too, and the
    input check in front of the compiled graph.)"""
    torch._dynamo.reset()
    model = make_model(residual={"kind": residual, "block_size": 3}, n_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    eager = model(ids, labels=ids)
    eager_grads = torch.autograd.grad(eager.loss, list(model.parameters()))
    compiled = torch.compile(model)
    out = compiled(ids, labels=ids)
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    assert_rel_close(out.logits, eager.logits, 1e-5, "logits")
    assert_rel_close(out.loss.reshape(1), eager.loss.reshape(1), 1e-5, "loss")
    for (name, _), g, ge in zip(model.named_parameters(), grads, eager_grads):
        assert_rel_close(g, ge, 1e-4, f"grad of {name}")
    # Input validation still runs in front of the compiled graph: the graph just compiled (the
    # same shape and arguments; other ones compiled a second, dynamic graph: 10-45 CPU-s).
    with pytest.raises(ValueError, match="outside the vocabulary"):
        compiled(torch.full((2, 9), model.config.vocab_size), labels=ids)


@pytest.mark.parametrize("residual", ["attnres_block", "attnres_full"])
def test_compiled_inference_matches_eager(residual):
    """Compiled forwards without autograd (``no_grad``, ``inference_mode``) run the operators
    directly and match eager (regression: Dynamo inlined the autograd Functions' ``forward``
    under ``no_grad`` with shifted arguments, and the C kernel crashed)."""
    torch._dynamo.reset()
    model = make_model(residual={"kind": residual, "block_size": 3}, n_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    compiled = torch.compile(model)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            assert_rel_close(compiled(ids).logits, model(ids).logits, 1e-5, f"logits under {mode.__name__}")


@pytest.mark.parametrize("residual", ["attnres_block", "attnres_full"])
def test_compiled_training_runs_the_depth_attention_operators(residual, monkeypatch):
    """``torch.compile`` traces the depth-attention operators as nodes of one graph (no graph
    break), so the compiled step runs the same kernels as eager - the CPU kernel here - and
    its loss and gradients equal eager's within the float32 rule (against the float64
    truth)."""
    from attnres.ops.depth_attention import cpu_kernel

    from conftest import GRAD_TOL, TOL, assert_fast_matches_naive

    torch._dynamo.reset()
    model = make_model(residual={"kind": residual, "block_size": 3}, n_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    explained = torch._dynamo.explain(model)(ids, labels=ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    # (the operators are reached through autograd Functions: Dynamo traces each into a
    # subgraph of its forward and one of its backward)
    targets = {str(n.target) for g in explained.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function"}
    assert {"attnres.phase1", "attnres.merge", "attnres.phase1_backward", "attnres.merge_backward"} <= targets

    torch._dynamo.reset()
    ran = []
    if cpu_kernel.cpu_kernel() is not None:
        for name in ("phase1_forward", "phase1_backward", "merge_forward", "merge_backward"):
            fn = getattr(cpu_kernel, name)
            monkeypatch.setattr(cpu_kernel, name, lambda *a, _fn=fn, _name=name, **k: (ran.append(_name), _fn(*a, **k))[1])

    def step(m, runner):
        out = runner(ids, labels=ids)
        return [out.loss.reshape(1), *torch.autograd.grad(out.loss, list(m.parameters()))]

    compiled_model = torch.compile(model)
    compiled = step(model, compiled_model)
    if cpu_kernel.cpu_kernel() is not None:
        assert {"phase1_forward", "phase1_backward", "merge_forward", "merge_backward"} <= set(ran)
    # Input validation still runs in front of the compiled graph: the graph just compiled (the
    # same shape and arguments; other ones compiled a second, dynamic graph: 10-45 CPU-s).
    with pytest.raises(ValueError, match="outside the vocabulary"):
        compiled_model(torch.full((2, 9), model.config.vocab_size), labels=ids)
    eager = step(model, model)
    truth_model = copy.deepcopy(model).double()
    truth = step(truth_model, truth_model)
    names = ["loss"] + [f"grad of {n}" for n, _ in model.named_parameters()]
    assert_fast_matches_naive(compiled[:1], eager[:1], truth[:1], torch.float32, names[:1], TOL[torch.float32])
    assert_fast_matches_naive(compiled[1:], eager[1:], truth[1:], torch.float32, names[1:], GRAD_TOL[torch.float32])


@pytest.mark.parametrize("option", ["autocast_stream", pytest.param("autocast_norm_output", marks=pytest.mark.slow),
                                    pytest.param("autocast_phase1_sums", marks=pytest.mark.slow)])
def test_compiled_autocast_stream_has_no_graph_break_and_matches_eager(option):
    """``autocast_stream`` (``autocast_norm_output``: the merges' outputs in bf16, their fake
    implementation's dtype; ``autocast_phase1_sums``: Phase 1's sums in bf16) under bf16 autocast: the autocast state it reads is traced (no
    graph break), and the compiled step is as close to the float64 truth as eager's (the bf16
    rule of ``assert_fast_matches_naive``)."""
    from conftest import GRAD_TOL, TOL, assert_fast_matches_naive

    torch._dynamo.reset()
    model = make_model(residual={"kind": "attnres_block", "block_size": 3, option: True}, n_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(model)(ids, labels=ids)
    assert explained.graph_break_count == 0, explained.break_reasons

    def step(m, runner, autocast=True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = runner(ids, labels=ids).loss
        return [loss.reshape(1), *torch.autograd.grad(loss, list(m.parameters()))]

    compiled, eager = step(model, torch.compile(model)), step(model, model)
    truth_model = copy.deepcopy(model).double()
    truth = step(truth_model, truth_model, autocast=False)
    names = ["loss"] + [f"grad of {n}" for n, _ in model.named_parameters()]
    bf16 = torch.bfloat16
    assert_fast_matches_naive(compiled[:1], eager[:1], truth[:1], bf16, names[:1], TOL[bf16])
    assert_fast_matches_naive(compiled[1:], eager[1:], truth[1:], bf16, names[1:], GRAD_TOL[bf16])


@pytest.mark.parametrize("residual", ["attnres_block", "attnres_full"])
def test_compiled_autocast_step_hands_each_reader_a_view_of_the_merge_output(residual, monkeypatch):
    """Under bf16 autocast the traced step keeps the merges' views for their readers (one for
    each of q, k, v and of gate, up): compared with one tensor for all readers, the forward
    graph has the 5 casts a layer of the sublayer inputs fewer, and the backward graph the 3
    additions a layer of the readers' gradients fewer - each sublayer's merge backward reads
    its readers' gradients as the projections' backward produced them (what inductor cannot
    fuse into our operator, it no longer has to compute)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from attnres.nn import transformer

    layers = 4

    def graphs(views: bool):
        if not views:
            monkeypatch.setattr(transformer.Attention, "input_readers", 1)
            monkeypatch.setattr(transformer.SwiGLU, "input_readers", 1)
        torch._dynamo.reset()
        got = {}

        def keep(name):
            def compiler(gm, _inputs):
                got[name] = gm.graph
                return make_boxed_func(gm.forward)

            return compiler

        model = make_model(residual={"kind": residual, "block_size": 2}, n_layers=layers)
        ids = torch.randint(0, model.config.vocab_size, (2, 6))
        compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(ids, labels=ids).loss
        loss.backward()
        monkeypatch.undo()
        targets = [[str(n.target) for n in got[g].nodes if n.op == "call_function"] for g in ("forward", "backward")]
        sums = [str(n.args[0].target) for n in got["backward"].nodes if str(n.target) == "attnres.merge_backward.default"]
        return targets[0].count("aten._to_copy.default"), targets[1].count("aten.add.Tensor"), sums

    casts, adds, sums = graphs(True)
    want_casts, want_adds, want_sums = graphs(False)
    assert (want_casts - casts, want_adds - adds) == (5 * layers, 3 * layers)
    # (the sublayers' merges: all but the output aggregation's)
    assert sum(s == "aten.add.Tensor" for s in want_sums) - sum(s == "aten.add.Tensor" for s in sums) == 2 * layers


def test_every_residual_compiles_with_fullgraph():
    """``torch.compile(model, fullgraph=True)`` traces every registered residual's forward
    as one graph (regression: the input check ran through ``torch.compiler.disable``, a
    graph break that ``fullgraph=True`` refused for every kind). Dynamo alone (the ``eager``
    backend) decides graph breaks; Inductor's numerics are checked below and above."""
    from attnres.nn.residual import registered_residuals

    # (attnres's own: a variant another test module registered is not seen here, registry_isolation)
    for kind in registered_residuals():
        torch._dynamo.reset()
        model = make_model(residual={"kind": kind, "block_size": 3} if kind == "attnres_block" else {"kind": kind},
                           n_layers=2)
        ids = torch.randint(0, model.config.vocab_size, (2, 9))
        out = torch.compile(model, fullgraph=True, backend="eager")(ids, labels=ids)
        assert_rel_close(out.logits, model(ids).logits, 1e-5, f"{kind} logits")


def test_fullgraph_inductor_step_still_checks_the_token_ids():
    """Under Inductor with ``fullgraph=True`` the value check is a node of the graph that
    the embedding reads (an op without a read output was dead code to Inductor, and an
    out-of-vocabulary id reached the embedding kernel's bounds assert); it refuses as the
    eager model does, and the step matches eager."""
    torch._dynamo.reset()
    model = make_model(residual={"kind": "attnres_block", "block_size": 3}, n_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        assert_rel_close(compiled(ids).logits, model(ids).logits, 1e-5, "logits")
        for bad in (model.config.vocab_size, -1):
            with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
                compiled(torch.full((2, 9), bad))


def test_the_token_check_is_kept_out_of_a_cuda_graph():
    """The check reads the ids to the host, which a CUDA graph capture refuses: Inductor must
    see its node as cudagraph-unsafe (``mode="reduce-overhead"`` then partitions around it or
    leaves the graph uncaptured), and it is the graph's only such node."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.utils import get_first_incompatible_cudagraph_node

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    model = make_model(residual={"kind": "attnres_block", "block_size": 3}, n_layers=2)
    with torch.no_grad():
        torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=keep))(torch.randint(0, 64, (2, 9)))
    (graph,) = graphs
    unsafe = get_first_incompatible_cudagraph_node(graph)
    assert unsafe is not None and unsafe.target is torch.ops.attnres.checked_token_ids.default
    others = [n for n in graph.graph.nodes if n is not unsafe and n.op == "call_function"
              and torch._inductor.utils.is_cudagraph_unsafe_fx_node(n)]
    assert others == []


@pytest.mark.parametrize("residual", ["standard", "attnres_block"])
def test_changing_sequence_lengths_compile_two_graphs_without_a_graph_break(residual):
    """Five sequence lengths: one static graph, then one dynamic graph for the others
    (regression: with dynamic shapes ``is_causal`` was a SymBool, which SDPA refused - a
    graph break in every layer, and Block's ``sublayer_input`` frames hit Dynamo's
    recompile limit and ran eagerly)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = make_model(residual={"kind": residual, "block_size": 3}, n_layers=2)
    compiled = torch.compile(model, backend="eager")
    for t in (5, 7, 9, 11, 13):
        ids = torch.randint(0, model.config.vocab_size, (2, t))
        assert_rel_close(compiled(ids).logits, model(ids).logits, 1e-5, f"logits at T={t}")
    assert not counters["graph_break"], list(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2


def test_torch_export_of_the_forward_runs_and_checks_the_token_ids():
    """``torch.export.export(model, (ids,))`` (non-strict, the default) traces the forward
    (regression: the eager value check's ``int(ids.min())`` was a data-dependent guard that
    export refused); the exported program matches eager and still refuses an
    out-of-vocabulary id."""
    model = make_model(residual={"kind": "attnres_block", "block_size": 3}, n_layers=2).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    exported = torch.export.export(model, (ids,)).module()
    assert_rel_close(exported(ids).logits, model(ids).logits, 1e-5, "logits")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        exported(torch.full((2, 9), model.config.vocab_size))


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_activation_checkpointing_compiles_into_one_graph_and_matches_eager(mode):
    """``activation_checkpoint`` under ``torch.compile``: one graph, no graph break
    (regression: the deferred norm input reached Dynamo's checkpoint operator, which takes
    tensors only - every checkpointed sublayer broke the graph and ran eagerly; selective's
    nested ``context_fn`` was refused by Dynamo), loss and every gradient equal eager's."""
    from attnres.models.trunk import sublayer_caller

    torch._dynamo.reset()
    model = make_model(residual={"kind": "attnres_block", "block_size": 3}, n_layers=2)
    model.sublayer_call = sublayer_caller(mode)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    explained = torch._dynamo.explain(model)(ids, labels=ids)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    out, eager = torch.compile(model, backend="aot_eager")(ids, labels=ids), model(ids, labels=ids)
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    eager_grads = torch.autograd.grad(eager.loss, list(model.parameters()))
    assert_rel_close(out.loss.reshape(1), eager.loss.reshape(1), 1e-5, "loss")
    for (name, _), g, ge in zip(model.named_parameters(), grads, eager_grads):
        assert_rel_close(g, ge, 1e-4, f"grad of {name}")
