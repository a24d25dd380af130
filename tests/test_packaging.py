"""What the packaging metadata (``pyproject.toml``) gives a build: setuptools reads it without
a deprecation, which its builds turn into an error at the deadline it names. Fast: the file is
read by setuptools as a build reads it, nothing is built (``tests/test_install.py`` builds the
wheel, slow)."""

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
