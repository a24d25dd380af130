"""``from attnres.upcycle import upcycle``: the documented path of :mod:`attnres.hf.upcycle`
(exact upcycling of a pretrained transformers decoder; needs ``transformers``), re-exported.
Importing it registers the AttnRes families with the ``transformers`` Auto classes."""

from .hf.upcycle import (
    CHECKED_WITH,
    FAMILIES,
    PREFIX,
    REFUSED,
    Layout,
    Router,
    RouterRecorder,
    family_of,
    init_missing_tensors,
    layout_of,
    moe_routers,
    register_families,
    upcycle,
    upcycled_classes,
    upcycled_config,
)
from .hf.upcycle import __all__  # noqa: F401 - the same public names
