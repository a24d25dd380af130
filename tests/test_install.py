"""A base install (the wheel with torch and nothing else): every command either works or
says in one line which extra to install and how (from that wheel: no package index serves
attnres) - no tracebacks, no warning from torch about NumPy; ``train --help`` works; the
wheel holds the licence and the example configs.

The wheel is built from this checkout and installed with ``--no-deps`` into a virtual
environment holding only ``torch==2.13.0`` (the CPU build this project's machines install
from local disk; ``ATTNRES_TEST_TORCH`` overrides the requirement). Creating that environment
takes about a minute, so it is cached in ``~/.cache/attnres/base-venv-<torch>``
(``ATTNRES_BASE_VENV`` overrides the path) and only the wheel is reinstalled on later runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TORCH = os.environ.get("ATTNRES_TEST_TORCH", "torch==2.13.0")


def _run(*cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)


@pytest.fixture(scope="module")
def base_install(tmp_path_factory) -> tuple[Path, Path]:
    """The virtual environment and the wheel installed in it."""
    venv = Path(os.environ.get("ATTNRES_BASE_VENV", Path.home() / ".cache" / "attnres" / f"base-venv-{TORCH.replace('=', '')}"))
    python = venv / "bin" / "python"
    if not (venv / ".torch-installed").is_file():
        assert _run(sys.executable, "-m", "venv", "--clear", venv).returncode == 0
        done = _run(python, "-m", "pip", "install", "-q", TORCH)
        assert done.returncode == 0, done.stderr
        (venv / ".torch-installed").write_text(TORCH)
    dist = tmp_path_factory.mktemp("dist")
    done = _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, ROOT)
    assert done.returncode == 0, done.stderr
    (wheel,) = dist.glob("attnres-*.whl")
    done = _run(python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", wheel)
    assert done.returncode == 0, done.stderr
    listed = _run(python, "-m", "pip", "list", "--format=freeze").stdout
    assert not any(line.lower().startswith(("numpy==", "safetensors==", "transformers==")) for line in listed.splitlines())
    return venv, wheel


COMMANDS = {  # command line -> the extra it must name
    "train --print-config": "train",
    "train steps=1": "train",
    "generate --checkpoint {run} --prompt hi": "train",
    "status {tmp}": "train",
    "compare --preset tiny --out {tmp}/cmp": "experiments",
    "experiment ablation --preset tiny --out {tmp}/ab": "experiments",
    "analyze --checkpoint {run}": "experiments",
    "export --checkpoint {run} --out {tmp}/hf": "hf",
    "eval --checkpoint {run}": "hf",
    "upcycle --model {tmp} --out {tmp}/up": "hf",
}


def test_every_command_of_a_base_install_names_its_extra(base_install, tmp_path):
    venv, wheel = base_install
    script = venv / "bin" / "attnres"  # (run by its path, the environment not activated: its own pip is named)
    pip = f"{venv / 'bin' / 'python'} -m pip"
    done = _run(script, "--version", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().startswith("attnres ") and not done.stderr, done.stderr
    for line, extra in COMMANDS.items():
        done = _run(script, *line.format(run=tmp_path / "run", tmp=tmp_path).split(), cwd=tmp_path)
        assert done.returncode != 0, line
        assert "Traceback" not in done.stderr and "NumPy" not in done.stderr, (line, done.stderr)
        (last,) = done.stderr.strip().splitlines()
        assert f'this needs the {extra!r} extra: {pip} install "{wheel}[{extra}]"' in last, (line, last)
    done = _run(script, "train", "--help", cwd=tmp_path)  # the options, and how to get the config fields
    assert done.returncode == 0 and "--resume-from DIR" in done.stdout and not done.stderr, done.stderr
    assert f'needs the \'train\' extra: {pip} install "{wheel}[train]"' in done.stdout, done.stdout
    python = venv / "bin" / "python"  # the library itself needs nothing beyond torch
    done = _run(python, "-c", "import attnres; m = attnres.AttnResLM(attnres.ModelConfig.preset('tiny')); print('ok')")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok") and not done.stderr, done.stderr


def test_the_wheel_holds_the_licence_and_the_example_configs(base_install):
    import zipfile

    names = zipfile.ZipFile(base_install[1]).namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    shipped = sorted(n for n in names if n.startswith("attnres/configs/"))
    assert shipped == sorted(f"attnres/configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")), shipped
