"""``metrics.jsonl``: the run's log of JSON records, written by :class:`MetricsLogger` and read
back by :func:`read_metrics`, which tolerates what a killed process leaves behind (a
truncated last line).

Every line is strict JSON. A value that is not a finite number (a diverged validation loss,
an infinite RMS in a diagnostics record) is written as ``null``, and the record's
``"nonfinite"`` field says what it was: ``{"val_loss": "NaN", "block_output_rms/1":
"Infinity"}`` (the path of the value - a field, then list indices - to ``NaN``,
``Infinity`` or ``-Infinity``). Python's ``json`` writes them as the bare ``NaN`` and
``Infinity`` that JSON does not have (``jq``, JavaScript and strict parsers refuse the line), as
the files of earlier versions hold; :func:`read_metrics` reads both into the same records,
``float("nan")`` where the value was NaN.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint.locate import RUN_LOG as METRICS_FILE
from ..output_paths import strict_json
from .out_dir import OutDirError, os_cause
from ..user_warning import warn_user

if TYPE_CHECKING:
    from .wandb_log import WandbMirror

__all__ = ["DATA_CHANGE", "METRICS_FILE", "NONFINITE", "MetricsLogger", "metrics_line", "read_metrics", "scalars"]

#: The field of a record that names its values that are not finite numbers (written as null).
NONFINITE = "nonfinite"


def _nonfinite(value: Any, path: str, found: dict[str, str]) -> None:
    """Collect into ``found`` the path (``name``, ``name/3``, ``name/3/0``) of every float in
    ``value`` that is not finite, with its JSON spelling (``NaN``, ``Infinity``, ``-Infinity``)."""
    if isinstance(value, float) and not math.isfinite(value):
        found[path] = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    elif isinstance(value, dict):
        for k, v in value.items():
            _nonfinite(v, f"{path}/{k}", found)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _nonfinite(v, f"{path}/{i}", found)


def metrics_line(record: dict[str, Any]) -> str:
    """One line of ``metrics.jsonl``: ``record`` as strict JSON, a value that is not finite as
    ``null`` named in the record's :data:`NONFINITE` field (see the module's docstring)."""
    found: dict[str, str] = {}
    for name, value in record.items():
        _nonfinite(value, name, found)
    return strict_json({**record, NONFINITE: found} if found else record) + "\n"


def _restored(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the values its :data:`NONFINITE` field names put back (as a file of an
    earlier version, written with bare ``NaN``, reads), that field removed."""
    marks = record.pop(NONFINITE, None)
    for path, spelling in (marks.items() if isinstance(marks, dict) else ()):
        *parents, last = path.split("/")
        owner: Any = record
        try:
            for part in parents:
                owner = owner[int(part) if isinstance(owner, list) else part]
            key = int(last) if isinstance(owner, list) else last
            if owner[key] is None:  # (a mark that does not fit the record is ignored)
                owner[key] = float(spelling)
        except (KeyError, IndexError, TypeError, ValueError):
            continue
    return record


#: The kind of the record a run resumed onto other text (``allow_data_change``) writes at its
#: resume step: ``fingerprint`` (the new text's) and ``before`` (the checkpoint's); the
#: validation losses after it are of the new text's validation split, those before of the old.
DATA_CHANGE = "data_change"

#: The fields of a record that the run tools read as numbers (``null``: not measured).
NUMBER_FIELDS = ("loss", "val_loss", "tokens", "tokens_per_s", "lr", "grad_norm")


def _readable(record: Any) -> bool:
    """Whether ``record`` is one the run tools can read: an object with a string ``kind``, an
    integer ``step`` and numbers (or ``null``) in :data:`NUMBER_FIELDS` - a line edited by hand
    (``"step": "x"``, ``"loss": "high"``) stopped attnres status and plot with a traceback."""
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return False
    if not isinstance(record.get("step"), int) or isinstance(record["step"], bool):
        return False
    return all(record.get(name) is None or (isinstance(record[name], (int, float)) and not isinstance(record[name], bool))
               for name in NUMBER_FIELDS)


def read_metrics(path: str | Path, warn: bool = True) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, in order. Lines that are not records the tools
    can read (:func:`_readable`) - typically the last line, cut short when the process was
    killed mid-write - are skipped, with a warning naming them when ``warn``. A missing file
    gives no records."""
    path = Path(path)
    if not path.exists():
        return []
    records, bad = [], []
    for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and _readable(record := _restored(record)):
            records.append(record)
        else:
            bad.append(lineno)
    if bad and warn:
        warn_user(f"{str(path)!r}: skipped {len(bad)} unreadable line(s) {bad[:5]} (a run killed mid-write "
                  "leaves a truncated last line)")
    return records


def scalars(kind: str, values: dict[str, Any]) -> dict[str, float]:
    """A record's scalars by their mirrored name: ``<kind>/<name>`` for a number,
    ``<kind>/<name>/<i>`` for each element of a list of numbers (per-block values)."""
    out: dict[str, float] = {}
    for name, value in values.items():
        if isinstance(value, (int, float)):
            out[f"{kind}/{name}"] = value
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            out.update({f"{kind}/{name}/{i}": v for i, v in enumerate(value)})
    return out


def _set_aside(path: Path) -> Path | None:
    """Move a non-empty log at ``path`` to ``<name>.old-N`` (the first N free) and return
    where: a fresh run in the directory of one killed before its first checkpoint replaced
    that run's only record of its steps without a word. An empty log (a start that trained no
    step) holds nothing to keep."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    n = 1
    while path.with_name(f"{path.name}.old-{n}").exists():
        n += 1
    aside = path.with_name(f"{path.name}.old-{n}")
    os.replace(path, aside)
    return aside


class MetricsLogger:
    """Appends JSON records to ``metrics.jsonl`` and mirrors their scalars to TensorBoard
    when the ``tensorboard`` package is installed and enabled, and to Weights & Biases through
    ``wandb``, a started :class:`~attnres.train.wandb_log.WandbMirror` (started before the data
    is read, so that a missing login is said first), which the logger closes.

    ``resume_step``: ``None`` starts a fresh log; otherwise the records up to that step are
    kept and the rest (logged by an interrupted run after its last checkpoint, and redone
    now) dropped, as is an unreadable line and a :data:`DATA_CHANGE` record of that step (an
    earlier resume's from the same checkpoint: the run writes its own)."""

    def __init__(self, out_dir: Path, tensorboard: bool, resume_step: int | None, wandb: WandbMirror | None = None) -> None:
        self.path = out_dir / METRICS_FILE
        self.kept_aside: Path | None = None  # (a fresh log's predecessor, moved aside: :func:`_set_aside`)
        if resume_step is not None and self.path.exists():
            # (a data_change record at the resume step is an earlier resume's from this checkpoint, which
            # writes none past it: this resume writes its own, if its data changed - two resumes from the
            # checkpoint before a change logged the change twice, and one back onto the old text kept it)
            kept = [r for r in read_metrics(self.path)
                    if r["step"] < resume_step or (r["step"] == resume_step and r["kind"] != DATA_CHANGE)]
            # through a file renamed into place: a process killed (or a disk full) while writing
            # left the log cut short, the run's history before the checkpoint gone with it
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            try:
                tmp.write_text("".join(map(metrics_line, kept)))
                os.replace(tmp, self.path)
            finally:
                tmp.unlink(missing_ok=True)
        elif resume_step is None:
            self.kept_aside = _set_aside(self.path)
            self.path.write_text("")
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                pass
            else:
                # Resumed: the events after the checkpoint, which the run logs again (its own step
                # kept). Fresh: every earlier event, of an attempt that stopped before its first
                # checkpoint, whose metrics.jsonl starts over too; it was shown beside this run's.
                self.writer = SummaryWriter(str(out_dir / "tensorboard"),
                                            purge_step=0 if resume_step is None else resume_step + 1)
        self.wandb = wandb

    def log(self, kind: str, step: int, **values: Any) -> None:
        """Append one record; :class:`~attnres.train.out_dir.OutDirError` naming the file
        when it cannot be written (a full disk)."""
        try:
            with self.path.open("a") as f:
                f.write(metrics_line({"kind": kind, "step": step, **values}))
        except OSError as e:
            raise OutDirError(f"could not append to {str(self.path)!r}: {os_cause(e)}") from None
        mirrored = scalars(kind, values) if self.writer is not None or self.wandb is not None else {}
        if self.writer is not None:
            for name, value in mirrored.items():
                self.writer.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(step, mirrored)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None
