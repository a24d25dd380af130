"""The prepared GPU check of the depth-attention path: one command, at most about 8 minutes
on an H100, that measures what the GPU targets are judged on and writes it as it goes.

    PYTHONPATH=src python benchmarks/gpu_check.py --out gpu-check   # on a lent GPU: docs/kernels.md's steps
    PYTHONPATH=src python benchmarks/gpu_check.py --cpu-smoke --out /tmp/gpu-check   # every part, toy sizes, CPU
    PYTHONPATH=src python benchmarks/gpu_check.py --out OUT --parts train_eager --force phase1_rows=false
                                                      # a part with a launch setting forced (triton_impl.FORCED)

Run it from the repository root with ``PYTHONPATH=src`` on a machine that has only PyTorch
and Triton (the peers are optional: their wheels brought along in ``.whl`` - flash-linear-attention,
fla-core, fast-attnres, flash-attn-res and einops, which fla-core needs - installed with ``pip
install --no-deps --target`` beside ``src`` on ``PYTHONPATH``: docs/kernels.md's follow-up 4;
see bench_kernels_gpu.py for why ``PYTHONPATH=src`` comes first with fast-attnres). The parts, in order; each prints its table
when measured and rewrites ``OUT/gpu_check.md``, ``OUT/gpu_check.json`` and
``OUT/summary.json`` (a part that measures in groups also after each: the compiled part's
targets before Full's compile), so a run stopped by a time limit keeps what it measured:

0. **warm-up**, started first in parallel subprocesses: our Triton kernels at every variant
   the models run (a few rows each, the real ``d`` and dtypes; one process per AttnRes
   model and stage: the float32-stream step, the bf16 decode, the bf16 step), the ops
   part's other launch settings, what the parity and ops parts launch outside the models'
   steps (the parity's float32 models and ops, the ops at their defaults, the one-token
   merge, Block at the op shape) and the peers' autotuners, into the on-disk caches, while
   the main process builds the models - unless the GPU's compute mode is other than Default
   (:func:`gpu_compute_mode`: one process at a time), where the parts compile their kernels
   in their untimed first steps (``warm_up`` says so).
1. **parity**: a small Block and Full AttnRes model at the real ``d``, float32, our kernels
   against the torch backend (logits, every gradient); each operation alone against the
   PyTorch implementation in float64.
2. **train, eager**: a training step (bf16 autocast) of the standard model, Block and Full
   AttnRes at d = 2048, 32 transformer blocks, N = 8 blocks (S = 8), sequence 2048, batch
   4, interleaved; the peak memory of a step and the bytes its forward keeps; Block also
   with its Phase-1 sums kept (``recompute_phase1=False``); the standard model and Block
   also with their sublayer norms returning bf16 (``ResidualConfig.autocast_norm_output``:
   no cast of a float32 norm output per linear layer; ``bf16_norm_out`` in the summary) and
   with the stream stored in bf16 (``ResidualConfig.autocast_stream``, float32 parameters:
   ``autocast_stream`` in the summary); Block also with its Phase-1 sums stored in bf16
   (``ResidualConfig.autocast_phase1_sums``: ``block_bf16_sums`` in the summary).
   ``--autocast-norm-output``, ``--autocast-stream`` and ``--autocast-phase1-sums`` run every
   part so, e.g. the compiled one.
3. **decode**: one cached decode step at batch 1 and 8 after a 2048-token context, eager
   and CUDA-graphed, bf16; Block's graphed step also with Phase 1's forward in one kernel
   (``block_phase1_one_kernel`` in the summary: what splitting it over the sources gains) -
   both batches' targets' steps (the standard model's, Block's) before the other steps.
4. **ops**: each of our operations alone (Phase 1 and the merge - also the merge that forms
   Block's partial sum itself - forward and backward) at
   ``M = 8192``, ``d = 2048``, bf16, timed by CUDA-graph replay (no host time) against its
   byte bound (every input read once, every output written once, at the datasheet
   bandwidth); Phase 1 and Block's usual merge also in the default training step's layout
   (a float32 stream under bf16 autocast: float32 sources, the merge reading a bf16 output
   and writing its readers' bf16 input, its backward reading their three bf16 gradients;
   ``ops_autocast`` in the summary); the host time of a merge call (forward + backward, and forward alone) against the
   standard model's add + RMSNorm at one token, with the part of it inside Triton's
   launcher; one Block AttnRes block against the peers that run the shape
   (bench_kernels_gpu.py's adapters).
5. **train, compiled**: the same steps as 2. under ``torch.compile`` - after the parts the
   targets are judged on and before the diagnostics (:data:`TARGET_PARTS`), so that one run
   of the prepared command measures every target: on the H200 it took 221 s, 208 of them inductor compiling three
   models (benchmarks/results/gpu-h200/log.txt). With less than its 230 s left but at least
   174 (``COMPILED_WITHOUT_FULL_S``), it compiles the standard model and Block only (Full has no target; named in
   ``skipped``); once the standard model has compiled, Block compiles while the standard model's
   compile time and the timing fit (:func:`compile_within`). The standard model and Block are compiled, timed and profiled (one compiled
   step each under ``torch.profiler``: where its device time goes, ``device_busy_compiled`` in
   the summary) before Full's compile; Full is then timed beside the compiled standard model.
6. **train, bf16 stream**: the eager steps with every model's parameters in bf16 (the
   stream and the sources stored in bf16, as FSDP2's ``param_dtype=torch.bfloat16`` and,
   in one process, ``ResidualConfig.autocast_stream`` give; without their per-step weight
   casts): half the bytes Block adds with a float32 stream (``bf16_stream`` in the
   summary) - before the diagnostics, as the residual-stream dtype option the training
   target may need.
7. **sweep**: the same operations at the other launch settings of ``SWEEPS`` (Phase 1's
   tiles and groups of sources, Phase 1 as one program per row, the merges' warps, the
   looping merges, their pipeline depth), each beside its default's time; a part of its own,
   so that a fault at a setting no default uses costs only this part - and after the
   targets' parts, so that its settings' compiles, where the warm-up has not made them, and
   a fault's fresh process do not come out of the compiled part's time.
8. **profile**: where one eager training step's device time goes, standard and Block (the
   operations with the most self time under ``torch.profiler``), and that time's share of
   the step's (``device_busy`` in the summary: below 1, the device waited for the host).
9. **decode profile**: what a graphed decode step replays, per model at batch 1: the
   kernels of one eager static step (the launches its CUDA graph records) - their number
   (``decode_kernels`` in the summary), device time and the operations with the most.

A part that raises is recorded (``errors``, with its traceback) and the next one runs; if it
left the device unusable (a kernel's memory fault is sticky: every later CUDA call of the
process fails), the parts after it run in a fresh process (``--continue``, within what is left
of the budget) that adds to the same files.
The files are also written before the models are built (the card, the versions, the code:
``code.source_digest``, and the commit where there is a ``.git``) and before each part, naming
it ``running``: a run killed by its time limit says where. A part's optional pieces (memory,
profiles, host time) that fail are recorded as ``part.piece`` in ``errors``, its timings
kept, and so is a step that fails its first run (an option's, a graph's capture, a model's
compile: :func:`runnable`), the part's other steps timed; the compiled part compiles each
model only while one more compile fits the budget. Where such a step loses the device - at
its first run, in its timing rounds, or a target's memory - the parts keep what they measured
before it (the targets' rows, the sweep's settings, decode's batches) and end there.
``summary.json`` holds the ratios to the standard model by name - ``train_eager``,
``train_compiled``, ``decode_b1``, ``decode_b8`` (graphed), ``decode_eager_b1``,
``decode_eager_b8``, ``memory`` - for Block AttnRes, the same for Full under ``full``, the
op-level ``x bound`` ratios under ``ops``, and the targets with ``met`` for each. Parts that
do not fit the ``--budget`` are skipped and named. ``--cpu-smoke`` runs every part at toy
sizes on the CPU (the Triton kernels under the interpreter): the default test suite runs it.
"""

from __future__ import annotations

import time

#: When this process started, before the imports (torch's takes seconds): ``--budget`` counts
#: from here, so that the budget and the command's time limit measure the same span.
STARTED = time.perf_counter()

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import gc  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager, nullcontext  # noqa: E402
from dataclasses import asdict, dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
if "--cpu-smoke" in sys.argv:  # the interpreter must be on before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, str(HERE))
# (this tree's attnres first, as ``PYTHONPATH=src`` puts it - the code the run records,
# code.source_digest - where the command leaves it out: an installed attnres, or none - the GPU
# machine's - was imported instead, or failed the run before it measured anything)
sys.path.insert(0, str(HERE.parent / "src"))
import bench_kernels_gpu as kernels_bench  # noqa: E402
from bench_training_overhead import out_dir, script_path  # noqa: E402

from attnres import AttnResLM, ModelConfig  # noqa: E402
from attnres.analysis import profiling  # noqa: E402
from attnres.inference import KVCache, StaticDecoder, decode_step, prefill  # noqa: E402
from attnres.ops.depth_attention import library  # noqa: E402
from attnres.output_paths import write_text_atomically  # noqa: E402

#: The targets (ratios to the standard model, Block AttnRes) and the op-level bound.
TARGETS = {"train_eager": 1.04, "train_compiled": 1.04, "decode_b1": 1.02, "decode_b8": 1.02, "memory": 1.05}
OP_BOUND_TARGET = 2.0
#: Host time of a merge call (forward + backward) over the standard's add + RMSNorm.
HOST_TARGET = 2.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Sizes:
    """What is measured: the op-level shape, the end-to-end model and its inputs."""

    tokens: int = 8192
    d: int = 2048
    n: int = 8  # completed sources of the op-level Phase 1 (the last block of N = 8)
    S: int = 8
    layers: int = 32  # transformer blocks (2 sublayers each)
    blocks: int = 8  # N, Block AttnRes' blocks
    seq: int = 2048
    batch: int = 4
    vocab: int = 32000
    repeats: int = 10
    op_repeats: int = 50


SMOKE = Sizes(tokens=8, d=16, n=2, S=2, layers=2, blocks=2, seq=8, batch=2, vocab=64, repeats=1, op_repeats=1)


# ----------------------------------------------------------------------------------------- timing
class Clock:
    """Wall time of a step on the device: CUDA events on a GPU, ``perf_counter`` on CPU; and
    the run's deadline (``perf_counter`` seconds; ``None``: none), which a part that can
    drop some of its work (the compiled part's models) checks before each piece. ``strict``
    (default: on the CPU, the smoke, whose failures are the tests'): a part's optional
    piece that raises fails the part, else it is recorded (:func:`attempt`) and the part's
    other results kept. ``on_measured``: where a part that measures in groups hands the rows
    it has so far (:meth:`measured`; :func:`run_one_part` writes them into the files)."""

    def __init__(self, device: str, deadline: float | None = None, strict: bool | None = None):
        self.cuda = device == "cuda"
        self.deadline = deadline
        self.strict = not self.cuda if strict is None else strict
        self.on_measured = None

    def measured(self, rows: dict) -> None:
        """A part's rows measured so far - the compiled part's targets before Full's compile,
        the eager part's before its other steps, decode's batch 1 - to :attr:`on_measured`
        (where set): a run its time limit kills later in the part keeps them. Where that
        fails (a full disk), the log says so and the part goes on: the part's end writes its
        rows again (unless ``strict``, the smoke)."""
        if self.on_measured is None:
            return
        try:
            self.on_measured(rows)
        except Exception as e:  # noqa: BLE001 - the rows stay in the part's result
            if self.strict:
                raise
            log(f"[gpu_check]   the rows measured so far were not written: {type(e).__name__}: {e}")

    def left(self) -> float:
        """Seconds to the deadline (infinite without one)."""
        return float("inf") if self.deadline is None else self.deadline - time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        return kernels_bench.cuda_time(fn)

    def interleaved(self, steps: dict, repeats: int) -> dict[str, float]:
        """Median seconds per step, one call of each per round in a rotating order."""
        if not steps:
            return {}
        for step in steps.values():
            step()
        self.sync()
        times = {k: [] for k in steps}
        names = list(steps)
        for r in range(repeats):
            for k in names[r % len(names):] + names[: r % len(names)]:
                times[k].append(self.time(steps[k]))
        return {k: statistics.median(v) for k, v in times.items()}

    def replayed(self, fn, repeats: int) -> float:
        """Median device seconds of ``fn`` replayed from a CUDA graph (no host time); on CPU,
        its wall time."""
        if not self.cuda:
            return statistics.median(self.time(fn) for _ in range(max(1, repeats)))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (compiles the kernels) outside the capture
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        return statistics.median(self.time(graph.replay) for _ in range(repeats))


def attempt(clock: Clock, errors: dict, name: str, fn, default=None):
    """``fn()``, or - where it raises and ``clock`` is not strict - ``default``, its traceback
    recorded as ``errors[name]``: a part's optional pieces (its memory, a profile, the host
    time) cannot lose the timings it measured before them (the compiled part's come after
    minutes of compiling)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded; the part's other results stand
        if clock.strict:
            raise
        record(errors, name, e)
        return default


def kept_unless_lost(clock: Clock, errors: dict, name: str, fn):
    """:func:`attempt` of ``fn`` (``None`` where it failed, recorded as ``errors[name]``),
    raising :class:`DeviceLost` where the failure left the device unusable: a part that
    measures in groups - the targets', then the others'; decode's batches - keeps the rows
    measured before (its timing rounds, its memory), and every later step's failure on the
    dead device is not recorded as that step's own."""
    value = attempt(clock, errors, name, fn)
    if value is None and not device_usable("cuda" if clock.cuda else "cpu"):
        raise DeviceLost(name)
    return value


def record(errors: dict, name: str, e: Exception) -> None:
    """``e``'s traceback as ``errors[name]``, and in the log."""
    errors[name] = "".join(traceback.format_exception(e))[-3000:]
    log(f"[gpu_check]   {name} FAILED (the part's other results kept):\n{errors[name]}")


class DeviceLost(Exception):
    """A step's failure, recorded, left the device unusable (:func:`runnable`,
    :func:`kept_unless_lost`): the part returns the rows it measured before, with the failure
    among its ``errors``, and the parts after it run in a fresh process (:func:`run_one_part`)."""


def runnable(clock: Clock, errors: dict, steps: dict, prefix: str = "") -> dict:
    """The ``steps`` that run once (their warm-up) without raising, in order. One that raises
    is left out, its traceback recorded as ``errors[prefix + name]``: a step no GPU has run
    yet - an option's, Phase 1 in one kernel, a graph's capture - cannot lose the part's
    other rows, the targets' among them. Raised where ``clock`` is strict (the smoke); where
    the failure left the device unusable, recorded and :class:`DeviceLost` raised, for the
    part - measuring in groups: the targets', then the others'; decode's batches - to keep
    the rows it measured before, as :func:`sweep` keeps its settings' (the parts after it
    run in a fresh process)."""
    device, kept = "cuda" if clock.cuda else "cpu", {}
    for name, step in steps.items():
        try:
            step()
        except Exception as e:  # noqa: BLE001 - recorded; the other steps stand
            if clock.strict:
                raise
            usable = device_usable(device)
            record(errors, prefix + name, e)
            if not usable:
                raise DeviceLost(prefix + name) from None
        else:
            kept[name] = step
    if len(kept) < len(steps):  # (the failures' tracebacks held their tensors: an out-of-memory step's)
        release_memory(device)
    clock.sync()
    return kept


# -------------------------------------------------------------------------------------- the ops
def op_bytes(z: Sizes, esz: int = 2) -> dict[str, int]:
    """Each operation's minimum bytes: its inputs read once, its outputs written once
    (``[M, d]`` tensors in the storage dtype; statistics in float32)."""
    row, f32 = z.tokens * z.d * esz, z.tokens * 4
    return {
        "phase1_fwd": z.n * row + z.S * (row + f32),  # sources in; weighted sums and lse out
        "phase1_bwd": (z.n + z.S) * row + z.S * 2 * f32 + z.n * row,  # sources, gradients, lse in; sources' grads out
        "merge_fwd": 2 * row + f32 + row + 5 * f32,  # o_hat, partial, its logit in; out, alpha, rc, zc, rstd out
        "merge_bwd": 3 * row + 5 * f32 + 2 * row + f32,  # g, o_hat, partial, stats in; both gradients, g_z out
        # Block's usual merge: the partial sum formed from the last output inside (+1 read, +1 write)
        "merge_add_fwd": 3 * row + f32 + 2 * row + 5 * f32,  # o_hat, partial, output in; the sum, out, stats
        "merge_add_bwd": 4 * row + 5 * f32 + 2 * row + f32,  # g, o_hat, the sum, its gradient in; two gradients
    }


def op_calls(z: Sizes, device: str, dtype: torch.dtype | None = None, impl=None,
             values: torch.dtype | None = None) -> dict:
    """Each operation's implementation (``impl``: our Triton kernels unless given) on the
    model's layout (``dtype``: bf16 storage on a GPU, float32 under the interpreter, unless
    given; the same values whatever the dtype, rounded to ``values`` first if given - a
    float64 reference of a bf16 run): callables that run it once, forward and backward
    apart."""
    from attnres.ops.depth_attention import triton_impl

    impl = impl or triton_impl
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g, device=device).to(  # noqa: E731
        torch.float64 if dtype == torch.float64 else torch.float32)
    row = lambda: r(z.tokens, z.d).to(values or dtype).to(dtype)  # noqa: E731 - a [M, d] tensor in storage
    sources = [row() for _ in range(z.n)]
    qg = r(z.S, z.d) * 0.5
    outs, lse = impl.phase1_forward(qg, sources, 1e-6)
    g_outs = [row() for _ in range(z.S)]
    g_lse = r(z.tokens, z.S)
    partial, w, q1 = row(), 1 + 0.1 * r(z.d), r(z.d) * 0.5
    zcol = lse.unbind(-1)[1].unsqueeze(-1)
    merged = impl.merge_forward(zcol, [outs[1]], [partial], q1, w, 1e-6, 1e-6)
    g_out = row()
    needs = [True] * 5
    addend = row()
    fused = impl.merge_forward(zcol, [outs[1]], [partial], q1, w, 1e-6, 1e-6, addend)
    return {
        "phase1_fwd": lambda: impl.phase1_forward(qg, sources, 1e-6),
        "phase1_bwd": lambda: impl.phase1_backward(qg, lse, sources, g_outs, g_lse, 1e-6, True,
                                                          [True] * z.n),
        "merge_fwd": lambda: impl.merge_forward(zcol, [outs[1]], [partial], q1, w, 1e-6, 1e-6),
        "merge_bwd": lambda: impl.merge_backward(g_out, merged[1], merged[2], merged[3], merged[4], [outs[1]],
                                                        [partial], q1, w, needs),
        "merge_add_fwd": lambda: impl.merge_forward(zcol, [outs[1]], [partial], q1, w, 1e-6, 1e-6, addend),
        "merge_add_bwd": lambda: impl.merge_backward(g_out, fused[1], fused[2], fused[3], fused[4], [outs[1]],
                                                            [fused[5]], q1, w, needs, g_out),
    }


#: The operations as the default training step runs them - a float32 stream under bf16
#: autocast, where :func:`op_calls` stores everything in bf16 (the targets' layout): Phase 1
#: over float32 block sums, and Block's usual merge reading a bf16 sublayer output as its
#: addend and writing the next sublayer's input in bf16 for its readers (q, k, v: a view
#: each), whose backward reads those readers' bf16 gradients and writes the addend's in bf16
#: beside the float32 sum's (docs/kernels.md, "One view for each reader").
AUTOCAST_OPS = ("phase1_fwd", "phase1_bwd", "merge_add_fwd", "merge_add_bwd")
AUTOCAST_READERS = 3


def autocast_op_bytes(z: Sizes) -> dict[str, int]:
    """:func:`op_bytes` of :data:`AUTOCAST_OPS` in the training step's layout."""
    wide, narrow, f32 = z.tokens * z.d * 4, z.tokens * z.d * 2, z.tokens * 4
    phase1 = op_bytes(z, 4)
    return {"phase1_fwd": phase1["phase1_fwd"], "phase1_bwd": phase1["phase1_bwd"],
            # o_hat, partial (float32), the output (bf16), its logit in; the sum (float32), out (bf16), stats out
            "merge_add_fwd": 3 * wide + 2 * narrow + 6 * f32,
            # the readers' gradients (bf16), o_hat, the sum, its gradient (float32), stats in;
            # o_hat's and the sum's gradients (float32), the output's (bf16), g_z out
            "merge_add_bwd": AUTOCAST_READERS * narrow + 3 * wide + 5 * f32 + 2 * wide + narrow + f32}


def autocast_op_calls(z: Sizes, device: str, impl=None, reference: bool = False) -> dict:
    """:data:`AUTOCAST_OPS` (``impl``: our Triton kernels unless given) in the training step's
    layout: float32 sources, each sublayer output and reader's gradient a bf16 value;
    ``reference``: every tensor float64, on the same values (rounded to bf16 where ours are
    bf16). Callables that run each once."""
    from attnres.ops.depth_attention import triton_impl

    impl = impl or triton_impl
    wide, narrow = (torch.float64, torch.float64) if reference else (torch.float32, torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g, device=device)  # noqa: E731
    row = lambda: r(z.tokens, z.d).to(wide)  # noqa: E731
    rounded = lambda: r(z.tokens, z.d).to(torch.bfloat16).to(narrow)  # noqa: E731
    sources = [row() for _ in range(z.n)]
    qg = (r(z.S, z.d) * 0.5).to(wide)
    outs, lse = impl.phase1_forward(qg, sources, 1e-6)
    g_outs, g_lse = [row() for _ in range(z.S)], r(z.tokens, z.S).to(wide)
    partial, addend, w, q1 = row(), rounded(), (1 + 0.1 * r(z.d)).to(wide), (r(z.d) * 0.5).to(wide)
    zcol = lse.unbind(-1)[1].unsqueeze(-1)
    merge = lambda: impl.merge_forward(zcol, [outs[1]], [partial], q1, w, 1e-6, 1e-6, addend, narrow)  # noqa: E731
    _, alpha, rc, zc, rstd, total = merge()
    g_out, *g_views = (rounded() for _ in range(AUTOCAST_READERS))
    g_total = row()
    return {
        "phase1_fwd": lambda: impl.phase1_forward(qg, sources, 1e-6),
        "phase1_bwd": lambda: impl.phase1_backward(qg, lse, sources, g_outs, g_lse, 1e-6, True, [True] * z.n),
        "merge_add_fwd": merge,
        "merge_add_bwd": lambda: impl.merge_backward(g_out, alpha, rc, zc, rstd, [outs[1]], [total], q1, w,
                                                     [True] * 5, g_total, narrow, g_views),
    }


#: Launch settings timed beside the defaults (``triton_impl.FORCED``), by the operations they
#: change: Phase 1's tile widths, the sources its kernels over blocks of rows load together
#: (2 by default: one, four, or all of Block's 8), Phase 1 as one program per row (the kernels the
#: H200 run measured, before those over blocks of rows), the merge programs' warps (8 at
#: d = 2048; on sm_80 Triton 3.6 spills 32 bytes in one fp32 variant at 8 and none at 16),
#: the merges looping over their sources (the kernels the H200 run measured, before those
#: holding them) and the held merges' pipeline depth (1: not pipelined). The next change of
#: a default is read off these.
MERGES = ("merge_fwd", "merge_bwd", "merge_add_fwd", "merge_add_bwd")
SWEEPS = {"block_d": ((64, 256), ("phase1_fwd", "phase1_bwd")),
          "phase1_group": ((1, 4, 8), ("phase1_fwd", "phase1_bwd")),
          "phase1_rows": ((False,), ("phase1_fwd", "phase1_bwd")),
          "merge_warps": ((4, 16), MERGES),
          "merge_held": ((False,), MERGES),
          "merge_stages": ((1, 2), MERGES)}


def sweep_settings(device: str) -> Iterator[tuple[str, int, tuple[str, ...]]]:
    """``(setting, value, operations)`` the sweep times (on the CPU one value each)."""
    for setting, (values, names) in SWEEPS.items():
        for value in values if device == "cuda" else values[:1]:
            yield setting, value, names


@contextmanager
def forced(setting: str, value: int | bool) -> Iterator[None]:
    """``triton_impl.FORCED[setting] = value`` for the block (then what it was)."""
    from attnres.ops.depth_attention import triton_impl

    before = triton_impl.FORCED[setting]
    triton_impl.FORCED[setting] = value
    try:
        yield
    finally:
        triton_impl.FORCED[setting] = before


@contextmanager
def phase1_in_one_kernel() -> Iterator[None]:
    """Phase 1's forward as one program per row (``phase1_fwd``) at any number of rows: not
    split over the sources (decoding) nor over blocks of rows."""
    with forced("phase1_split", False), forced("phase1_rows", False):
        yield


def part_sweep(z: Sizes, clock: Clock, device: str) -> dict:
    """The operations of the ops part at the launch settings of :data:`SWEEPS` (a part of its
    own: a fault at a setting no default uses costs the sweep, not the ops' rows; a failed
    row costs only itself, :func:`sweep`)."""
    peak = kernels_bench.peak_bandwidth()[0] if device == "cuda" else 1e11
    return sweep(z, clock, device, op_calls(z, device), op_bytes(z, 2 if device == "cuda" else 4), peak)


def sweep(z: Sizes, clock: Clock, device: str, calls: dict, bytes_: dict, peak: float) -> dict:
    """The operations at the launch settings of :data:`SWEEPS`: ``{name@setting=value: {us,
    x bound}}``, and first each at its default (``name@default``): each setting's time is
    held against the default's of the same part, minutes apart at most, not against the ops
    part's (the card's clocks drift; a ``--continue`` runs it in another process). A setting
    that fails an operation (launched at a setting no default uses) is recorded under
    ``errors`` as ``name@setting=value`` and the sweep goes on - up to a failure that left the
    device unusable: the rows measured are returned, and the parts after it run in a fresh
    process."""
    result, errors = {}, {}
    for name in dict.fromkeys(n for _, names in SWEEPS.values() for n in names):
        t = clock.replayed(calls[name], z.op_repeats)
        result[f"{name}@default"] = {"us": t * 1e6, "x_bound": t / (bytes_[name] / peak)}
    result["errors"] = errors
    for setting, value, names in sweep_settings(device):
        with forced(setting, value):
            for name in names:
                key = f"{name}@{setting}={value}"
                t = attempt(clock, errors, key, lambda name=name: clock.replayed(calls[name], z.op_repeats))
                if t is None:
                    if device_usable(device):
                        continue
                    return result
                result[key] = {"us": t * 1e6, "x_bound": t / (bytes_[name] / peak)}
                log(f"[gpu_check]   {name} at {setting}={value}: {t * 1e6:.1f} us")
    return result


class _TimedLaunches:
    """Stands in for a Triton kernel and times, on the host, each ``kernel[grid](...)``
    launch it forwards (Triton's launcher: argument binding, specialisation, the driver call)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.seconds, self.launches = kernel, 0.0, 0

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return launch(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.launches += 1

        return run


class _NoLaunch:
    """Stands in for a Triton kernel and launches nothing: the host's work up to the launch."""

    def __init__(self, kernel=None) -> None:
        pass

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextmanager
def replaced_kernels(names: tuple[str, ...], stand_in=_TimedLaunches) -> Iterator[list]:
    """The Triton kernels ``names`` replaced by ``stand_in(kernel)`` for the block (by
    default :class:`_TimedLaunches`)."""
    from attnres.ops.depth_attention import triton_kernels

    originals = {n: getattr(triton_kernels, n) for n in names}
    replaced = [stand_in(k) for k in originals.values()]
    for n, t in zip(names, replaced):
        setattr(triton_kernels, n, t)
    try:
        yield replaced
    finally:
        for n, k in originals.items():
            setattr(triton_kernels, n, k)


def timed_launches(names: tuple[str, ...]):
    """The Triton kernels ``names`` replaced by :class:`_TimedLaunches` for the block."""
    return replaced_kernels(names)


#: The hidden size of the host time's merge at one token.
HOST_D = 2048


def one_token_merge(device: str, backend: str):
    """Block's usual merge (the partial sum formed inside) at one token, as the host time
    calls it: ``(forward, forward + backward with autograd, its inputs (x, partial, addend,
    norm gain))``."""
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g, device=device)  # noqa: E731
    x, partial, v = (r(1, HOST_D).requires_grad_() for _ in range(3))
    z = r(1, 1).requires_grad_()
    q, w = r(HOST_D).requires_grad_(), r(HOST_D).requires_grad_()

    def forward():
        return library.merge(z, [x], [partial], q, 1e-6, w, 1e-6, backend, addend=v)

    def forward_backward():
        out, _, total = forward()
        torch.autograd.backward([out, total], [torch.ones_like(out), torch.ones_like(total)])

    return forward, forward_backward, (x, partial, v, w)


def host_overhead(clock: Clock, device: str, repeats: int) -> dict[str, float]:
    """Host microseconds per call at one token (the device idle): our merge (forward +
    backward, with autograd, as the model calls it) against the standard model's add +
    RMSNorm (forward + backward), each also forward only (no autograd). On the CPU, ours is
    the GPU path - the Triton implementation - with every launch stubbed (``kernels``:
    ``stubbed``): its Python and dispatch without Triton's launcher, against the standard's
    CPU operators, an estimate of the ratio before a GPU measures it. The part of ours inside
    Triton's launcher is :func:`triton_launch_us`, a piece of its own."""
    from attnres.ops.depth_attention import triton_launch

    d = HOST_D
    backend, kernels = ("auto", nullcontext()) if device == "cuda" else (
        "triton", replaced_kernels(tuple(triton_launch.SIGNATURES), _NoLaunch))
    ours_forward, ours, (x, partial, v, w) = one_token_merge(device, backend)

    def standard_forward():
        h = partial + v
        return F.rms_norm(h, (d,), w, 1e-6), h

    def standard():
        out, h = standard_forward()
        torch.autograd.backward([out, h], [torch.ones_like(out), torch.ones_like(h)])

    with kernels:
        result = {"ours": per_call_us(clock, ours, repeats), "standard": per_call_us(clock, standard, repeats)}
        with torch.no_grad():
            result.update(ours_forward=per_call_us(clock, ours_forward, repeats),
                          standard_forward=per_call_us(clock, standard_forward, repeats))
    if device != "cuda":
        result["kernels"] = "stubbed"
    return result


def per_call_us(clock: Clock, fn, repeats: int) -> float:
    """Host microseconds per call of ``fn`` over ``repeats`` calls (after three)."""
    for _ in range(3):
        fn()
    clock.sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    seconds = (time.perf_counter() - start) / repeats
    clock.sync()
    return seconds * 1e6


def triton_launch_us(clock: Clock, device: str, repeats: int) -> float | None:
    """Of :func:`host_overhead`'s merge call (forward + backward) on a GPU, the microseconds
    inside Triton's launcher (what launching from compiled code instead would save), to
    tell it from our own Python; ``None`` where the merge does not run our Triton kernels
    (the CPU)."""
    if device != "cuda":
        return None
    _, ours, (x, *_) = one_token_merge(device, "auto")
    if not library.pick("auto", [x]).__name__.endswith("triton_impl"):
        return None
    with timed_launches(("merge_fwd", "merge_fwd_held", "merge_bwd", "merge_bwd_held")) as timed:
        per_call_us(clock, ours, repeats)
    calls = timed[0].launches + timed[1].launches  # (one forward launch per call)
    return sum(t.seconds for t in timed) / calls * 1e6


#: How many calls each of the ops part's host times (ours, the standard's, the launcher's) is the mean of.
HOST_REPEATS = 200


def host_times(clock: Clock, device: str, errors: dict) -> dict | None:
    """:func:`host_overhead` (``errors["host"]`` where it fails: ``None``) and, as a piece of
    its own, :func:`triton_launch_us` into it as ``triton_launch`` (``errors["host_launch"]``
    where it fails), each over :data:`HOST_REPEATS` calls: a failure inside the stand-in for
    Triton's kernels loses that number alone, not ours and the standard's."""
    host = attempt(clock, errors, "host", lambda: host_overhead(clock, device, HOST_REPEATS))
    if host is not None:
        launch = attempt(clock, errors, "host_launch", lambda: triton_launch_us(clock, device, HOST_REPEATS))
        if launch is not None:
            host["triton_launch"] = launch
    return host


def part_ops(z: Sizes, clock: Clock, device: str, peers: dict, skipped: dict) -> dict:
    """Each operation against its bound (each row an attempt of its own, ``errors["op
    NAME"]``: one op's failed capture keeps the others' rows - up to a failure that left the
    device unusable, which ends the part with the rows measured), then its optional pieces:
    the training step's layout, the host time, one block against the peers."""
    peak = kernels_bench.peak_bandwidth()[0] if device == "cuda" else 1e11
    calls, bytes_ = op_calls(z, device), op_bytes(z, 2 if device == "cuda" else 4)
    rows, errors = {}, {}
    shape = kernels_bench.OpShape(z.tokens, z.d, z.n, z.S)
    result = {"shape": asdict(shape), "peak_GBps": peak / 1e9, "ops": rows, "autocast": {}, "block": {},
              "unsupported": dict(skipped), "errors": errors}
    for name, fn in calls.items():
        t = attempt(clock, errors, f"op {name}", lambda fn=fn: clock.replayed(fn, z.op_repeats))
        if t is None:
            if device_usable(device):
                continue
            return result  # (each call after it would fail: the parts after it run in a fresh process)
        rows[name] = {"us": t * 1e6, "bound_us": bytes_[name] / peak * 1e6, "x_bound": t / (bytes_[name] / peak)}
        log(f"[gpu_check]   {name}: {rows[name]['us']:.1f} us, {rows[name]['x_bound']:.2f}x bound")
    autocast = attempt(clock, errors, "autocast", lambda: autocast_ops(z, clock, device, peak), {})
    host = host_times(clock, device, errors)
    log(f"[gpu_check]   host: {host}")
    block, unsupported = attempt(clock, errors, "block", lambda: block_against_peers(z, clock, device, peers, skipped),
                                 ({}, dict(skipped)))
    result.update(autocast=autocast, block=block, unsupported=unsupported)
    if host is not None:
        result["host_us"] = host
    return result


def autocast_ops(z: Sizes, clock: Clock, device: str, peak: float) -> dict:
    """The ops of :data:`AUTOCAST_OPS` in the training step's layout, against their bounds."""
    autocast, autocast_bytes = {}, autocast_op_bytes(z)
    for name, fn in autocast_op_calls(z, device).items():
        t, bound = clock.replayed(fn, z.op_repeats), autocast_bytes[name] / peak
        autocast[name] = {"us": t * 1e6, "bound_us": bound * 1e6, "x_bound": t / bound}
        log(f"[gpu_check]   {name}, the training step's layout: {t * 1e6:.1f} us, {t / bound:.2f}x bound")
    return autocast


def block_against_peers(z: Sizes, clock: Clock, device: str, peers: dict, skipped: dict) -> tuple[dict, dict]:
    """One Block AttnRes block, ours and the peers' that run the shape (events, host
    included): ``({implementation: {fwd_us, fwd+bwd_us}}, {peer: why not})``."""
    shape = kernels_bench.OpShape(z.tokens, z.d, z.n, z.S)
    x = kernels_bench.make_inputs(shape, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    impls = {"ours (triton)": (kernels_bench.ours_triton, lambda s: None), **peers}
    steps, unsupported = {}, dict(skipped)
    for name, (run, check) in impls.items():
        reason = check(shape)
        if reason is None and name in peers:
            try:
                run(x)
            except Exception as e:  # noqa: BLE001 - a peer whose API changed is reported, not fatal
                reason = f"failed: {type(e).__name__}: {e}"
        if reason:
            unsupported[name] = reason
            continue
        steps.update(kernels_bench.block_steps(name, run, x))
    log(f"[gpu_check]   timing the block: {sorted(steps)}")
    block = {}
    for key, t in clock.interleaved(steps, z.repeats).items():
        impl, mode = key.split("|")
        block.setdefault(impl, {})[f"{mode}_us"] = t * 1e6
    return block, unsupported


# --------------------------------------------------------------------------------- parity
#: The kernels' parity passes within this many times the torch-vs-reference difference of
#: the same model on the same device (float32 rounding, amplified by depth); each operation
#: alone passes within OP_PARITY_TOLERANCE of float64.
PARITY_NOISE_FACTOR = 10
OP_PARITY_TOLERANCE = 1e-5
#: bf16 storage: a coarse check (a race or a wrong mask is off by O(1)). Each output is
#: rounded to 2^-9, and the float64 reference computes its own intermediate inputs (Phase
#: 1's outputs, the partial sum) where ours are rounded to bf16: up to 1e-2 under the
#: interpreter.
OP_PARITY_TOLERANCE_BF16 = 5e-2
#: The training step's layout: float32 inputs computed alike, the given bf16 values the same
#: on both sides; the bf16 outputs rounded once (~2e-3 relative, by truncation under the
#: interpreter up to twice that).
OP_PARITY_TOLERANCE_AUTOCAST = 1e-2


#: Each op-level parity of the parity part: its tolerance and its layout in words.
OP_PARITY_TOLERANCES = {"ops": OP_PARITY_TOLERANCE, "ops_bf16": OP_PARITY_TOLERANCE_BF16,
                        "ops_autocast": OP_PARITY_TOLERANCE_AUTOCAST}
OP_LAYOUTS = {"ops": "float32 storage", "ops_bf16": "bf16 storage",
              "ops_autocast": "the training step's layout (float32 stream, bf16 autocast)"}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def parity_model(z: Sizes, name: str, backend: str, ids: torch.Tensor, device: str, **sublayers):
    """A small ``name`` ("block" or "full") model on ``backend``, float32, its 1-D parameters
    (queries, gains) perturbed so that the depth weights are not uniform: its logits and
    ``{parameter: gradient}`` for ``ids``. ``sublayers``: ``ModelConfig`` fields that change
    (the warm-up's smaller sublayers)."""
    residual = residual_of(name, z)
    torch.manual_seed(0)
    with torch.device(device):
        model = AttnResLM(replace(model_config(z, {**residual, "backend": backend}), **sublayers))
    for p in model.parameters():
        if p.dim() == 1:
            p.data.add_(0.1 * torch.randn_like(p))
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {k: p.grad for k, p in model.named_parameters()}


def parity_errors(run, reference) -> dict:
    """Logits' and all gradients' relative errors of ``run`` against ``reference``, and the
    worst parameter's - relative to its own gradient, floored at a millionth of the largest
    (mixer 0's query has one source: its true gradient is exactly zero and both sides hold
    rounding whose ratio means nothing)."""
    (logits, grads), (ref_logits, ref_grads) = run, reference
    floor = 1e-6 * max(g.double().norm().item() for g in ref_grads.values())
    errors = {k: (grads[k] - ref_grads[k]).double().norm().item() / max(ref_grads[k].double().norm().item(), floor)
              for k in ref_grads}
    worst = max(errors, key=errors.get)
    return {"logits": relative_error(logits, ref_logits),
            "grads": relative_error(torch.cat([grads[k].flatten() for k in ref_grads]),
                                    torch.cat([g.flatten() for g in ref_grads.values()])),
            "worst_grad": errors[worst], "worst_grad_param": worst, "finite": bool(torch.isfinite(logits).all())}


def part_parity(z: Sizes, device: str) -> dict:
    """Our Triton kernels against the torch backend on this device, float32: logits and
    every parameter's gradient of a small Block and Full AttnRes model at the real ``d``
    (the interpreter's parity, again on the hardware: a race or a wrong mask shows here).

    Eight layers amplify float32 rounding: two correct implementations differ by ~2e-5 in
    the logits and ~3e-4 in the gradients (the torch against the reference backend, on the
    CPU). So the yardstick is that same pair on this device (``noise``): the kernels pass
    within :data:`PARITY_NOISE_FACTOR` times it. Each operation alone is held against
    float64 (``ops``), where no amplification hides anything."""
    small = parity_model_sizes(z)
    ids = torch.randint(0, small.vocab, (small.batch, small.seq), device=device)
    result = {}
    for name in ("block", "full"):
        runs = {b: parity_model(small, name, b, ids, device) for b in ("triton", "torch", "reference")}
        result[name] = parity_errors(runs["triton"], runs["torch"])
        noise = parity_errors(runs["reference"], runs["torch"])
        result[name]["noise"] = {k: noise[k] for k in ("logits", "grads")}
        result[name]["ok"] = result[name]["finite"] and all(
            result[name][k] <= PARITY_NOISE_FACTOR * noise[k] + 1e-6 for k in ("logits", "grads"))
        log(f"[gpu_check] parity {name}: {result[name]}")
    result["ops"] = op_parity(z, device)
    result["ops_bf16"] = op_parity(z, device, torch.bfloat16)
    result["ops_autocast"] = autocast_op_parity(z, device)
    log(f"[gpu_check] parity of the ops against float64: {result['ops']}; bf16 storage: {result['ops_bf16']}; "
        f"the training step's layout: {result['ops_autocast']}")
    return result


def parity_model_sizes(z: Sizes) -> Sizes:
    """The parity part's models: the real ``d``, eight layers in four blocks, 2 x 256 tokens."""
    return Sizes(**{**asdict(z), "layers": min(z.layers, 8), "blocks": min(z.blocks, 4), "seq": min(z.seq, 256),
                    "batch": 2})


def flat(value) -> list[torch.Tensor]:
    """The tensors of an operation's result (nested tuples and lists), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in (value or ()) if v is not None for t in flat(v)]


def op_parity(z: Sizes, device: str, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Each operation alone on the device (``dtype`` storage, our kernels) against the
    PyTorch implementation in float64 on the same values: the worst relative error over its
    outputs (METHOD: float32 lands far under 1e-3, tf32 near 3e-4; bf16 storage rounds every
    output to ~2e-3)."""
    from attnres.ops.depth_attention import torch_impl

    small = parity_sizes(z)
    return worst_errors(op_calls(small, device, dtype), op_calls(small, device, torch.float64, torch_impl, values=dtype))


def autocast_op_parity(z: Sizes, device: str) -> dict[str, float]:
    """:func:`op_parity` of the operations in the training step's layout (float32 sources,
    bf16 sublayer outputs, readers' gradients and merge outputs: :func:`autocast_op_calls`)."""
    from attnres.ops.depth_attention import torch_impl

    small = parity_sizes(z)
    return worst_errors(autocast_op_calls(small, device), autocast_op_calls(small, device, torch_impl, reference=True))


def parity_sizes(z: Sizes) -> Sizes:
    return Sizes(**{**asdict(z), "tokens": min(z.tokens, 512)})


def worst_errors(ours: dict, reference: dict) -> dict[str, float]:
    """Per operation, the worst relative error of its outputs against the reference's."""
    results = {name: (flat(ours[name]()), flat(reference[name]())) for name in ours}
    for name, (a, b) in results.items():
        if len(a) != len(b):
            raise RuntimeError(f"{name}: {len(a)} outputs against the reference's {len(b)}")
    return {name: max(relative_error(a, b) for a, b in zip(*pair)) for name, pair in results.items()}


def copy_bandwidth(device: str) -> float | None:
    """Measured device-to-device copy, bytes read + written per second (the achievable
    ceiling beside the datasheet's)."""
    if device != "cuda":
        return None
    src = torch.randn(2**28, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    t = statistics.median(Clock(device).time(lambda: dst.copy_(src)) for _ in range(10))
    return 2 * src.numel() * 4 / t


# ------------------------------------------------------------------------------ end to end
def model_config(z: Sizes, residual) -> ModelConfig:
    return ModelConfig(vocab_size=z.vocab, d_model=z.d, n_layers=z.layers, n_heads=max(1, z.d // 128),
                       max_seq_len=z.seq + 8, residual=residual)


VARIANTS = {"standard": "standard", "block": None, "full": {"kind": "attnres_full"}}


def residual_of(name: str, z: Sizes):
    """The residual config of variant ``name`` (Block: ``z.blocks`` blocks of sublayers)."""
    residual = VARIANTS[name]
    return {"kind": "attnres_block", "block_size": 2 * z.layers // z.blocks} if residual is None else residual


def build_models(z: Sizes, device: str, names: tuple[str, ...] = tuple(VARIANTS)) -> dict[str, AttnResLM]:
    models = {}
    for name in names:
        residual = residual_of(name, z)
        torch.manual_seed(0)
        with torch.device(device):  # (initialised there: minutes less at 1.6B parameters)
            models[name] = AttnResLM(model_config(z, residual))
    return models


def forward_of(model, ids: torch.Tensor, device: str):
    """The training step's forward: ``() -> loss`` under the step's autocast."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else nullcontext()

    def forward():
        with autocast:
            return model(ids, labels=ids).loss

    return forward


def train_steps(models: dict, ids: torch.Tensor, device: str, compiled: bool = False) -> dict:
    backend = "inductor" if device == "cuda" else "eager"  # (the smoke: the path, not the compiler)

    def step_of(model):
        forward = forward_of(torch.compile(model, backend=backend, dynamic=False) if compiled else model, ids, device)

        def step():
            forward().backward()
            model.zero_grad(set_to_none=True)

        return step

    return {name: step_of(m) for name, m in models.items()}


def peak_memory(step, device: str) -> int:
    if device != "cuda":
        return 1
    return kernels_bench.cuda_peak_step_memory(step)


def kept_bytes(forward, device: str) -> int:
    """Bytes ``forward()`` leaves allocated while its loss is held: what autograd keeps for
    the backward. Counted as allocations - saved-tensor hooks would change what is saved
    (Phase 1's sums are kept as a recipe only where no other hooks are in force)."""
    if device != "cuda":
        return profiling.kept_bytes(forward)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = forward()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before  # (the loss, and its graph, still held)


#: The eager step's extra variant: Block AttnRes keeping its Phase-1 sums for the backward
#: (``recompute_phase1=False``): what recomputing them costs in time and saves in memory.
SUMS_KEPT = "block (sums kept)"


def sums_kept(fn, model):
    """``fn`` run with ``model`` keeping its Phase-1 sums (see :data:`SUMS_KEPT`)."""
    def run():
        model.residual.recompute_phase1 = False
        try:
            return fn()
        finally:
            model.residual.recompute_phase1 = True

    return run


def _norm_output(model, on: bool) -> bool:
    return model.autocast_norm_outputs(on)


def _stream(model, on: bool) -> bool:
    before, model.residual.autocast_stream = model.residual.autocast_stream, on
    return before


def _phase1_sums(model, on: bool) -> bool:
    """(a model without Phase 1 - the standard one - has no sums to store: unchanged)"""
    residual = model.residual
    before = getattr(residual, "autocast_phase1_sums", False)
    if residual.has_depth_attention:
        residual.autocast_phase1_sums = on
    return before


#: Settings of the models that a run can switch on for every part (and its warm-up) and the
#: eager part switches on for a step (:data:`PAIRED`): the option's name
#: (``--autocast-norm-output``, ``--autocast-stream``, ``--autocast-phase1-sums``; each a
#: ``ResidualConfig`` field of that name) and its setter on a built model, which returns what
#: it was.
MODEL_OPTIONS = {"autocast_norm_output": _norm_output, "autocast_stream": _stream,
                 "autocast_phase1_sums": _phase1_sums}
#: The eager part's pairs of steps with an option on, the standard model and Block, and
#: their key in the summary: the sublayers' norms returning bf16 (``autocast_norm_output``,
#: the like-for-like comparison of the casts) and the stream stored in bf16
#: (``autocast_stream``: the one-process bf16 stream, with float32 parameters).
PAIRED = {"autocast_norm_output": ("bf16_norm_out", {"standard (bf16 norm out)": "standard",
                                                     "block (bf16 norm out)": "block"}),
          "autocast_stream": ("autocast_stream", {"standard (bf16 stream)": "standard",
                                                  "block (bf16 stream)": "block"})}
#: The eager part's Block with its Phase-1 sums in bf16 (``autocast_phase1_sums``; the
#: standard model has none: Block against the standard model as it is, ``block_bf16_sums``).
SUMS_BF16 = "block (bf16 sums)"


def apply_model_options(models: dict, options: list[str]) -> None:
    """Switch ``options`` (names of :data:`MODEL_OPTIONS`) on in every model."""
    for model in models.values():
        for option in options:
            MODEL_OPTIONS[option](model, True)


def model_options(args) -> list[str]:
    """The :data:`MODEL_OPTIONS` the command line switched on."""
    return [option for option in MODEL_OPTIONS if getattr(args, option)]


def option_flags(options: list[str]) -> list[str]:
    """The command-line flags of ``options``, for the warm-up's workers."""
    return ["--" + option.replace("_", "-") for option in options]


def with_option(fn, model, option: str):
    """``fn`` run with ``option`` (of :data:`MODEL_OPTIONS`) on in ``model``, then as it was."""
    def run():
        before = MODEL_OPTIONS[option](model, True)
        try:
            return fn()
        finally:
            MODEL_OPTIONS[option](model, before)

    return run


def part_train(z: Sizes, clock: Clock, models: dict, device: str, compiled: bool, paired: bool = False) -> dict:
    """The training steps, interleaved; eager, also Block keeping its sums (:data:`SUMS_KEPT`)
    and, with ``paired``, the standard model and Block with each option of :data:`PAIRED` -
    the targets' steps measured before any other's first run (:func:`eager_rows`)."""
    ids = torch.randint(0, z.vocab, (z.batch, z.seq), device=device)
    steps = train_steps(models, ids, device, compiled)
    forwards = {k: forward_of(m, ids, device) for k, m in models.items()}
    if not compiled and "block" in models:
        steps[SUMS_KEPT] = sums_kept(steps["block"], models["block"])
        forwards[SUMS_KEPT] = sums_kept(forwards["block"], models["block"])
    if not compiled and paired:
        for option, (_, variants) in PAIRED.items():
            for variant, name in variants.items():
                steps[variant] = with_option(steps[name], models[name], option)
                forwards[variant] = with_option(forwards[name], models[name], option)
        if "block" in models:
            steps[SUMS_BF16] = with_option(steps["block"], models["block"], "autocast_phase1_sums")
            forwards[SUMS_BF16] = with_option(forwards["block"], models["block"], "autocast_phase1_sums")
    if not compiled:
        return eager_rows(z, clock, models, device, steps, forwards)
    return compiled_rows(z, clock, models, device, steps)


def compiled_rows(z: Sizes, clock: Clock, models: dict, device: str, steps: dict) -> dict:
    """The compiled part's rows: the targets' steps (:func:`targets_first`) compiled
    (:func:`compile_within`), timed and profiled before Full's compile, then Full's, timed
    beside the standard model again (:func:`timed_beside`). Full's compile or timing that
    loses the device ends the part with the targets' rows, the failure recorded, so that such
    a fault loses neither the minutes of the targets' compiles nor the training target's
    compiled ratio."""
    errors: dict = {}
    result = {"errors": errors, "compile_s": {}, "dropped": {}, "warm_up_s": 0.0, "ms": {}, "profile": {}}
    seconds: dict[str, float] = {}
    targets, others = targets_first(steps, lambda name: name)
    try:
        for group in (targets, others):
            start = time.perf_counter()
            # (each model's first step compiles it: minutes, so each within the deadline)
            group, compile_s, dropped = compile_within(group, clock, errors, result["compile_s"])
            result["compile_s"].update(compile_s)
            result["dropped"].update(dropped)
            zero_grads(models)
            result["warm_up_s"] += time.perf_counter() - start
            seconds.update(timed_rounds(clock, errors, group, lambda: timed_beside(
                clock, group, targets, seconds, lambda name: "standard", z.repeats)))
            result["ms"] = {k: t * 1e3 for k, t in seconds.items()}
            clock.measured(result)  # (the timings, before the profile's steps: a kill there keeps them)
            # (where a compiled step's device time goes: one more step each, already compiled)
            result["profile"].update(kept_unless_lost(clock, errors, "profile", lambda: {
                name: profiled(group[name], device, PROFILE_TOP) for name in PROFILED if name in group}) or {})
            clock.measured(result)
    except DeviceLost:  # (recorded: the rows measured stand; the parts after run in a fresh process)
        pass
    return result


def zero_grads(models: dict) -> None:
    """(a step that failed in its backward left the gradients it had made: none is added to)"""
    for model in models.values():
        model.zero_grad(set_to_none=True)


def eager_rows(z: Sizes, clock: Clock, models: dict, device: str, steps: dict, forwards: dict) -> dict:
    """The eager part's rows: the targets' steps (:func:`targets_first`) run once, timed and
    their memory measured before any other step's first run, then the others', each timed
    beside the standard model again (:func:`timed_beside`). A step that loses the device - an
    option's at its first run or in its rounds (:func:`timed_rounds`), a step's memory
    (:func:`each`) - ends the part with the rows measured before, the failure recorded."""
    errors: dict = {}
    result = {"errors": errors, "warm_up_s": 0.0, "ms": {}, "peak_memory_MiB": {}, "kept_MiB": {}}
    seconds: dict[str, float] = {}
    targets, others = targets_first(steps, lambda name: name)
    try:
        for group in (targets, others):
            start = time.perf_counter()
            group = runnable(clock, errors, group)
            zero_grads(models)
            result["warm_up_s"] += time.perf_counter() - start
            seconds.update(timed_rounds(clock, errors, group, lambda: timed_beside(
                clock, group, targets, seconds, lambda name: "standard", z.repeats)))
            result["ms"] = {k: t * 1e3 for k, t in seconds.items()}
            each(clock, errors, "peak_memory", lambda s: peak_memory(s, device) / 2**20, group,
                 result["peak_memory_MiB"])
            # (what autograd keeps from the forward, apart from the backward's transients: the
            # CPU forecast's quantity, to tell which of the two the GPU's peak ratio comes from)
            each(clock, errors, "kept", lambda f: kept_bytes(f, device) / 2**20, {k: forwards[k] for k in group},
                 result["kept_MiB"])
            clock.measured(result)
    except DeviceLost:  # (recorded: the rows measured stand; the parts after run in a fresh process)
        pass
    return result


#: The models whose steps the targets are judged on (:data:`TARGETS`): each part that also
#: times other steps - Full AttnRes, the options', Phase 1 in one kernel - runs theirs first.
TARGET_MODELS = ("standard", "block")


def targets_first(steps: dict, model_of) -> tuple[dict, dict]:
    """``steps`` as ``(the targets' steps, the others)``: ``model_of(name)`` of a target's is
    in :data:`TARGET_MODELS`. The targets' are run, timed and measured first: a step no GPU
    has run - an option's, Phase 1 in one kernel, a graph's capture - that loses the device
    at its first run (a sticky fault: nothing can run after it) cannot lose their rows."""
    targets = {k: step for k, step in steps.items() if model_of(k) in TARGET_MODELS}
    return targets, {k: step for k, step in steps.items() if k not in targets}


def timed_beside(clock: Clock, steps: dict, references: dict, reference_s: dict[str, float], reference_of,
                 repeats: int) -> dict[str, float]:
    """Median seconds per step of ``steps`` (:meth:`Clock.interleaved`), each in the same
    rounds as its reference - ``references[reference_of(name)]``, timed before in rounds of
    its own at ``reference_s`` seconds - and scaled by ``reference_s / its time in these
    rounds``: a step's ratio to its reference is that of their shared rounds (the device's
    drift between the two timings cancels, as interleaving is for), its row in the units of
    the reference's. The summary's ratios by name hold as before. A step whose reference was
    not timed (failed) is timed as it is; without ``reference_s``, the steps alone."""
    names = {reference_of(k) for k in steps} & set(reference_s)
    rounds = clock.interleaved({**{r: references[r] for r in names}, **steps}, repeats)
    scale = {r: reference_s[r] / rounds[r] for r in names if rounds[r] > 0}
    return {k: rounds[k] * scale.get(reference_of(k), 1.0) for k in steps}


def timed_rounds(clock: Clock, errors: dict, steps: dict, timing, prefix: str = "") -> dict[str, float]:
    """``timing()`` - the timing rounds of ``steps`` - or, where it fails (a step failing after
    its first run), no rows, the failure recorded as ``errors[prefix + "timing " + the steps]``;
    :class:`DeviceLost` where it left the device unusable (:func:`kept_unless_lost`): the part
    keeps the rows measured before - the targets' where an option's step lost the device in
    its rounds, decode's earlier batches - rather than failing."""
    return kept_unless_lost(clock, errors, f"{prefix}timing {', '.join(steps)}", timing) or {}


def each(clock: Clock, errors: dict, piece: str, fn, items: dict, into: dict) -> None:
    """``into[name] = fn(item)`` over ``items`` in order, each an :func:`attempt` of its own (a
    failure recorded as ``errors[piece + " " + name]``, its row left out): a diagnostic
    step's failure - Full's or an option's memory, out of memory - keeps the standard
    model's and Block's rows, the memory target's (one attempt over all of them would lose
    every row). A failure that left the device unusable raises :class:`DeviceLost`
    (:func:`kept_unless_lost`), the rows before it in ``into``, so that the next step's first
    run, on the dead device, is not recorded as that step's fault."""
    failed = False
    for name, item in items.items():
        value = kept_unless_lost(clock, errors, f"{piece} {name}", lambda item=item: fn(item))
        if value is None:
            failed = True
        else:
            into[name] = value
    if failed:  # (the failures' tracebacks held their tensors: an out-of-memory step's)
        release_memory("cuda" if clock.cuda else "cpu")


#: Seconds to compile one model's training step (inductor, a cold cache: the H200 took 208 s
#: for three) - what the compiled part assumes for a model before it has timed one - and the
#: seconds it keeps for timing and profiling the compiled steps after the compiles.
COMPILE_S = 70
COMPILED_TIMING_S = 20
#: A compile after the first is assumed to take this many times the slowest so far (but
#: Block's after the standard model's: :func:`compile_within`).
COMPILE_MARGIN = 1.2


def compile_within(steps: dict, clock: Clock, errors: dict, compiled_s: dict[str, float] | None = None,
                   ) -> tuple[dict, dict[str, float], dict[str, str]]:
    """Run each compiled step once (this compiles it), in order, while the time to the
    deadline still fits one more compile (:data:`COMPILE_S`, or 1.2 times the slowest so far,
    ``compiled_s`` - the compile seconds of the models compiled before - among them) and the
    timing after it (:data:`COMPILED_TIMING_S`):
    ``(the compiled steps, {model: compile seconds}, {model dropped: why})``. The standard
    model comes first and Block second: a run short of time drops Full AttnRes, which has
    no target, and says so, rather than being cut off by the command's time limit. A model
    whose compile raises is left out, recorded in ``errors``; one that loses the device
    raises :class:`DeviceLost` (:func:`runnable`).

    Block, after the standard model has compiled, needs only the standard model's compile
    time and the timing, without the margin: dropped there, the standard model's compile
    would have been spent for a ratio-less row, while a compile overrunning the budget by its
    margin stays within the command's limit (the budget leaves 40 s of it) and the rows
    measured before are filed as measured (:meth:`Clock.measured`)."""
    kept, seconds, dropped = {}, {}, {}
    for name, step in steps.items():
        done = (*(compiled_s or {}), *seconds)
        margin = 1.0 if name in TARGET_MODELS and any(m in TARGET_MODELS for m in done) else COMPILE_MARGIN
        slowest = [margin * t for t in (*(compiled_s or {}).values(), *seconds.values())]
        need = max([COMPILE_S, *slowest]) + COMPILED_TIMING_S
        left = clock.left()
        if left < need:
            dropped[name] = (f"{left:.0f} s to the deadline, a compile and the timing after it take about {need:.0f} s: "
                             "not compiled")
            log(f"[gpu_check]   {name}: {dropped[name]}")
            continue
        start = time.perf_counter()
        if not runnable(clock, errors, {name: step}):
            continue
        seconds[name] = time.perf_counter() - start
        log(f"[gpu_check]   {name} compiled in {seconds[name]:.0f} s")
        kept[name] = step
    return kept, seconds, dropped


def part_train_bf16(z: Sizes, clock: Clock, models: dict, device: str) -> dict:
    """The eager step with a bf16 residual stream: every model's parameters in bf16 (what
    FSDP2's ``param_dtype=torch.bfloat16`` computes with, its float32 master weights aside),
    so that the stream, the sources of depth attention and their gradients are stored in
    bf16 - half the bytes Block AttnRes adds with a float32 stream. On the CPU (the smoke)
    float32 stays."""
    with weights_in(models, torch.bfloat16 if device == "cuda" else torch.float32):
        return part_train(z, clock, models, device, compiled=False)


#: The models whose training step is profiled (eager: the profile part; compiled: the
#: compiled part, after timing), and the operations listed for each (for each model's decode
#: step too: the decode profile part).
PROFILED = ("standard", "block")
PROFILE_TOP = 12


def part_profile(z: Sizes, models: dict, device: str) -> dict:
    """Where a training step's device time goes: one eager step of the standard model and of
    Block AttnRes under ``torch.profiler`` (after a warm-up step), the operations with the
    most self device time (self CPU time on the CPU), in ms."""
    ids = torch.randint(0, z.vocab, (z.batch, z.seq), device=device)
    steps = train_steps({k: models[k] for k in PROFILED}, ids, device)
    result = {}
    for name, step in steps.items():
        step()
        result[name] = profiled(step, device, PROFILE_TOP)
        log(f"[gpu_check]   profile {name}: {result[name]['total_ms']:.1f} ms self time")
    return result


def profiled(fn, device: str, top: int) -> dict:
    """``fn()`` once under ``torch.profiler``: the self device time of all it ran (self CPU
    time on the CPU) in ms, the ``top`` operations by it, and the device kernels (and copies)
    it launched (``None`` on the CPU)."""
    cuda = device == "cuda"
    attribute = "self_device_time_total" if cuda else "self_cpu_time_total"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    # (no default for the attribute: a name this torch lacks fails the piece rather than reading 0)
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attribute), reverse=True)
    total = sum(getattr(e, attribute) for e in events)
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) if cuda else None
    return {"total_ms": total / 1e3, "kernels": kernels,
            "top": [{"op": e.key[:80], "ms": getattr(e, attribute) / 1e3, "calls": e.count} for e in events[:top]]}


@contextmanager
def weights_in(models: dict, dtype: torch.dtype) -> Iterator[None]:
    """The models' weights in ``dtype`` for the block, then back in float32 for the other
    parts."""
    for model in models.values():
        model.to(dtype)
    try:
        yield
    finally:
        for model in models.values():
            try:
                model.float()
            except Exception:  # noqa: BLE001 - raised again unless the device is lost
                if device_usable(next(model.parameters()).device.type):
                    raise
                # (lost within the block - decode's batch 8 - the models are of no more use in this
                # process: the part keeps its rows, the parts after it run in a fresh one)
                break


def loaded_cache(model, batch: int, z: Sizes, device: str, dtype: torch.dtype) -> KVCache:
    """A dynamic cache holding a ``z.seq``-token context (random keys and values) for
    ``model`` at ``batch``."""
    cfg = model.config
    cache = KVCache(cfg.n_layers, capacity=z.seq + 1)
    shape = (batch, cfg.kv_heads, z.seq, cfg.head_dim)
    for layer in range(cfg.n_layers):
        cache.update(layer, torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype))
    return cache


def loaded_caches(model, batch: int, z: Sizes, device: str, dtype: torch.dtype, mode: str) -> tuple[KVCache, StaticDecoder]:
    """:func:`loaded_cache`, and a :class:`StaticDecoder` in ``mode`` loaded with it."""
    cache = loaded_cache(model, batch, z, device, dtype)
    decoder = StaticDecoder(model, batch, capacity=z.seq + 1, mode=mode)
    decoder.load(cache)
    return cache, decoder


def lazily(make, run):
    """A step that makes what it runs on its first call, ``made = make()``, then runs
    ``run(made)`` at each call: what it is made of - a cache, a captured graph - fails as
    the step does (:func:`runnable`)."""
    made = []

    def step():
        if not made:
            made.append(make())
        run(made[0])

    return step


def decode_steps(model, batch: int, z: Sizes, device: str, dtype: torch.dtype, mode: str, tokens) -> dict:
    """``model``'s decode step of ``tokens`` after a ``z.seq``-token context: ``eager`` (the
    dynamic cache) and ``graphed`` (a :class:`StaticDecoder` in ``mode``), each making its
    cache on its first call (:func:`lazily`)."""
    def eager(cache):
        decode_step(model, cache, tokens)
        cache.crop(z.seq)

    def graphed(decoder):
        decoder.step(tokens)
        decoder.rewind(z.seq)

    return {"eager": lazily(lambda: loaded_cache(model, batch, z, device, dtype), eager),
            "graphed": lazily(lambda: loaded_caches(model, batch, z, device, dtype, mode)[1], graphed)}


def one_kernel_step(model, batch: int, z: Sizes, device: str, dtype: torch.dtype, mode: str, tokens):
    """Block's graphed step of :func:`decode_steps` with Phase 1's forward in one kernel
    (:data:`ONE_KERNEL`): captured so (eager, each step so)."""
    def make():
        with phase1_in_one_kernel():
            return loaded_caches(model, batch, z, device, dtype, mode)[1]

    def run(decoder):
        with phase1_in_one_kernel():
            decoder.step(tokens)
        decoder.rewind(z.seq)

    return lazily(make, run)


#: The graphed decode step's extra variant: Block AttnRes with Phase 1's forward in one
#: kernel, as before it ran split over the sources at a few rows (``phase1_split=False``).
ONE_KERNEL = "block (phase 1 in one kernel)"


#: The decode part's batch sizes.
DECODE_BATCHES = (1, 8)


def part_decode(z: Sizes, clock: Clock, models: dict, device: str) -> dict:
    """One decode step after a ``z.seq``-token context (random keys and values) at batch 1
    and 8: ``eager`` (the dynamic cache, as ``attnres generate`` decodes on CPU) and
    ``graphed`` (``StaticDecoder``: the static cache's step captured in a CUDA graph; on
    CPU the same static step, eagerly); Block's graphed step also with Phase 1 in one
    kernel (:data:`ONE_KERNEL`). Every batch's targets' steps are measured before any other
    step's first run (:func:`decode_batch`), so that a sticky fault of batch 1's Full or
    one-kernel step cannot lose batch 8's targets' rows. A step that loses the device (a
    graph's capture) ends the part: the rows measured before it are returned, the failure
    among the ``errors`` (the parts after it run in a fresh process)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    static_mode = "graph" if device == "cuda" else "eager"
    result, errors, seconds = {}, {}, {batch: {} for batch in DECODE_BATCHES}
    tokens = {batch: torch.randint(0, z.vocab, (batch,), device=device) for batch in DECODE_BATCHES}
    with weights_in(models, dtype):
        for first in (True, False):  # (the targets' steps of every batch, then the other steps)
            lost = False
            for batch in DECODE_BATCHES:
                steps = {f"{name}|{mode}": step for name, model in models.items() for mode, step in
                         decode_steps(model, batch, z, device, dtype, static_mode, tokens[batch]).items()}
                if "block" in models:  # (the split Phase-1 forward's effect: Block's step without it)
                    steps[f"{ONE_KERNEL}|graphed"] = one_kernel_step(models["block"], batch, z, device, dtype,
                                                                     static_mode, tokens[batch])
                lost = decode_batch(clock, errors, steps, f"b{batch} ", z.repeats, seconds[batch], first)
                for key, t in seconds[batch].items():
                    name, mode = key.split("|")
                    result.setdefault(f"b{batch}", {}).setdefault(mode, {})[name] = t * 1e3
                del steps  # (and with them the caches and graphs, before the next batch's)
                if lost:
                    break
                clock.measured({**result, "errors": errors})
            if lost:
                break
    result["errors"] = errors
    return result


def decode_batch(clock: Clock, errors: dict, steps: dict, prefix: str, repeats: int, seconds: dict[str, float],
                 targets_only: bool) -> bool:
    """Into ``seconds``, the seconds per step of one batch's decode ``steps`` (``name|mode``):
    with ``targets_only`` the targets' (:func:`targets_first`), else the others', each timed
    beside the standard model's step of its mode (:func:`timed_beside`, its time in
    ``seconds``); and whether a step lost the device. Each step's cache is made, its graph
    captured, at its first run: one that fails is recorded, the others timed; one that loses
    the device, there or in the timing rounds (:func:`timed_rounds`), ends the part with the
    rows measured before it (:class:`DeviceLost`)."""
    targets, others = targets_first(steps, lambda key: key.split("|")[0])
    group = targets if targets_only else others
    try:
        group = runnable(clock, errors, group, prefix=prefix)
        seconds.update(timed_rounds(clock, errors, group, lambda: timed_beside(
            clock, group, targets, seconds, lambda key: "standard|" + key.split("|")[1], repeats), prefix))
    except DeviceLost:
        return True
    return False


def part_profile_decode(z: Sizes, models: dict, device: str) -> dict:
    """What a graphed decode step replays, per model at batch 1: the kernels of one eager
    static step (the very launches its CUDA graph records) under ``torch.profiler`` - how
    many, their device time, the operations with the most. At one token a step is a chain of
    small kernels, so the count is most of a graphed step's time; the residual's share is
    the difference between the models. On the CPU (the smoke) the kernels are not counted."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    result = {}
    with weights_in(models, dtype):
        tokens = torch.randint(0, z.vocab, (1,), device=device)
        for name, model in models.items():
            _, decoder = loaded_caches(model, 1, z, device, dtype, "eager")
            decoder.step(tokens)  # (warm)
            decoder.rewind(z.seq)
            result[name] = profiled(lambda decoder=decoder: decoder.step(tokens), device, PROFILE_TOP)
            log(f"[gpu_check]   decode profile {name}: {result[name]['kernels']} kernels, "
                f"{result[name]['total_ms']:.2f} ms self time")
    return result


# ---------------------------------------------------------------------------------- summary
def ratios(times: dict, name: str) -> float | None:
    return ratio_of(times, name, "standard")


def ratio_of(values: dict, name: str, against: str) -> float | None:
    """``values[name] / values[against]``, or ``None`` where either is missing."""
    return values[name] / values[against] if name in values and against in values else None


def summarize(result: dict) -> dict:
    """The ratios to the standard model by name (Block; Full under ``full``), with targets."""
    def by_variant(name: str) -> dict:
        out = {}
        if "train_eager" in result:
            out["train_eager"] = ratios(result["train_eager"]["ms"], name)
            out["memory"] = ratios(result["train_eager"].get("peak_memory_MiB", {}), name)
        if "train_compiled" in result:
            out["train_compiled"] = ratios(result["train_compiled"]["ms"], name)
        for batch in DECODE_BATCHES:
            modes = result.get("decode", {}).get(f"b{batch}", {})
            if "graphed" in modes:
                out[f"decode_b{batch}"] = ratios(modes["graphed"], name)
            if "eager" in modes:
                out[f"decode_eager_b{batch}"] = ratios(modes["eager"], name)
        return out

    summary = {"device": result["device"], **by_variant("block"), "full": by_variant("full"), "targets": TARGETS}
    if "running" in result:  # (the files of a run killed by its time limit: the part it was in)
        summary["running"] = result["running"]
    if result.get("forced"):  # (a run with --force: every part ran with these launch settings)
        summary["forced"] = result["forced"]
    if "train_bf16" in result:
        bf16 = result["train_bf16"]
        summary["bf16_stream"] = {name: {"train_eager": ratios(bf16["ms"], name),
                                         "memory": ratios(bf16.get("peak_memory_MiB", {}), name)}
                                  for name in bf16["ms"] if name != "standard"}
    one_kernel = {f"decode_b{b}": ratios(result["decode"][f"b{b}"]["graphed"], ONE_KERNEL) for b in DECODE_BATCHES
                  if ONE_KERNEL in result.get("decode", {}).get(f"b{b}", {}).get("graphed", {})}
    if one_kernel:
        summary["block_phase1_one_kernel"] = one_kernel
    if SUMS_KEPT in result.get("train_eager", {}).get("ms", {}):
        summary["block_sums_kept"] = {k: v for k, v in by_variant(SUMS_KEPT).items() if v is not None}
    if SUMS_BF16 in result.get("train_eager", {}).get("ms", {}):
        eager_ms = result["train_eager"]["ms"]
        summary["block_bf16_sums"] = {**{k: v for k, v in by_variant(SUMS_BF16).items() if v is not None},
                                      "block_vs_default": ratio_of(eager_ms, SUMS_BF16, "block")}
    eager = result.get("train_eager", {})
    for key, variants in PAIRED.values():  # (Block against the standard model, both with the option)
        if set(variants) <= set(eager.get("ms", {})):
            standard, block = variants
            summary[key] = {
                "train_eager": eager["ms"][block] / eager["ms"][standard],
                "memory": ratio_of(eager.get("peak_memory_MiB", {}), block, standard),
                "standard_vs_default": ratio_of(eager["ms"], standard, "standard"),
                "block_vs_default": ratio_of(eager["ms"], block, "block"),
                # (Block with the option against the standard model without it: the option as
                # a way for Block to the target)
                "block_vs_standard_default": ratio_of(eager["ms"], block, "standard")}
    summary["met"] = {k: summary[k] is not None and summary[k] <= v for k, v in TARGETS.items() if k in summary}
    if "ops" in result:
        ops = result["ops"]
        summary["ops"] = {k: v["x_bound"] for k, v in ops["ops"].items()}
        summary["ops_autocast"] = {k: v["x_bound"] for k, v in ops.get("autocast", {}).items()}
        # (every op measured: a row that failed is no row within the bound)
        summary["met"]["ops_within_2x_bound"] = set(summary["ops"]) >= set(op_bytes(SMOKE)) and all(
            v <= OP_BOUND_TARGET for v in summary["ops"].values())
        host = ops.get("host_us")
        if host:
            summary["host_ratio"] = host["ours"] / host["standard"]
            summary["met"]["host"] = summary["host_ratio"] <= HOST_TARGET
        ours = ops["block"].get("ours (triton)")
        others = {k: v for k, v in ops["block"].items() if k != "ours (triton)"}
        if ours and others:
            summary["met"]["faster_than_peers"] = all(ours["fwd+bwd_us"] < v["fwd+bwd_us"] for v in others.values())
    if "parity" in result:
        models = {k: v for k, v in result["parity"].items() if not k.startswith("ops")}
        summary["parity"] = {k: max(v["logits"], v["worst_grad"]) for k, v in models.items()}
        summary["met"]["parity"] = all(v["ok"] for v in models.values())
        for key, tolerance in OP_PARITY_TOLERANCES.items():
            summary["parity"][key] = result["parity"].get(key)
            summary["met"]["parity"] &= all(v <= tolerance for v in (result["parity"].get(key) or {}).values())
    for key, compiled in (("device_busy", False), ("device_busy_compiled", True)):
        busy = device_busy(result, compiled)
        if busy:
            summary[key] = busy
    kernels = {k: v["kernels"] for k, v in result.get("profile_decode", {}).items() if v["kernels"] is not None}
    if kernels:
        summary["decode_kernels"] = kernels
    summary["skipped"] = result.get("skipped", {})
    summary["errors"] = sorted(result.get("errors", {}))
    summary["software"] = {k: result.get(k) for k in ("python", "torch", "cuda", "triton")}
    summary["code"] = result.get("code")
    return summary


def device_busy(result: dict, compiled: bool = False) -> dict:
    """Per profiled model, its device self time over its eager (``compiled``: compiled)
    step's time: near 1 the step is bound by the device; below it the device waited for the
    host (launch overhead) that long. Empty without the profile and the step's time, or on
    the CPU."""
    part = result.get("train_compiled" if compiled else "train_eager", {})
    profiles = part.get("profile", {}) if compiled else result.get("profile", {})
    if result.get("device", "").startswith("CPU"):
        return {}
    return {name: prof["total_ms"] / part["ms"][name] for name, prof in profiles.items() if name in part.get("ms", {})}


def render_profile(profiles: dict, busy: dict, steps_ms: dict, mode: str) -> list[str]:
    """The profiled steps' tables: per model its self time in all (and its share of the
    ``mode`` step's time, ``busy``) and the operations with the most."""
    lines = []
    for name, prof in profiles.items():
        share = (f" - {busy[name]:.0%} of its {mode} step's {steps_ms[name]:.1f} ms (the rest: the device waiting "
                 "for the host)" if name in busy else "")
        lines += [f"**{name}**: {prof['total_ms']:.1f} ms in all{share}", "", "| op | ms | calls |", "|---|---:|---:|"]
        lines += [f"| `{e['op']}` | {e['ms']:.2f} | {e['calls']} |" for e in prof["top"]]
        lines.append("")
    return lines


def fmt_ratio(values: dict, name: str) -> str:
    """``values[name]`` over the standard model's, for a table (``-`` without it)."""
    ratio = ratios(values, name)
    return "-" if ratio is None else f"{ratio:.3f}"


def render_header(result: dict) -> list[str]:
    """The tables' head: the card, the command, the versions, the code, the time."""
    code = result.get("code") or {}
    commit = (f"commit {code['commit'][:12]}{' with changes' if code.get('dirty') else ''}, " if code.get("commit")
              else "")
    lines = [f"# GPU check on {result['device']}", "", f"Command: `{result['command']}`  ",
             f"torch {result['torch']}, triton {result['triton']}; {result.get('elapsed_s', 0):.0f} s; "
             f"device-to-device copy {result.get('copy_GBps', 0):.0f} GB/s (read + written).  ",
             f"Code: {commit}sources {code.get('source_digest', '?')} (`gpu_check.py --source-digest`).", ""]
    if "running" in result:
        lines += [f"**Still running {result['running']['part']}** (since {result['running']['since_s']:.0f} s): a "
                  "run killed by its time limit stopped there.", ""]
    lines += [f"Continued by another process (`--continue`): {parts}.  " for parts in result.get("continued", [])]
    lines += [""] if result.get("continued") else []
    return lines


def render_ops(ops: dict) -> list[str]:
    """The ops part's tables: each op against its bound, the host time, one block."""
    lines = [f"## Ops at M={ops['shape']['tokens']} d={ops['shape']['d']} n={ops['shape']['n']} "
             f"S={ops['shape']['S']} (graph replay; bound at {ops['peak_GBps']:.0f} GB/s)", "",
             "| op | µs | bound µs | x bound |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {v['us']:.1f} | {v['bound_us']:.1f} | {v['x_bound']:.2f} |" for k, v in ops["ops"].items()]
    lines += [f"| {k} (training step's layout) | {v['us']:.1f} | {v['bound_us']:.1f} | {v['x_bound']:.2f} |"
              for k, v in ops.get("autocast", {}).items()]
    h = ops.get("host_us")
    if h:
        lines += ["", f"Host time per call at one token: merge fwd+bwd {h['ours']:.1f} µs, standard add + RMSNorm "
                  f"fwd+bwd {h['standard']:.1f} µs ({h['ours'] / h['standard']:.2f}x)"
                  + (f"; forward only {h['ours_forward']:.1f} against {h['standard_forward']:.1f} µs"
                     if "ours_forward" in h else "")
                  + (f"; of ours, {h['triton_launch']:.1f} µs inside Triton's launcher" if "triton_launch" in h else "")
                  + ("; ours with its kernels' launches stubbed (the CPU's estimate of the GPU path's host work)"
                     if h.get("kernels") == "stubbed" else "")
                  + "."]
    lines += ["", "One Block AttnRes block (the S normalised sublayer inputs), events, host included:", "",
              "| implementation | fwd µs | fwd+bwd µs |", "|---|---:|---:|"]
    lines += [f"| {k} | {v['fwd_us']:.0f} | {v['fwd+bwd_us']:.0f} |" for k, v in ops["block"].items()]
    lines += [f"| {k} | - | {why} |" for k, why in ops["unsupported"].items()]
    return lines


def render(result: dict) -> str:
    lines = render_header(result)
    if "parity" in result:
        lines += ["## Parity: Triton kernels vs the torch backend, float32 (ok: within "
                  f"{PARITY_NOISE_FACTOR}x the reference backend's difference from it, the noise)", "",
                  "| model | logits rel. err. (noise) | all gradients rel. err. (noise) | worst parameter's (floored) "
                  "| ok |", "|---|---:|---:|---|---|"]
        lines += [f"| {k} | {v['logits']:.2e} ({v.get('noise', {}).get('logits', float('nan')):.1e}) | {v['grads']:.2e} "
                  f"({v.get('noise', {}).get('grads', float('nan')):.1e}) | {v['worst_grad']:.2e} "
                  f"({v['worst_grad_param']}) | {v['ok']} |"
                  for k, v in result["parity"].items() if not k.startswith("ops")]
        for key, tolerance in OP_PARITY_TOLERANCES.items():
            ops = result["parity"].get(key, {})
            lines += ["", f"Each operation alone in {OP_LAYOUTS[key]}, against the PyTorch implementation in float64 "
                      f"(worst relative error of its outputs; ok at most {tolerance:g}): "
                      + ", ".join(f"{k} {v:.1e}" for k, v in ops.items())]
        lines.append("")
    if "ops" in result:
        lines += render_ops(result["ops"])
    if "sweep" in result:
        sweep = result["sweep"]  # (against the default timed in the sweep, else the ops part's)
        default = {**result.get("ops", {}).get("ops", {}),
                   **{k.split("@")[0]: v for k, v in sweep.items() if k.endswith("@default")}}
        lines += ["", "## The ops at other launch settings (`--force SETTING=VALUE` runs a part so)", "",
                  "| op at setting | µs | x bound | x the default's time |", "|---|---:|---:|---:|"]
        for key, v in sweep.items():
            name = key.split("@")[0]
            against = f"{v['us'] / default[name]['us']:.2f}" if name in default else "-"
            lines.append(f"| {key} | {v['us']:.1f} | {v['x_bound']:.2f} | {against} |")
    for part in ("train_eager", "train_compiled", "train_bf16"):
        if part in result:
            ms = result[part]["ms"]
            lines += ["", f"## {part} (warm-up {result[part]['warm_up_s']:.0f} s)", "", "| model | ms | ratio |",
                      "|---|---:|---:|"]
            lines += [f"| {k} | {v:.2f} | {fmt_ratio(ms, k)} |" for k, v in ms.items()]
            if "peak_memory_MiB" in result[part]:
                mem = result[part]["peak_memory_MiB"]
                lines += ["", "| model | peak step memory MiB | ratio |", "|---|---:|---:|"]
                lines += [f"| {k} | {v:.0f} | {fmt_ratio(mem, k)} |" for k, v in mem.items()]
            if "kept_MiB" in result[part]:
                saved = result[part]["kept_MiB"]
                lines += ["", "Kept by the forward for the backward (MiB, ratio): " + ", ".join(
                    f"{k} {v:.0f} ({fmt_ratio(saved, k)})" for k, v in saved.items())]
            if "profile" in result[part]:
                lines += ["", "Where a compiled step's time goes (one step, self time, ms):", ""]
                lines += render_profile(result[part]["profile"], device_busy(result, compiled=True), ms, "compiled")
    if "decode" in result:
        lines += ["", "## decode step (ms)", "", "| batch | mode | model | ms | ratio |", "|---|---|---|---:|---:|"]
        for batch, modes in result["decode"].items():
            for mode, times in modes.items():
                lines += [f"| {batch} | {mode} | {k} | {v:.3f} | {fmt_ratio(times, k)} |" for k, v in times.items()]
    if "profile" in result:
        lines += ["", "## Where a training step's time goes (one eager step, self time, ms)", ""]
        lines += render_profile(result["profile"], device_busy(result), result.get("train_eager", {}).get("ms", {}),
                                "eager")
    if "profile_decode" in result:
        prof = result["profile_decode"]
        lines += ["", "## What a graphed decode step replays (batch 1: the kernels of one eager static step, self time, ms)",
                  "", "| model | kernels | ms | ratio |", "|---|---:|---:|---:|"]
        lines += [f"| {k} | {'-' if v['kernels'] is None else v['kernels']} | {v['total_ms']:.3f} | "
                  f"{fmt_ratio({n: p['total_ms'] for n, p in prof.items()}, k)} |" for k, v in prof.items()]
        for name, v in prof.items():
            lines += ["", f"**{name}**:", "", "| op | ms | calls |", "|---|---:|---:|"]
            lines += [f"| `{e['op']}` | {e['ms']:.3f} | {e['calls']} |" for e in v["top"]]
        lines.append("")
    for part, why in result.get("skipped", {}).items():
        lines.append(f"\nSkipped **{part}**: {why}")
    for part, trace in result.get("errors", {}).items():
        lines += ["", f"**{part} failed**:", "", "```", trace.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def write(out: Path, result: dict, strict: bool = False) -> str:
    """Write ``gpu_check.json`` (every number, first), ``summary.json`` and ``gpu_check.md``
    into ``out``, each whole or not at all (a run killed mid-write keeps the previous file);
    return the markdown. Where the summary or the tables cannot be made from a result (a
    part's result missing a key), the files say why and the run goes on - unless ``strict``
    (the smoke: the tests see it)."""
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomically(out / "gpu_check.json", json.dumps(result, indent=1, default=str))
    try:
        summary = summarize(result)
    except Exception as e:  # noqa: BLE001 - the raw results are written; the summary says what failed
        if strict:
            raise
        summary = {"device": result.get("device"), "summary_failed": "".join(traceback.format_exception(e))[-3000:],
                   "skipped": result.get("skipped", {}), "errors": sorted(result.get("errors", {}))}
    write_text_atomically(out / "summary.json", json.dumps(summary, indent=1, default=str))
    try:
        md = render(result)
    except Exception as e:  # noqa: BLE001 - as above
        if strict:
            raise
        md = (f"# GPU check on {result.get('device')}\n\nThe tables failed (gpu_check.json has every number):\n\n"
              f"```\n{''.join(traceback.format_exception(e))[-3000:]}```\n")
    write_text_atomically(out / "gpu_check.md", md)
    return md


# ------------------------------------------------------------------------------ provenance
def source_files(root: Path) -> list[Path]:
    """The files whose contents say which code a run measured: the package's sources and
    the benchmarks (this check among them)."""
    package = root / "src" / "attnres"
    files = [*package.rglob("*.py"), *package.rglob("*.c"), *(root / "benchmarks").glob("*.py")]
    return sorted(f for f in files if "__pycache__" not in f.parts)


def source_digest(root: Path) -> str:
    """A digest of :func:`source_files` (paths and contents): the same on the GPU machine,
    which gets a copy of the working tree without ``.git``, as here for the same code -
    ``PYTHONPATH=src python benchmarks/gpu_check.py --source-digest`` in a checkout of a
    commit prints that commit's."""
    digest = hashlib.sha256()
    for f in source_files(root):
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def code_version(root: Path) -> dict:
    """Which code runs: :func:`source_digest`, and the git commit and whether the sources
    differ from it where ``root`` is a git checkout (``None`` where not: the machine's copy)."""
    code = {"source_digest": source_digest(root), "commit": None, "dirty": None}

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20,
                              check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() == root.resolve():  # (not an enclosing repository's)
            code["commit"] = git("rev-parse", "HEAD")
            code["dirty"] = bool(git("status", "--porcelain", "--", "src", "benchmarks"))
    except (OSError, subprocess.SubprocessError):
        pass  # (no git, or no repository: the digest says which code it was)
    return code


def software() -> dict:
    """The versions that run the check (Python, PyTorch, its CUDA, Triton)."""
    import triton

    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__}


def gpu_facts() -> dict:
    """The card: name, compute capability, memory, multiprocessors and the driver's version
    (``nvidia-smi``, where there is one); what cannot be read is said, not raised."""
    try:
        props = torch.cuda.get_device_properties(0)
        facts = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                 "memory_GiB": round(props.total_memory / 2**30, 1), "sms": props.multi_processor_count}
    except Exception as e:  # noqa: BLE001 - provenance never stops the run
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        facts["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        facts["driver"] = None
    return facts


# ---------------------------------------------------------------------------------- warm-up
def gpu_compute_mode() -> str | None:
    """The GPU's compute mode as ``nvidia-smi`` names it (``Default``, ``Exclusive_Process``,
    ``Prohibited``; where the machine has several GPUs, the first that is not ``Default``), or
    ``None`` where it cannot be read (no ``nvidia-smi``, a failing one, ``[N/A]``): in a mode other than
    ``Default`` the device takes one process at a time, and the warm-up's workers would
    take it from the main process or fail to get it."""
    try:
        query = ["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader"]
        done = subprocess.run(query, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    modes = [line.strip() for line in done.stdout.splitlines()
             if line.strip() and not line.strip().startswith("[")] if done.returncode == 0 else []
    return next((m for m in modes if m != "Default"), modes[0] if modes else None)


def warm_up_worker(what: str, z: Sizes, device: str = "cuda", options: list[str] = ()) -> int:
    """Compile into the on-disk caches: ``models:NAME:STAGE`` runs that model's residual at a
    few rows (:func:`warm_up_model`: the same kernel variants as the full shape), ``sweeps``
    the ops part's other launch settings and its operations in the training step's layout,
    ``ops`` what the parity and ops parts launch outside the models' steps
    (:func:`warm_up_ops`), a peer name its block at the op shape.
    (``device``: the tests run them on the CPU, the kernels stubbed or interpreted.)"""
    if what.startswith("models:"):
        _, name, stage = what.split(":")
        warm_up_model(name, stage, z, device, options)
        Clock(device).sync()
        return 0
    if what == "ops":
        warm_up_ops(z, device)
        Clock(device).sync()
        return 0
    if what == "sweeps":  # the ops part's other launch settings and layout, at a few rows
        warps = min(SWEEPS["merge_warps"][0])  # (the fewest warps the sweep runs the merges with)
        few = Sizes(**{**asdict(z), "tokens": warm_up_rows(device, z.d, z.tokens, warps)})
        calls = op_calls(few, device)
        for setting, value, names in sweep_settings(device):
            with forced(setting, value):
                for name in names:
                    calls[name]()
        for fn in autocast_op_calls(few, device).values():  # (and the ops in the training step's layout)
            fn()
        Clock(device).sync()
        return 0
    peers, _ = kernels_bench.select_peers()
    shape = kernels_bench.OpShape(z.tokens, z.d, z.n, z.S)
    for step in kernels_bench.block_steps(what, peers[what][0], kernels_bench.make_inputs(shape)).values():
        step()
    torch.cuda.synchronize()
    return 0


#: The warm-up's models' sublayers: a key/value head and a narrow MLP (the kernels'
#: specialisations do not depend on them).
SMALL_SUBLAYERS = {"n_kv_heads": 1, "mlp_hidden": 64}


def warm_up_ops(z: Sizes, device: str) -> None:
    """Launch what the parity and ops parts launch besides the models' training and decode
    steps, each specialisation once: the parity part's models (float32, no autocast: no
    model stage runs so) and its operations alone (float32 and bf16 storage, the training
    step's layout) at their sizes; the ops part's operations at their defaults (at a few
    rows, :func:`warm_up_rows`), its host time's merge at one token and Block AttnRes' block
    at the op shape."""
    # (with the models' stages' small sublayers, vocabulary and key/value width: the same
    # specialisations, 0.3 GB of weights instead of 2.1 beside the main process's models)
    small = replace(parity_model_sizes(z), vocab=256)
    ids = torch.randint(0, small.vocab, (small.batch, small.seq), device=device)
    for name in ("block", "full"):
        parity_model(small, name, "triton", ids, device, **SMALL_SUBLAYERS)
    for dtype in (torch.float32, torch.bfloat16):
        for fn in op_calls(parity_sizes(z), device, dtype).values():
            fn()
    for fn in autocast_op_calls(parity_sizes(z), device).values():
        fn()
    few = Sizes(**{**asdict(z), "tokens": warm_up_rows(device, z.d, z.tokens)})
    for fn in op_calls(few, device).values():
        fn()
    one_token_merge(device, "auto")[1]()
    shape = kernels_bench.OpShape(z.tokens, z.d, z.n, z.S)
    inputs = kernels_bench.make_inputs(shape, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    for step in kernels_bench.block_steps("ours (triton)", kernels_bench.ours_triton, inputs).values():
        step()


#: The warm-up's workers that compile kernels outside the models' steps (:func:`warm_up_worker`).
KERNEL_WORKERS = ("sweeps", "ops")
#: The warm-up's stages of a model, each a worker of its own: the float32-stream training
#: step (and Block's bf16 norm outputs), the bf16 model's prefill and decode steps, its
#: training step. Each stage's variants are compiled in parallel with the others' (on the
#: H200, one worker a model compiling all three stages was the warm-up's critical path).
WARM_UP_STAGES = ("train", "decode", "bf16")
#: The warm-up's workers for the models: a model that runs our kernels (the standard model
#: runs none) by stage.
WARMED_MODELS = tuple(f"models:{name}:{stage}" for name in VARIANTS if name != "standard" for stage in WARM_UP_STAGES)


def warm_up_rows(device: str, d: int, full_rows: int, warps: int | None = None) -> int:
    """Rows at which a warm-up launches the variants the parts launch at ``full_rows`` on this
    device (fewer: its workers' memory), the fewest that are: more than Phase 1's few-rows
    geometry takes (``FEW_ROWS``); two or more for each of the held merges' persistent
    programs (one row a program runs them unpipelined, ``STAGES`` = 1: decoding's variant);
    and the same specialisation as ``full_rows`` for every integer the kernels take that
    depends on the rows (Triton compiles a variant per integer that is 1, a multiple of 16,
    or neither: the rows, and the rows per program of Phase 1's backward). The held merges'
    programs are as many as the device's multiprocessors keep resident - on an H200 (132)
    264 at d = 2048 - so the 48 rows the warm-up once ran compiled only decoding's merges
    there (the tests' 2 saw no difference). ``warps``: the fewest the merges run with
    (default: at ``d``)."""
    from attnres.ops.depth_attention import triton_impl, triton_launch as tl

    sms = triton_impl._sms(torch.device(device))
    warps = warps or triton_impl.FORCED["merge_warps"] or tl.merge_warps(tl.row_pad(d))
    least = max(tl.FEW_ROWS + 1, 2 * tl.held_programs(1 << 30, sms, warps) + 1)

    def kind(n: int) -> str:
        return "1" if n == 1 else "16k" if n % 16 == 0 else "int"

    def kinds(rows: int) -> list[str]:
        found = [kind(rows)]
        for S, wide, block_d in ((S, wide, b) for S in range(1, tl.MAX_QUERIES + 1) for wide in (False, True)
                                 for b in (triton_impl.FORCED["block_d"], *SWEEPS["block_d"][0])):
            block_rows, block = tl.phase1_rows_geometry(d, S, wide, block_d)
            found.append(kind(tl.dq_grid(rows, d, block, sms, triton_impl.FORCED["programs"], block_rows)[2]))
            found.append(kind(tl.dq_grid(rows, d, tl.phase1_tile(d, S, block_d, wide), sms,
                                         triton_impl.FORCED["programs"])[2]))
        return found

    target = kinds(full_rows)
    return next((rows for rows in range(-(-least // 16) * 16, full_rows, 16) if kinds(rows) == target), full_rows)


def warm_up_model(name: str, stage: str, z: Sizes, device: str, options: list[str] = ()) -> None:
    """Run model ``name``'s residual at warm-up stage ``stage`` (:data:`WARM_UP_STAGES`) at a
    few rows (:func:`warm_up_rows`): the kernel variants the parts launch at the full shape. A variant depends on
    ``d``, the dtypes and the number of sources and queries, not on the sublayers' sizes, so
    the model has the parts' depth and width but a small vocabulary, MLP and key/value width
    (1.2 GB of float32 weights at d = 2048 instead of 7.0: six workers fit beside the main
    process's models on an H100). ``options``: :data:`MODEL_OPTIONS` the run switched on."""
    # (the decode stage at 48 rows: over a decoding step's few; the training steps at as many
    # as launch the full shape's variants on this device)
    small = Sizes(**{**asdict(z), "seq": 48 if stage == "decode" else warm_up_rows(device, z.d, z.seq * z.batch),
                     "batch": 1})
    config = replace(model_config(small, residual_of(name, small)), vocab_size=256, **SMALL_SUBLAYERS)
    torch.manual_seed(0)
    with torch.device(device):
        model = AttnResLM(config)
    apply_model_options({name: model}, options)
    ids = torch.randint(0, config.vocab_size, (1, small.seq), device=device)
    if stage == "train":
        step = train_steps({name: model}, ids, device)[name]
        step()
        for option, (_, variants) in PAIRED.items():  # (train_eager's variants with an option on)
            if name in variants.values():
                with_option(step, model, option)()
        if name == "block":
            with_option(step, model, "autocast_phase1_sums")()
    elif stage == "decode":
        model.to(torch.bfloat16)
        for batch in DECODE_BATCHES:  # (a launch over one row compiles apart from one over several)
            _, cache = prefill(model, ids.expand(batch, -1))
            decode_step(model, cache, ids[:, -1].expand(batch))
            with phase1_in_one_kernel():  # (the decode part's one-kernel variant)
                decode_step(model, cache, ids[:, -1].expand(batch))
    elif stage == "bf16":  # (train_bf16's variants)
        model.to(torch.bfloat16)
        train_steps({name: model}, ids, device)[name]()
    else:
        raise ValueError(f"warm-up stage {stage!r}: choose from {WARM_UP_STAGES}")


#: Which of the warm-up's workers compile what each part launches: the kernel workers
#: (:data:`KERNEL_WORKERS`), or a stage of the models (:data:`WARM_UP_STAGES`, each model's
#: worker of it). A run of some parts starts only theirs (with ``ops``, the peers' too): a
#: follow-up of one part, ``--parts train_compiled`` on a fresh machine, waited for all eight,
#: up to 35 % of its budget, and could skip the one part it was run for.
#: The parts that build their own inputs and models (the others run the check's three models).
MODEL_FREE_PARTS = ("parity", "ops", "sweep")
WARM_UP_OF_PART = {"parity": KERNEL_WORKERS, "ops": KERNEL_WORKERS, "sweep": KERNEL_WORKERS,
                   "train_eager": ("train",), "train_compiled": ("train",), "profile": ("train",),
                   "decode": ("decode",), "profile_decode": ("decode",), "train_bf16": ("bf16",)}


def warm_up_workers(parts: list[str], peers: dict) -> list[str]:
    """The warm-up's workers a run of ``parts`` starts (:data:`WARM_UP_OF_PART`), in the order
    of :data:`WARMED_MODELS`, :data:`KERNEL_WORKERS`, then ``peers``' names where ``ops`` runs."""
    wanted = {what for part in parts for what in WARM_UP_OF_PART[part]}
    models = [what for what in WARMED_MODELS if what.rsplit(":", 1)[1] in wanted]
    return [*models, *(what for what in KERNEL_WORKERS if what in wanted), *(peers if "ops" in parts else ())]


def start_warm_up(parts: list[str], peers: dict, force: list[str], options: list[str] = ()) -> dict[str, subprocess.Popen]:
    """The warm-up's workers for ``parts`` (:func:`warm_up_workers`), started: ``{what: process}``."""
    extra = [*(arg for setting in force for arg in ("--force", setting)), *option_flags(options)]
    # (no --out: a worker writes nothing, and --out's check refuses os.devnull as a file)
    return {what: subprocess.Popen([sys.executable, __file__, "--warm-up-worker", what, *extra],
                                   stdout=subprocess.DEVNULL) for what in warm_up_workers(parts, peers)}


#: The most of the budget the warm-up may take (from the run's start): the H200 took 78 s of
#: 385 with the kernels of then. Workers still compiling then are stopped; what they had not
#: compiled, the parts compile in their untimed first steps.
WARM_UP_SHARE = 0.35


def wait_for_warm_up(workers: dict, started: float, deadline: float) -> dict:
    """Wait for the warm-up's ``workers`` (:func:`start_warm_up`) until ``deadline``
    (``perf_counter`` seconds), then stop those still running: ``{"s": seconds since
    ``started``, "workers": {what: exit code, or why none}, "finished_s": {what: seconds}}``.
    A worker that failed is named in the log: its variants compile in the parts."""
    pending, codes, finished = dict(workers), {}, {}
    while pending and time.perf_counter() < deadline:
        for what, worker in list(pending.items()):
            if worker.poll() is not None:
                codes[what], finished[what] = worker.returncode, time.perf_counter() - started
                del pending[what]
        if pending:
            time.sleep(0.2)
    for what, worker in pending.items():
        stop_worker(worker)
        codes[what] = f"stopped at the warm-up's deadline ({deadline - started:.0f} s)"
    failed = {what: code for what, code in codes.items() if code != 0}
    if failed:
        log(f"[gpu_check] warm-up workers that did not finish (their kernels compile in the parts): {failed}")
    return {"s": time.perf_counter() - started, "workers": codes, "finished_s": finished}


def stop_worker(worker: subprocess.Popen) -> None:
    """Stop a warm-up worker (killed if it ignores the request for 10 s); one that ended is
    left as it is."""
    if worker.poll() is not None:
        return
    worker.terminate()
    try:
        worker.wait(timeout=10)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def apply_force(settings: list[str]) -> dict:
    """``--force SETTING=VALUE``: ``triton_impl.FORCED`` for the whole run (what the parts
    run by default, e.g. ``phase1_rows=false`` for Phase 1 as one program per row); raises
    ``ValueError`` naming the setting or value it cannot take."""
    from attnres.ops.depth_attention import triton_impl

    applied = {}
    for text in settings:
        name, _, raw = text.partition("=")
        if name not in triton_impl.FORCED or not raw:
            raise ValueError(f"--force takes SETTING=VALUE with SETTING one of {sorted(triton_impl.FORCED)}; "
                             f"got {text!r}")
        words = {"true": True, "false": False, "none": None}
        if raw.lower() in words:
            value = words[raw.lower()]
        elif raw.isdigit():
            value = int(raw)
        else:
            raise ValueError(f"--force {name}: the value must be an integer, true, false or none; got {raw!r}")
        triton_impl.FORCED[name] = applied[name] = value
    return applied


# --------------------------------------------------------------------------------------- main
def run_part(part: str, z: Sizes, clock: Clock, models: dict, device: str, peers: dict, skipped: dict):
    if part == "parity":
        return part_parity(z, device)
    if part == "ops":
        return part_ops(z, clock, device, peers, skipped)
    if part == "sweep":
        return part_sweep(z, clock, device)
    if part == "decode":
        return part_decode(z, clock, models, device)
    if part == "profile":
        return part_profile(z, models, device)
    if part == "profile_decode":
        return part_profile_decode(z, models, device)
    if part == "train_bf16":
        return part_train_bf16(z, clock, models, device)
    return part_train(z, clock, models, device, compiled=part == "train_compiled", paired=part == "train_eager")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=out_dir,  # (a file there: a traceback once the warm-up has started)
                   help="directory for gpu_check.{md,json} and summary.json (required)")
    p.add_argument("--cpu-smoke", action="store_true", help="every part at toy sizes on the CPU (no GPU needed)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds; parts that would not fit are skipped")
    p.add_argument("--parts", default="parity,train_eager,decode,ops,train_compiled,train_bf16,sweep,profile,"
                                      "profile_decode",
                   help="comma-separated parts to run")
    p.add_argument("--no-peers", action="store_true", help="skip the peers")
    p.add_argument("--force", action="append", default=[], metavar="SETTING=VALUE",
                   help="a launch setting for the whole run (triton_impl.FORCED), e.g. phase1_rows=false; repeatable")
    p.add_argument("--autocast-norm-output", action="store_true",
                   help="every model's sublayer norms return bf16 under autocast (ResidualConfig.autocast_norm_output)"
                        " in every part - e.g. with --parts train_compiled")
    p.add_argument("--autocast-phase1-sums", action="store_true",
                   help="Block and Full AttnRes store Phase 1's weighted sums in bf16 under autocast "
                        "(ResidualConfig.autocast_phase1_sums) in every part - e.g. with --parts train_compiled")
    p.add_argument("--autocast-stream", action="store_true",
                   help="every model stores its residual stream in bf16 under autocast (ResidualConfig.autocast_stream)"
                        " in every part - e.g. with --parts train_eager,train_compiled")
    p.add_argument("--continue", dest="resume", action="store_true",
                   help="add the parts' results to those already in OUT/gpu_check.json (no warm-up): e.g. the parts "
                        "a run skipped for its budget, into a copy of its files (docs/kernels.md's follow-up 5); a "
                        "run does so by itself, in a fresh process, after a part lost the device")
    p.add_argument("--source-digest", action="store_true",
                   help="print the digest of this tree's sources that a run records (code.source_digest) and exit")
    p.add_argument("--warm-up-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.out and not args.source_digest and not args.warm_up_worker:  # (a worker writes nothing)
        p.error("the following arguments are required: --out")
    return args


#: The parts the targets are judged on (:data:`TARGETS`, the op-level bound, the host time,
#: parity): the prepared run's first, before any diagnostic part, so that a run short of its
#: budget drops diagnostics, not targets.
TARGET_PARTS = ("parity", "train_eager", "decode", "ops", "train_compiled")
#: The least time each part needs (s, on an H100): a part is skipped when less remains, so
#: that a run's time limit does not cut it off midway (the compiled part: 221 s on the H200,
#: 208 of them inductor compiling three models; the eager part: its 128 steps and 9 forwards -
#: the targets' rounds, the seven other steps' first runs and rounds beside the standard model,
#: each step's memory - at the H200's 230 / 266 / 586 ms a step of the standard model, Block
#: and Full, with that run's 6 s of first-step overhead, 43 s (benchmarks/results/gpu-h200),
#: 47 s at the H100's slower standard step:
#: tests/test_gpu_check.py::test_the_eager_parts_least_time_covers_its_steps_at_the_measured_step_times).
MIN_SECONDS = {"parity": 5, "profile": 15, "profile_decode": 10, "ops": 15, "sweep": 10, "train_eager": 48,
               "decode": 20, "train_compiled": 230, "train_bf16": 30}
#: The compiled part without Full AttnRes (which has no target): two models to compile - run so
#: when the whole part no longer fits but this does. As :func:`compile_within` counts: the
#: standard model's compile (``COMPILE_S``), Block's after it (``COMPILE_MARGIN`` times that)
#: and the timing, 174 s; at 160, as it was, the standard model compiled and Block was dropped,
#: a ratio-less row for 70 s of the budget.
COMPILED_WITHOUT_FULL_S = round(COMPILE_S + COMPILE_MARGIN * COMPILE_S + COMPILED_TIMING_S)


def fitting_models(part: str, models: dict, left: float) -> tuple[dict, str | None]:
    """The models ``part`` runs with ``left`` seconds of the budget: all of them, or for the
    compiled part short of its :data:`MIN_SECONDS`, all but Full AttnRes (and why)."""
    if part == "train_compiled" and "full" in models and COMPILED_WITHOUT_FULL_S <= left < MIN_SECONDS[part]:
        return ({k: m for k, m in models.items() if k != "full"},
                f"{left:.0f} s of the budget left: compiled without Full AttnRes")
    return models, None


def device_usable(device: str) -> bool:
    """Whether the device still runs work after a part raised. A kernel's memory fault (an
    illegal or misaligned address) is sticky: every later CUDA call of the process fails with
    it, so the parts after it need a fresh process (:func:`continue_elsewhere`)."""
    if device != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        (torch.ones(1, device=device) + 1).item()
        torch.cuda.empty_cache()
        return True
    except Exception:  # noqa: BLE001 - whatever CUDA raises here, the context is lost
        return False


def continue_elsewhere(argv: list[str], parts: list[str], budget: float) -> int:
    """Run ``parts`` within ``budget`` seconds in a fresh process that adds to this run's
    results (``--continue``): this process's device context is lost. The command line is this
    run's with a later ``--parts`` and ``--budget`` (argparse keeps the last of each)."""
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--parts", ",".join(parts),
               "--budget", f"{budget:.0f}", "--continue"]
    log(f"[gpu_check] the device's context is lost: {','.join(parts)} continue in a fresh process")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)
    return 0  # (not reached: execv replaces this process)


def previous_result(out: Path) -> dict:
    """The results a ``--continue`` run adds to (``OUT/gpu_check.json``)."""
    path = out / "gpu_check.json"
    if not path.is_file():
        raise FileNotFoundError(f"--continue: no results to continue in {path}")
    return json.loads(path.read_text())


#: Past the deadline by this many seconds, every thread's stack is written to the log (a
#: part overrunning the budget - a compile, a hung launch - is named before the command's
#: time limit kills the run).
HANG_DUMP_S = 15


def main(argv=None, started: float | None = None) -> int:
    """Run the check (``started``: ``perf_counter`` seconds the budget counts from; now
    unless given - the command line's run passes its process's start)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.source_digest:
        print(source_digest(HERE.parent))
        return 0
    unknown = sorted(set(args.parts.split(",")) - set(MIN_SECONDS))
    if unknown:
        log(f"gpu_check: unknown --parts {unknown}; choose from {sorted(MIN_SECONDS)}")
        return 2
    device = "cpu" if args.cpu_smoke else "cuda"
    z = SMOKE if args.cpu_smoke else Sizes()
    try:
        forced_settings = apply_force(args.force)
    except ValueError as e:
        log(f"gpu_check: {e}")
        return 2
    options = model_options(args)
    if args.warm_up_worker:
        return warm_up_worker(args.warm_up_worker, z, options=options)
    if device == "cuda" and not torch.cuda.is_available():
        log("gpu_check: needs a CUDA device (none found); --cpu-smoke runs every part on the CPU")
        return 2
    start = time.perf_counter() if started is None else started
    clock = Clock(device, deadline=start + args.budget)
    try:  # (a stderr without a file descriptor - a notebook's - has no dump)
        faulthandler.dump_traceback_later(max(1.0, clock.left() + HANG_DUMP_S))
    except (AttributeError, OSError, ValueError) as e:
        log(f"[gpu_check] no stack dump past the budget: {e}")
    try:
        return run_check(args, argv, clock, z, forced_settings, options, start)
    finally:
        faulthandler.cancel_dump_traceback_later()


def run_check(args, argv: list[str], clock: Clock, z: Sizes, forced_settings: dict, options: list[str],
              start: float) -> int:
    """The run of :func:`main`: the warm-up (unless ``--continue``), the models, the parts."""
    device, out, parts = "cuda" if clock.cuda else "cpu", Path(args.out), args.parts.split(",")
    peers, skipped = ({}, {}) if args.no_peers or args.cpu_smoke else kernels_bench.select_peers()
    # (the kernels of a --continue are in the on-disk caches already: no warm-up)
    warm = clock.cuda and not args.resume
    mode = gpu_compute_mode() if warm else None
    shared = mode in (None, "Default")  # (unknown - no nvidia-smi -: as before, in parallel)
    workers = start_warm_up(parts, peers, args.force, options) if warm and shared else {}
    try:
        prepared = prepare(args, argv, clock, z, forced_settings, options, start, workers)
    finally:  # (a run that raised before the warm-up was waited for leaves no worker compiling on its device)
        for worker in workers.values():
            stop_worker(worker)
    if prepared is None:
        return 2
    result, models, spent_before = prepared
    if warm:
        result["warm_up"] = {**result.get("warm_up", {}), "compute_mode": mode}
        if not shared:
            result["warm_up"]["skipped"] = (f"the GPU's compute mode is {mode}: one process at a time holds it, and "
                                            "the warm-up's workers would take it from this one (or fail to get it); "
                                            "each part compiles its kernels in its untimed first steps")
            log(f"[gpu_check] no parallel warm-up: {result['warm_up']['skipped']}")
    for i, part in enumerate(parts):
        lost = run_one_part(part, result, args, clock, z, models, device, peers, skipped, start, spent_before)
        if lost:
            rest = parts[i + 1:]
            return continue_elsewhere(argv, rest, clock.left()) if rest else 0
    result.pop("running", None)
    result["elapsed_s"] = spent_before + time.perf_counter() - start
    write(out, result, clock.strict)  # (parts skipped after the last that ran are named in the files too)
    return 0


def prepare(args, argv: list[str], clock: Clock, z: Sizes, forced_settings: dict, options: list[str], start: float,
            workers: dict) -> tuple[dict, dict, float] | None:
    """What the parts start from, while the warm-up's ``workers`` compile: the results (this
    run's head, or those a ``--continue`` adds to), the models, the warm-up waited for and the
    copy bandwidth measured after it: ``(result, models, seconds spent by the run continued)``,
    or ``None`` where there is nothing to continue (said in the log)."""
    device, out = "cuda" if clock.cuda else "cpu", Path(args.out)
    if args.resume:
        try:
            result = previous_result(out)
        except (OSError, ValueError) as e:
            log(f"gpu_check: {e}")
            return None
        for key in ("errors", "skipped"):
            result.setdefault(key, {})
        result.setdefault("continued", []).append(args.parts)
    else:
        # (as run from the repository root, the way the device machine runs it: it runs as written)
        result = {"command": " ".join(["PYTHONPATH=src python", script_path(__file__), *argv]),
                  "device": torch.cuda.get_device_name() if clock.cuda else "CPU (smoke)",
                  **software(), "code": code_version(HERE.parent), "sizes": asdict(z), "skipped": {}, "errors": {},
                  "forced": forced_settings}
        if clock.cuda:
            result["gpu"] = gpu_facts()
    spent_before = result.get("elapsed_s", 0.0)  # (by the run this one continues)
    result["running"] = {"part": "warm-up" if workers else "building the models",
                         "since_s": spent_before + time.perf_counter() - start}
    write(out, result, clock.strict)  # (a run cut off from here on still says what ran, where, and which code)
    # (a run of the parts that build their own inputs - the peers' follow-up, --parts ops - held three
    # 1.6B-parameter models it never ran)
    models = build_models(z, device) if set(args.parts.split(",")) - set(MODEL_FREE_PARTS) else {}
    apply_model_options(models, options)
    if options:
        result["forced"] = {**(forced_settings or {}), **dict.fromkeys(options, True)}
    if workers:  # the kernels compiled; the timed parts find them in the caches
        result["warm_up"] = wait_for_warm_up(workers, start, start + WARM_UP_SHARE * args.budget)
    if not args.resume:  # (after the warm-up: its workers would share the device)
        result["copy_GBps"] = (attempt(clock, result["errors"], "copy", lambda: copy_bandwidth(device)) or 0) / 1e9
    return result, models, spent_before


def run_one_part(part: str, result: dict, args, clock: Clock, z: Sizes, models: dict, device: str, peers: dict,
                 skipped: dict, start: float, spent_before: float) -> bool:
    """Run ``part`` if it fits the budget, into ``result`` (its failure recorded, its
    optional pieces' failures under ``errors`` as ``part.piece``, models it dropped under
    ``skipped``), and write the files: before (naming it as ``running``, so that a run its
    time limit kills says where) and after. Whether it left the device unusable."""
    out, left = Path(args.out), clock.left()
    forget_earlier(result, part)
    part_models, note = fitting_models(part, models, left) if clock.cuda else (models, None)
    if note:
        result["skipped"][f"{part} full"] = note
        log(f"[gpu_check] {part}: {note}")
    elif clock.cuda and left < MIN_SECONDS[part]:
        result["skipped"][part] = f"{left:.0f} s of the {args.budget:.0f} s budget left"
        log(f"[gpu_check] skipping {part}: {result['skipped'][part]}")
        return False
    log(f"[gpu_check] {part} ({time.perf_counter() - start:.0f} s)")
    result["running"] = {"part": part, "since_s": spent_before + time.perf_counter() - start}
    write(out, result, clock.strict)
    lost = failed = False
    # (the rows a part has measured so far, filed as at its end, still naming it running, so that
    # a run killed in the compiled part's last compile keeps the rows the part measured before it)
    so_far: dict = {}  # (the last rows handed: filed too where the part fails after them)

    def on_measured(rows: dict) -> None:
        so_far.clear()
        so_far.update(rows)
        write(out, filed(result, part, rows), clock.strict)

    clock.on_measured = on_measured
    try:
        part_result = run_part(part, z, clock, part_models, device, peers, skipped)
    except Exception as e:  # noqa: BLE001 - one part's failure is reported; the others still run
        lost = not device_usable(device)
        if clock.strict and not lost:  # (the smoke's failures are the tests')
            raise
        failed = True
        if so_far:  # (the end's write below wrote the run without the rows its files had held)
            file_part(result, part, dict(so_far))
        result["errors"][part] = "".join(traceback.format_exception(e))[-4000:]
        log(f"[gpu_check] {part} FAILED:\n{result['errors'][part]}")
        if lost:
            result["errors"][part] += lost_note(part)
    else:
        pieces = file_part(result, part, part_result)
        # (a piece's failure can lose the device as a part's can: the part's timings are kept,
        # the parts after it run in a fresh process - in this one each would fail)
        lost = bool(pieces) and not device_usable(device)
        if lost:
            result["errors"][f"{part}.{list(pieces)[-1]}"] += lost_note(part)
    finally:
        clock.on_measured = None
    if failed and not lost:  # (the failure's traceback held its tensors: give their memory back)
        release_memory(device)
    result.pop("running", None)
    result["elapsed_s"] = spent_before + time.perf_counter() - start
    print(write(out, result, clock.strict), flush=True)
    return lost


def file_part(result: dict, part: str, part_result: dict) -> dict:
    """``part_result`` into ``result[part]``, its pieces' errors (taken out of it) under
    ``errors`` as ``part.piece`` and the models it dropped under ``skipped``: the pieces'
    errors."""
    result[part] = part_result
    pieces = part_result.pop("errors", None) or {}
    for piece, trace in pieces.items():
        result["errors"][f"{part}.{piece}"] = trace
    for name, why in (part_result.pop("dropped", None) or {}).items():
        result["skipped"][f"{part} {name}"] = why
    return pieces


def filed(result: dict, part: str, rows: dict) -> dict:
    """A copy of ``result`` with ``part``'s ``rows`` so far filed as :func:`file_part` files
    its result, ``result`` and ``rows`` unchanged."""
    copy = {**result, "errors": dict(result["errors"]), "skipped": dict(result["skipped"])}
    file_part(copy, part, dict(rows))
    return copy


def lost_note(part: str) -> str:
    """What a failure's traceback adds where it left the device unusable."""
    return f"\n(the device's context was lost: the parts after {part}, if any, ran in a fresh process)"


def forget_earlier(result: dict, part: str) -> None:
    """Drop what an earlier run said of ``part`` - skipped (``part``, ``part full``), failed
    (``part``, ``part.piece``) - now that it runs again (``--continue``) and says anew: the
    files' ``skipped`` and ``errors`` say what to rerun."""
    for key in ("skipped", "errors"):
        result[key] = {name: v for name, v in result[key].items() if name.split(" ")[0].split(".")[0] != part}


def release_memory(device: str) -> None:
    """Free what a failed part left: its tensors (held by the traceback until now) and the
    allocator's cached blocks, so that an out-of-memory part does not fail the next."""
    gc.collect()
    if device == "cuda":
        try:
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - the next part finds out
            pass


if __name__ == "__main__":
    raise SystemExit(main(started=STARTED))
