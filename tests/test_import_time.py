"""What ``import attnres`` does: registers the ops and nothing more. It reads no installed
distribution (the name-clash check is the ``attnres`` command's) and imports neither
``torch._dynamo`` nor Triton (together longer than torch's own import), not even when a model
is built and run eagerly; both come when something compiles."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Wraps every importlib.metadata entry point that reads the installed distributions, so that
#: the script can say whether anything did. torch is imported first: its own import reads
#: versions (optree's) that are none of attnres's doing.
_COUNT_METADATA_READS = """
import importlib.metadata as metadata
import json
import sys

import pytest

import torch

reads = []


def counted(owner, name):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        reads.append(name)
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


for name in ("distributions", "distribution", "packages_distributions", "version", "metadata", "files"):
    counted(metadata, name)
counted(metadata.Distribution, "discover")
counted(metadata.Distribution, "from_name")
"""


def _run(script: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _COUNT_METADATA_READS + script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _loaded(modules: tuple[str, ...] = ("torch._dynamo", "triton")) -> str:
    return f"sorted(m for m in {modules!r} if m in sys.modules)"


def test_import_attnres_reads_no_distributions_and_imports_no_dynamo_or_triton():
    result = _run(f"""
import attnres
after_import = {{"reads": list(reads), "modules": {_loaded()}}}
import torch
from attnres import AttnResLM, ModelConfig
model = AttnResLM(ModelConfig.preset("tiny", residual="attnres_block"))
logits = model(torch.randint(0, 256, (1, 8))).logits
try:
    model(torch.tensor([[256]]))  # the input check (eager under torch.compile) still runs
    refused = False
except ValueError:
    refused = True
print(json.dumps({{"import": after_import, "model": {{"reads": list(reads), "modules": {_loaded()},
                  "shape": list(logits.shape), "refused": refused}}}}))
""")
    assert result["import"] == {"reads": [], "modules": []}
    assert result["model"] == {"reads": [], "modules": [], "shape": [1, 8, 256], "refused": True}


def test_the_command_still_checks_for_a_name_clash(tmp_path):
    """The scan moved out of ``import attnres`` into the command: it runs once the command
    line is parsed (``--version`` and ``--help`` end before it)."""
    result = _run(f"""
from attnres.cli import main
try:
    main(["--version"])
except SystemExit:
    pass
version = list(reads)
try:
    main(["generate", "--checkpoint", {str(tmp_path / "missing")!r}, "--prompt", "x"])
except SystemExit:
    pass
print(json.dumps({{"version": version, "command": "packages_distributions" in reads}}))
""")
    assert result == {"version": [], "command": True}


def test_the_launcher_and_the_parallel_config_import_no_pipelining_or_dtensor():
    """``attnres.distributed`` imports each public name's module on first use: the launcher and
    ``ParallelConfig`` (what ``attnres train`` needs before a rank builds its model) leave
    pipeline parallelism and FSDP2 (``torch.distributed.pipelining``, DTensor and with them
    TorchDynamo) unimported, and every name still imports from the package."""
    heavy = ("torch.distributed.pipelining", "torch.distributed.tensor", "torch._dynamo")
    result = _run(f"""
from attnres.distributed import ParallelConfig, process_context
light = {_loaded(heavy)}
import attnres.distributed as package
names = {{name: getattr(package, name).__module__ for name in package.__all__ if name not in ("PP_SCHEDULES", "SCHEDULES")}}
print(json.dumps({{"light": light, "heavy": {_loaded(heavy)}, "names": names}}))
""")
    assert result["light"] == [] and result["heavy"] == sorted(heavy)
    assert len(result["names"]) == 26 and result["names"]["PipelineRunner"] == "attnres.distributed.pipeline"
    assert all(module.startswith("attnres.distributed.") for module in result["names"].values()), result["names"]


def test_the_trainer_imports_no_pipelining_dtensor_or_dynamo():
    """``attnres.train`` imported pipeline parallelism's and DTensor's modules (and TorchDynamo
    with them: 1.7 CPU s of 1.9) for every command and rank that imports it - ``attnres
    status``, a config error's answer, ``attnres compare --report-only``: they come where a run
    builds pipeline stages or shards (DTensor is checked for without importing it), or where
    torch's optimiser imports TorchDynamo itself."""
    heavy = ("torch.distributed.pipelining", "torch.distributed.tensor", "torch._dynamo")
    result = _run(f"""
import attnres.cli, attnres.train, attnres.train.loop, attnres.train.status, attnres.distributed.mesh_model
import torch
from attnres.distributed.data_parallel import full_tensor
from attnres.distributed.grads import global_grad_norm
p = torch.nn.Parameter(torch.ones(3))
p.grad = torch.full((3,), 2.0)
norm = float(global_grad_norm([p]))
same = full_tensor(p.grad) is p.grad
print(json.dumps({{"loaded": {_loaded(heavy)}, "norm": norm, "same": same}}))
""")
    assert result == {"loaded": [], "norm": pytest.approx(12 ** 0.5), "same": True}
