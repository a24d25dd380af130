"""Scaling-law fits and the compute multiplier (report §5.1, Table 2): recovery of known
laws, the t-intervals' coverage in a seeded simulation (2 seeds included), refusals, and the
report on partial grids."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from attnres.experiments import write_report  # noqa: E402
from attnres.experiments.grids.scaling_fit import PowerLaw, compute_multiplier, fit_scaling  # noqa: E402
from attnres.experiments.grids.scaling_grid import ScalingData, ScalingGridError, missing_runs, scaling_data  # noqa: E402
from attnres.experiments.grids.scaling_report import REPORT_TABLE2, report_multiplier, scaling_section  # noqa: E402

COMPUTE = np.geomspace(1e-7, 1e-4, 5)


def _records(laws: dict[str, PowerLaw], seeds=(0, 1), noise: float = 0.0, rng=None, compute=COMPUTE,
             extra_compute: float = 1.02) -> list[dict]:
    """Run records of a grid whose families follow ``laws`` (AttnRes families cost
    ``extra_compute`` times the reference's compute at the same size), with log-normal seed noise."""
    rng = rng or np.random.default_rng(0)
    out = []
    for family, law in laws.items():
        for i, c in enumerate(compute):
            c_f = c * (1.0 if family == "baseline" else extra_compute)
            for k in seeds:
                loss = float(law.loss(c_f) * math.exp(rng.normal(0, noise) if noise else 0.0))
                out.append(dict(variant=f"{family}_s{i + 1}", family=family, coords={"size": f"s{i + 1}"}, seed=k,
                                val_loss=loss, pflops_days=float(c_f), params=1000 * (i + 1),
                                non_embedding_params=500 * (i + 1), steps=100 * (i + 1), residual_params=0,
                                step_time_s=0.1, peak_memory_bytes=None))
    return out


def _shifted(reference: PowerLaw, multiplier: float, alpha: float | None = None) -> PowerLaw:
    """A law that reaches the reference's loss with ``multiplier`` times less compute (at C = 1e-5 when
    its exponent differs)."""
    alpha = reference.alpha if alpha is None else alpha
    c0 = 1e-5
    target = reference.loss(multiplier * c0)
    return PowerLaw(float(target * c0**alpha), alpha)


def test_report_table2_fits_give_its_multiplier():
    """Report §5.1: at 5.6 PFLOP/s-days Block reaches 1.692 vs the baseline's 1.714, "a 1.25x compute advantage"."""
    base, block = PowerLaw(*REPORT_TABLE2["baseline"]), PowerLaw(*REPORT_TABLE2["block"])
    assert block.loss(5.6) == pytest.approx(1.692, abs=5e-4) and base.loss(5.6) == pytest.approx(1.714, abs=5e-4)
    assert report_multiplier("block") == pytest.approx(1.25, abs=0.01)
    assert report_multiplier("full") == pytest.approx(1.275, abs=0.01) and report_multiplier("baseline") is None
    # the multiplier inverts the law: the reference at m * C has the family's loss at C
    assert compute_multiplier(base, base.loss(3.0 * 0.7), 0.7) == pytest.approx(3.0)


def test_known_exponents_and_multipliers_are_recovered():
    base = PowerLaw(4.0, 0.06)
    laws = {"baseline": base, "block": _shifted(base, 1.25), "full": _shifted(base, 1.4, alpha=0.065)}
    fit = fit_scaling(scaling_data(_records(laws, seeds=(0, 1, 2), noise=2e-4)))
    for family, law in laws.items():
        assert fit.fits[family].alpha.value == pytest.approx(law.alpha, rel=0.02)
        assert fit.fits[family].A.value == pytest.approx(law.A, rel=0.02)
        assert fit.fits[family].alpha.low < fit.fits[family].alpha.value < fit.fits[family].alpha.high
    # Block: a constant 1.25 at every size - the reference needs 1.25 x 1.02 C for the loss Block
    # reaches at its own compute, 1.02 C (2 % above the reference's at each size), and the
    # multiplier is over that own compute (1.25 / 1.02 would count the 2 % twice; 1.25 x 1.02
    # not at all). 0.3 % at most off here, from the loss noise.
    for e in fit.comparisons["block"].multiplier_at_size:
        assert e.value == pytest.approx(1.25, rel=5e-3)
    for c, e in fit.comparisons["block"].multiplier_common:
        assert e.value == pytest.approx(1.25, rel=5e-3) and e.high - e.low < 0.1
    # Full: a steeper law, so the multiplier grows with compute; read where the fits overlap
    points = [c for c, _ in fit.comparisons["full"].multiplier_common]
    assert points[0] == pytest.approx(COMPUTE[0] * 1.02) and points[-1] == pytest.approx(COMPUTE[-1])
    for c, e in fit.comparisons["full"].multiplier_common:
        assert e.value == pytest.approx(float(compute_multiplier(base, laws["full"].loss(c), c)), rel=0.03)
    truth = laws["full"].loss(1.02 * COMPUTE) - base.loss(COMPUTE)
    assert [e.value for e in fit.comparisons["full"].delta_at_size] == pytest.approx(truth, abs=3e-3)


def _simulated_fits(seeds: int, shared: float, reps: int, rng) -> list:
    """``reps`` fits of a 5-size grid (true multiplier 1.25, exponent 0.06) with log-normal seed
    noise of sd 4e-3 per run, of which a share ``shared`` of the variance is common to both
    families (a seed fixes the data order of all of them)."""
    base_loss = 5 * COMPUTE**-0.06
    truth = np.stack([base_loss, 5 * (1.25 * COMPUTE) ** -0.06])[:, :, None]
    fits = []
    for _ in range(reps):
        noise = (math.sqrt(shared) * rng.normal(0, 4e-3, (1, 5, seeds))
                 + math.sqrt(1 - shared) * rng.normal(0, 4e-3, (2, 5, seeds)))
        data = ScalingData(("baseline", "block"), tuple(f"s{i}" for i in range(5)), tuple(range(seeds)),
                           truth * np.exp(noise), np.stack([COMPUTE, COMPUTE]), (None,) * 5)
        fits.append(fit_scaling(data, level=0.9))
    return fits


@pytest.mark.parametrize("seeds", [2, 4])
def test_t_intervals_cover_the_truth_at_their_level(seeds):
    """Seeded simulation, 400 grids of 5 sizes: the 90 % intervals of the common-range
    multiplier, the exponent and the per-size loss difference contain the true values at
    their nominal rate with 2 seeds as with 4 (the paired bootstrap they replace covered
    about 61 % of the time for a nominal 95 % with 2 seeds). Band: 3 binomial sd."""
    reps = 400
    fits = _simulated_fits(seeds, shared=0.0, reps=reps, rng=np.random.default_rng(seeds))
    true_delta = 5 * (1.25 * COMPUTE[2]) ** -0.06 - 5 * COMPUTE[2] ** -0.06
    rates = {
        "multiplier": np.mean([f.comparisons["block"].multiplier_common[1][1].low <= 1.25
                               <= f.comparisons["block"].multiplier_common[1][1].high for f in fits]),
        "alpha": np.mean([f.fits["baseline"].alpha.low <= 0.06 <= f.fits["baseline"].alpha.high for f in fits]),
        "delta": np.mean([f.comparisons["block"].delta_at_size[2].low <= true_delta
                          <= f.comparisons["block"].delta_at_size[2].high for f in fits]),
    }
    band = 3 * math.sqrt(0.9 * 0.1 / reps)
    assert all(abs(rate - 0.9) < band for rate in rates.values()), rates


def test_t_intervals_are_conservative_when_seed_noise_is_shared():
    """Half the seed variance common to both families: the difference's intervals, which
    treat the families as independent, cover at least their nominal rate."""
    reps = 300
    fits = _simulated_fits(2, shared=0.5, reps=reps, rng=np.random.default_rng(7))
    rate = np.mean([f.comparisons["block"].multiplier_common[1][1].low <= 1.25
                    <= f.comparisons["block"].multiplier_common[1][1].high for f in fits])
    assert rate >= 0.9 - 3 * math.sqrt(0.09 / reps)


def test_detectable_difference_follows_the_pooled_seed_noise():
    """With seed sd s on df degrees of freedom the two-sided t-test at the fit's level (90 %
    here) and 80 % power finds about (t_0.95 + t_0.8)·s·sqrt(2/n)."""
    from scipy import stats

    fit = _simulated_fits(2, shared=0.0, reps=1, rng=np.random.default_rng(3))[0]
    se = fit.sd_loss * math.sqrt(2 / 2)
    approx = (stats.t.ppf(0.95, fit.df) + stats.t.ppf(0.8, fit.df)) * se
    assert fit.df == 2 * 5 * 1 and fit.detectable_difference() == pytest.approx(approx, rel=0.02)


def test_grids_that_cannot_be_fitted_are_refused():
    base = PowerLaw(4.0, 0.06)
    laws = {"baseline": base, "block": _shifted(base, 1.2)}
    with pytest.raises(ScalingGridError, match=r"at least 3 model sizes; the grid has 2 \(s1, s2\)"):
        scaling_data(_records(laws, compute=COMPUTE[:2]))
    records = _records(laws)
    gone = [r for r in records if not (r["family"] == "block" and r["coords"]["size"] == "s3" and r["seed"] == 1)]
    with pytest.raises(ScalingGridError, match=r"missing or failed runs .*family 'block': size s3 seed 1"):
        scaling_data(gone)
    failed = [dict(r, val_loss=math.nan) if r["variant"] == "block_s2" and r["seed"] == 0 else r for r in records]
    with pytest.raises(ScalingGridError, match=r"family 'block': size s2 seed 0"):
        scaling_data(failed)
    assert missing_runs(failed) == [("block", "s2", 0)]
    with pytest.raises(ScalingGridError, match="no 'baseline' family"):
        scaling_data([r for r in records if r["family"] != "baseline"])
    with pytest.raises(ValueError, match="level"):
        fit_scaling(scaling_data(records), level=1.5)


def test_one_seed_fits_without_intervals():
    base = PowerLaw(4.0, 0.06)
    fit = fit_scaling(scaling_data(_records({"baseline": base, "block": _shifted(base, 1.2)}, seeds=(0,))))
    assert fit.df is None and fit.fits["block"].alpha.low is None
    assert fit.comparisons["block"].multiplier_common[1][1].text(".2f", "×") == "1.20×"


def test_a_report_cut_short_leaves_the_last_one_whole(tmp_path, monkeypatch):
    """A grid's report.md was written in place: a kill mid-write (a scheduler's time limit
    during --report-only) left it truncated. It is written atomically: the last one stays whole."""
    import pathlib

    base = PowerLaw(4.0, 0.06)
    records = _records({"baseline": base, "block": _shifted(base, 1.2)}, compute=COMPUTE[:3])
    before = write_report("scaling", records, tmp_path, "tiny").read_text()
    write_text = pathlib.Path.write_text

    def killed_mid_write(path, text, *args, **kwargs):
        if "report.md" not in path.name:
            return write_text(path, text, *args, **kwargs)
        write_text(path, text[:20], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(pathlib.Path, "write_text", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        write_report("scaling", records[:-1], tmp_path, "tiny")
    assert (tmp_path / "report.md").read_text() == before


def test_report_on_a_partial_grid_marks_missing_runs(tmp_path):
    """`--report-only` while the grid runs: missing runs are named, fits wait for 3 complete sizes."""
    base = PowerLaw(4.0, 0.06)
    laws = {"baseline": base, "block": _shifted(base, 1.2), "full": _shifted(base, 1.3)}
    full = _records(laws, compute=COMPUTE[:3])
    # seed 1 of the largest size not finished yet: fitted provisionally on seed 0
    records = [r for r in full if not (r["coords"]["size"] == "s3" and r["seed"] == 1)]
    text = write_report("scaling", records, tmp_path, "tiny").read_text()
    assert "**Partial grid**: 3 run(s) missing" in text and "**missing: seed 1**" in text
    assert "provisional, on the complete sizes s1, s2, s3 x seeds [0]" in text and "One seed: no intervals" in text
    # a size with no Block run at all: nothing to fit
    records = [r for r in full if r["variant"] != "block_s3"]
    text = write_report("scaling", records, tmp_path / "none", "tiny").read_text()
    assert "No fit: 2 complete size(s)" in text and not (tmp_path / "none" / "scaling.png").exists()
    text = write_report("scaling", full, tmp_path, "tiny").read_text()
    assert "Partial grid" not in text and "1.891·C^−0.057" in text and "1.25× at 5.6" in text
    assert "not run" not in text
    # the runs table: a column for missing runs only where some are (it was an empty one, under an empty header)
    assert "| size | model | shape | non-emb. params | steps | C (PFLOP/s-days) | val loss |\n" in text and "|  |" not in text
    partial = write_report("scaling", [r for r in full if not (r["coords"]["size"] == "s3" and r["seed"] == 1)],
                           tmp_path / "partial", "tiny").read_text()
    assert "| val loss | missing runs |\n" in partial


def test_report_leaves_out_a_size_that_no_run_finished(tmp_path):
    """A grid run on fewer sizes than its preset lists: the size without any finished run is
    named and left out, and the sizes that ran are fitted as a complete grid; a size that is
    only partly done still makes the grid partial."""
    base = PowerLaw(4.0, 0.06)
    laws = {"baseline": base, "block": _shifted(base, 1.2), "full": _shifted(base, 1.3)}
    full = _records(laws, compute=COMPUTE[:4])
    three = [r for r in full if r["coords"]["size"] != "s4"]
    expected = [(f, s) for f in laws for s in ("s1", "s2", "s3", "s4")]
    text = scaling_section(three, tmp_path, expected)
    assert "Sizes of the grid not run (no finished run): s4. The grid below is the 3 sizes that ran." in text
    assert "Partial grid" not in text and "| s4 |" not in text and "95% Student t over the 2 seeds" in text
    one_run = three + [r for r in full if r["variant"] == "block_s4" and r["seed"] == 0]
    text = scaling_section(one_run, tmp_path, expected)
    assert "not run" not in text and "**Partial grid**: 5 run(s) missing" in text
    assert (tmp_path / "scaling.png").stat().st_size > 0


def test_grid_planner_measures_every_variant_and_balances_the_split():
    """benchmarks/plan_scaling_grid.py: the per-step CPU time of every variant of a preset, and a
    split of the grid over processes with nearly equal cost."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_scaling_grid.py"
    spec = importlib.util.spec_from_file_location("plan_scaling_grid", path)
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    parts = plan.split({"a": 5.0, "b": 4.0, "c": 3.0, "d": 3.0, "e": 1.0}, 2)
    assert sorted(sum({"a": 5, "b": 4, "c": 3, "d": 3, "e": 1}[n] for n in p) for p in parts) == [8, 8]
    measured = plan.step_cpu_seconds("tiny", rounds=1)
    assert len(measured) == 9 and all(t >= 0 and steps >= 2 for t, steps in measured.values())


def test_the_report_names_only_modules_that_exist(tmp_path):
    """The report points its reader at the code of the fits: every ``attnres....`` module it
    names imports (it named ``attnres.experiments.scaling_fit``, which moved under ``grids``)."""
    import importlib
    import re

    base = PowerLaw(4.0, 0.06)
    laws = {"baseline": base, "block": _shifted(base, 1.2), "full": _shifted(base, 1.3)}
    text = write_report("scaling", _records(laws, noise=0.01), tmp_path, "tiny").read_text()
    names = set(re.findall(r"`(attnres(?:\.\w+)+)`", text))
    assert "attnres.experiments.grids.scaling_fit" in names
    for name in names:
        importlib.import_module(name)
