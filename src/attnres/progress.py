"""Progress bars: ``tqdm`` when it is installed (the ``train`` extra), nothing otherwise.

Long work shows a bar on stderr (a training run's steps, a grid's runs, tokenising a
corpus); a bar is a convenience, so without ``tqdm`` the work runs silently. A training
run's steps (:class:`StepProgress`) are shown as plain lines away from a terminal.
transformers' own bars follow ours in a command (:func:`transformers_bars`).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager


def progress_bar(enabled: bool = True, **kwargs):
    """``tqdm(dynamic_ncols=True, **kwargs)``, or ``None`` when not ``enabled`` or without tqdm.
    Away from a terminal (a log file) the bar is redrawn every ``LOG_INTERVAL_S`` seconds, not 10
    times a second: each redraw stays in the log. A Jupyter cell redraws it in place, as often
    as on a terminal."""
    if not enabled:
        return None
    stream = kwargs.get("file", sys.stderr)
    notebook = _in_notebook(stream)
    tqdm = _bar_class(notebook)
    if tqdm is None:
        return None
    if not notebook and not _is_terminal(stream):
        kwargs.setdefault("mininterval", LOG_INTERVAL_S)
    return tqdm(dynamic_ncols=True, **kwargs)


def _bar_class(notebook: bool):
    """tqdm's bar (``tqdm.auto``'s in a notebook: a widget where ipywidgets is installed), or
    ``None`` without tqdm."""
    try:
        if notebook:
            from tqdm.auto import tqdm
        else:
            from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


#: How often progress is written to a log file (stderr not a terminal), in seconds.
LOG_INTERVAL_S = 60.0


class StepProgress:
    """A training run's progress on stderr: a ``tqdm`` bar on a terminal (and in a Jupyter
    notebook), and away from one (a log file, a batch job's output, ``nohup``) a plain line
    at each evaluation and at most every ``every_s`` seconds at the logging cadence. A bar's carriage-return redraws would
    fill such a log with one line megabytes long, and the validation loss would not be in it.

    ``update`` counts steps; ``show(**fields)`` sets what is shown beside the step (the
    latest train loss, tokens/s), ``mark(**fields)`` also writes a line away from a terminal
    (an evaluation's validation loss), which a later line shows with the step it was
    marked at, ``val_loss 5.3810 (at step 200)``: bare, it read as the loss of the line's
    step. ``stop``: the step this invocation ends at when that
    is before ``total`` (``stop_after``): the time to go is to it, and the line says so."""

    def __init__(self, total: int, initial: int = 0, stream=None, every_s: float = LOG_INTERVAL_S,
                 stop: int | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.step, self.first = total, initial, initial
        self.stop = total if stop is None else min(stop, total)
        self.every_s = every_s
        self.fields: dict[str, str] = {}
        self.marked_at: dict[str, int] = {}  # the step each ``mark``ed field was measured at
        self.started = self.last_line = time.perf_counter()
        self.bar = None
        notebook = _in_notebook(self.stream)  # (a Jupyter cell redraws its bar in place)
        if notebook or _is_terminal(self.stream):
            tqdm = _bar_class(notebook)  # without tqdm, lines as away from a terminal
            if tqdm is not None:  # its bar and time to go to where this invocation ends, as the lines'
                until = {"desc": f"to stop_after={self.stop} of {total} steps"} if self.stop < total else {}
                self.bar = tqdm(total=self.stop, initial=initial, unit="step", dynamic_ncols=True, file=self.stream,
                                **until)

    def update(self, n: int = 1) -> None:
        self.step += n
        if self.bar is not None:
            self.bar.update(n)

    def show(self, **fields: str) -> None:
        """Show ``fields`` from now on; away from a terminal, a line if ``every_s`` has passed."""
        self.fields.update(fields)
        for name in fields:
            self.marked_at.pop(name, None)
        if self.bar is not None:
            self.bar.set_postfix(self.fields, refresh=False)
        else:
            now = time.perf_counter()
            if now - self.last_line >= self.every_s:
                self._line(now)

    def mark(self, **fields: str) -> None:
        """Show ``fields`` from now on and, away from a terminal, write a line now."""
        self.fields.update(fields)
        self.marked_at.update(dict.fromkeys(fields, self.step))
        if self.bar is not None:
            self.bar.set_postfix(self.fields, refresh=False)
        else:
            self._line(time.perf_counter())

    def _line(self, now: float) -> None:
        self.last_line = now
        elapsed, done = now - self.started, self.step - self.first
        left = self.stop - self.step
        until = "" if self.stop == self.total else f" to step {self.stop} (stop_after)"
        eta = f", ~{clock(elapsed / done * left)} to go{until}" if done > 0 and left > 0 else ""
        shown = "".join(f"  {name} {value}{self._measured_at(name)}" for name, value in self.fields.items())
        print(f"step {self.step}/{self.total}{shown}  ({clock(elapsed)} elapsed{eta})", file=self.stream, flush=True)

    def _measured_at(self, name: str) -> str:
        """`` (at step N)`` for a ``mark``ed field measured at an earlier step than the line's."""
        at = self.marked_at.get(name, self.step)
        return "" if at == self.step else f" (at step {at})"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def redraws_in_place(stream=None) -> bool:
    """Whether a bar on ``stream`` (stderr by default) is redrawn in place: a terminal or a
    Jupyter cell, not a log file, where each redraw stays."""
    stream = sys.stderr if stream is None else stream
    return _in_notebook(stream) or _is_terminal(stream)


@contextmanager
def transformers_bars(shown: bool):
    """transformers' own bars ("Loading weights", "Writing model shards", a Hub download's)
    off inside the block unless ``shown``; the setting before it is restored after, as a
    Python caller of a command had it. ``HF_HUB_DISABLE_PROGRESS_BARS`` set either way is the
    user's choice, and left to rule."""
    import huggingface_hub.utils.tqdm  # noqa: F401 (the module; as an attribute of huggingface_hub.utils, the class)

    hub = sys.modules["huggingface_hub.utils.tqdm"]
    if shown or hub.HF_HUB_DISABLE_PROGRESS_BARS is not None:
        yield
        return
    from transformers.utils import logging as hf_logging

    was, groups = hf_logging.is_progress_bar_enabled(), dict(hub.progress_bar_states)
    hf_logging.disable_progress_bar()  # (and the Hub's)
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
        hub.progress_bar_states.clear()  # (the Hub's per-group settings, which either call cleared)
        hub.progress_bar_states.update(groups)


def _in_notebook(stream) -> bool:
    """Whether ``stream`` is a Jupyter kernel's output (not a terminal, but it redraws)."""
    return type(stream).__module__.startswith("ipykernel.")


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def clock(seconds: float) -> str:
    """``h:mm:ss``, or ``m:ss`` under an hour."""
    minutes, s = divmod(int(round(seconds)), 60)
    h, m = divmod(minutes, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
