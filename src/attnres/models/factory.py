"""The one place a ``ModelConfig`` becomes a model, for training and loading alike."""

from __future__ import annotations

from torch import nn

from .config import ModelConfig, require_model_config
from .hf_registry import hf_hook
from .lm import AttnResLM

__all__ = ["build_model", "context_limit", "check_tokenizer_ids", "embedding_rows"]


def build_model(config: ModelConfig) -> nn.Module:
    """The freshly initialised model ``config`` describes: an :class:`AttnResLM`, or with
    ``hf_architecture`` a ``transformers`` family's AttnRes causal LM
    (:mod:`attnres.hf.families`, found through :mod:`.hf_registry`; needs ``transformers``),
    on the default device."""
    require_model_config(config, "build_model")
    if config.hf_architecture is None:
        return AttnResLM(config)
    return hf_hook("build_model")(config)


def context_limit(model: nn.Module) -> int:
    """The most positions ``model`` (what :func:`build_model` gives) attends over: an
    :class:`AttnResLM`'s ``max_seq_len``, a transformers model's ``max_position_embeddings``."""
    config = model.config
    return config.max_seq_len if isinstance(model, AttnResLM) else config.max_position_embeddings


def embedding_rows(model: nn.Module) -> int:
    """How many token ids ``model``'s input embedding has rows for."""
    # (a transformers model's embedding may have more rows than its config's vocab_size says)
    embedding = getattr(model, "get_input_embeddings", None)
    return embedding().num_embeddings if embedding is not None else model.config.vocab_size


def check_tokenizer_ids(model: nn.Module, ids: list[int], what: str) -> None:
    """Refuse token ids of ``what`` (the text a tokenizer encoded for ``model``) past the
    model's embedding rows: a tokenizer with more tokens than the model (not its own), which a
    transformers model's embedding meets with an ``IndexError`` deep in its forward."""
    rows = embedding_rows(model)
    top = max(ids, default=-1)
    if top >= rows:
        raise ValueError(f"{what}: its tokenizer gives token id {top}, outside the model's vocabulary [0, {rows}) "
                         "(its embedding's rows): the tokenizer is not this model's")
