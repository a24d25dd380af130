"""``attnres generate``: continue a prompt with a trained checkpoint (or a transformers
directory), streamed, with tokens/s."""

from __future__ import annotations

from .common import DTYPES, add_checkpoint_argument
from ..user_warning import warn_user
from ..validation import SEED_MAX, check_optional_count, missing_path_hint


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="continue a prompt (or several) with a trained checkpoint; tokens/s",
                         description="Continue --prompt (or --prompt-file) with the model of a training checkpoint or run directory "
                         "(its stored tokenizer), or of a transformers directory (attnres export's or attnres "
                         "upcycle's output: its own tokenizer, stopping at its end-of-sequence tokens), streaming "
                         "the text; tokens/s on stderr. A run started from an instruct model's directory stops at its "
                         "end-of-sequence tokens too; the sampling options keep their defaults here, not that "
                         "model's (its export carries those). Several prompts are continued together in one batch "
                         "(left-padded) and printed one after the other, each under a line saying how it was given: '==> 2/3: --prompt #2 <==', '==> 1/2: "
                         "--prompt-file FILE, line 4 <==' ('--prompt-file FILE #2': a file given twice).")
    add_checkpoint_argument(gen, transformers=True)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append",
                        help="the text to continue; repeat it for several prompts, continued together")
    prompt.add_argument("--prompt-file", metavar="FILE", action="append",
                        help="read the text to continue from FILE (UTF-8), or from standard input with '-'; repeat it "
                        "for several prompts, or see --each-line")
    gen.add_argument("--each-line", action="store_true",
                     help="each line of --prompt-file is a prompt of its own (blank lines skipped), all continued "
                     "together")
    gen.add_argument("--chat", action="store_true",
                     help="give the prompt as a user's message through the tokenizer's chat template, for an instruct "
                     "model (an upcycled SmolLM2-Instruct: its own template; attnres's models: plain 'user: ...' / "
                     "'assistant: ' lines, the template of their export)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    gen.add_argument("--stop", action="append", metavar="TEXT",
                     help=r"end the text where TEXT first appears in it, TEXT itself not printed (as vLLM's stop); "
                     r"repeat it for several (--stop '\n\n' --stop 'User:'); backslash escapes are read as in a Python "
                     r"string: \n a line break, \t a tab, \\ a backslash")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1: off)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0); of several prompts, each "
                     "samples with its own generator seeded with it: its completion is the one it gets alone")
    gen.add_argument("--chunk-size", type=int, help="prefill the prompt in chunks of this many tokens "
                     "(default: all at once)")
    gen.add_argument("--tokenizer", help="tokenizer.json (or a directory holding one) to use instead of the one stored in the checkpoint")
    gen.add_argument("--device", default="auto", help="auto (CUDA when available; default), cpu, cuda or cuda:N")
    gen.add_argument("--decode", default="auto", choices=("auto", "dynamic", "static", "compiled", "graph"),
                     help="how decode steps run: auto (graph on CUDA, dynamic elsewhere; default), dynamic (growing "
                     "cache, eager), or over a static cache: static (eager), compiled (torch.compile), graph (CUDA graph)")
    gen.add_argument("--dtype", default="float32", choices=DTYPES,
                     help="the weights' dtype while generating: float32 (as trained and stored; default), bfloat16 or "
                     "float16 (half the bytes a decode step reads: faster where reading the weights bounds a step, as on a GPU "
                     "for a large model; not measured here)")


def run(args, parser) -> int:
    return run_generate(args)


def check_context(prompt_tokens: int, max_new_tokens: int, limit: int, which: str = "the prompt") -> None:
    """Raise ``ValueError`` when a prompt of ``prompt_tokens`` plus ``max_new_tokens`` does not
    fit the model's context of ``limit`` tokens (the last new token is not fed back);
    ``which``: the prompt, as the message names it (of several, the longest and how it was given)."""
    need = prompt_tokens + max_new_tokens - 1
    if need > limit:
        room, keep = limit - prompt_tokens + 1, limit - max_new_tokens + 1
        hints = [f"use --max-new-tokens {room} or less"] if room >= 1 else []
        hints += [f"shorten the prompt to at most {keep} token{'s' * (keep != 1)}"] if keep >= 1 else []
        # One limit, the context: the prompt and the new tokens but the last fill it together.
        hint = " or ".join(hints) or (f"shorten the prompt and lower --max-new-tokens: together they may be at most "
                                      f"{limit + 1} tokens")
        raise ValueError(f"{which} ({prompt_tokens} token{'s' * (prompt_tokens != 1)}) plus --max-new-tokens {max_new_tokens} needs a context of "
                         f"{need} tokens, beyond the model's context limit of {limit} tokens (max_seq_len): {hint}")


def read_prompt(prompt_file: str) -> tuple[str, str]:
    """``(the prompt, how it was given)``: the text of one ``--prompt-file``
    (standard input for ``-``), its one final line break dropped (what an editor or ``echo``
    adds is not part of the text to continue). A file and standard input read alike: UTF-8,
    a byte-order mark (Windows editors write one) dropped, line breaks (CRLF, CR) read as LF."""
    import sys
    from pathlib import Path

    try:
        if prompt_file == "-":
            given = "--prompt-file - (standard input)"
            raw = getattr(sys.stdin, "buffer", None)  # (a stand-in stream without bytes: its text as it is)
            text = sys.stdin.read() if raw is None else raw.read().decode("utf-8-sig")
            text = text.replace("\r\n", "\n").replace("\r", "\n")  # as read_text reads a file
        else:
            given = f"--prompt-file {prompt_file}"
            text = Path(prompt_file).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ValueError(f"--prompt-file: no file {prompt_file!r}{missing_path_hint(prompt_file)}") from None
    except IsADirectoryError:
        raise ValueError(f"--prompt-file: {prompt_file!r} is a directory; give a text file") from None
    except OSError as e:  # (a file this user may not read: a traceback)
        raise ValueError(f"--prompt-file: {prompt_file!r} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        where = "standard input" if prompt_file == "-" else repr(prompt_file)
        raise ValueError(f"--prompt-file: {where} is not UTF-8 text") from None
    return text.removesuffix("\n"), given


def encode_prompt(tokenizer, prompt: str, chat: bool, settings: dict[str, str] | None = None) -> list[int]:
    """The prompt's ids: its text, or with ``chat`` a user's message through the chat template
    (a transformers directory's own; for a run's tokenizer the one ``settings`` holds, kept from
    the instruct model it started from with its special tokens - ``LoadedRun.chat_settings`` -
    else the plain-text template attnres's exports get, :data:`attnres.hf.export.CHAT_TEMPLATE`).
    A plain prompt starts with what a run's tokenizer template puts before a text
    (:attr:`~attnres.data.tokenizer.BPETokenizer.prefix_ids`: a transformers model's ``<s>``), as
    its export's tokenizer and ``attnres eval`` encode it: the run and its export continue the
    same ids (a chat template writes its own)."""
    from ..data.tokenizer import text_ids

    if not chat:
        return text_ids(tokenizer, prompt)
    if hasattr(tokenizer, "encode_chat"):  # a transformers directory's tokenizer
        return tokenizer.encode_chat(prompt)
    from ..hf.export import CHAT_TEMPLATE, make_hf_tokenizer

    settings = dict(settings or {})
    settings.setdefault("chat_template", CHAT_TEMPLATE)
    rendered = make_hf_tokenizer(tokenizer, **settings).apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(rendered)


def _warn_non_finite(model, checkpoint) -> None:
    """Warn when ``model``'s weights hold NaN or infinite values: every logit is then
    non-finite and sampling picks token 0 (a NUL byte with the byte tokenizer) without a word."""
    import torch

    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        warn_user(f"the weights of {str(checkpoint)!r} hold NaN or infinite values ({len(bad)} tensor(s), e.g. "
                  f"{bad[0]!r}): the logits are not finite and the text generated is meaningless; generate from "
                  "an earlier checkpoint")


def _transformers_decode_only(args, what: str) -> None:
    """Refuse the options that only attnres's own decoder has, for a transformers model."""
    if args.chunk_size is not None or args.decode not in ("auto", "dynamic"):
        raise ValueError(f"{what}, which decodes over its own cache: --chunk-size and --decode static/compiled/graph "
                         "are for attnres's own models; omit them")


def _check_graph_decode(args) -> None:
    """``--decode graph`` where the model will not be on CUDA: said in the options' words,
    before the model loads (the library's check names ``decode='graph'``, after it). A
    transformers directory takes no static decode at all, which :func:`_load` says."""
    from ..checkpoint import is_hf_directory
    from ..inference.loading import pick_device

    if args.decode != "graph" or is_hf_directory(args.checkpoint):
        return
    if (device := pick_device(args.device)).type != "cuda":
        raise ValueError(f"--decode graph captures a CUDA graph, which needs a GPU: the model would be on {device} "
                         f"(--device {args.device}); use --decode static or compiled there, or --device cuda")


def _load(args):
    """``(model, tokenizer, stop ids)`` of ``--checkpoint``: a training checkpoint or run
    directory (its stored tokenizer), or a transformers directory (its own tokenizer and
    end-of-sequence ids)."""
    import sys

    import torch

    from ..checkpoint import is_hf_directory
    from ..hub import local_folder
    from ..inference.loading import load_run, load_tokenizer, pick_device

    args.checkpoint = local_folder(args.checkpoint, "CHECKPOINT")  # a Hub id: fetched into the Hugging Face cache
    if is_hf_directory(args.checkpoint):
        if args.tokenizer is not None:
            raise ValueError("--tokenizer: a transformers directory generates with its own tokenizer; omit it")
        from ..hf.directory import load_directory
        from ..progress import redraws_in_place, transformers_bars

        _transformers_decode_only(args, f"{args.checkpoint!r} is a transformers directory")
        with transformers_bars(redraws_in_place()):  # (its "Loading weights" bar: not in a log)
            model, text = load_directory(args.checkpoint, pick_device(args.device))
        # (which model: as a checkpoint's line says which checkpoint; a Hub id's, its folder in the cache)
        print(f"attnres generate: transformers directory {args.checkpoint} ({type(model).__name__})", file=sys.stderr)
        stops, source, chat = text.stop_ids, args.checkpoint, {}
    else:
        run = load_run(args.checkpoint, pick_device(args.device))
        # (which one: of a run directory, its newest that verifies, which a run still training replaces)
        print(f"attnres generate: checkpoint {run.checkpoint} (step {run.state.get('step')})", file=sys.stderr)
        model, text, source = run.model, load_tokenizer(run, args.tokenizer), run.checkpoint
        # a run started from an instruct model: its chat template and special tokens
        chat = run.chat_settings() if args.tokenizer is None else {}
        stops = run.stop_ids(text) if args.tokenizer is None else ()  # and every end-of-sequence id it listed
        family = run.run_config["model"].get("hf_architecture")
        if family is not None:
            _transformers_decode_only(args, f"this checkpoint's model is a transformers {family!r} model "
                                            "(model.hf_architecture)")
    _warn_non_finite(model, source)
    return model.to(getattr(torch, args.dtype)), text, stops, chat


def text_pieces(tokenizer, steps, new: list[int]):
    """The text of the tokens ``steps`` yields (batches of one), piece by piece as they come
    (:class:`~attnres.inference.TextPieces`: a character split over tokens printed once whole),
    each token appended to ``new``."""
    from ..inference import TextPieces

    text = TextPieces(tokenizer, new)
    for tokens in steps:
        if piece := text.add(int(tokens[0])):
            yield piece
    if rest := text.end():  # the end: a character cut short by the last token, as it is
        yield rest


def read_stops(values: list[str] | None) -> list[str]:
    r"""``--stop``'s strings with their backslash escapes read as in a Python string - as
    ``codecs.decode(value, "unicode_escape")`` reads ASCII - (``\n`` a line break, ``\t`` a
    tab, ``\\`` a backslash, ``\u00e9``), every other character as given; an escape that
    cannot be read (``\x4``) is a ``ValueError`` naming it, one Python does not know (``\q``)
    stays as written."""
    import shlex
    import warnings

    stops = []
    for value in values or ():
        try:
            with warnings.catch_warnings():  # (an unknown escape: a DeprecationWarning, the text kept)
                warnings.simplefilter("ignore")
                # (a character beyond Latin-1 travels as its \u escape: the codec reads bytes)
                stops.append(value.encode("latin-1", "backslashreplace").decode("unicode_escape"))
        except UnicodeDecodeError as e:
            raise ValueError(f"--stop {shlex.quote(value)}: {e.reason}; backslash escapes are read as in a Python "
                             r"string (\n, \t, \xXX, \uXXXX): write \\ for a backslash") from None
    return stops


def _show(text: str) -> None:
    """Print ``text`` to stdout at once, in its encoding: a character it has no byte for
    written '?', as an output under a locale that is not UTF-8 needs."""
    import sys

    if text:
        encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
        print(text.encode(encoding, "replace").decode(encoding), end="", flush=True)


def print_until_stop(pieces, stops) -> bool:
    """Print the text ``pieces`` as it comes (:func:`_show`), up to the first stop string of
    ``stops`` (a :class:`~attnres.inference.StopStrings`); whether Ctrl-C ended it (what was
    held back is printed then too)."""
    interrupted = False
    try:
        for piece in pieces:
            _show(stops.feed(piece))
            if stops.found is not None:  # (the stream's next steps are not run)
                break
    except KeyboardInterrupt:  # Ctrl-C: end the text's line, then say how far it got
        interrupted = True
    _show(stops.flush())
    return interrupted


def read_prompts(prompts: list[str] | None, prompt_files: list[str] | None, each_line: bool) -> list[tuple[str, str]]:
    """``(text, how it was given)`` of each prompt: every ``--prompt``, or every
    ``--prompt-file`` (:func:`read_prompt`; a file given more than once numbered by its
    occurrence, ``--prompt-file FILE #2``), with ``--each-line`` each of its lines that is not
    blank; an empty prompt is a ``ValueError`` naming it."""
    if each_line and not prompt_files:
        raise ValueError("--each-line reads the lines of --prompt-file as prompts: give --prompt-file FILE (or repeat "
                         "--prompt, one prompt each)")
    if prompt_files is not None and prompt_files.count("-") > 1:  # (the second read found it empty)
        raise ValueError(f"--prompt-file - (standard input) is given {prompt_files.count('-')} times, but standard "
                         "input is read once: give it once, with --each-line for a prompt per line")
    if prompts is not None:
        found = [(text, "--prompt" if len(prompts) == 1 else f"--prompt #{n}") for n, text in enumerate(prompts, 1)]
    else:
        found = []
        for k, name in enumerate(prompt_files):
            text, given = read_prompt(name)
            if prompt_files.count(name) > 1:  # (the same file again: its header would read as the first's)
                given += f" #{prompt_files[:k + 1].count(name)}"
            if not each_line:
                found.append((text, given))
                continue
            lines = [(line, f"{given}, line {n}") for n, line in enumerate(text.split("\n"), 1) if line.strip()]
            if not lines:
                raise ValueError(f"{given} holds no prompt: every line is blank")
            found += lines
    for text, given in found:  # (the text, not its ids: a chat template or a beginning-of-text token would fill them)
        if not text:
            raise ValueError(f"{given} is empty: there is nothing to continue")
    return found


def _encode_prompts(tokenizer, prompts: list[tuple[str, str]], chat: bool, settings: dict) -> list[list[int]]:
    """Each prompt's ids (:func:`encode_prompt`); one that gives none is refused, unknown
    tokens are warned of."""
    from ..data.tokenizer import unknown_share

    encoded = []
    for text, given in prompts:
        ids = encode_prompt(tokenizer, text, chat, settings)
        if not ids:  # (a text the tokenizer's normaliser removes whole)
            raise ValueError(f"{given} gives no tokens: there is nothing to continue")
        if (unknown := unknown_share(tokenizer, ids)) is not None:  # (a WordLevel or WordPiece tokenizer's [UNK])
            which = "the prompt" if len(prompts) == 1 else f"the prompt ({given})"
            warn_user(f"{unknown[1]} of {which}'s {len(ids)} tokens are the tokenizer's unknown token {unknown[0]!r}: "
                      "its vocabulary does not cover that text, and the model sees the unknown token in its place")
        encoded.append(ids)
    return encoded


def _warn_repeated(prompts: list[tuple[str, str]], encoded: list[list[int]], sampled: bool) -> None:
    """Warn of prompts of the same ids (a file given twice, a line repeated): they get the
    same completion - greedy, or (``sampled``) each with a generator seeded with ``--seed`` -
    not several samples of one prompt."""
    first: dict[tuple[int, ...], str] = {}
    why = ("each prompt samples with a generator seeded with --seed, as alone); for several samples of one prompt, "
           "run it with several --seed values" if sampled else "greedy decoding)")
    for (_, given), ids in zip(prompts, encoded):
        if (seen := first.setdefault(tuple(ids), given)) != given:
            warn_user(f"{given} is the same prompt as {seen}: it gets the same completion ({why}")


def left_padded(prompts: list[list[int]], device):
    """``(input_ids [B, T], attention_mask [B, T] or None)``: the prompts left-padded with id
    0 to the longest (``None``: all of one length, nothing to mask)."""
    import torch

    t = max(map(len, prompts))
    ids = torch.zeros(len(prompts), t, dtype=torch.long)
    mask = torch.zeros(len(prompts), t, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, t - len(prompt):] = torch.tensor(prompt)
        mask[row, t - len(prompt):] = 1
    return ids.to(device), (None if bool(mask.all()) else mask.to(device))


def _stream(model, prompts: list[list[int]], args, device, sampling) -> tuple:
    """``(the stream of [B] tokens, the decode it runs)``: the prompts continued in one batch,
    left-padded - by attnres's own model (:func:`~attnres.inference.stream`) or a transformers
    model (``model.hf_architecture``, a directory: :func:`~attnres.inference.stream_transformers`,
    over its own cache). ``sampling``: the stream's keyword arguments, a seeded generator a
    prompt included."""
    import sys

    from ..inference import resolve_decode, stream, stream_transformers
    from ..models import AttnResLM

    ids, mask = left_padded(prompts, device)
    if not isinstance(model, AttnResLM):
        return stream_transformers(model, ids, mask, **sampling), "transformers"
    decode = resolve_decode(model, args.decode)
    if decode == "compiled":  # otherwise tens of seconds pass without a word before the first token
        print("attnres generate: compiling the decode step (torch.compile; the first token waits for it)",
              file=sys.stderr, flush=True)
    return stream(model, ids, attention_mask=mask, chunk_size=args.chunk_size, decode=decode, **sampling), decode


def _collect(steps, n_rows: int) -> tuple[list[list[int]], bool]:
    """``(each prompt's new tokens, whether Ctrl-C ended the generation)``: the batch's stream
    run to its end."""
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    try:
        for tokens in steps:
            for row, token in zip(rows, tokens.tolist()):
                row.append(token)
    except KeyboardInterrupt:
        return rows, True
    return rows, False


def _print_completions(tokenizer, prompts: list[tuple[str, str]], rows, stops: list[str],
                       stop_ids) -> tuple[list[str], int]:
    """Print each prompt's completion under a ``==> N/M: HOW <==`` line, how it was given (as
    ``head`` heads each of several files), its text up to its first stop string - as one prompt alone prints
    it (:func:`~attnres.inference.text_until_stop`); return a line on each for the summary and
    the tokens of all (to the one that ended each)."""
    from ..inference import text_until_stop

    said, n, n_tokens = [], len(prompts), 0
    for k, ((_, given), row) in enumerate(zip(prompts, rows), 1):
        done = text_until_stop(tokenizer, row, stops, stop_ids)
        _show(("\n" if k > 1 else "") + f"==> {k}/{n}: {given} <==\n" + done.text + "\n")
        ended = "" if done.stop is None else f"stopped at --stop {done.stop!r} after "
        said.append(f"  {k}/{n} ({given}): {ended}{done.n_tokens} token{'s' * (done.n_tokens != 1)}")
        n_tokens += done.n_tokens
    return said, n_tokens


def run_generate(args) -> int:
    """``attnres generate``: stream the continuation to stdout (several prompts: each
    completion after the batch), then tokens/s (stderr)."""
    import sys
    import time

    import torch

    from ..checkpoint import is_hf_directory
    from ..data.tokenizer import tokenizer_file
    from ..inference import StopStrings, check_sampling
    from ..models.factory import context_limit

    try:
        if not 0 <= args.seed <= SEED_MAX:  # (checked before the model loads: torch's generator refuses it)
            raise ValueError(f"--seed must be an integer >= 0 and <= {SEED_MAX}; got {args.seed}")
        check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens, options=True)  # (before loading)
        check_optional_count("--chunk-size", args.chunk_size, "the whole prompt at once")
        _check_graph_decode(args)
        until = read_stops(args.stop)
        # before the model loads: a wrong path fails fast
        prompts = read_prompts(args.prompt, args.prompt_file, args.each_line)
        if args.tokenizer is not None and not is_hf_directory(args.checkpoint):  # (a directory's: refused as such)
            tokenizer_file(args.tokenizer, "--tokenizer")  # (a wrong path: said before the model loads)
        model, tokenizer, stops, chat = _load(args)
        encoded = _encode_prompts(tokenizer, prompts, args.chat, chat)
        _warn_repeated(prompts, encoded, args.temperature > 0)
        longest = max(range(len(encoded)), key=lambda k: len(encoded[k]))  # (of several: named)
        check_context(len(encoded[longest]), args.max_new_tokens, context_limit(model),
                      "the prompt" if len(prompts) == 1 else f"the longest prompt ({prompts[longest][1]})")
        device = next(model.parameters()).device
        # (one prompt's text is followed for its stop strings as it prints, print_until_stop; of several, the
        # stream ends each row at its own). Each prompt draws from a generator of its own, seeded with --seed:
        # its sampled completion is the one it gets alone.
        seeded = [torch.Generator(device=device).manual_seed(args.seed) for _ in prompts]
        sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, generator=seeded,
                        stop_tokens=stops, **(dict(stop_strings=until, tokenizer=tokenizer) if len(prompts) > 1 else {}))
        steps, decode = _stream(model, encoded, args, device, sampling)
        new: list[int] = []
        one = StopStrings(until)  # (one prompt: its text printed as it comes)
        t0 = time.perf_counter()
        if len(prompts) == 1:
            interrupted = print_until_stop(text_pieces(tokenizer, steps, new), one)
        else:
            rows, interrupted = _collect(steps, len(prompts))
        elapsed = time.perf_counter() - t0
        said, n_tokens = ([], len(new)) if len(prompts) == 1 else _print_completions(tokenizer, prompts, rows, until,
                                                                                      stops)
    except ValueError as e:
        raise SystemExit(f"attnres generate: error: {e}") from None
    if len(prompts) == 1:
        print()
        ended = ("interrupted after " if interrupted else "" if one.found is None
                 else f"stopped at --stop {one.found!r} after ")
    else:
        ended = f"{len(prompts)} prompts in one batch" + (", interrupted after " if interrupted else ": ")
    print(f"attnres generate: {ended}{n_tokens} token{'s' * (n_tokens != 1)} in {elapsed:.2f} s "
          f"({n_tokens / max(elapsed, 1e-9):.1f} tokens/s, prefill included, {device}, {args.dtype}, {decode} decode)",
          *said, sep="\n", file=sys.stderr)
    return 130 if interrupted else 0
