"""The report of ``benchmarks/bf16_stream_loss.py``: paired differences over seeds, and the
launchers of its two settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bf16_stream_loss as study


def test_report_pairs_each_setting_with_the_float32_stream_seed_by_seed():
    losses = {"block": {"float32 stream": {0: 4.00, 1: 4.10, 2: 3.90},
                        "bf16 stream": {0: 4.01, 1: 4.13, 2: 3.92},
                        "autocast stream": {0: 3.99, 1: 4.10, 2: 3.91}}}
    text = study.report(losses, 1000, [0, 1, 2])
    rows = {cells[1]: cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                          for line in text.splitlines() if line.startswith("| block"))}
    base, fsdp, autocast = (rows[study.SETTINGS[s]] for s in ("float32 stream", "bf16 stream", "autocast stream"))
    assert base[2:] == ["4.0000", "4.1000", "3.9000", "4.0000", ""]
    assert fsdp[2:6] == ["4.0100", "4.1300", "3.9200", "4.0200"]
    assert fsdp[6] == "+0.0200 ± 0.0100"  # differences 0.01, 0.03, 0.02: mean 0.02, sd 0.01
    assert autocast[6] == "+0.0000 ± 0.0100"  # differences -0.01, 0, 0.01
    assert "block 0.1000" in text  # the float32 runs' seed spread


def test_report_leaves_out_a_setting_that_has_not_run_every_seed():
    losses = {"standard": {"float32 stream": {0: 4.0, 1: 4.1}, "autocast stream": {0: 4.0}}}
    text = study.report(losses, 10, [0, 1])
    assert study.SETTINGS["autocast stream"] not in text and study.SETTINGS["float32 stream"] in text


def test_each_setting_launches_and_configures_its_runs():
    single, ranks = study.command("float32 stream"), study.command("bf16 stream")
    assert single[-2:] == ["attnres", "train"] and "torch.distributed.run" not in single
    assert ranks[ranks.index("--nproc-per-node") + 1] == "2" and ranks[-2:] == ["attnres", "train"]
    assert study.command("autocast stream") == single
    assert study.setting_overrides("autocast stream") == ["model.residual.autocast_stream=true"]
    assert study.setting_overrides("norm output") == ["model.residual.autocast_norm_output=true"]
    assert study.command("norm output") == single
    assert study.setting_overrides("float32 stream") == study.setting_overrides("bf16 stream") == []


def test_final_eval_reads_the_last_steps_validation_loss(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "eval", "step": 5, "val_loss": 3.5}\n'
                                            '{"kind": "train", "step": 10, "loss": 3.0}\n'
                                            '{"kind": "eval", "step": 10, "val_loss": 3.25}\n')
    assert study.final_eval(tmp_path, 10) == pytest.approx(3.25)
    assert study.final_eval(tmp_path, 20) is None and study.final_eval(tmp_path / "none", 10) is None
