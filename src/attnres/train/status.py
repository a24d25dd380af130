"""Where training runs stand (``attnres status``): read from what a run writes, never
changing it - ``config.json``, ``metrics.jsonl``, ``checkpoints/`` and the ``run.lock`` of a
run in progress.

A run directory is one holding ``config.json`` and ``metrics.jsonl`` or ``checkpoints/``
(a transformers directory has a ``config.json`` but neither); :func:`find_runs` finds them
under a folder, a grid's ``<variant>/seed<k>`` runs included.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint import latest_checkpoint
from ..checkpoint.locate import reached_as
from ..checkpoint.manifest import STATE_FILE, step_of_directory
from ..output_paths import read_json_object
from ..shell_words import shell_path
from .lock import LOCK_FILE, stale_here
from .metrics import DATA_CHANGE, METRICS_FILE, read_metrics

__all__ = ["RunStatus", "find_runs", "run_status"]

#: Folders a run writes inside itself, never runs of their own.
_INSIDE_A_RUN = {"checkpoints", "tensorboard", "wandb", "analysis"}


@dataclass
class RunStatus:
    """One run: its model (``residual`` kind, ``n_layers``, ``d_model``), how far it got
    (``step`` of its newest record, of ``steps``), its latest losses (``val_step``: where
    ``val_loss`` was measured), tokens/s of its last logging window (``tokens_per_s``, over the
    ``tokens_per_s_steps`` optimiser steps since the record before it: a running run's speed
    now, not the run's mean), its newest checkpoint's
    step, and ``state``: ``running`` (a live process holds its lock), ``finished`` (a
    checkpoint of its last step; without checkpoints, a record of it), ``diverged`` (its last record: a loss or gradient norm that
    was not finite), ``stopped``, ``not started``, or ``unknown`` (a checkpoint, but no config
    that says the run's ``steps``); ``holder``: who holds the lock (``None`` unless running,
    or a lock left by a process of another host); ``config_error``: why its ``config.json``
    cannot be read, and where the model and ``steps`` came from instead; ``tokenizer``: what its
    losses are per token of (:func:`tokenizer_description`); ``block_size``: the S its config
    stores for a variant that reads it (Block AttnRes and its subclasses; ``None`` for other
    residuals, and for one not registered here: :func:`_block_size`), which tells the runs of a
    block-size sweep apart; ``data``: the text it trained on (:func:`data_fingerprint`); ``data_changes``: the steps it was
    resumed at onto other text (``allow_data_change``: its metrics.jsonl's ``data_change``
    records), where its validation loss changes text."""

    path: str
    residual: str | None
    n_layers: int | None
    d_model: int | None
    step: int
    steps: int | None
    train_loss: float | None
    val_loss: float | None
    val_step: int | None
    tokens_per_s: float | None
    checkpoint_step: int | None
    state: str
    holder: str | None = None
    config_error: str | None = None
    tokenizer: str | None = None
    block_size: int | None = None
    data: str | None = None
    data_changes: list[int] = field(default_factory=list)
    tokens_per_s_steps: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_run_directory(path: Path) -> bool:
    return (path / "config.json").is_file() and ((path / METRICS_FILE).is_file() or (path / "checkpoints").is_dir())


def refuse_a_folder_of_runs(out_dir: str | Path) -> None:
    """``ValueError`` when ``out_dir`` is no run but holds runs at any depth, as
    :func:`find_runs` finds them (``runs/``, a sweep's folder, ``runs/`` holding
    ``runs/sweep1/<run>``, a grid's ``--out``): a run trained there put its files beside
    theirs, and ``attnres status`` and ``plot`` of the folder then found that run alone (a run
    is not looked inside). Looks no further than the first four runs it meets."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir() or is_run_directory(out_dir):
        return
    runs = list(itertools.islice(_runs_below(out_dir), 4))
    if runs:
        named = ", ".join(str(p) for p in runs[:3]) + (" and more" if len(runs) > 3 else "")
        raise ValueError(f"out_dir {str(out_dir)!r} is a folder of runs ({named}), not a run: a run written there "
                         f"would put its files beside theirs, and attnres status and plot of the folder would then "
                         f"find it alone; give the run a folder of its own "
                         f"(out_dir={shell_path(out_dir / 'NAME')}), or to continue one of them, "
                         f"`attnres train out_dir={shell_path(runs[0])} --resume`")


def find_runs(root: str | Path) -> list[Path]:
    """The run directories at or under ``root``, in sorted order (not looking inside runs);
    for a path inside a run (a ``checkpoints/step-*`` directory, as ``attnres generate``
    takes, or a file of one), that run."""
    root = Path(root)
    if is_run_directory(root):
        return [root]
    whole = Path(os.path.abspath(root))  # (`.` from within a run's checkpoints/ has no parents to read)
    enclosing = next((p for p in list(whole.parents)[:3] if is_run_directory(p)), None)
    # (a file of the run itself too: `attnres plot runs/x/metrics.jsonl` said it was no run)
    if enclosing is not None and (whole.relative_to(enclosing).parts[0] in _INSIDE_A_RUN or root.is_file()):
        return [reached_as(enclosing, root)]
    return sorted(_runs_below(root))


def _runs_below(root: Path) -> Iterator[Path]:
    """The run directories under ``root`` (not a run itself), depth first in sorted order, not
    looking inside runs, hidden folders or the folders a run writes."""
    for folder, subfolders, _ in os.walk(root):
        here = Path(folder)
        if is_run_directory(here):
            yield here
            subfolders.clear()
        else:
            subfolders[:] = sorted(s for s in subfolders if s not in _INSIDE_A_RUN and not s.startswith("."))


def run_status(path: str | Path, warn: bool = False) -> RunStatus:
    """The :class:`RunStatus` of the run directory ``path``; ``warn``: say how many lines of
    its metrics.jsonl could not be read, and which (``attnres status``)."""
    path = Path(path)
    newest = latest_checkpoint(path, replaced=True)  # (one a kill left moved aside: its step's until a restart)
    config, config_error = _run_config(path, newest)
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    residual = model.get("residual")
    kind = residual.get("kind") if isinstance(residual, dict) else residual
    records = read_metrics(path / METRICS_FILE, warn=warn)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval" and r.get("val_loss") is not None]
    checkpoint_step = step_of_directory(newest) if newest is not None else None
    step = max([r["step"] for r in records] + [checkpoint_step or 0])
    steps = config.get("steps")
    state, holder = _state(path, step, steps, checkpoint_step, bool(records) and records[-1]["kind"] == "diverged")
    return RunStatus(path=str(path), residual=kind, n_layers=model.get("n_layers"), d_model=model.get("d_model"),
                     step=step, steps=steps, train_loss=train[-1].get("loss") if train else None,
                     val_loss=evals[-1]["val_loss"] if evals else None, val_step=evals[-1]["step"] if evals else None,
                     tokens_per_s=train[-1].get("tokens_per_s") if train else None, checkpoint_step=checkpoint_step,
                     state=state, holder=holder, config_error=config_error, tokenizer=tokenizer_description(config),
                     block_size=_block_size(residual, kind, model.get("n_layers")), data=data_fingerprint(newest),
                     data_changes=sorted({r["step"] for r in records if r["kind"] == DATA_CHANGE}),
                     tokens_per_s_steps=_window_steps(train))


def _window_steps(train: list[dict[str, Any]]) -> int | None:
    """The optimiser steps the last ``train`` record's tokens/s was measured over: from the
    train record before it (its log_every, or fewer at the run's last step), or from the start
    where it is the first. A record of a step a resume trained again (logged before a kill,
    past the checkpoint resumed from) is not the one before it."""
    if not train:
        return None
    last = train[-1]["step"]
    return last - max((r["step"] for r in train[:-1] if r["step"] < last), default=0)


def _block_size(residual: Any, kind: Any, n_layers: Any) -> int | None:
    """The block size a run's model has, where its variant reads it (its class's
    ``reads_fields``: Block AttnRes, a subclass of it, a variant of the user's that declares
    it; by name, only Block AttnRes itself showed it): the stored ``block_size``, or where the
    config leaves it to be derived (``null``) the S it derives from the depth
    (``ResidualConfig.resolved_block_size``; a default-S run showed none, beside a sweep's
    runs that state theirs). ``None`` for another variant, and for a kind not registered here
    (a residual of the user's whose module this command did not import, ``attnres --import
    MODULE status``: its class is not guessed)."""
    from ..nn.residual import ResidualConfig, residual_class

    size = residual.get("block_size") if isinstance(residual, dict) else None
    try:
        reads = "block_size" in residual_class(kind).reads_fields
    except ValueError:  # (UnregisteredResidual)
        return None
    if reads and size is None and isinstance(n_layers, int) and not isinstance(n_layers, bool) and n_layers > 0:
        size = ResidualConfig().resolved_block_size(2 * n_layers)  # (L: ModelConfig.n_sublayers, two a block)
    return size if reads and isinstance(size, int) else None


def tokenizer_description(config: dict[str, Any]) -> str | None:
    """The tokenizer a run's losses are per token of, from its config (``config.json``'s): its
    vocabulary (the model's, set from the tokenizer, a checkpoint's on resume) and the
    ``data.tokenizer`` asked for, e.g. ``"256 tokens (byte)"``; ``None`` where it does not say."""
    model, data = config.get("model"), config.get("data")
    vocab = model.get("vocab_size") if isinstance(model, dict) else None
    asked = data.get("tokenizer") if isinstance(data, dict) else None
    return f"{vocab} tokens ({asked})" if isinstance(vocab, int) and isinstance(asked, str) else None


def data_fingerprint(checkpoint: Path | None) -> str | None:
    """The fingerprint of the text the checkpoint ``checkpoint`` (a run's newest: see
    :func:`run_data`) trained on, its first 12 hex digits as the start-up summary gives it, read
    from its ``state.json`` without verifying; ``None`` where there is none (a run copied
    without its checkpoints) or it does not read."""
    state = read_json_object(checkpoint / STATE_FILE)[0] if checkpoint is not None else None
    data = state.get("data") if state is not None else None
    fingerprint = data.get("fingerprint") if isinstance(data, dict) else None
    return fingerprint[:12] if isinstance(fingerprint, str) else None


def run_data(run: str | Path) -> str | None:
    """:func:`data_fingerprint` of the run directory ``run``'s newest checkpoint."""
    return data_fingerprint(latest_checkpoint(Path(run), replaced=True))


def _run_config(path: Path, newest: Path | None) -> tuple[dict[str, Any], str | None]:
    """The config of the run ``path``: its ``config.json``, or where that cannot be read (a
    truncated file), the one its newest checkpoint ``newest`` stores (its ``state.json``,
    read, not verified: status only reads); and, then, the sentence that says so (else
    ``None``). A finished run with a damaged config.json was called "stopped", its steps
    unknown, with no word of the file."""
    file = path / "config.json"
    config, cause = read_json_object(file)
    if config is not None:
        return config, None
    said = f"{str(file)!r} cannot be read ({cause})"
    try:
        stored = json.loads((newest / STATE_FILE).read_text())["config"] if newest is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        stored = None
    if isinstance(stored, dict):
        return stored, f"{said}; the model and steps are those its checkpoint {newest.name} stores"
    return {}, f"{said}; the model and steps are unknown"


def _state(path: Path, step: int, steps: int | None, checkpoint_step: int | None,
           diverged: bool) -> tuple[str, str | None]:
    lock = path / LOCK_FILE
    if lock.is_file():
        try:
            holder = json.loads(lock.read_text())
        except (OSError, ValueError):
            holder = None
        if isinstance(holder, dict) and not stale_here(holder):
            return "running", f"PID {holder.get('pid')} on {holder.get('host')}"
    # (a run copied without its checkpoints, as results/ holds them, logged its last step: it was
    # called "stopped", and no command continues it)
    if steps is not None and (checkpoint_step == steps or (checkpoint_step is None and step == steps)):
        return "finished", None
    if diverged:  # (its last record: the loss or the gradient norm was not finite, and it stopped unsaved)
        return "diverged", None
    if steps is None and checkpoint_step is not None:  # (no config says how far it was to go)
        return "unknown", None
    return ("stopped" if step > 0 else "not started"), None
