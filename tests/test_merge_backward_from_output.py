"""The study of a merge backward that needs no Phase-1 sum
(``benchmarks/merge_backward_from_output.py``): its algebra is exact - without rounding (float64
throughout) it gives today's gradients and float64 autograd's - so what the study reports under
bf16 is the rounding of the output it reads, not a derivation error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import merge_backward_from_output as study  # noqa: E402


@pytest.mark.parametrize("case", ["trained", "spread gains", "sharp weights"])
def test_the_backward_from_the_output_is_exact_without_rounding(case):
    x = {k: v.double() for k, v in study.inputs(case, tokens=33, d=40, seed=1).items()}
    x["g"] = x["g_exact"]
    truth = study.truth(x, x["g"])
    today, fwd = study.today(x)
    new = study.from_output(x, fwd)
    for name, t, a, b in zip(study.NAMES, truth, today, new):
        assert study.rel(a, t) < 1e-10, name
        assert study.rel(b, t) < 1e-10, name


def test_under_bf16_it_loses_precision_that_today_keeps():
    x = study.inputs("trained", tokens=64, d=256, seed=0)
    truth = study.truth(x, x["g"])
    today, fwd = study.today(x)
    new = study.from_output(x, fwd)
    query = study.NAMES.index("query")
    assert study.rel(today[query], truth[query]) < 1e-5
    assert study.rel(new[query], truth[query]) > 1e-4  # the bf16 output's rounding
