"""``init_from`` a saved ``transformers`` directory (``save_pretrained``), not a checkpoint:
the weights of a pretrained or upcycled model of a supported family, and its tokenizer.

The run's model must be that directory's (``model.from_hf=DIR`` describes it); the weights
load through ``from_pretrained`` with the run's AttnRes config, so a plain family checkpoint
fills the residual with its faithful init (zero pseudo-queries, unit gains).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..data.tokenizer import TOKENIZER_FILE, BPETokenizer, generation_record, is_marker_token
from ..checkpoint import Source
from ..checkpoint.locate import WEIGHT_READ_ERRORS, refuse_missing_shards, refuse_missing_weights, unreadable_weights
from ..shell_words import shell_path
from ..progress import redraws_in_place, transformers_bars

__all__ = ["hf_source", "load_hf_weights"]

#: The residual's weights in an AttnRes family model's state dict (transformers' missing-key
#: patterns are regular expressions, searched).
RESIDUAL_KEYS = r"^residual\."


def hf_source(path: str | Path) -> Source:
    """``path`` as a start: step 0, and its ``tokenizer.json`` (if any) as the stored tokenizer,
    with the directory's chat template and its special tokens that the vocabulary holds
    (:func:`chat_settings`; the export declares them, and refuses one it lacks), and its
    generation settings (:func:`generation_settings`: end-of-sequence tokens, sampling defaults)."""
    path = Path(path)
    state: dict[str, Any] = {"step": 0, "hf_directory": True, "tokenizer": None}
    if (path / TOKENIZER_FILE).is_file():
        tok = BPETokenizer.load(path / TOKENIZER_FILE)
        chat = {k: v for k, v in chat_settings(path).items() if k == "chat_template"
                or (is_marker_token(tok.backend, v) if k == "pad_token" else tok.backend.token_to_id(v) is not None)}
        state["tokenizer"] = {"kind": "bpe", "file": TOKENIZER_FILE, "vocab_size": tok.vocab_size,
                              "fingerprint": tok.fingerprint, **chat}
        if generation := generation_settings(path, tok):
            state["tokenizer"]["generation"] = generation
    return Source(path, state)


def chat_settings(path: Path) -> dict[str, str]:
    """The chat template (``chat_template.jinja``, or ``tokenizer_config.json``'s) and the
    end-of-sequence, beginning-of-text and padding tokens (``tokenizer_config.json``'s
    ``eos_token``, ``bos_token``: a template may write ``{{ bos_token }}``, ``pad_token``) of
    the transformers directory ``path``, those it has (:data:`attnres.data.tokenizer.CHAT_SETTINGS`)."""
    found: dict[str, str] = {}
    config = _json_object(path / "tokenizer_config.json")
    template = path / "chat_template.jinja"
    if template.is_file():
        found["chat_template"] = template.read_text(encoding="utf-8")
    elif isinstance(config.get("chat_template"), str):
        found["chat_template"] = config["chat_template"]
    for name in ("eos_token", "bos_token", "pad_token"):
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and token:
            found[name] = token
    return found


def generation_settings(path: Path, tok: BPETokenizer) -> dict[str, Any]:
    """The generation settings of the transformers directory ``path`` (its
    ``generation_config.json``) that a tokenizer record keeps
    (:func:`attnres.data.tokenizer.generation_record`): its end-of-sequence ids (one or a list)
    as the tokens of ``tok``'s vocabulary they name (ids beyond it are left out), and its
    sampling defaults; ``{}`` for a directory without that file or with none of them."""
    config = _json_object(path / "generation_config.json")
    ids = config.get("eos_token_id")
    ids = ids if isinstance(ids, list) else [ids]
    eos = [tok.backend.id_to_token(i) for i in ids if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**31]
    return generation_record({**config, "eos_tokens": [t for t in eos if t is not None]})


def _json_object(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``; ``{}`` where there is none (no file, not JSON, not an object)."""
    try:
        found = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _saved_residual_kind(path: Path) -> str | None:
    """The residual kind an AttnRes directory's ``config.json`` names (``attnres_residual``, an
    upcycle's or export's), ``None`` for a plain family directory (or a config that does not read)."""
    residual = _json_object(path / "config.json").get("attnres_residual")
    return residual.get("kind") if isinstance(residual, dict) else None


@contextmanager
def _residual_expected_missing(cls: type) -> Iterator[None]:
    """Within, ``cls.from_pretrained`` takes the residual's weights missing from a directory as
    expected: a plain family directory has none, and the run gives them their faithful init.
    transformers printed its LOAD REPORT of them as MISSING ("Consider training on your
    downstream task"); any other weight missing or unexpected is still reported (and a missing
    one refused, :func:`load_hf_weights`). The class's own patterns are restored after."""
    own = cls.__dict__.get("_keys_to_ignore_on_load_missing")
    had = "_keys_to_ignore_on_load_missing" in cls.__dict__
    cls._keys_to_ignore_on_load_missing = [*(cls._keys_to_ignore_on_load_missing or []), RESIDUAL_KEYS]
    try:
        yield
    finally:
        if had:
            cls._keys_to_ignore_on_load_missing = own
        else:
            del cls._keys_to_ignore_on_load_missing


def load_hf_weights(model, path: str | Path) -> None:
    """Copy the weights saved in ``path`` into ``model`` (an ``AttnRes<Family>ForCausalLM``
    built from the run's config); residual tensors the directory lacks get their faithful
    init. Raises ``ValueError`` when the directory's model is another one."""
    param = next(model.parameters())
    refuse_missing_shards(f"init_from={str(path)!r}", path, "download or copy the model again")
    saved_residual = _saved_residual_kind(Path(path))
    # (an upcycle of the run's residual saved its tensors: missing, they are a damaged copy, not a residual to add)
    holds_residual = saved_residual is not None and saved_residual == (model.config.attnres_residual or {}).get("kind")
    try:  # the run's own class: a plain family directory loads into its AttnRes version
        with transformers_bars(redraws_in_place()), \
                contextlib.nullcontext() if holds_residual else _residual_expected_missing(type(model)):
            # (its "Loading weights" bar: not in a log, as eval has it)
            loaded, loading = type(model).from_pretrained(path, config=model.config, dtype=param.dtype,
                                                          output_loading_info=True)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"init_from={str(path)!r}: its weights do not fit this run's model ({e}); describe the model "
                         f"with model.from_hf={shell_path(path)}") from None
    except WEIGHT_READ_ERRORS as e:
        raise unreadable_weights(f"init_from={str(path)!r}", e, "copy or download the model again") from None
    # (a base model's or a classifier's directory: no LM head, which would start at random)
    missing = {k for k in loading["missing_keys"] if holds_residual or not k.startswith("residual.")}
    refuse_missing_weights(f"init_from={str(path)!r}", path, missing, "give the directory of this run's causal LM, "
                           f"which model.from_hf={shell_path(path)} describes")
    model.load_state_dict(loaded.state_dict())
