"""``AttnResLM``: a Llama-style decoder whose residual mechanism is picked by the config."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.baselines import build_baseline
from ..nn.norm import RMSNorm
from ..nn.residual import BlockAttnRes, FullAttnRes, ResidualStream, StandardResidual
from ..nn.rope import RotaryEmbedding
from ..nn.transformer import KVStore, TransformerBlock, causal_mask
from .config import BASELINES, ModelConfig

IGNORE_INDEX = -100


@dataclass
class LMOutput:
    """What :meth:`AttnResLM.forward` returns.

    logits: ``[B, T, vocab_size]``.
    loss: mean next-token cross-entropy (``labels`` shifted by one inside), or ``None``.
    depth_weights: with ``return_depth_weights=True`` and an AttnRes residual, one tensor
        per sublayer and a last one for the output aggregation, each ``[n_sources, B, T]``
        in float32; ``None`` otherwise.
    """

    logits: Tensor
    loss: Tensor | None = None
    depth_weights: list[Tensor] | None = None


def build_residual(config: ModelConfig) -> ResidualStream:
    """The residual module named by ``config.residual``."""
    d, L = config.d_model, config.n_sublayers
    if config.residual == "standard":
        return StandardResidual(d, L)
    if config.residual in BASELINES:
        return build_baseline(config.residual, d, L, n_streams=config.hc_streams, sinkhorn_iters=config.mhc_sinkhorn_iters)
    if config.residual == "attnres_full":
        return FullAttnRes(
            d, L, eps=config.attnres_eps, impl=config.attnres_impl, group_size=config.attnres_full_group_size, ablation=config.ablation
        )
    return BlockAttnRes(d, L, config.block_size, eps=config.attnres_eps, impl=config.attnres_impl, ablation=config.ablation)


class AttnResLM(nn.Module):
    """Decoder-only LM with a configurable residual (standard, Full or Block AttnRes).

    Structure (conventional, so that a Hugging Face wrapper stays thin): ``embed_tokens``;
    ``layers[i]`` with ``attn_norm``/``attn`` and ``mlp_norm``/``mlp``; ``residual`` (the
    depth mixing, with the AttnRes pseudo-queries and key norms); ``norm``; ``lm_head``.

    ``forward(input_ids [B, T], labels [B, T] | None)`` returns :class:`LMOutput`.

    Incremental decoding (``attnres.inference``): ``kv_cache`` holds the self-attention
    keys/values of the ``past`` tokens already processed; ``input_ids`` are the next ``T``
    tokens. The residual needs no cache: it mixes over depth, token by token, so running it
    on the new tokens alone is exact. ``attention_mask [B, past + T]`` (1 = real token,
    0 = left padding) masks padded keys and makes RoPE positions count real tokens only.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(
            TransformerBlock(config.d_model, config.n_heads, config.kv_heads, config.hidden_size, config.norm_eps)
            for _ in range(config.n_layers)
        )
        self.residual = build_residual(config)
        if hasattr(self.residual, "kernels"):
            self.residual.kernels = config.attnres_kernels
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta)
        self.init_weights()

    # -- initialisation ------------------------------------------------------------------
    def _init_module(self, module: nn.Module) -> None:
        """Per-module init in the style of a global ``model.apply(...)`` pass."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
        elif isinstance(module, RMSNorm):
            module.reset_parameters()

    def init_weights(self) -> None:
        """Normal(0, init_std) for projections and embeddings, ones for norm gains, and -
        last, so that nothing overwrites them - zero pseudo-queries (spec §2, §8)."""
        self.apply(self._init_module)
        self.residual.reset_parameters()

    # -- forward -------------------------------------------------------------------------
    @torch.compiler.disable  # data-dependent checks run eagerly, in front of a compiled graph
    def check_input_ids(self, input_ids: Tensor) -> None:
        """Raise ``ValueError`` unless ``input_ids`` is an integer ``[B, T]`` tensor of
        in-vocabulary ids with ``1 <= T <= max_seq_len``. Runs before any compute."""
        if not isinstance(input_ids, Tensor):
            raise ValueError(f"input_ids must be a tensor, got {type(input_ids).__name__}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape [batch, seq_len], got {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        if b == 0 or t == 0:
            raise ValueError(f"input_ids must be non-empty, got shape {tuple(input_ids.shape)}")
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds ModelConfig.max_seq_len={self.config.max_seq_len}")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.config.vocab_size})")

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        *,
        return_depth_weights: bool = False,
        attention_mask: Tensor | None = None,
        kv_cache: KVStore | None = None,
        last_logits_only: bool = False,
    ) -> LMOutput:
        """``input_ids [B, T]`` -> :class:`LMOutput` with ``logits [B, T, vocab]``
        (``[B, 1, vocab]``, the last position only, with ``last_logits_only``).

        ``kv_cache``: an ``attnres.inference.KVCache`` (its ``seq_len`` is ``past``), updated
        in place. ``attention_mask``: ``[B, past + T]`` of 0/1, left padding only.
        """
        self.check_input_ids(input_ids)
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        if labels is not None and last_logits_only:
            raise ValueError("labels need the logits of every position; do not pass last_logits_only=True with labels")
        t = input_ids.shape[1]
        past = 0 if kv_cache is None else kv_cache.seq_len
        if past + t > self.config.max_seq_len:
            raise ValueError(
                f"cached length {past} + {t} new tokens exceeds ModelConfig.max_seq_len={self.config.max_seq_len}"
            )
        h, state = self.decode(input_ids, attention_mask, kv_cache, record_weights=return_depth_weights)
        if last_logits_only:
            h = h[:, -1:]
        logits = self.lm_head(self.norm(h))
        loss = None
        if labels is not None:
            shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
            if shifted.dtype in (torch.float16, torch.bfloat16):
                shifted = shifted.float()  # the loss in at least float32
            loss = F.cross_entropy(
                shifted,
                labels[:, 1:].reshape(-1),
                ignore_index=IGNORE_INDEX,
            )
        return LMOutput(logits=logits, loss=loss, depth_weights=state.weights if return_depth_weights else None)

    def decode(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        kv_cache: KVStore | None = None,
        *,
        record_weights: bool = False,
        sublayer_call=None,
    ) -> tuple[Tensor, object]:
        """The decoder up to (not including) the final norm: ``input_ids [B, T]`` (already
        validated) -> the residual's output aggregation ``h [B, T, d]`` and the residual state
        (its ``weights`` hold the depth weights with ``record_weights``).

        ``sublayer_call(fn, *args)`` runs each sublayer ``fn(*args)`` (default: a plain call);
        the Hugging Face wrapper passes activation checkpointing here.
        """
        t = input_ids.shape[1]
        past = 0 if kv_cache is None else kv_cache.seq_len
        attn_mask = None
        if attention_mask is None:
            cos, sin = self.rope(t, offset=past)
        else:
            if attention_mask.shape != (input_ids.shape[0], past + t):
                raise ValueError(
                    f"attention_mask must have shape [batch, past + seq_len] = {(input_ids.shape[0], past + t)}, "
                    f"got {tuple(attention_mask.shape)}"
                )
            real = attention_mask.bool()
            # RoPE positions count real tokens; left padding sits at position 0.
            position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            cos, sin = self.rope.at(position_ids)
            allowed = causal_mask(t, past + t, input_ids.device)  # [T, past + T]
            # A padded query attends to itself only, so that no softmax row is empty; no real
            # token ever attends to a padded key.
            keys = torch.arange(past + t, device=input_ids.device)
            self_key = keys == keys[past:, None]
            attn_mask = (allowed & (real[:, None, :] | self_key)).unsqueeze(1)  # [B, 1, T, past + T]
        call = sublayer_call or (lambda fn, *args: fn(*args))
        x = self.embed_tokens(input_ids)
        residual = self.residual
        state = residual.start(x, record_weights=record_weights)
        # With the fused kernels the residual returns each sublayer's normalised input (its
        # pre-norm folded into the Phase-2 kernel) and the sublayers skip their own norm.
        fused = residual.fuses_norm(x)
        for i, layer in enumerate(self.layers):
            a, m = 2 * i, 2 * i + 1
            h_a = residual.sublayer_input(state, a, layer.attn_norm if fused else None)
            residual.add_output(state, a, call(layer.attention_sublayer, h_a, cos, sin, attn_mask, kv_cache, i, fused))
            h_m = residual.sublayer_input(state, m, layer.mlp_norm if fused else None)
            residual.add_output(state, m, call(layer.mlp_sublayer, h_m, fused))
        return residual.finish(state), state

    # -- conveniences --------------------------------------------------------------------
    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            params.pop(id(self.embed_tokens.weight), None)
        return sum(p.numel() for p in params.values())

    def residual_parameters(self) -> int:
        """Parameters added by the residual mechanism: ``2 (L + 1) d`` for AttnRes."""
        return sum(p.numel() for p in self.residual.parameters())
