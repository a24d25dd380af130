"""Graceful stopping: SIGINT and SIGTERM end a training run at the end of the current step."""

from __future__ import annotations

import signal
import threading
from typing import Any

from ..distributed.launch import end_if_orphaned


class StopSignals:
    """While active, SIGINT and SIGTERM only set :attr:`received`; the loop checkpoints and
    returns at the end of the current step. A second SIGINT interrupts at once; a SIGTERM
    because torchrun's agent died ends the process after a grace period, as the agent would
    have (:func:`~attnres.distributed.launch.end_if_orphaned`)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum, _frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == signal.SIGTERM and self.received is None:
            end_if_orphaned()
        self.received = signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
