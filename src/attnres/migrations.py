"""Config keys of earlier versions, migrated in one place.

Every key a config of an earlier version may hold (a ``config.json`` of a checkpoint, a
run's saved config, a YAML file, a CLI override, keyword arguments) is turned into today's
spelling here, with one ``DeprecationWarning`` per config naming each old key and its new one.
The configs call these functions when they are built (``ModelConfig``, ``ResidualConfig``,
``TrainConfig`` and the Hugging Face ``AttnResConfig``); nothing else knows an old key.

Kept because committed configs and checkpoints (``results/``) still hold them:

* :data:`RESIDUAL_RENAMES`: ``residual.impl`` -> ``residual.schedule`` and
  ``residual.kernels`` -> ``residual.backend`` (whose value ``"torch_graph"`` is now
  ``"reference"``), the two axes of the depth-attention op;
* :data:`FLAT_RESIDUAL_KEYS`: the flat ``ModelConfig`` keys of the residual settings
  (``attnres_block_size``, ``attnres_impl``, ..., ``hc_streams``) -> ``residual.*``;
* :data:`LEGACY_DISTRIBUTED`: ``TrainConfig.distributed``, replaced by the ``parallel`` mesh.

Where an old key and its new key are both given (a saved config with a CLI override of the
old spelling), the old key is the one the user just wrote, and it wins.

A config an earlier version stored (a grid run's ``config.json``, a checkpoint's
``state.json``) is read within :func:`stored_config`: its old keys are migrated without a
warning, since the user never wrote them; a config the user passes (``--config FILE``,
``key=value`` overrides, keyword arguments) still warns.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable

from .user_warning import warn_user
from .validation import did_you_mean, section_keys

__all__ = [
    "RESIDUAL_RENAMES",
    "RENAMED_BACKENDS",
    "FLAT_RESIDUAL_KEYS",
    "LEGACY_DISTRIBUTED",
    "migrate_residual_keys",
    "migrate_model_keys",
    "migrate_train_keys",
    "renamed_attribute",
    "accept_old_keys",
    "stored_config",
    "reading_stored",
]

#: ``ResidualConfig`` keys renamed: one name per axis of the depth-attention op.
RESIDUAL_RENAMES = {"impl": "schedule", "kernels": "backend"}
#: Values of ``ResidualConfig.backend`` renamed (``kernels="torch_graph"`` of earlier versions).
RENAMED_BACKENDS = {"torch_graph": "reference"}

#: Flat ``ModelConfig`` keys of earlier versions -> their place in ``ModelConfig.residual``.
FLAT_RESIDUAL_KEYS: dict[str, tuple[str, ...]] = {
    "attnres_block_size": ("block_size",),
    "attnres_impl": ("schedule",),
    "attnres_full_group_size": ("full_group_size",),
    "attnres_eps": ("eps",),
    "attnres_kernels": ("backend",),
    "attnres_input_dependent_query": ("ablation", "input_dependent_query"),
    "attnres_input_independent_mixing": ("ablation", "input_independent_mixing"),
    "attnres_sigmoid_weights": ("ablation", "sigmoid_weights"),
    "attnres_key_norm": ("ablation", "key_norm"),
    "attnres_heads": ("ablation", "heads"),
    "attnres_window": ("ablation", "window"),
    "hc_streams": ("hc_streams",),
    "mhc_sinkhorn_iters": ("sinkhorn_iters",),
}

#: The values of the deprecated ``TrainConfig.distributed`` and what each now means: data
#: parallelism is the mesh's ``dp`` dimension (FSDP2), and one process is the mesh of size 1.
LEGACY_DISTRIBUTED = {
    "auto": "the default: every launched rank is data parallel (parallel.dp = the ranks left over by tp and pp)",
    "fsdp": "the default: every launched rank is data parallel with FSDP2 (parallel.dp = the ranks left over)",
    "ddp": "data parallelism with FSDP2 over parallel.dp (DDP was removed; FSDP2 takes the same steps within float "
           "rounding and writes sharded (DCP) checkpoints)",
    "none": "parallel.dp=1 (one process; under a multi-rank launch the layout is refused)",
}


# True within stored_config, in its own thread (or asyncio task) only: a flag of the process
# let a thread reading a checkpoint silence the warning of an old key the user gave in another
_reading_stored: contextvars.ContextVar[bool] = contextvars.ContextVar("attnres_reading_stored", default=False)


@contextlib.contextmanager
def stored_config() -> Iterator[None]:
    """Within it, the old keys of the configs built are migrated without a
    ``DeprecationWarning``: for reading a config an earlier version stored (a grid run's
    ``config.json``, a checkpoint's ``state.json``), whose up to 13 old keys the user never
    wrote (``attnres compare --report-only`` over a committed grid warned of them as if the
    user had). Block AttnRes' single-block warning is not given either (:func:`reading_stored`:
    it was given when the run started, and a resume reads the config five times). Other
    warnings are left as they are. Per thread and asyncio task: another thread's configs (a
    config the user passes) still warn."""
    token = _reading_stored.set(True)
    try:
        yield
    finally:
        _reading_stored.reset(token)


def reading_stored() -> bool:
    """Whether a config built now is read within :func:`stored_config` (in this thread or task)."""
    return _reading_stored.get()


def _warn_deprecated_key(message: str) -> None:
    """The ``DeprecationWarning`` of an old key, but not of one a stored config holds."""
    if not _reading_stored.get():
        warn_user(message, DeprecationWarning)


def _warn_renamed(renamed: list[tuple[str, str]]) -> None:
    """One warning for the old keys ``(old, new)`` of one config: a config an earlier version
    saved holds up to 13 of them, which the user never wrote (one line each was a flood on
    every command that read the checkpoint)."""
    if len(renamed) == 1:
        old, new = renamed[0]
        _warn_deprecated_key(f"{old} is deprecated: use {new}")
    elif renamed:
        pairs = ", ".join(f"{old} -> {new}" for old, new in renamed)
        _warn_deprecated_key(f"{len(renamed)} keys of an earlier version are deprecated: {pairs} (read as the new "
                             "ones; a config saved by this version writes those)")


def _renamed_backend(value: Any) -> bool:
    return isinstance(value, str) and value in RENAMED_BACKENDS


def migrate_residual_keys(data: dict[str, Any], where: str = "ModelConfig.residual") -> dict[str, Any]:
    """``data`` (``ResidualConfig`` fields) with ``impl`` / ``kernels`` renamed ``schedule`` /
    ``backend`` and the backend ``"torch_graph"`` renamed ``"reference"``, with one
    ``DeprecationWarning`` naming the old keys; ``data`` is not changed."""
    renamed: list[tuple[str, str]] = []
    out = _migrate_residual(data, where, renamed)
    _warn_renamed(renamed)
    return out


def _migrate_residual(data: dict[str, Any], where: str, renamed: list[tuple[str, str]]) -> dict[str, Any]:
    """:func:`migrate_residual_keys`, adding each ``(old, new)`` key to ``renamed``."""
    if not any(k in data for k in RESIDUAL_RENAMES) and not _renamed_backend(data.get("backend")):
        return data
    out = dict(data)
    for old, new in RESIDUAL_RENAMES.items():
        if old not in out:
            continue
        value = out.pop(old)
        if old == "kernels" and _renamed_backend(value):
            renamed.append((f"{where}.kernels={value!r}", f"{where}.backend={RENAMED_BACKENDS[value]!r}"))
            value = RENAMED_BACKENDS[value]
        else:
            renamed.append((f"{where}.{old}", f"{where}.{new}"))
        out[new] = value
    if _renamed_backend(out.get("backend")):
        value = out["backend"]
        renamed.append((f"{where}.backend={value!r}", f"{where}.backend={RENAMED_BACKENDS[value]!r}"))
        out["backend"] = RENAMED_BACKENDS[value]
    return out


def _as_mapping(residual: Any) -> dict[str, Any]:
    """A residual value (``None``, a name, a mapping or a ``ResidualConfig``) as a mapping."""
    if residual is None:
        return {}
    if isinstance(residual, str):
        return {"kind": residual}
    if dataclasses.is_dataclass(residual) and not isinstance(residual, type):
        return dataclasses.asdict(residual)
    return dict(residual)


def migrate_model_keys(data: dict[str, Any], where: str = "ModelConfig") -> dict[str, Any]:
    """``data`` (``ModelConfig`` fields) with the flat residual keys of earlier versions moved
    into ``residual`` and the renamed residual keys renamed, with one ``DeprecationWarning``
    naming the old keys; ``data`` is not changed."""
    renamed: list[tuple[str, str]] = []
    out = _migrate_model(data, where, renamed)
    _warn_renamed(renamed)
    return out


def _migrate_model(data: dict[str, Any], where: str, renamed: list[tuple[str, str]]) -> dict[str, Any]:
    """:func:`migrate_model_keys`, adding each ``(old, new)`` key to ``renamed``."""
    residual = data.get("residual")
    if isinstance(residual, dict):
        migrated = _migrate_residual(residual, f"{where}.residual", renamed)
        if migrated is not residual:
            data = {**data, "residual": migrated}
    flat = [k for k in data if k in FLAT_RESIDUAL_KEYS]
    if not flat:
        return data
    out = {k: v for k, v in data.items() if k not in FLAT_RESIDUAL_KEYS}
    nested = _as_mapping(data.get("residual"))
    for key in flat:
        path, value = FLAT_RESIDUAL_KEYS[key], data[key]
        if path == ("backend",) and _renamed_backend(value):
            renamed.append((f"{where}.{key}={value!r}", f"{where}.residual.backend={RENAMED_BACKENDS[value]!r}"))
            value = RENAMED_BACKENDS[value]
        else:
            renamed.append((f"{where}.{key}", f"{where}.residual.{'.'.join(path)}"))
        if len(path) == 1:
            nested[path[0]] = value
        else:
            ablation = nested.get(path[0])
            nested[path[0]] = {**(_as_mapping(ablation) if ablation is not None else {}), path[1]: value}
    out["residual"] = nested
    return out


def migrate_train_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (``TrainConfig`` fields) without the deprecated ``distributed`` key, with a
    ``DeprecationWarning`` saying what it now means (:data:`LEGACY_DISTRIBUTED`);
    ``distributed="none"`` becomes ``parallel.dp=1`` where ``parallel.dp`` is not given.
    ``data`` itself is not changed."""
    if "distributed" not in data:
        return data
    out = {k: v for k, v in data.items() if k != "distributed"}
    value = data["distributed"]
    if value not in LEGACY_DISTRIBUTED:
        raise ValueError(f"TrainConfig.distributed must be one of {', '.join(map(repr, LEGACY_DISTRIBUTED))} "
                         f"(deprecated: use parallel.dp); got {value!r}")
    parallel = out.get("parallel")
    given_dp = parallel.dp if dataclasses.is_dataclass(parallel) else (
        parallel.get("dp") if isinstance(parallel, dict) else None)
    # (distributed='none' beside a parallel.dp of its own was said to be parallel.dp=1, where the dp given holds)
    meaning = (f"ignored: parallel.dp={given_dp!r} is given" if value == "none" and given_dp is not None
               else f"now {LEGACY_DISTRIBUTED[value]}")
    _warn_deprecated_key(f"TrainConfig.distributed is deprecated: use parallel.dp; distributed={value!r} is "
                         f"{meaning}. Remove it (docs/scale-out.md)")
    if value != "none" or given_dp is not None:
        pass
    elif parallel is None:
        out["parallel"] = {"dp": 1}
    elif dataclasses.is_dataclass(parallel) and parallel.dp is None:
        out["parallel"] = dataclasses.replace(parallel, dp=1)
    elif isinstance(parallel, dict) and parallel.get("dp") is None:
        out["parallel"] = {**parallel, "dp": 1}
    return out


def renamed_attribute(obj: Any, name: str, renames: dict[str, tuple[str, ...]], where: str) -> Any:
    """For a ``__getattr__``: the attribute an old ``name`` now is (``renames[name]``, a path
    of attributes from ``obj``), with the warning; ``AttributeError`` for any other name."""
    if name not in renames:
        raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")
    path = renames[name]
    warn_user(f"{where}.{name} is deprecated: use {where}.{'.'.join(path)}", DeprecationWarning)
    value = obj
    for part in path:
        value = getattr(value, part)
    return value


def accept_old_keys(cls: type, migrate: Callable[[dict[str, Any]], dict[str, Any]],
                    sections: Mapping[str, Iterable[str]] | None = None) -> None:
    """Make the constructor of the dataclass ``cls`` pass its keyword arguments through
    ``migrate`` first (one of the functions above), keeping its signature and docstring; an
    unknown keyword raises ``TypeError`` naming the known fields and the nearest one - or, for
    a field of one of ``sections`` (as ``from_dict`` takes them), that section's field."""
    init = cls.__init__
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    meant = section_keys(sections)

    def __init__(self, *args, **kwargs) -> None:
        kwargs = migrate(kwargs)
        unknown = [k for k in kwargs if k not in fields]
        if unknown:
            hint = f" (did you mean {meant[unknown[0]]!r}?)" if unknown[0] in meant else did_you_mean(unknown[0], fields)
            raise TypeError(f"{cls.__name__}: unknown field(s) {unknown}{hint}; known fields: {sorted(fields)}")
        init(self, *args, **kwargs)

    __init__.__doc__ = init.__doc__
    __init__.__signature__ = inspect.signature(init)
    cls.__init__ = __init__
