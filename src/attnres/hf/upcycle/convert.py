"""``upcycle``: a pretrained ``transformers`` causal LM as an AttnRes model, the same function."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from transformers import PreTrainedModel

from ...models.config import residual_fields_given, warn_unread_residual_fields
from ...nn.residual import ResidualConfig, validate_residual_config
from ...nn.residual.block import naming_block_size
from ...nn.residual.config import merge_residual
from ...shell_words import shell_path
from ..families import layout_of, upcycled_classes, upcycled_config

__all__ = ["check_upcycle_residual", "upcycle"]


#: The block size as upcycle names it, in the single block's warning: the field it sets and the command's flag.
UPCYCLE_BLOCK_SIZE = "model.residual.block_size (attnres upcycle's --block-size)"


@naming_block_size(UPCYCLE_BLOCK_SIZE)
def upcycle(
    model: PreTrainedModel,
    residual: str | dict[str, Any] | ResidualConfig = "attnres_block",
    block_size: int | None = None,
    *,
    exact_eps: bool = True,
    **settings: Any,
) -> PreTrainedModel:
    """The AttnRes version of ``model`` (a causal LM of a supported family, dense or mixture
    of experts: ``attnres.upcycle.FAMILIES``), around its own attention and MLP (or router
    and experts) modules.

    ``residual``: the variant (a registered name, a mapping of ``ResidualConfig`` fields or
    one); ``block_size`` and ``settings`` set ``ResidualConfig`` fields (``schedule``,
    ``backend``, ...). The residual starts at its faithful init - zero pseudo-queries, unit
    key-norm gains - where Full and Block AttnRes average each mixer's sources uniformly;
    with ``exact_eps`` every pre-norm and the final norm get ``eps / n^2`` for their ``n``
    sources, which makes the result the pretrained function up to rounding
    (docs/upcycling.md). ``model`` is left as it is: the result is a copy (same device and
    dtype), an ``AttnRes<Family>ForCausalLM`` that saves, loads and generates like the
    original. A field given that the variant does not read (``sinkhorn_iters`` of Block
    AttnRes) is warned of, as in a model config.
    """
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"upcycle takes a transformers causal LM, got {type(model).__name__}{_hint(model)}")
    model_type = model.config.model_type
    layout_of(model_type)  # refuses post-norm and unknown layouts with the reason
    config_cls, model_cls = upcycled_classes(model_type)
    family_cls = model_cls.__bases__[-1]  # (UpcycledModelMixin, the family's causal LM)
    if type(model) is not family_cls:
        raise ValueError(f"upcycle takes the family's causal LM ({family_cls.__name__}); got {type(model).__name__}")
    residual_config = _residual_config(residual, block_size, settings)
    if block_size is not None and residual_config.kind != "attnres_block":  # (it would be ignored)
        raise ValueError(f"block_size is Block AttnRes' S; residual {residual_config.kind!r} takes none (use "
                         "residual='attnres_block', the default)")
    # (upcycle(model, sinkhorn_iters=3) of Block AttnRes built the model as if it were not there, without a word)
    warn_unread_residual_fields(residual_fields_given({"residual": residual}) | residual_fields_given({"residual": settings}),
                                residual_config)
    new = copy.deepcopy(model)
    new.__class__ = model_cls
    _replace_config(new, upcycled_config(model.config, residual_config, exact_eps))
    new._attach_residual()
    new.residual.to(device=_residual_device(model), dtype=next(model.parameters()).dtype)
    return new


def _residual_config(residual: str | dict[str, Any] | ResidualConfig, block_size: int | None,
                     settings: dict[str, Any]) -> ResidualConfig:
    """The ``ResidualConfig`` :func:`upcycle` gives the model: ``residual`` with ``block_size``
    and ``settings`` set."""
    change = dict(settings)
    if block_size is not None:
        change["block_size"] = block_size
    return ResidualConfig.from_value(merge_residual(merge_residual(None, residual), change))


@naming_block_size(UPCYCLE_BLOCK_SIZE)
def check_upcycle_residual(config: Any, residual: str | dict[str, Any] | ResidualConfig, block_size: int | None = None,
                           **settings: Any) -> None:
    """Raise the ``ValueError`` :func:`upcycle` would raise for ``residual`` on the model of the
    transformers ``config`` (an option value the residual's ``__init__`` refuses, at the
    model's width and depth: ``validate_residual_config``, as the upcycled config runs it),
    from the config alone: ``attnres upcycle`` says it before the weights load (minutes for a
    large model). A config without ``hidden_size`` and ``num_hidden_layers`` is left to the
    conversion."""
    dim, layers = getattr(config, "hidden_size", None), getattr(config, "num_hidden_layers", None)
    if isinstance(dim, int) and isinstance(layers, int):
        validate_residual_config(_residual_config(residual, block_size, settings), dim, 2 * layers)


def _residual_device(model: PreTrainedModel) -> torch.device:
    """Where the residual goes: with the model's parameters, or - a model accelerate offloads
    (``device_map`` with ``"cpu"`` or ``"disk"`` entries), its parameters on the meta device
    until a forward loads them - where its input embedding computes. (On the meta device the
    residual held no values: zero queries only in name, and ``save_pretrained`` failed.)"""
    param = next(model.parameters())
    hook = getattr(model.get_input_embeddings(), "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    return torch.device(device) if param.device.type == "meta" and device is not None else param.device


def _hint(given: Any) -> str:
    """How to get a causal LM from what ``upcycle`` was given instead: a path or Hub id (the
    command takes those), or a PEFT model (whose adapters are not weights of the model)."""
    if isinstance(given, (str, os.PathLike)):
        return (f"; load it first - upcycle(AutoModelForCausalLM.from_pretrained({str(given)!r}), ...) - or run "
                f"`attnres upcycle --model {shell_path(given)} --out DIR`")
    if hasattr(given, "merge_and_unload"):
        return "; a PEFT model: upcycle model.merge_and_unload(), its adapters merged into the weights"
    return ""


#: The private settings of a loaded config that ``to_dict`` leaves out but the modules read:
#: the attention and experts implementations chosen at load (``attn_implementation="eager"``).
_RUNTIME_SETTINGS = ("_attn_implementation_internal", "_experts_implementation_internal")


def _replace_config(model: PreTrainedModel, config) -> None:
    """Make ``config`` the config of ``model`` and of every submodule that shared the old one
    (the inner model, each attention, the rotary embedding), as ``from_pretrained`` leaves
    them: one object. A submodule left with the old config would ignore what the user sets on
    ``model.config`` afterwards (``use_cache``, ``output_hidden_states``, the attention
    implementation) and would run the implementation chosen at load while ``model.config``
    said none."""
    old = model.config
    for name in _RUNTIME_SETTINGS:
        if name in vars(old):
            setattr(config, name, getattr(old, name))
    for module in model.modules():
        if module.__dict__.get("config") is old:
            module.config = config
