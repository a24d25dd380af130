"""Pipeline parallelism: native Block AttnRes (S = 4 of L = 6) and, in the slow suite, an
upcycled Llama (the same residual) served on two stages (one core each) give the tokens of
``attnres generate`` / HF ``generate``. The first stage holds one decoder layer, the second
two: the cut falls inside the first block, so the residual stream crosses as the embedding
and the block's partial sum (``attnres.serve.decoder.stream_keys``)."""

from __future__ import annotations

import pytest
from conftest import PP_MODEL, PP_MODEL_SLOW


def _check(result, model) -> None:
    if result is None:
        pytest.skip("needs two cores to bind the two stages to")
    out = result.result()
    assert out["pipeline_parallel_size"] == 2
    assert out["batch"] == model.ref
    assert out["prefix"] == model.ref_prefix
    assert out["batch_logprobs"] == [pytest.approx(ref, abs=2e-4) for ref in model.ref_logprobs]


def test_pipeline_parallel_native_is_token_for_token(pipeline_parallel, served):
    _check(pipeline_parallel, served[PP_MODEL])


@pytest.mark.slow
def test_pipeline_parallel_upcycled_is_token_for_token(pipeline_parallel_slow, served):
    _check(pipeline_parallel_slow, served[PP_MODEL_SLOW])
