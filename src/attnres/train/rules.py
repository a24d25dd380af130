"""Declarative validation rules for config fields: each rule checks a value and describes
what it allows, so that validation errors and ``attnres train --help`` say the same thing."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def fail(section: str, name: str, allowed: str, value: Any) -> None:
    """Raise the one error format of config validation: the field, what it allows, the value."""
    raise ValueError(f"{section}.{name} must be {allowed}; got {value!r}")


class Rule:
    """What a field allows: :meth:`ok` tests a value, :meth:`describe` says it in words."""

    def ok(self, value: Any) -> bool:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def check(self, section: str, name: str, value: Any) -> None:
        if not self.ok(value):
            fail(section, name, self.describe(), value)


@dataclass(frozen=True)
class Int(Rule):
    minimum: int

    def ok(self, value: Any) -> bool:
        return not isinstance(value, bool) and isinstance(value, int) and value >= self.minimum

    def describe(self) -> str:
        return f"an integer >= {self.minimum}"


@dataclass(frozen=True)
class Number(Rule):
    lo: float
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False

    def ok(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def describe(self) -> str:
        lb, rb = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        return f"a number in {lb}{self.lo}, {self.hi}{rb}"


@dataclass(frozen=True)
class Choice(Rule):
    allowed: tuple[str, ...]

    def ok(self, value: Any) -> bool:
        return isinstance(value, str) and value in self.allowed

    def describe(self) -> str:
        return "one of " + ", ".join(repr(a) for a in self.allowed)


@dataclass(frozen=True)
class Bool(Rule):
    def ok(self, value: Any) -> bool:
        return isinstance(value, bool)

    def describe(self) -> str:
        return "true or false"


@dataclass(frozen=True)
class Text(Rule):
    """A non-empty string (a path)."""

    what: str = "a path"

    def ok(self, value: Any) -> bool:
        return isinstance(value, str) and bool(value)

    def describe(self) -> str:
        return self.what


@dataclass(frozen=True)
class TextList(Rule):
    what: str = "a list of paths"

    def ok(self, value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(p, str) for p in value)

    def describe(self) -> str:
        return self.what


@dataclass(frozen=True)
class Nullable(Rule):
    """``None`` (meaning ``none_means``) or what ``rule`` allows."""

    rule: Rule
    none_means: str

    def ok(self, value: Any) -> bool:
        return value is None or self.rule.ok(value)

    def describe(self) -> str:
        return f"{self.rule.describe()}, or null ({self.none_means})"
