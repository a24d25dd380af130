"""The report of ``benchmarks/bf16_stream_loss.py``: paired differences over seeds, and the
launchers of its two settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bf16_stream_loss as study


def test_report_pairs_the_settings_seed_by_seed():
    losses = {"block": {"float32 stream": {0: 4.00, 1: 4.10, 2: 3.90},
                        "bf16 stream": {0: 4.01, 1: 4.13, 2: 3.92}}}
    text = study.report(losses, 1000, [0, 1, 2])
    row = next(line for line in text.splitlines() if line.startswith("| block"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:4] == ["4.0000 / 4.0100", "4.1000 / 4.1300", "3.9000 / 3.9200"]
    assert cells[4:6] == ["4.0000", "4.0200"]
    assert cells[6] == "+0.0200 ± 0.0100"  # differences 0.01, 0.03, 0.02: mean 0.02, sd 0.01
    assert "block 0.1000" in text  # the float32 runs' seed spread


def test_the_bf16_stream_runs_on_two_fsdp2_ranks():
    single, ranks = study.command("float32 stream"), study.command("bf16 stream")
    assert single[-2:] == ["attnres", "train"] and "torch.distributed.run" not in single
    assert ranks[ranks.index("--nproc-per-node") + 1] == "2" and ranks[-2:] == ["attnres", "train"]


def test_final_eval_reads_the_last_steps_validation_loss(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "eval", "step": 5, "val_loss": 3.5}\n'
                                            '{"kind": "train", "step": 10, "loss": 3.0}\n'
                                            '{"kind": "eval", "step": 10, "val_loss": 3.25}\n')
    assert study.final_eval(tmp_path, 10) == pytest.approx(3.25)
    assert study.final_eval(tmp_path, 20) is None and study.final_eval(tmp_path / "none", 10) is None
