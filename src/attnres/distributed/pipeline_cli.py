"""A pipelined training run from the command line (see docs/distributed-pipeline.md)."""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ..models.config import ModelConfig
from ..models.lm import AttnResLM
from ..nn.residual import registered_residuals
from .launch import backend_for_device
from .pipeline import RUNTIMES, SCHEDULES, PipelineConfig, PipelineRunner


def main(argv: list[str] | None = None) -> int:
    """``torchrun --nproc-per-node P -m attnres.distributed.pipeline_cli [options]``: a few
    pipelined AdamW steps of a preset model on one random batch, printing the loss and the
    bytes this pipeline sent per step (rank 0). The backend follows the device: NCCL on
    CUDA (one GPU per rank), gloo on CPU."""
    p = argparse.ArgumentParser(prog="attnres.distributed.pipeline_cli", description=main.__doc__)
    p.add_argument("--preset", default="demo")
    p.add_argument("--residual", default="attnres_block", choices=registered_residuals(),
                   help="a registered residual that can be cut into stages (standard, attnres_full, attnres_block)")
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--virtual-stages", type=int, default=2)
    p.add_argument("--schedule", default="interleaved_1f1b", choices=SCHEDULES)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--cache", action="store_true", help="cross-stage caching (this module's executor)")
    p.add_argument("--runtime", default="auto", choices=RUNTIMES)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--timeout", type=float, default=120, help="seconds a collective may wait before the group fails")
    args = p.parse_args(argv)

    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for_device(device), timeout=timedelta(seconds=args.timeout))
    try:
        cfg = ModelConfig.preset(args.preset, residual=args.residual, n_layers=args.n_layers)
        pipe = PipelineConfig(
            n_ranks=dist.get_world_size(), virtual_stages=args.virtual_stages, schedule=args.schedule,
            n_microbatches=args.microbatches, cache=args.cache, runtime=args.runtime,
        )
        torch.manual_seed(0)  # every rank builds the same model and keeps its own chunks
        runner = PipelineRunner(AttnResLM(cfg).to(device), pipe)
        opt = torch.optim.AdamW(runner.parameters(), lr=args.lr)
        # One fixed random batch: the loss falls as the model memorises it.
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
        for step in range(args.steps):
            runner.counter.reset()
            loss = runner.forward_backward(ids, ids)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sent = torch.tensor([runner.counter.total_bytes()], dtype=torch.float64, device=device)
            dist.all_reduce(sent, group=runner.group)
            if dist.get_rank() == 0:
                print(f"step {step + 1}: loss {loss.item():.4f}, sent {sent.item() / 2**20:.2f} MiB ({pipe.resolved_runtime} runtime, cache={pipe.cache})", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
