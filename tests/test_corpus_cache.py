"""Token caches found by the corpus's files, without reading its text (docs/data.md, "The
plan for corpora larger than RAM", steps 1 and 4): the same cache names and fingerprints as
before, a changed file misses, and temporary caches of dead writers are removed."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from attnres.data import ByteTokenizer, corpus_fingerprint, load_corpus, prepare_data
from attnres.data import cache_index
from attnres.data import corpus as corpus_mod
from attnres.data import dataset as dataset_mod

#: A cache that attnres 1 (before files keys) wrote for OLD_TEXT, val_fraction 0.1, byte tokenizer.
OLD_CACHE = Path(__file__).parent / "fixtures" / "token-cache-v1" / "0c6fe5df97788713-byte256"
OLD_TEXT = "".join(f"{i} the quick brown fox jumps over the lazy dog by the old mill\n" for i in range(200))
#: What that version computed as the corpus's digest (its caches' names, checkpoints' data fingerprint).
OLD_DIGEST = "0c6fe5df9778871373e4f2168d3e51daf8938d75c48eea933a7ce6ba1c94d62e"


@pytest.fixture
def no_reading(monkeypatch):
    """Reading any data file fails the test."""
    monkeypatch.setattr(corpus_mod, "_read_file", lambda *a: pytest.fail("the text was read"))


def _corpus(path: Path, val_fraction: float = 0.1):
    return load_corpus([str(path)], val_fraction, read=False)


def test_a_cache_hit_reads_no_text(tmp_path, monkeypatch):
    """Every run read, split and hashed the whole corpus to find its cache (the text's hash
    was the key): 20 GB of RAM for a 10 GB corpus before its first step, a cache hit included."""
    (tmp_path / "c.txt").write_text(OLD_TEXT)
    made = prepare_data(_corpus(tmp_path / "c.txt"), "byte", cache_dir=str(tmp_path / "cache"))
    monkeypatch.setattr(corpus_mod, "_read_file", lambda *a: pytest.fail("the text was read"))
    corpus = _corpus(tmp_path / "c.txt")
    assert corpus_fingerprint(corpus, str(tmp_path / "cache")) == OLD_DIGEST
    for given in (None, ByteTokenizer()):  # (a checkpoint's tokenizer, on resume)
        hit = prepare_data(corpus, "byte", cache_dir=str(tmp_path / "cache"), given=given)
        assert hit.cache_dir == made.cache_dir and np.array_equal(hit.train, made.train)
    assert not corpus.is_read and corpus.digest == OLD_DIGEST


def test_a_cache_of_the_earlier_version_is_found_and_then_found_without_reading(tmp_path, monkeypatch):
    """The digest (cache names, checkpoint fingerprints) is the one earlier versions computed:
    their caches and checkpoints still match. A cache without files keys is found by the text
    once, then records them."""
    (tmp_path / "c.txt").write_text(OLD_TEXT)
    shutil.copytree(OLD_CACHE, tmp_path / "cache" / OLD_CACHE.name)
    assert load_corpus([str(tmp_path / "c.txt")], 0.1).digest == OLD_DIGEST
    monkeypatch.setattr(dataset_mod, "_write_cache", lambda *a: pytest.fail("the cache was made again"))
    first = prepare_data(_corpus(tmp_path / "c.txt"), "byte", cache_dir=str(tmp_path / "cache"))
    assert first.cache_dir == tmp_path / "cache" / OLD_CACHE.name and len(first.train) + len(first.val) == len(OLD_TEXT)
    monkeypatch.setattr(corpus_mod, "_read_file", lambda *a: pytest.fail("the text was read"))
    again = _corpus(tmp_path / "c.txt")
    assert prepare_data(again, "byte", cache_dir=str(tmp_path / "cache")).cache_dir == first.cache_dir
    assert again.digest == OLD_DIGEST and not again.is_read
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [OLD_CACHE.name]


def _same_size_edit(path: Path) -> None:
    """Change a word without changing the size, and set the modification time back (as
    ``touch -r`` or ``rsync -t`` can): the status-change time still moves."""
    before = path.stat()
    time.sleep(0.05)  # (past the file system's clock tick)
    path.write_text(path.read_text().replace("fox", "cat", 1))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_a_file_whose_status_changed_misses(tmp_path):
    """A file edited in place, even keeping its size and modification time, is read again
    (its status-change time moved): the new text's cache, never the old one's. One only
    touched is read again too, and finds its cache by the text, with no tokenising."""
    path = tmp_path / "c.txt"
    path.write_text(OLD_TEXT)
    old = prepare_data(_corpus(path), "byte", cache_dir=str(tmp_path / "cache"))
    _same_size_edit(path)
    corpus = _corpus(path)
    new = prepare_data(corpus, "byte", cache_dir=str(tmp_path / "cache"))
    assert corpus.is_read and corpus.digest != OLD_DIGEST and new.cache_dir != old.cache_dir
    assert b"cat" in bytes(np.asarray(new.train, dtype=np.uint8)) + bytes(np.asarray(new.val, dtype=np.uint8))
    time.sleep(0.05)
    path.touch()  # the same text, a new modification time
    touched = _corpus(path)
    assert prepare_data(touched, "byte", cache_dir=str(tmp_path / "cache")).cache_dir == new.cache_dir
    assert touched.is_read and len(list((tmp_path / "cache").iterdir())) == 2


def test_the_split_settings_and_the_files_are_part_of_the_key(tmp_path, no_reading):
    (tmp_path / "c.txt").write_text(OLD_TEXT)
    (tmp_path / "d.txt").write_text(OLD_TEXT)
    keys = {_corpus(tmp_path / "c.txt").files_key, _corpus(tmp_path / "c.txt", 0.2).files_key,
            _corpus(tmp_path / "d.txt").files_key, load_corpus([str(tmp_path / "c.txt")], 0.1, "body", False).files_key}
    assert len(keys) == 4


def test_caches_that_disagree_about_the_files_are_not_trusted(tmp_path):
    """Two caches recording the same files with other digests (text changed behind an
    unchanged key): the text is read."""
    for name, digest in (("a", "1" * 64), ("b", "2" * 64)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text(json.dumps({"digest": digest, "files": ["k"]}))
    assert cache_index.recorded_digest(tmp_path, "k") is None
    (tmp_path / "b" / "meta.json").write_text(json.dumps({"digest": "1" * 64, "files": ["k", "j"]}))
    assert cache_index.recorded_digest(tmp_path, "k") == "1" * 64
    for key in map(str, range(2 * cache_index.MAX_FILES_KEYS)):
        cache_index.record_files(tmp_path / "a", key)
    kept = json.loads((tmp_path / "a" / "meta.json").read_text())["files"]
    assert kept == [str(k) for k in range(cache_index.MAX_FILES_KEYS, 2 * cache_index.MAX_FILES_KEYS)]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_temporary_caches_of_dead_processes_of_this_host_are_removed(tmp_path):
    """A writer killed outright (SIGKILL, power loss) left its temporary cache for ever; the
    next run removes it when its process is gone from this host. Another host's (a live
    writer on a shared file system), a live process's, and one of an earlier version (no
    host in its name) stay."""
    (tmp_path / "c.txt").write_text(OLD_TEXT)
    root, host, dead = tmp_path / "cache", cache_index._host(), _dead_pid()
    names = {"dead": f".0123456789abcdef-byte256.tmp-{host}-{dead}",
             "elsewhere": f".0123456789abcdef-byte256.tmp-other-{host}-{dead}",
             "alive": f".0123456789abcdef-byte256.tmp-{host}-{os.getpid()}",
             "earlier": f".0123456789abcdef-byte256.tmp-{dead}"}
    for name in names.values():
        (root / name).mkdir(parents=True)
        (root / name / "train.bin").write_bytes(b"\0" * 64)
    made = prepare_data(_corpus(tmp_path / "c.txt"), "byte", cache_dir=str(root))
    left = {p.name for p in root.iterdir()}
    assert left == {made.cache_dir.name, names["elsewhere"], names["alive"], names["earlier"]}


def test_meta_temporaries_of_dead_processes_inside_caches_are_removed(tmp_path, monkeypatch):
    """record_files killed between writing a cache's .meta.json.tmp-<host>-<pid> and its
    rename left that file in the cache for ever; the next run removes it when its process is
    gone from this host, by the rules of the temporary caches beside it."""
    (tmp_path / "c.txt").write_text(OLD_TEXT)
    root, host, dead = tmp_path / "cache", cache_index._host(), _dead_pid()
    made = prepare_data(_corpus(tmp_path / "c.txt"), "byte", cache_dir=str(root)).cache_dir

    def killed(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_index.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        cache_index.record_files(made, "another files key")
    monkeypatch.undo()
    mine = cache_index.temporary_dir(made / "meta.json")
    assert mine.is_file()  # (what a kill leaves; this process is alive: it stays)
    names = {"dead": f".meta.json.tmp-{host}-{dead}", "elsewhere": f".meta.json.tmp-other-{host}-{dead}",
             "earlier": f".meta.json.tmp-{dead}"}
    for name in names.values():
        (made / name).write_text("{}")
    cache_index.remove_stale_temporaries(root)
    left = {p.name for p in made.iterdir()}
    assert names["dead"] not in left
    assert {mine.name, names["elsewhere"], names["earlier"], "meta.json", "train.bin"} <= left


def test_a_writer_names_its_temporary_cache_by_host_and_process(tmp_path, monkeypatch):
    """What a writer killed mid-way leaves is what the next run recognises as its own."""
    seen = []

    def killed(tok, text, path, *args):
        seen.append(path.parent.name)
        raise KeyboardInterrupt

    (tmp_path / "c.txt").write_text(OLD_TEXT)
    monkeypatch.setattr(dataset_mod, "_encode_to_file", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(_corpus(tmp_path / "c.txt"), "byte", cache_dir=str(tmp_path / "cache"))
    match = cache_index._TEMPORARY.fullmatch(seen[0])
    assert match and match["host"] == cache_index._host() and int(match["pid"]) == os.getpid()


@pytest.mark.usefixtures("one_thread")
def test_a_resume_on_a_cache_hit_checks_the_data_without_reading_it(tmp_path, monkeypatch):
    """The fingerprint a checkpoint recorded is checked against the one the cache recorded
    for the unchanged files; nothing is read, and the new checkpoint records the same."""
    pytest.importorskip("safetensors")
    pytest.importorskip("yaml")
    from test_train import overrides

    from attnres.checkpoint import read_checkpoint_state
    from attnres.train import load_config, train

    (tmp_path / "c.txt").write_text(OLD_TEXT * 3)
    run = overrides(tmp_path / "c.txt", tmp_path / "run", steps=3, warmup_steps=0, eval_every=3)
    first = train(load_config(None, [*run, "stop_after=2"]))
    want = read_checkpoint_state(first.checkpoint)["data"]["fingerprint"]
    assert want == load_corpus([str(tmp_path / "c.txt")], 0.02).digest
    monkeypatch.setattr(corpus_mod, "_read_file", lambda *a: pytest.fail("the text was read"))
    resumed = train(load_config(None, [*run, "resume=true"]))
    assert resumed.step == 3 and read_checkpoint_state(resumed.checkpoint)["data"]["fingerprint"] == want


def test_json_lines_read_line_ends_as_a_text_file_does_and_miss_the_earlier_version_s_cache(tmp_path, monkeypatch):
    """A ``.txt`` file's ``\\r\\n`` (and lone ``\\r``) are read as ``\\n``, but a ``.jsonl``
    record's text kept them: the same text gave other tokens by format. It reads as the text
    file now, and a cache the earlier reading made for the same files (found by their key,
    without reading) is not reused with its old tokens: the key's version changed."""
    docs = [f"{i} the quick brown fox\r\njumps over the lazy dog\rby the old mill\n" for i in range(60)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "t").mkdir()
    for i, doc in enumerate(docs):
        (tmp_path / "t" / f"{i:02}.txt").write_bytes(doc.encode())
    with monkeypatch.context() as earlier:  # the earlier reading: the record's text as it is
        earlier.setattr(corpus_mod, "_universal_newlines", lambda text: text, raising=False)
        earlier.setattr(corpus_mod, "READ_VERSION", 1)
        old = prepare_data(_corpus(tmp_path / "c.jsonl"), "byte", cache_dir=str(tmp_path / "cache"))
    assert 13 in np.asarray(old.train)
    corpus = _corpus(tmp_path / "c.jsonl")
    new = prepare_data(corpus, "byte", cache_dir=str(tmp_path / "cache"))
    as_text = prepare_data(_corpus(tmp_path / "t"), "byte", cache_dir=str(tmp_path / "cache"))
    assert corpus.is_read and new.cache_dir != old.cache_dir and new.cache_dir == as_text.cache_dir
    assert 13 not in np.asarray(new.train) and 13 not in np.asarray(new.val)
    assert np.array_equal(new.train, as_text.train) and np.array_equal(new.val, as_text.val)


def test_documents_are_files_and_json_lines_joined_by_a_blank_line(tmp_path):
    """docs/data.md, "Documents: files and JSON lines": a ``.jsonl`` file read the same text as
    a ``.txt`` holding its records one after another, and gave more tokens, with nothing said
    why. Each record is a document, as each file is, and the documents are joined by a blank
    line with no end-of-text token: the ``.jsonl`` gives the ids of the ``.txt`` holding its
    records joined by ``\\n\\n``, and 2 byte tokens more per record boundary than their
    concatenation; an empty record adds its separator; files are joined alike."""
    records = ["".join(f"{r}.{i} the quick brown fox jumps over the lazy dog\n" for i in range(50)) for r in range(8)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in records))
    (tmp_path / "joined.txt").write_text("\n\n".join(records))
    (tmp_path / "concatenated.txt").write_text("".join(records))

    def tokens(name: str) -> np.ndarray:
        data = prepare_data(_corpus(tmp_path / name), "byte", cache_dir=str(tmp_path / f"cache-{name}"))
        return np.concatenate([np.asarray(data.train), np.asarray(data.val)])

    as_jsonl, joined, concatenated = tokens("c.jsonl"), tokens("joined.txt"), tokens("concatenated.txt")
    assert np.array_equal(as_jsonl, joined)
    assert len(as_jsonl) - len(concatenated) == 2 * (len(records) - 1)
    def read(path: Path) -> tuple[str, str]:
        corpus = load_corpus([str(path)], 0.1)
        return corpus.train, corpus.val

    def as_text(name: str, text: str) -> tuple[str, str]:
        (tmp_path / name).write_text(text)
        return read(tmp_path / name)

    assert read(tmp_path / "c.jsonl") == read(tmp_path / "joined.txt")
    assert _corpus(tmp_path / "c.jsonl").digest == _corpus(tmp_path / "joined.txt").digest
    (tmp_path / "empty.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in ("a" * 300, "", "b" * 300)))
    assert read(tmp_path / "empty.jsonl") == as_text("empty.txt", "a" * 300 + "\n\n\n\n" + "b" * 300)
    (tmp_path / "files").mkdir()
    for i, record in enumerate(records):
        (tmp_path / "files" / f"{i}.txt").write_text(record)
    assert read(tmp_path / "files") == read(tmp_path / "joined.txt")
    # (what docs/data.md says is what is pinned here)
    said = " ".join((Path(__file__).parents[1] / "docs" / "data.md").read_text().split())
    for words in ("joined by one blank line, `\\n\\n`", "2 characters, and 2 byte tokens, per boundary",
                  "(`\"a\"`, `\"\"`, `\"b\"` read as `a\\n\\n\\n\\nb`)"):
        assert words in said, words
