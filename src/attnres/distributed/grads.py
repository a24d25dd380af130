"""Global gradient clipping over any layout: data-parallel shards (FSDP2), tensor-parallel
shards (DTensor), replicated tensors and pipeline stages that each hold other parameters.

:func:`global_grad_norm` is the norm of the whole model's gradient, the same on every rank,
with one all-reduce over all ranks: each rank adds the sum of squares of its local gradient
shards, each divided by the number of ranks holding that same shard (a DTensor's: the
product of its mesh's replicated dimensions, times the stage's ranks outside that mesh; a
plain tensor's: all the stage's ranks), and the sum over the world is the global sum of
squares. :func:`clip_grads_` then scales every gradient by
``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .dtensor import is_dtensor

__all__ = ["global_grad_norm", "clip_grads_"]


def global_grad_norm(params: Iterable[nn.Parameter], stage_ranks: int = 1) -> Tensor:
    """The L2 norm (float64 scalar on the CPU, on every rank alike) of the gradients of
    ``params`` (this rank's) together with every other rank's; ``stage_ranks``: the ranks of
    one pipeline stage (world size / pp), which hold the same parameters.

    The sums of squares stay on their gradients' device until all are summed: one transfer
    to the host per device, not a host sync per parameter (on a GPU each would wait for the
    device, hundreds of times a step)."""
    squares: dict[torch.device, list[Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if is_dtensor(g):
            mesh = g.device_mesh
            copies = math.prod(mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())
            copies *= stage_ranks // mesh.size()
            local = g.to_local()
        else:
            copies, local = stage_ranks, g
        squares.setdefault(local.device, []).append(local.detach().double().pow(2).sum() / copies)
    total = torch.zeros((), dtype=torch.float64)
    for parts in squares.values():
        total = total + torch.stack(parts).sum().cpu()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else total.device
        total = total.to(device)
        dist.all_reduce(total)
        total = total.cpu()
    return total.sqrt()


@torch.no_grad()
def clip_grads_(params: Iterable[nn.Parameter], max_norm: float, total_norm: Tensor) -> None:
    """Scale the gradients of ``params`` so that their global norm ``total_norm`` is at
    most ``max_norm`` (no-op when it already is). The factor is copied to each device and
    dtype once, not once per gradient."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    factors: dict[tuple[torch.device, torch.dtype], Tensor] = {}
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if is_dtensor(p.grad) else p.grad
            key = (g.device, g.dtype)
            if key not in factors:
                factors[key] = coef.to(device=g.device, dtype=g.dtype)
            g.mul_(factors[key])
