"""Shared helpers for the test suite."""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
from pathlib import Path

import pytest

# The studies beside the package (``studies/``) are imported from the repository root, as
# ``python -m studies.NAME`` runs them from a clone (tests/studies/). A conftest of their own
# would shadow this one: the tests import its helpers as ``conftest``.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

# Inductor's on-disk cache does not key its C++ code on ATEN_CPU_CAPABILITY: code generated
# for one vector width (AVX-512: 16 floats) and reused under another (AVX2: 8), or the other
# way round, reads and writes past its buffers - NaN logits, a corrupted heap. Runs that set
# the variable get a cache of their own.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}")

# The same examples on every run unless ATTNRES_HYPOTHESIS=explore (tests/hypothesis_profiles.py).
# The serving suite's environment (make test-serve) has no hypothesis, and no property tests.
try:
    import hypothesis_profiles  # noqa: E402
except ModuleNotFoundError as missing:
    if missing.name != "hypothesis":
        raise
else:
    hypothesis_profiles.load()

import torch  # noqa: E402 (importing torch does not import triton; importing torch._dynamo does)

# `make test` runs the suite in one process per core (pytest-xdist): each takes its share of
# the cores for its own threads, not all of them (oversubscribed, tiny ops wait on each other).
# The processes its tests start (the command, README blocks, the GPU check's smoke run) take
# the same share, unless the caller set one: each of them would otherwise start a thread per
# core beside the other workers.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_share)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))


def _triton_device() -> str | None:
    """Where the Triton implementation is tested: ``"cuda"`` (the kernels compiled for the
    GPU) where CUDA is available, else ``"cpu"`` (Triton's interpreter). ``ATTNRES_GPU_TESTS=0``
    or ``TRITON_INTERPRET=1`` force the interpreter; ``ATTNRES_GPU_TESTS=1`` asks for the GPU
    (``None`` without one: the Triton tests skip)."""
    gpu = os.environ.get("ATTNRES_GPU_TESTS", "")
    if gpu == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    return None if gpu else "cpu"


#: The device the Triton tests put their tensors on (``None``: skip them).
TRITON_DEVICE = _triton_device()
# The interpreter must be switched on before triton is first imported (importing attnres
# imports torch._dynamo, which imports triton when it is installed).
if TRITON_DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
    from triton_interpreter import spare_repeated_patching

    spare_repeated_patching()  # (about half of each interpreted test's time)


def triton_device() -> str:
    """:data:`TRITON_DEVICE`, skipping the calling test where there is none (or no triton)."""
    pytest.importorskip("triton")
    if TRITON_DEVICE is None:
        pytest.skip("ATTNRES_GPU_TESTS=1, but no CUDA device")
    return TRITON_DEVICE


def to_triton_device(x):
    """Tensors (in lists, tuples) moved to :data:`TRITON_DEVICE` - differentiably, so that
    gradients come back to the CPU leaves."""
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to(TRITON_DEVICE), x)


def to_cpu(x):
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.cpu(), x)


from attnres import AttnResLM, ModelConfig  # noqa: E402
from registry_isolation import _residual_registry_of_this_module  # noqa: E402, F401 (an autouse fixture)
from cpu_times import (pytest_addoption, pytest_configure, pytest_runtest_protocol,  # noqa: E402, F401 (--cpu-times)
                       pytest_terminal_summary)

# The serving tests (tests/serve) need vLLM, which lives in its own environment: `make test-serve`.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["serve"]

# Normwise relative tolerances, ||a - b|| <= tol * ||b|| (Frobenius norms), per dtype. The float64 and float32
# bounds are the core issue's acceptance bounds; bfloat16 has 8 mantissa bits (eps = 2^-8),
# and rounding differences between two schedules compound through a whole network, so the
# model-level bound is looser than the op-level one.
TOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
}
# Gradients in bfloat16: a backward pass through a whole network compounds bf16 rounding.
GRAD_TOL = {**TOL, torch.bfloat16: 5e-2}
OP_TOL_BF16 = 1e-2


def activation_checkpointing(model: torch.nn.Module, enable: bool = True, **kwargs) -> None:
    """Turn a transformers model's activation checkpointing on (``kwargs``: the checkpoint's,
    as ``use_reentrant``) or off: ``activation_checkpointing_enable`` / ``_disable`` where
    transformers has them, else ``gradient_checkpointing_*`` (their deprecated names there;
    the only ones in transformers 5.20, the newest on Python 3.10)."""
    new = hasattr(model, "activation_checkpointing_enable")
    if not enable:
        (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()
    elif new:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Normwise relative error ``||a - b|| / ||b||`` (Frobenius norms), computed in float64."""
    a, b = a.detach().double(), b.detach().double()
    return torch.linalg.vector_norm(a - b).item() / max(torch.linalg.vector_norm(b).item(), 1e-30)


def assert_rel_close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str = "") -> None:
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    err = rel_err(a, b)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


GRAD_FLOOR = 1e-3


def tensor_errors(values, refs) -> list[float]:
    """Per-tensor ``||a - b|| / max(||b||, floor)`` with ``floor = GRAD_FLOOR * max_k ||b_k||``.

    The floor matters for gradients that are (nearly) zero through cancellation - the query
    of a sublayer whose sources are almost equal, attention projections at sequence length 1:
    they have no meaningful relative error of their own, so they are measured against a
    thousandth of the largest tensor in the same set instead.
    """
    values, refs = [v.detach().double() for v in values], [r.detach().double() for r in refs]
    assert len(values) == len(refs)
    floor = GRAD_FLOOR * max(torch.linalg.vector_norm(r).item() for r in refs)
    errs = []
    for a, b in zip(values, refs):
        assert a.shape == b.shape
        errs.append(torch.linalg.vector_norm(a - b).item() / max(torch.linalg.vector_norm(b).item(), floor, 1e-30))
    return errs


def scale_errors(values, refs) -> list[float]:
    """Per-tensor ``||a - b|| / max_k ||b_k||``: each error at the scale of the whole set."""
    values, refs = [v.detach().double() for v in values], [r.detach().double() for r in refs]
    scale = max(max(torch.linalg.vector_norm(r).item() for r in refs), 1e-30)
    return [torch.linalg.vector_norm(a - b).item() / scale for a, b in zip(values, refs)]


def fast_path_violations(fast, naive, truth, dtype, names, tol) -> list[str]:
    """What the acceptance check of two-phase vs naive finds wrong (empty: it passes).

    * float64: ``err(fast, naive) <= tol`` (1e-10): both are exact up to float64 rounding.
    * float32 and bfloat16: each low-precision path is held to the float64 ``truth``:
      ``err(fast, truth) <= max(tol, 2 * err(naive, truth))``. Comparing the two low-precision
      paths with each other instead is fragile: their rounding errors point in unrelated
      directions, so their difference can reach the *sum* of two equally accurate errors -
      which made the suite fail at 1.10e-5 > 1.08e-5 on an AVX-512 machine where the fast and
      naive paths were 5.6e-6 and 5.4e-6 from the truth (a different SIMD width, a different
      summation order). Against the truth, an equally accurate fast path always passes.
      A tensor also passes when its error is within ``tol`` of the *largest* tensor's norm
      (:func:`scale_errors`): the gradients of small tensors (a depth query at 1e-3 to 4e-2
      of the largest gradient) lose more digits on the two-phase paths, whose log-sum-exp
      split adds one cancellation (``gh . o_hat`` enters twice), than on the naive path -
      up to 7x its error over 1800 float32 gradients (11 cases x 2 shapes x 4 seeds), while
      their absolute errors stayed below 5e-6 of the largest gradient on both paths. One
      lucky naive sample then failed the ratio alone (issue 17's note). A wrong gradient is
      still caught: float64 holds every tensor to 1e-10, and in float32 an error of 1 % in a
      tensor at 1e-3 of the largest is already at the bound.
    """
    if dtype == torch.float64:
        errs, bounds = tensor_errors(fast, naive), [tol] * len(names)
        at_scale = [float("inf")] * len(names)
    else:
        errs = tensor_errors(fast, truth)
        bounds = [max(tol, 2 * e) for e in tensor_errors(naive, truth)]
        at_scale = scale_errors(fast, truth)
    return [f"{name}: relative error {e:.3e} > {b:.3e} ({dtype}; {s:.3e} of the largest tensor's norm)"
            for name, e, b, s in zip(names, errs, bounds, at_scale) if e > b and s > tol]


def assert_fast_matches_naive(fast, naive, truth, dtype, names, tol) -> None:
    """Assert :func:`fast_path_violations` finds nothing."""
    bad = fast_path_violations(fast, naive, truth, dtype, names, tol)
    assert not bad, "; ".join(bad)


def randomize_residual(model: torch.nn.Module, seed: int = 0, scale: float = 0.5) -> None:
    """Give the pseudo-queries and key-norm gains random values, so that tests exercise
    non-uniform depth weights (at init every query is zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("residual."):
                noise = torch.randn(p.shape, generator=g, dtype=torch.float64) * scale
                p.add_(noise.to(p.dtype))


def make_model(dtype: torch.dtype = torch.float32, seed: int = 0, randomize: bool = True, **overrides) -> AttnResLM:
    cfg = ModelConfig.preset("tiny", **overrides)
    torch.manual_seed(seed)
    model = AttnResLM(cfg).to(dtype)
    if randomize:
        randomize_residual(model, seed + 1)
    return model


def twin_with_schedule(model: AttnResLM, schedule: str) -> AttnResLM:
    """A deep copy of ``model`` (same weights) whose AttnRes module runs ``schedule``."""
    twin = copy.deepcopy(model)
    twin.residual.schedule = schedule
    return twin


@pytest.fixture
def one_thread():
    """Tiny models run fastest, and far more predictably on a shared machine, on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def hub_online_unset(monkeypatch):
    """No Hugging Face offline variable set and offline mode off in ``huggingface_hub`` and
    ``datasets`` (which read the variables when imported), whatever this machine sets; skips
    without lm_eval (and so ``datasets``). Returns ``(huggingface_hub.constants, datasets.config)``."""
    pytest.importorskip("lm_eval")
    import datasets.config
    from huggingface_hub import constants

    from attnres.hub import OFFLINE_VARIABLES

    for name in OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for module, name in ((constants, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"),
                         (datasets.config, "HF_DATASETS_OFFLINE")):
        monkeypatch.setattr(module, name, False)
    return constants, datasets.config


@pytest.fixture()
def users_matplotlib():
    """A session's own matplotlib backend with a pyplot figure open, as in a notebook (its
    inline backend) or a script with a window: what attnres's drawing must leave as it was."""
    matplotlib = pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    plt.switch_backend("svg")  # (not Agg, which attnres used to switch every session to)
    fig = plt.figure()
    yield plt.get_fignums()
    plt.close(fig)
    plt.switch_backend(before)


@pytest.fixture()
def writes_cut_short(monkeypatch):
    """Call the returned ``cut_short(text=True, figures=True, where="")`` and from then on every
    ``Path.write_text`` and matplotlib ``savefig`` to a file whose name holds ``where`` writes
    half of its file and fails as a full disk does (a kill mid-write): a writer must then leave
    the file that was there whole.
    Returns the files of a folder and their bytes, to compare before and after
    (``snapshot(folder)``)."""
    from pathlib import Path

    def cut_short(text: bool = True, figures: bool = True, where: str = "") -> None:
        write_text = Path.write_text

        def half_text(self, data, *args, **kwargs):
            if where not in self.name:
                return write_text(self, data, *args, **kwargs)
            write_text(self, data[: len(data) // 2], *args, **kwargs)
            raise OSError(28, "No space left on device")

        if text:
            monkeypatch.setattr(Path, "write_text", half_text)
        if figures:
            from matplotlib.figure import Figure

            savefig = Figure.savefig

            def half_figure(self, fname, *args, **kwargs):
                savefig(self, fname, *args, **kwargs)
                if where not in Path(fname).name:
                    return
                Path(fname).write_bytes(Path(fname).read_bytes()[:64])
                raise OSError(28, "No space left on device")

            monkeypatch.setattr(Figure, "savefig", half_figure)

    def snapshot(folder: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}

    return cut_short, snapshot


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True, scope="session")
def _interpreted_kernels_checked():
    """Under Triton's interpreter, every kernel's loads and stores must stay inside its tensor
    arguments, its alignment hints must hold and no two of its programs may race
    (:mod:`interpreter_checks`): what a GPU would fault on or race over, the interpreter lets
    pass. Switched on once for the session."""
    if (TRITON_DEVICE != "cpu" or importlib.util.find_spec("triton") is None
            or os.environ.get("ATTNRES_CHECK_KERNEL_ACCESSES") == "0"):
        yield
        return
    from interpreter_checks import checked_accesses

    with checked_accesses():
        yield


#: The modules that take longest (CPU-minutes on 2 cores: the ahead-of-time compile, the
#: interpreted kernels, compiled graphs, multi-process runs), run first: `make test` hands
#: whole modules to its worker processes in collection order, and a long module handed out
#: last kept one worker busy minutes after the other had finished.
LONG_MODULES = ("test_triton_aot.py", "test_depth_attention_ops.py", "test_compile.py", "test_multinode.py",
                "test_parallel_train.py", "test_data_parallel.py", "test_gpu_check.py", "test_train.py",
                "test_kernels.py", "test_readme.py")


def pytest_collection_modifyitems(config, items):
    first = {name: rank for rank, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # (stable: the rest keep their order)
