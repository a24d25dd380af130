"""The no-free-lunch study: tasks, models, the resumable grid, the computed findings
and its command line (`python -m studies.no_free_lunch`)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnres.nn import BlockAttnRes, FullAttnRes, StandardResidual
from studies.no_free_lunch.__main__ import main as study_main
from studies.no_free_lunch.findings import claim_status, compute_findings, paired_deltas, index_records, verdict
from studies.no_free_lunch.models import VARIANTS, ResidualMLP, block_size_for, build_residual
from studies.no_free_lunch.study import (
    NFL_PRESETS, Run, apply_config_overrides, build_model, get_config, grid_runs, load_results, run_grid, run_path,
    train_run,
)
from studies.no_free_lunch.tasks import TaskSpec, make_task

TINY = NFL_PRESETS["tiny"]


# -- tasks ---------------------------------------------------------------------------------
def test_task_endpoints_are_exactly_teacher_and_lookup():
    spec = TaskSpec(d_in=5, d_out=3, n_train=40, n_test=30)
    t0, t1 = make_task(0.0, 7, spec), make_task(1.0, 7, spec)
    assert torch.equal(t0.y_train, t0.structured_train)
    assert torch.equal(t1.y_train, t1.lookup)
    assert torch.equal(t0.y_test, t0.structured_test)
    assert torch.equal(t1.y_test, torch.zeros_like(t1.y_test))
    # every lam shares the seed's inputs, teacher and table
    assert torch.equal(t0.x_train, t1.x_train) and torch.equal(t0.lookup, t1.lookup)
    # the teacher is linear: least squares recovers it exactly from the training set
    w = torch.linalg.lstsq(t0.x_train.double(), t0.structured_train.double()).solution
    assert torch.allclose(t0.x_test.double() @ w, t0.structured_test.double(), atol=1e-5)
    # the lookup table is not: the same least squares explains little of it
    w1 = torch.linalg.lstsq(t1.x_train.double(), t1.lookup.double()).solution
    resid = (t1.x_train.double() @ w1 - t1.lookup.double()).pow(2).mean() / t1.lookup.double().pow(2).mean()
    assert resid > 0.6


def test_task_mixture_and_determinism():
    spec = TaskSpec(n_train=4000, n_test=10)
    t = make_task(0.25, 3, spec)
    expected = math.sqrt(0.75) * t.structured_train + math.sqrt(0.25) * t.lookup
    assert torch.allclose(t.y_train, expected, atol=1e-6)
    assert abs(t.y_train.var().item() - 1.0) < 0.05  # unit target variance at every lam
    again, other = make_task(0.25, 3, spec), make_task(0.25, 4, spec)
    for name in ("x_train", "y_train", "x_test", "y_test", "lookup"):
        assert torch.equal(getattr(t, name), getattr(again, name)), name
    assert not torch.equal(t.x_train, other.x_train)


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0.5"])
def test_task_rejects_bad_lambda(bad):
    with pytest.raises(ValueError, match="lam must be a number in \\[0, 1\\]"):
        make_task(bad, 0)


def test_task_spec_names_bad_field():
    with pytest.raises(ValueError, match="TaskSpec.n_train"):
        TaskSpec(n_train=0)


# -- models --------------------------------------------------------------------------------
def test_residual_per_variant():
    assert isinstance(build_residual("standard", 8, 5), StandardResidual)
    assert isinstance(build_residual("full", 8, 5), FullAttnRes)
    block = build_residual("block", 8, 30)
    assert isinstance(block, BlockAttnRes) and block.block_size == 4 == block_size_for(30)
    assert [block_size_for(d) for d in (4, 8, 16, 30)] == [2, 2, 2, 4]
    with pytest.raises(ValueError, match="variant must be one of"):
        build_residual("sigmoid", 8, 5)


def test_standard_model_is_a_plain_residual_mlp():
    """Without norms the standard model is ``h <- h + f(h)``, computed here by hand."""
    torch.manual_seed(0)
    m = ResidualMLP("standard", 4, 2, 8, 3, prenorm=False)
    x = torch.randn(5, 4)
    h = m.embed(x)
    for block in m.blocks:
        h = h + block.down(F.gelu(block.up(h)))
    assert torch.allclose(m(x), m.head(h), atol=1e-6)


def test_attnres_models_start_as_depth_averages():
    """Zero queries: Full AttnRes feeds each sublayer the mean of its sources; sigmoid
    weights give each source 1/2, i.e. half the standard residual's sum."""
    torch.manual_seed(0)
    full = ResidualMLP("full", 4, 2, 8, 3, prenorm=False)
    sig = ResidualMLP("full_sigmoid", 4, 2, 8, 3, prenorm=False)
    sig.load_state_dict(full.state_dict())
    x = torch.randn(5, 4)
    srcs = [full.embed(x)]
    for block in full.blocks:
        srcs.append(block.down(F.gelu(block.up(torch.stack(srcs).mean(0)))))
    assert torch.allclose(full(x), full.head(torch.stack(srcs).mean(0)), atol=1e-5)
    srcs = [sig.embed(x)]
    for block in sig.blocks:
        srcs.append(block.down(F.gelu(block.up(0.5 * torch.stack(srcs).sum(0)))))
    assert torch.allclose(sig(x), sig.head(0.5 * torch.stack(srcs).sum(0)), atol=1e-5)


def test_prenorm_sigmoid_variant_starts_as_the_standard_network():
    """sigmoid(0) = 1/2 halves every mixed input of the standard sum, and every consumer of it
    is an RMSNorm under PreNorm: at init the two networks are one function (not so without
    normalisation), so the sigmoid variant differs from standard only by what it learns."""
    x = torch.randn(7, 4)
    nets = {}
    for v in ("standard", "full_sigmoid"):
        for prenorm in (True, False):
            torch.manual_seed(0)
            nets[v, prenorm] = ResidualMLP(v, 4, 2, 8, 5, prenorm=prenorm)(x)
    assert torch.allclose(nets["standard", True], nets["full_sigmoid", True], atol=1e-4)
    assert not torch.allclose(nets["standard", False], nets["full_sigmoid", False], atol=1e-2)


def test_variants_share_initial_mlp_weights():
    ref = build_model(TINY, Run("prenorm", "standard", 3, 0.0, 5)).state_dict()
    for v in VARIANTS[1:]:
        sd = build_model(TINY, Run("prenorm", v, 3, 0.0, 5)).state_dict()
        for k in ("embed.weight", "blocks.2.up.weight", "head.bias"):
            assert torch.equal(sd[k], ref[k]), (v, k)
    other_seed = build_model(TINY, Run("prenorm", "standard", 3, 0.0, 6)).state_dict()
    assert not torch.equal(other_seed["embed.weight"], ref["embed.weight"])


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("norm", ["prenorm", "no_norm"])
def test_every_variant_trains(variant, norm, monkeypatch):
    config = apply_config_overrides(TINY, ["steps=4"])
    run = Run(norm, variant, 3, 0.5, 0)
    before = build_model(config, run)
    record = train_run(config, run)
    assert not record["diverged"] and math.isfinite(record["train_loss"]) and math.isfinite(record["test_loss"])
    assert len(record["hidden_rms"]) == 3 + 1
    assert record["block_size"] == (2 if variant == "block" else None)
    # training moved the weights: retrain by hand, keeping the model
    captured = {}
    real = build_model

    def keep(cfg, r):
        captured["m"] = real(cfg, r)
        return captured["m"]

    monkeypatch.setattr("studies.no_free_lunch.study.build_model", keep)
    again = train_run(config, run)
    assert again["train_loss"] == record["train_loss"]  # deterministic
    after = captured["m"].state_dict()
    assert not torch.equal(after["blocks.0.up.weight"], before.state_dict()["blocks.0.up.weight"])
    if variant != "standard":  # the zero queries learn
        queries = [p for n, p in captured["m"].residual.named_parameters() if n.endswith("query")]
        assert queries and any(q.abs().sum() > 0 for q in queries)
    assert record["residual_params"] == (0 if variant == "standard" else 2 * 4 * config.width)


# -- the grid ------------------------------------------------------------------------------
def _fake_train(calls):
    def train(config, run):
        calls.append(run)
        return {"norm": run.norm, "variant": run.variant, "depth": run.depth, "lam": run.lam, "seed": run.seed,
                "train_loss": 1.0, "test_loss": 1.0, "diverged": False, "wall_s": 0.0}
    return train


def test_grid_skips_finished_runs_and_resumes(tmp_path):
    calls = []
    n_runs = len(TINY.lams) * len(TINY.depths) * len(TINY.norms) * len(TINY.variants)
    records = run_grid(TINY, tmp_path, [0], "tiny", progress=False, train=_fake_train(calls))
    assert len(calls) == len(records) == n_runs
    calls.clear()
    run_grid(TINY, tmp_path, [0], "tiny", progress=False, train=_fake_train(calls))
    assert calls == []  # everything finished: nothing re-runs
    victim = grid_runs(TINY, [0])[5]
    run_path(tmp_path, victim).unlink()
    run_grid(TINY, tmp_path, [0, 1], "tiny", progress=False, train=_fake_train(calls))
    assert calls[0] == victim and len(calls) == 1 + n_runs and {r.seed for r in calls[1:]} == {1}
    assert len(load_results(tmp_path)) == 2 * n_runs


def test_interrupted_grid_keeps_finished_runs(tmp_path):
    calls = []

    def dies(config, run):
        if len(calls) == 3:
            raise KeyboardInterrupt
        return _fake_train(calls)(config, run)

    with pytest.raises(KeyboardInterrupt):
        run_grid(TINY, tmp_path, [0], "tiny", progress=False, train=dies)
    assert len(load_results(tmp_path)) == 3 and not list((tmp_path / "records").glob("*.tmp"))
    calls.clear()
    run_grid(TINY, tmp_path, [0], "tiny", progress=False, train=_fake_train(calls))
    assert len(calls) == len(grid_runs(TINY, [0])) - 3


def test_grid_refuses_another_configuration(tmp_path):
    run_grid(TINY, tmp_path, [0], "tiny", progress=False, train=_fake_train([]))
    with pytest.raises(ValueError, match=r"differs in \['steps'\]"):
        run_grid(apply_config_overrides(TINY, ["steps=9"]), tmp_path, [0], "tiny", progress=False,
                 train=_fake_train([]))
    with pytest.raises(ValueError, match="variants must be names"):
        run_grid(TINY, tmp_path, [0], "tiny", variants=["ful"], progress=False, train=_fake_train([]))


def test_grid_order_is_seed_major_and_variants_filter():
    runs = grid_runs(TINY, [0, 1], variants=["standard", "full"])
    assert {r.variant for r in runs} == {"standard", "full"}
    assert [r.seed for r in runs] == sorted(r.seed for r in runs)


def test_config_overrides_and_errors():
    c = apply_config_overrides(get_config("cpu"), ["steps=50", "depths=[4, 8]", "lr=1", "impl=two_phase"])
    assert (c.steps, c.depths, c.lr, c.impl) == (50, (4, 8), 1.0, "two_phase")
    with pytest.raises(ValueError, match="key one of"):
        apply_config_overrides(TINY, ["stpes=3"])
    with pytest.raises(ValueError, match="impl must be one of"):
        apply_config_overrides(TINY, ["impl=fast"])
    with pytest.raises(ValueError, match="lams must be"):
        apply_config_overrides(TINY, ["lams=[0, 2]"])
    with pytest.raises(ValueError, match="variants must be names .* including 'standard'"):
        apply_config_overrides(TINY, ["variants=[full]"])
    with pytest.raises(ValueError, match="preset must be one of"):
        get_config("small")
    cpu = get_config("cpu")  # the committed grid is the one the issue asks for
    assert cpu.lams == (0.0, 0.25, 0.5, 0.75, 1.0) and cpu.depths == (4, 8, 16, 30) and cpu.width == 64
    assert set(cpu.variants) == set(VARIANTS) and set(cpu.norms) == {"prenorm", "no_norm"}


# -- findings on synthetic results -----------------------------------------------------------
def _records(losses, seeds=(0, 1, 2), depths=(4, 30), lams=(0.0, 1.0), norms=("prenorm", "no_norm")):
    """Records whose loss is ``losses(norm, variant, depth, lam, metric, seed)``."""
    out = []
    for norm in norms:
        for v in VARIANTS:
            for d in depths:
                for lam in lams:
                    for s in seeds:
                        out.append({"norm": norm, "variant": v, "depth": d, "lam": lam, "seed": s, "diverged": False,
                                    "train_loss": losses(norm, v, d, lam, "train_loss", s),
                                    "test_loss": losses(norm, v, d, lam, "test_loss", s)})
    return out


def _status(claims, statement_start, variant, norm):
    found = [c for c in claims if c.statement.startswith(statement_start) and c.variant == variant and c.norm == norm]
    assert len(found) == 1, (statement_start, variant, norm, [c.statement for c in claims])
    return found[0].status


def _critique_world(norm, v, d, lam, metric, s):
    """The critique's world without norm: AttnRes better on structure, worse on memorisation,
    both gaps growing with depth; with PreNorm AttnRes better everywhere. Sigmoid weights
    memorise like the standard residual."""
    if v == "standard":
        return 1.0
    jitter = 1 + 0.01 * s
    if norm == "prenorm":
        return 0.8 * jitter
    if v == "full_sigmoid" and metric == "train_loss":
        return 1.0 - 0.001 * (s + 1)  # a hair below standard: better than softmax Full
    if lam == 0.0:
        return (0.9 if d == 4 else 0.5) * jitter
    return (1.1 if d == 4 else 2.0) * jitter


def test_findings_reproduce_the_critique_world():
    claims = compute_findings(_records(_critique_world))
    for v in ("full", "block"):
        assert _status(claims, "AttnRes wins on the structured task", v, "no_norm") == "holds"
        assert _status(claims, "... and by more as depth grows", v, "no_norm") == "holds"
        assert _status(claims, "the standard residual wins on memorisation", v, "no_norm") == "holds"
        assert _status(claims, "... the memorisation gap moving", v, "no_norm") == "holds"
        assert _status(claims, "about equal at depth 4", v, "no_norm") == "holds"
        assert _status(claims, "the standard residual wins on memorisation", v, "prenorm") == "contradicted"
    assert _status(claims, "with PreNorm AttnRes wins", "full+block", "prenorm") == "holds"
    assert _status(claims, "AttnRes's losses come from the setting without", "full+block", "") == "holds"
    assert _status(claims, "removing the sum-to-one", "full_sigmoid", "no_norm") == "holds"
    assert _status(claims, "where softmax Full AttnRes loses", "full_sigmoid", "no_norm") == "holds"
    assert _status(claims, "where softmax Full AttnRes loses", "full_sigmoid", "prenorm") == "no claim"


def test_findings_make_no_claim_with_fewer_than_three_seeds():
    claims = compute_findings(_records(_critique_world, seeds=(0, 1)))
    assert claims and all(c.status == "no claim" for c in claims), [(c.statement, c.status) for c in claims]


def test_findings_make_no_claim_when_seeds_disagree():
    def flip(norm, v, d, lam, metric, s):
        return 1.0 if v == "standard" else (0.5 if s == 1 else 2.0)

    claims = compute_findings(_records(flip))
    assert all(c.status == "no claim" for c in claims), [(c.statement, c.status) for c in claims]


def test_verdict_and_status_rules():
    assert verdict([-0.1, -0.2, -0.3]).sign == -1
    assert verdict([0.1, 0.2, 0.3, 0.1]).sign == 1
    assert verdict([-0.1, -0.2]).sign == 0 and "fewer than 3" in verdict([-0.1, -0.2]).reason
    assert verdict([-0.1, -0.2, 0.0]).sign == 0  # a tie is not agreement
    assert verdict([-0.1, -0.2, 0.3]).reason.startswith("seeds disagree")
    assert claim_status([-1, -1], -1) == "holds" and claim_status([-1, 0], -1) == "holds in part"
    assert claim_status([1, 1], -1) == "contradicted" and claim_status([1, 0], -1) == "contradicted in part"
    assert claim_status([1, -1], -1) == "mixed" and claim_status([0, 0], -1) == "no claim"


def test_diverged_run_counts_as_infinite_loss():
    recs = [{"norm": "prenorm", "variant": v, "depth": 4, "lam": 0.0, "seed": s, "diverged": v == "full" and s == 0,
             "train_loss": None if (v == "full" and s == 0) else 1.0, "test_loss": 1.0} for v in ("standard", "full")
            for s in range(3)]
    d = paired_deltas(index_records(recs), "prenorm", "full", 4, 0.0, "train_loss")
    assert d[0] == math.inf and d[1] == 0.0
    assert verdict(d.values()).mean is None


# -- CLI -----------------------------------------------------------------------------------
def test_cli_runs_grid_and_report(tmp_path):
    out = tmp_path / "nfl"
    args = ["--preset", "tiny", "--out", str(out), "--seeds", "0", "1", "2",
            "steps=2", "--variants", "standard", "full"]
    assert study_main(args) == 0
    recs = load_results(out)
    assert {r["variant"] for r in recs} == {"standard", "full"} and {r["seed"] for r in recs} == {0, 1, 2}
    assert all(r["steps"] == 2 for r in recs)
    assert json.loads((out / "experiment.json").read_text())["config"]["steps"] == 2
    report = (out / "report.md").read_text()
    assert "## Findings (computed)" in report and "--seeds 0 1 2" in report and "steps=2" in report
    assert "## Effect sizes with intervals" in report and "= 25%" in report and "p=" in report
    assert (out / "gap_train_loss.png").exists() and (out / "gap_test_loss.png").exists()
    assert study_main(["--preset", "tiny", "--out", str(out), "steps=2",
                     "--report-only"]) == 0  # the report's command names every seed in `out`, not only the default 0
    assert "--seeds 0 1 2" in (out / "report.md").read_text()
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "records").glob("*.json")}
    assert study_main(args) == 0  # finished: nothing re-runs
    assert {p: p.stat().st_mtime_ns for p in (out / "records").glob("*.json")} == mtimes


def test_cli_errors_name_the_problem(tmp_path, capsys):
    with pytest.raises(SystemExit, match="preset must be one of"):
        study_main(["--preset", "small", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="key one of"):
        study_main(["--preset", "tiny", "--out", str(tmp_path), "stepz=3"])
    with pytest.raises(SystemExit, match="no finished no-free-lunch runs"):
        study_main(["--preset", "tiny", "--out", str(tmp_path / "empty"), "--report-only"])


# -- effect sizes and the decided-cell rule's false-call rate ----------------------------------
def test_decided_cell_rule_passes_a_no_effect_cell_a_quarter_of_the_time():
    """With 3 seeds and no effect, all three paired gaps share a sign with probability 2 * (1/2)^3:
    checked exactly and by simulation through the rule itself (`verdict`), for normal and
    heavy-tailed symmetric seed noise."""
    from studies.no_free_lunch.effects import sign_rule_pass_rate

    assert [sign_rule_pass_rate(n) for n in (1, 2, 3, 4)] == [1.0, 0.5, 0.25, 0.125]
    with pytest.raises(ValueError, match="n_seeds"):
        sign_rule_pass_rate(0)
    rng = np.random.default_rng(0)
    for noise in (rng.normal(size=(20_000, 3)), rng.standard_t(2, size=(20_000, 3))):
        passed = sum(verdict(row).sign != 0 for row in noise.tolist()) / len(noise)
        assert passed == pytest.approx(0.25, abs=0.012)  # 4 binomial standard errors


def test_paired_effect_is_the_paired_t_test():
    from scipy import stats

    from studies.no_free_lunch.effects import paired_effect

    gaps = [0.1, 0.2, 0.3]
    e = paired_effect(gaps)
    half = stats.t.ppf(0.975, 2) * 0.1 / math.sqrt(3)
    assert e.mean == pytest.approx(0.2) and (e.low, e.high) == pytest.approx((0.2 - half, 0.2 + half))
    assert e.p_value == pytest.approx(stats.ttest_1samp(gaps, 0.0).pvalue)
    assert e.text() == "+58 % [-11, +181] p=0.074" and e.excludes_zero() == 0
    assert paired_effect([-0.3, -0.31, -0.29]).excludes_zero() == -1
    assert paired_effect([math.inf, math.nan]) is None and paired_effect([0.1]).low is None


def test_effects_summary_adjusts_for_the_cells_and_tests_patterns_at_the_seed_level():
    """Many cells read at once: each cell's small, noisy effect rarely survives Holm's
    adjustment, but the pattern - averaged per seed over its cells, one test over the seeds -
    does when every seed shows it."""
    from studies.no_free_lunch.findings import index_records
    from studies.no_free_lunch.report import _effects_summary

    rng = np.random.default_rng(0)
    seed_shift = {0: 0.03, 1: 0.05, 2: 0.04}  # AttnRes's test loss 7-12 % higher in every seed
    records = []
    for depth in (4, 8, 16):
        for lam in (0.0, 0.25, 0.5, 0.75):
            for seed in range(3):
                records.append(dict(norm="prenorm", variant="standard", depth=depth, lam=lam, seed=seed,
                                    train_loss=1.0, test_loss=1.0))
                gap = seed_shift[seed] + rng.normal(0, 0.03)
                records.append(dict(norm="prenorm", variant="full", depth=depth, lam=lam, seed=seed,
                                    train_loss=1.0, test_loss=10**gap))
    text = _effects_summary(index_records(records), ["prenorm"], ["full"], 0.95)
    kept = re.search(r"after Holm's adjustment over the 24 cells: (\d+) and (\d+)", text)
    assert kept and int(kept.group(2)) < 3
    line = next(x for x in text.splitlines() if "test loss at 0 < λ < 1" in x)
    assert "(9 cells, 3 seeds)" in line and float(line.rsplit("p=", 1)[1]) < 0.05
