"""The vLLM interfaces the served classes declare, working: a LoRA adapter on the upcycled
Llama and on an export (each engine serves it beside the base model; the tokens are HF
``generate``'s / ``attnres generate``'s with the adapter merged into the weights), and EAGLE-3 speculative decoding with a random drafter, whose
auxiliary hidden states are the AttnRes depth mixtures each decoder layer reads (not a
running residual sum), and under which the greedy tokens stay the model's. What the served
classes refuse instead (quantization, LoRA on a mixture of experts, ...) is in test_load_errors.py."""

from __future__ import annotations

import pytest
import torch
from conftest import EAGLE3_PROMPT, LORA_MODEL, LORA_MODELS


@pytest.mark.parametrize("name", LORA_MODELS)
def test_lora_adapter_gives_the_merged_models_tokens(served, lora_adapter, name):
    _, reference = lora_adapter[name]
    model = served[name]
    out = model.result()
    assert out["lora"] == reference
    assert out["lora"] != model.ref  # the adapter changes the tokens ...
    assert out["batch"] == model.ref  # ... of its requests only


def test_eagle3_keeps_the_models_greedy_tokens(served, speculation):
    out = speculation["eagle3"].result()
    model = served[LORA_MODEL]
    assert out["batch"] == model.ref
    assert out["prefix"] == model.ref_prefix
    assert out["spec_decode"]["num_drafts"] > 0 and out["spec_decode"]["num_draft_tokens"] > 0, out["spec_decode"]


def test_eagle3_drafter_reads_the_depth_mixtures(speculation, model_dirs):
    """vLLM's default layers for three decoder layers (0, 1, 2): what each reads - the input of
    its attention's pre-norm in the HF model - over the prompt's prefill."""
    import attnres.hf  # noqa: F401
    from transformers import AutoModelForCausalLM

    captured = speculation["eagle3"].result()["aux"]
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[LORA_MODEL], dtype=torch.float32).eval()
    inputs, outputs = {}, []

    def record_input(i):
        def hook(module, args):
            inputs.setdefault(i, args[0][0])  # (returning it would replace the input)
        return hook

    for i, layer in enumerate(hf.model.layers):
        layer.input_layernorm.register_forward_pre_hook(record_input(i))
        layer.self_attn.register_forward_hook(lambda module, args, out: outputs.append(out[0][0]))
        layer.mlp.register_forward_hook(lambda module, args, out: outputs.append(out[0]))
    with torch.inference_mode():
        hf(torch.tensor([list(EAGLE3_PROMPT.encode())]))
    assert captured is not None and len(captured) == len(hf.model.layers) == 3
    for i, ours in enumerate(captured):
        torch.testing.assert_close(torch.tensor(ours), inputs[i], atol=1e-4, rtol=1e-4)
        # What vLLM's Llama would hand the drafter: the running sum of the embedding and the
        # sublayer outputs so far - another tensor from layer 1 on.
        running_sum = inputs[0] + sum(outputs[: 2 * i], torch.zeros_like(inputs[0]))
        assert i == 0 or not torch.allclose(torch.tensor(ours), running_sum, atol=1e-2)


def test_eagle3_refusal_of_an_export_names_the_families_that_run_it():
    """An export refuses EAGLE-3 and points at the upcycled families that run it: exactly those
    whose served class does not refuse it (no engine: the classes only)."""
    import re

    from attnres.serve import SERVED_FAMILIES
    from attnres.serve.native import REFUSED
    from attnres.serve.upcycled import served_class

    listed = REFUSED["eagle3"].split("the upcycled ", 1)[1].removesuffix(" do")
    named = {name.replace("-", "").lower() for name in re.split(r", | and ", listed)}
    running = {cls.vllm_class.__name__.removesuffix("ForCausalLM").lower()
               for cls in map(served_class, SERVED_FAMILIES) if "eagle3" not in cls.refused}
    assert named == running, REFUSED["eagle3"]
