"""Worker of tests/test_pipeline.py: one rank of a pipeline process group.

``python tests/pipeline_worker.py CASES.json OUT.pt`` (under torchrun's environment, see
``attnres.distributed.local_spawn``) runs every case - a model config, a pipeline config -
as one training step on the pipeline and on the single-process model built from the same
seed, and rank 0 saves both losses, both sets of gradients (by parameter name, gathered from
all ranks) and the merged communication counters to ``OUT.pt``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from attnres import AttnResLM, ModelConfig
from attnres.distributed import CommCounter, PipelineConfig, PipelineRunner, default_backend
from attnres.models.lm import IGNORE_INDEX


def run_case(case: dict, device: torch.device) -> dict:
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
    runner = PipelineRunner(model, pipe)
    loss = runner.forward_backward(ids, labels)
    grads = {n: (None if p.grad is None else p.grad.detach().cpu()) for n, p in runner.named_parameters().items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (grads, runner.counter))
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
    cases = json.loads(open(sys.argv[1]).read())
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(default_backend(device), timeout=timedelta(seconds=60))
    try:
        results = {name: run_case(case, device) for name, case in cases.items()}
        if dist.get_rank() == 0:
            torch.save(results, sys.argv[2])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
