"""A saved transformers directory (``save_pretrained``) for ``attnres generate``: the output of
``attnres export`` or ``attnres upcycle``, or any causal LM that ``AutoModelForCausalLM``
loads once :mod:`attnres.hf` is imported, with the directory's own tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..checkpoint.locate import (WEIGHT_READ_ERRORS, refuse_mismatched_weights, refuse_missing_shards,
                                 refuse_missing_weights, unreadable_weights)
from ..data.tokenizer import TEMPLATE_PROBE, ordinary_tokens_marked_special, template_tokens
from ..user_warning import warn_user

__all__ = ["DirectoryText", "load_directory"]


class DirectoryText:
    """The directory's tokenizer as :func:`attnres.inference.stream_transformers`' caller
    uses one: ``encode`` adds what the tokenizer adds before a text (a Llama's beginning of
    sequence) but not what it appends (a T5-style end of sequence: a prompt would end the
    text before its continuation, and perplexity would also predict that token), ``decode``
    leaves special tokens out, except ordinary text declared special (``ordinary``: the line
    break of earlier versions' exports); ``stop_ids``, the model's end-of-sequence ids (none
    for attnres's exports: their models learnt no end of text)."""

    def __init__(self, tokenizer, stop_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.stop_ids = tokenizer, stop_ids
        self.appended = _appended_count(tokenizer)
        backend = self.backend
        self.ordinary = ordinary_tokens_marked_special(backend) if backend is not None else []
        kept = {token_id for token_id, _, _ in self.ordinary}
        self._skipped = {token_id for token_id, added in backend.get_added_tokens_decoder().items()
                         if added.special and token_id not in kept} if kept else set()

    @property
    def backend(self):
        """The fast tokenizer's ``tokenizers.Tokenizer`` (``None`` for a slow one): a
        byte-level one tells how many bytes a token holds (the perplexity's bits per byte)."""
        return getattr(self.tokenizer, "backend_tokenizer", None)

    def encode(self, text: str) -> list[int]:
        # (verbose=False: no "longer than the maximum length" warning; perplexity cuts windows itself)
        ids = self.tokenizer(text, verbose=False)["input_ids"]
        return ids[: len(ids) - self.appended]

    def decode(self, ids: list[int]) -> str:
        if not self.ordinary:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode([i for i in ids if i not in self._skipped], skip_special_tokens=False)

    def encode_chat(self, message: str) -> list[int]:
        """``message`` as a user's turn through the tokenizer's chat template, ready for the
        assistant's answer (the template's own special tokens; none added on top)."""
        if not self.tokenizer.chat_template:
            raise ValueError("--chat: this directory's tokenizer has no chat template (tokenizer_config.json's "
                             "chat_template, or chat_template.jinja); give the prompt as plain text, without --chat")
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                                  tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _appended_count(tokenizer) -> int:
    """How many special tokens ``tokenizer`` appends after a text (0 for most causal LMs'; 1
    for a ``$A </s>`` template): where a probe's own tokens end in its encoding."""
    split = template_tokens(tokenizer(TEMPLATE_PROBE)["input_ids"],
                            tokenizer(TEMPLATE_PROBE, add_special_tokens=False)["input_ids"])
    return 0 if split is None else len(split[1])  # (None: merged with the text's; no such tokenizer known: keep all)


#: The files a saved tokenizer has one of (``save_pretrained``; older slow tokenizers' vocabularies).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model")


def _refuse_incomplete_weights(where: str, path: str | Path, model: torch.nn.Module, loading: dict) -> None:
    """Raise ``ValueError`` where ``from_pretrained`` (its ``loading`` info) initialised
    tensors the directory lacks - random weights, or an AttnRes residual at zero queries:
    another model than the one saved, run with no more than transformers' load report - or
    left the AttnRes residual's tensors unused (a ``model_type`` of a plain family over an
    upcycled model builds that family without the residual). Other unused tensors pass:
    original checkpoints may hold some the family ignores (DeepSeek-V3's multi-token-prediction
    layer). The vLLM plugin refuses the same (docs/serving.md)."""
    missing = loading["missing_keys"]
    # (the residual's words for a residual's tensors: a plain family's directory lacking its head was told of
    # pseudo-queries and attnres upcycle)
    refuse_missing_weights(where, path, missing, "export or copy the directory again (a residual's pseudo-queries would be "
                           "zero); an original checkpoint under an AttnRes config is attnres upcycle --model DIR --out "
                           "NEW's to convert" if any(name.startswith("residual.") for name in missing) else
                           "export or copy the directory again")
    unused = sorted(name for name in loading["unexpected_keys"] if name.startswith("residual."))
    if unused:
        shown = ", ".join(unused[:3]) + (", ..." if len(unused) > 3 else "")
        raise ValueError(
            f"{where}: its weights hold an AttnRes residual ({shown}), which the model its config.json describes "
            f"({type(model).__name__}, model_type {model.config.model_type!r}) has no place for: the config.json names "
            "a model without it (an edited model_type?); restore its own config.json, or export or copy the directory "
            "again")


def load_directory(path: str | Path, device: torch.device) -> tuple[torch.nn.Module, DirectoryText]:
    """``(model, text)`` of the transformers directory ``path``: the model in eval mode on
    ``device``, and its tokenizer. Raises ``ValueError`` when either does not load, or when
    the weights are not all the model's (:func:`_refuse_incomplete_weights`)."""
    refuse_missing_shards(repr(str(path)), path, "download or copy the directory again")
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                              ignore_mismatched_sizes=True)  # (refused below)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{str(path)!r}: transformers cannot load its model: {e}") from None
    except WEIGHT_READ_ERRORS as e:  # a weights file cut short or damaged, a pickle holding more than tensors
        raise unreadable_weights(repr(str(path)), e, "export or copy the directory again") from None
    refuse_mismatched_weights(repr(str(path)), loading["mismatched_keys"],
                              "restore its own config.json, or export or copy the directory again")
    _refuse_incomplete_weights(repr(str(path)), path, model, loading)
    model = model.eval().to(device)
    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(f"{str(path)!r} holds no tokenizer (no tokenizer.json or tokenizer_config.json): save the "
                         f"model's own there: AutoTokenizer.from_pretrained(ORIGINAL).save_pretrained({str(path)!r}) (attnres "
                         "upcycle and attnres export write it)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(path)!r}: transformers cannot load its tokenizer: {e}") from None
    eos = model.generation_config.eos_token_id
    stop_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    text = DirectoryText(tokenizer, stop_ids)
    if text.ordinary:
        _keep_ordinary_tokens(path, text)
    return model, text


def _keep_ordinary_tokens(path: str | Path, text: DirectoryText) -> None:
    """``text`` stops at none of its ordinary tokens declared special (the line break that
    earlier versions of ``attnres export`` declared the end-of-sequence and padding token:
    generation stopped at the first line break and the text lost every one), with a warning."""
    token_id, content, shown = text.ordinary[0]
    more = f" (and {len(text.ordinary) - 1} more)" if len(text.ordinary) > 1 else ""
    text.stop_ids = tuple(i for i in text.stop_ids if i not in {t for t, _, _ in text.ordinary})
    warn_user(f"{str(path)!r} declares the ordinary token {content!r} (id {token_id}, the text {shown!r}) a special "
              f"token{more}, as earlier versions of attnres export did for the line break: it is kept in the text and "
              f"ends no generation; export the checkpoint again (attnres export --checkpoint RUN --out DIR) to write "
              f"the directory without it")
