"""Is the main job's step-time ratio robust to other load on the machine?

Runs ``attnres compare`` (what ``make demo`` runs) once on a quiet machine and then
``--loaded-runs`` times with busy loops on every core beside it, and compares the step-time
ratios of the reports' ``overhead.json``. The first run trains the models (about 7 minutes
for the demo preset); the later ones find the runs finished and only re-time the steps
(``--remeasure-overhead``: a re-run that trains nothing keeps the measurement otherwise) and
rewrite the report. A loaded run passes when every AttnRes ratio is within ``--tolerance``
of the quiet run's, or when its report says that variant's equal-time reading is too noisy
(or draws none).

    python benchmarks/demo_under_load.py                          # preset demo into runs/compare
    python benchmarks/demo_under_load.py --preset tiny --out runs/load-tiny --repeats 4   # a smoke run

Writes ``<out>/under-load/summary.md`` (and each condition's report and overhead.json beside
it); exits 1 when a loaded run fails. Run it with nothing else on the machine: "quiet" must be.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

from bench_training_overhead import out_dir

from attnres.output_paths import write_text_atomically


def _spin() -> None:
    while True:
        pass


def run_compare(preset: str, out: Path, repeats: int, overrides: list[str], busy: int) -> tuple[dict, str]:
    """``attnres compare`` with ``busy`` busy-loop processes beside it: (overhead.json, report.md)."""
    loops = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
    for p in loops:
        p.start()
    try:
        subprocess.run([sys.executable, "-m", "attnres", "compare", "--preset", preset, "--out", str(out),
                        "--overhead-repeats", str(repeats), "--remeasure-overhead", *overrides], check=True)
    finally:
        for p in loops:
            p.terminate()
            p.join()
    return json.loads((out / "overhead.json").read_text()), (out / "report.md").read_text()


LABELS = {"block": "Block AttnRes", "full": "Full AttnRes"}


def verdict(quiet: dict, loaded: dict, report: str, name: str, tolerance: float) -> str:
    """``within`` (the loaded ratio is within ``tolerance`` of the quiet one); else ``flagged``
    (the loaded report calls the variant's equal-time reading too noisy), ``unread`` (it
    draws no equal-time conclusion: the budget falls outside the evaluated curve) or ``FAIL``."""
    if abs(loaded["variants"][name]["step_ratio"] - quiet["variants"][name]["step_ratio"]) <= tolerance:
        return "within"
    label = LABELS.get(name, name)
    if f"{label} at equal time: too noisy" in report:
        return "flagged"
    return "FAIL" if f"{label} at equal time:" in report else "unread"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--out", type=out_dir, default="runs/compare")
    parser.add_argument("--repeats", type=int, default=10, help="--overhead-repeats of every run (default 10)")
    parser.add_argument("--loaded-runs", type=int, default=2)
    parser.add_argument("--busy", type=int, default=os.cpu_count(), help="busy loops beside a loaded run (default: one per core)")
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("overrides", nargs="*", help="TrainConfig overrides passed to attnres compare")
    args = parser.parse_args(argv)
    # (checked before the quiet run: --loaded-runs 0 was an IndexError after it, a negative
    # --tolerance a FAIL of every loaded run)
    for name in ("repeats", "loaded_runs", "busy"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be an integer >= 1, got {getattr(args, name)}")
    if not args.tolerance >= 0:
        parser.error(f"argument --tolerance: must be a number >= 0, got {args.tolerance}")
    from attnres.experiments import get_experiment

    try:  # (else `attnres compare` fails in a subprocess and this one with a CalledProcessError traceback)
        get_experiment("compare", args.preset)
    except ValueError as e:
        parser.error(f"argument --preset: {e}")
    out, keep = Path(args.out), Path(args.out) / "under-load"
    keep.mkdir(parents=True, exist_ok=True)
    results = []
    for k in range(args.loaded_runs + 1):
        label = "quiet" if k == 0 else f"loaded {k} ({args.busy} busy loops)"
        measured, report = run_compare(args.preset, out, args.repeats, args.overrides, 0 if k == 0 else args.busy)
        for name in ("overhead.json", "report.md"):
            write_text_atomically(keep / f"{'quiet' if k == 0 else f'loaded{k}'}-{name}", (out / name).read_text())
        results.append((label, measured, report))
    quiet = results[0][1]
    names = [n for n in quiet["variants"] if n != quiet["baseline"]]
    rows = ["| run | " + " | ".join(f"{n} ratio ± noise | {n} vs quiet" for n in names) + " | A/A twin |",
            "|---|" + "---:|---:|" * len(names) + "---:|"]
    failed = False
    for label, measured, report in results:
        cells = []
        for n in names:
            v = measured["variants"][n]
            verdict_n = "–" if measured is quiet else verdict(quiet, measured, report, n, args.tolerance)
            failed |= verdict_n == "FAIL"
            delta = v["step_ratio"] - quiet["variants"][n]["step_ratio"]
            cells += [f"{v['step_ratio']:.3f} ± {v['step_ratio_noise']:.3f}", f"{delta:+.3f} {verdict_n}"]
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {measured['twin']['step_ratio']:.3f} |")
    summary = (f"`attnres compare --preset {args.preset}`, step-time ratios (CPU time at one thread, interleaved, "
               f"{args.repeats} rounds) quiet and under load; pass: within ±{args.tolerance} of quiet, or the "
               f"report says too noisy.\n\n" + "\n".join(rows) + f"\n\n{'FAIL' if failed else 'PASS'}\n")
    write_text_atomically(keep / "summary.md", summary)
    print(summary)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
