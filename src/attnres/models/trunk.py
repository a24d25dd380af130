"""The decoder trunk shared by :class:`~attnres.AttnResLM`, the Hugging Face models and the
pipeline stages: the token embedding, the transformer blocks, the residual stream that mixes
their outputs over depth, and the final norm - plus the one sublayer loop and the one loss.

Who uses what:

* :class:`DecoderTrunk` (a module mixin) owns ``embed_tokens``, ``layers``, ``residual``,
  ``norm`` and ``rope`` under these names and runs the whole decoder pass (:meth:`decode`);
  ``AttnResLM`` and ``attnres.hf.AttnResPreTrainedModel`` inherit it.
* :func:`run_sublayers` is the loop over some transformer blocks; a pipeline stage runs it
  over its own blocks between ``residual.resume`` and ``residual.history``.
* :func:`next_token_loss` is the loss of all three.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from ..nn.compiled import COMPILED_PREFIX
from ..nn.norm import RMSNorm
from ..nn.residual import ResidualState, ResidualStream
from ..nn.rope import RotaryEmbedding
from ..nn.transformer import KVStore, TransformerBlock, causal_mask
from .config import ModelConfig

__all__ = ["IGNORE_INDEX", "DecoderTrunk", "run_sublayers", "next_token_loss", "plain_call", "check_labels_type",
           "check_label_values", "one_prompt_hint"]


def one_prompt_hint(input_ids) -> str:
    """How one prompt's ids become the ``[batch, seq_len]`` that the model and ``generate``
    take, for ids given as a flat list (``tokenizer.encode``'s) or a 1-D tensor: refused with
    their type or shape alone, they left the reader to guess the batch dimension. ``""`` for
    anything else."""
    if isinstance(input_ids, Tensor) and input_ids.dim() == 1:
        return ": one prompt's ids are a batch of one, input_ids[None] ([1, seq_len])"
    if isinstance(input_ids, (list, tuple)) and all(isinstance(i, int) for i in input_ids):
        return ": one prompt's ids are a batch of one, torch.tensor([ids]) ([1, seq_len])"
    if isinstance(input_ids, (list, tuple)):
        return ": torch.tensor(ids), each row the same length (left-pad shorter prompts, with attention_mask)"
    return ""


def check_token_values(input_ids: Tensor, vocab_size: int) -> None:
    """Raise ``ValueError`` unless every id of ``input_ids`` is in ``[0, vocab_size)``."""
    # (one read of both bounds: on an accelerator each read of a value waits for the device)
    lo, hi = torch.stack(torch.aminmax(input_ids)).tolist()
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        # (the argument named: of generate, the forward and the export's, ids of another tokenizer are the usual cause)
        raise ValueError(f"input_ids: token id {bad} is outside the vocabulary [0, {vocab_size}) of the model "
                         "(vocab_size): encode the text with the tokenizer the model was trained with")


def _values_readable(tensor: Tensor) -> bool:
    """Whether a check may read ``tensor``'s values at no cost: on the CPU, outside
    ``torch.compile`` and not a fake tensor (``FakeTensorMode``: shapes without storage, as a
    memory or launch survey runs a model; its boolean indexing has no shape to give)."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling() and not is_fake(tensor)


def check_mask_values(attention_mask: Tensor) -> None:
    """Raise ``ValueError`` unless ``attention_mask`` holds only 0 (padding) and 1 (a real
    token): any other value was read as 1 without a word (an additive mask's 0 / -inf as
    padding / real, the other way round). Reads the values only on the CPU and outside
    ``torch.compile``: on an accelerator the read would wait for the device at every forward."""
    if not _values_readable(attention_mask):
        return
    bad = attention_mask[(attention_mask != 0) & (attention_mask != 1)]
    if bad.numel():
        raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (a real token); got {bad[0].item()} (an "
                         "additive mask of 0 and -inf is not taken: 1 where a token is, 0 where padding is)")


def check_device(tensor, name: str, device: torch.device | None) -> None:
    """Refuse ``tensor`` (``name``: the argument) on a device other than the model's,
    ``device``, before anything runs: a prompt built on the CPU for a model moved to CUDA
    (``torch.tensor(ids)`` after ``model.cuda()``) failed deep inside the forward with
    torch's "Expected all tensors to be on the same device" (or, replayed in a CUDA graph,
    was copied over without a word)."""
    if isinstance(tensor, Tensor) and device is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, the model on {device}: move it there first, "
                         f"{name}.to({str(device)!r}) (or build it with device={str(device)!r})")


def _checked_token_ids(input_ids: Tensor, vocab_size: int) -> Tensor:
    check_token_values(input_ids, vocab_size)
    return input_ids.clone()


#: The value check as one node of a compiled graph: reading the ids' values is
#: data-dependent, and calling the check through ``torch.compiler.disable`` was a graph
#: break, which ``torch.compile(model, fullgraph=True)`` refused. The op returns a copy of
#: the ids (a few bytes) that the embedding reads: an op without an output that anything
#: reads is dead code to Inductor, which dropped the check. It reads the ids to the host, which
#: a CUDA graph cannot hold: tagged ``cudagraph_unsafe``, so that ``mode="reduce-overhead"``
#: keeps it out of the captured graph (Inductor partitions the graph around it, or leaves that
#: graph uncaptured) instead of failing the capture. The decode steps CUDA graphs are for do not
#: run it (``static_decode_step`` and a transformers static cache skip the check).
checked_token_ids = torch.library.custom_op("attnres::checked_token_ids", _checked_token_ids, mutates_args=(),
                                            tags=(torch._C.Tag.cudagraph_unsafe,))


@checked_token_ids.register_fake
def _(input_ids: Tensor, vocab_size: int) -> Tensor:
    return torch.empty_like(input_ids)


IGNORE_INDEX = -100


def check_labels_type(labels) -> None:
    """Raise ``ValueError`` unless ``labels`` is a tensor of token ids (int64 or int32): float
    labels failed in cross-entropy's "expected target dtype to be Long" (or, cast, lost their
    fractions without a word)."""
    if not isinstance(labels, Tensor) or labels.dtype not in (torch.long, torch.int32):
        got = f"dtype {labels.dtype}" if isinstance(labels, Tensor) else type(labels).__name__
        raise ValueError(f"labels must be a tensor of token ids (torch.long or torch.int32, {IGNORE_INDEX} = ignored), "
                         f"got {got}")


def check_label_values(labels: Tensor, vocab_size: int) -> None:
    """Raise ``ValueError`` unless every label is a token id in ``[0, vocab_size)`` or
    ``IGNORE_INDEX``: cross-entropy failed with "Target 100 is out of bounds" (a device-side
    assert on CUDA). Reads the values only on the CPU and outside ``torch.compile``: on an
    accelerator the read would wait for the device at every forward with labels."""
    if not _values_readable(labels):
        return
    bad = labels[((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= vocab_size)]
    if bad.numel():
        raise ValueError(f"labels must be token ids in [0, {vocab_size}) or {IGNORE_INDEX} (ignored); got {int(bad[0])}")


def next_token_loss(logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy of ``logits [B, T, vocab]`` at positions ``0 .. T-2`` against ``labels
    [B, T]`` at ``1 .. T-1`` (the shift is done here), ignoring ``IGNORE_INDEX``, in at least
    float32. ``reduction``: ``"mean"`` over the predicted tokens, or ``"sum"``."""
    # (labels shifted by the caller failed in cross-entropy's "Expected input batch_size (14) to match target
    # batch_size (12)", 1-D labels with "too many indices")
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"next_token_loss: labels must be [batch, seq_len] as logits are [batch, seq_len, vocab] (the "
                         f"shift is done here); got labels {tuple(labels.shape)}, logits {tuple(logits.shape)}")
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
    if shifted.dtype in (torch.float16, torch.bfloat16):
        shifted = shifted.float()  # the loss in at least float32
    # (int32 labels, as int32 input ids, which the embedding takes: cross-entropy takes int64 only)
    return F.cross_entropy(shifted, labels[:, 1:].reshape(-1).long(), ignore_index=IGNORE_INDEX, reduction=reduction)


def plain_call(fn, *args):
    """``fn(*args)``: how :func:`run_sublayers` calls a sublayer unless told otherwise."""
    return fn(*args)


def sublayer_caller(mode: str) -> Callable:
    """How each sublayer is called for ``activation_checkpoint=mode``: ``"none"`` plainly,
    ``"block"`` under ``torch.utils.checkpoint`` (its activations recomputed in the backward
    pass), ``"selective"`` likewise but keeping the outputs of matmuls and attention (a
    ``SelectiveCheckpointContext`` policy)."""
    if mode == "none":
        return plain_call
    from torch.utils.checkpoint import checkpoint

    options = checkpoint_options(mode)
    return lambda fn, *args: checkpoint(fn, *args, **options)


def checkpoint_options(mode: str) -> dict:
    """The keyword arguments of ``torch.utils.checkpoint.checkpoint`` for
    ``activation_checkpoint=mode`` (``"block"`` or ``"selective"``): the non-reentrant
    implementation, and for ``"selective"`` the policy that keeps matmuls and attention.
    A transformers family's model takes them as its ``gradient_checkpointing_kwargs``."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if mode == "block":
        return {"use_reentrant": False}
    # (a partial of module-level functions: Dynamo's checkpoint operator takes a plain or
    # partial function as context_fn, and refused the nested one: selective under torch.compile)
    return {"use_reentrant": False,
            "context_fn": functools.partial(create_selective_checkpoint_contexts, _selective_policy)}


#: The operators whose outputs ``activation_checkpoint="selective"`` keeps.
_SELECTIVE_SAVE = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
                   torch.ops.aten._scaled_dot_product_flash_attention.default,
                   torch.ops.aten._scaled_dot_product_efficient_attention.default}


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SELECTIVE_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def run_sublayers(
    residual: ResidualStream,
    state: ResidualState,
    blocks,
    cos: Tensor,
    sin: Tensor,
    attn_mask: Tensor | None = None,
    kv_cache: KVStore | None = None,
    sublayer_call=plain_call,
) -> None:
    """Run the transformer blocks ``blocks`` (pairs ``(i, TransformerBlock)``, block ``i``
    holding sublayers ``2i`` and ``2i + 1``) on ``state``: each sublayer gets its input from
    the residual and hands its raw output back. ``cos``/``sin``: the RoPE tables of the ``T``
    positions, ``[T, head_dim]`` or ``[B, T, head_dim]``; ``attn_mask``: ``[B, 1, T, past + T]``
    (True = may attend) or ``None`` (causal). ``sublayer_call(fn, *args)`` runs each sublayer
    (activation checkpointing goes here)."""
    for i, layer in blocks:
        a, m = 2 * i, 2 * i + 1
        h_a = residual.sublayer_input(state, a)
        residual.add_output(state, a, sublayer_call(layer.attention_sublayer, h_a, cos, sin, attn_mask, kv_cache, i))
        h_m = residual.sublayer_input(state, m)
        residual.add_output(state, m, sublayer_call(layer.mlp_sublayer, h_m))


def _drop_compiled_prefix(trunk: DecoderTrunk, state_dict: dict, prefix: str, *args) -> None:
    """Before a state dict loads: where every name of it under ``prefix`` is a compiled model's
    (``_orig_mod.<name>``, from ``torch.compile(model).state_dict()``), load them as the model's
    own names, which failed as missing and unexpected keys. No module of the trunk is called so.
    (The library's checkpoint loaders match names more widely, ``attnres.checkpoint.module``.)"""
    marked = prefix + COMPILED_PREFIX
    names = [name for name in state_dict if name.startswith(prefix)]
    if names and all(name.startswith(marked) for name in names):
        for name in names:
            state_dict[prefix + name[len(marked):]] = state_dict.pop(name)


def _materialise_rope(trunk: DecoderTrunk, incompatible_keys) -> None:
    """After a state dict loads: the RoPE tables where the embedding's weight now is (a model
    built on meta and loaded with ``assign=True``: no state dict holds the tables)."""
    trunk.rope.materialise(trunk.embed_tokens.weight.device)


class DecoderTrunk(nn.Module):
    """Mixin: the decoder up to (not including) the LM head. Call :meth:`build_trunk` in
    ``__init__``; the modules keep the names ``embed_tokens``, ``layers.{i}``,
    ``residual``, ``norm`` (and the buffer-only ``rope``)."""

    model_config: ModelConfig
    #: Whether the residual may hand each block's norm a deferred input that the norm folds
    #: into the residual's merge (``FusableNormInput``). Tensor parallelism turns it off: its
    #: sequence-parallel norms take tensors only.
    defer_norm: bool = True
    #: What ``inputs_embeds [B, T, d]`` become before the residual takes them as ``v_0``
    #: (``None``: themselves). Tensor parallelism sets it to this rank's shard of the sequence,
    #: as the embedding of ``input_ids`` gives it there.
    shard_inputs_embeds: Callable[[Tensor], Tensor] | None = None

    def build_trunk(self, config: ModelConfig) -> None:
        """Build the embedding, the blocks, the residual, the final norm and the RoPE tables
        that ``config`` describes, under the names of the class docstring."""
        self.model_config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(
            TransformerBlock(config.d_model, config.n_heads, config.kv_heads, config.hidden_size, config.norm_eps)
            for _ in range(config.n_layers)
        )
        self.autocast_norm_outputs(config.residual.autocast_norm_output)
        self.residual = config.build_residual()
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.rope = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_load_state_dict_pre_hook(_drop_compiled_prefix)
        self.register_load_state_dict_post_hook(_materialise_rope)

    def autocast_norm_outputs(self, on: bool) -> bool:
        """Whether the sublayers' norms return the autocast dtype under autocast
        (``ModelConfig.residual.autocast_norm_output``, set at construction): set it to
        ``on``; returns what it was."""
        norms = [norm for layer in self.layers for norm in (layer.attn_norm, layer.mlp_norm)]
        before = norms[0].autocast_output
        for norm in norms:
            norm.autocast_output = on
        return before

    def check_input_ids(self, input_ids: Tensor) -> Tensor:
        """Raise ``ValueError`` unless ``input_ids`` is an integer ``[B, T]`` tensor of
        in-vocabulary ids with ``1 <= T <= max_seq_len``. Runs before any compute. Returns
        the ids to compute with: ``input_ids`` itself, or while ``torch.compile`` traces, the
        copy that :data:`checked_token_ids` makes after checking the values (the graph's
        node for the check: no graph break)."""
        config = self.model_config
        if not isinstance(input_ids, Tensor):
            raise ValueError(f"input_ids must be a tensor, got {type(input_ids).__name__}{one_prompt_hint(input_ids)}")
        if input_ids.dtype not in (torch.long, torch.int32):  # (the embedding's index types)
            raise ValueError(f"input_ids must be an integer tensor of token ids (torch.long or torch.int32), got dtype "
                             f"{input_ids.dtype}: use input_ids.long()")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape [batch, seq_len], got {tuple(input_ids.shape)}"
                             f"{one_prompt_hint(input_ids)}")
        b, t = input_ids.shape
        if b == 0 or t == 0:
            raise ValueError(f"input_ids must be non-empty, got shape {tuple(input_ids.shape)}")
        if t > config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds ModelConfig.max_seq_len={config.max_seq_len}")
        if input_ids.device.type == "meta":  # (shape inference: no values to check)
            return input_ids
        if torch.compiler.is_compiling():
            return checked_token_ids(input_ids, config.vocab_size)
        if is_fake(input_ids):  # (FakeTensorMode outside torch.compile, a shape survey: no values either)
            return input_ids
        check_token_values(input_ids, config.vocab_size)
        return input_ids

    def check_inputs(self, input_ids: Tensor | None, inputs_embeds: Tensor | None) -> tuple[Tensor | None, int, int]:
        """Check the one of ``input_ids [B, T]`` and ``inputs_embeds [B, T, d]`` given
        (:meth:`check_input_ids`, :meth:`check_inputs_embeds`); return ``(input_ids, B, T)``
        with the ids to compute with (what :meth:`check_input_ids` returns)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [batch, seq_len] and inputs_embeds [batch, seq_len, d_model]")
        if inputs_embeds is None:
            return (self.check_input_ids(input_ids), *input_ids.shape)
        self.check_inputs_embeds(inputs_embeds)
        return (None, *inputs_embeds.shape[:2])

    def check_inputs_embeds(self, inputs_embeds: Tensor) -> None:
        """Raise ``ValueError`` unless ``inputs_embeds`` is a ``[B, T, d_model]`` tensor in the
        embedding's dtype, on its device, with ``1 <= T <= max_seq_len``: what the model
        takes in place of ``input_ids`` (soft prompts, another modality's features).
        Reads shapes only."""
        config, weight = self.model_config, self.embed_tokens.weight
        if not isinstance(inputs_embeds, Tensor):
            raise ValueError(f"inputs_embeds must be a tensor, got {type(inputs_embeds).__name__}")
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.d_model:
            raise ValueError(f"inputs_embeds must have shape [batch, seq_len, d_model={config.d_model}], got "
                             f"{tuple(inputs_embeds.shape)}")
        if inputs_embeds.shape[0] == 0 or inputs_embeds.shape[1] == 0:
            raise ValueError(f"inputs_embeds must be non-empty, got shape {tuple(inputs_embeds.shape)}")
        if inputs_embeds.shape[1] > config.max_seq_len:
            raise ValueError(f"sequence length {inputs_embeds.shape[1]} exceeds ModelConfig.max_seq_len={config.max_seq_len}")
        if inputs_embeds.dtype != weight.dtype or inputs_embeds.device != weight.device:
            raise ValueError(f"inputs_embeds must be {weight.dtype} on {weight.device}, as the embedding's weight (what "
                             f"embed_tokens gives): got {inputs_embeds.dtype} on {inputs_embeds.device}")

    def positions(self, input_ids: Tensor, attention_mask: Tensor | None, past: int):
        """RoPE tables and the attention mask of ``input_ids [B, T]`` (or their embeddings
        ``[B, T, d]``: only the batch, length and device are read) after ``past`` cached
        positions: ``(cos, sin, attn_mask)``; ``attn_mask`` is ``None`` without padding,
        else ``[B, 1, T, past + T]`` (True = may attend)."""
        t = input_ids.shape[1]
        if attention_mask is None:
            cos, sin = self.rope(t, offset=past)
            return cos, sin, None
        if not isinstance(attention_mask, Tensor) or attention_mask.shape != (input_ids.shape[0], past + t):
            got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask must be a tensor of shape [batch, past + seq_len] = "
                             f"{(input_ids.shape[0], past + t)}, got {got}")
        check_mask_values(attention_mask)
        real = attention_mask.bool()
        # RoPE positions count real tokens; left padding sits at position 0.
        position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
        cos, sin = self.rope.at(position_ids)
        allowed = causal_mask(t, past + t, input_ids.device)  # [T, past + T]
        # A padded query attends to itself only, so that no softmax row is empty; no real
        # token ever attends to a padded key.
        keys = torch.arange(past + t, device=input_ids.device)
        self_key = keys == keys[past:, None]
        return cos, sin, (allowed & (real[:, None, :] | self_key)).unsqueeze(1)  # [B, 1, T, past + T]

    def decode(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        kv_cache: KVStore | None = None,
        *,
        record_weights: bool = False,
        sublayer_call=plain_call,
        inputs_embeds: Tensor | None = None,
    ) -> tuple[Tensor, ResidualState]:
        """The decoder up to (not including) the final norm: ``input_ids [B, T]`` (already
        validated) -> the residual's output aggregation ``h [B, T, d]`` and the residual state
        (its ``weights`` hold the depth weights with ``record_weights``). ``inputs_embeds
        [B, T, d]`` (already validated; ``input_ids`` then ``None``) stand for
        ``embed_tokens(input_ids)``: they are the residual's ``v_0``.

        ``kv_cache`` holds the keys/values of the ``past`` positions (its ``seq_len``); a
        cache with ``attention_inputs(rope, T)`` (``StaticKVCache``) keeps its fill level and
        padding on the device and gives the RoPE tables and mask itself (``attention_mask``
        must then be ``None``), so the pass reads nothing back to the host.
        ``sublayer_call(fn, *args)`` runs each sublayer (activation checkpointing)."""
        # (the length from the inputs, not the embedding: under tensor parallelism the embedding
        # of the ids is this rank's shard of the sequence)
        inputs = input_ids if inputs_embeds is None else inputs_embeds
        if hasattr(kv_cache, "attention_inputs"):
            if attention_mask is not None:
                raise ValueError("a static KV cache holds the padding itself (StaticKVCache.start): pass attention_mask=None")
            cos, sin, attn_mask = kv_cache.attention_inputs(self.rope, inputs.shape[1])
        else:
            past = 0 if kv_cache is None else kv_cache.seq_len
            cos, sin, attn_mask = self.positions(inputs, attention_mask, past)
        if inputs_embeds is None:
            x = self.embed_tokens(input_ids)
        else:
            x = inputs_embeds if self.shard_inputs_embeds is None else self.shard_inputs_embeds(inputs_embeds)
        # Every sublayer input goes through the block's own RMSNorm first, so the residual may
        # fold that norm into its Phase-2 kernel (defer_norm). Not into a checkpointed sublayer
        # under torch.compile: Dynamo's checkpoint operator takes tensors only, and a deferred
        # input made every checkpointed sublayer a graph break that ran eagerly.
        checkpointed = sublayer_call is not plain_call and torch.compiler.is_compiling()
        state = self.residual.start(x, record_weights=record_weights, defer_norm=self.defer_norm and not checkpointed)
        run_sublayers(self.residual, state, enumerate(self.layers), cos, sin, attn_mask, kv_cache, sublayer_call)
        return self.residual.finish(state), state
