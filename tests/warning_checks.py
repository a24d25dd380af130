"""What a call warns of, for the tests of warnings. A module of its own, not the suite's
``conftest.py``: ``tests/serve`` imports ``test_train``'s helpers, where ``conftest`` is
``tests/serve/conftest.py`` (``from conftest import warned`` failed the serving suite)."""

from __future__ import annotations

import warnings


def warned(call, containing: str) -> list[str]:
    """The messages of the warnings ``call()`` gives, every one (``"always"``), that hold ``containing``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if containing in str(w.message)]
