"""The layout of an experiment directory: where each run lives and the files the runner,
the overhead measurement and the reports share.

::

    out/experiment.json               name, preset, overrides (EXPERIMENT_FILE)
    out/overhead.json                 side-by-side step time and memory (OVERHEAD_FILE)
    out/<variant>/seed<k>/            one attnres.train run directory
    out/<variant>/seed<k>/result.json the run's record, written last (RESULT_FILE)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..output_paths import read_json_object

EXPERIMENT_FILE = "experiment.json"
OVERHEAD_FILE = "overhead.json"
RESULT_FILE = "result.json"

#: Overrides (by their top-level key) that say how this command trains, not what the grid is,
#: as ``attnres train --resume`` takes them from each launch (train.resume.PER_LAUNCH, less
#: ``out_dir`` and ``resume*``, which the grid sets per run): how far (a grid paused with
#: ``stop_after=K`` is continued by its command without it), the progress display and the
#: process layout (``parallel.*``, the rank timeouts). Neither stored in ``experiment.json``
#: nor compared with the grid's overrides: a grid continued with ``progress=false`` or
#: another ``parallel.dp`` was refused as another grid's. (Restated here, where ``attnres
#: status`` reads it without the training code; a test keeps the two alike.)
PER_LAUNCH_OVERRIDES = frozenset({"stop_after", "progress", "parallel", "distributed", "dist_timeout_s",
                                  "setup_timeout_s"})


def grid_overrides(overrides: list[str]) -> list[str]:
    """``overrides`` less the per-launch ones (:data:`PER_LAUNCH_OVERRIDES`): the grid's own,
    as ``experiment.json`` stores them (one written by an earlier version may hold some)."""
    return [o for o in overrides if _top_key(o) not in PER_LAUNCH_OVERRIDES]


def _top_key(override: str) -> str:
    """The top-level key an override sets: ``parallel`` for ``parallel.dp=2``."""
    return str(override).partition("=")[0].strip().split(".")[0]


def run_dir(out: str | Path, variant: str, seed: int) -> Path:
    """The directory of one run in an experiment directory: ``out/<variant>/seed<k>``."""
    return Path(out) / variant / f"seed{seed}"


def saved_config(out: Path, record: dict[str, Any]) -> dict[str, Any] | None:
    """The ``config.json`` the run of ``record`` wrote (``None`` if it is missing)."""
    path = run_dir(out, record["variant"], record["seed"]) / "config.json"
    return json.loads(path.read_text()) if path.exists() else None


def read_overhead(out: Path) -> dict[str, Any] | None:
    """The side-by-side measurements of ``out/overhead.json`` (``None`` if not measured);
    ``ValueError`` naming the file and the fix when it cannot be read (cut short: the JSON
    parser's words alone, "Expecting ':' delimiter", named no file)."""
    path = Path(out) / OVERHEAD_FILE
    if not path.exists():
        return None
    return read_grid_file(path, "delete it (the report then takes the step times the runs logged), and the grid's "
                                "command without --report-only measures them again")


def data_fingerprint(checkpoint: Path | None) -> str | None:
    """The fingerprint of the text a run trained on, from the ``state.json`` of its final
    ``checkpoint``; ``None`` without one, or where it does not say (the report says where a
    grid's runs trained on different texts)."""
    state, _ = read_json_object(Path(checkpoint) / "state.json") if checkpoint is not None else (None, None)
    data = state.get("data") if state is not None else None
    return data.get("fingerprint") if isinstance(data, dict) else None


def read_grid_file(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object a grid wrote to ``path`` (a run's record, the overhead measurements);
    ``ValueError`` naming the file, why it cannot be read (cut short, edited) and ``fix``."""
    value, cause = read_json_object(path)
    if value is None:
        raise ValueError(f"{str(path)!r} cannot be read ({cause}); {fix}")
    return value


def read_experiment_header(out: str | Path) -> dict[str, Any] | None:
    """``out/experiment.json`` (experiment name, preset, overrides), or ``None`` when ``out``
    holds no experiment yet or the file is not a JSON mapping."""
    path = Path(out) / EXPERIMENT_FILE
    try:
        header = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return header if isinstance(header, dict) else None
