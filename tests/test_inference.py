"""Inference (issue 4): cached decoding, chunked prefill, padded batches, sampling, errors.

Every check runs for the three residuals; AttnRes models get random pseudo-queries so that
the depth weights are far from uniform.
"""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
from conftest import make_model, twin_with_schedule

from attnres.inference import KVCache, decode_step, generate, prefill, sample, stream

RESIDUALS = ["standard", "attnres_full", "attnres_block"]
ATOL = RTOL = 1e-4  # float32 acceptance bound of the issue


def close(a, b, what=""):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def random_ids(b, t, seed=1):
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=RESIDUALS)
def model(request):
    return make_model(residual=request.param).eval()


def full_logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


# -- cached decoding == one full forward ---------------------------------------------------
def test_cached_decode_matches_full_forward(model):
    ids = random_ids(2, 24)
    ref = full_logits(model, ids)
    logits, cache = prefill(model, ids[:, :7])
    steps = [logits]
    for i in range(7, 24):
        steps.append(decode_step(model, cache, ids[:, i]))
    assert cache.seq_len == 24
    close(torch.stack(steps, dim=1), ref[:, 6:], "decode vs full forward")


def test_multi_token_steps_with_cache_match_full_forward(model):
    """Chunks of several tokens over a non-empty cache: the causal mask must be aligned to
    the last keys (not SDPA's top-left ``is_causal``)."""
    ids = random_ids(2, 23)
    ref = full_logits(model, ids)
    cache = KVCache(model.config.n_layers)
    with torch.no_grad():
        parts = [model(ids[:, s : s + 5], kv_cache=cache).logits for s in range(0, 23, 5)]
    close(torch.cat(parts, dim=1), ref, "5-token steps vs full forward")


def test_decode_two_phase_matches_naive():
    for residual in ("attnres_full", "attnres_block"):
        fast = make_model(residual=residual).eval()
        naive = twin_with_schedule(fast, "naive")
        ids = random_ids(2, 12)
        a, b = generate(fast, ids, max_new_tokens=6), generate(naive, ids, max_new_tokens=6)
        assert torch.equal(a, b), residual


def test_folded_queries_kept_between_steps_follow_parameter_updates():
    """Without autograd the gain-folded queries are computed once and kept; an in-place
    update of a query or a gain (an optimiser step, ``load_state_dict``) must be seen."""
    model = make_model(residual="attnres_block").eval()
    res = model.residual
    ids = random_ids(1, 9)
    fresh = lambda: torch.stack([m.folded_query() for m in res.mixers])  # noqa: E731
    with torch.inference_mode():
        first = res.folded_queries(torch.float32)
        assert res.folded_queries(torch.float32) is first  # kept
    with torch.no_grad():
        res.mixers[1].query.add_(0.5)
        res.mixers[-1].key_norm.weight.mul_(2.0)
        updated = res.folded_queries(torch.float32)
    assert not updated.requires_grad and not updated.is_inference()
    torch.testing.assert_close(updated, fresh(), rtol=0, atol=0)
    assert not torch.equal(updated, first)
    with torch.no_grad():
        logits = model(ids).logits
    with torch.enable_grad():  # with autograd the queries are rebuilt in the graph, never cached
        q = res.folded_queries(torch.float32)
        assert q.requires_grad
        close(model(ids).logits, logits, "cached vs rebuilt queries")


@pytest.mark.filterwarnings("error")
def test_a_model_of_fake_tensors_runs_without_autograd_and_keeps_no_queries(monkeypatch):
    """The GPU check's launch survey builds its models under FakeTensorMode and runs their
    decode steps without autograd: the kept queries' key read each query's and gain's
    data_ptr(), which a fake tensor gives as 0 for all with a deprecation warning (an error in
    a later PyTorch). A fake model keeps nothing (it has no values) and reads no data_ptr."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from attnres import AttnResLM, ModelConfig

    def refused(tensor):  # (as a later PyTorch: the warning is PyTorch's warn-once, given once per process)
        raise RuntimeError("data_ptr() of a fake tensor")

    monkeypatch.setattr(FakeTensor, "data_ptr", refused, raising=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = AttnResLM(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16))
        ids = torch.randint(0, 64, (2, 5))
        with torch.no_grad():
            assert model(ids).logits.shape == (2, 5, 64)
            assert model.residual.folded_queries(torch.float32) is not model.residual.folded_queries(torch.float32)
    assert "_folded_cache" not in model.residual.__dict__


@pytest.mark.parametrize("residual", ["attnres_block", "attnres_full"])
def test_a_model_built_and_loaded_under_inference_mode_runs_and_follows_its_loads(residual):
    """A model built (or loaded: ``load_run``, ``from_pretrained``) under
    ``torch.inference_mode()`` has inference tensors for parameters, which track no version
    counter: the kept folded queries' key read each query's, and every forward and generate
    failed ("Inference tensors do not track version counter"). Such a model keeps nothing and
    runs - the logits and greedy tokens of the same weights built outside the mode - and a
    ``load_state_dict`` inside the mode (which changes no version anyone can read) is seen."""
    from attnres.inference import generate

    outside = make_model(residual=residual).eval()
    ids = random_ids(1, 9)
    other = make_model(residual=residual, seed=1).state_dict()  # (other randomised queries)
    with torch.inference_mode():
        inside = make_model(residual=residual).eval()
        assert inside.residual.mixers[0].query.is_inference()
        inside.load_state_dict(outside.state_dict())
        torch.testing.assert_close(inside(ids).logits, outside(ids).logits, rtol=0, atol=0)
        tokens = generate(inside, ids, max_new_tokens=4)
        inside.load_state_dict(other)  # (in place, inside the mode: nothing kept may hide it)
        changed = inside(ids).logits
    assert torch.equal(tokens, generate(outside, ids, max_new_tokens=4))
    outside.load_state_dict(other)
    with torch.no_grad():
        torch.testing.assert_close(changed, outside(ids).logits, rtol=0, atol=0)


def test_real_weights_run_under_fake_tensors_keep_no_fake_queries():
    """A model of real weights run without autograd under FakeTensorMode (a shape survey of
    an existing model) kept the folded queries it stacked there - a fake tensor, without
    values - and every later forward outside the mode took them: its logits were fake
    tensors too. Nothing fake is kept; the later forward equals the one before."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from attnres import AttnResLM, ModelConfig

    torch.manual_seed(0)
    model = AttnResLM(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)).eval()
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        before = model(ids).logits
        model.residual.__dict__.pop("_folded_cache", None)  # (the survey's forward is the first to stack them)
        with FakeTensorMode(allow_non_fake_inputs=True):
            assert model(torch.randint(0, 64, (2, 5))).logits.shape == (2, 5, 64)
        after = model(ids).logits
    assert not isinstance(after, FakeTensor) and torch.equal(after, before)


# -- chunked prefill == one-shot prefill ---------------------------------------------------
@pytest.mark.parametrize("chunk_size", [1, 3, 5, 16, 19, 64])
def test_chunked_prefill_matches_one_shot(model, chunk_size):
    ids = random_ids(2, 19)
    ref_logits, ref_cache = prefill(model, ids)
    logits, cache = prefill(model, ids, chunk_size=chunk_size)
    close(logits, ref_logits, f"logits, chunk {chunk_size}")
    assert cache.seq_len == ref_cache.seq_len == 19
    for layer in range(model.config.n_layers):
        close(cache.keys(layer), ref_cache.keys(layer), f"keys of layer {layer}")
        close(cache.values(layer), ref_cache.values(layer), f"values of layer {layer}")


def test_chunked_prefill_then_decode_matches_one_shot(model):
    ids = random_ids(1, 17)
    a = generate(model, ids, max_new_tokens=5, chunk_size=4)
    b = generate(model, ids, max_new_tokens=5)
    assert torch.equal(a, b)


# -- left-padded batches == each sequence alone --------------------------------------------
def padded_batch(lengths, pad_id=7, seed=3):
    """Left-padded batch of random prompts (the pad id is a real vocabulary entry, so only
    the mask keeps it out)."""
    t = max(lengths)
    prompts = [random_ids(1, n, seed + i)[0] for i, n in enumerate(lengths)]
    ids = torch.full((len(lengths), t), pad_id)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, t - len(p) :] = p
        mask[i, t - len(p) :] = 1
    return prompts, ids, mask


def test_padded_forward_matches_unpadded(model):
    prompts, ids, mask = padded_batch([5, 12, 9])
    batch = full_logits(model, ids, attention_mask=mask)
    for i, p in enumerate(prompts):
        close(batch[i, -len(p) :], full_logits(model, p[None])[0], f"row {i}")


def test_padded_forward_matches_unpadded_under_eager_attention(model):
    """A padded query attends to its own key only, so that no softmax row is empty: a row of
    -inf scores is NaN under eager attention, and the padded positions' NaN values reached
    every real token of the row at the next layer (weight 0 times NaN)."""
    eager = copy.deepcopy(model).double()  # (float64: a tolerance far below any real difference)
    for layer in eager.layers:
        layer.attn.implementation = "eager"
    prompts, ids, mask = padded_batch([5, 12, 9])
    batch = full_logits(eager, ids, attention_mask=mask)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(batch[i, -len(p) :], full_logits(eager, p[None])[0], atol=1e-10, rtol=1e-10,
                                   msg=lambda m, i=i: f"row {i}: {m}")


def test_padded_generation_matches_alone(model):
    prompts, ids, mask = padded_batch([5, 12, 9])
    new = 6
    tokens = generate(model, ids, mask, max_new_tokens=new)
    logits, cache = prefill(model, ids, mask, chunk_size=4)
    batch_logits = [logits]
    m = mask.bool()
    for s in range(new - 1):
        m = torch.cat([m, m.new_ones(len(prompts), 1)], dim=1)
        batch_logits.append(decode_step(model, cache, tokens[:, s], m))
    for i, p in enumerate(prompts):
        alone = generate(model, p[None], max_new_tokens=new)[0]
        assert torch.equal(tokens[i], alone), f"row {i}: {tokens[i].tolist()} vs {alone.tolist()}"
        logits, cache_i = prefill(model, p[None])
        alone_logits = [logits]
        for s in range(new - 1):
            alone_logits.append(decode_step(model, cache_i, alone[s : s + 1]))
        close(torch.stack([l[i] for l in batch_logits]), torch.cat(alone_logits), f"row {i} logits")


def test_all_ones_mask_is_the_plain_path(model):
    ids = random_ids(2, 10)
    close(full_logits(model, ids, attention_mask=torch.ones_like(ids)), full_logits(model, ids), "all-ones mask")


# -- sampling --------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible(model):
    ids = random_ids(2, 6)
    kw = dict(max_new_tokens=8, temperature=0.9, top_k=20, top_p=0.9)
    a = generate(model, ids, generator=torch.Generator().manual_seed(5), **kw)
    b = generate(model, ids, generator=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(a, b)
    assert a.shape == (2, 8)


def test_sample_filters():
    logits = torch.randn(4000, 50, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1)
    g = torch.Generator().manual_seed(1)
    assert torch.equal(sample(logits), greedy)
    assert torch.equal(sample(logits, temperature=1.0, top_k=1, generator=g), greedy)
    assert torch.equal(sample(logits, temperature=1.0, top_p=1e-6, generator=g), greedy)
    # top-k: every draw is among the k largest logits
    top5 = logits.topk(5, dim=-1).indices
    drawn = sample(logits, temperature=2.0, top_k=5, generator=g)
    assert (top5 == drawn[:, None]).any(-1).all()
    # top-p: every draw is in the smallest prefix of the sorted distribution reaching p
    probs = logits.softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < 0.5
    drawn = sample(logits, temperature=1.0, top_p=0.5, generator=g)
    rank = (order == drawn[:, None]).float().argmax(-1)
    assert keep.gather(-1, rank[:, None]).all()
    # temperature 1 without filters follows softmax(logits): a two-token check
    two = torch.tensor([[0.0, math.log(3.0)]]).expand(20000, 2)
    frac = sample(two, temperature=1.0, generator=g).float().mean().item()
    assert abs(frac - 0.75) < 0.02


def test_stop_tokens(model):
    ids = random_ids(2, 6)
    free = generate(model, ids, max_new_tokens=8)
    stop = int(free[0, 2])
    first = int((free[0] == stop).nonzero()[0])
    out = generate(model, ids, max_new_tokens=8, stop_tokens=[stop], pad_token_id=0)
    assert torch.equal(out[0, : first + 1], free[0, : first + 1])
    assert (out[0, first + 1 :] == 0).all()
    hit = (free[1] == stop).nonzero()
    if len(hit) == 0:  # the second row runs to max_new_tokens unaffected
        assert out.shape[1] == 8 and torch.equal(out[1], free[1])
    # a single sequence ends right after its stop token
    single = generate(model, ids[:1], max_new_tokens=8, stop_tokens=[stop])
    assert single.shape[1] == first + 1 and int(single[0, -1]) == stop


def test_stream_yields_what_generate_returns(model):
    ids = random_ids(2, 5)
    steps = list(stream(model, ids, max_new_tokens=4))
    assert all(s.shape == (2,) for s in steps)
    assert torch.equal(torch.stack(steps, 1), generate(model, ids, max_new_tokens=4))


class _CudaGenerator(torch.Generator):
    """A generator that says it is on CUDA (this test runs on CPU-only machines too)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


@pytest.mark.parametrize("generator, expected", [
    (42, "generator must be a torch.Generator (torch.Generator().manual_seed(seed)), a list of them (one per row of "
         "the batch) or None; got 42"),
    (_CudaGenerator(), "generator is on cuda:0, the model on cpu: the tokens are drawn on the model's device; use "
                       "torch.Generator(device='cpu').manual_seed(seed)"),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_generator_that_cannot_draw_the_tokens_is_refused_by_name(generator, expected, temperature):
    """`generate(..., generator=42)` (a seed where a generator goes) failed in torch.multinomial
    after the prefill, or, greedy, was ignored; a CPU generator for a model moved to CUDA (the
    README's, after load_run(..., device="cuda")) failed there with torch's error. Both are
    refused at the call, naming the argument and what to pass."""
    model = make_model(residual="attnres_block").eval()
    with pytest.raises(ValueError) as info:
        generate(model, random_ids(1, 4), max_new_tokens=2, temperature=temperature, generator=generator)
    assert str(info.value) == expected


def _seeded(n, seed=11):
    return [torch.Generator().manual_seed(seed) for _ in range(n)]


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_a_sampled_batch_with_a_generator_per_row_gives_each_prompt_its_tokens_alone(decode):
    """A sampled batch drew every row from one generator, so a prompt's sampled tokens changed
    with the other prompts beside it (vLLM seeds each request). ``generator=`` a list, one per
    row: each row of a ragged, left-padded batch (float64) now gets the tokens its prompt gets
    alone with a generator of the same seed - top-k / top-p included - while one generator for
    the whole batch still draws once for all rows (reproducible; not each alone's)."""
    model = make_model(torch.float64, residual="attnres_block").eval()
    prompts, ids, mask = padded_batch([5, 12, 9])
    kw = dict(max_new_tokens=10, temperature=1.0, top_k=50, top_p=0.95, decode=decode)
    batch = generate(model, ids, mask, generator=_seeded(3), **kw)
    alone = [generate(model, p[None], generator=_seeded(1)[0], **kw)[0] for p in prompts]
    assert batch.tolist() == [a.tolist() for a in alone]
    shared = generate(model, ids, mask, generator=torch.Generator().manual_seed(11), **kw)
    assert torch.equal(shared, generate(model, ids, mask, generator=torch.Generator().manual_seed(11), **kw))
    assert not torch.equal(shared, batch)  # (one generator's draws go to the rows in turn)
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rows = sample(logits, 0.7, 0, 1.0, _seeded(3))
    assert rows.tolist() == [int(sample(logits[i:i + 1], 0.7, 0, 1.0, _seeded(1)[0])) for i in range(3)]


def test_a_bad_list_of_generators_is_refused_by_name():
    """A list of generators must hold one ``torch.Generator`` per row, on the device the
    tokens are drawn on; otherwise ``sample``, ``stream`` / ``generate`` and
    ``stream_transformers`` refuse it at the call, naming ``generator`` (the entry)."""
    pytest.importorskip("transformers")
    from attnres.hf import AttnResForCausalLM
    from attnres.inference import stream_transformers

    model = make_model(residual="attnres_block").eval()
    exported = AttnResForCausalLM.from_native(model).eval()
    ids = random_ids(2, 4)
    cases = (
        (_seeded(3), "generator: a list of generators takes one per row of the batch, 2; got 3"),
        ([], "generator: a list of generators takes one per row of the batch, 2; got 0"),
        ([torch.Generator(), 7], r"generator\[1\] must be a torch.Generator \(torch.Generator\(\).manual_seed\(seed\)\); "
                                 "got 7"),
        ([_CudaGenerator(), torch.Generator()], r"generator\[0\] is on cuda:0, the model on cpu: the tokens are drawn "
                                                r"on the model's device; use torch.Generator\(device='cpu'\)"),
        ("ab", "generator must be a torch.Generator .*, a list of them"),
    )
    for generator, message in cases:
        for temperature in (0.0, 1.0):
            with pytest.raises(ValueError, match=message):
                generate(model, ids, max_new_tokens=2, temperature=temperature, generator=generator)
            with pytest.raises(ValueError, match=message):
                stream_transformers(exported, ids, max_new_tokens=2, temperature=temperature, generator=generator)
            on_logits = message.replace("the model's", "the logits'").replace("the model", "the logits")
            with pytest.raises(ValueError, match=on_logits):
                sample(torch.zeros(2, 5), temperature, generator=generator)


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_the_next_step_is_launched_before_the_tokens_are_handed_out(monkeypatch, decode):
    """`stream` launches decode step k + 1 before it yields step k's tokens and before it
    waits for them (on a GPU the step runs while the host reads the tokens); its tokens are
    those of `generate`; when every sequence has stopped, no step follows the one already
    launched."""
    import sys

    from attnres.inference import static as static_module

    generate_module = sys.modules["attnres.inference.generate"]  # (the package's `generate` is the function)
    model = make_model(residual="attnres_block").eval()
    ids = random_ids(2, 5)
    launched = []
    if decode == "dynamic":
        step = generate_module.decode_step
        monkeypatch.setattr(generate_module, "decode_step", lambda *a, **k: launched.append(1) or step(*a, **k))
    else:
        step = static_module.StaticDecoder.step
        monkeypatch.setattr(static_module.StaticDecoder, "step", lambda self, t: launched.append(1) or step(self, t))
    seen = [len(launched) for _ in stream(model, ids, max_new_tokens=5, decode=decode)]
    assert seen == [1, 2, 3, 4, 4]  # (no step after the last token)
    free = generate(model, ids, max_new_tokens=5, decode=decode)
    stop = int(free[0, 1])
    both = generate(model, ids, max_new_tokens=5, decode=decode, stop_tokens=[stop, *free[1, :2].tolist()])
    launched.clear()
    steps = list(stream(model, ids, max_new_tokens=5, decode=decode, stop_tokens=[stop, *free[1, :2].tolist()]))
    assert torch.equal(torch.stack(steps, 1), both) and len(launched) == len(steps)


# -- bad input -------------------------------------------------------------------------------
BAD = [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(stop_tokens=[256]), "stop_tokens"),
    (dict(pad_token_id=-1), "pad_token_id"),
]


@pytest.mark.parametrize("kwargs,name", BAD, ids=[f"{n}={list(k.values())[0]}" for k, n in BAD])
def test_invalid_parameters(kwargs, name):
    model = make_model(residual="attnres_block")
    with pytest.raises(ValueError, match=name):
        generate(model, random_ids(1, 4), **{"max_new_tokens": 2, **kwargs})


def test_stop_tokens_and_pad_id_errors_name_the_parameter():
    """A single id for ``stop_tokens`` (not a list of them), a tensor of ids, or a tensor
    ``pad_token_id`` is a ValueError that names the parameter and says what it takes, not a
    bare ``TypeError: 'int' object is not iterable`` or "got tensor(1)" for an id in range."""
    model = make_model(residual="attnres_block")
    ids = random_ids(1, 4)
    with pytest.raises(ValueError) as e:
        generate(model, ids, max_new_tokens=2, stop_tokens=1)
    assert str(e.value) == "stop_tokens must be a list of token ids in [0, 256) ([id] for one); got 1"
    with pytest.raises(ValueError) as e:
        generate(model, ids, max_new_tokens=2, stop_tokens=torch.tensor(1))
    assert str(e.value) == "stop_tokens must be a list of token ids in [0, 256) ([id] for one); got tensor(1)"
    with pytest.raises(ValueError) as e:
        generate(model, ids, max_new_tokens=2, stop_tokens=torch.tensor([1, 2]))
    assert str(e.value) == "stop_tokens must be token ids (Python ints) in [0, 256); got tensor(1)"
    with pytest.raises(ValueError) as e:
        generate(model, ids, max_new_tokens=2, pad_token_id=torch.tensor(0))
    assert str(e.value) == "pad_token_id must be a token id (a Python int) in [0, 256); got tensor(0)"
    with pytest.raises(ValueError) as e:
        stream(model, ids, max_new_tokens=2, stop_tokens=[256])
    assert str(e.value) == "stop_tokens must be token ids (Python ints) in [0, 256); got 256"


def test_prefill_names_a_bad_capacity():
    """``prefill(..., capacity="64")`` failed in a comparison ("'>' not supported between
    instances of 'int' and 'str'") and a negative capacity passed unnoticed."""
    model = make_model(residual="attnres_block").eval()
    for bad in ("64", -1, 2.5, True):
        with pytest.raises(ValueError, match=rf"capacity must be an integer >= 0 .*, got {bad!r}"):
            prefill(model, random_ids(1, 4), capacity=bad)
    logits, cache = prefill(model, random_ids(1, 4), capacity=16)
    assert cache.seq_len == 4 and cache.keys(0).shape[0] == 1


def test_stream_validates_before_running():
    """``stream`` raises at the call, not at the first ``next()``."""
    model = make_model(residual="attnres_block")
    for kwargs, said in ((dict(chunk_size=0), "chunk_size must be an integer >= 1 or None (one shot), got 0"),
                         (dict(top_p=2.0), "top_p must be a number in (0, 1] (1 = no nucleus filter); got 2.0"),
                         (dict(stop_tokens=[-1]), "stop_tokens must be token ids (Python ints) in [0, 256); got -1")):
        with pytest.raises(ValueError) as refused:
            stream(model, random_ids(1, 4), max_new_tokens=2, **kwargs)
        assert str(refused.value) == said


def test_invalid_prompts():
    model = make_model(residual="attnres_block")
    limit = model.config.max_seq_len
    with pytest.raises(ValueError, match="non-empty"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), max_new_tokens=1)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, random_ids(1, limit + 1), max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, random_ids(1, limit - 2), max_new_tokens=4)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(model, torch.tensor([[1, 300]]), max_new_tokens=1)
    ids = random_ids(2, 4)
    with pytest.raises(ValueError, match="attention_mask must be a tensor of the shape"):
        generate(model, ids, torch.ones(2, 3), max_new_tokens=1)
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, ids, torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]), max_new_tokens=1)
    with pytest.raises(ValueError, match="only 0"):
        generate(model, ids, torch.full((2, 4), 2), max_new_tokens=1)
    cache = KVCache(model.config.n_layers)
    with torch.no_grad():
        model(random_ids(1, limit - 1), kv_cache=cache)
        with pytest.raises(ValueError, match="max_seq_len"):
            model(random_ids(1, 2), kv_cache=cache)


def test_decode_step_names_its_argument_and_the_cache_its_batch():
    """A ``[B, 1]`` token tensor was reported as ``input_ids`` of shape ``(2, 1, 1)``; a batch
    other than the cache's failed in PyTorch's broadcasting ('expanded size ...')."""
    model = make_model(residual="attnres_block").eval()
    logits, cache = prefill(model, random_ids(2, 5))
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"tokens must have shape \[B\] .* got \(2, 1\)"):
            decode_step(model, cache, torch.tensor([[1], [2]]))
        with pytest.raises(ValueError, match="holds a batch of 2 sequences and this forward has 3"):
            decode_step(model, cache, torch.tensor([1, 2, 3]))
        assert cache.seq_len == 5  # nothing written
        step = decode_step(model, cache, torch.tensor([1, 2]))
        cache.crop(0)  # emptied: another batch may fill it
        model(random_ids(3, 4), kv_cache=cache)
    assert step.shape == (2, 256) and cache.seq_len == 4


def test_decode_step_after_a_left_padded_prefill_needs_the_mask():
    """``prefill(model, ids, mask)`` of a left-padded batch, then ``decode_step(model, cache,
    tokens)`` without a mask (its signature's default) attended to the padded keys and counted
    them in the positions: other tokens than ``generate``'s, without a word. That step is now
    refused, naming the mask it needs; with it, the steps give ``generate``'s tokens, and a
    prompt without padding still decodes without one."""
    model = make_model(residual="attnres_block").eval()
    ids = random_ids(2, 5)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    logits, cache = prefill(model, ids, mask)
    with pytest.raises(ValueError, match=re.escape("prefilled from a left-padded batch") + ".*"
                       + re.escape("attention_mask [B, cache.seq_len + 1] = [2, 6]")):
        decode_step(model, cache, sample(logits))
    assert cache.seq_len == 5  # nothing written
    tokens = []
    for _ in range(4):
        tokens.append(sample(logits))
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
        logits = decode_step(model, cache, tokens[-1], mask)
    assert torch.equal(torch.stack(tokens, 1), generate(model, ids, mask[:, :5], max_new_tokens=4))
    logits, cache = prefill(model, ids, torch.ones(2, 5, dtype=torch.long))  # (no padding: the mask is dropped)
    step = decode_step(model, cache, sample(logits))
    torch.testing.assert_close(step, prefill(model, torch.cat([ids, sample(logits)[:, None]], 1))[0], atol=1e-4, rtol=1e-4)


def test_a_cache_for_another_number_of_layers_is_refused_naming_the_fix():
    """A ``KVCache`` (or ``StaticKVCache``) made for fewer layers than the model failed with
    "list index out of range", one for more with "layers hold different lengths ...: a
    forward was interrupted" at the next step, a ``StaticKVCache`` of other heads, head size
    or batch with "index_copy_(): Source/destination tensor must have same slice shapes" or
    "The size of tensor a (2) must match"; the cache is refused before it is written."""
    from attnres.inference import StaticKVCache

    model = make_model(residual="attnres_block").eval()  # 2 transformer blocks
    ids = random_ids(2, 5)
    config = model.config
    caches = [KVCache(1), KVCache(3),
              StaticKVCache(1, 2, config.kv_heads, config.head_dim, 8), StaticKVCache.for_model(model, 2, 8)]
    with torch.no_grad():
        for cache in caches[:3]:
            with pytest.raises(ValueError, match=r"kv_cache holds [13] layers, the model has ModelConfig.n_layers=2: "
                                                 r"make it for this model: KVCache\(model.config.n_layers\)"):
                model(ids, kv_cache=cache)
            assert cache.seq_len == 0  # nothing written
        for shape in ((2, 4, config.head_dim), (2, config.kv_heads, 8), (3, config.kv_heads, config.head_dim)):
            cache = StaticKVCache(config.n_layers, shape[0], shape[1], shape[2], 8)
            with pytest.raises(ValueError, match=rf"StaticKVCache holds \(batch, key/value heads, head size\) "
                                                 rf"{re.escape(str(shape))}, this forward needs \(2, 2, 16\): make it for this model"):
                model(ids, kv_cache=cache)
            assert cache.seq_len == 0
        for cache in (KVCache(config.n_layers), caches[3]):
            torch.testing.assert_close(model(ids, kv_cache=cache).logits, model(ids).logits)


def test_generate_and_analyze_of_a_native_run_need_no_transformers(tmp_path):
    """Where ``transformers`` is not installed (a GPU machine with torch and the ``train``
    extra only), ``attnres generate`` and ``attnres analyze`` of a native run ended in "this
    needs the 'train' extra ... (the module 'transformers' is not installed)": the Hub-id check
    each makes of its checkpoint imported the transformers wing (``attnres.hf``)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_train import overrides, write_corpus

    from attnres.train import load_config, train

    corpus = write_corpus(tmp_path / "corpus.txt", n_lines=200)
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus, run, steps=1, eval_every=100, diagnostics_every=100)))
    script = ("import sys; sys.modules['transformers'] = None  # (as if not installed: its import fails)\n"
              "from attnres.cli import main\n"
              "assert main(sys.argv[1:]) == 0\n"
              "assert 'attnres.hf' not in sys.modules\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    for argv in (["generate", str(run), "--prompt", "the", "--max-new-tokens", "2"],
                 ["analyze", str(run), "--text", str(corpus), "--rows", "1", "--seq-len", "16",
                  "--out", str(tmp_path / "analysis")]):
        done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "analysis" / "mixing.json").is_file()


def test_generate_cli_continues_a_prompt_from_a_training_checkpoint(tmp_path, capsys, monkeypatch):
    import io
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main
    from attnres.train import load_config, train

    corpus = write_corpus(tmp_path / "corpus.txt", n_lines=200)
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus, run, steps=2, eval_every=100, diagnostics_every=100)))
    capsys.readouterr()  # the training's start-up summary
    assert cli_main(["generate", "--checkpoint", str(run), "--prompt", "the quick", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert "5 tokens in" in err and "tokens/s" in err
    # Greedy: the same command prints the same continuation.
    assert cli_main(["generate", "--checkpoint", str(run), "--prompt", "the quick", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == out
    with pytest.raises(SystemExit, match="--prompt is empty"):
        cli_main(["generate", "--checkpoint", str(run), "--prompt", ""])
    # The prompt from a file or standard input: the same text, the editor's final line break dropped.
    (tmp_path / "prompt.txt").write_text("the quick\n", encoding="utf-8")
    assert cli_main(["generate", str(run), "--prompt-file", str(tmp_path / "prompt.txt"), "--max-new-tokens", "5",
                     "--temperature", "0"]) == 0
    assert capsys.readouterr().out == out
    monkeypatch.setattr(sys, "stdin", io.StringIO("the quick\n"))
    assert cli_main(["generate", str(run), "--prompt-file", "-", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == out
    # A Windows editor's file (a byte-order mark, CRLF) and standard input read alike: the same text.
    from attnres.cli.generate import read_prompt

    (tmp_path / "windows.txt").write_bytes("\ufeffthe\r\nquick\r\n".encode("utf-8"))
    (tmp_path / "unix.txt").write_text("the\nquick\n", encoding="utf-8")
    assert read_prompt(str(tmp_path / "unix.txt"))[0] == "the\nquick"
    assert read_prompt(str(tmp_path / "windows.txt"))[0] == "the\nquick"
    # bytes, as a pipe gives them: UTF-8 whatever the locale's encoding
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\ufeffthe\r\nqu\u00efck\r\n".encode()),
                                                       encoding="latin-1"))
    assert read_prompt("-") == ("the\nqu\u00efck", "--prompt-file - (standard input)")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("caf\xe9".encode("latin-1")), encoding="latin-1"))
    with pytest.raises(ValueError, match="--prompt-file: standard input is not UTF-8 text"):
        read_prompt("-")
    with pytest.raises(SystemExit, match="--prompt is empty"):  # (the template's text is not the prompt)
        cli_main(["generate", str(run), "--prompt", "", "--chat"])
    (tmp_path / "empty.txt").write_text("\n", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    for given, message in ((tmp_path / "empty.txt", "--prompt-file .*empty.txt is empty: there is nothing to continue"),
                           (tmp_path / "nope.txt", "--prompt-file: no file '.*nope.txt'"),
                           (tmp_path, "--prompt-file: '.*' is a directory; give a text file"),
                           (tmp_path / "latin1.txt", "--prompt-file: '.*latin1.txt' is not UTF-8 text")):
        with pytest.raises(SystemExit, match=message):
            cli_main(["generate", str(run), "--prompt-file", str(given)])
    with pytest.raises(SystemExit):
        cli_main(["generate", str(run), "--prompt", "the", "--prompt-file", str(tmp_path / "prompt.txt")])
    assert "argument --prompt-file: not allowed with argument --prompt" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="temperature"):
        cli_main(["generate", "--checkpoint", str(run), "--prompt", "the", "--temperature", "-1"])
    with pytest.raises(SystemExit, match=r"neither a checkpoint nor a run directory with checkpoints: it holds 1 run\(s\); "
                       "name one, e.g. '.*run'"):
        cli_main(["generate", "--checkpoint", str(tmp_path), "--prompt", "the"])


def test_generate_cli_device_and_context_limit(tmp_path, capsys):
    """``--device`` picks where the model runs (a bad name is a one-line error naming the
    allowed values), and a prompt that does not fit the context is refused up front with
    the limit and what to change."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main
    from attnres.train import load_config, train

    corpus = write_corpus(tmp_path / "corpus.txt", n_lines=200)
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus, run, steps=1, eval_every=100, diagnostics_every=100)))
    capsys.readouterr()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert cli_main(["generate", "--checkpoint", str(run), "--prompt", "the", "--max-new-tokens", "3",
                     "--temperature", "0", "--device", device]) == 0
    assert f"prefill included, {device}" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got 'tpu'"):
        cli_main(["generate", "--checkpoint", str(run), "--prompt", "the", "--device", "tpu"])
    # tiny: max_seq_len 128; a 100-byte prompt leaves room for 29 new tokens
    with pytest.raises(SystemExit, match=r"prompt \(100 tokens\) plus --max-new-tokens 64 .*context limit of 128 "
                                         r"tokens \(max_seq_len\): use --max-new-tokens 29 or less"):
        cli_main(["generate", "--checkpoint", str(run), "--prompt", "x" * 100, "--max-new-tokens", "64"])
    assert cli_main(["generate", "--checkpoint", str(run), "--prompt", "x" * 100, "--max-new-tokens", "29",
                     "--temperature", "0", "--device", "cpu"]) == 0


def test_stream_warns_once_about_non_finite_logits():
    """Finite weights whose logits overflow (an output head scaled to 1e38) printed NUL bytes
    without a word; one warning names the step, and finite logits give none."""
    model = make_model(residual="attnres_block").eval()
    ids = random_ids(2, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(model, ids, max_new_tokens=3)
    with torch.no_grad():
        model.lm_head.weight.fill_(1e38)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    with pytest.warns(RuntimeWarning, match=r"logits of generation step 0 are not finite") as caught:
        generate(model, ids, max_new_tokens=3)
    assert len([w for w in caught if "not finite" in str(w.message)]) == 1


def test_sampling_a_row_without_a_distribution_takes_its_argmax():
    """NaN or infinite logits, or finite logits over a temperature near 0 (beyond float32),
    give no distribution: ``torch.multinomial`` raised "probability tensor contains either
    `inf`, `nan` or element < 0" from the first sampled step, before ``stream``'s warning (and
    ``attnres generate`` samples by default: a traceback). Such a row takes its argmax, as
    greedy decoding does; the other rows are drawn as before, from the same generator."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [1.0, float("nan"), 0.0], [0.5, 0.2, 0.1], [0.0, float("inf"), 1.0]])
    draw = sample(logits, 1.0, generator=torch.Generator().manual_seed(0))
    assert draw[1:].tolist() == [1, 0, 1]  # NaN row: argmax's pick, as greedy
    assert draw[0] == sample(logits[:1], 1.0, generator=torch.Generator().manual_seed(0))[0]
    assert sample(torch.tensor([[1.0, 2.0, 3.0], [4.0, -1.0, 0.0]]), 1e-40, top_p=0.5).tolist() == [2, 0]
    model = make_model(residual="attnres_block").eval()
    ids = random_ids(2, 5)
    with torch.no_grad():
        model.lm_head.weight.fill_(1e38)  # logits overflow: infinite, or NaN where they meet
    with pytest.warns(RuntimeWarning, match=r"logits of generation step 0 are not finite"):
        drawn = generate(model, ids, max_new_tokens=3, temperature=0.8, top_k=5, top_p=0.9,
                         generator=torch.Generator().manual_seed(0))
    with pytest.warns(RuntimeWarning, match="not finite"):
        assert torch.equal(drawn, generate(model, ids, max_new_tokens=3))


def test_generate_prints_a_character_split_over_tokens_once_whole():
    """A byte-level token holding the first byte of "é" decodes to U+FFFD: it was printed, and
    the next token's completed "é" was then skipped (the printed text kept the U+FFFD). The
    pieces now wait for a character's last byte; a character the last token cuts short is
    printed as it is."""
    from attnres.cli.generate import text_pieces
    from attnres.data.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("café €!")
    new: list[int] = []
    pieces = list(text_pieces(tokenizer, ([i] for i in ids), new))
    assert "".join(pieces) == "café €!" and "\ufffd" not in "".join(pieces) and new == ids
    assert pieces[:3] == ["c", "a", "f"] and "é" in pieces and "€" in pieces  # one piece per whole character
    cut = list(text_pieces(tokenizer, ([i] for i in tokenizer.encode("aé")[:-1]), []))
    assert cut == ["a", "\ufffd"]


class _WholeTextPieces:
    """``TextPieces`` as it was: the whole continuation decoded at each token (the pieces that
    the tail window must give)."""

    def __init__(self, tokenizer, ids=None):
        self.tokenizer, self.ids, self._shown, self._text = tokenizer, [] if ids is None else ids, "", ""

    def add(self, token):
        self.ids.append(token)
        self._text = self.tokenizer.decode(self.ids)
        ready = self._text.rstrip("\ufffd")
        if len(ready) <= len(self._shown):
            return ""
        piece, self._shown = ready[len(self._shown):], ready
        return piece

    def end(self):
        rest, self._shown = self._text[len(self._shown):], self._text
        return rest


def _pieces(cls, tokenizer, ids):
    text = cls(tokenizer)
    return [text.add(i) for i in ids] + [text.end()]


def _byte_fallback_tokenizer():
    """A Llama-style tokenizer of letters, '▁' and 256 byte tokens: every character beyond
    them is its UTF-8 bytes, each a token (byte fallback), and the decoder strips the text's
    leading space."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers

    letters = "▁abcdefghijklmnopqrstuvwxyzT.,"
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, **{c: 257 + i for i, c in enumerate(letters)}}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])

    class ByteFallback:
        def encode(self, text):
            return backend.encode(text).ids

        def decode(self, ids):
            return backend.decode(list(ids))

    return ByteFallback()


def test_text_pieces_follow_a_tail_window_with_the_pieces_of_the_whole_text(monkeypatch):
    """``TextPieces`` decoded the whole continuation at each token: quadratic in the tokens.
    It decodes a tail window now, and gives the very pieces the whole text gave - characters
    split over byte tokens (byte-level BPE, byte fallback with its leading space stripped, the
    byte tokenizer, invalid bytes), so ``text_until_stop`` finds a stop string across tokens at
    the same token, with the same text."""
    import random

    from attnres.data.tokenizer import ByteTokenizer, bpe_available, train_bpe
    from attnres.inference import TextPieces, text_until_stop
    from attnres.inference import stop_strings as module

    text = "The café ☕ is naïve, 😀 日本 ok. " * 4
    draw = random.Random(0)
    cases = [(ByteTokenizer(), list(text.encode())), (ByteTokenizer(), [draw.randrange(256) for _ in range(400)]),
             (ByteTokenizer(), [draw.choice(b"\x80\xbf\xe2\x82\xac\xf0\x9f\x98\xc3\xa9A") for _ in range(400)])]
    fallback = _byte_fallback_tokenizer()
    texts = [cases[0], (fallback, fallback.encode(text))]
    if bpe_available():
        bpe = train_bpe(text * 10, 300)
        texts.append((bpe, bpe.encode(text)))
        cases.append((bpe, [draw.randrange(bpe.vocab_size) for _ in range(300)]))
    for tokenizer, ids in cases + texts:
        assert _pieces(TextPieces, tokenizer, ids) == _pieces(_WholeTextPieces, tokenizer, ids), (tokenizer, ids)
    stops = ["é ☕ i", "😀 日", "naïve, 😀", "k. T"]  # across byte tokens, characters and words
    for tokenizer, ids in texts:
        for stop in stops:
            got = text_until_stop(tokenizer, ids, [stop])
            with monkeypatch.context() as whole:
                whole.setattr(module, "TextPieces", _WholeTextPieces)
                assert got == text_until_stop(tokenizer, ids, [stop]) and got.stop == stop


def test_text_pieces_decode_a_bounded_window_at_each_token():
    """The work of each token is bounded: every decode reads at most a few tokens, for text
    and for bytes that never make a whole character (the whole continuation was decoded
    each time: the work of the n-th token grew with n)."""
    from attnres.data.tokenizer import ByteTokenizer
    from attnres.inference import TextPieces

    class Counting(ByteTokenizer):
        def __init__(self):
            super().__init__()
            self.lengths = []

        def decode(self, ids):
            self.lengths.append(len(ids))
            return super().decode(ids)

    for ids in (list(("café €! 😀 naïve " * 100).encode()), [0x80] * 2000, [0xF0, 0x9F, 0x98] * 700):
        tokenizer = Counting()
        pieces = _pieces(TextPieces, tokenizer, ids)
        assert "".join(pieces) == bytes(ids).decode("utf-8", errors="replace")
        assert max(tokenizer.lengths) <= 16 and sum(tokenizer.lengths) <= 16 * len(ids), max(tokenizer.lengths)


def test_stream_transformers_reads_the_cache_field_the_output_has():
    """A forward taking the cache by both names (``cache``, transformers 5.24's, and
    ``past_key_values``), as attnres' transformers models' do, whose output has only the
    ``past_key_values`` field - transformers' output classes before 5.24, the newest on Python
    3.10: each step gets the previous step's cache (was: AttributeError ``'...' object has no
    attribute 'cache'`` at the second step, ``attnres generate`` on a transformers directory)."""
    from types import SimpleNamespace

    from attnres.inference import stream_transformers

    class OldOutputs(torch.nn.Module):  # the cache: the number of positions seen so far
        config = SimpleNamespace(max_position_embeddings=32, vocab_size=8)

        def forward(self, input_ids, use_cache=False, cache=None, past_key_values=None):
            seen = (cache or 0) + input_ids.shape[1]
            logits = torch.nn.functional.one_hot(torch.full(input_ids.shape, seen % 8), 8).float()
            return SimpleNamespace(logits=logits, past_key_values=seen)

    got = torch.cat(list(stream_transformers(OldOutputs(), torch.zeros(1, 3, dtype=torch.long), max_new_tokens=4)))
    assert got.tolist() == [3, 4, 5, 6]


def test_a_generation_past_the_context_names_lengths_that_fit():
    """A prompt longer than the context was told "a prompt of at most max_seq_len tokens",
    still too long by max_new_tokens - 1; each fix named now fits with the other length as
    given, and where neither alone can, their sum."""
    model = make_model(residual="attnres_block").eval()
    limit = model.config.max_seq_len
    for t, new, fix in ((limit + 10, 5, f"a prompt of at most {limit - 4} tokens$"),
                        (20, limit, f"max_new_tokens <= {limit - 19} or a prompt of at most 1 token$"),
                        (limit + 10, limit + 5, f"a prompt and max_new_tokens that add up to at most {limit + 1}$")):
        with pytest.raises(ValueError, match=rf"prompt length {t} \+ max_new_tokens {new} - 1 exceeds "
                                             rf"ModelConfig.max_seq_len={limit}: use {fix}"):
            generate(model, torch.zeros(1, t, dtype=torch.long), max_new_tokens=new)


def _meta_parameter_model():
    """A transformers-like causal LM (``stream_transformers``'s contract) with a parameter
    on the ``meta`` device: what a prompt on the CPU meets next to a model moved to CUDA."""
    from types import SimpleNamespace

    class OnMeta(torch.nn.Module):
        config = SimpleNamespace(max_position_embeddings=32, vocab_size=8)

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8, device="meta"))

        def forward(self, input_ids, use_cache=False, past_key_values=None):
            return SimpleNamespace(logits=self.weight.expand(*input_ids.shape, 8), past_key_values=None)

    return OnMeta()


def test_a_prompt_on_another_device_than_the_model_is_refused_naming_the_fix():
    """``ids = torch.tensor(...)`` on the CPU after ``model.cuda()`` failed deep inside the
    prefill with torch's "Tensor on device cpu is not on the expected device" (an
    ``attention_mask`` elsewhere: "Tensor.item() cannot be called on meta tensors"); each
    entry point now names the argument, both devices and the ``.to(...)`` that fixes it,
    before anything runs. The ``meta`` device stands in for the other one."""
    from attnres.inference import StaticDecoder, stream_transformers

    model = make_model(residual="attnres_block").eval()
    ids = random_ids(2, 4)
    on_meta = ids.to("meta")
    ran = []
    model.embed_tokens.register_forward_pre_hook(lambda *a: ran.append(True))
    message = r"input_ids is on meta, the model on cpu: move it there first, input_ids.to\('cpu'\)"
    for call in (lambda: generate(model, on_meta, max_new_tokens=2), lambda: stream(model, on_meta, max_new_tokens=2),
                 lambda: prefill(model, on_meta), lambda: generate(model, on_meta, decode="static", max_new_tokens=2)):
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(ValueError, match=r"attention_mask is on meta, the model on cpu: .* attention_mask.to\('cpu'\)"):
        generate(model, ids, torch.ones(2, 4, device="meta"), max_new_tokens=2)
    logits, cache = prefill(model, ids)
    decoder = StaticDecoder(model, 2, 8, mode="eager")
    decoder.load(cache)
    ran.clear()
    for step in (lambda t: decode_step(model, cache, t), decoder.step, lambda t: decoder.decode(t, 2)):
        with pytest.raises(ValueError, match=r"tokens is on meta, the model on cpu: .*tokens.to\('cpu'\)"):
            step(torch.tensor([1, 2], device="meta"))
    assert not ran and cache.seq_len == 4 and decoder.length == 4  # nothing ran, nothing written
    with pytest.raises(ValueError, match=r"input_ids is on cpu, the model on meta: .*input_ids.to\('meta'\)"):
        generate(make_model(residual="attnres_block").eval().to("meta"), ids, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"input_ids is on cpu, the model on meta: .*input_ids.to\('meta'\)"):
        stream_transformers(_meta_parameter_model(), torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2)
    dispatched = _meta_parameter_model()  # accelerate's device_map: its hooks move the ids (weights offloaded: meta)
    dispatched.hf_device_map = {"": "cpu"}
    stream_transformers(dispatched, torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2)  # (checked at the call)


def test_float_token_ids_are_refused_naming_the_fix():
    """``torch.tensor([[1., 2.]])`` as a prompt: ``stream_transformers`` failed inside the
    model's embedding ("Expected tensor for argument #1 'indices' to have one of the following
    scalar types: Long, Int"), as every entry point did for int8/int16/uint8 ids, and a
    ``StaticDecoder`` replaying a CUDA graph would have copied float tokens over without a
    word. Each says the dtypes it takes and ``.long()``, before anything runs; id 8 of a
    vocabulary of 8 is refused by ``stream_transformers`` too (a device-side assert on CUDA)."""
    from attnres.inference import StaticDecoder, stream_transformers

    model = make_model(residual="attnres_block").eval()
    floats = torch.tensor([[1.0, 2.0]])
    for ids in (floats, floats.to(torch.int16), floats.to(torch.uint8)):
        with pytest.raises(ValueError, match=rf"input_ids must be an integer tensor of token ids \(torch.long or "
                                             rf"torch.int32\), got dtype {ids.dtype}: use input_ids.long\(\)"):
            generate(model, ids, max_new_tokens=2)
    assert torch.equal(generate(model, floats.to(torch.int32), max_new_tokens=2),
                       generate(model, floats.long(), max_new_tokens=2))
    fake = _meta_parameter_model().to_empty(device="cpu")
    for bad, message in ((floats, r"input_ids must be token ids of dtype torch.long or torch.int32, got torch.float32: "
                                  r"use input_ids.long\(\)"),
                         (torch.tensor([[1, 8]]), r"token id 8 is outside the vocabulary \[0, 8\)")):
        with pytest.raises(ValueError, match=message):
            stream_transformers(fake, bad, max_new_tokens=2)
    logits, cache = prefill(model, floats.long())
    decoder = StaticDecoder(model, 1, 8, mode="eager")
    decoder.load(cache)
    for step in (lambda t: decode_step(model, cache, t), decoder.step):
        with pytest.raises(ValueError, match=r"tokens must be token ids of dtype torch.long or torch.int32, got "
                                             r"torch.float32: use tokens.long\(\)"):
            step(torch.tensor([1.0]))
    assert cache.seq_len == 2 and decoder.length == 2


class _AngleTokenizer:
    """Token ``i`` reads ``<iii>`` (three digits): a text of several characters per token."""

    @staticmethod
    def decode(ids):
        return "".join(f"<{i:03d}>" for i in ids)


def _first_holding(tokens, stop):
    """How many of ``tokens`` the text must have to hold ``stop`` (None: it never does)."""
    return next((k for k in range(1, len(tokens) + 1) if stop in _AngleTokenizer.decode(tokens[:k])), None)


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_stop_strings_end_a_sequence_at_the_token_that_completes_them(model, decode):
    """``stream`` / ``generate`` took stop token ids only (``attnres generate --stop`` had
    stop strings): ``stop_strings=`` with the ``tokenizer`` now finish a row at the token whose
    text completes one - across two tokens, inside one token - that token returned and the
    row padded after it, as a stop token is, the other row going on; the batch ends when
    every row has."""
    from attnres.inference import text_until_stop

    ids = random_ids(2, 6)
    free = generate(model, ids, max_new_tokens=8, decode=decode).tolist()
    across = f"{free[0][2]:03d}><{free[0][3]:03d}"  # the end of token 2's text and the start of token 3's
    k = next(k for k in range(3, 8) if free[0][k] not in free[1] + free[0][:k])
    inside = f"{free[0][k]:03d}"  # inside token k's text, '<...>' around it
    for stop in (across, inside):
        needed = _first_holding(free[0], stop)
        assert needed is not None and _first_holding(free[1], stop) is None, (free, stop)
        out = generate(model, ids, max_new_tokens=8, decode=decode, stop_strings=[stop], tokenizer=_AngleTokenizer,
                       pad_token_id=9)
        assert out[0].tolist() == free[0][:needed] + [9] * (8 - needed)
        assert out[1].tolist() == free[1]  # not in its text: it runs to max_new_tokens
        assert text_until_stop(_AngleTokenizer, out[0].tolist(), [stop]) == (
            _AngleTokenizer.decode(free[0][:needed]).split(stop)[0], stop, needed)
    alone = generate(model, ids[:1], max_new_tokens=8, decode=decode, stop_strings=across, tokenizer=_AngleTokenizer)
    assert alone[0].tolist() == free[0][:_first_holding(free[0], across)]  # every row ended: the stream ends
    both = generate(model, ids, max_new_tokens=8, decode=decode, tokenizer=_AngleTokenizer,
                    stop_strings=[across, f"{free[1][1]:03d}><{free[1][2]:03d}"])
    assert both.shape[1] == max(_first_holding(free[0], across), 3)


def test_stop_strings_none_is_none_and_text_until_stop_reads_tensors(model):
    """``stop_strings=None``, transformers' default (``generate(stop_strings=config.get("stop"))``),
    was refused as 'must be a list'; it is none. ``text_until_stop`` given ``generate``'s whole
    output ``[1, n]`` failed in torch ('only one element tensors can be converted'), and stop
    tokens as a tensor were never equal to an id (the text ran on past them); now a row and a
    tensor of stop tokens read as lists, and the rest is refused naming the parameter."""
    from attnres.inference import text_until_stop

    ids = random_ids(1, 5)
    free = generate(model, ids, max_new_tokens=6)
    assert torch.equal(generate(model, ids, max_new_tokens=6, stop_strings=None), free)
    assert text_until_stop(_AngleTokenizer, free[0], None) == (_AngleTokenizer.decode(free[0].tolist()), None, 6)
    stop = int(free[0, 2])
    assert text_until_stop(_AngleTokenizer, free[0], (), torch.tensor([stop])) == text_until_stop(
        _AngleTokenizer, free[0].tolist(), (), [stop])
    first = free[0].tolist().index(stop) + 1
    assert text_until_stop(_AngleTokenizer, free[0], (), torch.tensor([stop])).n_tokens == first
    for args, message in (((free, ()), r"ids must be a list of token ids or a 1-D tensor \(one sequence's: a row of "
                                       r"generate's output, out\[0\]\); got Tensor of shape \(1, 6\)"),
                          ((free[0], (), stop), r"stop_tokens must be a list of token ids or a 1-D tensor \(\[id\] for "
                                                r"one\); got int")):
        with pytest.raises(ValueError, match=message):
            text_until_stop(_AngleTokenizer, *args)


def test_stop_strings_in_stream_transformers_and_their_errors():
    from types import SimpleNamespace

    from attnres.inference import stream_transformers

    class Counting(torch.nn.Module):  # the next token: the number of positions seen
        config = SimpleNamespace(max_position_embeddings=32, vocab_size=16)

        def forward(self, input_ids, use_cache=False, past_key_values=None):
            seen = (past_key_values or 0) + input_ids.shape[1]
            return SimpleNamespace(logits=torch.nn.functional.one_hot(torch.full(input_ids.shape, seen), 16).float(),
                                   past_key_values=seen)

    prompt = torch.zeros(1, 3, dtype=torch.long)
    got = torch.cat(list(stream_transformers(Counting(), prompt, max_new_tokens=8, stop_strings=["4><00"],
                                             tokenizer=_AngleTokenizer)))
    assert got.tolist() == [3, 4, 5]
    model = make_model(residual="attnres_block").eval()
    for kwargs, message in ((dict(stop_strings=["x"]), r"stop_strings needs tokenizer=, the tokenizer whose decode"),
                            (dict(stop_strings=[""], tokenizer=_AngleTokenizer), "stop_strings must be non-empty strings; got ''"),
                            (dict(stop_strings=[3], tokenizer=_AngleTokenizer), "stop_strings must be non-empty strings; got 3"),
                            (dict(stop_strings=b"x", tokenizer=_AngleTokenizer), "stop_strings must be a list of non-empty")):
        for call in (lambda: stream(model, random_ids(1, 4), max_new_tokens=2, **kwargs),
                     lambda: stream_transformers(Counting(), prompt, max_new_tokens=2, **kwargs)):
            with pytest.raises(ValueError, match=message):
                call()


def test_the_arguments_in_another_order_are_refused_naming_the_order():
    """``generate(ids, model, ...)`` - the prompt where the model goes - failed with
    "'Tensor' object has no attribute 'parameters'" (``stream`` read the model's device
    before checking it), ``decode_step(cache, model, tokens)`` likewise with "'KVCache'
    object has no attribute 'parameters'", and ``stream_transformers(ids, model, ...)``
    with "'Tensor' object has no attribute 'config'". Each names the order it takes."""
    from attnres.inference import StaticDecoder, stream_transformers

    model = make_model(residual="attnres_block").eval()
    ids = random_ids(2, 4)
    for call in (lambda: generate(ids, model, max_new_tokens=2), lambda: stream(ids, model, max_new_tokens=2),
                 lambda: prefill(ids, model)):
        with pytest.raises(ValueError, match=r"takes the model first, got a Tensor there: call it as "
                                             r"\(model, input_ids, \.\.\.\)$"):
            call()
    logits, cache = prefill(model, ids)
    with pytest.raises(ValueError, match=r"decode_step takes the model first, got a KVCache there: call it as "
                                         r"decode_step\(model, cache, tokens\)$"):
        decode_step(cache, model, ids[:, 0])
    with pytest.raises(ValueError, match=r"StaticDecoder takes the model first, got a Tensor there"):
        StaticDecoder(ids, 2, 8, mode="eager")
    with pytest.raises(ValueError, match=r"stream_transformers takes a transformers causal LM first \(model, "
                                         r"input_ids, \.\.\.\), got Tensor$"):
        stream_transformers(ids, model, max_new_tokens=2)
    assert cache.seq_len == 4  # the refused step wrote nothing


def test_stream_transformers_of_attnres_s_own_model_names_stream():
    """``stream_transformers(model, ...)`` of an ``AttnResLM`` (the model ``load_run`` gives, with
    ``stream``'s arguments) failed inside its first forward with "AttnResLM.forward() got an
    unexpected keyword argument 'use_cache'"; it is refused by name, naming ``stream`` /
    ``generate`` (which give its tokens) and the export, compiled or not."""
    from attnres.inference import stream_transformers

    model = make_model(residual="attnres_block").eval()
    for given in (model, torch.compile(model)):
        with pytest.raises(ValueError, match=r"got attnres's own model \(an AttnResLM\): decode it with stream or "
                                             r"generate \(same arguments\), or export it, "
                                             r"AttnResForCausalLM.from_native\(model\)$"):
            stream_transformers(given, random_ids(2, 4), max_new_tokens=2)


def test_a_cache_read_or_cropped_at_a_position_it_does_not_have_is_refused_by_name():
    """``cache.crop(2.5)`` was taken as the cache's length (every later forward read it),
    ``cache.keys(5)`` of a 2-layer cache failed with "list index out of range", ``keys(-1)``
    read the last layer, a layer not filled yet "'NoneType' object is not subscriptable"."""
    model = make_model(residual="attnres_block").eval()
    with pytest.raises(ValueError, match=r"^layer 0 holds nothing yet: the cache is filled by a forward \(prefill\)$"):
        KVCache(model.config.n_layers).keys(0)
    logits, cache = prefill(model, random_ids(2, 5))
    for bad in (5, -1, 2.0, True):
        for read in (cache.keys, cache.values):
            with pytest.raises(ValueError, match=rf"^layer must be an integer in \[0, 2\) \(the cache's n_layers\), "
                                                 rf"got {re.escape(repr(bad))}$"):
                read(bad)
    for bad in (2.5, -1, 6, True):
        with pytest.raises(ValueError, match=rf"^seq_len must be an integer in \[0, 5\], got {re.escape(repr(bad))}$"):
            cache.crop(bad)
    assert cache.seq_len == 5 and cache.keys(1).shape[2] == 5
    cache.crop(3)
    assert cache.seq_len == 3 and cache.values(0).shape[2] == 3


def test_one_prompts_ids_without_a_batch_dimension_are_told_how_to_add_it():
    """newuser13: ``generate(model, torch.tensor(tokenizer.encode(text)))`` - one prompt's ids,
    as the tokenizer gives them - was refused with "input_ids must have shape [batch, seq_len],
    got (3,)" (and the list itself with "must be a tensor, got list"), which leaves the reader to
    find the batch dimension. ``generate``, ``stream``, the model's forward and
    ``stream_transformers`` now say how to make a batch of one; a list of rows is told
    ``torch.tensor(ids)`` and left padding."""
    from attnres.inference import stream_transformers

    model = make_model(residual="attnres_block").eval()
    ids = [5, 17, 42]
    one = r"one prompt's ids are a batch of one, "
    for call in (lambda x: generate(model, x, max_new_tokens=2), lambda x: list(stream(model, x, max_new_tokens=2)),
                 model, lambda x: list(stream_transformers(_meta_parameter_model(), x, max_new_tokens=2))):
        with pytest.raises(ValueError, match=one + re.escape("input_ids[None] ([1, seq_len])")):
            call(torch.tensor(ids))
    for call in (lambda x: generate(model, x, max_new_tokens=2), model):
        with pytest.raises(ValueError, match=r"input_ids must be a tensor, got list: " + one +
                                             re.escape("torch.tensor([ids]) ([1, seq_len])")):
            call(ids)
        with pytest.raises(ValueError, match=re.escape("torch.tensor(ids), each row the same length (left-pad")):
            call([ids, ids[:2]])
    # the fixes it names run: a batch of one gives the tokens of the same prompt in a batch
    assert torch.equal(generate(model, torch.tensor(ids)[None], max_new_tokens=2),
                       generate(model, torch.tensor([ids]), max_new_tokens=2))


def test_an_id_outside_the_vocabulary_names_input_ids_and_the_tokenizer():
    """newuser13: ids of another tokenizer (a larger vocabulary than the model's) were refused
    with "token id 300 is outside the vocabulary [0, 256)", naming neither the argument nor
    the usual cause; ``generate``, the forward and ``stream_transformers`` name ``input_ids``
    and the model's own tokenizer."""
    from attnres.hf import AttnResForCausalLM
    from attnres.inference import stream_transformers

    model = make_model(residual="attnres_block").eval()
    vocab = model.config.vocab_size
    ids = torch.tensor([[5, vocab + 44]])
    message = (rf"input_ids: token id {vocab + 44} is outside the vocabulary \[0, {vocab}\) of the model \(vocab_size\): "
               r"encode the text with the tokenizer the model was trained with")
    for call in (lambda x: generate(model, x, max_new_tokens=2), model,
                 lambda x: list(stream_transformers(AttnResForCausalLM.from_native(model).eval(), x, max_new_tokens=2))):
        with pytest.raises(ValueError, match=message):
            call(ids)


def test_a_cache_capacity_beyond_the_context_is_refused():
    """newuser13: ``prefill(model, ids, capacity=10**6)`` allocated a cache of a million
    positions for a model of a 128-token context, which no generation can fill (the static
    cache, ``StaticKVCache``, refuses such a capacity); refused alike, naming the limit. The
    context itself is a capacity that works."""
    model = make_model(residual="attnres_block").eval()
    limit = model.config.max_seq_len
    ids = torch.tensor([[5, 17, 42]])
    with pytest.raises(ValueError, match=rf"capacity must be <= ModelConfig.max_seq_len={limit}, the most positions a "
                                         rf"generation fills; got {limit + 1}"):
        prefill(model, ids, capacity=limit + 1)
    _, cache = prefill(model, ids, capacity=limit)
    assert cache.seq_len == 3
