"""What vLLM refuses at load time, with a message naming the file or the limit (not a crash
inside the residual or a bare shape assertion in a weight loader)."""

from __future__ import annotations


def test_config_that_does_not_match_the_weights(load_failures):
    code, log = load_failures["mismatch"].result()
    assert code != 0
    assert "model.safetensors holds tensor 'layers.2." in log, log[-3000:]
    assert "config.json" in log and "the config does not match the weights" in log


def test_head_size_the_cpu_attention_does_not_take(load_failures):
    code, log = load_failures["head_size"].result()
    assert code != 0
    assert "config.json: head size 16" in log and "not supported by vLLM's CPU_ATTN attention backend" in log, log[-3000:]
    assert "[32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]" in log


def test_a_mixture_of_experts_the_plugin_does_not_serve_yet(load_failures):
    code, log = load_failures["moe"].result()
    assert code != 0
    assert "AttnResQwen3MoeForCausalLM (the upcycled 'qwen3_moe' family, a mixture of experts) is not served on vLLM " \
           "yet" in log, log[-3000:]
