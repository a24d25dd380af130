"""Every training-config field with its default and allowed values: the text of
``attnres train --help``."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..models.config import PRESETS, ModelConfig
from ..distributed.parallel import PARALLEL_RULES, ParallelConfig
from .config import DATA_RULES, DEFAULT_MODEL_PRESET, TRAIN_RULES, DataConfig, TrainConfig, flatten


class _Probe:
    """A value no field accepts: validating it makes ModelConfig name what the field allows."""

    def __repr__(self) -> str:
        return "<probe>"


def _with(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of nested ``data`` with the dotted key set to ``value``."""
    head, _, rest = dotted.partition(".")
    copy = dict(data)
    copy[head] = _with(copy[head], rest, value) if rest else value
    return copy


def model_field_allowed(base: ModelConfig, dotted: str) -> str:
    """What ModelConfig allows for ``dotted``, as its own validation error words it (the
    model validates itself; this asks it rather than repeating its rules)."""
    leaf = dotted.rsplit(".", 1)[-1]
    try:
        ModelConfig.from_dict(_with(base.to_dict(), dotted, _Probe()))
    except ValueError as e:
        msg = str(e)
        for marker in (f".{dotted} must be ", f".{leaf} must be "):
            if marker in msg:
                return msg.split(marker, 1)[1].rsplit("; got", 1)[0]
    except Exception:  # noqa: BLE001 - a check that cannot handle the probe: fall through
        pass
    return "see attnres.ModelConfig"


def _fmt(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def config_reference() -> str:
    """Every ``key=value`` the training config takes: default and allowed values."""
    defaults = TrainConfig(progress=False)  # the built-in defaults (progress is a display choice)
    rows = []
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("model", "data", "parallel"):
            continue
        value = f.default if f.default is not dataclasses.MISSING else getattr(defaults, f.name)
        rows.append((f.name, _fmt(value), TRAIN_RULES[f.name].describe() if f.name in TRAIN_RULES else ""))
    data_defaults = DataConfig()
    for f in dataclasses.fields(DataConfig):
        rows.append((f"data.{f.name}", _fmt(getattr(data_defaults, f.name)), DATA_RULES[f.name].describe()))
    parallel_defaults = ParallelConfig()
    for name, rule in PARALLEL_RULES.items():
        rows.append((f"parallel.{name}", _fmt(getattr(parallel_defaults, name)), rule.describe()))
    model = defaults.model
    rows.append(("model", repr(DEFAULT_MODEL_PRESET), "a preset name (" + ", ".join(sorted(PRESETS)) + ") or model.<field>=..."))
    rows.append(("model.preset", repr(DEFAULT_MODEL_PRESET), "the preset the model.<field> settings change"))
    rows.append(("model.from_hf", "null", "a saved transformers directory (e.g. of `attnres upcycle`) whose model this "
                 "is, instead of a preset; with init_from=DIR, its weights too"))
    for key, value in flatten(model.to_dict()).items():
        rows.append((f"model.{key}", _fmt(value), model_field_allowed(model, key)))
    width = max(len(k) + len(v) for k, v, _ in rows) + 5
    lines = [f"  {k} = {v}".ljust(width) + f"  {allowed}" for k, v, allowed in rows]
    return ("every field, as key=value (default, then allowed values). The model: model.<field> settings, in a "
            f"YAML `model:` mapping or as overrides alike, start from preset {DEFAULT_MODEL_PRESET!r} unless "
            "model.preset names another; the model defaults below are that preset's:\n" + "\n".join(lines))

