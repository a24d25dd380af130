"""Hugging Face Hub model ids where a command takes a model's folder (attnres.hf.hub):
``attnres eval``, ``attnres generate`` and ``attnres analyze`` (``attnres upcycle --model``:
tests/test_upcycle.py).
No network here: the fetch is stood in for by the folder it would return."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("yaml")

import huggingface_hub  # noqa: E402
from test_train import overrides, write_corpus  # noqa: E402

from attnres.cli import main as cli_main  # noqa: E402
from attnres.hf.hub import is_hub_id  # noqa: E402
from attnres.train import load_config, train  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_what_reads_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not is_hub_id("runs/atnres")  # a misspelt run beside its folder, not a Hub id
    for path in ("Qwen", "./Qwen/Qwen3", "a/b/c", "/abs/path", "models/x.gguf", "Qwen/"):
        assert not is_hub_id(path), path
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)  # a local copy of that name: read as it is
    assert not is_hub_id("Qwen/Qwen3-0.6B")


@pytest.fixture(scope="module")
def hub_model(tmp_path_factory) -> Path:
    """A trained tiny run's export, as the folder a Hub fetch would return."""
    root = tmp_path_factory.mktemp("hub")
    train(load_config(None, overrides(write_corpus(root / "corpus.txt"), root / "run")))
    assert cli_main(["export", str(root / "run"), "--out", str(root / "snapshot")]) == 0
    return root / "snapshot"


def test_eval_and_generate_fetch_a_hub_id(hub_model, tmp_path, monkeypatch, capsys):
    asked = []

    def snapshot_download(repo_id, allow_patterns=None, **kwargs):
        asked.append(repo_id)
        return str(hub_model)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli_main(["generate", "acme/tiny", "--prompt", "the", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    via_hub = capsys.readouterr().out
    assert cli_main(["generate", str(hub_model), "--prompt", "the", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == via_hub and asked == ["acme/tiny"]
    text = tmp_path / "held-out.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    assert cli_main(["eval", "acme/tiny", "--tasks", "none", "--text", str(text)]) == 0
    written = tmp_path / "eval-acme--tiny.json"  # here, not in the Hugging Face cache
    results = json.loads(written.read_text())
    assert results["checkpoint"] == "acme/tiny" and not (hub_model / "eval.json").exists()
    assert asked == ["acme/tiny", "acme/tiny"]
    assert cli_main(["analyze", "acme/tiny", "--text", str(text), "--seq-len", "16", "--rows", "2"]) == 0
    report = tmp_path / "analysis-acme--tiny" / "report.md"  # here too
    assert report.is_file() and "attnres_block" in report.read_text() and asked[-1] == "acme/tiny"
    assert not (hub_model.parent / f"{hub_model.name}-analysis").exists()
