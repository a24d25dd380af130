"""Scale-out on ``torch.distributed``: process groups, data parallelism (FSDP2 / DDP) and
sequence-sharded prefill. See docs/distributed.md."""

from .data_parallel import full_model_state, full_optimizer_state, local_rows, shard_optimizer_state, wrap_model
from .launch import DistContext, DistributedError, backend_for_device, init_distributed, resolve_mode
from .sequence_parallel import ShardedPrefill, gather_sequence, sharded_prefill

__all__ = [
    "DistContext",
    "DistributedError",
    "backend_for_device",
    "init_distributed",
    "resolve_mode",
    "wrap_model",
    "local_rows",
    "full_model_state",
    "full_optimizer_state",
    "shard_optimizer_state",
    "ShardedPrefill",
    "sharded_prefill",
    "gather_sequence",
]
