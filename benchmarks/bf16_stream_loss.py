"""What a bf16 residual stream costs in loss, on the CPU (docs/kernels.md, "A bf16 stream").

On a GPU, Block AttnRes adds bytes in proportion to the residual stream's dtype: its Phase 1
and merges read the block sums and the stream. Under bf16 autocast with float32 parameters
the stream (and the block sums) stay float32; two ways make them bf16 - half those bytes:
``ModelConfig.residual.autocast_stream`` (one process: the stream stored in the autocast
dtype), and FSDP2's mixed precision (``param_dtype=torch.bfloat16``, float32 master weights
and reductions), which the trainer uses with ``dtype=bfloat16`` on more than one
data-parallel rank (the embedding output, and so the stream, are bf16).

This trains ``configs/train-cpu.yaml`` (d = 128, 4 transformer blocks, Muon, WSD, batch
16 x 128 tokens) for each model and seed in each setting, the same global batches in the
same order, all with ``dtype=bfloat16``:

* ``float32 stream``: one process (autocast around float32 parameters);
* ``bf16 stream``: ``torchrun --nproc-per-node 2`` (FSDP2's bf16 parameters);
* ``autocast stream``: one process with ``model.residual.autocast_stream=true``;
* ``norm output``: one process with ``model.residual.autocast_norm_output=true`` (the
  stream float32, each sublayer's norm output rounded to bf16 once, the projections' input
  gradients added in bf16);
* ``phase1 sums``: one process with ``model.residual.autocast_phase1_sums=true`` (the stream
  float32, AttnRes' Phase-1 weighted sums and their gradients in bf16; AttnRes models only).

Data parallelism alone does not move the loss: the float32 runs on two ranks equal the
single-process run within 1e-5 (``tests/test_parallel_train.py``). Reported: the final
validation loss of each run, and per model and bf16 setting the paired difference (minus the
float32 stream) over seeds with its spread. Finished runs are kept (a re-run skips them), so
the grid can be stopped and continued, and ``--settings`` adds a setting to a finished grid.

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/bf16_stream_loss.py --out runs/bf16-stream
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from bench_training_overhead import out_dir, positive_int

from attnres.output_paths import save_figure_atomically, strict_json, write_text_atomically

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "train-cpu.yaml"
MODELS = {"standard": "standard", "block": "attnres_block", "full": "attnres_full"}
#: Each setting, as the report names it; the first is the baseline the others are paired with.
SETTINGS = {"float32 stream": "float32 stream", "bf16 stream": "bf16 stream (FSDP2, 2 ranks)",
            "autocast stream": "bf16 stream (autocast_stream, 1 process)",
            "norm output": "float32 stream, bf16 norm outputs (autocast_norm_output, 1 process)",
            "phase1 sums": "float32 stream, bf16 Phase-1 sums (autocast_phase1_sums, 1 process)"}
#: What each setting other than the float32 stream changes in the run's configuration.
OVERRIDES = {"autocast stream": ["model.residual.autocast_stream=true"],
             "norm output": ["model.residual.autocast_norm_output=true"],
             "phase1 sums": ["model.residual.autocast_phase1_sums=true"]}
BASELINE = "float32 stream"


def command(setting: str) -> list[str]:
    """The launcher of one run: a single process, or two FSDP2 ranks."""
    if setting != "bf16 stream":
        return [sys.executable, "-m", "attnres", "train"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "attnres", "train"]


def setting_overrides(setting: str) -> list[str]:
    """What a setting changes in the run's configuration."""
    return OVERRIDES.get(setting, [])


def curve(run_dir: Path) -> list[tuple[int, float]]:
    """``(step, validation loss)`` of every evaluation of the run."""
    from attnres.train.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")  # (strict JSON: a NaN loss is null there, NaN here)
    return [(r["step"], r["val_loss"]) for r in rows if r.get("kind") == "eval"]


def final_eval(run_dir: Path, steps: int) -> float | None:
    """The validation loss at ``steps``, if the run got there."""
    return dict(curve(run_dir)).get(steps) if (run_dir / "metrics.jsonl").exists() else None


def train(out: Path, model: str, setting: str, seed: int, steps: int) -> float:
    run_dir = out / model / setting.replace(" ", "-") / f"seed{seed}"
    done = final_eval(run_dir, steps)
    if done is not None:
        return done
    overrides = [f"model.residual.kind={MODELS[model]}", "dtype=bfloat16", f"seed={seed}", f"steps={steps}",
                 f"out_dir={run_dir}", "progress=false", "tensorboard=false", "eval_every=100",
                 f"checkpoint_every={steps}", "keep_checkpoints=1", *setting_overrides(setting)]
    if any((run_dir / "checkpoints").glob("step-*")):  # (stopped with a checkpoint: continue it)
        overrides.append("resume=true")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"[{model} | {setting} | seed {seed}]", flush=True)
    subprocess.run([*command(setting), str(CONFIG), *overrides], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    loss = final_eval(run_dir, steps)
    if loss is None:
        raise RuntimeError(f"{run_dir}: no validation loss at step {steps}")
    return loss


def spread(values) -> float:
    """The sample standard deviation of ``values``; NaN where there are fewer than two or one is
    NaN (a diverged run's loss), where ``statistics.stdev`` raises an ``AttributeError``."""
    values = list(values)
    return statistics.stdev(values) if len(values) > 1 and all(math.isfinite(v) for v in values) else float("nan")


def report(losses: dict, steps: int, seeds: list[int], command: str = "python benchmarks/bf16_stream_loss.py") -> str:
    """The final losses of every setting, seed by seed, and each bf16 setting's paired
    difference from the float32 stream; ``command``: the command line that ran them."""
    lines = [f"# Loss of a bf16 residual stream against a float32 one (CPU, {steps} steps)", "",
             f"Generated by `{command}` (configs/train-cpu.yaml: d = 128, 4 transformer "
             "blocks, Block S = 2; Muon, WSD, batch 16 x 128 tokens; bf16 autocast in all). float32 stream: one "
             "process, float32 parameters; bf16 stream (FSDP2): two ranks with bf16 parameters (float32 master "
             "weights and reductions); bf16 stream (autocast_stream): one process, float32 parameters, "
             "`model.residual.autocast_stream=true`; bf16 norm outputs: one process, "
             "`model.residual.autocast_norm_output=true`; bf16 Phase-1 sums: one process, "
             "`model.residual.autocast_phase1_sums=true`. Final validation loss.", "",
             "| model | setting | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | minus float32 (mean ± sd) |",
             "|---|---|" + "---:|" * (len(seeds) + 2)]
    for model, by_setting in losses.items():
        base = by_setting[BASELINE]
        for setting, runs in by_setting.items():
            if set(runs) != set(seeds):
                continue
            paired = ""
            if setting != BASELINE:
                diffs = [runs[s] - base[s] for s in seeds]
                sd = spread(diffs)
                paired = f"{statistics.mean(diffs):+.4f} ± {sd:.4f}"
            cells = " | ".join(f"{runs[s]:.4f}" for s in seeds)
            lines.append(f"| {model} | {SETTINGS[setting]} | {cells} | {statistics.mean(runs.values()):.4f} | {paired} |")
    if len(seeds) > 1:
        lines += ["", "Seed-to-seed spread of the float32-stream runs (sd of the final loss): "
                  + ", ".join(f"{m} {spread(v[BASELINE].values()):.4f}" for m, v in losses.items())
                  + "."]
    return "\n".join(lines) + "\n"


def plot(out: Path, results: Path, models: list[str], seeds: list[int], settings: list[str]) -> None:
    """Validation-loss curves (top) and, per seed, each bf16 setting minus the float32 stream
    (bottom)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(2, len(models), figsize=(4.5 * len(models), 6), sharex=True, sharey="row", squeeze=False)
    for col, model in enumerate(models):
        top, bottom = axes[0][col], axes[1][col]
        for seed in seeds:
            curves = {s: dict(curve(out / model / s.replace(" ", "-") / f"seed{seed}")) for s in settings}
            for setting, style in zip(settings, ("-", "--", ":", "-.")):
                steps = sorted(curves[setting])
                top.plot(steps, [curves[setting][k] for k in steps], style, color=f"C{seed}",
                         label=f"{SETTINGS[setting]}, seed {seed}")
                if setting != BASELINE:
                    steps = sorted(set(curves[BASELINE]) & set(curves[setting]))
                    bottom.plot(steps, [curves[setting][k] - curves[BASELINE][k] for k in steps], style,
                                color=f"C{seed}", label=f"{SETTINGS[setting]}, seed {seed}")
        top.set_title(model)
        bottom.axhline(0, color="grey", lw=0.5)
        bottom.set_xlabel("step")
    axes[0][0].set_ylabel("validation loss")
    axes[1][0].set_ylabel("bf16 stream - float32 stream")
    axes[0][-1].legend(fontsize=7)
    axes[1][-1].legend(fontsize=7)
    fig.tight_layout()
    # (written beside it and renamed over it: a run stopped while saving keeps the committed plot whole)
    save_figure_atomically(fig, results / "bf16_stream_loss.png", "--results", dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # (checked before the first run: a file in the way of --results was a traceback after the whole grid)
    parser.add_argument("--out", type=lambda v: Path(out_dir(v)), required=True,
                        help="the run directories (checkpoints included)")
    parser.add_argument("--results", type=lambda v: Path(out_dir(v)), default=ROOT / "benchmarks" / "results",
                        help="where bf16_stream_loss.{md,json,png} go")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["standard", "block"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=positive_int, default=1000)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                        help="the float32 stream always runs (the others are paired with it)")
    args = parser.parse_args()
    settings = [BASELINE] + [s for s in args.settings if s != BASELINE]
    losses: dict = {m: {s: {} for s in settings} for m in args.models}
    for seed in args.seeds:  # seed by seed: a stopped grid still pairs every model's settings
        for model in args.models:
            for setting in settings:
                losses[model][setting][seed] = train(args.out, model, setting, seed, args.steps)
    text = report(losses, args.steps, args.seeds, shlex.join(["python", "benchmarks/bf16_stream_loss.py", *sys.argv[1:]]))
    args.results.mkdir(parents=True, exist_ok=True)
    write_text_atomically(args.results / "bf16_stream_loss.md", text, "--results")
    write_text_atomically(args.results / "bf16_stream_loss.json", strict_json(
        {m: {s: {str(k): v for k, v in d.items()} for s, d in by.items()} for m, by in losses.items()}, indent=1),
        "--results")
    plot(args.out, args.results, args.models, args.seeds, settings)
    print(text)


if __name__ == "__main__":
    main()
