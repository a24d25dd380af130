"""``init_from`` a saved ``transformers`` directory (``save_pretrained``), not a checkpoint:
the weights of a pretrained or upcycled model of a supported family, and its tokenizer.

The run's model must be that directory's (``model.from_hf=DIR`` describes it); the weights
load through ``from_pretrained`` with the run's AttnRes config, so a plain family checkpoint
fills the residual with its faithful init (zero pseudo-queries, unit gains).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..data.tokenizer import TOKENIZER_FILE, BPETokenizer
from ..checkpoint import Source

__all__ = ["hf_source", "load_hf_weights"]


def hf_source(path: str | Path) -> Source:
    """``path`` as a start: step 0, and its ``tokenizer.json`` (if any) as the stored tokenizer."""
    path = Path(path)
    state: dict[str, Any] = {"step": 0, "hf_directory": True, "tokenizer": None}
    if (path / TOKENIZER_FILE).is_file():
        tok = BPETokenizer.load(path / TOKENIZER_FILE)
        state["tokenizer"] = {"kind": "bpe", "file": TOKENIZER_FILE, "vocab_size": tok.vocab_size,
                              "fingerprint": tok.fingerprint}
    return Source(path, state)


def load_hf_weights(model, path: str | Path) -> None:
    """Copy the weights saved in ``path`` into ``model`` (an ``AttnRes<Family>ForCausalLM``
    built from the run's config); residual tensors the directory lacks get their faithful
    init. Raises ``ValueError`` when the directory's model is another one."""
    param = next(model.parameters())
    try:  # the run's own class: a plain family directory loads into its AttnRes version
        loaded = type(model).from_pretrained(path, config=model.config, dtype=param.dtype)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"init_from={str(path)!r}: its weights do not fit this run's model ({e}); describe the model "
                         f"with model.from_hf={path}") from None
    model.load_state_dict(loaded.state_dict())
