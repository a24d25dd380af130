"""Tasks of the no-free-lunch experiment: a structured teacher, a random lookup table, and
the mixture between them.

For a seed, one set of inputs, one linear teacher and one lookup table are drawn; every
mixing coefficient ``lam`` reuses them, so the grid over ``lam`` interpolates one task:

    x_i ~ N(0, I_{d_in})                       (n_train training and n_test test inputs)
    T(x) = W x,   W: rows drawn N(0, I), scaled to unit norm   (the linear teacher: each output ~ N(0, 1))
    R_i ~ N(0, I_{d_out})                      (the lookup table: one random target per training input)
    y_i = sqrt(1 - lam) * T(x_i) + sqrt(lam) * R_i

The square roots keep the target variance at 1 for every ``lam``, so train losses are on
one scale (predicting zero gives 1). ``lam = 0`` is exactly the teacher and ``lam = 1``
exactly the lookup table. Test targets are the structured part only,
``sqrt(1 - lam) * T(x)`` on fresh inputs: the random part of an unseen input cannot be
predicted, so the best any model can do there is the structured part (the Bayes
predictor), and the test loss measures how well that part generalises. At ``lam = 1`` the
test target is zero: the test loss then only measures how far the predictions on unseen
inputs stray from zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["TaskSpec", "Task", "make_task"]


@dataclass(frozen=True)
class TaskSpec:
    """Sizes of a task: input and output dimensions, training and test set sizes."""

    d_in: int = 16
    d_out: int = 8
    n_train: int = 256
    n_test: int = 1024

    def __post_init__(self) -> None:
        for name in ("d_in", "d_out", "n_train", "n_test"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TaskSpec.{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class Task:
    """One task's tensors (float32). ``structured_*`` is ``T(x)`` before mixing and
    ``lookup`` the table ``R``; ``y_*`` are the training and test targets."""

    lam: float
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    structured_train: Tensor
    structured_test: Tensor
    lookup: Tensor


def make_task(lam: float, seed: int, spec: TaskSpec = TaskSpec()) -> Task:
    """The task with mixing coefficient ``lam`` in [0, 1] for ``seed`` (deterministic: the
    same arguments give the same tensors; every ``lam`` shares the seed's inputs, teacher
    and table)."""
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be a number in [0, 1], got {lam!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    g = torch.Generator().manual_seed(seed)
    # The draw order is fixed, so adding fields later must append draws, not insert them.
    teacher = torch.randn(spec.d_out, spec.d_in, generator=g)
    teacher = teacher / teacher.norm(dim=1, keepdim=True)  # each output of T(x) is N(0, 1) exactly
    x_train = torch.randn(spec.n_train, spec.d_in, generator=g)
    x_test = torch.randn(spec.n_test, spec.d_in, generator=g)
    lookup = torch.randn(spec.n_train, spec.d_out, generator=g)
    structured_train = x_train @ teacher.T
    structured_test = x_test @ teacher.T
    a, b = math.sqrt(1.0 - lam), math.sqrt(lam)
    return Task(
        lam=float(lam),
        x_train=x_train,
        y_train=a * structured_train + b * lookup,
        x_test=x_test,
        y_test=a * structured_test,
        structured_train=structured_train,
        structured_test=structured_test,
        lookup=lookup,
    )
