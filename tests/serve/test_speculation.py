"""Speculative decoding whose drafter reads token ids only - vLLM's n-gram drafts, and a
draft model (another export) - on an export (Block AttnRes, ragged S): the target verifies several drafted tokens of a sequence
in one forward, keeps the accepted ones and overwrites the KV cache of the rejected ones,
and the greedy tokens stay ``attnres generate``'s, token for token, with their
log-probabilities. The prompts repeat themselves and the model falls into repeats of its own,
so that drafts are proposed, some accepted and more rejected (vLLM's counters). EAGLE-3,
whose drafter reads the depth mixtures, is in test_interfaces.py; the methods refused
without an engine in test_load_errors.py."""

from __future__ import annotations

import pytest
from conftest import NGRAM_MAX_TOKENS, NGRAM_MODEL, NGRAM_PROMPTS, _generate


@pytest.fixture(scope="module")
def reference(model_dirs):
    """``attnres generate``'s greedy tokens and their log-probabilities."""
    return _generate(model_dirs[NGRAM_MODEL], NGRAM_PROMPTS, NGRAM_MAX_TOKENS)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_drafts_keep_attnres_greedy_tokens(speculation, reference, method):
    out, (ref, ref_logprobs) = speculation[method].result(), reference
    for prompt, ours, theirs in zip(NGRAM_PROMPTS, out["batch"], ref):
        assert ours == theirs, f"prompt {prompt!r}: vLLM {ours} != attnres generate {theirs}"
    for ours, theirs in zip(out["batch_logprobs"], ref_logprobs):
        assert ours == pytest.approx(theirs, abs=2e-4)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_drafts_were_accepted_and_rejected(speculation, method):
    """Speculation ran: drafts proposed, some of their tokens accepted (several tokens of a
    sequence verified in one step) and some rejected (their KV entries written over)."""
    counters = speculation[method].result()["spec_decode"]
    assert counters["num_drafts"] > 0, counters
    assert 0 < counters["num_accepted_tokens"] < counters["num_draft_tokens"], counters
