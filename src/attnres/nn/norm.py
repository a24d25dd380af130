"""RMSNorm with a learnable gain, and the hook that lets a kernel fuse it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..validation import Int, Number

__all__ = ["RMSNorm", "FusableNormInput", "norm_input_value"]


class FusableNormInput:
    """A sublayer input ``h`` that has not been computed yet, because the kernel producing
    it can also apply the sublayer's RMSNorm in the same pass (report §4.2, fused Phase 2).

    The residual returns one when its caller feeds every sublayer input to an
    :class:`RMSNorm` (``ResidualStream.start(..., defer_norm=True)``). The norm module then
    calls :meth:`normalized` with its own gain and epsilon, so the norm's parameters,
    ``repr`` and forward hooks stay with the block that owns it. ``compute(weight, eps,
    out_dtype, readers)`` returns ``RMSNorm(h)`` (``weight=None``: ``h`` itself) in
    ``out_dtype`` (``None``: the stream's) - with ``readers > 1``, a tuple of that many
    tensors of it, one for each layer reading it, whose gradients the producing kernel adds
    up in float32; it may be called more than once (activation checkpointing recomputes).
    """

    __slots__ = ("_compute", "_value", "_with_grad")

    #: What a sublayer that does not start with our RMSNorm is told, after what it did.
    MISUSE = ("a deferred sublayer input (attnres.nn.norm.FusableNormInput): with ResidualStream.start(..., "
              "defer_norm=True) every sublayer must first pass its input to an attnres.nn.RMSNorm, which fuses into "
              "the residual's kernel; for sublayers that start otherwise (LayerNorm, torch.nn.RMSNorm, a Linear) call "
              "start(..., defer_norm=False)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Any PyTorch function handed one (a sublayer that does not start with our RMSNorm)
        # would fail with "must be Tensor, not FusableNormInput", naming neither cause nor cure.
        name = getattr(func, "__name__", str(func))
        raise TypeError(f"{name}() was given {cls.MISUSE}")

    def __getattr__(self, name: str):
        # (a sublayer reading its input as a tensor first - x.shape, x.view(...) - was told only
        # "'FusableNormInput' object has no attribute 'shape'"; dunders stay plain for copy and hasattr)
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f".{name} was read from {self.MISUSE}")

    def _refuse_operator(self, *_args: Any) -> NoReturn:
        raise TypeError(f"an operator (+, *, @, [...]) was applied to {self.MISUSE}")

    # (a sublayer that scales or slices its input first, h * 0.5 or h[..., :k], was told only
    # "unsupported operand type(s) for *: 'FusableNormInput' and 'float'"; a tensor operand
    # reaches __torch_function__ above)
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse_operator
    __matmul__ = __rmatmul__ = __pow__ = __neg__ = __getitem__ = _refuse_operator

    def __init__(self, compute: Callable[[Tensor | None, float | None], Tensor]) -> None:
        self._compute = compute
        self._value: Tensor | None = None
        self._with_grad = torch.is_grad_enabled()

    def normalized(self, norm: RMSNorm, out_dtype: torch.dtype | None = None,
                   readers: int = 1) -> Tensor | tuple[Tensor, ...]:
        """``norm(h)`` in ``out_dtype``, fused into the producing kernel (unless :meth:`value`
        ran first); ``readers > 1``: a tuple, one tensor for each reader (see the class)."""
        if self._value is not None:
            y = norm(self._value)
            return y if readers == 1 else (y,) * readers
        if self._with_grad and not torch.is_grad_enabled():
            # A reentrant torch.utils.checkpoint runs the sublayer without autograd and then
            # recomputes it from its tensor arguments only: this input (not a tensor) would
            # be cut off from the graph, and its gradients silently lost.
            raise RuntimeError(
                "a deferred sublayer input was evaluated with gradients disabled inside a forward pass that "
                "records them - a reentrant activation checkpoint (torch.utils.checkpoint(..., use_reentrant=True)) "
                "around the sublayer? Use use_reentrant=False (as activation_checkpoint='block' does).")
        return self._compute(norm.weight, norm.eps, out_dtype, readers)

    def value(self) -> Tensor:
        """``h`` itself, computed once without the norm (for hooks and diagnostics)."""
        if self._value is None:
            self._value = self._compute(None, None, None, 1)
        return self._value


def norm_input_value(x: Tensor | FusableNormInput) -> Tensor:
    """The tensor an :class:`RMSNorm` normalises: ``x``, or a fusable input's value."""
    return x.value() if isinstance(x, FusableNormInput) else x


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension; ``weight`` starts at 1.

    Shapes: ``[..., d] -> [..., d]``. Low-precision inputs are normalised in float32 and
    cast back once. A :class:`FusableNormInput` is normalised by the kernel that produces it.

    ``autocast_output`` (off by default; ``ModelConfig.residual.autocast_norm_output`` sets it
    on a model's sublayer norms): under autocast, return the autocast dtype - the value the
    next linear layers compute with, rounded once here instead of by each of them (a
    sublayer's q, k and v projections each round a float32 input again, and their
    gradients are converted back and added in float32); those layers' input gradients then
    add up in the autocast dtype. Without autocast it does nothing.

    ``readers`` (a forward argument): how many linear layers read the output - an
    attention's q, k and v projections, an MLP's gate and up. Where a kernel produces the
    input and applies the norm (a :class:`FusableNormInput`) under autocast (the option above
    off), the result is then a tuple of that many views of the output, one for each reader:
    the kernel writes the autocast dtype, as each reader would round it, and adds the
    readers' gradients in float32 itself - the values and gradients of the unfused path,
    without a pass that rounds the output or one that adds the gradients. Otherwise it is
    one tensor, which every reader reads.
    """

    #: Under autocast, return the autocast dtype (see the class docstring).
    autocast_output: bool = False

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        # (RMSNorm(0) was built, and failed or returned nothing at its first input; a negative eps gave NaN)
        if not Int(1).ok(dim):
            raise ValueError(f"RMSNorm: dim (the normalised last dimension) must be an integer >= 1, got {dim!r}")
        if not Number(0.0).ok(eps):
            raise ValueError(f"RMSNorm: eps must be a finite number >= 0, got {eps!r}")
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """The gain back to ones."""
        nn.init.ones_(self.weight)

    def output_dtype(self) -> torch.dtype | None:
        """The dtype :attr:`autocast_output` asks for here: the autocast dtype of the gain's
        device where autocast is on there, else ``None`` (the input's)."""
        device = self.weight.device.type
        if not self.autocast_output or device == "meta" or not torch.is_autocast_enabled(device):
            return None
        return torch.get_autocast_dtype(device)

    def forward(self, x: Tensor | FusableNormInput, readers: int = 1) -> Tensor | tuple[Tensor, ...]:
        out_dtype = self.output_dtype()
        if isinstance(x, FusableNormInput):
            device = self.weight.device.type
            if readers > 1 and out_dtype is None and device != "meta" and torch.is_autocast_enabled(device):
                # (each reader rounds to the autocast dtype: the kernel writes that, and
                # reads each reader's gradient)
                return x.normalized(self, torch.get_autocast_dtype(device), readers)
            return x.normalized(self, out_dtype)
        y = self._normalize(x)
        return y if out_dtype is None or y.dtype == out_dtype else y.to(out_dtype)

    def _normalize(self, x: Tensor) -> Tensor:
        if x.dtype in (torch.float16, torch.bfloat16) and self.weight.dtype != x.dtype:
            # (a float32 gain on a half input: normalised and scaled in float32, rounded once)
            return F.rms_norm(x.float(), (self.dim,), self.weight.float(), self.eps).to(x.dtype)
        # (a half input with a gain of its dtype: F.rms_norm computes in float32 and rounds once
        # already - one fused kernel on CUDA, where the line above would be four)
        return F.rms_norm(x, (self.dim,), self.weight.to(x.dtype), self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
