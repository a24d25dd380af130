"""Tokenizers that mark the start of every text they encode (a SentencePiece-style
``tokenizer.json``: Llama 2's and Mistral v0.1's ``Prepend("▁")`` normalizer, a ``Metaspace``
pre-tokenizer whose ``prepend_scheme`` is "always" or "first"). The token caches encode a
text in the pieces of ``text_chunks``: each piece after the first was read as a text's start
("▁word" where the whole text has "word"), and the ids changed at every cut. Tiny tokenizers
of each style are trained here, on a few lines (nothing is downloaded). And the last-resort
cut of a text with neither a line break nor a space, where the pre-tokenizer splits."""

import functools
import shutil

import numpy as np
import pytest

from attnres.data import dataset as dataset_mod
from attnres.data import load_corpus, prepare_data
from attnres.data.tokenizer import BPETokenizer, ByteTokenizer, bpe_available, text_chunks, train_bpe

pytestmark = pytest.mark.skipif(not bpe_available(), reason="needs the tokenizers package")

TEXT = ("The quick brown fox jumps over the lazy dog.\nA second line of text here.\n" * 3
        + "Pack my box with five dozen liquor jugs.\nHow vexingly quick daft zebras jump!\n") * 4

#: The styles built below: each marks a text's start, but for "metaspace-never" (no "▁" put
#: before a text) and attnres's own byte-level BPE.
STYLES = ("llama2", "metaspace-always", "metaspace-first", "metaspace-first-unsplit", "unigram-always",
          "bytelevel-prefix-space")


def _trained(model, trainer, pre_tokenizer, normalizer=None, decoder=None):
    """A ``tokenizers.Tokenizer`` trained on :data:`TEXT` with merges inside words only (as
    SentencePiece trains, split at whitespace, its line break a byte of its own), then given
    ``pre_tokenizer`` to encode with."""
    from tokenizers import Tokenizer, pre_tokenizers

    tok = Tokenizer(model)
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(prepend_scheme="never"),
                                                 pre_tokenizers.Split("\n", "isolated")])
    tok.train_from_iterator([TEXT], trainer=trainer)
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    return tok


def spm_style(style: str) -> BPETokenizer:
    """A tiny tokenizer of ``style``: "llama2" (Llama 2 / Mistral v0.1: normalizer
    ``Prepend("▁")`` + ``Replace(" ", "▁")``, no pre-tokenizer, byte fallback),
    "metaspace-<scheme>" (a BPE with a ``Metaspace`` pre-tokenizer of that ``prepend_scheme``;
    "metaspace-first-unsplit": one that does not split at spaces, as transformers converts Llama's
    tokenizer with ``legacy=False``),
    "unigram-always" (a Unigram with ``Metaspace``, as T5's) or "bytelevel-prefix-space" (a
    byte-level BPE whose ``ByteLevel`` has ``add_prefix_space``)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    bpe = functools.partial(trainers.BpeTrainer, vocab_size=400, show_progress=False)
    if style == "llama2":
        prepend = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        return BPETokenizer(_trained(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True),
                                     bpe(special_tokens=["<unk>", "<s>", "</s>"]), None, prepend,
                                     decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                                        decoders.Fuse(), decoders.Strip(" ", 1, 0)])))
    if style.startswith("metaspace-"):
        scheme, split = style.removeprefix("metaspace-").removesuffix("-unsplit"), not style.endswith("-unsplit")
        return BPETokenizer(_trained(models.BPE(unk_token="<unk>"), bpe(special_tokens=["<unk>"]),
                                     pre_tokenizers.Metaspace(prepend_scheme=scheme, split=split), None,
                                     decoders.Metaspace(prepend_scheme=scheme)))
    if style == "unigram-always":
        trainer = trainers.UnigramTrainer(vocab_size=100, special_tokens=["<unk>"], unk_token="<unk>",
                                          show_progress=False)
        return BPETokenizer(_trained(models.Unigram(), trainer, pre_tokenizers.Metaspace(prepend_scheme="always"),
                                     None, decoders.Metaspace(prepend_scheme="always")))
    assert style == "bytelevel-prefix-space"
    tok = Tokenizer.from_str(train_bpe(TEXT, 300).to_json())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    return BPETokenizer(tok)


def _pieces_ids_in_cache(tok, text, tmp_path, monkeypatch, size=64) -> list[int]:
    """The ids the token caches write for ``text`` cut in pieces of about ``size`` characters."""
    monkeypatch.setattr(dataset_mod, "text_chunks", functools.partial(text_chunks, size=size))
    monkeypatch.setattr(dataset_mod, "ENCODE_BATCH", 3)  # (several batches: the context crosses them)
    n = dataset_mod._encode_to_file(tok, text, tmp_path / "t.bin", np.uint16)
    ids = np.fromfile(tmp_path / "t.bin", dtype=np.uint16).tolist()
    assert len(ids) == n
    return ids


@pytest.mark.parametrize("style", STYLES)
def test_each_piece_read_alone_is_read_as_a_text_start(style):
    """What the caches did: the pieces' ids, joined, are not the whole text's."""
    tok = spm_style(style)
    pieces = list(text_chunks(TEXT, 64))
    assert len(pieces) > 10 and "".join(pieces) == TEXT
    assert [i for piece in pieces for i in tok.encode(piece)] != tok.encode(TEXT)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("size", [20, 64, 100])
def test_the_caches_pieces_give_the_ids_of_the_whole_text(style, size, tmp_path, monkeypatch):
    """Each piece after the first is read after the text before its cut: the ids are those of
    the whole text, which attnres eval --text and analyze --text encode in one call."""
    tok = spm_style(style)
    assert tok.marks_text_start
    assert _pieces_ids_in_cache(tok, TEXT, tmp_path, monkeypatch, size) == tok.encode(TEXT)


@pytest.mark.parametrize("tok", [train_bpe(TEXT, 300) if bpe_available() else None, ByteTokenizer()],
                         ids=["bpe", "byte"])
def test_byte_level_and_byte_ids_are_those_of_each_piece_alone_as_before(tok, tmp_path, monkeypatch):
    """attnres's own BPE and bytes read a piece's start as any other place: their pieces are
    encoded alone, as before, and their caches keep their names."""
    assert not tok.marks_text_start
    want = [i for piece in text_chunks(TEXT, 64) for i in tok.encode(piece)]
    assert _pieces_ids_in_cache(tok, TEXT, tmp_path, monkeypatch) == want == tok.encode(TEXT)


def test_a_metaspace_without_a_prepended_mark_does_not_mark_a_text_start():
    assert not spm_style("metaspace-never").marks_text_start


def _corpus_file(tmp_path):
    (tmp_path / "c.txt").write_text(TEXT * 6)
    return str(tmp_path / "c.txt")


@pytest.mark.parametrize("style", ["llama2", "metaspace-first"])
def test_a_cache_of_such_a_tokenizer_holds_the_ids_of_each_split_as_a_whole(style, tmp_path, monkeypatch):
    """data.tokenizer=PATH of a Llama-2-style tokenizer.json: the training split's ids (streamed
    in parts) and the validation split's are those of each split encoded as one."""
    monkeypatch.setattr(dataset_mod, "text_chunks", functools.partial(text_chunks, size=100))
    spm_style(style).save(tmp_path / "tokenizer.json")
    corpus = load_corpus([_corpus_file(tmp_path)], 0.2)
    data = prepare_data(corpus, str(tmp_path / "tokenizer.json"), cache_dir=str(tmp_path / "cache"))
    assert data.cache_dir.name.endswith("-cleancut-incontext")
    assert data.train.tolist() == data.tokenizer.encode(corpus.train)
    assert data.val.tolist() == data.tokenizer.encode(corpus.val)


def test_an_earlier_cache_of_such_a_tokenizer_is_not_taken_by_a_new_run(tmp_path, monkeypatch):
    """A cache written before (named ...-cleancut) holds the pieces read as text starts: a new
    run makes its own (...-cleancut-incontext); a resumed run, which may have trained on the
    old one (its data position counts its windows), keeps it, with a warning."""
    monkeypatch.setattr(dataset_mod, "text_chunks", functools.partial(text_chunks, size=100))
    spm_style("llama2").save(tmp_path / "tokenizer.json")
    corpus = load_corpus([_corpus_file(tmp_path)], 0.2)
    made = prepare_data(corpus, str(tmp_path / "tokenizer.json"), cache_dir=str(tmp_path / "cache"))
    old = made.cache_dir.with_name(made.cache_dir.name.removesuffix("-incontext"))
    made.cache_dir.rename(old)  # (as the earlier version named it)
    again = prepare_data(corpus, str(tmp_path / "tokenizer.json"), cache_dir=str(tmp_path / "cache"))
    assert again.cache_dir == made.cache_dir and old.exists()
    shutil.rmtree(again.cache_dir)
    with pytest.warns(UserWarning, match=r"was made by an earlier attnres, which read each piece of the text as the "
                                         r"start of a text: .* It is kept for this run, which resumes"):
        kept = prepare_data(corpus, str(tmp_path / "tokenizer.json"), cache_dir=str(tmp_path / "cache"),
                            given=made.tokenizer, resumed=True)
    assert kept.cache_dir == old


def test_the_cache_of_a_byte_level_tokenizer_given_by_path_keeps_its_name(tmp_path):
    train_bpe(TEXT, 300).save(tmp_path / "tokenizer.json")
    corpus = load_corpus([_corpus_file(tmp_path)], 0.2)
    data = prepare_data(corpus, str(tmp_path / "tokenizer.json"), cache_dir=str(tmp_path / "cache"))
    assert data.cache_dir.name.endswith("-cleancut")  # (named as before)


@pytest.mark.usefixtures("one_thread")
def test_a_resumed_run_keeps_the_earlier_cache_it_trained_on(tmp_path):
    """attnres train with data.tokenizer=PATH of a Llama-2-style tokenizer, stopped, then resumed
    after an upgrade (its cache named as an earlier version named it): the resume takes that
    cache, with a warning, and continues at its data position (a new cache holds other
    windows, which the sampler's state would refuse)."""
    from attnres.train import load_config, train

    spm_style("llama2").save(tmp_path / "tokenizer.json")
    settings = dict(model="tiny", **{"data.paths": f"[{_corpus_file(tmp_path)}]",
                                     "data.tokenizer": str(tmp_path / "tokenizer.json"),
                                     "data.val_fraction": 0.2}, seq_len=16, batch_size=2, steps=4, warmup_steps=1,
                    out_dir=str(tmp_path / "run"), progress="false", tensorboard="false", eval_every=2,
                    eval_batches=1, log_every=1, diagnostics_every=2, checkpoint_every=100)
    args = [f"{k}={v}" for k, v in settings.items()]
    assert train(load_config(None, [*args, "stop_after=2"])).step == 2
    [made] = (tmp_path / ".attnres-cache").iterdir()
    assert made.name.endswith("-cleancut-incontext")
    made.rename(made.with_name(made.name.removesuffix("-incontext")))
    with pytest.warns(UserWarning, match=r"It is kept for this run, which resumes a checkpoint"):
        assert train(load_config(None, [*args, "resume=true"])).step == 4
    assert sorted(p.name for p in (tmp_path / ".attnres-cache").iterdir()) == [made.name.removesuffix("-incontext")]


def _one_long_line(n: int = 3000) -> str:
    """Text with neither a line break nor a space (a minified dump): words and numbers between
    punctuation, where GPT-2's pre-tokenizer splits."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "délta", "12345", "zebra"]
    text = "".join(words[rng.integers(len(words))] + ",;.:(){}[]"[rng.integers(10)] for _ in range(n))
    return text


@pytest.mark.parametrize("size", [64, 100, 300])
def test_a_text_without_a_clean_cut_is_cut_where_the_pre_tokenizer_splits(size, tmp_path, monkeypatch):
    """The last resort (2 * size characters with neither a line break nor a space to cut at)
    cut at 2 * size, inside a word: its two halves were encoded apart. It now cuts where the
    tokenizer's pre-tokenizer splits (here GPT-2's, between a word and punctuation): the ids are
    the whole text's, and the pieces of the text streamed in parts those of the whole."""
    text = _one_long_line()
    tok = train_bpe(text, 320)
    at_twice_the_size = list(text_chunks(text, size))  # (as before, and still without a pre-tokenizer)
    assert {len(p) for p in at_twice_the_size[:-1]} == {2 * size}
    assert [i for piece in at_twice_the_size for i in tok.encode(piece)] != tok.encode(text)
    pieces = list(text_chunks(text, size, splits=tok.pre_token_starts))
    assert "".join(pieces) == text and all(size < len(p) <= 2 * size for p in pieces[:-1])
    assert _pieces_ids_in_cache(tok, text, tmp_path, monkeypatch, size) == tok.encode(text)
    rng = np.random.default_rng(size)
    cuts = sorted(rng.choice(len(text), 40, replace=False).tolist()) + [len(text)]
    parts = [text[a:b] for a, b in zip([0] + cuts, cuts)]
    assert list(text_chunks(iter(parts), size, splits=tok.pre_token_starts)) == pieces


def test_a_run_the_pre_tokenizer_does_not_split_is_cut_at_twice_the_size():
    """Letters only (CJK text, for GPT-2's pre-tokenizer one word): no place to cut but 2 * size."""
    text = "漢字かな" * 200
    tok = train_bpe(text, 300)
    assert [len(p) for p in text_chunks(text, 100, splits=tok.pre_token_starts)] == [200] * 4
