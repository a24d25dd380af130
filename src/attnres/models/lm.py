"""``AttnResLM``: a Llama-style decoder whose residual mechanism is picked by the config."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..nn.compiled import uncompiled
from ..nn.kv_cache import StaticKVCache
from ..nn.norm import RMSNorm
from ..nn.transformer import KVStore
from .config import ModelConfig, require_model_config
from .trunk import DecoderTrunk, check_device, check_label_values, check_labels_type, next_token_loss, plain_call


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

    def __repr__(self) -> str:
        """One line (a notebook shows ``out`` so): shapes and the loss's value, not the logits
        and one tensor per sublayer's depth weights (hundreds of lines)."""
        shape = lambda t: str(list(t.shape))  # noqa: E731
        loss = self.loss
        if loss is not None:
            loss = f"{loss.item():.4f}" if loss.numel() == 1 and loss.device.type != "meta" else shape(loss)
        weights = None if self.depth_weights is None else \
            f"{len(self.depth_weights)} x [n_sources, {', '.join(map(str, self.logits.shape[:2]))}]"
        return (f"LMOutput(logits {shape(self.logits)} {str(self.logits.dtype).removeprefix('torch.')}, loss {loss}, "
                f"depth_weights {weights})")


# A pytree node: FSDP2 finds the tensors a module returns by flattening its output, to gather
# the module's parameters again before their backward; torch 2.11 does not look inside a plain
# dataclass, so under data parallelism the backward of the head read freed storage
# ("setStorage: ... out of bounds for storage of size 0").
pytree.register_dataclass(LMOutput)


class AttnResLM(DecoderTrunk):
    """Decoder-only LM with a configurable residual (standard, Full or Block AttnRes).

    Structure (conventional, so that a Hugging Face wrapper stays thin): ``embed_tokens``;
    ``layers[i]`` with ``attn_norm``/``attn`` and ``mlp_norm``/``mlp``; ``residual`` (the
    depth mixing, with the AttnRes pseudo-queries and key norms); ``norm``; ``lm_head``.

    ``forward(input_ids [B, T], labels [B, T] | None)`` returns :class:`LMOutput`.
    ``config``: a copy of the :class:`ModelConfig` it was built from.

    Incremental decoding (``attnres.inference``): ``kv_cache`` holds the self-attention
    keys/values of the ``past`` tokens already processed; ``input_ids`` are the next ``T``
    tokens. The residual needs no cache: it mixes over depth, token by token, so running it
    on the new tokens alone is exact. ``attention_mask [B, past + T]`` (1 = real token,
    0 = left padding) masks padded keys and makes RoPE positions count real tokens only.
    """

    #: How each sublayer is called in a forward pass (``sublayer_caller(mode)``: activation
    #: checkpointing); set on an instance.
    sublayer_call = staticmethod(plain_call)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        require_model_config(config, "AttnResLM")
        config.validate()
        if config.hf_architecture is not None:
            raise ValueError(f"ModelConfig.hf_architecture={config.hf_architecture!r} builds a transformers model: use "
                             "attnres.models.build_model(config)")
        # A copy: a notebook that changes its config to build the next model (config.n_layers = 4)
        # changed this one's, which then described another model (its cache, export, checkpoint).
        self.config = config = copy.deepcopy(config)
        self.build_trunk(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
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
        last, so that nothing overwrites them - zero pseudo-queries (report §5, "Architecture Details")."""
        self.apply(self._init_module)
        self.residual.reset_parameters()

    # -- forward -------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor | None = None,
        labels: Tensor | None = None,
        *,
        return_depth_weights: bool = False,
        attention_mask: Tensor | None = None,
        kv_cache: KVStore | None = None,
        last_logits_only: bool = False,
        inputs_embeds: Tensor | None = None,
    ) -> LMOutput:
        """``input_ids [B, T]`` -> :class:`LMOutput` with ``logits [B, T, vocab]``
        (``[B, 1, vocab]``, the last position only, with ``last_logits_only``).

        ``labels [B, T]`` (``T >= 2``): token ids (int64 or int32, ``-100`` ignored), the
        inputs' own - the loss shifts them (their mean over the predicted tokens: NaN where
        every label past the first is ``-100``, as in transformers' causal LMs). ``input_ids``, ``labels`` and ``attention_mask`` on a device other
        than the model's are a ``ValueError`` naming the argument.

        ``inputs_embeds [B, T, d]`` in place of ``input_ids``: vectors the model takes as it
        takes ``embed_tokens(input_ids)`` (the residual's ``v_0``), e.g. a soft prompt
        concatenated with ``embed_tokens(ids)``; in the embedding's dtype and device.
        ``kv_cache``: an ``attnres.inference.KVCache`` (its ``seq_len`` is ``past``), updated
        in place. ``attention_mask``: ``[B, past + T]`` of 0/1, left padding only. A
        ``StaticKVCache`` holds the padding itself (``attention_mask`` must be ``None``).
        """
        # (weights on meta - a model built there for shape inference, or offloaded by accelerate,
        # whose hooks load them - compute wherever the inputs are: nothing to refuse)
        device = None if (weight := self.embed_tokens.weight).device.type == "meta" else weight.device
        check_device(input_ids, "input_ids", device)  # (before its values are read, on its device)
        input_ids, b, t = self.check_inputs(input_ids, inputs_embeds)
        self._check_labels(labels, (b, t), last_logits_only, device, self.config.vocab_size)
        check_device(attention_mask, "attention_mask", device)
        self._check_cache(kv_cache, b)
        past = 0 if kv_cache is None else kv_cache.seq_len
        if past + t > self.config.max_seq_len:
            raise ValueError(
                f"cached length {past} + {t} new tokens exceeds ModelConfig.max_seq_len={self.config.max_seq_len}"
            )
        if isinstance(kv_cache, StaticKVCache) and past + t > kv_cache.capacity:
            raise ValueError(f"cached length {past} + {t} new tokens exceeds the StaticKVCache capacity {kv_cache.capacity}")
        h, state = self.decode(input_ids, attention_mask, kv_cache, record_weights=return_depth_weights,
                               sublayer_call=self.sublayer_call, inputs_embeds=inputs_embeds)
        if last_logits_only:
            h = h[:, -1:]
        logits = self.lm_head(self.norm(h))
        loss = None if labels is None else next_token_loss(logits, labels)
        return LMOutput(logits=logits, loss=loss, depth_weights=state.weights if return_depth_weights else None)

    @staticmethod
    def _check_labels(labels: Tensor | None, shape: tuple[int, int], last_logits_only: bool,
                      device: torch.device | None, vocab_size: int) -> None:
        """Refuse labels the loss cannot take, naming them: not a tensor of token ids
        (:func:`check_labels_type`), of another shape than the inputs, on another device than
        the model, or (on the CPU) ids outside the vocabulary (:func:`check_label_values`)."""
        if labels is None:
            return
        check_labels_type(labels)
        if labels.shape != shape:
            raise ValueError(f"labels must have the shape [batch, seq_len] = {shape} of the inputs, got {tuple(labels.shape)}")
        if last_logits_only:
            raise ValueError("labels need the logits of every position; do not pass last_logits_only=True with labels")
        if shape[1] < 2:  # (the mean over no predicted token: a NaN loss, without a word)
            raise ValueError(f"labels need a sequence of at least 2 tokens: position t predicts token t + 1, and a "
                             f"sequence of {shape[1]} predicts none (the loss would be NaN)")
        check_device(labels, "labels", device)
        check_label_values(labels, vocab_size)

    def _check_cache(self, kv_cache: KVStore | None, batch_size: int) -> None:
        """Refuse what is not a cache, and a cache made for another model (its layers; a static
        cache's batch, key/value heads and head size), which failed inside an update ("list
        index out of range", "index_copy_(): Source/destination tensor must have same slice shapes")."""
        config = self.config
        fix = "make it for this model: KVCache(model.config.n_layers) or StaticKVCache.for_model(model, batch_size)"
        # (a cache of the wrong kind failed with "'str' object has no attribute 'seq_len'")
        if kv_cache is not None and not callable(getattr(kv_cache, "update", None)):
            raise ValueError(f"kv_cache must be an attnres.inference.KVCache or StaticKVCache, got "
                             f"{type(kv_cache).__name__}: {fix}")
        if getattr(kv_cache, "n_layers", config.n_layers) != config.n_layers:
            raise ValueError(f"kv_cache holds {kv_cache.n_layers} layers, the model has ModelConfig.n_layers="
                             f"{config.n_layers}: {fix}")
        if isinstance(kv_cache, StaticKVCache):
            have = (kv_cache.batch_size, kv_cache.k[0].shape[1], kv_cache.k[0].shape[3])
            need = (batch_size, config.kv_heads, config.head_dim)
            if have != need:
                raise ValueError(f"the StaticKVCache holds (batch, key/value heads, head size) {have}, this forward needs "
                                 f"{need}: {fix}")

    # -- conveniences --------------------------------------------------------------------
    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """The parameters, each counted once (a tied LM head shares the embedding's);
        ``exclude_embeddings``: without the token embedding's ``vocab_size * d_model``."""
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            params.pop(id(self.embed_tokens.weight), None)
        return sum(p.numel() for p in params.values())

    def residual_parameters(self) -> int:
        """Parameters added by the residual mechanism: ``2 (L + 1) d`` for AttnRes."""
        return sum(p.numel() for p in self.residual.parameters())


def require_attnres_lm(model: object, who: str) -> None:
    """Raise ``TypeError`` where ``model``, given to ``who`` (what runs attnres's own decoder:
    ``sharded_prefill``, ``PipelineRunner``), is not an :class:`AttnResLM`: a transformers model
    (an upcycle, an export) stopped there in "object has no attribute 'check_input_ids'".
    A ``torch.compile``'d AttnResLM is one (its wrapper answers its attributes, as it did before
    this check); a DDP or FSDP wrapper is named with the way to what it wraps, its ``.module``."""
    if isinstance(uncompiled(model), AttnResLM):
        return
    wrapped = getattr(model, "module", None) if isinstance(model, nn.Module) else None
    if isinstance(uncompiled(wrapped), AttnResLM):  # (DDP / FSDP: their attributes are not the model's)
        raise TypeError(f"{who} takes attnres's own model (an AttnResLM); got the {type(model).__name__} wrapper "
                        f"of one: give it {type(model).__name__}'s .module (the AttnResLM it wraps)")
    raise TypeError(f"{who} takes attnres's own model (an AttnResLM); got {type(model).__name__}: an export of "
                    "attnres's own model (AttnResForCausalLM) is one after .to_native(), and a transformers "
                    "family's model (an upcycle) runs whole, with its own forward")
