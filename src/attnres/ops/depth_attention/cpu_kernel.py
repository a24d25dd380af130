"""The CPU implementation of the depth-attention operations: ``cpu_kernel.c``, compiled on
first use and bound through a checked ``ctypes`` binding.

Build: the C source is compiled once per machine with the system's C compiler (``$CC``,
else ``cc``; ``-O3 -march=native -fopenmp``, about a second) into a cache directory
(``$ATTNRES_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnres`` or ``~/.cache/attnres``), keyed by
the source, the flags, the compiler and the CPU. Each process compiles into a file of its
own and renames it into place, so concurrent builds are safe. A compiler that refuses
``-march=native`` or ``-fopenmp`` gets the build again without the one it refuses, else
without both (one warning). Without
a compiler, or with ``ATTNRES_CPU_KERNEL=0``, :func:`cpu_kernel` returns ``None`` (one
warning when a build failed) and the operations run their PyTorch implementation.

Why ``ctypes`` and not a ``torch.utils.cpp_extension``: the kernel needs raw pointers only;
compiling against PyTorch's headers takes several times longer than the kernel itself on
every fresh clone (measured in docs/kernels.md) and ties the cached library to one torch
build. The binding is checked instead: the library exports every function's parameters as
text (declared once, in the C source) and an ABI version; :class:`KernelLibrary` builds its
``ctypes`` declarations from that text and takes every argument by name, checking tensors'
dtype, device and layout, so a mismatch raises instead of corrupting memory.

The four functions at the bottom have the signatures of their counterparts in
:mod:`.torch_impl` (the reference arithmetic; same saved statistics).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from ...machine import cpuinfo_lines
from ...user_warning import warn_user
from . import torch_impl

__all__ = ["cpu_kernel", "supports", "KernelLibrary", "phase1_forward", "phase1_backward", "merge_forward",
           "merge_backward"]

SOURCE = Path(__file__).with_name("cpu_kernel.c")
#: The ABI version the binding expects (``ATTNRES_ABI_VERSION`` in the C source).
ABI_VERSION = 4
# -ffp-contract=fast: fused multiply-adds (ISO C mode turns contraction off).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", "-std=c11")
#: Flags dropped when the compiler refuses the full set: each alone, then both (Apple's
#: clang refuses -fopenmp only, older clang on arm64 -march=native only).
OPTIONAL_FLAGS = ("-march=native", "-fopenmp")
_DROPS = ((), *((f,) for f in OPTIONAL_FLAGS), OPTIONAL_FLAGS)
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def _cache_dir() -> Path:
    if os.environ.get("ATTNRES_CACHE_DIR"):
        return Path(os.environ["ATTNRES_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnres"


#: The lines of ``/proc/cpuinfo`` that ``-march=native`` depends on: x86's model and flags,
#: an ARM CPU's implementer, part and features (Linux on aarch64 has no "model name").
_CPU_LINES = ("model name", "flags", "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features")


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's model and instruction-set flags."""
    info = cpuinfo_lines()
    if info is None:
        return platform.processor() or platform.machine()
    keep = [line for line in info if line.startswith(_CPU_LINES)]
    return "\n".join(sorted(set(keep)))


def _compile(compiler: list[str], flags: Sequence[str], target: Path) -> None:
    """Compile into a file of this process's own, then rename it into place (atomic)."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([*compiler, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, check=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build(compiler: list[str]) -> Path:
    """The compiled library (from the cache, or built now) by ``compiler`` (a command line:
    ``$CC`` may be ``ccache cc``): with every flag, else without the flags the compiler refuses
    (a warning names them)."""
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_id().encode()]))
    target = _cache_dir() / "cpu-kernels" / f"attnres_depth_attention-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    for dropped in _DROPS:
        try:
            _compile(compiler, [f for f in FLAGS if f not in dropped], target)
            break
        except subprocess.CalledProcessError:
            if dropped == _DROPS[-1]:
                raise
    if dropped:
        warn_user(f"attnres: the CPU kernel was built without {' '.join(dropped)} (the compiler refused it); "
                  "it runs slower" + (", on one thread (Apple's clang has no OpenMP: README, 'On macOS or ARM Linux')"
                                      if "-fopenmp" in dropped else ""))
    return target


class KernelLibrary:
    """The compiled kernel with a checked binding.

    The library's ``attnres_signatures()`` text names every parameter of every function
    with its C type (``int64_t``, ``int``, ``double``, ``[const] scalar_t *`` a tensor,
    ``... *const *`` a list of tensors, ``nullable`` where ``NULL`` is allowed);
    :meth:`call` takes the arguments by these names, in any order, and checks them."""

    _SCALARS = {"int64_t": (ctypes.c_int64, int), "int": (ctypes.c_int, int), "double": (ctypes.c_double, float)}

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.lib.attnres_abi_version.restype = ctypes.c_int
        self.lib.attnres_signatures.restype = ctypes.c_char_p
        version = self.lib.attnres_abi_version()
        if version != ABI_VERSION:
            raise OSError(f"{path} has ABI version {version}, the binding expects {ABI_VERSION}")
        self.params: dict[str, list[tuple[str, str, bool]]] = {}
        self.functions: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for entry in self.lib.attnres_signatures().decode().split(";"):
            name, _, rest = entry.strip().partition("(")
            self.params[name] = [self._parse(p) for p in rest.rstrip(")").split(",")]
            for dtype, suffix in _SUFFIX.items():
                fn = self.functions[name, dtype] = getattr(self.lib, f"attnres_{name}_{suffix}")
                fn.argtypes = [self._ctype(kind) for _, kind, _ in self.params[name]]
                fn.restype = None

    @staticmethod
    def _parse(param: str) -> tuple[str, str, bool]:
        """``"nullable const scalar_t * partial"`` -> ``("partial", "tensor", True)``."""
        words = param.replace("*", " * ").split()
        name, nullable, stars = words[-1], "nullable" in words, words.count("*")
        kind = {0: " ".join(w for w in words[:-1] if w != "const"), 1: "tensor", 2: "tensors"}[stars]
        return name, kind, nullable

    def _ctype(self, kind: str):
        return self._SCALARS[kind][0] if kind in self._SCALARS else ctypes.c_void_p

    def call(self, name: str, dtype: torch.dtype, **args) -> None:
        """Run ``attnres_<name>`` for ``dtype`` (float32 or float64) with ``args`` by name.

        Raises ``TypeError`` for a missing or unknown argument, a scalar of the wrong type,
        ``None`` where the C code does not allow ``NULL``, or a tensor that is not a
        contiguous CPU tensor of ``dtype``."""
        params = self.params[name]
        if len(args) != len(params) or any(p not in args for p, _, _ in params):
            missing = [p for p, _, _ in params if p not in args]
            unknown = sorted(set(args) - {p for p, _, _ in params})
            raise TypeError(f"attnres_{name}: missing arguments {missing}, unknown arguments {unknown}")
        values = []
        for param, kind, nullable in params:
            value = args[param]
            if kind == "tensor":
                values.append(_pointer(name, param, nullable, value, dtype))
            elif kind == "tensors":
                values.append((ctypes.c_void_p * len(value))(*[_pointer(name, param, nullable, x, dtype) for x in value]))
            else:
                values.append(self._scalar(name, param, kind, value))
        self.functions[name, dtype](*values)

    def _scalar(self, fn: str, param: str, kind: str, value):
        python_type = self._SCALARS[kind][1]
        if type(value) is not python_type and not (python_type is float and type(value) is int):
            raise TypeError(f"attnres_{fn}: {param} must be {kind}, got {type(value).__name__}")
        return value


def _pointer(fn: str, param: str, nullable: bool, x: Tensor | None, dtype: torch.dtype) -> int | None:
    """``x``'s data pointer, once it is checked to be what the C parameter takes."""
    if x is None:
        if not nullable:
            raise TypeError(f"attnres_{fn}: {param} must not be None")
        return None
    if isinstance(x, Tensor) and x.dtype is dtype and x.is_cpu and x.is_contiguous():
        return x.data_ptr()
    got = f"{x.dtype} {x.device} contiguous={x.is_contiguous()}" if isinstance(x, Tensor) else type(x).__name__
    raise TypeError(f"attnres_{fn}: {param} must be a contiguous CPU tensor of {dtype}, got {got}")


#: The way to the PyTorch implementation without the build's warning (the same numbers, somewhat slower).
_QUIET = " (or ATTNRES_CPU_KERNEL=0 to run it without building, and without this warning)"


#: ``ATTNRES_CPU_KERNEL``'s values that switch the kernel off, and those that leave it on (unset too).
SWITCHED_OFF, SWITCHED_ON = ("0", "false", "off", "no"), ("1", "true", "on", "yes", "")


def switched_off() -> bool:
    """Whether ``ATTNRES_CPU_KERNEL`` switches the kernel off: ``0`` (``false``, ``off``,
    ``no``). Only ``0`` did: ``ATTNRES_CPU_KERNEL=false`` built and ran the kernel without a
    word. A value that is neither on nor off is warned of, naming both, and leaves it on."""
    value = os.environ.get("ATTNRES_CPU_KERNEL", "").strip().lower()
    if value in SWITCHED_OFF:
        return True
    if value not in SWITCHED_ON:
        warn_user(f"ATTNRES_CPU_KERNEL={os.environ['ATTNRES_CPU_KERNEL']!r} is neither 0 (the PyTorch implementation; "
                  f"also {', '.join(SWITCHED_OFF[1:])}) nor 1 (the C kernel, as unset; also "
                  f"{', '.join(filter(None, SWITCHED_ON[1:]))}): the C kernel runs")
    return False


@functools.cache
def cpu_kernel() -> KernelLibrary | None:
    """The kernel library, built on the first call; ``None`` when it is switched off
    (``ATTNRES_CPU_KERNEL=0``: :func:`switched_off`) or cannot be built here (a warning says
    why, once)."""
    if switched_off():
        return None
    compiler = shlex.split(os.environ.get("CC", "")) or [c for c in [shutil.which("cc") or shutil.which("gcc")] if c]
    if not compiler:
        warn_user(f"attnres: no C compiler found (set $CC); depth attention runs its PyTorch implementation on CPU{_QUIET}")
        return None
    try:
        return KernelLibrary(_build(compiler))
    except (OSError, subprocess.CalledProcessError, AttributeError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        warn_user(f"attnres: the CPU kernel could not be built ({detail.strip()[:500]}); "
                  f"depth attention runs its PyTorch implementation instead: set $CC to a working C compiler{_QUIET}")
        return None


def supports(tensors: Sequence[Tensor | None]) -> bool:
    """Whether the kernel can take these tensors (``None`` entries skipped): CPU tensors
    with memory of their own, all float32 or all float64, contiguous - and the kernel built."""
    dtype = next(x for x in tensors if x is not None).dtype
    if dtype not in _SUFFIX:
        return False
    for x in tensors:
        if x is not None and not (x.dtype is dtype and x.is_cpu and x.is_contiguous() and _plain(x)):
            return False
    return cpu_kernel() is not None


def _plain(x: Tensor) -> bool:
    """A tensor with its own memory: not a subclass (a ``DTensor``, a fake tensor)."""
    return type(x) is Tensor or (type(x) is torch.nn.Parameter and type(x.data) is Tensor)


def _geometry(x: Tensor) -> dict:
    d = x.shape[-1]
    return {"tokens": x.numel() // d if d else 0, "d": d, "threads": torch.get_num_threads()}


def _new(needed: bool, like: Tensor, shape=None) -> Tensor | None:
    if not needed:
        return None
    return torch.empty_like(like) if shape is None else torch.empty(shape, dtype=like.dtype)


def phase1_forward(qg: Tensor, sources: Sequence[Tensor], eps: float, out_dtype=None) -> tuple[list[Tensor], Tensor]:
    if out_dtype not in (None, sources[0].dtype):  # (the C kernel writes the sources' dtype: converted after it)
        outs, lse = phase1_forward(qg, sources, eps)
        return [o.to(out_dtype) for o in outs], lse
    x0 = sources[0]
    outs = [torch.empty_like(x0) for _ in range(qg.shape[0])]
    lse = torch.empty((*x0.shape[:-1], qg.shape[0]), dtype=x0.dtype)
    cpu_kernel().call("phase1_forward", x0.dtype, **_geometry(x0), n=len(sources), S=qg.shape[0], src=sources, q=qg,
                      eps=float(eps), out=outs, lse=lse)
    return outs, lse


def phase1_backward(qg, lse, sources, g_outs, g_lse, eps: float, needs_qg: bool, needs_sources: Sequence[bool]):
    x0 = sources[0]
    if any(g is not None and g.dtype != x0.dtype for g in g_outs):
        if not all(g is None or torch.promote_types(g.dtype, x0.dtype) == x0.dtype for g in g_outs):
            return torch_impl.phase1_backward(qg, lse, sources, g_outs, g_lse, eps, needs_qg, needs_sources)
        # (the sums' gradients in their narrower dtype, autocast_phase1_sums: converted, exactly)
        g_outs = [g if g is None else g.to(x0.dtype) for g in g_outs]
    geometry = _geometry(x0)
    g_src = [_new(need, x0) for need in needs_sources]
    gq_part = _new(needs_qg, x0, (geometry["threads"], *qg.shape))
    cpu_kernel().call("phase1_backward", x0.dtype, **geometry, n=len(sources), S=qg.shape[0], src=sources, q=qg,
                      eps=float(eps), lse=lse.contiguous(), gout=[g if g is None else g.contiguous() for g in g_outs],
                      glse=None if g_lse is None else g_lse.contiguous(), gsrc=g_src, gq_part=gq_part)
    return (gq_part.sum(0) if gq_part is not None else None), g_src


def merge_forward(z, sources, computed, qg, norm_weight, eps: float, norm_eps: float, addend=None, out_dtype=None):
    if out_dtype is not None:  # (the C kernel writes the sources' dtype: converted after it, as a reader would)
        out, *rest = merge_forward(z, sources, computed, qg, norm_weight, eps, norm_eps, addend)
        return out.to(out_dtype), *rest
    total = None
    if addend is not None:  # (the kernel reads the sum: on CPU the add stays a separate pass)
        total = computed[-1] + addend
        computed = [*computed[:-1], total]
    x0 = (list(sources) + list(computed))[0]
    lead, k, c = x0.shape[:-1], len(sources), len(computed)
    out, alpha = torch.empty_like(x0), torch.empty((*lead, k + c), dtype=x0.dtype)
    rc, zc = _new(c > 0, x0, (*lead, c)), _new(c > 0, x0, (*lead, c))
    rstd = _new(norm_weight is not None, x0, (*lead, 1))
    cpu_kernel().call("merge_forward", x0.dtype, **_geometry(x0), k=k, c=c, src=sources, z=z.contiguous(),
                      comp=computed, qg=qg if c else None, eps=float(eps), norm_w=norm_weight,
                      norm_eps=float(norm_eps), out=out, alpha=alpha, rc=rc, zc=zc, rstd=rstd)
    return out, alpha, rc, zc, rstd, total


def merge_backward(g, alpha, rc, zc, rstd, sources, computed, qg, norm_weight, needs, g_total=None,
                   addend_dtype=None, g_views=()):
    """``needs``, ``g_total``, ``addend_dtype``, ``g_views``: as :func:`.torch_impl.merge_backward`."""
    x0 = (list(sources) + list(computed))[0]
    if g_views or torch.promote_types(g.dtype, x0.dtype) == x0.dtype:
        # (the C kernel reads g in the sources' dtype: a narrower one's converted, exactly; the
        # readers' gradients added up in it first, as autograd would)
        g = torch_impl.readers_grad(g, g_views, x0.dtype)
    if g.dtype != x0.dtype:
        return torch_impl.merge_backward(g, alpha, rc, zc, rstd, sources, computed, qg, norm_weight, needs, g_total,
                                         addend_dtype)
    k, c, geometry = len(sources), len(computed), _geometry(x0)
    needs_z, needs_x, (needs_qg, needs_norm) = needs[0], needs[1 : 1 + k + c], needs[1 + k + c :]
    grads = [_new(need, x0) for need in needs_x]
    g_z = _new(needs_z, x0, (*x0.shape[:-1], k))
    gqg_part = _new(needs_qg and c > 0, x0, (geometry["threads"], geometry["d"]))
    gw_part = _new(needs_norm and norm_weight is not None, x0, (geometry["threads"], geometry["d"]))
    cpu_kernel().call("merge_backward", x0.dtype, **geometry, k=k, c=c, src=sources, comp=computed,
                      qg=qg if c else None, norm_w=norm_weight, alpha=alpha, rc=rc, zc=zc, rstd=rstd,
                      g=g.contiguous(), gsrc=grads[:k], gcomp=grads[k:], gz=g_z, gqg_part=gqg_part, gw_part=gw_part)
    g_qg = gqg_part.sum(0) if gqg_part is not None else None
    g_norm = gw_part.sum(0) if gw_part is not None else None
    if g_total is not None and grads[-1] is not None:
        grads[-1].add_(g_total)
    return g_z, grads[:k], grads[k:], g_qg, g_norm, torch_impl.addend_grad(grads[-1], addend_dtype)
