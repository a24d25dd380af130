"""Experiment grids (issue 5): presets, runner, resumability, FLOPs, aggregation, reports."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("scipy")
pytest.importorskip("matplotlib")
pytest.importorskip("yaml")

from attnres import ModelConfig  # noqa: E402
from attnres.cli import EXPERIMENT_NAMES  # noqa: E402
from attnres.cli import main as cli_main  # noqa: E402
from attnres.experiments import (  # noqa: E402
    EXPERIMENTS,
    PFLOPS_DAY,
    PRESETS,
    arch_shape,
    fit_power_law,
    get_experiment,
    load_records,
    mean_std,
    run_experiment,
    summarize,
    to_pflops_days,
    training_flops_per_token,
    write_report,
)
from attnres.experiments.flops import matmul_parameters, non_embedding_parameters  # noqa: E402
from attnres.models import AttnResLM  # noqa: E402
from attnres.train.metrics import read_metrics  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every daft zebra".split()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 12)) for _ in range(300)))
    return path


def test_cli_lists_every_experiment_and_its_presets(capsys):
    from attnres.cli import main as cli_main
    from attnres.cli.experiment import GRID_PRESETS

    assert EXPERIMENT_NAMES == EXPERIMENTS
    assert GRID_PRESETS == PRESETS  # (the help listed 'small' for every grid; three refuse it)
    with pytest.raises(SystemExit):
        cli_main(["experiment", "--help"])
    assert "scaling: 'tiny', 'cpu' (default);" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(("name", "preset"), [(n, p) for n in EXPERIMENTS for p in PRESETS[n]])
def test_presets_build_valid_configs(name, preset, tmp_path):
    from attnres.experiments.job.runner import run_config

    exp = get_experiment(name, preset)
    names = [v.name for v in exp.variants]
    assert len(names) == len(set(names))
    for v in exp.variants:
        run_config(exp, v, 0, tmp_path / v.name)  # validates


def test_preset_contents():
    ablation = {v.name for v in get_experiment("ablation", "cpu").variants}
    assert {"baseline", "denseformer", "mhc", "full", "block_s4", "block-key_norm", "full+sigmoid"} <= ablation
    sizes = [v.coords["S"] for v in get_experiment("block-size", "cpu").variants if "S" in v.coords]
    assert sizes == [1, 2, 4, 8, 16]  # up to L = 16 sublayers
    with pytest.raises(ValueError, match="unknown experiment 'nope'"):
        get_experiment("nope", "tiny")
    with pytest.raises(ValueError, match="unknown preset 'big' for experiment 'scaling'; available: tiny, cpu"):
        get_experiment("scaling", "big")
    with pytest.raises(ValueError, match=r"unknown preset 'tny' \(did you mean 'tiny'\?\) for experiment 'compare'"):
        get_experiment("compare", "tny")
    with pytest.raises(ValueError, match=r"unknown experiment 'ablaton' \(did you mean 'ablation'\?\)"):
        get_experiment("ablaton", "tiny")
    compare = get_experiment("compare", "long")
    assert [v.name for v in compare.variants] == ["standard", "block", "full"]
    assert compare.base["model"]["n_layers"] >= 12  # the issue: at least 12 transformer blocks
    assert compare.variants[1].coords == {"S": 3, "N": 8}  # the report's N = 8 blocks


def test_scaling_preset_follows_the_report_recipe():
    """Sizes grow depth and width together (H = L_b, fixed d / L_b, report Table 2), span at
    least 4x in non-embedding parameters, train a fixed number of tokens per parameter each,
    and Block AttnRes keeps S >= 2 with N = ceil(L / S) blocks."""
    from attnres.experiments.flops import non_embedding_parameters
    from attnres.experiments.job.presets import _SCALING, block_size_for
    from attnres.experiments.job.runner import run_config

    exp = get_experiment("scaling", "cpu")
    sizes = sorted({v.coords["size"] for v in exp.variants})
    assert len(sizes) >= 4 and {v.family for v in exp.variants} == {"baseline", "block", "full"}
    n = {}
    for v in exp.variants:
        config = run_config(exp, v, 0, Path("unused"))
        m = config.model
        assert m.n_heads == m.n_layers and m.d_model == 16 * m.n_layers
        n[v.coords["size"]] = non_embedding_parameters(m)
        tokens = config.steps * config.tokens_per_step
        assert tokens / n[v.coords["size"]] == pytest.approx(_SCALING["cpu"].tokens_per_param, rel=0.02)
        assert config.warmup_steps == config.steps // 20 and config.schedule == "wsd"
        if v.family == "block":
            assert m.residual.block_size == v.coords["S"] >= 2 and v.coords["N"] == math.ceil(2 * m.n_layers / v.coords["S"])
    assert max(n.values()) / min(n.values()) >= 4
    assert [block_size_for(2 * b) for b in (2, 4, 8, 12, 16)] == [2, 2, 2, 3, 4]  # N = 8 where depth allows


def test_arch_shape_hits_ratios_and_budget():
    budget = 12 * 8 * 128**2
    for rd, rh in [(15, 0.5), (45, 1), (60, 2)]:
        n_layers, d, heads = arch_shape(rd, rh, budget)
        assert d % (2 * heads) == 0
        assert abs(d / n_layers - rd) / rd < 0.25 and 0.5 < 12 * n_layers * d**2 / budget < 2
        assert heads == rh * n_layers  # (exactly, on these ratios)
    # by hand: L_b = (budget / (12 (d/L_b)^2))^(1/3) = 8.35, 3.31; H = (H/L_b) L_b; d the multiple
    # of 2 H nearest (d/L_b) L_b (45 x 4 = 180, a tie between multiples of 8, is left out)
    assert [arch_shape(rd, rh, budget) for rd, rh in [(15, 0.5), (60, 2)]] == [(8, 120, 4), (3, 180, 6)]
    with pytest.raises(ValueError, match="must be > 0"):
        arch_shape(0, 1, budget)


def test_flops_scale_with_params_and_tokens():
    small = ModelConfig.preset("tiny", residual="standard")
    big = small.replace(d_model=128, n_heads=4, n_kv_heads=None)
    f_small, f_big = training_flops_per_token(small, 32), training_flops_per_token(big, 32)
    # matmuls: 6 x the Linear weights of the instantiated model
    model = AttnResLM(small)
    linear = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and not n.startswith("residual"))
    assert matmul_parameters(small) == linear and f_small.matmul == 6 * linear
    assert f_big.total > 3 * f_small.total  # ~ d^2
    assert f_small.matmul / f_small.total > 0.9  # dominated by 6N at this context
    assert non_embedding_parameters(small) == matmul_parameters(small) - small.d_model * small.vocab_size
    longer = training_flops_per_token(small, 64)
    assert longer.attention == pytest.approx(f_small.attention * 65 / 33) and longer.matmul == f_small.matmul
    # the residual mechanism: standard < block < full, and far below the matmuls
    res = {r: training_flops_per_token(small.replace(residual=r), 32).residual for r in ("standard", "attnres_block", "attnres_full")}
    assert res["standard"] < res["attnres_block"] < res["attnres_full"] < 0.1 * f_small.matmul
    assert to_pflops_days(PFLOPS_DAY * 2) == 2.0
    with pytest.raises(ValueError, match="seq_len"):
        training_flops_per_token(small, 0)


def test_mean_std_and_summary():
    assert mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert mean_std([4.0]) == (4.0, None)
    with pytest.raises(ValueError, match="^mean_std needs at least one value$"):  # (not statistics' own error)
        mean_std([])
    rec = dict(variant="v", family="f", coords={}, params=1, residual_params=0, pflops_days=1.0, peak_memory_bytes=None)
    s = summarize([{**rec, "val_loss": 1.0, "step_time_s": 0.1, "seed": 0}, {**rec, "val_loss": 2.0, "step_time_s": 0.3, "seed": 1}])["v"]
    assert (s.loss, s.loss_std, s.seeds, s.step_time_s) == (1.5, pytest.approx(math.sqrt(0.5)), 2, pytest.approx(0.2))


def test_power_law_fit_recovers_known_parameters():
    rng = np.random.default_rng(0)
    C = np.geomspace(1e-3, 10, 6)
    L = 1.87 * C**-0.058 * np.exp(rng.normal(0, 1e-4, C.shape))
    A, alpha = fit_power_law(list(C), list(L))
    assert A == pytest.approx(1.87, rel=1e-3) and alpha == pytest.approx(0.058, rel=1e-2)
    with pytest.raises(ValueError, match="distinct positive compute"):
        fit_power_law([1.0, 1.0], [2.0, 2.0])


def _check_runs(out: Path, n_runs: int) -> list[dict]:
    records = load_records(out)
    assert len(records) == n_runs
    for r in records:
        assert math.isfinite(r["val_loss"]) and r["params"] > 0 and r["flops"] == r["flops_per_token"] * r["tokens"]
        assert r["step_time_s"] > 0 and r["pflops_days"] > 0
    return records


def test_scaling_end_to_end_and_resume(corpus, tmp_path):
    out = tmp_path / "scaling"
    over = [f"data.paths=[{corpus}]"]
    assert cli_main(["experiment", "scaling", "--preset", "tiny", "--out", str(out), "--seeds", "0", *over]) == 0
    # a later invocation adds a seed; the report covers both
    assert cli_main(["experiment", "scaling", "--preset", "tiny", "--out", str(out), *over, "--seeds", "1"]) == 0
    exp = get_experiment("scaling", "tiny")
    records = _check_runs(out, 2 * len(exp.variants))
    assert "(n=2)" in (out / "report.md").read_text()
    residual = {r["variant"]: r["residual_params"] for r in records}
    assert residual["baseline_s1"] == 0 and residual["block_s1"] > 0
    report = (out / "report.md").read_text()
    assert "1.891·C^−0.057" in report and "Block AttnRes" in report and (out / "scaling.png").stat().st_size > 0
    # a second invocation skips every finished run and leaves their results alone
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/seed*/result.json")}
    log: list[str] = []
    run_experiment(exp, out, [0, 1], over, log=log.append)
    assert len(log) == len(stamps) and all("skipped" in line for line in log)
    assert stamps == {p: p.stat().st_mtime_ns for p in out.glob("*/seed*/result.json")}
    # a different grid in the same directory is refused
    with pytest.raises(ValueError, match="different experiment"):
        run_experiment(get_experiment("block-size", "tiny"), out, [0], over)


def test_interrupted_run_is_resumed(corpus, tmp_path):
    exp = get_experiment("scaling", "tiny")
    over = [f"data.paths=[{corpus}]"]
    run_experiment(exp, tmp_path, [0], over, log=lambda s: None)
    done = tmp_path / exp.variants[0].name / "seed0"
    (done / "result.json").unlink()  # as if the run had stopped after its final checkpoint
    log: list[str] = []
    run_experiment(exp, tmp_path, [0], over, log=log.append)
    # the log says that the run resumes (at its last checkpoint), not that it trains from scratch
    first = [line for line in log if "skipped" not in line][0]
    assert re.search(rf"{exp.variants[0].name} seed 0: resuming at step (\d+) of \1$", first), first
    assert not any("training" in line for line in log) and (done / "result.json").exists()


def test_a_grid_paused_with_stop_after_is_continued_by_the_command_status_gives(corpus, tmp_path, capsys):
    """stop_after=K was stored as the grid's override and its runs' records written at step K:
    the command `attnres status` gave (with stop_after) skipped every run as "finished
    earlier", and the command without it was refused as another grid's. stop_after is per
    launch now: the runs are stopped, not finished, and the grid's command continues them."""
    import shlex

    out = tmp_path / "grid"
    over = ["--overhead-repeats", "0", f"data.paths=[{corpus}]", "steps=4"]
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "standard", *over[2:],
                     "stop_after=2"]) == 0  # (nothing finished: the variants are not timed either)
    printed = capsys.readouterr().out
    assert "standard seed 0: stopped at step 2 of 4 (stop_after" in printed
    assert "every run stopped at step 2 (stop_after), none finished, so no report yet" in printed
    run = out / "standard" / "seed0"
    assert not any((path / name).exists() for path, name in ((run, "result.json"), (out, "report.md"),
                                                              (out, "overhead.json")))
    assert json.loads((out / "experiment.json").read_text())["overrides"] == over[2:]
    assert cli_main(["status", str(out)]) == 0
    status = capsys.readouterr().out
    assert " 2/4 " in status and "stopped" in status
    command = status.splitlines()[-1].split("`")[1]
    assert "stop_after" not in command
    assert cli_main(shlex.split(command)[1:] + ["--variants", "standard", "--overhead-repeats", "0"]) == 0
    assert "standard seed 0: resuming at step 2 of 4" in capsys.readouterr().out
    assert json.loads((run / "result.json").read_text())["steps"] == 4 and (out / "report.md").exists()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "eval"][-1] == 4
    # a grid's header of an earlier version, stop_after among its overrides, is continued without it
    header = json.loads((out / "experiment.json").read_text())
    (out / "experiment.json").write_text(json.dumps({**header, "overrides": header["overrides"] + ["stop_after=2"]}))
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "standard", *over]) == 0
    assert "finished earlier, skipped" in capsys.readouterr().out


def test_a_run_whose_checkpoint_a_kill_left_moved_aside_is_resumed_and_reported(corpus, tmp_path, capsys):
    """A run whose only checkpoint a kill left moved aside (.old-step-00000002: killed while
    writing that step again): the report named it unfinished "at step 0" and found no data
    fingerprint, and the grid's command started it anew, a fresh run whose start restored the
    checkpoint and then refused the out_dir as holding one. Readers see it; the grid resumes it."""
    from attnres.experiments.job.report import _data_fingerprint

    out = tmp_path / "grid"
    over = ["--overhead-repeats", "0", f"data.paths=[{corpus}]", "steps=4"]
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "standard", *over[2:],
                     "stop_after=2"]) == 0
    checkpoints = out / "standard" / "seed0" / "checkpoints"
    (checkpoints / "step-00000002").rename(checkpoints / ".old-step-00000002")
    with pytest.raises(ValueError, match=r"1 unfinished run \(standard seed 0 at step 2 of 4"):
        write_report("compare", [], out, "tiny")
    assert _data_fingerprint(out, {"variant": "standard", "seed": 0}) is not None
    capsys.readouterr()
    with pytest.warns(UserWarning, match="restored step-00000002"):  # (by the run's start)
        assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "standard", *over]) == 0
    assert "standard seed 0: resuming at step 2 of 4" in capsys.readouterr().out
    assert json.loads((out / "standard" / "seed0" / "result.json").read_text())["steps"] == 4


def test_a_grid_is_continued_with_another_progress_display_or_process_layout(corpus, tmp_path, capsys):
    """progress=false and parallel.* were stored as the grid's overrides and compared: the grid
    continued with the progress bar back on, or another parallel.dp, was refused as another
    grid's, where attnres train --resume takes them from each launch. They are per launch for a
    grid too: not stored, not compared (a header of an earlier version that holds them matches)."""
    from attnres.experiments.layout import PER_LAUNCH_OVERRIDES
    from attnres.train.resume import PER_LAUNCH

    assert PER_LAUNCH_OVERRIDES == PER_LAUNCH - {"resume", "resume_from", "out_dir"}  # (the grid sets those per run)
    out = tmp_path / "grid"
    over = ["--variants", "standard", "--overhead-repeats", "0", f"data.paths=[{corpus}]", "steps=4"]
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), *over, "stop_after=2", "progress=false",
                     "dist_timeout_s=60"]) == 0
    assert json.loads((out / "experiment.json").read_text())["overrides"] == over[4:]
    capsys.readouterr()
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), *over, "progress=true", "parallel.dp=1"]) == 0
    assert "standard seed 0: resuming at step 2 of 4" in capsys.readouterr().out
    assert json.loads((out / "standard" / "seed0" / "result.json").read_text())["steps"] == 4
    header = json.loads((out / "experiment.json").read_text())
    (out / "experiment.json").write_text(json.dumps({**header, "overrides": header["overrides"] + ["progress=false"]}))
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), *over]) == 0
    assert "finished earlier, skipped" in capsys.readouterr().out


def test_a_grids_relative_data_paths_are_stored_absolute_so_it_continues_from_anywhere(corpus, tmp_path, monkeypatch,
                                                                                       capsys):
    """data.paths=[corpus.txt] was stored as typed and read against the directory of each later
    command: the grid's command `attnres status` gave found no corpus from another directory.
    The grid's path overrides are stored absolute; the command typed again from where the grid
    started (relative paths, in any form) is still the grid's own."""
    import shlex

    monkeypatch.chdir(corpus.parent)
    typed = ["--variants", "standard", "--overhead-repeats", "0", "data.paths=[corpus.txt]", "data.cache_dir=cache",
             "steps=4"]
    assert cli_main(["compare", "--preset", "tiny", "--out", "grid", *typed, "stop_after=2"]) == 0
    header = json.loads((tmp_path / "grid" / "experiment.json").read_text())
    assert header["overrides"] == [f"data.paths=[{corpus}]", f"data.cache_dir={tmp_path / 'cache'}", "steps=4"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert cli_main(["status", str(tmp_path / "grid")]) == 0
    command = capsys.readouterr().out.splitlines()[-1].split("`")[1]
    assert cli_main(shlex.split(command)[1:] + typed[:4]) == 0
    assert "standard seed 0: resuming at step 2 of 4" in capsys.readouterr().out
    assert json.loads((tmp_path / "grid" / "standard" / "seed0" / "result.json").read_text())["steps"] == 4
    assert not (elsewhere / "cache").exists() and (tmp_path / "cache").is_dir()
    monkeypatch.chdir(tmp_path)  # the original command, from the original directory: the same grid
    assert cli_main(["compare", "--preset", "tiny", "--out", "grid", *typed[:4], "data.paths=./corpus.txt",
                     "data.cache_dir=cache/", "steps=4"]) == 0
    assert "finished earlier, skipped" in capsys.readouterr().out
    # a header of an earlier version, its paths as typed: the same command, from the same directory, continues it
    (tmp_path / "grid" / "experiment.json").write_text(json.dumps({**header, "overrides": typed[4:]}))
    assert cli_main(["compare", "--preset", "tiny", "--out", "grid", *typed]) == 0
    assert "finished earlier, skipped" in capsys.readouterr().out


def test_a_grid_moved_with_its_data_continues_with_the_new_paths_of_the_same_text(corpus, tmp_path, capsys):
    """A grid moved, or copied to another machine, with its data: experiment.json holds the
    old absolute data.paths, so the grid's command named a file no longer there, and the one
    with the new paths was refused as another grid's (unless experiment.json was edited by
    hand). The data's location is not the grid's identity (as for train --resume): the new
    paths continue it, their text checked against the fingerprint its runs recorded."""
    import shutil

    first, moved = tmp_path / "first", tmp_path / "moved"
    first.mkdir()
    shutil.copy(corpus, first / "corpus.txt")
    grid = ["compare", "--preset", "tiny", "--variants", "standard", "--overhead-repeats", "0", "steps=4"]
    assert cli_main([*grid, "--out", str(first / "grid"), f"data.paths=[{first / 'corpus.txt'}]", "stop_after=2"]) == 0
    first.rename(moved)
    capsys.readouterr()
    assert cli_main([*grid, "--out", str(moved / "grid"), f"data.paths=[{moved / 'corpus.txt'}]"]) == 0
    assert "standard seed 0: resuming at step 2 of 4" in capsys.readouterr().out
    header = json.loads((moved / "grid" / "experiment.json").read_text())
    assert header["overrides"] == ["steps=4", f"data.paths=[{moved / 'corpus.txt'}]"]  # (status gives these now)
    (moved / "other.txt").write_text("another text entirely\n" * 200)
    with pytest.raises(SystemExit, match=rf"data.paths \['{moved / 'other.txt'}'\] hold other text than the grid in "
                                         rf"'{moved / 'grid'}' trained on \(fingerprint \w+; its runs': \w+\)"):
        cli_main([*grid, "--out", str(moved / "grid"), "--seeds", "1", f"data.paths=[{moved / 'other.txt'}]"])
    assert not (moved / "grid" / "standard" / "seed1").exists()


def test_only_relative_paths_of_path_overrides_are_made_absolute(tmp_path, monkeypatch):
    from attnres.experiments.job.override_paths import absolute_path_overrides

    monkeypatch.chdir(tmp_path)
    given = ["data.paths=[a.txt, 'b c/*.txt']", "data.paths='x #1.txt'", "data.tokenizer=bpe", "data.tokenizer=./tok",
             "init_from=null", "resume_from=run/checkpoints", "data.cache_dir=$SCRATCH/c", "data.cache_dir=/abs",
             "lr=1e-3", "out_dir=x", "model.from_hf=hf", "model.from_hf=~/up"]
    assert absolute_path_overrides(given) == [
        f"data.paths=[{tmp_path}/a.txt, {tmp_path}/b c/*.txt]", f'data.paths=["{tmp_path}/x #1.txt"]',
        "data.tokenizer=bpe", f"data.tokenizer={tmp_path}/tok", "init_from=null",
        "resume_from=run/checkpoints", "data.cache_dir=$SCRATCH/c", "data.cache_dir=/abs", "lr=1e-3", "out_dir=x",
        f"model.from_hf={tmp_path}/hf", f"model.from_hf={Path.home()}/up"]


def test_a_run_recorded_at_stop_after_by_an_earlier_version_is_resumed_not_skipped(corpus, tmp_path):
    """An earlier version wrote the record of a run stop_after ended (at step K of N): such a
    run is continued to its steps, its record written again."""
    exp = get_experiment("compare", "tiny")
    over = [f"data.paths=[{corpus}]", "steps=4"]
    run_experiment(exp, tmp_path, [0], over + ["stop_after=2"], variants=["standard"], log=lambda s: None)
    run = tmp_path / "standard" / "seed0"
    (run / "result.json").write_text(json.dumps({"variant": "standard", "seed": 0, "steps": 4, "val_loss": 9.0}))
    log: list[str] = []
    records = run_experiment(exp, tmp_path, [0], over, variants=["standard"], log=log.append)
    assert log[0].endswith("standard seed 0: resuming at step 2 of 4") and records[0]["val_loss"] != 9.0


def test_a_grid_resumed_on_changed_data_says_what_a_grid_can_do(corpus, tmp_path):
    """A grid resumed after its text was edited stopped with train's message, naming no run of the
    grid and advising allow_data_change=true: an override the grid refuses (another grid's
    overrides), and one that would have its runs trained on two texts."""
    exp = get_experiment("compare", "tiny")
    over = [f"data.paths=[{corpus}]"]
    run_experiment(exp, tmp_path, [0], over, variants=["standard"], log=lambda s: None)
    run = tmp_path / "standard" / "seed0"
    (run / "result.json").unlink()  # as if the run had stopped after its final checkpoint
    with corpus.open("a") as f:
        f.write("\nan edited line")
    with pytest.raises(ValueError) as raised:
        run_experiment(exp, tmp_path, [0], over, variants=["standard"], log=lambda s: None)
    message = str(raised.value)
    assert message.startswith(f"run standard seed 0 ({run}): the training data differ from the data checkpoint ")
    assert message.endswith("where the grid's runs are trained on the same text: put the original text back at its "
                            "data.paths to continue the grid, or train the new text as a new grid, in another --out")
    assert "allow_data_change" not in message


def test_a_damaged_result_json_is_named_and_made_again(corpus, tmp_path, monkeypatch):
    """A result.json cut short (written in place: a grid killed mid-write) stopped every later
    command of the grid with the JSON parser's words alone ("Unterminated string starting at:
    line 4 column 2"), naming no file. It is named with the fix, deleting it, after which the
    grid's command makes the same record again from the final checkpoint; and it is written
    atomically now."""
    from attnres.experiments.job import runner

    over = ["--overhead-repeats", "0", f"data.paths=[{corpus}]"]
    command = ["compare", "--preset", "tiny", "--out", str(tmp_path), "--variants", "standard", *over]
    assert cli_main(command) == 0
    result = tmp_path / "standard" / "seed0" / "result.json"
    text = result.read_text()
    result.write_text(text[: len(text) // 2])
    for again in (command, ["compare", "--out", str(tmp_path), "--report-only"]):
        with pytest.raises(SystemExit, match=rf"^attnres compare: error: '{result}' cannot be read \(JSONDecodeError: "
                           r".*\); delete it, and the grid's command makes it again from the run's final checkpoint "
                           r"\(training nothing\)$"):
            cli_main(again)
    result.unlink()
    assert cli_main(command) == 0 and json.loads(result.read_text()) == json.loads(text)
    written, atomically = [], runner.write_text_atomically
    monkeypatch.setattr(runner, "write_text_atomically", lambda path, *args: written.append(path) or atomically(path, *args))
    result.unlink()
    assert cli_main(command) == 0 and result in written


def test_a_damaged_grid_header_says_how_to_put_it_back(corpus, tmp_path, monkeypatch):
    """experiment.json cut short (written in place) said only to pick another --out; deleted,
    the folder was refused for its report.md, which no grid wrote: the grid's finished runs were
    out of reach. The command that trained the grid says what header to put back, and the
    header is written atomically now."""
    from attnres.experiments.job import runner

    command = ["compare", "--preset", "tiny", "--out", str(tmp_path), "--variants", "standard", "--overhead-repeats",
               "0", f"data.paths=[{corpus}]"]
    written, atomically = [], runner.write_text_atomically
    monkeypatch.setattr(runner, "write_text_atomically", lambda path, *args: written.append(path) or atomically(path, *args))
    assert cli_main(command) == 0 and tmp_path / "experiment.json" in written
    header = (tmp_path / "experiment.json").read_text()
    (tmp_path / "experiment.json").write_text(header[:10])
    with pytest.raises(SystemExit) as refused:
        cli_main(command)
    said = str(refused.value)
    assert said.startswith(f"attnres compare: error: '{tmp_path / 'experiment.json'}' is not an experiment header (a "
                           "JSON mapping); if this command trained the grid, put its header back: ")
    put_back = said.split("put its header back: ", 1)[1].removesuffix("; else pick another --out")
    assert json.loads(put_back) == json.loads(header)
    (tmp_path / "experiment.json").write_text(put_back)
    assert cli_main(command) == 0  # the grid again: its run finished earlier, skipped


def test_a_damaged_overhead_json_is_named(corpus, tmp_path, monkeypatch):
    """overhead.json cut short (written in place) stopped the grid's report with "Expecting ':'
    delimiter: line 4 column 9", naming no file. It is named with the fix, and written
    atomically now."""
    from attnres.experiments.job import overhead

    written, atomically = [], overhead.write_text_atomically
    monkeypatch.setattr(overhead, "write_text_atomically", lambda path, *args: written.append(path) or atomically(path, *args))
    assert cli_main(["compare", "--preset", "tiny", "--out", str(tmp_path), "--variants", "standard",
                     "--overhead-repeats", "1", f"data.paths=[{corpus}]"]) == 0
    measured = tmp_path / "overhead.json"
    assert written == [measured]
    text = measured.read_text()
    measured.write_text(text[:40])
    with pytest.raises(SystemExit, match=rf"^attnres compare: error: '{measured}' cannot be read \(JSONDecodeError: .*\); "
                       r"delete it \(the report then takes the step times the runs logged\), and the grid's command "
                       r"without --report-only measures them again$"):
        cli_main(["compare", "--out", str(tmp_path), "--report-only"])
    measured.unlink()
    assert cli_main(["compare", "--out", str(tmp_path), "--report-only"]) == 0


def test_a_rerun_that_trains_nothing_keeps_the_overhead_measurement(corpus, tmp_path, monkeypatch, capsys):
    """`attnres compare` run again over a finished grid trained nothing and timed every variant
    again (minutes on CPU): the report's step-time ratios changed at each such re-run. It now
    keeps overhead.json where it measured the same models, batch and rounds, and says so;
    --remeasure-overhead, other rounds, a file of an earlier version or a run trained time them
    again."""
    import attnres.experiments as experiments

    measured, measure = [], experiments.measure_overhead
    monkeypatch.setattr(experiments, "measure_overhead", lambda *args, **kw: measured.append(args[3]) or measure(*args, **kw))
    command = ["compare", "--preset", "tiny", "--out", str(tmp_path), "--variants", "standard", f"data.paths=[{corpus}]",
               "--overhead-repeats", "1"]
    stored = tmp_path / "overhead.json"
    assert cli_main(command) == 0 and measured == [1]  # trained: measured
    figures_not_drawn(monkeypatch)  # (the runs' figures are drawn: the re-runs' reports need not draw them again)
    first = stored.read_text()
    capsys.readouterr()
    assert cli_main(command) == 0 and measured == [1]  # nothing trained: kept, as it was
    assert stored.read_text() == first
    said = capsys.readouterr().out
    assert ("attnres compare: nothing trained; the step times and memory of overhead.json, measured on this machine "
            "with these models, batch and 1 round, are kept (--remeasure-overhead times them again)\n") in said
    assert "overhead: " not in said
    assert cli_main([*command, "--remeasure-overhead"]) == 0 and measured == [1, 1]
    assert cli_main([*command[:-1], "2"]) == 0 and measured == [1, 1, 2]  # other rounds
    assert json.loads(stored.read_text())["settings"]["repeats"] == 2
    written = json.loads(stored.read_text())
    del written["settings"]  # (written by an earlier version: what it measured is unknown)
    stored.write_text(json.dumps(written))
    assert cli_main([*command[:-1], "2"]) == 0 and measured == [1, 1, 2, 2]
    assert cli_main([*command[:-1], "2"]) == 0 and measured == [1, 1, 2, 2]
    written = json.loads(stored.read_text())
    written["settings"]["models"]["block"]["residual"]["block_size"] += 1  # (the grid's models changed since)
    stored.write_text(json.dumps(written))
    assert cli_main([*command[:-1], "2"]) == 0 and measured == [1, 1, 2, 2, 2]
    assert cli_main([*command[:-1], "2", "--seeds", "0", "1"]) == 0 and measured == [1, 1, 2, 2, 2, 2]  # seed 1 trained


def test_an_overhead_measured_on_another_machine_is_not_kept(tmp_path, monkeypatch):
    """overhead.json's settings did not name the machine: a finished grid copied to another
    computer and run again there kept the first computer's step times. Another CPU model,
    number of cores or architecture now times the variants again (the grid's command keeps
    only what stored_overhead returns)."""
    import os
    import platform

    from attnres import machine
    from attnres.experiments import measure_overhead
    from attnres.experiments.job.overhead import stored_overhead

    grid = get_experiment("compare", "tiny")
    measured = measure_overhead(grid, tmp_path, repeats=1, log=lambda line: None)
    assert measured["settings"]["machine"] == {"cpu": machine.cpu_name(), "cores": os.cpu_count(),
                                               "architecture": platform.machine()}
    written = json.loads((tmp_path / "overhead.json").read_text())
    assert stored_overhead(grid, tmp_path, repeats=1) == written
    for module, name, other in [(machine, "cpu_name", "Another CPU"), (os, "cpu_count", 1024),
                                (platform, "machine", "riscv64")]:
        with monkeypatch.context() as elsewhere:
            elsewhere.setattr(module, name, lambda: other)
            assert stored_overhead(grid, tmp_path, repeats=1) is None, name
    assert stored_overhead(grid, tmp_path, repeats=1) == written  # back on the machine that measured


def test_an_overhead_measured_by_another_depth_attention_implementation_is_not_kept(tmp_path, monkeypatch):
    """overhead.json's settings did not say what ran depth attention in the timed steps: the
    same grid run again with ``ATTNRES_CPU_KERNEL=0`` (the PyTorch implementation, to compare it
    with the C kernel), or after the kernel changed, kept the C kernel's step times, saying they
    were measured with these models. The kernel's build (or the PyTorch implementation) is
    recorded now, and another one times the variants again."""
    from attnres.experiments import measure_overhead
    from attnres.experiments.job.overhead import stored_overhead
    from attnres.ops.depth_attention import cpu_kernel

    grid = get_experiment("compare", "tiny")
    measure_overhead(grid, tmp_path, repeats=1, log=lambda line: None)
    written = json.loads((tmp_path / "overhead.json").read_text())
    assert stored_overhead(grid, tmp_path, repeats=1) == written
    built = cpu_kernel.cpu_kernel()
    with monkeypatch.context() as switched_off:
        switched_off.setattr(cpu_kernel, "cpu_kernel", lambda: None)  # (ATTNRES_CPU_KERNEL=0, or no compiler)
        assert stored_overhead(grid, tmp_path, repeats=1) is None
    if built is not None:  # (another build: the kernel's source, flags, compiler or CPU changed)
        with monkeypatch.context() as rebuilt:
            rebuilt.setattr(built, "path", built.path.with_name("attnres_depth_attention-0123456789abcdef.so"))
            assert stored_overhead(grid, tmp_path, repeats=1) is None
    assert stored_overhead(grid, tmp_path, repeats=1) == written


def test_demo_under_load_times_the_finished_grid_again(tmp_path, monkeypatch):
    """benchmarks/demo_under_load.py re-runs `attnres compare` over the grid its quiet run
    trained, to time the steps beside a busy load: such a re-run now keeps the quiet
    measurement unless told --remeasure-overhead, and the loaded runs compared it with itself."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import demo_under_load

    ran = []
    monkeypatch.setattr(demo_under_load.subprocess, "run", lambda command, check: ran.append(command))
    (tmp_path / "overhead.json").write_text('{"variants": {}}')
    (tmp_path / "report.md").write_text("# report")
    assert demo_under_load.run_compare("tiny", tmp_path, 4, ["steps=4"], busy=0) == ({"variants": {}}, "# report")
    (command,) = ran
    assert command[command.index("compare"):] == ["compare", "--preset", "tiny", "--out", str(tmp_path),
                                                  "--overhead-repeats", "4", "--remeasure-overhead", "steps=4"]


def test_remeasure_overhead_is_refused_where_nothing_would_be_timed(tmp_path, capsys):
    """--remeasure-overhead where no measurement is taken (--report-only, --overhead-repeats 0,
    a grid without an overhead table) is refused naming the option, before anything trains."""
    refusals = [(["compare", "--report-only"], "--report-only only rewrites the report, of every finished run in --out; "
                 "it takes no --remeasure-overhead (to time the variants, run the grid's command again with "
                 "--remeasure-overhead and without --report-only"),
                (["compare", "--overhead-repeats", "0"], "--remeasure-overhead times the variants again, which "
                 "--overhead-repeats 0 turns off: drop one of them"),
                (["experiment", "scaling"], "--remeasure-overhead times the variants for an overhead table, which only "
                 "compare, ablation, block-size report; the scaling grid has none: drop the option")]
    for given, said in refusals:
        with pytest.raises(SystemExit):
            cli_main([*given, "--out", str(tmp_path), "--remeasure-overhead"])
        assert said in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_report_of_runs_trained_on_different_texts_says_so(corpus, tmp_path):
    """A grid's text edited while it ran (hours, run by run): the runs after the edit trained on
    the new text without a word, and the report compared their losses with the others'. It
    says which runs trained on which text (their records' fingerprints, or their checkpoints'
    for records of earlier versions), in the report and as a warning."""
    command = ["compare", "--preset", "tiny", "--out", str(tmp_path), "--overhead-repeats", "0", f"data.paths=[{corpus}]"]
    assert cli_main([*command, "--variants", "standard"]) == 0
    assert "These runs were not all" not in (tmp_path / "report.md").read_text()
    with corpus.open("a") as f:
        f.write("\nan edited line")
    with pytest.warns(UserWarning, match="These runs were not all trained on the same text"):
        assert cli_main([*command, "--variants", "block"]) == 0
    fingerprints = [json.loads((tmp_path / v / "seed0" / "result.json").read_text())["data_fingerprint"]
                    for v in ("standard", "block")]
    said = (f"**These runs were not all trained on the same text (its data files changed while the grid ran), so their "
            f"losses do not compare: data fingerprints {fingerprints[0][:12]}: standard seed 0; {fingerprints[1][:12]}: "
            "block seed 0. Retrain the runs of the text that is not wanted (delete their folders and run the grid's "
            "command again).**")
    assert fingerprints[0] != fingerprints[1] and said in (tmp_path / "report.md").read_text()
    result = tmp_path / "standard" / "seed0" / "result.json"  # a record of an earlier version: its checkpoint says
    result.write_text(json.dumps({k: v for k, v in json.loads(result.read_text()).items() if k != "data_fingerprint"}))
    with pytest.warns(UserWarning, match="These runs were not all trained on the same text"):
        assert cli_main(["compare", "--out", str(tmp_path), "--report-only"]) == 0
    assert said in (tmp_path / "report.md").read_text()


def test_each_finished_run_says_how_long_it_took_and_the_grid_has_to_go(corpus, tmp_path, monkeypatch):
    """An hours-long grid said only `[3/12] mhc seed 0: val loss ...`; now each run's time and
    the remaining runs' at the pace so far (seconds per step), finished runs not counted."""
    from attnres.experiments.job import runner
    from attnres.progress import clock

    exp = get_experiment("scaling", "tiny")
    over = [f"data.paths=[{corpus}]"]
    n = len(exp.variants)
    assert n >= 3
    now = [0.0]

    def run_one(config, variant, **_):  # each run: 7 s a step
        now[0] += 7.0 * config.steps
        record = {"variant": variant.name, "val_loss": 1.0}
        Path(config.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(config.out_dir) / "result.json").write_text(json.dumps(record))
        return record

    monkeypatch.setattr(runner, "run_one", run_one)
    monkeypatch.setattr(runner.time, "perf_counter", lambda: now[0])
    (tmp_path / exp.variants[-1].name / "seed0").mkdir(parents=True)  # a run finished earlier: skipped, not counted
    (tmp_path / exp.variants[-1].name / "seed0" / "result.json").write_text(json.dumps({"val_loss": 2.0}))
    # a run interrupted earlier: to go from its checkpoint, not from step 0 (one of its 2 steps)
    (tmp_path / exp.variants[1].name / "seed0" / "checkpoints" / "step-00000001").mkdir(parents=True)
    log: list[str] = []
    run_experiment(exp, tmp_path, [0], over, log=log.append)
    steps = [runner.run_config(exp, v, 0, tmp_path / v.name / "seed0", over).steps for v in exp.variants]
    done = [line for line in log if ": val loss" in line]
    assert len(done) == n - 1 and log[-1].endswith("finished earlier, skipped")
    assert done[0].endswith(f"val loss 1.0000 (took {clock(7 * steps[0])}; about {clock(7 * (sum(steps[1:n - 1]) - 1))} "
                            f"to go for {n - 2} run(s))"), done[0]
    assert done[-1].endswith(f"(took {clock(7 * steps[n - 2])})"), done[-1]  # nothing left to train


def test_a_run_of_one_step_is_announced_in_the_singular(corpus, tmp_path, monkeypatch):
    """A grid of ``steps=1`` announced each run as "training 1 steps"."""
    from attnres.experiments.job import runner

    exp = get_experiment("compare", "tiny")

    def run_one(config, variant, **_):
        Path(config.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(config.out_dir) / "result.json").write_text(json.dumps({"variant": variant.name, "val_loss": 1.0}))
        return {"variant": variant.name, "val_loss": 1.0}

    monkeypatch.setattr(runner, "run_one", run_one)
    log: list[str] = []
    run_experiment(exp, tmp_path, [0], [f"data.paths=[{corpus}]", "steps=1"], log=log.append)
    announced = [line for line in log if ": training" in line]
    assert announced and all(line.endswith(": training 1 step") for line in announced), announced


def test_arch_sweep_end_to_end(corpus, tmp_path, users_matplotlib, monkeypatch):
    import matplotlib
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    out = tmp_path / "arch"
    records = run_experiment(get_experiment("arch-sweep", "tiny"), out, [0], [f"data.paths=[{corpus}]"], log=lambda s: None)
    saved = _saved_figures(monkeypatch)
    path = write_report("arch-sweep", records, out, "tiny")
    # The baseline's and Block's heatmaps were each on its own colour scale (one colour, two losses), and
    # the losses were written in white on viridis' yellow too: one scale, and dark text on the bright cells.
    (fig,) = saved
    images = [image for ax in fig.axes for image in ax.get_images()]
    losses = [r["val_loss"] for r in records]
    assert len(images) == 2 and all(image.get_clim() == (min(losses), max(losses)) for image in images)
    for ax in fig.axes:
        for text in ax.texts:
            assert to_rgb(text.get_color()) == ((0, 0, 0) if float(text.get_text()) > (min(losses) + max(losses)) / 2
                                                else (1, 1, 1)), text.get_text()
    # (it switched a notebook's matplotlib to Agg: the user's later figures stopped showing)
    assert matplotlib.get_backend() == "svg" and plt.get_fignums() == users_matplotlib
    text = path.read_text()
    assert "Fig. 7" in text and "d/L_b" in text and text.count("(n=1)") == len(records)
    # (the set-up line gave the first cell's shape, "d_model 24, 3 transformer blocks", as every run's)
    assert "Set-up: model shape: by run (the table); vocab 256" in text and "d_model 24" not in text
    assert (out / "arch_sweep.png").stat().st_size > 0
    cells = {(r["coords"]["d/L_b"], r["coords"]["H/L_b"]) for r in records}
    assert len(cells) == 4 and json.loads((out / "experiment.json").read_text())["experiment"] == "arch-sweep"


def test_cli_errors_name_bad_values(tmp_path):
    with pytest.raises(SystemExit, match="unknown preset 'x'"):
        cli_main(["experiment", "scaling", "--preset", "x", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="steps"):
        cli_main(["experiment", "scaling", "--preset", "tiny", "--out", str(tmp_path), "steps=0"])
    (tmp_path / "empty").mkdir()
    # (it said "no finished runs to report for experiment 'scaling'": not which folder, nor what trains them)
    with pytest.raises(SystemExit, match=r"no finished runs to report for experiment 'scaling' in .*empty: no run of "
                       r"the grid has been trained there; its command without --report-only trains them"):
        cli_main(["experiment", "scaling", "--preset", "tiny", "--out", str(tmp_path / "empty"), "--report-only"])
    with pytest.raises(SystemExit, match=r"--out '.*emtpy' does not exist \(did you mean 'empty'\?\)"):
        cli_main(["experiment", "scaling", "--preset", "tiny", "--out", str(tmp_path / "emtpy"), "--report-only"])


def test_compare_end_to_end(corpus, tmp_path):
    """`attnres compare`: three models, two seeds, a report with its tables, plots and findings."""
    out = tmp_path / "compare"
    # evaluations at every step, so the equal-time budget (4 steps / step-time ratio, about 2
    # for a model this small) falls inside every curve
    over = [f"data.paths=[{corpus}]", "eval_every=1"]
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--seeds", "0", "1", *over]) == 0
    records = _check_runs(out, 6)
    assert {r["variant"] for r in records} == {"standard", "block", "full"}
    text = (out / "report.md").read_text()
    for needle in ("val loss @ equal steps", "val loss @ equal compute", "tokens/s", "Paired by seed",
                   "Fig. 5", "Fig. 8", "Findings (computed)", "Block AttnRes at equal steps", "2 x 16 tokens per step",
                   "seeds [0, 1]", "val loss @ equal time", "Δ val loss @ equal time", "Full AttnRes at equal time",
                   "timed interleaved over 10 rounds", "tokens/s (side by side): the tokens of one step"):
        assert needle in text, needle
    # the side-by-side step-time ratios (overhead.json) are the table's last columns
    ratios = json.loads((out / "overhead.json").read_text())["variants"]
    full_row = next(line for line in text.splitlines() if line.startswith("| Full AttnRes |"))
    full = ratios["full"]
    assert full_row.endswith(f"| {full['step_ratio']:.2f} ± {full['step_ratio_noise']:.2f} | {full['peak_ratio']:.2f} |")
    # tokens/s of the step timed side by side, not of the runs' wall clock under changing load
    assert f"| {2 * 16 / (full['median_ms'] / 1e3):,.0f} |" in full_row, full_row
    assert "on the process's CPU time" in text and "A/A twin" in text
    for png in ("val_loss.png", "magnitudes.png", "depth_weights.png", "mixing.png"):
        assert (out / png).stat().st_size > 0, png
    # the depth mixing matrices (report §6.2, Fig. 9) of every model, over seeds
    for needle in ("Depth mixing matrices (report §6.2, Fig. 9)", "| standard (PreNorm) | 1, 1 |",
                   "**Full AttnRes** (2 seed(s))", "fewer than 3 seeds, no claim"):
        assert needle in text, needle
    assert set(json.loads((out / "mixing.json").read_text())) == {"standard", "block", "full"}
    # the same runs through the generic command: nothing is retrained
    log: list[str] = []
    run_experiment(get_experiment("compare", "tiny"), out, [0, 1], over, log=log.append)
    assert all("skipped" in line for line in log)


def test_a_compare_report_without_diagnostics_says_why_figures_5_and_8_are_missing(corpus, tmp_path):
    """Runs shorter than diagnostics_every (`attnres compare steps=12`: the demo preset logs
    them every 80 steps) left the Fig. 5 / Fig. 8 sections out of the report without a word."""
    out = tmp_path / "compare"
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "standard", "block",
                     "--overhead-repeats", "0", f"data.paths=[{corpus}]", "diagnostics_every=100"]) == 0
    text = (out / "report.md").read_text()
    assert "No run logged a diagnostics record" in text and "`diagnostics_every` at most `steps`" in text
    assert not (out / "magnitudes.png").exists() and not (out / "depth_weights.png").exists()


def test_compare_reads_losses_at_equal_compute():
    """AttnRes costs more FLOPs per step: at the baseline's total compute its loss is read off
    its curve at an earlier step, linearly interpolated between evaluations."""
    from attnres.experiments.job.compare import BASELINE, Run, _equal_compute_losses

    def run(variant, flops_per_step, seed=0):
        rec = {"variant": variant, "seed": seed, "steps": 100, "flops": 100 * flops_per_step, "val_loss": 2.0}
        return Run(rec, eval_steps=[50, 75, 100], val_loss=[3.0, 2.5, 2.0])

    groups = {BASELINE: [run(BASELINE, 1.0)], "block": [run("block", 1.25)], "full": [run("full", 2.5)]}
    losses = _equal_compute_losses(groups)
    assert losses[BASELINE][0] == pytest.approx(2.0)  # its own budget: its last step
    assert losses["block"][0] == pytest.approx(2.4)  # step 80: 2.5 - 0.5 * 5 / 25
    assert math.isnan(losses["full"][0])  # step 40: before the first evaluation, not extrapolated


def test_compare_reads_losses_at_equal_time():
    """With step-time ratios measured side by side, a model whose step costs 1.25 baseline
    steps is read at step 100 / 1.25 = 80 of its curve; models without a ratio are left out."""
    from attnres.experiments.job.compare import BASELINE, Run, _equal_time_losses

    def run(variant):
        rec = {"variant": variant, "seed": 3, "steps": 100, "flops": 100.0, "val_loss": 2.0}
        return Run(rec, eval_steps=[50, 75, 100], val_loss=[3.0, 2.5, 2.0])

    groups = {BASELINE: [run(BASELINE)], "block": [run("block")], "full": [run("full")]}
    losses = _equal_time_losses(groups, {BASELINE: 1.0, "block": 1.25})
    assert losses == {BASELINE: {3: pytest.approx(2.0)}, "block": {3: pytest.approx(2.4)}}


def test_the_noise_of_a_step_time_ratio():
    """The median's 95 % interval by order statistics, widened to the A/A twin's distance from 1;
    an effect within the spread is too noisy (a nan is too)."""
    from attnres.analysis.profiling import median_interval
    from attnres.experiments.job.compare import too_noisy
    from attnres.experiments.job.overhead import timing_noise

    assert median_interval([float(v) for v in range(10, 0, -1)]) == (2.0, 9.0)  # n = 10: 2nd and 9th, 97.9 %
    assert median_interval(list(range(12))) == (2, 9) and median_interval([3, 1, 2]) == (1, 3)
    assert timing_noise((1.05, 1.09), 1.06, (0.99, 1.01)) == pytest.approx(0.03)  # its own interval
    assert timing_noise((1.05, 1.07), 1.06, (0.95, 1.02)) == pytest.approx(0.05)  # the twin's floor
    assert not too_noisy(-0.02, 0.01) and too_noisy(-0.02, 0.03) and too_noisy(0.0, 0.0) is False
    assert too_noisy(math.nan, 0.01) and too_noisy(0.1, math.nan)


def test_equal_time_is_too_noisy_when_the_ratio_noise_moves_the_gap_more_than_the_gap():
    """The equal-time gap read at the ratio and at ratio ± noise: a loaded machine's wide noise
    makes the finding say "too noisy" instead of drawing the conclusion."""
    from attnres.experiments.job.compare import BASELINE, Run, _findings, equal_time_noise, too_noisy

    def run(variant, losses):
        rec = {"variant": variant, "seed": 0, "steps": 100, "flops": 100.0, "val_loss": losses[-1]}
        return Run(rec, eval_steps=[50, 75, 100], val_loss=losses)

    groups = {BASELINE: [run(BASELINE, [3.0, 2.5, 2.0])], "block": [run("block", [2.9, 2.4, 1.9])]}
    ratio = {BASELINE: 1.0, "block": 1.25}  # block read at step 80: 2.4 - 0.5 * 5 / 25 = 2.3, the baseline at 100: 2.0
    (effect, spread), = equal_time_noise(groups, ratio, {"block": 0.01}).values()
    assert effect == pytest.approx(2.3 - 2.0) and spread == pytest.approx(abs(100 / 1.24 - 80) / 25 * 0.5, rel=1e-6)
    assert not too_noisy(effect, spread)
    quiet = {"block": {"time": [effect]}}
    assert "at equal time: paired gap to the standard model +0.3000" in _findings(groups, quiet, None,
                                                                                {"block": (effect, spread)})[0]
    # the gap at equal time is small, the noise large: no conclusion
    groups["block"] = [run("block", [2.6, 2.1, 1.9])]
    (effect, spread), = equal_time_noise(groups, ratio, {"block": 0.2}).values()
    assert too_noisy(effect, spread)
    (finding,) = _findings(groups, {"block": {"time": [effect]}}, None, {"block": (effect, spread)})
    assert "Block AttnRes at equal time: too noisy to draw a conclusion" in finding


def test_no_equal_time_conclusion_is_drawn_from_fewer_rounds_than_give_95_percent():
    """The step-time ratio's noise is its interval's half width, a 95 % interval from 6
    rounds; over fewer it is the rounds' range, which covers less (2 rounds: 50 %) - the
    report named that coverage, but the "too noisy" rule read the narrower noise as it was
    and drew equal-time conclusions from 2 rounds. Below 6 rounds every equal-time reading is
    too noisy, and the table and the findings say why."""
    from attnres.experiments.job import compare
    from attnres.experiments.job.compare import BASELINE, Run, _findings, _tables

    def run(variant, losses):
        rec = {"variant": variant, "seed": 0, "steps": 100, "flops": 100.0, "val_loss": losses[-1], "params": 10,
               "residual_params": 0, "flops_per_token": 1.0, "tokens": 1000}
        return Run(rec, eval_steps=[50, 75, 100], val_loss=losses)

    groups = {BASELINE: [run(BASELINE, [3.0, 2.5, 2.0])], "block": [run("block", [2.9, 2.4, 1.9])]}
    overheads = {BASELINE: {"step_ratio": 1.0, "step_ratio_noise": 0.0, "median_ms": 10.0, "peak_ratio": 1.0},
                 "block": {"step_ratio": 1.25, "step_ratio_noise": 0.01, "median_ms": 12.5, "peak_ratio": 1.1}}
    md, gaps, noisy = _tables(groups, overheads, 6)  # (the gap +0.3, its spread 0.01: drawn)
    assert "(too noisy)" not in md and "fewer than the 6" not in md
    md, gaps, noisy = _tables(groups, overheads, 2)
    assert "(too noisy)" in md and "Timed over 2 round(s), fewer than the 6 whose interval covers 95 %" in md
    assert compare.EQUAL_TIME_ROUNDS == 6
    (finding,) = [f for f in _findings(groups, gaps, None, noisy, 2) if "equal time" in f]
    assert "at equal time: too noisy to draw a conclusion: the step-time ratio was timed over 2 round(s)" in finding
    assert "--overhead-repeats 6 or more" in finding
    md, gaps, noisy = _tables(groups, overheads, 6)
    assert "at equal time: paired gap to the standard model +0.3000" in _findings(groups, gaps, None, noisy, 6)[-1]


def test_compare_finds_how_the_gap_moves_during_the_decay(tmp_path):
    """Report Fig. 5a: the gap to the baseline at the step the WSD decay starts (read off the
    curves, from the runs' config.json) against the gap at the end, paired by seed."""
    from attnres.experiments.job.compare import BASELINE, Run, _decay_gap_findings, decay_start

    def run(variant, seed, losses):
        rec = {"variant": variant, "seed": seed, "steps": 100, "flops": 100.0, "val_loss": losses[-1]}
        return Run(rec, eval_steps=[40, 80, 100], val_loss=losses)

    groups = {BASELINE: [run(BASELINE, 0, [3.0, 2.5, 2.0]), run(BASELINE, 1, [3.0, 2.6, 2.1]),
                         run(BASELINE, 2, [3.0, 2.6, 2.1])],
              "block": [run("block", 0, [2.9, 2.4, 1.85]), run("block", 1, [2.9, 2.5, 2.05]),
                        run("block", 2, [2.9, 2.5, 2.0])]}
    (finding,) = _decay_gap_findings(groups, 80)
    # gaps -0.1 / -0.1 / -0.1 at step 80, -0.15 / -0.05 / -0.1 at the end: the mean holds, one seed gains
    assert "-0.1000 when the learning-rate decay starts (step 80), -0.1000 at the end" in finding
    assert "in AttnRes’s favour in 1/3 seed(s)" in finding
    # with fewer than 3 seeds the gaps are stated, no direction is claimed
    (two,) = _decay_gap_findings({name: rs[:2] for name, rs in groups.items()}, 80)
    assert "over 2 seed(s): fewer than 3 seeds, so no claim of an ordering can be made" in two
    assert "favour" not in two
    config = tmp_path / "block" / "seed0" / "config.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps({"schedule": "wsd", "steps": 3600, "warmup_steps": 200, "decay_fraction": 0.2}))
    assert decay_start(tmp_path, {"variant": "block", "seed": 0}) == 2880
    # `attnres compare steps=30` on preset demo (warmup_steps=30): the warm-up takes the whole run, and
    # the report said "The learning rate decays from step 30" and read a stable phase before it
    config.write_text(json.dumps({"schedule": "wsd", "steps": 30, "warmup_steps": 30, "decay_fraction": 0.2}))
    assert decay_start(tmp_path, {"variant": "block", "seed": 0}) is None
    config.write_text(json.dumps({"schedule": "cosine", "steps": 3600, "warmup_steps": 200, "decay_fraction": 0.2}))
    assert decay_start(tmp_path, {"variant": "block", "seed": 0}) is None


def test_a_reading_at_equal_compute_outside_the_evaluations_is_said_why(tmp_path):
    """`attnres compare --preset tiny` (4 steps, evaluated at step 4 only): AttnRes's cell at
    equal compute, read at step 4 / 1.03, before its one evaluation, was "–" without a word.
    The report says why, and says nothing where every cell is read."""
    from attnres.experiments.job.compare import BASELINE, Run, _tables

    def run(variant, flops_per_token, eval_steps, losses):
        rec = {"variant": variant, "seed": 0, "steps": 4, "tokens": 400, "flops": 400 * flops_per_token,
               "flops_per_token": flops_per_token, "params": 100, "residual_params": 0, "val_loss": losses[-1]}
        return Run(rec, eval_steps=eval_steps, val_loss=losses)

    said = "\"–\" at equal compute: the step to read lies outside the steps the AttnRes run was evaluated at (the first"
    at_end = {BASELINE: [run(BASELINE, 1.0, [4], [5.0])], "block": [run("block", 1.03, [4], [4.9])]}
    md, _, _ = _tables(at_end)
    assert "| Block AttnRes | 100 | 0 | 4.9000 (n=1) | – |" in md and f"{said} at step 4)" in md
    evaluated = {BASELINE: [run(BASELINE, 1.0, [2, 4], [5.5, 5.0])], "block": [run("block", 1.03, [2, 4], [5.4, 4.9])]}
    md, _, _ = _tables(evaluated)
    assert "| Block AttnRes | 100 | 0 | 4.9000 (n=1) | 4.9" in md and "outside the steps" not in md


def test_rows_over_different_seeds_are_said_so():
    """A grid split by ``--variants`` (standard over seeds 0 and 1, Block over seed 1 alone): the
    table set standard's mean over both seeds beside Block's over seed 1 without a word, a gap
    of seed 0's batches, not of the models (the paired gap was a tenth of it)."""
    from attnres.experiments.job.compare import BASELINE, _tables

    def run(variant, seed, loss):
        from attnres.experiments.job.compare import Run

        rec = {"variant": variant, "seed": seed, "steps": 4, "tokens": 400, "flops": 400.0, "flops_per_token": 1.0,
               "params": 100, "residual_params": 0, "val_loss": loss}
        return Run(rec, eval_steps=[4], val_loss=[loss])

    split = {BASELINE: [run(BASELINE, 0, 5.48), run(BASELINE, 1, 5.36)], "block": [run("block", 1, 5.35)]}
    md, gaps, _ = _tables(split)
    assert ("The rows are means over different seeds (standard (PreNorm): 0, 1; Block AttnRes: 1), each seed its own "
            "batches: they do not compare with one another.") in md
    assert gaps["block"]["steps"] == [pytest.approx(-0.01)]  # (paired with seed 1's standard run)
    alike = {BASELINE: split[BASELINE], "block": [run("block", 0, 5.47), run("block", 1, 5.35)]}
    assert "different seeds" not in _tables(alike)[0]


def test_block_size_overheads_are_measured_side_by_side(corpus, tmp_path):
    out = tmp_path / "bs"
    over = [f"data.paths=[{corpus}]"]
    assert cli_main(["experiment", "block-size", "--preset", "tiny", "--out", str(out), "--overhead-repeats", "2",
                     *over]) == 0
    m = json.loads((out / "overhead.json").read_text())
    exp = get_experiment("block-size", "tiny")
    assert list(m["variants"]) == [v.name for v in exp.variants] and m["baseline"] == "baseline"
    base = m["variants"]["baseline"]
    assert base["step_ratio"] == 1.0 and base["peak_ratio"] == 1.0 and base["peak_memory_bytes"] > 0
    # (each variant's own peak: with Phase 1's sums recomputed, S = 1 no longer peaks above the
    # CPU's standard model, whose composite RMSNorm keeps its normalised input)
    for v in m["variants"].values():
        assert v["peak_memory_bytes"] > 0 and v["peak_ratio"] == pytest.approx(v["peak_memory_bytes"] / base["peak_memory_bytes"])
    assert len({v["peak_memory_bytes"] for v in m["variants"].values()}) > 1
    text = (out / "report.md").read_text()
    assert "timed interleaved over 2 rounds" in text
    assert f"{m['variants']['s1']['step_ratio']:.2f}×" in text
    with pytest.raises(SystemExit, match="--overhead-repeats must be >= 0"):
        cli_main(["experiment", "block-size", "--preset", "tiny", "--out", str(out), "--overhead-repeats", "-1"])


def test_overhead_repeats_for_a_grid_without_an_overhead_table_is_refused_before_it_trains(tmp_path, capsys, monkeypatch):
    """`attnres experiment scaling --overhead-repeats 5` measured nothing and said nothing: only
    compare / ablation / block-size report overheads. Refused at the command line; 0 (what
    scripts pass to every grid) and the default stay accepted."""
    from attnres.cli import experiment as cli_experiment

    calls = []
    monkeypatch.setattr(cli_experiment, "run_experiment_cli", lambda *a, **k: calls.append(a[6]) or 0)
    out = str(tmp_path / "grid")
    with pytest.raises(SystemExit) as e:
        cli_main(["experiment", "scaling", "--preset", "tiny", "--out", out, "--overhead-repeats", "5"])
    assert e.value.code == 2 and calls == []
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--overhead-repeats" in err and "compare, ablation, block-size" in err and "scaling grid has none" in err
    assert cli_main(["experiment", "scaling", "--preset", "tiny", "--out", out, "--overhead-repeats", "0"]) == 0
    assert cli_main(["experiment", "multiplier", "--preset", "tiny", "--out", out + "2"]) == 0
    assert cli_main(["experiment", "ablation", "--preset", "tiny", "--out", out + "3"]) == 0
    assert calls == [0, 0, 10]


def test_time_interleaved_rotates_the_order_every_round():
    """Every step takes every position in the round equally often (position bias cancels),
    and each step's times stay in round order for the paired ratios."""
    from attnres.analysis.profiling import time_interleaved

    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = time_interleaved(steps, repeats=6)
    rounds = [calls[i : i + 3] for i in range(0, len(calls), 3)]
    assert rounds[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    for name in steps:
        assert [r.index(name) for r in rounds].count(0) == 2  # first in 2 of 6 rounds
        assert len(times[name]) == 6


def test_variants_option_trains_only_the_named_variants(corpus, tmp_path):
    """`--variants` splits a grid over processes sharing --out: only the named variants train
    (overrides may follow the names), the report covers what is finished, and an unknown name
    is a one-line error that lists the grid's names."""
    out = tmp_path / "compare"
    over = [f"data.paths=[{corpus}]", "eval_every=2"]
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "standard", *over]) == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["standard"]
    assert (out / "report.md").exists()
    with pytest.raises(SystemExit, match=r"variants \(--variants\) must be names of the 'compare' grid "
                       r"\['standard', 'block', 'full'\]; got \['blok'\] \(did you mean 'block' for 'blok'\?\)"):
        cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "blok", *over])


def _runs_of(losses: dict[str, list[float]], steps: list[int]):
    """``Run`` s with the given validation losses per seed (one list entry per seed) at ``steps``."""
    from attnres.experiments.job.compare import Run

    return {name: [Run({"variant": name, "seed": k, "steps": steps[-1], "flops": 100.0 * steps[-1],
                        "val_loss": curve[-1]}, eval_steps=list(steps), val_loss=list(curve))
                   for k, curve in enumerate(curves)]
            for name, curves in losses.items()}


def test_findings_claim_no_ordering_from_fewer_than_three_seeds():
    from attnres.experiments.job.compare import _findings

    def gaps(n):
        return {"block": {"steps": [-0.05] * n}}

    one = _findings({}, gaps(1))
    assert one == ["Block AttnRes at equal steps: paired gap to the standard model -0.0500 over 1 seed(s): fewer than "
                   "3 seeds, so no claim of an ordering can be made (run more seeds, e.g. --seeds 0 1 2)."]
    assert "lower" not in one[0]
    (three,) = _findings({}, gaps(3))
    assert three.startswith("Block AttnRes at equal steps: lower validation loss than the standard model by 0.0500")


def _saved_figures(monkeypatch):
    """Every matplotlib figure saved while the returned list is watched."""
    from matplotlib.figure import Figure

    saved, save = [], Figure.savefig

    def record(fig, *args, **kwargs):
        saved.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return saved


def figures_not_drawn(monkeypatch) -> None:
    """From here on each matplotlib figure is saved as an empty file, not drawn: for the reports
    that a test writes again from runs whose figures it has drawn once (drawing them is most
    of a report's time; what the figures show is test_compare_end_to_end's)."""
    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "savefig", lambda fig, path, *args, **kwargs: Path(path).write_bytes(b""))


def test_val_loss_plot_draws_curves_of_a_single_evaluation(tmp_path, monkeypatch):
    """A short run evaluates once: its curve is one point, which a line alone does not
    draw; every curve has visible markers."""
    import matplotlib

    matplotlib.use("Agg")
    from attnres.experiments.job.compare import _plot_val_loss

    saved = _saved_figures(monkeypatch)
    _plot_val_loss(_runs_of({"standard": [[2.0]], "block": [[1.9]]}, [4]), tmp_path / "val_loss.png")
    (fig,) = saved
    for ax in fig.axes:
        curves = [line for line in ax.get_lines() if len(line.get_xdata()) == 1]
        assert len(curves) == 2
        assert all(line.get_marker() not in (None, "", " ", "None") and line.get_markersize() > 0 for line in curves)


def test_val_loss_plot_of_a_single_evaluation_ticks_whole_steps(tmp_path, monkeypatch):
    """A grid of one evaluation (preset tiny, at step 4) had its equal-steps panel read at steps
    3.80, 3.85, ..., 4.20: steps are counted, so they tick at whole numbers."""
    import matplotlib

    matplotlib.use("Agg")
    from attnres.experiments.job.compare import _plot_val_loss

    saved = _saved_figures(monkeypatch)
    _plot_val_loss(_runs_of({"standard": [[2.0]], "block": [[1.9]]}, [4]), tmp_path / "val_loss.png")
    (fig,) = saved
    fig.canvas.draw()
    steps = fig.axes[0]
    ticks = [t for t in steps.get_xticks() if steps.get_xlim()[0] <= t <= steps.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_a_grid_figure_that_fails_mid_write_leaves_the_one_before_whole(tmp_path, writes_cut_short):
    """The grid's figures (val_loss.png and the others of attnres compare and experiment)
    were saved in place: a kill or a full disk mid-write left a figure cut short where the
    last report's was. Each is saved beside and renamed into place."""
    import matplotlib

    matplotlib.use("Agg")
    from attnres.experiments.job.compare import _plot_val_loss
    from attnres.output_paths import OutputPathError

    cut_short, snapshot = writes_cut_short
    runs = _runs_of({"standard": [[2.0, 1.8]], "block": [[1.9, 1.7]]}, [2, 4])
    _plot_val_loss(runs, tmp_path / "val_loss.png")
    before = snapshot(tmp_path)
    cut_short()
    with pytest.raises(OutputPathError, match="the grid's figure '.*val_loss.png' could not be written: no space"):
        _plot_val_loss(runs, tmp_path / "val_loss.png")
    assert snapshot(tmp_path) == before


def test_plots_of_runs_without_diagnostics_or_curves_warn_nothing(tmp_path):
    """A compare run shorter than diagnostics_every (`attnres compare steps=12`) printed
    matplotlib's "attnres: warning: No artists with labels found to put in legend"."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    from attnres.experiments.job.compare import Run, _plot_magnitudes, _plot_val_loss

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _plot_magnitudes({"standard": [Run({"variant": "standard", "seed": 0})]},
                                    tmp_path / "magnitudes.png")
        _plot_val_loss({"standard": [Run({"variant": "standard", "seed": 0, "flops": 1.0, "steps": 1})]},
                       tmp_path / "val_loss.png")
    assert not (tmp_path / "magnitudes.png").exists()


def test_depth_weight_heatmaps_have_integer_source_ticks(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from attnres.experiments.job.compare import _plot_depth_weights

    groups = _runs_of({"full": [[2.0]]}, [4])
    n = 3  # 1 transformer block: 2 sublayers and the output, over up to 3 sources (auto ticks: 0, 0.5, 1, ...)
    groups["full"][0].diagnostics = {"depth_weights": [[1.0 / (l + 1)] * (l + 1) for l in range(n)]}
    saved = _saved_figures(monkeypatch)
    assert _plot_depth_weights(groups, tmp_path / "depth_weights.png")
    (fig,) = saved
    fig.canvas.draw()
    heatmaps = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert len(heatmaps) == 2
    for ax in heatmaps:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_depth_weight_heatmaps_say_the_sources_by_the_weights_not_the_variants_name(tmp_path, monkeypatch):
    """The x label said "blocks" for the variant named "block" alone: a Block AttnRes Variant of
    another name ("block4", added in Python) read "sublayer outputs". Told by the weights: Block's
    output row has fewer sources than the sublayer outputs and the embedding."""
    import matplotlib

    matplotlib.use("Agg")
    from attnres.experiments.job.compare import _plot_depth_weights

    groups = _runs_of({"block4": [[2.0]], "full": [[2.0]]}, [4])
    # 2 transformer blocks, S = 4 (one block): sources embedding, partial sum; the output: embedding, the block
    groups["block4"][0].diagnostics = {"depth_weights": [[1.0], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]}
    groups["full"][0].diagnostics = {"depth_weights": [[1.0 / (l + 1)] * (l + 1) for l in range(5)]}
    saved = _saved_figures(monkeypatch)
    assert _plot_depth_weights(groups, tmp_path / "depth_weights.png")
    labels = [ax.get_xlabel() for ax in saved[0].axes if ax.get_label() != "<colorbar>"]
    # the rows count the blocks from 1, as magnitudes.png does (they read "attn 0", "mlp 0" for its block 1)
    rows = [[t.get_text() for t in ax.get_yticklabels()] for ax in saved[0].axes if ax.get_label() != "<colorbar>"]
    assert rows[:2] == [["attn 1", "attn 2", "output"], ["mlp 1", "mlp 2", "output"]]
    assert labels == 2 * ["source (0 = embedding, then completed blocks,\nthen the current block's partial sum)"] + \
        2 * ["source (0 = embedding, then sublayer outputs)"]


def test_depth_weight_heatmaps_labels_fit_their_panels(tmp_path, monkeypatch):
    """Block AttnRes' x label, on one line, was wider than its panel: the two panels' labels ran
    into each other and the left one was cut at the figure's edge ("= embedding, then ...")."""
    import matplotlib

    matplotlib.use("Agg")
    from attnres.experiments.job.compare import _plot_depth_weights

    groups = _runs_of({"block": [[2.0]]}, [4])
    # 4 transformer blocks, S = 2: the output row reads the embedding and 4 blocks (tiny's shape)
    groups["block"][0].diagnostics = {"depth_weights": [[1.0 / (2 + l // 2)] * (2 + l // 2) for l in range(8)]
                                      + [[0.2] * 5]}
    saved = _saved_figures(monkeypatch)
    assert _plot_depth_weights(groups, tmp_path / "depth_weights.png")
    (fig,) = saved
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # as savefig draws it to a .png
    canvas.draw()
    renderer = canvas.get_renderer()
    labels = [ax.xaxis.label.get_window_extent(renderer) for ax in fig.axes if ax.get_label() != "<colorbar>"]
    width = fig.get_figwidth() * fig.dpi
    assert all(0 <= box.x0 and box.x1 <= width for box in labels), [(box.x0, box.x1, width) for box in labels]
    assert labels[0].x1 < labels[1].x0  # side by side, apart


def test_report_only_takes_the_preset_from_the_experiment(corpus, tmp_path):
    out = tmp_path / "compare"
    over = [f"data.paths=[{corpus}]", "--overhead-repeats", "0"]
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--seeds", "0", *over]) == 0
    assert cli_main(["compare", "--out", str(out), "--report-only"]) == 0
    title = (out / "report.md").read_text().splitlines()[0]
    assert title == "# Standard vs Block vs Full AttnRes — preset tiny"


def test_report_only_refuses_what_it_would_ignore(corpus, tmp_path, capsys, monkeypatch):
    """``--report-only`` with ``--seeds 0``, ``--variants block`` or ``--overhead-repeats 15``
    reported every finished run and timed nothing, and with overrides of other runs
    (``steps=3``) reported the grid's runs as if they were those; all without a word."""
    out = tmp_path / "compare"
    over = [f"data.paths=[{corpus}]", "--overhead-repeats", "0"]
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--seeds", "0", "1", *over]) == 0
    figures_not_drawn(monkeypatch)  # (the grid's figures are drawn: the reports again of its runs need not draw them)
    before = (out / "report.md").read_text()
    for given, named in ((["--seeds", "0"], "--seeds"), (["--variants", "block"], "--variants"),
                         (["--overhead-repeats", "15"], "--overhead-repeats")):
        with pytest.raises(SystemExit):
            cli_main(["compare", "--out", str(out), "--report-only", *given])
        assert (f"attnres compare: error: --report-only only rewrites the report, of every finished run in --out; it "
                f"takes no {named}") in capsys.readouterr().err
    with pytest.raises(SystemExit, match=rf"^attnres compare: error: '{out}' holds the 'compare' grid trained with the "
                       rf"overrides data.paths=\[{corpus}\]; this command gives steps=3: "):
        cli_main(["compare", "--out", str(out), "--report-only", "steps=3"])
    assert (out / "report.md").read_text() == before
    for same in ([f"data.paths=[{corpus}]"], [], ["--overhead-repeats", "0"]):  # the grid's command, or none
        assert cli_main(["compare", "--out", str(out), "--report-only", *same]) == 0
    assert capsys.readouterr().out.count("attnres compare: 6 runs reported") == 3  # every variant of both seeds


def test_reports_tolerate_a_truncated_metrics_line(corpus, tmp_path):
    out = tmp_path / "compare"
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "standard",
                     f"data.paths=[{corpus}]", "--overhead-repeats", "0"]) == 0
    with (out / "standard" / "seed0" / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "eval", "st')
    with pytest.warns(UserWarning, match="unreadable line"):
        assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--report-only"]) == 0


@pytest.mark.slow
def test_demo_step_time_ratios_hold_under_a_busy_loop_load(tmp_path):
    """The timing part of `make demo` (the demo grid's steps, CPU time at one thread, interleaved)
    without and then with a busy loop on every core: each AttnRes ratio moves by at most 0.05,
    or by no more than the noise the loaded measurement reports. The whole `make demo` check on
    a quiet machine: benchmarks/demo_under_load.py."""
    import os
    import subprocess
    import sys

    from attnres.experiments import measure_overhead

    grid = get_experiment("compare", "demo")
    quiet = measure_overhead(grid, tmp_path / "quiet", repeats=10)["variants"]
    # (plain processes: a multiprocessing.Process of a local function cannot be pickled under
    # the 'spawn' start method, macOS' default)
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        loaded = measure_overhead(grid, tmp_path / "loaded", repeats=10)["variants"]
    finally:
        for p in loops:
            p.kill()
            p.wait()
    for name in ("block", "full"):
        delta = abs(loaded[name]["step_ratio"] - quiet[name]["step_ratio"])
        assert delta <= max(0.05, loaded[name]["step_ratio_noise"]), (name, quiet[name], loaded[name])


def test_peak_memory_prints_nothing(capfd):
    """The profiler's native "USDT ... profiler_start / profiler_stop" lines stay out of the
    terminal (a `compare` printed them for every model); what the step prints stays in."""
    import sys

    from attnres.analysis.profiling import peak_memory_bytes

    x = torch.randn(64, 64, requires_grad=True)

    def step():
        print("step ran", file=sys.stderr)
        (x @ x).sum().backward()

    assert peak_memory_bytes(step) > 0
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err and "USDT" not in err
    assert "step ran" in err


def test_measuring_overheads_leaves_malloc_alone(tmp_path, monkeypatch):
    """Only the ``attnres`` command applies ``cpu_allocator`` (attnres.train.cpu_memory): the
    library's ``measure_overhead`` times the steps under the process's allocator as it is, and
    reports whether that retains freed memory."""
    from attnres.experiments import measure_overhead
    from attnres.train import cpu_memory

    calls = []

    class RecordingLibc:
        def mallopt(self, parameter, value):
            calls.append((parameter, value))
            return 1

    monkeypatch.setattr(cpu_memory, "_glibc", lambda: RecordingLibc())
    monkeypatch.setattr(cpu_memory, "_retained", False)
    result = measure_overhead(get_experiment("compare", "tiny"), tmp_path, repeats=3, log=lambda line: None)
    assert calls == [] and result["freed_memory_retained"] is False
    assert cpu_memory.set_cpu_allocator("retain") and calls  # what applying the setting would have recorded


def test_an_interval_of_fewer_than_6_rounds_is_said_with_its_coverage(tmp_path):
    """`--overhead-repeats 2` printed "95 % interval" for the range of 2 rounds, which covers the
    median half the time (6 rounds are the fewest whose interval covers 95 %): the log and the
    report say what the interval is."""
    from attnres.analysis.profiling import median_interval_coverage
    from attnres.experiments import measure_overhead
    from attnres.experiments.job.report import apply_overhead

    assert [median_interval_coverage(n) for n in (1, 2, 5)] == [0, 0.5, 0.9375]
    assert all(median_interval_coverage(n) >= 0.95 for n in range(6, 40))
    lines: list[str] = []
    measure_overhead(get_experiment("compare", "tiny"), tmp_path, repeats=2, log=lines.append)
    timed = [line for line in lines if "interval" in line]  # (the two variants and the A/A twin)
    assert len(timed) == 3 and all("(50 % interval (the range of 2 rounds; 6 rounds give 95 %) " in line
                                   for line in timed), timed
    assert "95 % interval of that median" not in apply_overhead({}, tmp_path)
    assert "the larger of the 50 % interval (the range of 2 rounds; 6 rounds give 95 %) of that median" in \
        apply_overhead({}, tmp_path)


def test_write_report_in_python_takes_the_grids_preset_as_report_only_does(corpus, tmp_path):
    """docs/experiments.md's `write_report("scaling", records, "runs/scaling")` (no preset) wrote
    another report than `--report-only`: no preset in the title, no unfinished size marked. The
    grid's experiment.json gives it; a Variant of the user's own stays among the named runs."""
    out = tmp_path / "scaling"
    grid = get_experiment("scaling", "tiny")
    grid = dataclasses.replace(grid, variants=[v for v in grid.variants if v.coords["size"] != "s3"])  # s3 unfinished
    records = run_experiment(grid, out, overrides=[f"data.paths=[{corpus}]"])
    python = write_report("scaling", records, out).read_text()
    assert python.startswith("# Scaling laws (Table 2 / Fig. 4) — preset tiny\n")
    assert cli_main(["experiment", "scaling", "--out", str(out), "--report-only", f"data.paths=[{corpus}]"]) == 0
    assert (out / "report.md").read_text() == python


def test_a_registered_residual_named_as_a_grid_variant_is_told_how_to_compare_it(tmp_path):
    """`attnres --import mine compare --variants mine` listed the grid's names only."""
    from attnres.experiments import get_experiment, run_experiment

    with pytest.raises(ValueError, match=r"got \['rezero'\]; \['rezero'\] is a registered residual, in no grid: add "
                       r"it to one as a Variant in Python \(docs/experiments.md, 'Grids'\)"):
        run_experiment(get_experiment("compare", "tiny"), tmp_path, variants=["rezero"])


def test_a_grid_without_matplotlib_is_refused_before_any_run_trains(corpus, tmp_path, monkeypatch):
    """The report's plots need the 'experiments' extra: without matplotlib every run trained
    (hours for a real grid) and only then did the report fail."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "compare"
    with pytest.raises(SystemExit, match=r"attnres compare: error: this needs the 'experiments' extra: .*'matplotlib'"):
        cli_main(["compare", "--preset", "tiny", "--out", str(out), "--overhead-repeats", "0", f"data.paths=[{corpus}]"])
    assert not out.exists()


def test_a_seed_given_twice_is_refused(corpus, tmp_path):
    """``--seeds 0 1 0`` trained seed 0 once and then listed it again as "finished earlier,
    skipped", under run numbers [4/9] .. [9/9] of a grid of 6."""
    out = tmp_path / "compare"
    with pytest.raises(SystemExit, match=r"seeds \(--seeds\) list 0 more than once; each seed is one run per variant: "
                       r"give distinct seeds, e.g. --seeds 0 1$"):
        cli_main(["compare", "--preset", "tiny", "--out", str(out), "--seeds", "0", "1", "0", f"data.paths=[{corpus}]"])
    assert not out.exists()


def test_a_grid_is_not_written_into_a_run_or_over_a_report_it_did_not_write(corpus, tmp_path):
    """``--out`` naming a training run mixed the grid's runs into it (and hid them from
    ``attnres status``); one holding another report.md (an ``attnres analyze`` output,
    notes) had it replaced without a word."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "report.md").write_text("mine")
    upcycled = tmp_path / "upcycled"  # (was called "a training run's directory (it holds config.json)")
    upcycled.mkdir()
    (upcycled / "config.json").write_text("{}")
    (upcycled / "model.safetensors").write_bytes(b"")
    for out, what in ((run, r"a training run's directory \(it holds config.json\)"),
                      (upcycled, r"a Hugging Face model directory \(config.json and its weights: an upcycle, an "
                                 r"export\), which the grid's runs and report would mix with"),
                      (notes, r"a folder with a report.md that no experiment wrote \(no experiment.json\)")):
        for extra in ([], ["--report-only"]):
            with pytest.raises(SystemExit, match=rf"attnres compare: error: --out '.*' is {what}.*pick another --out"):
                cli_main(["compare", "--preset", "tiny", "--out", str(out), "--overhead-repeats", "0",
                          f"data.paths=[{corpus}]", *extra])
    assert (notes / "report.md").read_text() == "mine" and sorted(p.name for p in run.iterdir()) == [
        "config.json", "metrics.jsonl"]


def test_the_report_names_the_grids_variants_with_no_run(corpus, tmp_path, capsys):
    """A compare grid trained with --variants standard block only: its report, titled "Standard
    vs Block vs Full", left Full out without a word (it has no run, no folder, no record). The
    report names it, and how to train it."""
    out = tmp_path / "compare"
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "standard", "block",
                     "--overhead-repeats", "0", f"data.paths=[{corpus}]"]) == 0
    text = (out / "report.md").read_text()
    assert text.startswith("# Standard vs Block vs Full AttnRes")
    assert ("Left out of this report: 1 variant of the grid with no run in this folder (full: the grid's command "
            "without --variants trains it, with `--variants full` it alone).") in text
    records = load_records(out, get_experiment("compare", "tiny"))
    assert "1 variant of the grid with no run in this folder (full" in write_report("compare", records, out).read_text()
    shutil.move(out / "block", tmp_path / "block")  # (the grid's preset: experiment.json's, where none is given)
    assert ("2 variants of the grid with no run in this folder (block, full: the grid's command without --variants "
            "trains them, with `--variants block full` them alone)") in write_report("compare", records[:1], out).read_text()
    shutil.move(out / "standard", tmp_path / "standard")  # (nothing trained: said as before, not as 3 variants)
    with pytest.raises(ValueError, match=r"no finished runs to report for experiment 'compare' in .*: no run of the "
                       "grid has been trained there"):
        write_report("compare", [], out, "tiny")


def test_the_report_says_once_how_to_train_the_variants_it_lacks(corpus, tmp_path, capsys):
    """A compare grid trained with --variants standard alone: the "Left out" line and the
    paragraph "No AttnRes run has finished" both said `--variants block full`. The paragraph
    points to the line; where the line does not name them (no preset known), it says the command."""
    out = tmp_path / "compare"
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "standard",
                     "--overhead-repeats", "0", f"data.paths=[{corpus}]"]) == 0
    text = (out / "report.md").read_text()
    assert text.count("`--variants block full`") == 1, text
    assert ("No AttnRes run has finished in this grid: the gaps paired by seed need a Block or Full AttnRes run of the "
            "same seed as the standard one. The line \"Left out of this report\" above names the command that trains "
            "them.") in text
    (out / "experiment.json").unlink()  # (no grid known: no "Left out" line, the paragraph says the command)
    records = load_records(out, get_experiment("compare", "tiny"))
    alone = write_report("compare", records, out).read_text()
    assert "Left out" not in alone and "Train them with the same command and `--variants block full`." in alone


def test_a_long_list_of_untrained_variants_gives_no_command_that_cannot_be_pasted(tmp_path):
    """More than 6 of the grid's variants with no run: the suggested command ended in a literal
    `--variants a b c d e f ...`. The first 6 are named, with how many more, and no --variants."""
    from attnres.experiments.job.report import _left_out

    _, text = _left_out(tmp_path, [], None, [f"v{i}" for i in range(9)])
    assert text == ("Left out of this report: 9 variants of the grid with no run in this folder (v0, v1, v2, v3, v4, "
                    "v5 and 3 more: the grid's command without --variants trains them).\n\n")
    _, text = _left_out(tmp_path, [], None, [f"v{i}" for i in range(6)])
    assert "with `--variants v0 v1 v2 v3 v4 v5` them alone" in text


def test_the_report_names_the_runs_it_leaves_out_and_what_a_lone_model_lacks(corpus, tmp_path, capsys):
    """An interrupted run was left out of the report without a word; a NaN validation loss
    ended the report in a traceback (statistics.stdev); a grid without the standard run (or
    without AttnRes) gave a table with no word on why the gaps are missing, or an empty one."""
    out = tmp_path / "compare"
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--overhead-repeats", "0",
                     f"data.paths=[{corpus}]"]) == 0
    (out / "full" / "seed0" / "result.json").unlink()  # as a run interrupted before its end leaves it
    records = load_records(out, get_experiment("compare", "tiny"))
    assert [r["variant"] for r in records] == ["standard", "block"]
    standard, block = records
    text = write_report("compare", [standard, {**block, "val_loss": math.nan}], out, "tiny").read_text()
    assert ("Left out of this report: 1 run whose final validation loss is not a number (block seed 0: see its "
            "metrics.jsonl; retrain it in another --out, e.g. at a lower lr); 1 unfinished run (full seed 0 at step 4 "
            f"of 4: the grid's command, without --report-only or stop_after, finishes it; `attnres status {out}` prints "
            "that command).") in text
    assert "\n1 run, steps [4]." in text and "1 warm-up step;" in text
    from attnres.train.lock import RunLock

    with RunLock(out / "full" / "seed0"):  # as another process's --variants full would hold it
        held = write_report("compare", [standard, block], out, "tiny").read_text()
    assert ("1 run being trained now by another process (full seed 0 at step 4 of 4: --report-only once it has "
            "finished)") in held and "unfinished run" not in held
    assert "No AttnRes run has finished in this grid" in text and "| model | Δ val loss" not in text
    text = write_report("compare", [block], out, "tiny").read_text()
    assert "No standard run has finished in this grid" in text and "`--variants standard`" in text
    with pytest.raises(ValueError, match=r"no finished runs to report for experiment 'compare' \(Left out of this "
                       r"report: 1 run whose final validation loss is not a number \(standard seed 0"):
        write_report("compare", [{**standard, "val_loss": None}], out, "tiny")
    # The closing line counts the runs the report covers (it said "2 runs" of a report of 1).
    result = out / "block" / "seed0" / "result.json"
    result.write_text(json.dumps({**json.loads(result.read_text()), "val_loss": None}))
    capsys.readouterr()
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--report-only"]) == 0
    assert f"attnres compare: 1 run reported of 2 finished; report {out / 'report.md'}" in capsys.readouterr().out


def test_depth_weight_heatmaps_name_the_step_of_the_record_they_show(tmp_path, monkeypatch):
    """The titles gave the run's last step; the weights are those of its last diagnostics
    record, logged every diagnostics_every steps (step 10 of a 12-step run at 5)."""
    import matplotlib

    matplotlib.use("Agg")
    from attnres.experiments.job.compare import _plot_depth_weights

    groups = _runs_of({"full": [[2.0]]}, [12])
    groups["full"][0].diagnostics = {"step": 10, "depth_weights": [[1.0 / (l + 1)] * (l + 1) for l in range(3)]}
    saved = _saved_figures(monkeypatch)
    assert _plot_depth_weights(groups, tmp_path / "depth_weights.png")
    (fig,) = saved
    titles = [ax.get_title() for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert titles == ["Full AttnRes: pre-attention (step 10)", "Full AttnRes: pre-MLP (step 10)"]


def test_a_grid_is_continued_with_its_overrides_in_any_order_and_told_which_they_are(tmp_path):
    """`attnres compare --out X steps=600 lr=2e-3` continued as `... lr=2e-3 steps=600` (or with
    `--seeds 0 1 lr=2e-3` moving one to the front) was refused as "a different experiment",
    naming the two lists as Python dicts; leaving the overrides out gave the same message."""
    from attnres.experiments.job.runner import check_same_experiment

    out = tmp_path / "grid"
    (out / "standard" / "seed0").mkdir(parents=True)
    (out / "standard" / "seed0" / "result.json").write_text("{}")  # (a run it trained: the header binds it)
    saved = {"experiment": "compare", "preset": "tiny", "overrides": ["steps=600", "lr=2e-3"]}
    (out / "experiment.json").write_text(json.dumps(saved))
    for same in (["lr=2e-3", "steps=600"], ["lr=0.002", "steps=600"], ["steps=600", "lr=2e-3"]):
        check_same_experiment(out, {**saved, "overrides": same})
    with pytest.raises(ValueError, match=r"holds the 'compare' grid trained with the overrides steps=600 lr=2e-3; "
                       r"this command gives none: to continue it give its overrides again \(in any order\)"):
        check_same_experiment(out, {**saved, "overrides": []})
    with pytest.raises(ValueError, match="this command gives steps=600 lr=1e-3: "):
        check_same_experiment(out, {**saved, "overrides": ["steps=600", "lr=1e-3"]})
    # a grid trained without any: said so (it read "trained with the overrides none")
    (out / "experiment.json").write_text(json.dumps({**saved, "overrides": []}))
    with pytest.raises(ValueError, match=r"holds the 'compare' grid trained without overrides; this command gives "
                       r"steps=600: to continue it give none, or pick another --out$"):
        check_same_experiment(out, {**saved, "overrides": ["steps=600"]})


def test_the_header_of_a_grid_that_trained_nothing_does_not_bind_the_next_command(corpus, tmp_path):
    """A grid whose first run was refused at its start (device=cuda on a machine without one)
    left its header alone, holding the failing override: the command without it was refused as
    another grid's ("give its overrides again"), the one with it failed again. A header without
    a run that wrote a checkpoint or a record is replaced by the next command's."""
    from attnres.experiments.job.runner import check_same_experiment

    out = tmp_path / "grid"
    out.mkdir()
    failed = {"experiment": "compare", "preset": "tiny", "overrides": [f"data.paths=[{corpus}]", "steps=2",
                                                                       "device=cuda"]}
    (out / "experiment.json").write_text(json.dumps(failed))
    run_experiment(get_experiment("compare", "tiny"), out, [0], failed["overrides"][:2], variants=["standard"],
                   log=lambda s: None)
    assert json.loads((out / "experiment.json").read_text())["overrides"] == failed["overrides"][:2]
    with pytest.raises(ValueError, match="holds the 'compare' grid trained with the overrides"):  # now it binds
        check_same_experiment(out, failed)


def test_a_misspelt_override_given_to_continue_a_grid_is_refused_by_its_name(tmp_path):
    """`attnres compare --out X stpes=600` on a grid trained without overrides said the grid was
    "trained with the overrides none; this command gives stpes=600": the typo read as a change
    of the grid's settings. The unknown key is named first, with the key meant."""
    out = tmp_path / "grid"
    out.mkdir()
    (out / "experiment.json").write_text(json.dumps({"experiment": "compare", "preset": "tiny", "overrides": []}))
    with pytest.raises(ValueError, match=r"unknown TrainConfig key\(s\) \['stpes'\] \(did you mean 'steps'"):
        run_experiment(get_experiment("compare", "tiny"), out, [0], ["stpes=600"], log=lambda s: None)
    assert sorted(p.name for p in out.iterdir()) == ["experiment.json"]


def test_a_misspelt_override_of_a_new_grid_is_said_as_the_grids_not_its_first_variants(tmp_path):
    """`attnres compare --out X step=10` said "experiment 'compare' variant 'standard': unknown
    TrainConfig key(s) ['step']": a mistake of every run read as one of the standard model's.
    The overrides are named instead; a variant's own error still names the variant."""
    from attnres.experiments.job.runner import run_config
    exp = get_experiment("compare", "tiny")
    with pytest.raises(ValueError, match=r"^experiment 'compare', the overrides \['step=10'\] \(every run of the grid\): "
                                         r"unknown TrainConfig key\(s\) \['step'\] \(did you mean 'steps'"):
        run_config(exp, exp.variants[0], 0, tmp_path / "run", ["step=10"])
    broken = dataclasses.replace(exp.variants[0], train={"stpes": 3})
    with pytest.raises(ValueError, match=r"^experiment 'compare' variant 'standard': unknown TrainConfig key\(s\) "
                                         r"\['stpes'\]"):
        run_config(exp, broken, 0, tmp_path / "run", ["steps=10"])


def test_an_override_of_what_the_variants_set_names_their_values_and_the_way_to_train_others():
    """`attnres compare model.residual.block_size=4` (Block AttnRes at another S) was refused
    with "choose variants with --variants", which cannot change S: the message names what each
    variant sets and the way to train other values, a Variant of your own."""
    from attnres.experiments.job.runner import check_grid_overrides

    with pytest.raises(ValueError, match=r"^override 'model.residual.block_size=4' changes model.residual.block_size, "
                                         r"which the 'compare' grid sets per variant \(block: 2\): choose among its "
                                         r"variants with --variants, or train other values as a Variant of your own in "
                                         r"Python \(docs/experiments.md, \"Grids\"\)$"):
        check_grid_overrides(get_experiment("compare", "tiny"), ["model.residual.block_size=4"])
    with pytest.raises(ValueError, match=r"sets per variant \(baseline_s1: 2, block_s1: 2, full_s1: 2, baseline_s2: 3, "
                                         r"\.\.\. \(9 variants\)\)"):
        check_grid_overrides(get_experiment("scaling", "tiny"), ["steps=5"])


def test_an_override_of_what_the_variants_set_is_refused_in_an_earlier_versions_flat_spelling_too():
    """`attnres compare model.attnres_block_size=4` (the flat key of earlier versions, still
    read) was not seen as an override of ``model.residual.block_size``, which the grid sets per
    variant: every run took S = 4, the grid's Block AttnRes trained at S = 4 under its S = 2 name.
    Refused as the nested spelling is; a flat key of a field the grid leaves alone is taken."""
    from attnres.experiments.job.runner import check_grid_overrides

    with pytest.raises(ValueError, match=r"^override 'model.attnres_block_size=4' changes model.residual.block_size, "
                                         r"which the 'compare' grid sets per variant \(block: 2\)"):
        check_grid_overrides(get_experiment("compare", "tiny"), ["model.attnres_block_size=4"])
    with pytest.raises(ValueError, match=r"^override 'model.attnres_key_norm=false' changes "
                                         r"model.residual.ablation.key_norm, which the 'ablation' grid sets per variant"):
        check_grid_overrides(get_experiment("ablation", "tiny"), ["model.attnres_key_norm=false"])
    check_grid_overrides(get_experiment("compare", "tiny"), ["model.attnres_eps=1e-5", "model.hc_streams=2"])


def test_an_override_of_a_field_no_run_of_the_grid_reads_is_warned_of(tmp_path):
    """`attnres compare model.residual.hc_streams=2` trained each of standard, Block and Full
    AttnRes as if it were not there without a word (the grid builds its runs' configs from
    mappings, which say nothing; `attnres train` warns of it). Warned once per field, naming
    the grid's variants; a field some run reads (Full AttnRes' full_group_size) is for it."""
    import warnings

    out = tmp_path / "grid"
    out.mkdir()  # (a header of another grid: refused after the runs' configs, before anything trains)
    (out / "experiment.json").write_text(json.dumps({"experiment": "other", "preset": "tiny", "overrides": []}))
    overrides = ["model.residual.hc_streams=2", "model.residual.sinkhorn_iters=3", "model.residual.full_group_size=2"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="holds a different experiment"):
            run_experiment(get_experiment("compare", "tiny"), out, [0, 1], overrides, log=lambda s: None)
    said = [str(w.message) for w in caught if "none of the runs" in str(w.message)]
    assert said == [
        "override model.residual.hc_streams=2 is read only by hyper_connections, mhc and mhc_lite, none of the runs "
        "of the 'compare' grid (standard, attnres_block, attnres_full): each trains the same model whatever it holds, "
        "so it is not used (leave it out)",
        "override model.residual.sinkhorn_iters=3 is read only by mhc, none of the runs of the 'compare' grid "
        "(standard, attnres_block, attnres_full): each trains the same model whatever it holds, so it is not used "
        "(leave it out)"]


@pytest.mark.parametrize("override", ["resume=true", "resume_from=elsewhere/run"])
def test_resume_overrides_are_refused_before_the_grid_is_written(tmp_path, override, capsys):
    """`attnres compare --out X resume=true` wrote the grid's header, then its first run was
    refused with train's advice ("drop --resume"), and resume_from=RUN resumed that one
    checkpoint into every run of the grid. The grid resumes each run from its own
    checkpoints: both are refused by name, before anything is written."""
    out = tmp_path / "grid"
    with pytest.raises(SystemExit, match=rf"override '{override.split('=')[0]}=.*' changes {override.split('=')[0]}, "
                                         "which the grid sets for each run \\(a run with checkpoints is resumed from its "
                                         "newest: give the grid's command again\\)"):
        cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "standard", "--overhead-repeats", "0",
                  override])
    assert not out.exists()


def test_a_layout_of_several_ranks_is_refused_before_the_grid_is_written(tmp_path):
    """`attnres compare --out X parallel.dp=2` wrote the grid's header, then its first run was
    refused with train's advice to launch `torchrun ... -m attnres train`, where a grid runs in
    one process (a torchrun launch of it is refused). Refused first, naming the grid's way."""
    out = tmp_path / "grid"
    with pytest.raises(SystemExit, match=r"error: parallel asks for dp 2 x tp 1 x pp 1 = 2 ranks, where a grid trains "
                                         r"its runs one after another in one process: leave the parallel.\* overrides "
                                         r"out \(or train each run with attnres train under torchrun\)$"):
        cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "standard", "--overhead-repeats", "0",
                  "parallel.dp=2"])
    assert not out.exists()


def test_a_run_that_diverges_is_named_with_the_grid_it_stopped(corpus, tmp_path, capsys):
    """One diverged run of a grid ended `attnres compare` with the trainer's message alone
    ("non-finite gradient norm at step 4 ..."), which of the grid's runs it was scrolled away."""
    out = tmp_path / "grid"
    with pytest.raises(SystemExit) as stop:
        cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "standard", "--overhead-repeats", "0",
                  f"data.paths=[{corpus}]", "lr=1e4", "steps=8"])
    message = str(stop.value.code)
    assert message.startswith(f"attnres compare: error: run standard seed 0 ({out / 'standard' / 'seed0'}): non-finite")
    assert message.endswith("set grad_clip (the grid's finished runs are kept: --report-only reports them)")


def test_an_interrupted_grid_says_once_how_to_resume(corpus, tmp_path, monkeypatch, capsys):
    """Ctrl-C in `attnres compare` printed "interrupted (run ... stopped by SIGINT; re-run the
    experiment to resume it); run the same command again to resume": two hints, one vague."""
    from types import SimpleNamespace

    import attnres.experiments.job.runner as runner

    out = tmp_path / "grid"
    # (the status is a shell's of the signal, as attnres train's: SIGTERM's was 130, as for Ctrl-C)
    for signal_name, status in (("SIGINT", 130), ("SIGTERM", 143)):
        monkeypatch.setattr(runner, "train", lambda config, **_: SimpleNamespace(interrupted=signal_name))
        assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "standard",
                         "--overhead-repeats", "0", f"data.paths=[{corpus}]"]) == status
        assert capsys.readouterr().out.splitlines()[-1] == (
            f"attnres compare: interrupted (run {out / 'standard' / 'seed0'} stopped by {signal_name}, at its "
            "checkpoint); run the same command again to resume")


def test_a_grid_is_not_started_inside_another_grid(tmp_path):
    """`attnres compare --out runs/compare/block` (a grid's variant folder, tab-completed) trained
    a whole new grid there, its runs mixed with the grid's own `block/seed0`."""
    from attnres.experiments.job.runner import check_same_experiment

    grid = tmp_path / "compare"
    (grid / "block" / "seed0").mkdir(parents=True)
    (grid / "experiment.json").write_text(json.dumps({"experiment": "compare", "preset": "tiny", "overrides": []}))
    header = {"experiment": "compare", "preset": "demo", "overrides": []}
    for inside in (grid / "block", grid / "block" / "new"):
        with pytest.raises(ValueError, match=rf"^--out '{re.escape(str(inside))}' is inside the grid "
                           rf"'{re.escape(str(grid))}' \(it holds experiment.json\); pick a folder outside it"):
            check_same_experiment(inside, header)
    (tmp_path / "experiment.json").write_text("[1, 2]")  # another tool's file of that name: no grid
    check_same_experiment(tmp_path / "elsewhere", header)


def test_a_grids_run_given_as_out_names_the_grids_folder(tmp_path):
    """`attnres compare --out runs/compare/block/seed0 --report-only` (a run, tab-completed) was
    told "pick another --out, e.g. a new folder", where a new folder reports nothing: the
    grid's folder is the --out that reports or continues it."""
    from attnres.experiments.job.runner import check_same_experiment

    grid = tmp_path / "compare"
    run = grid / "block" / "seed0"
    (run / "checkpoints").mkdir(parents=True)
    (grid / "experiment.json").write_text(json.dumps({"experiment": "compare", "preset": "tiny", "overrides": []}))
    with pytest.raises(ValueError, match=rf"^--out '{re.escape(str(run))}' is a training run's directory \(it holds "
                       rf"checkpoints/\), a run of the grid '{re.escape(str(grid))}': give the grid's folder, "
                       rf"--out {re.escape(str(grid))}, to continue or report it$"):
        check_same_experiment(run, {"experiment": "compare", "preset": "tiny", "overrides": []})
    alone = tmp_path / "run"  # a run of no grid: another --out, as before
    (alone / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="pick another --out, e.g. a new folder"):
        check_same_experiment(alone, {"experiment": "compare", "preset": "tiny", "overrides": []})


def test_a_cpu_run_on_a_gpu_machine_records_no_gpu_peak(corpus, tmp_path, monkeypatch):
    """A grid run with device=cpu on a machine with a GPU recorded the GPU's peak (0 B, or
    another process's) as its peak memory, where a CPU run has none; the reset ran on the
    current GPU, not the run's. The peak is that of the GPU the run trains on, None on the CPU.
    CUDA stubbed: a GPU present, the allocator's calls recorded."""
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: calls.append(("peak", device)) or 0)
    command = ["compare", "--preset", "tiny", "--out", str(tmp_path), "--variants", "standard", "--overhead-repeats",
               "0", "device=cpu", f"data.paths=[{corpus}]"]
    assert cli_main(command) == 0
    assert calls == []
    assert json.loads((tmp_path / "standard" / "seed0" / "result.json").read_text())["peak_memory_bytes"] is None


def test_a_grids_model_vocab_size_replaced_by_the_tokenizers_is_warned_of(corpus, tmp_path):
    """A grid given model.vocab_size=300 trained each run at the tokenizer's 256 rows without a
    word, where attnres train says so: each run says it, once; a grid without it says nothing."""
    import warnings

    def said(out, *extra) -> list[str]:
        command = ["compare", "--preset", "tiny", "--out", str(out), "--variants", "standard", "--overhead-repeats", "0",
                   f"data.paths=[{corpus}]", *extra]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cli_main(command) == 0
        return [str(w.message) for w in caught if "model.vocab_size" in str(w.message)]

    given = said(tmp_path / "given", "model.vocab_size=300")
    assert len(given) == 1 and given[0].startswith("model.vocab_size=300 is replaced by 256, the tokenizer's vocabulary")
    assert said(tmp_path / "default") == []
