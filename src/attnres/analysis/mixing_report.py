"""Depth mixing matrices on paper: Fig.-9-style panels (report §6.2), the rank and sink
tables (report §5.4.2) and findings computed over seeds, from :class:`DepthMixing` results.

Used by ``attnres analyze`` and by the ``attnres compare`` report; nothing here loads a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..output_paths import save_figure_atomically
from ..nn.residual.mixing import MixingMatrix
from .mixing import RANK_RTOL, SINK_MAX_CV, SINK_RATIO, DepthMixing

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "MIN_SEEDS_FOR_CLAIMS",
    "plot_mixing_panels",
    "rank_expectation",
    "uniform_weights",
    "rank_table",
    "sink_table",
    "mixing_findings",
    "method_note",
]

#: Claims about a variant (a sink, a rank) are made only where at least this many seeds agree.
MIN_SEEDS_FOR_CLAIMS = 3


def method_note(n_tokens: int | dict[str, int]) -> str:
    """How the numbers were measured, for a report: over ``n_tokens`` tokens, or per model
    (``{"A": 384, "B": 1024}``: models of other tokenizers cut the same text into other counts)."""
    counts = n_tokens if isinstance(n_tokens, dict) else {"": n_tokens}
    if len(set(counts.values())) > 1:
        over = "the tokens analysed (" + ", ".join(f"{name}: {n}" for name, n in counts.items()) + ")"
    else:
        n = next(iter(counts.values()))
        over = f"{n} tokens" if n else "the tokens analysed"
    return (f"`M[i -> l]` is the weight sublayer `l` (rows 1..L, the last row the output aggregation) gives source "
            f"`v_i` (columns: `v_0` the embedding, `v_i` the raw output of sublayer `i`), averaged over {over}; a "
            "Block AttnRes block's weight is given to each of its members (report §6.2). Semiseparable "
            "rank: the largest numerical rank of the blocks `M[k:, :k+1]` (every block on and below the diagonal "
            f"lies in one), counting singular values above {RANK_RTOL:g} × the largest singular value of `M` (weights "
            "computed in float32: (L + 1) × float32's machine epsilon, 1.2e-07, where that is more - their rounding "
            "is no direction of the mixing); for "
            "input-dependent variants the largest over the tokens' own matrices (and channels for channel-wise "
            "ones), beside the rank of the averaged `M`. Sink table: a source's weight averaged over the rows that "
            "see it; *relative* = that over the average weight of all sources in those rows (1 for the standard "
            f"residual); CV = its standard deviation across tokens and inputs over its mean. A sink: relative ≥ "
            f"{SINK_RATIO:g} with CV ≤ {SINK_MAX_CV:g} (a high weight whatever the input, report §5.4.2).")


def rank_expectation(residual: str, n_sublayers: int, block_size: int | None = None,
                     n_streams: int | None = None, uniform: bool = False,
                     measured: int | None = None) -> tuple[str, int | None, int | None]:
    """What report §6.2 says of the semiseparable rank: ``(words, low, high)`` (bounds or
    ``None``). No bound exceeds the most the blocks of an ``(L + 1) × (L + 1)`` matrix allow
    (``(L + 2) // 2``, Full AttnRes's); Block AttnRes with ``S = 1`` is Full AttnRes, and
    ``S`` counts at most ``L`` sublayers (``S ≥ L``: one block). ``uniform``: the measured
    AttnRes weights are uniform (:func:`uniform_weights`), whose matrix has rank 1 whatever
    N and S: the report's bounds, those of learnt queries, are not set against it. ``measured``:
    the largest rank measured, said to be rounding where uniform weights gave more than 1."""
    L = n_sublayers
    dense = (L + 2) // 2
    if uniform and residual in ("attnres_full", "attnres_block"):
        # (SmolLM2's Block upcycle, 60 sublayers: float32 sixths one ulp apart gave a second singular value of
        # 4.5e-9, above the threshold of float64 weights, 1e-9; mixing.rank_rtol now counts it for nothing)
        rounding = "" if not measured or measured < 2 else (
            f"; the {measured} measured is rounding: equal weights that differ in their last bits, above the rank's "
            "threshold")
        return ("1: every weight uniform (zero pseudo-queries: a model at initialisation, an upcycle at conversion)"
                f"{rounding}; report §6.2's bounds are for learnt queries", None, None)  # (no finding against them)
    if residual in ("standard", "highway", "rezero", "layerscale"):
        return "1 (report §6.2)", 1, 1
    if residual in ("hyper_connections", "mhc", "mhc_lite") and n_streams:
        return f"≤ m = {n_streams} (Eq. 10)", None, n_streams
    if residual == "attnres_full" or (residual == "attnres_block" and block_size == 1):
        full = "" if residual == "attnres_full" else " (S = 1 is Full AttnRes)"
        return f"dense: {dense}, the most the blocks of a {L + 1}×{L + 1} matrix allow{full}", dense, dense
    if residual == "attnres_block" and block_size:
        S = min(block_size, L)
        N = math.ceil(L / S)
        high = min(N + S, dense)
        notes = ([f"S = {block_size} counts as the {L} sublayers there are: one block"] if S != block_size else [])
        notes += [f"at most {dense} here, the most the blocks of a {L + 1}×{L + 1} matrix allow"] if high < N + S else []
        cap = "".join(f"; {n}" for n in notes)
        if S >= N - 1:
            return f"between N = {N} and N + S = {N + S} (report §6.2{cap})", N, high
        return (f"≤ N + S = {N + S}{cap}; the lower bound N = {N} may fail when S < N - 1 (here S = {S}; "
                f"it held in our tests whenever S ≥ N - 1)", None, high)
    # (DenseFormer, a residual of the user's own: an empty cell read as a value left out by mistake)
    return "none stated (report §6.2 derives the rank of the standard residual, Highway, (m)HC and AttnRes)", None, None


def uniform_weights(result: DepthMixing, tol: float = 1e-6) -> bool:
    """Whether every row of ``result``'s ``M`` gives its sources one weight, the same for every
    token: what zero pseudo-queries give (the faithful init, an upcycle at conversion)."""
    M = result.matrix.double()
    rows = [M[r, : r + 1] for r in range(M.shape[0])]
    spread = result.std.double().nan_to_num(0.0)
    return all(float(row.max() - row.min()) <= tol for row in rows) and float(spread.abs().max()) <= tol


def _label(i: int, n: int) -> str:
    return "out" if i == n - 1 else str(i + 1)


def plot_mixing_panels(panels: Sequence[tuple[str, torch.Tensor, list[range] | None]], path: str | Path | None = None,
                       diff: tuple[str, torch.Tensor] | None = None, one_scale: bool = False) -> Figure:
    """One Fig.-9-style panel per ``(title, M [L+1, L+1], source_groups)`` (or per
    :class:`DepthMixing`; ``M`` a :class:`MixingMatrix` too, averaged over its tokens): ``M`` on and below
    the diagonal, blank above, each panel on its own colour scale, or with ``one_scale`` all of
    them on one (one norm, one colour bar: ``attnres analyze --compare``, where one colour on
    two scales was two weights and the panels looked alike whatever their difference); block
    boundaries drawn for variants with source groups. ``diff``: a last panel ``(title, A - B)``
    on a diverging scale centred on 0, its own. Returns the matplotlib ``Figure``, also written
    to ``path`` when given; drawn without pyplot (matplotlib's backend and pyplot's figures are
    left as they are)."""
    from matplotlib.figure import Figure

    items = [(title, _lower_triangle(M), groups) for title, M, groups in _panels(panels)]
    items += [(diff[0], _lower_triangle(diff[1]), None)] if diff is not None else []
    shared = _shared_norm([A for _, A, _ in items[: len(panels)]]) if one_scale else None
    # (a colour bar beside two panels: constrained layout places it, tight_layout cannot)
    fig = Figure(figsize=(4.2 * len(items), 4.0), layout="constrained" if shared else None)
    axes = fig.subplots(1, len(items), squeeze=False)
    for k, (ax, (title, A, groups)) in enumerate(zip(axes[0], items)):
        n = A.shape[0]
        finite = np.abs(A[np.isfinite(A)])
        if diff is not None and k == len(items) - 1:
            # (over the finite entries only: np.nanmax of an all-NaN panel warned "All-NaN slice")
            lim = float(finite.max()) if finite.size else 0.0
            im = ax.imshow(A, cmap="RdBu_r", vmin=-(lim or 1.0), vmax=lim or 1.0)
        else:
            im = ax.imshow(A, cmap="viridis", norm=shared)  # (None: the panel's own scale)
        if not finite.size:  # a blank panel said nothing of why
            _say_nothing_to_show(ax)
        for g in groups or []:
            if g.start > 0:
                ax.axvline(g.start - 0.5, color="white", lw=0.6)
        step = max(1, n // 8)
        ax.set_xticks(range(0, n, step))
        ax.set_xticklabels([f"v{i}" for i in range(0, n, step)], fontsize=7)
        ax.set_yticks(range(0, n, step))
        ax.set_yticklabels([_label(i, n) for i in range(0, n, step)], fontsize=7)
        ax.set_xlabel("source")
        ax.set_ylabel("sublayer (last row: output)")
        ax.set_title(title, fontsize=9)
        if shared is None or k >= len(panels):
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
        elif k == len(panels) - 1:  # one colour bar for the panels on the one scale
            fig.colorbar(im, ax=list(axes[0][: len(panels)]), fraction=0.046 / len(panels), pad=0.04)
    if shared is None:
        fig.tight_layout()
    if path is not None:
        save_figure_atomically(fig, path, "the mixing figure", dpi=120)
    return fig


def _say_nothing_to_show(ax) -> None:
    """Write across an empty panel that it has no finite value, so a blank is not read as a drawing."""
    ax.text(0.5, 0.5, "nothing to show:\nno finite value", transform=ax.transAxes, ha="center", va="center",
            fontsize=9, color="0.3")


def _panels(panels) -> list[tuple[str, torch.Tensor, list[range] | None]]:
    """``panels`` as :func:`plot_mixing_panels` draws them, ``(title, M [n, n], source_groups)``
    each, else ``ValueError`` naming the fix. A :class:`DepthMixing` is its own panel (titled by
    its residual) and a :class:`MixingMatrix` is averaged over its tokens, as ``depth_mixing_matrix``
    averages; one panel not in a list, or a per-token ``M``, failed inside ("'str' object has no
    attribute 'detach'", "Invalid shape (2, 16, 9, 9) for image data")."""
    if isinstance(panels, (DepthMixing, str)) or (isinstance(panels, tuple) and panels and isinstance(panels[0], str)):
        raise ValueError("plot_mixing_panels takes a list of panels, one (title, M, source_groups) each: for one, "
                         "[(title, M, source_groups)]")
    out = []
    for k, panel in enumerate(panels):
        if isinstance(panel, DepthMixing):
            panel = (panel.residual, panel.matrix, panel.source_groups)
        if not (isinstance(panel, (tuple, list)) and len(panel) == 3 and isinstance(panel[0], str)):
            raise ValueError(f"plot_mixing_panels: panels[{k}] must be (title, M [n, n], source_groups) or a "
                             f"DepthMixing, got {type(panel).__name__}")
        title, M, groups = panel
        if isinstance(M, MixingMatrix):
            M = M.weights.reshape(-1, *M.weights.shape[-2:]).mean(0)
        if not isinstance(M, torch.Tensor) or M.dim() != 2 or M.shape[0] != M.shape[1]:
            got = tuple(M.shape) if isinstance(M, torch.Tensor) else type(M).__name__
            raise ValueError(f"plot_mixing_panels: panels[{k}] ({title!r}) needs one matrix M [n, n], got {got}: "
                             "for per-token matrices [..., n, n] pass their mean, M.reshape(-1, n, n).mean(0)")
        out.append((title, M, groups))
    return out


def _lower_triangle(M: torch.Tensor) -> np.ndarray:
    """``M`` as float64 numpy, blank (NaN) above the diagonal, where no sublayer reads a source."""
    A = M.detach().double().cpu().numpy().copy()
    A[np.triu_indices(A.shape[0], 1)] = np.nan
    return A


def _shared_norm(matrices: list[np.ndarray]):
    """One ``Normalize`` over the finite entries of every one of ``matrices``."""
    from matplotlib.colors import Normalize

    values = np.concatenate([A[np.isfinite(A)] for A in matrices])
    return Normalize(float(values.min()), float(values.max())) if values.size else Normalize()


def _over(results: Sequence[DepthMixing]) -> str:
    """What the ranks of ``results`` (one per seed) are the largest over: once when the seeds
    agree, else per seed (a seed without checkpoint has only its logged averaged ``M``)."""
    words = [r.rank_over if not r.input_dependent or not r.rank_tokens or r.rank_tokens < r.n_tokens  # (named there)
             else f"{r.rank_over} ({r.rank_tokens} tokens)" for r in results]
    return words[0] if len(set(words)) == 1 else "; ".join(words) + " (per seed)"


def rank_table(rows: Sequence[tuple[str, list[DepthMixing], str]]) -> str:
    """Markdown: per model (``(label, results over seeds, expectation words)``), the rank of
    each seed and of its averaged ``M``."""
    lines = ["| model | semiseparable rank (per seed) | rank of the token-averaged M | over | report §6.2 |",
             "|---|---|---|---|---|"]
    for label, results, expected in rows:
        lines.append(f"| {label} | {', '.join(str(r.rank) for r in results)} | "
                     f"{', '.join(str(r.rank_of_mean) for r in results)} | {_over(results)} | {expected} |")
    return "\n".join(lines)


def sink_table(label: str, results: list[DepthMixing], top: int = 4) -> str:
    """Markdown: the sources of ``results`` (one per seed) worth showing - ``v_0``, the
    ``top`` of each seed by relative weight and every source flagged in some seed - with
    mean ± std over seeds of the mean weight, relative weight and CV, and in how many seeds
    each is a sink."""
    shown = {0}
    for r in results:
        shown |= {s.source for s in sorted(r.sources, key=lambda s: -s.relative)[:top]}
        shown |= set(r.sinks())
    hidden = results[0].matrix.shape[0] - len(shown)
    lines = [f"**{label}** ({len(results)} seed(s))" + (
        f": v0, each seed's {top} sources of highest relative weight and every sink; the other {hidden} of the "
        f"{results[0].matrix.shape[0]} sources are in mixing.json" if hidden else ""), "",
             "| source | mean weight | relative | CV across tokens | sink in seeds |", "|---|---|---|---|---|"]

    def pm(xs: list[float]) -> str:
        if any(math.isnan(x) for x in xs):
            return "n/a"
        m = sum(xs) / len(xs)
        if len(xs) < 2:
            return f"{m:.3f}"
        sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
        return f"{m:.3f} ± {sd:.3f}"

    for i in sorted(shown):
        st = [r.sources[i] for r in results]
        lines.append(f"| v{i} | {pm([s.mean for s in st])} | {pm([s.relative for s in st])} | "
                     f"{pm([s.cv for s in st])} | {sum(s.sink for s in st)}/{len(st)} |")
    return "\n".join(lines)


def _per_seed(values: list) -> str:
    """Values over seeds as prose: one seed's as it is, several equal ones once, others as
    ``7, 7, 8 (per seed)`` (sink lists: ``none; v0; v0, v3 (per seed)``)."""
    if len(set(values)) == 1:
        return str(values[0])
    return ("; " if isinstance(values[0], str) else ", ").join(map(str, values)) + " (per seed)"


def mixing_findings(label: str, results: list[DepthMixing], low: int | None, high: int | None) -> list[str]:
    """Computed findings over seeds: the rank against report §6.2 and the sinks; claims only
    where at least :data:`MIN_SEEDS_FOR_CLAIMS` seeds agree."""
    out = []
    n = len(results)
    ranks = [r.rank for r in results]
    if low is not None or high is not None:
        ok = [(low is None or r >= low) and (high is None or r <= high) for r in ranks]
        bound = (f"[{low}, {high}]" if low is not None and high is not None and low != high else
                 f"= {low}" if low == high else f"≤ {high}" if low is None else f"≥ {low}")
        if n >= MIN_SEEDS_FOR_CLAIMS and all(ok):
            out.append(f"{label}: semiseparable rank {_per_seed(ranks)}, in every seed ({n}/{n}) within report §6.2's "
                       f"{bound}.")
        elif n >= MIN_SEEDS_FOR_CLAIMS and not any(ok):
            out.append(f"{label}: semiseparable rank {_per_seed(ranks)} outside report §6.2's {bound} in every seed "
                       f"({n}/{n}).")
        else:
            out.append(f"{label}: semiseparable rank {_per_seed(ranks)} (report §6.2: {bound}); "
                       + (f"{sum(ok)}/{n} seeds agree, no claim." if n >= MIN_SEEDS_FOR_CLAIMS else
                          f"fewer than {MIN_SEEDS_FOR_CLAIMS} seeds, no claim."))
    size = results[0].matrix.shape[0]
    if all(r.n_tokens == 0 for r in results):  # logged mean weights only: no spread across tokens, no sink flag
        heavy = [i for i in range(size) if all(r.sources[i].relative >= SINK_RATIO for r in results)]
        if n < MIN_SEEDS_FOR_CLAIMS:
            out.append(f"{label}: fewer than {MIN_SEEDS_FOR_CLAIMS} seeds, no claim about heavy sources.")
        elif heavy:
            desc = ", ".join(f"v{i} ({sum(r.sources[i].relative for r in results) / n:.2f}×)" for i in heavy)
            out.append(f"{label}: in all {n} seeds these sources take at least {SINK_RATIO:g}× the average weight of "
                       f"the sources beside them, on average over the logged batch: {desc} (sink candidates: their "
                       "spread across tokens was not logged).")
        else:
            out.append(f"{label}: no source takes {SINK_RATIO:g}× the average weight in all {n} seeds.")
        return out
    everywhere = [i for i in range(size) if all(r.sources[i].sink for r in results)]
    somewhere = sorted({i for r in results for i in r.sinks()} - set(everywhere))
    if n < MIN_SEEDS_FOR_CLAIMS:
        sinks = _per_seed([", ".join(f"v{i}" for i in r.sinks()) or "none" for r in results])
        out.append(f"{label}: sinks: {sinks}; fewer than {MIN_SEEDS_FOR_CLAIMS} seeds, no claim.")
    elif everywhere:
        desc = ", ".join(f"v{i} (relative weight {sum(r.sources[i].relative for r in results) / n:.2f}, CV "
                         f"{sum(r.sources[i].cv for r in results) / n:.2f})" for i in everywhere)
        out.append(f"{label}: depth-wise attention sink(s) in all {n} seeds: {desc}"
                   + (f"; flagged in some seeds only: {', '.join(f'v{i}' for i in somewhere)}." if somewhere else "."))
    else:
        out.append(f"{label}: no source is a sink in all {n} seeds"
                   + (f" (flagged in some: {', '.join(f'v{i}' for i in somewhere)})." if somewhere else "."))
    return out
