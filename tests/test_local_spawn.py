"""``attnres.distributed.local_spawn``: local workers meet on a store served from the launching
process, on a port bound when it was chosen - never on a port found free and bound later by
rank 0, which another process could take in between (the launch then failed by chance)."""

import socket
import subprocess

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


def test_workers_meet_though_another_process_binds_their_port_before_they_start(monkeypatch):
    """Another process binds the port in the workers' environment before the first of them
    starts (seconds before rank 0 has imported torch, on a loaded machine): stood for here by a
    listening socket the test binds as the first worker is spawned. Where the launcher's store
    holds the port, the bind fails and the workers meet on that store; a launch that found a
    port free and left it to rank 0 to bind, whatever its helper is called, fails
    (EADDRINUSE)."""
    taken: list[socket.socket] = []
    spawn = subprocess.Popen

    def take_the_port_then_spawn(*args, **kwargs):
        if not taken:
            other = socket.socket()
            taken.append(other)
            try:
                other.bind(("127.0.0.1", int(kwargs["env"]["MASTER_PORT"])))
                other.listen()
            except OSError:
                pass  # (held by the launcher's store, as it should be)
        return spawn(*args, **kwargs)

    monkeypatch.setattr(local_spawn.subprocess, "Popen", take_the_port_then_spawn)
    try:
        outs = run_local(["-c", WORKER], 2, timeout=120)
    finally:
        for other in taken:
            other.close()
    assert taken, "run_local spawned no worker through subprocess.Popen"
    assert [out.strip().splitlines()[-1] for out in outs] == ["rank 0 of 2: 2", "rank 1 of 2: 2"], outs
