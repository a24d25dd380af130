"""The compute-multiplier experiment: the preset's plan, reading the multiplier off a standard
ladder (known multipliers recovered on synthetic power-law runs), the coverage of its
interval in a seeded simulation, the report on a partial grid, and the refusal of runs that
would see their data twice."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("scipy")
pytest.importorskip("matplotlib")

from attnres.experiments import get_experiment, run_experiment  # noqa: E402
from attnres.experiments.grids.multiplier import ladder_crossing, ladder_loss, seed_multipliers  # noqa: E402
from attnres.experiments.grids.multiplier_report import compare_arms, multiplier_section  # noqa: E402
from attnres.experiments.job.presets import multiplier_grid  # noqa: E402
from attnres.experiments.job.runner import run_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

LADDER = (0.8, 1.0, 1.25, 1.6)


def test_cpu_preset_is_the_planned_grid():
    """Deep 12 x 64 with Block S = 3 (N = 8 blocks, the report's structure) and shallow 6 x 96;
    AttnRes at T, the standard model at the ladder's multiples of T, each run with its own
    WSD schedule and the same warm-up; every run within one pass over the data."""
    exp = get_experiment("multiplier", "cpu")
    grid = multiplier_grid("cpu")
    assert exp.max_data_passes == 1.0 and grid.seeds == 6 and grid.ladder == LADDER
    by = {v.name: run_config(exp, v, 0, Path("unused")) for v in exp.variants}
    assert [by[f"deep_standard_x{f:g}"].steps for f in LADDER] == [448, 560, 700, 896]
    assert by["deep_block"].model.residual.block_size == 3 and by["deep_block"].model.n_layers == 12
    assert by["shallow_block"].model.residual.block_size == 2 and by["shallow_full"].model.d_model == 96
    assert {c.warmup_steps for c in by.values()} == {50} and {c.schedule for c in by.values()} == {"wsd"}
    assert {c.steps for n, c in by.items() if "standard" not in n} == {grid.budget}
    # big.txt's training split holds 1,874,335 tokens of the BPE-4096 (14,643 windows of 128):
    # the longest run draws 896 x 16 = 14,336 of them
    assert max(c.steps for c in by.values()) * 16 <= 1_874_335 // 128


def _power_law(c, seed_shift=0.0, floor=0.0):
    return floor + (5.0 + seed_shift) * c**-0.07


def test_crossing_recovers_a_known_multiplier_on_a_power_law():
    ladder = [(f, _power_law(f)) for f in LADDER]
    for m in (0.85, 1.0, 1.1, 1.25, 1.5):
        got = ladder_crossing(ladder, _power_law(m))
        assert got.compute == pytest.approx(m, rel=1e-9)
        assert not got.extrapolated and got.method == "interpolated"
    for m in (0.5, 2.5):  # outside the ladder: along the end segment, flagged
        got = ladder_crossing(ladder, _power_law(m))
        assert got.compute == pytest.approx(m, rel=1e-9) and got.extrapolated
    # with an irreducible loss the law is not a line in (ln C, ln L): interpolation between
    # neighbouring rungs is still within 0.2 % of the truth
    curved = [(f, _power_law(f, floor=2.0)) for f in LADDER]
    assert ladder_crossing(curved, _power_law(1.18, floor=2.0)).compute == pytest.approx(1.18, rel=2e-3)
    assert ladder_loss(ladder, 1.1)[0] == pytest.approx(_power_law(1.1), rel=1e-12)


def test_a_ladder_that_does_not_fall_is_read_from_its_fit_or_refused():
    noisy = [(0.8, 4.00), (1.0, 3.95), (1.25, 3.96), (1.6, 3.90)]
    got = ladder_crossing(noisy, 3.93)
    assert got.method == "fit" and 1.0 < got.compute < 1.6
    with pytest.raises(ValueError, match="does not fall with compute"):
        ladder_crossing([(1.0, 3.9), (2.0, 4.0)], 3.95)
    with pytest.raises(ValueError, match=">= 2 distinct positive computes"):
        ladder_crossing([(1.0, 3.9)], 3.95)
    flat = [{"seed": 4, "val_loss": loss, "flops": c} for c, loss in [(1.0, 3.9), (2.0, 4.0)]]
    with pytest.raises(ValueError, match="seed 4, run 'deep_block': the ladder's loss does not fall"):
        seed_multipliers(flat, [{"seed": 4, "variant": "deep_block", "val_loss": 3.95, "flops": 1.0}])


def _records(multipliers: dict[str, float], seeds, noise: float = 0.0, rng=None, shapes=("deep",)) -> list[dict]:
    """Synthetic run records of a multiplier grid: the standard ladder on a power law with a
    per-seed offset, each AttnRes family at compute 1 (x its FLOPs ratio) with the loss the
    ladder reaches at ``m`` times that compute, plus independent noise per run."""
    rng = rng if rng is not None else np.random.default_rng(0)
    out = []
    for shape_i, shape in enumerate(shapes):
        for k in seeds:
            shift = 0.02 * math.sin(k + shape_i)
            for f in LADDER:
                loss = _power_law(f, shift + 0.05 * shape_i) + noise * rng.standard_normal()
                out.append({"variant": f"{shape}_standard_x{f:g}", "family": "baseline", "seed": k,
                            "coords": {"shape": shape, "budget": f}, "val_loss": loss, "pflops_days": f})
            for family, m in multipliers.items():
                c = 1.02  # AttnRes's FLOPs per token, x the standard model's
                loss = _power_law(m * c, shift + 0.05 * shape_i) + noise * rng.standard_normal()
                out.append({"variant": f"{shape}_{family}", "family": family, "seed": k,
                            "coords": {"shape": shape, "budget": 1.0}, "val_loss": loss, "pflops_days": c})
    for r in out:
        r.update(steps=1, flops_per_token=1.0, non_embedding_params=1, data_passes=0.5)
    return out


def test_seed_multipliers_recover_the_truth_per_seed():
    records = _records({"block": 1.2, "full": 1.1}, seeds=range(4))
    ladder = [r for r in records if r["family"] == "baseline"]
    for family, m in (("block", 1.2), ("full", 1.1)):
        got = seed_multipliers(ladder, [r for r in records if r["family"] == family], "pflops_days")
        assert sorted(got) == [0, 1, 2, 3]
        assert [v for v, _ in got.values()] == pytest.approx([m] * 4, rel=1e-9)


@pytest.mark.parametrize("n_seeds", [2, 6])
def test_multiplier_interval_covers_the_truth_at_its_level(n_seeds):
    """Seeded simulation: runs with independent seed noise on every run (0.01 nats, about the
    grids' seed spread); the 95 % t-interval of the geometric mean multiplier covers the true
    1.2x at its nominal rate, with 2 seeds as with 6 (the paired bootstrap the scaling report
    used covered about 61 % with 2 seeds). 600 simulated grids: the band is 3 binomial sd."""
    rng = np.random.default_rng(1)
    trials, covered = 600, 0
    for _ in range(trials):
        block = next(c for c in compare_arms(_records({"block": 1.2}, range(n_seeds), 0.01, rng)) if c.own_shape)
        t = block.log_mean
        covered += t.low <= math.log(1.2) <= t.high
    band = 3 * math.sqrt(0.95 * 0.05 / trials)
    assert abs(covered / trials - 0.95) < band


def test_report_marks_partial_results_and_uses_complete_seeds_only(tmp_path):
    records = _records({"block": 1.2, "full": 1.1}, range(4), noise=0.002, shapes=("deep", "shallow"))
    # seed 3's ladder is not finished: its Block run must not enter the deep multiplier
    records = [r for r in records if not (r["seed"] == 3 and r["variant"] == "deep_standard_x1.6")]
    text = multiplier_section(records, tmp_path, planned_seeds=6)
    assert "**Partial: 3 of 6 planned seeds complete** (seeds [0, 1, 2]" in text
    deep_block = next(c for c in compare_arms(records) if c.arm == "deep Block AttnRes" and c.own_shape)
    assert sorted(deep_block.multipliers) == [0, 1, 2] and deep_block.incomplete == [3]
    assert math.exp(deep_block.log_mean.mean) == pytest.approx(1.2, rel=0.05)
    assert (tmp_path / "multiplier.png").stat().st_size > 0
    assert "deep Block AttnRes against the shallow standard model at equal compute" in text


def test_runs_that_would_repeat_data_are_refused_before_any_training(tmp_path):
    """The tiny grid's longest standard runs (6 and 8 steps of 2 x 16 tokens) need more
    windows than a 200-byte file holds: refused by name, nothing written."""
    small = tmp_path / "small.txt"
    small.write_text(("the quick brown fox jumps over the lazy dog. " * 5)[:200])
    out = tmp_path / "grid"
    with pytest.raises(ValueError, match=r"at most 1 pass.*deep_standard_x1\.5 seed 0: 1\.\d+.*deep_standard_x2 seed 0"):
        run_experiment(get_experiment("multiplier", "tiny"), out,
                       overrides=[f"data.paths=[{small}]", "data.val_fraction=0.1"], log=lambda _: None)
    assert not out.exists()


def test_a_finished_run_records_its_passes_over_the_data(tmp_path):
    exp = get_experiment("multiplier", "tiny")
    records = run_experiment(exp, tmp_path, variants=["deep_block"], log=lambda _: None)
    config = json.loads((tmp_path / "deep_block" / "seed0" / "config.json").read_text())
    from attnres.data import load_corpus, prepare_data

    n_train = len(prepare_data(load_corpus(), "byte").train)
    assert records[0]["data_passes"] == pytest.approx(config["steps"] * config["batch_size"] / (n_train // config["seq_len"]))


def test_the_stable_phase_reading_recovers_a_known_multiplier_along_one_curve():
    """compare's reading along the constant-learning-rate phase: a standard run on a power law
    in steps and an AttnRes run that is worth 1.2x its compute (at 1.02x the FLOPs per token);
    beyond the standard curve's end the reading is a bound, not a number."""
    from attnres.experiments.job.compare import BASELINE, Run, stable_phase_multipliers
    from attnres.experiments.grids.multiplier import curve_crossing

    steps = list(range(100, 1100, 100))

    def run(variant, seed, factor, flops):
        losses = [5.0 * (s * factor) ** -0.1 for s in steps]
        return Run({"variant": variant, "seed": seed, "flops_per_token": flops, "val_loss": losses[-1],
                    "steps": steps[-1], "flops": flops * steps[-1]}, eval_steps=steps, val_loss=losses)

    assert curve_crossing(steps, [5.0 * s**-0.1 for s in steps], 5.0 * 450**-0.1) == pytest.approx(450)
    assert curve_crossing(steps, [5.0 * s**-0.1 for s in steps], 1.0) is None
    groups = {BASELINE: [run(BASELINE, k, 1.0, 1.0) for k in range(3)],
              "block": [run("block", k, 1.2 * 1.02, 1.02) for k in range(3)]}
    found = stable_phase_multipliers(groups, start=1000, points=4)["block"]
    assert sorted(found) == [100, 400, 700, 1000]
    for s in (100, 400, 700):
        interval, bounds = found[s]
        assert math.exp(interval.mean) == pytest.approx(1.2, rel=1e-3) and not bounds
    interval, bounds = found[1000]  # 1.2 x 1000 steps is past the curve's end
    assert interval is None and bounds == [(">", pytest.approx(1 / 1.02))] * 3


def test_a_single_seed_gives_a_multiplier_without_an_interval(tmp_path):
    text = multiplier_section(_records({"block": 1.2}, [0], shapes=("deep", "shallow")), tmp_path, planned_seeds=6)
    assert "- deep Block AttnRes: 1.200× over 1 seed(s): no interval yet" in text
    assert "includes the report's" not in text and "(no interval yet; n = 1)" in text


@pytest.mark.parametrize("scale", [0.8e-12, 0.8e-7, 1e-7, 0.5e-7])
def test_the_compute_axis_labels_do_not_run_into_one_another(tmp_path, monkeypatch, scale):
    """The ladder spans 0.8-1.6 T, under a decade: matplotlib labelled every minor tick of
    the log compute axis as ``8×10^-8``, and results/multiplier/multiplier.png read
    "7×10^-8 8×10^-8 9×10^-8 10^-7" run together. Each label shown stands apart."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from attnres.experiments.grids.multiplier_report import _plot

    matplotlib.use("Agg")
    saved, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *args, **kwargs: (saved.append(fig), save(fig, *args, **kwargs)))
    records = _records({"block": 1.2, "full": 1.1}, range(2), shapes=("deep", "shallow"))
    for r in records:
        r["pflops_days"] *= scale
    _plot(records, tmp_path)
    (fig,) = saved
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        shown = sorted((t.label1.get_window_extent(renderer) for t in ax.xaxis.get_major_ticks()
                        + ax.xaxis.get_minor_ticks() if t.label1.get_visible() and t.label1.get_text()
                        and lo <= t.get_loc() <= hi), key=lambda box: box.x0)
        assert len(shown) >= 2, [t.get_text() for t in ax.get_xticklabels(which="both")]
        # apart by at least half a label's height (about a space): 3 px read as one run of text
        assert all(b.x0 - a.x1 >= a.height / 2 for a, b in zip(shown, shown[1:])), [(b.x0, b.x1) for b in shown]
