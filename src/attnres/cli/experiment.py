"""``attnres compare`` (the main job) and ``attnres experiment NAME`` (one of the report's
grids): train every (variant, seed) of a grid under ``--out``, then write its report."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ..termination import interrupted_status
from ..validation import missing_path_hint
from .common import apply_cpu_allocator, check_output_dir, train_config_keys

#: Each grid's presets (``attnres.experiments.PRESETS``, restated so that building the parser
#: imports no experiment code; a test keeps the two equal) and its default one.
GRID_PRESETS = {
    "compare": ("tiny", "demo", "long"),
    "ablation": ("tiny", "small", "cpu"),
    "block-size": ("tiny", "small", "cpu"),
    "scaling": ("tiny", "cpu"),
    "arch-sweep": ("tiny", "cpu"),
    "multiplier": ("tiny", "cpu"),
}
EXPERIMENT_NAMES = tuple(GRID_PRESETS)
DEFAULT_PRESET = {"compare": "demo"}  # the others: "cpu"
OVERHEAD_EXPERIMENTS = ("compare", "ablation", "block-size")  # grids whose tables compare the variants' cost
DEFAULT_OVERHEAD_REPEATS = 10


def add_compare_parser(sub) -> None:
    cmp = sub.add_parser(
        "compare",
        help="the main job: train standard, Block and Full AttnRes alike and write report.md with plots",
        description="Train the standard, Block AttnRes and Full AttnRes models with identical data, hyper-parameters "
        "and seeds on the default corpus (resumable: finished runs are skipped), then write --out/report.md with "
        "validation-loss curves, a loss table at equal steps, equal compute and equal time (step times measured side "
        "by side after training) with tokens/s, output and gradient magnitude per block (Fig. 5), depth-weight "
        "heatmaps (Fig. 8) and depth mixing matrices (Fig. 9). Same as `attnres experiment compare`.",
        override_keys=train_config_keys,
    )
    _grid_arguments(cmp, default_out="runs/compare", presets="'tiny' (seconds), 'demo' (minutes; default) or "
                    "'long' (the committed 12-block comparison, 30+ minutes per run)")


def add_experiment_parser(sub) -> None:
    ex = sub.add_parser(
        "experiment",
        help="run one of the report's experiment grids and write its tables and plots",
        description="Run every (variant, seed) of an experiment grid under --out (one run directory each; finished "
        "runs are skipped, interrupted ones resumed), then write --out/report.md and plots. Overrides apply to "
        "every run alike, e.g. `attnres experiment block-size --preset cpu --out runs/bs --seeds 0 1 steps=500`.",
        override_keys=train_config_keys,
    )
    ex.add_argument("name", choices=EXPERIMENT_NAMES, help="which grid")
    _grid_arguments(ex, default_out=None, presets="'tiny' (seconds), by grid - " + "; ".join(
        f"{name}: " + ", ".join(repr(p) + (" (default)" if p == DEFAULT_PRESET.get(name, "cpu") else "") for p in presets)
        for name, presets in GRID_PRESETS.items()))


#: Said of an argument argparse left over that is neither an option nor an override
#: (``attnres experiment ablation --out x steps``).
OVERRIDE_HINT = "an override looks like key=value, with dotted keys for sections, e.g. steps=500 model.d_model=128"


def accepts_extra(argument: str) -> bool:
    """An argument after an option (``--seeds 0 key=value``): an override."""
    return "=" in argument and not argument.startswith("-")


def run(args, parser) -> int:
    seeds_given = args.seeds is not None
    args.seeds = args.seeds if seeds_given else ["0"]
    _split_overrides(args, parser)
    name = "compare" if args.command == "compare" else args.name
    if args.report_only:
        _refuse_what_report_only_ignores(args, parser, seeds_given and bool(args.seeds))
    if not args.report_only:
        check_output_dir(f"attnres {args.command}", args.out)
    preset = args.preset or _saved_preset(args.out, name) or DEFAULT_PRESET.get(name, "cpu")
    repeats = args.overhead_repeats
    if repeats is None:
        repeats = DEFAULT_OVERHEAD_REPEATS if name in OVERHEAD_EXPERIMENTS else 0
    elif repeats > 0 and name not in OVERHEAD_EXPERIMENTS:  # (measured nowhere: it was ignored without a word)
        parser.commands[args.command].error(
            f"--overhead-repeats times the variants for an overhead table, which only {', '.join(OVERHEAD_EXPERIMENTS)} "
            f"report; the {name} grid has none: drop the option")
    if args.remeasure_overhead and name not in OVERHEAD_EXPERIMENTS:
        parser.commands[args.command].error(
            f"--remeasure-overhead times the variants for an overhead table, which only {', '.join(OVERHEAD_EXPERIMENTS)} "
            f"report; the {name} grid has none: drop the option")
    if args.remeasure_overhead and not repeats and not args.report_only:
        parser.commands[args.command].error("--remeasure-overhead times the variants again, which --overhead-repeats 0 "
                                            "turns off: drop one of them")
    return run_experiment_cli(name, preset, args.out, args.seeds, args.overrides, args.report_only,
                              repeats, args.variants, prog=f"attnres {args.command}",
                              remeasure_overhead=args.remeasure_overhead)


def _refuse_what_report_only_ignores(args, parser, seeds_given: bool) -> None:
    """``--report-only`` trains and times nothing and reports every finished run: given with
    it, ``--seeds``, ``--variants``, ``--overhead-repeats N`` and ``--remeasure-overhead``
    were dropped without a word (a report of every seed, no overhead measured, where the
    command asked for one seed or a timing). Overrides are checked against the grid's
    (:func:`run_experiment_cli`)."""
    given = [option for option, is_given in (("--seeds", seeds_given), ("--variants", args.variants is not None),
                                             ("--overhead-repeats", bool(args.overhead_repeats)),
                                             ("--remeasure-overhead", args.remeasure_overhead)) if is_given]
    timing = (" (to time the variants, run the grid's command again with --remeasure-overhead and without "
              "--report-only: it trains nothing once every run has finished)"
              if {"--overhead-repeats", "--remeasure-overhead"} & set(given) else "")
    if given:
        parser.commands[args.command].error(f"--report-only only rewrites the report, of every finished run in --out; "
                                            f"it takes no {', '.join(given)}{timing}")


def _split_overrides(args, parser) -> None:
    """``--seeds 0 1 key=value``: argparse fills the seed list (and ``--variants``) with the
    overrides after it; they end the list."""
    args.overrides = [t for t in args.seeds if "=" in t] + args.overrides
    if args.variants is not None:  # the same for `--variants a b key=value`
        args.overrides = [t for t in args.variants if "=" in t] + args.overrides
        args.variants = [t for t in args.variants if "=" not in t]
    seeds = [t for t in args.seeds if "=" not in t]
    not_integers = [t for t in seeds if not re.fullmatch(r"-?[0-9]+", t)]
    if not_integers:
        a_key = any(t.replace(".", "_").isidentifier() for t in not_integers)  # an override's key without =value
        parser.commands[args.command].error(f"--seeds takes integers; got {', '.join(map(repr, not_integers))}"
                                            + (f" ({OVERRIDE_HINT})" if a_key else ""))
    args.seeds = [int(t) for t in seeds]


def _grid_arguments(parser: argparse.ArgumentParser, default_out: str | None, presets: str) -> None:
    """The options `compare` and `experiment` share."""
    parser.add_argument("--preset", help=f"grid size: {presets}")
    if default_out is None:
        parser.add_argument("--out", required=True, help="results directory")
    else:
        parser.add_argument("--out", default=default_out, help=f"results directory (default {default_out})")
    parser.add_argument("--seeds", nargs="+", default=None, help="seeds of every variant (default 0)")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from finished runs")
    parser.add_argument("--variants", nargs="+", metavar="NAME",
                        help="train only these variants of the grid (e.g. to split it over processes sharing --out); "
                        "the report covers every finished run in --out")
    parser.add_argument("--overhead-repeats", type=int, default=None,
                        help="compare / ablation / block-size: after training, time one step of every variant side by side "
                        "over this many interleaved rounds (CPU time of the process at one thread, with its noise) and "
                        "measure its peak memory, for the report's overhead columns (default 10; 0 = use the step times "
                        "the runs logged); other grids have no such columns")
    parser.add_argument("--remeasure-overhead", action="store_true",
                        help="compare / ablation / block-size: time the variants again where the command trains "
                        "nothing (every run finished) and overhead.json already holds a measurement of the same "
                        "models, batch and --overhead-repeats on this machine, which such a command otherwise keeps")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value",  # default: not listed as required
                        help="TrainConfig overrides for every run")


def _saved_preset(out: str, name: str) -> str | None:
    """The preset of the ``name`` experiment already in ``out`` (its experiment.json), so that
    a command without ``--preset`` continues or reports that grid rather than the default's."""
    from ..experiments.layout import read_experiment_header

    header = read_experiment_header(out)
    if header is None or header.get("experiment") != name or not isinstance(header.get("preset"), str):
        return None
    return header["preset"]


def run_experiment_cli(name: str, preset: str, out: str, seeds: list[int], overrides: list[str], report_only: bool,
                       overhead_repeats: int = 0, variants: list[str] | None = None,
                       prog: str = "attnres experiment", remeasure_overhead: bool = False) -> int:
    """``attnres experiment`` / ``attnres compare``: bad presets, seeds or overrides end the
    process with a one-line message, prefixed with ``prog`` (the command the user typed).
    A command that trains nothing keeps the overhead measurement of the same settings
    (``overhead.json``) unless ``remeasure_overhead``."""
    from ..experiments import get_experiment, load_records, measure_overhead, run_experiment, write_report
    from ..experiments.job.overhead import stored_overhead
    from ..experiments.job.runner import check_same_experiment, nothing_to_train
    from ..experiments.job.report import reportable
    from ..train import TrainingDiverged, TrainingOutOfMemory
    from ..train.config import apply_overrides

    if overhead_repeats < 0:
        raise SystemExit(f"{prog}: error: --overhead-repeats must be >= 0; got {overhead_repeats}")
    if report_only and not Path(out).exists():  # (not "no finished runs", as if the grid were there)
        raise SystemExit(f"{prog}: error: --out {out!r} does not exist{missing_path_hint(out, directories_only=True)}: "
                         "there is no grid there to report on")
    if report_only and Path(out).is_file():
        raise SystemExit(f"{prog}: error: --out {out!r} is a file: give the grid's folder (the --out it was trained into)")
    # What the report needs (the 'experiments' extra), before any run trains: missing, it was said
    # only once every run had finished (hours, for a real grid). main() names the extra.
    import matplotlib  # noqa: F401
    import scipy  # noqa: F401
    try:
        experiment = get_experiment(name, preset)
        # the report of another grid in `out` must not be overwritten (said first: its variants are others too)
        # (a report's overrides, given, must be the grid's: it reports the runs as they were trained; a run's
        # are compared by run_experiment, after each is validated)
        given = {"overrides": overrides} if overrides or not report_only else {}
        check_same_experiment(out, {"experiment": name, "preset": preset, **given}, check_overrides=report_only)
        _refuse_variants_added_in_python(out, name, experiment)
        if not report_only:
            apply_cpu_allocator(apply_overrides({}, overrides))
            timed = bool(overhead_repeats) and name in OVERHEAD_EXPERIMENTS
            # (asked before training: a re-run of a finished grid kept no numbers of its own - its report's
            # step-time ratios changed at every re-run that trained nothing)
            keep = timed and not remeasure_overhead and nothing_to_train(experiment, out, seeds, overrides, variants)
            run_experiment(experiment, out, seeds, overrides, variants=variants)
            if not load_records(out, experiment) and _stop_after(overrides) is not None:  # (nothing to time or report)
                print(f"{prog}: every run stopped at step {_stop_after(overrides)} (stop_after), none finished, so no "
                      "report yet: the same command without stop_after continues them")
                return 0
            if keep and stored_overhead(experiment, out, overrides, overhead_repeats) is not None:
                rounds = f"{overhead_repeats} round{'' if overhead_repeats == 1 else 's'}"
                print(f"{prog}: nothing trained; the step times and memory of overhead.json, measured on this "
                      f"machine with these models, batch and {rounds}, are kept (--remeasure-overhead times them again)")
            elif timed:
                measure_overhead(experiment, out, overrides, overhead_repeats)
        records = load_records(out, experiment)  # every seed finished so far, not only this invocation's
        path = write_report(name, records, out, preset)
    except (ValueError, TrainingDiverged, TrainingOutOfMemory) as e:
        raise SystemExit(f"{prog}: error: {e}") from None
    except KeyboardInterrupt as e:  # a run checkpointed on SIGINT/SIGTERM: re-running resumes it
        print(f"{prog}: interrupted ({e or 'SIGINT'}); run the same command again to resume")
        return interrupted_status(e)
    reported = len(reportable(records))  # (the report names those it leaves out, and why)
    print(f"{prog}: {reported} run{'' if reported == 1 else 's'} reported"
          + (f" of {len(records)} finished" if reported < len(records) else "") + f"; report {path}")
    return 0


def _stop_after(overrides: list[str]):
    """The ``stop_after=K`` among a grid command's ``overrides`` (the last one), else ``None``."""
    from ..train.config import parse_override

    given = [value for keys, value in map(parse_override, overrides) if keys == ["stop_after"]]
    return given[-1] if given else None


def _refuse_variants_added_in_python(out: str, name: str, experiment) -> None:
    """Raise ``ValueError`` when ``out`` holds finished runs of variants that are not in the
    grid (a residual of the user's added in Python, docs/experiments.md 'Grids'): the report
    written from the command line knows the grid's variants only, and replaced the one that
    had them with one that left them out, saying nothing."""
    from ..experiments import load_records

    own = {v.name for v in experiment.variants}
    added = sorted({r.get("variant") for r in load_records(out) if r.get("variant") not in own}, key=str)
    if added:
        raise ValueError(f"{str(out)!r} holds finished runs of variants not in the {name!r} grid ({', '.join(map(str, added))}"
                         f": added to it in Python, docs/experiments.md 'Grids'); a report written from the command line "
                         "would leave them out: write it in Python with that grid (write_report(name, "
                         "run_experiment(grid, out), out)), or pick another --out")
