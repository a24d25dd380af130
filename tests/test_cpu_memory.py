"""The CPU allocator setting of training (attnres.train.cpu_memory): with ``"retain"`` a
freed block is reused without paging it in again; ``"system"`` leaves glibc as it is; only
the ``attnres`` command applies it, the library never does."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from attnres.train import TrainConfig
from attnres.train.config import RESUMABLE_CHANGES
from attnres.train import cpu_memory
from attnres.train.cpu_memory import CPU_ALLOCATORS, set_cpu_allocator

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="the setting acts on glibc's malloc only")

# malloc, touch and free a 64 MiB block three times; the page faults of each round.
_FAULTS = """
import ctypes, ctypes.util
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def probe():
    faults = []
    for _ in range(3):
        before = cpu_memory.minor_page_faults()
        block = libc.malloc(64 * 2**20)
        ctypes.memset(block, 1, 64 * 2**20)
        libc.free(block)
        faults.append(cpu_memory.minor_page_faults() - before)
    return faults
"""

# In a fresh interpreter (the setting is process-wide and cannot be undone), without torch
# (the module is loaded from its file): the faults of each round after the setting.
_PROBE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("cpu_memory", sys.argv[1])
cpu_memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_memory)
retained = cpu_memory.set_cpu_allocator(sys.argv[2])
""" + _FAULTS + """
print(json.dumps({"retained": retained, "faults": probe()}))
"""


def _probe(kind: str) -> dict:
    module = cpu_memory.__file__
    out = subprocess.run([sys.executable, "-c", _PROBE, module, kind], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_retain_reuses_freed_memory_and_system_pages_it_in_again():
    pages = 64 * 2**20 // 4096
    system, retain = _probe("system"), _probe("retain")
    assert not system["retained"] and retain["retained"]
    assert min(system["faults"]) > pages // 2  # glibc unmaps the block and pages it in again
    assert retain["faults"][0] > pages // 2 and max(retain["faults"][1:]) < pages // 100  # reused as it is


def test_unknown_allocator_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"cpu_allocator must be one of \['retain', 'system'\]; got 'tcmalloc'"):
        set_cpu_allocator("tcmalloc")
    with pytest.raises(ValueError, match="cpu_allocator"):
        TrainConfig(cpu_allocator="tcmalloc")
    assert CPU_ALLOCATORS == ("retain", "system") and TrainConfig().cpu_allocator == "retain"


def test_allocator_changes_no_value_so_a_run_may_resume_with_another():
    assert "cpu_allocator" in RESUMABLE_CHANGES



# In a fresh interpreter: train through the library (attnres.train.train, which builds a
# Trainer) with cpu_allocator=retain, probe the allocator, then train through the command
# (attnres.cli.main) and probe again. Prints each phase's page faults per 64 MiB round.
_LIBRARY_THEN_COMMAND = """
import json, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from attnres.cli import main
from attnres.train import load_config, train
from attnres.train import cpu_memory

root = Path(sys.argv[1])
(root / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
def args(out):
    return [f"data.paths=[{root / 'corpus.txt'}]", "data.tokenizer=byte", "model=tiny", "seq_len=16", "batch_size=2",
            "steps=2", "warmup_steps=1", "eval_every=2", "eval_batches=1", "checkpoint_every=2", "progress=false",
            "tensorboard=false", "device=cpu", "cpu_allocator=retain", f"out_dir={root / out}"]
""" + _FAULTS + """
train(load_config(None, args("library")))
library = {"retained": cpu_memory.retains_freed_memory(), "faults": probe()}
assert main(["train", *args("command")]) == 0
command = {"retained": cpu_memory.retains_freed_memory(), "faults": probe()}
print(json.dumps({"library": library, "command": command}))
"""


@glibc
def test_the_library_leaves_malloc_alone_and_the_command_applies_the_setting(tmp_path):
    """``attnres.train.train`` (building a ``Trainer``) with ``cpu_allocator=retain`` changes
    nothing process-wide: afterwards a freed 64 MiB block is paged in again on every reuse,
    as under glibc's defaults. ``attnres train`` applies the setting to its own process:
    afterwards the block is reused as it is."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {"PYTHONPATH": src, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _LIBRARY_THEN_COMMAND, str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    pages = 64 * 2**20 // 4096
    library, command = result["library"], result["command"]
    assert not library["retained"] and min(library["faults"]) > pages // 2
    assert command["retained"] and max(command["faults"][1:]) < pages // 100


def test_peak_rss_is_in_bytes_on_linux_and_macos(monkeypatch):
    """``ru_maxrss`` is KiB on Linux and bytes on macOS: the parallel-memory benchmark
    multiplied by 1024 everywhere, so on a Mac it reported 1024 times the memory."""
    import resource

    peak = cpu_memory.peak_rss_bytes()
    if Path("/proc/self/status").exists():   # Linux: the kernel's own count of the peak, in kB
        hwm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                   if line.startswith("VmHWM:"))
        assert abs(peak - hwm * 1024) <= 0.05 * peak
    monkeypatch.setattr(sys, "platform", "darwin")
    assert cpu_memory.peak_rss_bytes() == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
