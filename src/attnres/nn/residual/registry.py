"""The residual registry: every variant a ``ModelConfig`` can name.

Built-in variants register themselves when :mod:`attnres.nn.residual` is imported; user
code registers its own with the same decorator, and the model, ``attnres train``, the
Hugging Face wrapper and the FLOP count then accept its name (the pipeline too, for a variant
without parameters of its own or built on ``AttnResBase``)::

    from attnres import register_residual
    from attnres.nn.residual import SingleStreamResidual

    @register_residual("scaled")
    class ScaledResidual(SingleStreamResidual):
        def __init__(self, dim, n_sublayers, init=1.0):
            super().__init__(dim, n_sublayers)
            self.scale = nn.Parameter(torch.full((n_sublayers,), init))
        def update(self, l, h, out):
            return h + self.scale[l] * out

    ModelConfig(residual={"kind": "scaled", "options": {"init": 0.5}})
"""

from __future__ import annotations

import inspect
from typing import TypeVar

from .base import ResidualStream
from .config import VARIANT_FIELDS, ResidualConfig
from .kinds import _REGISTRY, UnregisteredResidual, registered_residuals, residual_class

__all__ = ["UnregisteredResidual", "register_residual", "residual_class", "registered_residuals",
           "validate_residual_config"]

T = TypeVar("T", bound=type)

#: The protocol's methods as the model calls them (the arguments after ``self``); ``update`` is
#: a :class:`~attnres.nn.residual.SingleStreamResidual`'s.
PROTOCOL_CALLS = {"_start": ("embedding", "common"), "_input": ("state", "l"), "_add": ("state", "l", "output"),
                  "_finish": ("state",), "update": ("l", "h", "out")}


def register_residual(name: str, *, replace: bool = False):
    """Class decorator: register a :class:`~attnres.nn.residual.ResidualStream` subclass
    under ``name`` (sets its ``name`` attribute). Registering a taken name raises
    ``ValueError`` unless ``replace=True``; a built-in variant's name raises even then."""
    if isinstance(name, type):  # (@register_residual without its name: the class came as the name)
        raise ValueError(f"register_residual takes the variant's name first: @register_residual('my_residual') above "
                         f"class {name.__qualname__}, not a bare @register_residual")
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a residual name must be a Python identifier such as 'my_residual'; got {name!r}")

    def decorate(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, ResidualStream)):
            raise TypeError(f"register_residual({name!r}) decorates ResidualStream subclasses, not {cls!r}")
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:  # said here, not as "Can't instantiate abstract class" when a model is built
            raise TypeError(f"register_residual({name!r}): {cls.__qualname__} does not define {', '.join(missing)}, "
                            "which every residual must (SingleStreamResidual subclasses: update(l, h, out); "
                            "docs/design.md, 'The registry, and how to add a variant')")
        _check_signatures(name, cls)
        _check_reads_fields(name, cls)
        if name in _REGISTRY and _REGISTRY[name] is not cls and (not replace or _REGISTRY[name].builtin()):
            _refuse_taken(name, _REGISTRY[name], cls)
        own = cls.__dict__.get("name")  # (a subclass inherits its parent's: not its own registration)
        if own not in (None, name) and _REGISTRY.get(own) is cls:
            # its name is what analyze, the start line and mixing.json say: models of the first name
            # would have been reported under the second
            raise ValueError(f"register_residual({name!r}): {cls.__qualname__} is registered as {own!r} already; a "
                             f"class has one name - register a subclass under {name!r} (class Alias({cls.__name__}): "
                             "pass)")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def _check_signatures(name: str, cls: type) -> None:
    """Raise ``TypeError`` naming the method unless the model can call each protocol method of
    ``cls`` as it does (:data:`PROTOCOL_CALLS`), and its ``__init__`` with ``(dim, n_sublayers)``
    where the default ``from_config`` builds it: said at registration, not as a TypeError in the
    middle of the first forward ("update() takes 3 positional arguments but 4 were given")."""
    calls = {name_: args for name_, args in PROTOCOL_CALLS.items() if hasattr(cls, name_)}
    if cls.from_config.__func__ is ResidualStream.from_config.__func__:
        calls["__init__"] = ("dim", "n_sublayers")
    for method, args in calls.items():
        function = getattr(cls, method)
        bound = () if isinstance(inspect.getattr_static(cls, method), staticmethod) else (None,)  # (self)
        try:
            signature = inspect.signature(function)
            # (__init__'s other arguments are options, which check_config requires where they have no default)
            (signature.bind_partial if method == "__init__" else signature.bind)(*bound, *args)
        except TypeError:
            said = f"{cls.__qualname__}.{method}{inspect.signature(function)}" if callable(function) else (
                f"{cls.__qualname__}.{method} = {function!r}")
            caller = "the default from_config" if method == "__init__" else "the model"
            hint = ", **options), or define from_config" if method == "__init__" else ")"
            raise TypeError(f"register_residual({name!r}): {said} cannot be called as {caller} calls it, "
                            f"{method}(self, {', '.join(args)}{hint} (docs/design.md, 'The registry, and how to add "
                            "a variant')") from None
        except ValueError:  # (no signature to read: a builtin or C function, left to the call)
            continue


def _check_reads_fields(name: str, cls: type) -> None:
    """Raise ``ValueError`` unless ``cls.reads_fields`` is a set of :data:`VARIANT_FIELDS`: a
    misspelt field would leave the one meant uncompared on resume, without a word."""
    fields = cls.reads_fields
    if not isinstance(fields, (set, frozenset)) or not set(fields) <= set(VARIANT_FIELDS):
        raise ValueError(f"register_residual({name!r}): {cls.__qualname__}.reads_fields must be a set of "
                         f"{', '.join(repr(f) for f in VARIANT_FIELDS)} (the residual fields it builds from that "
                         f"only some variants read); got {fields!r}")


def _refuse_taken(name: str, taken: type, cls: type) -> None:
    """Raise unless ``cls`` is the class registered as ``name`` defined again (its module run
    again: ``importlib.reload``, a notebook cell re-run), which then replaces it."""
    where = f"{taken.__module__}.{taken.__qualname__}"
    if where == f"{cls.__module__}.{cls.__qualname__}":
        return  # (it was refused, and the second run of a notebook cell needed replace=True)
    # Replacing a built-in (replace=True too) would change what every such checkpoint loads as:
    # in a process without the user's module it loads as the built-in again, silently.
    if taken.builtin():
        raise ValueError(f"residual {name!r} is already registered: it is a built-in variant ({where}); register "
                         f"{cls.__qualname__} under a name of its own, e.g. register_residual('my_{name}') (replace=True "
                         "replaces a variant of your own, never a built-in: what names it would load as the built-in "
                         "wherever your module is not imported)")
    raise ValueError(f"residual {name!r} is already registered by {where}; register {cls.__qualname__} under another "
                     "name, or pass replace=True to override it")


def validate_residual_config(config: ResidualConfig, dim: int, n_sublayers: int) -> None:
    """Raise ``ValueError`` naming the field unless ``config`` describes a registered variant
    with settings it accepts (generic field checks, then the variant's ``check_config``)."""
    cls = residual_class(config.kind)
    config.check_fields(dim)
    # (a depth-attention variant of the user's may have no two-phase schedule: then no Phase 1 either)
    two_phase = cls.has_depth_attention and "two_phase" in getattr(cls, "SCHEDULES", ("two_phase",))
    if config.autocast_phase1_sums and not (two_phase and config.schedule == "two_phase"):
        raise ValueError(f"ModelConfig.residual.autocast_phase1_sums applies to Full and Block AttnRes' two-phase "
                         f"schedule (it stores Phase 1's weighted sums); residual {config.kind!r} with schedule "
                         f"{config.schedule!r} has none - set it false")
    cls.check_config(config, dim, n_sublayers)
    if config.options and cls.from_config.__func__ is ResidualStream.from_config.__func__:
        _check_option_values(cls, config, dim, n_sublayers)


def _check_option_values(cls: type[ResidualStream], config: ResidualConfig, dim: int, n_sublayers: int) -> None:
    """Build the variant on the meta device (no memory, no init), so that an option value its
    ``__init__`` refuses is a config error - at ``--print-config``, before the data is read -
    and not one of the model's construction. Only the ``ValueError`` the default ``from_config``
    raises for such a value counts: an ``__init__`` that cannot run on the meta device is
    built, and judged, where the model is."""
    import torch

    try:
        with torch.device("meta"):
            cls.from_config(config, dim, n_sublayers)
    except ValueError:
        raise
    except Exception:  # noqa: BLE001 - (meta-only failures: left to the real build)
        pass
