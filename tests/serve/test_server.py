"""``vllm serve`` on an exported Block AttnRes model (ragged S): the OpenAI-compatible server
answers ``/v1/completions`` and ``/v1/chat/completions`` (the export's tokenizer carries a
plain-text chat template) with the greedy text ``attnres generate`` gives; the server runs on
127.0.0.1 on a free port in its own process group and is stopped (server.py)."""

from __future__ import annotations

from conftest import CHAT, MAX_TOKENS, PROMPTS, SERVER_MODEL, _generate


def text_of(tok, ids: list[int]) -> str:
    """The text vLLM returns for ``ids``: the byte-level decode, less the bytes at the end that
    may begin an unfinished UTF-8 character (vLLM holds them back; the decode shows each as
    U+FFFD). The random test models emit arbitrary bytes."""
    return tok.decode(ids).rstrip("\ufffd")


def test_completions_and_chat_match_attnres(server_run, model_dirs):
    from transformers import AutoTokenizer

    directory = model_dirs[SERVER_MODEL]
    tok = AutoTokenizer.from_pretrained(directory)
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    (completion_ref, chat_ref), _ = _generate(directory, [PROMPTS[4], rendered], MAX_TOKENS)
    out = server_run.result()
    choice = out["completion"]["choices"][0]
    assert choice["token_ids"] == completion_ref
    assert choice["text"] == text_of(tok, completion_ref)
    reply = out["chat"]["choices"][0]
    assert reply["token_ids"] == chat_ref
    assert reply["message"]["content"] == text_of(tok, chat_ref)
    assert len(out["started"]) >= 2 and out["left_behind"] == []  # the server, its engine core, ...: all gone
