"""What the served models share (imports vLLM): the residual stream over vLLM's decoder
layers, the checks of what vLLM can run, and the compile decorator's settings.

vLLM batches the tokens of all scheduled requests flat - prefill chunks and decode steps of
different sequences side by side, ``[num_tokens, d]`` - and only its ``Attention`` layer
knows which token belongs to which sequence (it reads and writes the paged KV cache). The
residual needs nothing of that: depth attention mixes the sublayer outputs of each token on
its own, so the flat token dimension is just the ``...`` of the residual's ``[..., d]``
tensors, and continuous batching, chunked prefill and prefix caching work unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor, nn
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.attention import Attention

from ..nn.residual import ResidualConfig, ResidualStream, build_residual
from ..models.families.layout import Layout

__all__ = ["SublayerNames", "DYNAMIC_ARG_DIMS", "serving_residual", "run_decoder", "check_servable"]

#: ``@support_torch_compile``: the token dimension of the model body's inputs is dynamic.
DYNAMIC_ARG_DIMS = {"input_ids": 0, "positions": 0, "intermediate_tensors": 0, "inputs_embeds": 0}


@dataclass(frozen=True)
class SublayerNames:
    """Where a decoder layer keeps its two sublayers: the modules ``attention``
    (``(positions=, hidden_states=)``) and ``mlp``, and the norms around them (``layout``)."""

    attention: str
    mlp: str
    layout: Layout


def serving_residual(config: ResidualConfig, dim: int, n_sublayers: int) -> ResidualStream:
    """The residual module ``config`` describes, on its PyTorch backends: vLLM compiles the
    model body (its inductor fuses the residual's elementwise work like any other), and the
    fused kernels of :mod:`attnres.kernels` serve training. Same function, same parameters."""
    return build_residual(ResidualConfig.from_value({**config.to_dict(), "kernels": "torch"}), dim, n_sublayers)


def _sublayer(layer: nn.Module, names: SublayerNames, attention: bool, positions: Tensor, h: Tensor) -> Tensor:
    layout = names.layout
    if attention:
        x = getattr(layer, layout.attn_norm)(h)
        out = getattr(layer, names.attention)(positions=positions, hidden_states=x)
        post = layout.attn_post
    else:
        out = getattr(layer, names.mlp)(getattr(layer, layout.mlp_norm)(h))
        post = layout.mlp_post
    return out if post is None else getattr(layer, post)(out)


def run_decoder(residual: ResidualStream, layers: Iterable[nn.Module], names: SublayerNames, positions: Tensor,
                embedding: Tensor) -> Tensor:
    """The decoder layers on the residual stream: ``embedding [num_tokens, d]`` (after any
    scaling) -> the output aggregation ``[num_tokens, d]``, before the final norm. Each
    sublayer (its pre-norm, module and optional output norm) reads its input from the
    residual and hands its raw output back (report §3)."""
    state = residual.start(embedding)
    for i, layer in enumerate(layers):
        for l, attention in ((2 * i, True), (2 * i + 1, False)):
            h = residual.sublayer_input(state, l)
            residual.add_output(state, l, _sublayer(layer, names, attention, positions, h))
    return residual.finish(state)


def check_servable(model: nn.Module, config_file: str) -> None:
    """Refuse, with the reason, what the served AttnRes models cannot run: pipeline
    parallelism (the residual carries several depth sources between stages, vLLM's
    intermediate tensors one), and a head size the selected attention backend does not
    support (vLLM's CPU attention takes a fixed list) - checked when the model is built,
    before any weight is read."""
    if get_pp_group().world_size > 1:
        raise NotImplementedError(
            f"{config_file}: AttnRes models do not run under pipeline parallelism in vLLM (the residual stream carries "
            "the block sums between layers, not one hidden state); use tensor parallelism (--tensor-parallel-size)")
    for name, module in model.named_modules():
        if isinstance(module, Attention) and not module.attn_backend.supports_head_size(module.head_size):
            backend = module.attn_backend
            raise ValueError(
                f"{config_file}: head size {module.head_size} (hidden size / attention heads, or head_dim) is not "
                f"supported by vLLM's {backend.get_name()} attention backend, which takes head sizes "
                f"{backend.get_supported_head_sizes()} ({name})")
