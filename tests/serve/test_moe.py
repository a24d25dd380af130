"""Upcycled mixtures of experts served on vLLM's own mixture-of-experts blocks (its routers
and fused experts) give HF ``generate``'s greedy tokens, token for token in float32: a batch
of eight prompts of 1 to 70 tokens with chunked prefill (32 tokens a step) and two requests
sharing a cached prefix, random weights with non-zero pseudo-queries. The default suite serves
one model per required family - Qwen3-MoE and OLMoE with ragged Block AttnRes (S = 4 of
L = 6), Mixtral and DeepSeek-V3 (multi-head latent attention, in vLLM's multi-head form) with
Full AttnRes, GPT-OSS (attention sinks, sliding windows, biased router) with Block; the slow
suite the other residual of each and Qwen2-MoE, DeepSeek-V2, GLM-4.5 and Granite MoE with both
(``make test-serve PYTEST_ARGS="-m 'slow or not slow'"``). All models of a suite are served
one after the other by one worker process."""

from __future__ import annotations

import pytest
from conftest import check_batch_and_prefix as check
from models import MOE, MOE_SLOW


@pytest.mark.parametrize("name", list(MOE))
def test_mixture_of_experts_is_token_for_token(moe, name):
    check(moe[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MOE_SLOW))
def test_more_mixtures_of_experts_are_token_for_token(moe_slow, name):
    check(moe_slow[name])
