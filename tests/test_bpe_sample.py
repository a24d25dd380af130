"""``data.bpe_sample``: the BPE trained on evenly spaced pieces of the training split
(docs/data.md, "The plan for corpora larger than RAM", step 3), all of it by default."""

import numpy as np
import pytest

from attnres.data import load_corpus, prepare_data
from attnres.data.tokenizer import bpe_available, sampled_chunks, text_chunks, train_bpe

needs_bpe = pytest.mark.skipif(not bpe_available(), reason="needs the tokenizers package")


def test_a_sample_is_evenly_spaced_pieces_of_the_text():
    text = "".join(f"line {i:05d} of the text\n" for i in range(4000))  # 92,000 characters
    chunks = list(text_chunks(text, 1000))
    picked = list(sampled_chunks(iter([text[:500], text[500:]]), len(text), 8000, size=1000))
    assert len(picked) == 8 and set(picked) <= set(chunks) and 8000 <= sum(map(len, picked)) <= 8000 + 8 * 23
    starts = [text.index(p) for p in picked]  # (every line differs: a piece is found where it lies)
    assert starts[0] == 0 and all(abs(b - a - len(text) / 8) <= 1100 for a, b in zip(starts, starts[1:]))
    assert list(sampled_chunks(text, len(text), len(text))) == list(text_chunks(text))  # all: as without a sample
    assert list(sampled_chunks(text, len(text), 500, size=1000)) == list(text_chunks(text, 500))[:1]


@needs_bpe
def test_the_bpe_is_trained_on_the_sample_and_on_all_the_text_by_default(tmp_path):
    """The sample's BPE lacks the word that only the text past the sample holds; the default
    is the BPE of the whole training split, as before; each has its own cache, and both
    caches hold all the training text."""
    lines = [f"the quick brown fox {i % 17} jumps over the lazy dog\n" for i in range(600)]
    lines += [f"zyxwvut qponml {i % 5} zyxwvut\n" for i in range(1500)]
    (tmp_path / "c.txt").write_text("".join(lines))
    corpus = load_corpus([str(tmp_path / "c.txt")], 0.02)
    full = prepare_data(corpus, "bpe", 320, str(tmp_path / "cache"))
    sampled = prepare_data(corpus, "bpe", 320, str(tmp_path / "cache"), bpe_sample=8000)
    assert full.tokenizer.to_json() == train_bpe(corpus.train, 320).to_json()  # (today's vocabulary)
    assert sampled.tokenizer.to_json() == train_bpe(corpus.train, 320, sample=8000).to_json()
    assert "Ġzyxwvut" in full.tokenizer.backend.get_vocab() and "Ġzyxwvut" not in sampled.tokenizer.backend.get_vocab()
    assert (full.cache_dir.name.endswith("-bpe320-cleancut") and sampled.cache_dir.name.endswith("-bpe320-sample8000-cleancut"))
    decoded = sampled.tokenizer.decode(np.asarray(sampled.train).tolist())
    assert decoded == corpus.train
    again = prepare_data(load_corpus([str(tmp_path / "c.txt")], 0.02, read=False), "bpe", 320, str(tmp_path / "cache"),
                         bpe_sample=8000)
    assert again.cache_dir == sampled.cache_dir and again.tokenizer.fingerprint == sampled.tokenizer.fingerprint


def test_bpe_sample_is_a_validated_setting():
    pytest.importorskip("yaml")
    from attnres.train import load_config

    assert load_config(None, []).data.bpe_sample is None
    assert load_config(None, ["data.bpe_sample=1000000"]).data.bpe_sample == 1_000_000
    with pytest.raises(ValueError, match=r"data\.bpe_sample must be an integer >= 1, or null \(all of the training "
                                         r"split\); got 0"):
        load_config(None, ["data.bpe_sample=0"])


@needs_bpe
def test_a_run_trains_its_bpe_on_the_sample(tmp_path):
    pytest.importorskip("yaml")
    from attnres.train import load_config, train

    (tmp_path / "c.txt").write_text("".join(f"the quick brown fox {i % 17} jumps over the lazy dog\n" for i in range(600)))
    settings = dict(model="tiny", seq_len=16, batch_size=2, steps=1, warmup_steps=0, out_dir=tmp_path / "run",
                    progress="false", tensorboard="false", eval_every=1, eval_batches=1, log_every=1,
                    diagnostics_every=100, checkpoint_every=100, **{"data.paths": f"[{tmp_path / 'c.txt'}]",
                    "data.tokenizer": "bpe", "data.vocab_size": 300, "data.bpe_sample": 3000})
    train(load_config(None, [f"{k}={v}" for k, v in settings.items()]))
    assert [p.name[16:] for p in (tmp_path / ".attnres-cache").iterdir()] == ["-bpe300-sample3000-cleancut"]
