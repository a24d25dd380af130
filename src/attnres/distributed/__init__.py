"""Scale-out on ``torch.distributed``: process groups, the ``(pp, dp, tp)`` mesh and this
rank's part of a model over it (docs/scale-out.md), data parallelism (FSDP2), sequence-sharded
prefill (docs/distributed.md) and pipeline parallelism with cross-stage caching
(docs/distributed-pipeline.md)."""

from typing import TYPE_CHECKING

from ..lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .comm_accounting import (CommCounter, Transition, cached_transfers, chunk_histories, history_layout,
                                  naive_transfers, plan_transitions)
    from .data_parallel import apply_fsdp, shard_optimizer_state
    from .launch import DistContext, DistributedError, backend_for_device, init_distributed, process_context
    from .parallel import PP_SCHEDULES, ParallelConfig, ParallelLayout, build_layout
    from .pipeline import (SCHEDULES, CachedStage, PipelineChunk, PipelineConfig, PipelineRunner, StageCache,
                           stage_parameter_names)
    from .sequence_parallel import ShardedPrefill, gather_sequence, sharded_prefill

# The public names, each imported from its module on first use (PEP 562): pipeline parallelism
# and FSDP2 import torch.distributed.pipelining and DTensor, and with them TorchDynamo - about
# 0.6 CPU seconds that a command checking its config or launching ranks need not wait for.
_EXPORTS = {
    # process groups
    **dict.fromkeys(["DistContext", "DistributedError", "backend_for_device", "init_distributed", "process_context"],
                    ".launch"),
    # data parallelism
    **dict.fromkeys(["apply_fsdp", "shard_optimizer_state"], ".data_parallel"),
    # sequence-sharded prefill
    **dict.fromkeys(["ShardedPrefill", "sharded_prefill", "gather_sequence"], ".sequence_parallel"),
    # the mesh
    **dict.fromkeys(["PP_SCHEDULES", "ParallelConfig", "ParallelLayout", "build_layout"], ".parallel"),
    # pipeline parallelism
    **dict.fromkeys(["SCHEDULES", "CachedStage", "PipelineChunk", "PipelineConfig", "PipelineRunner", "StageCache",
                     "stage_parameter_names"], ".pipeline"),
    **dict.fromkeys(["CommCounter", "Transition", "cached_transfers", "chunk_histories", "history_layout",
                     "naive_transfers", "plan_transitions"], ".comm_accounting"),
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
