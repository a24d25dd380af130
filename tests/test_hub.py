"""Hugging Face Hub model ids where a command takes a model's folder (attnres.hub):
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
from attnres.hub import is_hub_id  # noqa: E402
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


def test_eval_of_a_hub_id_refuses_a_tokenizer_before_fetching_it(hub_model, tmp_path, monkeypatch):
    """`attnres eval ORG/NAME --tokenizer DIR` (a transformers tokenizer's directory, holding a
    tokenizer.json) fetched the whole model - minutes and gigabytes - before refusing the
    --tokenizer that a transformers directory never takes. Refused first, with the message a
    local directory gets."""
    def snapshot_download(repo_id, allow_patterns=None, **kwargs):
        raise AssertionError(f"{repo_id} fetched before --tokenizer was refused")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)
    for model in ("acme/tiny", str(hub_model)):
        with pytest.raises(SystemExit, match=r"error: --tokenizer: a transformers directory is evaluated with its own "
                                             r"tokenizer; omit it$"):
            cli_main(["eval", model, "--tasks", "none", "--tokenizer", str(hub_model)])


def test_the_harness_reads_its_data_sets_offline_only_where_it_cannot_download_them(monkeypatch, hub_online_unset):
    """`attnres eval` with a harness task asks the Hub once, without the client's retries: where
    something answers (a local server here), the harness stays online; where nothing does, or the
    user set offline mode, it reads from the cache; a variable set to 0 keeps it online, unasked."""
    import http.server
    import threading

    from attnres.hf.evaluate import harness_offline
    from attnres.hub import hub_unreachable, offline_mode

    constants, config = hub_online_unset
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # (answers 501)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert hub_unreachable() is None and harness_offline() is None
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    assert harness_offline().startswith("the Hugging Face Hub cannot be reached (http://127.0.0.1:9: ")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert harness_offline() is None
    with offline_mode():
        assert constants.HF_HUB_OFFLINE is config.HF_HUB_OFFLINE is True
        assert harness_offline() == "offline mode is set (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE)"
    assert constants.HF_HUB_OFFLINE is config.HF_HUB_OFFLINE is config.HF_DATASETS_OFFLINE is False
