"""SIGTERM as an exception, so that a process asked to stop (``kill``, a batch scheduler at
its time limit, a container stopped) cleans up on its way out as Ctrl-C does: Python's
default for SIGTERM ends the process at once, with no ``finally`` run, and data preparation
left its partial token cache and the run's lock behind."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while :func:`sigterm_raises` was active. A ``KeyboardInterrupt``, so
    that whatever cleans up after an interrupt (removing a temporary cache, releasing a lock)
    does so after a SIGTERM too; ``str()`` is ``"SIGTERM"`` unless a message says more."""

    signal_number = int(signal.SIGTERM)

    def __init__(self, message: str = "SIGTERM") -> None:
        super().__init__(message)


class _RaiseOnce:
    """The SIGTERM handler: raises :class:`Terminated` at the first SIGTERM, and ignores the
    ones that follow while the stack unwinds (they would cut the clean-up short; SIGKILL still
    ends the process)."""

    def __init__(self) -> None:
        self.raised = False

    def __call__(self, _signum, _frame) -> None:
        if not self.raised:
            self.raised = True
            raise Terminated


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While active, SIGTERM raises :class:`Terminated` in the main thread. Only in place of
    Python's default: a handler the program set (or ``SIG_IGN``) is left as it is, as is an
    enclosing ``sigterm_raises``; off the main thread (which alone runs signal handlers) it
    does nothing."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _RaiseOnce())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def interrupted_status(error: KeyboardInterrupt) -> int:
    """The exit status of a command that ``error`` stopped, as a shell reports a process that
    the signal ended: 143 for a SIGTERM (:class:`Terminated`), 130 for Ctrl-C."""
    return 128 + (error.signal_number if isinstance(error, Terminated) else int(signal.SIGINT))
