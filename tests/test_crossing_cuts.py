"""A tokenizer.json whose pieces cross line breaks (a BPE trained on text with line breaks, with
a ``Metaspace`` pre-tokenizer of ``prepend_scheme="never"`` or none: pieces such as
``"text\\nnext"``): the token caches cut their ~1 MB pieces just after a line break, as if the
pre-tokenizer split there, and their ids at the cuts were not the whole text's. Such a
tokenizer is told (``clean_cuts``) and its text cut only where it reads the two sides apart
(before a space, or where its tokens start). Tiny tokenizers are trained here (nothing is
downloaded)."""

import functools
import shutil
import warnings

import pytest

from attnres.data import dataset as dataset_mod
from attnres.data import load_corpus, prepare_data
from attnres.data.crossing_cuts import CUTS
from attnres.data.tokenizer import BPETokenizer, bpe_available, text_chunks, train_bpe

pytestmark = pytest.mark.skipif(not bpe_available(), reason="needs the tokenizers package")

TEXT = "".join(f"line {i % 7} of the text\nnext {i % 5} here\n" for i in range(300))


def _crossing(style: str) -> BPETokenizer:
    """A BPE trained on :data:`TEXT` split at spaces, not at line breaks (a ``Metaspace``
    pre-tokenizer of ``prepend_scheme="never"``): pieces such as "▁text\\nnext". Of ``style``
    "metaspace-never", it keeps that pre-tokenizer; "sentencepiece": none, its spaces made "▁"
    by its normalizer (as Llama 2's, but trained on lines); "split-words": the same trained split
    at line breaks too (as SentencePiece trains, its pieces in words); "none": trained without a
    pre-tokenizer, its pieces across line breaks and spaces; "whitespace": trained and used with
    a ``Whitespace`` pre-tokenizer (which drops whitespace)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    metaspace = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.pre_tokenizer = {"none": None, "whitespace": pre_tokenizers.Whitespace(),
                         "split-words": pre_tokenizers.Sequence([metaspace, pre_tokenizers.Split("\n", "isolated")])
                         }.get(style, metaspace)
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    if style in ("sentencepiece", "split-words"):
        tok.normalizer, tok.pre_tokenizer = normalizers.Replace(" ", "▁"), None
    return BPETokenizer(tok)


def test_a_tokenizer_whose_pieces_cross_line_breaks_is_told():
    assert any("\n" in piece.rstrip("\n") for piece in _crossing("metaspace-never").backend.get_vocab())
    assert _crossing("metaspace-never").clean_cuts == ("space",)  # (Metaspace splits before a "▁")
    assert _crossing("sentencepiece").clean_cuts == ("space",)  # (its pieces hold a "▁" only at their start)
    assert _crossing("none").clean_cuts == ()  # ("the text\nnext" holds both)
    # attnres's own BPE and a Whitespace one split at both; a SentencePiece-style one of pieces in
    # words has none across
    assert train_bpe(TEXT, 300).clean_cuts == CUTS == _crossing("whitespace").clean_cuts
    assert _crossing("split-words").clean_cuts == CUTS


@pytest.mark.parametrize("style", ["metaspace-never", "sentencepiece"])
def test_the_cache_of_such_a_tokenizer_holds_the_ids_of_each_split_as_a_whole(style, tmp_path, monkeypatch):
    """data.tokenizer=PATH of such a tokenizer: the ids of the training split (streamed in
    parts) and of the validation split are those of each encoded as one; cut after a line break,
    they were not."""
    monkeypatch.setattr(dataset_mod, "text_chunks", functools.partial(text_chunks, size=100))
    tok = _crossing(style)
    tok.save(tmp_path / "tokenizer.json")
    (tmp_path / "c.txt").write_text(TEXT)
    corpus = load_corpus([str(tmp_path / "c.txt")], 0.2)
    at_line_breaks = [i for piece in text_chunks(corpus.train, 100) for i in tok.encode(piece)]
    assert at_line_breaks != tok.encode(corpus.train)  # (what the caches held)
    data = prepare_data(corpus, str(tmp_path / "tokenizer.json"), cache_dir=str(tmp_path / "cache"))
    assert data.train.tolist() == tok.encode(corpus.train)
    assert data.val.tolist() == tok.encode(corpus.val)
    assert data.cache_dir.name.endswith("-cleancut-tokencut")  # (not an earlier cache's name: its ids differ)


def test_an_earlier_cache_of_such_a_tokenizer_is_kept_only_by_a_resumed_run(tmp_path, monkeypatch):
    """A cache written before (named ...-cleancut, cut after line breaks): a new run makes its
    own (...-cleancut-tokencut); a resumed run, which may have trained on it, keeps it, with a
    warning."""
    monkeypatch.setattr(dataset_mod, "text_chunks", functools.partial(text_chunks, size=100))
    _crossing("metaspace-never").save(tmp_path / "tokenizer.json")
    (tmp_path / "c.txt").write_text(TEXT)
    corpus = load_corpus([str(tmp_path / "c.txt")], 0.2)
    made = prepare_data(corpus, str(tmp_path / "tokenizer.json"), cache_dir=str(tmp_path / "cache"))
    old = made.cache_dir.with_name(made.cache_dir.name.removesuffix("-tokencut"))
    made.cache_dir.rename(old)  # (as the earlier version named it)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = prepare_data(corpus, str(tmp_path / "tokenizer.json"), cache_dir=str(tmp_path / "cache"))
    assert again.cache_dir == made.cache_dir and old.exists()
    shutil.rmtree(again.cache_dir)
    with pytest.warns(UserWarning, match=r"was made by an earlier attnres, which cut the text into pieces after line "
                                         r"breaks that this tokenizer's pieces cross .* It is kept for this run, "
                                         r"which resumes a checkpoint .* named \.\.\.-cleancut-tokencut"):
        kept = prepare_data(corpus, str(tmp_path / "tokenizer.json"), cache_dir=str(tmp_path / "cache"),
                            given=made.tokenizer, resumed=True)
    assert kept.cache_dir == old and not made.cache_dir.exists()


def test_a_tokenizer_with_pieces_across_both_cuts_is_warned_of(tmp_path):
    """No cut keeps the ids of a tokenizer whose pieces cross line breaks and spaces: the cache
    says so, naming the tokenizer."""
    tok = _crossing("none")
    tok.save(tmp_path / "tokenizer.json")
    (tmp_path / "c.txt").write_text(TEXT)
    corpus = load_corpus([str(tmp_path / "c.txt")], 0.2)
    with pytest.warns(UserWarning, match=r"the tokenizer \(data.tokenizer=.*tokenizer.json\) has pieces across line "
                                         r"breaks and spaces .* ids at those cuts may not be those of the text"):
        prepare_data(corpus, str(tmp_path / "tokenizer.json"), cache_dir=str(tmp_path / "cache"))
