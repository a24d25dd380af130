"""The vLLM plugin's parts that need no vLLM (the serving tests themselves are in
tests/serve, run by ``make test-serve``): importing it imports no vLLM, it covers every
architecture attnres writes, and it checks a checkpoint against its config."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch
from safetensors import safe_open

from attnres import AttnResLM, ModelConfig
from attnres.models.families import upcycled_classes
from attnres.serve import NATIVE_ARCHITECTURE, SERVED_FAMILIES, architectures, register, unserved_families
from attnres.serve.checkpoint import CheckpointMismatch, checked_weights, expected_shapes


def test_importing_the_plugin_imports_no_vllm():
    code = "import sys, attnres, attnres.serve, attnres.serve.families, attnres.serve.checkpoint, attnres.serve.refused; " \
           "print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_entry_point_is_the_register_function():
    plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert plugins["attnres"].value == "attnres.serve:register"
    assert plugins["attnres"].load() is register


def test_every_upcycled_family_is_served_or_refused_with_a_reason():
    """The dense families are served; the mixtures of experts are refused, each with a reason."""
    from attnres.upcycle import FAMILIES

    unserved = unserved_families()
    assert set(SERVED_FAMILIES) | set(unserved) == set(FAMILIES) and not set(SERVED_FAMILIES) & set(unserved)
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "olmoe", "gpt_oss"} <= set(unserved)
    assert all(FAMILIES[name].router is not None and reason for name, reason in unserved.items())


def test_an_unserved_family_is_refused_when_vllm_looks_its_class_up():
    """vLLM resolves a registered ``"module:Class"`` by importing the module and getting the
    class: for a mixture of experts that raises, naming the architecture and the family."""
    import importlib

    from attnres.serve.refused import UnservedFamily

    registry = FakeRegistry()
    register(registry)
    for model_type in ("qwen3_moe", "deepseek_v3"):
        name = upcycled_classes(model_type)[1].__name__
        module, _, cls = registry.models[name].partition(":")
        assert module == "attnres.serve.refused"
        with pytest.raises(UnservedFamily, match=rf"{name} \(the upcycled '{model_type}' family, a mixture of experts\) "
                                                 r"is not served on vLLM yet: vLLM runs a mixture of experts"):
            getattr(importlib.import_module(module), cls)
    with pytest.raises(AttributeError):  # a dense family's name is not this module's
        getattr(importlib.import_module("attnres.serve.refused"), upcycled_classes("llama")[1].__name__)


class FakeRegistry:
    def __init__(self) -> None:
        self.models: dict[str, str] = {}

    def register_model(self, name: str, target: str) -> None:
        self.models[name] = target


def test_register_names_what_export_and_upcycle_write(tmp_path):
    """The registered names are the ``architectures`` that the saved directories carry."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from attnres.hf import AttnResForCausalLM
    from attnres.upcycle import upcycle

    registry = FakeRegistry()
    register(registry)
    assert registry.models == architectures()
    assert registry.models[NATIVE_ARCHITECTURE] == "attnres.serve.native:AttnResForCausalLM"
    native = AttnResForCausalLM.from_native(AttnResLM(ModelConfig.preset("tiny")))
    native.save_pretrained(tmp_path / "native")
    written = [json.loads((tmp_path / "native" / "config.json").read_text())["architectures"][0]]
    for model_type in ("llama", "gemma3_text"):
        config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        upcycle(AutoModelForCausalLM.from_config(config), "attnres_block").save_pretrained(tmp_path / model_type)
        written.append(json.loads((tmp_path / model_type / "config.json").read_text())["architectures"][0])
    assert written == ["AttnResForCausalLM", "AttnResLlamaForCausalLM", "AttnResGemma3ForCausalLM"]
    for name in written:
        module, _, cls = registry.models[name].partition(":")
        assert module.startswith("attnres.serve.") and cls == name


def _export(directory, **fields) -> ModelConfig:
    from attnres.hf import AttnResForCausalLM

    config = ModelConfig.preset("tiny", **fields)
    AttnResForCausalLM.from_native(AttnResLM(config)).save_pretrained(directory)
    return config


def _tensors(directory):
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return [(name, f.get_tensor(name)) for name in f.keys()]


def test_checked_weights_pass_a_matching_checkpoint(tmp_path):
    config = _export(tmp_path)
    weights = _tensors(tmp_path)
    assert list(checked_weights(weights, expected_shapes(lambda: AttnResLM(config)), tmp_path)) == weights


@pytest.mark.parametrize("change, message", [
    ({"n_layers": 1}, r"model\.safetensors holds tensor 'layers\.1\.[a-z_.]+' \[.*\], which the model described by "
                      r".*config\.json has no place for: the config does not match the weights"),
    ({"n_layers": 3}, r"the checkpoint in .* lacks \d+ tensor\(s\) that the model described by .*config\.json needs: "
                      r"'layers\.2\..*the config does not match the weights"),
    ({"mlp_hidden": 64}, r"model\.safetensors: tensor 'layers\.0\.mlp\.(gate|up|down)_proj\.weight' has shape "
                         r"\[\d+, \d+\], but .*config\.json describes \[\d+, \d+\]"),
])
def test_checked_weights_name_the_file_when_the_config_does_not_match(tmp_path, change, message):
    """The checkpoint of the tiny preset (2 layers) under a config that says otherwise."""
    _export(tmp_path)
    wrong = ModelConfig.preset("tiny", **change)
    with pytest.raises(CheckpointMismatch, match=message):
        list(checked_weights(_tensors(tmp_path), expected_shapes(lambda: AttnResLM(wrong)), tmp_path))


def test_checked_weights_accept_missing_optional_tensors(tmp_path):
    """A tied head and the residual's tensors may be missing (they take the embedding and the
    faithful init); anything else may not."""
    config = _export(tmp_path)
    expected = expected_shapes(lambda: AttnResLM(config))
    kept = [(n, t) for n, t in _tensors(tmp_path) if not n.startswith("residual.")]
    optional = [n for n in expected if n.startswith("residual.")]
    assert optional and len(list(checked_weights(kept, expected, tmp_path, optional))) == len(kept)
    with pytest.raises(CheckpointMismatch, match="lacks"):
        list(checked_weights(kept, expected, tmp_path))


def test_expected_shapes_are_the_checkpoint_names_built_on_the_meta_device():
    shapes = expected_shapes(lambda: AttnResLM(ModelConfig.preset("bench-infer")))
    assert shapes["embed_tokens.weight"] == (8192, 1024)
    assert shapes["residual.mixers.0.query"] == (1024,) and shapes["layers.15.attn.q_proj.weight"] == (1024, 1024)
    assert torch.get_default_device().type == "cpu"  # the meta device was only a context
