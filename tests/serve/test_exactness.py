"""vLLM serves exported and upcycled AttnRes models exactly: greedy tokens equal
``attnres generate`` (exports) and HF ``generate`` (upcycles) token for token, in float32,
under vLLM's default compile mode, for a batch of eight prompts of different lengths
submitted together with chunked prefill, for two requests sharing a cached prefix, and with
sampling parameters and stop strings. Models: the standard residual, Block AttnRes with
S = 2 and with a ragged S = 4 (L = 6), Full AttnRes; Llama and Gemma 3 (sandwich norms)
upcycled to Block AttnRes. Block (ragged) and Full run in vLLM's default compile mode, the
others eagerly (``COMPILED`` in conftest.py: compiling costs a minute a model)."""

from __future__ import annotations

import pytest
from conftest import COMPILED, MODEL_NAMES, PROMPTS

pytestmark = pytest.mark.parametrize("name", MODEL_NAMES)


def test_compiled_models_run_in_vllms_default_compile_mode(served, name):
    """vLLM compiles Block (ragged S) and Full with its default mode (on CPU: Dynamo traced
    once, inductor); the others run eagerly (enforce_eager)."""
    assert (served[name].result()["compilation_mode"] != "NONE") == (name in COMPILED)


def test_batch_with_chunked_prefill_is_token_for_token(served, name):
    """Eight prompts of 1 to 70 tokens at once, at most 32 tokens per step: long prompts are
    prefilled in chunks beside other requests' decoding."""
    model = served[name]
    got = model.result()["batch"]
    for prompt, ours, ref in zip(PROMPTS, got, model.ref):
        assert ours == ref, f"{name}: prompt {prompt!r}: vLLM {ours} != reference {ref}"


def test_logprobs_match(served, name):
    """The log-probabilities vLLM reports for the greedy tokens are the reference's (float32)."""
    model = served[name]
    for ours, ref in zip(model.result()["batch_logprobs"], model.ref_logprobs):
        assert ours == pytest.approx(ref, abs=2e-4)


def test_prefix_caching_is_token_for_token(served, name):
    """The second request reuses the first one's cached KV blocks of their shared prefix."""
    model = served[name]
    out = model.result()
    assert out["prefix"] == model.ref_prefix
    assert out["prefix_cached_tokens"][1] >= 64, out["prefix_cached_tokens"]


def test_top_k_1_sampling_is_greedy(served, name):
    model = served[name]
    assert model.result()["top_k_1"] == model.ref


def test_stop_string_ends_the_completion(served, name):
    model = served[name]
    stop = model.result()["stop"]
    assert stop["finish_reason"] == "stop" and stop["stop_reason"] == model.stop
    assert stop["ids"] == model.ref[2][: model.stop_index + 1]
