"""Decoding over a static-capacity KV cache (``StaticKVCache``, ``StaticDecoder``): it equals
the dynamic-cache decode token for token and in its logits (against the float64 truth), and
its step compiles with ``fullgraph=True`` into one graph that every step reuses (nothing
data-dependent reaches Python). The CUDA-graph capture itself runs only where there is a GPU;
what it records - the eager step - is checked here for reads back and host data, and the
order of its warm-up and capture with the CUDA calls faked.

Prompts are a ragged, left-padded batch; AttnRes models get random pseudo-queries.
"""

from __future__ import annotations

import contextlib

import copy
import re

import pytest
import torch
from conftest import TOL, assert_fast_matches_naive, assert_rel_close, make_model

from attnres.inference import (
    StaticDecoder,
    StaticKVCache,
    decode_step,
    generate,
    prefill,
    static_decode_step,
    stream,
)

RESIDUALS = ["standard", "attnres_full", "attnres_block"]
pytestmark = pytest.mark.usefixtures("one_thread")


def ragged_prompts(b: int = 3, t: int = 7, seed: int = 1):
    """``[b, t]`` ids and a left-padding mask: row 0 has 3 pads, row 2 one, row 1 none."""
    ids = torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return ids, mask


def assert_freed_with_its_kept_decoder(holder: list) -> None:
    """The one model in ``holder`` and the one decoder ``generate`` keeps for it are freed
    when ``holder`` lets the model go, the garbage collector off: no reference cycle holds
    them (GPU memory held until a collection)."""
    import gc
    import weakref

    from attnres.inference import kept_decoders

    ((decoder, _),) = vars(holder[0])[kept_decoders._ATTRIBUTE].idle.values()  # (with its CUDA event, None here)
    refs = [weakref.ref(holder[0]), weakref.ref(decoder)]
    del decoder
    gc.disable()
    try:
        holder.clear()
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()


def dynamic_logits(model, ids, mask, tokens):
    """Prefill, then feed ``tokens [B, n]`` one column at a time over the growing cache:
    the logits after the prompt and after each token, ``[B, n + 1, vocab]``."""
    logits, cache = prefill(model, ids, mask)
    out, mask = [logits], mask.bool()
    for i in range(tokens.shape[1]):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        out.append(decode_step(model, cache, tokens[:, i], mask))
    return torch.stack(out, dim=1)


def static_logits(model, ids, mask, tokens, mode="eager"):
    """The same through a :class:`StaticDecoder` whose capacity leaves slots unfilled."""
    logits, cache = prefill(model, ids, mask)
    decoder = StaticDecoder(model, ids.shape[0], capacity=ids.shape[1] + tokens.shape[1] + 5, mode=mode)
    decoder.load(cache, mask)
    out = [logits] + [decoder.step(tokens[:, i]).clone() for i in range(tokens.shape[1])]
    return torch.stack(out, dim=1)


@pytest.fixture(scope="module", params=RESIDUALS)
def model(request):
    return make_model(residual=request.param).eval()


# -- the static cache decodes what the dynamic one decodes ------------------------------------
def test_static_decode_equals_dynamic_decode_token_for_token(model):
    ids, mask = ragged_prompts()
    dynamic = generate(model, ids, mask, max_new_tokens=12, decode="dynamic")
    static = generate(model, ids, mask, max_new_tokens=12, decode="static")
    assert torch.equal(static, dynamic)
    assert torch.equal(generate(model, ids, mask, max_new_tokens=1, decode="static"), dynamic[:, :1])
    # ... and each sequence as it would decode alone (no padding, the dynamic cache).
    for row in range(ids.shape[0]):
        alone = ids[row : row + 1, mask[row].bool()]
        assert torch.equal(generate(model, alone, max_new_tokens=12, decode="static"), dynamic[row : row + 1])


def test_static_decode_under_autocast_equals_dynamic_decode(model):
    """``generate`` inside ``torch.autocast`` (a float32 model decoding in bfloat16; on CUDA,
    where the static cache is the default): the keys and values autocast makes are stored
    in the cache of the parameters' dtype (exactly: a widening), as the dynamic cache holds
    them - it failed at the first step in index_copy_, "self and source expected to have the
    same dtype"."""
    ids, mask = ragged_prompts()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dynamic = generate(model, ids, mask, max_new_tokens=8, decode="dynamic")
        assert torch.equal(generate(model, ids, mask, max_new_tokens=8, decode="static"), dynamic)


def test_static_decode_logits_match_the_float64_truth(model):
    """The static step's logits are as close to the float64 truth as the dynamic step's
    (tests/conftest.py's rule for two float32 paths), at every step of a ragged batch."""
    ids, mask = ragged_prompts()
    tokens = generate(model, ids, mask, max_new_tokens=9)[:, :8]
    dynamic = dynamic_logits(model, ids, mask, tokens)
    static = static_logits(model, ids, mask, tokens)
    truth_model = copy.deepcopy(model).double()
    truth = dynamic_logits(truth_model, ids, mask, tokens)
    names = [f"logits after step {i}" for i in range(tokens.shape[1] + 1)]
    assert_fast_matches_naive(list(static.unbind(1)), list(dynamic.unbind(1)), list(truth.unbind(1)), torch.float32,
                              names, TOL[torch.float32])


def test_static_cache_gives_the_positions_and_mask_of_the_padding_mask(model):
    """After a padded prefill, the static cache's RoPE tables and mask for the next token are
    the dynamic path's (``DecoderTrunk.positions`` of the extended mask), padded with
    masked slots up to the capacity, which ``load_`` zeroes: a masked key still enters the
    attention's weighted sum with weight 0, so what a kept decoder's earlier generation left
    there (NaN, if it diverged) must not stay."""
    ids, mask = ragged_prompts()
    _, cache = prefill(model, ids, mask)
    static = StaticKVCache.for_model(model, ids.shape[0], capacity=12)
    for t in (*static.k, *static.v):
        t.fill_(float("nan"))  # (an earlier generation's slots)
    static.load_(cache, mask)
    cos, sin, allowed = static.attention_inputs(model.rope, 1)
    extended = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
    ref_cos, ref_sin, ref_allowed = model.positions(ids[:, :1], extended, past=7)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert torch.equal(allowed[..., :8], ref_allowed) and not allowed[..., 8:].any()
    for layer in range(model.config.n_layers):
        assert torch.equal(static.k[layer][:, :, :7], cache.keys(layer)) and not static.k[layer][:, :, 7:].any()
        assert torch.equal(static.v[layer][:, :, :7], cache.values(layer)) and not static.v[layer][:, :, 7:].any()


def test_static_prefill_through_the_model_forward_equals_the_dynamic_one(model):
    """``AttnResLM.forward`` takes a ``StaticKVCache`` too: a prompt written into it in two
    chunks gives the dynamic cache's logits (padding set through ``start``)."""
    ids, mask = ragged_prompts()
    ref, _ = prefill(model, ids, mask)
    static = StaticKVCache.for_model(model, 3, capacity=10)
    static.start.copy_((mask == 0).sum(-1))
    with torch.no_grad():
        model(ids[:, :4], kv_cache=static)
        logits = model(ids[:, 4:], kv_cache=static).logits[:, -1]
    assert static.seq_len == 7
    assert_rel_close(logits, ref, TOL[torch.float32], "static-cache prefill vs dynamic")


# -- the step compiles into one graph ------------------------------------------------------------
class GraphRecorder:
    """A ``torch.compile`` backend that counts the graphs Dynamo hands it, keeps the operators
    they call and runs them as traced (no Inductor: quick)."""

    def __init__(self):
        self.graphs, self.targets = 0, set()

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.targets |= {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        return gm.forward


@pytest.mark.parametrize("residual", RESIDUALS)
def test_decode_step_compiles_with_fullgraph_into_one_graph(residual):
    """``fullgraph=True`` fails on any graph break (a host sync, ``.item()``, a data-dependent
    branch); a Python int read from the device would also be baked into the graph and force a
    new one at the next step. Six steps compile one graph, and its logits are the eager
    step's."""
    torch._dynamo.reset()
    model = make_model(residual=residual, n_layers=2).eval()
    ids, mask = ragged_prompts()
    _, cache = prefill(model, ids, mask)
    tokens = torch.randint(0, 256, (3, 6), generator=torch.Generator().manual_seed(2))
    eager, compiled = (StaticKVCache.for_model(model, 3, capacity=16) for _ in range(2))
    recorder = GraphRecorder()
    step = torch.compile(static_decode_step, fullgraph=True, dynamic=False, backend=recorder)
    with torch.no_grad():
        for c in (eager, compiled):
            c.load_(cache, mask)
        for i in range(tokens.shape[1]):
            want = static_decode_step(model, eager, tokens[:, i])
            assert_rel_close(step(model, compiled, tokens[:, i]), want, TOL[torch.float32], f"step {i}")
    assert recorder.graphs == 1
    assert torch.equal(compiled.end, eager.end) and int(compiled.end) == 13
    if residual != "standard":  # the depth-attention operators are nodes of that graph
        assert {"attnres.phase1", "attnres.merge"} <= recorder.targets, sorted(recorder.targets)


#: What a CUDA graph cannot record: a read back to the host (``.item()``, a data-dependent
#: shape or truth value) or a tensor made from host data (``torch.tensor(...)``: a
#: synchronous copy to the device, which a capturing stream refuses).
NOT_CAPTURABLE = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero", "aten.equal",
                  "aten.lift_fresh", "aten.lift_fresh_copy", "aten._pin_memory", "aten._assert_async"}


@pytest.mark.parametrize("residual", RESIDUALS)
def test_the_eager_static_step_that_a_cuda_graph_records_reads_nothing_back_and_copies_no_host_data(residual):
    """``StaticDecoder(mode="graph")`` records the *eager* step (``torch.cuda.graph``), not a
    compiled one, so ``fullgraph=True`` (above) does not cover it: a ``torch.tensor`` of a
    Python value compiles into a constant but is a host-to-device copy in eager code, which
    the capture refuses. The eager step, with the depth-attention operators through the
    dispatcher, dispatches none of :data:`NOT_CAPTURABLE` - checked on the CPU for what the
    capture will meet on a GPU."""
    from test_depth_attention_ops import OperatorLog

    from attnres.ops.depth_attention import library

    model = make_model(residual=residual, n_layers=2).eval()
    ids, mask = ragged_prompts()
    _, cache = prefill(model, ids, mask)
    decoder = StaticDecoder(model, 3, capacity=12, mode="eager")
    decoder.load(cache, mask)
    token = torch.zeros(3, dtype=torch.long)
    decoder.step(token)  # (the first step folds the key-norm gains into the queries)
    log = OperatorLog()
    with torch.no_grad(), library.through_dispatcher(), log:
        decoder.step(token)
    assert log.names and not NOT_CAPTURABLE & set(log.names), sorted(NOT_CAPTURABLE & set(log.names))
    if residual != "standard":
        assert {"attnres.phase1", "attnres.merge"} <= set(log.names)


def test_block_decode_step_dispatches_fewer_operations_than_the_standard_one(monkeypatch):
    """What a graphed decode step replays, counted on the CPU with the Triton kernels stubbed
    (the GPU check's shape in depth: 32 transformer blocks, Block AttnRes with N = 8 blocks of
    8 sublayers): Block's merges fuse the block's partial sum and the next sublayer's norm,
    so its 65 merges, 7 Phase 1s (two launches each, split over the sources at one row) and 7
    block-closing adds replace the standard model's 64 adds and 65 norms - fewer operations
    in all."""
    pytest.importorskip("triton")
    from test_depth_attention_ops import FREE_OPERATORS, OperatorLog, _StubKernel

    from attnres.nn.kv_cache import KVCache
    from attnres.ops.depth_attention import triton_kernels

    launches: list[str] = []
    for name in ("phase1_fwd", "phase1_logits", "phase1_combine", "merge_fwd", "merge_fwd_held"):
        monkeypatch.setattr(triton_kernels, name, _StubKernel(name, launches))
    counts = {}
    for residual in ("standard", {"kind": "attnres_block", "block_size": 8, "backend": "triton"}):
        model = make_model(residual=residual, n_layers=32, d_model=32, n_heads=2, n_kv_heads=2, randomize=False).eval()
        cache = KVCache(32, capacity=9)
        shape = (1, model.config.kv_heads, 8, model.config.head_dim)
        for layer in range(32):
            cache.update(layer, torch.randn(shape), torch.randn(shape))
        decoder = StaticDecoder(model, 1, capacity=9, mode="eager")
        decoder.load(cache)
        token = torch.zeros(1, dtype=torch.long)
        with torch.inference_mode():
            decoder.step(token)  # (the first step folds the key-norm gains into the queries, kept after)
            decoder.rewind(8)
        log, before = OperatorLog(), len(launches)
        with torch.inference_mode(), log:
            decoder.step(token)
        ops = [n for n in log.names if n not in FREE_OPERATORS] + launches[before:]
        counts[model.config.residual.kind] = ops
    standard, block = counts["standard"], counts["attnres_block"]
    assert block.count("merge_fwd_held") == 65 and "merge_fwd" not in block  # (Block's merges: held)
    assert block.count("phase1_logits") == block.count("phase1_combine") == 7
    assert standard.count("aten.rms_norm") == 65 and block.count("aten.rms_norm") == 1
    assert standard.count("aten.add") - block.count("aten.add") == 64 - 7
    assert len(block) < len(standard), (len(block), len(standard))


@pytest.mark.parametrize("residual", ["attnres_block", "attnres_full"])
def test_compiled_decoder_generates_the_dynamic_tokens(residual):
    """``decode="compiled"``: the step through Inductor (``fullgraph=True``) generates the
    dynamic path's tokens."""
    torch._dynamo.reset()
    model = make_model(residual=residual, n_layers=2).eval()
    ids, mask = ragged_prompts()
    want = generate(model, ids, mask, max_new_tokens=8, decode="dynamic")
    assert torch.equal(generate(model, ids, mask, max_new_tokens=8, decode="compiled"), want)


def test_compiled_decoder_past_the_recompile_limit_decodes_eagerly():
    """``decode="compiled"`` compiles one graph per model class, dtype, batch size, capacity
    and grad mode, shared by every generation of the process: past Dynamo's recompile limit
    (8; here 1) ``fullgraph=True`` raised ``FailOnRecompileLimitHit`` ("Hard failure due to
    fullgraph=True") from the first step. It now decodes eagerly, the same tokens, with a
    warning naming the limit."""
    model = make_model(residual="attnres_block", n_layers=2).eval()
    ids, mask = ragged_prompts()
    with torch._dynamo.config.patch(recompile_limit=1):
        generate(model, ids, mask, max_new_tokens=3, decode="compiled")  # (compiles, or a graph is there)
        for rows in (ids.shape[0] - 1, ids.shape[0] - 2):  # new batch sizes: past the limit
            want = generate(model, ids[:rows], mask[:rows], max_new_tokens=6, decode="dynamic")
            with pytest.warns(RuntimeWarning, match=r"recompile limit \(torch._dynamo.config.recompile_limit=1\).*"
                                                    r"decodes eagerly; raise the limit, or use decode='static'"):
                got = generate(model, ids[:rows], mask[:rows], max_new_tokens=6, decode="compiled")
            assert torch.equal(got, want)


@pytest.mark.slow
def test_a_kept_compiled_decoder_past_the_recompile_limit_compiles_again_at_its_next_generation():
    """``generate`` keeps its compiled decoders: one that ran the eager step past the
    recompile limit ran it in every later generation, without a word, the limit raised
    as its warning says or not. Each generation (``load``) tries the compiled step again:
    past the limit it warns again, below it compiles."""
    import warnings

    from attnres.inference import kept_decoders

    torch._dynamo.reset()
    model = make_model(residual="attnres_block", n_layers=2).eval()
    ids, mask = ragged_prompts()
    want = generate(model, ids[:2], mask[:2], max_new_tokens=4, decode="dynamic")
    with torch._dynamo.config.patch(recompile_limit=1):
        generate(model, ids, mask, max_new_tokens=4, decode="compiled")  # (the one graph the limit allows)
        for _ in range(2):
            with pytest.warns(RuntimeWarning, match=r"recompile limit"):
                assert torch.equal(generate(model, ids[:2], mask[:2], max_new_tokens=4, decode="compiled"), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(generate(model, ids[:2], mask[:2], max_new_tokens=4, decode="compiled"), want)
    decoders = [decoder for decoder, _ in vars(model)[kept_decoders._ATTRIBUTE].idle.values()]
    assert len(decoders) == 2 and all(d._compiled is not None for d in decoders)


@pytest.mark.slow
def test_a_kept_compiled_decoder_gives_each_call_its_dynamic_tokens_and_goes_with_its_model():
    """``decode="compiled"`` keeps its decoder across calls: prompts of other lengths,
    padding and text in one capacity bucket reuse it (stale slots, fill level and padding
    of the call before replaced by ``load``), each with the dynamic cache's tokens, and
    ``del model`` frees the model and it (Dynamo's cache holds neither)."""
    model = make_model(residual="attnres_block", n_layers=2).eval()
    for t, n, seed in ((9, 5, 1), (5, 9, 2), (7, 3, 3)):
        ids, mask = ragged_prompts(t=t, seed=seed)
        if seed == 3:
            mask = None  # (no padding after padded rows: start back at slot 0)
        want = generate(model, ids, mask, max_new_tokens=n, decode="dynamic")
        assert torch.equal(generate(model, ids, mask, max_new_tokens=n, decode="compiled"), want), (t, n)
    holder = [model]
    del model
    assert_freed_with_its_kept_decoder(holder)


# -- the decoder's API ---------------------------------------------------------------------
def test_a_decoder_is_freed_when_its_last_reference_goes():
    """A decoder of every mode frees its static cache when its last reference goes (``del``,
    ``release_decoders`` of the ones ``generate`` keeps), without a garbage collection: the
    compiled one held its bound ``_run_compiled`` - a cycle through itself, its cache held in
    (GPU) memory until a collection."""
    import gc
    import weakref

    model = make_model(residual="attnres_block").eval()
    for mode in ("eager", "compiled"):
        decoder = StaticDecoder(model, 2, capacity=16, mode=mode)
        refs = [weakref.ref(decoder), weakref.ref(decoder.cache.k[0])]
        gc.disable()
        try:
            del decoder
            assert [ref() for ref in refs] == [None, None], mode
        finally:
            gc.enable()


def test_decoder_decodes_greedily_and_rewinds():
    """``decode(tokens, n)`` is ``n`` greedy steps; ``rewind`` returns to a context length
    (how a benchmark decodes at a fixed context) and decodes the same again."""
    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    want = generate(model, ids, mask, max_new_tokens=7, decode="dynamic")
    logits, cache = prefill(model, ids, mask)
    decoder = StaticDecoder(model, 3, capacity=16, mode="eager")
    decoder.load(cache, mask)
    first = logits.argmax(-1)
    assert torch.equal(decoder.decode(first, 6), want[:, 1:])
    assert decoder.length == 13
    decoder.rewind(7)
    assert torch.equal(decoder.decode(first, 6), want[:, 1:])
    with pytest.raises(ValueError, match=r"StaticDecoder.decode: 4 steps from 13 positions need 17"):
        decoder.decode(first, 4)
    with pytest.raises(ValueError, match=r"seq_len must be in \[0, 13\]"):
        decoder.rewind(17)


def test_decoding_past_the_capacity_is_refused_before_any_step():
    """newuser13: ``decode(tokens, n)`` with room for fewer than ``n`` steps ran the steps that
    fit, then refused the next one ("the static cache is full"): the tokens decoded were lost
    and the decoder was left at its capacity. It is refused before any step, saying how many
    fit and the capacity that takes ``n``; the decoder is as it was, and the steps that fit
    decode what they would have."""
    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    want = generate(model, ids, mask, max_new_tokens=10, decode="dynamic")
    logits, cache = prefill(model, ids, mask)
    decoder = StaticDecoder(model, 3, capacity=ids.shape[1] + 9, mode="eager")
    decoder.load(cache, mask)
    first = logits.argmax(-1)
    with pytest.raises(ValueError, match=rf"StaticDecoder.decode: 12 steps from {ids.shape[1]} positions need "
                                         rf"{ids.shape[1] + 12}, beyond the decoder's capacity of {ids.shape[1] + 9}: "
                                         rf"decode at most 9 steps, rewind it, or build it with capacity >= "
                                         rf"{ids.shape[1] + 12}$"):
        decoder.decode(first, 12)
    assert decoder.length == ids.shape[1]
    assert torch.equal(decoder.decode(first, 9), want[:, 1:])
    with pytest.raises(ValueError, match=r"need .*: rewind it, or build it with capacity"):
        decoder.decode(first, 1)


def test_captured_graph_is_refreshed_when_the_weights_it_reads_change():
    """What ``load`` checks before it reuses a captured graph: the parameters' addresses, and
    the AttnRes folded queries (recomputed after an in-place update of a query: copied into
    the ones the graph reads, at their address, without a capture)."""
    model = make_model(residual="attnres_block").eval()
    decoder = StaticDecoder(model, 1, capacity=8, mode="eager")
    decoder._captured_with = decoder._weights()  # what _capture records
    assert not decoder._stale()
    read = decoder._captured_with[1]
    with torch.no_grad():
        model.residual.mixers[1].query.add_(0.1)  # an optimiser step: same address, new value
        assert not decoder._stale()
        assert decoder._captured_with[1] is read and torch.equal(read, model.residual.folded_queries(torch.float32))
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # a replaced tensor
    assert decoder._stale()


def test_a_graph_is_captured_with_the_models_device_current(monkeypatch):
    """``torch.cuda.graph`` captures a stream of the current device: the capture makes the
    model's device current (a model on ``cuda:1``). The CUDA calls stubbed: what runs inside
    the device switch is the warm-up and the recording."""
    model = make_model(residual="attnres_block").eval()
    decoder = StaticDecoder(model, 1, capacity=8, mode="eager")
    events = []

    @contextlib.contextmanager
    def switch(device):
        events.append(("enter", torch.device(device)))
        yield
        events.append(("exit", torch.device(device)))

    monkeypatch.setattr(torch.cuda, "device", switch)
    monkeypatch.setattr(decoder, "device", torch.device("cuda", 1))
    monkeypatch.setattr(decoder, "_record", lambda: events.append("record"))
    decoder._capture()
    assert events == [("enter", torch.device("cuda", 1)), "record", ("exit", torch.device("cuda", 1))]


def test_a_graph_records_one_step_after_its_warm_up_steps_outside_the_capture(monkeypatch):
    """What ``mode="graph"`` records (the CUDA calls faked, the capture running the step
    eagerly): ``warmup`` steps on a side stream first, each on the emptied cache - the kernels
    compiled and loaded, which a capture cannot do -, then one step inside the capture, all without
    autograd; the decoder is left empty - one that had decoded too, its filled length counted
    as none (``load`` captures a used decoder again before it takes the new cache, which it may
    still refuse) -, its graph current for the weights, and a step replays it and returns the
    captured logits."""
    from attnres.inference import static

    model = make_model(residual="attnres_block").eval()
    decoder = StaticDecoder(model, 1, capacity=8, mode="eager")
    prompt = torch.randint(0, 256, (1, 4), generator=torch.Generator().manual_seed(1))
    decoder.load(prefill(model, prompt)[1])
    decoder.step(prompt[:, -1])  # (a decoder used before its capture: 5 positions filled)
    log = []

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            log.append("wait")

    class Graph:
        def replay(self):
            log.append("replay")

    @contextlib.contextmanager
    def scope(name):
        log.append(name)
        yield
        log.append(f"{name} end")

    for name, value in {"Stream": Stream, "current_stream": Stream, "CUDAGraph": Graph,
                        "stream": lambda s: scope("side stream"), "graph": lambda g, capture_error_mode: scope("capture")}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    step = static.static_decode_step

    def logged(model, cache, tokens):
        log.append(("step", int(cache.end), torch.is_grad_enabled()))
        return step(model, cache, tokens)

    monkeypatch.setattr(static, "static_decode_step", logged)
    decoder._record()
    assert log == ["wait", "side stream", ("step", 0, False), ("step", 0, False), "side stream end", "wait",
                   "capture", ("step", 0, False), "capture end"]
    assert decoder.length == 0 and not decoder._stale()
    log.clear()
    assert decoder.step(torch.zeros(1, dtype=torch.long)) is decoder._logits and log == ["replay"]


def test_a_left_padded_prefill_is_loaded_with_its_mask():
    """``decoder.load(cache)`` of a left-padded prefill without its mask (docs/inference.md's
    ``decoder.load(cache, mask)`` with the mask left out) took the padded keys as real, without a
    word; it is refused, naming the mask, and with it the decoder gives ``generate``'s tokens."""
    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    logits, cache = prefill(model, ids, mask)
    decoder = StaticDecoder(model, batch_size=3, capacity=7 + 4, mode="eager")
    with pytest.raises(ValueError, match=re.escape("prefilled from a left-padded batch (its attention_mask holds "
                                                   "zeros): pass that mask too, attention_mask [B, T] = [3, 7]")):
        decoder.load(cache)
    decoder.load(cache, mask)
    assert torch.equal(decoder.decode(logits.argmax(-1), 3), generate(model, ids, mask, max_new_tokens=4)[:, 1:])


def test_static_decoding_refuses_bad_input():
    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    with pytest.raises(ValueError, match=r"decode must be one of .*; got 'cuda_graph' \(did you mean 'graph'\?\)"):
        generate(model, ids, mask, max_new_tokens=2, decode="cuda_graph")
    with pytest.raises(ValueError, match="decode='graph' captures a CUDA graph: the model is on cpu"):
        stream(model, ids, mask, max_new_tokens=2, decode="graph")
    with pytest.raises(ValueError, match="mode='graph' captures a CUDA graph"):
        StaticDecoder(model, 1, mode="graph")
    # (docs/inference.md names generate's decode="static" beside StaticDecoder's mode="eager", the same step:
    # either name where the other goes said only the allowed values)
    with pytest.raises(ValueError, match=r"mode must be one of .*, got 'static' \(generate's decode='static' is "
                                         r"mode='eager' here\)$"):
        StaticDecoder(model, 1, mode="static")
    with pytest.raises(ValueError, match=r"decode must be one of .*; got 'eager' \(StaticDecoder's mode='eager' is "
                                         r"decode='static' here\)$"):
        generate(model, ids, mask, max_new_tokens=2, decode="eager")
    with pytest.raises(ValueError, match=r"mode must be one of .*, got 'fast'$"):  # nothing near: no guess
        StaticDecoder(model, 1, mode="fast")
    with pytest.raises(ValueError, match=r"got 'compile' \(did you mean 'compiled'\?\)"):
        StaticDecoder(model, 1, mode="compile")
    with pytest.raises(ValueError, match="capacity must be <= ModelConfig.max_seq_len"):
        StaticKVCache.for_model(model, 1, capacity=model.config.max_seq_len + 1)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        StaticKVCache.for_model(model, 0)
    static = StaticKVCache.for_model(model, 3, capacity=8)
    with pytest.raises(ValueError, match="holds the padding itself"):
        model(ids, kv_cache=static, attention_mask=mask)
    with pytest.raises(ValueError, match="exceeds the StaticKVCache capacity 8"):
        model(torch.cat([ids, ids], dim=1), kv_cache=static)
    _, cache = prefill(model, torch.cat([ids, ids], dim=1))
    with pytest.raises(ValueError, match="more than the capacity 8"):
        static.load_(cache)
    _, cache = prefill(model, ids[:1])
    with pytest.raises(ValueError, match="at batch size 1, this one 2 at 3"):
        static.load_(cache)
    _, cache = prefill(model, ids)
    with pytest.raises(ValueError, match=r"attention_mask must be a tensor of the batch and cached positions \(3, 7\)"):
        static.load_(cache, mask[:, 1:])
    with pytest.raises(ValueError, match=r"seq_len must be in \[0, 8\]"):
        static.crop_(9)


def test_a_step_of_the_wrong_number_of_tokens_is_refused_and_changes_nothing():
    """``StaticDecoder.step`` took tokens of any shape: a graphed step copied one token into
    every row (other rows decoded it), an eager one broadcast or failed deep in the model.
    Now a shape other than ``[batch_size]`` is refused before the cache moves."""
    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    decoder = StaticDecoder(model, ids.shape[0], capacity=16, mode="eager")
    _, cache = prefill(model, ids, mask)
    decoder.load(cache, mask)
    for bad in (ids[:1, -1], ids[:, -1:], ids[:, -1].repeat(2)):
        with pytest.raises(ValueError, match=rf"tokens must have shape \[batch_size\] = \[3\].*got {re.escape(str(list(bad.shape)))}$"):
            decoder.step(bad)
    assert decoder.length == ids.shape[1] and int(decoder.cache.end) == ids.shape[1]
    assert decoder.step(ids[:, -1]).shape == (3, model.config.vocab_size)


def test_a_prefill_of_another_batch_size_is_refused_saying_to_build_a_decoder_for_it():
    """A decoder built for 3 rows given the prefill of 1 or 4 said "the cache holds 2 layers at
    batch size 1, this one 2 at 3" (which one is "this one", and what to do?); prefill's pair
    ended in "'tuple' object has no attribute". Both are said as the decoder's, with the way
    out; the decoder still decodes its own batch afterwards."""
    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    decoder = StaticDecoder(model, 3, capacity=12, mode="eager")
    for rows in (1, 4):
        _, cache = prefill(model, torch.cat([ids, ids])[:rows])
        with pytest.raises(ValueError, match=re.escape(
                f"StaticDecoder.load: the cache holds a batch of {rows} sequence{'s' * (rows != 1)}, and this decoder "
                f"decodes 3 (its batch_size, fixed when it was built: its buffers and graphs are made for it): build a "
                f"StaticDecoder(model, batch_size={rows}, ...) for that batch (one per batch size), or prefill a batch "
                "of 3")):
            decoder.load(cache)
    with pytest.raises(TypeError, match=re.escape("takes the KVCache a prefill filled, got a tuple (prefill returns "
                                                  "logits and the cache: logits, cache = prefill(...))")):
        decoder.load(prefill(model, ids, mask), mask)
    logits, cache = prefill(model, ids, mask)
    decoder.load(cache, mask)
    assert torch.equal(decoder.decode(logits.argmax(-1), 4), generate(model, ids, mask, max_new_tokens=5)[:, 1:])


def test_loading_a_cache_checks_its_padding_mask():
    """``StaticDecoder.load(cache, attention_mask)`` counted each row's zeros as its left
    padding whatever the mask: a right-padded mask (or one of other values) decoded other
    tokens without a word. It is checked as ``generate`` checks a prompt's mask; a mask of
    0.0 / 1.0 floats or booleans decodes as the integer one."""
    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    want = generate(model, ids, mask, max_new_tokens=5)
    logits, cache = prefill(model, ids, mask)
    decoder = StaticDecoder(model, 3, capacity=12, mode="eager")
    for bad, message in ((mask.flip(1), "must be left-padded"), (mask * 2, "must hold only 0 .padding. and 1")):
        with pytest.raises(ValueError, match=f"attention_mask {message}"):
            decoder.load(cache, bad)
    for given in (mask.float(), mask.bool()):
        decoder.load(cache, given)
        assert torch.equal(decoder.decode(logits.argmax(-1), 4), want[:, 1:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("residual", RESIDUALS)
def test_graphed_decode_equals_dynamic_decode_on_cuda(residual):
    """The captured CUDA graph replays the static step: the dynamic path's tokens, and its
    logits as close to the truth."""
    model = make_model(residual=residual).eval().cuda()
    ids, mask = (t.cuda() for t in ragged_prompts())
    want = generate(model, ids, mask, max_new_tokens=12, decode="dynamic")
    assert torch.equal(generate(model, ids, mask, max_new_tokens=12, decode="graph"), want)
    tokens = want[:, :8]
    dynamic, graphed = dynamic_logits(model, ids, mask, tokens), static_logits(model, ids, mask, tokens, mode="graph")
    truth = dynamic_logits(copy.deepcopy(model).double(), ids, mask, tokens)
    names = [f"logits after step {i}" for i in range(tokens.shape[1] + 1)]
    assert_fast_matches_naive(list(graphed.unbind(1)), list(dynamic.unbind(1)), list(truth.unbind(1)), torch.float32,
                              names, TOL[torch.float32])


# -- the Hugging Face model over transformers' StaticCache ------------------------------------
def hf_twin(native):
    pytest.importorskip("transformers")
    from attnres.hf import AttnResForCausalLM

    return AttnResForCausalLM.from_native(native).eval()


def test_hf_static_cache_generates_the_dynamic_tokens(model):
    """``generate(cache_implementation="static")`` (transformers' ``StaticCache``, the default
    on CUDA) gives the native tokens for a ragged batch, and logits as close to the float64
    truth as the dynamic cache's."""
    hf = hf_twin(model)
    ids, mask = ragged_prompts()
    want = generate(model, ids, mask, max_new_tokens=8)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    static = hf.generate(ids, cache_implementation="static", **kwargs)
    dynamic = hf.generate(ids, **kwargs)  # on CPU: the dynamic cache
    assert torch.equal(static.sequences[:, 7:], want) and torch.equal(dynamic.sequences[:, 7:], want)
    truth = dynamic_logits(copy.deepcopy(model).double(), ids, mask, want[:, :7])
    names = [f"logits after step {i}" for i in range(8)]
    assert_fast_matches_naive(list(static.logits), list(dynamic.logits), list(truth.unbind(1)), torch.float32, names,
                              TOL[torch.float32])


def test_hf_static_cache_takes_a_two_dimensional_mask():
    """A ``StaticCache`` with the 2-D padding mask (a direct forward call) or none gives the
    dynamic cache's logits."""
    pytest.importorskip("transformers")
    from transformers.cache_utils import DynamicCache, StaticCache

    hf = hf_twin(make_model(residual="attnres_block").eval())
    ids, mask = ragged_prompts()
    for m in (mask, None):
        static, dynamic = StaticCache(config=hf.config, max_cache_len=12), DynamicCache(config=hf.config)
        with torch.no_grad():
            for s, e in ((0, 5), (5, 7)):
                part = None if m is None else m[:, :e]
                got = hf(ids[:, s:e], attention_mask=part, cache=static, use_cache=True).logits
                want = hf(ids[:, s:e], attention_mask=part, cache=dynamic, use_cache=True).logits
                assert_rel_close(got, want, TOL[torch.float32], f"mask {m is not None}, tokens {s}..{e}")


def test_hf_decode_step_over_a_static_cache_compiles_with_fullgraph():
    """The forward over a ``StaticCache`` with the 4-D mask ``generate`` passes (what
    transformers compiles on CUDA): one graph for every decode step, no graph break, and the
    dynamic cache's logits."""
    pytest.importorskip("transformers")
    from transformers.cache_utils import DynamicCache, StaticCache

    torch._dynamo.reset()
    hf = hf_twin(make_model(residual="attnres_block", n_layers=2).eval())
    ids, mask = ragged_prompts()
    capacity = 12
    static, dynamic = StaticCache(config=hf.config, max_cache_len=capacity), DynamicCache(config=hf.config)
    recorder = GraphRecorder()
    step = torch.compile(hf, fullgraph=True, dynamic=False, backend=recorder)
    with torch.no_grad():
        hf(ids, attention_mask=mask, cache=static, use_cache=True)
        tokens = hf(ids, attention_mask=mask, cache=dynamic, use_cache=True).logits[:, -1].argmax(-1)
        real = torch.cat([mask, torch.ones(3, capacity - 7, dtype=mask.dtype)], dim=1).bool()
        for slot in range(7, 10):
            four_d = (real & (torch.arange(capacity) <= slot))[:, None, None, :]
            got = step(tokens[:, None], attention_mask=four_d, cache=static, use_cache=True).logits[:, -1]
            want = hf(tokens[:, None], attention_mask=real[:, : slot + 1].long(), cache=dynamic, use_cache=True).logits[:, -1]
            assert_rel_close(got, want, TOL[torch.float32], f"slot {slot}")
            tokens = want.argmax(-1)
    assert recorder.graphs == 1


def test_hf_generate_defaults_to_the_static_cache_on_cuda(monkeypatch):
    """On CUDA ``generate`` asks transformers for a static cache unless the call names a
    cache, a cache implementation or ``use_cache=False``; on CPU it changes nothing."""
    pytest.importorskip("transformers")
    from transformers import GenerationMixin

    from attnres.hf import AttnResForCausalLM

    hf = hf_twin(make_model(residual="attnres_block").eval())
    seen = []
    monkeypatch.setattr(GenerationMixin, "generate", lambda self, *a, **k: seen.append(k.get("cache_implementation")))
    hf.generate(torch.zeros(1, 2, dtype=torch.long))
    monkeypatch.setattr(AttnResForCausalLM, "device", property(lambda self: torch.device("cuda")))
    hf.generate(torch.zeros(1, 2, dtype=torch.long))
    hf.generate(torch.zeros(1, 2, dtype=torch.long), cache_implementation="dynamic")
    hf.generate(torch.zeros(1, 2, dtype=torch.long), use_cache=False)
    assert seen == [None, "static", "dynamic", None]
