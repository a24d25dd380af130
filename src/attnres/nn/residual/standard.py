"""Single-stream residuals: one hidden state ``h`` updated after every sublayer.

:class:`SingleStreamResidual` is the easiest base for a new variant: implement
``update(l, h, out)`` (and ``residual_flops_per_token``), register it, done. Its history
is the hidden state alone, so such variants can be cut into pipeline stages (a pipeline takes
those without parameters: it splits only AttnRes' depth queries between its stages).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .base import DepthHistory, HistoryLayout, ResidualState, ResidualStream
from .config import ResidualConfig
from .mixing import MixingMatrix, unit_lower_triangular
from .kinds import refuse_other_kind
from .registry import register_residual

__all__ = ["StreamState", "SingleStreamResidual", "StandardResidual"]


@dataclass
class StreamState(ResidualState):
    """``h``: the hidden state, the input of the next sublayer ``[..., d]``."""

    h: Tensor | None = None


class SingleStreamResidual(ResidualStream):
    """``h_{l+1} = update(l, h_l, f_l(h_l))``, starting from the embedding."""

    @abstractmethod
    def update(self, l: int, h: Tensor, out: Tensor) -> Tensor:
        """The hidden state after sublayer ``l`` from its input ``h`` and raw output ``out``
        (the shape of ``h``)."""

    def _start(self, embedding: Tensor, common: dict[str, Any]) -> StreamState:
        return StreamState(h=embedding, **common)

    def _input(self, state: StreamState, l: int) -> Tensor:
        return state.h

    def _add(self, state: StreamState, l: int, output: Tensor) -> None:
        h = self.update(l, state.h, output)
        # Checked at the first sublayer of a forward (else a later sublayer's error blames itself): an
        # update's result has one shape for one input shape, and once a forward keeps the hot path bare.
        if l == 0 and (not isinstance(h, Tensor) or h.shape != state.h.shape):
            got = list(h.shape) if isinstance(h, Tensor) else type(h).__name__
            raise ValueError(f"residual {self._label()}: {type(self).__qualname__}.update({l}, h, out) must return the "
                             f"next hidden state, of h's shape {list(state.h.shape)}; got {got}")
        state.h = h

    def _finish(self, state: StreamState) -> Tensor:
        return state.h

    def history_layout(self, sublayer: int) -> HistoryLayout:
        return HistoryLayout(0, True)

    def _history(self, state: StreamState) -> DepthHistory:
        return DepthHistory([], state.h)

    def _resume(self, history: DepthHistory, at_sublayer: int, common: dict[str, Any]) -> StreamState:
        return StreamState(h=history.running, **common)


@register_residual("standard")
class StandardResidual(SingleStreamResidual):
    """PreNorm residual: the input of sublayer ``l`` is ``v_0 + v_1 + ... + v_l``."""

    upcycles_exactly = True  # (the pretrained models' own residual)

    def __init__(self, dim: int, n_sublayers: int) -> None:
        # (its own, so that another variant's option - BlockAttnRes's block_size, kept while swapping in
        # the baseline - is refused naming StandardResidual, not "ResidualStream.__init__()")
        super().__init__(dim, n_sublayers)

    @classmethod
    def check_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> None:
        super().check_config(config, dim, n_sublayers)
        cls._no_options(config)

    @classmethod
    def from_config(cls, config: ResidualConfig, dim: int, n_sublayers: int) -> StandardResidual:
        refuse_other_kind(cls, config)
        return cls(dim, n_sublayers)

    def update(self, l: int, h: Tensor, out: Tensor) -> Tensor:
        return h + out

    def residual_flops_per_token(self) -> float:
        return float(self.n_sublayers * self.dim)  # one add per sublayer

    def _mixing_matrix(self, state: StreamState, per_channel: bool = False) -> MixingMatrix:
        """All ones on and below the diagonal (report §6.2)."""
        return MixingMatrix(unit_lower_triangular(self.n_sublayers, state.h.device), input_dependent=False)
