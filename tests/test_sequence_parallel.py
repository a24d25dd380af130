"""Sequence-sharded prefill (report §4.2) against one-process prefill, on 2 and 4 gloo ranks.

One ``torchrun`` launch of 4 processes (this file run as a script) covers every case: the
whole world (P = 4) and a sub-group of ranks 0 and 1 (P = 2), for the standard residual,
Block and Full AttnRes, in float32 and float64. Rank 0 writes the gathered logits, the KV
cache and every rank's measured bytes of depth sources; the tests compare them with
``model(ids)`` and ``inference.prefill`` in this process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")

from conftest import TOL, assert_rel_close, make_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from attnres.distributed.sequence_parallel import sharded_prefill  # noqa: E402
from attnres.inference import prefill  # noqa: E402

RESIDUALS = ("standard", "attnres_block", "attnres_full")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
GROUPS = (4, 2)  # P; ranks 0 .. P-1
BATCH, SEQ = 2, 16
SHAPE = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)  # L = 4 sublayers, N = 2 blocks (S = 2)


def build(residual: str, dtype: torch.dtype):
    """The same model and prompt in the worker and in the test (non-zero AttnRes queries)."""
    model = make_model(dtype, seed=3, residual={"kind": residual, "block_size": 2}, **SHAPE).eval()
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    return model, ids


def worker(out: Path) -> None:
    import torch.distributed as dist

    from attnres.distributed.sequence_parallel import gather_sequence, sharded_prefill

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = {p: (dist.new_group(list(range(p))) if p < dist.get_world_size() else None) for p in GROUPS}
    for p, group in groups.items():
        if rank >= p:
            continue
        for residual in RESIDUALS:
            for dname, dtype in DTYPES.items():
                model, ids = build(residual, dtype)
                res = sharded_prefill(model, ids, group=group, build_cache=True)
                logits = gather_sequence(res.logits, group)
                sizes = [None] * p
                dist.all_gather_object(sizes, [res.start, res.n_sources, res.source_bytes], group=group)
                if rank == 0:
                    tag = f"{residual}-{dname}-P{p}"
                    cache = res.kv_cache
                    tensors = {"logits": logits}
                    for layer in range(model.config.n_layers):
                        tensors[f"k{layer}"], tensors[f"v{layer}"] = cache.keys(layer), cache.values(layer)
                    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"{tag}.safetensors"))
                    (out / f"{tag}.json").write_text(json.dumps(sizes))
    model, ids = build("attnres_block", torch.float32)
    try:
        sharded_prefill(model, ids[:, :10])
    except ValueError as e:
        if rank == 0:
            (out / "indivisible.txt").write_text(str(e))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    from distributed_utils import torchrun

    out = tmp_path_factory.mktemp("seqpar")
    torchrun(4, __file__, str(out))
    return out


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("p", GROUPS)
@pytest.mark.parametrize("dname", DTYPES)
@pytest.mark.parametrize("residual", RESIDUALS)
def test_sharded_prefill_matches_one_process(sharded, residual, dname, p):
    """Logits and KV cache equal one-process prefill within the dtype's model tolerance (the
    shards' attention runs over fewer keys with an explicit mask, so bitwise equality is not
    guaranteed, although this CPU build happens to give it); each rank holds exactly 1/P of
    the depth-source bytes."""
    dtype = DTYPES[dname]
    model, ids = build(residual, dtype)
    got = load_file(str(sharded / f"{residual}-{dname}-P{p}.safetensors"))
    with torch.no_grad():
        want = model(ids).logits
        _, cache = prefill(model, ids)
        _, state = model.decode(ids)
    assert_rel_close(got["logits"], want, TOL[dtype], f"{residual} {dname} P={p} logits")
    for layer in range(model.config.n_layers):
        assert_rel_close(got[f"k{layer}"], cache.keys(layer), TOL[dtype], f"keys of layer {layer}")
        assert_rel_close(got[f"v{layer}"], cache.values(layer), TOL[dtype], f"values of layer {layer}")

    from attnres.distributed.sequence_parallel import residual_sources, tensors_nbytes

    sources = residual_sources(model.residual, state)
    full_bytes = tensors_nbytes(sources)
    expected_sources = {"standard": 1, "attnres_block": 2 + 1, "attnres_full": 4 + 1}[residual]
    assert len(sources) == expected_sources
    assert full_bytes == expected_sources * BATCH * SEQ * SHAPE["d_model"] * dtype.itemsize
    per_rank = json.loads((sharded / f"{residual}-{dname}-P{p}.json").read_text())
    assert [start for start, _, _ in per_rank] == [r * SEQ // p for r in range(p)]
    for _, n_sources, nbytes in per_rank:
        assert n_sources == expected_sources
        assert nbytes * p == full_bytes  # N (T/P) d per rank, measured from the tensors held


def test_sharded_prefill_rejects_indivisible_length(sharded):
    """T must split into P equal shards: every rank raises, before any collective."""
    assert "sequence length 10 must be divisible by the number of ranks 4" in (sharded / "indivisible.txt").read_text()


@pytest.mark.parametrize("residual", ["mhc", "denseformer"])
def test_sharded_prefill_names_a_residual_without_described_sources(residual):
    """Hyper-connections' streams and DenseFormer's averages are not the history the prefill
    measures: every rank ran the whole sharded prefill, then stopped on "cannot be cut into
    pipeline stages". Refused before any collective (here no process group exists at all),
    naming the residual and those that work."""
    model, ids = build(residual, torch.float32)
    with pytest.raises(ValueError, match=rf"sharded_prefill: residual '{residual}' does not describe the depth "
                                         r"sources it holds .*use a residual that does \(standard, attnres_block, "
                                         r"attnres_full\)"):
        sharded_prefill(model, ids)


def test_sharded_prefill_of_a_transformers_model_names_what_it_takes():
    """An upcycled transformers model (or an export) given to sharded_prefill stopped in an
    AttributeError ("'AttnResLlamaForCausalLM' object has no attribute 'check_input_ids'"):
    refused before any collective (no process group here), naming what it takes and the way
    from an export of attnres's own model."""
    pytest.importorskip("transformers")
    from fixtures.tiny_families import tiny_model

    from attnres.hf import AttnResForCausalLM
    from attnres.upcycle import upcycle

    model, ids = build("attnres_block", torch.float32)
    for other, name in ((upcycle(tiny_model("llama"), "attnres_block"), "AttnResLlamaForCausalLM"),
                        (AttnResForCausalLM.from_native(model), "AttnResForCausalLM")):
        with pytest.raises(TypeError, match=rf"sharded_prefill takes attnres's own model \(an AttnResLM\); got {name}: an "
                                            r"export of attnres's own model \(AttnResForCausalLM\) is one after "
                                            r"\.to_native\(\), and a transformers family's model \(an upcycle\) runs whole"):
            sharded_prefill(other, ids)


def test_sharded_prefill_on_a_rank_outside_its_group_says_so(monkeypatch):
    """A rank outside ``group`` (torch's get_rank(group) = -1) sliced an empty shard and
    stopped on "torch.cat(): expected a non-empty list of Tensors" after a collective it was
    not part of. It is refused first, naming its rank. Torch's answers for a non-member are
    stubbed (no process group here)."""
    from attnres.distributed import sequence_parallel

    monkeypatch.setattr(sequence_parallel.dist, "get_rank", lambda group=None: 1 if group is None else -1)
    monkeypatch.setattr(sequence_parallel.dist, "get_world_size", lambda group=None: 2 if group is None else -1)
    model, ids = build("attnres_block", torch.float32)
    with pytest.raises(ValueError, match=r"sharded_prefill: this process \(global rank 1\) is not in the group it was "
                                         r"given; call it on the group's ranks only"):
        sharded_prefill(model, ids, group=object())


def test_a_compiled_model_is_taken_and_a_wrapped_one_named_with_its_module(monkeypatch):
    """``sharded_prefill(torch.compile(model), ...)`` ran (the wrapper answers the model's
    attributes) until the check of a transformers model refused it as not an AttnResLM: it
    gets past that check again (here to the group check, torch's answers stubbed). A DDP-style
    wrapper (its ``.module`` the model), which stopped in "no attribute 'check_input_ids'", is
    named with the way to the model it wraps."""
    from torch import nn

    from attnres.distributed import sequence_parallel

    monkeypatch.setattr(sequence_parallel.dist, "get_rank", lambda group=None: 1 if group is None else -1)
    monkeypatch.setattr(sequence_parallel.dist, "get_world_size", lambda group=None: 2 if group is None else -1)
    model, ids = build("attnres_block", torch.float32)
    with pytest.raises(ValueError, match=r"sharded_prefill: this process \(global rank 1\) is not in the group"):
        sharded_prefill(torch.compile(model), ids, group=object())

    class Wrapper(nn.Module):  # (DDP's shape: the model as .module, its attributes not forwarded)
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    with pytest.raises(TypeError, match=r"sharded_prefill takes attnres's own model \(an AttnResLM\); got the Wrapper "
                                        r"wrapper of one: give it Wrapper's \.module \(the AttnResLM it wraps\)"):
        sharded_prefill(Wrapper(model), ids, group=object())


if __name__ == "__main__":
    worker(Path(sys.argv[1]))


def test_the_documented_example_runs_as_written_on_two_ranks(tmp_path):
    """docs/distributed.md's ``python`` block (the section had none to run: only the benchmark,
    which writes into the repository's results), saved as the file its first line names and
    launched as it says: the gathered logits are one process's, the decoding step from the
    sharded cache is the whole sequence's, and each rank holds the embedding and 2 blocks of
    its 32 positions."""
    import re

    from distributed_utils import run_doc_example

    out = run_doc_example("distributed.md", "prefill_example.py",
                          "\nwith torch.no_grad():\n"
                          "    assert torch.allclose(logits, model(prompt).logits, rtol=1e-5, atol=1e-6)\n"
                          "    whole = model(torch.cat([prompt, next_id], 1)).logits[:, -1:]\n"
                          "    assert torch.allclose(step, whole, rtol=1e-5, atol=1e-6)\n"
                          "print(f\"equal to one process on rank {shard.start // 32}\")\n", tmp_path)
    for rank in (0, 1):  # (not anchored to lines: the ranks share one pipe, see test_pipeline's)
        assert re.search(rf"rank {rank}: positions from {32 * rank}, 3 depth sources of 24576 bytes", out), out
        assert f"equal to one process on rank {rank}" in out, out
