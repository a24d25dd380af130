"""vLLM's features beyond greedy decoding, on the export (Block AttnRes, ragged S) and the
upcycled Llama, each against the model itself (``attnres generate`` and the native model's
forward for the export, HF ``generate`` and forward for the Llama; conftest.reference_model):
seeded parallel sampling (``n > 1``), ``LLM.beam_search`` against a beam search computed here,
prompt log-probabilities, preemption under KV-cache pressure, structured outputs (guided
decoding by a regular expression, a choice or a JSON schema's grammar), the sampling options the engine applies to the
logits (``logit_bias``, ``allowed_token_ids``, ``bad_words``, ``min_tokens`` with stop tokens,
top-5 ``logprobs``; the presence, frequency and repetition penalties), ``LLM.chat``, embeddings
from vLLM's pooling runner, and prompt embeddings as input (``enable_prompt_embeds``). One engine
a model serves all of them but the embeddings and the prompt embeddings (conftest.features)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import (BEAM_TOKENS, BEAM_WIDTH, CHATS, FEATURE_MAX_TOKENS, FEATURE_MODELS, FEATURE_PROMPTS, OPTIONS,
                      OPTIONS_MAX_TOKENS, PROMPTS, SAMPLING, SAMPLING_TOP_1, STRUCTURED_CHOICES, STRUCTURED_REGEX,
                      STRUCTURED_STOP, _generate, beam_search, reference_model)

pytestmark = pytest.mark.parametrize("name", FEATURE_MODELS)


class Reference:
    """One model as the references compute it: its tokenizer and the log-probabilities of
    every next token after each position of a sequence (the native model for an export)."""

    def __init__(self, directory) -> None:
        self.directory = directory
        self.tok, self.hf, native = reference_model(directory)
        self.model = native or self.hf

    def ids(self, prompt: str) -> list[int]:
        return self.tok(prompt)["input_ids"]

    def last_hidden_state(self, ids: list[int]) -> torch.Tensor:
        """``[len(ids), d]``: the final norm's output (transformers' base model: an upcycled
        model's ``model``, an export's ``AutoModel``)."""
        from transformers import AutoModel

        base = self.hf.model if hasattr(self.hf, "model") else AutoModel.from_pretrained(self.directory, dtype=torch.float32)
        with torch.inference_mode():
            return base(torch.tensor([ids])).last_hidden_state[0].float()

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """``[len(ids), vocab]``: row i is the distribution of the token after ``ids[:i + 1]``."""
        with torch.inference_mode():
            return self.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@pytest.fixture(scope="module")
def reference(model_dirs):
    references = {}

    def get(name: str) -> Reference:
        if name not in references:
            references[name] = Reference(model_dirs[name])
        return references[name]
    return get


@pytest.fixture(scope="module")
def greedy(model_dirs):
    """``attnres generate`` / HF ``generate``: the greedy tokens of :data:`PROMPTS` and their
    log-probabilities, by model."""
    return {name: _generate(model_dirs[name], PROMPTS, FEATURE_MAX_TOKENS) for name in FEATURE_MODELS}


def test_preemption_keeps_the_greedy_tokens(features, greedy, name):
    """A KV cache too small for the batch at once: vLLM preempts requests and recomputes their
    KV entries when they resume - the tokens and their log-probabilities stay the model's."""
    out, (ref, ref_logprobs) = features[name].result(), greedy[name]
    assert out["preemptions"] > 0, out["preemptions"]
    for prompt, ours, theirs in zip(PROMPTS, out["batch"], ref):
        assert ours == theirs, f"prompt {prompt!r}: vLLM {ours} != reference {theirs}"
    for ours, theirs in zip(out["batch_logprobs"], ref_logprobs):
        assert ours == pytest.approx(theirs, abs=2e-4)


def test_parallel_sampling_draws_samples_of_the_model(features, reference, name):
    """``n = 4`` seeded samples a prompt, top-k 5: each token one of the model's five likeliest
    in its context, with the model's log-probability; the samples differ, and the same seed
    draws the same samples again."""
    out, model = features[name].result()["sampling"][0], reference(name)
    for prompt, samples, logprobs in zip(FEATURE_PROMPTS, out["ids"], out["logprobs"]):
        assert len(samples) == SAMPLING["n"] and len({tuple(s) for s in samples}) > 1, samples
        prompt_ids = model.ids(prompt)
        for sample, sample_logprobs in zip(samples, logprobs):
            assert len(sample) == SAMPLING["max_tokens"]
            theirs = model.logprobs(prompt_ids + sample)[len(prompt_ids) - 1:-1]
            for step, (token, ours) in enumerate(zip(sample, sample_logprobs)):
                assert token in theirs[step].topk(SAMPLING["top_k"]).indices.tolist(), (prompt, sample, step)
                assert ours == pytest.approx(theirs[step, token].item(), abs=2e-4)
    assert out["again"] == out["ids"]


def test_parallel_sampling_from_the_top_token_is_greedy(features, greedy, name):
    """``n = 3`` samples from the top token each give the greedy tokens (vLLM refuses ``n > 1``
    at temperature 0: "n must be 1 when using greedy sampling")."""
    out, (ref, _) = features[name].result()["sampling"][1], greedy[name]
    for prompt, samples in zip(FEATURE_PROMPTS, out["ids"]):
        assert samples == [ref[PROMPTS.index(prompt)][:SAMPLING_TOP_1["max_tokens"]]] * SAMPLING_TOP_1["n"], prompt


def test_beam_search_is_the_models(features, reference, name):
    """``LLM.beam_search`` (width 3, 5 tokens) against the same search over the model's
    log-probabilities (conftest.beam_search)."""
    out, model = features[name].result()["beam_search"], reference(name)
    for prompt, beams in zip(FEATURE_PROMPTS, out):
        prompt_ids = model.ids(prompt)
        kept = beam_search(model.logprobs, prompt_ids, BEAM_WIDTH, BEAM_TOKENS)
        assert [b["tokens"] for b in beams] == [prompt_ids + tokens for tokens, _ in kept], prompt
        assert [b["cum_logprob"] for b in beams] == pytest.approx([score for _, score in kept], abs=2e-4 * BEAM_TOKENS)


def test_prompt_logprobs_are_the_models(features, reference, name):
    """vLLM's log-probability of every prompt token after the tokens before it (none for the
    first), against the model's forward on the prompt."""
    out, model = features[name].result()["prompt_logprobs"], reference(name)
    for prompt, ours in zip(PROMPTS, out):
        ids = model.ids(prompt)
        assert len(ours) == len(ids) and ours[0] is None
        theirs = model.logprobs(ids)[torch.arange(len(ids) - 1), torch.tensor(ids[1:], dtype=torch.long)]
        assert ours[1:] == pytest.approx(theirs.tolist(), abs=2e-4), prompt


def test_structured_outputs_hold_to_the_constraint(features, name):
    """Guided decoding (vLLM's default backend, xgrammar) by a regular expression and by a
    choice: the text is what the constraint allows. The test models' tokenizer (an export's) has
    no end-of-sequence token, so nothing the grammar allows can end the request once the
    constraint is met: xgrammar's mask then leaves no token, vLLM samples token 0 (byte 0) and
    ends the request as ``error``. A terminator in the constraint and a stop string at it end
    the request there, ``stop``, the text the constraint's alone."""
    regex, choice, regex_stop, choice_stop = features[name].result()["structured"][:4]
    for out in regex + choice:
        assert out["ids"][-1] == 0 and out["finish_reason"] == "error", out
    assert all(re.fullmatch(STRUCTURED_REGEX, out["text"][:-1]) for out in regex), regex
    assert all(out["text"][:-1] in STRUCTURED_CHOICES for out in choice), choice
    for out in regex_stop + choice_stop:
        assert out["finish_reason"] == "stop" and out["ids"][-1] == ord(STRUCTURED_STOP), out
    assert all(re.fullmatch(STRUCTURED_REGEX, out["text"]) for out in regex_stop), regex_stop
    assert all(out["text"] in STRUCTURED_CHOICES for out in choice_stop), choice_stop


def test_a_json_schema_as_docs_grammar_ends_at_its_terminator(features, name):
    """A JSON schema has no place for a terminator, and its grammar allows whitespace once the
    object is complete; written as docs/serving.md says - xgrammar's grammar of the schema, then
    the terminator - each request ends at the stop string, ``stop``, with a JSON object of the
    schema."""
    for out in features[name].result()["structured"][4]:
        assert out["finish_reason"] == "stop" and out["ids"][-1] == ord(STRUCTURED_STOP), out
        value = json.loads(out["text"])
        assert set(value) == {"a", "b"} and isinstance(value["a"], bool) and value["b"] in ({"c": "x"}, {"c": "y"}), out


def test_embeddings_are_the_final_hidden_state(features, reference, name):
    """vLLM's pooling runner (``runner="pooling"``, ``LLM.embed``) wraps the served class in its
    embedding adapter: the embedding of a prompt is the final norm's output at its last token,
    normalised - the model's ``last_hidden_state`` (transformers' base model of the directory)."""
    out, model = features[f"{name}-embed"].result()["embeddings"], reference(name)
    for prompt, ours in zip(FEATURE_PROMPTS, out):
        theirs = torch.nn.functional.normalize(model.last_hidden_state(model.ids(prompt))[-1], dim=-1)
        assert ours == pytest.approx(theirs.tolist(), abs=2e-5), prompt


def constrained_greedy(model: Reference, prompt: str, banned, stop_ids=(), bias=None, penalize=None) -> list[int]:
    """Greedy decoding of ``model`` with the logits changed as vLLM's sampler changes them:
    ``penalize(logits, prompt_ids, generated)`` applied, ``bias`` (token -> value) added, the
    tokens ``banned(generated)`` names set to -inf; ends after a token of ``stop_ids`` (kept) or
    :data:`OPTIONS_MAX_TOKENS` tokens."""
    ids, generated = model.ids(prompt), []
    while len(generated) < OPTIONS_MAX_TOKENS:
        with torch.inference_mode():
            logits = model.model(torch.tensor([ids + generated])).logits[0, -1].float()
            if penalize is not None:
                logits = penalize(logits, ids, generated)
            for token, value in (bias or {}).items():
                logits[token] += value
            logits[list(banned(generated))] = float("-inf")
            generated.append(int(logits.argmax()))
        if generated[-1] in stop_ids:
            break
    return generated


def bad_word_bans(model: Reference, words: list[str]):
    """vLLM's ``bad_words``: a word's last token is banned where the tokens generated so far
    end with the rest of it (each word as the tokenizer encodes it; with a space in front
    vLLM adds the form only where it encodes to as many tokens, never for the byte tokenizer)."""
    encoded = [model.tok(word, add_special_tokens=False)["input_ids"] for word in words]
    return lambda generated: {w[-1] for w in encoded if len(w) == 1 or generated[len(generated) - len(w) + 1:] == w[:-1]}


def test_sampling_options_change_the_logits_as_they_say(features, reference, greedy, name):
    """``logit_bias``, ``allowed_token_ids``, ``bad_words`` and ``min_tokens`` (with stop
    tokens) at temperature 0: the tokens of greedy decoding over the model's logits changed as
    each option says (:func:`constrained_greedy`), each option changing some of the greedy tokens;
    ``min_tokens`` keeps the stop tokens out of the first tokens, then ends a request at one."""
    out, model, (ref, _) = features[name].result()["options"], reference(name), greedy[name]
    stop_ids, minimum = OPTIONS["min_tokens"]["stop_token_ids"], OPTIONS["min_tokens"]["min_tokens"]
    not_allowed = set(range(len(model.tok))) - set(OPTIONS["allowed_token_ids"]["allowed_token_ids"])
    expected = {
        "logit_bias": lambda p: constrained_greedy(model, p, lambda generated: (),
                                                   bias=OPTIONS["logit_bias"]["logit_bias"]),
        "allowed_token_ids": lambda p: constrained_greedy(model, p, lambda generated: not_allowed),
        "bad_words": lambda p: constrained_greedy(model, p, bad_word_bans(model, OPTIONS["bad_words"]["bad_words"])),
        "min_tokens": lambda p: constrained_greedy(model, p, lambda generated: stop_ids if len(generated) < minimum
                                                   else (), stop_ids=stop_ids),
    }
    for option, expect in expected.items():
        ours = [o["ids"] for o in out[option]]
        assert ours == [expect(p) for p in FEATURE_PROMPTS], option
        unchanged = [ref[PROMPTS.index(p)][:len(o)] for p, o in zip(FEATURE_PROMPTS, ours)]
        assert ours != unchanged, f"{option} changed no greedy token: the test shows nothing"
    finished = [(o["finish_reason"], o["stop_reason"], o["ids"]) for o in out["min_tokens"]]
    assert any(reason == "stop" and ids[-1] == stop for reason, stop, ids in finished), finished
    assert all(len(ids) >= minimum for _, _, ids in finished)
    first = [ref[PROMPTS.index(p)][:minimum] for p in FEATURE_PROMPTS]
    assert any(t in stop_ids for tokens in first for t in tokens), "no stop token held back: the test shows nothing"


def penalty(presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0):
    """vLLM's penalties (OpenAI's and CTRL's): ``repetition`` divides the positive logits and
    multiplies the negative ones of every token in the prompt or generated so far; then each
    generated token's logit loses ``frequency`` times its count and ``presence`` once."""
    def penalize(logits: torch.Tensor, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[prompt_ids + generated] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=len(logits)).float()
        return logits - frequency * counts - presence * (counts > 0).float()
    return penalize


def test_penalties_change_the_logits_as_they_say(features, reference, greedy, name):
    """``presence_penalty``, ``frequency_penalty`` and ``repetition_penalty`` at temperature 0:
    the tokens of greedy decoding over the model's logits penalised as vLLM says
    (:func:`penalty`), each penalty changing some of the greedy tokens."""
    out, model, (ref, _) = features[name].result()["options"], reference(name), greedy[name]
    for option, field in (("presence_penalty", "presence"), ("frequency_penalty", "frequency"),
                          ("repetition_penalty", "repetition")):
        penalize = penalty(**{field: OPTIONS[option][option]})
        ours = [o["ids"] for o in out[option]]
        assert ours == [constrained_greedy(model, p, lambda generated: (), penalize=penalize)
                        for p in FEATURE_PROMPTS], option
        unchanged = [ref[PROMPTS.index(p)][:len(o)] for p, o in zip(FEATURE_PROMPTS, ours)]
        assert ours != unchanged, f"{option} changed no greedy token: the test shows nothing"


def test_top_logprobs_are_the_models(features, reference, greedy, name):
    """``logprobs=5`` at temperature 0: the greedy tokens, and at each step the model's five
    likeliest tokens with their log-probabilities (within 2e-4; float32)."""
    out, model, (ref, _) = features[name].result()["options"]["top_logprobs"], reference(name), greedy[name]
    for prompt, ours in zip(FEATURE_PROMPTS, out):
        assert ours["ids"] == ref[PROMPTS.index(prompt)][:OPTIONS_MAX_TOKENS]
        prompt_ids = model.ids(prompt)
        theirs = model.logprobs(prompt_ids + ours["ids"])[len(prompt_ids) - 1:-1].topk(OPTIONS["top_logprobs"]["logprobs"])
        for step, values, tokens in zip(ours["top"], theirs.values, theirs.indices, strict=True):
            assert sorted(map(int, step)) == sorted(tokens.tolist()), prompt
            assert [step[str(t)] for t in tokens.tolist()] == pytest.approx(values.tolist(), abs=2e-4), prompt


def test_chat_is_the_models_greedy_tokens_on_the_rendered_chat(features, reference, model_dirs, name):
    """``LLM.chat`` renders each conversation with the directory's chat template (an export's
    plain-text one; the test tokenizer's for the upcycled model) - the prompt tokens
    transformers' ``apply_chat_template`` gives - and continues it with the model's greedy tokens."""
    out, model = features[name].result()["chat"], reference(name)
    rendered = [model.tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in CHATS]
    assert [o["prompt_ids"] for o in out] == [model.ids(text) for text in rendered]
    assert [o["ids"] for o in out] == _generate(model_dirs[name], rendered, OPTIONS_MAX_TOKENS)[0]


def test_prompt_embeds_give_the_greedy_tokens(features, greedy, name):
    """``enable_prompt_embeds``: the model's own embedding of each prompt's ids handed to
    ``LLM.generate`` as ``{"prompt_embeds": ...}`` (the served model's forward takes
    ``inputs_embeds`` and starts the residual stream from them) gives the greedy tokens of the
    ids and their log-probabilities (within 2e-4)."""
    out, (ref, ref_logprobs) = features[f"{name}-prompt-embeds"].result()["prompt_embeds"], greedy[name]
    assert out["ids"] == ref
    for ours, theirs in zip(out["logprobs"], ref_logprobs):
        assert ours == pytest.approx(theirs, abs=2e-4)
