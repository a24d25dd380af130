"""Parallel degrees and the one ``DeviceMesh`` a run is laid out on.

:class:`ParallelConfig` is ``TrainConfig.parallel``: data-parallel (``dp``), tensor-parallel
(``tp``) and pipeline (``pp``) degrees and the pipeline's schedule. :func:`build_layout` turns
it, with the process group's size, into a :class:`ParallelLayout`: one
``torch.distributed.device_mesh.DeviceMesh`` with dimensions ``("pp", "dp", "tp")`` (``tp``
innermost, so tensor-parallel peers are neighbouring ranks; on a multi-GPU node they share
NVLink) and this rank's coordinate on each.

Which rows a rank trains on depends only on its ``dp`` coordinate: tensor-parallel and
pipeline peers see the same rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..validation import Bool, Choice, Fields, Int, Nullable

__all__ = ["PP_SCHEDULES", "ParallelConfig", "ParallelLayout", "build_layout", "check_one_process", "microbatches_problem",
           "PARALLEL_RULES"]

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")

PARALLEL_RULES = {
    "dp": Nullable(Int(1), "the ranks left over: world size / (tp * pp)"),
    "tp": Int(1),
    "pp": Int(1),
    "pp_schedule": Choice(PP_SCHEDULES),
    "pp_virtual": Int(1),
    "pp_cache": Bool(),
    "pp_microbatches": Nullable(Int(1), "parallel.pp * parallel.pp_virtual"),
}
_CHECK = Fields("TrainConfig.parallel")


@dataclass
class ParallelConfig:
    """How a run is spread over the processes ``torchrun`` starts.

    dp: data-parallel degree (FSDP2); ``None`` takes the ranks left over by ``tp`` and
        ``pp`` (so a plain multi-rank launch is data parallel, and one process is the mesh of
        size 1).
    tp: tensor-parallel degree: attention and MLP projections split over ``tp`` ranks
        (DTensor), norms and the residual on the sequence-sharded hidden states.
    pp: pipeline stages (physical); ``pp_virtual`` chunks per stage, ``C = pp * pp_virtual``.
    pp_schedule: ``"gpipe"``, ``"1f1b"`` (``pp_virtual = 1``) or ``"interleaved_1f1b"``
        (``pp_virtual >= 2``); torch's ``ScheduleGPipe`` / ``ScheduleLoopedBFS``,
        ``Schedule1F1B``, ``ScheduleInterleaved1F1B``.
    pp_cache: cross-stage caching (report §4.1): a stage keeps the block history it
        received for its earlier virtual stages and only new blocks travel.
    pp_microbatches: micro-batches per step (each data-parallel rank's batch divides into
        them); ``None``: ``pp * pp_virtual``.
    """

    dp: int | None = None
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1
    pp_cache: bool = False
    pp_microbatches: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name, rule in PARALLEL_RULES.items():
            _CHECK.rule(name, rule, getattr(self, name))
        if self.pp_schedule == "1f1b" and self.pp_virtual != 1:
            _CHECK.fail("pp_virtual", "1 for pp_schedule='1f1b' (use 'interleaved_1f1b' or 'gpipe' for more)",
                        self.pp_virtual)
        if self.pp_schedule == "interleaved_1f1b" and self.pp_virtual < 2:
            _CHECK.fail("pp_virtual", ">= 2 for pp_schedule='interleaved_1f1b' (use '1f1b' for 1)", self.pp_virtual)
        if self.pp_cache and self.pp_virtual < 2:
            _CHECK.fail("pp_cache", "false unless parallel.pp_virtual >= 2 (a stage caches what it received for its "
                        "earlier virtual stages)", self.pp_cache)
        if self.pp > 1:
            problem = microbatches_problem(self.pp_schedule, self.pp, self.microbatches)
            if problem is not None:
                _CHECK.fail("pp_microbatches", problem + "; unset: pp * pp_virtual", self.microbatches)

    @property
    def microbatches(self) -> int:
        return self.pp_microbatches if self.pp_microbatches is not None else self.pp * self.pp_virtual

    @property
    def is_default(self) -> bool:
        """Nothing but data parallelism (``tp = pp = 1``)."""
        return self.tp == 1 and self.pp == 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ParallelConfig:
        if isinstance(data, ParallelConfig):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"TrainConfig.parallel must be a mapping of {sorted(PARALLEL_RULES)}; got {data!r}")
        _CHECK.known_keys(data, PARALLEL_RULES)
        return cls(**data)


def microbatches_problem(schedule: str, stages: int, microbatches: int, stages_name: str = "parallel.pp") -> str | None:
    """What ``microbatches`` must be for torch's ``schedule`` over ``stages`` pipeline ranks
    (the field ``stages_name``), where it does not fit, else ``None``. Said at configuration
    time: torch raises its own error (naming no field) only when the first step builds the
    schedule, after the run directory and the data were set up."""
    if schedule == "1f1b" and microbatches < stages:
        return (f">= {stages_name}={stages} for schedule '1f1b' (torch's Schedule1F1B keeps every stage busy with its "
                "own micro-batch)")
    rounds = max(1, microbatches // stages)  # torch's ScheduleInterleaved1F1B: rounds of equal size
    if schedule == "interleaved_1f1b" and microbatches % rounds:
        return (f"divisible by its number of rounds (max(1, micro-batches // {stages_name}) = {rounds} with "
                f"{stages_name}={stages}) for schedule 'interleaved_1f1b' (torch's ScheduleInterleaved1F1B runs the "
                f"micro-batches in rounds of equal size): for example at most {stages} or a multiple of {stages}")
    return None


@dataclass(frozen=True)
class ParallelLayout:
    """The resolved degrees, the mesh and this rank's place on it.

    mesh: ``DeviceMesh`` of shape ``(pp, dp, tp)`` named ``("pp", "dp", "tp")`` (``None`` in
    a single process). ``dp_rank`` picks the rows of the global batch; ``pp_rank`` the
    pipeline stage; ``tp_rank`` the shard of the projections.
    """

    dp: int
    tp: int
    pp: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    mesh: Any = None

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group along ``dim`` (``"dp"``, ``"tp"`` or ``"pp"``)."""
        return None if self.mesh is None else self.mesh.get_group(dim)

    def submesh(self, dim: str):
        return None if self.mesh is None else self.mesh[dim]

    @property
    def size(self) -> int:
        """The ranks of the mesh (1: one process)."""
        return self.dp * self.tp * self.pp

    def describe(self) -> str:
        return f"dp {self.dp} x tp {self.tp} x pp {self.pp}"


def resolve_degrees(config: ParallelConfig, world_size: int) -> tuple[int, int, int]:
    """``(dp, tp, pp)`` for ``world_size`` ranks; ``ValueError`` naming the field when they do
    not multiply to it."""
    inner = config.tp * config.pp
    if world_size % inner:
        raise ValueError(f"TrainConfig.parallel: tp x pp = {config.tp} x {config.pp} = {inner} does not divide the "
                         f"{world_size} launched ranks; launch a multiple of {inner} ranks (torchrun --nproc-per-node "
                         f"{inner * (config.dp or 1)}), or set parallel.tp and parallel.pp to a product that divides "
                         f"{world_size}")
    if config.dp is None:
        return world_size // inner, config.tp, config.pp
    if config.dp * inner != world_size:
        raise ValueError(f"TrainConfig.parallel: dp x tp x pp = {config.dp} x {config.tp} x {config.pp} = "
                         f"{config.dp * inner} ranks, but {world_size} were launched; launch {config.dp * inner} "
                         f"(torchrun --nproc-per-node {config.dp * inner}), or leave parallel.dp unset for the ranks "
                         f"left over by tp and pp (here {world_size // inner})")
    return config.dp, config.tp, config.pp


def check_one_process(config: ParallelConfig) -> None:
    """``ValueError`` naming the fix where ``config`` asks for more than one rank and this
    process has no process group (a run started without ``torchrun``)."""
    if config.dp not in (None, 1) or not config.is_default:
        n = (config.dp or 1) * config.tp * config.pp
        raise ValueError(f"TrainConfig.parallel asks for dp {config.dp or 1} x tp {config.tp} x pp {config.pp} = {n} "
                         f"ranks; launch them with `torchrun --nproc-per-node {n} -m attnres train ...`, or set "
                         "parallel.dp=1 parallel.tp=1 parallel.pp=1 to train (or resume) in one process")


def build_layout(config: ParallelConfig, device: torch.device | None = None) -> ParallelLayout:
    """The layout of this process: a single-process one without a process group, else the
    mesh over the default group (every rank must call this)."""
    if not (dist.is_available() and dist.is_initialized()):
        check_one_process(config)
        return ParallelLayout(1, 1, 1, 0, 0, 0)
    from torch.distributed.device_mesh import init_device_mesh

    dp, tp, pp = resolve_degrees(config, dist.get_world_size())
    kind = (device or torch.device("cpu")).type
    mesh = init_device_mesh(kind, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    return ParallelLayout(dp, tp, pp, mesh.get_local_rank("dp"), mesh.get_local_rank("tp"), mesh.get_local_rank("pp"),
                          mesh)
