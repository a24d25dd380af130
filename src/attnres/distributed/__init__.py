"""Scale-out on ``torch.distributed``: process groups, the ``(pp, dp, tp)`` mesh and this
rank's part of a model over it (docs/scale-out.md), data parallelism (FSDP2), sequence-sharded
prefill (docs/distributed.md) and pipeline parallelism with cross-stage caching
(docs/distributed-pipeline.md)."""

from .comm_accounting import (
    CommCounter,
    Transition,
    cached_transfers,
    chunk_histories,
    history_layout,
    naive_transfers,
    plan_transitions,
)
from .data_parallel import apply_fsdp, shard_optimizer_state
from .launch import (
    DistContext,
    DistributedError,
    backend_for_device,
    init_distributed,
    process_context,
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
    "process_context",
    # data parallelism
    "apply_fsdp",
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
