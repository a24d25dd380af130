# The profile in profile_train_step.txt: two training steps of the standard and the Block (Triton)
# model at bench_kernels_gpu.py's end-to-end shape, after three warm-up steps. Run from the
# repository root: PYTHONPATH=src python benchmarks/results/gpu-h100/profile_train_step.py
import sys, torch
sys.path.insert(0, "benchmarks")
import bench_kernels_gpu as b
from attnres import AttnResLM
from torch.profiler import profile, ProfilerActivity
args = b.parse_args([])
base = b.e2e_config(args)
for name, res in [("standard", "standard"), ("block (triton)", {"kind": "attnres_block", "kernels": "triton"})]:
    torch.manual_seed(0)
    m = AttnResLM(base.replace(residual=res if res == "standard" else {**res, "block_size": base.residual.block_size})).cuda()
    ids = torch.randint(0, base.vocab_size, (args.e2e_batch, args.e2e_seq), device="cuda")
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            m(ids, labels=ids).loss.backward()
        m.zero_grad(set_to_none=True)
    for _ in range(3): step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(2): step()
        torch.cuda.synchronize()
    print(f"==== {name} (2 steps)")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=28, max_name_column_width=60))
    del m; torch.cuda.empty_cache()
