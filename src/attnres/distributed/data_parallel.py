"""Data parallelism for :class:`~attnres.AttnResLM`: FSDP2 (``fully_shard``) or DDP.

* :func:`wrap_model` shards (FSDP2) or replicates (DDP) the model. FSDP2 units are each
  sublayer's ``attn`` and ``mlp`` modules, plus the root for everything else (embedding, head,
  norms, the AttnRes queries). Not the transformer blocks: the model calls
  ``block.attention_sublayer`` and ``block.mlp_sublayer``, never ``block.forward``, and FSDP2
  gathers a module's parameters in a hook on ``forward``.
* :func:`local_rows` gives each rank its disjoint slice of the global batch, so ``K`` ranks
  with ``batch_size / K`` rows each take the same optimiser step as one process with the whole
  batch (the per-rank mean losses have equal weight, and DDP/FSDP average gradients).
* FSDP2 runs write sharded (DCP) checkpoints of :func:`sharded_parameters` (each rank its
  shards; :mod:`attnres.train.sharded_checkpoint`). DDP runs write consolidated ones:
  :func:`full_model_state` / :func:`full_optimizer_state` give whole tensors keyed exactly like
  a single-process ``state_dict()``; :func:`shard_optimizer_state` cuts a consolidated
  optimiser state (an older FSDP2 checkpoint, or one process's) to this rank's shards on
  load. Either way a checkpoint does not depend on the number of ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .launch import DistContext

DP_MODES = ("ddp", "fsdp")


def wrap_model(model: nn.Module, mode: str, ctx: DistContext, param_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard ``model`` in place (``fsdp``) or wrap it (``ddp``). Returns what to call for
    training forwards (the model itself for FSDP2, the DDP wrapper for DDP); ``model`` stays
    usable for evaluation. Build the optimiser *after* this call: FSDP2 replaces parameters
    by sharded DTensors. ``param_dtype`` (FSDP2): its ``MixedPrecisionPolicy``, parameters
    gathered and gradients computed in that dtype, reduced in float32; the sharded master
    weights stay float32."""
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mp = mixed_precision_policy(param_dtype)
        for layer in model.layers:
            fully_shard(layer.attn, mp_policy=mp)
            fully_shard(layer.mlp, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    if mode == "ddp":
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    raise ValueError(f"data-parallel mode must be one of {DP_MODES}; got {mode!r}")


@contextlib.contextmanager
def gradient_sync(forward: nn.Module, mode: str, sync: bool) -> Iterator[None]:
    """Around the forward and backward of one micro-batch: with ``sync=False`` the gradients
    only accumulate locally (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync(False)``);
    the last micro-batch of a step syncs, reducing the accumulated sum once. ``mode``
    ``"none"`` does nothing."""
    if mode == "ddp" and not sync:
        with forward.no_sync():
            yield
        return
    if mode == "fsdp":
        forward.set_requires_gradient_sync(sync)
    yield


def local_rows(batch: Tensor, ctx: DistContext) -> Tensor:
    """Rank ``r``'s rows ``[r B/K, (r+1) B/K)`` of a global batch ``[B, ...]``."""
    b = batch.shape[0]
    if b % ctx.world_size:
        raise ValueError(f"TrainConfig.batch_size={b} must be divisible by the number of ranks {ctx.world_size}")
    per = b // ctx.world_size
    return batch[ctx.rank * per:(ctx.rank + 1) * per]


def mean_over_ranks(value: float, ctx: DistContext) -> float:
    """The mean of a Python float over all ranks (every rank gets the result)."""
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.item() / ctx.world_size


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """True on every rank if ``flag`` is true on any rank."""
    t = torch.tensor([int(flag)], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def mixed_precision_policy(param_dtype: torch.dtype | None):
    """FSDP2's ``MixedPrecisionPolicy`` for ``param_dtype`` (``None``: none): parameters
    gathered and gradients computed in that dtype, gradients reduced in float32; the sharded
    master weights stay float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)


def sharded_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """``model``'s parameters by name, as FSDP2 registers them between steps: this rank's
    shards (DTensors), the objects the optimiser holds. FSDP2 keeps the root's parameters
    gathered after a forward (and a forward-only evaluation leaves them so), so every FSDP2
    module is resharded first. Tied parameters appear once."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return dict(model.named_parameters())


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor behind a DTensor (a collective: every rank must call it), or ``t``."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_model_state(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with every DTensor gathered, on the CPU. Tensors shared between
    keys (tied weights) stay shared, so the checkpoint stores them once. Collective."""
    gathered: dict[tuple[int, int, tuple[int, ...]], Tensor] = {}
    out = {}
    for name, t in model.state_dict().items():
        # Tied keys are distinct DTensor objects over the same local shard.
        local = t.to_local() if isinstance(t, DTensor) else t
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(t.shape))
        if key not in gathered:
            gathered[key] = full_tensor(t).detach().cpu()
        out[name] = gathered[key]
    return out


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every DTensor gathered (CPU), in the single-process
    layout. Collective: all ranks visit the entries in the same (sorted) order."""
    sd = optimizer.state_dict()
    state = {idx: {k: (full_tensor(v).cpu() if isinstance(v, Tensor) else v) for k, v in sd["state"][idx].items()}
             for idx in sorted(sd["state"])}
    return {"state": state, "param_groups": sd["param_groups"]}


def shard_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """A full (single-process) optimiser state dict with every per-parameter tensor cut to
    this rank's shard of its (DTensor) parameter; scalars such as Adam's ``step`` are kept.
    Pass the result to ``optimizer.load_state_dict``."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for idx, entry in sd["state"].items():
        p = params[int(idx)]
        state[idx] = {
            k: (distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                if isinstance(p, DTensor) and isinstance(v, Tensor) and v.shape == p.shape else v)
            for k, v in entry.items()
        }
    return {"state": state, "param_groups": sd["param_groups"]}
