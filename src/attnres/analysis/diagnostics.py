"""Training diagnostics (report Fig. 5 and Fig. 8).

* **Output magnitude per transformer block** (Fig. 5b): the RMS over batch, positions and
  channels of the block's output ``v_attn + v_mlp`` - the sum of the raw outputs of its two
  sublayers, i.e. what the block adds to a standard residual stream. We also record the RMS
  of the hidden state *entering* each block (the input of its attention sublayer's norm):
  under PreNorm it grows with depth (PreNorm dilution), under AttnRes it stays bounded.
* **Gradient magnitude per transformer block** (Fig. 5c): the L2 norm of the gradient of all
  the block's parameters together (attention, MLP and both pre-norm gains), before clipping.
* **Depth-attention weights** (Fig. 8): for every sublayer and the output aggregation, the
  mean over batch and positions of its softmax weights over the sources.
* **Depth-attention entropy**: for every sublayer and the output aggregation, the mean over
  batch and positions of the entropy (nats) of each position's weights over the sources - 0
  when each position takes one source, ``log(sources)`` when it spreads evenly. The entropy of
  the mean weights would hide positions that each pick one source, but different ones.
* **Expert load** (mixture-of-experts family models only): per MoE layer, the share of the
  routing assignments each expert received (:mod:`attnres.analysis.experts`), with its
  normalised entropy and the busiest expert's load over an even one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..models.hf_registry import hf_hook
from ..nn.compiled import uncompiled
from ..nn.norm import norm_input_value
from .mixing import OWN_MODEL_WAY, refuse_wrapper


def _rms(x: Tensor) -> float:
    return x.detach().float().pow(2).mean().sqrt().item()


def _blocks(model: nn.Module) -> list[tuple[nn.Module, nn.Module, nn.Module, nn.Module]]:
    """Per transformer block ``(block, attention, mlp, attention pre-norm)``: the native
    decoder's names, or a ``transformers`` family's (``attnres.upcycle``: ``model.layers``
    and the names of the family's layout)."""
    if hasattr(model, "layers") and all(hasattr(layer, a) for layer in model.layers for a in ("attn", "mlp", "attn_norm")):
        return [(layer, layer.attn, layer.mlp, layer.attn_norm) for layer in model.layers]
    if not hasattr(getattr(model, "config", None), "model_type"):  # (a model of the user's own: an AttributeError
        # on 'config', or on a layer's 'attn', from inside the hooks' set-up)
        refuse_wrapper(model, "the block diagnostics")
        raise TypeError(f"the block diagnostics run AttnResLM, the attnres.hf models and transformers models of "
                        f"attnres.upcycle, whose blocks' attn, mlp and attn_norm they hook; got {type(model).__name__}; "
                        f"{OWN_MODEL_WAY}, and a forward hook on each of your sublayers gives its output")
    x = hf_hook("layout_of")(hf_hook("family_of")(model.config.model_type))
    return [(layer, getattr(layer, x.attn), getattr(layer, x.mlp), getattr(layer, x.attn_norm)) for layer in model.model.layers]


def depth_entropy(weights: Tensor) -> float:
    """The mean over batch and positions of the entropy (nats) of ``weights [sources, B, T]``
    (one mixer's depth-attention weights, as ``return_depth_weights`` gives them) over the
    sources; ``0 log 0 = 0``. Weights that do not sum to 1 over dim 0 (sources last, logits,
    a mixing matrix's rows) are refused: their "entropy" was a number all the same."""
    return _entropy(_one_mixers_weights(weights))


def _entropy(weights: Tensor) -> float:
    """:func:`depth_entropy` unchecked: what :func:`forward_diagnostics` logs, for every
    variant - the ablation ``sigmoid_weights`` (report Table 4) records weights that do not
    sum to 1, and a refusal there ended its training run at its first diagnostics step."""
    w = weights.detach().double()
    return float(-torch.special.xlogy(w, w).sum(0).mean()) + 0.0  # + 0.0: one source gives -0.0


#: How far from 1 a position's weights may sum: softmax in float32 is within ~1e-6; a bf16 copy within ~1e-2.
_WEIGHT_SUM_ATOL = 2e-2


def _one_mixers_weights(weights: Any) -> Tensor:
    """``weights`` as :func:`depth_entropy` reads them, ``[sources, ...]`` summing to 1 over
    the sources, else ``ValueError`` naming the fix. ``state.weights`` (every mixer's, a list)
    failed in "'list' object has no attribute 'detach'"; weights with the sources last
    (``[B, T, sources]``, as a plot takes them) gave an entropy over the batch, silently."""
    if isinstance(weights, (list, tuple)):
        raise ValueError(f"depth_entropy takes one mixer's weights [n_sources, ...], got a {type(weights).__name__} of "
                         f"{len(weights)} (every mixer's, as state.weights or depth_weights hold them): call it on each, "
                         "[depth_entropy(w) for w in weights]")
    if not isinstance(weights, Tensor) or weights.dim() < 1 or not weights.is_floating_point():
        got = f"{weights.dtype} {tuple(weights.shape)}" if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"depth_entropy takes one mixer's weights, a floating-point tensor [n_sources, ...], got {got}")
    sums = weights.detach().double().sum(0)
    if sums.numel() and not bool(((sums - 1).abs() <= _WEIGHT_SUM_ATOL).all()):
        raise ValueError(f"depth_entropy takes one mixer's weights [n_sources, ...] summing to 1 over the sources (dim "
                         f"0); those given {tuple(weights.shape)} sum to {float(sums.min()):.4g} .. "
                         f"{float(sums.max()):.4g} over dim 0: sources last ([..., n_sources])? pass "
                         "weights.movedim(-1, 0); logits? pass their softmax over the sources")
    return weights


def _first(out):
    """A module's output tensor (attention modules of ``transformers`` return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def block_grad_norms(model: nn.Module) -> list[float]:
    """L2 norm of each transformer block's parameter gradients (0 where none exist). With
    FSDP2 the gradients are sharded DTensors: they are gathered (a collective, so every rank
    must call this)."""
    from torch.distributed.tensor import DTensor

    norms = []
    for layer, *_ in _blocks(model):
        grads = [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().float()
                 for p in layer.parameters() if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item() if grads else 0.0)
    return norms


@torch.no_grad()
def forward_diagnostics(model: nn.Module, input_ids: Tensor) -> dict[str, Any]:
    """One no-grad forward of ``model`` (an :class:`~attnres.AttnResLM`, or a family model of
    ``attnres.upcycle``) on ``input_ids`` that records per-block output and input RMS and the
    mean depth weights.

    Returns ``block_output_rms`` and ``block_input_rms`` (one float per transformer block)
    and ``depth_weights`` (one list of per-source means per sublayer, then the output
    aggregation) with ``depth_entropy`` (per sublayer, then the output aggregation: see
    :func:`depth_entropy`), both ``None`` for a residual without depth attention; for a
    mixture-of-experts family model also ``expert_load``, per MoE layer ``{"layer",
    "fraction"}``, and per MoE layer ``expert_load_entropy`` and ``expert_max_load`` (see
    :mod:`attnres.analysis.experts`). Touches no random state.
    """
    # torch.compile's wrapper runs the module it wraps: calling the wrapper would trace the model
    # again with the hooks below in it (a recompilation, and graph breaks at each hook's .item())
    model = uncompiled(model)
    outputs: dict[int, list[Tensor]] = {}
    inputs: dict[int, float] = {}
    handles = []
    blocks = _blocks(model)
    for b, (_, attn, mlp, attn_norm) in enumerate(blocks):
        def keep_output(_m, _args, out, b=b):
            outputs.setdefault(b, []).append(_first(out).detach().float())

        def keep_input(_m, args, b=b):  # on the fused-kernel path the norm's input is not a tensor yet
            inputs[b] = _rms(norm_input_value(args[0]))

        handles += [attn.register_forward_hook(keep_output), mlp.register_forward_hook(keep_output),
                    attn_norm.register_forward_pre_hook(keep_input)]
    was_training = model.training
    model.eval()
    routers = None  # a family model's RouterRecorder
    try:
        if hasattr(model, "depth_weights_if_any"):  # a family model: it records through its own call
            with hf_hook("router_recorder")(model) as routers:
                recorded = model.depth_weights_if_any(input_ids, use_cache=False)
        else:
            recorded = model(input_ids, return_depth_weights=True).depth_weights
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    n = len(blocks)
    out = {
        "block_output_rms": [_rms(outputs[b][0] + outputs[b][1]) for b in range(n)],
        "block_input_rms": [inputs[b] for b in range(n)],
        "depth_weights": [w.float().mean(dim=(1, 2)).tolist() for w in recorded] if recorded else None,
        "depth_entropy": [_entropy(w) for w in recorded] if recorded else None,
    }
    if routers is not None and routers.routers:
        from .experts import recorded_expert_load

        loads = recorded_expert_load(routers)
        out["expert_load"] = [{"layer": x.layer, "fraction": x.fraction} for x in loads]
        out["expert_load_entropy"] = [x.entropy for x in loads]
        out["expert_max_load"] = [x.max_load for x in loads]
    return out
