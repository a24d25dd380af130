"""Tensor parallelism through vLLM's parallel layers: Block AttnRes served on two ranks (one
core each; vLLM-CPU needs the binding ``VLLM_CPU_OMP_THREADS_BIND="0|1"``) gives the tokens
of ``attnres generate``. The attention and MLP projections are sharded; the residual is
replicated and mixes the full hidden state every rank holds after the row-parallel reduce."""

from __future__ import annotations

import pytest
from conftest import TP_MODEL


def test_tensor_parallel_is_token_for_token(tensor_parallel, served):
    if tensor_parallel is None:
        pytest.skip("needs two cores to bind the two ranks to")
    out = tensor_parallel.result()
    model = served[TP_MODEL]
    assert out["batch"] == model.ref
    assert out["prefix"] == model.ref_prefix
    assert out["batch_logprobs"] == [pytest.approx(ref, abs=2e-4) for ref in model.ref_logprobs]
