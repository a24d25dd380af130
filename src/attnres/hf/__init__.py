"""Hugging Face integration (needs ``transformers``: the ``hf`` extra, ``pip install -e ".[hf]"``).

``AttnResConfig`` (model_type ``"attnres"``), ``AttnResModel`` and ``AttnResForCausalLM``,
registered with ``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM`` by
:func:`register` - which importing this module calls (``import attnres.hf``), together with
the AttnRes versions of the supported transformers families - so a saved directory loads
with ``AutoModelForCausalLM.from_pretrained(path)`` and no ``trust_remote_code``.
``export_checkpoint`` writes a training checkpoint as such a directory; ``upcycle`` is
:func:`attnres.upcycle.upcycle`.
"""

from ..models.families import register_families
from ..upcycle import upcycle
from .configuration import AttnResConfig
from .export import export_checkpoint, load_native_checkpoint, make_hf_tokenizer
from .modeling import AttnResForCausalLM, AttnResModel, AttnResPreTrainedModel, HFCacheAdapter


def register() -> None:
    """Register the classes with the transformers Auto factories (idempotent)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    AutoConfig.register(AttnResConfig.model_type, AttnResConfig, exist_ok=True)
    AutoModel.register(AttnResConfig, AttnResModel, exist_ok=True)
    AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)
    register_families()  # the AttnRes versions of the supported transformers families


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
