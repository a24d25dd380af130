"""Expert load of mixture-of-experts models: how evenly each MoE layer's router spreads the
tokens over its experts.

For one MoE layer over ``N`` tokens routed top-``k`` to ``E`` experts, ``fraction[e]`` is the
share of the ``N k`` routing assignments that expert ``e`` received (the fractions sum to 1;
an even router gives each ``1 / E``). Two summaries:

* ``entropy``: the normalised entropy ``-sum_e f_e log f_e / log E``, 1 for an even load,
  0 when every token goes to the same ``k = 1`` expert;
* ``max_load``: ``E max_e f_e``, the busiest expert's load relative to an even one (1 when
  even; what capacity-limited expert parallelism must provision for).

The routers are the family's own (``attnres.hf.families.layout``); their selections are
recorded with forward hooks, so the numbers are the model's actual routing decisions,
group limits and bias corrections (DeepSeek-V3) included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..models.hf_registry import hf_hook

__all__ = ["ExpertLoad", "expert_load", "load_of_selections", "expert_load_table", "recorded_expert_load"]


@dataclass
class ExpertLoad:
    """The expert load of one MoE layer (see the module docstring).

    layer: the decoder layer (0-based); its MLP is sublayer ``2 * layer + 2`` (1-based).
    fraction: per expert, its share of the routing assignments.
    tokens: the tokens routed; top_k: experts per token.
    """

    layer: int
    fraction: list[float]
    tokens: int
    top_k: int

    @property
    def n_experts(self) -> int:
        return len(self.fraction)

    @property
    def entropy(self) -> float:
        h = -sum(f * math.log(f) for f in self.fraction if f > 0)
        return h / math.log(self.n_experts) if self.n_experts > 1 else 1.0

    @property
    def max_load(self) -> float:
        return self.n_experts * max(self.fraction)

    @property
    def idle(self) -> int:
        """Experts that received no token."""
        return sum(f == 0 for f in self.fraction)

    def to_dict(self) -> dict:
        return {"layer": self.layer, "fraction": self.fraction, "tokens": self.tokens, "top_k": self.top_k,
                "entropy": self.entropy, "max_load": self.max_load, "idle": self.idle}


def load_of_selections(layer: int, selected: list[Tensor], n_experts: int) -> ExpertLoad:
    """The :class:`ExpertLoad` of ``selected``, a layer's selected experts ``[tokens, top_k]``
    from one or more forwards."""
    picks = torch.cat([s.reshape(-1, s.shape[-1]) for s in selected])
    counts = torch.bincount(picks.reshape(-1).long(), minlength=n_experts).double()
    return ExpertLoad(layer, (counts / counts.sum()).tolist(), picks.shape[0], picks.shape[1])


def recorded_expert_load(recorder) -> list[ExpertLoad]:
    """The expert load of every MoE layer over the forwards a
    :class:`~attnres.hf.families.moe.RouterRecorder` recorded."""
    return [load_of_selections(layer, recorder.selected[layer], recorder.logits[layer][0].shape[-1])
            for layer, _ in recorder.routers if layer in recorder.selected]


@torch.no_grad()
def expert_load(model: nn.Module, input_ids: Tensor, batch_size: int = 8) -> list[ExpertLoad]:
    """The expert load of every MoE layer of ``model`` (a mixture-of-experts causal LM of a
    supported family, plain or AttnRes) over ``input_ids [B, T]``, in eval mode (routers
    without jitter), ``batch_size`` rows per forward. ``[]`` for a dense model."""
    was_training = model.training
    model.eval()
    try:
        with hf_hook("router_recorder")(model) as rec:
            for rows in input_ids.split(batch_size):
                model(rows, use_cache=False)
    finally:
        model.train(was_training)
    return recorded_expert_load(rec)


def expert_load_table(models: list[tuple[str, list[ExpertLoad]]],
                      depth_weights: dict[str, dict[int, list[float] | None]] | None = None) -> str:
    """A markdown table: per model and MoE layer, the normalised entropy, the busiest
    expert's relative load, the idle experts, optionally the depth weights into the layer's
    MLP (``depth_weights[model][layer]``: the mean weight of each source) and the per-expert
    fractions."""
    weights = depth_weights or {}
    extra = ("depth weights into the MLP | ", "---|") if weights else ("", "")
    lines = [f"| model | layer | experts (top-k) | entropy | max load | idle | {extra[0]}fraction per expert |",
             f"|---|---:|---:|---:|---:|---:|{extra[1]}---|"]
    for name, loads in models:
        for x in loads:
            w = weights.get(name, {}).get(x.layer)
            cell = (("—" if w is None else " ".join(f"{v:.3f}" for v in w)) + " | ") if weights else ""
            lines.append(f"| {name} | {x.layer} | {x.n_experts} ({x.top_k}) | {x.entropy:.4f} | {x.max_load:.3f} | "
                         f"{x.idle} | {cell}{' '.join(f'{f:.3f}' for f in x.fraction)} |")
    return "\n".join(lines)
