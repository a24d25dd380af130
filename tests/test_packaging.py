"""What the packaging metadata (``pyproject.toml``, ``MANIFEST.in``) gives a build: setuptools
reads it without a deprecation, which its builds turn into an error at the deadline it names;
and the sdist, and the wheel built from it as ``python -m build`` builds them, hold what they
should (a few seconds; ``tests/test_install.py`` installs a wheel, slow)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_setuptools_reads_the_project_metadata_without_a_deprecation():
    """`license = { text = "MIT" }` (a TOML table) warned on every build, wheel and sdist alike,
    that setuptools refuses it from 2027-02-18: the licence is an SPDX string with its file named
    in `license-files` now (PEP 639), and the build requires a setuptools that reads that form."""
    pytest.importorskip("setuptools", minversion="77")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [str(w.message).splitlines()[0] for w in said if "deprecat" in str(w.message).lower()] == []
    assert dist.metadata.license_expression == "MIT" and dist.metadata.license_files == ["LICENSE"]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, list[str]]:
    """The sdist built from a copy of this checkout's files (tracked and new, as git lists
    them: the build's egg-info stays out of the checkout), and the wheel built from that
    sdist unpacked, as `python -m build` builds them: ``{"sdist": names, "wheel": names}``."""
    import subprocess
    import sys
    import tarfile
    import zipfile

    pytest.importorskip("setuptools", minversion="77")
    root = tmp_path_factory.mktemp("packaging")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    copy = root / "checkout"
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file() or source.is_symlink():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            (copy / name).symlink_to(source.readlink()) if source.is_symlink() else (copy / name).write_bytes(
                source.read_bytes())
    build = "import sys; from setuptools import build_meta; print(getattr(build_meta, sys.argv[1])(sys.argv[2]))"
    done = subprocess.run([sys.executable, "-c", build, "build_sdist", str(root)], cwd=copy, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    sdist = root / done.stdout.split()[-1]
    with tarfile.open(sdist) as archive:
        names = [n.partition("/")[2] for n in archive.getnames()]
        archive.extractall(root / "unpacked", filter="data")
    (unpacked,) = (root / "unpacked").iterdir()
    done = subprocess.run([sys.executable, "-c", build, "build_wheel", str(root)], cwd=unpacked, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr  # (a file the build needs missing from the sdist fails here)
    return {"sdist": names, "wheel": zipfile.ZipFile(root / done.stdout.split()[-1]).namelist()}


def test_the_sdist_builds_the_wheel_and_holds_no_half_of_the_test_suite(built):
    """The sdist held tests/test_*.py alone (setuptools' default include) - without conftest.py,
    the helpers and fixtures they import, or the docs and benchmarks they read - a suite that
    could not run. It holds what builds the package: the sources and their data, the licence
    and the README (the long description); the wheel built from it holds the package and its
    data, no tests, benchmarks, studies or bytecode."""
    sdist, wheel = built["sdist"], built["wheel"]
    for needed in ("pyproject.toml", "README.md", "LICENSE", "src/attnres/__init__.py",
                   "src/attnres/configs/train-cpu.yaml", "src/attnres/ops/depth_attention/cpu_kernel.c"):
        assert needed in sdist, needed
    assert not [n for n in sdist if n.startswith(("tests/", "benchmarks/", "studies/", "docs/"))]
    shipped = {n.removeprefix("src/") for n in sdist if n.startswith("src/attnres/") and "." in n.rpartition("/")[2]}
    assert shipped <= set(wheel) and "attnres/configs/train-cpu.yaml" in wheel
    assert "attnres/py.typed" in wheel  # (PEP 561: without it a type checker reads none of the annotations)
    assert not [n for n in wheel if not n.startswith(("attnres/", "attnres-"))]
    assert not [n for n in wheel if n.endswith((".pyc", ".pyo")) or "__pycache__" in n or "/tests/" in n]
