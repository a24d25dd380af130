"""Scale-out on ``torch.distributed``: pipeline parallelism with cross-stage caching."""

from .comm_accounting import (
    CommCounter,
    Transition,
    cached_transfers,
    chunk_histories,
    history_layout,
    naive_transfers,
    plan_transitions,
)
from .pipeline import (
    RUNTIMES,
    SCHEDULES,
    PipelineChunk,
    PipelineConfig,
    PipelineRunner,
    default_backend,
    schedule_orders,
    timetable,
)

__all__ = [
    "RUNTIMES",
    "SCHEDULES",
    "CommCounter",
    "PipelineChunk",
    "PipelineConfig",
    "PipelineRunner",
    "Transition",
    "cached_transfers",
    "chunk_histories",
    "default_backend",
    "history_layout",
    "naive_transfers",
    "plan_transitions",
    "schedule_orders",
    "timetable",
]
