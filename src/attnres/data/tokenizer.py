"""Tokenizers: a byte-level BPE trained locally with ``tokenizers``, and a plain byte fallback.

Both map text to ids and back losslessly (the BPE runs on bytes, so every string survives
a round trip). :func:`tokenizer_state` / :func:`tokenizer_from_state` store a tokenizer with a
checkpoint (``tokenizer.json`` for the BPE, a marker for bytes) and load it back, and
:attr:`fingerprint` names a tokenizer by its content.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from ..validation import missing_path_hint
from .crossing_cuts import CUTS, AddedTokenMatches, added_token_matches, clean_cuts

TOKENIZER_KINDS = ("bpe", "byte")


class Tokenizer(Protocol):
    """What training and inference need from a tokenizer (what :class:`ByteTokenizer` and
    :class:`BPETokenizer` both have)."""

    kind: str
    vocab_size: int
    fingerprint: str
    #: Whether :meth:`encode` reads the start of a text apart (:attr:`BPETokenizer.marks_text_start`).
    marks_text_start: bool
    #: The kinds of :func:`text_chunks`' cuts it reads apart (:attr:`BPETokenizer.clean_cuts`).
    clean_cuts: tuple[str, ...]
    #: Where its pre-tokenizer splits a text (:attr:`BPETokenizer.pre_token_starts`), or ``None``.
    pre_token_starts: Callable[[str], list[int]] | None
    #: Where its added tokens match a text, not to be cut (:attr:`BPETokenizer.added_tokens`), or ``None``.
    added_tokens: AddedTokenMatches | None

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, on several threads where the tokenizer can."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    @property
    def prefix_ids(self) -> list[int]:
        """The ids its template puts before a text, which :meth:`encode` leaves out
        (:attr:`BPETokenizer.prefix_ids`): a prompt is ``prefix_ids + encode(text)``, as the README
        writes it for :func:`attnres.inference.load_tokenizer`'s tokenizer."""
        ...


#: The text a tokenizer's template (:func:`template_tokens`) is probed with.
TEMPLATE_PROBE = "Hello"

#: Texts cut in two where :func:`text_chunks` cuts (after a line break, before a space) that
#: :attr:`BPETokenizer.marks_text_start` reads apart and whole.
START_PROBES = (("a\n", "b"), ("a", " b"))


def template_tokens(full: list[int], plain: list[int]) -> tuple[list[int], list[int]] | None:
    """``(before, after)``: the ids a tokenizer's template (its post-processor: a Llama's
    ``<s>`` before a text, a T5's ``</s>`` after it) adds around a text, from the text's ids with
    them (``full``) and without (``plain``); ``None`` where ``plain`` is not a run of ``full``
    (the added tokens merged with the text's: no tokenizer known does)."""
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return None


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no training, no dependencies."""

    kind = "byte"
    vocab_size = 256
    fingerprint = "byte"
    model_name = "byte"  # (what a run's summary calls it)
    marks_text_start = False
    clean_cuts = CUTS
    pre_token_starts = None  # (bytes read the same wherever a text is cut)
    added_tokens = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    @property
    def prefix_ids(self) -> list[int]:
        """None: bytes have no beginning-of-text token (:attr:`BPETokenizer.prefix_ids`), so a
        prompt is ``tokenizer.prefix_ids + tokenizer.encode(text)`` with either tokenizer."""
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.vocab_size} tokens)"


class BPETokenizer:
    """A byte-level BPE (``tokenizers``) stored as ``tokenizer.json``."""

    kind = "bpe"

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.fingerprint = "bpe-" + hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.vocab_size} tokens, fingerprint {self.fingerprint[:16]})"

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"cannot read tokenizer file {str(path)!r} (a tokenizer.json of the tokenizers library, "
                             f"as a checkpoint or attnres export holds): {e}") from None

    @classmethod
    def from_json(cls, text: str, source: str = "tokenizer.json") -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            return cls(HFTokenizer.from_str(text))
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(f"cannot read tokenizer {source!r}: {e}") from None

    def to_json(self) -> str:
        """The tokenizer as the text of a ``tokenizer.json``."""
        return self._tok.to_str()

    @property
    def model_name(self) -> str:
        """The ``tokenizers`` model, as a run's summary names it: ``"bpe"``, or for a user's
        ``tokenizer.json`` of another model ``"wordpiece"``, ``"unigram"``, ``"wordlevel"``
        (:attr:`kind` stays ``"bpe"``: how the tokenizer is stored and read, any model)."""
        return type(self._tok.model).__name__.lower()

    @functools.cached_property
    def marks_text_start(self) -> bool:
        """Whether this tokenizer encodes the start of every text it is given apart from the
        same characters inside a text: a SentencePiece-style ``tokenizer.json`` (Llama 2's,
        Mistral v0.1's) puts a "▁" before it (a ``Prepend("▁")`` normalizer; a ``Metaspace``
        pre-tokenizer whose ``prepend_scheme`` is "always" or "first"), a ``ByteLevel`` one with
        ``add_prefix_space`` a space. Each piece of :func:`text_chunks` after the first then reads
        "▁word" where the whole text has "word" (:mod:`attnres.data.piece_ids`). Told from the
        normalizer and pre-tokenizer, at both kinds of cut: the two sides of each
        :data:`START_PROBES` read apart are not what the whole reads. attnres's own BPE does not."""
        return any(self._as_model_reads(a + b) != self._as_model_reads(a) + self._as_model_reads(b)
                   for a, b in START_PROBES)

    @functools.cached_property
    def clean_cuts(self) -> tuple[str, ...]:
        """The kinds of :func:`text_chunks`' cuts (:data:`~attnres.data.crossing_cuts.CUTS`: after
        a line break, before a space) whose two sides this tokenizer reads apart: both for
        attnres's own BPE, GPT-2's, Llama 3's and Qwen's (their pre-tokenizers split there), and
        for a SentencePiece-style one whose pieces hold no line break and a "▁" only at their
        start; only "space" for one whose pieces cross line breaks (a ``Metaspace``
        pre-tokenizer with ``prepend_scheme="never"`` trained on text with line breaks:
        ``"text\\nnext"``). See :func:`~attnres.data.crossing_cuts.clean_cuts`."""
        return clean_cuts(self._tok)

    @functools.cached_property
    def added_tokens(self) -> AddedTokenMatches | None:
        """Where this tokenizer's added tokens (``add_tokens``, its special tokens) match a
        text, which :func:`text_chunks` does not cut inside (a cut in ``"<p>\\n</p>"`` split the
        token in two); ``None`` where it has none a cut can fall inside (attnres's own BPE).
        See :class:`~attnres.data.crossing_cuts.AddedTokenMatches`."""
        return added_token_matches(self._tok)

    @property
    def pre_token_starts(self) -> Callable[[str], list[int]] | None:
        """A function giving the offsets in a text where this tokenizer's pre-tokenizer starts
        a pre-token (GPT-2's: at each change between letters, digits and punctuation), where
        :func:`text_chunks` cuts a text that has no line break or space to cut at (of
        :attr:`clean_cuts`); ``None`` where it has no pre-tokenizer (a Llama 2 ``tokenizer.json``)."""
        pre = self._tok.pre_tokenizer
        if pre is None:
            return None
        return lambda text: [start for _, (start, _) in pre.pre_tokenize_str(text)]

    def _as_model_reads(self, text: str) -> str:
        """``text`` normalized and pre-tokenized as :meth:`encode` does, its pre-tokens joined."""
        if self._tok.normalizer is not None:
            text = self._tok.normalizer.normalize_str(text)
        if self._tok.pre_tokenizer is not None:
            text = "".join(piece for piece, _ in self._tok.pre_tokenizer.pre_tokenize_str(text))
        return text

    @property
    def unknown_token(self) -> tuple[str, int] | None:
        """``(token, id)`` of the token this tokenizer writes for text its vocabulary does not
        cover (a WordPiece's or WordLevel's ``[UNK]``), or ``None`` (a byte-level BPE covers
        every text)."""
        token = getattr(self._tok.model, "unk_token", None)
        token_id = self._tok.token_to_id(token) if isinstance(token, str) else None
        return None if token_id is None else (token, token_id)

    def save(self, path: str | Path) -> None:
        """Write atomically (temporary file, then rename)."""
        tmp = f"{path}.tmp-{os.getpid()}"
        self._tok.save(tmp)
        os.replace(tmp, path)

    def encode(self, text: str) -> list[int]:
        # (no special tokens: a tokenizer.json brought by the user - data.tokenizer=PATH - may
        # add a BOS to every piece of text it is given, which the trained BPE never did)
        return self._tok.encode(text, add_special_tokens=False).ids

    @property
    def prefix_ids(self) -> list[int]:
        """The ids this tokenizer's template puts before every text (the ``<s>`` that a
        transformers model's ``tokenizer.json`` adds; none for attnres's own BPE), which
        :meth:`encode` leaves out: training streams the text without them. The run's export
        encodes a text after them (transformers adds them), and so does the perplexity of
        ``attnres eval`` (:func:`attnres.hf.evaluate.perplexity`), for the run as for its export."""
        split = template_tokens(self._tok.encode(TEMPLATE_PROBE).ids, self.encode(TEMPLATE_PROBE))
        return [] if split is None else split[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # (tokenizers encodes the texts of a batch on its own threads, one text per thread)
        return [encoding.ids for encoding in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))


def text_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids of a text read on its own - a prompt, held-out text: ``tokenizer``'s template's
    tokens before a text (:attr:`BPETokenizer.prefix_ids`, a transformers ``tokenizer.json``'s
    ``<s>``; none for attnres's own tokenizers) and then its ids, as a run's export's tokenizer
    encodes it in transformers, so that ``attnres generate``, ``eval`` and ``analyze`` give a
    run and its export the same ids. (Training streams text without them: :meth:`encode`.)"""
    return [*getattr(tokenizer, "prefix_ids", ()), *tokenizer.encode(text)]


def unknown_share(tokenizer: Tokenizer, ids) -> tuple[str, int, float] | None:
    """``(token, count, share)`` of ``tokenizer``'s unknown token (``[UNK]``: text its
    vocabulary does not cover) among ``ids`` (a list, an array or a tensor of token ids), or
    ``None`` where it has no such token (a byte-level BPE, the byte tokenizer) or ``ids`` hold
    none of it."""
    unknown = getattr(tokenizer, "unknown_token", None)
    if unknown is None or not len(ids):
        return None
    count = ids.count(unknown[1]) if isinstance(ids, list) else int((ids == unknown[1]).sum())
    return (unknown[0], count, count / len(ids)) if count else None


def bpe_available() -> bool:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True


def train_bpe(text: str | Iterable[str], vocab_size: int, progress: bool = False,
              length: int | None = None, sample: int | None = None) -> BPETokenizer:
    """Train a byte-level BPE with (at most) ``vocab_size`` tokens on ``text``, locally.

    ``text``: a string, or its consecutive parts (a corpus's training text streamed from its
    files: :meth:`~attnres.data.corpus.Corpus.train_parts`), of ``length`` characters; the
    trainer reads it in the pieces of :func:`text_chunks`, the same for both. ``sample``:
    train on about that many characters of it only, evenly spaced pieces
    (:func:`sampled_chunks`; ``data.bpe_sample``); ``None``: on all of it.

    The 256 byte symbols are always in the vocabulary, so ``vocab_size`` must be >= 256; a
    small text may stop short of ``vocab_size`` merges (read ``.vocab_size`` afterwards).
    ``progress``: a line saying what runs, then ``tokenizers``' own progress bars (drawn
    on a terminal only).
    """
    if vocab_size < 256:
        raise ValueError(f"data.vocab_size must be >= 256 for the byte-level BPE; got {vocab_size}")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # tokenizers' bars are drawn on a terminal only, but it writes blank lines to stdout
    # anywhere else (a log file, a pipe): ask for them on a terminal only.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress and sys.stdout.isatty() and sys.stderr.isatty(),
    )
    length = len(text) if isinstance(text, str) else length
    chunks = text_chunks(text) if sample is None else sampled_chunks(text, length, sample)
    if progress:
        of = "the training text" if length is None else f"{length:,} characters"
        print(f"training a byte-level BPE of {vocab_size} tokens on "
              f"{of if sample is None else f'a sample of about {sample:,} of {of} (data.bpe_sample)'}", file=sys.stderr)
    run_interruptibly(lambda: tok.train_from_iterator(chunks, trainer=trainer, length=None))
    return BPETokenizer(tok)


def run_interruptibly(fn) -> Any:
    """``fn()`` in a worker thread while this thread waits in short slices, so that Ctrl-C
    (``KeyboardInterrupt``) reaches the caller at once. ``tokenizers`` swallows SIGINT while
    its training runs in the calling thread; here the worker is abandoned on an interrupt
    (a daemon thread: it ends with the process)."""
    if threading.current_thread() is not threading.main_thread():
        return fn()  # signals reach only the main thread: nothing to gain
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result["error"] = e

    worker = threading.Thread(target=work, name="attnres-bpe", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.05)
    if "error" in result:
        raise result["error"]
    return result.get("value")


#: The file name of a stored BPE tokenizer.
TOKENIZER_FILE = "tokenizer.json"


def is_tokenizer_path(value: str) -> bool:
    """Whether a ``data.tokenizer`` value names a file rather than a kind: it ends with
    ``.json`` or holds a ``/`` (so that a misspelt kind, ``bpr``, is not looked for as a file)."""
    return value.endswith(".json") or "/" in value or os.sep in value


def load_tokenizer_file(path: str | Path, what: str) -> BPETokenizer:
    """The tokenizer of the ``tokenizer.json`` that ``path`` names: the file, or the one in a
    directory (a checkpoint's, a transformers tokenizer's); ``ValueError`` naming ``what``
    (the option, e.g. ``--tokenizer``) for a directory without one or a path that does not exist."""
    file = tokenizer_file(path, what)
    try:
        tok = BPETokenizer.load(file)
    except ValueError as e:  # ("cannot read tokenizer file ...": which option named it)
        raise ValueError(f"{what}: {e}") from None
    top = max(tok.backend.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= tok.vocab_size:  # (the model has a row per token: found at the first step, after all the tokenising)
        raise ValueError(f"{what} {str(file)!r} has {tok.vocab_size} tokens but ids up to {top} (its vocabulary "
                         f"skips ids): the model's embedding has a row per token, ids 0 to {tok.vocab_size - 1}; give "
                         "a tokenizer whose ids run without gaps")
    return tok


def tokenizer_file(path: str | Path, what: str) -> Path:
    """The ``tokenizer.json`` that ``path`` names (:func:`load_tokenizer_file`), not read: a
    cheap check that it is there, before any data is read."""
    file = Path(path).expanduser()
    if file.is_dir():
        if not (file / TOKENIZER_FILE).is_file():
            raise ValueError(f"{what} {str(file)!r} is a directory without a {TOKENIZER_FILE}: give a "
                             f"{TOKENIZER_FILE} file, or a directory holding one{slow_tokenizer_hint(file)}")
        file = file / TOKENIZER_FILE
    if not file.is_file():
        raise ValueError(f"{what} {str(file)!r} does not exist{missing_path_hint(file)}: give a {TOKENIZER_FILE} "
                         "file, or a directory holding one")
    return file


#: The files of a transformers tokenizer kept in its "slow" form (GPT-2's BPE files, a
#: SentencePiece or WordPiece model), which ``transformers`` converts to a ``tokenizer.json``.
SLOW_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                        "vocab.txt")


def slow_tokenizer_hint(directory: Path) -> str:
    """For a directory without a ``tokenizer.json`` that holds a transformers tokenizer's slow
    files, how to write the ``tokenizer.json`` (transformers converts them); else ``""``."""
    found = [name for name in SLOW_TOKENIZER_FILES if (directory / name).is_file()]
    if not found:
        return ""
    return (f" ({', '.join(found)}: a transformers tokenizer without its {TOKENIZER_FILE}; transformers writes one: "
            f"python -c \"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained({str(directory)!r})"
            f".save_pretrained({str(directory)!r})\")")


#: What a tokenizer record may carry beside its tokenizer, from a transformers directory a run
#: started from (an instruct model's): its chat template, end-of-turn token, beginning-of-text
#: token (which templates such as Llama 3's and Mistral's write as ``{{ bos_token }}``) and
#: padding token (Qwen3's ``<|endoftext|>``; one of the vocabulary's special tokens only, never
#: ordinary text: :mod:`attnres.hf.export`), which its ``tokenizer.json`` does not hold. Kept
#: through checkpoints and used by ``attnres export`` and ``attnres generate --chat``;
#: attnres's own tokenizers have none.
CHAT_SETTINGS = ("chat_template", "eos_token", "bos_token", "pad_token")

#: The generation settings a tokenizer record may carry (its ``"generation"`` entry) from the
#: ``generation_config.json`` of a transformers directory a run started from: ``eos_tokens``,
#: its end-of-sequence ids as token strings (an instruct model lists several: Qwen3's
#: ``<|im_end|>`` and ``<|endoftext|>``), and the sampling defaults below, each JSON scalar
#: with the values it may take. ``attnres export`` writes them to the export's
#: ``generation_config.json``; ``attnres generate`` stops at every ``eos_tokens`` entry.
GENERATION_DEFAULTS = {
    "do_sample": lambda v: isinstance(v, bool),
    "temperature": lambda v: _number(v) and 0 < v < float("inf"),
    "top_k": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "top_p": lambda v: _number(v) and 0 < v <= 1,
    "min_p": lambda v: _number(v) and 0 <= v <= 1,
    "typical_p": lambda v: _number(v) and 0 < v <= 1,
    "repetition_penalty": lambda v: _number(v) and 0 < v < float("inf"),
}

#: The defaults that only sampling uses: with ``do_sample`` not true, transformers refuses to
#: save a generation config that sets them (greedy decoding ignores them), so they are not kept.
SAMPLING_ONLY = ("temperature", "top_k", "top_p", "min_p", "typical_p")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def generation_record(values: Any) -> dict[str, Any]:
    """Of ``values`` (a ``generation_config.json``'s settings, or a stored record), those
    :data:`GENERATION_DEFAULTS` allows with a value it accepts, and ``eos_tokens`` as a list of
    non-empty strings; the sampling-only ones only where ``do_sample`` is true. Anything else
    (another key, a value out of range, a list or mapping) is left out, so what is kept
    validates where it is written."""
    values = values if isinstance(values, dict) else {}
    kept: dict[str, Any] = {k: v for k, v in values.items() if k in GENERATION_DEFAULTS and GENERATION_DEFAULTS[k](v)}
    if kept.get("do_sample") is not True:
        kept = {k: v for k, v in kept.items() if k not in SAMPLING_ONLY}
    eos = values.get("eos_tokens")
    if isinstance(eos, list) and eos and all(isinstance(t, str) and t for t in eos):
        kept["eos_tokens"] = list(dict.fromkeys(eos))
    return kept


def tokenizer_state(tok: Tokenizer) -> tuple[dict[str, Any], dict[str, bytes]]:
    """How to store ``tok`` with a checkpoint: a JSON-able description (kind, vocabulary
    size, fingerprint, file) and the files to write beside it (``tokenizer.json`` for the
    BPE; none for bytes, whose description is the whole of it)."""
    meta: dict[str, Any] = {"kind": tok.kind, "vocab_size": tok.vocab_size, "fingerprint": tok.fingerprint}
    if isinstance(tok, BPETokenizer):
        meta["file"] = TOKENIZER_FILE
        return meta, {TOKENIZER_FILE: tok.to_json().encode("utf-8")}
    if isinstance(tok, ByteTokenizer):
        return meta, {}
    raise ValueError(f"cannot store a tokenizer of type {type(tok).__name__} (expected BPE or byte)")


def tokenizer_from_state(meta: dict[str, Any], directory: str | Path) -> Tokenizer:
    """The tokenizer that :func:`tokenizer_state` described, read from ``directory``."""
    kind = meta.get("kind") if isinstance(meta, dict) else None
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        path = Path(directory) / meta.get("file", TOKENIZER_FILE)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read the stored tokenizer {str(path)!r}: {e}") from None
        tok = BPETokenizer.from_json(text, str(path))
        if tok.vocab_size != meta.get("vocab_size"):
            raise ValueError(f"the stored tokenizer {str(path)!r} has {tok.vocab_size} tokens, its description says "
                             f"{meta.get('vocab_size')}")
        return tok
    raise ValueError(f"unknown stored tokenizer {meta!r}: expected kind 'bpe' or 'byte'")


def ordinary_tokens_marked_special(tok) -> list[tuple[int, str, str]]:
    """``(id, content, text)`` of every special token of the ``tokenizers.Tokenizer`` ``tok``
    that is ordinary text: it decodes to a ``text`` other than its ``content`` (a byte-level
    stand-in, such as ``"Ċ"`` for the line break) which encodes back to it, as the line break
    that earlier versions of ``attnres export`` declared the end-of-sequence and padding token.
    Markers such as ``<s>`` or ``<|endoftext|>`` decode to themselves and are not listed."""
    found = []
    for token_id, added in sorted(tok.get_added_tokens_decoder().items()):
        if not added.special:
            continue
        text = tok.decode([token_id], skip_special_tokens=False)
        if text and text != added.content and tok.encode(text, add_special_tokens=False).ids == [token_id]:
            found.append((token_id, added.content, text))
    return found


def is_marker_token(tok, content: str) -> bool:
    """Whether ``content`` is a special token of the ``tokenizers.Tokenizer`` ``tok`` that no
    text but itself encodes to: an added special token outside the model's own vocabulary
    (``<|endoftext|>``), not a piece of ordinary text declared special (a ``"the"`` or the
    ``"Ċ"`` of :func:`ordinary_tokens_marked_special`, which a directory's ``tokenizer_config.json``
    names). Such a token may be declared the padding token without any text being lost."""
    added = any(a.special and a.content == content for a in tok.get_added_tokens_decoder().values())
    return added and tok.model.token_to_id(content) is None


#: Where :func:`text_chunks` cuts a text: just after a line break, or else just before a space,
#: with a character other than whitespace on either side - a whitespace run of its own, where
#: byte-level BPEs' pre-tokenizers (GPT-2's, which ``data.tokenizer=bpe`` trains; Llama 3's and
#: Qwen's) split anyway, so the pieces' ids are those of the whole text. A cut inside a longer
#: run (after the first of three line breaks, a line break before an indent) changed them: the
#: run's merged tokens ("\n\n") became several. (Python's whitespace holds the tokenizers'.)
_LINE_CUT = re.compile(r"\n(?<=\S\n)(?=\S)")  # (the literal first: found as fast as str.find)
_SPACE_CUT = re.compile(r" (?<=\S )(?=\S)")


#: How many characters before a last-resort cut of :func:`text_chunks` (2 * size without a
#: clean one) a tokenizer's pre-tokenizer is asked where it splits, and how many after it are
#: read with them (so that a pre-token that ends at the cut is seen to end there).
SPLIT_WINDOW, SPLIT_LOOKAHEAD = 1024, 16


def text_chunks(text: str | Iterable[str], size: int = 1 << 20, splits: Callable[[str], list[int]] | None = None,
                cuts: tuple[str, ...] = CUTS, added: AddedTokenMatches | None = None) -> Iterator[str]:
    """``text`` in consecutive pieces of about ``size`` characters, each ending just after the
    first line break of :data:`_LINE_CUT` (a line break between two characters other than
    whitespace) ``size`` characters or more after its start (the last one at the end of the
    text). Joined, they give ``text`` back. ``text`` may be given as consecutive parts (a
    stream of a corpus): the pieces are those of their join.

    A piece that reaches ``2 * size`` characters with no such line break past ``size`` ends
    just before its first space of :data:`_SPACE_CUT` past ``size`` instead, or at ``2 * size``
    where it has none: a text without line breaks (text8, a dump on one line) was one piece,
    the whole corpus encoded in one call (about 75 bytes of the BPE's memory a character, no
    progress, no Ctrl-C until it ended). Both cuts leave a byte-level BPE's ids as those of
    the whole text (its pre-tokenizer splits there anyway). The last resort, 2 * size
    characters without either, ends at the last place before them where ``splits`` (a
    tokenizer's :attr:`~BPETokenizer.pre_token_starts`) splits the text (:func:`_split_before`),
    or, without one (bytes, a tokenizer without a pre-tokenizer, a run of letters such as CJK
    text that GPT-2's pre-tokenizer does not split), at 2 * size: it may split a word.

    ``cuts``: the kinds of cut taken (a tokenizer's :attr:`~BPETokenizer.clean_cuts`): a text
    encoded by one whose pieces cross line breaks is cut only before a space, else as the last
    resort. ``added``: where a tokenizer's added tokens match (:attr:`~BPETokenizer.added_tokens`):
    no cut falls inside a match (the last resort at 2 * size one inside falls at its start, or
    at the start of the match that holds that start), and a last resort inside the whitespace
    before a match falls at that whitespace's start, or at the end of a match inside it
    (:func:`_out_of_a_run_before_a_match`)."""
    held, start = "", 0  # (the text not yet yielded is held[start:])
    for part in [text] if isinstance(text, str) else text:
        held = held[start:] + part if start < len(held) else part
        start = 0
        while (end := _piece_end(held, start, size, False, splits, cuts, added)) is not None:
            yield held[start:end]
            start = end
    while start < len(held):
        end = _piece_end(held, start, size, True, splits, cuts, added)
        yield held[start:end]
        start = end


def _piece_end(text: str, start: int, size: int, final: bool, splits: Callable[[str], list[int]] | None,
               cuts: tuple[str, ...], added: AddedTokenMatches | None) -> int | None:
    """Where :func:`text_chunks`' piece starting at ``start`` of ``text`` ends, or ``None``
    where that needs more text than ``text`` holds (``final``: the text ends there)."""
    lo, hi = start + size, start + 2 * size
    if added is not None and not final and len(text) < hi + SPLIT_LOOKAHEAD + added.reach:
        return None  # (whether a cut is inside a match is read past it: the pieces of parts are those of their join)

    def clean(at: int) -> bool:
        return added is None or added.holding(text, at) is None

    # (hi + 1: the character after it is seen)
    if "line" in cuts and (line := next((m.end() for m in _LINE_CUT.finditer(text, lo, hi + 1) if clean(m.end())),
                                        None)) is not None:
        return line
    if len(text) <= hi:  # (a line break may come before hi, or the text ends)
        return len(text) if final else None
    if "space" in cuts and (space := next((m.start() for m in _SPACE_CUT.finditer(text, lo, hi + 1)
                                           if clean(m.start())), None)) is not None:
        return space
    if splits is None:
        at = hi
    elif len(text) < hi + SPLIT_LOOKAHEAD and not final:  # (the pieces of parts are those of their join)
        return None
    else:
        at = _split_before(text, lo, hi, splits, clean)
    # (at hi, where no other place was found: back to the start of the match that holds it, and
    # of the one that holds that start - an rstrip token's whitespace may run into the next match)
    while added is not None and (inside := added.holding(text, at)) is not None and inside > start:
        at = inside
    if added is None:
        return at
    return _out_of_a_run_before_a_match(text, start, at, min(hi + SPLIT_LOOKAHEAD, len(text)), added)


def _out_of_a_run_before_a_match(text: str, start: int, at: int, stop: int, added: AddedTokenMatches) -> int:
    """``at``, or, where it is inside a whitespace run (after whitespace) that runs on to a
    match of an added token starting at most at ``stop``, the run's start, or the end of a match
    inside the run (of ``"<br>\\n"``), after ``start``: tokenizers takes the matches out first and
    reads the whitespace before one as one pre-token ("  <br>\\n": "ĠĠ"), where the raw text's
    pre-tokenizer starts one at its last space (" " | " <br"), so a cut there changed the ids (seed
    22, tests/test_chunk_properties.py). The run's start, after a character other than whitespace,
    and a match's end are places where both read the text apart. ``at`` where neither is found.
    (``stop``: the text held past a last-resort cut, so that a text streamed in parts is cut alike.)"""
    if not text[at - 1].isspace():
        return at
    end = at
    while end < stop and text[end].isspace() and not added.starts_at(text, end):
        end += 1
    if end == at or not added.starts_at(text, end):
        return at  # (at a match's start, or the run is followed by text: read apart as it is)
    back = at
    while back - 1 > start and text[back - 1].isspace() and added.holding(text, back - 1) is None:
        back -= 1
    # (stopped at the run's start or at a match's end; else the run reaches back to the piece's start)
    return at if text[back - 1].isspace() and added.holding(text, back - 1) is None else back


def _split_before(text: str, lo: int, hi: int, splits: Callable[[str], list[int]], clean: Callable[[int], bool]) -> int:
    """The last place in ``text`` after ``lo`` and at most ``hi`` where ``splits`` splits it,
    asked of the :data:`SPLIT_WINDOW` characters before ``hi`` and :data:`SPLIT_LOOKAHEAD`
    after, from two starts one character apart: a place both find (a window's first characters
    may be split otherwise than in the whole text: Llama 3's digits, in threes from their
    window's start), and not just after whitespace (GPT-2's pre-tokenizer reads "\\n\\n" before a
    word as "\\n", "\\n" and at a text's end as one "\\n\\n": its lookahead ``\\s+(?!\\S)``),
    nor inside a match of an added token (``clean``); ``hi`` where there is none."""
    first, end = max(lo + 1, hi - SPLIT_WINDOW), hi + SPLIT_LOOKAHEAD
    found = [{begin + k for k in splits(text[begin:end])} for begin in (first, first + 1)]
    return max((k for k in found[0] & found[1] if first + 1 < k <= hi and not text[k - 1].isspace() and clean(k)),
               default=hi)


def sampled_chunks(text: str | Iterable[str], length: int, sample: int, size: int = 1 << 20) -> Iterator[str]:
    """About ``sample`` characters of ``text`` (``length`` characters; a string or its parts),
    as evenly spaced pieces of :func:`text_chunks` (of ``size`` characters, or ``sample``
    where that is less): the piece that holds each of ``k = ceil(sample / size)`` positions
    spaced ``length / k`` apart, from the start. All of the text, in the pieces of
    :func:`text_chunks`, when ``sample >= length``. ``text`` is read through."""
    if sample >= length:
        yield from text_chunks(text, size)
        return
    size = min(size, sample)
    k = -(-sample // size)
    stride, start, j = length / k, 0, 0
    for chunk in text_chunks(text, size):
        end = start + len(chunk)
        if j < k and j * stride < end:
            yield chunk
            while j < k and j * stride < end:
                j += 1
        start = end
