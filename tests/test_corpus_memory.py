"""Reading a corpus without holding it (docs/data.md, "The plan for corpora larger than RAM",
step 2): the files are streamed, the split and the digest are the ones of the whole text,
byte for byte, and a cache miss holds no copy of the corpus."""

import functools
import hashlib
import json
import math
import random
import shutil
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest

from attnres.data import corpus as corpus_mod
from attnres.data import dataset as dataset_mod
from attnres.data import load_corpus, prepare_data
from attnres.data.tokenizer import ByteTokenizer, bpe_available, text_chunks, train_bpe

LINE = "the quick brown fox jumps over the lazy dog, and the mill turns on; {}\n"


def _old_split(paths: list[Path], val_fraction: float, text_field: str = "text") -> tuple[str, str, str]:
    """(train, val, digest) as attnres computed them from the whole text (commit 4df6077),
    kept here as the reference the streamed split must equal: caches and checkpoints name
    their data by this digest."""
    docs = []
    for path in paths:
        if path.suffix == ".jsonl":
            lines = path.read_text(encoding="utf-8-sig").splitlines()
            docs += [json.loads(line)[text_field] for line in lines if line.strip()]
        else:
            docs.append(path.read_text(encoding="utf-8-sig"))
    text = "\n\n".join(docs)
    n = corpus_mod.piece_count(len(text), val_fraction)
    bounds = [0]
    for k in range(1, n):
        target, end = max(bounds[-1], k * len(text) // n), (k + 1) * len(text) // n
        cuts = [text.find(sep, target, max(end, target + 1)) for sep in ("\n", " ")]
        bounds.append(next((c + 1 for c in cuts if c >= 0), min(target, len(text))))
    bounds.append(len(text))
    n_val = max(1, round(val_fraction * n))
    val_pieces = {int((j + 0.5) * n / n_val) for j in range(n_val)}
    pieces = list(zip(bounds, bounds[1:]))
    train = "".join(text[a:b] for i, (a, b) in enumerate(pieces) if i not in val_pieces)
    val = "".join(text[a:b] for i, (a, b) in enumerate(pieces) if i in val_pieces)
    digest = hashlib.sha256(f"{len(train)}:".encode() + (train + val).encode("utf-8")).hexdigest()
    return train, val, digest


def _corpora(root: Path) -> list[tuple[list[Path], float]]:
    """Corpora at the edges of reading and splitting: a byte-order mark, \\r\\n and \\r line
    ends, 2- and 4-byte characters, .jsonl records (an empty one among them), several files,
    one long line, no break at all, runs of line breaks, the smallest texts that split."""
    rng = random.Random(0)
    words = "alpha beta gamma délta ε 😀 zeta eta theta iota".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 12))) + "\n" for _ in range(3000)]
    files = {"bom.txt": b"\xef\xbb\xbf" + "".join(lines[:800]).encode(),
             "crlf.txt": "".join(lines[800:1600]).replace("\n", "\r\n").encode(),
             "cr.txt": "".join(lines[1600:1900]).replace("\n", "\r").encode(),
             "recs.jsonl": "\n".join([json.dumps({"text": "".join(lines[i:i + 9])}) for i in range(1900, 2500, 9)]
                                     + ["", json.dumps({"text": ""}), json.dumps({"text": "ü\n"})]).encode(),
             "oneline.txt": " ".join(line.strip() for line in lines[2500:]).encode(),
             "nobreak.txt": ("ab" * 6000).encode(),
             "breaks.txt": ("word " * 500 + "\n" * 300 + "z" * 3000 + "\n\n\n" + "y " * 2000).encode(),
             "tiny.txt": b"hello world\n" * 10, "tiny2.txt": b"x" * 333}
    for name, data in files.items():
        (root / name).write_bytes(data)
    p = {name: root / name for name in files}
    return [([p["bom.txt"]], 0.02), ([p["crlf.txt"]], 0.1), ([p["cr.txt"]], 0.05), ([p["recs.jsonl"]], 0.02),
            ([p["bom.txt"], p["recs.jsonl"], p["crlf.txt"], p["cr.txt"]], 0.02), ([p["oneline.txt"]], 0.02),
            ([p["nobreak.txt"]], 0.05), ([p["breaks.txt"]], 0.1), ([p["tiny.txt"]], 0.3), ([p["tiny2.txt"]], 0.1),
            ([p["breaks.txt"], p["tiny.txt"]], 0.3)]


@pytest.mark.parametrize("read_chunk", [1 << 20, 64, 7])
def test_the_streamed_split_and_digest_are_those_of_the_whole_text(tmp_path, monkeypatch, read_chunk):
    """The same train and validation text, byte for byte, and the same digest (cache names,
    checkpoints' data fingerprints) as when the whole text was read and split, however the
    files are read in parts (a \\r\\n, a cut target, a 4-byte character across two parts)."""
    monkeypatch.setattr(corpus_mod, "READ_CHUNK", read_chunk, raising=False)
    for paths, val_fraction in _corpora(tmp_path):
        train, val, digest = _old_split(paths, val_fraction)
        corpus = load_corpus([str(p) for p in paths], val_fraction)
        assert (corpus.digest, corpus.val, corpus.train) == (digest, val, train), (paths, val_fraction)
        assert corpus.train_length == len(train) and "".join(corpus.train_parts()) == train


def test_the_split_errors_are_those_of_the_whole_text(tmp_path):
    (tmp_path / "tiny.txt").write_text("hello world\n" * 10)
    with pytest.raises(ValueError, match=r"^the corpus \(120 characters\) is too small to hold out"):
        load_corpus([str(tmp_path / "tiny.txt")], 0.1)
    (tmp_path / "ws.txt").write_text("a" + "\n" * 5000 + "b")
    with pytest.raises(ValueError, match=r"^the corpus \(5002 characters\) is too small to split with val_fraction=0.1$"):
        load_corpus([str(tmp_path / "ws.txt")], 0.1)


def test_text_chunks_of_parts_are_those_of_their_join():
    """The BPE and the encoders read the training text in the pieces of text_chunks: streamed
    in parts, the pieces (and so the vocabulary and the token ids) must be the same."""
    rng = random.Random(1)
    text = "".join(rng.choice(["a", "bc ", "\n", "déf", "\n\n", "x" * 40]) for _ in range(3000))
    for size in (1, 16, 300, 1 << 20):
        want = list(text_chunks(text, size))
        for _ in range(5):
            cuts = sorted(rng.sample(range(len(text)), 40)) + [len(text)]
            parts = [text[a:b] for a, b in zip([0] + cuts, cuts)] + [""]
            assert list(text_chunks(iter(parts), size)) == want


def test_where_a_file_stops_being_utf8_is_found_without_reading_it_whole(tmp_path, monkeypatch):
    """A data file that is not UTF-8 was read whole to say where (2.7 times its size: a 30 GB
    .jsonl.zst named as data was killed rather than refused). It is read a chunk at a time now:
    the same line and byte as decoding it whole (characters cut by a chunk's end, a file cut
    mid-character), and a compressed file of 16 MB is refused holding under half its size."""
    rng = random.Random(3)
    monkeypatch.setattr(corpus_mod, "READ_CHUNK", 7)
    for _ in range(300):
        data = "".join(rng.choice(["a", "\n", "é", "€", "𝄞"]) for _ in range(rng.randint(0, 40))).encode()
        at = rng.randint(0, len(data))
        data = data[:at] + rng.choice([b"\xff", b"\xe9", b"\x80", b"", b"\xf0\x9d"]) + data[at:]
        (tmp_path / "f.txt").write_bytes(data)
        try:
            data.decode("utf-8")
            want = None
        except UnicodeDecodeError as e:
            want = (data.count(b"\n", 0, e.start) + 1, e.start)
        assert corpus_mod._first_non_utf8(tmp_path / "f.txt") == want, data
    monkeypatch.undo()
    (tmp_path / "big.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00" + rng.randbytes(1 << 24))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"is not UTF-8 text \(line 1, byte 1; a gzip-compressed file: decompress"):
            load_corpus([str(tmp_path / "big.jsonl.gz")])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # (a read buffer and the text reader's: about 5 MB)


def test_text_without_line_breaks_is_cut_into_bounded_pieces():
    """A corpus on one line (text8, a dump without line breaks) was one piece, the whole text
    encoded in one call (~75 bytes of the BPE's memory a character). Its pieces are at most
    twice the size, cut before a space where there is one (else anywhere), and streamed in
    parts they are still those of the join."""
    rng = random.Random(2)
    words = "".join(rng.choice(["ab ", "cdé ", "  ", "x" * 30, "\t"]) for _ in range(2000))
    for text, cut_before_space in ((words, True), ("y" * 5000, False)):
        for size in (1, 16, 300):
            pieces = list(text_chunks(text, size))
            assert "".join(pieces) == text and max(map(len, pieces)) <= 2 * size
            if size > 1:
                assert len(pieces) >= len(text) // (2 * size)
            if cut_before_space and size == 300:  # (a space in every 300 characters: each cut is before one)
                assert all(p.startswith(" ") for p in pieces[1:])
            for _ in range(3):
                cuts = sorted(rng.sample(range(len(text)), 30)) + [len(text)]
                parts = [text[a:b] for a, b in zip([0] + cuts, cuts)]
                assert list(text_chunks(iter(parts), size)) == pieces


@pytest.mark.skipif(not bpe_available(), reason="needs the tokenizers package")
def test_a_line_cut_before_its_spaces_keeps_the_bpe_ids():
    """Cutting a long line before a space does not change a byte-level BPE's ids: its
    pre-tokenizer splits there anyway."""
    text = "".join(LINE.format(i * 7 % 1000).replace("\n", "  ") for i in range(400))
    tok = train_bpe(text, 400)
    pieces = list(text_chunks(text, 500))
    assert len(pieces) > 20
    assert [i for piece in pieces for i in tok.encode(piece)] == tok.encode(text)


@pytest.mark.skipif(not bpe_available(), reason="needs the tokenizers package")
def test_pieces_cut_inside_whitespace_runs_keep_the_bpe_ids_of_the_whole_text():
    """The caches' pieces were cut just after the first line break past their size: inside a
    run of three (a paragraph break and a blank line), before an indent, after a line's
    trailing spaces, where the BPE's pre-tokenizer does not split - its merged "\\n\\n"
    became two "\\n", and the validation split's ids were not those `attnres eval --text`
    gives the same text as a whole. They are cut where it splits anyway: the ids are the
    whole text's, for every size, and in parts too."""
    rng = random.Random(4)
    blocks = ["para {} words here", "\n", "\n\n", "\n\n\n", "\n    indented {}", "  \n", " \n\n  ", "x" * 12, " "]
    text = "".join(rng.choice(blocks).format(i) + "ab cd" for i in range(3000))  # (a clean space in each block)
    tok = train_bpe(text, 320)
    assert {"ĊĊ", "ĊĠĠĠ"} <= set(tok.backend.get_vocab())  # (runs the pre-tokenizer keeps whole are merged)
    whole = tok.encode(text)
    for size in (60, 300, 1000):  # (no piece of 2 * size: each cut is a clean one)
        pieces = list(text_chunks(text, size))
        assert "".join(pieces) == text and len(pieces) > len(text) // (3 * size)
        assert [i for piece in pieces for i in tok.encode(piece)] == whole, size
        cuts = sorted(rng.sample(range(len(text)), 30)) + [len(text)]
        assert list(text_chunks(iter([text[a:b] for a, b in zip([0] + cuts, cuts)]), size)) == pieces


@pytest.mark.skipif(not bpe_available(), reason="needs the tokenizers package")
def test_a_cache_of_pieces_cut_inside_whitespace_runs_is_not_taken_by_a_new_run(tmp_path, monkeypatch):
    """An earlier version's BPE cache holds ids cut inside whitespace runs: a new run (the
    same corpus and settings: the same name then) would have taken them silently. It makes its
    own (named -cleancut), and so does a new run given the tokenizer (init_from, data.tokenizer=PATH:
    it trained on neither); a resumed run (it may have trained on the old cache: its data
    position counts that cache's windows) keeps the old one, with a warning. A byte cache's ids
    are the same."""
    monkeypatch.setattr(dataset_mod, "text_chunks", functools.partial(text_chunks, size=1000))
    (tmp_path / "c.txt").write_text("".join(LINE.format(i) + "\n\n" * (i % 3) for i in range(300)))
    corpus = load_corpus([str(tmp_path / "c.txt")], 0.1)
    data = prepare_data(corpus, "bpe", 300, str(tmp_path / "cache"))
    assert data.cache_dir.name.endswith("-bpe300-cleancut")
    old = data.cache_dir.with_name(data.cache_dir.name.removesuffix("-cleancut"))
    data.cache_dir.rename(old)  # (as an earlier version named it, with its ids: cut after each first line break)
    cuts = [0] + [corpus.train.index("\n", k) + 1 for k in range(1000, len(corpus.train), 1000)] + [len(corpus.train)]
    earlier = [i for a, b in zip(cuts, cuts[1:]) for i in data.tokenizer.encode(corpus.train[a:b])]
    assert earlier != data.tokenizer.encode(corpus.train)  # (one of them cut a run of line breaks)
    (old / "train.bin").unlink()
    np.asarray(earlier, np.uint16).tofile(old / "train.bin")
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({**meta, "n_train": len(earlier)}))
    again = prepare_data(corpus, "bpe", 300, str(tmp_path / "cache"))
    assert again.cache_dir.name == data.cache_dir.name and again.cache_dir.exists() and old.exists()
    shutil.rmtree(again.cache_dir)
    data.tokenizer.save(tmp_path / "tokenizer.json")
    for given in (dict(given=data.tokenizer), dict(tokenizer=str(tmp_path / "tokenizer.json"))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (no word of the old cache: it is not taken)
            made = prepare_data(corpus, **{"tokenizer": "bpe", "vocab_size": 300, **given},
                                cache_dir=str(tmp_path / "cache"))
        assert made.cache_dir.name.endswith("-cleancut") and old.exists()
        assert made.train.tolist() == data.tokenizer.encode(corpus.train)
        shutil.rmtree(made.cache_dir)
    with pytest.warns(UserWarning, match=r"was made by an earlier attnres, which cut the text into pieces inside "
                                         r"whitespace runs: .* It is kept for this run, which resumes a checkpoint"):
        kept = prepare_data(corpus, "bpe", 300, str(tmp_path / "cache"), given=data.tokenizer, resumed=True)
    assert kept.cache_dir == old and kept.train.tolist() == earlier
    assert prepare_data(corpus, "byte", cache_dir=str(tmp_path / "cache")).cache_dir.name.endswith("-byte256")
    # both found (a run started from the checkpoint made the current one): the one whose windows
    # the resumed run's data position counts
    made = prepare_data(corpus, "bpe", 300, str(tmp_path / "cache"))
    assert len(earlier) != len(made.train)
    with pytest.warns(UserWarning, match=r"was made by an earlier attnres, .* It is kept for this run, which resumes"):
        kept = prepare_data(corpus, "bpe", 300, str(tmp_path / "cache"), given=data.tokenizer, resumed=True,
                            fits=lambda train: len(train) == len(earlier))
    assert kept.cache_dir == old
    current = prepare_data(corpus, "bpe", 300, str(tmp_path / "cache"), given=data.tokenizer, resumed=True,
                           fits=lambda train: len(train) == len(made.train))
    assert current.cache_dir == made.cache_dir


@pytest.mark.skipif(not bpe_available(), reason="needs the tokenizers package")
@pytest.mark.usefixtures("one_thread")
def test_a_resumed_run_takes_the_earlier_cache_its_data_position_counts(tmp_path, monkeypatch):
    """attnres train stopped, then upgraded (its cache named as an earlier version named it), a
    new run started from its checkpoint since (init_from: a current cache, here a window shorter):
    the resume takes the cache it trained on, with a warning, where the current one has other
    windows than its data position counts ('sampler state does not match the data')."""
    from test_train import overrides

    from attnres.train import load_config, train

    monkeypatch.setattr(dataset_mod, "text_chunks", functools.partial(text_chunks, size=1000))
    (tmp_path / "c.txt").write_text("".join(LINE.format(i) + "\n\n" * (i % 3) for i in range(300)))
    args = overrides(tmp_path / "c.txt", tmp_path / "run", **{"data.tokenizer": "bpe", "data.vocab_size": 300},
                     seq_len=16, batch_size=2, steps=4, eval_every=2, eval_batches=1)
    assert train(load_config(None, [*args, "stop_after=2"])).step == 2
    [made] = (tmp_path / ".attnres-cache").iterdir()
    old = made.rename(made.with_name(made.name.removesuffix("-cleancut")))
    shutil.copytree(old, made)  # (the current cache, its ids cut elsewhere: a window fewer)
    meta = json.loads((made / "meta.json").read_text())
    ids = np.fromfile(made / "train.bin", dtype=meta["dtype"])[:-16]
    (made / "train.bin").unlink()
    ids.tofile(made / "train.bin")
    (made / "meta.json").write_text(json.dumps({**meta, "n_train": len(ids)}))
    with pytest.warns(UserWarning, match=r"was made by an earlier attnres, .* It is kept for this run, which resumes"):
        assert train(load_config(None, [*args, "resume=true"])).step == 4


@pytest.mark.skipif(not bpe_available(), reason="needs the tokenizers package")
def test_a_resumed_run_whose_cache_was_deleted_makes_it_again_rather_than_take_an_earlier_one_of_other_windows(
        tmp_path, monkeypatch):
    """A resumed run whose current cache was deleted (to free the disk), an earlier version's
    cache of its tokenizer still beside it: that one was taken, with "It is kept for this run",
    although its windows are not those its data position counts - the run trained on the
    current one, and the resume then failed with "sampler state does not match the data". It is
    made again, with the windows the position counts, and the earlier one is left alone."""
    monkeypatch.setattr(dataset_mod, "text_chunks", functools.partial(text_chunks, size=1000))
    (tmp_path / "c.txt").write_text("".join(LINE.format(i) + "\n\n" * (i % 3) for i in range(300)))
    cache = str(tmp_path / "cache")
    data = prepare_data(load_corpus([str(tmp_path / "c.txt")], 0.1), "bpe", 300, cache)
    trained_on = data.train.tolist()
    old = data.cache_dir.with_name(data.cache_dir.name.removesuffix("-cleancut"))
    shutil.copytree(data.cache_dir, old)  # (an earlier version's, its ids cut elsewhere: windows fewer)
    meta = json.loads((old / "meta.json").read_text())
    (old / "train.bin").unlink()
    np.asarray(trained_on[:-40], meta["dtype"]).tofile(old / "train.bin")
    (old / "meta.json").write_text(json.dumps({**meta, "n_train": len(trained_on) - 40}))
    shutil.rmtree(data.cache_dir)
    windows = len(trained_on) // 16  # (the checkpoint's data position: seq_len 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no word of the earlier cache: it is not taken)
        again = prepare_data(load_corpus([str(tmp_path / "c.txt")], 0.1), "bpe", 300, cache, given=data.tokenizer,
                             resumed=True, fits=lambda train: len(train) // 16 == windows)
    assert again.cache_dir.name.endswith("-cleancut") and again.train.tolist() == trained_on
    assert old.exists()


@pytest.mark.skipif(not bpe_available(), reason="needs the tokenizers package")
def test_the_bpe_of_the_streamed_training_text_is_the_one_of_the_string(tmp_path, monkeypatch):
    """The same vocabulary (the same tokenizer file) and the same token ids as the BPE trained
    on the training split as one string."""
    monkeypatch.setattr(corpus_mod, "READ_CHUNK", 1000, raising=False)
    (tmp_path / "c.txt").write_text("".join(LINE.format(i * 7 % 1000) for i in range(6000)))
    corpus = load_corpus([str(tmp_path / "c.txt")], 0.02, read=False)
    data = prepare_data(corpus, "bpe", 400, str(tmp_path / "cache"))
    want = train_bpe(corpus.train, 400)
    assert data.tokenizer.to_json() == want.to_json()
    ids = [i for piece in text_chunks(corpus.train) for i in want.encode(piece)]
    assert np.array_equal(np.asarray(data.train), ids)


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_pieces_encoded_in_batches_give_the_ids_of_each_piece_alone(tmp_path, monkeypatch, kind):
    """The caches' pieces are encoded several at a time (on the BPE's threads): the ids, and
    so the caches, are those of encoding one piece after the other, the last batch short."""
    if kind == "bpe" and not bpe_available():
        pytest.skip("needs the tokenizers package")
    text = "".join(LINE.format(i * 13 % 997) for i in range(400))
    tok = train_bpe(text, 300) if kind == "bpe" else ByteTokenizer()
    monkeypatch.setattr(dataset_mod, "text_chunks", functools.partial(text_chunks, size=700))
    monkeypatch.setattr(dataset_mod, "ENCODE_BATCH", 3)
    pieces = list(text_chunks(text, 700))
    batches = []
    monkeypatch.setattr(tok, "encode_batch", lambda texts, encode=tok.encode_batch: batches.append(texts) or encode(texts))
    n = dataset_mod._encode_to_file(tok, iter([text[:1000], text[1000:]]), tmp_path / "t.bin", np.uint16,
                                    length=len(text))
    want = [i for piece in pieces for i in tok.encode(piece)]
    assert n == len(want) and np.array_equal(np.fromfile(tmp_path / "t.bin", dtype=np.uint16), want)
    assert [len(b) for b in batches] == [3] * (len(pieces) // 3) + [len(pieces) % 3] * (len(pieces) % 3 > 0)


def test_a_file_changed_after_the_split_is_said(tmp_path):
    (tmp_path / "c.txt").write_text("".join(LINE.format(i) for i in range(300)))
    corpus = load_corpus([str(tmp_path / "c.txt")], 0.02)
    with (tmp_path / "c.txt").open("a") as f:
        f.write("more\n")
    with pytest.raises(ValueError, match=r"^the data files changed while they were read \(21,\d+ characters now, "
                                         r"21,\d+ before\): run again once they stay as they are$"):
        prepare_data(corpus, "byte", cache_dir=str(tmp_path / "cache"))
    assert not list((tmp_path / "cache").glob("*/meta.json")) and not list((tmp_path / "cache").glob(".*"))


def test_a_cache_miss_holds_no_copy_of_the_corpus(tmp_path, monkeypatch):
    """The text was read into one string and split into two (2x the corpus, before the
    caches were made: 20 GB of RAM for a 10 GB corpus). Now the files are streamed in parts
    (here of 16 K characters, and tokenised in pieces of 16 K: 1 M by default), and only
    the validation text (2 %) is held."""
    monkeypatch.setattr(corpus_mod, "READ_CHUNK", 1 << 14, raising=False)
    monkeypatch.setattr(dataset_mod, "text_chunks", functools.partial(text_chunks, size=1 << 14))
    monkeypatch.setattr(dataset_mod, "ENCODE_BATCH", 2)  # (pieces held at once: the cores, up to 8)
    files = []
    for k in range(3):
        files.append(tmp_path / f"part{k}.txt")
        files[-1].write_text("".join(LINE.format(i) for i in range(k * 15_000, (k + 1) * 15_000)))
    size = sum(f.stat().st_size for f in files)
    tracemalloc.start()
    try:
        corpus = load_corpus([str(p) for p in files], 0.02)
        data = prepare_data(corpus, "byte", cache_dir=str(tmp_path / "cache"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(data.train) + len(data.val) == size + 4  # (and the two separators between three files)
    assert peak < 0.2 * size, f"{peak / size:.2f}x the corpus"
    assert math.isclose(len(corpus.val) / size, 0.02, rel_tol=0.2)

