"""Whether a tensor is a DTensor, without importing DTensor.

``torch.distributed.tensor`` takes most of a second to import (TorchDynamo with it); a
one-process run never makes a DTensor, and a tensor can be one only once that module is
loaded, so the check looks there first instead of importing it."""

from __future__ import annotations

import sys

from torch import Tensor

__all__ = ["is_dtensor"]


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2's and tensor
    parallelism's parameters and gradients)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)
