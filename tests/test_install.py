"""A base install (``pip install attnres``: torch and nothing else): every command either
works or says in one line which extra to install - no tracebacks.

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
def base_venv(tmp_path_factory) -> Path:
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
    return venv


COMMANDS = {  # command line -> the extra it must name
    "train --print-config": "train",
    "train --help": "train",
    "train steps=1": "train",
    "generate --checkpoint {run} --prompt hi": "train",
    "compare --preset tiny --out {tmp}/cmp": "experiments",
    "experiment ablation --preset tiny --out {tmp}/ab": "experiments",
    "experiment no-free-lunch --preset tiny --out {tmp}/nfl": "experiments",
    "analyze --checkpoint {run}": "experiments",
    "export --checkpoint {run} --out {tmp}/hf": "hf",
    "eval --checkpoint {run}": "hf",
    "upcycle --model {tmp} --out {tmp}/up": "hf",
}


def test_every_command_of_a_base_install_names_its_extra(base_venv, tmp_path):
    script = base_venv / "bin" / "attnres"
    done = _run(script, "--version", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().startswith("attnres "), done.stderr
    for line, extra in COMMANDS.items():
        done = _run(script, *line.format(run=tmp_path / "run", tmp=tmp_path).split(), cwd=tmp_path)
        assert done.returncode != 0, line
        assert "Traceback" not in done.stderr, (line, done.stderr)
        last = done.stderr.strip().splitlines()[-1]
        assert f'pip install "attnres[{extra}]"' in last, (line, last)
    python = base_venv / "bin" / "python"  # the library itself needs nothing beyond torch
    done = _run(python, "-c", "import attnres; m = attnres.AttnResLM(attnres.ModelConfig.preset('tiny')); print('ok')")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr
