"""The transformers wing: everything of attnres that needs ``transformers`` (the ``hf`` extra,
``pip install -e ".[hf]"``), serving none of it to the torch-only core except through
:mod:`attnres.models.hf_registry`, which importing this package fills.

* :mod:`.configuration`, :mod:`.modeling` - the native model as a transformers model;
  :mod:`.export` and :mod:`.evaluate` - writing a checkpoint as one, evaluating one;
* :mod:`.families` - AttnRes models built from a transformers decoder family's own modules
  (``ModelConfig.hf_architecture``, ``model.from_hf``);
* :mod:`.upcycle` - converting a pretrained family checkpoint (also ``attnres.upcycle``).


``AttnResConfig`` (model_type ``"attnres"``), ``AttnResModel`` and ``AttnResForCausalLM``,
registered with ``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM`` by
:func:`register` - which importing this module calls (``import attnres.hf``), together with
the AttnRes versions of the supported transformers families - so a saved directory loads
with ``AutoModelForCausalLM.from_pretrained(path)`` and no ``trust_remote_code``.
``export_checkpoint`` writes a training checkpoint as such a directory; ``upcycle`` is
:func:`attnres.upcycle.upcycle`.
"""

from ..extras import require_extra

require_extra("hf", "transformers", "attnres.hf")  # (before the modules below, which import it)

from ..models.hf_registry import register_hf_hooks
from .families import (RouterRecorder, build_hf_model, check_hf_config, family_of, layout_of, model_fields_from_directory,
                       name_causal_lm, register_families)
from .upcycle import upcycle
from .configuration import AttnResConfig
from .export import export_checkpoint, load_native_checkpoint, make_hf_tokenizer
from .modeling import AttnResForCausalLM, AttnResModel, AttnResPreTrainedModel, HFCacheAdapter


def register() -> None:
    """Register the classes with the transformers Auto factories (idempotent)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    AutoConfig.register(AttnResConfig.model_type, AttnResConfig, exist_ok=True)
    AutoModel.register(AttnResConfig, AttnResModel, exist_ok=True)
    AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)
    name_causal_lm(AttnResConfig, AttnResForCausalLM)
    register_families()  # the AttnRes versions of the supported transformers families
    register_hf_hooks(build_model=build_hf_model, check_config=check_hf_config,
                      fields_from_directory=model_fields_from_directory, layout_of=layout_of, family_of=family_of,
                      router_recorder=RouterRecorder)


register()


__all__ = [
    "AttnResConfig",
    "AttnResModel",
    "AttnResForCausalLM",
    "AttnResPreTrainedModel",
    "HFCacheAdapter",
    "register",
    "export_checkpoint",
    "load_native_checkpoint",
    "make_hf_tokenizer",
    "upcycle",
]
