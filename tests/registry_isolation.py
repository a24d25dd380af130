"""A pytest plugin (the suite's ``conftest.py`` takes its fixture): each test sees the residual
registry as attnres's own variants plus those its own module registered - never a variant
another test module registered in the same process (``make test`` runs many modules in one
xdist worker; a test compiling "every registered residual" once built another module's
variant that wanted an option). What a test registers is gone after it."""

from __future__ import annotations

import pytest

from attnres.nn.residual import registry


@pytest.fixture(autouse=True)
def _residual_registry_of_this_module(request):
    """For the test: the built-in variants and the classes of the test's module (registered
    when it was imported, or by its module fixtures); afterwards the registry as it was before
    the test (so each module still finds what it registered on import)."""
    entries = registry._REGISTRY
    before = dict(entries)
    module = getattr(request.module, "__name__", None)
    entries.clear()
    entries.update({name: cls for name, cls in before.items() if cls.builtin() or cls.__module__ == module})
    yield
    entries.clear()
    entries.update(before)
