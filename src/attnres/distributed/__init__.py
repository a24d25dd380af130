"""Scale-out on ``torch.distributed``: process groups, data parallelism (FSDP2 / DDP),
sequence-sharded prefill (docs/distributed.md) and pipeline parallelism with cross-stage
caching (docs/distributed-pipeline.md)."""

from .comm_accounting import (
    CommCounter,
    Transition,
    cached_transfers,
    chunk_histories,
    history_layout,
    naive_transfers,
    plan_transitions,
)
from .data_parallel import (
    full_model_state,
    full_optimizer_state,
    local_rows,
    shard_optimizer_state,
    wrap_model,
)
from .launch import (
    DistContext,
    DistributedError,
    backend_for_device,
    init_distributed,
    resolve_mode,
)
from .parallel import PP_SCHEDULES, ParallelConfig, ParallelLayout, build_layout
from .pipeline import (
    SCHEDULES,
    CachedStage,
    PipelineChunk,
    PipelineConfig,
    PipelineRunner,
    StageCache,
    stage_parameter_names,
)
from .sequence_parallel import ShardedPrefill, gather_sequence, sharded_prefill

__all__ = [
    # process groups
    "DistContext",
    "DistributedError",
    "backend_for_device",
    "init_distributed",
    "resolve_mode",
    # data parallelism
    "wrap_model",
    "local_rows",
    "full_model_state",
    "full_optimizer_state",
    "shard_optimizer_state",
    # sequence-sharded prefill
    "ShardedPrefill",
    "sharded_prefill",
    "gather_sequence",
    # the mesh
    "PP_SCHEDULES",
    "ParallelConfig",
    "ParallelLayout",
    "build_layout",
    # pipeline parallelism
    "SCHEDULES",
    "CachedStage",
    "PipelineChunk",
    "PipelineConfig",
    "PipelineRunner",
    "StageCache",
    "stage_parameter_names",
    "CommCounter",
    "Transition",
    "cached_transfers",
    "chunk_histories",
    "history_layout",
    "naive_transfers",
    "plan_transitions",
]
