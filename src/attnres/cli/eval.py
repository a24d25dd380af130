"""``attnres eval``: perplexity / bits per byte on held-out text, then lm-evaluation-harness tasks."""

from __future__ import annotations

import argparse
import re

from ..validation import check_optional_count, missing_path_hint
from .common import DTYPES, add_checkpoint_argument


#: The default perplexity window, at most: a pretrained model's whole context (40,960 tokens
#: for Qwen3; a transformers directory's, or a run's started from one) would be one window of
#: the held-out text, minutes and gigabytes of attention on a CPU. A run and its export are
#: both held to it, so that they give the same numbers.
MAX_DEFAULT_WINDOW = 2048


def add_parser(sub) -> None:
    ev = sub.add_parser(
        "eval",
        help="perplexity / bits per byte on held-out text and lm-evaluation-harness tasks",
        description="Evaluates a training checkpoint, or a transformers directory (attnres export's or attnres "
        "upcycle's output, with its own tokenizer): perplexity and bits per byte on held-out text (default: the "
        "run's validation split; for a directory, the built-in corpus's), then lm-evaluation-harness (model='hf') "
        "on the local tasks attnres_ppl and attnres_cloze built from that text, or on any harness task names given "
        "(those need the network).",
    )
    add_checkpoint_argument(ev, transformers=True)
    ev.add_argument("--tasks", default="attnres_ppl,attnres_cloze",
                    help="comma-separated lm-eval tasks (default: the local 'attnres_ppl,attnres_cloze'; 'none' to skip)")
    ev.add_argument("--text", help="held-out text file (default: the run's validation split; for a transformers "
                    "directory, the built-in corpus's validation split)")
    ev.add_argument("--tokenizer", help="tokenizer.json (or a directory holding one) to use instead of the one stored in the checkpoint")
    ev.add_argument("--out", help="results JSON (default: eval.json in the run given, DIR-eval.json beside a "
                    "transformers directory DIR, "
                    "RUN/eval-step-N.json for a checkpoint RUN/checkpoints/step-N; for a Hub id, "
                    "./eval-ORG--NAME.json); its folder must exist. An existing file is replaced only when it is an "
                    "earlier eval result (or with --overwrite)")
    ev.add_argument("--overwrite", action="store_true",
                    help="replace an existing --out file that is not an earlier attnres eval result")
    ev.add_argument("--limit", type=_limit, help="at most this many documents per lm-eval task, or a fraction F "
                    "(0 < F < 1) of each task's (lm-eval's --limit; default: all); the perplexity pass reads the whole "
                    "held-out text either way")
    ev.add_argument("--seq-len", type=int, help="perplexity window, and lm-eval's (its max_length) (default: the "
                    f"model's context, its max_seq_len, at most {MAX_DEFAULT_WINDOW})")
    ev.add_argument("--batch-size", type=_batch_size, default=8,
                    help="lm-eval's batch: a number of requests (default 8), 'auto' (the largest that fits, found by "
                    "trial from 64 down) or 'auto:N' (found again N times over the run), as lm-eval's --batch_size; the "
                    "perplexity pass batches its windows by tokens either way")
    ev.add_argument("--num-fewshot", type=int, metavar="N", help="solved examples before each lm-eval request "
                    "(default: each task's own, 0 for most; the local tasks draw theirs from their own items)")
    ev.add_argument("--device", default="auto",
                    help="device of the perplexity pass and lm-eval: auto (CUDA when available; default), cpu, cuda "
                    "or cuda:N")
    ev.add_argument("--dtype", default="float32", choices=DTYPES,
                    help="the weights' dtype in the perplexity pass and lm-eval: float32 (as trained and stored; "
                    "default), bfloat16 or float16 (on a GPU, about half the time and memory)")
    ev.add_argument("--bootstrap-iters", type=int, default=1000,
                    help="lm-eval bootstrap resamples for the standard errors of metrics that need them (default "
                    "1000; 0 = lm-eval computes none)")


def _batch_size(text: str) -> int | str:
    """``--batch-size``: a count (checked >= 1 with the other values), or lm-eval's ``auto`` /
    ``auto:N`` as it takes them."""
    if re.fullmatch(r"auto(:[1-9][0-9]*)?", text.strip().lower()):
        return text.strip().lower()
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes a number of requests per batch, 'auto' or 'auto:N' (N >= 1); got "
                                         f"{text!r}") from None


def _limit(text: str) -> int | float:
    """``--limit``: a count of documents, or a fraction of each task's (lm-eval's meaning of a
    value below 1); the range is checked with the other values."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(f"takes a number of documents or a fraction (0 < F < 1) of each task's; got "
                                     f"{text!r}")


def _check_harness_sizes(args) -> None:
    """``--batch-size`` and ``--limit`` as lm-eval takes them, or ``ValueError`` naming what is
    accepted: a count >= 1, ``auto[:N]`` (the parser's), a fraction strictly between 0 and 1."""
    if not isinstance(args.limit, float):
        check_optional_count("--limit", args.limit, "every document of each task")
    elif not 0 < args.limit < 1:  # (1.0 too: lm-eval's one document, or meant as all of them?)
        count = int(args.limit) if args.limit >= 1 and args.limit.is_integer() else None
        count = "" if count is None else f"write {count} for {count} document{'s' * (count > 1)} of each task, or "
        raise ValueError(f"--limit takes a whole number of documents (>= 1) or a fraction F of each task's documents "
                         f"(0 < F < 1); got {args.limit} ({count}omit it for every document)")
    if isinstance(args.batch_size, int) and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1 (lm-eval's batch); got {args.batch_size} ('auto' or 'auto:N' for "
                         "lm-eval's choice)")


def run(args, parser) -> int:
    return run_eval(args)


#: The keys that make a JSON file an earlier result of ``attnres eval``, which a new one replaces.
RESULT_KEYS = ("checkpoint", "perplexity", "lm_eval")


def _earlier_result(path) -> bool:
    """Whether the file ``path`` is a results JSON that ``attnres eval`` wrote (its keys
    :data:`RESULT_KEYS`); a file too large to be one is not read."""
    import json

    try:
        if path.stat().st_size > 1 << 24:
            return False
        held = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # (unreadable, not UTF-8, not JSON)
        return False
    return isinstance(held, dict) and all(key in held for key in RESULT_KEYS)


def _eval_output(args):
    """Where ``attnres eval`` writes its results; checked before any work is done. An existing
    file there that is not an earlier result (a user's notes, a config) is refused unless
    ``--overwrite``."""
    from ..output_paths import OutputPathError

    out = _eval_output_path(args)
    if out.exists() and not args.overwrite and not _earlier_result(out):
        raise OutputPathError(f"--out {str(out)!r} exists and is not an earlier attnres eval result (a JSON file "
                              f"with {', '.join(map(repr, RESULT_KEYS))}): give another --out, or --overwrite to "
                              "replace it")
    return out


def _eval_output_path(args):
    """Where ``attnres eval`` writes its results (``--out``, or the default for the checkpoint),
    checked as a file to write."""
    from pathlib import Path

    from ..checkpoint import is_hf_directory, no_checkpoint_at, refuse_model_file
    from ..checkpoint.locate import run_of_checkpoint
    from ..hub import is_hub_id
    from ..output_paths import check_output_file

    if args.out:
        refuse_model_file(args.out)  # (the results would replace a file a checkpoint or model is read from)
        return check_output_file(Path(args.out), "--out")
    if is_hub_id(args.checkpoint):  # (not into the Hugging Face cache): here
        return check_output_file(Path(f"eval-{args.checkpoint.replace('/', '--')}.json"), "--out")
    if not Path(args.checkpoint).is_dir():  # (the default --out lies in it: say what is missing, or a file)
        raise ValueError(no_checkpoint_at(args.checkpoint))
    if (found := run_of_checkpoint(args.checkpoint)) is not None:  # a step-N directory or the checkpoints folder
        run, step = found
        return check_output_file(run / (f"eval-{step}.json" if step else "eval.json"), "--out")
    path = Path(args.checkpoint)
    if is_hf_directory(path):  # beside it, as analyze's: a file inside would be uploaded and shipped with the model
        return check_output_file(path.parent / f"{path.resolve().name}-eval.json", "--out")
    return check_output_file(path / "eval.json", "--out")


def _load(args, device, directory: bool, text: str | None):
    """``(model, tokenizer, held-out text, its name, the run loaded)``: of a transformers
    directory (its own model class and tokenizer; the built-in corpus's validation split by
    default; no run), or of a training checkpoint (its stored tokenizer; the run's validation
    split; ``args.checkpoint`` becomes the checkpoint loaded, a run directory's newest); the
    windows of either at most :data:`MAX_DEFAULT_WINDOW` unless ``--seq-len`` says."""
    from ..data.corpus import TEXT_FIELD, is_json_lines, json_lines_text, load_corpus
    from ..inference.loading import load_run, load_tokenizer

    if not directory:
        run = load_run(args.checkpoint, device)
        args.checkpoint = str(run.checkpoint)
        print(f"attnres eval: checkpoint {args.checkpoint} (step {run.state.get('step')})")
        if text is not None and is_json_lines(args.text):  # (its records' text, in the field the run trained on)
            field = run.run_config["data"].get("text_field", TEXT_FIELD)
            text = _held_out(args.text, json_lines_text(args.text, "--text", field))
        _note_untrained_positions(args, run)
        _default_window(args, run.model)
        return (run.model, load_tokenizer(run, args.tokenizer), *((text, None) if text is not None else
                                                                   (run.validation_text(), "validation split")), run)
    from ..hf.directory import load_directory
    from ..progress import redraws_in_place, transformers_bars

    with transformers_bars(redraws_in_place()):  # (its "Loading weights" bar: not in a log)
        model, tokenizer = load_directory(args.checkpoint, device)
    # (which model, as a checkpoint's line says which checkpoint: a Hub id's, its folder in the cache)
    print(f"attnres eval: transformers directory {args.checkpoint} ({type(model).__name__})")
    _default_window(args, model)
    if text is None:  # (said: an export of a run on other data was measured on other text, without a word)
        print("attnres eval: held-out text: the built-in corpus's validation split, not the data the model was "
              "trained on unless that was it (--text FILE for other text)")
        return model, tokenizer, load_corpus().val, "the built-in corpus's validation split", None
    if is_json_lines(args.text):  # (its records' text, in the field "text")
        text = _held_out(args.text, json_lines_text(args.text, "--text"))
    return model, tokenizer, text, None, None


def _check_against_config(args, directory: bool) -> None:
    """Refuse ``--seq-len`` past the model's context and a ``--tokenizer`` that does not read or
    whose vocabulary is not the model's, from the model's config alone (a transformers
    directory's ``config.json``; the ``state.json`` of a run's newest checkpoint, unverified),
    before the weights load - minutes for a large upcycled model - with the messages the
    checks after the load give. A config that does not read is left to the load, which says
    what is wrong with it."""
    from ..hf.evaluate import check_window

    if directory:
        config = _directory_config(args.checkpoint)
        limit = getattr(config, "max_position_embeddings", None)
        if args.seq_len is not None and isinstance(limit, int):
            check_window(args.seq_len, limit, "max_position_embeddings")
        return  # (a --tokenizer is refused as such: a directory is evaluated with its own)
    config = _checkpoint_model_config(args.checkpoint)
    if config is None:
        return
    if args.seq_len is not None:  # (the name the model built from it gives its context: perplexity's)
        check_window(args.seq_len, config.max_seq_len,
                     "max_seq_len" if config.hf_architecture is None else "max_position_embeddings")
    if args.tokenizer is not None:
        from ..data.tokenizer import load_tokenizer_file
        from ..inference.loading import check_vocabulary

        check_vocabulary(load_tokenizer_file(args.tokenizer, "--tokenizer"), config.vocab_size, args.tokenizer)


def _directory_config(path: str):
    """The transformers config of the directory ``path``, or ``None`` where it does not read."""
    from transformers import AutoConfig

    from .. import hf  # noqa: F401 (importing it registers AttnRes's model types with AutoConfig)

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError):
        return None


def _checkpoint_model_config(path: str):
    """The :class:`~attnres.models.config.ModelConfig` stored in the newest checkpoint at
    ``path`` (a run or ``step-*`` directory), read without verifying it; ``None`` where there is
    none or it does not build."""
    from ..checkpoint.locate import newest_state
    from ..migrations import stored_config
    from ..models.config import ModelConfig

    found = newest_state(path)
    config = found[1].get("config") if found is not None else None
    try:
        with stored_config():  # (an earlier version's spellings: not the user's to be warned of)
            return ModelConfig.from_dict(config["model"]) if isinstance(config, dict) else None
    except (ValueError, TypeError, KeyError):
        return None


def _held_out(path: str, text: str) -> str:
    """``text``, read from the ``--text`` file ``path``; ``ValueError`` when it is blank."""
    if not text.strip():  # (a .jsonl file's records may all be empty)
        raise ValueError(f"--text {path!r} is empty: there is no text to evaluate on")
    return text


def _default_window(args, model) -> None:
    """``--seq-len``'s default: the model's context, at most :data:`MAX_DEFAULT_WINDOW` (said
    where it is shortened)."""
    from ..models.factory import context_limit

    if args.seq_len is None and context_limit(model) > MAX_DEFAULT_WINDOW:
        args.seq_len = MAX_DEFAULT_WINDOW
        print(f"attnres eval: perplexity windows of {MAX_DEFAULT_WINDOW} tokens (the model's context is "
              f"{context_limit(model)}; --seq-len to change)")


def _note_untrained_positions(args, run) -> None:
    """Say so where the default window (the model's context, at most
    :data:`MAX_DEFAULT_WINDOW`) is longer than the sequences the run trained on (its
    ``seq_len``): the positions past them are ones this training never showed the model, and
    its loss there is higher than at the length it trained on (and than its ``val_loss``,
    measured on ``seq_len`` windows). Not of a run started from other weights (``init_from``:
    a pretrained model's saw its whole context). The default stays the model's context, which
    the run's export is evaluated on too."""
    from ..models.factory import context_limit

    trained = run.run_config.get("seq_len")
    window = min(context_limit(run.model), MAX_DEFAULT_WINDOW)
    if args.seq_len is None and isinstance(trained, int) and trained < window and not run.run_config.get("init_from"):
        print(f"attnres eval: perplexity windows of {window} tokens (the model's context"
              f"{'' if window == context_limit(run.model) else f', at most {MAX_DEFAULT_WINDOW}'}); the run trained "
              f"from scratch on sequences of {trained} (seq_len), so positions {trained}-{window - 1} are ones its "
              f"training never showed it: --seq-len {trained} measures it at the length it trained on")


def _lm_eval(args, tasks: list[str], text: str, run, tokenizer, device, offline: bool, window: int) -> dict:
    """lm-eval's results on ``tasks``: of the transformers directory, or (``run``: the
    training checkpoint loaded) of its model's export into a temporary directory - the model
    the perplexity pass measured, not the run's newest checkpoint by then, which a run still
    training has replaced (and may have deleted: with ``tokenizer``, the run's as loaded, not its
    checkpoint's file read again). ``offline``: the harness reads its data sets
    from the local cache only (:func:`attnres.hf.evaluate.run_lm_eval`'s). ``window``: the
    perplexity pass's, the harness's ``max_length``."""
    import tempfile

    from .. import hf
    from ..hf.evaluate import run_lm_eval

    harness = dict(limit=args.limit, batch_size=args.batch_size, device=str(device), dtype=args.dtype,
                   bootstrap_iters=args.bootstrap_iters, num_fewshot=args.num_fewshot, offline=offline,
                   max_length=window)  # (the perplexity's windows: the harness's are the model's whole context)
    if run is None:
        return run_lm_eval(args.checkpoint, tasks, text, **harness)
    with tempfile.TemporaryDirectory(prefix="attnres-hf-") as hf_dir:
        hf.export_checkpoint(run, hf_dir, args.tokenizer, tokenizer=tokenizer)
        return run_lm_eval(hf_dir, tasks, text, **harness)


def _harness_failed(error: OSError, tasks: list[str], out) -> str:
    """What ``attnres eval`` says when lm-eval fails with ``error`` after the perplexity pass,
    whose results were written to ``out``."""
    from ..hf.evaluate import LOCAL_TASKS

    said = f"lm-eval failed: {error}"
    own = [t for t in tasks if t not in LOCAL_TASKS]
    if isinstance(error, ConnectionError) or "Couldn't reach" in str(error):
        said += (f" ({', '.join(own) or 'a harness task'}: the harness downloads its data set from the Hugging Face "
                 f"Hub; run where the network reaches it, or use the local tasks {', '.join(LOCAL_TASKS)}, which need "
                 "none)")
    return f"{said}; the perplexity results are written to {out}, without lm-eval's"


def _metric_name(key: str) -> str:
    """lm-eval's ``metric,filter`` key as printed: the metric, and its filter where it is not
    lm-eval's default ``none`` (``acc,none`` is ``acc``; ``exact_match,flexible-extract``
    stays). The results JSON keeps the harness's keys."""
    metric, _, applied = key.partition(",")
    return metric if applied in ("", "none") else key


def _number(value: float, decimals: int = 4) -> str:
    """A score as printed: fixed decimals, or in scientific notation from a million on (a word
    perplexity of an untrained model, 3.4e10, printed 34000000000.0000)."""
    return f"{value:.{decimals}f}" if abs(value) < 1e6 else f"{value:.{decimals}e}"


def _perplexity_line(ppl: dict) -> str:
    return (f"attnres eval: held-out loss {ppl['loss']:.4f}, perplexity {_number(ppl['perplexity'], 3)}, bits/byte "
            f"{ppl['bits_per_byte']:.4f} over {ppl['tokens']} token" + "s" * (ppl["tokens"] != 1))


def _checked_before_loading(args, tasks: list[str]):
    """The arguments of ``attnres eval`` checked before the model loads (or is fetched from the
    Hub), each refused naming its option (``ValueError``): ``(results file, the harness's offline note, the --text's
    text or None)``."""
    from pathlib import Path

    from ..checkpoint import is_hf_directory
    from ..data.corpus import read_text_file
    from ..data.tokenizer import tokenizer_file
    from ..hf.evaluate import check_tasks
    from ..hub import is_hub_id

    check_optional_count("--seq-len", args.seq_len, "the model's max_seq_len")
    _check_harness_sizes(args)
    out = _eval_output(args)
    offline = check_tasks(tasks)  # (why the harness reads its data sets from the cache, where it must)
    if args.text is not None and not Path(args.text).is_file():
        raise ValueError(f"--text {args.text!r} is not a file{missing_path_hint(args.text)}")
    # (said before the model loads, naming the option; a .jsonl file's records are read after it: _load)
    text = _held_out(args.text, read_text_file(args.text, "--text")) if args.text is not None else None
    # (a Hub id is a transformers directory too: refused before it is fetched, minutes and gigabytes)
    if args.tokenizer is not None and (is_hf_directory(args.checkpoint) or is_hub_id(args.checkpoint)):
        raise ValueError("--tokenizer: a transformers directory is evaluated with its own tokenizer; omit it")
    if args.tokenizer is not None:
        tokenizer_file(args.tokenizer, "--tokenizer")  # (a wrong path: said before the model loads)
    for option, value in (("--bootstrap-iters", args.bootstrap_iters), ("--num-fewshot", args.num_fewshot)):
        if value is not None and value < 0:
            raise ValueError(f"{option} must be >= 0; got {value}")
    if not tasks and (unused := [o for o, v in (("--limit", args.limit), ("--num-fewshot", args.num_fewshot))
                                 if v is not None]):
        from ..user_warning import warn_user

        warn_user(f"{' and '.join(unused)} act{'s' * (len(unused) == 1)} on lm-eval's tasks, and --tasks none runs "
                  "none: the perplexity pass reads the whole held-out text")
    return out, offline, text


def run_eval(args) -> int:
    """``attnres eval``: perplexity and bits per byte, then lm-eval; writes a results JSON.
    Arguments that can be checked (output folder, text file, device) are checked first."""
    from pathlib import Path

    import torch

    from ..checkpoint import is_hf_directory
    from ..hub import local_folder
    from ..hf.evaluate import LOCAL_TASKS, check_document_start, check_local_tasks, perplexity
    from ..inference.loading import pick_device
    from ..models.factory import context_limit
    from ..output_paths import strict_json, write_text_atomically

    tasks = [] if args.tasks.strip().lower() == "none" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        if not tasks and args.tasks.strip().lower() != "none":
            raise ValueError(f"--tasks {args.tasks!r} names no task: give lm-eval task names, or 'none' for the "
                             "perplexity alone")
        out, offline, text = _checked_before_loading(args, tasks)
        device = pick_device(args.device)
        source = args.checkpoint  # (a Hub id stays the name in the results, not its folder in the cache)
        local = args.checkpoint = local_folder(args.checkpoint, "CHECKPOINT")
        directory = is_hf_directory(args.checkpoint)
        _check_against_config(args, directory)  # (before the weights: minutes of an upcycled model's)
        seq_len_given = args.seq_len is not None  # (_load sets the default's cap in its place)
        model, tokenizer, text, text_name, run = _load(args, device, directory, text)
        model.to(getattr(torch, args.dtype))
        if tasks and directory:  # (an export of a run's checkpoint starts them with its own line break)
            check_document_start(model, tokenizer.tokenizer, args.checkpoint)
        if any(task in LOCAL_TASKS for task in tasks):
            # (refused before the perplexity pass, not lost to it; the window is the harness's max_length)
            check_local_tasks(text, tasks, args.num_fewshot, tokenizer, args.seq_len or context_limit(model),
                              seq_len_given=seq_len_given, limit=args.limit, context=context_limit(model))
        results = {"checkpoint": source if source != local else str(Path(args.checkpoint).resolve()),
                   "step": None if run is None else run.state.get("step"),
                   # (absolute, as the checkpoint: the file a relative --text named, read from elsewhere)
                   "text": str(Path(args.text).resolve()) if args.text else text_name,
                   "seq_len": args.seq_len or context_limit(model),
                   "device": str(device), "dtype": args.dtype, "perplexity": perplexity(model, tokenizer, text, args.seq_len,
                                                                       progress=True),
                   # (what the harness was given: its scores on a --limit of each task are not the full task's)
                   "lm_eval_settings": {"tasks": tasks, "limit": args.limit, "num_fewshot": args.num_fewshot,
                                        "batch_size": args.batch_size, "bootstrap_iters": args.bootstrap_iters}
                   if tasks else None,  # (--tasks none: the harness was given nothing)
                   "lm_eval": {}}
        print(_perplexity_line(results["perplexity"]))
        try:
            results["lm_eval"] = (_lm_eval(args, tasks, text, run, tokenizer, device, offline is not None,
                                           results["seq_len"]) if tasks else {})
        # (a harness task's data set out of reach, most often, or a setting the harness refuses only as it
        # runs, a ValueError: the perplexity is kept either way)
        except (OSError, ValueError) as e:
            results["lm_eval_error"] = str(e)
            write_text_atomically(out, strict_json(results, indent=1, default=str))
            raise OSError(_harness_failed(e, tasks, out)) from None
        # (strict JSON, as scripts read it: a NaN perplexity of a diverged model is null)
        write_text_atomically(out, strict_json(results, indent=1, default=str))
    except (ValueError, OSError) as e:
        raise SystemExit(f"attnres eval: error: {e}") from None
    for task, metrics in results["lm_eval"].items():
        shown = ", ".join(f"{_metric_name(k)} {_number(v)}" for k, v in metrics.items() if isinstance(v, float))
        shots = f" ({metrics['n-shot']}-shot)" if metrics.get("n-shot") else ""
        print(f"attnres eval: {task}{shots}: {shown}")
    print(f"attnres eval: results written to {out}")
    return 0
