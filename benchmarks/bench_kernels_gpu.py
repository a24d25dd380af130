"""GPU benchmark of the depth-attention Triton kernels. Needs CUDA and triton.

Two parts; every variant is timed **interleaved** (one call of each per round, CUDA events)
after a warm-up, and we report medians.

1. **Op level: the inputs of one Block AttnRes block.** Given ``n`` completed block sums
   ``[n, M, d]``, the ``S - 1`` partial sums that the block's later sublayers see, ``S``
   pseudo-queries (key-norm gain folded in) and the ``S`` sublayers' pre-norm gains, produce
   the ``S`` normalised sublayer inputs ``RMSNorm(h_l) * gain_l`` - everything the residual
   does for one block, as a model runs it. Forward, and forward + backward (upstream
   gradient on every output). Implementations:

   * ``ours (triton)``: the Phase-1 kernel (each source's logits for the ``S`` queries
     computed in its one pass over the sources), then per sublayer the merge kernel with the
     partial sum's logit computed and the RMSNorm fused in;
   * ``ours (torch)``, ``ours (torch.compile)``: the PyTorch reference path;
   * peers, each through an adapter that maps these shapes to its API (skipped, with the
     reason, when the package is missing or does not support the shape):
     ``fla`` (``fla.ops.attnres.fused_attnres``, package ``flash-linear-attention``: one call
     per sublayer over all its sources, output RMSNorm fused), ``fast-attnres``
     (``attnres(values, query)`` per sublayer, then ``F.rms_norm``) and ``flash-attn-res``
     (its Phase-1 and Phase-2 ops, then ``F.rms_norm``). ``fast-attnres`` installs a
     top-level package that is also called ``attnres``: the adapter loads it from its
     distribution's files under another module name.

   Memory traffic: ``min`` bytes are what any implementation must move (read every source
   and partial sum once, write the ``S`` outputs); ``ours`` bytes are what our kernels read
   and write (each tensor counted once per kernel; a kernel's repeated walks over a row hit
   the cache). Achieved bandwidth = bytes / median forward time, as a fraction of the
   device's peak (its datasheet figure where known, else a measured device copy); the
   bandwidth bound is ``min bytes / peak``.
2. **End to end** - training step (forward + backward, bf16 autocast) and one cached decode
   step (batch 1 and 8) of Block AttnRes (``backend="triton"`` and ``"torch"``)
   against the standard residual, default d = 2048, 32 transformer blocks, S = 8 sublayers
   per block (N = 8 blocks). Targets: training step <= 1.04x, decode <= 1.02x (as
   ``gpu_check.py``'s).

Run it from the repository root with ``PYTHONPATH=src``: fast-attnres installs a package
named ``attnres`` into site-packages, which must not shadow this project's.

    PYTHONPATH=src python benchmarks/bench_kernels_gpu.py            # full run
    PYTHONPATH=src python benchmarks/bench_kernels_gpu.py --quick    # smaller, few repeats
    PYTHONPATH=src python benchmarks/bench_kernels_gpu.py --dry-run  # no GPU: shapes, bytes, peers

Writes ``benchmarks/results/kernels_gpu.{json,md}`` (``--quick``: ``kernels_gpu_quick``;
``--dry-run`` writes nothing), after every op-level shape too, so that a run stopped by a
time limit keeps what it measured. Cold, the peers' autotuners compile every candidate
configuration one after another (minutes per shape): ``--warm-up`` compiles every
implementation first, in parallel processes, into the on-disk Triton and inductor caches.
``--part ops|e2e`` runs one part. Measured on an H100: benchmarks/results/gpu-h100/.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_training_overhead import log, out_stem, positive_int, script_path, write_results

from attnres import AttnResLM, ModelConfig
from attnres.ops.depth_attention import library, reference

EPS = 1e-6
#: Datasheet peak memory bandwidth (bytes/s) by device-name substring, most specific first.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12, "A100": 1.555e12}
TARGETS = {"train": 1.04, "decode": 1.02}  # the report's < 4 % and 2 %, as gpu_check.TARGETS


@dataclass(frozen=True)
class OpShape:
    """One block's inputs: ``tokens`` rows, hidden size ``d``, ``n`` completed sources,
    ``S`` sublayers per block; bf16 storage."""

    tokens: int
    d: int
    n: int
    S: int

    @property
    def label(self) -> str:
        return f"M={self.tokens} d={self.d} n={self.n} S={self.S}"


def op_shapes(quick: bool) -> list[OpShape]:
    """Benchmarked shapes: d = 2048 (the end-to-end width) at the first and a late block,
    a wide model, and a hidden size that is not a power of two."""
    if quick:
        return [OpShape(4096, 1024, 2, 4), OpShape(4096, 1000, 6, 4)]
    return [OpShape(16384, 2048, 2, 8), OpShape(16384, 2048, 8, 8), OpShape(8192, 8192, 8, 8), OpShape(16384, 3000, 8, 8)]


def block_bytes(s: OpShape, esz: int = 2) -> dict[str, int]:
    """Bytes moved by one block's forward: ``min`` (any implementation) and ``ours`` (the
    model's schedule: Phase 1 of the block's queries in one pass over the sources, their
    logits computed there; the first sublayer's norm; then per sublayer one merge of Phase
    1's result with the partial sum, whose logit the merge computes, the norm fused)."""
    row, f32 = s.tokens * s.d * esz, s.tokens * 4  # a [tokens, d] tensor; one float32 per row
    minimum = (s.n + (s.S - 1) + s.S) * row  # sources, partial sums in; outputs out
    phase1 = s.n * row + s.S * (row + f32)  # sources in; weighted sums, lse out
    first = 2 * row + f32  # the first sublayer: its weighted sum and lse in, normalised out
    later = (s.S - 1) * (2 * row + f32 + row + 2 * f32 + 3 * f32)  # o_hat, partial, lse in; out, alpha, stats out
    return {"min": minimum, "ours": phase1 + first + later}


# ------------------------------------------------------------------------------ inputs
def make_inputs(s: OpShape, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g, device=device) * scale)
    return {
        "sources": [r(s.tokens, s.d).to(dtype).requires_grad_() for _ in range(s.n)],
        "partials": [r(s.tokens, s.d).to(dtype).requires_grad_() for _ in range(s.S - 1)],
        "qg": r(s.S, s.d, scale=0.5).requires_grad_(),  # float32, as the model folds them
        "gains": (1 + 0.1 * r(s.S, s.d)).to(dtype).requires_grad_(),
        "upstream": [r(s.tokens, s.d).to(dtype) for _ in range(s.S)],
    }


def leaves(x: dict) -> list[torch.Tensor]:
    return [*x["sources"], *x["partials"], x["qg"], x["gains"]]


# ------------------------------------------------------------------------------ ours
def _ours(x: dict, backend: str) -> list[torch.Tensor]:
    """One block's ``S`` normalised sublayer inputs as the model's schedule runs them: Phase 1
    of the block's queries, then per sublayer the merge of its Phase-1 result (a source of
    known logit, its log-sum-exp) with the partial sum (none for the first) and the
    sublayer's norm."""
    ops = reference if backend == "reference" else library
    kw = {} if backend == "reference" else {"backend": backend}
    sources, qg, gains, partials = x["sources"], x["qg"], x["gains"], x["partials"]
    outs, lse = ops.phase1(qg, sources, EPS, **kw)
    lse = lse.unbind(-1)  # (as the model: each merge reads its column, no slice copy)
    queries = qg.unbind(0)
    return [ops.merge(lse[s].unsqueeze(-1), [outs[s]], partials[s - 1 : s] if s else [], queries[s] if s else None,
                      EPS, gains[s], EPS, **kw)[0] for s in range(len(qg))]


def ours_triton(x: dict) -> list[torch.Tensor]:
    """Our block on the Triton kernels (``backend="triton"``)."""
    return _ours(x, "triton")


def ours_torch(x: dict) -> list[torch.Tensor]:
    """The same block on the readable reference (``backend="reference"``)."""
    return _ours(x, "reference")


# ------------------------------------------------------------------------------ peers
def _rms_norm(h: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """The sublayer pre-norm, for peers that do not fuse it (float32 inside, as ours)."""
    return F.rms_norm(h.float(), (h.shape[-1],), gain.float(), EPS).to(h.dtype)


def _load_fast_attnres():
    """fast-attnres's package is named ``attnres``, like this project: load it from its
    distribution's files under the name ``fast_attnres_peer``."""
    dist = importlib.metadata.distribution("fast-attnres")
    init = Path(dist.locate_file("attnres/__init__.py"))
    spec = importlib.util.spec_from_file_location("fast_attnres_peer", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["fast_attnres_peer"] = module
    spec.loader.exec_module(module)
    return module


def fla_adapter():
    from fla.ops.attnres import fused_attnres

    def run(x: dict) -> list[torch.Tensor]:
        ones = torch.ones_like(x["gains"][0])  # key-norm gain: folded into qg here
        qg = x["qg"].to(x["gains"].dtype)  # the peers take queries in the storage dtype
        outs = []
        for s in range(len(qg)):
            residuals = x["sources"] + ([x["partials"][s - 1]] if s else [])
            outs.append(fused_attnres(query=qg[s], residuals=residuals, rms_weight=ones, output_rms_weight=x["gains"][s], rms_eps=EPS))
        return outs

    return run, lambda s: None


def fast_attnres_adapter():
    peer = _load_fast_attnres()

    def run(x: dict) -> list[torch.Tensor]:
        qg = x["qg"].to(torch.bfloat16)  # fast-attnres takes bf16 queries only
        outs = []
        for s in range(len(qg)):
            values = x["sources"] + ([x["partials"][s - 1]] if s else [])
            outs.append(_rms_norm(peer.attnres(values, qg[s], eps=EPS), x["gains"][s]))
        return outs

    def unsupported(s: OpShape) -> str | None:
        return None if s.d <= 8192 and s.n + 1 <= 129 else "fast-attnres supports d <= 8192 and <= 129 sources"

    return run, unsupported


def flash_attn_res_adapter():
    from flash_attn_res import (
        phase_1_batched_attention_triton_op,
        phase_2_online_softmax_merge_triton_op,
    )

    def run(x: dict) -> list[torch.Tensor]:
        qg = x["qg"].to(torch.bfloat16)
        V = torch.stack(x["sources"]).unsqueeze(1)  # [n, B=1, T=M, d]
        out, lse = phase_1_batched_attention_triton_op(V, qg, EPS)  # [S, 1, M, d], [S, 1, M]
        outs = [_rms_norm(out[0, 0], x["gains"][0])]
        for s, partial in enumerate(x["partials"], start=1):
            h = phase_2_online_softmax_merge_triton_op(partial.unsqueeze(0), qg[s], out[s], lse[s], EPS)
            outs.append(_rms_norm(h[0], x["gains"][s]))
        return outs

    def unsupported(s: OpShape) -> str | None:
        return None if s.d & (s.d - 1) == 0 else "flash-attn-res needs a power-of-two hidden size"

    return run, unsupported


#: Peer name -> (pip package, adapter factory returning (run, unsupported(shape) -> reason)).
PEERS = {
    "fla fused_attnres": ("flash-linear-attention", fla_adapter),
    "fast-attnres": ("fast-attnres", fast_attnres_adapter),
    "flash-attn-res": ("flash-attn-res", flash_attn_res_adapter),
}


def select_peers() -> tuple[dict, dict[str, str]]:
    """``(available, skipped)``: adapters of the importable peers, and for the others why
    they are skipped."""
    available, skipped = {}, {}
    for name, (package, factory) in PEERS.items():
        try:
            available[name] = factory()
        except (ImportError, importlib.metadata.PackageNotFoundError, FileNotFoundError) as e:
            skipped[name] = f"not installed (pip install {package}): {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - a peer that breaks on import (flash-attn-res 0.1.12 on Triton 3.9)
            skipped[name] = f"installed but fails to load: {type(e).__name__}: {str(e)[:300]}"
    return available, skipped


# ------------------------------------------------------------------------------ timing
def cuda_time(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def cuda_peak_step_memory(step) -> int:
    """Peak memory of one step above what was allocated before it (parameters and anything
    else alive between steps not counted): what the step saves for its backward, plus
    transients (the kernels save the sources by reference, not a stacked copy)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def time_interleaved(steps: dict, repeats: int) -> dict[str, float]:
    """Median seconds per step, one call of each step per round (in a rotating order)."""
    for step in steps.values():
        step()
        step()
    torch.cuda.synchronize()
    times = {k: [] for k in steps}
    names = list(steps)
    for r in range(repeats):  # the order rotates, so that no step always runs first
        for k in names[r % len(names):] + names[: r % len(names)]:
            times[k].append(cuda_time(steps[k]))
    return {k: statistics.median(v) for k, v in times.items()}


def peak_bandwidth() -> tuple[float, str]:
    """Bytes/s of the device: its datasheet peak where known, else a measured copy."""
    name = torch.cuda.get_device_name()
    for key, bw in PEAK_BANDWIDTH.items():
        if key in name:
            return bw, f"datasheet ({key})"
    x = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = statistics.median(cuda_time(lambda: y.copy_(x)) for _ in range(20))
    return 2 * x.numel() / t, "measured device copy"


def implementations(peers: dict) -> dict:
    """Name -> (run, unsupported(shape) -> reason): ours, then the importable peers."""
    impls = {"ours (triton)": (ours_triton, lambda s: None), "ours (torch)": (ours_torch, lambda s: None)}
    impls["ours (torch.compile)"] = (torch.compile(ours_torch, dynamic=False), lambda s: None)
    impls.update(peers)
    return impls


def block_steps(name: str, run, x: dict) -> dict:
    """The two timed steps of one implementation: forward, and forward + backward."""

    def fwd():
        with torch.no_grad():
            run(x)

    def fwd_bwd():
        outs = run(x)
        torch.autograd.backward(outs, x["upstream"])

    return {f"{name}|fwd": fwd, f"{name}|fwd+bwd": fwd_bwd}


def compile_only(args, peers: dict, name: str) -> int:
    """Run one implementation's steps once per shape and exit: its Triton kernels (and the
    peers' autotuning candidates) and inductor's graphs land in the on-disk caches, where
    the timed run finds them (``--warm-up``)."""
    run, unsupported = implementations(peers)[name]
    for shape in op_shapes(args.quick):
        if unsupported(shape) is None:
            start = time.perf_counter()
            for step in block_steps(name, run, make_inputs(shape)).values():
                step()
            torch.cuda.synchronize()
            log(f"  [warm-up] {name} {shape.label}: {time.perf_counter() - start:.0f} s")
    return 0


def warm_up(args, names: list[str]) -> None:
    """Compile every implementation in parallel, one process each. Cold, the peers'
    autotuners compile every candidate configuration of their backward kernels with
    ``ptxas`` one after another - minutes per shape on an H100 host - and doing that for
    each implementation in turn inside the timed run did not finish in 320 s."""
    log(f"[warm-up] compiling {len(names)} implementations in parallel")
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--compile-only", name, *(["--quick"] if args.quick else [])])
             for name in names]
    codes = [p.wait() for p in procs]
    for name, code in zip(names, codes):
        if code:
            log(f"[warm-up] {name}: exit {code} (the timed run compiles it itself)")
    log(f"[warm-up] done in {time.perf_counter() - start:.0f} s")


def bench_ops(args, peers: dict, skipped: dict, checkpoint=lambda ops: None) -> dict:
    """Time every implementation on every shape; ``checkpoint(results)`` after each shape,
    so that a run cut short keeps what it measured."""
    peak, peak_source = peak_bandwidth()
    impls = implementations(peers)
    results = {"peak_GBps": peak / 1e9, "peak_source": peak_source, "skipped_peers": skipped, "shapes": []}
    for shape in op_shapes(args.quick):
        log(f"[ops] {shape.label}")
        x = make_inputs(shape)
        steps, row = {}, {"shape": asdict(shape), "bytes": block_bytes(shape), "impls": {}, "unsupported": {}}
        for name, (run, unsupported) in impls.items():
            reason = unsupported(shape)
            if reason is None and name in peers:
                try:  # a peer whose API does not match its adapter is reported, not fatal
                    run(x)
                except Exception as e:  # noqa: BLE001
                    reason = f"failed: {type(e).__name__}: {e}"
            if reason:
                log(f"  {name}: {reason}")
                row["unsupported"][name] = reason
                continue
            steps.update(block_steps(name, run, x))
        for key, t in time_interleaved(steps, args.repeats).items():
            name, mode = key.split("|")
            row["impls"].setdefault(name, {})[f"{mode}_us"] = t * 1e6
        bound = row["bytes"]["min"] / peak
        for name, r in row["impls"].items():
            t = r["fwd_us"] / 1e6
            r["min_bytes_fraction_of_peak"] = row["bytes"]["min"] / t / peak
            r["fwd_over_bandwidth_bound"] = t / bound
            if name == "ours (triton)":
                r["own_bytes_fraction_of_peak"] = row["bytes"]["ours"] / t / peak
        results["shapes"].append(row)
        checkpoint(results)
        del x
    return results


def e2e_config(args) -> ModelConfig:
    return ModelConfig(
        vocab_size=32000, d_model=args.e2e_d, n_layers=args.e2e_layers, n_heads=max(1, args.e2e_d // 128),
        max_seq_len=args.e2e_seq + 1, residual={"block_size": 2 * args.e2e_layers // args.e2e_blocks},
    )


def bench_e2e(args) -> dict:
    from attnres.inference import KVCache, decode_step

    base = e2e_config(args)
    variants = {
        "standard": base.replace(residual="standard"),
        "block (triton)": base.replace(residual={"kind": "attnres_block", "backend": "triton"}),
        "block (torch)": base.replace(residual={"kind": "attnres_block", "backend": "torch"}),
    }
    models = {}
    for name, cfg in variants.items():
        torch.manual_seed(0)
        models[name] = AttnResLM(cfg).cuda()
    ids = torch.randint(0, base.vocab_size, (args.e2e_batch, args.e2e_seq), device="cuda")
    res = {"config": {"d_model": base.d_model, "n_layers": base.n_layers, "block_size": base.residual.block_size, "seq": args.e2e_seq, "batch": args.e2e_batch}}

    def train(model):
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        return step

    res["train"] = time_interleaved({k: train(m) for k, m in models.items()}, args.repeats)
    res["train_peak_memory_bytes"] = {k: cuda_peak_step_memory(train(m)) for k, m in models.items()}
    for model in models.values():
        model.to(torch.bfloat16)
    for batch in (1, 8):
        cache = KVCache(base.n_layers, capacity=args.e2e_seq + 1)
        shape = (batch, base.kv_heads, args.e2e_seq, base.head_dim)
        for layer in range(base.n_layers):
            cache.update(layer, torch.randn(shape, device="cuda", dtype=torch.bfloat16), torch.randn(shape, device="cuda", dtype=torch.bfloat16))
        tokens = torch.randint(0, base.vocab_size, (batch,), device="cuda")

        def decode(model, cache=cache, tokens=tokens):
            def step():
                with torch.no_grad():
                    decode_step(model, cache, tokens)
                cache.crop(args.e2e_seq)

            return step

        res[f"decode b={batch}"] = time_interleaved({k: decode(m) for k, m in models.items()}, args.repeats)
    return res


# ------------------------------------------------------------------------------ output
def render_markdown(r: dict) -> str:
    lines = [f"# Fused kernels on {r['device']}", "", f"Command: `{r['command']}`  ", f"torch {r['torch']}, triton {r['triton']}.", ""]
    lines += render_ops(r["ops"]) if "ops" in r else ["Op level: not measured in this run."]
    lines += render_e2e(r["e2e"]) if "e2e" in r else ["", "End to end: not measured in this run."]
    return "\n".join(lines) + "\n"


def render_ops(ops: dict) -> list[str]:
    lines = [
        f"## Op level: the S normalised sublayer inputs of one block (bf16), peak {ops['peak_GBps']:.0f} GB/s ({ops['peak_source']})",
        "",
        "*bw* = minimum bytes / forward time as a fraction of the peak; *x bound* = forward time / (minimum bytes / peak).",
        "",
        "| shape | implementation | fwd µs | fwd+bwd µs | bw (min bytes) | x bound |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in ops["shapes"]:
        label = OpShape(**row["shape"]).label
        for name, t in sorted(row["impls"].items(), key=lambda kv: kv[1]["fwd_us"]):
            lines.append(f"| {label} | {name} | {t['fwd_us']:.0f} | {t['fwd+bwd_us']:.0f} | {t['min_bytes_fraction_of_peak']:.2f} | {t['fwd_over_bandwidth_bound']:.2f} |")
        for name, why in row["unsupported"].items():
            lines.append(f"| {label} | {name} | - | - | - | {why} |")
    for name, why in ops["skipped_peers"].items():
        lines.append(f"\nSkipped peer **{name}**: {why}")
    return lines


def render_e2e(e: dict) -> list[str]:
    c = e["config"]
    lines = [
        "",
        f"## End to end: d={c['d_model']}, {c['n_layers']} transformer blocks, S={c['block_size']} (N={2 * c['n_layers'] // c['block_size']}), seq {c['seq']}",
        "",
        "| mode | variant | median ms | ratio to standard | target |",
        "|---|---|---:|---:|---|",
    ]
    for mode, times in e.items():
        if mode in ("config", "train_peak_memory_bytes"):
            continue
        target = TARGETS["train" if mode == "train" else "decode"]
        for name, t in times.items():
            ratio = t / times["standard"]
            verdict = "" if name == "standard" else f"<= {target:.2f}: {'met' if ratio <= target else 'MISSED'}"
            lines.append(f"| {mode} | {name} | {t * 1e3:.2f} | {ratio:.3f} | {verdict} |")
    mem = e.get("train_peak_memory_bytes")
    if mem:
        lines += ["", "Peak memory of one training step above the memory allocated before it (bf16 autocast):", "",
                  "| variant | MiB | ratio to standard |", "|---|---:|---:|"]
        for name, b in mem.items():
            lines.append(f"| {name} | {b / 2**20:.0f} | {b / mem['standard']:.3f} |")
    return lines


def dry_run(args) -> dict:
    """The plan without a GPU: shapes, byte counts, end-to-end config and peer selection."""
    _, skipped = select_peers()
    cfg = e2e_config(args)
    plan = {
        "ops": [{"shape": asdict(s), "bytes": block_bytes(s)} for s in op_shapes(args.quick)],
        "e2e": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "block_size": cfg.residual.block_size, "n_blocks": 2 * cfg.n_layers // cfg.residual.block_size},
        "peers": {name: skipped.get(name, "available") for name in PEERS},
    }
    for row in plan["ops"]:
        b = row["bytes"]
        log(f"[dry-run] {OpShape(**row['shape']).label}: min {b['min'] / 2**20:.0f} MiB, ours {b['ours'] / 2**20:.0f} MiB")
    log(f"[dry-run] end to end: {plan['e2e']}")
    for name, status in plan["peers"].items():
        log(f"[dry-run] peer {name}: {status}")
    return plan


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller shapes and models, few repeats")
    p.add_argument("--dry-run", action="store_true", help="print the plan (shapes, bytes, peers); no GPU needed")
    p.add_argument("--repeats", type=positive_int, default=30)
    p.add_argument("--e2e-d", type=positive_int, default=2048)
    p.add_argument("--e2e-layers", type=positive_int, default=32, help="transformer blocks (2 sublayers each)")
    p.add_argument("--e2e-blocks", type=positive_int, default=8, help="N, the number of AttnRes blocks")
    p.add_argument("--e2e-seq", type=positive_int, default=2048)
    p.add_argument("--e2e-batch", type=positive_int, default=4)
    p.add_argument("--part", choices=("all", "ops", "e2e"), default="all", help="which part to run")
    p.add_argument("--warm-up", action="store_true",
                   help="first compile every implementation in parallel processes (fills the Triton and inductor caches)")
    p.add_argument("--compile-only", metavar="IMPL", help=argparse.SUPPRESS)  # one --warm-up worker
    p.add_argument("--out", type=out_stem, default=None,
                   help="output path without suffix (default: benchmarks/results/kernels_gpu[_quick])")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 5)
        args.e2e_d, args.e2e_layers, args.e2e_seq, args.e2e_batch = 512, 8, 512, 2
    if (2 * args.e2e_layers) % args.e2e_blocks:
        p.error(f"--e2e-blocks must divide the {2 * args.e2e_layers} sublayers, got {args.e2e_blocks}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args)
        return 0
    if not torch.cuda.is_available():
        log("bench_kernels_gpu: needs a CUDA device (none found); --dry-run shows the plan without one")
        return 2
    import triton

    peers, skipped = select_peers()
    for name, why in skipped.items():
        log(f"skipping peer {name}: {why}")
    if args.compile_only:
        return compile_only(args, peers, args.compile_only)
    if args.warm_up and args.part != "e2e":
        warm_up(args, [n for n in implementations(peers) if n != "ours (torch)"])
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / ("kernels_gpu_quick" if args.quick else "kernels_gpu")
    result = {
        "command": " ".join(["PYTHONPATH=src python", script_path(sys.argv[0]), *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "args": vars(args),
    }

    def checkpoint(ops: dict) -> None:  # the shapes measured so far, written as we go
        write_results(out, {**result, "ops": ops}, render_markdown)

    if args.part != "e2e":
        result["ops"] = bench_ops(args, peers, skipped, checkpoint)
    if args.part != "ops":
        result["e2e"] = bench_e2e(args)
    write_results(out, result, render_markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
