"""The fused CPU kernel of the lean path (``cpu_merge.c``: the depth merge, Phase 1 and a
source's logits), built on first use.

The C source is compiled once per machine with the system's C compiler (``$CC``, else
``cc``; ``-O3 -march=native -fopenmp``, about a second) into a cache directory
(``$ATTNRES_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnres`` or ``~/.cache/attnres``), keyed by
the source, the flags, the compiler and the CPU, and loaded with :mod:`ctypes`: no Python
or PyTorch headers, no build step at install time. Without a compiler, or with
``ATTNRES_CPU_KERNEL=0``, :func:`cpu_kernel` returns ``None`` (with one warning when the
build failed) and the lean path runs its PyTorch code instead - the same function.

The ``*_forward`` / ``*_backward`` pairs take and return tensors; the autograd nodes that
call them are :class:`attnres.ops.recompute._DepthMerge` (merge), ``_Phase1`` and
``_RmsLogits`` (logits), whose PyTorch code is the kernel's reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "cpu_kernel",
    "cpu_kernel_supports",
    "merge_forward",
    "merge_backward",
    "phase1_forward",
    "phase1_backward",
    "logits_forward",
    "logits_backward",
]

SOURCE = Path(__file__).with_name("cpu_merge.c")
# -ffp-contract=fast: fused multiply-adds (ISO C mode turns contraction off).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", "-std=c11")
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def _cache_dir() -> Path:
    if os.environ.get("ATTNRES_CACHE_DIR"):
        return Path(os.environ["ATTNRES_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnres"


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's model and instruction-set flags."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in info if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _build(compiler: str) -> Path:
    """Compile the kernel (or find it in the cache); the file appears atomically."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(), _cpu_id().encode()]))
    target = _cache_dir() / "cpu-kernels" / f"attnres_cpu_merge-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, check=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, dbl, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double, ctypes.c_int
    for suffix in _SUFFIX.values():
        fwd = getattr(lib, f"attnres_merge_forward_{suffix}")
        fwd.argtypes = [i64, i64, i64, ptr, ptr, ptr, ptr, dbl, ptr, dbl, ptr, ptr, ptr, ptr, ptr, ptr, cint]
        fwd.restype = None
        bwd = getattr(lib, f"attnres_merge_backward_{suffix}")
        bwd.argtypes = [i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr,
                        cint]
        bwd.restype = None
        p1f = getattr(lib, f"attnres_phase1_forward_{suffix}")
        p1f.argtypes = [i64, i64, i64, i64, ptr, ptr, ptr, ptr, cint]
        p1f.restype = None
        p1b = getattr(lib, f"attnres_phase1_backward_{suffix}")
        p1b.argtypes = [i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, cint]
        p1b.restype = None
        lf = getattr(lib, f"attnres_logits_forward_{suffix}")
        lf.argtypes = [i64, i64, i64, ptr, ptr, dbl, ptr, ptr, cint]
        lf.restype = None
        lb = getattr(lib, f"attnres_logits_backward_{suffix}")
        lb.argtypes = [i64, i64, i64, ptr, ptr, ptr, ptr, ptr, cint, ptr, cint]
        lb.restype = None


@functools.cache
def cpu_kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, built on the first call; ``None`` when it is switched off
    (``ATTNRES_CPU_KERNEL=0``) or cannot be built here (a warning says why, once)."""
    if os.environ.get("ATTNRES_CPU_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn("attnres: no C compiler found (set $CC), the lean path runs its PyTorch code on CPU", stacklevel=2)
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
        _declare(lib)
    except (OSError, subprocess.CalledProcessError, AttributeError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        warnings.warn(f"attnres: the CPU merge kernel could not be built ({detail.strip()[:500]}); "
                      "the lean path runs its PyTorch code instead", stacklevel=2)
        return None
    return lib


def cpu_kernel_supports(tensors: Sequence[Tensor | None], out_dtype: torch.dtype) -> bool:
    """Whether the kernel can take these tensors (``None`` entries skipped): plain CPU
    tensors, all float32 or all float64 (the result too), contiguous, and the kernel built.
    Otherwise the PyTorch code runs."""
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in _SUFFIX or out_dtype != first.dtype:
        return False
    for x in tensors:
        if x is not None and not (_plain(x) and x.device.type == "cpu" and x.dtype == first.dtype and x.is_contiguous()):
            return False
    return cpu_kernel() is not None


def _plain(x: Tensor) -> bool:
    """A tensor with its own memory: not a subclass (a ``DTensor`` under tensor parallelism,
    a fake or functional tensor while tracing), whose ``data_ptr`` the kernel cannot read."""
    return type(x) is Tensor or (type(x) is torch.nn.Parameter and type(x.data) is Tensor)


def _function(name: str, dtype: torch.dtype):
    """The kernel's entry point ``name`` for ``dtype`` (float32 or float64)."""
    return getattr(cpu_kernel(), f"attnres_{name}_{_SUFFIX[dtype]}")


def _ptr(x: Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


def _ptrs(xs: Sequence[Tensor | None]) -> ctypes.Array:
    return (ctypes.c_void_p * len(xs))(*[_ptr(x) for x in xs])


def _source_gradients(x0: Tensor, needs: Sequence[bool], into: Sequence[tuple[Tensor, bool] | None] | None):
    """Where a backward writes each source's gradient: a new tensor (returned) or the
    buffer ``into[j]`` names; ``(new tensors or None, pointers, accumulate flags)``."""
    into = into if into is not None else [None] * len(needs)
    new = [torch.empty_like(x0) if need and dest is None else None for need, dest in zip(needs, into)]
    dests = [dest[0] if dest is not None and need else g for g, dest, need in zip(new, into, needs)]
    accumulate = (ctypes.c_ubyte * len(needs))(*[dest is not None and dest[1] for dest in into])
    return new, _ptrs(dests), accumulate


def merge_forward(z: Tensor, sources: Sequence[Tensor], partial: Tensor | None, qg: Tensor | None, eps: float,
                  norm_weight: Tensor | None, norm_eps: float, keep_input: bool):
    """The forward of :class:`~attnres.ops.recompute._DepthMerge` (same arguments, every
    tensor contiguous and of one dtype, float32 or float64): returns ``(out, alpha, r_b,
    zb, rstd, kept)``, ``None`` where absent."""
    x0 = sources[0]
    d, tokens, n = x0.shape[-1], x0.numel() // x0.shape[-1], len(sources)
    m = n + (partial is not None)
    new = functools.partial(torch.empty, dtype=x0.dtype)
    out, alpha = new(x0.shape), new((*x0.shape[:-1], m))
    r_b, zb = (new(x0.shape[:-1]), new(x0.shape[:-1])) if partial is not None else (None, None)
    rstd = new((*x0.shape[:-1], 1)) if norm_weight is not None else None
    kept = new(x0.shape) if keep_input and norm_weight is not None else None
    z = z.contiguous()  # a local: the kernel reads its memory
    _function("merge_forward", x0.dtype)(
        tokens, d, n, _ptrs(sources), _ptr(z), _ptr(partial), _ptr(qg), eps, _ptr(norm_weight), norm_eps,
        _ptr(out), _ptr(alpha), _ptr(r_b), _ptr(zb), _ptr(rstd), _ptr(kept), torch.get_num_threads())
    return out, alpha, r_b, zb, rstd, kept


def merge_backward(g: Tensor, alpha: Tensor, r_b, zb, rstd, kept, partial, qg, norm_weight, sources: Sequence[Tensor],
                   needs_sources: Sequence[bool], needs_z: bool, needs_partial: bool, needs_qg: bool, needs_norm: bool,
                   into: Sequence[tuple[Tensor, bool] | None] | None = None):
    """The backward of :class:`~attnres.ops.recompute._DepthMerge` from ``g = d loss / d out``:
    returns ``(g_z, g_partial, g_qg, g_norm, grads of the sources)``, ``None`` where not needed.

    ``into[j] = (buffer, accumulate)`` writes source ``j``'s gradient into ``buffer`` (added
    to it with ``accumulate``) instead of a new tensor; its entry of the result is ``None``."""
    x0 = sources[0]
    d, tokens, n = x0.shape[-1], x0.numel() // x0.shape[-1], len(sources)
    threads = torch.get_num_threads()
    new = functools.partial(torch.empty, dtype=x0.dtype)
    g_src, dests, accumulate = _source_gradients(x0, needs_sources, into)
    g_z = new((*x0.shape[:-1], n)) if needs_z else None
    g_partial = new(x0.shape) if needs_partial and partial is not None else None
    gqg_part = new((threads, d)) if needs_qg and partial is not None else None
    gw_part = new((threads, d)) if needs_norm and norm_weight is not None else None
    g = g.contiguous()  # a local: the kernel reads its memory
    _function("merge_backward", x0.dtype)(
        tokens, d, n, _ptrs(sources), _ptr(partial), _ptr(qg), _ptr(norm_weight), _ptr(alpha), _ptr(r_b), _ptr(zb),
        _ptr(rstd), _ptr(kept), _ptr(g), dests, accumulate, _ptr(g_z), _ptr(g_partial), _ptr(gqg_part),
        _ptr(gw_part), threads)
    g_qg = gqg_part.sum(0) if gqg_part is not None else None
    g_norm = gw_part.sum(0) if gw_part is not None else None
    return g_z, g_partial, g_qg, g_norm, g_src


def phase1_forward(z: Tensor, sources: Sequence[Tensor]) -> tuple[list[Tensor], Tensor]:
    """Phase 1 of ``S`` queries over ``n`` sources (``[..., d]``, contiguous, float32 or
    float64): logits ``z [..., S, n]`` -> ``S`` weighted sums ``[..., d]`` and the
    log-sum-exp of each query's logits ``[..., S]``."""
    x0 = sources[0]
    d, tokens, n, S = x0.shape[-1], x0.numel() // x0.shape[-1], len(sources), z.shape[-2]
    z = z.contiguous()  # a local: the kernel reads its memory
    outs = [torch.empty_like(x0) for _ in range(S)]
    lse = torch.empty(z.shape[:-1], dtype=x0.dtype)
    _function("phase1_forward", x0.dtype)(
        tokens, d, n, S, _ptrs(sources), _ptr(z), _ptrs(outs), _ptr(lse), torch.get_num_threads())
    return outs, lse


def phase1_backward(z: Tensor, lse: Tensor, sources: Sequence[Tensor], g_outs: Sequence[Tensor | None],
                    g_lse: Tensor | None, needs_z: bool, needs_sources: Sequence[bool],
                    into: Sequence[tuple[Tensor, bool] | None] | None = None) -> tuple[Tensor | None, list]:
    """The backward of :func:`phase1_forward`: ``(g_z, grads of the sources)``, ``None``
    where not needed; ``into`` as in :func:`merge_backward`."""
    x0 = sources[0]
    d, tokens, n, S = x0.shape[-1], x0.numel() // x0.shape[-1], len(sources), z.shape[-2]
    z = z.contiguous()
    g_outs = [g.contiguous() if g is not None else None for g in g_outs]  # locals: the kernel reads them
    g_lse = g_lse.contiguous() if g_lse is not None else None
    g_src, dests, accumulate = _source_gradients(x0, needs_sources, into)
    g_z = torch.empty_like(z) if needs_z else None
    _function("phase1_backward", x0.dtype)(
        tokens, d, n, S, _ptrs(sources), _ptr(z), _ptr(lse), _ptrs(g_outs), _ptr(g_lse), _ptr(g_z), dests,
        accumulate, torch.get_num_threads())
    return g_z, g_src


def logits_forward(x: Tensor, qg: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """A source's logits against ``K`` gain-folded queries: ``x [..., d]``, ``qg [K, d]``
    (contiguous, one dtype, float32 or float64) -> ``z = (x . qg_k) / rms(x)`` ``[..., K]``
    and the RMS factor ``1 / rms(x)`` ``[...]``."""
    d, K = x.shape[-1], qg.shape[0]
    tokens = x.numel() // d
    z = torch.empty((*x.shape[:-1], K), dtype=x.dtype)
    r = torch.empty(x.shape[:-1], dtype=x.dtype)
    _function("logits_forward", x.dtype)(tokens, d, K, _ptr(x), _ptr(qg), eps, _ptr(z), _ptr(r), torch.get_num_threads())
    return z, r


def logits_backward(gz: Tensor, x: Tensor, qg: Tensor, r: Tensor, needs_x: bool, needs_qg: bool,
                    into: tuple[Tensor, bool] | None = None) -> tuple[Tensor | None, Tensor | None]:
    """The backward of :func:`logits_forward` from ``gz [..., K]``: ``(d x, d qg)``, ``None``
    where not needed; ``into = (buffer, accumulate)`` writes ``d x`` there instead (its entry
    of the result is then ``None``), as in :func:`merge_backward`."""
    d, K = x.shape[-1], qg.shape[0]
    tokens = x.numel() // d
    threads = torch.get_num_threads()
    g_x = torch.empty_like(x) if needs_x and into is None else None
    dest, accumulate = into if into is not None else (g_x, False)
    gq_part = torch.empty((threads, K, d), dtype=x.dtype) if needs_qg else None
    gz = gz.contiguous()  # a local: the kernel reads its memory
    _function("logits_backward", x.dtype)(
        tokens, d, K, _ptr(x), _ptr(qg), _ptr(r), _ptr(gz), _ptr(dest), int(accumulate), _ptr(gq_part),
        threads)
    return g_x, (gq_part.sum(0) if gq_part is not None else None)
