"""AttnRes around a ``transformers`` decoder's own attention and MLP (or mixture-of-experts)
modules.

For a supported family ``X`` (``llama``, ``qwen3``, ``qwen3_moe``, ...) :mod:`.classes` writes out
a config class ``AttnResXConfig`` (``X``'s config plus ``attnres_residual`` and
``attnres_exact_eps``, with ``model_type = "attnres_X"``) and a model class
``AttnResXForCausalLM`` (``X``'s causal LM plus a ``residual`` module) over the mixins here
(:class:`UpcycledConfigMixin`, :class:`UpcycledModelMixin`); its :func:`register_families`
registers both with the Auto classes (``import attnres.hf`` calls it), so that a saved directory loads with
``AutoModelForCausalLM.from_pretrained``, no ``trust_remote_code``. Parameter names are ``X``'s own plus ``residual.*``, so a pretrained
``X`` checkpoint loads into the AttnRes model as it is (the residual starts at its faithful
init: zero pseudo-queries, unit key-norm gains).

The family's model loop runs unchanged (embedding, rotary tables, masks, caches, final
norm, head, logit soft-capping); each decoder layer's class is swapped for a subclass whose
``forward`` runs its two sublayers on inputs from the residual stream instead of adding their
outputs: layer 0 starts the stream from the embedding it receives, the last layer returns
the output aggregation, which the model's final norm then sees.

``attnres_exact_eps`` (set by :func:`attnres.upcycle.upcycle`): with zero queries every
mixer averages its ``n_l`` sources uniformly, and since they partition the outputs so far
(Full and Block alike) the sublayer input is ``h_l / n_l`` with ``h_l`` the standard
stream. ``RMSNorm_eps(x / n) = RMSNorm_{eps n^2}(x)``, so giving each pre-norm (and the final
norm) the epsilon ``eps / n_l^2`` makes the converted model the pretrained function exactly,
up to rounding (docs/upcycling.md).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn

from ...checkpoint.locate import refuse_loading_training_output
from ...migrations import migrate_residual_keys, stored_config
from ...nn.residual import ResidualConfig, ResidualStream, build_residual, validate_residual_config
from ...nn.residual.config import residual_as_dict
from ...models.saved_config import check_saved_config, config_source, naming_source
from .layout import PREFIX, Layout, family_of, layout_of
from .remote_code import KeepsItsSourceHome, SavesAutoMap
from .residual_module import FAMILY_KEY, naming_residual_module, saved_residual_module

try:  # transformers' record of the outputs of a forward (output_hidden_states, output_attentions)
    from transformers.utils.output_capturing import _active_collector as _output_collector
except ImportError:  # releases without it pass output_hidden_states down the layers instead
    _output_collector = None

__all__ = ["init_missing_tensors", "onload", "offload", "adjust_eps", "UpcycledConfigMixin", "UpcycledModelMixin",
           "SAVED_FIELDS", "PREFIX"]

_EPS_NAMES = ("variance_epsilon", "eps")


def init_missing_tensors(module: nn.Module, counterpart: nn.Module) -> None:
    """Copy into ``module``'s own parameters and buffers (not its children's) that
    transformers did not load (no ``_is_hf_initialized`` flag) the values of
    ``counterpart``, a freshly built module of the same structure."""
    mine = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
    theirs = dict(counterpart.named_parameters(recurse=False)) | dict(counterpart.named_buffers(recurse=False))
    with torch.no_grad():
        for key, tensor in mine.items():
            if not getattr(tensor, "_is_hf_initialized", False) and tensor.device.type != "meta":
                tensor.copy_(theirs[key].to(tensor.dtype))


def onload(module: nn.Module) -> list[nn.Module]:
    """Load the weights accelerate offloaded from ``module`` and its submodules, returning the
    modules to hand to :func:`offload` after the pass. ``device_map`` with ``"cpu"`` or
    ``"disk"`` entries (``"auto"`` with a ``max_memory`` the model exceeds) leaves offloaded
    parameters on the meta device, and accelerate's hooks load them when the module's forward
    runs; the decoder calls the residual's methods, never its forward, so its hooks did not
    fire and the pass stopped on its meta parameters."""
    if torch.compiler.is_compiling():
        return []  # (accelerate's hooks do not run under torch.compile)
    hooked: list[nn.Module] = []
    _find_hooked(module, hooked)
    for m in hooked:
        m._hf_hook.pre_forward(m)
    return hooked


def _find_hooked(module: nn.Module, into: list[nn.Module]) -> None:
    """Append ``module`` and its submodules that carry an accelerate hook to ``into``, reading
    the plain attributes: ``modules()`` and ``getattr`` through ``nn.Module.__getattr__`` took
    269 µs for a residual of 64 sublayers, this 25 (``timeit`` of onload + offload, 2,000 calls;
    the decoder searches at each forward)."""
    if module.__dict__.get("_hf_hook") is not None:
        into.append(module)
    for child in module._modules.values():
        if child is not None:
            _find_hooked(child, into)


def offload(hooked: list[nn.Module]) -> None:
    """Offload again what :func:`onload` loaded (accelerate's hooks after a forward)."""
    for m in hooked:
        m._hf_hook.post_forward(m, None)


class _Stream:
    """The per-model link between the decoder layers and the residual: the module, and the
    state of the forward in flight (started by layer 0, finished by the last layer).

    ``modules``: the model's own submodules (its ``_modules``, not the model: no reference
    cycle keeps a deleted model's memory). ``residual`` is read from them at each use, so a
    module put in its place is the one the layers use - PEFT's ``modules_to_save=["residual"]``
    wrapper, whose trainable copy the layers bypassed while they held the original."""

    def __init__(self, modules: dict[str, nn.Module], n_layers: int) -> None:
        self.modules, self.n_layers = modules, n_layers
        self.state = None
        self.record_weights = False
        # A recording forward's depth weights and finished residual state, until
        # _recorded_forward hands them on.
        self.weights: list[torch.Tensor] | None = None
        self.recorded = None
        self.onloaded: list[nn.Module] = []  # the residual's modules accelerate offloads, loaded for the pass

    @property
    def residual(self) -> ResidualStream:
        return self.modules["residual"]


def _set_eps(norm: nn.Module, eps: float) -> None:
    for name in _EPS_NAMES:
        if hasattr(norm, name):
            setattr(norm, name, eps)
            return
    raise ValueError(f"{type(norm).__name__} has none of the epsilon attributes {_EPS_NAMES}")


def adjust_eps(residual: ResidualStream, layers, final_norm: nn.Module, layout: Layout, eps: float) -> None:
    """``attnres_exact_eps``: each pre-norm of ``layers`` (decoder layers with the norms
    ``layout`` names), and ``final_norm``, gets ``eps / n^2`` for its mixer's ``n`` sources
    (module docstring). The norms may be transformers' or vLLM's (``variance_epsilon``).
    ``None`` in place of a layer or of ``final_norm``: held by another pipeline stage (vLLM),
    skipped."""
    counts = residual.sources_per_mixer()
    if not counts:
        return  # a residual without depth mixing: nothing is rescaled
    for l, n in enumerate(counts[:-1]):
        layer = layers[l // 2]
        if layer is not None:
            _set_eps(getattr(layer, layout.attn_norm if l % 2 == 0 else layout.mlp_norm), eps / n**2)
    if final_norm is not None:
        _set_eps(final_norm, eps / counts[-1] ** 2)


def _refuse_native_keywords(kwargs: dict) -> None:
    """``model(ids, return_depth_weights=True)``, the native model's keyword, reached the family's
    attention through its ``**kwargs`` and was dropped there: an output without the weights, and
    not a word. Refused, naming the methods that record them."""
    if kwargs.get("return_depth_weights"):
        raise ValueError("return_depth_weights is a keyword of attnres's own model (AttnResLM); a transformers model "
                         "of attnres.upcycle records the depth weights with model.depth_weights(input_ids) (one "
                         "[n_sources, batch, seq] tensor per sublayer, then the output aggregation) and its depth "
                         "mixing matrix with model.depth_mixing(input_ids)")


def _layer_forward(self, hidden_states, **kwargs):
    """A decoder layer of an upcycled model: its two sublayers on inputs from the residual.

    ``kwargs`` (mask, positions, rotary tables, the cache under the name the model loop
    uses: ``cache`` in transformers 5.24, ``past_key_values`` before) go to the attention
    as the family's own layer passes them."""
    stream, index, layout = self.__dict__["_attnres"]
    residual = stream.residual
    if index == 0:
        _refuse_native_keywords(kwargs)
        stream.onloaded = onload(residual)
        stream.state = residual.start(hidden_states, record_weights=stream.record_weights)
    state = stream.state
    checkpointing = self.__dict__.get("_attnres_checkpointing", False) and self.training
    scale = None if layout.output_scale is None else getattr(self, layout.output_scale)

    def finish(out, post):
        out = out if post is None else getattr(self, post)(out)
        return out if scale is None else out * scale

    def attention(h):
        out = getattr(self, layout.attn)(hidden_states=getattr(self, layout.attn_norm)(h), **kwargs)[0]
        return finish(out, layout.attn_post)

    def mlp(h):
        out = getattr(self, layout.mlp)(getattr(self, layout.mlp_norm)(h))
        if isinstance(out, tuple):  # GPT-OSS: (hidden, router scores); sparse blocks of some releases: (hidden, logits)
            out = out[layout.mlp_output or 0]
        return finish(out, layout.mlp_post)

    try:
        for l, sublayer in ((2 * index, attention), (2 * index + 1, mlp)):
            h = residual.sublayer_input(state, l)
            # Checkpointing per sublayer, never across the residual: a recomputed layer would
            # replay the residual's calls out of order.
            out = self._gradient_checkpointing_func(sublayer, h) if checkpointing else sublayer(h)
            residual.add_output(state, l, out)
    except BaseException:
        # A forward that fails (out of memory: lm-eval's batch-size search retries smaller)
        # let go of its state, which held every source and their graph until the next forward.
        stream.state = None
        raise
    if index == stream.n_layers - 1:
        stream.state = None
        out = residual.finish(state)
        offload(stream.onloaded)
        if stream.record_weights:
            stream.weights, stream.recorded = state.weights, state
        return out
    if _collecting_hidden_states():  # output_hidden_states=True: what the family reports after each layer
        return _stream_total(residual, state)
    return hidden_states  # the next layer reads the residual stream, not this


def _collecting_hidden_states() -> bool:
    """Whether transformers records the decoder layers' outputs as ``hidden_states`` in the
    forward in flight (its output-capturing hooks read what each layer returns)."""
    if _output_collector is None:
        return False
    collected = _output_collector.get()
    return collected is not None and "hidden_states" in collected


def _stream_total(residual: ResidualStream, state) -> torch.Tensor:
    """The hidden state between two decoder layers as ``output_hidden_states`` reports it: the
    sum of the residual's history - a single stream's ``h`` (standard, ReZero, LayerScale,
    Highway), or Full and Block AttnRes' sources, which partition the outputs so far: their
    sum is what the standard residual would carry, the pretrained model's hidden state at
    conversion. What the next sublayer reads is a depth mixture of them, not one tensor."""
    try:
        history = residual.history(state)
    except (ValueError, NotImplementedError):
        raise ValueError(f"output_hidden_states: the residual {type(residual).__name__} keeps no single stream between "
                         "decoder layers to report; leave output_hidden_states off (the model's last hidden state is "
                         "what its final norm returns) or use a standard, Full or Block AttnRes residual") from None
    parts = [*history.completed, *([] if history.running is None else [history.running])]
    return torch.stack(parts).sum(0) if len(parts) > 1 else parts[0]


def _checkpointing_flag(self):
    return False  # the layer is never checkpointed whole (see _layer_forward)


def _set_checkpointing_flag(self, value: bool) -> None:
    self.__dict__["_attnres_checkpointing"] = bool(value)


def _reduce_layer(self, protocol):
    """Pickle a swapped layer by its family's layer class, which any process can import (the
    AttnRes subclass is made at run time): ``torch.save(model)``, ``copy.deepcopy``, sending
    the model to another process."""
    reduced = object.__reduce_ex__(self, protocol)  # (copyreg.__newobj__, (cls,), state, ...)
    return (_swapped_layer, (type(self).__bases__[0],), *reduced[2:])


def _swapped_layer(base: type):
    """An empty layer of class ``_layer_class(base)``, for unpickling to fill."""
    cls = _layer_class(base)
    return cls.__new__(cls)


@functools.cache
def _layer_class(base: type) -> type:
    """``base`` (a decoder layer class) with the AttnRes forward."""
    return types.new_class(f"AttnRes{base.__name__}", (base,), exec_body=lambda ns: ns.update(
        forward=_layer_forward,
        gradient_checkpointing=property(_checkpointing_flag, _set_checkpointing_flag),
        __reduce_ex__=_reduce_layer,
        __module__=__name__,
    ))


#: The fields an upcycled family's saved config must hold, and what they are.
SAVED_FIELDS = {
    "attnres_residual": "the AttnRes residual settings: kind, block_size, ...",
    "attnres_exact_eps": "whether the pre-norms' epsilons are rescaled to keep the converted function exact",
}


class UpcycledConfigMixin(SavesAutoMap):
    """What the AttnRes version of a family's config adds: ``attnres_residual`` (a
    :class:`~attnres.nn.residual.ResidualConfig` as a mapping) and ``attnres_exact_eps``.
    A saved config must hold both, and name this family's model_type and architecture."""

    RESIDUAL_MODULE_KEY = FAMILY_KEY

    @classmethod
    def auto_classes(cls) -> tuple[str, dict[str, str]]:
        """What a saved directory's ``auto_map`` names (:class:`SavesAutoMap`; no ``AutoModel``:
        the causal LM holds the residual)."""
        return "attnres.hf.families.classes", {"AutoConfig": cls.__name__, "AutoModelForCausalLM": cls.architecture}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        refuse_loading_training_output(pretrained_model_name_or_path)
        kwargs.setdefault("name_or_path", str(pretrained_model_name_or_path))
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """As the family's ``from_dict`` (what every loader calls with a ``config.json``'s
        contents), refusing a config that lacks the AttnRes fields or names another model
        (:func:`attnres.models.saved_config.check_saved_config`). The residual keys of an
        earlier version it stores (``attnres_residual.impl``, ``kernels``) are migrated without
        a warning, and its single block is not warned of again (the upcycle or export that wrote
        it did): the user never wrote them."""
        source = config_source(kwargs)
        check_saved_config(config_dict, model_type=cls.model_type, architectures=(cls.architecture,),
                           required=SAVED_FIELDS, source=source, given=kwargs)
        with stored_config():  # (an earlier upcycle's spellings, a single block: said when it was written, not per read)
            if isinstance(config_dict.get("attnres_residual"), dict):
                config_dict = {**config_dict, "attnres_residual": migrate_residual_keys(
                    config_dict["attnres_residual"], f"{cls.__name__}.attnres_residual")}
            return naming_source(source, lambda: super(UpcycledConfigMixin, cls).from_dict(config_dict, **kwargs))

    def residual_kind(self) -> str:
        return self.attnres_residual["kind"]

    def __post_init__(self, **kwargs) -> None:
        module = saved_residual_module(kwargs, FAMILY_KEY)
        given = residual_as_dict(self.attnres_residual or {})
        # (ResidualConfig refuses a kind not registered here: named with the module config.json records)
        with naming_residual_module(module, given.get("kind", ResidualConfig.kind), FAMILY_KEY):
            self.attnres_residual = ResidualConfig.from_value(given).to_dict()
        super().__post_init__(**kwargs)
        with naming_residual_module(module, self.residual_kind(), FAMILY_KEY):
            validate_residual_config(self.residual_config(), self.hidden_size, 2 * self.num_hidden_layers)
        if self.residual_config().autocast_norm_output:
            raise ValueError(f"attnres_residual.autocast_norm_output applies to attnres' own transformer blocks; a "
                             f"{self.model_type!r} model's norms are its family's own: leave it false")

    def residual_config(self) -> ResidualConfig:
        return ResidualConfig.from_value(self.attnres_residual)


class InitsResidualFromFresh:
    """The faithful init of a residual whose tensors a checkpoint may lack: each module's
    missing tensors (:func:`init_missing_tensors`) take the values of a freshly built residual
    (:meth:`_new_residual`, built on the CPU once per init pass and dropped after it) - zero
    pseudo-queries, unit key-norm gains, each baseline's own init - whatever the module type."""

    def _new_residual(self) -> ResidualStream:
        """The residual the model's config describes, newly built."""
        raise NotImplementedError

    def _init_residual_tensors(self, module: nn.Module, name: str) -> None:
        """Init the residual's submodule ``module`` (``name`` within it; ``""``: the residual)."""
        fresh = self.__dict__.get("_fresh_residual")
        if fresh is None:
            with torch.device("cpu"):
                fresh = self.__dict__["_fresh_residual"] = self._new_residual()
        init_missing_tensors(module, fresh.get_submodule(name) if name else fresh)

    def initialize_weights(self) -> None:
        try:
            super().initialize_weights()
        finally:
            self.__dict__.pop("_fresh_residual", None)  # built for one init pass only


class UpcycledModelMixin(KeepsItsSourceHome, InitsResidualFromFresh):
    """What the AttnRes version of a family's causal LM adds: the ``residual`` module, the
    swapped decoder layers, the epsilon adjustment and the faithful init of the residual."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self._attach_residual()

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """As the family's class: the experts are the family's. transformers decides it from
        the source of the class's module, which here defines no experts: the default
        ``grouped_mm`` fell back to ``eager`` and asking for it was refused."""
        family = next(c for c in cls.__mro__ if c.__module__.startswith("transformers.models."))
        return family._can_set_experts_implementation()

    def _attach_residual(self) -> None:
        config = self.config
        layout = layout_of(family_of(config.model_type))
        layers = self.model.layers
        L = 2 * config.num_hidden_layers
        self.residual = build_residual(config.residual_config(), config.hidden_size, L)
        stream = _Stream(self._modules, config.num_hidden_layers)
        self.__dict__["_attnres_stream"] = stream
        for i, layer in enumerate(layers):
            base = type(layer)
            if "_attnres" in layer.__dict__:  # already swapped (attached twice)
                base = base.__bases__[0]
            layer.__class__ = _layer_class(base)
            if "_old_forward" in layer.__dict__:  # accelerate's hook (device_map) runs the forward it wrapped,
                layer._old_forward = types.MethodType(_layer_forward, layer)  # the family's: swap that one too
            layer.__dict__["_attnres"] = (stream, i, layout)
            # The family layer's own checkpointing flag (enabled before the upcycle), which the
            # swapped class's property would hide: it checkpoints the sublayers instead.
            if layer.__dict__.pop("gradient_checkpointing", False):
                layer.gradient_checkpointing = True
        if config.attnres_exact_eps:
            self._adjust_eps(layout)

    def _adjust_eps(self, layout: Layout) -> None:
        adjust_eps(self.residual, self.model.layers, self.model.norm, layout, self.config.rms_norm_eps)

    def _recorded_forward(self, *args, **kwargs):
        """``self(*args, **kwargs)`` recording the depth-attention weights: the weights and the
        finished residual state, which the stream then lets go of (kept on the model, their
        autograd graph held the whole forward's activations, and ``copy.deepcopy`` of the model
        failed on them)."""
        stream = self.__dict__["_attnres_stream"]
        stream.record_weights, stream.weights, stream.recorded = True, None, None
        try:
            self(*args, **kwargs)
            return stream.weights, stream.recorded
        finally:
            stream.record_weights, stream.weights, stream.recorded = False, None, None

    def depth_weights(self, *args, **kwargs) -> list[torch.Tensor]:
        """Run ``self(*args, **kwargs)`` recording the depth-attention weights; one tensor
        ``[n_sources, B, T]`` per sublayer, then the output aggregation. A residual without
        depth attention (the standard one, the baselines) has none: a ``ValueError`` naming
        it, and :meth:`depth_mixing`, which describes every residual (an empty list read as
        weights that were never computed)."""
        if not self.residual.has_depth_attention:
            raise ValueError(f"depth_weights: the {self.residual.name!r} residual computes no depth-attention "
                             "weights (Full and Block AttnRes do); model.depth_mixing(input_ids) gives its depth "
                             "mixing matrix (report §6.2)")
        return self.depth_weights_if_any(*args, **kwargs)

    def depth_weights_if_any(self, *args, **kwargs) -> list[torch.Tensor] | None:
        """:meth:`depth_weights`, or ``None`` (the forward run all the same, for the hooks and
        recorders of a caller that reads more than the weights) for a residual without depth
        attention, as the native model's ``return_depth_weights``."""
        if not self.residual.has_depth_attention:
            self(*args, **kwargs)
            return None
        weights, _ = self._recorded_forward(*args, **kwargs)
        return weights

    def depth_mixing(self, input_ids: torch.Tensor, per_channel: bool = False):
        """The depth mixing matrix (report §6.2) of a forward on ``input_ids [B, T]``: the
        residual's :class:`~attnres.nn.residual.mixing.MixingMatrix` (see
        :meth:`~attnres.nn.residual.ResidualStream.mixing_matrix`)."""
        _, state = self._recorded_forward(input_ids, use_cache=False)
        return self.residual.mixing_matrix(state, per_channel=per_channel)

    def training_forward_kwargs(self) -> dict[str, Any]:
        """What a training forward passes besides ``labels``: ``use_cache=False`` (see
        :meth:`evaluation_forward_kwargs`), and ``output_router_logits=True`` for a
        mixture-of-experts family whose causal LM then adds its load-balancing loss
        (``router_aux_loss_coef`` times ``aux_loss``) to the loss, as the family trains."""
        router = layout_of(family_of(self.config.model_type)).router
        moe = {"output_router_logits": True} if router is not None and router.aux_loss_coef else {}
        return {**self.evaluation_forward_kwargs(), **moe}

    def evaluation_forward_kwargs(self) -> dict[str, Any]:
        """What a loss-only forward (training, validation) passes besides ``labels``:
        ``use_cache=False``. The family's forward builds a KV cache by default (the config's
        ``use_cache``, which generation wants), holding every layer's keys and values to the
        end of the forward - memory a validation pass would otherwise free layer by layer -
        and transformers warns of it under activation checkpointing at every run."""
        return {"use_cache": False}

    def _init_weights(self, module: nn.Module) -> None:
        """The family's init, except for the residual's tensors: those the checkpoint lacks
        get the values of a freshly built residual (zero queries, unit gains)."""
        name = next((n for n, m in self.residual.named_modules() if m is module), None) if hasattr(self, "residual") else None
        if name is None:
            super()._init_weights(module)
            return
        self._init_residual_tensors(module, name)

    def _new_residual(self) -> ResidualStream:
        config = self.config
        return build_residual(config.residual_config(), config.hidden_size, 2 * config.num_hidden_layers)
