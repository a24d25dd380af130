"""Hugging Face integration (needs ``transformers``; ``pip install attnres[hf]``).

``AttnResConfig`` (model_type ``"attnres"``), ``AttnResModel`` and ``AttnResForCausalLM``,
registered with ``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM`` by
:func:`register` - which ``import attnres`` calls when transformers is installed - so a
saved directory loads with ``AutoModelForCausalLM.from_pretrained(path)`` and no
``trust_remote_code``. Importing this module registers them. ``export`` writes a training checkpoint as such a directory.
"""

from ..upcycle.modeling import register_families
from .configuration import AttnResConfig
from .export import export_checkpoint, load_native_checkpoint, make_hf_tokenizer
from .modeling import AttnResForCausalLM, AttnResModel, AttnResPreTrainedModel, HFCacheAdapter


def register() -> None:
    """Register the classes with the transformers Auto factories (idempotent)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    AutoConfig.register(AttnResConfig.model_type, AttnResConfig, exist_ok=True)
    AutoModel.register(AttnResConfig, AttnResModel, exist_ok=True)
    AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)
    register_families()  # the AttnRes versions of the supported transformers families (attnres.upcycle)


def __getattr__(name: str):
    # attnres.hf.upcycle, without importing attnres.upcycle's package while it may be
    # importing transformers (which imports this module through attnres's import hook)
    if name == "upcycle":
        from ..upcycle.convert import upcycle

        return upcycle
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
