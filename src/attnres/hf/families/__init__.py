"""AttnRes models built from a ``transformers`` decoder family's own modules (needs
``transformers``): what a ``ModelConfig`` with ``hf_architecture`` describes.

* :mod:`~attnres.hf.families.layout` - the supported families and where their pre-norms
  (and a mixture of experts' router) are;
* :mod:`~attnres.hf.families.moe` - a mixture of experts' routers and what they chose in a
  forward (:class:`RouterRecorder`, for the expert-load analysis);
* :mod:`~attnres.hf.families.modeling` - what the AttnRes version of a family's config and
  causal LM add (the mixins), and the decoder layers' AttnRes forward;
* :mod:`~attnres.hf.families.classes` - the ``AttnRes<Family>`` config and causal-LM classes,
  written out (:func:`upcycled_classes`), and :func:`register_families`, which
  registers them with the ``transformers`` Auto classes (``attnres.hf`` calls it when
  imported; nothing here does at import);
* :mod:`~attnres.hf.families.build` - ``ModelConfig`` <-> family config:
  :func:`build_hf_model` (a fresh model) and :func:`model_fields_from_directory`
  (``model.from_hf=DIR``).

Converting a pretrained family checkpoint is :mod:`attnres.hf.upcycle`'s, on top of these; the
torch-only core reaches these through :mod:`attnres.models.hf_registry`.
"""

from .build import build_hf_model, check_hf_config, hf_config_of, model_fields_from_directory, model_fields_of
from .layout import CHECKED_WITH, FAMILIES, REFUSED, Layout, Router, family_of, layout_of
from .moe import RouterRecorder, moe_routers
from .classes import CLASSES, name_causal_lm, register_families, upcycled_classes, upcycled_config
from .modeling import PREFIX, UpcycledModelMixin, init_missing_tensors, offload, onload

__all__ = [
    "CHECKED_WITH",
    "CLASSES",
    "FAMILIES",
    "PREFIX",
    "REFUSED",
    "Layout",
    "Router",
    "RouterRecorder",
    "UpcycledModelMixin",
    "build_hf_model",
    "check_hf_config",
    "family_of",
    "hf_config_of",
    "init_missing_tensors",
    "layout_of",
    "model_fields_from_directory",
    "model_fields_of",
    "moe_routers",
    "name_causal_lm",
    "offload",
    "onload",
    "register_families",
    "upcycled_classes",
    "upcycled_config",
]
