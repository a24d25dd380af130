"""What vLLM refuses at load time, with a message naming the file, the field or the limit (not
a crash inside the residual, a bare shape assertion in a weight loader, or a model that loads
as another one). All are tried in one process, one engine after the other (conftest.try_to_load)."""

from __future__ import annotations

import pytest
from models import UNSERVED_MOE


def refused(load_failures, name: str) -> str:
    loaded, log = load_failures.result()[name]
    assert not loaded, f"{name} loaded"
    return log


def test_config_that_does_not_match_the_weights(load_failures):
    log = refused(load_failures, "mismatch")
    assert "model.safetensors holds tensor 'layers.2." in log, log[-3000:]
    assert "config.json" in log and "the config does not match the weights" in log


def test_head_size_the_cpu_attention_does_not_take(load_failures):
    log = refused(load_failures, "head_size")
    assert "config.json: head size 16" in log and "not supported by vLLM's CPU_ATTN attention backend" in log, log[-3000:]
    assert "[32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]" in log
    from attnres.cli.export import VLLM_CPU_HEAD_SIZES  # what `attnres export` warns about: vLLM's own list

    assert str(list(VLLM_CPU_HEAD_SIZES)) in log


def test_a_family_the_plugin_does_not_serve(load_failures):
    log = refused(load_failures, "moe")
    assert f"(the upcycled {UNSERVED_MOE!r} family) is not served on vLLM: vLLM 0.32 has no class of" in log, log[-3000:]


def test_a_tokenizer_that_would_drop_line_breaks(load_failures):
    """An export of earlier versions (the line break its padding token, so special): refused,
    saying how to export again or fix the directory."""
    log = refused(load_failures, "old_tokenizer")
    assert "old_tokenizer/tokenizer.json declares the ordinary token 'Ċ' (id 10, the text '\\n') a special token" \
        in log, log[-3000:]
    assert "attnres export --checkpoint RUN --out DIR" in log


@pytest.mark.parametrize("name, field", [("no_residual", "residual"), ("upcycled_no_residual", "attnres_residual")])
def test_a_config_without_its_residual_settings(load_failures, name, field):
    log = refused(load_failures, name)
    assert f"{name}/config.json has no field {field!r} (the AttnRes residual settings" in log, log[-3000:]


def test_a_model_type_that_is_not_the_architectures(load_failures):
    log = refused(load_failures, "llama_model_type")
    assert "llama_model_type/config.json: model_type 'llama' does not match the architecture AttnResLlamaForCausalLM" \
        in log, log[-3000:]
    assert "'residual_config'" not in log  # not the crash inside the model


def test_a_quantized_checkpoint(load_failures):
    log = refused(load_failures, "quantized")
    assert "quantized/config.json: quantized AttnRes models are not served ('fp8', from its quantization_config)" \
        in log, log[-3000:]


def test_lora_on_an_export(load_failures):
    log = refused(load_failures, "lora_native")
    assert "config.json: LoRA adapters are not supported here: an attnres export (AttnResForCausalLM) does not " \
           "declare LoRA support" in log, log[-3000:]
