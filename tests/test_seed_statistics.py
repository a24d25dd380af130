"""Seed-level statistics of the experiment reports (attnres.experiments.stats): Student-t
intervals against scipy's tests, their coverage with 2 seeds, power, Holm's adjustment, and
how the ablation and compare reports use them."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("scipy")
from scipy import optimize, stats  # noqa: E402

from attnres.experiments.stats import (  # noqa: E402
    detectable_effect,
    holm,
    mean_difference,
    pooled_sd,
    t_interval,
    t_test_power,
)


def test_t_interval_matches_scipys_one_sample_test():
    values = [0.3, -0.1, 0.5, 0.2]
    t = t_interval(values, null=0.1)
    ref = stats.ttest_1samp(values, 0.1)
    assert t.p_value == pytest.approx(ref.pvalue, rel=1e-10) and t.df == 3
    low, high = ref.confidence_interval(0.95)
    assert (t.low, t.high) == pytest.approx((low, high), rel=1e-10)
    assert t_interval([1.0]).low is None and t_interval([2.0, 2.0]).p_value is None
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_interval([1.0, 2.0], sd=0.5)


def test_mean_difference_with_the_two_groups_pooled_is_students_two_sample_test():
    a, b = [5.1, 5.3, 5.2], [5.4, 5.6]
    sd, df = pooled_sd([a, b])
    d = mean_difference(a, b, sd, df)
    ref = stats.ttest_ind(a, b, equal_var=True)
    assert d.p_value == pytest.approx(ref.pvalue, rel=1e-10) and d.df == 3 and d.n == 5
    # the interval inverts the test: the shifts of a that Student's test keeps at 5 % (scipy
    # 1.10, the experiments extra's lowest, has no ttest_ind(...).confidence_interval)
    def p_minus_level(shift):
        return stats.ttest_ind([x - shift for x in a], b, equal_var=True).pvalue - 0.05

    est = np.mean(a) - np.mean(b)
    low = optimize.brentq(p_minus_level, est - 10.0, est, xtol=1e-15)
    high = optimize.brentq(p_minus_level, est, est + 10.0, xtol=1e-15)
    assert (d.low, d.high) == pytest.approx((low, high), rel=1e-9)


@pytest.mark.parametrize("n", [2, 3, 6])
def test_t_interval_covers_the_mean_at_its_level_with_few_seeds(n):
    """4000 seeded samples of n normal values: the 95 % interval covers the true mean 95 % of
    the time (band: 3 binomial sd), with 2 values too; mean ± 0.71·|d0 − d1|, what a paired
    bootstrap over 2 seeds gives, covers about 61 %."""
    rng = np.random.default_rng(n)
    samples = rng.normal(1.0, 0.01, (4000, n))
    covered = np.mean([t.low <= 1.0 <= t.high for t in map(t_interval, samples)])
    assert abs(covered - 0.95) < 3 * math.sqrt(0.95 * 0.05 / 4000)
    if n == 2:
        half = 0.71 * np.abs(samples[:, 0] - samples[:, 1])
        boot = np.mean(np.abs(samples.mean(axis=1) - 1.0) <= half)
        assert 0.56 < boot < 0.66


def test_power_and_the_detectable_effect_agree():
    # no effect: the test's size (scipy 1.10's noncentral t is 6e-11 off the central one there)
    assert t_test_power(0.0, 1.0, 5) == pytest.approx(0.05, abs=1e-9)
    d = detectable_effect(0.01, 5, power=0.8)
    assert t_test_power(d, 0.01, 5) == pytest.approx(0.8, abs=1e-6)
    assert detectable_effect(0.01, 50) < d  # more degrees of freedom, smaller detectable effect
    # a large noncentrality on 1 df, where scipy's lower-tail nct.cdf returns nan
    assert t_test_power(0.08, 0.001, 1) == pytest.approx(1.0, abs=0.05)


def test_holm_adjusts_step_down_and_keeps_missing_values():
    assert holm([0.01, 0.04, None, 0.03]) == pytest.approx([0.03, 0.06, None, 0.06])
    assert holm([0.5, 0.9]) == [1.0, 1.0] and holm([]) == []


def test_ablation_differences_without_a_shared_seed_pool_the_seed_variance_and_adjust_for_every_variant():
    """Runs that share no seed with the baseline (records without one here) cannot be paired:
    difference of the means, the seed sd pooled over every variant, each cell saying so."""
    from attnres.experiments.job.report import baseline_differences

    losses = {"baseline": [5.0, 5.02], "a": [4.9, 4.92], "b": [5.01, 4.99], "c": [5.3, 5.32]}
    records = [{"variant": v, "val_loss": x} for v, xs in losses.items() for x in xs]
    cells, note = baseline_differences(records)
    assert set(cells) == {"a", "b", "c"} and "on 4 degrees of freedom" in note and "3 variants" in note
    sd, df = pooled_sd(losses.values())
    d = mean_difference(losses["a"], losses["baseline"], sd, df)
    adjusted = holm([mean_difference(losses[v], losses["baseline"], sd, df).p_value for v in "abc"])
    assert cells["a"] == f"{d.text('+.4f')} (unpaired; p = {d.p_value:.2g}; Holm {adjusted[0]:.2g})"
    assert "unpaired (a, b, c: no seed in common with the baseline)" in note and "paired:" not in note
    assert baseline_differences([r for r in records if r["variant"] != "baseline"]) == ({}, "")


def _seeded(losses: dict[str, dict[int, float]]) -> list[dict]:
    return [{"variant": v, "seed": seed, "val_loss": x, "family": v, "coords": {}, "params": 10, "residual_params": 0}
            for v, by_seed in losses.items() for seed, x in by_seed.items()]


def test_ablation_differences_pair_the_runs_of_a_seed_as_compare_does():
    """The ablation and block-size tables took every Δ from unpaired means with a pooled sd,
    where `attnres compare` pairs the runs of a seed (the same batches and initial draws).
    Where a variant ran the baseline's seeds, Δ is the mean of the per-seed differences with
    its sd from those differences, over the seeds both ran; unpaired only where no seed is
    shared; the cells and the note say which."""
    from attnres.experiments.job.report import _ablation_md, baseline_differences, summarize

    losses = {"baseline": {0: 5.00, 1: 5.10, 2: 4.95}, "a": {0: 4.96, 1: 5.05, 2: 4.92},
              "b": {0: 5.02, 1: 5.08}, "c": {7: 4.90, 8: 4.97}}
    records = _seeded(losses)
    cells, note = baseline_differences(records)
    diffs = {v: [x - losses["baseline"][s] for s, x in losses[v].items()] for v in "ab"}
    t = {v: t_interval(d) for v, d in diffs.items()}
    sd, df = pooled_sd([list(by_seed.values()) for by_seed in losses.values()])
    u = mean_difference(list(losses["c"].values()), list(losses["baseline"].values()), sd, df)
    adjusted = holm([t["a"].p_value, t["b"].p_value, u.p_value])
    assert cells["a"] == f"{t['a'].text('+.4f')} (paired, n=3; p = {t['a'].p_value:.2g}; Holm {adjusted[0]:.2g})"
    assert cells["b"] == f"{t['b'].text('+.4f')} (paired, n=2; p = {t['b'].p_value:.2g}; Holm {adjusted[1]:.2g})"
    assert cells["c"] == f"{u.text('+.4f')} (unpaired; p = {u.p_value:.2g}; Holm {adjusted[2]:.2g})"
    # the shared seed effect (seed 1 harder for every model) is left out of the paired interval
    assert t["a"].high < 0 and t["a"].high - t["a"].low < 0.05
    assert "paired: the variant's run minus the baseline's run of the same seed" in note
    assert f"unpaired (c: no seed in common with the baseline): difference of the mean losses" in note
    assert f"({sd:.4f} on {df} degrees of freedom)" in note and "3 variants" in note
    table = _ablation_md(summarize(records), records)
    assert cells["a"] in table and cells["c"] in table and note in table
    # every variant paired: no pooled sd is named
    cells, note = baseline_differences(_seeded({v: losses[v] for v in ("baseline", "a")}))
    assert "(paired, n=3;" in cells["a"] and "unpaired" not in note and "pooled" not in note
    # one seed each: no spread to give an interval from, as before
    assert baseline_differences(_seeded({"baseline": {0: 5.0}, "a": {0: 4.9}})) == ({}, "")


def test_ablation_differences_of_one_shared_seed_are_unpaired_and_holm_counts_the_cells_with_a_p():
    """A variant that shares one seed with the baseline had a paired cell of that seed's
    difference alone ("paired, n=1"): no interval, its other seeds unused, and the note's
    Holm family counted it though it had no p. Fewer than two shared seeds is unpaired, with
    every seed; a cell without a p-value (identical differences: no spread) is no part of the
    family the note names."""
    from attnres.experiments.job.report import baseline_differences

    losses = {"baseline": {0: 5.0, 1: 5.5, 2: 5.25}, "a": {0: 4.9, 1: 5.45, 2: 5.2}, "b": {0: 4.95, 7: 5.1},
              "e": {0: 4.75, 1: 5.25}}
    cells, note = baseline_differences(_seeded(losses))
    sd, df = pooled_sd([list(by_seed.values()) for by_seed in losses.values()])
    u = mean_difference(list(losses["b"].values()), list(losses["baseline"].values()), sd, df)
    assert cells["b"].startswith(f"{u.text('+.4f')} (unpaired; p = ")
    assert "unpaired (b: one seed in common, no spread to pair)" in note
    assert cells["e"] == "-0.2500 (paired, n=2)"  # (the same difference at both seeds: no interval, no p)
    assert "Holm's adjustment over the 2 variants compared" in note


def test_compare_findings_say_when_the_interval_includes_zero():
    from attnres.experiments.job.compare import _findings

    (resolved,) = _findings({}, {"block": {"steps": [-0.05, -0.04, -0.06]}})
    assert resolved.startswith("Block AttnRes at equal steps: lower validation loss than the standard model by 0.0500 "
                               "(95 % t-interval [")
    (unresolved,) = _findings({}, {"block": {"compute": [-0.02, 0.01, -0.005]}})
    assert "no difference from the standard model resolved" in unresolved and "better in 2/3" in unresolved
