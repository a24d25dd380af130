"""Validation shared by every config dataclass of the package.

Declarative rules check a value and describe what they allow, so that a validation error
and ``attnres train --help`` say the same thing; :class:`Fields` applies them to one config,
whose name prefixes every error::

    check = Fields("ModelConfig.residual")
    check.rule("block_size", Nullable(Int(1), "about 8 blocks"), 0)
    # ValueError: ModelConfig.residual.block_size must be an integer >= 1, or null (about 8 blocks); got 0
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar, overload

Held = TypeVar("Held")
Given = TypeVar("Given")

#: A path as the path fields take one: a string, or a path object (``pathlib.Path``).
PathText = str | os.PathLike[str]


class Converted(Generic[Held, Given]):
    """The annotation of a config field that its ``__post_init__`` converts: the constructor
    takes a ``Given`` (a preset name, a mapping, a ``pathlib.Path``) and the field holds a
    ``Held``, as a type checker is told by this descriptor's ``__set__`` and ``__get__`` (a
    dataclass field annotated with a descriptor takes its ``__set__`` value in ``__init__``).
    Annotating the field ``Held`` refused ``ModelConfig(residual={...})`` in mypy, and ``Held |
    Given`` every read of it (``config.residual.kind``). Only an annotation: no field holds one.
    (mypy checks an assignment after construction against ``Given`` too; ``validate`` converts
    the path fields again then, but not a section given as a mapping.)"""

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Converted[Held, Given]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> Held: ...
    def __get__(self, obj: object, owner: type | None = None) -> Any:
        raise TypeError("Converted is an annotation, not a field's value")

    def __set__(self, obj: object, value: Given) -> None:
        raise TypeError("Converted is an annotation, not a field's value")


def python_scalars(config: Any) -> None:
    """Replace the NumPy scalars among a config dataclass's fields (and the values of a mapping
    field, such as a residual's ``options``) by the Python numbers they hold: ``for seed in
    np.arange(3)`` or ``np.float32`` learning rates (a notebook's sweep) were refused ("must be an
    integer >= 0; got np.int64(1)"), and config.json could not store them. An array is left as
    it is, for the field's check to refuse; a NumPy bool becomes a ``bool``, which an integer
    field refuses as it refuses ``True``."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if (plain := _python_values(value)) is not value:
            object.__setattr__(config, f.name, plain)  # (a frozen dataclass too)


def _python_values(value: Any) -> Any:
    """``value`` with its NumPy scalars as Python ones (in a mapping: a new one, the caller's
    left as it was); ``value`` itself when it holds none."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()
    if isinstance(value, dict) and any(_python_values(v) is not v for v in value.values()):
        return {k: _python_values(v) for k, v in value.items()}
    return value


#: Other names of an allowed value that no spelling distance finds ('gpu' is nearer 'cpu'
#: than 'cuda'): the hint names the value they stand for, where it is allowed.
ALIASES = {"gpu": "cuda", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
           "float": "float32", "f32": "float32", "fp64": "float64", "double": "float64"}


def nearest(value: Any, allowed: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The allowed string nearest to a misspelt ``value`` (``difflib``'s similarity, at least
    ``cutoff``; a higher one for long lists, where some name is always somewhat near; first the
    value an :data:`ALIASES` name stands for: 'gpu' -> 'cuda', not 'cpu'; then the one allowed
    string ``value`` is in another case), else the one allowed string of ``value``'s letters in
    another order (``tyni`` -> 'tiny'), else the one allowed string that ends in ``_value``
    (``block`` -> 'attnres_block'), or ``None`` when no allowed one is near or ``value`` is not
    a string."""
    if not isinstance(value, str):
        return None
    allowed = list(allowed)
    if ALIASES.get(value.lower()) in allowed:
        return ALIASES[value.lower()]
    # (difflib compares case: 'ATTNRES_FULL' was near no choice, 'TINY' no preset)
    same = [a for a in allowed if a.casefold() == value.casefold()]
    if len(same) == 1:
        return same[0]
    near = difflib.get_close_matches(value, allowed, n=1, cutoff=cutoff)
    if near:
        return near[0]
    # the letters of one allowed name in another order (difflib rated 'tyni' 0.5 against 'tiny': no guess)
    shuffled = [a for a in allowed if len(value) > 2 and sorted(a.casefold()) == sorted(value.casefold())]
    if len(shuffled) == 1:
        return shuffled[0]
    # a name given without its prefix (``kind=block`` for 'attnres_block'), when one allowed name ends so
    ends = [a for a in allowed if value and a.endswith("_" + value)]
    return ends[0] if len(ends) == 1 else None


def did_you_mean(value: Any, allowed: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` with the allowed string nearest to ``value``, or ``""``."""
    near = nearest(value, allowed)
    return "" if near is None else f" (did you mean {near!r}?)"


def missing_path_hint(path: str | os.PathLike[str], directories_only: bool = False) -> str:
    """For a ``path`` that does not exist, where it stops existing and the nearest name there:
    ``" (did you mean 'train-cpu.yaml'?)"`` when only its last component is missing, else
    ``": 'runs/compare' holds no 'blok' (did you mean 'block'?)"`` (a typo in a folder above
    is the first missing component, not the last); ``""`` with nothing near. ``directories_only``:
    the last component names a directory, so only directories are suggested for it."""
    path = Path(path)
    if path.is_symlink():  # (a dangling link: the nearest name was the link's own)
        return f" (a symbolic link to {os.readlink(path)!r}, which does not exist)"
    missing = path
    while missing.parent != missing and not missing.parent.exists():
        missing = missing.parent
    folder, last = missing.parent, missing == path
    try:
        names = [p.name for p in folder.iterdir() if p.is_dir() or (last and not directories_only)]
    except OSError:  # (a file, or a folder this user may not list: no suggestion)
        names = []
    where = "" if last else f": {str(folder)!r} holds no {missing.name!r}"
    return where + did_you_mean(missing.name, names)


def check_path_argument(value: Any, call: str, what: str = "a checkpoint or run directory") -> None:
    """Refuse a ``path`` argument that is not a path (``str`` or ``os.PathLike``), naming
    ``what`` it takes and the order the function takes, ``call``: a model given first,
    ``load_checkpoint(model, path)``, ended in pathlib's "expected str, bytes or os.PathLike
    object, not AttnResLM"."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"path must be {what} (a str or Path), got {type(value).__name__}: call it as {call}")


def did_you_mean_each(values: Iterable[str], allowed: Iterable[str], note: Callable[[str], str] | None = None,
                      cutoff: float = 0.6, meant: Mapping[str, str] | None = None) -> str:
    """`` (did you mean 'a' for 'x', 'b' for 'y'?)``: for each value, ``meant[value]`` when
    given, else the nearest allowed string (:func:`nearest`; ``note(near)`` after it, when
    given), or ``""`` when no value has one."""
    allowed, meant = list(allowed), meant or {}
    hints = [f"{near!r}{note(near) if note else ''} for {value!r}"
             for value in values if (near := meant.get(value) or nearest(value, allowed, cutoff)) is not None]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def section_keys(sections: Mapping[str, Iterable[str]] | None) -> dict[str, str]:
    """Each key of ``sections`` (section name -> its keys) -> ``section.key``, from the first
    section that has it: what a section's field written one level up meant (``val_fraction``
    -> ``data.val_fraction``), where the nearest spelling of the level's own keys would mislead."""
    meant: dict[str, str] = {}
    for name, keys in (sections or {}).items():
        for key in keys:
            meant.setdefault(key, f"{name}.{key}")
    return meant


def check_known_keys(section: str, data: Iterable[str], known: Iterable[str],
                     sections: Mapping[str, Iterable[str]] | None = None) -> None:
    """Raise ``ValueError`` for keys of ``data`` not in ``known``, naming the nearest known key
    of each (a misspelt ``out=`` for ``out_dir=``; a field of one of ``sections``, its section
    name -> its keys, as that section's: ``data.val_fraction`` for ``val_fraction``) and listing them all."""
    known = sorted(set(known))
    unknown = sorted(set(data) - set(known), key=str)  # (a YAML key may be a number: 1: 2)
    if not unknown:
        return
    meant = section_keys(sections)
    # an override's dotted key written into a YAML file (model.d_model: 64), where it names no field
    dotted = [k for k in unknown if isinstance(k, str) and "." in k and k.partition(".")[0] in known]
    for key in dotted:
        *heads, last = key.split(".")
        meant[key] = "".join(f"{h}: {{" for h in heads) + f"{last}: ..." + "}" * len(heads)
    nest = "; a dotted key is a command-line override's: in a config file, nest it under its section" if dotted else ""
    raise ValueError(f"unknown {section} key(s) {unknown}{did_you_mean_each(unknown, known, meant=meant)}{nest}; "
                     f"known keys: {known}")


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings (a config's ``to_dict()``) as one mapping with dotted keys (an empty
    mapping, such as ``model.residual.options``, is a value of its own)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def fail(section: str, name: str, allowed: str, value: Any, hint: str = "") -> NoReturn:
    """Raise the one error format of config validation: the field, what it allows, the value
    (then ``hint``, such as :func:`did_you_mean`'s)."""
    raise ValueError(f"{section}.{name} must be {allowed}; got {value!r}{hint}")


#: How a null is spelt by habit elsewhere (Python's ``None``): in YAML these are strings, so a
#: path field would take the text 'None' as a directory name.
NULL_SPELLINGS = ("none", "null", "~")


def yaml_typed_hint(value: Any) -> str:
    """Why a text field got a number, boolean, date or null: YAML read it so (``0777``,
    ``12:30``, ``2024-01-01``, ``yes``, ``1e3``, ``~``); quoting keeps the text. On the command
    line the YAML quotes go inside the shell's: ``key='VALUE'`` reached YAML as ``key=VALUE``."""
    if value is None:  # (`out_dir=~`: a home directory to the user, YAML's null to the parser)
        return " (YAML read the value as null: null, ~ and an empty value are YAML's null)"
    kind = ("a boolean" if isinstance(value, bool) else "a number" if isinstance(value, (int, float))
            else "a date" if type(value).__name__ in ("date", "datetime") else None)
    return "" if kind is None else (f" (YAML read the value as {kind}; quote it to keep it as text: key: 'VALUE' in "
                                    "a config file, \"key='VALUE'\" on the command line)")


def _quoted_number_hint(value: Any, integer: bool) -> str:
    """A number given as a string (``lr: "3e-4"`` in a file): the quotes make it text."""
    if not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if integer and not number.is_integer():
        return ""
    return " (a quoted number is a string: write it without quotes)"


class Rule:
    """What a field allows: :meth:`ok` tests a value, :meth:`describe` says it in words,
    :meth:`hint` says how to fix a refused value where the rule knows (``""`` otherwise)."""

    def ok(self, value: Any) -> bool:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def hint(self, value: Any) -> str:
        return ""

    def check(self, section: str, name: str, value: Any) -> None:
        if not self.ok(value):
            fail(section, name, self.describe(), value, self.hint(value))


#: The largest seed PyTorch's generators take (an unsigned 64-bit integer).
SEED_MAX = 2**64 - 1


@dataclass(frozen=True)
class Int(Rule):
    minimum: int
    maximum: int | None = None

    def ok(self, value: Any) -> bool:
        return (not isinstance(value, bool) and isinstance(value, int) and value >= self.minimum
                and (self.maximum is None or value <= self.maximum))

    def describe(self) -> str:
        return f"an integer >= {self.minimum}" + ("" if self.maximum is None else f" and <= {self.maximum}")

    def hint(self, value: Any) -> str:
        # YAML (and Python) read 1e3 or 1000.0 as a float: the integer is meant
        if isinstance(value, float) and value.is_integer() and self.ok(int(value)):
            return f" (a float: write the integer {int(value)})"
        return _quoted_number_hint(value, integer=True)


def check_sizes(owner: str, **sizes: Any) -> None:
    """Raise ``ValueError`` ``"{owner}: {name} must be an integer >= 1, got {value!r}"`` for
    the first of ``sizes`` that is not: a module's widths and counts, checked where it is built
    (``SwiGLU(8, 0)`` was built and returned zeros; a negative size failed inside torch)."""
    for name, value in sizes.items():
        if not Int(1).ok(value):
            raise ValueError(f"{owner}: {name} must be an integer >= 1, got {value!r}")


def check_optional_count(option: str, value: int | None, default: str) -> None:
    """An option (or the Python parameter that mirrors it) that is omitted for its ``default``
    or given as a count >= 1 (0 used to mean the default without a word)."""
    if value is not None and not Int(1).ok(value):
        kind = "" if isinstance(value, int) and not isinstance(value, bool) else "an integer "
        raise ValueError(f"{option} must be {kind}>= 1 (omit it for {default}); got {value!r}")


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
        if self.hi == math.inf:  # (inf itself is refused: every number must be finite)
            return f"a finite number {'>' if self.lo_open else '>='} {self.lo:g}"
        lb, rb = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        return f"a number in {lb}{self.lo}, {self.hi}{rb}"

    def hint(self, value: Any) -> str:
        return _quoted_number_hint(value, integer=False)


@dataclass(frozen=True)
class Choice(Rule):
    allowed: tuple[str, ...]
    #: For a field that reads like a switch (``activation_checkpoint=true``): the names nearest
    #: to false and to true, each with what it does, so that a boolean is told which name it meant.
    switch: tuple[tuple[str, str], tuple[str, str]] | None = field(default=None, kw_only=True)

    def ok(self, value: Any) -> bool:
        return isinstance(value, str) and value in self.allowed

    def describe(self) -> str:
        return "one of " + ", ".join(repr(a) for a in self.allowed)

    def hint(self, value: Any) -> str:
        if isinstance(value, bool):  # (YAML reads true, yes and on as booleans; no name here is one)
            return self._boolean_hint(value)
        return did_you_mean(value, self.allowed)

    def _boolean_hint(self, value: bool) -> str:
        said = " (a name is expected, and true or false is none of them"
        if self.switch is None:
            return said + ")"
        name, meaning = self.switch[value]
        return f"{said}: the nearest to {str(value).lower()} is {name!r}, {meaning})"


def unsupported_device_hint(name: Any) -> str:
    """For a device PyTorch has that attnres does not run on (Apple's GPU, ``mps``), what to
    use instead (``""`` for any other name)."""
    if isinstance(name, str) and name.split(":")[0].strip().lower() == "mps":
        return (": Apple's GPU (mps) is not supported - attnres runs on cpu or cuda (its kernels, float64 "
                "analyses and tests are not built for mps); use cpu")
    return ""


@dataclass(frozen=True)
class DeviceChoice(Choice):
    """A device setting (``auto``, ``cpu``, ``cuda``, or one GPU: ``cuda:N``): ``mps`` gets
    what to use instead."""

    def ok(self, value: Any) -> bool:
        return super().ok(value) or (isinstance(value, str) and re.fullmatch(r"cuda:\d+", value) is not None)

    def describe(self) -> str:
        return f"{super().describe()}, or 'cuda:N' (one GPU of several)"

    def hint(self, value: Any) -> str:
        return unsupported_device_hint(value) or super().hint(value)


@dataclass(frozen=True)
class ChoiceOrPath(Choice):
    """One of ``allowed``, or a path that ``is_path`` recognises (so that a misspelt choice
    is refused here, not looked for as a file later, and gets :class:`Choice`'s hint);
    ``path`` says what the path names."""

    is_path: Callable[[str], bool]
    path: str

    def ok(self, value: Any) -> bool:
        return super().ok(value) or (isinstance(value, str) and self.is_path(value))

    def describe(self) -> str:
        return f"{super().describe()}, or {self.path}"

    def hint(self, value: Any) -> str:
        if isinstance(value, str) and value and os.path.exists(value):  # (mytok, a folder here: only its '/' missing)
            return f" ({value!r} is a path here: write it ./{value})"
        return yaml_typed_hint(value) or super().hint(value)


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

    def hint(self, value: Any) -> str:
        return yaml_typed_hint(value)


@dataclass(frozen=True)
class TextList(Rule):
    """A list of non-empty strings (paths): an empty one would name the current directory."""

    what: str = "a list of paths"

    def ok(self, value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(p, str) and p.strip() for p in value)

    def describe(self) -> str:
        return self.what

    def hint(self, value: Any) -> str:
        items = value if isinstance(value, list) else [value]
        return next((h for h in map(yaml_typed_hint, items) if h), "")


@dataclass(frozen=True)
class Nullable(Rule):
    """``None`` (meaning ``none_means``) or what ``rule`` allows."""

    rule: Rule
    none_means: str

    def ok(self, value: Any) -> bool:
        # 'None' (Python's spelling) is a string in YAML: a path field would take it as a name
        return value is None or (self.rule.ok(value) and not _spelt_null(value))

    def describe(self) -> str:
        return f"{self.rule.describe()}, or null ({self.none_means})"

    def hint(self, value: Any) -> str:
        if _spelt_null(value):
            return " (a string: YAML's null is written null or ~)"
        return self.rule.hint(value)


def _spelt_null(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in NULL_SPELLINGS


class Fields:
    """The checks of one config: errors read ``"<prefix>.<name> must be <allowed>; got <value>"``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def fail(self, name: str, allowed: str, value: Any) -> NoReturn:
        fail(self.prefix, name, allowed, value)

    def rule(self, name: str, rule: Rule, value: Any) -> None:
        rule.check(self.prefix, name, value)

    def integer(self, name: str, value: Any, allow_none: str | None = None) -> None:
        """An ``int`` (not a ``bool``) ``>= 1``; ``None`` too when ``allow_none`` says what it means
        (a field with another bound states its own :class:`Int`, through :meth:`rule`)."""
        self.rule(name, Int(1) if allow_none is None else Nullable(Int(1), allow_none), value)

    def positive(self, name: str, value: Any) -> None:
        self.rule(name, Number(0.0, lo_open=True), value)

    def boolean(self, name: str, value: Any) -> None:
        self.rule(name, Bool(), value)

    def choice(self, name: str, value: Any, allowed: Iterable[str]) -> None:
        self.rule(name, Choice(tuple(allowed)), value)

    def known_keys(self, data: dict[str, Any], known: Iterable[str],
                   sections: Mapping[str, Iterable[str]] | None = None) -> None:
        """Raise for keys of ``data`` that are not in ``known`` (:func:`check_known_keys`)."""
        check_known_keys(self.prefix, data, known, sections)
