"""Inference: KV caches, one-shot and chunked prefill, cached decoding (eager, compiled or
in a CUDA graph), sampling, stop tokens and stop strings, streaming.

>>> import torch
>>> from attnres import AttnResLM, ModelConfig
>>> from attnres.inference import generate
>>> model = AttnResLM(ModelConfig.preset("tiny")).eval()  # a trained run's: load_run("runs/my-run").model
>>> input_ids = torch.tensor([[5, 17, 42]])     # a text's: torch.tensor([load_tokenizer(run).encode(text)])
>>> new_tokens = generate(model, input_ids, max_new_tokens=32, temperature=0.8, top_p=0.9,
...                       generator=torch.Generator().manual_seed(0))
>>> new_tokens.shape                            # [batch, new tokens]; load_tokenizer(run).decode(ids) their text
torch.Size([1, 32])
"""

from ..nn.kv_cache import KVCache, StaticKVCache
from .generate import (DECODE_MODES, check_sampling, decode_step, generate, prefill, resolve_decode, sample, stream,
                       stream_transformers)
from .loading import LoadedRun, load_run, load_tokenizer
from .static import STATIC_MODES, StaticDecoder, static_decode_step
from .stop_strings import StopStrings, TextPieces, text_until_stop

__all__ = ["KVCache", "StaticKVCache", "prefill", "decode_step", "sample", "generate", "stream", "stream_transformers",
           "check_sampling", "DECODE_MODES", "resolve_decode", "StaticDecoder", "STATIC_MODES", "static_decode_step",
           "LoadedRun", "load_run", "load_tokenizer", "StopStrings", "TextPieces", "text_until_stop"]
