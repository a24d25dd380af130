"""``from attnres.upcycle import upcycle``: the documented path of :mod:`attnres.hf.upcycle`
(exact upcycling of a pretrained transformers decoder; needs ``transformers``), re-exported
whole. Importing it registers the AttnRes families with the ``transformers`` Auto classes."""

from .hf.upcycle import *  # noqa: F403 - the same public names, listed in attnres.hf.upcycle.__all__
from .hf.upcycle import __all__  # noqa: F401
