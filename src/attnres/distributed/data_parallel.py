"""Data parallelism: FSDP2 (``fully_shard``) over the mesh's ``dp`` dimension.

* :func:`apply_fsdp` shards a module in place: each transformer block's ``attn`` and ``mlp``
  (the units whose ``forward`` the model calls: it calls ``block.attention_sublayer`` and
  ``block.mlp_sublayer``, never ``block.forward``, and FSDP2 gathers a module's parameters
  in a hook on ``forward``), then the root for everything else (embedding, head, norms,
  the depth queries). A model without such blocks (a ``transformers`` family's) is one unit.
* Each data-parallel rank trains on its rows of the global batch
  (:meth:`~attnres.distributed.mesh_model.ParallelModel.rows`): ``K`` ranks with ``batch_size / K`` rows
  each take the step one process takes with the whole batch (the per-rank mean losses have
  equal weight, and the reduce-scatter averages the gradients).
* :func:`shard_optimizer_state` cuts a consolidated optimiser state (one process's
  checkpoint) to this rank's shards on load; sharded checkpoints need nothing of the kind.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .dtensor import is_dtensor

__all__ = ["apply_fsdp", "mixed_precision_policy", "reshard", "shard_optimizer_state", "full_tensor"]


def mixed_precision_policy(param_dtype: torch.dtype | None):
    """FSDP2's ``MixedPrecisionPolicy`` for ``param_dtype`` (``None``: none): parameters
    gathered and gradients computed in that dtype, gradients reduced in float32; the sharded
    master weights stay float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)


def apply_fsdp(root: nn.Module, blocks: Iterable[nn.Module], mesh, param_dtype: torch.dtype | None = None,
               reshard_after_forward: bool = True, ignored: set[nn.Parameter] | None = None) -> None:
    """``fully_shard`` each of ``blocks``' ``attn`` and ``mlp`` and then ``root``, in place,
    over the 1-D ``mesh``. Build the optimiser *after* this call: FSDP2 replaces parameters
    by sharded DTensors. ``param_dtype``: the mixed-precision policy
    (:func:`mixed_precision_policy`); ``ignored``: parameters FSDP2 leaves alone."""
    from torch.distributed.fsdp import fully_shard

    mp = mixed_precision_policy(param_dtype)
    for block in blocks:
        fully_shard(block.attn, mesh=mesh, mp_policy=mp)
        fully_shard(block.mlp, mesh=mesh, mp_policy=mp)
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, ignored_params=ignored or None)


def reshard(modules: Iterable[nn.Module]) -> None:
    """Free FSDP2's gathered parameters of ``modules`` (and their FSDP2 children): a
    forward-only evaluation, or a pipeline stage between its forward and backward, leaves
    them gathered, and the module then shows its unsharded tensors, not the parameters."""
    from torch.distributed.fsdp import FSDPModule

    for root in modules:
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor behind a DTensor (a collective: every rank must call it), or ``t``."""
    return t.full_tensor() if is_dtensor(t) else t


def shard_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """A full (single-process) optimiser state dict with every per-parameter tensor cut to
    this rank's shard of its (DTensor) parameter; scalars such as Adam's ``step``, and the
    state of plain-tensor parameters, are kept. Pass the result to
    ``optimizer.load_state_dict``."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for idx, entry in sd["state"].items():
        p = params[int(idx)]
        state[idx] = {
            k: _shard_like(v, p) if is_dtensor(p) and isinstance(v, Tensor) and v.shape == p.shape else v
            for k, v in entry.items()
        }
    return {"state": state, "param_groups": sd["param_groups"]}


def _shard_like(full: Tensor, p: Tensor) -> Tensor:
    """This rank's shard of ``full``, cut as the DTensor ``p`` is."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
