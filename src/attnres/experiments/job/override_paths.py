"""A grid's path overrides made absolute: ``experiment.json`` stores them, ``attnres status``
repeats them and a resume reads them, each maybe from another directory than the grid's
start, where ``data.paths=[corpus.txt]`` named another file or none."""

from __future__ import annotations

import json
from typing import Any

from ...data.corpus import absolute_paths
from ...data.tokenizer import is_tokenizer_path
from ...train.config import parse_override

#: The override keys that hold paths (``data.tokenizer`` only where it names a file), and
#: whether the value is a list of them. (``model.from_hf`` names a directory only, never a Hub
#: id: a relative one kept as typed named another folder, or none, from another directory.)
PATH_KEYS = {"data.paths": True, "data.cache_dir": False, "data.tokenizer": False, "init_from": False,
             "model.from_hf": False}


def absolute_path_overrides(overrides: list[str]) -> list[str]:
    """``overrides`` with the relative paths of :data:`PATH_KEYS` made absolute against the
    current directory (``~`` read as the home), as ``attnres train`` records its data paths
    (:func:`attnres.data.corpus.absolute_paths`); an absolute path, a null, a tokenizer kind
    (``bpe``) and a path that starts with an environment variable (``$SCRATCH/x``, read at
    each command) stay as given, and so does every other override."""
    return [_absolute(item) for item in overrides]


def _absolute(item: str) -> str:
    key = str(item).partition("=")[0].strip()
    if key not in PATH_KEYS:
        return item
    value = parse_override(item)[1]
    many = PATH_KEYS[key]
    paths = value if many and isinstance(value, list) else [value]  # (data.paths=a.txt is the list [a.txt])
    if not all(isinstance(p, str) and p for p in paths):  # (null, or a bad value: TrainConfig names the field)
        return item
    if key == "data.tokenizer" and not is_tokenizer_path(value):
        return item
    made = [p if p.startswith("$") else absolute_paths([p])[0] for p in paths]
    return f"{key}={_as_value(made if many else made[0])}"


def _as_value(value: Any) -> str:
    """``value`` written as an override's value: bare where YAML reads it back as it is
    (``[/home/a/corpus.txt]``), else as JSON, which YAML reads (a path with ``, `` or `` #``)."""
    bare = f"[{', '.join(value)}]" if isinstance(value, list) else value
    try:
        if parse_override(f"x={bare}")[1] == value:
            return bare
    except ValueError:
        pass
    return json.dumps(value)
