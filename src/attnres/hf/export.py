"""Training checkpoint -> Hugging Face directory (``attnres export``).

A training checkpoint (``attnres.checkpoint``) holds the weights, the run config and
the tokenizer (checkpoints of earlier versions lack the tokenizer: it is then recovered from
the run's data settings, with a warning), unless a ``tokenizer.json`` is given. The HF
directory gets ``config.json``, ``model.safetensors``, ``generation_config.json`` and the
tokenizer as a ``PreTrainedTokenizerFast``.

End of text: none. Training streams plain text with no special tokens (documents are joined
by a blank line), so the model has no end-of-text token to predict, and declaring an
ordinary one (the line break, as earlier versions did) makes ``generate`` stop at the first
line break. The export sets no ``eos_token``: ``generate`` runs for ``max_new_tokens`` (pass
``stop_strings`` or ``eos_token_id`` to stop earlier). A run started from an instruct model's
directory is the exception: the chat template and end-of-turn token of that directory stay
with its tokenizer through the checkpoints (:data:`attnres.data.tokenizer.CHAT_SETTINGS`), and
its export declares them, so ``generate`` and vLLM stop at the end of a turn again; so do the
end-of-sequence ids and sampling defaults of its ``generation_config.json``
(:data:`attnres.data.tokenizer.GENERATION_DEFAULTS`: Qwen3's ``<|im_end|>`` and
``<|endoftext|>``, its temperature, top-p, top-k), which the export's ``generation_config.json`` holds.

Padding: none either (but an instruct model's own padding token, which its vocabulary holds
as a special token - Qwen3's ``<|endoftext|>`` - is kept, as its end of turn is, in the
tokenizer and in ``generation_config.json``'s ``pad_token_id``: batches pad and finished
sequences fill as with the model the run started from). Every special token of a
``transformers`` tokenizer is an entry of its added vocabulary, and an ordinary token declared special is lost twice: decoding with
``skip_special_tokens=True`` (vLLM's default, for completions, chat and streaming) drops it,
and the text of its stand-in character (``"Ċ"`` for the line break) encodes as that token
instead of its own bytes. Earlier versions declared the line break the padding token, and
served text lost every line break; their tokenizers are refused by the vLLM plugin with
this reason (:func:`attnres.data.tokenizer.ordinary_tokens_marked_special`), and ``attnres generate`` keeps
their line breaks with a warning (:mod:`attnres.hf.directory`). Batched HF calls set a padding id in
memory (``tok.pad_token_id = 0``: padded positions are masked, so which id pads does not
matter). The line break is what lm-evaluation-harness gets as the prefix of rolling
log-likelihoods (``PREFIX_TEXT``, passed as its ``prefix_token_id``): a line break is what
precedes a document in the training stream.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

from ..checkpoint.locate import refuse_training_output
from ..data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, is_marker_token
from ..inference.loading import load_model as load_native_checkpoint  # noqa: F401 - re-exported by attnres.hf
from ..inference.loading import LoadedRun, load_run, load_tokenizer
from ..models import AttnResLM
from ..output_paths import HF_MODEL_FILES, check_output_dir, honour_umask, write_directory_atomically
from .modeling import AttnResForCausalLM

#: The exported tokenizer's chat template: our models learn plain text, so a conversation is
#: rendered as plain text too - one ``role: content`` line per message, then ``assistant: ``
#: to be continued (what ``apply_chat_template`` and vLLM's ``/v1/chat/completions`` use).
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'assistant: ' }}{%- endif %}"
)

#: The text of the token lm-eval gets as its log-likelihood prefix (see the module
#: docstring); neither an end-of-sequence nor a padding token.
PREFIX_TEXT = "\n"


def _byte_stand_ins() -> dict[int, str]:
    """The byte -> character table of byte-level BPE (``tokenizers``' ``ByteLevel``):
    printable Latin-1 bytes stand for themselves, the other bytes for ``chr(256 + k)``."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_level_tokenizer():
    """A ``tokenizers`` tokenizer equal to :class:`ByteTokenizer`: id ``b`` is byte ``b``."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _byte_stand_ins().items()}
    if set(vocab) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("the byte table does not match tokenizers' ByteLevel alphabet")
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def make_hf_tokenizer(tokenizer: Tokenizer, model_max_length: int | None = None, chat_template: str = CHAT_TEMPLATE,
                      eos_token: str | None = None, bos_token: str | None = None,
                      pad_token: str | None = None) -> PreTrainedTokenizerFast:
    """Our tokenizer (BPE or bytes) as a ``PreTrainedTokenizerFast`` with the same ids, no
    special tokens (no end-of-sequence and no padding token: module docstring), padding on
    the left, the plain-text :data:`CHAT_TEMPLATE`, and ``model_max_length`` (the model's
    ``max_seq_len``) when given: every text encodes to our tokenizer's ids, and every id
    decodes to its text. ``eos_token`` / ``bos_token`` / ``pad_token``: an instruct model's end
    of turn, beginning of text and padding, kept from the directory a run started from (its
    chat template may write ``{{ bos_token }}``, which renders empty where none is declared);
    the padding token must be one of the vocabulary's special tokens (module docstring)."""
    if isinstance(tokenizer, BPETokenizer):
        rust = tokenizer.backend
    elif isinstance(tokenizer, ByteTokenizer):
        rust = byte_level_tokenizer()
    else:
        raise ValueError(f"cannot convert a tokenizer of type {type(tokenizer).__name__} (expected BPE or byte)")
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    # Left padding: a batch of prompts padded on the right would have ``generate`` continue
    # each short prompt after its padding.
    kept = (("eos_token", eos_token, "end-of-sequence"), ("bos_token", bos_token, "beginning-of-text"),
            ("pad_token", pad_token, "padding"))
    for name, token, what in kept:
        if token is not None:
            if rust.token_to_id(token) is None:
                raise ValueError(f"the {what} token {token!r} is not in the tokenizer's vocabulary")
            extra[name] = token
    if pad_token is not None and not is_marker_token(rust, pad_token):
        raise ValueError(f"the padding token {pad_token!r} is ordinary text, not one of the vocabulary's special tokens: "
                         "declared special, it would be dropped from decoded text")
    return PreTrainedTokenizerFast(tokenizer_object=rust, clean_up_tokenization_spaces=False,
                                   chat_template=chat_template, padding_side="left", **extra)


def check_export_target(out_dir: str | Path) -> Path:
    """``out_dir`` as a place :func:`export_checkpoint` may write (``ValueError`` naming why
    not: a file in the way, read-only, a training run's directory), checked before the model
    loads."""
    out = check_output_dir(out_dir)
    refuse_training_output(out)
    return out


def export_checkpoint(checkpoint: str | Path | LoadedRun, out_dir: str | Path, tokenizer_path: str | None = None,
                      tokenizer: Tokenizer | None = None) -> Path:
    """Write the checkpoint (a path, or a run :func:`load_run` loaded, its model as it is) as
    a Hugging Face directory loadable with
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` and ``AutoTokenizer.from_pretrained``.
    An existing ``out_dir`` keeps its other files, but the files of a model it held that the
    export does not overwrite (its shards and their index, its tokenizer's other files:
    :data:`attnres.output_paths.HF_MODEL_FILES`) are removed, with a warning naming them.
    Raises ``ValueError`` (before any work) when ``out_dir`` cannot be written (a file in
    the way, a read-only file system), and when writing it fails. ``tokenizer``: the one
    :func:`load_tokenizer` gave for the run and ``tokenizer_path`` already, not read again from
    the checkpoint, which a run still training may have deleted since (``keep_checkpoints``)."""
    out = check_export_target(out_dir)
    run = checkpoint if isinstance(checkpoint, LoadedRun) else load_run(checkpoint)
    model = run.model
    if tokenizer is None:
        tokenizer = load_tokenizer(run, tokenizer_path)  # refuses a vocabulary that is not the model's
    # (a run started from an instruct model keeps its chat template and end of turn; the tokenizer's own only)
    chat = run.chat_settings() if tokenizer_path is None else {}
    native = isinstance(model, AttnResLM)  # else model.hf_architecture: already a transformers model
    hf_tok = make_hf_tokenizer(tokenizer, model.config.max_seq_len if native else model.config.max_position_embeddings,
                               **chat)
    hf = AttnResForCausalLM.from_native(model, eos_token_id=None, pad_token_id=None) if native else model
    # (and its generation_config.json's end-of-sequence ids and sampling defaults; attnres's own runs have none)
    stops = run.stop_ids(tokenizer) if tokenizer_path is None else ()
    hf.generation_config.eos_token_id = (stops[0] if len(stops) == 1 else list(stops)) if stops else None
    # (an instruct model's padding token, a special one; else none, and generate pads nothing: no end of text)
    hf.generation_config.pad_token_id = hf_tok.pad_token_id
    for name, value in (run.sampling_defaults() if tokenizer_path is None else {}).items():
        setattr(hf.generation_config, name, value)

    def write(staging: Path) -> None:
        hf.save_pretrained(staging)
        hf_tok.save_pretrained(staging)
        honour_umask(staging.glob("*.safetensors"))
        if not (staging / "config.json").is_file():
            raise ValueError(f"writing the Hugging Face directory {str(out)!r} failed: no config.json was written")

    # (a disk that filled up since the check: nothing half-written; the weights of a model that
    # was there go, as its shards would be read beside the new file)
    return write_directory_atomically(out, write, weights=HF_MODEL_FILES)
