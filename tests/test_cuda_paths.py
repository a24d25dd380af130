"""The code paths only CUDA takes, driven on the CPU: no GPU runs this suite.

``decode="graph"`` (and ``"auto"`` on CUDA) captures the eager decode step in a CUDA graph
and replays it. Here ``attnres.inference.static.cuda_graphs`` says yes on the CPU and the
CUDA calls are faked (:func:`fake_cuda_graphs`): each fake is bound against the real
function's signature first (a wrong name or argument fails here as it would on a GPU), and
the fake graph keeps what a CUDA graph keeps - the operators a capture dispatches, with
their arguments and results (memory addresses, Python numbers baked in) - restores what the
capture wrote (a capture runs no kernel), refuses what a capturing stream refuses (a read
back to the host), and a replay runs those operators again into the same results. So
``stream`` / ``generate`` over the graphed step run here as they run on a GPU: ragged
prompts, sampling, stop tokens and stop strings, against the dynamic cache's tokens.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import TRITON_DEVICE, make_model
from test_static_decode import NOT_CAPTURABLE, assert_freed_with_its_kept_decoder, ragged_prompts
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from attnres.inference import StaticDecoder, generate, prefill, resolve_decode, static
from attnres.ops.depth_attention import library

#: Block AttnRes through its Triton kernels too (the backend CUDA runs), under Triton's
#: interpreter: where the suite runs them on a GPU, the model is not on the CPU the fakes need.
RESIDUALS = ["standard", "attnres_full", "attnres_block",
             pytest.param({"kind": "attnres_block", "backend": "triton"}, id="attnres_block-triton",
                          marks=pytest.mark.skipif(TRITON_DEVICE != "cpu", reason="Triton's interpreter"))]
pytestmark = pytest.mark.usefixtures("one_thread")


def _every_residual():
    """attnres's own variants. (At collection, the registry also holds what other test modules
    registered on import - under xdist, a worker's own mix -, which each test's registry then
    leaves out (registry_isolation): such a parameter failed, "unknown residual".)"""
    from attnres.nn.residual import registered_residuals, residual_class

    return [name for name in registered_residuals() if residual_class(name).builtin()]


def _writes(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors operator ``func`` writes in place (its schema's mutable arguments, ``out=``)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        written += [t for t in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(t, torch.Tensor)]
    return written


class _Capture(TorchDispatchMode):
    """What a CUDA graph records of the operators run inside ``torch.cuda.graph``: each one
    with its arguments and results, for :meth:`replay`; the tensors they write are saved
    first and put back at the end (:meth:`restore`), as a capture writes nothing."""

    def __init__(self):
        super().__init__()
        self.ops, self.saved = [], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func.overloadpacket) in NOT_CAPTURABLE:
            raise RuntimeError(f"{func}: operation not permitted when stream is capturing (a CUDA graph)")
        for t in _writes(func, args, kwargs):
            self.saved.setdefault(id(t), (t, t.clone()))
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def restore(self) -> None:
        for t, before in self.saved.values():
            t.copy_(before)

    def replay(self) -> None:
        """The recorded operators again, on the tensors they read then (their values now),
        each result copied into the tensor the capture made (a view of a tensor is itself)."""
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for old, fresh in zip(tree_leaves(out), tree_leaves(new)):
                if isinstance(old, torch.Tensor) and old.untyped_storage().data_ptr() != fresh.untyped_storage().data_ptr():
                    old.copy_(fresh)


def _bound(real, fake):
    """``fake``, called only with arguments that ``real`` (torch's own) takes."""
    signature = inspect.signature(real)

    def call(*args, **kwargs):
        signature.bind(*args, **kwargs)
        return fake(*args, **kwargs)

    return call


class _Log(list):
    """The captures and replays in order; ``events``: the CUDA events recorded and waited on;
    ``modes``: each capture's ``capture_error_mode``; ``capturing``: the threads capturing now."""

    def __init__(self):
        super().__init__()
        self.events, self.modes, self.capturing = [], [], []


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    """CUDA graphs on the CPU: ``cuda_graphs`` says yes, the CUDA calls the graphed decoder
    makes faked (bound against torch's signatures). Returns the log of captures and replays."""
    log = _Log()

    class Stream:
        def __init__(self, device=None, priority=0, **kwargs):
            pass

        def wait_stream(self, stream):
            pass

        def wait_event(self, event):
            log.events.append(("wait", event))

    class Event:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            self.stream = None

        def record(self, stream=None):
            self.stream = stream
            log.events.append(("record", self))

    streams = threading.local()  # (each thread's current stream: its default, or the innermost torch.cuda.stream's)

    def stack() -> list:
        if not hasattr(streams, "stack"):
            streams.stack = [Stream()]
        return streams.stack

    @contextlib.contextmanager
    def stream_context(stream):
        stack().append(stream or stack()[-1])  # (torch.cuda.stream(None) changes nothing)
        try:
            yield
        finally:
            stack().pop()

    class CUDAGraph:
        def __init__(self, keep_graph=False):
            self.capture = None

        def replay(self):
            log.append("replay")
            # (a replay runs kernels, past autograd's checks: in the mode the capture ran in, the
            # operators writing its own results - inference tensors, if it was in inference mode - may)
            with torch.inference_mode(self.inference), torch.no_grad():  # (inference_mode(False) enables grad)
                self.capture.replay()

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        if log.capturing and stream is None:  # (torch.cuda.graph's default_capture_stream: one for every thread)
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (another thread's "
                               "capture on torch.cuda.graph's default capture stream)")
        log.append("capture")
        log.modes.append(capture_error_mode)
        log.capturing.append(threading.get_ident())
        cuda_graph.capture, cuda_graph.inference = _Capture(), torch.is_inference_mode_enabled()
        try:
            with library.through_dispatcher(), cuda_graph.capture:  # (the kernels as operators the mode sees)
                yield
        finally:
            log.capturing.remove(threading.get_ident())
        cuda_graph.capture.restore()

    real = torch.cuda
    fakes = {"device": _bound(real.device, lambda device: contextlib.nullcontext()),
             "current_stream": _bound(real.current_stream, lambda device=None: stack()[-1]),
             "Stream": Stream, "stream": _bound(real.stream, stream_context),
             "CUDAGraph": CUDAGraph, "graph": _bound(real.graph, graph), "Event": Event}
    for name, value in fakes.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(static, "cuda_graphs", lambda device: True)
    return log


@pytest.mark.parametrize("residual", RESIDUALS)
def test_the_graphed_decoder_replays_the_static_steps_logits(fake_cuda_graphs, residual):
    """``StaticDecoder(mode="graph")``: one capture (after its warm-up steps), then every
    step a replay whose logits are the eager static step's."""
    model = make_model(residual=residual).eval()
    ids, mask = ragged_prompts()
    tokens = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(2))
    got = {}
    for mode in ("eager", "graph"):
        logits, cache = prefill(model, ids, mask)
        decoder = StaticDecoder(model, 3, capacity=7 + 5, mode=mode)
        decoder.load(cache, mask)
        got[mode] = torch.stack([decoder.step(tokens[:, i]).clone() for i in range(5)], dim=1)
        assert decoder.length == 12
    assert fake_cuda_graphs == ["capture"] + ["replay"] * 5
    torch.testing.assert_close(got["graph"], got["eager"], rtol=0, atol=0)
    # (a capture in "global" mode refuses a host sync or allocation in any thread: another thread's
    # generate - each with a decoder of its own - failed, and broke this capture)
    assert fake_cuda_graphs.modes == ["thread_local"]


@pytest.mark.parametrize("residual", RESIDUALS)
def test_generate_over_the_graphed_step_gives_the_dynamic_tokens(fake_cuda_graphs, residual):
    """What ``generate`` does on CUDA by default (``decode="auto"`` is ``"graph"`` there): the
    dynamic cache's tokens for a ragged batch - greedy; sampled with a generator per row;
    ended by a stop token (the rows after it padded, the stream ending when all have); and
    ended by stop strings. One capture for all: the decoder is kept across calls."""
    from test_inference import _AngleTokenizer, _first_holding

    model = make_model(residual=residual).eval()
    assert resolve_decode(model, "auto") == "graph"
    ids, mask = ragged_prompts()

    def both(**kwargs):
        out = {}
        for decode in ("dynamic", "auto"):
            if "generator" in kwargs:
                kwargs["generator"] = [torch.Generator().manual_seed(7 + row) for row in range(3)]
            replays = fake_cuda_graphs.count("replay")
            out[decode] = generate(model, ids, mask, decode=decode, **kwargs)
        assert fake_cuda_graphs.count("replay") > replays, fake_cuda_graphs
        assert torch.equal(out["auto"], out["dynamic"]), (out["auto"], out["dynamic"])
        return out["dynamic"]

    free = both(max_new_tokens=10).tolist()
    both(max_new_tokens=10, temperature=0.9, top_k=50, top_p=0.95, generator="per row")
    stop = free[0][4]  # row 0 ends at its 5th token at the latest, the others where they meet it
    ended = both(max_new_tokens=10, stop_tokens=[stop], pad_token_id=3)
    assert ended[0, :5].tolist() == free[0][:free[0].index(stop) + 1] + [3] * (4 - free[0].index(stop))
    across = f"{free[1][2]:03d}><{free[1][3]:03d}"
    out = both(max_new_tokens=10, stop_strings=[across], tokenizer=_AngleTokenizer, pad_token_id=3)
    needed = _first_holding(free[1], across)
    assert out[1].tolist()[:needed] == free[1][:needed] and set(out[1].tolist()[needed:]) <= {3}
    assert fake_cuda_graphs[0] == "capture" and set(fake_cuda_graphs[1:]) == {"replay"}, fake_cuda_graphs


@pytest.mark.parametrize("residual", _every_residual())
def test_hf_generate_over_the_compiled_static_cache_gives_the_dynamic_tokens(residual):
    """What ``AttnResForCausalLM.generate`` does on CUDA: a ``StaticCache``, whose decode steps
    transformers runs compiled (there Inductor's CUDA graphs; here a quick backend, on the CPU
    as ``CompileConfig._compile_all_devices`` lets it). Through transformers' own loop, every
    decode step one graph with no break (``fullgraph=True``, stricter than transformers
    asks); a ragged batch gets the dynamic cache's tokens - greedy, sampled, ended by an
    end-of-sequence id."""
    pytest.importorskip("transformers")
    from test_static_decode import GraphRecorder, hf_twin
    from transformers import CompileConfig

    hf = hf_twin(make_model(residual=residual).eval())
    ids, mask = ragged_prompts()
    torch._dynamo.reset()
    recorder = GraphRecorder()
    # (a function: the config's deep copy, which transformers compiles with, copies an object)
    compiled = CompileConfig(backend=lambda gm, inputs: recorder(gm, inputs), mode=None, fullgraph=True)
    compiled._compile_all_devices = True  # (transformers compiles on CUDA and a few other devices only)
    free = None
    for sampling in ({"do_sample": False}, {"do_sample": True, "top_k": 20}, {"do_sample": False, "eos_token_id": -1}):
        if sampling.get("eos_token_id") == -1:
            sampling["eos_token_id"] = int(free[0, 3])
        out = {}
        for cache in ("static", "dynamic"):
            torch.manual_seed(3)
            out[cache] = hf.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0, cache_implementation=cache,
                                     **({"compile_config": compiled} if cache == "static" else {}), **sampling)
        assert torch.equal(out["static"], out["dynamic"]), (sampling, out)
        free = out["dynamic"][:, 7:] if free is None else free
    assert recorder.graphs == 1


@pytest.mark.parametrize("built, stepped", [(True, False), (False, True)])
def test_a_graphed_decoder_steps_in_and_out_of_inference_mode(fake_cuda_graphs, built, stepped):
    """A graphed decoder built under ``torch.inference_mode()`` (with the prefill, as a
    server or benchmark sets it up) and stepped outside it - or the other way round - gives
    the eager decoder's tokens: each step copies its tokens into the buffer the graph reads,
    which was an inference tensor when built in that mode ("Inplace update to inference
    tensor outside InferenceMode is not allowed" at the first step)."""
    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    want = generate(model, ids, mask, max_new_tokens=5, decode="static")
    with torch.inference_mode(built):
        logits, cache = prefill(model, ids, mask)
        decoder = StaticDecoder(model, 3, capacity=7 + 4, mode="graph")
    with torch.inference_mode(stepped):
        decoder.load(cache, mask)
        assert torch.equal(decoder.decode(logits.argmax(-1), 4), want[:, 1:])
    assert fake_cuda_graphs == ["capture"] + ["replay"] * 4


@pytest.mark.parametrize("residual", _every_residual())
def test_every_residual_decodes_through_the_graphed_step(fake_cuda_graphs, residual):
    """``generate``'s default on CUDA captures the decode step of whatever residual the model
    has - the baselines too, not only AttnRes: each one's step reads nothing back to the
    host (the capture would refuse it) and replays to the dynamic cache's tokens."""
    model = make_model(residual=residual).eval()
    ids, mask = ragged_prompts()
    want = generate(model, ids, mask, max_new_tokens=6, decode="dynamic")
    assert torch.equal(generate(model, ids, mask, max_new_tokens=6), want)
    assert fake_cuda_graphs == ["capture"] + ["replay"] * 5


@pytest.mark.parametrize("method", ["prompt", "prefix", "lora"])
def test_hf_generate_on_cuda_keeps_the_dynamic_cache_under_peft_prompt_learning(monkeypatch, method):
    """On CUDA ``AttnResForCausalLM.generate`` asks for a static cache; under PEFT's prompt or
    prefix tuning (peft 0.21) that failed in PEFT's inputs ("KeyError: 'cache_position'"; its
    virtual tokens do not fit a cache sized for the prompt either), where the dynamic cache
    generates (test_hf's PEFT tests): prompt learning keeps transformers' default; LoRA, whose
    inputs are the model's own, gets the static cache."""
    peft = pytest.importorskip("peft")
    from test_static_decode import hf_twin
    from transformers import GenerationMixin

    from attnres.hf import AttnResForCausalLM

    config = {"prompt": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
              "prefix": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3),
              "lora": lambda: peft.LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj"])}[method]()
    adapted = peft.get_peft_model(hf_twin(make_model(residual="attnres_block").eval()), config)
    seen = []
    monkeypatch.setattr(GenerationMixin, "generate", lambda self, *a, **k: seen.append(k.get("cache_implementation")))
    monkeypatch.setattr(AttnResForCausalLM, "device", property(lambda self: torch.device("cuda")))
    adapted.generate(input_ids=torch.ones(1, 3, dtype=torch.long), max_new_tokens=2)
    assert seen == [None if method in ("prompt", "prefix") else "static"]


@pytest.mark.slow
def test_compiled_decode_on_cuda_compiles_for_cuda_graphs_and_marks_each_step(monkeypatch):
    """``decode="compiled"`` on CUDA compiles the step with ``mode="reduce-overhead"``
    (Inductor's CUDA graphs; on the CPU Inductor leaves them out) and tells the graphs where
    each step begins - the previous step's logits, read by then, may be overwritten: the
    static step's tokens, a batch of another size too."""
    from attnres.inference import static as static_module

    marks = []
    monkeypatch.setattr(static_module, "cuda_graphs", lambda device: True)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin",
                        _bound(torch.compiler.cudagraph_mark_step_begin, lambda: marks.append(1)))
    queued = []  # (the event a kept decoder's give-back records on CUDA: kept_decoders._steps_queued)
    monkeypatch.setattr(torch.cuda, "Event", lambda: type("Event", (), {"record": lambda self, stream: queued.append(1)})())
    monkeypatch.setattr(torch.cuda, "current_stream", _bound(torch.cuda.current_stream, lambda device=None: None))
    monkeypatch.setattr(static_module, "_COMPILED", {})
    model = make_model(residual="attnres_block", n_layers=2).eval()
    ids, mask = ragged_prompts()
    for rows in (3, 2):
        marks.clear()
        want = generate(model, ids[:rows], mask[:rows], max_new_tokens=5, decode="static")
        assert torch.equal(generate(model, ids[:rows], mask[:rows], max_new_tokens=5, decode="compiled"), want)
        assert len(marks) == 4
    assert list(static_module._COMPILED) == ["reduce-overhead"] and len(queued) == 2


def test_a_cuda_out_of_memory_is_told_in_words():
    """CUDA's caching allocator raises ``torch.OutOfMemoryError`` ("CUDA out of memory. Tried to
    allocate 2.00 GiB. GPU 0 has ..."): training names the device, the allocation and what to
    lower, as for the CPU's (test_first_use)."""
    from attnres.train import TrainConfig
    from attnres.train.loop import out_of_memory

    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                   "79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process "
                                   "has 78.12 GiB memory in use.")
    said = str(out_of_memory(error, TrainConfig(batch_size=8, seq_len=64), torch.device("cuda", 0)))
    assert said.startswith("out of memory on cuda:0: one micro-batch of batch_size 8 x seq_len 64 tokens"), said
    assert "(an allocation of 2,048 MiB failed); lower batch_size" in said, said


def _index(device: int | torch.device | None) -> int:
    """The index of a device as torch.cuda's functions take it (``None``, ``"cuda"``: 0, the current one here)."""
    return device if isinstance(device, int) else (0 if device is None or device.index is None else device.index)


def test_env_names_each_cuda_device_and_the_triton_kernels(monkeypatch, capsys, request):
    """``attnres env`` where CUDA is available (the calls faked, bound against torch's): each
    device by name and compute capability, and the Triton kernels for depth attention - or
    PyTorch where triton is installed but cannot be imported (said "the Triton kernels", from
    triton's installed version alone, while every operator ran PyTorch)."""
    from importlib import metadata

    from attnres.cli import main as cli_main

    names = ["NVIDIA H100 80GB HBM3", "NVIDIA A10"]
    capabilities = [(9, 0), (8, 6)]
    real = torch.cuda
    for name, fake in {"is_available": lambda: True, "device_count": lambda: 2,
                       "get_device_name": lambda device=None: names[_index(device)],
                       "get_device_capability": lambda device=None: capabilities[_index(device)]}.items():
        monkeypatch.setattr(torch.cuda, name, _bound(getattr(real, name), fake))
    impl = library._triton_impl()
    if not isinstance(impl, ImportError):  # (the faked cards' capabilities are not kept for later tests)
        impl.unsupported_gpu.cache_clear()
        request.addfinalizer(impl.unsupported_gpu.cache_clear)
    assert cli_main(["env"]) == 0
    text = capsys.readouterr().out
    assert "; cuda: NVIDIA H100 80GB HBM3 (sm_90), NVIDIA A10 (sm_86)\n" in text, text
    try:
        kernels = f"the Triton kernels (triton {metadata.version('triton')})"
    except metadata.PackageNotFoundError:
        kernels = "PyTorch (triton is not installed: pip install triton)"
    assert f"\n  cuda   {kernels}\n" in text, text
    # triton installed but not importable (broken, or built for another torch): PyTorch runs, and says why
    if kernels.startswith("the Triton kernels"):
        monkeypatch.setattr(library, "_triton_impl", lambda: ImportError("cannot import name 'knobs' from 'triton'"))
        assert cli_main(["env"]) == 0
        said = capsys.readouterr().out
        assert "\n  cuda   PyTorch (triton cannot be imported here: cannot import name 'knobs' from 'triton')\n" in said


@pytest.mark.parametrize("warmup", [0, -1, 1.5, "2"])
def test_a_graphed_decoder_warms_up_at_least_once(fake_cuda_graphs, warmup):
    """``mode="graph"`` runs ``warmup`` eager steps before its capture, where the kernels are
    compiled and their workspaces allocated (a capturing stream refuses both): 0 or a negative
    number captured at once, a float or string failed in ``range``; refused, naming it."""
    model = make_model(residual="attnres_block").eval()
    with pytest.raises(ValueError, match=r"StaticDecoder: warmup \(the eager steps before a CUDA graph's capture\) "
                                         rf"must be an integer >= 1 for mode='graph', got {re.escape(repr(warmup))}"):
        StaticDecoder(model, 1, capacity=8, mode="graph", warmup=warmup)
    assert fake_cuda_graphs == []
    StaticDecoder(model, 1, capacity=8, mode="graph", warmup=1)
    assert fake_cuda_graphs == ["capture"]


def test_a_graphed_decoder_is_reused_across_prompts_and_rewound(fake_cuda_graphs):
    """One graphed decoder for many batches of its size (what a benchmark or server keeps):
    each ``load`` of another prefill, and a ``rewind``, decode what the eager decoder decodes
    - one capture for all, as the weights did not change - and after the weights are replaced
    (``model.to``-style), the next ``load`` captures again."""
    model = make_model(residual="attnres_block").eval()
    graphed, eager = (StaticDecoder(model, 3, capacity=7 + 6, mode=mode) for mode in ("graph", "eager"))
    for seed in (1, 2):
        ids, mask = ragged_prompts(seed=seed)
        logits, cache = prefill(model, ids, mask)
        outs = []
        for decoder in (graphed, eager):
            decoder.load(cache, mask)
            first = decoder.decode(logits.argmax(-1), 5)
            decoder.rewind(7 + 2)
            outs.append(torch.cat([first, decoder.decode(first[:, 2], 3)], dim=1))
        assert torch.equal(outs[0], outs[1])
    assert fake_cuda_graphs.count("capture") == 1
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 2)
    ids, mask = ragged_prompts()
    logits, cache = prefill(model, ids, mask)
    graphed.load(cache, mask)
    eager.load(cache, mask)
    assert fake_cuda_graphs.count("capture") == 2
    assert torch.equal(graphed.decode(logits.argmax(-1), 5), eager.decode(logits.argmax(-1), 5))


def test_a_graphed_decoder_warms_up_on_the_empty_cache(fake_cuda_graphs):
    """A capacity smaller than ``warmup``: the warm-up steps wrote past the cache's end (on
    CUDA a device-side assert, which ends the process's use of the GPU); each now runs on
    the emptied cache, and the decoder decodes as the eager one."""
    model = make_model(residual="attnres_block").eval()
    ids = torch.randint(0, 256, (2, 1), generator=torch.Generator().manual_seed(3))
    logits, cache = prefill(model, ids)
    out = []
    for mode, warmup in (("graph", 4), ("eager", 2)):
        decoder = StaticDecoder(model, 2, capacity=2, mode=mode, warmup=warmup)
        decoder.load(cache)
        out.append(decoder.decode(logits.argmax(-1), 1))
    assert torch.equal(out[0], out[1]) and fake_cuda_graphs == ["capture", "replay"]


def test_a_torchrun_rank_on_cuda_joins_over_nccl_bound_to_its_gpu(monkeypatch):
    """``init_distributed`` on CUDA (torchrun, two ranks; CUDA and the process group faked,
    bound against torch's signatures): rank 1 takes ``cuda:LOCAL_RANK`` as its current
    device and creates the group over NCCL with that ``device_id`` (a communicator bound to
    its GPU), with the timeout asked."""
    from datetime import timedelta

    import torch.distributed as dist

    from attnres.distributed import launch

    made, current = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", _bound(torch.cuda.set_device, current.append))
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(made))
    monkeypatch.setattr(dist, "init_process_group", _bound(dist.init_process_group,
                                                           lambda backend=None, **kwargs: made.append((backend, kwargs))))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(launch.atexit, "register", lambda fn, *args: fn)
    ctx = launch.init_distributed("auto", timeout_s=30.0)
    assert current == [1] and ctx.device == torch.device("cuda", 1) and ctx.backend == "nccl"
    assert made == [("nccl", {"timeout": timedelta(seconds=30.0), "device_id": torch.device("cuda", 1)})]
    assert (ctx.rank, ctx.world_size, ctx.timeout_s) == (1, 2, 30.0)


# -- the decoders generate keeps across calls ---------------------------------------------------


@pytest.fixture
def built(monkeypatch):
    """The :class:`StaticDecoder` s that ``generate`` builds, by ``(batch size, capacity)``."""
    from attnres.inference import kept_decoders

    log = []

    class Counted(StaticDecoder):
        def __init__(self, model, batch_size, capacity=None, mode="graph", warmup=2):
            log.append((batch_size, capacity))
            super().__init__(model, batch_size, capacity, mode, warmup)

    monkeypatch.setattr(kept_decoders, "StaticDecoder", Counted)
    return log


def test_generate_keeps_its_graphed_decoder_across_calls(fake_cuda_graphs, built, monkeypatch):
    """A capture per ``generate`` call (``torch.cuda.graph`` collects Python's garbage and
    empties the CUDA allocator first) cost an evaluation loop more than its short
    generations: the decoder is kept, one per batch size and capacity bucket (here 16
    positions), and every call gives the dynamic cache's tokens - prompts of another length
    or text in the same bucket capture nothing; another batch size or a longer generation
    builds its own."""
    import sys

    monkeypatch.setattr(sys.modules["attnres.inference.generate"], "_CAPACITY_STEP", 16)
    model = make_model(residual="attnres_block").eval()
    calls = [(1, 7, 5), (2, 7, 5), (2, 5, 8), (1, 5, 5), (1, 7, 12)]  # (seed, prompt length, new tokens)
    for seed, t, n in calls:
        ids, mask = ragged_prompts(t=t, seed=seed)
        for rows in (3, 2):
            want = generate(model, ids[:rows], mask[:rows], max_new_tokens=n, decode="dynamic")
            assert torch.equal(generate(model, ids[:rows], mask[:rows], max_new_tokens=n), want), (seed, t, n, rows)
    assert built == [(3, 16), (2, 16), (3, 32), (2, 32)]
    assert fake_cuda_graphs.count("capture") == 4


def test_two_streams_at_once_each_get_a_decoder(fake_cuda_graphs, built):
    """Two streams of one model at one batch size, stepped in turn: a kept decoder serves one
    generation at a time, so while the first holds the one kept from an earlier call the
    second builds its own (each gives its dynamic tokens; lent to both, their steps
    interleaved in one cache), and one is kept after (one per batch size and capacity); a
    stream closed early gives its decoder back too."""
    from attnres.inference import kept_decoders, stream

    model = make_model(residual="attnres_block").eval()
    prompts = [ragged_prompts(seed=seed) for seed in (1, 2)]
    want = [generate(model, ids, mask, max_new_tokens=6, decode="dynamic") for ids, mask in prompts]
    assert torch.equal(generate(model, *prompts[0], max_new_tokens=6), want[0])  # (a decoder kept: one to lend)
    assert len(built) == 1
    streams = [stream(model, ids, mask, max_new_tokens=6) for ids, mask in prompts]
    got = [[], []]
    for _ in range(6):
        for i, s in enumerate(streams):
            got[i].append(next(s))
    for i in range(2):
        assert torch.equal(torch.stack(got[i], dim=1), want[i])
        assert next(streams[i], None) is None
    assert len(built) == 2 and len(vars(model)[kept_decoders._ATTRIBUTE].idle) == 1
    early = stream(model, *prompts[0], max_new_tokens=6)
    next(early), next(early)
    early.close()
    assert torch.equal(generate(model, *prompts[1], max_new_tokens=6), want[1])
    assert len(built) == 2 and fake_cuda_graphs.count("capture") == 2


def test_kept_decoders_follow_the_model_and_are_released(fake_cuda_graphs, built):
    """A model cast to another dtype drops the decoders of the old one (a cache of the old
    dtype) and builds new ones; under autocast a graph of its own (a capture records the
    casts); ``release_decoders`` frees them (how many it freed), and the next call builds
    again, and refuses a wrapper of the model (DDP's: it freed nothing) or another object; a
    copy or pickle of the model takes none (a CUDA graph can be neither)."""
    import copy
    import io

    from attnres.inference import kept_decoders, release_decoders

    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    generate(model, ids, mask, max_new_tokens=4)
    generate(model, ids, mask, max_new_tokens=4)
    assert len(built) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        generate(model, ids, mask, max_new_tokens=4)
    assert len(built) == 2 and len(vars(model)[kept_decoders._ATTRIBUTE].idle) == 2
    for twin in (copy.deepcopy(model), torch.load(_saved(model, io.BytesIO()), weights_only=False)):
        assert release_decoders(twin) == 0
        assert torch.equal(generate(twin, ids, mask, max_new_tokens=4), generate(model, ids, mask, max_new_tokens=4))
    model.double()
    want = generate(model, ids, mask, max_new_tokens=4, decode="dynamic")
    assert torch.equal(generate(model, ids, mask, max_new_tokens=4), want)
    assert len(vars(model)[kept_decoders._ATTRIBUTE].idle) == 1  # (the float32 ones dropped)
    assert release_decoders(torch.compile(model)) == 1 and release_decoders(model) == 0
    wrapper = torch.nn.Module()  # (a DDP or FSDP wrapper: the model is its .module)
    wrapper.module = model
    with pytest.raises(TypeError, match=r"release_decoders takes attnres's own model .*got the Module wrapper of one: "
                                        r"give it Module's .module"):
        release_decoders(wrapper)
    with pytest.raises(TypeError, match=r"release_decoders takes attnres's own model \(an AttnResLM\); got NoneType"):
        release_decoders(None)
    generate(model, ids, mask, max_new_tokens=4)
    assert built[-1] == built[-2] == (3, 128) and len(built) == 6


def _saved(model, buffer):
    torch.save(model, buffer)
    buffer.seek(0)
    return buffer


def test_kept_decoders_make_way_for_a_new_one(fake_cuda_graphs, built, monkeypatch):
    """At most ``KEPT_PER_MODEL`` decoders are kept (the least recently used goes first); a
    new decoder that runs out of memory beside kept ones frees them and is built again, once
    what the failed build allocated is freed (a retry inside the ``except`` clause ran with the
    error's traceback holding it)."""
    import weakref

    from attnres.inference import kept_decoders

    monkeypatch.setattr(kept_decoders, "KEPT_PER_MODEL", 2)
    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    for rows in (3, 2, 1, 3, 1, 2):
        generate(model, ids[:rows], mask[:rows], max_new_tokens=3)
    assert [rows for rows, _ in built] == [3, 2, 1, 3, 2]
    counted, allocated = kept_decoders.StaticDecoder, []

    def short_of_memory(*args, **kwargs):
        buffer = torch.empty(8)  # (what the failed build allocated before it ran out)
        allocated.append(weakref.ref(buffer))
        monkeypatch.setattr(kept_decoders, "StaticDecoder", built_again)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    def built_again(*args, **kwargs):
        assert allocated[0]() is None, "the failed build's memory is held through the retry"
        return counted(*args, **kwargs)

    monkeypatch.setattr(kept_decoders, "StaticDecoder", short_of_memory)
    want = generate(model, ids, mask, max_new_tokens=3, decode="dynamic").tolist()
    assert generate(model, ids, mask, max_new_tokens=3).tolist() == want
    assert list(vars(model)[kept_decoders._ATTRIBUTE].idle) and len(built) == 6


def test_a_graph_kept_from_an_autocast_block_casts_the_weights_of_each_step(fake_cuda_graphs):
    """A graph captured under ``torch.autocast`` and kept for a later call: a capture that
    read autocast's cache of cast weights recorded no cast, only the cached copies, which
    autocast frees when its block ends (on a GPU the next call's replays read freed memory;
    here the copies of the capture's time: the weights updated in place since were not
    seen, the tokens were the old weights'). The capture casts without that cache."""
    model = make_model(residual="attnres_block").eval()
    other = dict(make_model(residual="attnres_block", seed=5).named_parameters())
    ids, mask = ragged_prompts()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        generate(model, ids, mask, max_new_tokens=6)
    with torch.no_grad():  # (the AttnRes queries left alone: new folded queries capture again)
        for name, p in model.named_parameters():
            if not name.startswith("residual."):
                p.copy_(other[name])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = generate(model, ids, mask, max_new_tokens=6, decode="dynamic")
        assert torch.equal(generate(model, ids, mask, max_new_tokens=6), want)
    assert fake_cuda_graphs.count("capture") == 1


def test_a_model_with_kept_decoders_is_freed_when_its_last_reference_goes(fake_cuda_graphs):
    """``del model`` frees the model and its kept decoders (their caches and graphs) at
    once, as it frees a model that never generated: a kept decoder that held its model made
    a cycle through the model's ``__dict__``, which only the garbage collector freed (GPU
    memory held until a collection). A decoder lent out again decodes with the model."""
    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    want = generate(model, ids, mask, max_new_tokens=4, decode="dynamic")
    for _ in range(2):
        assert torch.equal(generate(model, ids, mask, max_new_tokens=4), want)
    holder = [model]
    del model
    assert_freed_with_its_kept_decoder(holder)


def test_a_decoder_interrupted_mid_step_is_not_kept(fake_cuda_graphs, built, monkeypatch):
    """A ``KeyboardInterrupt`` (or any error) inside a step leaves the decoder mid-step:
    it is dropped, not kept, and the next call builds another that gives the dynamic
    tokens; an error of the caller's between steps (the stream then closed) keeps it."""
    from attnres.inference import stream

    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    want = generate(model, ids, mask, max_new_tokens=6, decode="dynamic")
    step = StaticDecoder.step

    def interrupted(self, tokens):
        step(self, tokens)
        raise KeyboardInterrupt

    monkeypatch.setattr(StaticDecoder, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        generate(model, ids, mask, max_new_tokens=6)
    monkeypatch.setattr(StaticDecoder, "step", step)
    assert torch.equal(generate(model, ids, mask, max_new_tokens=6), want) and len(built) == 2
    with pytest.raises(ZeroDivisionError):
        for i, _ in enumerate(stream(model, ids, mask, max_new_tokens=6)):
            i / (2 - i)
    assert torch.equal(generate(model, ids, mask, max_new_tokens=6), want) and len(built) == 2


def test_a_kept_graph_follows_the_models_weights(fake_cuda_graphs):
    """The kept graph of a model whose weights were replaced (``load_state_dict(...,
    assign=True)``: new addresses), whose AttnRes queries were updated in place (new folded
    queries), or that was trained and put back in eval mode: every call gives the dynamic
    tokens of the weights it has then."""
    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()

    def same_tokens():
        want = generate(model, ids, mask, max_new_tokens=6, decode="dynamic")
        assert torch.equal(generate(model, ids, mask, max_new_tokens=6), want)

    same_tokens()
    model.load_state_dict(make_model(residual="attnres_block", seed=3).state_dict(), assign=True)
    same_tokens()
    with torch.no_grad():
        model.residual.mixers[1].query.mul_(-2)
    same_tokens()
    model.train()
    with torch.no_grad():
        model.lm_head.weight.data *= 1.5
    model.eval()
    same_tokens()
    # (new addresses only: new folded queries of the same parameters - after an in-place update, or train() and
    # eval(), which drop them - are copied into those the graph reads)
    assert fake_cuda_graphs.count("capture") == 2


def test_a_stream_collected_under_the_kept_decoders_lock_gives_its_decoder_back(fake_cuda_graphs, built, monkeypatch):
    """An abandoned stream in a reference cycle is closed by the garbage collector, which
    runs at whatever allocation comes next - in the thread that holds the kept decoders'
    lock, too: its give-back waited for that lock, which the same thread held (the thread,
    and every later generate of the process, hung). A give-back takes no lock; the decoder
    is kept at the next borrow."""
    import gc

    from attnres.inference import kept_decoders, stream

    monkeypatch.setattr(kept_decoders, "_LOCK", threading.Lock())  # (a hang holds this one only)
    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    want = generate(model, ids, mask, max_new_tokens=6, decode="dynamic")
    abandoned = stream(model, ids, mask, max_new_tokens=6)
    next(abandoned)
    cycle = [abandoned]
    cycle.append(cycle)
    del abandoned, cycle
    kept = kept_decoders._kept

    def collecting(owner):  # (under the lock: a collection an allocation there would start)
        gc.collect()
        return kept(owner)

    monkeypatch.setattr(kept_decoders, "_kept", collecting)
    got = []
    worker = threading.Thread(target=lambda: got.append(generate(model, ids, mask, max_new_tokens=6)), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert got and torch.equal(got[0], want)
    assert len(built) == 1  # (the abandoned stream's decoder, given back during the collection)


def test_a_decoder_given_back_mid_stream_is_waited_for_on_the_next_borrowers_cuda_stream(fake_cuda_graphs):
    """A stream closed early gives its decoder back with its next step queued on the GPU; a
    borrower on another CUDA stream (another thread's) would load the cache that step still
    reads. The give-back records an event after the queued steps, and the next borrow waits
    on it on its current stream, before loading; tokens as the dynamic cache's."""
    from attnres.inference import stream

    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    early = stream(model, ids, mask, max_new_tokens=6)
    next(early), next(early)
    early.close()
    [(what, given_back)] = fake_cuda_graphs.events
    assert what == "record"
    want = generate(model, ids, mask, max_new_tokens=6, decode="dynamic")
    assert torch.equal(generate(model, ids, mask, max_new_tokens=6), want)
    assert fake_cuda_graphs.events[1] == ("wait", given_back) and fake_cuda_graphs.events[2][0] == "record"
    assert fake_cuda_graphs.count("capture") == 1


def test_two_threads_capturing_at_once_take_turns(fake_cuda_graphs, monkeypatch):
    """Two threads building a graphed decoder at once (a server's generates of two batch
    sizes): ``torch.cuda.graph`` captures on one side stream shared by every thread, so the
    second capture began on the stream the first was capturing - the ``"thread_local"``
    capture mode no longer stopped it at its device sync - and failed, the first with it.
    Captures take turns (the first held in its capture until the second is at its own);
    both decoders replay the eager step's logits."""
    model = make_model(residual="attnres_block").eval()
    real_step, real_graph = static.static_decode_step, torch.cuda.CUDAGraph
    first_capturing, second_at_capture, errors, decoders = threading.Event(), threading.Event(), [], {}

    def step(*args):
        if fake_cuda_graphs.capturing and not first_capturing.is_set():
            first_capturing.set()
            second_at_capture.wait(timeout=30)
            time.sleep(0.2)  # (the second thread, unheld, enters its capture meanwhile)
        return real_step(*args)

    def graph(*args, **kwargs):
        if first_capturing.is_set():
            second_at_capture.set()
        return real_graph(*args, **kwargs)

    def build(b):
        try:
            decoders[b] = StaticDecoder(model, b, capacity=7 + 3, mode="graph")
        except RuntimeError as e:
            errors.append(e)

    monkeypatch.setattr(static, "static_decode_step", step)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", graph)
    first = threading.Thread(target=build, args=(3,))
    first.start()
    assert first_capturing.wait(timeout=30)
    second = threading.Thread(target=build, args=(2,))
    second.start()
    first.join(timeout=60), second.join(timeout=60)
    assert not errors and sorted(decoders) == [2, 3] and fake_cuda_graphs.count("capture") == 2
    for b, graphed in decoders.items():
        ids, mask = (t[:b] for t in ragged_prompts())
        eager = StaticDecoder(model, b, capacity=7 + 3, mode="eager")
        logits, cache = prefill(model, ids, mask)
        graphed.load(cache, mask), eager.load(cache, mask)
        assert torch.equal(graphed.decode(logits.argmax(-1), 3), eager.decode(logits.argmax(-1), 3))


def test_a_decoder_given_back_from_another_cuda_stream_records_its_event_on_its_steps_stream(fake_cuda_graphs):
    """A stream in a reference cycle is closed by the garbage collector in whatever thread
    and CUDA stream context it runs - another thread's stream, or a capture's, where the
    event recorded into the graph failed the next borrower's wait. The give-back's event is
    recorded on the stream the decoder's steps ran on (the one current at its load)."""
    from attnres.inference import stream

    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    early = stream(model, ids, mask, max_new_tokens=6)
    next(early), next(early)
    steps_stream = torch.cuda.current_stream()
    with torch.cuda.stream(torch.cuda.Stream()):  # (where the collection ran)
        early.close()
    [(what, given_back)] = fake_cuda_graphs.events
    assert what == "record" and given_back.stream is steps_stream


def test_an_optimizer_step_during_a_capture_leaves_no_folded_queries_made_in_it(fake_cuda_graphs, monkeypatch):
    """An optimizer step in another thread (a model trained beside one that generates) while a
    decoder captures its graph: the capture built new folded queries, and the residual kept
    them - on a GPU never computed outside a replay (a capture runs no kernel), so the model's
    next eager forward read whatever that memory held. The residual keeps none made in the
    capture; the graph, which builds its own at each replay, and the eager step agree."""
    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    other_step = torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1)  # (no gradients: counted, nothing run)
    real_step = static.static_decode_step

    def step(*args):
        if fake_cuda_graphs.capturing:  # (the other thread's step, taken meanwhile)
            other_step.step()
        return real_step(*args)

    monkeypatch.setattr(static, "static_decode_step", step)
    decoder = StaticDecoder(model, 3, capacity=7 + 3, mode="graph")
    made = {t.untyped_storage().data_ptr() for *_, out in decoder._graph.capture.ops for t in tree_leaves(out)
            if isinstance(t, torch.Tensor)}
    with torch.no_grad():
        kept = model.residual.folded_queries(model.embed_tokens.weight.dtype)
    assert kept.untyped_storage().data_ptr() not in made
    monkeypatch.setattr(static, "static_decode_step", real_step)
    tokens = torch.randint(0, 256, (3, 3), generator=torch.Generator().manual_seed(2))
    got = {}
    for mode, built in (("graph", decoder), ("eager", StaticDecoder(model, 3, capacity=7 + 3, mode="eager"))):
        built.load(prefill(model, ids, mask)[1], mask)
        got[mode] = torch.stack([built.step(tokens[:, i]).clone() for i in range(3)], dim=1)
    torch.testing.assert_close(got["graph"], got["eager"], rtol=0, atol=0)
    assert fake_cuda_graphs.count("capture") == 1


def test_a_prefill_out_of_memory_frees_the_kept_decoders_and_runs_again(fake_cuda_graphs, monkeypatch):
    """The kept decoders' caches are GPU memory a generation of another shape cannot use: a
    prefill that runs out of memory beside them frees them and runs again (the tokens as the
    dynamic cache's); with none kept, the error is the caller's as it was."""
    import sys

    from attnres.inference import kept_decoders

    generate_module = sys.modules["attnres.inference.generate"]
    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    want = generate(model, ids, mask, max_new_tokens=3, decode="dynamic")
    generate(model, ids, mask, max_new_tokens=3)
    assert len(vars(model)[kept_decoders._ATTRIBUTE].idle) == 1
    real, failures = generate_module.prefill, []

    def short_of_memory(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return real(*args, **kwargs)

    monkeypatch.setattr(generate_module, "prefill", short_of_memory)
    assert torch.equal(generate(model, ids[:2], mask[:2], max_new_tokens=3), want[:2])
    assert failures == [1] and fake_cuda_graphs.count("capture") == 2
    assert len(vars(model)[kept_decoders._ATTRIBUTE].idle) == 1  # (the batch of 2's; the batch of 3's freed)
    failures.clear()
    with pytest.raises(torch.OutOfMemoryError):
        kept_decoders.freeing_kept_on_oom(make_model(residual="standard"), short_of_memory)


def test_a_graphed_decoder_is_not_captured_again_after_another_models_optimizer_step(fake_cuda_graphs):
    """The kept folded queries are keyed by the optimizer steps taken in the process (a fused
    step bumps no version counter), so a step of another model's optimizer - a student or
    reward model trained beside a graphed AttnRes model that generates - gave new ones, and the
    kept decoder captured its graph again at each load. Now their values are copied into the
    tensor the graph reads: one capture, and after the model's own fused step (its queries
    changed in place) the replay still gives the eager step's logits."""
    model = make_model(residual="attnres_block").eval()
    ids, mask = ragged_prompts()
    other = torch.nn.Linear(4, 4)
    other_step = torch.optim.SGD(other.parameters(), lr=0.1)
    decoder = StaticDecoder(model, 3, capacity=7 + 3, mode="graph")
    for _ in range(2):
        decoder.load(prefill(model, ids, mask)[1], mask)
        other(torch.ones(1, 4)).sum().backward()
        other_step.step()
    assert fake_cuda_graphs.count("capture") == 1
    _after_a_fused_step_the_replay_is_the_eager_step(model, decoder, fake_cuda_graphs)


def test_a_graphed_decoder_built_in_inference_mode_takes_new_folded_queries_outside_it(fake_cuda_graphs):
    """A graphed decoder built under ``torch.inference_mode()`` (a server's setup) and loaded
    outside it after an optimizer step gave new folded queries: they are copied into the
    ones its graph reads, in place - which an inference tensor would refuse outside that
    mode; the residual makes its kept queries outside it - and the replay gives the eager
    step's logits, with no capture again."""
    model = make_model(residual="attnres_block").eval()
    with torch.inference_mode():
        decoder = StaticDecoder(model, 3, capacity=7 + 3, mode="graph")
    _after_a_fused_step_the_replay_is_the_eager_step(model, decoder, fake_cuda_graphs)


def test_a_graphed_decoder_of_a_model_built_in_inference_mode_decodes_in_and_out_of_it(fake_cuda_graphs):
    """A model built under ``torch.inference_mode()`` (its parameters inference tensors, which
    track no version: the residual keeps no folded queries for it, but stacks them in each
    forward) and its graphed decoder built there too: loaded outside the mode, the decoder
    copied the queries stacked then into the ones it captured - an inference tensor, refused
    outside the mode ("Inplace update to inference tensor outside InferenceMode"). Decoding in
    and then out of the mode gives the eager step's logits, with one capture."""
    ids, mask = ragged_prompts()
    tokens = torch.randint(0, 256, (3, 3), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        model = make_model(residual="attnres_block").eval()
        decoder = StaticDecoder(model, 3, capacity=7 + 3, mode="graph")
        eager = StaticDecoder(model, 3, capacity=7 + 3, mode="eager")
    for inside in (True, False):
        got = {}
        with torch.inference_mode(inside):
            for mode, built in (("graph", decoder), ("eager", eager)):
                built.load(prefill(model, ids, mask)[1], mask)
                got[mode] = torch.stack([built.step(tokens[:, i]).clone() for i in range(3)], dim=1)
        torch.testing.assert_close(got["graph"], got["eager"], rtol=0, atol=0)
    assert fake_cuda_graphs.count("capture") == 1


def _after_a_fused_step_the_replay_is_the_eager_step(model, decoder: StaticDecoder, log: list) -> None:
    """A fused AdamW step of ``model``'s residual (in place, its version counters unchanged),
    then ``decoder`` (graphed, batch 3, capacity 10) and an eager decoder each loaded with a
    prefill of :func:`ragged_prompts`: the same logits for three steps, and no capture again."""
    ids, mask = ragged_prompts()
    own = torch.optim.AdamW(model.residual.parameters(), lr=0.1, fused=True)
    model.residual.mixers[1].query.grad = torch.ones_like(model.residual.mixers[1].query)
    own.step()
    tokens = torch.randint(0, 256, (3, 3), generator=torch.Generator().manual_seed(2))
    got = {}
    for mode, built in (("graph", decoder), ("eager", StaticDecoder(model, 3, capacity=7 + 3, mode="eager"))):
        built.load(prefill(model, ids, mask)[1], mask)
        got[mode] = torch.stack([built.step(tokens[:, i]).clone() for i in range(3)], dim=1)
    assert log.count("capture") == 1
    torch.testing.assert_close(got["graph"], got["eager"], rtol=0, atol=0)


@pytest.mark.parametrize("device, interpreted, triton, reason", [
    ("cuda", False, False, "triton cannot be imported here: No module named 'triton'"),
    ("cpu", False, True, "the Triton kernels run on CUDA GPUs, and the device is cpu"),
    ("cpu", True, False, "triton cannot be imported here"),
])
def test_a_run_with_the_triton_backend_is_refused_where_its_kernels_cannot_run(monkeypatch, device, interpreted,
                                                                                triton, reason):
    """`model.residual.backend=triton` was refused before any work off a GPU only: on a CUDA
    machine without triton the run read its data and built its model, and its first forward
    failed with a traceback. Both are refused at the start, saying what to use instead; a GPU
    with triton passes."""
    from attnres.train import load_config
    from attnres.train.loop import check_backend

    if interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gone = ImportError("No module named 'triton'")
    importable = SimpleNamespace(unsupported_gpu=lambda device: None)  # (triton_impl on a card it compiles for)
    monkeypatch.setattr(library, "_triton_impl", lambda: importable if triton else gone)
    config = load_config(None, ["model.residual.backend=triton"])
    with pytest.raises(ValueError, match=rf"^model.residual.backend='triton' cannot run here: {reason}.*; use "
                                         r"backend='auto' \(the C kernel on the CPU, the Triton kernels on CUDA where "
                                         r"triton is installed, else PyTorch\) or 'torch'$"):
        check_backend(config, torch.device(device))
    monkeypatch.setattr(library, "_triton_impl", lambda: importable)
    check_backend(config, torch.device("cuda"))  # (a GPU with triton)
    check_backend(load_config(None, ["model.residual.backend=auto"]), torch.device(device))
