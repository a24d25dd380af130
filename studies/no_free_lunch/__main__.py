"""``python -m studies.no_free_lunch``: run the no-free-lunch grid (resumable) and write its report."""

from __future__ import annotations

import argparse
import sys

from attnres.output_paths import OutputPathError, check_output_dir

from .study import NFL_PRESETS, PROG, run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run every (setting, variant, depth, lam, seed) of the no-free-lunch grid under --out "
        "(finished runs are skipped), then write --out/report.md and plots. key=value overrides set fields of the "
        "grid's configuration, e.g. steps=800 \"depths=[4,30]\".")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="configuration overrides")
    parser.add_argument("--preset", default="cpu", help=f"grid size: {', '.join(map(repr, NFL_PRESETS))} (default 'cpu')")
    parser.add_argument("--out", required=True, help="results directory")
    parser.add_argument("--seeds", nargs="+", default=["0"], help="seeds of every run (default 0)")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from finished runs")
    parser.add_argument("--variants", nargs="+", metavar="NAME",
                        help="train only these variants (e.g. to split the grid over processes sharing --out)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse fills a positional list once: overrides written after an option (`--seeds 0 1
    # steps=2`, `--variants full steps=2`) end that option's list or arrive as extras.
    if any(e.startswith("-") or "=" not in e for e in extra):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = [t for t in args.seeds if "=" in t] + args.overrides + extra
    if args.variants is not None:
        args.overrides = [t for t in args.variants if "=" in t] + args.overrides
        args.variants = [t for t in args.variants if "=" not in t]
    try:
        seeds = [int(t) for t in args.seeds if "=" not in t]
    except ValueError:
        parser.error(f"--seeds takes integers; got {args.seeds!r}")
    if not args.report_only:
        try:
            check_output_dir(args.out, "--out")
        except OutputPathError as e:
            raise SystemExit(f"{PROG}: error: {e}") from None
    return run_cli(args.preset, args.out, seeds, args.overrides, args.report_only, args.variants)


if __name__ == "__main__":
    sys.exit(main())
