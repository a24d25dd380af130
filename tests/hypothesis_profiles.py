"""The suite's hypothesis profiles, loaded by conftest.py before any test module is imported.

A failed CI means nothing of a day's work lands, so the default suite must fail only for a
real defect: its property tests draw the same examples on every run. Drawing new ones is a
separate, deliberate run (`make test-fuzz`, docs/testing.md), whose counterexamples become
``@example``s of the property with the fix.

* ``deterministic`` (the default): examples seeded from each test function (``derandomize``,
  which also keeps no example database), so a run's result depends only on the code - a
  property still checks its whole drawn set, the same set each run. No ``deadline``: on a
  loaded 2-core CI machine one example's wall time says nothing of a defect.
* ``explore`` (``ATTNRES_HYPOTHESIS=explore`` or ``--hypothesis-profile=explore``): random
  seeds (``--hypothesis-seed=N`` repeats one) and :data:`EXPLORE_FACTOR` times each
  property's examples; failures are kept in ``.hypothesis/`` and replayed first next time.

Both print the reproduction blob of a failure (``@reproduce_failure``).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

#: How many times its own ``max_examples`` a property runs under ``explore``.
EXPLORE_FACTOR = 10
_PLAIN_EXAMPLES = 100  # (hypothesis's default max_examples: a property's own count is for it)

#: The environment variable naming the profile (``--hypothesis-profile`` overrides it).
PROFILE_VARIABLE = "ATTNRES_HYPOTHESIS"

_COMMON = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deterministic", derandomize=True, **_COMMON)
settings.register_profile("explore", derandomize=False, max_examples=EXPLORE_FACTOR * _PLAIN_EXAMPLES, **_COMMON)


def load() -> str:
    """Load the profile :data:`PROFILE_VARIABLE` names (``deterministic`` when unset; hypothesis
    itself would load its ``ci`` profile where ``CI`` is set). Returns its name."""
    name = os.environ.get(PROFILE_VARIABLE) or "deterministic"
    if name not in ("deterministic", "explore"):
        raise ValueError(f"{PROFILE_VARIABLE}={name!r}: the test profiles are 'deterministic' (the default) "
                         "and 'explore'")
    settings.load_profile(name)
    return name


def examples(n: int) -> int:
    """A property's ``max_examples``: ``n`` under the default profile, scaled by the loaded
    profile's ``max_examples`` (``explore``: :data:`EXPLORE_FACTOR` x ``n``). Read when the test
    module is imported, after ``--hypothesis-profile`` has been applied."""
    return max(1, n * settings().max_examples // _PLAIN_EXAMPLES)
