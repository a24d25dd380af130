"""Build a model on the ``meta`` device and materialise only some of its parameters, with
exactly the values a full build on the CPU would give them.

A pipeline stage owns a few transformer blocks; a full model per rank would cost every rank
the whole model's memory. But a new run must start from the weights a single process gets
from the same seed, or pipelined and single-process training would differ from step 0.

:func:`build_on_meta` runs the model's own constructor (and so its own initialisation) on
the ``meta`` device under a dispatch mode that keeps, for every in-place initialisation op
applied to a parameter (``normal_``, ``uniform_``, ``fill_``, ``zero_``, ...), the op, its
arguments and - for a random op - the CPU generator's state just before it, and consumes
the generator exactly as the real op would (the op runs once on a scratch CPU tensor of the
same shape, which is dropped). :meth:`MetaBuild.materialize` then replays, for each wanted
parameter only, its ops on a fresh tensor: the result equals the full build bit for bit, and
the generator ends where a full build leaves it. Memory: the wanted parameters plus one
scratch tensor at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MetaBuild", "build_on_meta"]

aten = torch.ops.aten
# In-place ops that initialise a parameter; the random ones draw from the CPU generator.
RANDOM_OPS = {aten.normal_.default, aten.uniform_.default, aten.bernoulli_.float, aten.random_.default,
              getattr(aten.random_, "from"), aten.random_.to, aten.exponential_.default, aten.log_normal_.default,
              aten.cauchy_.default, aten.geometric_.default}
FILL_OPS = {aten.fill_.Scalar, aten.zero_.default, aten.mul_.Scalar, aten.add_.Scalar, aten.clamp_.default,
            aten.div_.Scalar, aten.sub_.Scalar}


@dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    rng: Tensor | None  # the CPU generator's state before a random op


class _Recorder(TorchDispatchMode):
    """Records in-place init ops on meta tensors (by tensor identity) and draws the random
    numbers they would have drawn on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[int, list[_Op]] = {}
        self.keep: list[Tensor] = []  # keeps recorded tensors alive, so their ids stay theirs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if isinstance(target, Tensor) and target.is_meta and func in RANDOM_OPS | FILL_OPS:
            if kwargs.get("generator") is not None:
                raise ValueError(f"materialising {func}: an explicit generator is not supported")
            rng = None
            if func in RANDOM_OPS:
                rng = torch.get_rng_state()
                func(torch.empty(target.shape, dtype=target.dtype, device="cpu"), *args[1:], **kwargs)  # draws as the real op would
            self.ops.setdefault(id(target), []).append(_Op(func, tuple(args[1:]), dict(kwargs), rng))
            self.keep.append(target)
            return target
        if isinstance(target, Tensor) and target.is_meta and torch.Tag.inplace_view not in func.tags and \
                func._schema.name.endswith("_") and any(isinstance(a, Tensor) and not a.is_meta for a in args[1:]):
            raise ValueError(f"materialising: {func} writes a real tensor into a meta parameter; only in-place "
                             "initialisation ops can be replayed")
        return func(*args, **kwargs)


@dataclass
class MetaBuild:
    """A module built on ``meta`` and the log of how each parameter was initialised."""

    module: nn.Module
    ops: dict[int, list[_Op]]
    keep: list[Tensor] = field(default_factory=list)  # the recorded meta tensors, kept alive

    def materialize(self, names: Iterable[str], device: torch.device | str = "cpu",
                    placeholder: Callable[[str], bool] | None = None) -> None:
        """Give the parameters ``names`` (fully qualified) their initial values on ``device``,
        in place; buffers of every module holding one are recomputed by the module
        (``reset_tables``-style methods are the caller's). The generator state is left as a
        full build leaves it. ``placeholder(name)``: parameters to create as zeros instead
        (present so that code touching them runs, never trained)."""
        wanted = set(names)
        params = dict(self.module.named_parameters(remove_duplicate=False))
        unknown = wanted - set(params)
        if unknown:
            raise KeyError(f"no parameters {sorted(unknown)} in {type(self.module).__name__}")
        saved = torch.get_rng_state()
        try:
            for name in sorted(wanted, key=list(params).index):
                p = params[name]
                if not p.is_meta:
                    continue
                value = self._replay(name, p)
                self._assign(name, nn.Parameter(value.to(device), requires_grad=p.requires_grad))
            for name, p in params.items():
                if placeholder is not None and name not in wanted and p.is_meta and placeholder(name):
                    self._assign(name, nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=device),
                                                    requires_grad=False))
        finally:
            torch.set_rng_state(saved)

    def _replay(self, name: str, p: Tensor) -> Tensor:
        ops = self.ops.get(id(p))
        if not ops:
            raise ValueError(f"parameter {name!r} was never initialised in place while the model was built; it cannot "
                             "be materialised from the meta device")
        out = torch.empty(p.shape, dtype=p.dtype, device="cpu")
        for op in ops:
            if op.rng is not None:
                torch.set_rng_state(op.rng)
            op.func(out, *op.args, **op.kwargs)
        return out

    def _assign(self, name: str, value: nn.Parameter) -> None:
        *path, leaf = name.split(".")
        owner = self.module.get_submodule(".".join(path))
        old = owner._parameters[leaf]
        owner._parameters[leaf] = value
        # Shared (tied) parameters: every module holding the same meta tensor gets the new one.
        for mod in self.module.modules():
            for k, q in list(mod._parameters.items()):
                if q is old:
                    mod._parameters[k] = value


def build_on_meta(factory: Callable[[], nn.Module]) -> MetaBuild:
    """``factory()`` on the ``meta`` device with its initialisation recorded (see the
    module docstring). The CPU generator advances exactly as ``factory()`` on the CPU
    would advance it."""
    recorder = _Recorder()
    with torch.device("meta"), recorder:
        module = factory()
    return MetaBuild(module, recorder.ops, recorder.keep)
