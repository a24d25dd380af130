"""Weights & Biases: the run's metrics mirrored to a W&B project (``wandb_project=NAME``).

``metrics.jsonl`` stays the record of the run; W&B gets the same scalars as TensorBoard, each
under ``<kind>/<name>`` (``train/loss``, ``eval/val_loss``, ``diagnostics/block_grad_norm/3``) at
the step it was logged at, and the resolved config. The W&B run is named after ``out_dir``
and its id is kept in ``out_dir/wandb.json``, so a resumed run (``--resume``) continues the
same W&B run (the steps logged after the last checkpoint before the interruption keep their
first values there: W&B's steps only go up; a warning says so). W&B's own settings come from
its environment: ``WANDB_ENTITY``, ``WANDB_MODE`` (``offline`` writes the run under
``out_dir/wandb/`` for a later ``wandb sync``; no network needed), ``WANDB_API_KEY`` or
``wandb login``.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from ..extras import install_command
from ..output_paths import write_text_atomically
from ..user_warning import warn_user

#: The file in ``out_dir`` that keeps the W&B run id across resumptions.
WANDB_FILE = "wandb.json"

#: Characters W&B refuses in a project name.
_NOT_IN_A_PROJECT_NAME = "/\\#?%:"


def require_wandb(project: str | None) -> None:
    """Raise ``ValueError`` before any work when ``wandb_project`` is set and the ``wandb``
    package is missing."""
    if project is None:
        return
    bad = sorted(set(project) & set(_NOT_IN_A_PROJECT_NAME))
    if bad or len(project) > 128:
        raise ValueError(f"TrainConfig.wandb_project must be a W&B project name: at most 128 characters, none of "
                         f"{' '.join(_NOT_IN_A_PROJECT_NAME)}; got {project!r}")
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise ValueError(f"wandb_project={project!r} needs the wandb package ({install_command('wandb')}); or "
                         "leave wandb_project unset (null) to log to metrics.jsonl and TensorBoard only")


class WandbMirror:
    """The W&B run of one training run (rank 0): ``log`` mirrors a metrics record, ``close``
    finishes the W&B run."""

    def __init__(self, project: str, out_dir: Path, resume_step: int | None, config: dict[str, Any]) -> None:
        import wandb

        keep = out_dir / WANDB_FILE
        run_id = None
        if resume_step is not None and keep.is_file():  # the same W&B run as before the interruption
            try:
                run_id = json.loads(keep.read_text())["id"]
            except (ValueError, KeyError, TypeError):
                run_id = None
        if run_id is None:
            run_id = uuid.uuid4().hex[:16]
            # (renamed into place: cut short by a kill, the resumed run could not read the id
            # and started another W&B run)
            write_text_atomically(keep, json.dumps({"id": run_id, "project": project}), f"out_dir's {WANDB_FILE}")
        self.run = None
        try:
            self.run = wandb.init(project=project, name=str(out_dir), id=run_id, resume="allow", dir=str(out_dir),
                                  config=config)
        except wandb.errors.Error as e:  # not logged in, no network, a project of another entity
            raise ValueError(f"wandb_project={project!r}: W&B could not start the run ({type(e).__name__}: {e}); "
                             "log in (wandb login, or WANDB_API_KEY), or set WANDB_MODE=offline to write the run "
                             f"under {str(out_dir / 'wandb')!r} for a later `wandb sync`") from None
        # W&B's steps only go up: the steps an interrupted run logged after its last checkpoint
        # stay in the W&B run, and their redone values (metrics.jsonl's) are ignored there.
        first = getattr(self.run, "starting_step", 0) or 0
        if resume_step is not None and first > resume_step + 1:
            warn_user(f"wandb_project={project!r}: the W&B run {run_id} already holds steps up to {first - 1}, "
                      f"logged before the interruption; this run resumes at step {resume_step + 1}, so W&B keeps "
                      f"the old values of steps {resume_step + 1}-{first - 1} and ignores the redone ones "
                      f"(metrics.jsonl has them)")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """One record's scalars (:func:`attnres.train.metrics.scalars`) at ``step``."""
        if scalars:
            self.run.log(scalars, step=step)

    def update_config(self, config: dict[str, Any]) -> None:
        """The run's config as the data resolved it (the model's vocabulary, from the tokenizer):
        W&B starts before the data is read."""
        self.run.config.update(config, allow_val_change=True)

    def close(self, failed: bool = False) -> None:
        """Finish the W&B run; ``failed``: marked failed there (the set-up stopped after it started)."""
        if self.run is not None:
            if failed:
                self.run.finish(exit_code=1)
            else:
                self.run.finish()
            self.run = None
