"""The Python API as a notebook uses it: what a user passes by mistake to ``AttnResLM``, its
forward, the inference functions and the ``attnres.nn`` building blocks is refused at the
boundary, in one message naming the argument and what it takes, instead of deep inside torch."""

from __future__ import annotations

import pytest
import torch

from attnres import AttnResLM, ModelConfig


def tiny_model(**changes) -> AttnResLM:
    torch.manual_seed(0)
    return AttnResLM(ModelConfig.preset("tiny", **changes)).eval()


@pytest.mark.parametrize("config", [{"vocab_size": 256}, "tiny", None])
def test_the_model_takes_a_model_config_and_says_how_to_make_one(config):
    """``AttnResLM({"vocab_size": 256})`` or ``AttnResLM("tiny")`` ended in "'dict' object has
    no attribute 'validate'"."""
    with pytest.raises(TypeError, match=rf"^AttnResLM takes a ModelConfig, got {type(config).__name__}: .*"
                                        r"ModelConfig.preset\(name\)"):
        AttnResLM(config)
