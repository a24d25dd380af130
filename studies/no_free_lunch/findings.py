"""Findings of the no-free-lunch grid, computed from its run records: which claims of the
critique, of its revision, and of the stated mechanism hold here.

Gaps are paired by seed and taken on a log scale, ``delta = log10(loss_A / loss_B)``
(negative: ``A`` is lower; -0.1 is about 21 % lower), because the losses span orders of
magnitude across ``lam``. A cell (one norm setting, depth and ``lam``) is **decided** only
when it has at least ``MIN_SEEDS`` paired seeds and *every* one of them has the same sign;
otherwise no claim is made about it. A diverged run counts as an infinite loss.

Claims read from the cells (``lam = 0`` is the structured task, ``lam = 1`` the lookup):

* critique: AttnRes wins on the structured task (test loss at the smallest ``lam``); by more
  as depth grows (the per-seed change of the gap from the shallowest to the deepest stack);
  the standard residual wins on memorisation (train loss at the largest ``lam``), the gap
  widening with depth; at the shallowest depth the two are about equal;
* revision: with PreNorm AttnRes wins everywhere (every train-loss cell, every test-loss
  cell with structure in it, i.e. ``lam < 1``); AttnRes's losses come from the setting
  without normalisation;
* mechanism (the sigmoid variant): if the softmax's sum-to-one cap is what costs AttnRes
  memorisation, unnormalised sigmoid weights should memorise better than softmax AttnRes,
  most of all where softmax AttnRes loses to the standard residual.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .models import VARIANTS

__all__ = [
    "MIN_SEEDS", "METRICS", "STATUSES", "Verdict", "Claim", "index_records", "paired_deltas", "verdict",
    "claim_status", "compute_findings",
]

MIN_SEEDS = 3
METRICS = ("train_loss", "test_loss")
STATUSES = ("holds", "holds in part", "mixed", "contradicted in part", "contradicted", "no claim")

Key = tuple[str, str, int, float]  # (norm, variant, depth, lam)


def index_records(records: Iterable[dict[str, Any]]) -> dict[Key, dict[int, dict[str, Any]]]:
    """``{(norm, variant, depth, lam): {seed: record}}``."""
    index: dict[Key, dict[int, dict[str, Any]]] = {}
    for r in records:
        index.setdefault((r["norm"], r["variant"], int(r["depth"]), float(r["lam"])), {})[int(r["seed"])] = r
    return index


def _loss(record: dict[str, Any], metric: str) -> float:
    value = record.get(metric)
    return math.inf if record.get("diverged") or value is None else max(float(value), 1e-30)


def paired_deltas(index: dict[Key, dict[int, dict[str, Any]]], norm: str, variant: str, depth: int, lam: float,
                  metric: str, reference: str = "standard") -> dict[int, float]:
    """``{seed: log10(loss_variant / loss_reference)}`` over the seeds both have (``nan`` when
    both diverged, ``+-inf`` when one did)."""
    a = index.get((norm, variant, depth, float(lam)), {})
    b = index.get((norm, reference, depth, float(lam)), {})
    out = {}
    for seed in sorted(set(a) & set(b)):
        la, lb = _loss(a[seed], metric), _loss(b[seed], metric)
        if math.isinf(la) and math.isinf(lb):
            out[seed] = math.nan
        elif math.isinf(la) or math.isinf(lb):
            out[seed] = math.inf if math.isinf(la) else -math.inf
        else:
            out[seed] = math.log10(la) - math.log10(lb)
    return out


@dataclass(frozen=True)
class Verdict:
    """The seeds of one comparison: ``n`` paired seeds, how many have the first model
    ``lower`` (delta < 0) or ``higher``, mean and sample std of the deltas (``None`` when not
    finite or, for std, with one seed), and ``sign``: -1 (first lower in all >= MIN_SEEDS
    seeds), +1 (higher in all), 0 (no claim; ``reason`` says why)."""

    n: int
    lower: int
    higher: int
    mean: float | None
    std: float | None
    sign: int
    reason: str

    def short(self) -> str:
        """``-0.123 ± 0.045 (3/3 lower)``-style text."""
        if self.n == 0:
            return "no paired seeds"
        m = "div." if self.mean is None else f"{self.mean:+.3f}"
        s = "" if self.std is None else f" ± {self.std:.3f}"
        return f"{m}{s} ({self.lower}/{self.n} lower)"


def verdict(deltas: Iterable[float], min_seeds: int = MIN_SEEDS) -> Verdict:
    """Decide one comparison from its per-seed deltas (see :class:`Verdict`)."""
    d = list(deltas)
    n = len(d)
    lower = sum(1 for x in d if x < 0)
    higher = sum(1 for x in d if x > 0)
    finite = all(math.isfinite(x) for x in d)
    mean = statistics.fmean(d) if d and finite else None
    std = statistics.stdev(d) if n > 1 and finite else None
    if n < min_seeds:
        return Verdict(n, lower, higher, mean, std, 0, f"{n} paired seed(s), fewer than {min_seeds}")
    if lower == n:
        return Verdict(n, lower, higher, mean, std, -1, f"lower in all {n} seeds")
    if higher == n:
        return Verdict(n, lower, higher, mean, std, +1, f"higher in all {n} seeds")
    return Verdict(n, lower, higher, mean, std, 0, f"seeds disagree ({lower} lower, {higher} higher of {n})")


def claim_status(signs: list[int], expected: int) -> str:
    """A claim's status from its cells' signs, ``expected`` being the sign the claim predicts:
    ``holds`` (every cell decided as expected), ``holds in part`` (some, none against),
    ``contradicted`` (every cell decided against), ``contradicted in part`` (some against,
    none for), ``mixed`` (some each way), ``no claim`` (no cell decided)."""
    if not signs:
        return "no claim"
    pro = sum(1 for s in signs if s == expected)
    con = sum(1 for s in signs if s == -expected)
    if pro == 0 and con == 0:
        return "no claim"
    if con == 0:
        return "holds" if pro == len(signs) else "holds in part"
    if pro == 0:
        return "contradicted" if con == len(signs) else "contradicted in part"
    return "mixed"


@dataclass(frozen=True)
class Claim:
    """One computed finding: who claimed it, for which model and norm setting, its status
    (:data:`STATUSES`) and the evidence (per cell) in words."""

    source: str  # "critique", "revision" or "mechanism"
    statement: str
    variant: str
    norm: str
    status: str
    evidence: str

    def markdown(self) -> str:
        where = ", ".join(x for x in (self.variant, self.norm) if x)
        return f"- **{self.status}** — {self.statement} [{where}]: {self.evidence}"


def _axes(index: dict[Key, Any]) -> tuple[list[str], list[str], list[int], list[float]]:
    norms = sorted({k[0] for k in index}, key=lambda n: ("prenorm", "no_norm").index(n) if n in ("prenorm", "no_norm") else 9)
    present = {k[1] for k in index}
    variants = [v for v in VARIANTS if v in present] + sorted(present - set(VARIANTS))
    return norms, variants, sorted({k[2] for k in index}), sorted({k[3] for k in index})


def _cells_text(items: list[tuple[str, Verdict]]) -> str:
    return "; ".join(f"{label}: {v.short()}" for label, v in items)


@dataclass(frozen=True)
class _Grid:
    """The indexed records and the axes they span, with the comparisons the claims read."""

    index: dict[Key, dict[int, dict[str, Any]]]
    norms: list[str]
    variants: list[str]
    depths: list[int]
    lams: list[float]
    min_seeds: int

    @property
    def attnres(self) -> list[str]:
        return [v for v in ("full", "block") if v in self.variants]

    def cell(self, norm: str, variant: str, depth: int, lam: float, metric: str, reference: str = "standard") -> Verdict:
        """One cell: ``variant`` against ``reference`` over the paired seeds."""
        deltas = paired_deltas(self.index, norm, variant, depth, lam, metric, reference)
        return verdict(deltas.values(), self.min_seeds)

    def _depth_pairs(self, norm: str, variant: str, lam: float, metric: str) -> list[tuple[float, float]]:
        """Per seed, (gap at the shallowest depth, gap at the deepest)."""
        lo = paired_deltas(self.index, norm, variant, self.depths[0], lam, metric)
        hi = paired_deltas(self.index, norm, variant, self.depths[-1], lam, metric)
        return [(lo[s], hi[s]) for s in sorted(set(lo) & set(hi))]

    def trend(self, norm: str, variant: str, lam: float, metric: str) -> Verdict:
        """Per seed, the gap at the deepest depth minus the gap at the shallowest."""
        return verdict([hi - lo for lo, hi in self._depth_pairs(norm, variant, lam, metric)], self.min_seeds)

    def widening(self, norm: str, variant: str, lam: float, metric: str) -> Verdict:
        """Per seed, ``|gap at the deepest| - |gap at the shallowest|`` (positive: the gap widens)."""
        return verdict([abs(hi) - abs(lo) for lo, hi in self._depth_pairs(norm, variant, lam, metric)], self.min_seeds)


def compute_findings(records: Iterable[dict[str, Any]], min_seeds: int = MIN_SEEDS) -> list[Claim]:
    """Every claim the grid in ``records`` can speak to (see the module docstring)."""
    index = index_records(records)
    norms, variants, depths, lams = _axes(index)
    if "standard" not in variants or not depths or not lams:
        return []
    grid = _Grid(index, norms, variants, depths, lams, min_seeds)
    return [*_critique_claims(grid), *_revision_claims(grid), *_mechanism_claims(grid)]


def _critique_claims(g: _Grid) -> list[Claim]:
    """The critique's claims, per norm setting and AttnRes variant."""
    claims = []
    for norm in g.norms:
        for v in g.attnres:
            claims += _structured_task_claims(g, norm, v) + _memorisation_claims(g, norm, v)
    return claims


def _structured_task_claims(g: _Grid, norm: str, v: str) -> list[Claim]:
    lam0, d_lo, d_hi = g.lams[0], g.depths[0], g.depths[-1]
    struct = [(f"depth {d}", g.cell(norm, v, d, lam0, "test_loss")) for d in g.depths]
    claims = [Claim("critique", f"AttnRes wins on the structured task (test loss at λ = {lam0:g})", v, norm,
                    claim_status([x.sign for _, x in struct], -1), _cells_text(struct))]
    if d_hi != d_lo:
        t = g.trend(norm, v, lam0, "test_loss")
        claims.append(Claim("critique", f"... and by more as depth grows: the structured-task gap moves in "
                            f"AttnRes's favour from depth {d_lo} to {d_hi} (gap at depth {d_hi} minus gap at "
                            f"depth {d_lo}, per seed; λ = {lam0:g}, test loss; a trend, whoever leads)", v, norm,
                            claim_status([t.sign], -1), t.short().replace("lower", "more negative")))
    return claims


def _memorisation_claims(g: _Grid, norm: str, v: str) -> list[Claim]:
    lam0, lam1, d_lo, d_hi = g.lams[0], g.lams[-1], g.depths[0], g.depths[-1]
    mem = [(f"depth {d}", g.cell(norm, v, d, lam1, "train_loss")) for d in g.depths]
    claims = [Claim("critique", f"the standard residual wins on memorisation (train loss at λ = {lam1:g})", v,
                    norm, claim_status([x.sign for _, x in mem], +1), _cells_text(mem))]
    if d_hi == d_lo:
        return claims
    t = g.trend(norm, v, lam1, "train_loss")
    claims.append(Claim("critique", f"... the memorisation gap moving in the standard residual's favour with "
                        f"depth (gap at depth {d_hi} minus gap at depth {d_lo}, per seed; λ = {lam1:g}, "
                        f"train loss; a trend, whoever leads)", v, norm,
                        claim_status([t.sign], +1), t.short().replace("lower", "more negative")))
    ends = [(f"λ = {lam0:g} test", g.widening(norm, v, lam0, "test_loss")),
            (f"λ = {lam1:g} train", g.widening(norm, v, lam1, "train_loss"))]
    claims.append(Claim("critique", f"about equal at depth {d_lo}, the gaps wider at depth {d_hi} (per seed "
                        f"|gap at {d_hi}| − |gap at {d_lo}|, at both ends)", v, norm,
                        claim_status([x.sign for _, x in ends], +1),
                        _cells_text(ends).replace("lower", "narrower at the deeper stack")))
    return claims


def _revision_cells(g: _Grid, norm: str) -> list[tuple[str, Verdict]]:
    """Every AttnRes cell of ``norm``: train loss at every λ, test loss where there is structure."""
    items = []
    for v in g.attnres:
        for d in g.depths:
            for lam in g.lams:
                items.append((f"{v} d{d} λ{lam:g} train", g.cell(norm, v, d, lam, "train_loss")))
                if lam < 1.0:
                    items.append((f"{v} d{d} λ{lam:g} test", g.cell(norm, v, d, lam, "test_loss")))
    return items


def _tally(items: list[tuple[str, Verdict]]) -> str:
    won = [k for k, x in items if x.sign < 0]
    lost = [k for k, x in items if x.sign > 0]
    text = f"{len(won)} of {len(items)} cells decided for AttnRes, {len(lost)} for the standard residual"
    return text + (f" ({', '.join(lost)})" if lost else "")


def _revision_claims(g: _Grid) -> list[Claim]:
    """The revision's claims: PreNorm AttnRes wins everywhere; its losses come from no norm."""
    if not g.attnres:
        return []
    cells_of = {norm: _revision_cells(g, norm) for norm in g.norms}
    variants = "+".join(g.attnres)
    claims = []
    if "prenorm" in cells_of:
        items = cells_of["prenorm"]
        claims.append(Claim("revision", "with PreNorm AttnRes wins on every task (train loss at every λ, test loss "
                            "where there is structure, λ < 1)", variants, "prenorm",
                            claim_status([x.sign for _, x in items], -1), _tally(items)))
    if "prenorm" in cells_of and "no_norm" in cells_of:
        lost = {n: sum(1 for _, x in cells_of[n] if x.sign > 0) for n in ("prenorm", "no_norm")}
        status, ev = _attribution(lost["prenorm"], lost["no_norm"])
        claims.append(Claim("revision", "AttnRes's losses come from the setting without normalisation",
                            variants, "", status, ev))
    return claims


def _attribution(prenorm: int, no_norm: int) -> tuple[str, str]:
    """Status and evidence of "the losses come from no norm", from the cells lost in each setting."""
    if prenorm == 0 and no_norm == 0:
        return "no claim", "AttnRes loses no decided cell in either setting: there are no losses to attribute"
    counts = f"cells decided for the standard residual: {no_norm} without norm, {prenorm} with PreNorm"
    if prenorm == 0:
        return "holds", counts
    if no_norm == 0:
        return "contradicted", counts
    return "contradicted in part", counts


def _mechanism_claims(g: _Grid) -> list[Claim]:
    """The stated mechanism (the sum-to-one cap), read off the sigmoid variant against softmax Full."""
    if "full_sigmoid" not in g.variants or "full" not in g.variants:
        return []
    lam1 = g.lams[-1]
    claims = []
    for norm in g.norms:
        vs_full = [(f"depth {d}", g.cell(norm, "full_sigmoid", d, lam1, "train_loss", reference="full"))
                   for d in g.depths]
        claims.append(Claim("mechanism", f"removing the sum-to-one constraint (sigmoid weights) helps memorisation: "
                            f"train loss at λ = {lam1:g}, sigmoid vs softmax Full AttnRes", "full_sigmoid", norm,
                            claim_status([x.sign for _, x in vs_full], -1), _cells_text(vs_full)))
        full_lost = [(d, lam) for d in g.depths for lam in g.lams if g.cell(norm, "full", d, lam, "train_loss").sign > 0]
        claims.append(_gap_closing_claim(g, norm, full_lost))
    return claims


def _gap_closing_claim(g: _Grid, norm: str, full_lost: list[tuple[int, float]]) -> Claim:
    """Where softmax Full AttnRes loses to the standard residual on train loss (``full_lost``),
    does the sigmoid variant do better than softmax Full?"""
    statement = "where softmax Full AttnRes loses to the standard residual on train loss, sigmoid weights close the gap"
    if not full_lost:
        return Claim("mechanism", statement, "full_sigmoid", norm, "no claim",
                     "softmax Full AttnRes loses no decided train-loss cell here: there is no loss for "
                     "the mechanism to explain")
    rec = [(f"d{d} λ{lam:g}", g.cell(norm, "full_sigmoid", d, lam, "train_loss", reference="full"))
           for d, lam in full_lost]
    return Claim("mechanism", statement + " (sigmoid vs softmax Full)", "full_sigmoid", norm,
                 claim_status([x.sign for _, x in rec], -1), _cells_text(rec))
