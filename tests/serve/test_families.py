"""The other served families - Mistral, Qwen2 (QKV biases), Qwen3 (QK norms), Gemma, Gemma 2
(sandwich norms, soft-capping, sliding windows) - upcycled to Block AttnRes and served on
vLLM's own modules give HF ``generate``'s tokens (slow suite: an engine start each;
``make test-serve PYTEST_ARGS="-m 'slow or not slow'"``)."""

from __future__ import annotations

import pytest
from models import OTHER_FAMILIES


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OTHER_FAMILIES))
def test_family_is_token_for_token(other_families, name):
    model = other_families[name]
    out = model.result()
    assert out["batch"] == model.ref
    assert out["prefix"] == model.ref_prefix
