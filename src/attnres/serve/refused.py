"""The architectures of upcycled families the plugin does not serve yet
(:func:`attnres.serve.families.unserved_families`), refused when vLLM looks their class up.

:func:`attnres.serve.register` points each such ``AttnRes<Family>ForCausalLM`` here; vLLM
imports the class by name when it inspects the model (before any engine or weight is set
up), and this module's ``__getattr__`` raises :class:`UnservedFamily` naming the family and
the reason. vLLM logs it and stops with "Model architectures [...] failed to be inspected".
No vLLM is imported here.
"""

from __future__ import annotations

from ..models.families import upcycled_classes
from .families import unserved_families

__all__ = ["UnservedFamily", "refusal"]


class UnservedFamily(NotImplementedError):
    """An ``attnres upcycle`` directory of a family the vLLM plugin does not serve yet."""


def refusal(architecture: str) -> str | None:
    """The message refusing ``architecture`` (an ``AttnRes<Family>ForCausalLM`` name), or
    ``None`` if it is not an unserved family's."""
    for model_type, reason in unserved_families().items():
        if upcycled_classes(model_type)[1].__name__ == architecture:
            return (f"attnres.serve: {architecture} (the upcycled {model_type!r} family, a mixture of experts) is not "
                    f"served on vLLM yet: {reason}. Run it with transformers (AutoModelForCausalLM.from_pretrained "
                    "after `import attnres.hf`); docs/serving.md lists the served families")
    return None


def __getattr__(name: str):
    message = refusal(name)
    if message is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raise UnservedFamily(message)
