"""Global gradient clipping over any layout: data-parallel shards (FSDP2), tensor-parallel
shards (DTensor), replicated tensors and pipeline stages that each hold other parameters.

:func:`global_grad_norm` is the norm of the whole model's gradient, the same on every rank:
each DTensor gradient contributes the sum of squares of its local shard, summed over the
mesh dimensions along which it is sharded (not over those it is replicated on); a plain
gradient contributes its own; and the stages' sums add up over the pipeline group.
:func:`clip_grads_` then scales every gradient by ``min(1, max_norm / (norm + 1e-6))``, as
``torch.nn.utils.clip_grad_norm_`` does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

__all__ = ["global_grad_norm", "clip_grads_"]


def global_grad_norm(params: Iterable[nn.Parameter], pp_group: dist.ProcessGroup | None = None) -> Tensor:
    """The L2 norm (float64 scalar, on every rank alike) of the gradients of ``params`` (this
    rank's) together with those of the other pipeline stages (``pp_group``)."""
    sharded: dict[tuple, list] = {}  # (mesh, sharded mesh dims) -> [mesh, local sum of squares]
    total = None
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            dims = tuple(i for i, pl in enumerate(g.placements) if isinstance(pl, Shard))
            entry = sharded.setdefault((id(g.device_mesh), dims), [g.device_mesh, 0.0])
            entry[1] = entry[1] + g.to_local().detach().double().pow(2).sum()
        else:
            sq = g.detach().double().pow(2).sum()
            total = sq if total is None else total + sq
    for (_, dims), (mesh, sq) in sharded.items():
        for dim in dims:  # sum over each dimension the gradient is sharded along
            dist.all_reduce(sq, group=mesh.get_group(dim))
        total = sq if total is None else total + sq
    if total is None:
        total = torch.zeros((), dtype=torch.float64)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


@torch.no_grad()
def clip_grads_(params: Iterable[nn.Parameter], max_norm: float, total_norm: Tensor) -> None:
    """Scale the gradients of ``params`` so that their global norm ``total_norm`` is at
    most ``max_norm`` (no-op when it already is)."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            g.mul_(coef.to(g.dtype).to(g.device))
