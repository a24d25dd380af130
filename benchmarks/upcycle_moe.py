"""Continued training of an upcycled mixture of experts against its original (docs/experiments.md).

1. Pretrain a small Qwen3-MoE (the family's own modules, standard residual; 4 decoder layers,
   d = 128, 8 experts, top-2, the family's load-balancing loss) on the training split of the
   default corpus, long enough for the experts to differ; write it as a plain ``qwen3_moe``
   directory (the original) and as its Block AttnRes upcycle (``attnres.upcycle``; S = 2).
2. Continue training both with identical data, optimiser, schedule and seed through
   ``attnres train model.from_hf=DIR init_from=DIR`` (the original as the family model with
   the standard residual: the same function, the same modules), for each seed.
3. At every checkpoint, on fixed validation windows: each model's expert load per MoE layer
   (``attnres.analysis.experts``), how far it moved from its own load at conversion and from
   the other model's at the same step (total variation distance), how many of each token's
   top-k experts the two models share (routing agreement), and the norm of the upcycle's
   pseudo-queries (zero at conversion).

Writes ``--out/report.md``, ``results.json``, ``config.json`` (the two training set-ups),
``loss.png``, ``experts.png`` and ``analysis/`` (``attnres analyze`` of the first seed's
final upcycle against the original: depth mixing matrices and the expert-load table). About 10 core-minutes at one thread with the defaults.

    nice -n 10 python benchmarks/upcycle_moe.py --out results/upcycle-moe --seeds 0 1
    python benchmarks/upcycle_moe.py --quick   # a smoke run, into results/upcycle-moe-quick and runs/upcycle-moe-quick
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from bench_training_overhead import out_dir, positive_int

from attnres.output_paths import write_text_atomically

FAMILY = "qwen3_moe"
MODEL = {"d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 256}
EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "norm_topk_prob": True,
           "router_aux_loss_coef": 0.01, "decoder_sparse_step": 1}
BLOCK_SIZE = 2


def train_overrides(args, out_dir: Path, steps: int, **extra) -> list[str]:
    """The settings both phases share, plus ``extra``."""
    common = {"data.tokenizer": "bpe", "data.vocab_size": args.vocab, "seq_len": args.seq_len, "batch_size": args.batch,
              "optimizer": "adamw", "weight_decay": 0.0, "grad_clip": 1.0, "log_every": 1, "eval_every": args.every,
              "eval_batches": 8, "diagnostics_every": args.every, "checkpoint_every": args.every,
              "keep_checkpoints": 1000, "tensorboard": "false", "progress": "true", "out_dir": str(out_dir),
              "steps": steps}
    return [f"{k}={v}" for k, v in {**common, **extra}.items()]


def pretrain(args, work: Path) -> Path:
    """Phase 1: the standard MoE, trained from scratch; returns its run directory."""
    from attnres.train import load_config, train

    run = work / "pretrain"
    fields = {f"model.{k}": v for k, v in MODEL.items()} | {f"model.hf_config.{k}": v for k, v in EXPERTS.items()}
    overrides = train_overrides(args, run, args.pretrain_steps, **fields, **{
        "model.hf_architecture": FAMILY, "model.residual.kind": "standard", "lr": args.pretrain_lr,
        "schedule": "cosine", "warmup_steps": max(1, args.pretrain_steps // 20), "seed": 1000})
    if not (run / "checkpoints").is_dir():
        train(load_config(None, overrides))
    return run


def write_models(pretrained: Path, work: Path) -> dict[str, Path]:
    """The pretrained MoE as a plain family directory (``original``) and its Block AttnRes
    upcycle (``block``), each with the run's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from attnres.inference.loading import load_run, load_tokenizer
    from attnres.upcycle import PREFIX, upcycle

    run = load_run(pretrained)
    fields = {k: v for k, v in run.model.config.to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version") and not k.startswith("attnres_")}
    original = AutoModelForCausalLM.from_config(AutoConfig.for_model(FAMILY, **fields))
    assert run.model.config.model_type == PREFIX + FAMILY
    original.load_state_dict(run.model.state_dict())  # the standard residual has no parameters: the same keys
    dirs = {"original": work / "original", "block": work / "block"}
    original.save_pretrained(dirs["original"])
    upcycle(original, "attnres_block", BLOCK_SIZE).save_pretrained(dirs["block"])
    tokenizer_json = load_tokenizer(run).to_json()
    for d in dirs.values():
        (d / "tokenizer.json").write_text(tokenizer_json)
    return dirs


def continue_training(args, dirs: dict[str, Path], seed: int, work: Path) -> dict[str, Path]:
    """Phase 2 for one seed: the same continued training of both models."""
    from attnres.train import load_config, train

    runs = {}
    for name, d in dirs.items():
        runs[name] = run = work / f"seed{seed}-{name}"
        overrides = train_overrides(args, run, args.steps, **{
            "model.from_hf": str(d), "init_from": str(d), "lr": args.lr, "schedule": "constant",
            "warmup_steps": max(1, args.steps // 20), "seed": seed})
        if not (run / "checkpoints").is_dir():
            train(load_config(None, overrides))
    return runs


def _selections(model, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    from attnres.upcycle import RouterRecorder

    with torch.no_grad(), RouterRecorder(model) as rec:
        model.eval()(tokens, use_cache=False)
    return {layer: torch.cat(rec.selected[layer]) for layer, _ in rec.routers}


def _models_at(runs: dict[str, Path], dirs: dict[str, Path], step: int):
    from transformers import AutoModelForCausalLM

    from attnres.inference.loading import load_run
    from attnres.checkpoint import checkpoint_path

    if step == 0:
        return {name: AutoModelForCausalLM.from_pretrained(d) for name, d in dirs.items()}
    return {name: load_run(checkpoint_path(run, step)).model for name, run in runs.items()}


def routing_over_training(runs: dict[str, Path], dirs: dict[str, Path], steps: list[int], tokens: torch.Tensor) -> list[dict]:
    """Per checkpoint step: expert loads, their distances, routing agreement, query norm."""
    from attnres.analysis.experts import load_of_selections

    rows, start = [], None
    for step in steps:
        models = _models_at(runs, dirs, step)
        picks = {name: _selections(m, tokens) for name, m in models.items()}
        n_experts = EXPERTS["num_experts"]
        loads = {name: {layer: load_of_selections(layer, [s], n_experts) for layer, s in p.items()} for name, p in picks.items()}
        start = start or loads
        row = {"step": step, "query_norm": float(torch.stack([m.query.detach().norm() for m in models["block"].residual.mixers]).mean()),
               "layers": []}
        for layer in loads["original"]:
            a, b = picks["original"][layer], picks["block"][layer]
            agreement = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).float().mean().item()
            row["layers"].append({
                "layer": layer, "agreement": agreement,
                "tv_between": _tv(loads["block"][layer].fraction, loads["original"][layer].fraction),
                **{f"tv_from_start_{n}": _tv(loads[n][layer].fraction, start[n][layer].fraction) for n in loads},
                **{f"load_{n}": loads[n][layer].to_dict() for n in loads}})
        rows.append(row)
        print(f"  step {step}: query norm {row['query_norm']:.3f}, routing agreement "
              f"{sum(x['agreement'] for x in row['layers']) / len(row['layers']):.3f}", flush=True)
    return rows


def _tv(p: list[float], q: list[float]) -> float:
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q))


def _curves(run: Path) -> dict:
    from attnres.train.metrics import read_metrics

    records = read_metrics(run / "metrics.jsonl")  # (strict JSON: a NaN is null there, NaN here)
    diags = [r for r in records if r["kind"] == "diagnostics" and r.get("depth_weights")]
    return {"train": [(r["step"], r["loss"], r.get("aux_loss")) for r in records if r["kind"] == "train"],
            "eval": [(r["step"], r["val_loss"]) for r in records if r["kind"] == "eval"],
            # the largest departure of a mean depth weight from uniform (1/n over a mixer's n sources)
            "depth_departure": [(r["step"], max(abs(w - 1 / len(ws)) for ws in r["depth_weights"] for w in ws))
                                for r in diags]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=out_dir, default=None, help="report directory (default results/upcycle-moe; --quick: "
                                               "results/upcycle-moe-quick, not the committed one)")
    p.add_argument("--work", type=out_dir, default=None, help="model directories and training runs (default runs/upcycle-moe"
                                                "[-quick])")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--pretrain-steps", type=positive_int, default=400)
    p.add_argument("--pretrain-lr", type=float, default=3e-3)
    p.add_argument("--steps", type=positive_int, default=300, help="continued-training steps of each model")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--every", type=positive_int, default=50, help="checkpoint, eval and diagnostics cadence")
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--vocab", type=positive_int, default=2048)
    p.add_argument("--rows", type=positive_int, default=16, help="validation windows for the routing measurements")
    p.add_argument("--quick", action="store_true", help="a smoke run: few steps, small batches")
    p.add_argument("--report-only", action="store_true", help="rewrite report.md and the plots from results.json")
    args = p.parse_args(argv)
    if args.quick:
        args.pretrain_steps, args.steps, args.every, args.batch, args.rows, args.seeds = 6, 4, 2, 4, 2, args.seeds[:1]
    suffix = "-quick" if args.quick else ""  # (a smoke run wrote over the committed results/upcycle-moe)
    args.out = args.out or f"results/upcycle-moe{suffix}"
    args.work = args.work or f"runs/upcycle-moe{suffix}"
    if args.report_only and not (Path(args.out) / "results.json").is_file():  # (was a FileNotFoundError traceback)
        p.error(f"argument --report-only: {Path(args.out) / 'results.json'} not found: run the benchmark first")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out, work = Path(args.out), Path(args.work)
    if args.report_only:
        from upcycle_moe_report import write_report

        write_report(out, json.loads((out / "results.json").read_text()))
        return 0
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    results = run_all(args, work, out)
    write_text_atomically(out / "config.json", json.dumps(results.pop("configs"), indent=1))
    write_text_atomically(out / "results.json", json.dumps(results, indent=1))
    from upcycle_moe_report import write_report

    write_report(out, json.loads((out / "results.json").read_text()))
    print(f"wrote {out / 'report.md'}")
    return 0


def run_all(args, work: Path, out: Path) -> dict:
    from attnres.experiments.job.analyze import analysis_tokens
    from attnres.inference.loading import load_run

    t0 = time.process_time()
    pretrained = pretrain(args, work)
    dirs = write_models(pretrained, work)
    tokens = analysis_tokens(load_run(pretrained), rows=args.rows, seq_len=args.seq_len)
    results: dict = {"command": "python benchmarks/upcycle_moe.py " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {' '.join(map(str, v)) if isinstance(v, list) else v}")
        for k, v in vars(args).items() if v not in (None, False) and k != "report_only"),
        "family": FAMILY, "model": MODEL, "experts": EXPERTS, "block_size": BLOCK_SIZE, "torch": torch.__version__,
        "pretrain": _curves(pretrained), "seeds": {}, "analysis_tokens": tokens.numel()}
    results["configs"] = {"pretrain": json.loads((pretrained / "config.json").read_text())}
    for seed in args.seeds:
        runs = continue_training(args, dirs, seed, work)
        results["configs"][f"continue (seed {seed}, block)"] = json.loads((runs["block"] / "config.json").read_text())
        steps = [0] + list(range(args.every, args.steps + 1, args.every))
        print(f"seed {seed}: routing over training", flush=True)
        results["seeds"][str(seed)] = {"curves": {n: _curves(r) for n, r in runs.items()},
                                       "routing": routing_over_training(runs, dirs, steps, tokens)}
        if seed == args.seeds[0]:  # attnres analyze on the final checkpoints: depth mixing, expert load
            from attnres.experiments.job.analyze import write_analysis

            write_analysis(runs["block"], runs["original"], out / "analysis", rows=args.rows, seq_len=args.seq_len)
    results["cpu_seconds"] = round(time.process_time() - t0)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
