"""AttnRes for the user's own Hugging Face decoder (needs ``transformers``).

``upcycle(model, residual="attnres_block", block_size=None)`` turns a pretrained causal LM of
a supported family - dense or mixture of experts - into an AttnRes model that computes the
same function at conversion (docs/upcycling.md). The generated ``AttnRes<Family>`` classes are
models (:mod:`attnres.hf.families`, which also serve training those architectures from
scratch with AttnRes); importing this module registers them with the ``transformers`` Auto
classes.
"""

from ..families import (
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
    upcycled_classes,
    upcycled_config,
)
from .convert import upcycle

register_families()

__all__ = [
    "upcycle",
    "upcycled_classes",
    "upcycled_config",
    "register_families",
    "init_missing_tensors",
    "layout_of",
    "family_of",
    "Layout",
    "Router",
    "CHECKED_WITH",
    "moe_routers",
    "RouterRecorder",
    "FAMILIES",
    "REFUSED",
    "PREFIX",
]
