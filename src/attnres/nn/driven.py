"""Modules a model drives through their methods and never calls, so that a hook registered on
one never runs: the transformer block (the residual calls its two sublayers apart) and the
residual stream (``start``, ``sublayer_input``, ``add_output``, ``finish``)."""

from __future__ import annotations

from torch import nn

from ..user_warning import warn_user

__all__ = ["DrivenModule"]


def _warns_first(method: str, kind: str):
    """``nn.Module``'s hook registration ``method``, after the warning that the ``kind`` hook
    never runs."""
    def register(self: DrivenModule, hook, **kwargs):
        warn_user(f"a {kind} on {type(self).__name__} never runs: the model drives it through its methods and never "
                  f"calls it; {self.hook_instead}")
        return getattr(super(DrivenModule, self), method)(hook, **kwargs)

    register.__name__ = register.__qualname__ = method
    register.__doc__ = f"``nn.Module.{method}``, after a warning that the hook never runs."
    return register


class DrivenModule(nn.Module):
    """An ``nn.Module`` whose ``forward`` a model never calls. Registering a forward or backward
    hook on it warns, naming what to hook instead (:attr:`hook_instead`): the hook of a notebook
    that captures each block's output (``model.layers[i].register_forward_hook``) or the depth
    mixing (``model.residual``) never ran, and it got nothing without a word. The hook is
    registered all the same: a tool that hooks every module (a model summary, ``fully_shard`` of
    a block) goes on as before."""

    #: What to hook instead, in words (each class's own).
    hook_instead = ""

    register_forward_pre_hook = _warns_first("register_forward_pre_hook", "forward pre-hook")
    register_forward_hook = _warns_first("register_forward_hook", "forward hook")
    register_full_backward_pre_hook = _warns_first("register_full_backward_pre_hook", "backward pre-hook")
    register_full_backward_hook = _warns_first("register_full_backward_hook", "backward hook")
