"""The CPU allocator setting of training (attnres.train.cpu_memory): with ``"retain"`` a
freed block is reused without paging it in again; ``"system"`` leaves glibc as it is."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from attnres.train import TrainConfig
from attnres.train.config import RESUMABLE_CHANGES
from attnres.train import cpu_memory
from attnres.train.cpu_memory import CPU_ALLOCATORS, set_cpu_allocator

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="the setting acts on glibc's malloc only")

# In a fresh interpreter (the setting is process-wide and cannot be undone), without torch
# (the module is loaded from its file): malloc, touch and free a 64 MiB block three times,
# and print the page faults of each round.
_PROBE = """
import ctypes, ctypes.util, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("cpu_memory", sys.argv[1])
cpu_memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_memory)
retained = cpu_memory.set_cpu_allocator(sys.argv[2])
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for _ in range(3):
    before = cpu_memory.minor_page_faults()
    block = libc.malloc(64 * 2**20)
    ctypes.memset(block, 1, 64 * 2**20)
    libc.free(block)
    faults.append(cpu_memory.minor_page_faults() - before)
print(json.dumps({"retained": retained, "faults": faults}))
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

