"""Exports whose residual is a baseline that cannot be cut into pipeline stages (mHC's several
streams, DenseFormer; models.BASELINES), and an upcycled Llama with mHC, are served on one
stage token for token as ``attnres generate`` (HF ``generate``) - a batch of eight prompts with
chunked prefill, and a shared cached prefix - and refused under pipeline parallelism with the
reason (they were refused on one stage too, with a message about pipeline stages, before the
stream's layout was asked for only when vLLM asks)."""

from __future__ import annotations

import pytest
from conftest import check_batch_and_prefix
from models import BASELINES, SHAPE, UPCYCLED_BASELINES


@pytest.mark.parametrize("name", [*BASELINES, *UPCYCLED_BASELINES])
def test_batch_with_chunked_prefill_and_prefix_caching_are_token_for_token(baselines, name):
    model = baselines[name]
    check_batch_and_prefix(model)
    for ours, ref in zip(model.result()["batch_logprobs"], model.ref_logprobs):
        assert ours == pytest.approx(ref, abs=2e-4)


@pytest.mark.parametrize("name", list(BASELINES))
def test_pipeline_parallelism_is_refused_with_the_reason(name):
    """No engine: the check the model runs when vLLM builds it on more than one stage."""
    from attnres.nn.residual import ResidualConfig, build_residual
    import torch

    from attnres.serve.decoder import empty_stream, stream_keys, uncut_residual

    residual = build_residual(ResidualConfig.from_value(BASELINES[name]), SHAPE["d_model"], 2 * SHAPE["n_layers"])
    assert uncut_residual(residual, 1) is None
    message = uncut_residual(residual, 2)
    assert f"residual {BASELINES[name]['kind']!r} does not describe its history" in message
    assert "drop --pipeline-parallel-size" in message
    with pytest.raises(ValueError, match="cannot be cut into pipeline stages"):
        empty_stream(residual, 1, SHAPE["d_model"])(4, None, None)  # asked for only under pipeline parallelism
    block = build_residual(ResidualConfig.from_value({"kind": "attnres_block", "block_size": 4}), SHAPE["d_model"], 6)
    assert uncut_residual(block, 2) is None
    buffers = empty_stream(block, 1, SHAPE["d_model"])(batch_size=3, dtype=torch.float32, device="cpu")  # vLLM's call
    assert list(buffers.tensors) == stream_keys(block, 2) == ["attnres_completed_0", "attnres_running"]
    assert all(t.shape == (3, SHAPE["d_model"]) and not t.any() for t in buffers.tensors.values())
