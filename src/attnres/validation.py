"""Validation helpers shared by every config dataclass of the package.

A :class:`Fields` checker carries the prefix of the config it checks (``"ModelConfig"``,
``"ModelConfig.residual"``, ``"TrainConfig"``, ...), so every error names the field the user
wrote and the values it accepts::

    check = Fields("ModelConfig.residual")
    check.integer("block_size", 0, allow_none="about 8 blocks")
    # ValueError: ModelConfig.residual.block_size must be an integer >= 1 or None (about 8 blocks); got 0
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NoReturn

__all__ = ["Fields"]


class Fields:
    """Raise ``ValueError("<prefix>.<name> must be <allowed>; got <value>")`` on bad values."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def fail(self, name: str, allowed: str, value: Any) -> NoReturn:
        raise ValueError(f"{self.prefix}.{name} must be {allowed}; got {value!r}")

    def integer(self, name: str, value: Any, minimum: int = 1, allow_none: str | None = None) -> None:
        """An ``int`` (not a ``bool``) ``>= minimum``; ``None`` too when ``allow_none`` says what it means."""
        if value is None and allow_none is not None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            extra = f" or None ({allow_none})" if allow_none is not None else ""
            self.fail(name, f"an integer >= {minimum}{extra}", value)

    def number(self, name: str, value: Any, lo: float = 0.0, hi: float = math.inf, lo_open: bool = True,
               hi_open: bool = False) -> None:
        """A finite ``int`` or ``float`` in the interval; by default ``(0, inf]``, i.e. positive."""
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        ok = ok and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
        if not ok:
            if lo == 0.0 and lo_open and hi == math.inf:
                self.fail(name, "a finite number > 0", value)
            lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
            self.fail(name, f"a number in {lb}{lo}, {hi}{rb}", value)

    def boolean(self, name: str, value: Any) -> None:
        if not isinstance(value, bool):
            self.fail(name, "True or False", value)

    def choice(self, name: str, value: Any, allowed: Iterable[str]) -> None:
        allowed = tuple(allowed)
        if value not in allowed:
            self.fail(name, "one of " + ", ".join(repr(a) for a in allowed), value)

    def known_keys(self, data: dict[str, Any], known: Iterable[str]) -> None:
        """Raise for keys of ``data`` that are not in ``known``, listing the known ones."""
        known = set(known)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {self.prefix} key(s) {unknown}; known keys: {sorted(known)}")
