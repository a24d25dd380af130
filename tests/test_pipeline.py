"""Pipeline parallelism (issue 6): the chunks, the schedules, cross-stage caching and the
communication account, against the single-process model and report §4.1's formulas.

The multi-process checks run as few process launches as possible (starting a process and
importing torch costs seconds here): each launch runs a batch of cases, see
``tests/pipeline_worker.py``; all of them run on CPU with gloo.
"""

from __future__ import annotations

import json
import math
import re
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import TOL, assert_rel_close, scale_errors, tensor_errors

from attnres import AttnResLM, ModelConfig
from attnres.distributed import (
    PipelineChunk,
    PipelineConfig,
    PipelineRunner,
    cached_transfers,
    chunk_histories,
    history_layout,
    naive_transfers,
    plan_transitions,
)
from attnres.distributed import pipeline as pipeline_module
from attnres.distributed.local_spawn import run_local

WORKER = Path(__file__).with_name("pipeline_worker.py")
SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = dict(vocab_size=64, d_model=16, n_heads=2, max_seq_len=16, mlp_hidden=32)
RESIDUALS = {
    "standard": {"residual": "standard"},
    "block": {"residual": {"kind": "attnres_block", "block_size": 3}},  # boundaries fall inside blocks
    "full": {"residual": {"kind": "attnres_full", "full_group_size": 3}},  # ... and inside groups
}


def block_plan(n_ranks: int, virtual_stages: int, per_chunk: int, block_size: int = 2):
    """A Block AttnRes config and split in which every chunk completes exactly ``per_chunk``
    entries (chunk 0: the embedding and ``per_chunk - 1`` blocks), so report §4.1 applies exactly."""
    layers_per_block = block_size // 2
    c = n_ranks * virtual_stages
    split = (layers_per_block * (per_chunk - 1),) + (layers_per_block * per_chunk,) * (c - 1)
    cfg = ModelConfig(**TINY, n_layers=sum(split), residual={"kind": "attnres_block", "block_size": block_size})
    return cfg, split


# -- the account: a pure function of the plan --------------------------------------------
@pytest.mark.parametrize("block_size", [2, 4])
@pytest.mark.parametrize("P,V,Np", [(4, 2, 1), (2, 2, 1), (2, 3, 2), (4, 3, 2), (3, 2, 3), (4, 1, 2)])
def test_transfers_equal_spec_formulas(P, V, Np, block_size):
    cfg, split = block_plan(P, V, Np, block_size)
    completed, running = chunk_histories(cfg, split)
    assert not any(running)  # chunk boundaries are block boundaries: no partial sum travels
    naive = plan_transitions(completed, running, P, cached=False)
    cached = plan_transitions(completed, running, P, cached=True)
    assert sum(t.blocks for t in naive) == naive_transfers(P, V, Np) == P * V * (P * V - 1) // 2 * Np
    assert sum(t.blocks for t in cached) == cached_transfers(P, V, Np)
    for t in cached:
        # Into chunk c >= P: the P N_p entries produced since rank c % P last received a history.
        assert t.blocks == (P * Np if t.chunk >= P else t.chunk * Np)
        assert t.cached + t.blocks == naive[t.chunk - 1].blocks
        assert (t.src_rank, t.dst_rank) == ((t.chunk - 1) % P, t.chunk % P)
    if (P, V, Np) == (4, 2, 1):
        assert (naive_transfers(P, V, Np), cached_transfers(P, V, Np)) == (28, 22)


def test_transfers_of_other_layouts():
    """Full AttnRes (the embedding is one entry more in chunk 0), partial sums, standard."""
    P, V, k = 2, 2, 1  # one transformer block (2 sublayer outputs) per chunk
    full = ModelConfig(**TINY, n_layers=4, residual="attnres_full")
    completed, running = chunk_histories(full, (k,) * 4)
    assert completed == [0, 3, 5, 7] and not any(running)
    naive = sum(t.blocks for t in plan_transitions(completed, running, P, cached=False))
    cached = sum(t.blocks for t in plan_transitions(completed, running, P, cached=True))
    assert naive == naive_transfers(P, V, 2 * k) + (P * V - 1)  # every history holds v_0 too
    assert cached == cached_transfers(P, V, 2 * k) + P  # v_0 travels until each rank holds it

    block = ModelConfig(**TINY, n_layers=4, residual={"kind": "attnres_block", "block_size": 3})
    completed, running = chunk_histories(block, (1, 1, 1, 1))
    assert [history_layout(block, s) for s in (2, 4, 6)] == [(1, True), (2, True), (3, False)]
    assert completed == [0, 1, 2, 3] and running == [False, True, True, False]
    assert [t.tensors for t in plan_transitions(completed, running, P, cached=True)] == [2, 3, 2]

    std = ModelConfig(**TINY, n_layers=4, residual="standard")
    ts = plan_transitions(*chunk_histories(std, (1, 1, 1, 1)), P, cached=True)
    assert [(t.blocks, t.running) for t in ts] == [(0, 1)] * 3


def test_config_errors():
    with pytest.raises(ValueError, match="PipelineConfig.schedule"):
        PipelineConfig(n_ranks=2, schedule="zero_bubble")
    with pytest.raises(ValueError, match="PipelineConfig.virtual_stages"):
        PipelineConfig(n_ranks=2, virtual_stages=2, schedule="1f1b")
    with pytest.raises(ValueError, match="PipelineConfig.layers_per_chunk"):
        PipelineConfig(n_ranks=2, layers_per_chunk=(1, -1))
    with pytest.raises(ValueError, match="PipelineConfig.layers_per_chunk"):
        PipelineConfig(n_ranks=2, layers_per_chunk=(1, 1)).chunk_layers(3)
    model = AttnResLM(ModelConfig(**TINY, n_layers=2, residual="mhc"))
    with pytest.raises(ValueError, match="'mhc' does not describe its history"):
        PipelineChunk(model, 0, range(1), 2)
    with pytest.raises(ValueError, match=r"'rezero' has parameters it cannot split: train it without a pipeline \(parallel.pp=1"):
        PipelineChunk(AttnResLM(ModelConfig(**TINY, n_layers=2, residual="rezero")), 0, range(1), 2)
    tied = AttnResLM(ModelConfig(**TINY, n_layers=2, tie_embeddings=True))
    with pytest.raises(ValueError, match="tie_embeddings"):
        PipelineChunk(tied, 0, range(1), 2)


def test_a_transformers_model_is_refused_naming_what_the_runner_takes():
    """PipelineRunner(an upcycled transformers model, ...) stopped on every rank in an
    AttributeError ("'AttnResLlamaForCausalLM' object has no attribute 'check_input_ids'"):
    refused first (here without a process group), naming what it takes."""
    pytest.importorskip("transformers")
    from fixtures.tiny_families import tiny_model

    from attnres.upcycle import upcycle

    with pytest.raises(TypeError, match=r"PipelineRunner takes attnres's own model \(an AttnResLM\); got "
                                        r"AttnResLlamaForCausalLM: .*\.to_native\(\)"):
        PipelineRunner(upcycle(tiny_model("llama"), "attnres_block"), PipelineConfig(n_ranks=2))


def test_a_compiled_model_is_taken_by_the_runner(monkeypatch):
    """PipelineRunner(torch.compile(model), ...) was taken (the wrapper answers the model's
    attributes) until the check of a transformers model refused it as not an AttnResLM: it gets
    past that check again (here to the group-size check, torch's answer stubbed)."""
    monkeypatch.setattr(pipeline_module.dist, "get_world_size", lambda group=None: 1)
    model = AttnResLM(ModelConfig.preset("tiny"))
    with pytest.raises(ValueError, match=r"PipelineConfig.n_ranks must be the process group's size 1"):
        PipelineRunner(torch.compile(model), PipelineConfig(n_ranks=2))


@pytest.mark.parametrize("schedule,virtual,stages,refused,taken", [
    ("1f1b", 1, 4, [1, 2, 3], [4, 5, 8]),  # torch's Schedule1F1B: M >= P
    ("interleaved_1f1b", 2, 2, [5, 7, 9], [1, 2, 3, 4, 6, 8]),  # torch's rounds: M % max(1, M // P) == 0
    ("gpipe", 2, 4, [], [1, 3, 5]),
])
def test_microbatches_torchs_schedules_refuse_are_refused_at_configuration(schedule, virtual, stages, refused, taken):
    """A micro-batch count torch's schedule refuses is refused when the config is read,
    naming the field (``attnres train`` used to set up the run directory and the data, then
    fail at the first step with torch's own message, once per rank)."""
    from attnres.distributed import ParallelConfig

    for m in refused:
        with pytest.raises(ValueError, match=rf"TrainConfig.parallel.pp_microbatches must be .*{schedule}.*; got {m}"):
            ParallelConfig(pp=stages, pp_schedule=schedule, pp_virtual=virtual, pp_microbatches=m)
        with pytest.raises(ValueError, match=rf"PipelineConfig.n_microbatches must be .*n_ranks={stages}"):
            PipelineConfig(n_ranks=stages, virtual_stages=virtual, schedule=schedule, n_microbatches=m)
    for m in taken:
        ParallelConfig(pp=stages, pp_schedule=schedule, pp_virtual=virtual, pp_microbatches=m)
        PipelineConfig(n_ranks=stages, virtual_stages=virtual, schedule=schedule, n_microbatches=m)
    ParallelConfig(pp=stages, pp_schedule=schedule, pp_virtual=virtual)  # the default, pp * pp_virtual


# -- the chunks, chained in one process --------------------------------------------------
@pytest.mark.parametrize(
    "residual,extra,split",
    [
        ("standard", {}, (2, 1, 2)),
        ("attnres_block", {"block_size": 3}, (1, 2, 2)),
        ("attnres_block", {"block_size": 4}, (0, 2, 0, 3)),  # empty chunks pass the stream on
        ("attnres_block", {"block_size": 1}, (2, 1, 2)),
        ("attnres_block", {"block_size": 3, "schedule": "naive"}, (1, 2, 2)),
        ("attnres_full", {"full_group_size": 3}, (1, 2, 2)),
        ("attnres_full", {"full_group_size": 4}, (2, 2, 1)),
        ("attnres_full", {"schedule": "naive"}, (1, 3, 1)),
    ],
)
def test_chained_chunks_equal_the_model(residual, extra, split):
    """The serialised stream rebuilds the residual state exactly: chunks called one after
    the other give the model's logits and every gradient, for boundaries inside blocks and
    Appendix-B groups, block boundaries, the naive path and empty chunks."""
    cfg = ModelConfig(**TINY, n_layers=sum(split), residual={"kind": residual, **extra})
    torch.manual_seed(0)
    model = AttnResLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    out = model(ids, ids)
    out.loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ranges = PipelineConfig(n_ranks=len(split), layers_per_chunk=split).chunk_layers(cfg.n_layers)
    chunks = [PipelineChunk(model, c, r, len(split)) for c, r in enumerate(ranges)]
    x = (ids,)
    for chunk in chunks:
        x = chunk(*x)
        if not chunk.last:
            assert len(x) == sum(history_layout(cfg, chunk.s1))  # the documented layout
    assert_rel_close(x, out.logits, TOL[torch.float32], "logits")
    torch.nn.functional.cross_entropy(x[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1)).backward()
    names = sorted(ref)
    assert sorted({n for ch in chunks for n, _ in ch.named_parameters()}) == names  # every parameter, once
    assert max(tensor_errors([dict(model.named_parameters())[n].grad for n in names], [ref[n] for n in names])) <= TOL[torch.float32]


@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone (P = 1: every edge stays on the rank), on an
    in-process store (no port to find free)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.skipif(pipeline_module.TORCH_VERSION < pipeline_module.ONE_RANK_GLOO_TORCH,
                    reason=f"torch {torch.__version__}'s pipeline schedules send between one rank's stages, which "
                           f"gloo cannot: torch>={pipeline_module.ONE_RANK_GLOO_TORCH} (refused by name: "
                           "test_one_rank_with_several_chunks_on_gloo_before_torch_2_12_is_refused)")
def test_one_rank_pipeline_and_its_errors(one_rank_group):
    """P = 1, V = 3 with the cache on torch's looped schedule: rank-local edges and cached
    entries (their gradients deposited and sent back) give the model's loss and gradients;
    bad batches and sizes are refused with clear errors."""
    cfg = ModelConfig(**TINY, n_layers=3, residual={"kind": "attnres_block", "block_size": 3})
    torch.manual_seed(0)
    ref = AttnResLM(cfg)
    torch.manual_seed(0)
    model = AttnResLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (4, 8), generator=torch.Generator().manual_seed(1))
    out = ref(ids, ids)
    out.loss.backward()
    runner = PipelineRunner(model, PipelineConfig(n_ranks=1, virtual_stages=3, n_microbatches=2, cache=True))
    assert runner.loss(ids, ids).item() == pytest.approx(out.loss.item(), rel=TOL[torch.float32])
    loss = runner.forward_backward(ids, ids)
    assert math.isclose(loss.item(), out.loss.item(), rel_tol=TOL[torch.float32])
    names = sorted(n for n, _ in ref.named_parameters())
    grads = runner.named_parameters()
    assert sorted(grads) == names
    assert max(tensor_errors([grads[n].grad for n in names], [dict(ref.named_parameters())[n].grad for n in names])) <= TOL[torch.float32]
    with pytest.raises(ValueError, match="not divisible by PipelineConfig.n_microbatches=2"):
        runner.forward_backward(ids[:3], ids[:3])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runner.forward_backward(ids + cfg.vocab_size, ids)
    with pytest.raises(ValueError, match="PipelineConfig.n_ranks"):
        PipelineRunner(model, PipelineConfig(n_ranks=2))
    s2 = AttnResLM(ModelConfig(**TINY, n_layers=3, residual={"kind": "attnres_block", "block_size": 2}))
    with pytest.raises(ValueError, match=r"edges into chunks \[2\] would carry nothing"):  # an empty chunk in between
        PipelineRunner(s2, PipelineConfig(n_ranks=1, virtual_stages=3, cache=True, layers_per_chunk=(1, 0, 2)))


def test_one_rank_with_several_chunks_on_gloo_before_torch_2_12_is_refused(one_rank_group, monkeypatch):
    """Torch 2.11's schedules failed at the first step inside gloo ("Pair is not connected"):
    the runner refuses it up front, naming the field and the torch that runs it."""
    cfg = ModelConfig(**TINY, n_layers=3, residual={"kind": "attnres_block", "block_size": 3})
    model = AttnResLM(cfg)
    monkeypatch.setattr(pipeline_module, "TORCH_VERSION", torch.torch_version.TorchVersion("2.11.0+cu130"))
    with pytest.raises(ValueError, match=r"PipelineConfig.virtual_stages must be 1 with n_ranks=1 on gloo under "
                                         r"torch 2.11.0\+cu130 .*torch>=2.12 does not\); got 3"):
        PipelineRunner(model, PipelineConfig(n_ranks=1, virtual_stages=3))
    assert PipelineRunner(model, PipelineConfig(n_ranks=1)).chunks  # one chunk: no message at all
    monkeypatch.setattr(pipeline_module, "TORCH_VERSION", torch.torch_version.TorchVersion("2.12.0"))
    assert len(PipelineRunner(model, PipelineConfig(n_ranks=1, virtual_stages=3)).chunks) == 3


# -- several processes --------------------------------------------------------------------
def run_cases(tmp_path: Path, n_ranks: int, cases: dict, timeout: float) -> dict:
    spec, out = tmp_path / "cases.json", tmp_path / "out.pt"
    spec.write_text(json.dumps(cases))
    env = {"PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run_local([str(WORKER), str(spec), str(out)], n_ranks, timeout, env=env)
    return torch.load(out)


def case(model: dict, n_ranks: int, schedule: str, V: int, cache: bool, M: int, split=None, batch=None) -> dict:
    pipe = dict(n_ranks=n_ranks, virtual_stages=V, schedule=schedule, n_microbatches=M, cache=cache, layers_per_chunk=split)
    return dict(model={**TINY, **model}, pipeline=pipe, batch=batch or M, seq=8)


def check_against_single_process(results: dict) -> None:
    """Loss and every parameter gradient of each case equal the single-process model's
    (float32, 1e-5); cached and uncached runs of one setting give the same results."""
    for name, r in results.items():
        names = sorted(r["ref_grads"])
        assert sorted(r["grads"]) == names, f"{name}: the ranks' parameters are not the model's"
        assert all(r["grads"][n] is not None for n in names), f"{name}: a parameter got no gradient"
        assert math.isclose(r["loss"], r["ref_loss"], rel_tol=TOL[torch.float32]), f"{name}: loss {r['loss']} vs {r['ref_loss']}"
        errs = tensor_errors([r["grads"][n] for n in names], [r["ref_grads"][n] for n in names])
        worst = max(range(len(names)), key=errs.__getitem__)
        assert errs[worst] <= TOL[torch.float32], f"{name}: gradient of {names[worst]} off by {errs[worst]:.2e}"
    for name, r in results.items():
        if name.endswith("/cached"):
            # The same schedule without the cache runs the same forward: the loss is equal bit
            # for bit; a cached entry's gradient adds up its uses in another order (rounding,
            # measured at the scale of the largest gradient: a small one - a depth query's -
            # carries the rounding of the large ones it is computed from).
            base = results[name.removesuffix("/cached") + "/naive"]
            assert r["loss"] == base["loss"], name
            names = sorted(r["grads"])
            errs = scale_errors([r["grads"][n] for n in names], [base["grads"][n] for n in names])
            assert max(errs) <= 1e-6, f"{name}: cached vs uncached gradients differ by {max(errs):.2e}"


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """One launch of 4 processes runs every multi-process case (the 2-rank ones on two
    subgroups side by side): starting processes costs far more than the cases."""
    cases = {}
    for res, model in RESIDUALS.items():
        model = {**model, "n_layers": 4}
        cases[f"P2/{res}/gpipe/naive"] = case(model, 2, "gpipe", 1, False, 2)
        cases[f"P2/{res}/1f1b/naive"] = case(model, 2, "1f1b", 1, False, 3)
        cases[f"P2/{res}/interleaved/naive"] = case(model, 2, "interleaved_1f1b", 2, False, 2)
        cases[f"P2/{res}/interleaved/cached"] = case(model, 2, "interleaved_1f1b", 2, True, 2)
        cases[f"P2/{res}/gpipe-v2/naive"] = case(model, 2, "gpipe", 2, False, 2)
        cases[f"P2/{res}/gpipe-v2/cached"] = case(model, 2, "gpipe", 2, True, 2)
    for res, model in RESIDUALS.items():
        model = {**model, "n_layers": 8}
        cases[f"P4/{res}/interleaved/naive"] = case(model, 4, "interleaved_1f1b", 2, False, 4)
        cases[f"P4/{res}/interleaved/cached"] = case(model, 4, "interleaved_1f1b", 2, True, 4)
    # Spec §5's example: P = 4, V = 2, N_p = 1 -> 28 vs 22 block transfers per micro-batch.
    cfg, split = block_plan(4, 2, 1)
    model = {"residual": {"kind": "attnres_block", "block_size": 2}, "n_layers": cfg.n_layers}
    for mode, cache in (("naive", False), ("cached", True)):
        cases[f"P4/spec/interleaved/{mode}"] = case(model, 4, "interleaved_1f1b", 2, cache, 4, split=list(split))
    cases["P4/spec/1f1b/naive"] = case(model, 4, "1f1b", 1, False, 4, split=[1, 2, 2, 2])
    return run_cases(tmp_path_factory.mktemp("pp"), 4, cases, timeout=420)


@pytest.fixture(scope="module")
def two_ranks(launch):
    return {k.removeprefix("P2/"): v for k, v in launch.items() if k.startswith("P2/")}


@pytest.fixture(scope="module")
def four_ranks(launch):
    return {k.removeprefix("P4/"): v for k, v in launch.items() if k.startswith("P4/")}


def test_two_ranks_equal_single_process(two_ranks):
    check_against_single_process(two_ranks)


def test_four_ranks_equal_single_process(four_ranks):
    check_against_single_process(four_ranks)


def test_counted_transfers_equal_the_plan(two_ranks, four_ranks):
    """What the ranks actually sent, forward and backward, per edge and micro-batch, is the
    plan's count; for report §4.1's example it is 28 (naive) vs 22 (cached) blocks."""
    M = 4
    spec = {mode: four_ranks[f"spec/interleaved/{mode}"]["counter"] for mode in ("naive", "cached")}
    for mode, counter in spec.items():
        for direction in ("forward", "backward"):
            blocks = sum(t for _, t, _ in counter[direction].values())
            assert blocks == M * (28 if mode == "naive" else 22), (mode, direction, counter[direction])
            assert all(m == M for m, _, _ in counter[direction].values())
    bytes_per_block = 1 * 8 * 16 * 4  # a micro-batch of 1 sequence x 8 tokens x d = 16, float32
    assert sum(b for _, _, b in spec["cached"]["forward"].values()) == M * 22 * bytes_per_block
    for results in (two_ranks, four_ranks):
        for name, r in results.items():
            cfg, pipe = ModelConfig(**r["case"]["model"]), r["case"]["pipeline"]
            split = pipe["layers_per_chunk"] or [len(x) for x in PipelineConfig(**{**pipe, "layers_per_chunk": None}).chunk_layers(cfg.n_layers)]
            plan = plan_transitions(*chunk_histories(cfg, split), pipe["n_ranks"], cached=pipe["cache"])
            M = pipe["n_microbatches"]
            sent = {c: t for c, (_, t, _) in r["counter"]["forward"].items()}
            assert sent == {t.chunk: M * t.tensors for t in plan}, name
            assert {c: t for c, (_, t, _) in r["counter"]["backward"].items()} == sent, name


def test_the_documented_python_example_runs_as_written_on_two_ranks(tmp_path):
    """docs/distributed-pipeline.md's ``python`` block, saved as the file its first line names
    and launched as it says (``torchrun --nproc-per-node 2``): every rank's loss is the
    single-process model's on the same batch. The block used ``device``, ``input_ids`` and
    ``labels`` without defining them and ``ModelConfig(...)``: it stopped at its first line."""
    from distributed_utils import run_doc_example

    out = run_doc_example("distributed-pipeline.md", "pipeline_example.py",
                          "\ntorch.manual_seed(0)\n"
                          "reference = AttnResLM(config)(input_ids, labels).loss\n"
                          "assert torch.allclose(loss, reference, rtol=1e-5), (loss, reference)\n"
                          "print(f\"equal to one process on rank {os.environ['RANK']}\")\n", tmp_path)
    for rank in (0, 1):
        # Not anchored to lines: the ranks share one pipe, and unbuffered, a print writes its
        # text and its newline apart, so one rank's line may land inside another's (CI saw
        # "rank 1: loss 6.9043rank 0: loss 6.9043\n\n"). Each text is one piece, one f-string:
        # a print of two arguments writes them and the space between apart, and the other
        # rank's text landed between "rank" and its number (two ranks printing together under
        # PYTHONUNBUFFERED=1 lost about a third of such lines, none of one f-string's).
        assert re.search(rf"rank {rank}: loss \d+\.\d{{4}}(?!\d)", out), out
        assert f"equal to one process on rank {rank}" in out, out


def test_the_documented_pipeline_command_says_its_small_step_count_and_loads():
    """docs/distributed-pipeline.md's ``attnres train parallel.pp=2 ...`` command ran the default
    1000 steps (minutes on 2 cores) without saying so. It names a small ``steps=``, the comment
    above it says that count, and its overrides load as a config (a pipeline of 2 stages)."""
    from attnres.train import load_config

    doc = (Path(__file__).resolve().parent.parent / "docs" / "distributed-pipeline.md").read_text()
    block = re.search(r"```bash\n(.*?)```", doc, re.S).group(1)
    command = " ".join(line.strip().rstrip("\\") for line in block.splitlines() if not line.startswith("#"))
    overrides = command.split(" -m attnres train ", 1)[1].split()
    config = load_config(None, overrides)
    assert config.parallel.pp == 2 and config.steps <= 100, overrides
    assert f"{config.steps} steps" in block and "half a minute" in block, block
