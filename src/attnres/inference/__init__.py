"""Inference: KV cache, one-shot and chunked prefill, cached decoding, sampling, streaming.

>>> from attnres.inference import generate
>>> new_tokens = generate(model, input_ids, max_new_tokens=32, temperature=0.8, top_p=0.9)
"""

from ..nn.kv_cache import KVCache
from .generate import check_sampling, decode_step, generate, prefill, sample, stream

__all__ = ["KVCache", "prefill", "decode_step", "sample", "generate", "stream", "check_sampling"]
