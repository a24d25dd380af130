"""The sublayers of a Llama-style decoder: grouped-query attention and a SwiGLU MLP."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..validation import check_sizes
from .driven import DrivenModule
from .norm import FusableNormInput, RMSNorm
from .rope import apply_rotary


class KVStore(Protocol):
    """What :class:`Attention` needs from a key/value cache (``attnres.inference.KVCache``)."""

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k``/``v`` ``[B, n_kv_heads, T, head_dim]`` to layer ``layer``'s cache and
        return all keys/values seen so far, ``[B, n_kv_heads, past + T, head_dim]``."""
        ...


def causal_mask(t: int, s: int, device: torch.device | None = None) -> Tensor:
    """Boolean ``[t, s]`` mask (True = may attend) for ``t`` queries that are the last ``t``
    of ``s >= t`` keys: query ``i`` sees keys ``0 .. s - t + i``."""
    q = torch.arange(s - t, s, device=device)
    return torch.arange(s, device=device) <= q[:, None]


def eager_attention(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False, enable_gqa: bool = False
) -> Tensor:
    """Explicit ``softmax(q k^T / sqrt(head_dim) + mask) v`` (softmax in float32, or float64
    for float64 inputs), with the
    arguments of ``F.scaled_dot_product_attention``: ``q [B, H, T, D]``, ``k``/``v``
    ``[B, H_kv, S, D]``, boolean ``attn_mask`` (True = may attend) or ``is_causal``."""
    if enable_gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = (q @ k.transpose(-1, -2)).to(compute) * q.shape[-1] ** -0.5
    if is_causal:
        attn_mask = causal_mask(q.shape[2], k.shape[2], q.device)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return scores.softmax(dim=-1).to(v.dtype) @ v


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE through ``scaled_dot_product_attention``.

    Shapes: ``x [B, T, d] -> [B, T, d]``; ``n_heads`` query heads share ``n_kv_heads``
    key/value heads. ``cos``/``sin``: the RoPE tables of the ``T`` positions, ``[T, head_dim]``
    (``RotaryEmbedding(head_dim, max_seq_len)(T)``) or ``[B, T, head_dim]`` (``.at(positions)``).

    Incremental decoding: with ``kv_cache`` the new keys/values are appended to layer
    ``layer``'s cache and the ``T`` queries attend over all ``past + T`` keys.
    ``attn_mask`` (boolean, True = may attend, broadcastable to ``[B, 1, T, past + T]``)
    replaces the built-in causal mask and must include causality; ``None`` means causal with
    the queries aligned to the *last* ``T`` keys.

    ``implementation``: ``"sdpa"`` (default, ``F.scaled_dot_product_attention``) or
    ``"eager"`` (:func:`eager_attention`, the explicit softmax; same function).

    ``x`` may also be a tuple of :attr:`input_readers` tensors of the same value, one for
    each of the q, k and v projections (a fused norm's under autocast, see :class:`RMSNorm`).
    """

    IMPLEMENTATIONS = ("sdpa", "eager")
    #: The linear layers that read the input: q, k, v.
    input_readers = 3

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        # (used on its own, in a model of the user's: d_model=10, n_heads=4 ran with heads of 2 and q of width 8;
        # n_kv_heads=0 ran; n_kv_heads=3 of 4 failed inside scaled_dot_product_attention)
        check_sizes("Attention", d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads)
        if d_model % n_heads:
            raise ValueError(f"Attention: n_heads={n_heads} must divide d_model={d_model} (the head dimension is "
                             "d_model / n_heads)")
        if n_heads % n_kv_heads:
            raise ValueError(f"Attention: n_kv_heads={n_kv_heads} must divide n_heads={n_heads} (each key/value head "
                             "serves n_heads / n_kv_heads query heads)")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.implementation = "sdpa"

    def forward(
        self,
        x: Tensor | tuple[Tensor, Tensor, Tensor],
        cos: Tensor,
        sin: Tensor,
        attn_mask: Tensor | None = None,
        kv_cache: KVStore | None = None,
        layer: int = 0,
    ) -> Tensor:
        xq, xk, xv = x if isinstance(x, tuple) else (x, x, x)
        if xq.dim() != 3 or xq.shape[-1] != self.q_proj.in_features or cos.shape[-2] != xq.shape[1]:
            self._refuse(xq, cos)
        b, t, _ = xq.shape
        q = self.q_proj(xq).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(xk).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(xv).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(layer, k, v)
        s = k.shape[2]
        # (a branch, not the condition's value: with dynamic shapes `t > 1` is a SymBool, which
        # SDPA refused - a graph break; Dynamo guards on a branch and passes a constant)
        is_causal = False
        if attn_mask is None and s == t and t > 1:
            is_causal = True
        if attn_mask is None and s > t > 1:
            attn_mask = causal_mask(t, s, xq.device)
        attend = F.scaled_dot_product_attention if self.implementation == "sdpa" else eager_attention
        out = attend(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))  # (-1: no T = 0)

    def _refuse(self, x: Tensor, cos: Tensor) -> None:
        """The error of an input that is not ``[B, T, d_model]`` or RoPE tables not of its ``T``
        rows (used on its own: a ``[T, d]`` input failed with "not enough values to unpack",
        another width in a matmul, tables of another length in a broadcast)."""
        d = self.q_proj.in_features
        if x.dim() != 3 or x.shape[-1] != d:
            raise ValueError(f"Attention: x must have shape [batch, seq_len, d_model={d}], got {tuple(x.shape)}")
        raise ValueError(f"Attention: cos and sin must have the {x.shape[1]} rows of x's positions "
                         f"([seq_len, head_dim] or [batch, seq_len, head_dim], rope(seq_len)), got {tuple(cos.shape)}")


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: ``[..., d] -> [..., d]`` with hidden size ``hidden``;
    ``x`` may also be a tuple of two tensors of the same value, one for each of gate and up
    (a fused norm's under autocast, see :class:`RMSNorm`)."""

    #: The linear layers that read the input: gate, up.
    input_readers = 2

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        check_sizes("SwiGLU", d_model=d_model, hidden=hidden)
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor | tuple[Tensor, Tensor]) -> Tensor:
        x_gate, x_up = x if isinstance(x, tuple) else (x, x)
        return self.down_proj(F.silu(self.gate_proj(x_gate)) * self.up_proj(x_up))


class TransformerBlock(DrivenModule):
    """One transformer block = two sublayers, each with its own pre-norm.

    ``attention_sublayer(h) = attn(attn_norm(h))`` and ``mlp_sublayer(h) = mlp(mlp_norm(h))``
    return the *raw* sublayer outputs ``v_l`` (report §3.1); how they are combined across
    depth is the residual module's job, not the block's. ``h`` may be a
    :class:`~attnres.nn.norm.FusableNormInput`, which the block's norm turns into
    ``norm(h)`` inside the residual's fused kernel - handing each of the sublayer's linear
    layers that read it (``input_readers``) a tensor of its own. The block itself is never
    called (a hook on it warns that it never runs; hook its sublayers' modules).
    """

    hook_instead = ("hook its sublayers' modules: .attn and .mlp give their raw outputs (what the residual mixes), "
                    "a pre-hook on .attn_norm or .mlp_norm their inputs")

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, mlp_hidden: int, eps: float) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(d_model, eps)
        self.attn = Attention(d_model, n_heads, n_kv_heads)
        self.mlp_norm = RMSNorm(d_model, eps)
        self.mlp = SwiGLU(d_model, mlp_hidden)

    def attention_sublayer(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        attn_mask: Tensor | None = None,
        kv_cache: KVStore | None = None,
        layer: int = 0,
    ) -> Tensor:
        """``attn(attn_norm(h))``: ``h [B, T, d]`` -> the raw output ``[B, T, d]`` (the
        arguments after ``h`` as :class:`Attention` takes them)."""
        return self.attn(_normalized(self.attn_norm, h, self.attn), cos, sin, attn_mask, kv_cache, layer)

    def mlp_sublayer(self, h: Tensor) -> Tensor:
        """``mlp(mlp_norm(h))``: ``h [B, T, d]`` -> the raw output ``[B, T, d]``."""
        return self.mlp(_normalized(self.mlp_norm, h, self.mlp))


def _normalized(norm: RMSNorm, h: Tensor | FusableNormInput, sublayer: nn.Module):
    """``norm(h)`` for ``sublayer``: for a fused norm's input, possibly a tuple with one
    tensor for each of its ``input_readers`` (see :class:`RMSNorm`; a module without that
    attribute - a user's own - takes one tensor)."""
    readers = getattr(sublayer, "input_readers", 1)
    return norm(h, readers=readers) if isinstance(h, FusableNormInput) and readers > 1 else norm(h)
