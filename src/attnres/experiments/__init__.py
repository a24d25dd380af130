"""Experiment grids: the main job ``attnres compare`` (= ``attnres experiment compare``) and
the report's grids, ``attnres experiment {ablation,block-size,scaling,arch-sweep,multiplier}``.

``job/`` holds the main job and the runner every grid goes through (presets, training, overhead
timing, reports); ``grids/`` the analyses particular to the report's grids (scaling laws, compute
multiplier). The helpers both use live here: ``stats`` (seed-level intervals and tests), ``flops``
(compute per token) and ``layout`` (the files of a results directory).

>>> from attnres.experiments import get_experiment, run_experiment, write_report
>>> exp = get_experiment("block-size", "cpu")
>>> records = run_experiment(exp, "runs/block-size", seeds=[0, 1])
>>> write_report("block-size", records, "runs/block-size")
"""

from .flops import PFLOPS_DAY, FlopCount, to_pflops_days, training_flops_per_token
from .job.presets import EXPERIMENTS, PRESET_NAMES, PRESETS, Experiment, Variant, arch_shape, get_experiment
from .job.report import summarize, write_report
from .stats import fit_power_law, mean_std
from .job.overhead import measure_overhead
from .job.runner import load_records, run_experiment

__all__ = [
    "EXPERIMENTS", "PRESET_NAMES", "PRESETS", "Experiment", "Variant", "get_experiment", "arch_shape",
    "run_experiment", "load_records", "measure_overhead", "write_report", "summarize", "mean_std", "fit_power_law",
    "training_flops_per_token", "FlopCount", "to_pflops_days", "PFLOPS_DAY",
]
