"""Loading a checkpoint's weights into the module they belong to, whatever part of it (or of
the module that saved them) ``torch.compile`` wrapped."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from torch import Tensor, nn

from ..nn.compiled import uncompiled_name
from .manifest import CheckpointError


def weight_key(t: Tensor) -> object:
    """What each name of one weight - a tied one's names alike - holds: the memory it views
    (where it starts, its shape), for a tie by a shared parameter or by shared storage; a
    tensor without memory - on the meta device, or empty, whose addresses are all 0 - only
    itself (``data_ptr()`` made every such tensor the tie of every other)."""
    storage = t.untyped_storage() if t.device.type != "meta" else None
    if storage is None or storage.nbytes() == 0:
        return id(t)
    return t.device, storage.data_ptr(), t.storage_offset(), tuple(t.shape)


def load_weights(path: str | Path, model: nn.Module, weights: dict[str, Tensor]) -> None:
    """Load ``weights`` (a checkpoint's, read from ``path``) into ``model``, or raise
    :class:`CheckpointError` naming what does not fit. A name that differs from one of
    ``model``'s only in ``torch.compile``'s ``_orig_mod.`` loads as that one: the state dict of
    ``torch.compile(wrapper)`` (``_orig_mod.model.<name>``) into ``wrapper``, a checkpoint of
    ``wrapper`` into one whose ``model`` is compiled (``model._orig_mod.<name>``). A tied
    weight is stored once: its other names are filled by the tie. Two names the model ties
    that the checkpoint holds apart (its model's were not tied: the embedding and the LM head)
    do not fit - one weight cannot hold both, as safetensors' ``load_model`` refused them."""
    held = model.state_dict(keep_vars=True)  # (the parameters themselves: a tie is one object)
    ours = {uncompiled_name(name): name for name in held}
    weights = {ours.get(uncompiled_name(name), name): tensor for name, tensor in weights.items()}
    _refuse_other_shapes(path, weights, held)
    given = defaultdict(list)
    for name in weights.keys() & held.keys():
        given[weight_key(held[name])].append(name)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if weight_key(held[k]) not in given]
    apart = sorted(sorted(names) for names in given.values() if len(names) > 1)
    if missing or unexpected or apart:
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit the model: missing {sorted(missing)}, "
                              f"unexpected {sorted(unexpected)}" + (f", tied here but apart in the checkpoint {apart}"
                                                                    if apart else ""))


def _refuse_other_shapes(path: str | Path, weights: dict[str, Tensor], held: dict[str, Tensor]) -> None:
    """:class:`CheckpointError` naming the checkpoint and the first weights whose shapes differ
    from the model's (a model of another size): ``load_state_dict``'s RuntimeError, a line per
    weight, named neither the checkpoint nor what to do (from ``load_sharded_weights`` unwrapped)."""
    other = sorted(name for name in weights.keys() & held.keys() if weights[name].shape != held[name].shape)
    if other:
        shown = "; ".join(f"{name} {list(weights[name].shape)} there, {list(held[name].shape)} here" for name in other[:3])
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit the model: {len(other)} weight(s) have other "
                              f"shapes ({shown}{'; ...' if len(other) > 3 else ''}): build the model with the "
                              "checkpoint's config (config.model in its state.json)")
