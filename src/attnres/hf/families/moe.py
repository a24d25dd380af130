"""The routers of a mixture-of-experts family model, plain or AttnRes, and what they decide.

:func:`moe_routers` finds them from the family's :class:`~attnres.hf.families.layout.Router`
description; :class:`RouterRecorder` records, during forwards, each router's logits and the
experts it selected (every supported router returns ``(logits, weights, selected)``, but
GraniteMoE's in transformers 5.20 - the newest on Python 3.10 - ``(selected, weights, logits)``).
"""

from __future__ import annotations

from torch import Tensor, nn

from .layout import FAMILIES, family_of

__all__ = ["moe_routers", "RouterRecorder"]


def moe_routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(decoder layer index, router module)`` of every MoE layer of ``model``, a causal
    LM of a supported family (plain or AttnRes); ``[]`` for dense families and for models
    that are not a supported family's."""
    config = getattr(model, "config", None)
    layout = FAMILIES.get(family_of(getattr(config, "model_type", None) or ""))
    if layout is None or layout.router is None:
        return []
    out = []
    for i, layer in enumerate(model.model.layers):
        try:
            out.append((i, layer.get_submodule(layout.router.path)))
        except AttributeError:  # a dense layer (first_k_dense_replace, mlp_only_layers)
            continue
    return out


class RouterRecorder:
    """Records what the routers of ``model`` decide in the forwards run inside ``with``.

    ``logits[layer]`` / ``selected[layer]``: per forward, the router logits ``[tokens,
    n_experts]`` and the selected experts ``[tokens, top_k]`` of that decoder layer (detached).
    """

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        self.logits: dict[int, list[Tensor]] = {}
        self.selected: dict[int, list[Tensor]] = {}
        self._handles: list = []

    def __enter__(self) -> RouterRecorder:
        for layer, router in self.routers:
            def keep(_module, _args, out, layer=layer):
                logits, selected = (out[2], out[0]) if out[2].is_floating_point() else (out[0], out[2])
                self.logits.setdefault(layer, []).append(logits.detach())
                self.selected.setdefault(layer, []).append(selected.detach())

            self._handles.append(router.register_forward_hook(keep))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
