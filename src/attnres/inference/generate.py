"""Prefill (one-shot or chunked), cached decode steps, sampling, ``generate`` and ``stream``.

The residual - standard, Full or Block AttnRes with its two-phase schedule - mixes over
depth for each token on its own, so prefill and decode simply run the model's normal
forward on the new tokens; only self-attention reads the :class:`KVCache`.

Shapes: ``input_ids [B, T]`` (integer), ``attention_mask [B, T]`` of 0/1 with **left**
padding (1 = real token), logits ``[B, vocab]`` (float32), sampled tokens ``[B]``.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterable, Iterator, Sequence
from numbers import Integral, Real

import torch
from torch import Tensor

from ..models.factory import context_limit
from ..models.lm import AttnResLM
from ..models.trunk import check_token_values, one_prompt_hint
from ..nn.compiled import uncompiled
from ..nn.kv_cache import KVCache, check_left_padding
from ..user_warning import warn_user
from ..validation import did_you_mean, did_you_mean_each
from . import static as _static  # (its cuda_graphs looked up at each call: the tests replace it)
from .kept_decoders import borrowed_decoder, freeing_kept_on_oom
from .static import StaticDecoder, check_device, check_native, check_tokens, model_device
from .stop_strings import RowStops, check_stop_strings

__all__ = ["DECODE_MODES", "resolve_decode", "prefill", "decode_step", "sample", "generate", "stream", "check_sampling",
           "stream_transformers"]

#: How :func:`stream` runs its decode steps: ``"dynamic"`` (the growing :class:`KVCache`,
#: eager), or over a static-capacity cache ``"static"`` (eager), ``"compiled"``
#: (``torch.compile``) or ``"graph"`` (a CUDA graph) - see :class:`StaticDecoder`;
#: ``"auto"`` is ``"graph"`` on CUDA and ``"dynamic"`` elsewhere.
DECODE_MODES = ("auto", "dynamic", "static", "compiled", "graph")
_STATIC_MODE = {"static": "eager", "compiled": "compiled", "graph": "graph"}
#: ``decode="graph"`` and ``"compiled"`` round the static cache's capacity up to a multiple of
#: this (at most ``max_seq_len``): a captured or compiled step's shapes include the capacity,
#: so generations whose prompt and ``max_new_tokens`` differ a little share one kept decoder.
_CAPACITY_STEP = 256
#: What ``generator=`` takes: none (torch's global generator), one for the whole batch, or one
#: per row of the batch (:func:`sample`).
Generators = torch.Generator | Sequence[torch.Generator] | None


def _check_mask(model: AttnResLM, input_ids: Tensor, attention_mask: Tensor | None,
                max_new_tokens: int | None = None) -> Tensor | None:
    """Validate the model, the prompt (with ``max_new_tokens``: that they fit the context,
    first - a prompt longer than the context is told what length fits) and its left-padding
    mask; return the mask as bool, or ``None`` when it masks nothing."""
    check_native(model, "prefill, generate and stream each")
    if max_new_tokens is not None and isinstance(input_ids, Tensor) and input_ids.dim() == 2:
        _check_context(input_ids.shape[1], max_new_tokens, model.config.max_seq_len, "ModelConfig.max_seq_len")
    model.check_input_ids(input_ids)
    device = model_device(model)
    check_device(input_ids, "input_ids", device)  # (before the mask's values are read: on its device)
    return _left_padding(input_ids, attention_mask, device)


def _left_padding(input_ids: Tensor, attention_mask: Tensor | None, device: torch.device | None) -> Tensor | None:
    """``attention_mask`` checked against the prompt ``input_ids`` (on ``device``, the model's;
    its shape, 0/1, left padding with a real token in each row) as bool, or ``None`` when it
    masks nothing."""
    check_device(attention_mask, "attention_mask", device)
    mask = check_left_padding(attention_mask, tuple(input_ids.shape), "the shape of input_ids")
    return None if mask is None or bool(mask.all()) else mask


def _check_chunk_size(chunk_size: int | None) -> None:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, Integral) or chunk_size < 1):
        raise ValueError(f"chunk_size must be an integer >= 1 or None (one shot), got {chunk_size!r}")


@torch.inference_mode()
def prefill(
    model: AttnResLM,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    chunk_size: int | None = None,
    capacity: int = 0,
) -> tuple[Tensor, KVCache]:
    """Run the prompt ``input_ids [B, T]`` through ``model`` and fill a new KV cache.

    ``chunk_size=C`` processes the prompt ``C`` tokens at a time (the last chunk may be
    shorter): the residual then holds its depth sources (block representations) for ``C``
    tokens at once, ``O(N C d)`` instead of ``O(N T d)``, and the result equals one-shot
    prefill up to floating-point rounding. ``capacity`` pre-sizes the cache (positions).

    Returns the logits of the last prompt position ``[B, vocab]`` in float32 and the cache.
    """
    mask = _check_mask(model, input_ids, attention_mask)
    _check_chunk_size(chunk_size)
    if isinstance(capacity, bool) or not isinstance(capacity, Integral) or capacity < 0:
        raise ValueError(f"capacity must be an integer >= 0 (positions to allocate; 0: the prompt's), got {capacity!r}")
    if capacity > (limit := model.config.max_seq_len):  # (allocated at once, never filled: as StaticKVCache refuses it)
        raise ValueError(f"capacity must be <= ModelConfig.max_seq_len={limit}, the most positions a generation fills; "
                         f"got {capacity}")
    t = input_ids.shape[1]
    if chunk_size is None:
        chunk_size = t
    cache = KVCache(model.config.n_layers, capacity=max(capacity, t))
    cache.left_padded = mask is not None
    for start in range(0, t, chunk_size):
        end = min(start + chunk_size, t)
        out = model(
            input_ids[:, start:end],
            kv_cache=cache,
            attention_mask=None if mask is None else mask[:, :end],
            last_logits_only=True,
        )
    return out.logits[:, -1].float(), cache


@torch.inference_mode()
def decode_step(model: AttnResLM, cache: KVCache, tokens: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Feed one token per sequence, ``tokens [B]``; return the next-token logits ``[B, vocab]``
    (float32). ``attention_mask [B, cache.seq_len + 1]`` (or ``None`` without padding)."""
    check_native(model, "decode_step", "decode_step(model, cache, tokens)")
    if not isinstance(tokens, Tensor) or tokens.dim() != 1:
        got = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(f"decode_step: tokens must have shape [B] (one token per sequence), got {got}")
    check_tokens(tokens, "tokens", model_device(model))
    if attention_mask is None and getattr(cache, "left_padded", False):  # (a cache of a prefill: KVCache)
        raise ValueError(f"decode_step: this cache was prefilled from a left-padded batch (its attention_mask holds "
                         f"zeros), so each step needs the mask too - the prompt's with a column of ones per token fed "
                         f"since, attention_mask [B, cache.seq_len + 1] = [{tokens.shape[0]}, {cache.seq_len + 1}], as "
                         "stream passes it; without it the padded keys would be attended")
    out = model(tokens[:, None], kv_cache=cache, attention_mask=attention_mask, last_logits_only=True)
    return out.logits[:, -1].float()


def check_sampling(temperature: float, top_k: int, top_p: float, max_new_tokens: int | None = None,
                   options: bool = False) -> None:
    """Raise ``ValueError`` naming the parameter and its allowed values on bad input; with
    ``options``, by its command-line option (``--max-new-tokens``), as ``attnres generate``
    checks them before it loads a model."""
    def name(parameter: str) -> str:
        return "--" + parameter.replace("_", "-") if options else parameter

    if isinstance(temperature, bool) or not isinstance(temperature, Real) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{name('temperature')} must be a finite number > 0, or 0 for greedy decoding; "
                         f"got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, Integral) or top_k < 0:
        raise ValueError(f"{name('top_k')} must be an integer >= 0 (0 = no top-k filter); got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, Real) or not (0 < top_p <= 1):
        raise ValueError(f"{name('top_p')} must be a number in (0, 1] (1 = no nucleus filter); got {top_p!r}")
    if max_new_tokens is not None:
        _check_max_new_tokens(max_new_tokens, name("max_new_tokens"))


def _check_max_new_tokens(max_new_tokens: int, name: str = "max_new_tokens") -> None:
    """What :func:`check_sampling` checks of ``max_new_tokens``, which the streams need given
    (``max_new_tokens=None`` ended in "unsupported operand type(s) for +: 'int' and 'NoneType'")."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral) or max_new_tokens < 1:
        raise ValueError(f"{name} must be an integer >= 1; got {max_new_tokens!r}")


def sample(
    logits: Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: Generators = None,
) -> Tensor:
    """Pick one token per row of ``logits [B, vocab]``: argmax for ``temperature == 0``,
    otherwise a draw from ``softmax(logits / temperature)`` restricted to the ``top_k``
    largest logits (``0`` = all) and then to the smallest set of tokens whose probability
    reaches ``top_p`` (nucleus). Returns ``[B]`` (int64).

    ``generator``: one ``torch.Generator`` that every row draws from (in one draw), or a
    sequence of ``B`` of them, one per row: row ``i`` then draws from ``generator[i]`` as
    a batch of that row alone would, so a prompt's sampled tokens do not depend on the
    other prompts of its batch (vLLM's per-request seed).

    A row without a distribution to draw from - NaN or infinite logits, or logits over a
    temperature near 0 beyond float32's range - takes its argmax, as greedy decoding does."""
    check_sampling(temperature, top_k, top_p)
    # (a forward's [B, T, vocab] stopped in torch.multinomial with "prob_dist must be 1 or 2 dim", and
    # one row's [vocab] drew a token without a batch, or failed in the top-k filter with "too many indices")
    if not isinstance(logits, Tensor) or logits.dim() != 2:
        got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"sample: logits must be a tensor [batch, vocab], got {got}: a forward's [batch, seq_len, "
                         "vocab] gives it as out.logits[:, -1], one row [vocab] as logits[None]")
    if logits.shape[1] == 0:  # (failed in argmax's "Expected reduction dim 1 to have non-zero size")
        raise ValueError(f"sample: logits must hold a logit for each token of the vocabulary, got {tuple(logits.shape)}: "
                         "no token to pick")
    _check_generator(generator, logits.device, logits.shape[0], "the logits")
    return _draw(logits, temperature, top_k, top_p, generator)


def _draw(logits: Tensor, temperature: float, top_k: int, top_p: float, generator: Generators) -> Tensor:
    """:func:`sample` of arguments checked already: the streams check them once, at the call,
    not at every token."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    raw, logits = logits, logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first stays).
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    probs = logits.softmax(dim=-1)
    invalid = probs.isnan().any(dim=-1, keepdim=True)  # (multinomial refuses such a row, or draws garbage on CUDA)
    probs = probs.masked_fill(invalid, 1.0)
    if generator is None or isinstance(generator, torch.Generator):
        drawn = torch.multinomial(probs, 1, generator=generator)
    else:  # one draw a row, each [1, vocab] as the row alone draws it: its generator's state moves as alone
        drawn = torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs.split(1), generator)])
    return torch.where(invalid, raw.argmax(dim=-1, keepdim=True), drawn).squeeze(-1)


def stream(
    model: AttnResLM,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_tokens: Iterable[int] = (),
    pad_token_id: int = 0,
    generator: Generators = None,
    chunk_size: int | None = None,
    decode: str = "auto",
    stop_strings: Iterable[str] | str = (),
    tokenizer=None,
) -> Iterator[Tensor]:
    """Yield the generated tokens step by step, one ``[B]`` tensor per step.

    A sequence that has produced one of ``stop_tokens`` is finished: the stop token is
    yielded, later steps yield ``pad_token_id`` for it, and the stream ends when every
    sequence is finished or after ``max_new_tokens`` steps. ``stop_strings`` (with the
    ``tokenizer`` whose ``decode(ids)`` gives the text) finish a sequence the same way at the
    token whose text completes one of them in the decoded text of its new tokens (the prompt's
    text is not searched) - across tokens or inside one; that token and the ones before are
    yielded, as transformers returns them (:func:`~attnres.inference.stop_strings.text_until_stop`
    gives the text before the stop string, what ``attnres generate --stop`` prints). Each
    step then reads the tokens on the host. Sampling as in :func:`sample`
    (``temperature=0``: greedy); ``generator`` makes sampling reproducible - one per row of
    the batch (a list) gives each row the tokens its prompt gets alone with that generator. The prompt is
    validated (non-empty, in-vocabulary ids of dtype ``torch.long`` or ``torch.int32``, on the
    model's device, ``T + max_new_tokens - 1 <= max_seq_len``) before anything runs.

    ``input_ids [B, T]``: the prompts; ``attention_mask [B, T]`` (1 for a token, 0 for
    padding; ``None``: no padding) for prompts of different lengths, left-padded.
    ``chunk_size``: prefill the prompt in chunks of that many tokens (less peak memory).
    ``decode`` (one of :data:`DECODE_MODES`) picks how the decode steps run; the static modes
    give the same tokens as ``"dynamic"`` (up to floating-point rounding of the logits).
    """
    check_native(model, "prefill, generate and stream each")  # (before resolve_decode reads its parameters)
    check_sampling(temperature, top_k, top_p)
    _check_max_new_tokens(max_new_tokens)
    _check_chunk_size(chunk_size)
    decode = resolve_decode(model, decode)
    mask = _check_mask(model, input_ids, attention_mask, max_new_tokens)
    _check_generator(generator, model_device(model), input_ids.shape[0], "the model")
    stops = _check_stops(stop_tokens, pad_token_id, model.config.vocab_size)
    texts = _row_stops(stop_strings, tokenizer, input_ids.shape[0])
    return _stream(model, input_ids, mask, max_new_tokens, temperature, top_k, top_p, stops, pad_token_id, generator,
                   chunk_size, decode, texts)


def _row_stops(stop_strings, tokenizer, batch_size: int) -> RowStops | None:
    """The stop strings' bookkeeping for a batch (``None``: there are none)."""
    stops = check_stop_strings(stop_strings, tokenizer)
    return RowStops(tokenizer, stops, batch_size) if stops else None


def _check_generator(generator, device: torch.device | None, rows: int, holder: str) -> None:
    """``generator`` must be ``None``, a ``torch.Generator``, or a sequence of ``rows`` of them
    (one per row of the batch), each on ``device`` - the device of ``holder`` (the model, the
    logits), where the tokens are drawn: a seed given as an int, or the README's CPU generator
    for a model moved to CUDA, failed in ``torch.multinomial`` after the prompt's prefill (or,
    greedy, was ignored without a word)."""
    if generator is None:
        return
    if isinstance(generator, torch.Generator):
        _check_generator_device(generator, "generator", device, holder)
        return
    if isinstance(generator, (str, bytes, Tensor)) or not isinstance(generator, Sequence):
        raise ValueError(f"generator must be a torch.Generator (torch.Generator().manual_seed(seed)), a list of them "
                         f"(one per row of the batch) or None; got {generator!r}")
    if len(generator) != rows:
        raise ValueError(f"generator: a list of generators takes one per row of the batch, {rows}; got "
                         f"{len(generator)}")
    for i, one in enumerate(generator):
        if not isinstance(one, torch.Generator):
            raise ValueError(f"generator[{i}] must be a torch.Generator (torch.Generator().manual_seed(seed)); got "
                             f"{one!r}")
        _check_generator_device(one, f"generator[{i}]", device, holder)


def _check_generator_device(generator: torch.Generator, name: str, device: torch.device | None, holder: str) -> None:
    if device is not None and generator.device.type != device.type:
        whose = holder + ("'" if holder.endswith("s") else "'s")
        raise ValueError(f"{name} is on {generator.device}, {holder} on {device}: the tokens are drawn on {whose} "
                         f"device; use torch.Generator(device={str(device)!r}).manual_seed(seed)")


def _check_stops(stop_tokens: Iterable[int], pad_token_id: int, vocab: int) -> list[int]:
    """``stop_tokens`` as a list, after checking it and ``pad_token_id`` against the vocabulary."""
    if (isinstance(stop_tokens, (Integral, str, bytes)) or not isinstance(stop_tokens, Iterable)
            or (isinstance(stop_tokens, Tensor) and stop_tokens.dim() == 0)):
        raise ValueError(f"stop_tokens must be a list of token ids in [0, {vocab}) ([id] for one); got {stop_tokens!r}")
    stops = list(stop_tokens)
    for name, ids, what in (("stop_tokens", stops, "token ids (Python ints)"),
                            ("pad_token_id", [pad_token_id], "a token id (a Python int)")):
        for tok in ids:
            if isinstance(tok, bool) or not isinstance(tok, Integral) or not 0 <= tok < vocab:
                raise ValueError(f"{name} must be {what} in [0, {vocab}); got {tok!r}")
    return stops


def _check_context(t: int, max_new_tokens: int, limit: int, name: str) -> None:
    """The prompt and every new token but the last (never fed back) must fit the context;
    the fix named fits with the other length as given (a prompt of at most ``limit`` tokens,
    what it named before, was too long by ``max_new_tokens - 1``)."""
    if t + max_new_tokens - 1 > limit:
        room, keep = limit - t + 1, limit - max_new_tokens + 1
        fixes = [f"max_new_tokens <= {room}"] * (room >= 1) + [f"a prompt of at most {keep} token{'s' * (keep != 1)}"] * (keep >= 1)
        raise ValueError(f"prompt length {t} + max_new_tokens {max_new_tokens} - 1 exceeds {name}={limit}: use "
                         + (" or ".join(fixes) or f"a prompt and max_new_tokens that add up to at most {limit + 1}"))


def resolve_decode(model, decode: str) -> str:
    """``decode`` checked against :data:`DECODE_MODES` for ``model``'s device, with ``"auto"``
    resolved (``"graph"`` on CUDA, ``"dynamic"`` elsewhere)."""
    if decode not in DECODE_MODES:
        # (StaticDecoder's mode="eager" is decode="static" here: the eager step over a static cache)
        hint = " (StaticDecoder's mode='eager' is decode='static' here)" if decode == "eager" else \
            did_you_mean(decode, DECODE_MODES)
        raise ValueError(f"decode must be one of {DECODE_MODES}; got {decode!r}{hint}")
    device = next(model.parameters()).device
    if decode == "auto":
        return "graph" if _static.cuda_graphs(device) else "dynamic"
    if decode == "graph" and not _static.cuda_graphs(device):
        raise ValueError(f"decode='graph' captures a CUDA graph: the model is on {device}; use 'compiled' or 'static'")
    return decode


def _stream(model, input_ids, mask, max_new_tokens, temperature, top_k, top_p, stops, pad_token_id, generator, chunk_size,
            decode, texts):
    """The generation loop behind :func:`stream`, on validated arguments (``mask``: bool or
    ``None``; ``texts``: the stop strings' :class:`RowStops`, or ``None``)."""
    b, t = input_ids.shape
    capacity = t + max_new_tokens - 1
    logits, cache = freeing_kept_on_oom(model, lambda: prefill(model, input_ids, mask, chunk_size,
                                                               capacity=capacity if decode == "dynamic" else t))
    static_steps = decode != "dynamic" and max_new_tokens > 1  # (one token needs no decode step)
    with _static_decoder(model, b, capacity, decode) if static_steps else contextlib.nullcontext() as static:
        if static is not None:
            static.load(cache, mask)
            cache = None  # (its keys and values are in the static cache now)
        yield from _steps(model, logits, cache, static, mask, max_new_tokens, temperature, top_k, top_p, stops,
                          pad_token_id, generator, texts)


def _static_decoder(model, batch_size: int, capacity: int, decode: str):
    """A context holding the :class:`StaticDecoder` for a static ``decode`` mode: for
    ``"graph"`` and ``"compiled"`` one kept across calls (:mod:`.kept_decoders`: a capture or
    compilation per call would cost more than a short generation), its capacity rounded up
    to a multiple of :data:`_CAPACITY_STEP` (at most ``max_seq_len``) so that generations of
    nearby lengths share it; for ``"static"`` (eager, cheap to build) a new one of exactly
    ``capacity``."""
    if decode == "static":
        return contextlib.nullcontext(StaticDecoder(model, batch_size, capacity, mode="eager"))
    capacity = min(-(-capacity // _CAPACITY_STEP) * _CAPACITY_STEP, model.config.max_seq_len)
    return borrowed_decoder(model, batch_size, capacity, _STATIC_MODE[decode])


def _steps(model, logits, cache, static, mask, max_new_tokens, temperature, top_k, top_p, stops, pad_token_id,
           generator, texts):
    """The decode loop of :func:`_stream` after prefill: over the dynamic ``cache`` (with the
    padding ``mask``), or over ``static``, a loaded :class:`StaticDecoder`."""
    b = logits.shape[0]
    stop_ids = torch.tensor(stops, dtype=torch.long, device=logits.device)
    finished = torch.zeros(b, dtype=torch.bool, device=logits.device)
    warned = False
    for step in range(max_new_tokens):
        finite = torch.isfinite(logits).all()
        tokens = _draw(logits, temperature, top_k, top_p, generator)
        tokens = tokens.masked_fill(finished, pad_token_id)
        finished |= torch.isin(tokens, stop_ids)
        last = step == max_new_tokens - 1
        if not last:
            # The next step is launched before anything here waits for this one: on a GPU it
            # runs while the host reads this step's tokens (below, and in the caller, which
            # prints them); when every sequence has just stopped, its logits go unused.
            # (Stream order: the sampling above reads the logits before the step overwrites
            # them - the CUDA graph's output buffer.)
            if static is not None:
                upcoming = static.step(tokens)
            else:
                if mask is not None:
                    mask = torch.cat([mask, mask.new_ones(b, 1)], dim=1)
                upcoming = decode_step(model, cache, tokens, mask)
        yield tokens
        # One host sync a step: whether every sequence is done, and whether the logits the
        # tokens came from were finite (NaN or infinite logits sample token 0, or argmax's
        # pick, without a word: a NUL byte with the byte tokenizer); with stop strings, the
        # tokens too, whose text ends rows.
        if texts is None:
            done, finite = torch.stack((finished.all(), finite)).tolist()
        else:
            done, finite = texts.update(tokens, finished, finite)
        if not finite and not warned:
            warn_user(f"the logits of generation step {step} are not finite (NaN or infinite): the tokens "
                      "generated from them are meaningless (weights that overflow, or a diverged checkpoint)",
                      RuntimeWarning)
            warned = True
        if last or done:
            return
        logits = upcoming


def stream_transformers(model, input_ids: Tensor, attention_mask: Tensor | None = None, *, max_new_tokens: int,
                        temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, stop_tokens: Iterable[int] = (),
                        pad_token_id: int = 0, generator: Generators = None,
                        stop_strings: Iterable[str] | str = (), tokenizer=None) -> Iterator[Tensor]:
    """:func:`stream` for a transformers causal LM - a family's model with an AttnRes residual
    (``model.hf_architecture``, ``attnres upcycle``), an export, or any other: the prompt
    ``input_ids [B, T]`` through the model once, then one token a step over its own cache
    (``past_key_values``), sampled as :func:`sample` samples; yields ``[B]`` per step.
    ``attention_mask [B, T]`` (1 for a token, 0 for padding; ``None``: no padding): prompts of
    different lengths, left-padded, checked as :func:`stream` checks it; the model gets it, and
    the position ids transformers' ``generate`` makes of it (real tokens counted) when its
    forward takes them, each step the mask one column longer - the tokens ``generate`` gives.
    Stop tokens and stop strings end a sequence as in :func:`stream` (later steps give it
    ``pad_token_id``; the stream ends when every sequence has ended). The arguments are checked
    at the call, as :func:`stream` checks them."""
    if not isinstance(model, torch.nn.Module) or not hasattr(getattr(model, "config", None), "vocab_size"):
        # (the arguments in another order failed in "'Tensor' object has no attribute 'config'")
        raise ValueError(f"stream_transformers takes a transformers causal LM first (model, input_ids, ...), got "
                         f"{type(model).__name__}")
    if isinstance(uncompiled(model), AttnResLM):  # (its forward failed on use_cache=True)
        raise ValueError("stream_transformers decodes a transformers causal LM over its own cache, got attnres's own "
                         "model (an AttnResLM): decode it with stream or generate (same arguments), or export it, "
                         "AttnResForCausalLM.from_native(model)")
    check_sampling(temperature, top_k, top_p)
    _check_max_new_tokens(max_new_tokens)
    stops = _check_stops(stop_tokens, pad_token_id, model.config.vocab_size)
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or 0 in input_ids.shape:
        got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a non-empty tensor of shape [batch, seq_len], got {got}"
                         f"{one_prompt_hint(input_ids)}")
    _check_generator(generator, model_device(model), input_ids.shape[0], "the model")
    # (a model that accelerate dispatched over devices, device_map=..., moves the ids itself)
    device = None if getattr(model, "hf_device_map", None) else model_device(model)
    check_tokens(input_ids, "input_ids", device)
    mask = _left_padding(input_ids, attention_mask, device)
    check_token_values(input_ids, model.config.vocab_size)  # (on CUDA, an id out of range is a device-side assert)
    _check_context(input_ids.shape[1], max_new_tokens, context_limit(model), "the model's context")
    texts = _row_stops(stop_strings, tokenizer, input_ids.shape[0])
    return _stream_transformers(model, input_ids, mask, max_new_tokens, temperature, top_k, top_p, stops, pad_token_id,
                                generator, texts)


def _stream_transformers(model, input_ids, mask, max_new_tokens, temperature, top_k, top_p, stops, pad_token_id,
                         generator, texts):
    """The loop behind :func:`stream_transformers`, on checked arguments (``mask``: bool or
    ``None``)."""
    # transformers 5.24 renamed the cache, argument and output field, from past_key_values; a
    # forward may take both names (ours do) while its output, transformers' class, has one
    parameters = inspect.signature(model.forward).parameters
    cache = "cache" if "cache" in parameters else "past_key_values"
    padding = {} if mask is None else _padded_inputs(mask, "position_ids" in parameters)
    stop_ids = torch.tensor(stops, dtype=torch.long, device=input_ids.device)
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    with torch.no_grad():
        out = model(input_ids=input_ids, use_cache=True, **padding)
        for step in range(max_new_tokens):
            tokens = _draw(out.logits[:, -1].float(), temperature, top_k, top_p, generator)
            tokens = tokens.masked_fill(finished, pad_token_id)
            finished |= torch.isin(tokens, stop_ids)
            if step < max_new_tokens - 1:  # launched before the caller reads this step's tokens
                padding = _next_padded_inputs(padding)
                out = model(input_ids=tokens[:, None], use_cache=True, **{cache: _output_cache(out)}, **padding)
            yield tokens
            if texts is not None:
                if texts.update(tokens, finished)[0]:
                    return
            elif stop_ids.numel() and bool(finished.all()):
                return


def _padded_inputs(mask: Tensor, positions: bool) -> dict[str, Tensor]:
    """The prefill's padding inputs as transformers' ``generate`` makes them from a left-padded
    ``mask``: the mask (0/1 integers, as a tokenizer gives it) and, for a forward that takes
    them (``positions``), position ids counting real tokens (``0`` on the padding)."""
    inputs = {"attention_mask": mask.long()}
    if positions:
        inputs["position_ids"] = (inputs["attention_mask"].cumsum(-1) - 1).masked_fill(~mask, 0)
    return inputs


def _next_padded_inputs(inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """The padding inputs of the next decode step: the mask one real column longer, the one
    new token's position after the last (none without padding)."""
    if not inputs:
        return inputs
    mask = inputs["attention_mask"]
    step = {"attention_mask": torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)}
    if "position_ids" in inputs:
        step["position_ids"] = inputs["position_ids"][:, -1:] + 1
    return step


def _output_cache(out):
    """The cache a transformers model's output holds: its ``cache`` field (transformers
    5.24 on), else ``past_key_values`` (before; the newest transformers on Python 3.10)."""
    return out.cache if hasattr(out, "cache") else out.past_key_values


def generate(model: AttnResLM, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
    """Generate after ``input_ids [B, T]``; returns the new tokens ``[B, n]`` with
    ``n <= max_new_tokens`` (fewer when every sequence stopped early; finished sequences
    are filled with ``pad_token_id``). Keyword arguments as in :func:`stream`."""
    unknown = sorted(set(kwargs) - set(_STREAM_KEYWORDS))
    if unknown:  # (was "stream() got an unexpected keyword argument", a function the call did not name)
        raise TypeError(f"generate() got unexpected keyword argument(s) {unknown}"
                        f"{did_you_mean_each(unknown, _STREAM_KEYWORDS, meant=_TRANSFORMERS_NAMES)}; it takes "
                        f"{', '.join(_STREAM_KEYWORDS)}")
    return torch.stack(list(stream(model, input_ids, attention_mask, **kwargs)), dim=1)


#: What ``generate`` passes on to :func:`stream`; ``help(generate)`` shows them in its signature.
_STREAM_KEYWORDS = [name for name, p in inspect.signature(stream).parameters.items() if p.kind is p.KEYWORD_ONLY]
generate.__signature__ = inspect.signature(stream).replace(return_annotation=Tensor)
#: transformers' ``generate`` arguments, by habit, and ours for them (spelling would suggest
#: ``pad_token_id`` for ``eos_token_id``).
_TRANSFORMERS_NAMES = {"eos_token_id": "stop_tokens", "max_length": "max_new_tokens", "do_sample": "temperature"}
