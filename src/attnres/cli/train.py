"""``attnres train``: train (or continue) a run from a YAML config plus key=value overrides."""

from __future__ import annotations

import argparse
import os
import sys

from ..termination import Terminated, interrupted_status
from .common import (apply_cpu_allocator, attnres_command, end_process, first_on_node,
                     leave_the_message_to_the_first_on_node, rank_zero, resume_command, train_config_keys)


def add_parser(sub) -> None:
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
        override_keys=train_config_keys, path_option="--config",
    )
    tr.add_argument("--config", metavar="CONFIG.yaml",
                    help="YAML file with TrainConfig fields (default: built-in defaults); may also be given "
                    "without --config")
    tr.add_argument("--resume", action="store_true",
                    help="continue from the newest valid checkpoint in out_dir (= resume=true); without a config file, "
                    "with the run's own config as stored with it (the overrides given change it)")
    tr.add_argument("--resume-from", metavar="DIR",
                    help="continue from this checkpoint (a step-* directory, or a run directory: its newest valid "
                    "one) into out_dir (= resume_from=DIR)")
    tr.add_argument("--print-config", action="store_true",
                    help="print the resolved config (YAML, after --config and the overrides) and exit")
    tr.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                    help="config overrides, YAML-parsed values (an argument without '=' is the config file)")


def accepts_extra(argument: str) -> bool:
    """An argument after an option (``--resume steps=10``): an override or the config file."""
    return not argument.startswith("-")


def run(args, parser) -> int:
    config, overrides = _config_file_and_overrides(parser.commands["train"], args.config, args.overrides)
    flags = (["resume=true"] if args.resume else []) + ([f"resume_from={args.resume_from}"] if args.resume_from else [])
    return run_train(config, overrides + flags, args.print_config)


def _config_reference() -> str:
    """Every config field (``train --help``); without the 'train' extra, how to get it."""
    try:
        from ..train.reference import config_reference
    except ImportError as e:  # a base install: the options above still help
        from ..extras import install_command

        return (f"The list of every config field (and training itself) needs the 'train' extra: "
                f"{install_command('train')} (the module {(e.name or '?').partition('.')[0]!r} is not installed).")
    return config_reference()


def _config_file_and_overrides(parser, config: str | None, arguments: list[str]) -> tuple[str | None, list[str]]:
    """``attnres train [CONFIG.yaml] [key=value ...]``: an argument without ``=`` is the config
    file (what users type, and what multi-node recipes pass), the same as ``--config``."""
    files = [a for a in arguments if "=" not in a]
    given = [f for f in (config, *files) if f is not None]
    named = [a for a in arguments if "=" in a and a.endswith((".yaml", ".yml")) and os.path.isfile(a)]
    if named and not given:  # (its '=' made it an override: "unknown TrainConfig key(s) ['a']")
        from ..shell_words import shell_path

        parser.error(f"{named[0]!r} is a config file, but the '=' in its name makes it a key=value override here: "
                     f"give it with --config {shell_path(named[0])}")
    if len(given) > 1:
        parser.error(f"one config file at most (as the first argument or with --config); got {given}")
    if files and os.path.isdir(files[0]):
        parser.error(f"{files[0]!r} is a directory, not a config file (a YAML file) or a key=value override")
    if files:
        from ..train.config import config_path, missing_config_error  # configs/NAME.yaml: also the shipped one

        if not config_path(files[0]).is_file():  # (a .yaml one: the nearest name, as --config says it)
            parser.error(missing_config_error(files[0]) if files[0].endswith((".yaml", ".yml")) else
                         f"{files[0]!r} is neither a key=value override nor a config file")
    return (given[0] if given else None), [a for a in arguments if "=" in a]


def _train_error(error: BaseException) -> SystemExit:
    """The exit of ``attnres train`` on ``error``: its one line, printed once per node when
    every rank has it alike (an error before the ranks have joined comes from the same config
    on every rank; after, :func:`~attnres.distributed.launch.raised_on_every_rank` says so);
    a rank's own error is printed where it happened."""
    import torch.distributed as dist

    from ..distributed.launch import raised_on_every_rank

    alike = raised_on_every_rank(error) or not (dist.is_available() and dist.is_initialized())
    if alike and not first_on_node():
        leave_the_message_to_the_first_on_node()
        return SystemExit(1)
    return SystemExit(f"attnres train: error: {error}")


def _exit_after_collective_failure(exit_: SystemExit) -> None:
    """End a rank whose process group broke: its message, then ``os._exit(1)``. A normal
    interpreter exit would destroy the backend's threads still waiting on the dead peer, and
    gloo's then abort the process ("terminate called without an active exception", exit
    status -6) after the clear message, now and then."""
    end_process(exit_.code if isinstance(exit_.code, str) else 1)


def run_train(config_path: str | None, overrides: list[str], print_config: bool = False) -> int:
    """``attnres train``: errors in the config, data or checkpoints end the process with a
    one-line message; an interrupted run exits with 128 + the signal number. With
    ``print_config``, print the resolved config and exit."""
    from ..nn.residual.block import naming_block_size
    from ..train.config import BLOCK_SIZE_FIELD

    with naming_block_size(BLOCK_SIZE_FIELD):  # (the single block's warning names the override, not upcycle's flag)
        return _run_train(config_path, overrides, print_config)


def _run_train(config_path: str | None, overrides: list[str], print_config: bool = False) -> int:
    import signal

    from ..checkpoint import refuse_out_dir_not_a_run
    from ..distributed.launch import DistributedError
    from ..nn.residual.kinds import UnregisteredResidual
    from ..models.config import warn_unread_residual_fields
    from ..train import TrainingDiverged, TrainingOutOfMemory, train
    from ..train.config import config_data, sets_vocab_size, yaml_dump
    from ..train.resume import unregistered_in_the_resumed_run

    try:
        try:
            config, residual_fields, held = _configured_held(config_path, overrides)
        except UnregisteredResidual as e:  # (a resumed run's kind restated without --import)
            said = unregistered_in_the_resumed_run(e, config_data(config_path, overrides))
            if said is None:
                raise
            raise ValueError(said) from None
        stored_in = None
        if config_path is None and config.resuming:  # the run's own config: no model to restate
            refuse_out_dir_not_a_run(config.out_dir)  # (before saying it resumes what is there)
            config, stored_in = _the_runs_config(config, overrides, held)
            if stored_in is not None and rank_zero():
                print(f"attnres train: resuming with the config stored in {stored_in} (no config file given), "
                      "the command's overrides applied", file=sys.stderr)
        if stored_in is None:  # (else they were of the defaults; the run's config, built with the overrides, said its own)
            _show(held)
        # (against the config trained: `--resume model.residual.block_size=8` sets the run's variant's)
        warn_unread_residual_fields(residual_fields, config.model)
        if print_config:
            if not first_on_node():  # every rank of a launch resolves the same config
                return 0
            print(yaml_dump(config.to_dict()), end="")
            # (a YAML comment: the printed config still loads as it is)
            print("# model.vocab_size is replaced by the tokenizer's vocabulary when the run starts (data.tokenizer, "
                  "data.vocab_size; an init_from or resumed model's padded embedding keeps its size)")
            note = _default_options_note(config.model.residual)
            if note:
                print(note)
            return 0
        apply_cpu_allocator(config.to_dict())
        result = train(config, vocab_size_given=sets_vocab_size(config_path, overrides))
    except DistributedError as e:
        _exit_after_collective_failure(_train_error(e))
    except (ValueError, TrainingDiverged, TrainingOutOfMemory) as e:
        raise _train_error(e) from None
    except KeyboardInterrupt as e:  # before the loop (reading or tokenising the data), or a second Ctrl-C in it
        stopped = "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"
        if rank_zero():
            print(f"attnres train: {stopped} before a checkpoint was written; run the same command again (with "
                  "--resume where the run already has checkpoints)", file=sys.stderr)
        return interrupted_status(e)
    if result.interrupted:
        if rank_zero():
            print(f"attnres train: stopped by {result.interrupted} after step {result.step}; checkpoint "
                  f"{result.checkpoint}; {_how_to_continue(config)}")
        return 128 + int(getattr(signal, result.interrupted))
    if rank_zero():
        print(_end_of_run(result, config))
    return 0


def _configured_held(config_path: str | None, overrides: list[str]) -> tuple:
    """:func:`~attnres.train.config.configured` and the warnings it gave, held back: a resume
    without a config file trains the run's own config with the overrides
    (:func:`~attnres.train.resume.config_of_the_run`), and what was said of the defaults they
    were applied to is not of it (`--resume model.residual.block_size=8` on a 24-layer run
    warned that 8 "is at least the model's 4 sublayers", the default model's). Shown at once
    where the config cannot be built."""
    import warnings

    from ..train.config import configured

    with warnings.catch_warnings(record=True) as held:
        try:
            built, failed = configured(config_path, overrides), None
        except BaseException as e:  # noqa: BLE001 - shown, then raised as it was
            built, failed = None, e
    if failed is not None:
        _show(held)
        raise failed
    return (*built, held)


def _the_runs_config(config, overrides: list[str], held: list) -> tuple:
    """:func:`~attnres.train.resume.config_of_the_run`, with the warnings it gives. Where it
    fails, the ``held`` warnings that are the overrides' own are shown with them, before the
    error: the ``DeprecationWarning`` of an old spelling (``model.attnres_block_size=2``) is
    true of whatever config it is applied to, and may explain the error - it was dropped with
    the rest (the run's config, built, gives it again; one not yet built did not). What was
    said of the defaults' model (a single block of their depth) is not of the run, and stays
    unsaid."""
    import warnings

    from ..train.resume import config_of_the_run

    with warnings.catch_warnings(record=True) as said:
        try:
            found, failed = config_of_the_run(config, overrides), None
        except BaseException as e:  # noqa: BLE001 - shown with the warnings, then raised as it was
            found, failed = None, e
    if failed is not None:
        again = {str(w.message) for w in said}  # (given again by the run's config before it failed)
        _show([w for w in held if issubclass(w.category, DeprecationWarning) and str(w.message) not in again])
    _show(said)
    if failed is not None:
        raise failed
    return found


def _show(held: list) -> None:
    """Show the warnings ``held`` (``warnings.catch_warnings(record=True)``'s) as they would
    have been shown. They passed the filters when raised, under the module that raised them:
    issued again (``warn_explicit`` without it), a ``DeprecationWarning`` of the package was
    filtered as a file path's and hidden by Python's default filters (``model=demo`` and
    ``model.attnres_block_size=4`` said nothing of their new spellings)."""
    import warnings

    for w in held:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


def _default_options_note(residual) -> str | None:
    """A YAML comment naming the options of a residual built from its ``__init__`` arguments
    that are left at their defaults: ``options`` holds only those set, so ``--print-config``
    showed ``options: {}`` and none of the variant's settings."""
    import inspect

    from ..nn.residual import ResidualStream, residual_class

    cls = residual_class(residual.kind)
    if cls.from_config.__func__ is not ResidualStream.from_config.__func__:  # (built-ins: fields of their own)
        return None
    params = list(inspect.signature(cls.__init__).parameters.values())[3:]  # after self, dim, n_sublayers
    unset = [f"{p.name}={p.default!r}" for p in params if p.default is not p.empty and p.name not in residual.options
             and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return (f"# model.residual.options of residual {residual.kind!r} left at {cls.__qualname__}'s defaults: "
            f"{', '.join(unset)}") if unset else None


def _how_to_continue(config) -> str:
    """The command that continues the run of ``config``: under torchrun, launched as this run
    was, with its ``parallel.*`` settings (the stored config leaves the layout to the launch:
    a plain `attnres train ... --resume` resumes a 4-rank tp x pp run in one process)."""
    attnres = attnres_command(config.model.residual.kind)  # (without --import the resume fails: kind not registered)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None
    command = resume_command(str(config.out_dir), attnres, config.parallel.to_dict(), world, per_node)
    if world <= 1:
        return f"continue with --resume (`{command}`: the run's own config)"
    return (f"continue with --resume, launched as this run was (`{command}`: the run's own config; any other layout "
            "resumes it too)")


def _end_of_run(result, config) -> str:
    """The last line of a run that ended by itself: at its last step, or before it (``stop_after``)."""
    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    stale = result.val_loss is not None and result.val_step not in (None, result.step)
    measured = f" (at step {result.val_step})" if stale else ""
    steps = config.steps
    early = result.step < steps
    what = f"stopped at step {result.step} of {steps} (stop_after)" if early else f"finished at step {result.step}"
    return (f"attnres train: {what}, train loss {fmt(result.train_loss)}, val loss {fmt(result.val_loss)}{measured}; "
            f"checkpoint {result.checkpoint}" + (f"; {_how_to_continue(config)}" if early else ""))
