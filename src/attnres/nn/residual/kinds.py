"""The registered residual names and their classes: the lookup that ``ResidualConfig`` (its
``kind``, checked as it is built) and the registry (which fills it) share, apart from both so
that neither imports the other."""

from __future__ import annotations

from ...validation import did_you_mean

__all__ = ["UnregisteredResidual", "refuse_other_kind", "registered_residuals", "residual_class"]

#: Each registered name -> its ``ResidualStream`` class (:func:`attnres.register_residual` fills it).
_REGISTRY: dict[str, type] = {}


class UnregisteredResidual(ValueError):
    """A residual name that is not registered in this process (``kind``): its module was not
    imported, or the name is misspelt."""

    def __init__(self, message: str, kind: object = None) -> None:  # (unpickled from the message alone)
        super().__init__(message)
        self.kind = kind


def residual_class(name: str) -> type:
    """The ``ResidualStream`` class registered as ``name``; :class:`UnregisteredResidual` (a
    ``ValueError``) listing the registered names otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise UnregisteredResidual(
            f"ModelConfig.residual.kind must be one of {', '.join(repr(n) for n in _REGISTRY)}; "
            f"got {name!r}{did_you_mean(name, _REGISTRY)}; "
            "a residual of your own is registered by importing its module first: `attnres --import MODULE <command> "
            "...` on the command line, `import MODULE` in Python", name
        ) from None


def registered_residuals() -> tuple[str, ...]:
    """Every registered name, built-in variants first, in registration order."""
    return tuple(_REGISTRY)


def refuse_other_kind(cls: type, config) -> None:
    """Raise ``ValueError`` unless ``config.kind`` is the residual ``cls`` builds: its registered
    class, or an unregistered subclass of it. ``BlockAttnRes.from_config`` of an
    ``attnres_full`` config built a Block AttnRes and ignored the kind; the name picks the
    class in :func:`attnres.nn.residual.build_residual`."""
    registered = residual_class(config.kind)
    if cls is registered or (issubclass(cls, registered) and "name" not in vars(cls)):
        return
    # (a class of the user's not registered has the name '': named by its class, and how to name it)
    builds, fix = (f"residual {cls.name!r}", "") if cls.name else (
        "a class not registered", f", and register_residual('my_residual') above class {cls.__qualname__} gives it "
        "a kind of its own")
    raise ValueError(f"{cls.__qualname__}.from_config builds {builds}; "
                     f"the config's kind is {config.kind!r} ({registered.__qualname__}): build_residual(config, dim, "
                     f"n_sublayers) builds the class its kind names{fix}")
