"""Training and forward overhead of Block / Full AttnRes over the standard residual (CPU).

Shape (core issue): d = 512, 8 transformer blocks (L = 16 sublayers), Block AttnRes with
S = 4 (N = 4 blocks), sequence 256, batch 8, float32, vocabulary 8192, on the CPU.

Method: all models are built with the same seed; for every backend (eager, torch.compile)
and mode (train step = forward + backward; forward = inference-mode forward) each model is
warmed up, then the models are timed **interleaved** (one step of each, round after round),
and we report the median step time, the ratio of medians against the standard model, and
the median of the per-round ratios (robust to drifts that hit a whole round). Peak memory is
the largest rise of live CPU allocations above their level at the start of one eager
training step (profiler memory events): activations, gradients and temporaries; the
parameters and inputs, allocated before the step, are not counted. Timings on a shared 2-core machine are noisy; the
ratios are the result, not the absolute times.

The process keeps the memory a step frees for the next step (``--cpu-allocator retain``, as
``attnres train`` does; ``system``: glibc's defaults, which hand large freed blocks back and
page them in again every step, unevenly between the models), and the minor page faults of
one step are reported beside the times (attnres.train.cpu_memory).

    python benchmarks/bench_training_overhead.py            # full run (~15 min on 2 cores)
    python benchmarks/bench_training_overhead.py --quick    # a smoke run
    python benchmarks/bench_training_overhead.py --shape main-job --backends eager --modes train

``*_graph`` variants run the two-phase path on the plain-graph reference (``backend="reference"``)
beside the default (the depth-attention operators: the CPU kernel on CPU), ``*_torch`` the
operators' PyTorch implementation (``backend="torch"``); ``--shape main-job`` is the main
job's model (d = 64, 12 blocks, S = 3, 16 x 128 tokens, one thread) and writes
``training_overhead_main_job.{json,md}``.

**Side by side with another version of the package** (no regression): ``--baseline REV``
(a git revision, checked out with ``git archive``) or ``--baseline DIR`` (a directory holding
an ``attnres`` package) runs every model twice, once with this working tree's package and
once with the baseline's, each in a worker process of its own (``--worker``: same seeds,
same shapes, the CPU allocator setting applied in each), and the coordinator interleaves
the steps of both across rounds. The report gives each version's ratios against its own
standard model and the paired ratio ``this / baseline`` of every variant::

    python benchmarks/bench_training_overhead.py --baseline 331a2fd --variants standard,block,full --modes train
    python benchmarks/bench_training_overhead.py --baseline 331a2fd --shape main-job --variants standard,block,full --modes train

Writes ``benchmarks/results/training_overhead.{json,md}`` (``_main_job`` with ``--shape main-job``,
``_quick`` with ``--quick``, ``_versus_baseline`` with ``--baseline``); ``--out PATH`` writes
``PATH.{json,md}`` as given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnres import AttnResLM, ModelConfig
from attnres.analysis.profiling import paired_summary, peak_memory_bytes, time_interleaved


def cpu_memory():
    """``attnres.train.cpu_memory``, imported where a run uses it: importing it imports
    ``attnres.train`` and its checkpoints (safetensors, the ``train`` extra), which
    gpu_check.py and bench_kernels_gpu.py - importing this module's helpers on a GPU machine
    with only PyTorch, Triton and NumPy - do not have."""
    from attnres.train import cpu_memory as module

    return module


VARIANTS = {
    "standard": dict(residual="standard"),
    "block": dict(residual="attnres_block"),
    "full": dict(residual="attnres_full"),
    # The lean path in PyTorch only, without the fused CPU merge kernel (backend="torch").
    "block_torch": dict(residual={"kind": "attnres_block", "backend": "torch"}),
    "full_torch": dict(residual={"kind": "attnres_full", "backend": "torch"}),
    # The two-phase path as a plain autograd graph (the default before the lean path).
    "block_graph": dict(residual={"kind": "attnres_block", "backend": "reference"}),
    "full_graph": dict(residual={"kind": "attnres_full", "backend": "reference"}),
    "block_naive": dict(residual={"kind": "attnres_block", "schedule": "naive"}),
    "full_naive": dict(residual={"kind": "attnres_full", "schedule": "naive"}),
}
#: Targets of the paired step-time ratio against the standard model (train: the training-overhead
#: targets of docs/training-overhead.md; forward: the inference target).
TARGETS = {
    ("eager", "train", "block"): 1.03, ("eager", "train", "full"): 1.08,
    ("compile", "train", "block"): 1.02, ("compile", "train", "full"): 1.05,
    ("eager", "forward", "block"): 1.02,
}
#: Targets of the eager peak-memory ratio.
MEMORY_TARGETS = {"block": 1.03, "full": 1.06}
#: ``--shape main-job``: the main job's model (``attnres compare --preset long``: d = 64, 12
#: blocks, S = 3) at its batch (16 x 128 tokens), one thread; its targets in eager.
MAIN_JOB = dict(vocab_size=4096, d_model=64, n_layers=12, n_heads=4, residual={"block_size": 3})
MAIN_JOB_TARGETS = {("eager", "train", "block"): 1.08, ("eager", "train", "full"): 1.15}


def run_header() -> dict:
    """The ``machine`` and ``command`` fields every benchmark result records."""
    return {
        "machine": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor(),
        },
        "command": " ".join([os.path.basename(sys.executable), script_path(sys.argv[0]), *sys.argv[1:]]),
    }


def script_path(argv0: str) -> str:
    """The script as run from the repository root (``benchmarks/x.py``), wherever it was started
    from: a result's command line must run as written (``python bench_inference.py`` did not)."""
    repo = Path(__file__).resolve().parents[1]
    try:
        return Path(argv0).resolve().relative_to(repo).as_posix()
    except ValueError:
        return argv0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# Argument types of the benchmark scripts: a bad value is an argparse error naming the option
# at start-up (one line), not a traceback - or a file that cannot be written - after minutes
# of measuring.


def out_dir(value: str) -> str:
    """``--out`` naming a directory (created if missing): neither it nor a parent may be a file."""
    path = Path(value)
    blocker = next((a for a in (path, *path.parents) if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        raise argparse.ArgumentTypeError(f"{blocker} is a file; give a directory (created if missing)")
    return value


def out_stem(value: str) -> str:
    """``--out``: a path without suffix; its ``.json`` and ``.md`` must be writable files."""
    path = Path(value)
    blocker = next((a for a in path.parents if a.exists() and not a.is_dir()), None)
    if blocker is not None:
        raise argparse.ArgumentTypeError(f"{blocker} is a file, not a directory: give a path under a directory "
                                         "(the .json and .md are written beside each other)")
    taken = [q for q in (path.with_suffix(".json"), path.with_suffix(".md")) if q.is_dir()]
    if taken:
        raise argparse.ArgumentTypeError(f"{taken[0]} is a directory: give a path without suffix whose .json "
                                         "and .md can be files")
    return value


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}")
    return number


def positive_ints(value: str) -> str:
    """A comma-separated list of integers >= 1 (kept as the string given)."""
    for item in value.split(","):
        try:
            positive_int(item)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1, got {value!r}") from None
    return value


def comma_list(allowed) -> callable:
    """A comma-separated, non-empty subset of ``allowed`` (kept as the string given)."""
    def parse(value: str) -> str:
        items = [v for v in value.split(",") if v]
        unknown = [v for v in items if v not in allowed]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                                             f"allowed (comma-separated): {','.join(allowed)}")
        return value
    return parse


def make_step(model, runner, ids, mode):
    if mode == "train":

        def step():
            out = runner(ids, labels=ids)
            out.loss.backward()
            model.zero_grad(set_to_none=True)

    else:

        def step():
            with torch.inference_mode():
                runner(ids)

    return step


def page_faults(step) -> int:
    """Minor page faults of one call of ``step`` (fresh pages the kernel zero-fills)."""
    before = cpu_memory().minor_page_faults()
    step()
    return cpu_memory().minor_page_faults() - before


def summarize(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return paired_summary(times, "standard")


#: ``--quick``: a smoke run of every code path at a small batch (it must not take the full
#: run's minutes, and writes ``*_quick`` beside the committed results, not over them).
QUICK = dict(batch=2, seq=32, repeats=2)
BACKENDS, MODES = ("eager", "compile"), ("train", "forward")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats-train", type=positive_int, default=11)
    p.add_argument("--repeats-forward", type=positive_int, default=21)
    p.add_argument("--backends", type=comma_list(BACKENDS), default="eager,compile")
    p.add_argument("--modes", type=comma_list(MODES), default="train,forward")
    p.add_argument("--variants", type=comma_list(VARIANTS), default=",".join(VARIANTS))
    p.add_argument("--batch", type=positive_int, default=None, help="sequences per step (default 8; main-job 16)")
    p.add_argument("--seq", type=positive_int, default=None, help="tokens per sequence (default 256; main-job 128)")
    p.add_argument("--shape", choices=("bench-cpu", "main-job"), default="bench-cpu",
                   help="bench-cpu: d=512, 8 blocks, S=4 (default); main-job: d=64, 12 blocks, S=3, batch 16 x 128, "
                        "one thread")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's; main-job: 1)")
    p.add_argument("--cpu-allocator", choices=cpu_memory().CPU_ALLOCATORS, default="retain",
                   help="retain: freed memory stays in the process for the next step, as in `attnres train` "
                        "(default); system: glibc's defaults (attnres.train.cpu_memory)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: batch 2 x 32 tokens, 2 rounds, eager only unless --backends is given; "
                        "writes training_overhead[_main_job][_versus_baseline]_quick")
    p.add_argument("--baseline", default=None, metavar="REV_OR_DIR",
                   help="also run the package of this git revision or directory, side by side (see above)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time (default); cpu: the process's CPU time (steadier on a shared machine, "
                        "with one thread)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=out_stem, default=None,
                   help="output path without suffix, written as given (default: benchmarks/results/training_overhead"
                        "[_main_job][_versus_baseline][_quick])")
    args = p.parse_args(argv)
    main_job = args.shape == "main-job"
    if args.quick:
        args.repeats_train = args.repeats_forward = QUICK["repeats"]
        if args.backends == p.get_default("backends"):
            args.backends = "eager"
    default_batch, default_seq = (16, 128) if main_job else (8, 256)
    args.batch = args.batch or (QUICK["batch"] if args.quick else default_batch)
    args.seq = args.seq or (QUICK["seq"] if args.quick else default_seq)
    if main_job:
        args.threads = args.threads or 1
    if args.out is None:
        name = ("training_overhead" + ("_main_job" if main_job else "") + ("_versus_baseline" if args.baseline else "")
                + ("_quick" if args.quick else ""))  # (*_quick.* is git-ignored)
        args.out = str(Path(__file__).parent / "results" / name)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return serve(args)
    if args.baseline:
        return side_by_side(args)
    if args.threads:
        torch.set_num_threads(args.threads)

    retained = cpu_memory().set_cpu_allocator(args.cpu_allocator)
    base, variants, models, ids = build_models(args)
    results = {
        "config": {**base.to_dict(), "batch": args.batch, "seq": args.seq, "dtype": "float32", "shape": args.shape},
        **run_header(),
        "cpu_allocator": args.cpu_allocator, "freed_memory_retained": retained,
        "params": {k: m.num_parameters() for k, m in models.items()},
        "residual_params": {k: m.residual_parameters() for k, m in models.items()},
        "timing": {},
        "page_faults_per_step": {},
        "peak_memory_bytes": {},
    }
    for backend in args.backends.split(","):
        for mode in args.modes.split(","):
            names = [n for n in variants if backend == "eager" or not n.endswith("_naive")]
            steps = {}
            for name in names:
                model = models[name]
                runner = model if backend == "eager" else torch.compile(model)
                steps[name] = make_step(model, runner, ids, mode)
                t0 = time.perf_counter()
                steps[name]()
                steps[name]()
                log(f"[{backend}/{mode}] warm-up {name}: {time.perf_counter() - t0:.1f} s")
            repeats = args.repeats_train if mode == "train" else args.repeats_forward
            results["timing"][f"{backend}/{mode}"] = summarize(time_interleaved(steps, repeats, log))
            results["page_faults_per_step"][f"{backend}/{mode}"] = {name: page_faults(steps[name]) for name in names}
            if backend == "eager" and mode == "train":
                for name in names:
                    results["peak_memory_bytes"][name] = peak_memory_bytes(steps[name])
                    log(f"    peak memory {name}: {results['peak_memory_bytes'][name] / 2**20:.0f} MiB")
            torch._dynamo.reset()

    write_results(Path(args.out), results, render_markdown)
    return 0


def build_models(args):
    """The shape's config, the variants (the standard model first), one model each (same
    seed) and the batch of token ids."""
    torch.manual_seed(0)
    base = ModelConfig.preset("bench-cpu", max_seq_len=max(256, args.seq))
    if args.shape == "main-job":
        base = base.replace(**MAIN_JOB)
    variants = [v for v in args.variants.split(",") if v]
    if "standard" not in variants:
        variants.insert(0, "standard")
    models = {}
    for name in variants:
        torch.manual_seed(0)
        models[name] = AttnResLM(base.replace(**VARIANTS[name]))
    ids = torch.randint(0, base.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    return base, variants, models, ids


# ----------------------------------------------------------------------------------------
# Side by side with a baseline version of the package: one worker process per version
# ----------------------------------------------------------------------------------------


def serve(args) -> int:
    """Worker: build the models with the ``attnres`` on ``PYTHONPATH`` and run what the
    coordinator asks, one JSON line in, one out (``setup``, ``step``, ``memory``, ``quit``)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    retained = cpu_memory().set_cpu_allocator(args.cpu_allocator)
    base, variants, models, ids = build_models(args)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    steps = {}
    print(json.dumps({"config": base.to_dict(), "variants": variants, "retained": retained, **run_header()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["cmd"] == "quit":
            return 0
        if request["cmd"] == "setup":  # (re)build the steps for a backend and mode, warmed up
            torch._dynamo.reset()
            backend, mode = request["backend"], request["mode"]
            steps = {n: make_step(m, m if backend == "eager" else torch.compile(m), ids, mode) for n, m in models.items()}
            for step in steps.values():
                step()
                step()
            reply = {"ok": True}
        elif request["cmd"] == "step":
            t0 = clock()
            steps[request["name"]]()
            reply = {"seconds": clock() - t0}
        else:  # memory
            reply = {"bytes": peak_memory_bytes(steps[request["name"]])}
        print(json.dumps(reply), flush=True)
    return 0


class Worker:
    """A worker process running this script with ``src`` first on ``PYTHONPATH``."""

    def __init__(self, src: Path, argv: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv, "--worker"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent)
        self.header = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker exited with {self.proc.wait()}")
        return json.loads(line)

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
        self.proc.stdin.close()
        self.proc.wait()


def baseline_source(spec: str, tmp: Path) -> Path:
    """The ``src`` directory of the baseline: ``spec`` itself when it holds ``attnres``, else a
    git revision of this repository, unpacked into ``tmp``."""
    for candidate in (Path(spec), Path(spec) / "src"):
        if (candidate / "attnres" / "__init__.py").exists():
            return candidate.resolve()
    repo = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "archive", spec, "src"], cwd=repo, capture_output=True)
    if archive.returncode:
        why = archive.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["git archive failed"]
        raise SystemExit(f"bench_training_overhead.py: error: --baseline {spec!r} is neither a directory holding an "
                         f"attnres package nor a git revision of this repository ({why[0]})")
    archive = archive.stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    return tmp / "src"


def worker_argv(args) -> list[str]:
    """The options a worker needs to build the same models as every other worker."""
    argv = ["--variants", args.variants, "--batch", str(args.batch), "--seq", str(args.seq), "--shape", args.shape,
            "--cpu-allocator", args.cpu_allocator, "--clock", args.clock]
    return argv + (["--threads", str(args.threads)] if args.threads else [])


def interleave(workers: dict[str, Worker], names: list[str], repeats: int) -> dict[str, list[float]]:
    """Seconds of every step ``"<version>/<variant>"``, one call each per round, the order
    rotating by one per round (as :func:`~attnres.analysis.profiling.time_interleaved`)."""
    keys = [f"{v}/{n}" for v in workers for n in names]
    times: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(repeats):
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:
            version, name = key.split("/", 1)
            times[key].append(workers[version].ask(cmd="step", name=name)["seconds"])
        log(f"    round {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()))
    return times


def side_by_side(args) -> int:
    """Coordinator of ``--baseline``: both versions' models, interleaved; see the module docstring."""
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"this": Path(__file__).resolve().parents[1] / "src", "baseline": baseline_source(args.baseline, Path(tmp))}
        workers = {version: Worker(src, worker_argv(args)) for version, src in sources.items()}
        try:
            results = {"config": {**workers["this"].header["config"], "batch": args.batch, "seq": args.seq,
                                  "dtype": "float32", "shape": args.shape},
                       **run_header(), "baseline": args.baseline, "clock": args.clock,
                       "cpu_allocator": args.cpu_allocator, "timing": {}, "versus_baseline": {}, "peak_memory_bytes": {}}
            names = workers["this"].header["variants"]
            for backend in args.backends.split(","):
                for mode in args.modes.split(","):
                    measure_side_by_side(args, workers, names, backend, mode, results)
        finally:
            for w in workers.values():
                w.close()
    write_results(Path(args.out), results, render_side_by_side)
    return 0


def measure_side_by_side(args, workers, names, backend: str, mode: str, results: dict) -> None:
    key = f"{backend}/{mode}"
    for version, w in workers.items():
        t0 = time.perf_counter()
        w.ask(cmd="setup", backend=backend, mode=mode)
        log(f"[{key}] warm-up {version}: {time.perf_counter() - t0:.1f} s")
    repeats = args.repeats_train if mode == "train" else args.repeats_forward
    times = interleave(workers, names, repeats)
    results["timing"][key] = {v: paired_summary({n: times[f"{v}/{n}"] for n in names}, "standard") for v in workers}
    results["versus_baseline"][key] = {
        n: statistics.median(a / b for a, b in zip(times[f"this/{n}"], times[f"baseline/{n}"])) for n in names}
    if backend == "eager" and mode == "train":
        results["peak_memory_bytes"] = {v: {n: w.ask(cmd="memory", name=n)["bytes"] for n in names}
                                        for v, w in workers.items()}


def render_side_by_side(r: dict) -> str:
    c = r["config"]
    targets = MAIN_JOB_TARGETS if c.get("shape") == "main-job" else TARGETS
    lines = ["# Training overhead side by side with a baseline version (CPU)", "",
             f"Command: `{r['command']}`  ", f"Baseline: `{r['baseline']}`; clock: {r['clock']}.  ",
             f"Shape: d={c['d_model']}, {c['n_layers']} transformer blocks, Block S={block_size_of(c)}, seq {c['seq']}, "
             f"batch {c['batch']}.  ", "",
             "*paired* = median over rounds of (model / standard model of the same version) in the same round; "
             "*this / baseline* = median over rounds of (this version's step / the baseline's step).", "",
             "| backend / mode | variant | this: paired | baseline: paired | this / baseline | target |",
             "|---|---|---:|---:|---:|---|"]
    for key, versions in r["timing"].items():
        backend, mode = key.split("/")
        for name in versions["this"]:
            tgt = targets.get((backend, mode, name))
            this, base = versions["this"][name]["median_paired_ratio"], versions["baseline"][name]["median_paired_ratio"]
            verdict = f"<= {tgt:.2f}: {'met' if this <= tgt else 'missed'}" if tgt else ""
            lines.append(f"| {key} | {name} | {this:.4f} | {base:.4f} | {r['versus_baseline'][key][name]:.4f} | {verdict} |")
    if r["peak_memory_bytes"]:
        mem_targets = {} if c.get("shape") == "main-job" else MEMORY_TARGETS
        lines += ["", "Peak memory of one eager training step, ratio to the standard model of the same version:", "",
                  "| variant | this | baseline | target |", "|---|---:|---:|---|"]
        this, base = r["peak_memory_bytes"]["this"], r["peak_memory_bytes"]["baseline"]
        for name in this:
            ratio, tgt = this[name] / this["standard"], mem_targets.get(name)
            verdict = f"<= {tgt:.2f}: {'met' if ratio <= tgt else 'missed'}" if tgt else ""
            lines.append(f"| {name} | {ratio:.3f} | {base[name] / base['standard']:.3f} | {verdict} |")
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: dict, render, plot=None) -> None:
    """Write ``out.json``, the Markdown ``render(results)`` to ``out.md`` and, given ``plot``,
    ``plot(results, out.png)``; print the Markdown, then the paths written: the default ``out``
    replaces a committed result (benchmarks/results/), which the run's last line now says.
    Each file is written beside its place and renamed over it, so a run stopped while writing
    (Ctrl-C, a full disk) leaves the committed file as it was, never cut short; the Markdown is
    rendered before anything is written."""
    # Imported here, not with the module: a --baseline worker runs this script against the
    # baseline's package, and the documented baselines (ad2ee06, 331a2fd) predate output_paths.
    from attnres.output_paths import replace_atomically, write_text_atomically

    out.parent.mkdir(parents=True, exist_ok=True)
    written = [out.with_suffix(".json"), out.with_suffix(".md")]
    md = render(results)
    write_text_atomically(written[0], json.dumps(results, indent=1))
    write_text_atomically(written[1], md)
    if plot is not None:
        written.append(out.with_suffix(".png"))
        replace_atomically(written[-1], lambda tmp: plot(results, tmp))
    print(md)
    print("wrote " + ", ".join(str(path) for path in written), flush=True)


def block_size_of(config: dict) -> int:
    """Block AttnRes' S from a saved config (nested ``residual``, or the flat key of earlier results)."""
    residual = config.get("residual")
    return residual["block_size"] if isinstance(residual, dict) else config["attnres_block_size"]


def allocator_line(r: dict) -> str:
    kind = r.get("cpu_allocator", "system")  # results before the setting: glibc's defaults
    if kind == "retain" and r.get("freed_memory_retained"):
        return ("CPU allocator: `retain` (freed memory stays in the process for the next step, as in "
                "`attnres train`; `--cpu-allocator system` for glibc's defaults).")
    return "CPU allocator: the system's (glibc's defaults: large freed blocks go back to the system)."


def render_markdown(r: dict) -> str:
    c = r["config"]
    lines = [
        "# Training overhead of AttnRes over the standard residual (CPU)",
        "",
        f"Command: `{r['command']}`  ",
        f"Shape: d={c['d_model']}, {c['n_layers']} transformer blocks (L={2 * c['n_layers']}), "
        f"Block S={block_size_of(c)}, seq {c['seq']}, batch {c['batch']}, {c['dtype']}, vocab {c['vocab_size']}.  ",
        f"Machine: {r['machine']['cpu_count']} CPUs, {r['machine']['threads']} torch threads, torch {r['machine']['torch']}.  ",
        allocator_line(r),
        "",
        "Times are medians over interleaved rounds; *ratio* = median / median of the standard model; "
        "*paired* = median over rounds of (this model / standard) in the same round.",
        "",
        "| backend / mode | variant | median ms | ratio | paired ratio | target |",
        "|---|---|---:|---:|---:|---|",
    ]
    targets = MAIN_JOB_TARGETS if c.get("shape") == "main-job" else TARGETS
    for key, rows in r["timing"].items():
        backend, mode = key.split("/")
        for name, s in rows.items():
            tgt = targets.get((backend, mode, name))
            verdict = ""
            if tgt is not None:
                ok = s["median_paired_ratio"] <= tgt
                verdict = f"<= {tgt:.2f}: {'met' if ok else 'missed'}"
            lines.append(
                f"| {key} | {name} | {s['median_ms']:.1f} | {s['ratio_of_medians']:.4f} | {s['median_paired_ratio']:.4f} | {verdict} |"
            )
    faults = r.get("page_faults_per_step", {})
    if faults:
        names = list(next(iter(faults.values())))
        lines += ["", "Minor page faults of one step (fresh 4 KiB pages the kernel zero-fills):", "",
                  "| backend / mode | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        lines += [f"| {key} | " + " | ".join(str(row.get(n, "")) for n in names) + " |" for key, row in faults.items()]
    if r["peak_memory_bytes"]:
        base = r["peak_memory_bytes"]["standard"]
        mem_targets = {} if c.get("shape") == "main-job" else MEMORY_TARGETS
        lines += ["", "Peak memory of one eager training step (rise of live CPU allocations during the step; parameters not counted):", "",
                  "| variant | peak MiB | ratio | target |", "|---|---:|---:|---|"]
        for name, b in r["peak_memory_bytes"].items():
            tgt = mem_targets.get(name)
            verdict = f"<= {tgt:.2f}: {'met' if b / base <= tgt else 'missed'}" if tgt else ""
            lines.append(f"| {name} | {b / 2**20:.0f} | {b / base:.3f} | {verdict} |")
    eager = r["timing"].get("eager/train", {})
    if "block_graph" in eager or "full_graph" in eager:
        lines += ["", "Lean vs graph two-phase path (eager, train step): graph median / lean median", ""]
        for v in ("block", "full"):
            if f"{v}_graph" in eager and v in eager:
                lines.append(f"- {v}: {eager[f'{v}_graph']['median_ms'] / eager[v]['median_ms']:.3f}x")
    if "block_naive" in eager or "full_naive" in eager:
        lines += ["", "Two-phase vs naive (eager, train step): speed-up = naive median / two-phase median", ""]
        for v in ("block", "full"):
            if f"{v}_naive" in eager and v in eager:
                lines.append(f"- {v}: {eager[f'{v}_naive']['median_ms'] / eager[v]['median_ms']:.2f}x")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
