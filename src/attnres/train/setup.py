"""What a training run starts from, before any model exists: the checkpoint it resumes or
whose weights start it (:func:`locate_start`), and its data - tokenizer, sampler, validation
batches (:func:`prepare_run_data`).

Both take ``main_first(fn, shared=False, what=...)``: run ``fn`` on rank 0 first and then on the
other ranks (which may then read what rank 0 wrote: a token cache, checkpoints set aside),
or with ``shared`` give rank 0's result to every rank (the checkpoint to start from: its
files hashed once, not once per rank); in one process it is ``fn()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from ..checkpoint import (CheckpointError, Source, find_valid_checkpoint, is_hf_directory, latest_checkpoint,
                          no_checkpoint_at, remove_partial_checkpoints, set_aside_newer)
from ..checkpoint.manifest import OPTIMIZER_FILE, REPLACED_PREFIX
from ..data import (BatchSampler, TokenData, corpus_fingerprint, earlier_cache_tokenizer, load_corpus, prepare_data,
                   validation_batches)
from ..data.tokenizer import (CHAT_SETTINGS, TOKENIZER_FILE, TOKENIZER_KINDS, Tokenizer, load_tokenizer_file,
                              slow_tokenizer_hint, tokenizer_from_state, tokenizer_state)
from ..distributed.launch import on_every_rank
from ..models.hf_registry import NATIVE_MODEL_TYPE
from .config import TrainConfig
from .hf_source import hf_source
from .resume import check_data, check_progress, refuse_residual_change
from ..user_warning import warn_user
from ..shell_words import shell_path
from ..output_paths import read_json_object

__all__ = ["Start", "RunData", "locate_start", "prepare_run_data", "removed_while_set_up"]

MainFirst = Callable[..., Any]  # (fn, shared=False, what=rank 0's work in words) -> fn()'s result, see above


@dataclass(frozen=True)
class Start:
    """Where a run starts: the checkpoint it continues (``resume``), or the checkpoint or
    ``transformers`` directory whose weights start it (``init``, ``init_from``); neither for
    a new run. ``origin``: the ``init_from`` provenance every checkpoint of the run carries."""

    resume: Source | None = None
    init: Source | None = None
    origin: dict[str, Any] | None = None


def _owns(out_dir: Path, where: Path) -> bool:
    """Whether ``where`` (a run or checkpoint directory) is ``out_dir``'s own."""
    ckpts = (out_dir / "checkpoints").resolve()
    return where.resolve() in (out_dir.resolve(), ckpts) or where.resolve().parent == ckpts


def _as_restored(out_dir: Path, where: Path) -> Path:
    """``where``, or - a ``.old-step-*`` of ``out_dir``'s own checkpoints - the ``step-*`` the
    start renamed it back to (``remove_partial_checkpoints``, before the resume is looked up):
    ``--resume-from RUN/checkpoints/.old-step-X`` into its own run failed in "does not exist"."""
    if where.name.startswith(REPLACED_PREFIX) and where.parent.resolve() == (out_dir / "checkpoints").resolve():
        return where.with_name(where.name[len(REPLACED_PREFIX):])
    return where


def _resume_source(config: TrainConfig, out_dir: Path, main: bool, main_first: MainFirst) -> Source:
    """The newest checkpoint that verifies at ``resume_from`` (or in ``out_dir``); corrupted
    ones in this run's own directory are set aside, with a warning."""
    where = Path(config.resume_from) if config.resume_from is not None else out_dir
    restored = _as_restored(out_dir, where)
    if restored != where and main:
        print(f"attnres train: resuming {restored.name}: the start renamed {where.name} (a step a kill left moved "
              "aside) back to it")
    where = restored
    set_aside = main and _owns(out_dir, where)
    # rank 0 verifies (hashes every file) and sets aside what does not verify; the others take its pick
    source = main_first(lambda: find_valid_checkpoint(where, set_aside=set_aside, resuming=True), shared=True,
                        what="verifying the checkpoint to resume")
    if source is None and config.resume_from is not None:
        raise ValueError(f"resume_from: {no_checkpoint_at(config.resume_from)}")
    if source is None:
        raise ValueError(f"resume=true but {str(where / 'checkpoints')!r} holds no checkpoint: the run has none to "
                         "continue (it stopped before its first, or they were removed); drop --resume to start it anew")
    if (config.resume_from is not None and not _owns(out_dir, where)
            and (own := latest_checkpoint(out_dir)) is not None):
        raise ValueError(f"resume_from={config.resume_from!r} is not a checkpoint of out_dir {str(out_dir)!r}, which "
                         f"holds checkpoints of another run ({own.name} the newest): continuing it there would set those "
                         "aside and cut that run's metrics.jsonl back to the resumed step; continue it into a new "
                         "out_dir, or name one of out_dir's own checkpoints")
    source.run_config()  # a checkpoint without one refused by name (check_progress would assume defaults)
    check_progress(source)
    if config.resume_from is not None and main:
        for moved in set_aside_newer(out_dir, source.step):
            print(f"attnres train: {moved.name}: a later checkpoint than the one resumed from, set aside")
    return source


def _init_source(config: TrainConfig) -> Start:
    """``init_from``: a transformers directory (its model must be this run's) or a checkpoint."""
    if is_hf_directory(config.init_from):
        if config.model.hf_architecture is None:
            raise ValueError(_not_this_run_s_directory(config.init_from))
        source = hf_source(config.init_from)
        refuse_residual_change(source, config.model, config.allow_residual_change)
        return Start(init=source, origin={"transformers_directory": str(source.path), "step": 0})
    # the weights alone are read (a fresh optimiser): a checkpoint shared without its optimiser
    # state starts a run, as attnres generate and export take it
    source = find_valid_checkpoint(config.init_from, optional=(OPTIMIZER_FILE,))
    if source is None:
        raise ValueError(f"init_from: {no_checkpoint_at(config.init_from)}")
    source.run_config()  # a checkpoint without one refused by name
    refuse_residual_change(source, config.model, config.allow_residual_change)
    return Start(init=source, origin={"checkpoint": str(source.path), "step": source.step})


def _not_this_run_s_directory(path: str) -> str:
    """The refusal of ``init_from=path``, a transformers directory, for a run of attnres's own
    model. An export of attnres's own model was told to be given as ``model.from_hf``, which
    refuses it ("train on from its run"): the way is its run, with the run's config."""
    if (read_json_object(Path(path) / "config.json")[0] or {}).get("model_type") == NATIVE_MODEL_TYPE:
        return (f"init_from={path!r} is an `attnres export` of attnres's own model, which init_from and model.from_hf "
                "do not take: train on from its run (or one of its checkpoints) with the run's config, `attnres train "
                "--config RUN/config.json init_from=RUN out_dir=DIR`")
    return f"init_from={path!r} is a transformers directory: its model must be this run's (model.from_hf={shell_path(path)})"


def locate_start(config: TrainConfig, main: bool, main_first: MainFirst) -> Start:
    """The checkpoint to start from: with ``resume`` / ``resume_from`` the newest one that
    verifies; with ``init_from`` the weights to start from. A new run refuses an ``out_dir``
    that holds checkpoints. Rank 0 (``main``) first removes what a crash left half-written."""
    out_dir = Path(config.out_dir)
    if main:
        for partial in remove_partial_checkpoints(out_dir):
            print(f"attnres train: removed {partial.name}, a checkpoint an interrupted run (killed while writing it) "
                  "left half-written")
    if config.resuming:
        source = _resume_source(config, out_dir, main, main_first)
        return Start(resume=source, origin=source.state.get("init_from"))
    if latest_checkpoint(out_dir) is not None:
        raise ValueError(f"{str(out_dir)!r} already holds checkpoints; set resume=true (--resume) to continue, "
                         "--resume-from DIR to continue a given checkpoint, or pick another out_dir")
    return Start() if config.init_from is None else main_first(lambda: _init_source(config), shared=True,
                                                               what="verifying the init_from checkpoint")


@dataclass
class RunData:
    """A run's data: the tokenised splits and tokenizer (``tokens``), the corpus fingerprint,
    the tokenizer as a checkpoint stores it (``tokenizer_meta``, ``tokenizer_files``) and
    where it came from, whether a resumed run continues on changed data
    (``allow_data_change``), the training sampler (at the resumed position) and the
    validation batches."""

    tokens: TokenData
    fingerprint: str
    tokenizer_meta: dict[str, Any]
    tokenizer_files: dict[str, bytes]
    tokenizer_origin: str
    changed: bool
    sampler: BatchSampler
    val_batches: list[Tensor]


def stored_tokenizer(source: Source, requested: str) -> Tokenizer | None:
    """The tokenizer stored with ``source``. A checkpoint of an earlier version stores none:
    it trained with its token cache's, named as that version named it, taken where it is left
    (:func:`~attnres.data.earlier_cache_tokenizer`; a BPE trained again need not be it), else ``None``
    (with a warning: the tokenizer is then made from ``data`` as then). A
    transformers directory without a ``tokenizer.json`` is refused unless ``requested``
    (``data.tokenizer``) names one: its embeddings index its own vocabulary, which a
    tokenizer made from the data does not match (a smaller one trained on it without a word)."""
    meta = source.state.get("tokenizer")
    if meta is None and source.state.get("hf_directory"):
        if requested not in TOKENIZER_KINDS:  # (a tokenizer.json given: the user's choice, checked against the embedding)
            return None
        path = str(source.path)
        raise ValueError(f"init_from={path!r} holds no {TOKENIZER_FILE}: its embeddings index the pretrained model's own "
                         "vocabulary, which a tokenizer made from the data would not match; save the model's tokenizer "
                         "there" + (slow_tokenizer_hint(source.path) or f" (AutoTokenizer.from_pretrained(ORIGINAL)"
                                    f".save_pretrained({path!r}) writes it)") + " or give it as data.tokenizer=PATH")
    if meta is None:
        old = f"{str(source.path)!r} stores no tokenizer (written by an earlier version)"
        trained_on = earlier_cache_tokenizer(source.run_config().get("data") or {}, old)
        if trained_on is None:
            warn_user(f"{old}: making it from the data settings")
        return trained_on
    return tokenizer_from_state(meta, source.path)


def removed_while_set_up(config: TrainConfig, source: Source, resumed: bool) -> Exception:
    """The error, every rank's, for the checkpoint a run starts from (``source``: the one
    resumed, or else ``init_from``'s) removed after it was verified, while its tokenizer,
    weights, optimiser or RNG states were still to be read: a checkpoint of another run, still
    training, whose rotation (``keep_checkpoints``) removed it."""
    key = ("resume_from" if config.resume_from is not None else "resume") if resumed else "init_from"
    return on_every_rank(CheckpointError(
        f"{key}={str(source.path)!r} was removed while this run was set up: its run, still training, keeps only its "
        f"newest checkpoints (keep_checkpoints); start again (of a run directory its newest is taken then), or copy "
        f"a checkpoint aside and {'resume' if resumed else 'start'} from the copy"))


def warn_if_tokenizer_unused(requested: str, given: Tokenizer, source: Source) -> None:
    """Say so when ``data.tokenizer`` asks for a tokenizer other than the one a run started
    from ``source`` keeps (``given``, the one its embeddings were trained with): bytes, or a
    ``tokenizer.json`` that is not it. (The default, ``bpe``, asks for nothing in particular.)"""
    if requested == "bpe" or (requested == "byte" and given.kind == "byte"):
        return
    if requested not in TOKENIZER_KINDS:
        try:
            if load_tokenizer_file(requested, "data.tokenizer").fingerprint == given.fingerprint:
                return
        except ValueError:
            pass  # (unreadable or gone: not used either)
    warn_user(f"data.tokenizer={requested!r} is not used: a run started from {str(source.path)!r} keeps the "
              f"tokenizer stored with it ({given.model_name}, {given.vocab_size} tokens), the one its embeddings were "
              "trained with")


def _source_vocab_size(config: TrainConfig, start: Start) -> int | None:
    """The embedding size of the model a run starts from (``None`` for a new run): a
    checkpoint's, from its config; a transformers directory's, which ``model.from_hf``
    describes (``init_from`` such a directory requires it)."""
    source = start.resume or start.init
    if source is None:
        return None
    if source.state.get("hf_directory"):
        return config.model.vocab_size
    return ((source.state.get("config") or {}).get("model") or {}).get("vocab_size")


def model_vocab_size(config: TrainConfig, start: Start, tokenizer_size: int) -> int:
    """The run's ``model.vocab_size``: the tokenizer's, except that a model started from
    (or resumed with) an embedding padded beyond its tokenizer keeps it. Pretrained models
    often pad it (Qwen2.5 / Qwen3: 151,936 rows, 151,665 tokens); the token ids still come
    from the tokenizer, and the extra rows are never a target."""
    padded = _source_vocab_size(config, start)
    source = start.resume or start.init
    if padded is not None and tokenizer_size > padded and source.state.get("hf_directory"):
        # (else transformers prints its size-mismatch table and the load fails with no word of the cause)
        raise ValueError(f"init_from={str(source.path)!r}: its tokenizer.json has {tokenizer_size} tokens, more than "
                         f"the {padded} rows of its embedding (config.json's vocab_size): the ids from {padded} on "
                         "have no embedding; save a tokenizer.json of at most that many tokens with the model")
    return padded if padded is not None and padded > tokenizer_size else tokenizer_size


def _vocab_size_replaced(config: TrainConfig, start: Start, vocab_size: int, tokenizer_size: int) -> str:
    """Why the ``model.vocab_size`` the user gave is not the run's ``vocab_size``: the
    embedding needs a row per token id of the tokenizer, and has no use for more (but where
    the model started from pads its embedding, whose rows it keeps)."""
    given = f"model.vocab_size={config.model.vocab_size} is replaced by {vocab_size}"
    source = start.resume or start.init
    if vocab_size != tokenizer_size:
        return (f"{given}: the embedding of {str(source.path)!r}, which the run starts from, is padded to {vocab_size} "
                f"rows beyond its tokenizer's {tokenizer_size} tokens, and keeps them")
    how = ("the tokenizer stored with the checkpoint the run starts from" if source is not None
           else "data.tokenizer=byte: one per byte value" if config.data.tokenizer == "byte"
           else f"the BPE of data.vocab_size={config.data.vocab_size} (set that for another size)"
           if config.data.tokenizer == "bpe" else f"data.tokenizer={config.data.tokenizer!r}")
    return (f"{given}, the tokenizer's vocabulary ({how}): the model's embedding has one row per token id, "
            "so its size follows the tokenizer")


def _short_of(asked: int, made: int) -> str:
    """For a BPE made from the data with fewer tokens than ``data.vocab_size`` asked for (a
    small text, where the trainer runs out of pairs to merge), words that say so; else ``""``."""
    return f" (of data.vocab_size={asked}: this text holds no more merges)" if made < asked else ""


def prepare_run_data(config: TrainConfig, start: Start, main_first: MainFirst,
                     vocab_size_given: bool = False) -> tuple[TrainConfig, RunData]:
    """Read and tokenise the corpus (rank 0 first, the others then read its cache) and
    build the sampler and the validation batches. A run that starts from a checkpoint keeps
    that checkpoint's tokenizer; a resumed one checks that the data is the checkpoint's and
    continues at its data position. Returns ``config`` with the model's vocabulary set from
    the tokenizer (or kept where a start's embedding is padded beyond it,
    :func:`model_vocab_size`; the caller's config is left alone), and the data.
    ``vocab_size_given``: the user set ``model.vocab_size`` (a preset's default cannot be
    told from it in ``config``), who is told when it is replaced."""
    # (the text is read only where no token cache recorded these files: a cache hit reads none)
    corpus = load_corpus(config.data.paths, config.data.val_fraction, config.data.text_field, read=False)
    source = start.resume or start.init
    try:
        given = stored_tokenizer(source, config.data.tokenizer) if source is not None else None
    except ValueError:  # (its tokenizer.json gone: "cannot read the stored tokenizer", as if the checkpoint were damaged)
        if source is None or source.state.get("hf_directory") or Path(source.path).exists():
            raise
        raise removed_while_set_up(config, source, resumed=start.resume is not None) from None
    if given is not None:
        warn_if_tokenizer_unused(config.data.tokenizer, given, source)
    changed = start.resume is not None and check_data(start.resume, corpus_fingerprint(corpus, config.data.cache_dir),
                                                      config.allow_data_change)
    # (a resumed run's data position counts the windows of the cache it trained on, where an
    # earlier version's and a current one are both found)
    position = (start.resume.state.get("sampler") or {}) if start.resume is not None and not changed else {}
    windows = position.get("n_windows")
    fits = None if windows is None else lambda train: len(train) // config.seq_len == windows
    # (resumed onto other data, allow_data_change: the checkpoint trained on no cache of it, as a new run)
    tokens = main_first(lambda: prepare_data(corpus, config.data.tokenizer, config.data.vocab_size,
                                             config.data.cache_dir, given=given, progress=config.progress,
                                             bpe_sample=config.data.bpe_sample,
                                             resumed=start.resume is not None and not changed, fits=fits),
                        what="preparing the data: training the tokenizer, tokenising the corpus")
    vocab_size = model_vocab_size(config, start, tokens.vocab_size)
    if vocab_size_given and config.model.vocab_size != vocab_size:
        warn_user(_vocab_size_replaced(config, start, vocab_size, tokens.vocab_size))
    if config.model.vocab_size != vocab_size:
        config = dataclasses.replace(config, model=config.model.replace(vocab_size=vocab_size))
    meta, files = tokenizer_state(tokens.tokenizer)
    if given is not None:  # an instruct model's chat template, end-of-turn token and generation settings stay
        meta.update({k: v for k, v in (source.state.get("tokenizer") or {}).items() if k in (*CHAT_SETTINGS, "generation")})
    sampler = BatchSampler(tokens.train, config.seq_len, config.batch_size, config.seed)
    if start.resume is not None and not changed:
        sampler.load_state_dict(start.resume.state["sampler"])
    # (a tokenizer.json given by path was said to be "made from the data" at start-up, and so
    # were the bytes, which nothing is made from)
    # (and a transformers directory's, of init_from, was said to be "stored in the checkpoint"; so was the one
    # of the token cache an earlier version's checkpoint trained on, which stores none: stored_tokenizer)
    origin = (f"from {str(source.path)!r} (init_from)" if given is not None and source.state.get("hf_directory")
              else "stored in the checkpoint" if given is not None and source.state.get("tokenizer") is not None
              else "from the token cache the checkpoint trained on (it stores none)" if given is not None
              else "one per byte value" if tokens.tokenizer.kind == "byte"
              else "made from the data" + _short_of(config.data.vocab_size, tokens.vocab_size)
              if config.data.tokenizer in TOKENIZER_KINDS
              else f"read from {config.data.tokenizer}")
    data = RunData(tokens, corpus.digest, meta, files, origin, changed, sampler,
                   validation_batches(tokens.val, config.seq_len, config.batch_size, config.eval_batches))
    return config, data
