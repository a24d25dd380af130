"""Where a run starts from, and whether it may: resume (``resume`` / ``resume_from``) and
fine-tuning starts (``init_from``).

* :func:`find_valid_checkpoint` - the newest checkpoint that verifies, falling back past
  corrupted or incomplete ones (and, in the run's own directory, setting them aside as
  ``checkpoints/corrupt-step-*`` so nothing is lost and later tools skip them).
* :func:`check_resumable` - the config may differ only in fields that do not change the
  trajectory; ``steps`` only where the learning rate of every step already taken stays the
  same (:func:`schedule_change`).
* :func:`check_data` - the data's fingerprint must match the checkpoint's, unless
  ``allow_data_change`` says otherwise.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint import STATE_FILE, CheckpointError, checkpoint_dirs, read_checkpoint_state
from .config import RESUMABLE_CHANGES, TrainConfig, flatten
from .schedule import lr_factor

CORRUPT_PREFIX = "corrupt-"
SUPERSEDED_PREFIX = "superseded-"


@dataclass
class Source:
    """A verified checkpoint to start from: its directory and its ``state.json``."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return self.state["step"]


def _set_aside(path: Path, prefix: str) -> Path:
    """Rename checkpoint ``path`` to ``<prefix><name>`` beside it (a free name), keeping it."""
    target = path.with_name(prefix + path.name)
    k = 1
    while target.exists():
        target = path.with_name(f"{prefix}{path.name}.{k}")
        k += 1
    path.rename(target)
    return target


def find_valid_checkpoint(location: str | Path, set_aside: bool = False, optional: tuple[str, ...] = ()) -> Source | None:
    """The newest checkpoint at ``location`` that verifies: ``location`` is a ``step-*``
    directory (it must verify) or a run directory (its checkpoints, newest first). Each one
    that fails verification, when an older one verifies, is reported with a warning and, with
    ``set_aside`` (the run's own directory, under its lock), renamed to ``corrupt-step-*``.
    ``None`` when the run directory holds no checkpoint; :class:`CheckpointError` naming
    every problem when none verifies (nothing is renamed then). ``optional``: files that may
    be absent (see :func:`read_checkpoint_state`)."""
    location = Path(location)
    if (location / STATE_FILE).is_file() or location.name.startswith("step-"):
        return Source(location, read_checkpoint_state(location, optional))
    candidates = checkpoint_dirs(location)
    bad: list[tuple[Path, str]] = []
    for path in reversed(candidates):
        try:
            state = read_checkpoint_state(path, optional)
        except CheckpointError as e:
            bad.append((path, str(e)))
            continue
        for broken, problem in bad:  # set aside only with a valid one to fall back to
            moved = f"; set aside as {_set_aside(broken, CORRUPT_PREFIX).name!r}" if set_aside else ""
            warnings.warn(f"skipping a checkpoint that does not verify: {problem}{moved}", stacklevel=3)
        if bad:
            warnings.warn(f"falling back to the newest valid checkpoint {str(path)!r} (step {state['step']})",
                          stacklevel=3)
        return Source(path, state)
    if bad:
        raise CheckpointError(f"no checkpoint in {str(location)!r} verifies: " + "; ".join(p for _, p in bad))
    return None


def set_aside_newer(out_dir: str | Path, step: int) -> list[Path]:
    """Rename the checkpoints of ``out_dir`` newer than ``step`` to ``superseded-step-*``: a
    run resumed from an earlier checkpoint makes them part of an abandoned trajectory (they
    are kept, but no resume or tool picks them up)."""
    moved = []
    for path in checkpoint_dirs(out_dir):
        if int(path.name.split("-", 1)[1]) > step:
            moved.append(_set_aside(path, SUPERSEDED_PREFIX))
    return moved


def _normalised(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config as this version writes it (older checkpoints may lack newer fields or
    use older spellings); the saved mapping itself when it no longer validates."""
    try:
        return TrainConfig.from_dict(saved).to_dict()
    except (ValueError, TypeError):
        return saved


def schedule_change(saved: dict[str, Any], current: dict[str, Any], done: int) -> str | None:
    """``None`` when the learning rate of each of the ``done`` steps already taken is the same
    under ``current`` as under ``saved`` (then a changed ``steps`` changes nothing about the
    past: the resumed run equals a run trained with the new ``steps`` from the start);
    otherwise the first step where they differ, in words."""
    keys = ("schedule", "warmup_steps", "min_lr_ratio", "decay_fraction")
    if saved.get("steps") == current.get("steps"):
        return None
    for s in range(done):
        old = lr_factor(s, saved["steps"], *(saved[k] for k in keys))
        new = lr_factor(s, current["steps"], *(current[k] for k in keys))
        if old != new:
            return (f"at step {s + 1} the learning rate was {old:.4g} x lr with steps={saved['steps']} and would have "
                    f"been {new:.4g} x lr with steps={current['steps']}")
    return None


def check_resumable(saved: dict[str, Any], current: dict[str, Any], source: Source) -> None:
    """Raise ``ValueError`` when ``current`` may not continue ``source`` (whose config is
    ``saved``): a field that changes the trajectory differs, or ``steps`` changes the
    learning rate of the steps already taken, or falls below them."""
    old, new = flatten(_normalised(saved)), flatten(current)
    differing = sorted(k for k in set(old) | set(new) if k not in RESUMABLE_CHANGES and old.get(k) != new.get(k))
    if differing:
        raise ValueError(f"cannot resume from {str(source.path)!r}: the config differs in {differing} "
                         f"(only {sorted(RESUMABLE_CHANGES)} may change on resume; to start over from these weights "
                         "with other settings, use init_from)")
    step = source.step
    if current["steps"] < step:
        raise ValueError(f"cannot resume from {str(source.path)!r}: steps={current['steps']} is below the checkpoint's "
                         f"step {step}")
    change = schedule_change(old, new, step)
    if change is not None:
        raise ValueError(
            f"cannot resume from {str(source.path)!r} with steps={new['steps']}: the checkpoint was trained with "
            f"steps={old['steps']}, and the {old['schedule']!r} learning-rate schedule spans `steps` ({change}), so the "
            "run would jump to another point of its schedule. To stop earlier, keep "
            f"steps={old['steps']} and set stop_after=K. To train longer, start a new run from this checkpoint's "
            f"weights with init_from={str(source.path)} (fresh optimiser and schedule), or, for a schedule you mean to "
            "extend, use schedule=wsd or constant: their steps may change on resume while the learning rate of the "
            "steps already taken stays the same (WSD: before the decay starts).")


def check_data(source: Source, fingerprint: str, allow_change: bool) -> bool:
    """Compare the data's ``fingerprint`` with the one ``source`` was trained on. Returns
    whether the data changed (then ``allow_change`` was set: a warning says so); raises
    ``ValueError`` when it changed and ``allow_change`` is not set. Checkpoints of earlier
    versions store no fingerprint: a warning says the data cannot be checked."""
    saved = (source.state.get("data") or {}).get("fingerprint")
    if saved is None:
        warnings.warn(f"checkpoint {str(source.path)!r} stores no data fingerprint (written by an earlier version): "
                      "cannot check that the data is unchanged", stacklevel=2)
        return False
    if saved == fingerprint:
        return False
    if not allow_change:
        raise ValueError(
            f"the training data differ from the data checkpoint {str(source.path)!r} was trained on (fingerprint "
            f"{fingerprint[:12]} vs {saved[:12]}): resuming would continue on other text without a word. Point "
            "data.paths at the original data, or set allow_data_change=true to continue on the new data (tokenised "
            "with the checkpoint's tokenizer, the data position starting over)")
    warnings.warn(f"allow_data_change=true: the data differ from checkpoint {str(source.path)!r}'s (fingerprint "
                  f"{fingerprint[:12]} vs {saved[:12]}); continuing on the new data with the checkpoint's tokenizer, "
                  "the data position starting over", stacklevel=2)
    return True
