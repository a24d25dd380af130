"""Side-by-side cost measurements on a noisy machine: interleaved step timing, the peak
memory of one step and what a forward keeps for its backward.

Timings on a shared CPU drift with the load. Timing several models **interleaved** (one step
of each, round after round) exposes them to the same drift, and the median of the per-round
ratios against a baseline is robust to drifts that hit a whole round. Report ratios, not
absolute times.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any


#: Clocks for :func:`time_interleaved`. ``wall``: elapsed time. ``cpu``: CPU time of this
#: process (all its threads) - time the process spends waiting for a core taken by another
#: process does not count, so on a shared machine it is far steadier than wall time; with one
#: torch thread it is the work of the computation itself (with several, idle OpenMP threads
#: spinning at barriers count too). Memory-bandwidth contention still shows in both.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def time_interleaved(steps: dict[str, Callable[[], None]], repeats: int,
                     log: Callable[[str], None] | None = None, clock: str = "wall") -> dict[str, list[float]]:
    """Seconds (of ``clock``, see :data:`CLOCKS`) of every call of each ``steps[name]()``,
    ``repeats`` rounds of one call each. Warm the steps up before (the first call of a model
    pays one-off costs).

    The order rotates by one step per round (round ``r`` starts with step ``r mod k``): a
    step's position in the round matters - on CPU the first one was measured 3 % slower
    than an identical twin timed last - so every step takes every position equally often
    when ``repeats`` is a multiple of ``k``."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1; got {repeats!r}")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}; got {clock!r}")
    now = CLOCKS[clock]
    times: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    for r in range(repeats):
        start = r % len(names)
        for name in names[start:] + names[:start]:
            t0 = now()
            steps[name]()
            times[name].append(now() - t0)
        if log is not None:
            log(f"    round {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()))
    return times


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median of ``values``: the ``k``-th
    smallest and ``k``-th largest value, ``k`` the largest with ``P(Binomial(n, 1/2) < k) <=
    (1 - confidence) / 2`` (for n = 10 at 95 %: the 2nd and 9th of 10, 97.9 % coverage). Fewer
    values than that needs (n < 6 at 95 %): the smallest and the largest."""
    if not values:
        raise ValueError("median_interval needs at least one value")
    ordered, n = sorted(values), len(values)
    k = _median_order(n, confidence)
    return ordered[k - 1], ordered[n - k]


def _median_order(n: int, confidence: float) -> int:
    """The ``k`` of :func:`median_interval` for ``n`` values."""
    k, below = 0, 0.0  # below = P(B < k + 1)
    while k < n // 2:
        below += math.comb(n, k) / 2**n
        if below > (1 - confidence) / 2:
            break
        k += 1
    return max(k, 1)


def median_interval_coverage(n: int, confidence: float = 0.95) -> float:
    """How often the interval :func:`median_interval` gives for ``n`` values covers the median:
    ``1 - 2 P(Binomial(n, 1/2) < k)``; ``confidence`` or more from 6 values at 95 %, below it
    for fewer (the range of the values: 2 values 50 %, 5 values 93.75 %; 1 value 0)."""
    k = _median_order(n, confidence)
    return 1 - 2 * sum(math.comb(n, j) for j in range(k)) / 2**n


def paired_summary(times: dict[str, list[float]], baseline: str) -> dict[str, dict[str, float | list[float]]]:
    """Per name: ``median_ms``, ``ratio_of_medians`` and ``median_paired_ratio`` against
    ``baseline`` (the median over rounds of this round's time / the baseline's) with
    ``paired_ratio_interval``, its 95 % interval (:func:`median_interval`), and the samples
    in ms."""
    if baseline not in times:
        raise ValueError(f"baseline {baseline!r} is not among the timed steps {sorted(times)}")
    base = times[baseline]
    out = {}
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base)]
        out[name] = {
            "median_ms": statistics.median(ts) * 1e3,
            "ratio_of_medians": statistics.median(ts) / statistics.median(base),
            "median_paired_ratio": statistics.median(ratios),
            "paired_ratio_interval": list(median_interval(ratios)),
            "samples_ms": [t * 1e3 for t in ts],
        }
    return out


@contextlib.contextmanager
def _native_stderr_silenced():
    """File descriptor 2 pointed at ``/dev/null`` for the block: what native code prints
    there (not Python's ``sys.stderr`` object alone) is dropped. Keep the block to the call
    that prints."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _allocation_totals(fn: Callable[[], Any]) -> tuple[Any, list[int]]:
    """``fn()``'s result and the live CPU allocation level after each allocation or free
    during it (profiler memory events), preceded by the level at its start."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _native_stderr_silenced():  # the profiler's C++ side prints "USDT ... profiler_start" here
        prof.__enter__()
    try:
        result = fn()
    finally:
        with _native_stderr_silenced():  # ... and "profiler_stop" here
            prof.__exit__(None, None, None)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e["args"] for e in json.load(f)["traceEvents"]
                      if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})]
    if not events:
        return result, []
    return result, [events[0]["Total Allocated"] - events[0]["Bytes"]] + [e["Total Allocated"] for e in events]


def peak_memory_bytes(step: Callable[[], None]) -> int:
    """Largest rise of live CPU allocations during ``step()`` above the level at its start
    (profiler memory events): activations, gradients and temporaries, not what was allocated
    before the step (parameters, inputs)."""
    totals = _allocation_totals(step)[1][1:]
    return max(totals) - min(totals) if totals else 0


def kept_bytes(forward: Callable[[], Any]) -> int:
    """Bytes of CPU allocations ``forward()`` leaves alive while its result is held: for a
    training forward, what autograd keeps for the backward (plus the loss). Counted as
    allocations, not by saved-tensor hooks, which would change what is saved (a residual
    that recomputes instead of saving steps aside for other hooks)."""
    totals = _allocation_totals(forward)[1]  # (measured while the result was still held)
    return totals[-1] - totals[0] if totals else 0
