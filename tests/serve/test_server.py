"""``vllm serve`` on an exported Block AttnRes model (ragged S): the OpenAI-compatible server
answers ``/v1/completions`` and ``/v1/chat/completions`` (the export's tokenizer carries a
plain-text chat template) with the greedy text ``attnres generate`` gives; the server runs on
127.0.0.1 on a free port in its own process group and is stopped (server.py)."""

from __future__ import annotations

from conftest import CHAT, MAX_TOKENS, PROMPTS, SERVER_MODEL, _generate


def test_completions_and_chat_match_attnres(server_run, model_dirs):
    from transformers import AutoTokenizer

    directory = model_dirs[SERVER_MODEL]
    tok = AutoTokenizer.from_pretrained(directory)
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    (completion_ref, chat_ref), _ = _generate(directory, [PROMPTS[4], rendered], MAX_TOKENS)
    out = server_run.result()
    choice = out["completion"]["choices"][0]
    assert choice["token_ids"] == completion_ref
    assert choice["text"] == tok.decode(completion_ref)
    reply = out["chat"]["choices"][0]
    assert reply["token_ids"] == chat_ref
    assert reply["message"]["content"] == tok.decode(chat_ref)
    assert not out["left_behind"]
