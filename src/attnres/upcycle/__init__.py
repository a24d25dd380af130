"""AttnRes for the user's own Hugging Face decoder (needs ``transformers``).

``upcycle(model, residual="attnres_block", block_size=None)`` turns a pretrained causal LM of
a supported family - dense or mixture of experts - into an AttnRes model that computes the same function at conversion
(docs/upcycling.md); the generated ``AttnRes<Family>`` classes also serve training those
architectures from scratch with AttnRes. Importing this module registers them with the
``transformers`` Auto classes.
"""

from .convert import upcycle
from .families import CHECKED_WITH, FAMILIES, REFUSED, Layout, Router, family_of, layout_of
from .moe import RouterRecorder, moe_routers
from .modeling import PREFIX, init_missing_tensors, register_families, upcycled_classes, upcycled_config

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
