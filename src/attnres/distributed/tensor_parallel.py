"""Tensor parallelism for the decoder (DTensor ``parallelize_module``), with sequence
parallelism for the norms, and the AttnRes residual on the sequence-sharded hidden states.

Plan (Megatron-LM's, as torchtitan writes it for Llama), on a 1-D ``tp`` mesh:

* ``embed_tokens``: ``RowwiseParallel`` (vocabulary rows split), output sharded along the
  sequence: every rank holds ``T / tp`` positions of the hidden state from the start;
* each block: ``attn_norm`` / ``mlp_norm`` ``SequenceParallel`` (on the sequence shard);
  ``attn`` / ``mlp`` take their input all-gathered (``PrepareModuleInput``);
  ``q/k/v_proj`` and ``gate/up_proj`` ``ColwiseParallel`` (heads and hidden units split),
  ``o_proj`` and ``down_proj`` ``RowwiseParallel`` with a reduce-scatter back to the
  sequence shard;
* ``norm`` ``SequenceParallel``, ``lm_head`` ``ColwiseParallel`` gathering the logits. With
  tied embeddings both are the same ``[vocab, d]`` parameter, split by vocabulary rows.

The residual stream between sublayers is a plain ``[B, T / tp, d]`` tensor on each rank, so
the AttnRes residual - Phase 1 over the completed blocks, the Phase-2 merges - runs on the
rank's own positions, unchanged (depth attention mixes over depth, token by token: report
§4.2). Its parameters (the pseudo-queries and key-norm gains) stay plain, replicated
tensors; each rank's gradient covers its positions only, so :func:`reduce_replicated_grads`
sums them over the ``tp`` group after the backward pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from .dtensor import is_dtensor

__all__ = ["apply_tensor_parallel", "reduce_replicated_grads", "reduce_grads", "check_tp_shapes"]

# Attention.forward(x, cos, sin, attn_mask, kv_cache, layer): only x is sharded.
_ATTN_ARGS = 6


def check_tp_shapes(config, tp: int) -> None:
    """``ValueError`` naming the field unless heads, key/value heads and the MLP's hidden
    units divide over ``tp`` ranks."""
    for name, value in (("n_heads", config.n_heads), ("n_kv_heads", config.kv_heads), ("mlp_hidden", config.hidden_size)):
        if value % tp:
            raise ValueError(f"ModelConfig.{name}={value} must be divisible by TrainConfig.parallel.tp={tp}")


def _block_plan() -> dict:
    # (DTensor's modules, here and below, are imported where a run shards over tp ranks: most
    # of a second, which a run without tensor parallelism does not spend)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    gather = dict(input_layouts=(Shard(1),) + (None,) * (_ATTN_ARGS - 1),
                  desired_input_layouts=(Replicate(),) + (None,) * (_ATTN_ARGS - 1))
    return {
        "attn_norm": SequenceParallel(),
        "attn": PrepareModuleInput(**gather),
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tensor_parallel(root: nn.Module, mesh, layers: Iterable[nn.Module]) -> None:
    """Shard ``layers`` (transformer blocks) and, where ``root`` holds them, its
    ``embed_tokens``, ``norm`` and ``lm_head`` over the 1-D ``mesh``, in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    tp = mesh.size()
    if hasattr(root, "defer_norm"):  # a whole model: its norms become sequence-parallel modules, which take tensors
        root.defer_norm = False
    for layer in layers:
        parallelize_module(layer, mesh, _block_plan())
        # Each rank now computes n_heads / tp query heads and n_kv_heads / tp key/value heads.
        layer.attn.n_heads //= tp
        layer.attn.n_kv_heads //= tp
    embed, head = getattr(root, "embed_tokens", None), getattr(root, "lm_head", None)
    tied = embed is not None and head is not None and head.weight is embed.weight
    plan = {}
    if embed is not None:
        plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(root, "norm", None) is not None:
        plan["norm"] = SequenceParallel()
    if head is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if plan:
        parallelize_module(root, mesh, plan)
    if embed is not None:  # (a sequence that does not split evenly failed in a collective, or aborted gloo)
        embed.register_forward_pre_hook(lambda _, args: check_sequence_length("input_ids", args[0].shape[1], tp))
        if hasattr(root, "shard_inputs_embeds"):  # inputs_embeds in place of the embedding's output
            root.shard_inputs_embeds = partial(sequence_shard, mesh)
    if tied:
        # Each style distributes the weight into a parameter of its own: tie them again. Both
        # split the [vocab, d] matrix by vocabulary rows (Shard(0)), the embedding's lookup and
        # the head's output features alike, so one DTensor serves both.
        if head.weight.placements != embed.weight.placements:
            raise ValueError("model.tie_embeddings with parallel.tp > 1: the embedding and LM head shards differ "
                             f"({embed.weight.placements} vs {head.weight.placements}); set model.tie_embeddings=false")
        head.weight = embed.weight


def check_sequence_length(name: str, t: int, tp: int) -> None:
    """``ValueError`` unless a sequence of ``t`` positions splits evenly over ``tp`` ranks."""
    if t % tp:
        raise ValueError(f"{name} of {t} positions under tensor parallelism: the sequence length must be divisible by "
                         f"parallel.tp={tp} (the norms and the residual run on the sequence shard); pad the sequence "
                         "to a multiple of it")


def sequence_shard(mesh, inputs_embeds: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the sequence of ``inputs_embeds [B, T, d]`` (the same on every rank
    of the 1-D ``mesh``), as the sharded embedding gives it for ``input_ids``; its gradient
    comes back whole on every rank (an all-gather), as in one process."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    check_sequence_length("inputs_embeds", inputs_embeds.shape[1], mesh.size())
    whole = DTensor.from_local(inputs_embeds, mesh, [Replicate()], run_check=False)
    return whole.redistribute(mesh, [Shard(1)]).to_local()


def reduce_replicated_grads(params: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Sum the gradients of replicated parameters over the ``tp`` ``group`` (each rank's
    covers its sequence shard only). Gradients that FSDP sharded are summed shard by shard."""
    reduce_grads([p.grad for p in params if p.grad is not None], group)


def reduce_grads(grads: list[torch.Tensor], group: dist.ProcessGroup, divisor: int = 1) -> None:
    """Sum ``grads`` over ``group`` in one all-reduce, in place (a DTensor by its local
    shard), then divide by ``divisor`` (``> 1``: the mean over a group of that size)."""
    if not grads:
        return
    local = [g.to_local() if is_dtensor(g) else g for g in grads]
    flat = torch.cat([t.reshape(-1) for t in local])
    dist.all_reduce(flat, group=group)
    if divisor > 1:
        flat /= divisor
    offset = 0
    for t in local:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
