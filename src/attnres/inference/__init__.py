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

from typing import TYPE_CHECKING

from ..lazy_exports import lazy_exports
from ..nn.kv_cache import KVCache, StaticKVCache
from .generate import (DECODE_MODES, check_sampling, decode_step, generate, prefill, resolve_decode, sample, stream,
                       stream_transformers)
from .kept_decoders import release_decoders
from .static import STATIC_MODES, StaticDecoder, static_decode_step
from .stop_strings import StopStrings, TextPieces, text_until_stop

if TYPE_CHECKING:
    from .loading import LoadedRun, load_run, load_tokenizer

__all__ = ["KVCache", "StaticKVCache", "prefill", "decode_step", "sample", "generate", "stream", "stream_transformers",
           "check_sampling", "DECODE_MODES", "resolve_decode", "StaticDecoder", "STATIC_MODES", "static_decode_step",
           "release_decoders", "LoadedRun", "load_run", "load_tokenizer", "StopStrings", "TextPieces", "text_until_stop"]
# A run's loading, imported on first use (PEP 562): it imports the checkpoints' safetensors
# (the train extra), which decoding does not need - benchmarks/gpu_check.py decodes on a GPU
# machine with only PyTorch, Triton and NumPy installed.
__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(("LoadedRun", "load_run", "load_tokenizer"), ".loading"),
                                    globals(), extra=__all__)
