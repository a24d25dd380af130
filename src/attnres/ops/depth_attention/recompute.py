"""Phase 1's weighted sums recomputed for the backward instead of kept from the forward.

Each sublayer's merge (report §4.2, Phase 2) needs its Phase-1 weighted sum ``o_l`` again in
the backward: the gradient of its logit takes ``<g, o_l>``, and the fused RMSNorm re-forms
the merged input from it. Saved as they are, these are one more ``[tokens, d]`` tensor per
sublayer than a standard PreNorm model keeps - on a GPU, where PyTorch's fused RMSNorm saves
its input and ``1/rms`` only, about 12 % more peak step memory at 32 transformer blocks
(benchmarks/results/gpu-h200). Their recipe is kept anyway: Phase 1 saves its queries and
sources for its own backward. So the merges save a reference to the recipe instead
(saved-tensor hooks), and the first merge of the block to need its sum in the backward runs
Phase 1 forward again - once per block, the same call on the same tensors, so the same
values - and hands each merge its sum.

Cost: one more Phase-1 forward per block in the backward (a read of the completed sources
and a write of the block's sums); gain: the sums of a block live during its backward only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["Phase1Recompute", "recipes_unusable"]


def recipes_unusable() -> bool:
    """Whether the recipe must stay out: saved-tensor hooks already in force
    (``torch.utils.checkpoint``'s, a user's offloading - theirs then decide what is saved) or
    switched off (``torch.func``'s ``grad`` refuses them), or any ``torch.func`` transform
    active (the operators' wrappers then run the reference, and its batched tensors have no
    storage for the recipe to find the sums by). If PyTorch cannot tell, assume it must."""
    autograd = torch._C._autograd
    try:
        if torch._C._are_functorch_transforms_active():
            return True
        if not autograd._saved_tensors_hooks_is_enabled():
            return True
        return autograd._top_saved_tensors_default_hooks(False) is not None
    except Exception:  # noqa: BLE001 - private API: another PyTorch may lack it or refuse the call
        return True


class _Recipe:
    """What a merge saves in place of Phase-1 sum ``index``."""

    __slots__ = ("owner", "index")

    def __init__(self, owner: Phase1Recompute, index: int) -> None:
        self.owner, self.index = owner, index


class Phase1Recompute:
    """The recipe of one Phase-1 call's weighted sums ``outs``: ``phase1(qg, sources, eps,
    out_dtype)``.

    Use :meth:`saving` around each merge that takes one of the sums: within it, a tensor
    autograd saves that is one of ``outs`` is stored as its index. Keeps references to
    ``qg`` and ``sources`` (which Phase 1 saves for its own backward anyway), never to
    ``outs``.
    """

    def __init__(self, phase1: Callable[..., tuple[list[Tensor], Tensor]], qg: Tensor, sources: Sequence[Tensor],
                 eps: float, outs: Sequence[Tensor], out_dtype: torch.dtype | None = None) -> None:
        self._phase1, self._qg, self._sources, self._eps = phase1, qg, list(sources), eps
        self._out_dtype = out_dtype
        self._versions = self._current_versions()
        # (found by where they start - one cheap call per tensor a merge saves - then checked by
        # shape, strides and dtype: the sums are alive while their block's merges run)
        self._keys = {_start(o): (s, _layout(o)) for s, o in enumerate(outs)}
        self._sums: list[Tensor | None] | None = None
        self._pending = [0] * len(outs)  # (recipes of each sum not yet unpacked)

    def _current_versions(self) -> list[int]:
        return [t._version for t in (self._qg, *self._sources)]

    def saving(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks that store the sums as recipes (see the class docstring)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: Tensor):
        found = self._keys.get(_start(t))
        if found is None or found[1] != _layout(t):
            return t
        index = found[0]
        self._pending[index] += 1
        return _Recipe(self, index)

    def _take(self, index: int) -> Tensor:
        sums = self._sums
        if sums is None or sums[index] is None:
            if self._current_versions() != self._versions:
                raise RuntimeError(
                    "one of the tensors Phase 1's weighted sums are recomputed from (its queries or sources) was "
                    "modified in place after the forward; the backward cannot recompute them. Modify a copy instead, "
                    "or set ModelConfig.residual.recompute_phase1=False to keep the sums.")
            with torch.no_grad():
                fresh = self._phase1(self._qg, self._sources, self._eps, self._out_dtype)[0]
            # (kept: the sums whose merges have yet to ask)
            sums = [o if s == index or self._pending[s] > 0 else None for s, o in enumerate(fresh)]
        out = sums[index]
        self._pending[index] -= 1
        if self._pending[index] <= 0:  # (every merge that saved this sum has it)
            sums[index] = None
        self._sums = None if all(o is None for o in sums) else sums
        return out


def _start(t: Tensor) -> tuple[int, int]:
    """Where ``t`` starts: its storage (the identity PyTorch's own ``StorageWeakRef`` keys by)
    and its offset there. Not ``data_ptr()``: a fake tensor's (``FakeTensorMode``, shapes
    without storage, as the GPU check's launch survey runs a model) is 0 for every tensor, with
    a deprecation warning that a later PyTorch makes an error, and a meta tensor's is its
    offset from 0 - every sum would have been found as the last one."""
    return t.untyped_storage()._cdata, t.storage_offset()


def _layout(t: Tensor) -> tuple:
    return t.dtype, t.device, t.shape, t.stride()


def _unpack(saved):
    return saved.owner._take(saved.index) if isinstance(saved, _Recipe) else saved
