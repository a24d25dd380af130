"""``attnres.distributed.local_spawn``: local workers meet on a store served from the launching
process, on a port bound when it was chosen - never on a port found free and bound later by
rank 0, which another process could take in between (the launch then failed by chance)."""

import socket

import pytest

from attnres.distributed import local_spawn
from attnres.distributed.local_spawn import run_local

#: A worker: joins the group from torchrun's environment and sums its rank's 1 over the group.
WORKER = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {t.item():.0f}")
dist.destroy_process_group()
"""


def test_the_port_given_to_the_workers_is_held_from_the_moment_it_is_chosen():
    with local_spawn.rendezvous_env() as env:
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", int(env["MASTER_PORT"])))


def test_workers_meet_though_a_port_found_free_is_taken_before_they_start(monkeypatch):
    """Another process binds the port a launch found free before its rank 0 has imported torch
    (seconds on a loaded machine): stood for here by a listening socket on the port the launch
    used to find free (``free_port``). The workers still meet and sum over the group."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(local_spawn, "free_port", lambda: taken.getsockname()[1], raising=False)
        outs = run_local(["-c", WORKER], 2, timeout=120)
    assert [out.strip().splitlines()[-1] for out in outs] == ["rank 0 of 2: 2", "rank 1 of 2: 2"], outs
