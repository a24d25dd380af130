"""How fast a token cache is written: the BPE encoding pieces one at a time against
``ENCODE_BATCH`` at a time (``tokenizers``' ``encode_batch``, one piece a thread).

The text is ``big.txt`` (the default corpus) with its lines shuffled, repeated to ``--mb``
million characters; a BPE of 4096 tokens trained on its first 2 MB encodes it through
``attnres.data.dataset._encode_to_file`` (the pieces of about 1 MB the caches are written
in), one piece a call and then the machine's default batch, interleaved, ``--repeats``
times each; the medians and their ratio. The ids are the same either way
(``tests/test_corpus_memory.py``). Time an idle machine: the batch runs on every core.

    python benchmarks/bench_tokenize.py            # 16 MB, 3 repeats: ~1 min on 2 cores
    python benchmarks/bench_tokenize.py --mb 0.2 --repeats 1 --out /tmp/tokenize   # a smoke run

Writes ``benchmarks/results/tokenize.{json,md}``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_training_overhead import log, out_stem, positive_int, run_header, write_results  # noqa: E402

from attnres.data import dataset  # noqa: E402
from attnres.data.corpus import default_corpus_path  # noqa: E402
from attnres.data.tokenizer import train_bpe  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {value!r}")
    return number


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=positive_float, default=16.0, help="millions of characters encoded (16)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed encodings of each kind (3)")
    parser.add_argument("--out", type=out_stem, default=str(RESULTS / "tokenize"),
                        help="path without suffix of the .json and .md (benchmarks/results/tokenize)")
    return parser.parse_args(argv)


def shuffled_text(chars: int) -> str:
    lines = Path(default_corpus_path()).read_text(encoding="utf-8").splitlines(keepends=True)
    rng, text = random.Random(0), []
    while sum(map(len, text)) < chars:
        rng.shuffle(lines)
        text.append("".join(lines))
    return "".join(text)[:chars]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = shuffled_text(int(args.mb * 1e6))
    tok = train_bpe(text[:2_000_000], 4096)
    batches = {"one piece a call": 1, f"{dataset.ENCODE_BATCH} pieces a call": dataset.ENCODE_BATCH}
    seconds: dict[str, list[float]] = {name: [] for name in batches}
    default = dataset.ENCODE_BATCH
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for _ in range(args.repeats):
                for name, batch in batches.items():
                    dataset.ENCODE_BATCH = batch
                    start = time.perf_counter()
                    tokens = dataset._encode_to_file(tok, text, Path(tmp) / "train.bin", np.uint16)
                    seconds[name].append(time.perf_counter() - start)
                    log(f"{name}: {seconds[name][-1]:.2f} s")
        finally:
            dataset.ENCODE_BATCH = default
    medians = {name: statistics.median(ts) for name, ts in seconds.items()}
    one, many = medians.values()
    results = {**run_header(), "characters": len(text), "tokens": tokens, "encode_batch": default,
               "seconds": seconds, "median_s": medians, "speedup": one / many}
    write_results(Path(args.out), results, render)
    return 0


def render(r: dict) -> str:
    rows = [f"| {name} | {s:.2f} | {r['characters'] / s / 1e6:.2f} |" for name, s in r["median_s"].items()]
    return "\n".join([
        "# Writing a token cache: the BPE's pieces one at a time or in batches", "",
        f"`{r['command']}` - {r['characters'] / 1e6:.1f} M characters of shuffled big.txt, {r['tokens']} tokens "
        f"(a BPE of 4096), {len(next(iter(r['seconds'].values())))} interleaved repeats, medians; "
        f"{r['machine']['cpu_count']} cores, torch {r['machine']['torch']}.", "",
        "| encoding | s | M characters / s |", "|---|---:|---:|", *rows, "",
        f"Batched: **{r['speedup']:.2f}x** as fast (the ids are the same).", ""])


if __name__ == "__main__":
    sys.exit(main())
