"""Memory of reading a corpus: a large one must fit in a small multiple of its size."""

import hashlib
import tracemalloc

from attnres.data.corpus import corpus_digest, load_corpus

LINE = "the quick brown fox jumps over the lazy dog, and the mill turns on; {}\n"


def _peak_of_loading(paths) -> int:
    tracemalloc.start()
    try:
        load_corpus([str(p) for p in paths], 0.02)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_reading_a_corpus_holds_it_at_most_twice(tmp_path):
    """The text was held four times over (five for several files: the documents, their
    join, the split's pieces, train + val joined again and its UTF-8 bytes for the digest):
    a 10 GB corpus needed some 45 GB of RAM on every run, a cache hit included."""
    files = []
    for k in range(2):
        files.append(tmp_path / f"part{k}.txt")
        files[-1].write_text("".join(LINE.format(i) for i in range(k * 20_000, (k + 1) * 20_000)))
    size = sum(f.stat().st_size for f in files)
    assert _peak_of_loading(files) < 2.3 * size


def test_the_digest_is_the_one_of_the_joined_text():
    """Checkpoints and caches of earlier versions name their data by this hash: hashing in
    pieces must not change it."""
    train, val = "é" * 1000 + "abc\n" * 300, "xyz\n" * 70
    want = hashlib.sha256(f"{len(train)}:".encode() + (train + val).encode("utf-8")).hexdigest()
    assert corpus_digest(train, val, chunk=7) == want
