"""Hugging Face integration (attnres.hf): lossless conversion, cached generation, Auto
classes after ``import attnres.hf`` (and no import hook from ``import attnres``), eager vs
sdpa attention, activation checkpointing,
tokenizer export, and ``attnres eval`` with lm-evaluation-harness on local tasks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from attnres import AttnResLM, ModelConfig  # noqa: E402
from attnres.cli import main as cli_main  # noqa: E402
from attnres.data.tokenizer import ByteTokenizer, train_bpe  # noqa: E402
from attnres.hf import AttnResConfig, AttnResForCausalLM, AttnResModel, make_hf_tokenizer  # noqa: E402
from attnres.inference import generate  # noqa: E402
from conftest import activation_checkpointing  # noqa: E402
from warning_checks import warned  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")
#: generate's name for a cache of the caller's (transformers 5.24 renamed ``past_key_values``).
CACHE_ARG = "cache" if hasattr(CausalLMOutputWithPast, "cache") else "past_key_values"


pytestmark = pytest.mark.usefixtures("one_thread")


def native_model(seed: int = 0, **overrides) -> AttnResLM:
    """A tiny native model whose AttnRes queries are not zero (so depth mixing matters)."""
    torch.manual_seed(seed)
    model = AttnResLM(ModelConfig.preset("tiny", **overrides)).eval()
    with torch.no_grad():
        for p in model.residual.parameters():
            p.normal_(std=0.5)
    return model


def test_from_native_takes_a_compiled_model():
    """``AttnResForCausalLM.from_native(torch.compile(model))`` - a notebook's model is often
    the compiled one - was refused as "from_native takes an AttnResLM, got OptimizedModule",
    where generate and the checkpoints take it: it copies the compiled model's original."""
    native, ids = native_model(), torch.randint(0, 256, (2, 8))
    hf = AttnResForCausalLM.from_native(torch.compile(native)).eval()
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, native(ids).logits)


@pytest.mark.parametrize("overrides", [dict(residual="attnres_block"), dict(residual="attnres_full", tie_embeddings=True),
                                       dict(residual="standard")])
def test_native_hf_native_round_trip_is_exact(overrides):
    native = native_model(**overrides)
    hf = AttnResForCausalLM.from_native(native).eval()
    assert set(hf.state_dict()) == set(native.state_dict())
    ids = torch.randint(0, native.config.vocab_size, (2, 16))
    with torch.no_grad():
        ref = native(ids, labels=ids)
        out = hf(ids, labels=ids, use_cache=False)
        back = hf.to_native()(ids).logits
    assert torch.equal(out.logits, ref.logits) and torch.equal(back, ref.logits)
    assert torch.allclose(out.loss, ref.loss)
    base = AttnResModel(hf.config)
    base.load_state_dict({k: v for k, v in hf.state_dict().items() if not k.startswith("lm_head")})
    with torch.no_grad():
        assert torch.allclose(hf.lm_head(base(ids).last_hidden_state), ref.logits, atol=1e-6)


def test_fresh_model_keeps_zero_queries_and_native_init():
    hf = AttnResForCausalLM(AttnResConfig.from_model_config(ModelConfig.preset("tiny")))
    queries = [p for n, p in hf.named_parameters() if n.endswith(".query")]
    assert queries and all(bool((q == 0).all()) for q in queries)
    assert all(bool((p == 1).all()) for n, p in hf.named_parameters() if n.endswith("key_norm.weight"))
    assert abs(float(hf.embed_tokens.weight.detach().std()) - 0.02) < 0.005


def test_config_rejects_bad_fields_and_mirrors_model_config():
    with pytest.raises(ValueError, match="residual"):
        AttnResConfig(residual="nope")
    cfg = ModelConfig.preset("tiny", residual="attnres_full")
    assert AttnResConfig.from_model_config(cfg).to_model_config() == cfg
    # what PretrainedConfig keeps as an extra attribute while the model takes the default
    with pytest.raises(ValueError, match="unknown field 'd_modle' - did you mean 'd_model'"):
        AttnResConfig(d_modle=64)
    with pytest.raises(ValueError, match="hidden_size=64 .* contradicts d_model=128"):
        AttnResConfig(hidden_size=64, d_model=128)
    # a Llama config's names (was: kept aside, the model built with ModelConfig's defaults instead)
    with pytest.raises(ValueError, match="unknown field 'num_hidden_layer' - did you mean 'num_hidden_layers'"):
        AttnResConfig(num_hidden_layer=2)
    for hf_name, field in (("intermediate_size", "mlp_hidden"), ("rms_norm_eps", "norm_eps")):
        with pytest.raises(ValueError, match=rf"{hf_name} is the transformers name of {field}, .*: set {field}=7"):
            AttnResConfig(**{hf_name: 7})
    assert AttnResConfig(hidden_size=64).d_model == 64  # HF names alone, and HF's own keys, still go
    assert AttnResConfig(sep_token_id=3, architectures=["AttnResForCausalLM"], num_labels=2).d_model == 512


@pytest.mark.parametrize("option, value, does", [
    ("head_dim", 8, "its heads are d_model // n_heads: 16"),
    ("rope_parameters", {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, "its RoPE is unscaled"),
    ("rope_scaling", {"rope_type": "linear", "factor": 4.0}, "its RoPE is unscaled, of base rope_theta=10000.0: None"),
    ("hidden_act", "gelu", "its MLP is SwiGLU: 'silu'"),
    ("attention_bias", True, "no bias"),
    ("mlp_bias", True, "no bias"),
    ("attention_dropout", 0.1, "no dropout"),
    ("sliding_window", 8, "its attention is global"),
])
def test_config_refuses_an_option_the_decoder_does_not_have(option, value, does):
    """A transformers option the native decoder does not have (a Llama config's ``head_dim``,
    ``rope_parameters`` with a scaling, ``attention_dropout`` for fine-tuning, ...) was kept as
    an extra attribute and the model built without it: heads of ``d_model // n_heads``,
    unscaled RoPE, no dropout, without a word. Refused, naming what the decoder does; the
    value it matches (a Llama config's default) still goes, and builds the same model."""
    fields = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
    with pytest.raises(ValueError, match=rf"AttnResConfig: {option}=.* is an option the AttnRes decoder does not have \(.*{re.escape(does)}"):
        AttnResConfig(**fields, **{option: value})
    matching = {"head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_scaling": None,
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
                "sliding_window": None}[option]
    assert AttnResConfig(**fields, **{option: matching}).to_model_config() == AttnResConfig(**fields).to_model_config()


def test_an_attnres_config_built_in_python_warns_of_a_field_its_variant_does_not_read_once(tmp_path):
    """``AttnResConfig(residual={"kind": "attnres_full", "block_size": 4})`` built in Python
    said nothing, where the same ``ModelConfig(...)`` warns. It warns once, as it is built;
    saved and loaded again (config.json, a stored config) or made from a native config
    (``from_model_config``, which was warned of when built) it says nothing."""
    def unread(call) -> list[str]:
        return warned(call, " is read only by ")

    made = []
    said = unread(lambda: made.append(AttnResConfig(residual={"kind": "attnres_full", "block_size": 4})))
    assert len(said) == 1 and said[0].startswith("model.residual.block_size=4 is read only by attnres_block")
    made[0].save_pretrained(tmp_path)
    assert unread(lambda: AttnResConfig.from_pretrained(tmp_path)) == []
    assert unread(lambda: AttnResConfig.from_model_config(made[0].to_model_config())) == []
    assert unread(lambda: AttnResConfig(residual={"kind": "attnres_block", "block_size": 4})) == []


def test_a_single_block_is_warned_of_once_where_the_hf_config_is_stated(tmp_path):
    """Block AttnRes' single block (block_size=4 of 2 layers: 4 sublayers) is warned of once per
    statement on the native paths; the Hugging Face ones built a new ResidualConfig at each
    ``to_model_config()``, which the mark of the statement did not cover: ``AttnResConfig(...)``
    then ``AutoModelForCausalLM.from_config(config)`` warned twice (two lines, both shown by
    Python's default filter), ``from_model_config(native)`` after the native config again,
    ``from_pretrained(dir)`` twice. Once each, where it is stated. A block size changed after
    the config was built is another statement, warned of; the mark is no field (config.json,
    ``==``)."""
    from transformers import AutoModelForCausalLM

    def single(call) -> list[str]:
        return warned(call, "single block")

    fields = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
    made = []
    assert len(single(lambda: made.append(AttnResConfig(**fields, residual={"block_size": 4})))) == 1
    config = made[0]
    assert single(lambda: made.append(AutoModelForCausalLM.from_config(config))) == []
    assert single(config.to_model_config) == []
    assert len(single(lambda: made.append(ModelConfig(**fields, residual={"block_size": 4})))) == 1
    native = made[-1]
    assert single(lambda: made.append(AttnResConfig.from_model_config(native))) == []
    assert single(lambda: AttnResForCausalLM(made[-1])) == []
    made[1].save_pretrained(tmp_path)
    assert "_said" not in (tmp_path / "config.json").read_text()  # (the slot, and the marks it holds)
    assert len(single(lambda: AutoModelForCausalLM.from_pretrained(tmp_path))) == 1
    config.residual["block_size"] = 8
    assert len(single(lambda: AutoModelForCausalLM.from_config(config))) == 1
    other = AttnResConfig(**fields, residual={"block_size": 2})  # (no single block said)
    other.residual["block_size"] = 8
    assert len(single(lambda: made.append(AttnResConfig(**fields, residual={"block_size": 8})))) == 1
    assert other == made[-1]
    native.residual.block_size = 8
    assert len(single(lambda: AttnResConfig.from_model_config(native))) == 1


def test_a_single_block_hf_config_read_back_in_python_is_not_warned_of_again(tmp_path):
    """``AttnResConfig(**config.to_dict())`` of a single block (block_size=4 of 2 layers) repeated
    the warning that stating ``config`` gave, as ``ModelConfig(**native.to_dict())`` no longer
    does: a config read back in Python is quiet, and so are the models built of it, while
    ``from_pretrained(dir)`` (from_dict, a config.json) still says it once and a residual
    stated anew, or a block size changed after the read-back, is warned of."""
    from transformers import AutoModelForCausalLM

    def single(call) -> int:
        return len(warned(call, "single block"))

    fields = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
    made = []
    assert single(lambda: made.append(AttnResConfig(**fields, residual={"block_size": 4}))) == 1
    config = made[0]
    assert single(lambda: made.append(AttnResConfig(**config.to_dict()))) == 0
    assert single(lambda: AttnResConfig(**config.to_diff_dict())) == 0
    again = made[-1]
    assert again.residual == config.residual
    assert single(lambda: AutoModelForCausalLM.from_config(again)) == 0
    config.save_pretrained(tmp_path)
    assert single(lambda: AttnResConfig.from_pretrained(tmp_path)) == 1
    assert single(lambda: AttnResConfig(**{**config.to_dict(), "residual": {"block_size": 4}})) == 1
    again.residual["block_size"] = 8
    assert single(again.to_model_config) == 1


def test_a_residual_field_changed_on_an_hf_config_is_warned_of_once_as_its_single_block_is(tmp_path):
    """``config.residual["block_size"] = 4`` on a Full AttnRes ``AttnResConfig``, then a model of
    it: to_model_config() read the config quietly, so the model was built as if S were not
    there without a word, where the same change to a single block was warned of (and
    ``dataclasses.replace`` of a native config warns of both). Warned of once, at the change;
    an unchanged config, a stored one and a config read back say nothing."""
    from transformers import AutoModelForCausalLM

    def unread(call) -> list[str]:
        return warned(call, " is read only by ")

    config = AttnResConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, residual="attnres_full")
    assert unread(lambda: AutoModelForCausalLM.from_config(config)) == []
    config.residual["block_size"] = 4
    said = unread(lambda: AutoModelForCausalLM.from_config(config))
    assert len(said) == 1 and said[0].startswith("model.residual.block_size=4 is read only by attnres_block"), said
    assert unread(config.to_model_config) == []
    config.save_pretrained(tmp_path)
    assert unread(lambda: AttnResConfig.from_pretrained(tmp_path).to_model_config()) == []
    assert unread(lambda: AttnResConfig(**config.to_dict()).to_model_config()) == []


@pytest.mark.parametrize("kind", ["standard", "attnres_full"])
def test_an_attnres_config_of_a_config_read_back_does_not_warn_of_the_presets_block_size(kind):
    """``AttnResConfig(**config.to_dict())`` of ``ModelConfig.preset("tiny", residual=kind)`` (and of
    the AttnResConfig made of it) warned of the preset's own block size, a field the user never
    wrote: the residual, completed with every field, was checked as the user's. What the user
    gives is what it was given, before it is completed; a mapping of every field is a config
    read back. The user's own block size still warns."""
    def unread(call) -> list[str]:
        return warned(call, " is read only by ")

    native = ModelConfig.preset("tiny", residual=kind)
    made = []
    assert unread(lambda: made.append(AttnResConfig(**native.to_dict()))) == []
    assert unread(lambda: AttnResConfig(**made[0].to_dict())) == []
    said = unread(lambda: AttnResConfig(**{**native.to_dict(), "residual": {"kind": kind, "block_size": 3}}))
    assert len(said) == 1 and said[0].startswith("model.residual.block_size=3 is read only by attnres_block"), said


def test_a_residual_field_given_to_from_pretrained_that_its_variant_does_not_read_is_warned_of_once(tmp_path):
    """``from_pretrained(dir, residual={"block_size": 8})`` of a Full AttnRes export: the stored
    config.json is read quietly, and the block size the user gave with it was read quietly too -
    loaded as if it were not there, without a word. Warned of once (the config class's, the Auto
    model's); without the kwarg, or with a kind that reads it, nothing is said."""
    from transformers import AutoModelForCausalLM

    AttnResForCausalLM.from_native(native_model(residual="attnres_full")).save_pretrained(tmp_path)
    said = warned(lambda: AttnResConfig.from_pretrained(tmp_path, residual={"block_size": 8}), " is read only by ")
    assert len(said) == 1 and said[0].startswith("model.residual.block_size=8 is read only by attnres_block"), said
    assert len(warned(lambda: AutoModelForCausalLM.from_pretrained(tmp_path, residual={"block_size": 8}),
                      " is read only by ")) == 1
    assert warned(lambda: AttnResConfig.from_pretrained(tmp_path), " is read only by ") == []
    assert warned(lambda: AttnResConfig.from_pretrained(tmp_path, residual={"kind": "attnres_block", "block_size": 2}),
                  " is read only by ") == []


def test_cache_is_accepted_under_both_names():
    """transformers 5.24 renamed the cache argument ``past_key_values`` to ``cache``: a decode
    step continues the same cache under either name, and both at once is refused."""
    from transformers.cache_utils import DynamicCache

    from attnres.hf.modeling import _cache_field

    hf = AttnResForCausalLM.from_native(native_model(residual="attnres_block")).eval()
    ids = torch.randint(0, hf.config.vocab_size, (1, 7))
    full = hf(ids, use_cache=False).logits[:, -1]
    for name in ("cache", "past_key_values"):
        prefix = hf(ids[:, :6], use_cache=True, **{name: DynamicCache(config=hf.config)})
        cache = getattr(prefix, next(iter(_cache_field(type(prefix), None))))
        assert cache.get_seq_length() == 6
        step = hf(ids[:, 6:], use_cache=True, **{name: cache}).logits[:, -1]
        torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        hf(ids, use_cache=True, cache=DynamicCache(config=hf.config), past_key_values=DynamicCache(config=hf.config))


def test_generate_with_cache_equals_native_greedy():
    native = native_model(residual="attnres_block")
    hf = AttnResForCausalLM.from_native(native).eval()
    ids = torch.randint(0, native.config.vocab_size, (2, 9))
    ref = generate(native, ids, max_new_tokens=12)
    out = hf.generate(ids, max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(out[:, 9:], ref)
    # Left-padded batch: the mask reaches the native attention and RoPE positions.
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ref = generate(native, ids, mask, max_new_tokens=8)
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(out[:, 9:], ref)


def test_generation_modes_that_edit_the_cache_give_their_reference_tokens():
    """Beam search reorders the cache, assisted generation and prompt lookup crop it back to
    the accepted tokens, and a cache handed from one ``generate`` to the next continues it:
    each gives the tokens of its reference - beam search without a cache, greedy decoding in
    one call."""
    hf = AttnResForCausalLM.from_native(native_model(residual="attnres_block")).eval()
    ids = torch.randint(0, hf.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([ids, ids[:, :6]], 1)  # a repeat for prompt lookup to find
    kw = dict(max_new_tokens=8, do_sample=False)
    greedy = hf.generate(ids, **kw)
    assert torch.equal(hf.generate(ids, num_beams=3, **kw), hf.generate(ids, num_beams=3, use_cache=False, **kw))
    assert torch.equal(hf.generate(ids, prompt_lookup_num_tokens=3, **kw), greedy)
    assert torch.equal(hf.generate(ids, assistant_model=AttnResForCausalLM.from_native(native_model(seed=1)).eval(), **kw),
                       greedy)
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    first = hf.generate(ids, max_new_tokens=3, do_sample=False, **{CACHE_ARG: cache})
    assert torch.equal(hf.generate(first, max_new_tokens=5, do_sample=False, **{CACHE_ARG: cache}), greedy)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
def test_inputs_embeds_are_taken_as_the_embedding_of_input_ids(cache_implementation):
    """``inputs_embeds`` (a soft prompt; PEFT's prompt tuning, multimodal models) was refused
    ("AttnRes models take input_ids"). The forward takes them as the ids' embedding, the same
    logits and loss bit for bit; ``generate(inputs_embeds=...)`` gives the new tokens of
    ``generate(input_ids)``, left padding and a static cache included."""
    native = native_model(residual="attnres_block")
    hf = AttnResForCausalLM.from_native(native).eval()
    ids = torch.randint(1, native.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    embeds = hf.get_input_embeddings()(ids).detach()
    with torch.no_grad():
        by_ids, by_vectors = hf(ids, labels=ids, use_cache=False), hf(inputs_embeds=embeds, labels=ids, use_cache=False)
    assert torch.equal(by_vectors.logits, by_ids.logits) and torch.equal(by_vectors.loss, by_ids.loss)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    common = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                  cache_implementation=cache_implementation)
    want = hf.generate(ids, **common)[:, ids.shape[1]:]
    got = hf.generate(inputs_embeds=embeds, **common)
    assert torch.equal(got[:, -6:], want) and torch.equal(want, generate(native, ids, mask, max_new_tokens=6))
    with pytest.raises(ValueError, match="pass exactly one of input_ids"):
        hf(ids, inputs_embeds=embeds)
    with pytest.raises(ValueError, match=r"inputs_embeds must have shape \[batch, seq_len, d_model=64\]"):
        hf(inputs_embeds=embeds[..., :8])


def test_generate_past_the_context_is_refused_before_any_compute():
    """``max_new_tokens`` past ``max_seq_len``: over a dynamic cache the forward refused the
    token past the context at the end of the work ("cached length 128 + 1 new tokens
    exceeds"); over a static cache of that size at the prefill - and transformers kept the
    size for later calls, so every later static ``generate`` was refused too. Both are now
    refused at the call, naming the most ``max_new_tokens`` that fits (or, for a prompt longer
    than the context, the longest prompt that fits with the ``max_new_tokens`` asked: it named
    ``max_seq_len``, too long by ``max_new_tokens - 1``), a prompt of ``inputs_embeds`` too;
    what fits (the prompt at the limit with one new token, on either cache) generates the
    native tokens."""
    native = native_model(residual="attnres_block")
    hf = AttnResForCausalLM.from_native(native).eval()
    limit = native.config.max_seq_len
    ids = torch.randint(0, native.config.vocab_size, (1, 20))
    full = torch.randint(0, native.config.vocab_size, (1, limit))
    greedy = dict(do_sample=False, pad_token_id=0)
    for cache in ("dynamic", "static"):
        with pytest.raises(ValueError, match=rf"the prompt \(20 tokens\) with max_new_tokens=200 needs a context of 219 "
                                             rf".*max_seq_len={limit}: use max_new_tokens={limit - 19} or less"):
            hf.generate(ids, max_new_tokens=200, cache_implementation=cache, **greedy)
        with pytest.raises(ValueError, match=rf"max_length=300 needs .*: use max_length={limit + 1} or less"):
            hf.generate(input_ids=ids, max_length=300, cache_implementation=cache, **greedy)
        with pytest.raises(ValueError, match=rf"the prompt \(20 tokens\) with max_new_tokens=200 .*: use max_new_tokens="
                                             rf"{limit - 19} or less"):  # (was: refused after the work, or at the prefill)
            hf.generate(inputs_embeds=hf.embed_tokens(ids).detach(), max_new_tokens=200, cache_implementation=cache, **greedy)
        long = torch.randint(0, native.config.vocab_size, (1, limit + 10))  # the prompt alone is too long
        for given, fix in ((dict(max_new_tokens=5), f"a prompt of at most {limit - 4} tokens"),  # (was: {limit})
                           (dict(max_new_tokens=limit + 5), f"a prompt and max_new_tokens that add up to at most {limit + 1}"),
                           (dict(max_length=limit + 20), f"a prompt of at most {limit} tokens and max_length={limit + 1}"),
                           (dict(max_new_tokens=limit), "a prompt of at most 1 token$")):  # (was: "1 tokens")
            with pytest.raises(ValueError, match=rf"the prompt \({limit + 10} tokens\) .*: use {fix}"):
                hf.generate(long, cache_implementation=cache, **given, **greedy)
        with pytest.raises(ValueError, match=rf"the prompt \(1 token\) with max_new_tokens={limit + 5} "):
            hf.generate(ids[:, :1], max_new_tokens=limit + 5, cache_implementation=cache, **greedy)
        out = hf.generate(ids, max_new_tokens=limit - 19, cache_implementation=cache, **greedy)[:, 20:]
        if cache == "static":  # a cache of the caller's, too large (was: "lower max_new_tokens", which it ignores)
            from transformers import StaticCache

            with pytest.raises(ValueError, match=rf"holds {2 * limit} from 0: make it with max_cache_len={limit} or less"):
                hf.generate(ids, max_new_tokens=2, **{CACHE_ARG: StaticCache(config=hf.config, max_cache_len=2 * limit)},
                            **greedy)
        assert torch.equal(out, generate(native, ids, max_new_tokens=limit - 19))
        out = hf.generate(full, max_new_tokens=1, cache_implementation=cache, **greedy)[:, limit:]
        assert torch.equal(out, generate(native, full, max_new_tokens=1))


def test_native_decoding_refuses_a_transformers_model():
    """``attnres.inference.generate`` of an ``AttnResForCausalLM`` ran: its forward takes
    ``kv_cache`` into ``**kwargs`` and ignores it, so every decode step saw its one new token
    without the prompt, and the tokens differed from the model's own from the second on,
    without a word (``StaticDecoder`` failed with "'NoneType' object is not subscriptable").
    They are refused, saying what to use; the converted model, also under ``torch.compile``,
    generates the native tokens."""
    from attnres.inference import StaticDecoder, prefill, stream

    native = native_model(residual="attnres_block")
    hf = AttnResForCausalLM.from_native(native).eval()
    ids = torch.randint(0, native.config.vocab_size, (1, 8))
    calls = (lambda: generate(hf, ids, max_new_tokens=4), lambda: stream(hf, ids, max_new_tokens=4),
             lambda: prefill(hf, ids), lambda: StaticDecoder(hf, 1, 16, mode="eager"))
    for call in calls:
        with pytest.raises(ValueError, match=r"runs attnres's own model \(an AttnResLM\), got AttnResForCausalLM: "
                                             r"convert an AttnResForCausalLM with .to_native\(\)"):
            call()
    want = hf.generate(ids, max_new_tokens=6, do_sample=False)[:, 8:]
    assert torch.equal(generate(hf.to_native(), ids, max_new_tokens=6), want)
    # (under torch.compile: the prefill and a cached decode step are what the check lets through; each
    # further step's new cache length made Dynamo trace again, 5.1 CPU-s for 6 tokens against 1.8 for 2)
    assert torch.equal(generate(torch.compile(native, backend="eager"), ids, max_new_tokens=2), want[:, :2])


def test_stream_transformers_validates_before_running():
    """``stream_transformers`` checked only the sampling: a prompt past the context ran up
    to the model's "cached length 128 + 1 new tokens exceeds" after the work, a
    ``pad_token_id`` of -1 was fed back to the model once a row had stopped, and a single
    stop id failed as "'int' object is not iterable". They are refused at the call, as
    :func:`attnres.inference.stream` refuses them, naming the parameter; an ``attention_mask``
    too (its shape, 0/1, left padding, its device)."""
    from attnres.inference import stream_transformers

    native = native_model(residual="attnres_block")
    hf = AttnResForCausalLM.from_native(native).eval()
    ids = torch.randint(0, native.config.vocab_size, (2, 20))
    for kwargs, message in ((dict(max_new_tokens=200), r"prompt length 20 \+ max_new_tokens 200 - 1 exceeds the model's "
                                                       r"context=128: use max_new_tokens <= 109"),
                            (dict(max_new_tokens=2, pad_token_id=-1), r"pad_token_id must be a token id .* in \[0, 256\)"),
                            (dict(max_new_tokens=2, stop_tokens=1), r"stop_tokens must be a list of token ids"),
                            (dict(max_new_tokens=2, stop_tokens=[256]), r"stop_tokens must be token ids")):
        with pytest.raises(ValueError, match=message):
            stream_transformers(hf, ids, **kwargs)
    with pytest.raises(ValueError, match=r"input_ids must be a non-empty tensor of shape \[batch, seq_len\], got \(20,\)"):
        stream_transformers(hf, ids[0], max_new_tokens=2)
    ones = torch.ones(2, 20, dtype=torch.long)
    for mask, message in ((ones[:, 1:], r"attention_mask must be a tensor of the shape of input_ids \(2, 20\), got "
                                        r"\(2, 19\)"),
                          (ones * 2, r"attention_mask must hold only 0 \(padding\) and 1 \(real token\)"),
                          (torch.cat([ones[:, 1:], ones[:, :1] * 0], dim=1), "attention_mask must be left-padded"),
                          (ones.to("meta"), r"attention_mask is on meta, the model on cpu: .*attention_mask.to\('cpu'\)")):
        with pytest.raises(ValueError, match=message):  # as stream checks it
            stream_transformers(hf, ids, mask, max_new_tokens=2)
    got = torch.stack(list(stream_transformers(hf, ids, max_new_tokens=109)), dim=1)
    assert torch.equal(got, generate(native, ids, max_new_tokens=109))


def test_stream_transformers_equals_the_native_stream():
    """``stream_transformers`` (what ``attnres generate`` runs for a transformers family's
    model) on the HF form of a native model: the native model's greedy tokens, and a
    seeded sampling that repeats itself."""
    from attnres.inference import stream_transformers

    native = native_model(residual="attnres_block")
    hf = AttnResForCausalLM.from_native(native).eval()
    ids = torch.randint(0, native.config.vocab_size, (2, 9))
    got = torch.stack(list(stream_transformers(hf, ids, max_new_tokens=8)), dim=1)
    assert torch.equal(got, generate(native, ids, max_new_tokens=8))
    draws = [torch.stack(list(stream_transformers(hf, ids, max_new_tokens=8, temperature=0.9, top_p=0.9,
                                                  generator=torch.Generator().manual_seed(3))), dim=1)
             for _ in range(2)]
    assert torch.equal(draws[0], draws[1]) and draws[0].shape == (2, 8)


def _upcycled_llama():
    """A tiny upcycled Llama (a transformers family's model with a Block AttnRes residual),
    its queries away from zero so that depth mixing matters."""
    from fixtures.tiny_families import tiny_model

    from attnres.upcycle import upcycle

    model = upcycle(tiny_model("llama"), "attnres_block", block_size=4).eval()
    with torch.no_grad():
        for mixer in model.residual.mixers:
            mixer.query.normal_(std=0.3)
    return model


@pytest.mark.parametrize("which", ["export", "upcycled"])
def test_stream_transformers_of_a_left_padded_batch_is_each_prompt_alone_and_transformers_generate(which):
    """``stream_transformers`` took no ``attention_mask``: prompts of different lengths could
    not share a batch (``attnres generate`` ran them one after the other). A left-padded batch
    (float32) now gives each prompt's greedy tokens alone and transformers' own
    ``generate(..., attention_mask=...)`` on the same batch, token for token; a stop token and
    a stop string end the rows they end alone (and the stop token where ``generate``'s
    ``eos_token_id`` ends them); sampled with a generator per row, each prompt's draws alone
    (one generator for the batch gave each row draws that depended on the others), an
    export's the draws of attnres's own model's batch."""
    from types import SimpleNamespace

    from attnres.cli.generate import left_padded
    from attnres.inference import stream, stream_transformers

    native = native_model(residual="attnres_block")
    model = AttnResForCausalLM.from_native(native).eval() if which == "export" else _upcycled_llama()
    draw = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=draw).tolist() for n in (3, 7, 5)]
    ids, mask = left_padded(prompts, "cpu")
    angle = SimpleNamespace(decode=lambda tokens: "".join(f"<{i:03d}>" for i in tokens))  # token i reads <iii>

    def batch(**kwargs):
        return torch.stack(list(stream_transformers(model, ids, mask, max_new_tokens=8, **kwargs)), dim=1).tolist()

    def alone(width=8, seed=None, **kwargs):  # each prompt by itself (seed: a generator each), padded with 5
        rows = [torch.cat(list(stream_transformers(model, torch.tensor([prompt]), max_new_tokens=8, **kwargs, **(
            {} if seed is None else dict(temperature=1.0, generator=torch.Generator().manual_seed(seed))))))
                for prompt in prompts]
        return [row.tolist() + [5] * (width - len(row)) for row in rows]

    free = batch()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert free == alone() == want[:, ids.shape[1]:].tolist()
    k = next(k for k in range(1, 6) if free[1][k] not in free[1][:k])
    stopped = batch(stop_tokens=[free[1][k]], pad_token_id=5)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=free[1][k],
                          pad_token_id=5)
    assert stopped == alone(len(stopped[0]), stop_tokens=[free[1][k]]) == want[:, ids.shape[1]:].tolist()
    assert stopped[1] == free[1][:k + 1] + [5] * (len(stopped[0]) - k - 1)
    k = next(k for k in range(1, 6) if free[0][k] not in free[0][:k])
    stopped = batch(stop_strings=[f"{free[0][k]:03d}"], tokenizer=angle, pad_token_id=5)
    assert stopped == alone(len(stopped[0]), stop_strings=[f"{free[0][k]:03d}"], tokenizer=angle)
    assert stopped[0] == free[0][:k + 1] + [5] * (len(stopped[0]) - k - 1)
    # sampled with a generator per row: each prompt's draws alone (and, an export, its native model's batch's)
    sampled = batch(temperature=1.0, generator=[torch.Generator().manual_seed(3) for _ in prompts])
    assert sampled == alone(seed=3)
    if which == "export":
        own = stream(native, ids, mask, max_new_tokens=8, temperature=1.0,
                     generator=[torch.Generator().manual_seed(3) for _ in prompts])
        assert sampled == torch.stack(list(own), dim=1).tolist()


def test_generate_takes_a_transformers_directory(tmp_path, capsys):
    """``attnres generate DIR`` for a saved transformers directory (an export, an upcycle):
    the native model's greedy tokens through the directory's own model and tokenizer, and
    an end-of-sequence id in its generation config ends the text there."""
    from transformers import AutoTokenizer

    native = native_model(residual="attnres_block")
    prompt = "the quick"
    want = generate(native, torch.tensor([list(prompt.encode())]), max_new_tokens=6)[0].tolist()
    stop_at = next(k for k in range(1, 6) if want[k] not in want[:k])  # the first step that makes this id
    for name, eos, n in (("plain", None, 6), ("with-eos", want[stop_at], stop_at + 1)):
        hf = AttnResForCausalLM.from_native(native)
        hf.generation_config.eos_token_id = eos
        hf.save_pretrained(tmp_path / name)
        make_hf_tokenizer(ByteTokenizer(), native.config.max_seq_len).save_pretrained(tmp_path / name)
        assert cli_main(["generate", str(tmp_path / name), "--prompt", prompt, "--max-new-tokens", "6",
                         "--temperature", "0", "--device", "cpu"]) == 0
        tok, shown, printed = AutoTokenizer.from_pretrained(tmp_path / name), "", ""
        for k in range(n):  # the command prints the text as it grows
            text = tok.decode(want[: k + 1], skip_special_tokens=True)
            printed, shown = printed + text[len(shown):], text
        out, err = capsys.readouterr()
        assert out == printed + "\n" and f"{n} tokens in" in err and "transformers decode" in err, name
    with pytest.raises(SystemExit, match="is a transformers directory, which decodes over its own cache"):
        cli_main(["generate", str(tmp_path / "plain"), "--prompt", prompt, "--decode", "static"])
    with pytest.raises(SystemExit, match="--tokenizer: a transformers directory generates with its own tokenizer"):
        cli_main(["generate", str(tmp_path / "plain"), "--prompt", prompt, "--tokenizer", "t.json"])



def test_generate_names_a_truncated_weights_file_of_a_transformers_directory(tmp_path):
    """A directory whose model.safetensors was cut short (a copy or an export that did not
    finish): one line naming the directory and the file, not safetensors' traceback."""
    hf = AttnResForCausalLM.from_native(native_model())
    hf.save_pretrained(tmp_path)
    make_hf_tokenizer(ByteTokenizer(), 128).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    for cut in (1000, weights.stat().st_size // 2):  # inside the header; inside the tensors
        weights.write_bytes(weights.read_bytes()[:cut])
        with pytest.raises(SystemExit, match=rf"'{tmp_path}': its weights cannot be read, the .safetensors file is "
                                             "truncated or corrupted"):
            cli_main(["generate", str(tmp_path), "--prompt", "the", "--max-new-tokens", "2", "--device", "cpu"])


def test_generate_names_a_directory_without_a_tokenizer(tmp_path):
    """A directory written by ``model.save_pretrained`` alone (an upcycle in Python, as the
    README shows it) holds no tokenizer: the command said transformers "Couldn't instantiate
    the backend tokenizer ... install sentencepiece or tiktoken"; it now says the directory
    holds none and how to save the model's own there."""
    AttnResForCausalLM.from_native(native_model()).save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match=rf"'{tmp_path}' holds no tokenizer \(no tokenizer.json or "
                                         rf"tokenizer_config.json\): save the model's own there: "
                                         rf"AutoTokenizer.from_pretrained\(ORIGINAL\).save_pretrained\('{tmp_path}'\)"):
        cli_main(["generate", str(tmp_path), "--prompt", "the", "--max-new-tokens", "2", "--device", "cpu"])


def _edit_weights(directory: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("dropped", ["residual.mixers.1.query", "layers.1.mlp.down_proj.weight"])
def test_generate_refuses_a_transformers_directory_whose_weights_lack_tensors(tmp_path, dropped):
    """A hand-edited export without one pseudo-query (or one MLP weight) generated at a zero
    query (a random weight): another model than the one saved, under no more than
    transformers' load report. Refused naming the tensor, as the vLLM plugin refuses it."""
    AttnResForCausalLM.from_native(native_model(residual="attnres_block")).save_pretrained(tmp_path)
    make_hf_tokenizer(ByteTokenizer(), 128).save_pretrained(tmp_path)
    _edit_weights(tmp_path, lambda tensors: tensors.pop(dropped))
    with pytest.raises(SystemExit, match=re.escape(f"'{tmp_path}' lacks 1 weight(s) of the causal LM ({dropped})") +
                       ".*export or copy the directory again"):
        cli_main(["generate", str(tmp_path), "--prompt", "the", "--max-new-tokens", "2", "--device", "cpu"])


def test_generate_refuses_an_upcycled_directory_whose_model_type_drops_the_residual(tmp_path):
    """An upcycled Llama whose model_type says "llama" (docs/hf.md: the Auto classes build plain
    Llama) generated as plain Llama, the residual's tensors left unused under transformers'
    UNEXPECTED. Refused naming them and the model_type."""
    from fixtures.tiny_families import tiny_model

    from attnres.upcycle import upcycle

    upcycle(tiny_model("llama", vocab_size=256), "attnres_block", block_size=2).save_pretrained(tmp_path)
    make_hf_tokenizer(ByteTokenizer(), 128).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(SystemExit, match=re.escape(f"'{tmp_path}': its weights hold an AttnRes residual (residual.") +
                       r".* which the model its config\.json describes \(LlamaForCausalLM, model_type 'llama'\) has no "
                       "place for"):
        cli_main(["generate", str(tmp_path), "--prompt", "the", "--max-new-tokens", "2", "--device", "cpu"])


def test_a_plain_directory_saved_with_a_tied_head_under_an_untied_config_names_the_config_field(tmp_path):
    """A plain Llama whose head was tied to the embedding by hand and saved (save_pretrained keeps
    one copy of the shared tensor) under ``tie_word_embeddings: false``: refused for its missing
    head, which is right (transformers starts it at random), but told of a residual's
    pseudo-queries and attnres upcycle, none of them its own. Said: set tie_word_embeddings."""
    from fixtures.tiny_families import tiny_model

    llama = tiny_model("llama", vocab_size=256, tie_word_embeddings=False)
    llama.lm_head.weight = llama.model.embed_tokens.weight
    llama.save_pretrained(tmp_path)
    make_hf_tokenizer(ByteTokenizer(), 128).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as raised:
        cli_main(["generate", str(tmp_path), "--prompt", "the", "--max-new-tokens", "2", "--device", "cpu"])
    said = str(raised.value)
    assert f"'{tmp_path}' lacks 1 weight(s) of the causal LM (lm_head.weight)" in said, said
    assert 'set "tie_word_embeddings": true in its config.json' in said and "pseudo-queries" not in said, said


@pytest.mark.parametrize("on_disk", ["residual", ""])
def test_a_model_offloaded_by_accelerate_computes_the_same_logits(tmp_path, on_disk):
    """``device_map`` with the residual or the whole model (what ``"auto"`` does with a
    ``max_memory`` the model exceeds) offloaded to disk: accelerate's hooks load a module's
    weights for its forward, and the decoder loads the residual's, whose forward never runs
    (was: "the embedding is on cpu but this residual's parameters are on meta"). The same
    logits and greedy tokens as the model in memory."""
    hf = AttnResForCausalLM.from_native(native_model(residual="attnres_block")).eval()
    hf.save_pretrained(tmp_path / "hf")
    device_map = {"": "disk"} if on_disk == "" else {name: "disk" if name == on_disk else "cpu"
                                                     for name, _ in hf.named_children()}
    offloaded = AttnResForCausalLM.from_pretrained(tmp_path / "hf", device_map=device_map,
                                                   offload_folder=tmp_path / "offload").eval()
    assert offloaded.residual.mixers[0].query.device.type == "meta"
    ids = torch.randint(0, hf.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(offloaded(ids).logits, hf(ids).logits)
    for cache in ("dynamic", "static"):
        kw = dict(max_new_tokens=4, do_sample=False, cache_implementation=cache)
        assert torch.equal(offloaded.generate(ids, **kw), hf.generate(ids, **kw))
    assert offloaded.residual.mixers[0].query.device.type == "meta"  # offloaded again


def test_eager_attention_matches_sdpa():
    native = native_model(residual="attnres_block")
    hf = AttnResForCausalLM.from_native(native).eval()
    ids = torch.randint(0, native.config.vocab_size, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        sdpa = hf(ids, attention_mask=mask).logits
        hf.config._attn_implementation = "eager"
        eager = hf(ids, attention_mask=mask).logits
        eager_plain = hf(ids).logits
        hf.config._attn_implementation = "sdpa"
        sdpa_plain = hf(ids).logits
    assert torch.allclose(eager, sdpa, atol=1e-5) and torch.allclose(eager_plain, sdpa_plain, atol=1e-5)
    hf.config._attn_implementation = "eagr"
    with pytest.raises(ValueError, match=r"attn_implementation must be one of \('sdpa', 'eager'\); got 'eagr' "
                       r"\(did you mean 'eager'\?\)"):
        hf(ids)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(reentrant):
    """Also with ``use_reentrant=True``, a common fine-tuning recipe (was: a RuntimeError
    about a deferred sublayer input in the forward)."""
    native = native_model(residual="attnres_block")
    ids = torch.randint(0, native.config.vocab_size, (2, 16))
    grads = []
    for checkpointing in (False, True):
        hf = AttnResForCausalLM.from_native(native).train()
        if checkpointing:
            activation_checkpointing(hf, use_reentrant=reentrant)
            assert hf.gradient_checkpointing
            # transformers' own answer, under either of its names (the newer absent in 5.20)
            assert (hf.is_activation_checkpointing if hasattr(hf, "is_activation_checkpointing")
                    else hf.is_gradient_checkpointing)
            assert hf.defer_norm is not reentrant  # (the fused norm where autograd runs the sublayer)
        hf(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in hf.named_parameters()})
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-6), name
    activation_checkpointing(hf, enable=False)
    assert hf.defer_norm and "defer_norm" not in hf.__dict__


@pytest.mark.parametrize("reentrant", [False, True])
def test_generate_in_training_mode_with_activation_checkpointing(reentrant):
    """``generate`` right after training (the model still in training mode, activation
    checkpointing on, as ``Trainer`` leaves it) dropped the cache, which only a backward's
    recompute of a sublayer makes unsafe: each step then saw its last token alone and the
    continuation was another one, without a word. Without gradients the sublayers run as is,
    cache included, as transformers' layers do: the tokens of the model in eval mode; with
    gradients the cache is still dropped."""
    hf = AttnResForCausalLM.from_native(native_model(residual="attnres_block"))
    prompt = torch.randint(0, hf.config.vocab_size, (2, 5))
    expected = hf.eval().generate(prompt, max_new_tokens=6, do_sample=False)
    activation_checkpointing(hf, use_reentrant=reentrant)
    hf.train()
    torch.testing.assert_close(hf.generate(prompt, max_new_tokens=6, do_sample=False), expected, rtol=0, atol=0)
    out = hf(prompt, use_cache=True)  # with gradients: no cache under checkpointing ('past_key_values' before 5.24)
    assert getattr(out, "cache", getattr(out, "past_key_values", None)) is None
    activation_checkpointing(hf, enable=False)


def test_the_native_model_s_return_depth_weights_is_refused_not_dropped():
    """``hf(ids, return_depth_weights=True)`` - the keyword of the README's ``AttnResLM`` - went
    into the wrapper's ``**kwargs`` and was dropped: an output without ``depth_weights``, and not
    a word. It is refused, naming ``to_native()``; ``False`` is left alone."""
    hf = AttnResForCausalLM.from_native(native_model()).eval()
    ids = torch.randint(0, hf.config.vocab_size, (1, 8))
    for model in (hf, AttnResModel(hf.config)):
        with pytest.raises(ValueError, match=r"return_depth_weights=True is a keyword of attnres's own model "
                                             r"\(AttnResLM\).*model\.to_native\(\)\(input_ids, return_depth_weights=True\)"):
            model(ids, return_depth_weights=True)
    assert hf(ids, return_depth_weights=False).logits.shape == (1, 8, hf.config.vocab_size)
    assert len(hf.to_native()(ids, return_depth_weights=True).depth_weights) == 2 * hf.config.n_layers + 1


@pytest.mark.parametrize("name", ["output_hidden_states", "output_attentions"])
def test_per_layer_outputs_are_refused_not_dropped(name):
    """The native decoder records no per-layer hidden states or attention weights: asking for
    them is refused with the way out (was: ``hidden_states`` / ``attentions`` silently
    ``None``, a ``TypeError`` at the user's first index)."""
    hf = AttnResForCausalLM.from_native(native_model()).eval()
    ids = torch.randint(0, hf.config.vocab_size, (1, 8))
    for model in (hf, AttnResModel(hf.config)):
        with pytest.raises(ValueError, match=f"{name}=True: the native AttnRes decoder records no per-layer"):
            model(ids, **{name: True})
    hf.config.output_hidden_states = True  # (the config refuses output_attentions itself under sdpa)
    with pytest.raises(ValueError, match="output_hidden_states=True"):
        hf(ids)
    hf.config.output_hidden_states = False
    assert hf(ids, **{name: False}).logits.shape == (1, 8, hf.config.vocab_size)
    assert hf.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 10)


def test_return_dict_false_gives_a_tuple():
    """``return_dict=False`` (in the call, or ``config.return_dict``), which transformers'
    models and the upcycled families answer with a tuple, was swallowed: the output stayed a
    ``ModelOutput``, and ``loss, logits = model(..., return_dict=False)`` unpacked its keys,
    the strings ``'loss'`` and ``'logits'``. It is now ``(loss, logits, cache)`` /
    ``(last_hidden_state, cache)``, the ``None`` ones left out (the cache with ``use_cache=False``),
    the same tensors."""
    hf = AttnResForCausalLM.from_native(native_model()).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 8))
    with torch.no_grad():
        full = hf(ids, labels=ids)
        loss, logits = hf(ids, labels=ids, use_cache=False, return_dict=False)
        (hidden,) = AttnResModel(hf.config)(ids, use_cache=False, return_dict=False)
        cached = hf(ids, return_dict=False)
        hf.config.return_dict = False
        from_config = hf(ids, labels=ids)
    assert torch.equal(loss, full.loss) and torch.equal(logits, full.logits)
    assert isinstance(hidden, torch.Tensor) and hidden.shape == (2, 8, hf.config.d_model)
    assert len(cached) == 2 and cached[1].get_seq_length() == 8
    assert isinstance(from_config, tuple) and torch.equal(from_config[0], full.loss)


def test_labels_of_another_shape_are_refused_in_one_line():
    """Labels not of the input's shape ``[batch, seq_len]`` - 1-D, or already shifted by the
    user - stopped inside the loss with "too many indices for tensor of dimension 1" or
    cross-entropy's "Expected input batch_size (2) to match target batch_size (1)". Refused
    naming both shapes; labels of the input's shape give the loss as before."""
    hf = AttnResForCausalLM.from_native(native_model()).eval()
    ids = torch.randint(0, hf.config.vocab_size, (1, 8))
    for labels in (ids[0], ids[:, 1:], torch.cat([ids, ids], 1)):
        with pytest.raises(ValueError, match=rf"labels of shape {re.escape(str(list(labels.shape)))}: they must be \[batch, seq_len\] as "
                                             r"the input ids are, here \[1, 8\] \(not shifted"):
            hf(ids, labels=labels)
    with pytest.raises(ValueError, match=r"as the positions logits_to_keep keeps of the input ids are, here \[1, 1\]"):
        hf(ids, labels=ids, logits_to_keep=1)
    assert hf(ids, labels=ids).loss.ndim == 0


def test_labels_that_are_not_in_vocabulary_token_ids_are_refused_by_name():
    """Float labels were cast to ids without a word (``AttnResLM`` refuses them), and a label
    past the vocabulary, or negative other than -100, stopped in cross-entropy with "Target
    300 is out of bounds"; both name ``labels`` and what it takes, as ``AttnResLM`` does."""
    hf = AttnResForCausalLM.from_native(native_model()).eval()
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (2, 8))
    with pytest.raises(ValueError, match=r"^labels must be a tensor of token ids \(torch.long or torch.int32, -100 = "
                                         r"ignored\), got dtype torch.float32$"):
        hf(ids, labels=ids.float())
    for bad in (vocab, -5):
        labels = ids.clone()
        labels[0, 2] = bad
        with pytest.raises(ValueError, match=rf"^labels must be token ids in \[0, {vocab}\) or -100 \(ignored\); got {bad}$"):
            hf(ids, labels=labels)
        labels[0, 2] = -100
        assert torch.equal(hf(ids, labels=labels).loss, hf.to_native()(ids, labels=labels).loss)


def test_a_mask_the_model_would_drop_unread_is_refused_by_name():
    """A mask of ones and 2s, or of ones but another shape than the batch, was taken as 'no
    padding' and dropped without a word (``generate`` with it too); a value other than 0 and 1
    is refused naming ``attention_mask`` and the values it takes, a shape naming both, as
    ``AttnResLM`` refuses them. A mask of ones of the right shape is still dropped: the
    logits of no mask."""
    hf = AttnResForCausalLM.from_native(native_model()).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 8))
    twos = torch.ones(2, 8, dtype=torch.long)
    twos[0, 0] = 2
    values = r"^attention_mask must hold only 0 \(padding\) and 1 \(a real token\); got 2 "
    with pytest.raises(ValueError, match=values):
        hf(ids, attention_mask=twos)
    with pytest.raises(ValueError, match=values):
        hf.generate(ids, attention_mask=twos, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"^attention_mask must be a tensor of shape \[batch, past \+ seq_len\] = "
                                         r"\(2, 8\), got \(2, 5\)$"):
        hf(ids, attention_mask=torch.ones(2, 5, dtype=torch.long))
    assert torch.equal(hf(ids, attention_mask=torch.ones(2, 8, dtype=torch.long)).logits, hf(ids).logits)


def test_a_cpu_mask_s_values_are_read_once_a_forward(monkeypatch):
    """The wrapper read a CPU mask's values (``check_mask_values``), then the shared decoder
    read them again: each forward with padding scanned its mask twice. The decoder's check is
    the one left (one scan a forward; none for a mask of ones, dropped as no padding), and a
    bad value is still refused with its words, as ``AttnResLM`` refuses it."""
    import attnres.hf.modeling as modeling
    import attnres.models.trunk as trunk

    checked = []

    def counted(mask):
        checked.append(mask)
        return check(mask)

    check = trunk.check_mask_values
    monkeypatch.setattr(trunk, "check_mask_values", counted)
    monkeypatch.setattr(modeling, "check_mask_values", counted, raising=False)  # (the wrapper's own name of it)
    hf = AttnResForCausalLM.from_native(native_model()).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 8))
    padded = torch.ones(2, 8, dtype=torch.long)
    padded[0, :3] = 0
    assert torch.equal(hf(ids, attention_mask=padded).logits, hf.to_native()(ids, attention_mask=padded).logits)
    assert len(checked) == 2  # (one by the wrapper's forward, one by the native model's)
    checked.clear()
    hf(ids, attention_mask=torch.ones(2, 8, dtype=torch.long))
    assert checked == []
    twos = padded * 2
    with pytest.raises(ValueError) as wrapped:
        hf(ids, attention_mask=twos)
    with pytest.raises(ValueError) as native:
        hf.to_native()(ids, attention_mask=twos)
    assert str(wrapped.value) == str(native.value) and str(native.value).startswith("attention_mask must hold only 0")


def test_inputs_on_the_meta_device_are_refused_by_name_before_the_forward():
    """Token ids on the meta device (no values) next to a model on the CPU gave logits on meta
    without a word, a mask there "Tensor.item() cannot be called on meta tensors", labels there
    "Cannot copy out of meta tensor; no data!" after the whole forward. Each is refused naming
    the argument before anything runs, as ``AttnResLM`` refuses them; a model whose weights
    are on meta (shape inference, accelerate's offloading) still computes where they are."""
    hf = AttnResForCausalLM.from_native(native_model()).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 8))
    ran = []
    hf.embed_tokens.register_forward_pre_hook(lambda *a: ran.append(True))
    for name, call in (("input_ids", lambda: hf(ids.to("meta"))),
                       ("attention_mask", lambda: hf(ids, attention_mask=torch.ones(2, 8, device="meta"))),
                       ("labels", lambda: hf(ids, labels=ids.to("meta")))):
        with pytest.raises(ValueError, match=rf"^{name} is on meta, the model on cpu: move it there first, "
                                             rf"{name}.to\('cpu'\)"):
            call()
    assert not ran
    on_meta = AttnResForCausalLM.from_native(native_model()).to("meta")
    assert on_meta(ids.to("meta")).logits.shape == (2, 8, hf.config.vocab_size)


def test_from_native_of_a_config_says_how_to_build_the_model():
    """``AttnResForCausalLM.from_native(config)`` - the ModelConfig where the model goes -
    ended in "'ModelConfig' object has no attribute 'config'"; it names what it takes and
    how to build the model from a config."""
    from attnres.hf import AttnResConfig

    config = native_model().config
    with pytest.raises(TypeError, match=r"^from_native takes an AttnResLM, got ModelConfig: build the model from it, "
                                        r"AttnResForCausalLM\(AttnResConfig.from_model_config\(config\)\)$"):
        AttnResForCausalLM.from_native(config)
    assert AttnResForCausalLM(AttnResConfig.from_model_config(config)).config.d_model == config.d_model


@pytest.mark.parametrize("keep, got", [(-1, "-1"), (True, "True"), ("2", "'2'"), (2.5, "2.5"),
                                       (torch.tensor([[0, 1]]), "a 2-D torch.int64 tensor"),
                                       (torch.tensor([0.0, 1.0]), "a 1-D torch.float32 tensor")])
def test_a_logits_to_keep_that_keeps_other_positions_is_refused_by_name(keep, got):
    """``logits_to_keep=-1`` kept every position but the first without a word (the slice
    ``[1:]``), a 2-D tensor of indices gave 4-D logits, a string or float failed in indexing.
    Refused naming it and what it takes; 0, a count and a 1-D tensor of indices keep what they
    kept (the last positions, or the ones named)."""
    hf = AttnResForCausalLM.from_native(native_model()).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 8))
    with pytest.raises(ValueError, match=rf"^logits_to_keep must be an integer >= 0 \(the last positions; 0: all\) or a "
                                         rf"1-D tensor of position indices; got {re.escape(got)}$"):
        hf(ids, logits_to_keep=keep)
    logits = hf(ids).logits
    assert torch.equal(hf(ids, logits_to_keep=3).logits, logits[:, -3:])
    assert torch.equal(hf(ids, logits_to_keep=torch.tensor([0, 5])).logits, logits[:, [0, 5]])


def test_a_negative_item_count_or_a_legacy_cache_is_refused_by_name():
    """``num_items_in_batch=-3`` turned the loss's sign without a word; a legacy cache (a tuple
    or list of tensors, which transformers 5 no longer takes) failed with "'list' object has no
    attribute 'is_compileable'"."""
    hf = AttnResForCausalLM.from_native(native_model()).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 8))
    with pytest.raises(ValueError, match=r"^num_items_in_batch must be the number \(>= 0\) of predicted tokens in the "
                                         r"accumulated batches; got -3$"):
        hf(ids, labels=ids, num_items_in_batch=-3)
    with pytest.raises(ValueError, match=r"^past_key_values must be a transformers Cache \(DynamicCache, StaticCache, "
                                         r"or the one a forward returned\), got list$"):
        hf(ids, past_key_values=[], use_cache=True)
    # (transformers 5.24's name for it, which generate passes: the message named past_key_values, not given)
    with pytest.raises(ValueError, match=r"^cache must be a transformers Cache \(DynamicCache, StaticCache, or the one "
                                         r"a forward returned\), got tuple$"):
        hf(ids, cache=(), use_cache=True)
    summed = hf(ids, labels=ids, num_items_in_batch=14).loss
    torch.testing.assert_close(summed, hf(ids, labels=ids).loss)  # (14 predicted tokens: the mean)


def test_a_fully_masked_batch_gives_the_loss_transformers_gives():
    """Labels all -100 (an SFT batch whose every answer is masked): the loss is a mean over no
    tokens, NaN, with zero gradients, as transformers' Llama gives for the same labels; summed
    over the Trainer's num_items_in_batch, 0 (NaN for 0 items), as Llama's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ours = AttnResForCausalLM.from_native(native_model())
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=ours.config.vocab_size, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    ids = torch.randint(0, ours.config.vocab_size, (2, 6))
    masked = torch.full_like(ids, -100)
    for model in (ours, llama):
        loss = model(ids, labels=masked).loss
        loss.backward()
        assert loss.isnan(), type(model).__name__
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters() if p.grad is not None)
        assert model(ids, labels=masked, num_items_in_batch=5).loss.item() == 0.0
        assert model(ids, labels=masked, num_items_in_batch=torch.tensor(0)).loss.isnan()
        assert model(ids[:, :1], labels=ids[:, :1]).loss.isnan()  # one token a row: nothing to predict


def test_logits_to_keep_takes_a_count_or_the_positions_to_keep():
    """``logits_to_keep`` is, as in transformers' models, a count of last positions or a 1-D
    tensor of the positions to keep (was: a tensor stopped the forward with "Boolean value of
    Tensor with more than one value is ambiguous")."""
    hf = AttnResForCausalLM.from_native(native_model()).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 8))
    with torch.no_grad():
        full = hf(ids).logits
        last, picked = hf(ids, logits_to_keep=1).logits, hf(ids, logits_to_keep=torch.tensor([2, 5, 7])).logits
    torch.testing.assert_close(last, full[:, -1:])
    torch.testing.assert_close(picked, full[:, [2, 5, 7]])
    assert hf(ids, logits_to_keep=0).logits.shape == full.shape


def test_resized_embeddings_take_the_new_ids_at_once(tmp_path):
    """``resize_token_embeddings`` (adding tokens for fine-tuning) then a new id: accepted,
    and the same function as the native model of the resized config, also after a reload
    (was: 'token id 299 is outside the vocabulary [0, 256)' until saved and reloaded)."""
    from transformers import AutoModelForCausalLM

    hf = AttnResForCausalLM.from_native(native_model()).eval()
    hf.resize_token_embeddings(300, mean_resizing=False)
    ids = torch.tensor([[299, 1, 256, 7]])
    with torch.no_grad():
        logits = hf(ids).logits
        assert logits.shape == (1, 4, 300)
        assert torch.equal(hf.to_native()(ids).logits, logits)
    assert hf.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 6)
    hf.save_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path).eval()(ids).logits, logits)


def test_tokenizer_export_keeps_ids(tmp_path):
    from transformers import AutoTokenizer

    text = "the quick brown fox jumps over río café naïve\nsecond line"
    # The stand-ins of byte-level BPE for the line break and the tab, and text that looks special.
    special_looking = "a\nĊ\tĉ <|endoftext|> <s></s> <pad>\r\n"
    for tok in (ByteTokenizer(), train_bpe(text * 20, 300)):
        hf_tok = make_hf_tokenizer(tok)
        hf_tok.save_pretrained(tmp_path / tok.kind)
        loaded = AutoTokenizer.from_pretrained(tmp_path / tok.kind)
        for t in (text, special_looking):
            assert loaded(t, add_special_tokens=False)["input_ids"] == tok.encode(t)
            # skip_special_tokens=True is what vLLM decodes with: nothing is special, nothing is dropped.
            assert loaded.decode(tok.encode(t), skip_special_tokens=True) == t
        # No special tokens at all: no end-of-sequence token (training has none), no padding token.
        assert loaded.eos_token is None and loaded.pad_token is None and loaded.all_special_ids == []


def _fresh_process(script: str, *args, modules) -> subprocess.CompletedProcess:
    """``script`` in an interpreter that has not imported attnres (stdin closed: transformers'
    trust_remote_code question is answered at once), transformers' module cache in ``modules``."""
    env = {"PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HF_MODULES_CACHE": str(modules)}
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=180, stdin=subprocess.DEVNULL)


def test_a_saved_directory_loads_with_trust_remote_code_where_attnres_hf_was_not_imported(tmp_path):
    """A plain ``lm_eval --model hf`` command line, a notebook, a Hub download: the process never
    imported attnres.hf, and transformers said it "does not recognize this architecture". A
    saved directory (the native model, an upcycled dense and MoE family) now names its classes
    in config.json's auto_map, through a module file that imports them from the installed
    attnres: ``from_pretrained(DIR, trust_remote_code=True)`` gives the AttnRes model and its
    logits; without it transformers asks for it; without attnres installed it names the package;
    saved again, the model writes that module file only (not attnres's own sources)."""
    from attnres.upcycle import upcycle
    from fixtures.tiny_families import VOCAB, tiny_model

    models = {"native": AttnResForCausalLM.from_native(native_model(residual="attnres_block")),
              **{family: upcycle(tiny_model(family), "attnres_block", block_size=2) for family in ("qwen3", "qwen3_moe")}}
    for name, model in models.items():
        with torch.no_grad():
            for p in model.residual.parameters():
                p.normal_(std=0.3)
            ids = torch.randint(0, VOCAB, (1, 9))
            model.eval().save_pretrained(tmp_path / name)
            torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / name / "ref.pt")
    # One process for every check (starting one costs more than the checks): first attnres not
    # installed - transformers' own check of the module file's imports names it - then the
    # finder that hides it is taken away, and the process has still not imported attnres.
    script = (
        "import sys, importlib.abc, torch\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'attnres': raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from transformers import AutoModelForCausalLM\n"
        "try:\n"
        "    AutoModelForCausalLM.from_pretrained(sys.argv[2], trust_remote_code=True)\n"
        "    raise SystemExit('loaded without attnres')\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "del sys.meta_path[0]\n"
        "for d in sys.argv[1:]:\n"
        "    try:\n"
        "        AutoModelForCausalLM.from_pretrained(d)\n"
        "        raise SystemExit('loaded without trust_remote_code')\n"
        "    except ValueError as e:\n"
        "        assert 'trust_remote_code=True' in str(e), e\n"
        "assert 'attnres' not in sys.modules\n"
        "for d in sys.argv[1:]:\n"
        "    ref = torch.load(d + '/ref.pt')\n"
        "    m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()\n"
        "    assert type(m).__module__.startswith('attnres.hf.'), type(m)\n"
        "    diff = (m(ref['ids']).logits - ref['logits']).abs().max().item()\n"
        "    assert diff < 1e-5, (d, diff)  # another process: other thread count, other rounding\n"
        "    m.save_pretrained(d + '-again')\n"
        "print('ok')\n"
    )
    dirs = [tmp_path / name for name in models]
    run = _fresh_process(script, *dirs, modules=tmp_path / "modules")
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-3000:]
    assert "requires the following packages that were not found in your environment: attnres" in run.stdout, run.stderr
    for d in dirs:  # saved again from the class the module file gave: the same files, the same auto_map
        again = tmp_path / f"{d.name}-again"
        assert sorted(p.name for p in again.glob("*.py")) == ["attnres_classes.py"]
        auto_map = json.loads((d / "config.json").read_text())["auto_map"]
        assert json.loads((again / "config.json").read_text())["auto_map"] == auto_map


#: A user's module registering a residual of their own (README, "Bring your own residual").
USER_RESIDUAL = """
import torch
from torch import nn
from attnres import register_residual
from attnres.nn.residual import SingleStreamResidual

@register_residual("scaled_byo")
class ScaledResidual(SingleStreamResidual):
    def __init__(self, dim, n_sublayers, init=1.0):
        super().__init__(dim, n_sublayers)
        self.init = init
        self.scale = nn.Parameter(torch.full((n_sublayers,), init))
    def reset_parameters(self):
        nn.init.constant_(self.scale, self.init)
    def update(self, l, h, out):
        return h + self.scale[l].to(out.dtype) * out
"""


def test_an_export_and_an_upcycle_of_a_residual_of_the_user_s_own_load_in_a_fresh_process(tmp_path, monkeypatch,
                                                                                           request):
    """``attnres --import my_residuals export`` / ``upcycle --residual <own>``: the directory did
    not say which module registers its residual, so ``from_pretrained(DIR, trust_remote_code=True)``
    in a fresh process stopped with the registry's list of the names it knows. config.json names
    the module, which the directory's module file imports first: it loads, with the logits of the
    model written; where the module cannot be imported the error names it and how to make it
    importable, and after ``import attnres.hf`` (nothing imported for the directory) it names the
    module to import. A built-in residual's directory is written as before (no such key)."""
    pytest.importorskip("yaml")
    from test_train import overrides, write_corpus

    from fixtures.tiny_families import tiny_model

    NATIVE_KEY, FAMILY_KEY = "residual_module", "attnres_residual_module"  # (config.json's, beside the residual)

    user = tmp_path / "user"
    user.mkdir()
    (user / "byo_residuals.py").write_text(USER_RESIDUAL)
    monkeypatch.setattr(sys, "path", list(sys.path))  # (--import puts the file's folder first)
    request.addfinalizer(lambda: sys.modules.pop("byo_residuals", None))  # (the registry forgets it too)
    imported = ["--import", str(user / "byo_residuals.py")]
    corpus = write_corpus(tmp_path / "corpus.txt", n_lines=200)
    run = tmp_path / "run"
    assert cli_main([*imported, "train", *overrides(corpus, run, steps=1, warmup_steps=0, eval_every=100, diagnostics_every=100,
                                                   **{"model.residual.kind": "scaled_byo",
                                                      "model.residual.options.init": 0.5})]) == 0
    assert cli_main([*imported, "export", str(run), "--out", str(tmp_path / "export")]) == 0
    tiny_model("llama", vocab_size=256).save_pretrained(tmp_path / "llama")
    make_hf_tokenizer(ByteTokenizer()).save_pretrained(tmp_path / "llama")
    assert cli_main([*imported, "upcycle", "--model", str(tmp_path / "llama"), "--residual", "scaled_byo",
                     "--out", str(tmp_path / "upcycle")]) == 0
    from transformers import AutoModelForCausalLM

    dirs = {"export": NATIVE_KEY, "upcycle": FAMILY_KEY}
    for name, key in dirs.items():
        assert json.loads((tmp_path / name / "config.json").read_text())[key] == "byo_residuals"
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        ids = torch.randint(0, 256, (1, 9))
        with torch.no_grad():
            torch.save({"ids": ids, "logits": model(ids).logits}, tmp_path / name / "ref.pt")
    from attnres.upcycle import upcycle

    for builtin in (AttnResForCausalLM.from_native(native_model(residual="attnres_block")),
                    upcycle(tiny_model("llama"), "attnres_block", block_size=2)):
        builtin.save_pretrained(tmp_path / "builtin")
        assert not {NATIVE_KEY, FAMILY_KEY} & set(json.loads((tmp_path / "builtin" / "config.json").read_text()))
        assert "import_residual_module" not in (tmp_path / "builtin" / "attnres_classes.py").read_text()

    # One process for both (starting one costs more than the checks): without the user's folder
    # on sys.path each directory names the module it cannot import; with it, each loads.
    load = ("import importlib, sys, torch\n"
            "from transformers import AutoModelForCausalLM\n"
            "def load_each():\n"
            "    for d in sys.argv[2:]:\n"
            "        try:\n"
            "            m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()\n"
            "        except ImportError as e:\n"
            "            print(e)\n"
            "            continue\n"
            "        ref = torch.load(d + '/ref.pt')\n"
            "        diff = (m(ref['ids']).logits - ref['logits']).abs().max().item()\n"
            "        assert diff < 1e-5, (d, diff)  # another process: other thread count, other rounding\n"
            "        print('loaded', type(m).__name__)\n"
            "load_each()\n"
            "print('-- the user folder on sys.path --')\n"
            "sys.path.append(sys.argv[1])\n"
            "importlib.invalidate_caches()\n"
            "load_each()\n")
    paths = [tmp_path / name for name in dirs]
    run = _fresh_process(load, user, *paths, modules=tmp_path / "modules")
    missing, _, found = run.stdout.partition("-- the user folder on sys.path --\n")
    assert missing.splitlines() == [
        f"residual 'scaled_byo' is registered by module 'byo_residuals' (config.json's {key}), which cannot be "
        "imported here (No module named 'byo_residuals'): put the folder that holds it on PYTHONPATH, or pip install "
        "the package that has it" for key in dirs.values()], run.stdout[-2000:] + run.stderr[-3000:]
    assert found.splitlines() == ["loaded AttnResForCausalLM", "loaded AttnResLlamaForCausalLM"], (
        run.stdout[-2000:] + run.stderr[-3000:])
    # Where attnres.hf is imported, its classes load the directory, and nothing is imported for it:
    from attnres.nn.residual import registry

    monkeypatch.delitem(registry._REGISTRY, "scaled_byo")  # (a process that did not import the module)
    monkeypatch.delitem(sys.modules, "byo_residuals")
    with pytest.raises(ValueError) as refused:
        AutoModelForCausalLM.from_pretrained(paths[0])
    assert str(refused.value) == (
        f"{paths[0] / 'config.json'}: residual 'scaled_byo' is not registered: module 'byo_residuals' registers it "
        f"(config.json's {NATIVE_KEY}); import it first (`import byo_residuals` in Python, `attnres --import "
        "byo_residuals <command> ...`)")


def test_a_directory_of_a_residual_a_script_registered_says_so(tmp_path, monkeypatch):
    """A residual registered in a script (its ``__main__``) is in no module another process can
    import: saving warns, and loading where it is not registered says why, under
    ``trust_remote_code`` (the module file) and after ``import attnres.hf`` alike; the script run
    again, which registers it, loads the directory."""
    from transformers import AutoModelForCausalLM

    from attnres import register_residual
    from attnres.nn.residual import SingleStreamResidual, registry
    from attnres.nn.residual.imports import import_residual_module

    script_class = type("InScript", (SingleStreamResidual,), {"__module__": "__main__",
                                                              "update": lambda self, l, h, out: h + 0.5 * out})
    register_residual("in_script_test")(script_class)
    model = AttnResForCausalLM.from_native(native_model(residual="in_script_test"))
    with pytest.warns(UserWarning, match=r"residual 'in_script_test' is registered by this script \(its __main__\), "
                      r"which no other process can import: .* loads only in a process that registers it again"):
        model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["residual_module"] == "__main__"
    assert "import_residual_module('__main__', 'in_script_test', 'residual_module')" in (
        tmp_path / "attnres_classes.py").read_text()
    import_residual_module("__main__", "in_script_test", "residual_module")  # registered here: nothing to do
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)).__name__ == "AttnResForCausalLM"
    monkeypatch.delitem(registry._REGISTRY, "in_script_test")
    said = ("residual 'in_script_test' was registered by the script that saved this directory (its residual_module is "
            "'__main__'), which no other process can import: move the class into a module, import that module, and "
            "save the directory again")
    with pytest.raises(ImportError) as refused:
        import_residual_module("__main__", "in_script_test", "residual_module")
    assert str(refused.value) == said
    with pytest.raises(ValueError) as refused:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert str(refused.value) == f"{tmp_path / 'config.json'}: {said}"


def test_a_module_that_no_longer_registers_the_residual_is_named_as_imported(tmp_path, monkeypatch, request):
    """config.json names a module that is imported but registers the residual no more (renamed
    since, or another module of that name first on sys.path): the load said to import the
    module - imported already - and under trust_remote_code the registry's list of names."""
    from transformers import AutoModelForCausalLM

    from attnres.nn.residual.imports import import_residual_module

    (tmp_path / "renamed_byo.py").write_text(USER_RESIDUAL.replace('"scaled_byo"', '"renamed_byo"'))
    monkeypatch.syspath_prepend(str(tmp_path))
    request.addfinalizer(lambda: sys.modules.pop("renamed_byo", None))
    said = (f"residual 'scaled_byo' is not registered, though module 'renamed_byo' ({tmp_path / 'renamed_byo.py'}) - "
            "which config.json's residual_module says registers it - was imported: the class was renamed or moved "
            "since the directory was saved, or another module of that name comes first on sys.path; registered here: ")
    with pytest.raises(ImportError) as refused:
        import_residual_module("renamed_byo", "scaled_byo", "residual_module")
    assert str(refused.value).startswith(said) and "renamed_byo" in str(refused.value)[len(said):], refused.value
    config = AttnResForCausalLM.from_native(native_model()).config.to_diff_dict()
    config["residual"]["kind"], config["residual_module"] = "scaled_byo", "renamed_byo"
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as refused:
        AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert str(refused.value).startswith(f"{tmp_path / 'saved' / 'config.json'}: {said}"), refused.value
    # A value that names no module (a hand edit): refused naming the key, never imported.
    config["residual_module"] = "my residuals; rm"
    (tmp_path / "saved" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: residual_module must name the module that registers the "
                                         r"residual, such as 'my_pkg.residuals'; got 'my residuals; rm'"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "saved")


def test_a_config_pushed_from_its_folder_uploads_the_module_file_its_auto_map_names(tmp_path, monkeypatch):
    """``config.save_pretrained(DIR, push_to_hub=True)`` uploads the files that transformers saw
    change while it saved; the module file ``auto_map`` names was written before it looked, so
    the Hub repository got a config.json naming a file it lacked (trust_remote_code loading
    failed there). Offline: the Hub client is a stand-in recording what is uploaded."""
    from types import SimpleNamespace

    import transformers.configuration_utils
    import transformers.utils.hub

    from attnres.hf.families.remote_code import MODULE_FILE

    uploads = []

    class Hub:
        def create_repo(self, repo_id, **kwargs):
            return SimpleNamespace(repo_id=repo_id)

        def create_commit(self, repo_id, operations, **kwargs):
            uploads.append(sorted(op.path_in_repo for op in operations))

    for module in (transformers.configuration_utils, transformers.utils.hub):
        monkeypatch.setattr(module, "hf_api", Hub)
    config = AttnResForCausalLM.from_native(native_model(residual="attnres_block")).config
    for _ in range(2):  # a new folder, then the same one again
        config.save_pretrained(str(tmp_path / "pushed"), push_to_hub=True, repo_id="me/attnres")
        assert uploads.pop() == sorted([MODULE_FILE, "config.json"])
    assert json.loads((tmp_path / "pushed" / "config.json").read_text())["auto_map"]["AutoConfig"].startswith(
        "attnres_classes.")


@pytest.mark.slow
def test_lm_eval_s_own_command_line_evaluates_a_saved_directory_with_trust_remote_code(tmp_path):
    """``lm_eval run --model hf --model_args pretrained=DIR,trust_remote_code=True`` (no
    ``import attnres.hf``; docs/hf.md), offline, on the local tasks ``attnres eval`` writes, with
    the line break as the prefix of rolling log-likelihoods (the directory declares no end of
    text). Was: "does not recognize this architecture". (About half a minute: lm_eval's start.)"""
    from attnres.hf.evaluate import write_local_tasks

    native = native_model(residual="attnres_block")
    AttnResForCausalLM.from_native(native).save_pretrained(tmp_path / "hf")
    make_hf_tokenizer(ByteTokenizer(), native.config.max_seq_len).save_pretrained(tmp_path / "hf")
    text = "\n".join(f"line {i} " + " ".join(f"w{(i * 7 + k) % 50}" for k in range(14)) for i in range(30))
    write_local_tasks(tmp_path / "tasks", text)
    env = {"PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    args = ["run", "--model", "hf", "--model_args", f"pretrained={tmp_path / 'hf'},trust_remote_code=True,prefix_token_id=10",
            "--tasks", "attnres_ppl,attnres_cloze", "--include_path", str(tmp_path / "tasks"), "--limit", "4",
            "--batch_size", "2", "--device", "cpu"]
    run = subprocess.run([sys.executable, "-m", "lm_eval", *args], capture_output=True, text=True, env=env, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "bits_per_byte" in run.stdout and "acc_norm" in run.stdout, run.stdout[-2000:]


def test_lm_eval_s_truncation_warnings_are_counted_into_one(caplog):
    """The harness logs a line per request longer than the model's context; they are held
    back while it runs and counted (tokens cut per request), its other lines pass."""
    import logging

    from attnres.hf.evaluate import _truncations_counted

    harness = logging.getLogger("lm_eval.models.huggingface")
    with caplog.at_level(logging.WARNING), _truncations_counted() as cut:
        for n in (9, 5):
            harness.warning(f"Combined length of context (81) and continuation (55) exceeds model's maximum length "
                            f"(128). Truncating {n} tokens from the left.")
        harness.warning("something else")
    harness.warning("Combined length of context (1) and continuation (1) exceeds ... Truncating 3 tokens")  # after
    assert cut == [9, 5]
    assert [r.getMessage()[:14] for r in caplog.records] == ["something else", "Combined lengt"]


def test_the_truncation_warning_names_the_window_in_parentheses():
    """`attnres eval --limit 4 --num-fewshot 5` (docs/hf.md) warned "longer than the window, 64
    tokens and were cut ...": the window's length reads as the start of a list."""
    from attnres.hf.evaluate import truncation_warning

    assert truncation_warning([9, 131], 64) == (
        "2 of the tasks' requests were longer than the window (64 tokens) and were cut from the left by lm-eval "
        "(the longest by 131 tokens): their scores saw less context")
    assert truncation_warning([5], None).startswith("1 of the tasks' requests were longer than the model's context "
                                                    "and were cut")


def test_attnres_ppl_reads_documents_in_the_perplexity_windows(tmp_path, monkeypatch):
    """lm-eval's rolling log-likelihood windows were the model's whole context
    (max_position_embeddings, 128 here; a Qwen3 upcycle's 40,960), not `attnres eval`'s window
    (--seq-len, or the context at most 2,048): a document longer than --seq-len was scored in
    other windows than the perplexity pass's. The harness is given the window (max_length): a
    document of whole windows (the harness's last window takes a full one's context, the
    perplexity pass's a shorter one) has the perplexity's loss, started from the line break
    the harness starts it with."""
    pytest.importorskip("lm_eval")
    import math

    from attnres.hf.evaluate import perplexity, run_lm_eval

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    native = native_model(residual="attnres_block")
    AttnResForCausalLM.from_native(native).save_pretrained(tmp_path / "hf")
    make_hf_tokenizer(ByteTokenizer(), native.config.max_seq_len).save_pretrained(tmp_path / "hf")
    window = 32
    docs = [" ".join(f"w{i}{j}" for j in range(24))[: 3 * window].rstrip() for i in range(4)]
    docs = [d + "x" * (3 * window - len(d)) for d in docs]  # (three windows each, of bytes)
    results = run_lm_eval(tmp_path / "hf", ["attnres_ppl"], "\n\n".join(docs), bootstrap_iters=0, max_length=window)
    nats = sum(perplexity(native, ByteTokenizer(), "\n" + d, seq_len=window)["loss"] * len(d) for d in docs)
    want = nats / math.log(2) / sum(map(len, docs))
    assert results["attnres_ppl"]["bits_per_byte,none"] == pytest.approx(want, rel=1e-5)
    whole = run_lm_eval(tmp_path / "hf", ["attnres_ppl"], "\n\n".join(docs), bootstrap_iters=0)  # (128: one window)
    assert abs(whole["attnres_ppl"]["bits_per_byte,none"] - want) > 1e-3  # (0.007 bits: other windows)


def test_attnres_eval_runs_lm_eval_on_local_tasks(tmp_path, monkeypatch, capfd, caplog):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_train import overrides, write_corpus

    from attnres.train import load_config, train

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    corpus = write_corpus(tmp_path / "corpus.txt", n_lines=400)
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus, run, steps=2, eval_every=100, diagnostics_every=100)))
    out = tmp_path / "eval.json"
    capfd.readouterr()
    monkeypatch.chdir(tmp_path)  # outside a git repository
    assert cli_main(["eval", "--checkpoint", str(run), "--limit", "4", "--out", str(out), "--device", "cpu"]) == 0
    # no harness warnings: metric defaults, the model type, transformers' cache name (logged), git (printed)
    err, logged = capfd.readouterr().err, "\n".join(r.getMessage() for r in caplog.records if r.levelno >= 30)
    for noise in ("is defined, but", "neither marked as CausalLM", "are deprecated", "fatal:", "Traceback",
                  "Token indices sequence length is longer", "Combined length of context"):
        assert noise not in err and noise not in logged, noise
    results = json.loads(out.read_text())
    ppl = results["perplexity"]
    assert ppl["tokens"] > 0 and ppl["perplexity"] > 1 and ppl["bits_per_byte"] > 0
    assert set(results["lm_eval"]) == {"attnres_ppl", "attnres_cloze"} and results["device"] == "cpu"
    cloze, rolling = results["lm_eval"]["attnres_cloze"], results["lm_eval"]["attnres_ppl"]
    assert 0 <= cloze["acc,none"] <= 1
    assert rolling["bits_per_byte,none"] > 0
    # Standard errors are numbers, not "N/A": the binomial one for accuracy (4 items),
    # the ratio estimator's for the rolling metrics.
    acc = cloze["acc,none"]
    assert cloze["acc_stderr,none"] == pytest.approx((acc * (1 - acc) * 4 / 3 / 4) ** 0.5)
    for name in ("bits_per_byte", "byte_perplexity", "word_perplexity"):
        assert isinstance(rolling[f"{name}_stderr,none"], float) and rolling[f"{name}_stderr,none"] > 0, name
    # export writes a directory the Auto classes and AutoTokenizer load, with no end-of-text token.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert cli_main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert model.config.eos_token_id is None and tok.eos_token_id is None and model.generation_config.eos_token_id is None
    assert tok.pad_token_id is None and model.config.pad_token_id is None and model.generation_config.pad_token_id is None
    assert tok.model_max_length == model.config.max_position_embeddings == model.config.max_seq_len


def test_lm_eval_generation_tasks_run_on_an_export_without_an_end_of_text_token(tmp_path):
    """lm-eval's ``generate_until`` (gsm8k and every generation task) decodes the tokenizer's
    end-of-text id to add it to the stop strings; an export declares none, and decoding
    ``None`` failed with "TypeError: 'None' is not an instance of 'Sequence'". The tokenizer
    ``attnres eval`` gives the harness generates what ``generate`` does, up to the task's stop
    string."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from attnres.hf.evaluate import harness_tokenizer

    hf = AttnResForCausalLM.from_native(native_model(residual="attnres_block")).eval()
    hf.save_pretrained(tmp_path / "hf")
    make_hf_tokenizer(ByteTokenizer(), hf.config.max_seq_len).save_pretrained(tmp_path / "hf")
    tokenizer, prefix = harness_tokenizer(tmp_path / "hf")
    assert tokenizer.eos_token_id is None
    lm = HFLM(pretrained=hf, tokenizer=tokenizer, batch_size=1, **prefix)
    context = "the quick"
    ids = tokenizer(context, return_tensors="pt")["input_ids"]
    expected = tokenizer.decode(hf.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:])
    until = expected[3:5]  # (a stop string the greedy continuation holds)
    out = lm.generate_until([Instance("generate_until", {}, (context, {"until": [until], "max_gen_toks": 6,
                                                                         "do_sample": False}), 0)])
    assert out == [expected[:expected.index(until)]]
    assert tokenizer.decode([104, 105]) == "hi"  # (ids decode as before)


def test_perplexity_windows_predict_every_token_once():
    from attnres.hf.evaluate import perplexity

    model = native_model(residual="attnres_block")
    text = "the quick brown fox jumps over the lazy dog. " * 2
    ids = torch.tensor([ByteTokenizer().encode(text)])
    with torch.no_grad():
        whole = float(model(ids, labels=ids).loss)
    one = perplexity(model, ByteTokenizer(), text)  # one window (text shorter than max_seq_len)
    assert one["tokens"] == ids.shape[1] - 1 == one["bytes"]
    assert abs(one["loss"] - whole) < 1e-5
    assert abs(one["bits_per_byte"] - whole / torch.log(torch.tensor(2.0)).item()) < 1e-5
    windows = perplexity(model, ByteTokenizer(), text, seq_len=32)  # shorter contexts: a different loss
    assert windows["tokens"] == one["tokens"] and windows["loss"] != one["loss"]
    with pytest.raises(ValueError, match=r"--seq-len must be in \[1, 128\] \(the model's context limit, max_seq_len\)"):
        perplexity(model, ByteTokenizer(), text, seq_len=129)
    # (a transformers model's field: `attnres eval DIR --seq-len 500` named max_seq_len, which its config lacks)
    with pytest.raises(ValueError, match=r"^--seq-len must be in \[1, 128\] \(the model's context limit, "
                                         r"max_position_embeddings\); got 129: omit it for the default window$"):
        perplexity(AttnResForCausalLM.from_native(model), ByteTokenizer(), text, seq_len=129)


@pytest.mark.parametrize("text", ["élan vital, naïve café", "日本語のテキスト and more", "plain ascii text here"])
def test_bits_per_byte_counts_the_bytes_after_the_first_token(text):
    """Bits per byte divide by the UTF-8 bytes of the predicted tokens: all but those of the
    first token. A first token holding part of a character ("é" is two byte tokens) was
    counted as U+FFFD, 3 bytes, for 1 or 2: 8 bytes instead of 10 for "élan vital"."""
    from attnres.data.tokenizer import train_bpe
    from attnres.hf.evaluate import perplexity

    model = native_model(residual="attnres_block")
    byte = perplexity(model, ByteTokenizer(), text)
    assert byte["bytes"] == byte["tokens"] == len(text.encode()) - 1
    bpe = train_bpe("the quick brown fox jumps over the lazy dog\n" * 20, 300)
    # Trained on ASCII, it keeps a leading "é" or "日" as single bytes; ASCII decodes exactly.
    first = 1 if not text.isascii() else len(bpe.decode(bpe.encode(text)[:1]))
    got = perplexity(native_model(residual="attnres_block", vocab_size=bpe.vocab_size), bpe, text)
    assert got["bytes"] == len(text.encode()) - first


def test_local_cloze_items_have_distinct_choices_and_the_right_label(tmp_path):
    from attnres.hf.evaluate import CLOZE_CHOICES, held_out_documents, write_local_tasks

    text = "\n".join(f"line {i} " + " ".join(f"w{(i * 7 + k) % 50}" for k in range(14)) for i in range(30))
    write_local_tasks(tmp_path, text)
    docs = held_out_documents(text)
    items = [json.loads(line) for line in (tmp_path / "cloze.jsonl").read_text().splitlines()]
    assert items and len((tmp_path / "ppl.jsonl").read_text().splitlines()) == len(docs)
    for item in items:
        assert len(set(item["choices"])) == len(item["choices"]) == CLOZE_CHOICES
        assert any(d.startswith(item["context"] + item["choices"][item["label"]]) for d in docs)


def test_a_cloze_item_is_never_among_its_own_solved_examples(tmp_path):
    """attnres_cloze draws each item's --num-fewshot examples from its one split: the harness
    drew them from the whole split, the item itself with its answer among them (5-shot, 8 of 40
    items here), which raised its accuracy. Named as the few-shot split too, each item is left
    out of its own, as docs/hf.md says ("from its other items")."""
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from attnres.hf.evaluate import write_local_tasks

    text = "\n".join(f"line {i} " + " ".join(f"w{(i * 7 + k) % 50}" for k in range(14)) for i in range(40))
    manager = TaskManager(include_path=str(write_local_tasks(tmp_path, text)), include_defaults=False)
    task = manager.load(["attnres_cloze"])["tasks"]["attnres_cloze"] if hasattr(manager, "load") else None
    if task is None:  # (lm_eval before TaskManager.load)
        from lm_eval.tasks import get_task_dict

        task = get_task_dict(["attnres_cloze"], manager)["attnres_cloze"]
    task.set_fewshot_seed(1234)
    items = list(task.test_docs())
    for shots in (5, len(items) - 1):
        for item in items:
            solved = item["context"] + item["choices"][item["label"]]
            assert solved not in task.fewshot_context(item, num_fewshot=shots), (shots, item["context"])


def test_importing_attnres_registers_nothing_and_attnres_hf_is_all_the_auto_classes_need(tmp_path):
    """In a fresh process (one for both checks: starting one costs more than the checks),
    ``import attnres`` leaves ``sys.meta_path`` as it was and does not touch transformers:
    importing transformers afterwards knows no AttnRes model type until ``attnres.hf`` is
    imported (or ``attnres.hf.register()`` is called), which registers them all. Then
    ``import attnres.hf`` is all ``AutoModelForCausalLM`` / ``AutoModel.from_pretrained``
    need for a saved directory (no ``trust_remote_code``)."""
    native = native_model(residual="attnres_block")
    hf = AttnResForCausalLM.from_native(native)
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    ids = torch.randint(0, native.config.vocab_size, (1, 10))
    with torch.no_grad():
        torch.save({"ids": ids, "logits": native(ids).logits}, tmp_path / "ref.pt")
    script = (
        "import sys\n"
        "before = list(sys.meta_path)\n"
        "import attnres\n"
        "assert sys.meta_path == before, (before, sys.meta_path)\n"
        "assert 'transformers' not in sys.modules\n"
        "from transformers import AutoConfig\n"
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
        "assert 'attnres' not in CONFIG_MAPPING and 'attnres_llama' not in CONFIG_MAPPING\n"
        "import attnres.hf\n"
        "assert not [f for f in sys.meta_path if type(f).__module__.startswith('attnres')]  # transformers adds its own\n"
        "assert 'attnres' in CONFIG_MAPPING and 'attnres_llama' in CONFIG_MAPPING\n"
        "import torch\n"
        "from transformers import AutoModel, AutoModelForCausalLM\n"
        "d = sys.argv[1]; ref = torch.load(d + '/ref.pt')\n"
        "m = AutoModelForCausalLM.from_pretrained(d).eval()\n"
        "assert type(m).__name__ == 'AttnResForCausalLM', type(m)\n"
        "diff = (m(ref['ids']).logits - ref['logits']).abs().max().item()\n"
        "assert diff < 1e-5, diff  # another process: other thread count, other rounding\n"
        "assert type(AutoModel.from_pretrained(d)).__name__ == 'AttnResModel'\n"
        "e = AutoModelForCausalLM.from_pretrained(d, attn_implementation='eager').eval()\n"
        "assert e.config._attn_implementation == 'eager'\n"
        "assert (e(ref['ids']).logits - ref['logits']).abs().max().item() < 1e-5\n"
        "assert e.layers[0].attn.implementation == 'eager'\n"
        "print('ok')\n"
    )
    env = {"PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120,
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout[-2000:] + run.stderr[-2000:]
    assert "custom code" not in run.stderr  # the auto_map the directory also has: neither a prompt nor a warning


def test_import_attnres_without_transformers(tmp_path):
    """``import attnres`` and the native model work where transformers is not installed:
    a site directory holding everything of this environment except transformers."""
    import site

    packages = Path(next(p for p in site.getsitepackages() if Path(p, "torch").is_dir()))
    view = tmp_path / "site"
    view.mkdir()
    for entry in packages.iterdir():
        if not entry.name.startswith("transformers"):
            (view / entry.name).symlink_to(entry)
    script = (
        "import sys, attnres, torch\n"
        "m = attnres.AttnResLM(attnres.ModelConfig.preset('tiny'))\n"
        "m(torch.zeros(1, 4, dtype=torch.long))\n"
        "import importlib.util; assert importlib.util.find_spec('transformers') is None\n"
        "print('ok')\n"
    )
    env = {"PYTHONPATH": f"{SRC}:{view}", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_export_and_eval_check_their_outputs_before_any_work(tmp_path, monkeypatch):
    """``export --out <existing file>`` and ``eval --out <missing folder>`` fail at once
    with a message naming the path; the file is left alone."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_train import overrides, write_corpus

    import attnres.hf.evaluate as evaluate_mod
    from attnres.train import load_config, train

    corpus = write_corpus(tmp_path / "corpus.txt", n_lines=200)
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus, run, steps=1, eval_every=100, diagnostics_every=100)))
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    with pytest.raises(SystemExit, match=r"attnres export: error: --out .*notes.txt' cannot be used: it is a file"):
        cli_main(["export", "--checkpoint", str(run), "--out", str(existing)])
    assert existing.read_text() == "keep me"
    monkeypatch.setattr(evaluate_mod, "perplexity", lambda *a, **k: pytest.fail("eval did work before checking --out"))
    with pytest.raises(SystemExit, match=r"attnres eval: error: --out .*: the folder .*missing' does not exist"):
        cli_main(["eval", "--checkpoint", str(run), "--out", str(tmp_path / "missing" / "eval.json")])


def test_exported_model_generates_past_line_breaks(tmp_path):
    """The export declares no end-of-sequence token, so HF ``generate`` does not stop at a
    line break: a model that always predicts "\\n" produces every token asked for."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_train import overrides, write_corpus

    from attnres.hf import export_checkpoint
    from attnres.inference.loading import load_run
    from attnres.train import load_config, train
    from attnres.checkpoint import save_checkpoint

    corpus = write_corpus(tmp_path / "corpus.txt", n_lines=200)
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus, run, steps=1, eval_every=100, diagnostics_every=100,
                                      **{"model.residual": "standard"})))
    loaded = load_run(run)
    model = loaded.model
    with torch.no_grad():  # blocks add nothing; every token embeds alike; the head favours "\n"
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        model.embed_tokens.weight.copy_(torch.ones_like(model.embed_tokens.weight))
        model.lm_head.weight.zero_()
        model.lm_head.weight[ord("\n")] = 1.0
    keep = {k: v for k, v in loaded.state.items() if k not in ("format_version", "step", "files", "optimizer")}
    save_checkpoint(run, 2, model, torch.optim.AdamW(model.parameters()), keep, keep=5)  # byte tokenizer: no file
    export_checkpoint(run, tmp_path / "hf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tok("the quick", return_tensors="pt")
    out = hf.generate(**ids, max_new_tokens=5, do_sample=False)
    assert tok.decode(out[0, ids["input_ids"].shape[1]:]) == "\n" * 5


def test_exported_tokenizer_pads_a_batch_of_prompts_for_generate(tmp_path):
    """The exported tokenizer pads on the left: a batch of ragged prompts, padded with an id
    set in memory as the docs say, generates what each prompt generates alone (padded on the
    right, the short prompt was continued after its padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    native = native_model(residual="attnres_block")
    assert native.config.vocab_size >= 256  # the byte tokenizer's ids
    AttnResForCausalLM.from_native(native).save_pretrained(tmp_path / "hf")
    make_hf_tokenizer(ByteTokenizer(), native.config.max_seq_len).save_pretrained(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.padding_side == "left"
    tok.pad_token_id = 0
    prompts = ["the quick brown fox", "a"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    out = hf.generate(**batch, max_new_tokens=6, do_sample=False)[:, batch["input_ids"].shape[1]:]
    for prompt, row in zip(prompts, out):
        alone = tok(prompt, return_tensors="pt")
        assert torch.equal(row, hf.generate(**alone, max_new_tokens=6, do_sample=False)[0, alone["input_ids"].shape[1]:])
    # transformers' pipeline, batched with the same in-memory padding id (docs/hf.md)
    from transformers import pipeline

    texts = pipeline("text-generation", model=hf, tokenizer=tok)(prompts, batch_size=2, max_new_tokens=6, do_sample=False,
                                                                 return_full_text=False)
    assert [t[0]["generated_text"] for t in texts] == [tok.decode(row) for row in out]


def test_ratio_stderr_matches_a_bootstrap():
    """The delta-method standard error of sum(a)/sum(b) agrees with a brute-force bootstrap
    of the same documents (an independent estimate) to about 5 %."""
    import numpy as np

    from attnres.hf.evaluate import ratio_stderr

    rng = np.random.default_rng(0)
    b = rng.integers(20, 200, size=200).astype(float)  # bytes per document
    a = -b * rng.normal(2.0, 0.3, size=200)  # log-likelihoods
    pick = rng.integers(0, 200, size=(20000, 200))
    boot = a[pick].sum(axis=1) / b[pick].sum(axis=1)
    assert ratio_stderr(list(zip(a, b))) == pytest.approx(float(boot.std(ddof=1)), rel=0.05)
    with pytest.raises(ValueError, match="at least 2"):
        ratio_stderr([(1.0, 2.0)])


# -- loading fills what a checkpoint lacks with the faithful init (issue 15, items 10-11) --

@pytest.mark.parametrize("residual", [
    "attnres_block",
    "attnres_full",
    "layerscale",
    "denseformer",
    {"kind": "attnres_block", "schedule": "naive", "ablation": {"input_dependent_query": True}},
])
def test_loading_a_standard_checkpoint_initialises_the_missing_residual(tmp_path, residual):
    """A standard-residual checkpoint loaded as another residual: every residual parameter is
    missing from it and must get its faithful init (zero queries and projections, unit gains,
    each baseline's own), not uninitialised memory; the shared weights load as saved."""
    std = AttnResForCausalLM.from_native(native_model(residual="standard"))
    std.save_pretrained(tmp_path / "std")
    config = AttnResConfig.from_model_config(std.native_config.replace(residual=residual))
    for trial in range(3):
        loaded = AttnResForCausalLM.from_pretrained(tmp_path / "std", config=config)
        fresh = config.to_model_config().build_residual()
        want = dict(fresh.named_parameters())
        for name, p in loaded.residual.named_parameters():
            if name.endswith(".weight") and "gates" not in name and "query_proj" not in name:
                assert torch.equal(p, torch.ones_like(p)), name  # key-norm gains
            elif "query" in name or "mixing" in name or "dwa" in name or "scales" in name:
                assert torch.equal(p, want[name]), name  # zero queries, identity DWA, LayerScale's init
        assert torch.equal(loaded.embed_tokens.weight, std.embed_tokens.weight)
        ids = torch.randint(0, 256, (2, 6))
        assert torch.isfinite(loaded(ids).logits).all()


def test_a_partly_missing_residual_keeps_what_was_loaded(tmp_path):
    """Only the parameters absent from the checkpoint are initialised; loaded ones stay."""
    from safetensors.torch import load_file, save_file

    model = AttnResForCausalLM.from_native(native_model(residual="attnres_block"))
    model.save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    weights = load_file(str(path))
    dropped = "residual.mixers.2.query"
    del weights[dropped]
    save_file(weights, str(path), metadata={"format": "pt"})
    loaded = AttnResForCausalLM.from_pretrained(tmp_path / "m")
    params = dict(loaded.named_parameters())
    assert torch.equal(params[dropped], torch.zeros_like(params[dropped]))
    for name, value in weights.items():
        assert torch.equal(params[name], value), name


def test_mhc_lite_survives_save_and_load(tmp_path):
    """Regression: mHC-lite's permutation matrices were a non-persistent buffer that
    ``from_pretrained`` left uninitialised (NaN logits from a complete checkpoint)."""
    model = AttnResForCausalLM.from_native(native_model(residual={"kind": "mhc_lite", "hc_streams": 3}))
    model.save_pretrained(tmp_path / "m")
    ids = torch.randint(0, 256, (2, 6))
    for _ in range(3):
        loaded = AttnResForCausalLM.from_pretrained(tmp_path / "m")
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_from_pretrained_accepts_the_flat_keys_of_earlier_versions(tmp_path):
    """`from_pretrained(dir, attnres_block_size=1)`: the flat key sets residual.block_size with a
    DeprecationWarning (it reached the model's __init__ as an unknown argument: TypeError)."""
    from transformers import AutoModelForCausalLM

    AttnResForCausalLM.from_native(native_model(residual={"kind": "attnres_block", "block_size": 2})).save_pretrained(tmp_path)
    for cls in (AttnResForCausalLM, AutoModelForCausalLM):
        with pytest.warns(DeprecationWarning, match=r"attnres_block_size is deprecated: use .*residual.block_size"):
            model = cls.from_pretrained(tmp_path, attnres_block_size=1)
        assert model.config.to_model_config().residual.block_size == 1
    assert AttnResForCausalLM.from_pretrained(tmp_path).config.to_model_config().residual.block_size == 2


def test_from_pretrained_changes_only_the_residual_fields_it_is_given(tmp_path):
    """`from_pretrained(dir, residual={"kind": "attnres_block", "backend": "torch"})` (another
    kernel for the same model) replaced the stored residual with the mapping given: the block
    size went back to its default (ceil(L / 8), not the stored 2) and the weights, of the same
    shapes, loaded without a word into another model; `residual={"backend": "torch"}` stopped
    with KeyError 'kind', `residual="attnres_full"` with a TypeError. A residual given changes
    what it names of the stored one, as ModelConfig.replace does."""
    from transformers import AutoModelForCausalLM

    native = native_model(residual={"kind": "attnres_block", "block_size": 2})
    AttnResForCausalLM.from_native(native).save_pretrained(tmp_path)
    ids = torch.randint(0, native.config.vocab_size, (1, 8))
    for cls, given in ((AttnResForCausalLM, {"kind": "attnres_block", "backend": "torch"}),
                       (AutoModelForCausalLM, {"kind": "attnres_block", "backend": "torch"}),
                       (AttnResForCausalLM, {"backend": "torch"})):
        model = cls.from_pretrained(tmp_path, residual=given).eval()
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, native(ids).logits)
        assert model.config.residual["block_size"] == 2 and model.config.residual["backend"] == "torch"
    residual = AttnResForCausalLM.from_pretrained(tmp_path, residual={"block_size": 1}).config.to_model_config().residual
    assert (residual.kind, residual.block_size) == ("attnres_block", 1)
    residual = AttnResForCausalLM.from_pretrained(tmp_path, residual="attnres_full").config.to_model_config().residual
    assert (residual.kind, residual.block_size) == ("attnres_full", 2)


@pytest.mark.parametrize("given, named", [({"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                                             "rope_scaling=.* is an option the AttnRes decoder does not have"),
                                            ({"n_layer": 1}, "unknown field 'n_layer' - did you mean 'n_layers'"),
                                            ({"intermediate_size": 128}, "intermediate_size is the transformers name of "
                                                                         "mlp_hidden")])
def test_from_pretrained_names_a_keyword_that_is_no_field(tmp_path, given, named):
    """A keyword of ``from_pretrained`` that is no config field went on to the model's
    ``__init__``: "unexpected keyword argument 'rope_scaling'", naming neither the field meant
    nor why; it is refused as ``AttnResConfig(...)`` refuses it."""
    from transformers import AutoModelForCausalLM

    AttnResForCausalLM.from_native(native_model()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=named):
        AutoModelForCausalLM.from_pretrained(tmp_path, **given)


def test_a_saved_triton_backend_loads_where_triton_cannot_run(tmp_path):
    """A model trained on a GPU with ``backend="triton"`` and saved with ``save_pretrained``
    stored it; loaded on a CPU, its first forward failed ("backend='triton' runs the Triton
    kernels on CUDA tensors ... use backend='auto'"), which ``from_pretrained`` gave no hint of.
    A stored "triton" is read as "auto" (the Triton kernels on CUDA; here, the logits of the
    model built with the default backend); a "triton" the caller gives is kept, and refused at
    the forward."""
    native = native_model(residual={"kind": "attnres_block", "block_size": 2, "backend": "triton"})
    AttnResForCausalLM.from_native(native).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["residual"]["backend"] == "triton"
    ids = torch.randint(0, native.config.vocab_size, (1, 8))
    model = AttnResForCausalLM.from_pretrained(tmp_path).eval()
    assert model.config.residual["backend"] == "auto" and model.config.residual["block_size"] == 2
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, native_model(residual={"kind": "attnres_block", "block_size": 2})(ids).logits)
    kept = AttnResForCausalLM.from_pretrained(tmp_path, residual={"backend": "triton"}).eval()
    assert kept.config.residual["backend"] == "triton"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return  # (the kernels run on the CPU under the interpreter)
    with pytest.raises(ValueError, match="backend='triton' runs the Triton kernels on CUDA tensors"):
        kept(ids)


def test_exported_tokenizer_renders_chats_as_plain_text(tmp_path):
    """The exported tokenizer carries a chat template (vLLM's /v1/chat/completions needs one):
    one ``role: content`` line per message, then ``assistant: `` to continue; it survives
    save and load."""
    from transformers import AutoTokenizer

    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf import make_hf_tokenizer

    make_hf_tokenizer(ByteTokenizer()).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == "system: be brief\nuser: hi\nassistant: "
    assert tok.apply_chat_template(chat, tokenize=False) == "system: be brief\nuser: hi\n"


def _hf_trainer(model, tmp_path, data, **kwargs):
    """A ``transformers.Trainer`` on CPU for a few steps: plain SGD, constant rate, no logging
    or saving, so two runs differ only in what ``kwargs`` set."""
    from transformers import Trainer, TrainingArguments

    args = dict(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=4, learning_rate=1.0, optim="sgd",
                lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], save_strategy="no", use_cpu=True,
                disable_tqdm=True, logging_steps=1, seed=0)
    return Trainer(model=model, args=TrainingArguments(**{**args, **kwargs}), train_dataset=data)


def _padded_examples(n: int, length: int = 12) -> list[dict]:
    """``n`` examples of ``length`` ids, each padded on the right from its own length on
    (``labels`` -100 and ``attention_mask`` 0 there), so the batches hold different numbers
    of predicted tokens."""
    gen = torch.Generator().manual_seed(0)
    examples = []
    for i in range(n):
        ids = torch.randint(1, 256, (length,), generator=gen)
        real = 3 + (5 * i) % (length - 3)
        examples.append({"input_ids": ids, "labels": ids.masked_fill(torch.arange(length) >= real, -100),
                         "attention_mask": (torch.arange(length) < real).long()})
    return examples


def test_trainer_gradient_accumulation_equals_one_large_batch(tmp_path):
    """``transformers.Trainer`` passes ``num_items_in_batch`` (the predicted tokens of all
    accumulated batches) to a forward that takes ``**kwargs`` and then leaves the loss
    unscaled; the forward ignored it, so with ``gradient_accumulation_steps=2`` the loss and
    the gradients were twice the large batch's. Two batches of 4 accumulated now give the one
    batch of 8's update and loss."""
    native = native_model(residual="attnres_block")
    data = _padded_examples(8)
    runs = []
    for batch, steps in ((8, 1), (4, 2)):
        hf = AttnResForCausalLM.from_native(native)
        trainer = _hf_trainer(hf, tmp_path, data, per_device_train_batch_size=batch, gradient_accumulation_steps=steps,
                              max_steps=1)
        runs.append((trainer.train().training_loss, hf.lm_head.weight.detach() - native.lm_head.weight))
    (loss_one, update_one), (loss_acc, update_acc) = runs
    assert loss_acc == pytest.approx(loss_one, rel=1e-5)
    torch.testing.assert_close(update_acc, update_one, rtol=1e-4, atol=1e-6)


def test_trainer_evaluation_gathers_the_logits_of_a_prefix_tuned_model_and_not_its_cache(tmp_path):
    """PEFT's prefix tuning hands the model a cache, which the output returns; the Trainer's
    evaluation gathers every output but ``keys_to_ignore_at_inference``, which named only
    ``past_key_values``, not transformers' ``cache`` (5.24+): with ``compute_metrics`` the
    evaluation failed ("Unsupported types (DynamicCache) passed to `_pad_across_processes`").
    The metrics now see the logits alone, as they do for transformers' Llama."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(AttnResForCausalLM.from_native(native_model()),
                                peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    data = _padded_examples(4)
    seen = []

    def metrics(prediction):
        seen.append(prediction.predictions)
        return {}

    trainer = _hf_trainer(model, tmp_path, [], per_device_eval_batch_size=2)
    trainer.compute_metrics = metrics
    trainer.evaluate(data)
    assert len(seen) == 1 and not isinstance(seen[0], tuple) and seen[0].shape == (4, 12, 256)


def test_trainer_label_smoothing_shifts_the_labels(tmp_path):
    """``label_smoothing_factor`` makes ``transformers.Trainer`` compute the loss from the
    logits itself, shifting the labels only for a model class it knows as a causal LM; it did
    not know the AttnRes classes, so it scored each position against its own token instead of
    the next one. The loss is now the shifted, smoothed cross-entropy (and is the model's own
    loss when smoothing is 0)."""
    import torch.nn.functional as F

    hf = AttnResForCausalLM.from_native(native_model(residual="attnres_block"))
    batch = {k: torch.stack([e[k] for e in _padded_examples(4)]) for k in ("input_ids", "labels", "attention_mask")}
    trainer = _hf_trainer(hf, tmp_path, [], label_smoothing_factor=0.1)
    with torch.no_grad():
        loss = trainer.compute_loss(hf, dict(batch))
        logits = hf(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), label_smoothing=0.1)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    # The upcycled families' causal LMs are named as such too (the same Trainer check).
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from attnres.hf.families import FAMILIES, upcycled_classes

    assert {upcycled_classes(f)[1].__name__ for f in FAMILIES} <= set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def test_config_dict_carries_the_transformers_names_and_the_saved_file_does_not(tmp_path):
    """Tools that read a config as ``config.to_dict()`` look for the transformers names: PEFT's
    prompt and prefix tuning stopped with "Please specify `num_attention_heads` in
    `peft_config`", and would have sized a prefix with every query head where the keys have
    ``n_kv_heads``. The dict now carries ``num_attention_heads``, ``num_key_value_heads``,
    ``hidden_size`` and ``num_hidden_layers`` (and ``config.num_key_value_heads`` reads), while
    ``config.json`` keeps only the attnres fields and loads back to an equal config."""
    config = AttnResConfig.from_model_config(ModelConfig.preset("tiny", n_heads=4, n_kv_heads=2))
    data = config.to_dict()
    assert (data["num_attention_heads"], data["num_key_value_heads"], data["hidden_size"], data["num_hidden_layers"]) == (
        config.n_heads, config.n_kv_heads, config.d_model, config.n_layers) == (4, 2, 64, 2)
    assert config.num_key_value_heads == 2
    assert AttnResConfig.from_dict(data).to_model_config() == config.to_model_config()
    mha = AttnResConfig.from_model_config(ModelConfig.preset("tiny", n_kv_heads=None))  # as many as n_heads
    assert "num_key_value_heads" not in mha.to_dict()
    assert AttnResConfig.from_dict(mha.to_dict()).to_model_config() == mha.to_model_config()
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not {"num_attention_heads", "num_key_value_heads", "hidden_size", "num_hidden_layers"} & set(saved)
    assert AttnResConfig.from_pretrained(tmp_path).to_model_config() == config.to_model_config()


def test_num_key_value_heads_reads_a_count_where_n_kv_heads_is_none():
    """vLLM reads the transformers name whenever the config has it (``getattr`` over
    ``num_key_value_heads`` and the like): an export of a preset with ``n_kv_heads=None`` (as
    many as ``n_heads``: ``train-cpu``, ``small``, ...) gave None, and ``vllm serve`` stopped
    with a validation error about ``total_num_kv_heads``. The name reads the count now; the
    field, ``to_dict()`` and the saved file keep None, and setting the name sets the field."""
    mha = AttnResConfig.from_model_config(ModelConfig.preset("train-cpu"))
    assert mha.n_kv_heads is None and mha.num_key_value_heads == mha.n_heads == 4
    assert "num_key_value_heads" not in mha.to_dict()
    assert AttnResConfig.from_dict(mha.to_dict()).to_model_config() == mha.to_model_config()
    mha.num_key_value_heads = 2
    assert (mha.n_kv_heads, mha.num_key_value_heads, mha.to_model_config().n_kv_heads) == (2, 2, 2)
    assert AttnResConfig(n_heads=4, num_key_value_heads=1).n_kv_heads == 1
    with pytest.raises(ValueError, match="num_key_value_heads=1 .the HF name of n_kv_heads. contradicts n_kv_heads=2"):
        AttnResConfig(n_heads=4, n_kv_heads=2, num_key_value_heads=1)


@pytest.mark.parametrize("method", ["prompt", "prefix"])
def test_peft_prompt_learning_generates_what_its_forward_predicts(method):
    """PEFT's prompt and prefix tuning look for the cache among the model inputs: peft 0.21
    under ``past_key_values``, peft 0.22 under transformers' name (``cache`` from 5.24). Under
    the wrong name PEFT put its virtual tokens in again at every step (prompt tuning:
    "attention_mask must have shape ... (2, 14), got (2, 11)"; prefix tuning: "pass the cache
    as `cache` or as `past_key_values`, not both") - first with peft 0.21, then with 0.22
    once the cache was renamed for 0.21. Greedy ``generate`` now gives, token by token, the
    argmax of the PEFT model's own forward over the growing sequence (left padding included),
    with the installed peft (CI installs the newest)."""
    peft = pytest.importorskip("peft")
    config = (peft.PromptTuningConfig if method == "prompt" else peft.PrefixTuningConfig)(
        task_type="CAUSAL_LM", num_virtual_tokens=3)
    torch.manual_seed(0)
    model = peft.get_peft_model(AttnResForCausalLM.from_native(native_model(residual="attnres_block")), config).eval()
    with torch.no_grad():
        for p in model.prompt_encoder.parameters():
            p.normal_()  # (prompt tuning's init is the embedding of random tokens; prefix tuning's is random too)
    ids = torch.randint(1, 256, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)[:, -4:]
    seq, seq_mask = ids, mask
    with torch.no_grad():
        for step in range(4):
            nxt = model(input_ids=seq, attention_mask=seq_mask).logits[:, -1].argmax(-1)
            assert torch.equal(out[:, step], nxt), step
            seq, seq_mask = torch.cat([seq, nxt[:, None]], 1), torch.cat([seq_mask, torch.ones_like(mask[:, :1])], 1)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_peft_prefix_tuning_trains_under_the_trainer_s_use_cache_false(checkpointing):
    """``transformers.Trainer`` sets ``config.use_cache = False`` (its ``args.use_cache``);
    PEFT's prefix tuning still hands the model its virtual keys and values as a cache. The
    cache was dropped under ``use_cache=False`` and the first training step failed
    ("attention_mask must be a tensor of shape [batch, past + seq_len] = (4, 46), got (4,
    50)"); a given cache is now read as transformers' models read it, and under activation
    checkpointing read without being written (the recompute would append its keys twice):
    the loss and the prefix's gradients are those of the forward with ``use_cache=True``."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(AttnResForCausalLM.from_native(native_model(residual="attnres_block")),
                                peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)).train()
    ids = torch.randint(1, 256, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.prompt_encoder.parameters() if p.grad is not None]

    reference, reference_grads = loss_and_grads()  # (config.use_cache: True)
    model.base_model.config.use_cache = False  # (what the Trainer does)
    if checkpointing:
        activation_checkpointing(model.base_model, use_reentrant=False)
    loss, grads = loss_and_grads()
    torch.testing.assert_close(loss, reference)
    assert grads and len(grads) == len(reference_grads)
    for grad, expected in zip(grads, reference_grads):
        torch.testing.assert_close(grad, expected)


def test_peft_prefix_tuning_under_a_reentrant_checkpoint_is_refused_naming_the_way_out():
    """A reentrant checkpoint recomputes each sublayer in a backward of its own, and each went
    through the graph that made prefix tuning's cache: "Trying to backward through the graph a
    second time" at the first Trainer step. Refused, naming ``use_reentrant=False``."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(AttnResForCausalLM.from_native(native_model()),
                                peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)).train()
    activation_checkpointing(model.base_model, use_reentrant=True)
    ids = torch.randint(1, 256, (2, 7))
    with pytest.raises(ValueError, match="reentrant activation checkpoint.*'use_reentrant': False"):
        model(input_ids=ids, labels=ids).loss.backward()


def test_a_static_cache_under_activation_checkpointing_is_refused_not_dropped():
    """A cache given to a training forward with activation checkpointing is read (prefix
    tuning's); a ``StaticCache``, whose buffers are mostly empty slots, cannot be read so and
    is refused naming the way out (it was dropped without a word)."""
    from transformers import StaticCache

    model = AttnResForCausalLM.from_native(native_model()).train()
    activation_checkpointing(model, use_reentrant=False)
    ids = torch.randint(1, 256, (1, 5))
    with pytest.raises(ValueError, match="StaticCache cannot be read under activation checkpointing.*DynamicCache"):
        model(input_ids=ids, **{CACHE_ARG: StaticCache(config=model.config, max_cache_len=16)}, use_cache=False)


@pytest.mark.parametrize("option", ["cache_implementation", "assistant_model", "prompt_lookup_num_tokens"])
def test_generation_modes_that_peft_prompt_tuning_cannot_take_are_refused_by_name(option):
    """PEFT puts its virtual tokens in front only of the inputs the dynamic cache's first
    step prepares: a static cache failed inside PEFT ("KeyError: 'cache_position'"), and
    assisted decoding (a draft model, prompt lookup) generated other tokens than greedy
    decoding without a word. They are refused naming the option; LoRA takes them."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(AttnResForCausalLM.from_native(native_model()),
                                peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)).eval()
    value = {"cache_implementation": "static", "assistant_model": AttnResForCausalLM.from_native(native_model(1)).eval(),
             "prompt_lookup_num_tokens": 2}[option]
    with pytest.raises(ValueError, match=f"{option}=.* under PEFT's prompt learning"):
        model.generate(input_ids=torch.randint(1, 256, (1, 6)), max_new_tokens=3, do_sample=False, **{option: value})


def test_inputs_embeds_under_peft_prompt_tuning_are_refused_naming_input_ids():
    """PEFT's ``prepare_inputs_for_generation`` (put on the model for the call) takes no
    ``inputs_embeds``, and transformers refused them saying the model "doesn't have its
    forwarding implemented" - which it has, without PEFT or with LoRA."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(AttnResForCausalLM.from_native(native_model()),
                                peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)).eval()
    embeds = model.get_input_embeddings()(torch.randint(1, 256, (1, 6)))
    with pytest.raises(ValueError, match="inputs_embeds under PEFT's prompt learning.*pass input_ids"):
        model.generate(inputs_embeds=embeds, max_new_tokens=3, do_sample=False)


@pytest.mark.parametrize("prompt", [torch.tensor([3, 4, 5]), [3, 4, 5]])
def test_generate_names_one_prompt_s_ids_given_without_a_batch(prompt):
    """One prompt's ids, 1-D (``tokenizer.encode``'s list, or a tensor of it), failed inside
    transformers' ``generate`` ("IndexError: tuple index out of range"), where the forward
    names the batch dimension: ``generate`` names it too."""
    model = AttnResForCausalLM.from_native(native_model()).eval()
    with pytest.raises(ValueError, match=r"generate: input_ids must be a \[batch, seq_len\] tensor.*a batch of one"):
        model.generate(prompt, max_new_tokens=2, do_sample=False)


def test_generate_given_a_tokenizer_s_output_says_to_unpack_it(tmp_path):
    """``apply_chat_template(..., return_tensors="pt")`` returns a ``BatchEncoding`` in
    transformers 5 (the ids in 4): passed to ``generate`` as the ids, it failed in an
    ``AttributeError`` with no message. ``generate`` names it and ``generate(**inputs)``."""
    model = AttnResForCausalLM.from_native(native_model()).eval()
    tok = make_hf_tokenizer(ByteTokenizer(), model.config.max_seq_len)
    inputs = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    with pytest.raises(ValueError, match=r"got the BatchEncoding of input_ids, attention_mask .*generate\(\*\*inputs"):
        model.generate(inputs, max_new_tokens=2, do_sample=False)
    assert model.generate(**inputs, max_new_tokens=2, do_sample=False).shape == (1, inputs["input_ids"].shape[1] + 2)


def test_early_exit_drafting_is_refused_by_name():
    """transformers' early-exit drafting changes ``config.num_hidden_layers``, which the
    decoder does not read: it failed in "'AttnResForCausalLM' object has no attribute ''"."""
    model = AttnResForCausalLM.from_native(native_model()).eval()
    with pytest.raises(ValueError, match="assistant_early_exit=1: .*assistant_model="):
        model.generate(input_ids=torch.randint(1, 256, (1, 6)), max_new_tokens=3, do_sample=False, assistant_early_exit=1)


def test_peft_lora_merged_generates_what_the_adapted_model_generates():
    """LoRA on the attention projections (non-zero adapters): the merged model's logits are
    the adapted model's, its greedy tokens too, and they differ from the base model's."""
    peft = pytest.importorskip("peft")
    native = native_model(residual="attnres_block")
    config = peft.LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    adapted = peft.get_peft_model(AttnResForCausalLM.from_native(native), config).eval()
    ids = torch.randint(1, 256, (2, 7))
    kw = dict(max_new_tokens=5, do_sample=False)
    with torch.no_grad():
        logits, out = adapted(input_ids=ids).logits, adapted.generate(input_ids=ids, **kw)
        merged = adapted.merge_and_unload()
        assert type(merged) is AttnResForCausalLM
        torch.testing.assert_close(merged(ids).logits, logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(merged.generate(ids, **kw), out)
    assert not torch.equal(AttnResForCausalLM.from_native(native).eval().generate(ids, **kw), out)


def test_an_export_of_an_earlier_version_generates_past_its_line_breaks_and_keeps_them(tmp_path):
    """Earlier versions of ``attnres export`` declared the line break the end-of-sequence and
    padding token: ``attnres generate`` of such a directory stopped at the first line break and
    printed the text without any. It now keeps them, with a warning saying to export again."""
    from transformers import PreTrainedTokenizerFast

    from attnres.hf.directory import load_directory
    from attnres.hf.export import byte_level_tokenizer

    old = tmp_path / "old-export"  # that export's files: eos and pad the line break (byte 10, "Ċ")
    AttnResForCausalLM.from_native(native_model(), eos_token_id=10, pad_token_id=10).save_pretrained(old)
    rust = byte_level_tokenizer()
    PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="Ċ", pad_token="Ċ").save_pretrained(old)
    with pytest.warns(UserWarning, match=r"declares the ordinary token 'Ċ' \(id 10, the text '\\n'\) a special token, "
                                         r"as earlier versions of attnres export did.*export the checkpoint again"):
        _, text = load_directory(old, torch.device("cpu"))
    assert text.stop_ids == ()
    ids = text.encode("one\ntwo")
    assert ids == list(b"one\ntwo") and text.decode(ids) == "one\ntwo"
