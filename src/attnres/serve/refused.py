"""The architectures of upcycled families the plugin does not serve
(:func:`attnres.serve.families.unserved_families`, and any whose classes the installed vLLM
lacks: :func:`attnres.serve.upcycled.served_class`), refused when vLLM builds the model.

:func:`attnres.serve.register` points each such ``AttnRes<Family>ForCausalLM`` here; this
module's ``__getattr__`` gives vLLM a class that passes its inspection (it has the methods
and signatures of a text-generation model) and whose constructor raises
:class:`UnservedFamily`, naming the family and the reason - the first thing the engine does
with it, before any weight is read. The refusal is so the last error vLLM reports before its
own "Engine core initialization failed" (raising while vLLM inspects the class would bury it
under the inspection's generic "failed to be inspected"), and vLLM neither says
"architecture not supported" nor falls back to its Transformers backend. Only torch is
imported here, no vLLM.
"""

from __future__ import annotations

import functools

from ..hf.families import upcycled_classes
from .families import unserved_families

__all__ = ["UnservedFamily", "refusal", "refusing_class"]


class UnservedFamily(NotImplementedError):
    """An ``attnres upcycle`` directory of a family the vLLM plugin does not serve."""


def refusal(architecture: str) -> str | None:
    """The message refusing ``architecture`` (an ``AttnRes<Family>ForCausalLM`` name), or
    ``None`` if it is not an unserved family's."""
    for model_type, reason in unserved_families().items():
        if upcycled_classes(model_type)[1].__name__ == architecture:
            return (f"attnres.serve: {architecture} (the upcycled {model_type!r} family) is not served on vLLM: "
                    f"{reason}. Run it with transformers (AutoModelForCausalLM.from_pretrained after "
                    "`import attnres.hf`); docs/serving.md lists the served families")
    return None


def refusing_class(architecture: str, message: str | None = None) -> type:
    """A vLLM text-generation model class named ``architecture`` whose constructor raises
    :class:`UnservedFamily` with ``message`` (default :func:`refusal`'s, for an unserved
    family; one class per architecture and message)."""
    if message is None:
        message = refusal(architecture)
        if message is None:
            raise ValueError(f"{architecture} is not the architecture of an unserved family")
    return _refusing_class(architecture, message)


@functools.cache
def _refusing_class(architecture: str, message: str) -> type:
    from torch import nn

    class Refused(nn.Module):
        def __init__(self, *, vllm_config=None, prefix: str = "") -> None:
            raise UnservedFamily(message)

        # What vLLM's inspection looks for in a text-generation model (never called).
        def embed_input_ids(self, input_ids):
            raise UnservedFamily(message)

        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
            raise UnservedFamily(message)

        def compute_logits(self, hidden_states):
            raise UnservedFamily(message)

    Refused.__name__ = Refused.__qualname__ = architecture
    Refused.__module__, Refused.__doc__ = __name__, message
    return Refused


def __getattr__(name: str) -> type:
    if refusal(name) is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return refusing_class(name)
