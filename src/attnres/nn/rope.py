"""Rotary position embeddings (Llama's rotate-half convention)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..validation import Number, check_sizes


class RotaryEmbedding(nn.Module):
    """Precomputed ``cos``/``sin`` tables of shape ``[max_seq_len, head_dim]``.

    The tables are computed in float64 and rounded once to the buffers' dtype (float32 by
    default); a module cast to float64 recomputes them in float64, so a float64 model
    carries no float32 rounding in its positions.

    ``forward(seq_len, offset=0)`` returns the rows for positions ``offset .. offset+seq_len-1``
    (``[seq_len, head_dim]``); ``at(position_ids [B, T])`` returns per-sequence rows
    ``[B, T, head_dim]`` (left-padded batches, where positions count real tokens only).
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        # (a head_dim of 0, a max_seq_len of 0 or a theta <= 0 built empty or NaN tables without a word)
        check_sizes("RotaryEmbedding", head_dim=head_dim, max_seq_len=max_seq_len)
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        if not Number(0.0, lo_open=True).ok(theta):
            raise ValueError(f"RotaryEmbedding: theta must be {Number(0.0, lo_open=True).describe()}, got {theta!r}")
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
        """``(cos, sin)`` computed in float64 on the CPU, then cast once to ``dtype``."""
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        t = torch.arange(self.max_seq_len, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)

    def reset_tables(self) -> None:
        """Recompute the tables in place, in the buffers' dtype and device."""
        if self.cos.device.type == "meta":
            return
        cos, sin = self._tables(self.cos.dtype, self.cos.device)
        with torch.no_grad():
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def _apply(self, fn, recurse: bool = True):
        # A cast to a finer dtype would only widen the rounded tables: `model.double()` kept
        # float32 rounding, and `model.to(torch.bfloat16).float()` bf16's (positions off by up
        # to 2e-3, unlike a fresh model with the same weights): recompute them exactly.
        # A model built on the meta device and materialised (`to_empty`) has empty tables,
        # which gave NaN logits: recompute them too (they are not parameters, no init sets them).
        was, was_meta = self.cos.dtype, self.cos.device.type == "meta"
        out = super()._apply(fn, recurse)
        finer = self.cos.dtype.is_floating_point and torch.finfo(self.cos.dtype).eps < torch.finfo(was).eps
        if finer or (was_meta and self.cos.device.type != "meta"):
            self.reset_tables()
        return out

    def materialise(self, device: torch.device) -> None:
        """Compute the tables on ``device`` (in their dtype) where they are still on the meta
        device: a model built there and given its weights by ``load_state_dict(..., assign=True)``
        keeps them there, as no state dict holds them."""
        if self.cos.device.type == "meta" and device.type != "meta":
            self.cos, self.sin = self._tables(self.cos.dtype, device)

    def reset_parameters(self) -> None:
        """What a deferred initialisation calls on every module: the tables recomputed."""
        self.reset_tables()

    def forward(self, seq_len: int, offset: int = 0) -> tuple[Tensor, Tensor]:
        """``(cos, sin)``, each ``[seq_len, head_dim]``: the rows of positions ``offset ..
        offset + seq_len - 1``."""
        if offset + seq_len > self.max_seq_len:  # (the slice came out short: a broadcast error in apply_rotary)
            raise ValueError(f"RotaryEmbedding: positions {offset}..{offset + seq_len - 1} are past its "
                             f"max_seq_len={self.max_seq_len} (the tables' rows): build it with a larger max_seq_len")
        return self.cos[offset : offset + seq_len], self.sin[offset : offset + seq_len]

    def at(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``(cos, sin)``, each ``[B, T, head_dim]``: the rows of ``position_ids [B, T]``."""
        return self.cos[position_ids], self.sin[position_ids]


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` is ``[B, H, T, head_dim]``; ``cos``/``sin`` are ``[T, head_dim]`` (shared by the
    batch) or ``[B, T, head_dim]`` (per-sequence positions)."""
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin
