"""The suite's hypothesis profiles (tests/hypothesis_profiles.py): the default suite draws the
same examples on every run, so a failed CI is a real defect and never an unlucky draw;
``explore`` draws new ones, more of them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

import hypothesis_profiles

TESTS = Path(__file__).resolve().parent

#: A property run in a fresh interpreter (its own hash seed, its own random state), printing
#: what it drew and what the loaded profile says.
DRAW = """
import json, sys
sys.path.insert(0, sys.argv[1])
import hypothesis_profiles
name = hypothesis_profiles.load()
from hypothesis import given, settings, strategies as st
drawn = []

@settings(max_examples=hypothesis_profiles.examples(20))
@given(st.text(), st.integers())
def prop(text, number):
    drawn.append([text, number])

prop()
print(json.dumps({"profile": name, "drawn": drawn, "max_examples": hypothesis_profiles.examples(20)}))
"""


def draw(profile: str | None, cwd: Path) -> dict:
    """What :data:`DRAW` draws under ``profile`` (``None``: the variable unset), run in ``cwd``
    (where ``explore`` keeps its example database), outside CI:
    hypothesis loads a derandomized profile of its own where ``CI`` is set, and that must not
    stand in for the suite's on a developer's machine."""
    from hypothesis._settings import _CI_VARS

    drop = {hypothesis_profiles.PROFILE_VARIABLE, *_CI_VARS}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if profile is not None:
        env[hypothesis_profiles.PROFILE_VARIABLE] = profile
    proc = subprocess.run([sys.executable, "-c", DRAW, str(TESTS)], env=env, capture_output=True, text=True,
                          timeout=120, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.skipif(os.environ.get(hypothesis_profiles.PROFILE_VARIABLE) == "explore", reason="make test-fuzz")
def test_the_default_suite_draws_the_same_examples_every_run(tmp_path):
    assert settings.default.derandomize and settings.default.database is None
    assert settings.default.deadline is None and settings.default.print_blob
    first, second = draw(None, tmp_path), draw(None, tmp_path)
    assert first["profile"] == "deterministic" and first["max_examples"] == 20
    assert first["drawn"] == second["drawn"] and len(first["drawn"]) >= 10


def test_the_explore_profile_draws_new_examples_ten_times_as_many(tmp_path):
    first, second = draw("explore", tmp_path), draw("explore", tmp_path)
    assert first["profile"] == "explore" and first["max_examples"] == 200
    assert first["drawn"] != second["drawn"]


def test_an_unknown_profile_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(hypothesis_profiles.PROFILE_VARIABLE, "fuzz")
    with pytest.raises(ValueError, match=r"^ATTNRES_HYPOTHESIS='fuzz': the test profiles are 'deterministic' "):
        hypothesis_profiles.load()


def test_the_suites_conftest_loads_where_hypothesis_is_not_installed():
    """The serving suite (``make test-serve``) runs in vLLM's environment, which has no
    hypothesis, under this same conftest: importing the profiles there stopped every test of
    that suite at collection (ModuleNotFoundError). The conftest loads without hypothesis."""
    blocked = ("import sys; sys.modules['hypothesis'] = None; sys.path.insert(0, sys.argv[1]); import conftest; "
               "print('loaded')")
    done = subprocess.run([sys.executable, "-c", blocked, str(TESTS)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("loaded"), done.stderr[-3000:]
