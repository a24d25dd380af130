"""Command-line entry point: ``attnres <command>`` (or ``python -m attnres``)."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnres", description="Attention Residuals for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser(
        "train",
        help="train an LM from a YAML config plus key=value overrides",
        description="Train (or with resume=true continue) a run. Overrides use dotted keys, e.g. "
        "`attnres train --config run.yaml steps=2000 model.residual=standard data.paths=[my.txt]`. "
        "SIGINT/SIGTERM write a checkpoint and exit. Data parallel on K processes: "
        "`torchrun --nproc-per-node K -m attnres train ...` (FSDP2; distributed=ddp for DDP).",
    )
    tr.add_argument("--config", help="YAML file with TrainConfig fields (default: built-in defaults)")
    tr.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in out_dir (= resume=true)")
    tr.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, YAML-parsed values")
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
    gen = sub.add_parser("generate", help="continue a prompt with a trained checkpoint and report tokens/s")
    gen.add_argument("--checkpoint", required=True, help="a checkpoint directory (step-*) or a run directory (its newest)")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1: off)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    gen.add_argument("--chunk-size", type=int, help="prefill the prompt in chunks of this many tokens")
    gen.add_argument("--tokenizer", help="tokenizer.json to use instead of the one the run's data settings give")
    xp = sub.add_parser("export", help="write a training checkpoint as a Hugging Face directory (model + tokenizer)")
    xp.add_argument("--checkpoint", required=True, help="a checkpoint directory (step-*) or a run directory (its newest)")
    xp.add_argument("--out", required=True, help="output directory for save_pretrained")
    xp.add_argument("--tokenizer", help="tokenizer.json to use instead of the one the run's data settings give")
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
    ev.add_argument("--tokenizer", help="tokenizer.json to use instead of the one the run's data settings give")
    ev.add_argument("--out", help="results JSON (default: <checkpoint>/eval.json)")
    ev.add_argument("--limit", type=int, help="at most this many documents per lm-eval task")
    ev.add_argument("--seq-len", type=int, help="perplexity window (default: the model's max_seq_len)")
    ev.add_argument("--batch-size", type=int, default=8, help="lm-eval batch size (default 8)")
    ev.add_argument("--device", default="cpu", help="lm-eval device (default cpu)")
    return parser


EXPERIMENT_NAMES = ("compare", "ablation", "block-size", "scaling", "arch-sweep")
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
                        "over this many interleaved rounds and measure its peak memory, for the report's overhead "
                        "columns (default 10; 0 = use the step times the runs logged)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="TrainConfig overrides for every run")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse binds `experiment`'s positional overrides together with NAME, so overrides
    # written after the options arrive here as extras; accept them there, and only there.
    grid = args.command in ("experiment", "compare")
    if extra and (not grid or any(e.startswith("-") or "=" not in e for e in extra)):
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
        return run_train(args.config, args.overrides + (["resume=true"] if args.resume else []))
    elif grid:
        name = "compare" if args.command == "compare" else args.name
        if name == "no-free-lunch":
            from .experiments.no_free_lunch import run_cli

            return run_cli(args.preset or "cpu", args.out, args.seeds, args.overrides, args.report_only, args.variants)
        preset = args.preset or DEFAULT_PRESET.get(name, "cpu")
        return run_experiment_cli(name, preset, args.out, args.seeds, args.overrides, args.report_only,
                                  args.overhead_repeats, args.variants)
    elif args.command == "generate":
        return run_generate(args)
    elif args.command == "export":
        return run_export(args.checkpoint, args.out, args.tokenizer)
    elif args.command == "eval":
        return run_eval(args)
    return 0


OVERHEAD_EXPERIMENTS = ("compare", "ablation", "block-size")  # grids whose tables compare the variants' cost


def run_experiment_cli(name: str, preset: str, out: str, seeds: list[int], overrides: list[str], report_only: bool,
                       overhead_repeats: int = 0, variants: list[str] | None = None) -> int:
    """``attnres experiment`` / ``attnres compare``: bad presets, seeds or overrides end the
    process with a one-line message."""
    from .experiments import get_experiment, load_records, measure_overhead, run_experiment, write_report
    from .train import TrainingDiverged

    if overhead_repeats < 0:
        raise SystemExit(f"attnres {name}: error: --overhead-repeats must be >= 0; got {overhead_repeats}")
    try:
        experiment = get_experiment(name, preset)
        if not report_only:
            run_experiment(experiment, out, seeds, overrides, variants=variants)
            if overhead_repeats and name in OVERHEAD_EXPERIMENTS:
                measure_overhead(experiment, out, overrides, overhead_repeats)
        records = load_records(out, experiment)  # every seed finished so far, not only this invocation's
        path = write_report(name, records, out, preset)
    except (ValueError, TrainingDiverged) as e:
        raise SystemExit(f"attnres experiment: error: {e}") from None
    except KeyboardInterrupt as e:  # a run checkpointed on SIGINT/SIGTERM: re-running resumes it
        print(f"attnres experiment: interrupted ({e or 'SIGINT'}); run the same command again to resume")
        return 130
    print(f"attnres experiment: {len(records)} runs; report {path}")
    return 0


def run_generate(args) -> int:
    """``attnres generate``: stream the continuation to stdout, then tokens/s (stderr)."""
    import sys
    import time

    import torch

    from .inference import stream
    from .inference.loading import load_model, load_tokenizer

    try:
        model, run_config = load_model(args.checkpoint)
        tokenizer = load_tokenizer(run_config, args.tokenizer)
        ids = tokenizer.encode(args.prompt)
        if not ids:
            raise ValueError("--prompt is empty: there is nothing to continue")
        steps = stream(
            model, torch.tensor([ids]), max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, generator=torch.Generator().manual_seed(args.seed),
            chunk_size=args.chunk_size,
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
          "prefill included)", file=sys.stderr)
    return 0


def _hf_imports():
    """``attnres.hf`` (and lm_eval for eval), or a one-line error naming the extra."""
    try:
        from . import hf
    except ImportError as e:
        raise SystemExit(f"attnres: this command needs the 'hf' extra (pip install 'attnres[hf]'): {e}") from None
    return hf


def run_export(checkpoint: str, out: str, tokenizer: str | None) -> int:
    """``attnres export``: checkpoint -> Hugging Face directory."""
    hf = _hf_imports()
    try:
        path = hf.export_checkpoint(checkpoint, out, tokenizer)
    except ValueError as e:
        raise SystemExit(f"attnres export: error: {e}") from None
    print(f"attnres export: wrote {path} (load with transformers.AutoModelForCausalLM.from_pretrained after `import attnres`)")
    return 0


def run_eval(args) -> int:
    """``attnres eval``: perplexity and bits per byte, then lm-eval; writes a results JSON."""
    import json
    import tempfile
    from pathlib import Path

    hf = _hf_imports()
    from .hf.evaluate import perplexity, run_lm_eval
    from .hf.export import run_tokenizer

    tasks = [] if args.tasks.strip().lower() == "none" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        model, run_config = hf.load_native_checkpoint(args.checkpoint)
        tokenizer = run_tokenizer(run_config, args.tokenizer)
        if args.text is not None:
            text = Path(args.text).read_text(encoding="utf-8")
        else:
            from .data import load_corpus

            text = load_corpus(run_config["data"]["paths"], run_config["data"]["val_fraction"]).val
        results = {"checkpoint": str(Path(args.checkpoint).resolve()), "text": args.text or "validation split",
                   "perplexity": perplexity(model, tokenizer, text, args.seq_len), "lm_eval": {}}
        print("attnres eval: held-out loss {loss:.4f}, perplexity {perplexity:.3f}, bits/byte {bits_per_byte:.4f} "
              "over {tokens} tokens".format(**results["perplexity"]))
        if tasks:
            with tempfile.TemporaryDirectory(prefix="attnres-hf-") as hf_dir:
                hf.export_checkpoint(args.checkpoint, hf_dir, args.tokenizer)
                results["lm_eval"] = run_lm_eval(hf_dir, tasks, text, limit=args.limit, batch_size=args.batch_size,
                                                 device=args.device)
    except (ValueError, OSError) as e:
        raise SystemExit(f"attnres eval: error: {e}") from None
    out = Path(args.out) if args.out else Path(args.checkpoint) / "eval.json"
    out.write_text(json.dumps(results, indent=1, default=str))
    for task, metrics in results["lm_eval"].items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
        print(f"attnres eval: {task}: {shown}")
    print(f"attnres eval: results written to {out}")
    return 0


def run_train(config_path: str | None, overrides: list[str]) -> int:
    """``attnres train``: errors in the config, data or checkpoints end the process with a
    one-line message; an interrupted run exits with 128 + the signal number."""
    import signal

    from .distributed.launch import DistributedError
    from .train import TrainingDiverged, load_config, train

    try:
        result = train(load_config(config_path, overrides))
    except (ValueError, TrainingDiverged, DistributedError) as e:
        raise SystemExit(f"attnres train: error: {e}") from None
    if result.interrupted:
        print(f"attnres train: stopped by {result.interrupted} after step {result.step}; checkpoint {result.checkpoint}; "
              "continue with --resume")
        return 128 + int(getattr(signal, result.interrupted))
    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    print(f"attnres train: finished at step {result.step}, train loss {fmt(result.train_loss)}, "
          f"val loss {fmt(result.val_loss)}; checkpoint {result.checkpoint}")
    return 0
