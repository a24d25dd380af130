"""``attnres eval``: perplexity and bits per byte on held-out text, and lm-evaluation-harness
through its Hugging Face adapter (``model="hf"``) on local task files.

Local tasks (written into a temporary directory with their data; nothing is downloaded):

``attnres_ppl``
    rolling log-likelihood of held-out documents (``loglikelihood_rolling``): word and byte
    perplexity and bits per byte, as the harness's ``wikitext`` task reports them.
``attnres_cloze``
    multiple-choice cloze: the first words of a held-out passage, and as choices its true
    continuation and the continuations of three other passages (accuracy, and accuracy
    normalised by length); chance is 25 %.

Standard harness tasks (``hellaswag``, ``lambada_openai``, ...) are names too; they need the
network to fetch their data sets (see ``docs/hf.md``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import random
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from ..data.dataset import UNKNOWN_SHARE
from ..data.tokenizer import ByteTokenizer, Tokenizer, text_ids, unknown_share
from ..progress import progress_bar
from ..user_warning import warn_user
from ..validation import did_you_mean_each
from ..models import AttnResLM
from ..models.factory import check_tokenizer_ids, context_limit, embedding_rows

LOCAL_TASKS = ("attnres_ppl", "attnres_cloze")
CLOZE_CHOICES = 4
CLOZE_WORDS = 8


#: Tokens per forward pass of :func:`perplexity`: short windows go through the model together.
PERPLEXITY_BATCH_TOKENS = 4096


@torch.inference_mode()
def perplexity(model: nn.Module, tokenizer: Tokenizer, text: str, seq_len: int | None = None,
               progress: bool = False) -> dict:
    """Next-token loss of ``model`` (an ``AttnResLM`` or a transformers causal LM) on ``text``
    in windows of ``seq_len + 1`` tokens that overlap by one, so every token but the first is
    predicted exactly once (from at most ``seq_len`` tokens of context). A run's tokenizer's
    ``text`` starts with the tokens its template puts before a text (:attr:`~attnres.data.tokenizer.BPETokenizer.prefix_ids`:
    a ``<s>``, which then predicts the text's first token), as the run's export encodes it, so
    that a run and its export give the same perplexity. Windows of the same
    length run in batches of about :data:`PERPLEXITY_BATCH_TOKENS` tokens (one token of
    context per window would otherwise be one forward pass per token); ``progress``: a bar
    over the tokens.

    Returns ``tokens`` (predicted), ``bytes`` (UTF-8 bytes of the predicted text),
    ``loss`` (nats per token), ``perplexity`` and ``bits_per_byte``
    (total nats / ln 2 / bytes).
    """
    limit = context_limit(model)
    seq_len = seq_len or limit
    # (its config's name for the context)
    check_window(seq_len, limit, "max_seq_len" if isinstance(model, AttnResLM) else "max_position_embeddings")
    ids = text_ids(tokenizer, text)
    check_tokenizer_ids(model, ids, "the held-out text")
    if len(ids) < 2:
        raise ValueError(f"the held-out text has {len(ids)} token{'' if len(ids) == 1 else 's'}: at least 2 are needed "
                         "(the first is only read)")
    unknown = unknown_share(tokenizer, ids)  # (a WordLevel or WordPiece tokenizer's [UNK])
    if unknown is not None and unknown[2] > UNKNOWN_SHARE:
        warn_user(f"{unknown[2]:.0%} of the held-out text's tokens are the tokenizer's unknown token {unknown[0]!r}: "
                  "its vocabulary does not cover that text, and the perplexity measures predicting the unknown token "
                  "in its place")
    device = next(model.parameters()).device
    windows = [ids[s : s + seq_len + 1] for s in range(0, len(ids) - 1, seq_len)]
    full = [w for w in windows if len(w) == seq_len + 1]
    per_batch = max(1, PERPLEXITY_BATCH_TOKENS // seq_len)
    batches = [full[i : i + per_batch] for i in range(0, len(full), per_batch)]
    batches += [[w] for w in windows if len(w) != seq_len + 1]  # the last window, when shorter
    total = 0.0
    bar = progress_bar(progress, total=len(ids) - 1, unit="token", unit_scale=True, desc="perplexity")
    for batch in batches:
        x = torch.tensor(batch, device=device)
        logits = model(x[:, :-1]).logits.float()
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum"))
        if bar is not None:
            bar.update(x[:, 1:].numel())
    if bar is not None:
        bar.close()
    n_tokens = len(ids) - 1
    n_bytes = len(text.encode("utf-8")) - _token_bytes(tokenizer, ids[0])
    return {
        "tokens": n_tokens,
        "bytes": n_bytes,
        "loss": total / n_tokens,
        "perplexity": math.exp(total / n_tokens),
        "bits_per_byte": total / math.log(2) / n_bytes,
    }


def check_window(seq_len: int, limit: int, field: str) -> None:
    """Refuse a perplexity window ``seq_len`` (``--seq-len``) outside ``[1, limit]``, the
    model's context, which its config names ``field``: by :func:`perplexity`, and by
    ``attnres eval`` from the config alone, before the weights load."""
    if not 1 <= seq_len <= limit:
        raise ValueError(f"--seq-len must be in [1, {limit}] (the model's context limit, {field}); got {seq_len}: "
                         "omit it for the default window")


def _token_bytes(tokenizer: Tokenizer, token_id: int) -> int:
    """The UTF-8 bytes of the text ``token_id`` stands for. Decoded alone, a token that holds
    part of a character (the first byte of "é") gives U+FFFD, 3 bytes: a byte-level token is
    counted from its symbols instead, one per byte. A special token (a leading ``<s>``, which
    decodes to nothing) holds none of the text."""
    if isinstance(tokenizer, ByteTokenizer):
        return 1
    decoded = tokenizer.decode([token_id])
    if not decoded:
        return 0
    backend = getattr(tokenizer, "backend", None)  # a BPETokenizer's tokenizers.Tokenizer
    if backend is not None:
        from tokenizers import decoders

        if isinstance(backend.decoder, decoders.ByteLevel):
            return len(backend.id_to_token(token_id))
    return len(decoded.encode("utf-8"))


def held_out_documents(text: str, min_words: int = 12, max_docs: int = 200) -> list[str]:
    """Short documents from ``text``: consecutive lines joined (whitespace normalised) until
    a document has at least ``min_words`` words or a blank line ends it; shorter leftovers
    are dropped. At most ``max_docs``, in order."""
    docs, words = [], []
    for line in [*text.splitlines(), ""]:
        words += line.split()
        if (not line.strip() or len(words) >= min_words) and words:
            if len(words) >= min_words:
                docs.append(" ".join(words))
            words = []
    return docs[:max_docs]


#: What to do about held-out text the local tasks cannot be built from.
_MORE_TEXT = "give more held-out text (--text FILE), or --tasks none for the perplexity alone"


def local_task_data(text: str, seed: int = 0) -> tuple[list[str], list[dict]]:
    """The documents of ``attnres_ppl`` and the items of ``attnres_cloze`` built from
    ``text``. ``ValueError`` when the text gives too few documents or no cloze item:
    ``attnres eval`` asks before its perplexity pass, so that it is not lost to the error."""
    docs = held_out_documents(text)
    if len(docs) < CLOZE_CHOICES:
        raise ValueError(f"the held-out text gives {len(docs)} documents of >= 12 words; the local tasks "
                         f"({', '.join(LOCAL_TASKS)}) need >= {CLOZE_CHOICES}: {_MORE_TEXT}")
    rng = random.Random(seed)
    items = []
    for i, d in enumerate(docs):
        words = d.split()
        cut = len(words) // 2
        context, ending = " ".join(words[:cut]), " " + " ".join(words[cut : cut + CLOZE_WORDS])
        # Distractors: the words at the same place in other documents, distinct and non-empty.
        others = [j for j in range(len(docs)) if j != i]
        rng.shuffle(others)
        choices = [ending]
        for j in others:
            alt = " " + " ".join(docs[j].split()[cut : cut + CLOZE_WORDS])
            if alt.strip() and alt not in choices:
                choices.append(alt)
            if len(choices) == CLOZE_CHOICES:
                break
        if len(choices) < CLOZE_CHOICES:
            continue
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(ending)})
    if not items:
        raise ValueError(f"the held-out text is too uniform to build a cloze item with distinct choices: {_MORE_TEXT}")
    return docs, items


def longest_cloze_choice(items: list[dict], tokenizer) -> int:
    """The most tokens a choice of the ``attnres_cloze`` ``items`` takes, counted as lm-eval
    counts a continuation: the ids of context + choice past those of the context alone
    (``tokenizer``: anything with ``encode(text) -> ids``)."""
    longest = 0
    for item in items:
        context = len(tokenizer.encode(item["context"]))
        longest = max(longest, *(len(tokenizer.encode(item["context"] + choice)) - context for choice in item["choices"]))
    return longest


def check_local_tasks(text: str, tasks: list[str], num_fewshot: int | None, tokenizer=None,
                      window: int | None = None, seq_len_given: bool = True,
                      limit: int | float | None = None, context: int | None = None) -> None:
    """Refuse, before any evaluation, held-out text the local tasks among ``tasks`` cannot be
    built from (:func:`local_task_data`), and a ``num_fewshot`` that ``attnres_cloze`` cannot
    give: the harness draws each item's solved examples from its other items, and ran out of
    them with "Sample larger than population or is negative" after the perplexity pass.
    With ``tokenizer`` and the harness's ``window`` (its ``max_length``: ``--seq-len`` where
    ``seq_len_given``, else the default: the model's ``context``, or a cap below it), a window
    shorter than a cloze choice is refused too: the harness reads a choice whole, and stopped on
    a bare ``AssertionError``; the message names the window as it was set, and offers a longer
    ``--seq-len`` where the model's context holds the choice. Of the items it reads: the first
    ``limit`` (``--limit``: a count, or a fraction of them)."""
    _, items = local_task_data(text)
    if "attnres_cloze" in tasks and num_fewshot is not None and num_fewshot >= len(items):
        raise ValueError(f"--num-fewshot {num_fewshot}: attnres_cloze has {len(items)} items built from the held-out "
                         f"text, and draws each one's solved examples from the others: at most {len(items) - 1} "
                         "(or give more held-out text, --text FILE)")
    if "attnres_cloze" in tasks and tokenizer is not None and window is not None:
        read = None if limit is None else int(limit) if limit >= 1 else math.ceil(len(items) * limit)
        longest = longest_cloze_choice(items[:read], tokenizer)
        if longest > window:
            capped = not seq_len_given and context is not None and window < context
            what = (f"--seq-len {window}" if seq_len_given else f"the default window of {window} tokens (the model's "
                    f"context of {context}, capped; --seq-len to change)" if capped
                    else f"the model's context of {window} tokens")
            fits = longest <= context if context is not None else seq_len_given
            more = f"give --seq-len {longest} or more, or " if fits else ""
            raise ValueError(f"{what}: attnres_cloze's longest choice takes {longest} tokens, and lm-eval reads each "
                             f"choice whole inside its window: {more}--tasks attnres_ppl (the cloze task left out)")


def write_local_tasks(directory: str | Path, text: str, seed: int = 0) -> Path:
    """Write the task YAMLs and JSONL data of :data:`LOCAL_TASKS` built from ``text``
    (:func:`local_task_data`) into ``directory``; returns it (the harness's ``include_path``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    docs, items = local_task_data(text, seed)
    for name, records in (("ppl.jsonl", [{"text": d} for d in docs]), ("cloze.jsonl", items)):
        with (directory / name).open("w") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
    (directory / "attnres_ppl.yaml").write_text(
        "task: attnres_ppl\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(directory / 'ppl.jsonl'))}\n"
        "test_split: test\n"
        "output_type: loglikelihood_rolling\n"
        "num_fewshot: 0\n"  # (whole documents, without examples: --num-fewshot leaves it at 0)
        'doc_to_text: ""\n'
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n"  # aggregation and direction given: the harness warns about each metric without them
        "  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}\n"
        "  - {metric: byte_perplexity, aggregation: weighted_perplexity, higher_is_better: false}\n"
        "  - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}\n"
        "metadata:\n  version: 1.0\n"
    )
    (directory / "attnres_cloze.yaml").write_text(
        "task: attnres_cloze\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(directory / 'cloze.jsonl'))}\n"
        "test_split: test\n"
        # (its one split: named, the harness leaves each item out of its own solved examples, which
        # it otherwise draws from the whole split, the item itself with its answer among them)
        "fewshot_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        'target_delimiter: ""\n'
        "metric_list:\n"
        "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
        "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n"
        "metadata:\n  version: 1.0\n"
    )
    return directory


def ratio_stderr(pairs: list[tuple[float, float]]) -> float:
    """Standard error of the ratio estimator ``R = sum(a) / sum(b)`` over ``n >= 2``
    documents ``(a_i, b_i)`` (delta method: ``sqrt(n / (n - 1) * sum((a_i - R b_i)^2)) /
    sum(b)``). The harness's rolling log-likelihood metrics are such ratios: total
    log-likelihood over total words or bytes."""
    n = len(pairs)
    if n < 2:
        raise ValueError("a standard error needs at least 2 documents")
    total_a, total_b = sum(a for a, _ in pairs), sum(b for _, b in pairs)
    ratio = total_a / total_b
    return math.sqrt(n / (n - 1) * sum((a - ratio * b) ** 2 for a, b in pairs)) / total_b


#: Rolling log-likelihood metrics: each is ``f(R)`` of the ratio ``R`` (mean log-likelihood
#: per word or byte); ``|f'(R)|`` turns the ratio's standard error into the metric's.
_RATIO_METRICS = {
    "word_perplexity": lambda r: math.exp(-r),
    "byte_perplexity": lambda r: math.exp(-r),
    "bits_per_byte": lambda r: 1.0 / math.log(2),
}


def add_ratio_stderrs(results: dict, samples: dict) -> dict:
    """Fill the standard errors that lm-evaluation-harness leaves as ``"N/A"`` for the rolling
    log-likelihood metrics (word / byte perplexity, bits per byte: it has neither a closed
    form nor a bootstrap for their weighted aggregates) from the per-document
    ``(log-likelihood, words or bytes)`` pairs of ``samples``, by :func:`ratio_stderr`."""
    for task, metrics in results.items():
        for key in list(metrics):
            name, _, filt = key.partition(",")
            if name not in _RATIO_METRICS or metrics.get(f"{name}_stderr,{filt}") not in (None, "N/A"):
                continue
            pairs = [tuple(map(float, doc[name])) for doc in samples.get(task, [])
                     if isinstance(doc.get(name), (list, tuple)) and len(doc[name]) == 2]
            if len(pairs) < 2:
                continue
            ratio = sum(a for a, _ in pairs) / sum(b for _, b in pairs)
            metrics[f"{name}_stderr,{filt}"] = _RATIO_METRICS[name](ratio) * ratio_stderr(pairs)
    return results


def check_tasks(tasks: list[str]) -> str | None:
    """Raise ``ValueError`` naming every entry of ``tasks`` that is neither a local task nor
    a task, group or tag lm-evaluation-harness knows, or whose data set the harness cannot
    get (:func:`_check_cached`), before any evaluation runs (the harness itself fails only
    after the perplexity pass: a ``KeyError``, or a ``ConnectionError`` after about 25 s of
    retries). Looking the harness's names up indexes its task files: a few seconds, paid only
    for non-local names. Returns why the harness must read their data sets from the local
    cache (:func:`harness_offline`; they are there), or ``None`` where it may download them."""
    others = [t for t in tasks if t not in LOCAL_TASKS]
    if not others:
        return None
    manager = harness_task_manager()
    known = manager.all_tasks
    unknown = [t for t in others if t not in known]
    if unknown:
        # (a close match only: among the harness's thousands of names some is always somewhat near)
        hint = did_you_mean_each(unknown, [*LOCAL_TASKS, *known], cutoff=0.8)
        raise ValueError(f"--tasks: unknown task(s) {', '.join(map(repr, unknown))}{hint}: the local tasks are "
                         f"{', '.join(LOCAL_TASKS)}, and `lm-eval ls tasks` lists the harness's own (comma-separated, "
                         "e.g. --tasks attnres_ppl,hellaswag; 'none' skips lm-eval)")
    offline = harness_offline()
    if offline is not None:
        _check_cached(manager, others, offline)
    return offline


@functools.cache
def harness_task_manager():
    """lm-evaluation-harness's ``TaskManager`` of its own tasks, built once a process: building
    one indexes its thousands of task files (10 - 20 s on a laptop's core), which the check of
    the task names (:func:`check_tasks`) and the run of harness tasks alone (:func:`run_lm_eval`)
    would otherwise each pay."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def harness_offline() -> str | None:
    """Why the harness's own tasks must read their data sets from the local cache, or ``None``
    where they may download them: offline mode set by the user (``HF_HUB_OFFLINE=1``), or the
    Hub out of reach (:func:`attnres.hub.hub_unreachable`, asked only where the user has set
    none of :data:`attnres.hub.OFFLINE_VARIABLES`: one set to 0 keeps the harness online)."""
    import datasets.config

    from ..hub import OFFLINE_VARIABLES, hub_unreachable

    if datasets.config.HF_HUB_OFFLINE:
        return "offline mode is set (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE)"
    if any(os.environ.get(name) for name in OFFLINE_VARIABLES):
        return None
    unreachable = hub_unreachable()
    return None if unreachable is None else f"the Hugging Face Hub cannot be reached ({unreachable})"


def _check_cached(manager, tasks: list[str], offline: str) -> None:
    """Raise ``ValueError`` naming each of the harness's ``tasks`` whose data set is not in
    the local cache, built as the harness builds it in offline mode (at once, no requests);
    ``offline``: why it cannot be downloaded."""
    from ..hub import offline_mode

    missing = []
    with offline_mode(), warnings.catch_warnings():
        # (lm-eval 0.4.13 deprecates the loader that its earlier versions have alone, in favour of load())
        warnings.simplefilter("ignore", DeprecationWarning)
        for task in tasks:
            try:
                manager.load_task_or_group([task])
            except OSError:  # (ConnectionError: "Couldn't reach ... (OfflineModeIsEnabled)"; FileNotFoundError)
                missing.append(task)
    if missing:
        raise ValueError(f"--tasks: the data set of {', '.join(missing)} is not in the local cache, and {offline}: run "
                         "once where the network reaches the Hub (the harness caches what it downloads), or use the "
                         f"local tasks {', '.join(LOCAL_TASKS)}, which need none")


@contextlib.contextmanager
def _truncations_counted():
    """The harness warns once per request longer than the model's context ("Combined length
    of context ... Truncating N tokens from the left"): hundreds of lines on a small model.
    They are held back while it runs and counted into the yielded list (the tokens cut from
    each), for one warning after."""
    import re

    harness = logging.getLogger("lm_eval.models.huggingface")
    cut: list[int] = []

    def hold_back(record: logging.LogRecord) -> bool:
        found = re.search(r"^Combined length of context .* Truncating (\d+) tokens", record.getMessage())
        if found:
            cut.append(int(found.group(1)))
        return found is None

    harness.addFilter(hold_back)
    try:
        yield cut
    finally:
        harness.removeFilter(hold_back)


def truncation_warning(truncated: list[int], max_length: int | None) -> str:
    """The one warning for the requests the harness cut (``truncated``: the tokens cut from
    each, :func:`_truncations_counted`) to ``max_length`` (None: the model's context)."""
    window = "the model's context" if max_length is None else f"the window ({max_length} tokens)"
    return (f"{len(truncated)} of the tasks' requests were longer than {window} and were cut from the left by "
            f"lm-eval (the longest by {max(truncated)} tokens): their scores saw less context")


@contextlib.contextmanager
def _quiet_git_describe():
    """The harness records the git commit of the working directory with ``git describe``,
    whose "fatal: not a git repository" reaches the terminal outside a repository: run it
    with its stderr dropped while the harness runs (the recorded value is unchanged)."""
    from lm_eval import evaluator
    from lm_eval.loggers import utils as harness_utils

    def describe() -> str | None:
        try:
            done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
        except (subprocess.CalledProcessError, FileNotFoundError):
            return harness_utils.get_commit_from_path(os.getcwd())
        return done.stdout.strip()

    users = [m for m in (harness_utils, evaluator) if hasattr(m, "get_git_commit_hash")]  # it imports the name
    originals = [m.get_git_commit_hash for m in users]
    for m in users:
        m.get_git_commit_hash = describe
    try:
        yield
    finally:
        for m, original in zip(users, originals):
            m.get_git_commit_hash = original


def document_start(tokenizer, hf_dir: str | Path) -> tuple[int, str]:
    """``(id, what it is)``: the token lm-eval starts each document of ``hf_dir``'s
    ``tokenizer`` (a transformers one) with: its end-of-text token, else its beginning-of-text
    one, else a line break."""
    from .export import PREFIX_TEXT

    if tokenizer.eos_token_id is not None:  # (a pretrained model's: the harness's own choice)
        return tokenizer.eos_token_id, f"end-of-text token {tokenizer.eos_token!r}"
    if tokenizer.bos_token_id is not None:
        return tokenizer.bos_token_id, f"beginning-of-text token {tokenizer.bos_token!r}"
    # attnres's exports declare no end-of-text token (see attnres.hf.export): the harness
    # prefixes rolling log-likelihoods with a line break instead.
    ids = tokenizer(PREFIX_TEXT, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"the tokenizer of {str(hf_dir)!r} has no end- or beginning-of-text token and does not "
                         f"encode {PREFIX_TEXT!r} as one token: lm-eval has no token to start a document with")
    return ids[0], "line break"


def check_document_start(model: nn.Module, tokenizer, hf_dir: str | Path) -> None:
    """Refuse, before any work, a directory whose tokenizer starts lm-eval's documents with a
    token past ``model``'s embedding rows (a tokenizer_config.json that adds an end-of-text
    token the tokenizer.json lacks, as transformers' Qwen2Tokenizer does): the held-out text
    never holds that token, and lm-eval ended in an ``IndexError`` after the perplexity pass."""
    start, named = document_start(tokenizer, hf_dir)
    rows = embedding_rows(model)
    if start >= rows:
        raise ValueError(f"{str(hf_dir)!r}: lm-eval starts each document with its tokenizer's {named} (id {start}), "
                         f"but the tokenizer has {len(tokenizer)} tokens and the model's embedding {rows} rows: save "
                         f"a tokenizer of at most {rows} tokens with the model, or give --tasks none for the "
                         "perplexity alone")


def harness_tokenizer(hf_dir: str | Path):
    """``(tokenizer, prefix)``: ``hf_dir``'s tokenizer as lm-eval is given it, and the
    ``prefix_token_id`` model argument where it needs one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    own, named = document_start(tokenizer, hf_dir)
    prefix = {"prefix_token_id": own} if named == "line break" else {}
    # Often no padding token either: the harness would add one beyond the model's vocabulary.
    # Padded positions are masked, so that token pads (in memory only).
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = own
    if tokenizer.eos_token_id is None:
        _decode_no_end_as_none(tokenizer)
    # The harness cuts long documents into windows itself: transformers' "Token indices sequence
    # length is longer than ... will result in indexing errors" is marked as said (its warn-once flag).
    tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer, prefix


def _decode_no_end_as_none(tokenizer) -> None:
    """Let ``tokenizer`` (in memory) decode ``None`` - the end-of-text id of a tokenizer that
    declares none, attnres's exports' - as ``None``: lm-eval's ``generate_until`` adds the
    decoded end-of-text token to each task's stop strings, and takes ``None`` for "no such
    token", but decoding it failed every generation task (gsm8k, ...) with "TypeError:
    'None' is not an instance of 'Sequence'" (lm-evaluation-harness issue 2178). Generation
    then stops at the task's own stop strings or its ``max_gen_toks``."""
    decode = tokenizer.decode

    def decode_or_none(token_ids, *args, **kwargs):
        return None if token_ids is None else decode(token_ids, *args, **kwargs)

    tokenizer.decode = decode_or_none


def run_lm_eval(hf_dir: str | Path, tasks: list[str], text: str, *, limit: int | float | None = None,
                batch_size: int | str = 8, device: str = "cpu", dtype: str = "float32", bootstrap_iters: int = 1000,
                num_fewshot: int | None = None, offline: bool = False, max_length: int | None = None) -> dict:
    """``lm_eval.simple_evaluate`` with ``model="hf"`` on the transformers directory ``hf_dir``
    (an export, an upcycle, a pretrained model; its weights in ``dtype``, a ``torch`` dtype
    name).
    Local tasks are generated from ``text``; other names are the harness's own tasks.
    ``limit`` and ``batch_size`` as the harness takes them: a count, or a fraction (below 1) of
    each task's documents; a count, ``"auto"`` or ``"auto:N"``.
    ``num_fewshot``: solved examples before each request (``None``: each task's own).
    ``offline``: the data sets are read from the local cache only (:func:`attnres.hub.offline_mode`:
    where :func:`harness_offline` says so, they are there, and the Hub client would spend its
    retries before reading them).
    ``max_length``: the harness's window (its rolling log-likelihood windows, and the most
    tokens of a request it reads: it cuts longer ones from the left), which it otherwise takes
    from the model's whole context (``max_position_embeddings``): ``attnres eval`` gives it its
    perplexity window, so that ``attnres_ppl`` reads a long document in the windows the
    perplexity pass reads the text in.
    Returns the harness's ``results`` (per task, metric -> value, and ``n-shot``, the
    examples it was given), with standard errors:
    the harness's own (closed form for accuracies; ``bootstrap_iters`` resamples where it
    bootstraps) and, for the rolling log-likelihood metrics, :func:`add_ratio_stderrs`."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from ..hub import offline_mode

    local = [t for t in tasks if t in LOCAL_TASKS]
    tokenizer, prefix = harness_tokenizer(hf_dir)
    model_args = {"pretrained": str(hf_dir), "tokenizer": tokenizer, "dtype": dtype,
                  # an attnres model is a causal LM the harness cannot tell from its model_type
                  "backend": "causal", **prefix, **({"max_length": max_length} if max_length is not None else {})}
    with tempfile.TemporaryDirectory(prefix="attnres-tasks-") as tmp:
        include = write_local_tasks(tmp, text) if local else None
        # (the harness's tasks alone: the index the task names were checked with)
        manager = (harness_task_manager() if include is None
                   else TaskManager(include_path=str(include), include_defaults=len(local) < len(tasks)))
        with _quiet_git_describe(), _truncations_counted() as truncated, \
                (offline_mode() if offline else contextlib.nullcontext()):
            out = lm_eval.simple_evaluate(
                model="hf",
                model_args=model_args,
                tasks=tasks,
                task_manager=manager,
                batch_size=batch_size,
                device=device,
                limit=limit,
                num_fewshot=num_fewshot,
                log_samples=True,
                bootstrap_iters=bootstrap_iters,
            )
    if truncated:
        warn_user(truncation_warning(truncated, max_length))
    if out is None:
        raise RuntimeError("lm_eval.simple_evaluate returned no results")
    for task, shots in (out.get("n-shot") or {}).items():  # (each task's own number, where not given)
        if task in out["results"]:
            out["results"][task]["n-shot"] = shots
    return add_ratio_stderrs(out["results"], out.get("samples") or {}) if bootstrap_iters > 0 else out["results"]
