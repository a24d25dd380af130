"""Command-line entry point: ``attnres <command>`` (or ``python -m attnres``).

One module per command, each with its parser (``add_parser``) and what it runs (``run``);
:data:`COMMANDS` lists them, :func:`build_parser` builds the parser from that table and
:func:`main` dispatches by lookup. What the commands share is in :mod:`.common`.
"""

from __future__ import annotations

import os  # (the tests also replace os._exit through attnres.cli.os)
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from ..termination import Terminated, interrupted_status
from . import analyze, env, experiment, export, generate, plot, status, train, upcycle
from . import eval as eval_command
from .common import (ImportModule, Parser, end_process, expand_home, missing_extra, override_split_by_the_shell,
                     plain_warnings, record_given_imports, refuse_a_multi_rank_launch, refuse_empty_values,
                     resolve_checkpoint, version_line)
from .experiment import EXPERIMENT_NAMES
from .generate import check_context

__all__ = ["COMMANDS", "EXPERIMENT_NAMES", "build_parser", "check_context", "main", "missing_extra", "run"]


@dataclass(frozen=True)
class Command:
    """One ``attnres`` command: ``add_parser(subparsers)`` adds its parser, ``run(args,
    parser)`` runs it and returns the exit status; ``accepts_extra`` says which arguments
    argparse left over it takes as overrides (argparse fills a positional list once, so
    overrides written after an option, ``--resume steps=10``, arrive as extras; ``None``:
    none)."""

    add_parser: Callable
    run: Callable
    accepts_extra: Callable[[str], bool] | None = None
    #: Said after "unrecognized arguments" when one of them is not an option (a second path,
    #: an override without its ``=value``).
    extra_path_hint: str = ""


#: Every command, in the order ``attnres --help`` lists them.
COMMANDS: dict[str, Command] = {
    "train": Command(train.add_parser, train.run, train.accepts_extra),
    "compare": Command(experiment.add_compare_parser, experiment.run, experiment.accepts_extra,
                       extra_path_hint=experiment.OVERRIDE_HINT),
    "experiment": Command(experiment.add_experiment_parser, experiment.run, experiment.accepts_extra,
                          extra_path_hint=experiment.OVERRIDE_HINT),
    "generate": Command(generate.add_parser, generate.run),
    "export": Command(export.add_parser, export.run),
    "analyze": Command(analyze.add_parser, analyze.run,
                       extra_path_hint="one checkpoint at a time; to compare two: attnres analyze A --compare B"),
    "upcycle": Command(upcycle.add_parser, upcycle.run),
    "eval": Command(eval_command.add_parser, eval_command.run),
    "status": Command(status.add_parser, status.run),
    "plot": Command(plot.add_parser, plot.run),
    "env": Command(env.add_parser, env.run),
}

#: The commands that run in one process and write what they make, and why: under a
#: multi-rank launch they are refused (every rank ran them whole). `train` is the launch's
#: command; `status` and `env` only read (`env` on each node of a launch says what each has).
_READS_SHARDS = "sharded checkpoints included: it reads every rank's shards itself"
_A_GRID = ("it trains its runs one after another and times their steps side by side; to spread a grid over "
           "processes, start one per --variants, sharing --out")
ONE_PROCESS_COMMANDS = {"generate": _READS_SHARDS, "export": _READS_SHARDS, "analyze": _READS_SHARDS,
                        "eval": _READS_SHARDS, "upcycle": "a transformers model in, one out", "plot": "one figure",
                        "compare": _A_GRID, "experiment": _A_GRID}


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
        with plain_warnings():
            status = main()
        sys.stdout.flush()  # (what is still buffered meets a closed pipe here, not at exit)
    except SystemExit as e:
        status = e.code
    except BrokenPipeError:  # the reader of stdout stopped (`attnres env | head -3`): end quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 128 + 13  # killed by SIGPIPE, as the shell reports it
    if not _in_process_group():
        raise SystemExit(status)
    from ..distributed.launch import destroy_process_group

    destroy_process_group()
    end_process(status)


def build_parser() -> Parser:
    parser = Parser(prog="attnres", description="Attention Residuals for PyTorch")
    parser.add_argument("--version", action="version", version=version_line())
    parser.add_argument("--import", dest="imports", action=ImportModule, metavar="MODULE", default=[],
                        help="import MODULE first (repeatable; or a .py file's path), e.g. one that registers its own "
                        "residual with attnres.register_residual: `attnres --import my_residuals train "
                        "model.residual.kind=mine`")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS.values():
        command.add_parser(sub)
    parser.commands = sub.choices  # name -> the command's parser
    return parser


def main(argv: list[str] | None = None) -> int:
    """``attnres``: parse the command line, warn about a name clash, run the command; a
    command that needs an extra that is not installed says which."""
    from ..extras import reinstall_command
    from ..name_clash import warn_about_clashes

    # Show the package's own deprecations (Python hides DeprecationWarning outside __main__):
    # an old config key should say what replaces it.
    warnings.filterwarnings("default", category=DeprecationWarning, module=r"attnres(\.|$)")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # --version and --help end here, at once
    record_given_imports(args.imports)
    warn_about_clashes(reinstall_command)  # every distribution's file list: a fraction of a second
    command = COMMANDS[args.command]
    split = override_split_by_the_shell(getattr(parser.commands[args.command], "_given", [])) \
        if command.accepts_extra is not None else None
    if split is not None:  # (its pieces after the first were read as a config file, a seed, an argument)
        parser.commands[args.command].error(f"the shell split an override at its spaces: quote it, \"{split}\", or "
                                            "leave the spaces out")
    if extra and (command.accepts_extra is None or not all(command.accepts_extra(e) for e in extra)):
        hint = f" ({command.extra_path_hint})" if command.extra_path_hint and any(
            not e.startswith("-") for e in extra) else ""
        if any(e == "--import" or e.startswith("--import=") for e in extra):  # an option of `attnres` itself
            hint = f" (--import goes before the command: `attnres --import MODULE {args.command} ...`)"
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if extra:
        args.overrides = args.overrides + extra
    if args.command in ONE_PROCESS_COMMANDS:
        refuse_a_multi_rank_launch(args.command, ONE_PROCESS_COMMANDS[args.command])
    refuse_empty_values(parser.commands[args.command], args)
    expand_home(args)
    try:
        # (inside: naming a checkpoint that is not there imports attnres.checkpoint, and with it
        # safetensors, which a base install lacks - the train extra's line, not a traceback)
        resolve_checkpoint(args)
        return command.run(args, parser)
    except KeyboardInterrupt as e:  # Ctrl-C (or a SIGTERM) outside a training loop's own handling: one line
        print(f"attnres {args.command}: {'stopped by SIGTERM' if isinstance(e, Terminated) else 'interrupted'}",
              file=sys.stderr)
        return interrupted_status(e)
    except ImportError as e:
        message = missing_extra([args.command], e)
        if message is None:
            raise
        raise SystemExit(message) from None
