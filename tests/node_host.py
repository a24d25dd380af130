"""``torchrun ... tests/node_host.py HOSTS ARGS...``: ``attnres ARGS`` as if this rank's node
had its own host name, ``HOSTS.split(",")[GROUP_RANK]`` (torchrun's node rank: with one rank
per node, the host of rank r is ``HOSTS[r]``, so ``HOSTS[0]`` is where rank 0 runs).

Two torchrun agents on one host share its name, where a multi-node job has one name per node.
Only ``socket.gethostname`` of this process changes: what attnres records and compares (the
run lock's holder, the ``out_dir`` check's report); the agents, the rendezvous and gloo run on
the real host as they are.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys

if __name__ == "__main__":
    host = sys.argv[1].split(",")[int(os.environ.get("GROUP_RANK", "0"))]
    socket.gethostname = lambda: host
    sys.argv = ["attnres", *sys.argv[2:]]
    runpy.run_module("attnres", run_name="__main__", alter_sys=True)
