"""Worker of tests/test_pipeline.py: one rank of a group of 4 processes.

``python tests/pipeline_worker.py CASES.json OUT.pt`` (under torchrun's environment, see
``attnres.distributed.local_spawn``) runs every case - a model config, a pipeline config -
as one training step on the pipeline and on the single-process model built from the same
seed. Cases with ``n_ranks = 4`` use the whole group; those with ``n_ranks = 2`` are shared
between the subgroups {0, 1} and {2, 3}, which run them side by side (one launch instead of
two; the second subgroup's global ranks differ from its group ranks, which the P2P code must
translate). Rank 0 saves both losses, both sets of gradients (by parameter name, gathered
from the pipeline's ranks) and the merged communication counters to ``OUT.pt``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from attnres import AttnResLM, ModelConfig
from attnres.distributed import (
    CommCounter,
    PipelineConfig,
    PipelineRunner,
    backend_for_device,
)
from attnres.models import IGNORE_INDEX


def run_case(case: dict, device: torch.device, group: dist.ProcessGroup | None) -> dict:
    cfg = ModelConfig(**case["model"])
    pipe = case["pipeline"]
    pipe = PipelineConfig(**{**pipe, "layers_per_chunk": tuple(pipe["layers_per_chunk"]) if pipe.get("layers_per_chunk") else None})
    gen = torch.Generator().manual_seed(case.get("data_seed", 1))
    ids = torch.randint(0, cfg.vocab_size, (case["batch"], case["seq"]), generator=gen).to(device)
    labels = ids.clone()
    labels[0, 2] = IGNORE_INDEX  # the loss is a mean over the predicted tokens of the whole batch
    torch.manual_seed(0)
    ref = AttnResLM(cfg).to(device)
    torch.manual_seed(0)
    model = AttnResLM(cfg).to(device)
    out = ref(ids, labels)
    out.loss.backward()
    runner = PipelineRunner(model, pipe, group=group)
    loss = runner.forward_backward(ids, labels)
    grads = {n: (None if p.grad is None else p.grad.detach().cpu()) for n, p in runner.named_parameters().items()}
    gathered: list = [None] * pipe.n_ranks
    dist.all_gather_object(gathered, (grads, runner.counter), group=group)
    merged, counter = {}, CommCounter()
    for g, c in gathered:
        merged.update(g)
        counter.merge(c)
    return {
        "case": case,
        "loss": loss.item(),
        "ref_loss": out.loss.item(),
        "grads": merged,
        "ref_grads": {n: p.grad.detach().cpu() for n, p in ref.named_parameters()},
        "counter": counter.as_dict(),
    }


def main() -> None:
    torch.set_num_threads(1)
    cases = json.loads(Path(sys.argv[1]).read_text())
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for_device(device), timeout=timedelta(seconds=60))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        assert world == 4, "the cases are laid out for 4 processes"
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine, pair_cases = {}, [name for name, c in cases.items() if c["pipeline"]["n_ranks"] == 2]
        for name, case in cases.items():
            if case["pipeline"]["n_ranks"] == 4:
                mine[name] = run_case(case, device, None)
        for i, name in enumerate(pair_cases):
            if i % 2 == rank // 2:
                result = run_case(cases[name], device, pairs[rank // 2])
                if rank % 2 == 0:
                    mine[name] = result
        everything: list = [None] * world
        dist.all_gather_object(everything, mine)
        if rank == 0:
            torch.save({k: v for part in everything for k, v in part.items()}, sys.argv[2])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
