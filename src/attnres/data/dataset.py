"""Token caches (numpy memory maps) and deterministic, resumable batch sampling.

Layout of a cache, beside the data by default::

    <cache_dir>/<digest[:16]>-<kind><vocab>[-cleancut[-incontext][-tokencut]]/
        tokenizer.json      (BPE only)
        train.bin, val.bin  raw token ids, uint16 (uint32 for vocabularies > 65536)
        meta.json           what the .bin files hold; written last, so its presence marks
                            a complete cache

The key (corpus digest, tokenizer kind, requested vocabulary size) changes whenever the
text, the split or the tokenizer request does, so a stale cache is never reused. Data
tokenised with a given tokenizer (a checkpoint's, on resume or ``init_from``; or
``data.tokenizer=PATH``) that differs from the cached one goes to ``<digest[:16]>-<kind><vocab>-<tokenizer fingerprint[-12:]>-cleancut``
(:data:`CUT_SUFFIX`, a BPE's: the pieces the text was tokenised in; ``-cleancut-incontext``,
:data:`CONTEXT_SUFFIX`, for a tokenizer that marks a text's start, whose pieces are read in
context; ``-tokencut``, :data:`TOKEN_CUT_SUFFIX`, last, for one whose pieces cross line breaks).
meta.json also records the keys of the files the cache was made from (see
:mod:`attnres.data.cache_index`): the digest is found there, and the text not read, while
the files are unchanged.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..output_paths import OutputPathError, os_cause
from ..progress import progress_bar
from ..termination import sigterm_raises
from ..user_warning import warn_user
from ..validation import did_you_mean
from .cache_index import record_files, recorded_digest, remove_stale_temporaries, temporary_dir
from .corpus import DOCUMENT_SEPARATOR, TEXT_FIELD, Corpus, is_json_lines, load_corpus
from .crossing_cuts import CUTS
from .piece_ids import pieces_ids
from .tokenizer import (TOKENIZER_KINDS, BPETokenizer, ByteTokenizer, Tokenizer, bpe_available, is_tokenizer_path,
                        load_tokenizer_file, text_chunks, train_bpe, unknown_share)

CACHE_DIRNAME = ".attnres-cache"
# Pieces of text encoded in one call (in parallel by the BPE's own threads, one piece each):
# the cores, at most 8 (each piece's ids are held as a Python list until written: ~35 MB for
# 1 MB of text).
ENCODE_BATCH = max(1, min(8, os.cpu_count() or 1))
FALLBACK_CACHE = Path.home() / ".cache" / "attnres"


@dataclass
class TokenData:
    """The tokenised splits of a run (read-only memory maps) and their tokenizer."""

    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer
    cache_dir: Path

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


def resolve_cache_root(corpus: Corpus, cache_dir: str | None) -> Path:
    """``cache_dir`` if given; else ``.attnres-cache`` beside the data when that directory is
    writable (not for the default corpus inside site-packages); else ``~/.cache/attnres``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    beside = corpus.home / CACHE_DIRNAME
    if "site-packages" not in corpus.home.parts and _writable(beside):
        return beside
    return FALLBACK_CACHE


def _encode_to_file(tok: Tokenizer, text: str | Iterable[str], path: Path, dtype: np.dtype, progress: bool = False,
                    length: int | None = None) -> int:
    """Encode ``text`` (a string, or its consecutive parts: a split streamed from the files,
    of ``length`` characters) piece by piece (the pieces of :func:`text_chunks`, about 1 MB,
    cut after a line break or before a space that ``tok`` reads apart, so memory stays bounded
    for large corpora; :data:`ENCODE_BATCH` of them at a time, on as many threads; each read as
    the text's continuation where the tokenizer marks a text's start:
    :func:`~attnres.data.piece_ids.pieces_ids`) and write the ids to ``path`` atomically, with
    a progress bar over the characters when ``progress``. Returns the number of tokens."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    n = 0
    length = len(text) if isinstance(text, str) else length
    bar = progress_bar(progress, total=length, unit="char", unit_scale=True, desc=f"tokenizing {path.stem}")
    pieces, before = text_chunks(text, splits=tok.pre_token_starts, cuts=tok.clean_cuts, added=tok.added_tokens), ""
    try:
        with tmp.open("wb") as f:
            while batch := list(itertools.islice(pieces, ENCODE_BATCH)):
                for ids in pieces_ids(tok, batch, before):
                    ids = np.asarray(ids, dtype=dtype)
                    ids.tofile(f)
                    n += ids.shape[0]
                before = batch[-1]
                if bar is not None:
                    bar.update(sum(map(len, batch)))
    finally:
        if bar is not None:
            bar.close()
    os.replace(tmp, path)
    return n


def _open_tokens(path: Path, dtype: np.dtype, n: int) -> np.ndarray:
    arr = np.memmap(path, dtype=dtype, mode="r")
    if arr.shape[0] != n:
        raise ValueError(f"token cache {str(path)!r} holds {arr.shape[0]} tokens, its meta.json says {n}; delete the cache directory")
    return arr


def _open_cache(cache: Path, tok: Tokenizer | None) -> TokenData | None:
    """The complete cache ``cache`` (``None`` when absent, or when ``tok`` is given and the
    cache was made with another tokenizer)."""
    meta_path = cache / "meta.json"
    if not meta_path.is_file():
        return None
    try:  # (a damaged meta.json gave "Expecting ',' delimiter" or a KeyError traceback)
        meta = json.loads(meta_path.read_text())
        kind, dtype, n_train, n_val = meta["tokenizer"], np.dtype(meta["dtype"]), int(meta["n_train"]), int(meta["n_val"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"token cache {str(cache)!r} is damaged: its meta.json cannot be read ({type(e).__name__}: "
                         f"{e}); delete that directory, and the cache is made again") from None
    cached: Tokenizer = BPETokenizer.load(cache / "tokenizer.json") if kind == "bpe" else ByteTokenizer()
    if tok is not None and cached.fingerprint != tok.fingerprint:
        return None
    train = _open_tokens(cache / "train.bin", dtype, n_train)
    val = _open_tokens(cache / "val.bin", dtype, n_val)
    return TokenData(train, val, cached, cache)


def _write_cache(corpus: Corpus, cache: Path, tok: Tokenizer, progress: bool = False) -> None:
    """Tokenise both splits with ``tok`` into ``cache``, atomically (a temporary directory
    renamed into place; removed again if anything, Ctrl-C or a SIGTERM included, interrupts it).
    :class:`~attnres.output_paths.OutputPathError` (a ``ValueError``) naming the cache, the
    cause and the fix when it cannot be written (a full disk, a read-only file system)."""
    tmp = temporary_dir(cache)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if isinstance(tok, BPETokenizer):
            tok.save(tmp / "tokenizer.json")
        dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
        n_train = _encode_to_file(tok, corpus.train_parts(), tmp / "train.bin", dtype, progress, corpus.train_length)
        n_val = _encode_to_file(tok, corpus.val, tmp / "val.bin", dtype, progress)
        _warn_unknown_tokens(tok, _open_tokens(tmp / "train.bin", dtype, n_train))
        _warn_unseparated_documents(tok, corpus)
        meta = dict(digest=corpus.digest, tokenizer=tok.kind, vocab_size=tok.vocab_size, dtype=dtype.name,
                    n_train=n_train, n_val=n_val, sources=list(corpus.sources), files=[corpus.files_key])
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if cache.exists():  # another process finished first; its cache is equivalent
            shutil.rmtree(tmp)
        else:
            _publish(tmp, cache)
    except OSError as e:  # (was a traceback, after minutes of tokenising)
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputPathError(f"could not write the token cache {str(cache)!r}: {os_cause(e)}; make room there, or "
                              "set data.cache_dir to a directory that has it") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


#: The share of a training split's tokens that may be the tokenizer's unknown token before
#: :func:`_warn_unknown_tokens` says that the tokenizer does not cover the text.
UNKNOWN_SHARE = 0.01


def _warn_unknown_tokens(tok: Tokenizer, tokens: np.ndarray) -> None:
    """Warn when more than :data:`UNKNOWN_SHARE` of ``tokens`` are ``tok``'s unknown token: a
    tokenizer of another language or script (a WordPiece's ``[UNK]``) turns the text into that
    token, and a model trained on it reaches a low loss predicting it, without a word."""
    unknown = unknown_share(tok, tokens)
    if unknown is not None and unknown[2] > UNKNOWN_SHARE:
        warn_user(f"{unknown[2]:.0%} of the training tokens are the tokenizer's unknown token {unknown[0]!r}: its "
                  "vocabulary does not cover this text (a tokenizer of another language or script?), and the model "
                  "would learn to predict that token; use a tokenizer made for the text (data.tokenizer=bpe trains "
                  "one on it)")


def _warn_no_clean_cut(tok: Tokenizer, name: str) -> None:
    """Warn when ``tok`` (called ``name``) reads none of
    :func:`~attnres.data.tokenizer.text_chunks`' cuts apart
    (:attr:`~attnres.data.tokenizer.BPETokenizer.clean_cuts`: its pieces cross both line breaks
    and spaces): its text is then cut where its pre-tokenizer splits, else every 2 MB, and the
    ids there may not be those of the text as a whole."""
    if not tok.clean_cuts:
        warn_user(f"the tokenizer ({name}) has pieces across line breaks and spaces (a BPE trained without a "
                  "pre-tokenizer?): the token cache cuts the text into pieces of about 1 MB where its pre-tokenizer "
                  "splits, else every 2 MB, and its ids at those cuts may not be those of the text as a whole; a "
                  "tokenizer whose pre-tokenizer splits at spaces or line breaks has none")


def _warn_unseparated_documents(tok: Tokenizer, corpus: Corpus) -> None:
    """Warn when ``corpus`` holds several documents (files, JSON lines) and ``tok`` encodes the
    blank line that joins them (:data:`~attnres.data.corpus.DOCUMENT_SEPARATOR`) as nothing: a
    tokenizer that drops whitespace (a ``Whitespace`` or BERT pre-tokenizer) ran one document
    into the next, with no boundary the model could see, without a word."""
    several = len(corpus.files) > 1 or any(map(is_json_lines, corpus.files))
    if several and not tok.encode(DOCUMENT_SEPARATOR):
        warn_user(f"the tokenizer encodes the blank line that separates documents (files, JSON lines) as no token at "
                  "all (it drops whitespace): each document runs into the next with no boundary the model can see; "
                  "use a tokenizer that keeps line breaks (data.tokenizer=bpe trains one on the text)")


def _publish(tmp: Path, cache: Path) -> None:
    """Rename the complete cache ``tmp`` to ``cache``; where another process renamed its own
    there first (after this one looked), that one stays and ``tmp`` goes."""
    try:
        os.replace(tmp, cache)
    except OSError:
        if not (cache / "meta.json").is_file():  # (not that race: a real failure)
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _recall_digest(corpus: Corpus, root: Path) -> str | None:
    """The digest the caches in ``root`` recorded for ``corpus``'s files, which ``corpus`` then
    takes as its text's (no text read); ``None`` (nothing recalled) when none did, or when
    ``corpus`` is read already."""
    digest = None if corpus.is_read else recorded_digest(root, corpus.files_key)
    if digest is not None:
        corpus.recall(digest)
    return digest


def corpus_fingerprint(corpus: Corpus, cache_dir: str | None = None) -> str:
    """``corpus.digest`` (the data fingerprint a checkpoint records and checks), without
    reading the text where a token cache in ``cache_dir`` (as :func:`prepare_data` resolves
    it) recorded the digest for the same files: see :class:`~attnres.data.corpus.Corpus`."""
    _recall_digest(corpus, resolve_cache_root(corpus, cache_dir))
    return corpus.digest


def prepare_data(corpus: Corpus, tokenizer: str = "bpe", vocab_size: int = 4096, cache_dir: str | None = None,
                 given: Tokenizer | None = None, progress: bool = False, bpe_sample: int | None = None,
                 resumed: bool = False, fits: Callable[[np.ndarray], bool] | None = None) -> TokenData:
    """Tokenise ``corpus`` with the requested tokenizer, reusing a complete cache if present.

    ``tokenizer="bpe"`` trains a byte-level BPE on the *training* split only; when the
    ``tokenizers`` package is missing it falls back to bytes (with a warning). ``"byte"``
    always uses bytes (vocabulary 256; ``vocab_size`` is then ignored). A path (ending with
    ``.json`` or holding a ``/``): that ``tokenizer.json``, or the one in that directory (a
    transformers model's, say; ``vocab_size`` is then ignored).

    ``given``: use this tokenizer (a checkpoint's) instead of making one; the request is then
    ignored. Its cache is the usual one when that was made with the same tokenizer, else one
    keyed by the tokenizer's fingerprint.

    A cache that recorded the corpus's files (unchanged since) is found without reading the
    text; temporary caches of this host's dead processes are removed first.

    ``progress``: show progress bars (stderr) for the work a cache hit skips: training the
    BPE (``tokenizers``' own bars) and tokenising each split.

    ``bpe_sample``: train the BPE on about that many characters of the training split, evenly
    spaced pieces (:func:`~attnres.data.tokenizer.sampled_chunks`), not on all of it; its
    cache is its own (``...-bpe4096-sample<N>``). ``None`` (the default): all of it.

    ``resumed``: ``given`` is the tokenizer of a checkpoint this run resumes on the data it
    trained on, which may have trained on an earlier version's cache of it: that cache is kept,
    with a warning (:func:`_find_cache`). A run not resumed (or resumed onto other data,
    ``allow_data_change``) makes its own instead.

    ``fits``: of a ``resumed`` run, whether a training split holds as many windows as its
    checkpoint's data position counts. A current cache that does not is passed over for an
    earlier version's that does: the run trained on that one, and a new run made the current one
    since (a run started from the same checkpoint).
    """
    if tokenizer not in TOKENIZER_KINDS and not is_tokenizer_path(tokenizer):
        raise ValueError(f"data.tokenizer must be one of {TOKENIZER_KINDS} or a tokenizer.json path; got {tokenizer!r}"
                         f"{did_you_mean(tokenizer, TOKENIZER_KINDS)}")
    by_path = given is None and tokenizer not in TOKENIZER_KINDS
    if by_path:
        given = load_tokenizer_file(tokenizer, "data.tokenizer")
    if given is None and tokenizer == "bpe" and not bpe_available():
        warn_user("the 'tokenizers' package is not installed: falling back to the byte-level tokenizer")
        tokenizer = "byte"
    root = resolve_cache_root(corpus, cache_dir)
    remove_stale_temporaries(root)
    names = functools.partial(_cache_names, tokenizer=tokenizer, vocab_size=vocab_size, given=given,
                              bpe_sample=bpe_sample)
    with sigterm_raises():  # (a SIGTERM, as Ctrl-C, removes the partial cache: see _write_cache)
        found = _find_cache(corpus, root, names, given, resumed, fits)
        if found is not None:
            return found
        cache = root / names(corpus.digest)[-1]
        made = (given if given is not None
                else train_bpe(corpus.train_parts(), vocab_size, progress, corpus.train_length, bpe_sample)
                if tokenizer == "bpe" else ByteTokenizer())
        _warn_no_clean_cut(made, f"data.tokenizer={tokenizer}" if by_path else repr(made))
        _write_cache(corpus, cache, made, progress)
        return _open_cache(cache, given)


#: The end of the caches' names: their text was cut into pieces (:func:`~attnres.data.tokenizer.text_chunks`)
#: where the tokenizer's pre-tokenizer splits anyway, so their ids are those of the whole text.
#: Earlier versions' caches, named without it, cut inside whitespace runs (after the first of
#: three line breaks): a few ids at their cuts differ. A new run does not take them, even one
#: given a tokenizer (``init_from``, ``data.tokenizer=PATH``); a resumed one does, with a warning
#: (:func:`_find_cache`). A BPE's only: bytes' ids are the same wherever the text is cut.
CUT_SUFFIX = "-cleancut"

#: After :data:`CUT_SUFFIX`, for a tokenizer that marks the start of every text it encodes
#: (:attr:`~attnres.data.tokenizer.BPETokenizer.marks_text_start`: a Llama 2 or Mistral v0.1
#: ``tokenizer.json``): its pieces were read as the text's continuation
#: (:mod:`attnres.data.piece_ids`). Earlier versions read each as a text's start, a "▁" at every
#: cut: a new run does not take their caches. Other tokenizers' ids, and names, are unchanged.
CONTEXT_SUFFIX = "-incontext"

#: Last, for a tokenizer that reads some of :func:`~attnres.data.tokenizer.text_chunks`' cuts
#: together (:attr:`~attnres.data.tokenizer.BPETokenizer.clean_cuts`: its pieces cross line
#: breaks, ``"text\nnext"``): its text was cut only where it reads the two sides apart.
#: Earlier versions cut it after line breaks, its ids there not the whole text's: a new run does
#: not take their caches. Other tokenizers' ids, and names, are unchanged.
TOKEN_CUT_SUFFIX = "-tokencut"

#: Last, for a tokenizer with an added token that a line or space cut can fall inside
#: (``tokenizer.add_tokens(["<p>\n</p>"])``, ``"New York"``, one that takes the whitespace beside
#: it: :meth:`~attnres.data.crossing_cuts.AddedTokenMatches.holds_a_cut`): its text is not cut
#: inside a match. Earlier versions cut there, splitting the token in two: a new run does not take
#: their caches. Other tokenizers' names are unchanged: only a last-resort cut, in 2 MB without a
#: line break or space, fell inside their tokens (``"<|endoftext|>"`` written out in the text), as
#: rare as the last-resort cuts that an earlier change moved without renaming caches. So, too, the
#: last-resort cuts that fell inside the whitespace before a match (seed 22 of
#: ``tests/test_chunk_properties.py``), moved to its start without renaming: a cache changes only
#: where such a cut was, whose ids there were not the whole text's.
ADDED_TOKEN_SUFFIX = "-addedcut"

#: Why a cache named without each suffix, an earlier version's, holds ids that are not the
#: whole text's (:func:`_find_cache`'s warning).
_WITHOUT = {
    CUT_SUFFIX: "cut the text into pieces inside whitespace runs: a few of its ids at the cuts (about one piece of "
                "1 MB in a few) are not those of the text as a whole",
    CONTEXT_SUFFIX: "read each piece of the text as the start of a text: this tokenizer marks a text's start (a "
                    "SentencePiece-style '▁'), so its ids at every cut (one each 1 MB) are not those of the text as "
                    "a whole",
    TOKEN_CUT_SUFFIX: "cut the text into pieces after line breaks that this tokenizer's pieces cross (its vocabulary "
                      "holds pieces with a line break inside), so its ids at those cuts are not those of the text as "
                      "a whole",
    ADDED_TOKEN_SUFFIX: "cut the text into pieces inside added tokens of this tokenizer (a line break or space "
                        "inside one, or beside one that takes it), so its ids there read the token as text",
}


def _cache_names(digest: str, tokenizer: str, vocab_size: int, given: Tokenizer | None,
                 bpe_sample: int | None = None) -> list[str]:
    """The caches that hold the corpus of ``digest`` tokenised as asked, in the order they are
    looked for; a new one is made as the last. A BPE trained on a sample (``bpe_sample``) is
    another tokenizer than the one trained on all the text: its cache is named for it."""
    kind = tokenizer if given is None else given.kind
    requested = f"{digest[:16]}-{kind}{vocab_size if kind == 'bpe' else 256}"
    if kind == "bpe" and bpe_sample is not None:
        requested += f"-sample{bpe_sample}"
    cut = CUT_SUFFIX if kind == "bpe" else ""  # (bytes' ids are the same wherever the text is cut)
    if given is not None and given.marks_text_start:
        cut += CONTEXT_SUFFIX
    if given is not None and given.clean_cuts != CUTS:
        cut += TOKEN_CUT_SUFFIX
    if given is not None and given.added_tokens is not None and given.added_tokens.holds_a_cut():
        cut += ADDED_TOKEN_SUFFIX
    if given is None:
        return [requested + cut]
    key_vocab = given.vocab_size if given.kind == "bpe" else 256
    return [requested + cut, f"{digest[:16]}-{given.kind}{key_vocab}-{given.fingerprint[-12:]}{cut}"]


def _find_cache(corpus: Corpus, root: Path, names: Callable[[str], list[str]], given: Tokenizer | None,
                resumed: bool = False, fits: Callable[[np.ndarray], bool] | None = None) -> TokenData | None:
    """The complete cache of ``corpus`` tokenised as asked: by the digest recorded for its
    files (no text read), else by its text's digest (a cache of an earlier version, or files
    copied or touched since: their key is then recorded too); ``None`` when there is none.
    A ``resumed`` run (its tokenizer ``given``: the checkpoint's, whose data position counts the
    windows of the cache it trained on) takes an earlier version's cache of it last, with a
    warning: one named without the latest of its suffixes (:data:`ADDED_TOKEN_SUFFIX`,
    :data:`TOKEN_CUT_SUFFIX`, :data:`CONTEXT_SUFFIX`, then :data:`CUT_SUFFIX`), newest first; or
    before a current one whose training split does not ``fit`` its data position. An earlier
    cache that does not ``fit`` it either is not the one the run trained on: it is left, and the
    current one made again where it was deleted. A new run, even one given a tokenizer
    (``init_from``, ``data.tokenizer=PATH``), makes its own: it trained on none."""
    recorded = _recall_digest(corpus, root)
    found = None if recorded is None else _first_cache(root, names(recorded), given, corpus.files_key)
    if recorded is not None and found is None:
        corpus.read()  # (the recorded caches are gone: the text decides)
    if found is None:
        found = _first_cache(root, names(corpus.digest), given, corpus.files_key)
    if (given is None or given.kind != "bpe" or not resumed
            or found is not None and (fits is None or fits(found.train))):
        return found
    levels = _earlier_names(names(corpus.digest))
    for earlier, lacking in levels:
        older = _first_cache(root, earlier, given, corpus.files_key)
        # (one of other windows than the data position counts: the run did not train on it)
        if older is not None and (fits is None or fits(older.train)):
            why = "; and ".join(_WITHOUT[suffix] for suffix in lacking)
            warn_user(f"token cache {str(older.cache_dir)!r} was made by an earlier attnres, which {why}. It is kept "
                      "for this run, which resumes a checkpoint that may have trained on it; a new run makes its own, "
                      f"named ...{''.join(reversed(levels[-1][1]))}")
            return older
    return found


def earlier_cache(data: Mapping[str, Any]) -> TokenData | None:
    """The complete cache of a run's data tokenised as its settings ask (``data``: the ``data``
    section of its stored config) that an earlier version made, named without the latest of
    the suffixes of :data:`_WITHOUT`, newest first; ``None`` where there is none (or the
    settings ask for no BPE). Its tokenizer is the one a checkpoint that stores none (an earlier
    version's) trained with: training a BPE again need not give it, the earlier version's
    training having read the text cut elsewhere (:data:`CUT_SUFFIX`). Raises ``ValueError``
    where the data is not found (:func:`~attnres.data.corpus.load_corpus`)."""
    if data.get("tokenizer") != "bpe":
        return None
    corpus = load_corpus(data["paths"], data["val_fraction"], data.get("text_field", TEXT_FIELD), read=False)
    root = resolve_cache_root(corpus, data.get("cache_dir"))
    _recall_digest(corpus, root)  # (no text read where a cache recorded these files)
    names = _cache_names(corpus.digest, "bpe", data["vocab_size"], None, data.get("bpe_sample"))
    return next((found for earlier, _ in _earlier_names(names)
                 if (found := _first_cache(root, earlier, None, corpus.files_key)) is not None), None)


def earlier_cache_tokenizer(data: Mapping[str, Any], old: str, hint: str = "") -> Tokenizer | None:
    """The tokenizer of :func:`earlier_cache` of ``data``, said in a warning (``old``: the
    checkpoint that stores none, in words; ``hint``: what the caller offers besides); ``None``
    where no such cache is left, or its data settings or its data cannot be read (the caller
    then makes one from the data settings, or says what is missing)."""
    try:
        trained_on = earlier_cache(data)
    except (KeyError, TypeError, ValueError):
        return None
    if trained_on is None:
        return None
    warn_user(f"{old}: taking the tokenizer of the token cache it trained on, {str(trained_on.cache_dir)!r}{hint}")
    return trained_on.tokenizer


def _earlier_names(names: list[str]) -> list[tuple[list[str], list[str]]]:
    """``names`` (all ending with the same suffixes of :data:`_WITHOUT`) as earlier versions
    named them, with the suffixes they lack: less their last suffix, then less the one before
    it too, ... (the newest first)."""
    levels: list[tuple[list[str], list[str]]] = []
    while (suffix := next((s for s in _WITHOUT if names[0].endswith(s)), None)) is not None:
        names = [name.removesuffix(suffix) for name in names]
        levels.append((names, [*(levels[-1][1] if levels else []), suffix]))
    return levels


def _first_cache(root: Path, names: list[str], given: Tokenizer | None, files_key: str) -> TokenData | None:
    """The first complete cache of ``names`` in ``root``, with ``files_key`` recorded in it."""
    for name in names:
        found = _open_cache(root / name, given)
        if found is not None:
            record_files(found.cache_dir, files_key)
            return found
    return None


class BatchSampler:
    """Deterministic batches of ``[batch_size, seq_len]`` token windows (the model predicts
    every token of a window from the ones before it).

    The training split is cut into non-overlapping windows of ``seq_len`` tokens; every
    epoch visits them in a fresh order drawn from ``numpy.random.default_rng([seed, epoch])``.
    The whole position is one integer, :attr:`samples_drawn`, which the checkpoint stores:
    a sampler rebuilt with the same data, seed and shape and given that state continues
    with exactly the batches the original would have produced.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.n_windows = len(tokens) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"the training split has {len(tokens)} token{'s' * (len(tokens) != 1)}, fewer than seq_len = {seq_len}; lower seq_len, "
                             "or give more text (or a smaller data.val_fraction)")
        self.samples_drawn = 0
        self._epoch = -1
        self._order: np.ndarray | None = None

    def _window(self, k: int) -> int:
        epoch, i = divmod(k, self.n_windows)
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._epoch = epoch
        return int(self._order[i])

    def next_batch(self) -> torch.Tensor:
        """The next ``[batch_size, seq_len]`` int64 batch; advances the position."""
        span = self.seq_len
        rows = []
        for k in range(self.samples_drawn, self.samples_drawn + self.batch_size):
            start = self._window(k) * span
            rows.append(np.asarray(self.tokens[start:start + span], dtype=np.int64))
        self.samples_drawn += self.batch_size
        return torch.from_numpy(np.stack(rows))

    def state_dict(self) -> dict[str, int]:
        return {"samples_drawn": self.samples_drawn, "n_windows": self.n_windows, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("n_windows") != self.n_windows or state.get("seed") != self.seed:
            raise ValueError(
                f"sampler state does not match the data: checkpoint has n_windows={state.get('n_windows')}, "
                f"seed={state.get('seed')}; this run has n_windows={self.n_windows}, seed={self.seed}"
            )
        self.samples_drawn = int(state["samples_drawn"])


def validation_batches(tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int) -> list[torch.Tensor]:
    """Up to ``n_batches`` fixed batches of consecutive ``seq_len`` windows from the start of
    the validation split (the same batches at every evaluation)."""
    span = seq_len
    n_windows = min(len(tokens) // span, batch_size * n_batches)
    if n_windows < 1:
        raise ValueError(f"the validation split has {len(tokens)} token{'s' * (len(tokens) != 1)}, fewer than seq_len = {span}; "
                         "raise data.val_fraction or lower seq_len")
    windows = np.asarray(tokens[: n_windows * span], dtype=np.int64).reshape(n_windows, span)
    return [torch.from_numpy(windows[i:i + batch_size]) for i in range(0, n_windows, batch_size)]
