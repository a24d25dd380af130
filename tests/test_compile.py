"""``torch.compile(model)`` runs for every variant and matches eager (forward and gradients)."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_rel_close, make_model

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("residual", ["standard", "attnres_full", "attnres_block"])
def test_compiled_model_matches_eager(residual):
    torch._dynamo.reset()
    model = make_model(residual={"kind": residual, "block_size": 3}, n_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    eager = model(ids, labels=ids)
    eager_grads = torch.autograd.grad(eager.loss, list(model.parameters()))
    compiled = torch.compile(model)
    out = compiled(ids, labels=ids)
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    assert_rel_close(out.logits, eager.logits, 1e-5, "logits")
    assert_rel_close(out.loss.reshape(1), eager.loss.reshape(1), 1e-5, "loss")
    for (name, _), g, ge in zip(model.named_parameters(), grads, eager_grads):
        assert_rel_close(g, ge, 1e-4, f"grad of {name}")
    # Input validation still runs in front of the compiled graph.
    with pytest.raises(ValueError, match="outside the vocabulary"):
        compiled(torch.full((1, 3), model.config.vocab_size))
