"""A scaling grid's runs as arrays: validation loss per (family, size, seed) and compute per
(family, size), checked complete before anything is fitted (report §5.1, Table 2).

A run record (``result.json`` of :mod:`attnres.experiments.job.runner`, or any mapping with the
same fields) needs ``family``, ``seed``, ``val_loss``, ``pflops_days`` and a size: its
``coords["size"]`` label, else its ``non_embedding_params``, else its ``params``. Records of
any grid work, a GPU user's 100M-1B runs as much as the CPU preset's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["MIN_SIZES", "ScalingGridError", "ScalingData", "size_key", "missing_runs", "complete_sizes", "fittable_part",
           "scaling_data"]

#: Fewest model sizes a power-law fit with an interval is accepted on (two points fit any line).
MIN_SIZES = 3


class ScalingGridError(ValueError):
    """A grid that cannot be fitted: too few sizes, or a family with a missing or failed run."""


def size_key(record: dict[str, Any]) -> str:
    """The model size a record belongs to: ``coords["size"]``, else its parameter count."""
    coords = record.get("coords") or {}
    if "size" in coords:
        return str(coords["size"])
    for field in ("non_embedding_params", "params"):
        if record.get(field) is not None:
            return str(record[field])
    raise ScalingGridError(f"record of variant {record.get('variant')!r} has no size: no coords['size'], "
                           "non_embedding_params or params")


def _finished(record: dict[str, Any]) -> bool:
    loss = record.get("val_loss")
    return isinstance(loss, (int, float)) and math.isfinite(loss) and loss > 0 and (record.get("pflops_days") or 0) > 0


def _index(records: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    return {(r["family"], size_key(r), int(r["seed"])): r for r in records}


def missing_runs(records: list[dict[str, Any]], expected: list[tuple[str, str]] | None = None,
                 seeds: list[int] | None = None) -> list[tuple[str, str, int]]:
    """``(family, size, seed)`` of every run the grid lacks or that failed (no finite loss):
    ``expected`` (family, size) pairs (default: every family x every size seen) x ``seeds``
    (default: every seed seen)."""
    index = _index(records)
    families = list(dict.fromkeys(r["family"] for r in records))
    sizes = list(dict.fromkeys(size_key(r) for r in records))
    pairs = expected if expected is not None else [(f, s) for f in families for s in sizes]
    seeds = sorted({int(r["seed"]) for r in records}) if seeds is None else list(seeds)
    return [(f, s, k) for f, s in pairs for k in seeds if (f, s, k) not in index or not _finished(index[(f, s, k)])]


def finished_sizes(records: list[dict[str, Any]]) -> set[str]:
    """The sizes at which at least one run (any family, any seed) finished."""
    return {size_key(r) for r in records if _finished(r)}


def complete_sizes(records: list[dict[str, Any]], expected: list[tuple[str, str]] | None = None,
                   seeds: list[int] | None = None) -> list[str]:
    """The sizes at which no run is missing (see :func:`missing_runs`), in first-seen order."""
    gaps = {s for _, s, _ in missing_runs(records, expected, seeds)}
    sizes = [s for _, s in expected] if expected is not None else [size_key(r) for r in records]
    return [s for s in dict.fromkeys(sizes) if s not in gaps]


def fittable_part(records: list[dict[str, Any]], expected: list[tuple[str, str]] | None = None,
                  min_sizes: int = MIN_SIZES) -> tuple[list[str], list[int]]:
    """``(sizes, seeds)`` of the largest complete part of a partial grid: all seeds seen if
    that leaves ``min_sizes`` complete sizes, else without the seed missing the most runs,
    and so on (a grid run seed after seed has its first seeds complete first)."""
    seeds = sorted({int(r["seed"]) for r in records})
    while seeds:
        sizes = complete_sizes(records, expected, seeds)
        if len(sizes) >= min_sizes or len(seeds) == 1:
            return sizes, seeds
        gaps = missing_runs(records, expected, seeds)
        seeds.remove(max(seeds, key=lambda k: (sum(1 for *_, g in gaps if g == k), k)))
    return [], []


@dataclass(frozen=True)
class ScalingData:
    """A complete grid. ``families``: the reference first; ``sizes``: by increasing compute of
    the reference; ``loss[f, s, k]``: validation loss of family f, size s, seed ``seeds[k]``;
    ``compute[f, s]``: training compute in PFLOP/s-days (the same for every seed);
    ``params[s]``: the reference's non-embedding (else total) parameters, ``None`` if unknown."""

    families: tuple[str, ...]
    sizes: tuple[str, ...]
    seeds: tuple[int, ...]
    loss: np.ndarray
    compute: np.ndarray
    params: tuple[int | None, ...]

    @property
    def reference(self) -> str:
        return self.families[0]

    @property
    def mean_loss(self) -> np.ndarray:
        """``[f, s]``: mean over seeds."""
        return self.loss.mean(axis=-1)


def _check(records: list[dict[str, Any]], reference: str, min_sizes: int) -> None:
    families = list(dict.fromkeys(r["family"] for r in records))
    if reference not in families:
        raise ScalingGridError(f"no {reference!r} family in the grid (families: {', '.join(families) or 'none'}): "
                               "the compute multiplier is measured against it")
    if len(families) < 2:
        raise ScalingGridError(f"the grid has only the {reference!r} family: nothing to compare with")
    sizes = list(dict.fromkeys(size_key(r) for r in records))
    if len(sizes) < min_sizes:
        raise ScalingGridError(f"a scaling-law fit needs at least {min_sizes} model sizes; the grid has {len(sizes)} "
                               f"({', '.join(sizes)})")
    gaps = missing_runs(records)
    if gaps:
        by_family: dict[str, list[str]] = {}
        for f, s, k in gaps:
            by_family.setdefault(f, []).append(f"size {s} seed {k}")
        text = "; ".join(f"family {f!r}: {', '.join(runs)}" for f, runs in by_family.items())
        raise ScalingGridError(f"missing or failed runs (no finite validation loss): {text}. Finish them (re-run the "
                               "grid's command: it resumes) or leave those sizes out")


def scaling_data(records: list[dict[str, Any]], reference: str = "baseline", min_sizes: int = MIN_SIZES) -> ScalingData:
    """The complete grid of ``records`` as arrays; raises :class:`ScalingGridError` with fewer
    than ``min_sizes`` sizes, without a ``reference`` family, or with a missing or failed run
    in any family (every family must have every size and every seed seen)."""
    _check(records, reference, min_sizes)
    index = _index(records)
    families = [reference] + [f for f in dict.fromkeys(r["family"] for r in records) if f != reference]
    seeds = sorted({int(r["seed"]) for r in records})
    sizes = sorted(dict.fromkeys(size_key(r) for r in records),
                   key=lambda s: index[(reference, s, seeds[0])]["pflops_days"])
    loss = np.array([[[index[(f, s, k)]["val_loss"] for k in seeds] for s in sizes] for f in families], dtype=float)
    compute = np.array([[np.mean([index[(f, s, k)]["pflops_days"] for k in seeds]) for s in sizes] for f in families])
    params = tuple(index[(reference, s, seeds[0])].get("non_embedding_params") or index[(reference, s, seeds[0])].get("params")
                   for s in sizes)
    if len(set(compute[0])) < len(sizes):
        raise ScalingGridError(f"two sizes of the {reference!r} family have the same compute: the fit needs distinct ones")
    return ScalingData(tuple(families), tuple(sizes), tuple(seeds), loss, compute, params)
