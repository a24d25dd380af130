"""What a new user meets first: the console script, and one-line errors at the command
line's boundary (bad files, tokenizers, task names, checkpoints), each naming what to do."""

from __future__ import annotations

import contextlib
import importlib.util
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("yaml")
pytest.importorskip("safetensors")

from test_train import overrides, write_corpus  # noqa: E402

from attnres.cli import main as cli_main  # noqa: E402
from attnres.train import load_config, train  # noqa: E402

CONSOLE_SCRIPT = Path(sys.executable).with_name("attnres")
MY_RESIDUALS = (
    "from attnres import register_residual\n"
    "from attnres.nn.residual import SingleStreamResidual\n"
    "@register_residual('halved', replace=True)\n"
    "class Halved(SingleStreamResidual):\n"
    "    def update(self, l, h, out):\n"
    "        return h + 0.5 * out\n"
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A finished 4-step run of the tiny model with a BPE of 320 tokens."""
    tmp = tmp_path_factory.mktemp("run")
    corpus = write_corpus(tmp / "corpus.txt")
    train(load_config(None, overrides(corpus, tmp / "run", steps=4, **{"data.tokenizer": "bpe", "data.vocab_size": 320})))
    return tmp / "run"


@pytest.mark.skipif(not CONSOLE_SCRIPT.is_file(), reason="the attnres console script is not installed")
def test_console_script_imports_a_module_from_the_current_directory(tmp_path):
    """The README's `attnres --import my_residuals train ...`, through the installed script."""
    (tmp_path / "my_residuals.py").write_text(MY_RESIDUALS)
    done = subprocess.run([str(CONSOLE_SCRIPT), "--import", "my_residuals", "train", "--print-config",
                           "model.residual.kind=halved"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "kind: halved" in done.stdout


@pytest.fixture
def halved_module(tmp_path, monkeypatch):
    """``halved_residuals.py`` in ``tmp_path`` (the working directory), registering residual
    'halved' when imported; the import and ``sys.path`` are undone afterwards (the registration
    too, by the suite's fixture: registry_isolation)."""
    from attnres.nn.residual import registry

    (tmp_path / "halved_residuals.py").write_text(MY_RESIDUALS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.setitem(sys.modules, "halved_residuals", None)  # (the key is removed afterwards)
    del sys.modules["halved_residuals"]
    return registry


def test_a_checkpoint_with_an_unregistered_residual_names_its_module(tmp_path, halved_module):
    """A run trained in Python, its residual's module imported there: a command without it names it."""
    __import__("halved_residuals")
    corpus = write_corpus(tmp_path / "corpus.txt", n_lines=200)
    train(load_config(None, overrides(corpus, tmp_path / "run", steps=2, warmup_steps=1,
                                      **{"model.residual.kind": "halved"})))
    del halved_module._REGISTRY["halved"]  # a new process that has not imported the module
    with pytest.raises(SystemExit) as info:
        cli_main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "the", "--max-new-tokens", "2"])
    assert str(info.value).endswith("residual 'halved' is not registered: this run's residual class is in module "
                                    "'halved_residuals'; add --import halved_residuals (`attnres --import "
                                    "halved_residuals <command> ...`; in Python, `import halved_residuals` first)")


def test_the_commands_after_a_run_trained_with_import_name_the_module(tmp_path, halved_module):
    """A run trained with `attnres --import MODULE train ...`: its `train --resume`, `generate` and
    `eval` without --import said only "kind must be one of ...; `attnres --import MODULE`" - the
    run did not record which module. Its checkpoints do now (state.json's "imports"), and the
    error names it; the module is not imported for the user. A resume that restates the run's
    kind (refused before the checkpoint was read) names it too. A checkpoint of an earlier
    version (no record) gives the registry's message as before."""
    import json

    from attnres.checkpoint.manifest import STATE_FILE, latest_checkpoint, seal_state

    corpus = write_corpus(tmp_path / "corpus.txt", n_lines=200)
    run = tmp_path / "run"
    assert cli_main(["--import", "halved_residuals", "train", *overrides(corpus, run, steps=2, warmup_steps=1),
                     "model.residual.kind=halved"]) == 0
    del halved_module._REGISTRY["halved"]  # a new process that has not imported the module
    commands = {"resume": ["train", f"out_dir={run}", "--resume"],
                # its kind restated (refused before the run was read: the registry's message alone)
                "resume, kind given": ["train", f"out_dir={run}", "--resume", "model.residual.kind=halved"],
                "resume_from, kind given": ["train", f"out_dir={tmp_path / 'next'}", f"resume_from={run}",
                                            "model.residual.kind=halved"],
                "generate": ["generate", "--checkpoint", str(run), "--prompt", "the", "--max-new-tokens", "2"],
                "eval": ["eval", "--checkpoint", str(run), "--tasks", "none"]}
    without_hf = importlib.util.find_spec("transformers") is None
    if without_hf:  # (attnres eval needs the hf extra; the other commands are checked without it, then a skip)
        del commands["eval"]
    for name, argv in commands.items():
        with pytest.raises(SystemExit) as info:
            cli_main(argv)
        said = str(info.value)
        assert said.endswith("residual 'halved' is not registered: this run was trained with --import "
                             "halved_residuals; add --import halved_residuals (`attnres --import halved_residuals "
                             "<command> ...`; in Python, `import halved_residuals` first)"), (name, said)
        assert "checkpoint " in said and "halved" not in halved_module._REGISTRY, (name, said)  # (named, not imported)
    ckpt = latest_checkpoint(run)
    doc = json.loads((ckpt / STATE_FILE).read_text())
    assert doc.pop("imports") == {"given": ["halved_residuals"], "residual": "halved",
                                  "residual_module": "halved_residuals"}
    (ckpt / STATE_FILE).write_text(json.dumps(seal_state({k: v for k, v in doc.items() if k != "state_sha256"})))
    for name, argv in commands.items():
        with pytest.raises(SystemExit) as info:
            cli_main(argv)
        assert "got 'halved'; a residual of your own is registered by importing its module first: `attnres --import " \
               "MODULE <command> ...`" in str(info.value), (name, str(info.value))
    if without_hf:
        pytest.skip("attnres eval needs transformers (the hf extra)")


def test_text_the_tokenizer_does_not_cover_is_warned_of_in_generate_and_eval(tmp_path):
    """A run with a tokenizer of the user's whose vocabulary is words (WordLevel, WordPiece):
    `attnres generate --prompt "zorglub frimousse"` continued from "[UNK] [UNK]", and `attnres
    eval --text` of another language measured predicting "[UNK]", without a word. Both warn now,
    with the share; text the vocabulary covers gives no warning."""
    import warnings

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    corpus = write_corpus(tmp_path / "corpus.txt", n_lines=200)
    words = sorted({piece for piece, _ in Whitespace().pre_tokenize_str(corpus.read_text())})
    tok = HFTokenizer(WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "words.json"))
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus, run, steps=1, warmup_steps=0, **{
        "data.tokenizer": str(tmp_path / "words.json"), "data.cache_dir": str(tmp_path / "cache")})))
    other = tmp_path / "other.txt"
    other.write_text("the zorglub frimousse de la maison blanche.\n" * 20)

    def said(argv):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cli_main(argv) == 0
        return [str(w.message) for w in caught if "unknown token" in str(w.message)]

    generate = ["generate", str(run), "--max-new-tokens", "2", "--device", "cpu", "--prompt"]
    assert said([*generate, "the zorglub frimousse"]) == [
        "2 of the prompt's 3 tokens are the tokenizer's unknown token '[UNK]': its vocabulary does not cover that "
        "text, and the model sees the unknown token in its place"]
    assert said([*generate, "the"]) == []
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    evaluate = ["eval", str(run), "--tasks", "none", "--device", "cpu", "--out", str(tmp_path / "eval.json"), "--text"]
    assert said([*evaluate, str(other)]) == [
        "75% of the held-out text's tokens are the tokenizer's unknown token '[UNK]': its vocabulary does not cover "
        "that text, and the perplexity measures predicting the unknown token in its place"]
    assert said([*evaluate, str(corpus)]) == []


def test_eval_and_analyze_read_held_out_json_lines_as_training_does(tmp_path):
    """`attnres eval RUN --text held_out.jsonl` scored the model on the file's JSON syntax
    (braces, quotes, field names), without a word, and `attnres analyze` averaged its mixing
    over it: a run trained on JSON lines is measured on their text field now (the run's
    data.text_field), the records joined by a blank line as training joins them, the same
    numbers as that text in a .txt file; a line without the field is refused, naming the
    option and the line."""
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    import json

    lines = write_corpus(tmp_path / "corpus.txt").read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"content": line}) + "\n" for line in lines))
    run = tmp_path / "run"
    train(load_config(None, overrides(tmp_path / "train.jsonl", run, steps=1, warmup_steps=0,
                                      **{"data.text_field": "content"})))
    held = lines[:40]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps({"content": line, "id": i}) + "\n"
                                                 for i, line in enumerate(held)))
    (tmp_path / "held.txt").write_text("\n\n".join(held))

    def perplexity(name: str) -> dict:
        out = tmp_path / f"{name}.json"
        assert cli_main(["eval", str(run), "--tasks", "none", "--device", "cpu", "--text", str(tmp_path / name),
                         "--out", str(out)]) == 0
        return json.loads(out.read_text())["perplexity"]

    assert perplexity("held.jsonl") == perplexity("held.txt")

    def mixing(name: str) -> dict:
        assert cli_main(["analyze", str(run), "--text", str(tmp_path / name), "--device", "cpu", "--out",
                         str(tmp_path / f"analysis-{name}")]) == 0
        return json.loads((tmp_path / f"analysis-{name}" / "mixing.json").read_text())

    assert mixing("held.jsonl") == mixing("held.txt")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"content": "a"}) + "\n" + json.dumps({"text": "b"}) + "\n")
    with pytest.raises(SystemExit, match=r"--text: .*bad\.jsonl:2: every JSONL line must be an object with a "
                                         r"string field \"content\""):
        cli_main(["eval", str(run), "--tasks", "none", "--device", "cpu", "--text", str(tmp_path / "bad.jsonl"),
                  "--out", str(tmp_path / "bad.json")])


def test_held_out_json_lines_without_the_field_say_what_eval_and_analyze_read(tmp_path):
    """`attnres eval RUN --text held.jsonl` (and `analyze`) with records of another field said
    "data.text_field names the field that holds the text", an option neither command takes:
    the message says the field is the run's, and what to give instead."""
    import json

    from attnres.data.corpus import json_lines_text

    (tmp_path / "held.jsonl").write_text(json.dumps({"txt": "a"}) + "\n")
    with pytest.raises(ValueError) as info:
        json_lines_text(tmp_path / "held.jsonl", "--text", "content")
    message = str(info.value)
    assert message.startswith("--text: ") and "(this one has the fields ['txt'])" in message
    assert "names the field" not in message
    assert "the one the run trained on (its data.text_field" in message and "plain-text file" in message


@pytest.mark.parametrize("command", ["generate", "eval", "export"])
def test_a_tokenizer_of_another_vocabulary_is_refused(run_dir, tmp_path, command):
    from attnres.data.tokenizer import train_bpe

    other = tmp_path / "other.json"
    train_bpe(write_corpus(tmp_path / "other.txt", n_lines=100, seed=1).read_text(), 290).save(other)
    args = {"generate": ["--prompt", "the", "--max-new-tokens", "2"], "eval": ["--tasks", "none"],
            "export": ["--out", str(tmp_path / "hf")]}[command]
    if command != "generate":
        pytest.importorskip("transformers")
    with pytest.raises(SystemExit) as info:
        cli_main([command, "--checkpoint", str(run_dir), "--tokenizer", str(other), *args])
    message = str(info.value)
    assert f"--tokenizer {str(other)!r} has 290 tokens" in message and "vocab_size) 320" in message


def test_tokenizer_may_name_a_directory_holding_its_tokenizer_json(run_dir, tmp_path):
    """``--tokenizer DIR`` (a checkpoint's, a transformers tokenizer's) reads ``DIR/tokenizer.json``
    (it failed with "Is a directory (os error 21)"); a directory without one is refused by name."""
    from attnres.inference.loading import load_run, load_tokenizer

    run = load_run(run_dir)
    given = load_tokenizer(run, str(run.checkpoint))
    assert given.fingerprint == load_tokenizer(run).fingerprint
    with pytest.raises(ValueError, match=rf"--tokenizer '{tmp_path}' is a directory without a tokenizer.json: give"):
        load_tokenizer(run, str(tmp_path))


def test_eval_refuses_unknown_task_names_before_any_work(run_dir, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    out = tmp_path / "eval.json"
    with pytest.raises(SystemExit) as info:
        cli_main(["eval", "--checkpoint", str(run_dir), "--tasks", "attnres_ppl,bogus_task,hellaswg",
                  "--out", str(out)])
    message = str(info.value)
    assert "unknown task(s) 'bogus_task', 'hellaswg'" in message and "lm-eval ls tasks" in message
    assert "(did you mean 'hellaswag' for 'hellaswg'?)" in message  # (nothing is close to bogus_task)
    assert "attnres_ppl" not in message.split("unknown task(s)")[1].split("(did you mean")[0]
    assert "held-out loss" not in capsys.readouterr().out  # refused before the perplexity pass
    assert not out.exists()


@pytest.mark.parametrize("tasks", ["attnres_ppl", "attnres_cloze"])
def test_eval_refuses_text_too_short_for_the_local_tasks_before_any_work(run_dir, tmp_path, capsys, tasks):
    """Held-out text too short to build the local tasks from is refused before the perplexity
    pass (it ran, printed its result and was lost to the error with no results file), saying
    how to go on."""
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    short = tmp_path / "short.txt"
    short.write_text("the quick brown fox\njumps over the lazy dog\n")
    out = tmp_path / "eval.json"
    with pytest.raises(SystemExit) as info:
        cli_main(["eval", str(run_dir), "--tasks", tasks, "--text", str(short), "--out", str(out), "--device", "cpu"])
    assert str(info.value) == ("attnres eval: error: the held-out text gives 0 documents of >= 12 words; the local "
                               "tasks (attnres_ppl, attnres_cloze) need >= 4: give more held-out text (--text FILE), "
                               "or --tasks none for the perplexity alone")
    assert "held-out loss" not in capsys.readouterr().out and not out.exists()
    assert cli_main(["eval", str(run_dir), "--tasks", "none", "--text", str(short), "--out", str(out),
                     "--device", "cpu"]) == 0


def test_eval_writes_strict_json_when_the_perplexity_is_not_a_number(run_dir, tmp_path, monkeypatch):
    """A diverged model's NaN loss went into eval.json as a bare NaN, which jq and JavaScript
    refuse; now null, as attnres status --json writes it."""
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    import json
    import math

    from attnres.hf import evaluate

    def diverged(*args, **kwargs):
        return {"tokens": 10, "bytes": 20, "loss": math.nan, "perplexity": math.nan, "bits_per_byte": math.inf}

    monkeypatch.setattr(evaluate, "perplexity", diverged)
    out = tmp_path / "eval.json"
    assert cli_main(["eval", str(run_dir), "--tasks", "none", "--out", str(out), "--device", "cpu"]) == 0

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    written = json.loads(out.read_text(), parse_constant=refuse)
    assert written["perplexity"] == {"tokens": 10, "bytes": 20, "loss": None, "perplexity": None, "bits_per_byte": None}


def test_eval_of_an_export_equals_eval_of_its_run(run_dir, tmp_path, capsys):
    """`attnres eval DIR` of a transformers directory (an export, an upcycle) said it was
    "neither a checkpoint nor a run directory"; it now evaluates it with its own tokenizer,
    on the built-in corpus's validation split unless --text is given. The export of a run
    gives the run's perplexity and lm-eval results (the same text, function and tokens)."""
    pytest.importorskip("lm_eval")
    import json

    text = tmp_path / "held-out.txt"
    text.write_text(write_corpus(tmp_path / "corpus.txt").read_text()[:6000])
    assert cli_main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    got = {}
    for name, source in (("run", run_dir), ("export", tmp_path / "hf")):
        out = tmp_path / f"{name}.json"
        assert cli_main(["eval", str(source), "--text", str(text), "--tasks", "attnres_ppl,attnres_cloze",
                         "--limit", "4", "--out", str(out), "--device", "cpu"]) == 0
        got[name] = json.loads(out.read_text())
    assert got["export"]["perplexity"] == pytest.approx(got["run"]["perplexity"], rel=1e-6)
    assert got["export"]["lm_eval"].keys() == got["run"]["lm_eval"].keys() == {"attnres_ppl", "attnres_cloze"}
    for task, metrics in got["run"]["lm_eval"].items():
        numbers = {k: v for k, v in metrics.items() if isinstance(v, float)}
        assert numbers and {k: got["export"]["lm_eval"][task][k] for k in numbers} == pytest.approx(numbers, rel=1e-6)
    capsys.readouterr()
    assert cli_main(["eval", str(tmp_path / "hf"), "--tasks", "none", "--device", "cpu"]) == 0  # no --text, no --out
    written = json.loads((tmp_path / "hf-eval.json").read_text())  # (beside the model: not shipped with it)
    assert not (tmp_path / "hf" / "eval.json").exists()
    assert written["text"] == "the built-in corpus's validation split" and written["perplexity"]["tokens"] > 1000
    # (said: the run trained on other data, and nothing on the terminal told which text was measured)
    # (after the line naming the directory loaded)
    assert capsys.readouterr().out.splitlines()[1] == ("attnres eval: held-out text: the built-in corpus's validation "
                                                       "split, not the data the model was trained on unless that was "
                                                       "it (--text FILE for other text)")
    with pytest.raises(SystemExit, match="--tokenizer: a transformers directory is evaluated with its own tokenizer"):
        cli_main(["eval", str(tmp_path / "hf"), "--tasks", "none", "--tokenizer", str(tmp_path / "hf")])


def test_eval_of_a_run_with_a_long_context_equals_eval_of_its_export(run_dir, tmp_path, monkeypatch, capsys):
    """A run's model whose context is longer than MAX_DEFAULT_WINDOW (a run started from a
    pretrained model's upcycle: Qwen3's 40,960 tokens) was evaluated on windows of its whole
    context, its export on windows of MAX_DEFAULT_WINDOW: a run and its export gave different
    perplexities (and the run's took minutes and gigabytes on a CPU). Both are held to it now,
    which the command says, and give the same numbers; --seq-len still decides."""
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    import json

    from attnres.cli import eval as eval_command

    monkeypatch.setattr(eval_command, "MAX_DEFAULT_WINDOW", 24)  # (below the tiny model's 128)
    text = tmp_path / "held-out.txt"
    text.write_text(write_corpus(tmp_path / "corpus.txt").read_text()[:3000])
    assert cli_main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    got = {}
    for name, source in (("run", run_dir), ("export", tmp_path / "hf")):
        capsys.readouterr()
        assert cli_main(["eval", str(source), "--text", str(text), "--tasks", "none", "--out",
                         str(tmp_path / f"{name}.json"), "--device", "cpu"]) == 0
        assert "perplexity windows of 24 tokens (the model's context is 128; --seq-len to change)" in \
            capsys.readouterr().out
        got[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert got["run"]["seq_len"] == got["export"]["seq_len"] == 24
    assert got["run"]["perplexity"]["loss"] == pytest.approx(got["export"]["perplexity"]["loss"], rel=1e-6)
    assert cli_main(["eval", str(run_dir), "--text", str(text), "--tasks", "none", "--seq-len", "100", "--out",
                     str(tmp_path / "run.json"), "--device", "cpu"]) == 0
    assert json.loads((tmp_path / "run.json").read_text())["seq_len"] == 100


def _run_and_export_whose_tokenizer_adds_a_bos(tmp_path):
    """A 2-step run trained with a tokenizer.json whose template puts <bos> before every text
    (a transformers model's, data.tokenizer=PATH, or a run started from an upcycle), exported to
    ``tmp_path / "hf"``; returns the tokenizer's backend."""
    from tokenizers import processors

    from attnres.data.corpus import load_corpus
    from attnres.data.tokenizer import BPETokenizer, train_bpe

    corpus = write_corpus(tmp_path / "corpus.txt", n_lines=200)
    backend = train_bpe(load_corpus([str(corpus)]).train, 280).backend
    backend.add_special_tokens(["<bos>"])
    bos = backend.token_to_id("<bos>")
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    (tmp_path / "tok").mkdir()
    BPETokenizer(backend).save(tmp_path / "tok" / "tokenizer.json")
    train(load_config(None, overrides(corpus, tmp_path / "run", steps=2, warmup_steps=0,
                                      **{"data.tokenizer": str(tmp_path / "tok")})))
    assert cli_main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    return backend


def test_eval_of_a_run_whose_tokenizer_adds_a_bos_equals_eval_of_its_export(tmp_path):
    """A run whose tokenizer's template puts <bos> before every text and its export gave
    different perplexities (2078 tokens against 2079): the export's tokenizer, in
    transformers, adds the <bos> before the held-out text, the run's pass did not. The run's
    pass now starts the text with it too: the same tokens, bytes and loss."""
    pytest.importorskip("transformers")
    import json

    from attnres.data.tokenizer import BPETokenizer

    backend = _run_and_export_whose_tokenizer_adds_a_bos(tmp_path)
    text = tmp_path / "held-out.txt"
    text.write_text(write_corpus(tmp_path / "other.txt", n_lines=60, seed=3).read_text())
    got = {}
    for name in ("run", "hf"):
        out = tmp_path / f"{name}.json"
        assert cli_main(["eval", str(tmp_path / name), "--text", str(text), "--tasks", "none", "--out", str(out),
                         "--device", "cpu"]) == 0
        got[name] = json.loads(out.read_text())["perplexity"]
    plain = BPETokenizer(backend).encode(text.read_text())
    assert got["run"]["tokens"] == got["hf"]["tokens"] == len(plain)  # every token predicted, the first from <bos>
    assert got["run"]["bytes"] == got["hf"]["bytes"] == len(text.read_bytes())
    assert got["run"]["loss"] == pytest.approx(got["hf"]["loss"], rel=1e-6, abs=0)


def test_generate_of_a_run_whose_tokenizer_adds_a_bos_continues_what_its_export_does(tmp_path):
    """`attnres generate RUN --prompt X` encoded the prompt without the <bos> that its export's
    tokenizer puts before it (and `attnres eval` reads before a text): the run and its export
    continued different ids. The run's prompt now starts with it too: the same ids; README's
    Python prompt, tokenizer.prefix_ids + encode, is those ids (a byte tokenizer had no prefix_ids)."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from attnres.cli.generate import encode_prompt
    from attnres.data.tokenizer import ByteTokenizer
    from attnres.inference import load_run, load_tokenizer

    backend = _run_and_export_whose_tokenizer_adds_a_bos(tmp_path)
    prompt = "the quick brown"
    want = AutoTokenizer.from_pretrained(tmp_path / "hf")(prompt)["input_ids"]
    assert want[0] == backend.token_to_id("<bos>") and len(want) > 2
    tokenizer = load_tokenizer(load_run(tmp_path / "run"))
    assert encode_prompt(tokenizer, prompt, False) == want
    # README's Python prompt, for a run's tokenizer of either kind: the command's ids
    for tokenizer in (tokenizer, ByteTokenizer()):
        assert tokenizer.prefix_ids + tokenizer.encode(prompt) == encode_prompt(tokenizer, prompt, False)


def test_analyze_of_a_run_whose_tokenizer_adds_a_bos_equals_analyze_of_its_export(tmp_path):
    """`attnres analyze RUN` read the text without the <s> that its export's tokenizer puts
    first: every window one token apart from the export's, other matrices. Now the same."""
    pytest.importorskip("transformers")
    import json

    import torch

    _run_and_export_whose_tokenizer_adds_a_bos(tmp_path)
    common = ["--text", str(tmp_path / "corpus.txt"), "--seq-len", "16", "--rows", "3", "--device", "cpu"]
    assert cli_main(["analyze", str(tmp_path / "run"), "--out", str(tmp_path / "of-run"), *common]) == 0
    assert cli_main(["analyze", str(tmp_path / "hf"), *common]) == 0
    of_run = json.loads((tmp_path / "of-run" / "mixing.json").read_text())[0]["matrix"]
    of_export = json.loads((tmp_path / "hf-analysis" / "mixing.json").read_text())[0]["matrix"]
    assert torch.allclose(torch.tensor(of_export), torch.tensor(of_run), atol=1e-6, rtol=0)


def test_eval_gives_the_harness_tasks_the_number_of_examples_asked_for(run_dir, tmp_path, capsys):
    """`attnres eval --num-fewshot 5` (lm-eval's own option, for a task such as MMLU 5-shot) was
    an unrecognised argument. Now the harness gets it, and the results and the printed lines say
    each task's number of examples: the cloze task takes them, the rolling perplexity of whole
    documents none."""
    pytest.importorskip("lm_eval")
    import json

    out = tmp_path / "eval.json"
    with pytest.raises(SystemExit, match="--num-fewshot must be >= 0; got -1"):
        cli_main(["eval", str(run_dir), "--num-fewshot", "-1", "--out", str(out)])
    text = write_corpus(tmp_path / "held-out.txt", n_lines=100, seed=2)
    assert cli_main(["eval", str(run_dir), "--text", str(text), "--limit", "2", "--num-fewshot", "2", "--out",
                     str(out), "--device", "cpu"]) == 0
    results = json.loads(out.read_text())["lm_eval"]
    assert (results["attnres_cloze"]["n-shot"], results["attnres_ppl"]["n-shot"]) == (2, 0)
    said = capsys.readouterr().out
    assert "attnres eval: attnres_cloze (2-shot): acc" in said and "attnres eval: attnres_ppl: " in said


def test_eval_refuses_more_solved_examples_than_the_cloze_task_has_before_any_work(run_dir, tmp_path, capsys):
    """`attnres eval --num-fewshot N` with N at least the cloze task's items ran the perplexity
    pass, then lm-eval failed drawing each item's examples from the others ("Sample larger than
    population or is negative", no option named) and the perplexity was lost with no results
    file. Now it is refused first, with the most the text allows, which runs."""
    pytest.importorskip("lm_eval")
    import json

    from attnres.hf.evaluate import local_task_data

    text = write_corpus(tmp_path / "held-out.txt", n_lines=40, seed=2)
    items = len(local_task_data(text.read_text())[1])
    out = tmp_path / "eval.json"
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli_main(["eval", str(run_dir), "--text", str(text), "--tasks", "attnres_cloze", "--limit", "1",
                  "--num-fewshot", str(items), "--out", str(out), "--device", "cpu"])
    assert str(info.value) == (f"attnres eval: error: --num-fewshot {items}: attnres_cloze has {items} items built from "
                               "the held-out text, and draws each one's solved examples from the others: at most "
                               f"{items - 1} (or give more held-out text, --text FILE)")
    assert "held-out loss" not in capsys.readouterr().out and not out.exists()
    assert cli_main(["eval", str(run_dir), "--text", str(text), "--tasks", "attnres_cloze", "--limit", "1",
                     "--num-fewshot", str(items - 1), "--out", str(out), "--device", "cpu"]) == 0
    assert json.loads(out.read_text())["lm_eval"]["attnres_cloze"]["n-shot"] == items - 1


def test_eval_refuses_a_window_shorter_than_a_cloze_choice_before_any_work(run_dir, tmp_path, capsys):
    """`attnres eval --seq-len 8` (a short window, as a small run's seq_len): after the perplexity
    pass lm-eval stopped on a bare AssertionError traceback (`len(continuation_enc) <=
    self.max_length`: it reads each cloze choice, 8 words, whole inside its window) and no results
    file was written. Now the window is refused first, naming the one the cloze task needs, which
    runs."""
    pytest.importorskip("lm_eval")
    import json

    from attnres.hf.evaluate import local_task_data, longest_cloze_choice
    from attnres.inference import load_run, load_tokenizer

    text = write_corpus(tmp_path / "held-out.txt", n_lines=40, seed=2)
    items = local_task_data(text.read_text())[1][:3]  # (the harness's --limit 3: the first three)
    longest = longest_cloze_choice(items, load_tokenizer(load_run(run_dir)))
    out = tmp_path / "eval.json"
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli_main(["eval", str(run_dir), "--text", str(text), "--limit", "3", "--seq-len", str(longest - 1),
                  "--out", str(out), "--device", "cpu"])
    assert str(info.value) == (f"attnres eval: error: --seq-len {longest - 1}: attnres_cloze's longest choice takes "
                               f"{longest} tokens, and lm-eval reads each choice whole inside its window: give "
                               f"--seq-len {longest} or more, or --tasks attnres_ppl (the cloze task left out)")
    assert "held-out loss" not in capsys.readouterr().out and not out.exists()
    assert cli_main(["eval", str(run_dir), "--text", str(text), "--tasks", "attnres_ppl", "--limit", "3",
                     "--seq-len", str(longest - 1), "--out", str(out), "--device", "cpu"]) == 0
    assert cli_main(["eval", str(run_dir), "--text", str(text), "--limit", "3", "--seq-len", str(longest),
                     "--out", str(out), "--overwrite", "--device", "cpu"]) == 0
    assert 0 <= json.loads(out.read_text())["lm_eval"]["attnres_cloze"]["acc,none"] <= 1


def test_eval_names_a_capped_default_window_not_a_seq_len_the_user_gave(run_dir, tmp_path, monkeypatch, capsys):
    """A model of a long context evaluated without --seq-len gets windows of MAX_DEFAULT_WINDOW
    (2048); a cloze choice longer than that was refused as "--seq-len 2048", an option never
    given. The refusal names the default window and the cap, and still offers a longer
    --seq-len, which the model's context holds."""
    pytest.importorskip("lm_eval")
    import attnres.cli.eval as eval_cli
    from attnres.hf.evaluate import local_task_data, longest_cloze_choice
    from attnres.inference import load_run, load_tokenizer
    from attnres.models.factory import context_limit

    text = write_corpus(tmp_path / "held-out.txt", n_lines=40, seed=2)
    items = local_task_data(text.read_text())[1][:3]
    run = load_run(run_dir)
    longest, context = longest_cloze_choice(items, load_tokenizer(run)), context_limit(run.model)
    assert longest <= context  # (the cap below the context, as 2048 below a long model's)
    monkeypatch.setattr(eval_cli, "MAX_DEFAULT_WINDOW", longest - 1)
    with pytest.raises(SystemExit) as info:
        cli_main(["eval", str(run_dir), "--text", str(text), "--limit", "3", "--out", str(tmp_path / "eval.json"),
                  "--device", "cpu"])
    assert str(info.value) == (f"attnres eval: error: the default window of {longest - 1} tokens (the model's context "
                               f"of {context}, capped; --seq-len to change): attnres_cloze's longest choice takes "
                               f"{longest} tokens, and lm-eval reads each choice whole inside its window: give "
                               f"--seq-len {longest} or more, or --tasks attnres_ppl (the cloze task left out)")


@pytest.mark.parametrize("given, context, named, offered", [
    (True, "long", "--seq-len {w}", True), (False, "long", "the default window of {w} tokens (the model's context "
                                             "of 4096, capped; --seq-len to change)", True),
    (False, "the window", "the model's context of {w} tokens", False),
    (True, "the window", "--seq-len {w}", False)])  # (a --seq-len past the context is refused: not offered)
def test_a_window_shorter_than_a_cloze_choice_is_named_as_it_was_set(given, context, named, offered, tmp_path):
    """The window is named as it was set - the --seq-len given, the default capped below the
    model's context, or that context - and a longer --seq-len is offered where the context
    holds the choice."""
    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf.evaluate import check_local_tasks, local_task_data, longest_cloze_choice

    text = write_corpus(tmp_path / "held-out.txt", n_lines=40, seed=2).read_text()
    longest = longest_cloze_choice(local_task_data(text)[1], ByteTokenizer())
    w = longest - 1
    context = 4096 if context == "long" else w
    with pytest.raises(ValueError) as info:
        check_local_tasks(text, ["attnres_cloze"], None, ByteTokenizer(), w, seq_len_given=given, context=context)
    more = f"give --seq-len {longest} or more, or " if offered else ""
    assert str(info.value) == (f"{named.format(w=w)}: attnres_cloze's longest choice takes {longest} tokens, and "
                               f"lm-eval reads each choice whole inside its window: {more}--tasks attnres_ppl (the "
                               "cloze task left out)")


def test_eval_prints_each_metric_by_its_name_and_keeps_the_harness_s_keys(run_dir, tmp_path, monkeypatch, capsys):
    """`attnres eval` printed lm-eval's keys with their filter suffix ('word_perplexity,none
    3.4e10'); it prints the metric's name, with the filter where it is not lm-eval's default
    'none'. The results JSON keeps the harness's keys as they are."""
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    import json

    import attnres.cli.eval as eval_cli
    from attnres.hf import evaluate

    harness = {"attnres_ppl": {"alias": "attnres_ppl", "word_perplexity,none": 34.5, "word_perplexity_stderr,none": 1.5,
                               "n-shot": 0},
               "attnres_cloze": {"word_perplexity,none": 3.4e10},  # (an untrained model's: not 34000000000.0000)
               "gsm8k": {"exact_match,strict-match": 0.25, "exact_match,flexible-extract": 0.5, "n-shot": 5}}
    monkeypatch.setattr(evaluate, "check_tasks", lambda tasks: None)  # (gsm8k's data set: not looked for)
    monkeypatch.setattr(eval_cli, "_lm_eval", lambda *a, **k: json.loads(json.dumps(harness)))
    out = tmp_path / "eval.json"
    capsys.readouterr()
    assert cli_main(["eval", str(run_dir), "--tasks", "attnres_ppl,gsm8k", "--out", str(out), "--device", "cpu"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("attnres eval: attnres_",
                                                                                      "attnres eval: gsm8k"))]
    assert said == ["attnres eval: attnres_ppl: word_perplexity 34.5000, word_perplexity_stderr 1.5000",
                    "attnres eval: attnres_cloze: word_perplexity 3.4000e+10",
                    "attnres eval: gsm8k (5-shot): exact_match,strict-match 0.2500, exact_match,flexible-extract 0.5000"]
    assert json.loads(out.read_text())["lm_eval"] == harness


def test_eval_says_one_token_in_the_singular(run_dir, tmp_path, monkeypatch, capsys):
    """A held-out text of two tokens predicts one: the line said "over 1 tokens"."""
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    from attnres.hf import evaluate

    monkeypatch.setattr(evaluate, "perplexity", lambda *a, **k: dict(loss=1.0, perplexity=2.718, bits_per_byte=1.5,
                                                                       tokens=1, bytes=1))
    capsys.readouterr()
    assert cli_main(["eval", str(run_dir), "--tasks", "none", "--out", str(tmp_path / "eval.json"), "--device",
                     "cpu"]) == 0
    assert "attnres eval: held-out loss 1.0000, perplexity 2.718, bits/byte 1.5000 over 1 token\n" in \
        capsys.readouterr().out


def test_eval_takes_lm_eval_s_automatic_batch_size_and_a_fraction_of_each_task(run_dir, tmp_path, monkeypatch,
                                                                                capsys):
    """`attnres eval --batch-size auto` and `--limit 0.1`, as lm-eval's command line takes them,
    were refused by argparse ("invalid int value"). The harness now gets them as it takes them
    (the batch found by trial; 10 % of each task's documents, rounded up) and the results file
    records them (it did not record --limit); what neither accepts is refused by name."""
    pytest.importorskip("lm_eval")
    import json
    import math

    import lm_eval

    harness, seen = lm_eval.simple_evaluate, {}

    def recorded(**kwargs):
        out = harness(**kwargs)
        seen.update(batch_size=kwargs["batch_size"], limit=kwargs["limit"], max_length=kwargs["model_args"].get("max_length"),
                    docs={task: len(samples) for task, samples in out["samples"].items()})
        return out

    monkeypatch.setattr(lm_eval, "simple_evaluate", recorded)
    text = write_corpus(tmp_path / "held-out.txt", n_lines=100, seed=2)  # 100 documents, one a line
    out = tmp_path / "eval.json"
    assert cli_main(["eval", str(run_dir), "--text", str(text), "--batch-size", "auto:2", "--limit", "0.1", "--out",
                     str(out), "--device", "cpu", "--seq-len", "64"]) == 0
    # (max_length: the perplexity's window, which the results record)
    assert seen == {"batch_size": "auto:2", "limit": 0.1, "max_length": 64, "docs": {"attnres_ppl": 10, "attnres_cloze": 10}}
    written = json.loads(out.read_text())
    assert written["seq_len"] == 64
    assert written["perplexity"]["tokens"] > 1000  # (the whole text: --limit is lm-eval's)
    assert math.isfinite(written["lm_eval"]["attnres_ppl"]["bits_per_byte,none"])
    # (recorded: the scores of a tenth of each task are not the whole task's)
    assert written["lm_eval_settings"] == {"tasks": ["attnres_ppl", "attnres_cloze"], "limit": 0.1, "num_fewshot": None,
                                           "batch_size": "auto:2", "bootstrap_iters": 1000}
    for value, said in (("1.0", "--limit takes a whole number of documents (>= 1) or a fraction F of each task's "
                                "documents (0 < F < 1); got 1.0 (write 1 for 1 document of each task, or omit it for "
                                "every document)"),
                        ("2.5", "got 2.5 (omit it"), ("-0.5", "got -0.5 (omit it"), ("nan", "got nan (omit it"),
                        # (lm-eval's five documents, refused as not whole: the count to write is named)
                        ("5.0", "got 5.0 (write 5 for 5 documents of each task, or omit it for every document)")):
        with pytest.raises(SystemExit, match=re.escape(f"attnres eval: error: {said}" if value == "1.0" else said)):
            cli_main(["eval", str(run_dir), "--limit", value, "--out", str(out)])
    for option, value in (("--batch-size", "auto:0"), ("--batch-size", "big"), ("--limit", "some")):
        with pytest.raises(SystemExit) as info:
            cli_main(["eval", str(run_dir), option, value, "--out", str(out)])
        assert info.value.code == 2 and f"argument {option}: takes " in capsys.readouterr().err


def test_eval_keeps_the_perplexity_when_the_harness_refuses_a_setting_as_it_runs(run_dir, tmp_path, monkeypatch):
    """A ValueError of lm-eval's after the perplexity pass (a task with fewer solved examples than
    --num-fewshot asks for: "Sample larger than population or is negative") lost the perplexity
    with no results file, as a harness task out of reach once did. Now the results file holds the
    perplexity and the harness's error, as for that one."""
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    import json

    from attnres.hf import evaluate

    def refused(hf_dir, tasks, text, **kwargs):
        raise ValueError("Sample larger than population or is negative")

    monkeypatch.setattr(evaluate, "run_lm_eval", refused)
    out = tmp_path / "eval.json"
    with pytest.raises(SystemExit) as info:
        cli_main(["eval", str(run_dir), "--tasks", "attnres_ppl", "--text", str(write_corpus(tmp_path / "t.txt")),
                  "--out", str(out), "--device", "cpu"])
    assert str(info.value) == ("attnres eval: error: lm-eval failed: Sample larger than population or is negative; "
                               f"the perplexity results are written to {out}, without lm-eval's")
    results = json.loads(out.read_text())
    assert results["lm_eval_error"] == "Sample larger than population or is negative" and results["lm_eval"] == {}
    assert results["perplexity"]["tokens"] > 0


def test_eval_keeps_the_perplexity_when_a_harness_task_cannot_fetch_its_data(run_dir, tmp_path, monkeypatch):
    """`attnres eval --tasks lambada_openai` without network: after the perplexity pass lm-eval
    failed ("Couldn't reach 'EleutherAI/lambada_openai' on the Hub", the datasets library's
    ConnectionError) and the perplexity was lost, no results file written. Now the results
    file holds the perplexity and the error, and the message says why and what to do."""
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    import json

    from attnres.hf import evaluate

    def offline(hf_dir, tasks, text, **kwargs):
        raise ConnectionError("Couldn't reach 'EleutherAI/lambada_openai' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(evaluate, "check_tasks", lambda tasks: None)  # (the harness's index: seconds)
    monkeypatch.setattr(evaluate, "run_lm_eval", offline)
    out = tmp_path / "eval.json"
    with pytest.raises(SystemExit) as info:
        cli_main(["eval", str(run_dir), "--tasks", "lambada_openai", "--out", str(out), "--device", "cpu"])
    said = str(info.value)
    assert said.startswith("attnres eval: error: lm-eval failed: Couldn't reach 'EleutherAI/lambada_openai' on the "
                           "Hub (LocalEntryNotFoundError) (lambada_openai: the harness downloads its data set from "
                           "the Hugging Face Hub; run where the network reaches it, or use the local tasks "
                           "attnres_ppl, attnres_cloze, which need none)"), said
    assert said.endswith(f"the perplexity results are written to {out}, without lm-eval's"), said
    written = json.loads(out.read_text())
    assert written["perplexity"]["tokens"] > 0 and written["lm_eval"] == {}
    assert written["lm_eval_error"].startswith("Couldn't reach")


def test_the_harness_indexes_its_task_files_once_for_the_check_and_the_run(monkeypatch):
    """`attnres eval --tasks hellaswag` indexed lm-eval's task files twice (10 - 20 s each):
    once to check the names, once for the harness's run. The run of harness tasks alone now
    takes the index the check built (one a process); local tasks need one of their own."""
    pytest.importorskip("lm_eval")
    import lm_eval
    import lm_eval.tasks

    from attnres.hf import evaluate

    built, given = [], []

    class Counted(lm_eval.tasks.TaskManager):
        def __init__(self, *args, **kwargs):
            built.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Counted)
    monkeypatch.setattr(evaluate, "harness_offline", lambda: None)  # (no Hub probe)
    monkeypatch.setattr(evaluate, "harness_tokenizer", lambda hf_dir: (None, {}))
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: given.append(kw["task_manager"]) or {"results": {}})
    # (built afresh here; left for the later tests of this process, as a command's process keeps it)
    evaluate.harness_task_manager.cache_clear()
    for _ in range(2):
        assert evaluate.check_tasks(["attnres_ppl", "hellaswag"]) is None
    assert evaluate.run_lm_eval("unused", ["hellaswag"], "", bootstrap_iters=0) == {}
    assert len(built) == 1 and given == [evaluate.harness_task_manager()]
    text = "\n\n".join(" ".join(f"w{i}x{j}" for j in range(16)) for i in range(8))
    evaluate.run_lm_eval("unused", ["attnres_ppl"], text, bootstrap_iters=0)  # (its own index: of its tasks)
    assert len(built) == 2 and built[1]["include_path"] and not built[1]["include_defaults"]
    assert given[1] is not given[0]


@contextlib.contextmanager
def at_most(seconds: float):
    """Within: a ``TimeoutError`` after ``seconds`` (SIGALRM), so that a test waiting on the
    network cannot hang."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    before = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


@pytest.fixture
def hub_out_of_reach(tmp_path, monkeypatch, hub_online_unset):
    """The Hugging Face Hub at a closed local port (every request refused at once, none leaves
    the machine), empty data set and Hub caches, no offline variable set; returns the data set
    cache (a ``Path``)."""
    constants, config = hub_online_unset
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(config, "HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    return tmp_path / "datasets"


def cache_lambada(cache: Path, tmp_path: Path) -> None:
    """A small stand-in for the harness's lambada_openai data set (EleutherAI/lambada_openai,
    config default, split test) in the data set cache ``cache``, where ``datasets`` finds a
    data set it has downloaded and prepared before."""
    import json
    import shutil

    import datasets

    rows = tmp_path / "lambada.jsonl"
    rows.write_text("".join(json.dumps({"text": f"the quick brown fox {i} jumps over the lazy dog"}) + "\n"
                            for i in range(8)))
    built = datasets.load_dataset("json", data_files={"test": str(rows)}, cache_dir=str(tmp_path / "build"))
    source = Path(built["test"].cache_files[0]["filename"]).parent
    target = cache / "EleutherAI___lambada_openai" / "default" / "0.0.0" / source.name
    target.mkdir(parents=True)
    shutil.copy(source / "json-test.arrow", target / "lambada_openai-test.arrow")
    info = json.loads((source / "dataset_info.json").read_text())
    (target / "dataset_info.json").write_text(json.dumps({**info, "config_name": "default",
                                                          "dataset_name": "lambada_openai"}))


def test_eval_refuses_at_once_a_harness_task_whose_data_set_it_cannot_get(run_dir, tmp_path, hub_out_of_reach,
                                                                          capsys):
    """`attnres eval --tasks lambada_openai` where the Hub cannot be reached spent about 25 s in
    the Hub client's retries, after the perplexity pass, before saying so. The tasks' data sets
    are now looked up in the local cache in offline mode first: one that is not there is refused
    at once, before any work, naming it and why; the offline mode is set back after."""
    import datasets.config

    out = tmp_path / "eval.json"
    with at_most(90), pytest.raises(SystemExit) as info:
        cli_main(["eval", str(run_dir), "--tasks", "attnres_ppl,lambada_openai", "--out", str(out), "--device", "cpu"])
    said = str(info.value)
    assert said.startswith("attnres eval: error: --tasks: the data set of lambada_openai is not in the local cache, "
                           "and the Hugging Face Hub cannot be reached (http://127.0.0.1:9: "), said
    assert said.endswith("run once where the network reaches the Hub (the harness caches what it downloads), or use "
                         "the local tasks attnres_ppl, attnres_cloze, which need none"), said
    assert "held-out loss" not in capsys.readouterr().out and not out.exists()
    assert datasets.config.HF_HUB_OFFLINE is False


@pytest.mark.slow  # (the harness indexes its task files twice: the check, then its own run)
def test_eval_reads_a_cached_harness_task_where_the_hub_cannot_be_reached(run_dir, tmp_path, hub_out_of_reach):
    """A harness task whose data set is in the local cache runs where the Hub cannot be reached
    (read in offline mode, without the Hub client's retries), beside the local tasks."""
    import json

    from huggingface_hub import constants

    cache_lambada(hub_out_of_reach, tmp_path)
    out = tmp_path / "eval.json"
    with at_most(90):
        assert cli_main(["eval", str(run_dir), "--tasks", "attnres_ppl,lambada_openai", "--limit", "4", "--out",
                         str(out), "--device", "cpu"]) == 0
    results = json.loads(out.read_text())["lm_eval"]
    assert results.keys() == {"attnres_ppl", "lambada_openai"} and 0 <= results["lambada_openai"]["acc,none"] <= 1
    assert constants.HF_HUB_OFFLINE is False


def test_eval_says_that_harness_options_do_nothing_without_harness_tasks(run_dir, tmp_path):
    """`attnres eval --tasks none --limit 3` ignored --limit without a word (the perplexity pass
    reads the whole text), and the results recorded harness settings the harness never got.
    Now a warning names the options, and the results record no harness settings."""
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    import json

    out = tmp_path / "eval.json"
    with pytest.warns(UserWarning, match=r"^--limit and --num-fewshot act on lm-eval's tasks, and --tasks none runs "
                                         r"none: the perplexity pass reads the whole held-out text$"):
        assert cli_main(["eval", str(run_dir), "--tasks", "none", "--limit", "3", "--num-fewshot", "2", "--out",
                         str(out), "--device", "cpu"]) == 0
    assert json.loads(out.read_text())["lm_eval_settings"] is None


def test_eval_says_when_its_windows_reach_past_the_length_the_run_trained_on(run_dir, tmp_path, capsys):
    """The run trained on 32-token sequences of a model whose max_seq_len is 128: `attnres eval`'s
    default windows of 128 tokens measured it at positions 32-127, which training never showed it
    (a higher loss than the run's val_loss, without a word). Now it says so and how to measure it
    at its training length; a --seq-len given says nothing."""
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    import json

    out = tmp_path / "eval.json"
    note = ("attnres eval: perplexity windows of 128 tokens (the model's context); the run trained from scratch on "
            "sequences of 32 (seq_len), so positions 32-127 are ones its training never showed it: --seq-len 32 "
            "measures it at the length it trained on\n")
    capsys.readouterr()
    assert cli_main(["eval", str(run_dir), "--tasks", "none", "--out", str(out), "--device", "cpu"]) == 0
    assert note in capsys.readouterr().out and json.loads(out.read_text())["seq_len"] == 128
    assert cli_main(["eval", str(run_dir), "--tasks", "none", "--seq-len", "32", "--out", str(out), "--device",
                     "cpu"]) == 0
    assert "perplexity windows" not in capsys.readouterr().out and json.loads(out.read_text())["seq_len"] == 32
    # (a run started from other weights, init_from: those may have seen every position; nothing said)
    corpus = write_corpus(tmp_path / "corpus.txt")
    train(load_config(None, overrides(corpus, tmp_path / "tuned", steps=1, warmup_steps=0, init_from=str(run_dir),
                                      **{"data.tokenizer": "bpe", "data.vocab_size": 320})))
    assert cli_main(["eval", str(tmp_path / "tuned"), "--tasks", "none", "--out", str(out), "--device", "cpu"]) == 0
    assert "perplexity windows" not in capsys.readouterr().out and json.loads(out.read_text())["seq_len"] == 128


def test_eval_records_the_held_out_text_s_absolute_path(run_dir, tmp_path, monkeypatch):
    """`attnres eval RUN --text held-out.txt` recorded "held-out.txt" as typed beside the
    checkpoint's absolute path: read from another directory, the results named no file. The
    text is recorded absolute now, as the checkpoint is."""
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    import json

    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "held-out.txt")
    assert cli_main(["eval", str(run_dir), "--text", "held-out.txt", "--tasks", "none", "--out", "eval.json",
                     "--device", "cpu"]) == 0
    assert json.loads((tmp_path / "eval.json").read_text())["text"] == str((tmp_path / "held-out.txt").resolve())


def test_eval_of_a_step_or_the_checkpoints_folder_writes_in_the_run_not_among_its_checkpoints(run_dir, tmp_path):
    """`attnres eval RUN/checkpoints/step-N` wrote eval.json into the checkpoint, which the run's
    keep_checkpoints rotation deletes with it when the run goes on (or resumes), and `attnres eval
    RUN/checkpoints` (what tab completion offers) among the checkpoints. Now RUN/eval-step-N.json
    and RUN/eval.json, as attnres analyze writes RUN/analysis/step-N and RUN/analysis."""
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    import json
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    step = next((run / "checkpoints").glob("step-*"))
    assert cli_main(["eval", str(step), "--tasks", "none", "--device", "cpu"]) == 0
    assert json.loads((run / f"eval-{step.name}.json").read_text())["checkpoint"] == str(step)
    assert cli_main(["eval", str(run / "checkpoints"), "--tasks", "none", "--device", "cpu"]) == 0
    assert json.loads((run / "eval.json").read_text())["checkpoint"] == str(step)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [step.name] and not (step / "eval.json").exists()


def test_eval_of_a_training_run_records_and_keeps_the_checkpoint_it_evaluates(tmp_path, monkeypatch, capsys):
    """`attnres eval RUN` while the run trains: eval.json named the run directory, not the
    checkpoint (no step), and lm-eval's export took the run's newest checkpoint again, one
    written during the perplexity pass. Now the checkpoint and its step are printed and
    recorded, and lm-eval evaluates the model the perplexity pass measured, even when the
    run has deleted its checkpoint since (keep_checkpoints): with a BPE, whose tokenizer.json went
    with it, the export failed reading it again ("cannot read the stored tokenizer") and lm-eval's
    results were lost; the tokenizer loaded for the perplexity pass is exported now."""
    pytest.importorskip("lm_eval")
    import json
    import shutil

    from safetensors.torch import load_file

    from attnres.hf import evaluate

    corpus = write_corpus(tmp_path / "corpus.txt", n_lines=200)
    run = tmp_path / "run"
    train(load_config(None, overrides(corpus, run, steps=4, warmup_steps=1, checkpoint_every=2,
                                      **{"data.tokenizer": "bpe", "data.vocab_size": 300})))
    newer = run / "checkpoints" / "step-00000004"
    shutil.move(newer, tmp_path / "later")  # the run is at step 2; step 4 is written during the perplexity pass
    older = run / "checkpoints" / "step-00000002"
    measure, exported, evaluated = evaluate.perplexity, {}, load_file(str(older / "model.safetensors"))

    def while_training(*args, **kwargs):
        shutil.move(tmp_path / "later", newer)
        shutil.rmtree(older)
        return measure(*args, **kwargs)

    def harness(hf_dir, tasks, text, **kwargs):
        exported.update(load_file(str(Path(hf_dir) / "model.safetensors")))
        exported["tokenizer"] = json.loads((Path(hf_dir) / "tokenizer.json").read_text())["model"]["vocab"]
        return {}

    monkeypatch.setattr(evaluate, "perplexity", while_training)
    monkeypatch.setattr(evaluate, "run_lm_eval", harness)
    out = tmp_path / "eval.json"
    assert cli_main(["eval", str(run), "--tasks", "attnres_ppl", "--text", str(corpus), "--out", str(out),
                     "--device", "cpu"]) == 0
    results = json.loads(out.read_text())
    assert (results["checkpoint"], results["step"]) == (str(older), 2)
    assert f"attnres eval: checkpoint {older} (step 2)" in capsys.readouterr().out
    embedding = exported["embed_tokens.weight"]  # (an export keeps the checkpoint's tensor names)
    assert embedding.equal(evaluated["embed_tokens.weight"])
    assert not embedding.equal(load_file(str(newer / "model.safetensors"))["embed_tokens.weight"])
    assert exported.pop("tokenizer") == json.loads((newer / "tokenizer.json").read_text())["model"]["vocab"]


def test_generate_chat_puts_the_prompt_through_the_chat_template(run_dir, tmp_path, capsys):
    """`--chat`: the prompt as a user's turn through the tokenizer's chat template, for
    instruct models (an upcycled SmolLM2-Instruct). A run uses the plain-text template of its
    export: the same tokens as its export with --chat, and as the rendered text given as it is."""
    pytest.importorskip("transformers")
    assert cli_main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    (tmp_path / "rendered.txt").write_text("user: the quick\nassistant: ")
    outputs = {}
    for name, args in (("run", [str(run_dir), "--prompt", "the quick", "--chat"]),
                       ("export", [str(tmp_path / "hf"), "--prompt", "the quick", "--chat"]),
                       ("rendered", [str(run_dir), "--prompt-file", str(tmp_path / "rendered.txt")]),
                       ("plain", [str(run_dir), "--prompt", "the quick"])):
        capsys.readouterr()
        assert cli_main(["generate", *args, "--max-new-tokens", "6", "--temperature", "0"]) == 0
        outputs[name] = capsys.readouterr().out
    assert outputs["run"] == outputs["export"] == outputs["rendered"] != outputs["plain"], outputs
    (tmp_path / "hf" / "chat_template.jinja").unlink()  # a directory whose tokenizer has no template
    config = tmp_path / "hf" / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"unused"'))
    with pytest.raises(SystemExit, match="--chat: this directory's tokenizer has no chat template"):
        cli_main(["generate", str(tmp_path / "hf"), "--prompt", "the quick", "--chat"])


def _fake_distribution(root: Path, name: str, version: str) -> Path:
    """An installed distribution's metadata whose files include one under a top-level ``attnres``.
    The file exists, as an installed one does: Python 3.12's ``Distribution.files`` leaves out the
    listed files that are missing. It is no module and there is no ``__init__.py``, so this
    directory's ``attnres`` does not shadow the package under test."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (root / "attnres").mkdir(exist_ok=True)
    (root / "attnres" / f"{name}.data").write_text("")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"attnres/{name}.data,,\n{info.name}/METADATA,,\n")
    (info / "top_level.txt").write_text("attnres\n")
    return root


def test_a_distribution_that_also_installs_attnres_is_named(tmp_path):
    """fast-attnres installs a package named `attnres` too: the command finds it and any other
    such distribution from every file list; `import attnres` reads no distributions (no import-
    time work) and says nothing."""
    import os

    _fake_distribution(tmp_path, "fast-attnres", "2.1.0")
    _fake_distribution(tmp_path, "attnres-fork", "0.3")
    # (this checkout's src after the fakes: the code under test where attnres is not installed, as on a machine
    # that runs a clone with PYTHONPATH=src, and not another checkout's installed copy where it is)
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(src)]), "PYTHONWARNINGS": "default"}
    # One interpreter (starting one costs more than the checks): `import attnres`, a mark on
    # stderr, then `attnres train --print-config` run as `python -m attnres` runs it (runpy).
    script = ("import sys, runpy, attnres\n"
              "print('-- imported --', file=sys.stderr, flush=True)\n"
              "sys.argv = ['attnres', 'train', '--print-config']\n"
              "runpy.run_module('attnres', run_name='__main__', alter_sys=True)\n")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    imported, mark, command = done.stderr.partition("-- imported --\n")
    assert mark and "also installs a top-level package named 'attnres'" not in imported, done.stderr
    assert command.count("also installs a top-level package named 'attnres'") == 2  # each once
    assert "'attnres-fork' (0.3)" in command
    assert "'fast-attnres' (2.1.0) also installs a top-level package named 'attnres'" in command
    assert "pip uninstall fast-attnres attnres" in command


def test_the_clash_warning_reinstalls_attnres_as_it_was_installed(tmp_path, monkeypatch, capsys):
    """The advice after `pip uninstall fast-attnres attnres` was `pip install attnres again`:
    no package index serves attnres (an index's `attnres` is another project's, or none), so a
    user of a wheel was sent to the wrong package. It names the wheel (the clone, the sdist)
    this installation came from, as the missing-extra hints do."""
    from attnres import extras, name_clash

    wheel = tmp_path / "attnres-0.1.0-py3-none-any.whl"
    monkeypatch.setattr(extras, "installed_from", lambda: ("wheel", wheel))
    monkeypatch.setattr(extras, "pip_command", lambda: "pip")  # (an activated environment's)
    monkeypatch.setattr(name_clash, "clashing_distributions", lambda: {"fast-attnres": "2.1.0"})
    monkeypatch.setattr(name_clash, "_warned", set())
    with pytest.warns(UserWarning, match="also installs a top-level package named 'attnres'") as said:
        assert cli_main(["status", str(tmp_path)]) == 0
    (message,) = [str(w.message) for w in said if "fast-attnres" in str(w.message)]
    assert message.endswith(f'(here: pip uninstall fast-attnres attnres, then pip install "{wheel}")'), message
    assert "pip install attnres again" not in message
    monkeypatch.setattr(extras, "installed_from", lambda: ("clone", tmp_path))
    assert extras.reinstall_command() == f'pip install -e "{tmp_path}"'


def test_the_clash_check_reads_every_distribution_s_file_list(tmp_path, monkeypatch):
    """Not only the known clashes: a distribution of any name whose files include a top-level
    ``attnres`` (the check had a fast mode, the known names alone, that no caller used)."""
    from attnres.name_clash import clashing_distributions

    monkeypatch.syspath_prepend(str(_fake_distribution(tmp_path, "attnres-fork", "0.3")))
    assert clashing_distributions() == {"attnres-fork": "0.3"}


def test_a_checkpoint_without_its_optimizer_state_generates_and_exports(run_dir, tmp_path, capsys):
    """Using a model needs no optimiser state; resuming does, and still refuses."""
    import shutil

    from attnres.checkpoint import latest_checkpoint

    ckpt = tmp_path / "step-00000004"
    shutil.copytree(latest_checkpoint(run_dir), ckpt)
    (ckpt / "optimizer.safetensors").unlink()
    assert cli_main(["generate", "--checkpoint", str(ckpt), "--prompt", "the", "--max-new-tokens", "3"]) == 0
    if importlib.util.find_spec("transformers") is not None:
        assert cli_main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    corpus = write_corpus(tmp_path / "corpus.txt")
    with pytest.raises(SystemExit, match="optimizer.safetensors is missing"):
        cli_main(["train", *overrides(corpus, tmp_path / "resumed", steps=6, **{"data.tokenizer": "bpe",
                  "data.vocab_size": 320}), f"resume_from={ckpt}"])


def test_a_checkpoint_without_its_optimizer_state_starts_a_run_with_init_from(run_dir, tmp_path):
    """init_from reads the weights alone (a fresh optimiser), yet a checkpoint shared without
    its optimiser state was refused ("optimizer.safetensors is missing"), and a run directory
    whose newest checkpoint lacked it fell back to an older one, while generate and export
    took it."""
    import shutil

    from attnres.checkpoint import latest_checkpoint, read_checkpoint_state

    shared = tmp_path / "shared"
    shutil.copytree(run_dir, shared)
    (latest_checkpoint(shared) / "optimizer.safetensors").unlink()
    corpus = write_corpus(tmp_path / "corpus.txt")
    for init_from in (latest_checkpoint(shared), shared):
        result = train(load_config(None, overrides(corpus, tmp_path / f"from-{init_from.name}", steps=1, warmup_steps=0,
                                                   init_from=str(init_from), **{"data.tokenizer": "bpe"})))
        origin = read_checkpoint_state(result.checkpoint)["init_from"]
        assert origin["checkpoint"] == str(latest_checkpoint(shared)) and origin["step"] == 4


def test_the_long_prompt_hint_counts_the_new_tokens():
    """A context of 128: 64 new tokens leave room for a prompt of 65, not 128."""
    from attnres.cli import check_context

    check_context(65, 64, 128)
    with pytest.raises(ValueError, match=r"use --max-new-tokens 29 or less or shorten the prompt to at most 65 tokens"):
        check_context(100, 64, 128)
    with pytest.raises(ValueError, match=r"needs a context of 263 tokens.*: shorten the prompt to at most 65 tokens$"):
        check_context(200, 64, 128)
    with pytest.raises(ValueError, match=r"lower --max-new-tokens: together they may be at most 129 tokens$"):
        check_context(200, 300, 128)
    # One token, said so (was: "the prompt (1 tokens)", "at most 1 tokens").
    with pytest.raises(ValueError, match=r"^the prompt \(1 token\) plus --max-new-tokens 200 needs"):
        check_context(1, 200, 128)
    with pytest.raises(ValueError, match=r"shorten the prompt to at most 1 token$"):
        check_context(200, 128, 128)
    with pytest.raises(ValueError, match=r"\(max_seq_len\): use --max-new-tokens 126 or less$"):  # one limit, not two
        check_context(3, 100000, 128)


@pytest.mark.parametrize("command", ["eval", "analyze"])
def test_a_binary_text_file_is_named(run_dir, tmp_path, command):
    if command == "eval":
        pytest.importorskip("transformers")
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(SystemExit) as info:
        cli_main([command, "--checkpoint", str(run_dir), "--text", str(binary), "--out", str(tmp_path / "o")]
                 + (["--tasks", "none"] if command == "eval" else []))
    assert f"--text {str(binary)!r} is not UTF-8 text (line 2, byte 128); give a text file" in str(info.value)  # (byte 10 is a line break)


GREEDY = ["--prompt", "the", "--max-new-tokens", "6", "--temperature", "0"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_decodes_the_same_text_over_a_static_cache(run_dir, capsys, monkeypatch, dtype):
    """`attnres generate --decode static` (the static cache, eager) prints the dynamic
    cache's greedy continuation and names the decode it ran, in the stored float32 and with
    `--dtype bfloat16` (the weights cast before decoding; the cache and the stream follow
    them); `--decode graph` on the CPU is a one-line error in the options' words (it named
    `decode='graph'`, the Python argument), before the model loads."""
    import torch

    from attnres.inference import loading

    seen = []
    load = loading.load_run
    monkeypatch.setattr(loading, "load_run", lambda *a, **k: seen.append(load(*a, **k)) or seen[-1])
    args = ["generate", "--checkpoint", str(run_dir), *GREEDY, "--dtype", dtype]
    text = {}
    for decode in ("dynamic", "static"):
        assert cli_main([*args, "--decode", decode]) == 0
        out = capsys.readouterr()
        text[decode] = out.out
        assert f"cpu, {dtype}, {decode} decode)" in out.err
    assert text["static"] == text["dynamic"] and text["dynamic"].strip()
    assert {p.dtype for run in seen for p in run.model.parameters()} == {getattr(torch, dtype)}
    seen.clear()
    for device in ("cpu", "auto"):  # (auto: the CPU here, as there is no GPU in the suite's runs)
        if device == "auto" and torch.cuda.is_available():
            continue
        with pytest.raises(SystemExit, match=re.escape(
                f"attnres generate: error: --decode graph captures a CUDA graph, which needs a GPU: the model would be "
                f"on cpu (--device {device}); use --decode static or compiled there, or --device cuda")):
            cli_main([*args, "--decode", "graph", "--device", device])
    assert not seen  # refused before the model loads


@pytest.mark.parametrize("command", ["generate", "export", "analyze", "eval"])
def test_the_checkpoint_is_the_first_argument_or_checkpoint(run_dir, tmp_path, capsys, monkeypatch, command):
    """Each command that reads a checkpoint takes it as its first argument
    (`attnres generate runs/x ...`) as well as `--checkpoint runs/x`; neither, or two that
    differ, is a one-line error."""
    from attnres import cli

    seen = []
    monkeypatch.setitem(cli.COMMANDS, command, cli.Command(cli.COMMANDS[command].add_parser,
                                                           lambda args, parser: seen.append(args) or 0))
    rest = {"generate": ["--prompt", "the"], "export": ["--out", str(tmp_path / "hf")]}.get(command, [])
    assert cli_main([command, str(run_dir), *rest]) == 0
    assert cli_main([command, *rest, "--checkpoint", str(run_dir)]) == 0
    assert cli_main([command, str(run_dir), "--checkpoint", str(run_dir), *rest]) == 0
    assert [a.checkpoint for a in seen] == [str(run_dir)] * 3
    assert not any(hasattr(a, "checkpoint_path") or hasattr(a, "checkpoint_parser") for a in seen)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli_main([command, *rest])
    assert f"attnres {command}: error: the following arguments are required: CHECKPOINT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main([command, str(run_dir), "--checkpoint", str(tmp_path), *rest])
    assert "two checkpoints given" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "export", "analyze", "eval"])
def test_a_checkpoint_that_does_not_exist_is_named_as_given(run_dir, tmp_path, capsys, monkeypatch, command):
    """``attnres eval ./rnu`` said "'rnu' does not exist", naming no argument: the error names
    CHECKPOINT or --checkpoint, as given, with the nearest name there, before the command runs."""
    from attnres import cli

    seen = []
    monkeypatch.setitem(cli.COMMANDS, command, cli.Command(cli.COMMANDS[command].add_parser,
                                                           lambda args, parser: seen.append(args) or 0))
    rest = {"generate": ["--prompt", "the"], "export": ["--out", str(tmp_path / "hf")]}.get(command, [])
    typo = run_dir.parent / (run_dir.name[:-2] + run_dir.name[-1] + run_dir.name[-2])  # the last two letters swapped
    for given, name in (([str(typo)], "CHECKPOINT"), (["--checkpoint", str(typo)], "--checkpoint")):
        with pytest.raises(SystemExit):
            cli_main([command, *given, *rest])
        err = capsys.readouterr().err
        assert f"attnres {command}: error: {name} {str(typo)!r} does not exist (did you mean {run_dir.name!r}?)" \
            in err, err
    assert not seen


@pytest.mark.parametrize("command, transformers", [("generate", True), ("eval", True), ("analyze", True),
                                                   ("export", False)])
def test_the_checkpoint_s_help_names_the_transformers_directories_a_command_reads(command, transformers, capsys):
    """``attnres generate --help`` said CHECKPOINT is "a checkpoint directory (step-*) or a run
    directory", and so did its missing-argument error, though generate, eval and analyze read an
    export, an upcycle or a Hub id there too (export does not)."""
    from attnres.cli import build_parser

    parser = build_parser()._subparsers._group_actions[0].choices[command]
    helps = {a.dest: a.help for a in parser._actions if a.dest in ("checkpoint_path", "checkpoint")}
    assert len(helps) == 2
    assert all(("transformers directory" in h and "Hub id" in h) == transformers for h in helps.values()), helps
    rest = {"generate": ["--prompt", "the"], "export": ["--out", "hf"]}.get(command, [])
    with pytest.raises(SystemExit):
        cli_main([command, *rest])
    err = capsys.readouterr().err
    assert "arguments are required: CHECKPOINT (a run or checkpoint directory" in err
    assert ("a transformers directory or a Hub id" in err) == transformers, err


def test_generate_runs_from_a_positional_checkpoint(run_dir, capsys):
    assert cli_main(["generate", str(run_dir), *GREEDY]) == 0
    assert capsys.readouterr().out.strip()


def test_analyze_says_what_it_was_given_before_it_writes_anything(run_dir, tmp_path):
    """A run that wrote no checkpoint was called "a Hugging Face directory" (its config.json);
    a file was refused for the --out made from it; an --out holding a compare grid lost its
    report.md to the analysis; --seq-len past the model's context said no fix."""
    import shutil

    bare = tmp_path / "stopped-early"  # a run that stopped before its first checkpoint
    bare.mkdir()
    for name in ("config.json", "metrics.jsonl"):
        shutil.copy(run_dir / name, bare / name)
    with pytest.raises(SystemExit, match=r"'.*stopped-early' is neither a checkpoint nor a run directory with "
                       r"checkpoints: it is a training run that has written no checkpoint yet") as e:
        cli_main(["analyze", str(bare)])
    assert "Hugging Face" not in str(e.value) and not (bare / "analysis").exists()
    # a grid's finished run without its checkpoints (docs/experiments.md's `attnres analyze --checkpoint
    # results/compare-long-300/block/seed0` on a clone) was said to have written none yet, "or still training"
    (bare / "result.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"checkpoints: it is a finished run of a grid \(result.json\) whose "
                       r"checkpoints are not there \(removed, or not copied with it"):
        cli_main(["analyze", str(bare)])
    text = tmp_path / "notes.txt"
    text.write_text("x")
    with pytest.raises(SystemExit, match=r"'.*notes.txt' is neither a checkpoint .*: it is a file; name a run"):
        cli_main(["analyze", str(text)])
    grid = tmp_path / "grid"
    grid.mkdir()
    (grid / "experiment.json").write_text('{"experiment": "compare", "preset": "tiny", "overrides": []}')
    (grid / "report.md").write_text("the compare report")
    with pytest.raises(SystemExit, match=r"--out '.*grid' holds an experiment grid \(experiment.json\): its report.md, "
                       r"mixing.png and mixing.json would be replaced; pick another --out"):
        cli_main(["analyze", str(run_dir), "--out", str(grid)])
    assert (grid / "report.md").read_text() == "the compare report" and not (grid / "mixing.png").exists()
    with pytest.raises(SystemExit, match=r"--seq-len 999 exceeds the model's max_seq_len 128: use --seq-len 128 or less"):
        cli_main(["analyze", str(run_dir), "--out", str(tmp_path / "a"), "--seq-len", "999"])


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("where", ["step", "checkpoints"])
@pytest.mark.parametrize("resume", [True, False])
def test_out_dir_that_is_a_checkpoint_or_its_folder_is_refused(run_dir, tmp_path, capsys, where, resume):
    """`attnres train out_dir=RUN/checkpoints/step-N --resume` (a checkpoint where the run
    directory belongs) trained on and nested a second run inside the checkpoint
    (RUN/checkpoints/step-N/checkpoints/step-M, its metrics and config beside the weights);
    now it is refused before anything is written, with the commands that do what was meant."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    step = sorted((run / "checkpoints").glob("step-*"))[-1]
    out = step if where == "step" else run / "checkpoints"
    before = _listing(run)
    args = ["train", f"out_dir={out}", "progress=false", "tensorboard=false"]
    args += ["--resume"] if resume else [f"data.paths=[{write_corpus(tmp_path / 'corpus.txt', n_lines=100)}]",
                                         "data.tokenizer=byte", "steps=1", "seq_len=16", "batch_size=2"]
    with pytest.raises(SystemExit) as info:
        cli_main(args)
    message = str(info.value)
    assert f"out_dir={run} --resume" in message, message
    assert ("a checkpoint of the run" if where == "step" else "the checkpoints/ folder of the run") in message
    assert _listing(run) == before
    assert "resuming with the config stored" not in capsys.readouterr().err  # (it resumes nothing)


def test_out_dir_that_is_a_hugging_face_directory_is_refused(tmp_path):
    """Training into an export or upcycle (say `out_dir=qwen3-attnres` beside
    `init_from=qwen3-attnres`) replaced its transformers config.json with the run's."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "attnres"}')
    (hf / "model.safetensors").write_bytes(b"")
    corpus = write_corpus(tmp_path / "corpus.txt", n_lines=100)
    with pytest.raises(SystemExit) as info:
        cli_main(["train", *overrides(corpus, hf, steps=1)])
    assert "Hugging Face directory" in str(info.value) and "another out_dir" in str(info.value)
    assert (hf / "config.json").read_text() == '{"model_type": "attnres"}'


@pytest.mark.parametrize("args, expected", [
    (["train", "--config", "configs/run.yml", "--print-config"], "config file 'configs/run.yml' does not exist (did you mean 'run.yaml'?)"),
    (["train", "--config", "train-cpu.yml", "--print-config"], "(did you mean 'configs/train-cpu.yaml', shipped with attnres?)"),
    (["train", "data.paths=[my_txets/]", "steps=1"], "data path 'my_txets' does not exist (did you mean 'my_texts'?)"),
    (["generate", "RUN", "--prompt-file", "promt.txt"], "--prompt-file: no file 'promt.txt' (did you mean 'prompt.txt'?)"),
    (["analyze", "RUN", "--text", "corpus.tx"], "--text 'corpus.tx' is not a file (did you mean 'corpus.txt'?)"),
    (["eval", "RUN", "--text", "corpus.tx", "--tasks", "none"], "--text 'corpus.tx' is not a file (did you mean 'corpus.txt'?)"),
])
def test_a_misspelt_file_is_named_with_the_nearest_one(run_dir, tmp_path, monkeypatch, args, expected):
    """A newcomer's typos in the files a command reads (`.yml` for `.yaml`, transposed letters)
    were said not to exist, with no word of the file that does."""
    if args[0] == "eval":
        pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "run.yaml").write_text("steps: 1\n")
    (tmp_path / "my_texts").mkdir()
    write_corpus(tmp_path / "my_texts" / "a.txt", n_lines=50)
    write_corpus(tmp_path / "corpus.txt", n_lines=50)
    (tmp_path / "prompt.txt").write_text("the")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        cli_main([str(run_dir) if a == "RUN" else a for a in args])
    assert expected in str(info.value)


def test_ctrl_c_during_generate_ends_the_line_and_says_how_far_it_got(run_dir, capsys, monkeypatch):
    """Ctrl-C while `attnres generate` streams left the text without its newline, so
    "attnres generate: interrupted" was glued to it on the terminal, with no word of the
    tokens written; now the line ends and the tokens so far are counted."""
    from attnres.cli import generate as generate_cli

    real = generate_cli.text_pieces

    def interrupted_after_two(tokenizer, steps, new):
        for k, piece in enumerate(real(tokenizer, steps, new)):
            yield piece
            if k == 1:
                raise KeyboardInterrupt

    monkeypatch.setattr(generate_cli, "text_pieces", interrupted_after_two)
    assert cli_main(["generate", str(run_dir), *GREEDY]) == 130
    captured = capsys.readouterr()
    assert captured.out.endswith("\n") and captured.out.strip()
    assert re.search(r"attnres generate: interrupted after [2-9] tokens in [\d.]+ s \(", captured.err), captured.err


def test_generate_to_an_output_that_is_not_utf8_replaces_what_it_cannot_encode(run_dir, capfd, monkeypatch):
    """`attnres generate ... > out.txt` where the locale's encoding is not UTF-8 (Latin-1, a
    Windows code page): the first character it has no byte for (a U+FFFD of a byte-level token
    that is not UTF-8, a CJK character) ended the stream with "attnres generate: error: 'ascii'
    codec can't encode character". Such a character is now written as '?', and the stream goes on."""
    import io

    from attnres.cli import generate as generate_cli

    def pieces(tokenizer, steps, new):
        for piece in ("caf", "\u00e9 ", "\ufffd", "\u65e5 end"):
            new.append(0)
            yield piece

    monkeypatch.setattr(generate_cli, "text_pieces", pieces)
    out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", out)
    assert cli_main(["generate", str(run_dir), *GREEDY]) == 0
    out.flush()
    assert out.buffer.getvalue() == b"caf? ?? end\n"
    assert "attnres generate: 4 tokens in" in capfd.readouterr().err


def _forced_pieces(monkeypatch, pieces, seen=None):
    """``attnres generate`` streams ``pieces`` (one token each) in place of the model's text;
    ``seen``: a function called before each piece after the first (what was printed by then)."""
    from attnres.cli import generate as generate_cli

    def forced(tokenizer, steps, new):
        for k, piece in enumerate(pieces):
            if k and seen is not None:
                seen()
            new.append(0)
            yield piece

    monkeypatch.setattr(generate_cli, "text_pieces", forced)


@pytest.mark.parametrize("pieces, stops, printed, found, tokens", [
    (["Hello wor", "ld. User: hi", " more"], ["User:"], "Hello world. ", "'User:'", 2),  # inside one piece
    (["one\n", "\ntwo", " three"], [r"\n\n"], "one", r"'\n\n'", 2),  # across pieces, escapes read
    (["ab", "cX", "YZ", "!"], ["cXY"], "ab", "'cXY'", 3),  # ending inside a token's text
    (["Us", "er: x", "y"], ["User:"], "", "'User:'", 2),  # at the very start
    (["a b", "\n\nc END", "z"], ["END", r"\n\n"], "a b", r"'\n\n'", 2),  # several: the first one met
    (["a b", "c"], [" "], "a", "' '", 1),  # spaces are text: not an empty --stop
])
def test_generate_stop_ends_the_text_before_the_stop_string(run_dir, capsys, monkeypatch, pieces, stops, printed, found,
                                                             tokens):
    """`attnres generate --stop TEXT` (transformers' stop_strings, vLLM's stop): the text ends
    before the first stop string - in one token's text, across tokens, at the very start - the
    tokens after it are not generated, and the summary says where it stopped."""
    _forced_pieces(monkeypatch, pieces)
    assert cli_main(["generate", str(run_dir), *GREEDY, *[a for stop in stops for a in ("--stop", stop)]]) == 0
    out = capsys.readouterr()
    assert out.out == printed + "\n"
    # (one token: "1 token", not "1 tokens")
    assert f"attnres generate: stopped at --stop {found} after {tokens} token{'s' * (tokens != 1)} in " in out.err, out.err


def test_generate_stop_holds_back_a_possible_stop_string_until_it_diverges(run_dir, capsys, monkeypatch):
    """What may be the start of a stop string is not printed until the text goes another way
    (then it is, whole), nor lost when the text ends inside it."""
    printed = []
    _forced_pieces(monkeypatch, ["say U", "s", "a then ", "Us"], seen=lambda: printed.append(capsys.readouterr().out))
    assert cli_main(["generate", str(run_dir), *GREEDY, "--stop", "User:", "--stop", "Usa!"]) == 0
    out = capsys.readouterr()
    assert printed == ["say ", "", "Usa then "]  # 'U', then 'Us', held: 'User:' or 'Usa!' may follow
    assert out.out == "Us\n"  # the end: what was held back
    assert "stopped" not in out.err and "attnres generate: 4 tokens in" in out.err


def test_generate_stop_prints_what_it_held_back_when_ctrl_c_ends_the_text(run_dir, capsys, monkeypatch):
    from attnres.cli import generate as generate_cli

    def interrupted(tokenizer, steps, new):
        new.append(0)
        yield "x U"
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_cli, "text_pieces", interrupted)
    assert cli_main(["generate", str(run_dir), *GREEDY, "--stop", "User:"]) == 130
    out = capsys.readouterr()
    assert out.out == "x U\n" and "interrupted after 1 token in " in out.err


@pytest.mark.parametrize("text, stop, printed", [
    ("Hello world.\n\nUser: how are you?", r"\n\nUser:", "Hello world."),
    ("the café is open", "fé", "the ca"),  # 'é': two byte-level tokens, the stop string ends inside the second
])
def test_generate_stop_ends_the_decoded_stream_of_tokens(run_dir, capsys, monkeypatch, text, stop, printed):
    """The tokens of ``text`` forced through the run's BPE tokenizer and its decoding: a stop
    string made of several tokens, or ending inside a character's bytes, ends the text before
    it, and no token after the one that completes it is asked for."""
    import torch

    import attnres.inference
    from attnres.inference import load_run, load_tokenizer

    tokenizer = load_tokenizer(load_run(str(run_dir), "cpu"), None)
    ids, meant = tokenizer.encode(text), stop.replace(r"\n", "\n")
    needed = next(n for n in range(1, len(ids) + 1) if meant in tokenizer.decode(ids[:n]))
    assert 1 < needed < len(ids) and meant not in tokenizer.decode(ids[:needed - 1])
    asked = []

    def forced(model, input_ids, **kwargs):
        for i in ids:
            asked.append(i)
            yield torch.tensor([i])

    monkeypatch.setattr(attnres.inference, "stream", forced)
    assert cli_main(["generate", str(run_dir), *GREEDY, "--stop", stop]) == 0
    out = capsys.readouterr()
    assert out.out == printed + "\n"
    assert f"attnres generate: stopped at --stop {meant!r} after {needed} tokens in " in out.err, out.err
    assert len(asked) == needed


def test_generate_stop_reads_backslash_escapes_and_refuses_a_broken_one(run_dir, monkeypatch):
    from attnres.cli import generate as generate_cli

    assert generate_cli.read_stops([r"\n\n", r"C:\\x", "é\\t€", r"\q"]) == ["\n\n", "C:\\x", "é\t€", r"\q"]

    def no_loading(args):
        raise AssertionError("the model was loaded before --stop was checked")

    monkeypatch.setattr(generate_cli, "_load", no_loading)
    with pytest.raises(SystemExit) as info:
        cli_main(["generate", str(run_dir), "--prompt", "the", "--stop", r"\x4"])
    assert str(info.value).startswith(r"attnres generate: error: --stop '\x4': truncated \xXX escape; ")
    assert r"write \\ for a backslash" in str(info.value)


def test_resuming_a_misspelt_out_dir_names_the_run_meant(run_dir, tmp_path, capsys):
    """`attnres train out_dir=runs/rnu --resume` said "'runs/rnu/checkpoints' holds no
    checkpoint", as if the run were there and empty."""
    import shutil

    shutil.copytree(run_dir, tmp_path / "run")
    with pytest.raises(SystemExit) as info:
        cli_main(["train", f"out_dir={tmp_path / 'rnu'}", "--resume"])
    assert f"out_dir {str(tmp_path / 'rnu')!r} does not exist (did you mean 'run'?)" in str(info.value)
    assert not (tmp_path / "rnu").exists()


@pytest.mark.parametrize("flag, value, expected", [
    ("--max-new-tokens", "0", "--max-new-tokens must be an integer >= 1; got 0"),
    ("--temperature", "-1", "--temperature must be a finite number > 0, or 0 for greedy decoding; got -1.0"),
    ("--top-k", "-2", "--top-k must be an integer >= 0 (0 = no top-k filter); got -2"),
    ("--top-p", "0", "--top-p must be a number in (0, 1] (1 = no nucleus filter); got 0.0"),
    ("--chunk-size", "0", "--chunk-size must be >= 1 (omit it for the whole prompt at once); got 0"),
])
def test_generate_names_a_bad_sampling_option_by_its_flag_before_loading(run_dir, monkeypatch, flag, value, expected):
    """`attnres generate --max-new-tokens 0` said "max_new_tokens must be ..." (the Python
    parameter, not the option given) after loading the model."""
    from attnres.cli import generate as generate_cli

    def no_loading(args):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(generate_cli, "_load", no_loading)
    with pytest.raises(SystemExit) as info:
        cli_main(["generate", str(run_dir), "--prompt", "the", flag, value])
    assert str(info.value) == f"attnres generate: error: {expected}"


@pytest.mark.parametrize("target", ["checkpoints/STEP/state.json", "checkpoints/STEP/model.safetensors", "config.json",
                                    "metrics.jsonl", "hf/config.json", "hf/tokenizer.json", "hf/attnres_classes.py"])
def test_eval_out_that_is_a_file_of_a_run_or_model_is_refused(run_dir, tmp_path, target):
    """`attnres eval RUN --out RUN/checkpoints/step-N/state.json` replaced the checkpoint's
    manifest with the results (the checkpoint no longer verified); a run's config.json or a
    Hugging Face directory's files likewise. Refused now, before any work, --overwrite or not
    (with it, the module file that config.json's auto_map names was replaced)."""
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "hf").mkdir()  # (a Hugging Face directory: its config.json and weights)
    (run / "hf" / "config.json").write_text("{}")
    (run / "hf" / "model.safetensors").write_bytes(b"")
    (run / "hf" / "attnres_classes.py").write_text("from attnres.hf import AttnResConfig\n")
    step = sorted((run / "checkpoints").glob("step-*"))[-1].name
    out = run / target.replace("STEP", step)
    before = out.read_bytes() if out.exists() else None
    with pytest.raises(SystemExit) as info:
        cli_main(["eval", str(run), "--tasks", "none", "--out", str(out), "--overwrite"])
    assert f"--out {str(out)!r} is a file of " in str(info.value) and "another --out" in str(info.value)
    assert (out.read_bytes() if out.exists() else None) == before


def test_eval_replaces_an_earlier_result_but_no_other_file_unless_told(run_dir, tmp_path, monkeypatch, capsys):
    """`attnres eval RUN --out notes.txt` (or over a settings.json) replaced whatever file was there
    with the results. A file that is not an earlier result (its keys checkpoint, perplexity,
    lm_eval) is now refused before any work unless --overwrite; an earlier result is replaced as
    before, through a temporary file renamed into place."""
    pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    import json
    import os

    evaluate_args = ["eval", str(run_dir), "--tasks", "none", "--device", "cpu", "--out"]
    for name, held in (("notes.txt", "my notes\n"), ("settings.json", '{"lr": 0.001}'), ("empty.json", "")):
        path = tmp_path / name
        path.write_text(held)
        with pytest.raises(SystemExit) as info:
            cli_main([*evaluate_args, str(path)])
        assert str(info.value) == (f"attnres eval: error: --out {str(path)!r} exists and is not an earlier attnres eval "
                                   "result (a JSON file with 'checkpoint', 'perplexity', 'lm_eval'): give another "
                                   "--out, or --overwrite to replace it")
        assert path.read_text() == held and "held-out loss" not in capsys.readouterr().out
    assert cli_main([*evaluate_args, str(tmp_path / "notes.txt"), "--overwrite"]) == 0
    earlier = json.loads((tmp_path / "notes.txt").read_text())
    assert earlier["perplexity"]["tokens"] > 0
    replaced = []
    monkeypatch.setattr(os, "replace", lambda src, dst: (replaced.append((Path(src).name, Path(dst).name)),
                                                         Path(src).rename(dst)))
    assert cli_main([*evaluate_args, str(tmp_path / "notes.txt")]) == 0  # an earlier result: replaced
    assert json.loads((tmp_path / "notes.txt").read_text()) == earlier
    assert replaced == [(f".notes.txt.tmp-{os.getpid()}.txt", "notes.txt")]  # (the suffix kept: replace_atomically)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.json", "notes.txt", "settings.json"]


@pytest.mark.parametrize("args, expected", [
    (["--seeds", "-1"], "seeds (--seeds) must be a non-empty list of integers >= 0 and <= 18446744073709551615; got "
     "[-1]"),
    (["--seeds", str(2**64)], "seeds (--seeds) must be a non-empty list of integers >= 0 and <= 18446744073709551615; "
     f"got [{2**64}]"),  # (said as the field of each run: TrainConfig.seed)
    (["--variants", "blok"], "variants (--variants) must be names of the 'compare' grid"),
    (["data.paths=[/no-such-attnres-data]"], "data path '/no-such-attnres-data' does not exist"),
])
def test_compare_names_a_bad_seed_or_variant_by_its_option(tmp_path, args, expected):
    """`attnres compare --seeds -1` said "seeds must be ..." where the option is --seeds (the
    message of a seed given twice already named it)."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("scipy")
    with pytest.raises(SystemExit) as info:
        cli_main(["compare", "--preset", "tiny", "--out", str(tmp_path / "grid"), *args])
    assert expected in str(info.value)
    assert not (tmp_path / "grid").exists()


def test_a_home_relative_path_in_a_config_file_is_the_home_directory(tmp_path, monkeypatch):
    """`out_dir: ~/runs/x` in a YAML file (the shell expands `~` on the command line, not in a
    file) trained into a directory named '~' in the current one; init_from / resume_from
    likewise named no checkpoint. data.paths already read `~` as the home directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config_file = tmp_path / "run.yaml"
    config_file.write_text("out_dir: ~/runs/x\ninit_from: ~/runs/base\n")
    config = load_config(config_file)
    assert config.out_dir == str(tmp_path / "home" / "runs" / "x")
    assert config.init_from == str(tmp_path / "home" / "runs" / "base")
    assert load_config(None, ["resume_from=~/runs/x"]).resume_from == str(tmp_path / "home" / "runs" / "x")


def test_report_only_on_a_misspelt_out_names_the_grid_meant(tmp_path):
    """`attnres compare --out runs/comprae --report-only` said "no finished runs to report",
    as if the grid were there and unfinished; so did an --out that is a file."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("scipy")
    (tmp_path / "compare").mkdir()
    with pytest.raises(SystemExit) as info:
        cli_main(["compare", "--out", str(tmp_path / "comprae"), "--report-only"])
    assert f"--out {str(tmp_path / 'comprae')!r} does not exist (did you mean 'compare'?)" in str(info.value)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SystemExit) as info:  # (it said "no finished runs to report")
        cli_main(["compare", "--out", str(tmp_path / "notes.txt"), "--report-only"])
    assert f"--out {str(tmp_path / 'notes.txt')!r} is a file: give the grid's folder" in str(info.value)


@pytest.mark.parametrize("args, expected", [
    (["train", "--print-config", "model.preset=[1]"],
     "TrainConfig.model.preset must be a model preset, one of 'bench-cpu', 'bench-infer', 'tiny', 'train-cpu'; got [1]"),
    (["train", "--print-config", "model.preset={a: 1}"], "TrainConfig.model.preset must be a model preset, one of"),
    (["train", "--print-config", "model=tny"], "TrainConfig.model must be a model preset, one of 'bench-cpu', "
     "'bench-infer', 'tiny', 'train-cpu'; got 'tny' (did you mean 'tiny'?)"),
    (["train", "--config", "BINARY", "--print-config"], "config file 'BINARY' is not UTF-8 text (line 2, byte 128); give "
     "a text file"),
    (["eval", "NOT_A_DIR", "--tasks", "none"], "'NOT_A_DIR' is neither a checkpoint nor a run directory with "
     "checkpoints: it is a file; name a run directory"),
    (["generate", "RUN", "--prompt-file", "NOT_A_DIR/prompt.txt"], "--prompt-file: 'NOT_A_DIR/prompt.txt' cannot be "
     "read: Not a directory"),
    (["generate", "RUN", "--prompt", "the", "--tokenizer", "NOT_A_DIR"], "--tokenizer: cannot read tokenizer file "
     "'NOT_A_DIR' (a tokenizer.json of the tokenizers library"),
    (["analyze", "RUN", "--compare", "NOT_A_DIR"], "--compare: 'NOT_A_DIR' is neither a checkpoint nor a run directory"),
])
def test_a_wrong_argument_is_one_line_naming_it(run_dir, tmp_path, capsys, args, expected):
    """Wrong values found by trying every field and option (`attnres train model.preset=[1]`:
    "TypeError: unhashable type: 'list'", a traceback; a binary config file: "'utf-8' codec
    can't decode byte 0xb1"; a file given as the checkpoint of `eval`, called its --out; a
    prompt file under a file: a traceback) are each one line naming the option or field."""
    if args[0] == "eval":
        pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)))
    not_a_dir = tmp_path / "notes.txt"
    not_a_dir.write_text("the")
    names = {"RUN": str(run_dir), "BINARY": str(binary), "NOT_A_DIR": str(not_a_dir), "OUT": str(tmp_path / "out")}
    argv = [names.get(a, a.replace("NOT_A_DIR", str(not_a_dir)).replace("OUT", str(tmp_path / "out"))) for a in args]
    expected = expected.replace("BINARY", str(binary)).replace("NOT_A_DIR", str(not_a_dir))
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    said = info.value.code if isinstance(info.value.code, str) else capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code not in (0, None) and expected in said, said
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_a_bad_device_or_tokenizer_is_refused_before_loading(run_dir, tmp_path, monkeypatch, command):
    """`attnres generate RUN --device bogus` read and verified the checkpoint and built the
    model (minutes for a large one) before it refused the device; `--tokenizer` naming no
    file likewise, in generate and eval."""
    if command == "eval":
        pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    from attnres.inference import loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the option was checked")

    monkeypatch.setattr(loading, "find_valid_checkpoint", no_loading)
    rest = {"generate": ["--prompt", "the"], "eval": ["--tasks", "none", "--out", str(tmp_path / "e.json")]}[command]
    for option, expected in ((["--device", "bogus"], "--device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got 'bogus'"),
                             (["--device", "mps"], "Apple's GPU (mps) is not supported"),
                             (["--tokenizer", str(tmp_path / "tok.json")], f"--tokenizer '{tmp_path / 'tok.json'}' "
                              "does not exist: give a tokenizer.json file")):
        with pytest.raises(SystemExit) as info:
            cli_main([command, str(run_dir), *rest, *option])
        assert expected in str(info.value)


def test_eval_refuses_a_long_window_or_a_wrong_tokenizer_before_the_weights_load(run_dir, tmp_path, monkeypatch):
    """`attnres eval RUN --seq-len N` past the model's context, and a `--tokenizer` that does
    not read or whose vocabulary is not the model's, were refused only once the weights had
    loaded (minutes for a large upcycled model); of a transformers directory, --seq-len too.
    They are refused from the config, before, with the messages the checks after the load give."""
    pytest.importorskip("transformers")
    from attnres.data.tokenizer import train_bpe
    from attnres.hf import directory
    from attnres.inference import loading

    assert cli_main(["export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    other, unreadable = tmp_path / "other.json", tmp_path / "unreadable.json"
    train_bpe(write_corpus(tmp_path / "other.txt", n_lines=100, seed=1).read_text(), 290).save(other)
    unreadable.write_text("{not a tokenizer")

    def no_loading(*args, **kwargs):
        raise AssertionError("the weights were loaded before the option was checked")

    monkeypatch.setattr(loading, "load_run", no_loading)
    monkeypatch.setattr(directory, "load_directory", no_loading)
    window = "--seq-len must be in [1, 128] (the model's context limit, {}); got 129: omit it for the default window"
    for source, option, expected in (
            (run_dir, ["--seq-len", "129"], window.format("max_seq_len")),
            (tmp_path / "hf", ["--seq-len", "129"], window.format("max_position_embeddings")),
            (run_dir, ["--tokenizer", str(other)], f"--tokenizer {str(other)!r} has 290 tokens, the model's vocabulary "
             "(vocab_size) 320: its ids would index other embeddings"),
            (run_dir, ["--tokenizer", str(unreadable)], f"--tokenizer: cannot read tokenizer file {str(unreadable)!r}")):
        with pytest.raises(SystemExit) as info:
            cli_main(["eval", str(source), "--tasks", "none", "--device", "cpu", "--out", str(tmp_path / "e.json"),
                      *option])
        assert str(info.value).startswith(f"attnres eval: error: {expected}"), info.value


@pytest.mark.parametrize("command", ["eval", "analyze"])
def test_an_empty_text_file_is_refused_by_its_option_before_loading(run_dir, tmp_path, monkeypatch, command):
    """`attnres eval / analyze RUN --text empty.txt` loaded the model, then said 'the held-out
    text must have at least 2 tokens' (analyze: 'the text has 0 tokens'), naming no option."""
    if command == "eval":
        pytest.importorskip("transformers")  # (attnres eval: the hf extra)
    from attnres.inference import loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the checkpoint was read before --text was checked")

    monkeypatch.setattr(loading, "find_valid_checkpoint", no_loading)
    for body in ("", "\n \n")[: 2 if command == "eval" else 1]:  # (analyze: an empty file; eval reads it: blank too)
        (tmp_path / "empty.txt").write_text(body)
        out = ["--tasks", "none", "--out", str(tmp_path / "e.json")] if command == "eval" else ["--out", str(tmp_path / "a")]
        with pytest.raises(SystemExit, match=re.escape(f"--text '{tmp_path / 'empty.txt'}' is empty: there is no text "
                                                       f"to {'evaluate on' if command == 'eval' else 'analyse'}")):
            cli_main([command, str(run_dir), "--text", str(tmp_path / "empty.txt"), *out])


@pytest.mark.parametrize("args, expected", [
    (["train", "--resume-from", "", "out_dir=OUT", "steps=1", "progress=false"], "--resume-from is empty; --resume-from: "
     "continue from this checkpoint (a step-* directory"),
    (["train", "--config", "", "--print-config"], "--config is empty; --config: YAML file with TrainConfig fields"),
    (["generate", "", "--prompt", "the"], "CHECKPOINT is empty; CHECKPOINT: a checkpoint directory (step-*) or a run "
     "directory (its newest)"),
    (["generate", "RUN", "--prompt-file", ""], "--prompt-file is empty; --prompt-file: read the text to continue from "
     "FILE (UTF-8), or from standard input with '-'"),
    (["generate", "RUN", "--prompt", "the", "--tokenizer", " "], "--tokenizer is empty; --tokenizer: tokenizer.json"),
    (["generate", "RUN", "--prompt", "the", "--stop", "\n", "--stop", ""], "--stop is empty; --stop: end the text where "
     "TEXT first appears in it, TEXT itself not printed (as vLLM's stop)"),
    (["export", "RUN", "--out", ""], "--out is empty; --out: output directory for save_pretrained"),
    (["analyze", "RUN", "--compare", ""], "--compare is empty; --compare: a second checkpoint"),
    (["eval", "RUN", "--tasks", "none", "--out", ""], "--out is empty; --out: results JSON"),
    (["status", ""], "DIR is empty; DIR: folders to look in"),
    (["compare", "--preset", "", "--out", "OUT"], "--preset is empty; --preset: grid size: 'tiny' (seconds), 'demo'"),
    (["upcycle", "--model", "", "--out", "OUT"], "--model is empty; --model: a save_pretrained directory"),
])
def test_an_empty_value_is_refused_by_name(run_dir, tmp_path, monkeypatch, capsys, args, expected):
    """An empty option (`--out "$DIR"` with DIR unset) was read as the current directory:
    `export RUN --out ''` wrote the model's files there, `generate '' ...` said "'.' is neither
    a checkpoint ..."; an empty --resume-from or --preset was taken as not given (a new run, the
    'demo' grid, trained). Each is now a usage error naming the option, before any work."""
    monkeypatch.chdir(tmp_path)
    argv = [str(run_dir) if a == "RUN" else str(tmp_path / "out") if a.endswith("OUT") else a for a in args]
    argv = [f"out_dir={tmp_path / 'out'}" if a.startswith("out_dir=") else a for a in argv]
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith(f"attnres {args[0]}: error: {expected}"), said
    assert list(tmp_path.iterdir()) == []  # (nothing written here, nor into --out)


def test_an_export_of_attnres_own_model_is_not_upcycled_and_says_why(run_dir, tmp_path):
    """`attnres upcycle --model EXPORT` and `attnres train model.from_hf=EXPORT` of an export
    of a training run said its "decoder layout is not recognised", listing the families;
    `upcycle --model RUN`, transformers' "Unrecognized model in RUN"."""
    pytest.importorskip("transformers")
    assert cli_main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    reason = ("cannot upcycle model_type 'attnres': it is attnres's own model (an `attnres export` of a training run), "
              "AttnRes already: use it as it is")
    with pytest.raises(SystemExit, match=re.escape(f"attnres upcycle: error: {reason}")):
        cli_main(["upcycle", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "up")])
    with pytest.raises(SystemExit, match=re.escape(f"TrainConfig.model.from_hf='{tmp_path / 'hf'}': {reason}")):
        cli_main(["train", "--print-config", f"model.from_hf={tmp_path / 'hf'}"])
    with pytest.raises(SystemExit, match=re.escape(f"--model '{run_dir}' is a training run's directory (it holds "
                                                   "checkpoints/), attnres's own model, AttnRes already: use it as it is")):
        cli_main(["upcycle", "--model", str(run_dir), "--out", str(tmp_path / "up")])  # ("Unrecognized model")
    assert not (tmp_path / "up").exists()


@pytest.mark.parametrize("command", ["status", "plot"])
def test_a_folder_that_cannot_be_read_is_named(tmp_path, monkeypatch, capsys, command):
    """`attnres status DIR` of a folder this user may not list ended in a PermissionError's
    traceback (seen as a user without the rights; root reads every folder, so the error is
    raised here as the file system raises it)."""
    from attnres.train import status

    locked = tmp_path / "locked"
    locked.mkdir()

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path / "config.json"))

    monkeypatch.setattr(status, "is_run_directory", denied)
    with pytest.raises(SystemExit) as info:
        cli_main([command, str(locked)])
    assert str(info.value) == f"attnres {command}: error: DIR: '{locked / 'config.json'}' cannot be read: permission denied"


def _a_stop_string(text: str, not_in: str = "") -> str:
    """A few characters of ``text`` (from its second on) for --stop: no U+FFFD (a byte-level
    token's part of a character), not only spaces, not in ``not_in``."""
    return next(text[i:i + n] for n in (2, 3, 4) for i in range(1, len(text) - n)
                if "\ufffd" not in text[i:i + n] and text[i:i + n].strip() and text[i:i + n] not in not_in)


def _generate(argv, capsys) -> tuple[str, str]:
    capsys.readouterr()
    assert cli_main(["generate", *argv]) == 0
    out = capsys.readouterr()
    return out.out, out.err


def test_stop_strings_in_python_end_where_generate_stop_ends(run_dir, capsys):
    """``generate(..., stop_strings=[TEXT], tokenizer=...)`` (the Python API had stop token ids
    only) stops at the token where `attnres generate --stop TEXT` stops, with the same tokens;
    ``text_until_stop`` gives the text the command prints."""
    import torch

    from attnres.inference import generate, load_run, load_tokenizer, text_until_stop

    args = [str(run_dir), "--prompt", "the", "--max-new-tokens", "16", "--temperature", "0"]
    free = _generate(args, capsys)[0].rstrip("\n")
    stop = _a_stop_string(free)
    printed, said = _generate([*args, "--stop", stop], capsys)
    run = load_run(str(run_dir), "cpu")
    tokenizer = load_tokenizer(run)
    new = generate(run.model, torch.tensor([tokenizer.encode("the")]), max_new_tokens=16, stop_strings=[stop],
                   tokenizer=tokenizer)[0].tolist()
    text, found, n_tokens = text_until_stop(tokenizer, new, [stop])
    assert (text + "\n", found, n_tokens) == (printed, stop, len(new)) and len(new) < 16
    assert f"stopped at --stop {stop!r} after {n_tokens} tokens in " in said
    assert printed == free[:free.find(stop)] + "\n"


_PROMPTS = ["the", "a quick brown fox"]
_GREEDY_8 = ["--max-new-tokens", "8", "--temperature", "0"]


_SAMPLED_8 = ["--max-new-tokens", "8", "--temperature", "1", "--top-k", "40", "--seed", "5"]


def _each_alone(run_dir, capsys, extra, sampling=_GREEDY_8) -> list[tuple[str, str]]:
    return [_generate([str(run_dir), *sampling, "--prompt", p, *extra], capsys) for p in _PROMPTS]


def _batch_as_each_alone(run_dir, capsys, extra, each=None, sampling=_GREEDY_8) -> str:
    """`attnres generate` of both prompts with ``extra`` (and ``sampling``, greedy by default):
    each completion and its summary line as each prompt alone (``each``: their outputs, else
    run here); the batch's output."""
    each = each or _each_alone(run_dir, capsys, extra, sampling)
    batch, said = _generate([str(run_dir), *sampling, "--prompt", _PROMPTS[0], "--prompt", _PROMPTS[1], *extra], capsys)
    assert batch == f"==> 1/2: --prompt #1 <==\n{each[0][0]}\n==> 2/2: --prompt #2 <==\n{each[1][0]}"
    lines = said.splitlines()
    assert re.search(r"^attnres generate: 2 prompts in one batch: \d+ tokens in [\d.]+ s \(", said, re.M), said
    for k, (out, err) in enumerate(each, 1):
        tokens = re.search(r"((stopped at --stop .* after )?\d+ tokens?) in", err).group(1)
        assert f"  {k}/2 (--prompt #{k}): {tokens}" in lines, (said, err)
    return batch


def test_generate_continues_several_prompts_in_one_batch_as_each_alone(run_dir, tmp_path, capsys):
    """`attnres generate` took one prompt. `--prompt` repeated (or `--prompt-file` repeated, or
    `--prompt-file FILE --each-line`) continues them in one left-padded batch and prints each
    completion under its own `==> N/M: PROMPT <==` line: greedy, the text each prints alone,
    with `--stop` (in one of them) alike; the summary has a line for each."""
    plain = _each_alone(run_dir, capsys, [])
    stop = _a_stop_string(plain[0][0], not_in=plain[1][0])
    for extra, each in (([], plain), (["--stop", stop], None)):
        batch = _batch_as_each_alone(run_dir, capsys, extra, each)
        if not extra:  # the same prompts as a file's lines
            listed = tmp_path / "prompts.txt"
            listed.write_text(f"{_PROMPTS[0]}\n\n{_PROMPTS[1]}\n")
            from_file = _generate([str(run_dir), *_GREEDY_8, "--prompt-file", str(listed), "--each-line"], capsys)[0]
            assert from_file == batch.replace("--prompt #1", f"--prompt-file {listed}, line 1").replace(
                "--prompt #2", f"--prompt-file {listed}, line 3")
    (tmp_path / "blank.txt").write_text("\n \n")
    for argv, message in ((["--prompt", "the", "--each-line"], "--each-line reads the lines of --prompt-file as prompts"),
                          (["--prompt-file", str(tmp_path / "blank.txt"), "--each-line"], "holds no prompt: every line is blank"),
                          (["--prompt", "the", "--prompt", ""], "--prompt #2 is empty: there is nothing to continue")):
        with pytest.raises(SystemExit, match=message):
            cli_main(["generate", str(run_dir), *argv])


def test_generate_continues_several_prompts_with_chat_and_a_seed_as_one(run_dir, capsys):
    """`--chat` puts each prompt of a batch through the template, as alone. A sampled batch
    drew its rows from one generator seeded with `--seed`, so a prompt's completion was not
    the one it gets alone with that seed; each prompt now samples with a generator of its own
    seeded with `--seed`: its completion alone (docs/inference.md)."""
    _batch_as_each_alone(run_dir, capsys, [], sampling=_SAMPLED_8)
    pytest.importorskip("transformers")  # (--chat renders the template with transformers: the hf extra)
    _batch_as_each_alone(run_dir, capsys, ["--chat"])


def test_a_prompt_file_given_twice_is_numbered_and_a_repeated_prompt_warned_of(run_dir, tmp_path, capsys):
    """`--prompt-file F --prompt-file F` printed both completions under the same
    `--prompt-file F` header; each now says which time it is (`#1`, `#2`). A prompt given twice
    (that file, `--prompt` twice) is warned of: each prompt samples with a generator seeded with
    `--seed`, so the two get the same completion - the one it gets alone - not two samples."""
    import warnings

    prompt = tmp_path / "p.txt"
    prompt.write_text("the quick\n")

    def run(*argv) -> tuple[str, list[str]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = _generate([str(run_dir), *_SAMPLED_8, *argv], capsys)[0]
        return out, [str(w.message) for w in caught if "the same prompt" in str(w.message)]

    alone = _generate([str(run_dir), *_SAMPLED_8, "--prompt-file", str(prompt)], capsys)[0]
    out, said = run("--prompt-file", str(prompt), "--prompt-file", str(prompt))
    assert out == f"==> 1/2: --prompt-file {prompt} #1 <==\n{alone}\n==> 2/2: --prompt-file {prompt} #2 <==\n{alone}"
    assert said == [f"--prompt-file {prompt} #2 is the same prompt as --prompt-file {prompt} #1: it gets the same "
                    "completion (each prompt samples with a generator seeded with --seed, as alone); for several "
                    "samples of one prompt, run it with several --seed values"]
    out, said = run("--prompt-file", str(prompt), "--prompt-file", str(prompt), "--each-line")
    assert f"==> 2/2: --prompt-file {prompt} #2, line 1 <==\n" in out and len(said) == 1
    assert run("--prompt", "the", "--prompt", "a", "--prompt", "the")[1] == [
        "--prompt #3 is the same prompt as --prompt #1: it gets the same completion (each prompt samples with a "
        "generator seeded with --seed, as alone); for several samples of one prompt, run it with several --seed values"]
    assert run("--prompt", _PROMPTS[0], "--prompt", _PROMPTS[1])[1] == []
    assert run("--prompt", "the", "--prompt", "the", "--temperature", "0")[1] == [
        "--prompt #2 is the same prompt as --prompt #1: it gets the same completion (greedy decoding)"]


def test_generate_continues_several_prompts_of_a_transformers_directory_in_one_batch(run_dir, tmp_path, capsys):
    """A transformers directory (an export here) continued several prompts one after the other
    (stream_transformers took no attention mask). They go in one left-padded batch now, as the
    run's own: greedy, each completion is the one that prompt gets alone (stop tokens and strings
    in a batch: tests/test_hf.py); sampled, too (a generator of its own a prompt, seeded with
    `--seed`), and the run's batch with the same seed."""
    pytest.importorskip("transformers")
    assert cli_main(["export", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    _batch_as_each_alone(tmp_path / "hf", capsys, [])
    batch = _batch_as_each_alone(tmp_path / "hf", capsys, [], sampling=_SAMPLED_8)
    sampled = [*_SAMPLED_8, "--prompt", _PROMPTS[0], "--prompt", _PROMPTS[1]]
    assert batch == _generate([str(run_dir), *sampled], capsys)[0]
    assert "transformers decode" in _generate([str(tmp_path / "hf"), *sampled], capsys)[1]


def test_ctrl_c_during_a_batch_prints_what_each_prompt_has(run_dir, capsys, monkeypatch):
    """Ctrl-C while several prompts generate: each completion so far is printed under its
    line, the summary says the batch was interrupted, and the status is 130."""
    import torch

    import attnres.inference
    from attnres.inference import load_run, load_tokenizer

    tokenizer = load_tokenizer(load_run(str(run_dir), "cpu"), None)
    first, second = [tokenizer.encode(c)[0] for c in "ab"], [tokenizer.encode(c)[0] for c in "xy"]

    def interrupted(model, input_ids, **kwargs):
        assert input_ids.shape[0] == 2
        yield torch.tensor([first[0], second[0]])
        yield torch.tensor([first[1], second[1]])
        raise KeyboardInterrupt

    monkeypatch.setattr(attnres.inference, "stream", interrupted)
    capsys.readouterr()
    assert cli_main(["generate", str(run_dir), *_GREEDY_8, "--prompt", "the", "--prompt", "a"]) == 130
    out = capsys.readouterr()
    assert out.out == "==> 1/2: --prompt #1 <==\nab\n\n==> 2/2: --prompt #2 <==\nxy\n"
    assert "attnres generate: 2 prompts in one batch, interrupted after 4 tokens in " in out.err
    assert "  1/2 (--prompt #1): 2 tokens" in out.err


def test_generate_names_the_prompt_of_several_that_does_not_fit_and_reads_standard_input_once(run_dir, monkeypatch):
    """Of several prompts, one longer than the context was refused as 'the prompt (N tokens)',
    naming none of them; now the longest is named as given. `--prompt-file -` given twice read
    standard input twice and refused the second, empty, read as 'is empty'; now it says
    standard input is read once."""
    import io

    long = "the quick brown fox " * 80
    with pytest.raises(SystemExit, match=r"the longest prompt \(--prompt #2\) \(\d+ tokens\) plus --max-new-tokens 8 "):
        cli_main(["generate", str(run_dir), *_GREEDY_8, "--prompt", "the", "--prompt", long, "--prompt", "a"])
    monkeypatch.setattr(sys, "stdin", io.StringIO("the\n"))
    with pytest.raises(SystemExit, match=r"--prompt-file - \(standard input\) is given 2 times, but standard input is "
                                         "read once: give it once, with --each-line for a prompt per line"):
        cli_main(["generate", str(run_dir), *_GREEDY_8, "--prompt-file", "-", "--prompt-file", "-"])


def test_generate_help_says_how_several_prompts_are_headed_and_run():
    """`attnres generate --help` said each completion comes under a '==> N/M: PROMPT <==' line
    (it is how the prompt was given, not its text)."""
    from attnres.cli import build_parser

    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    said = " ".join(generate.format_help().split())
    assert "'==> 2/3: --prompt #2 <=='" in said and "PROMPT <==" not in said
    assert "continued together in one batch" in said


def test_a_checkpoint_trained_with_the_triton_backend_generates_where_triton_cannot_run(run_dir, tmp_path, monkeypatch,
                                                                                        capsys):
    """A run trained on a GPU with `model.residual.backend=triton` stores that backend; loaded on
    a CPU, its first forward refused it ("use backend='auto' ... or 'torch'"), which `attnres
    generate` and `eval` have no option to set. The backend picks the implementation, not the
    weights: the checkpoint now loads with backend='auto', said in a warning (and an export of it,
    for any machine, stores 'auto')."""
    import json
    import shutil

    from attnres.checkpoint.manifest import STATE_FILE, latest_checkpoint, seal_state
    from attnres.inference import load_run

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    ckpt = latest_checkpoint(run)
    doc = json.loads((ckpt / STATE_FILE).read_text())
    doc["config"]["model"]["residual"]["backend"] = "triton"
    (ckpt / STATE_FILE).write_text(json.dumps(seal_state({k: v for k, v in doc.items() if k != "state_sha256"})))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the suite's interpreter runs Triton on the CPU)
    with pytest.warns(UserWarning, match=r"trained with model.residual.backend='triton', which cannot run here \(the "
                                         r"Triton kernels run on CUDA GPUs, and the device is cpu\): loading it with "
                                         r"backend='auto'"):
        assert load_run(run).model.config.residual.backend == "auto"
    with pytest.warns(UserWarning, match="backend='triton'"):
        assert cli_main(["generate", str(run), *_GREEDY_8, "--prompt", "the"]) == 0
    assert "8 tokens in" in capsys.readouterr().err
    if importlib.util.find_spec("transformers") is not None:  # (an export, for any machine, stores 'auto')
        with pytest.warns(UserWarning, match="backend='triton'"):
            assert cli_main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
        assert json.loads((tmp_path / "hf" / "config.json").read_text())["residual"]["backend"] == "auto"
