"""A saved ``config.json`` that lacks the AttnRes residual settings, or whose ``model_type``
and ``architectures`` name different models, is refused by transformers' loaders (the Auto
classes and the AttnRes classes' ``from_pretrained``) with a message naming the file and the
field, instead of loading another model with the default residual. (vLLM reads configs
through the same classes: tests/serve/test_load_errors.py.)"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from attnres import AttnResLM, ModelConfig  # noqa: E402
from attnres.hf import AttnResForCausalLM  # noqa: E402
from fixtures.tiny_families import tiny_model  # noqa: E402
from attnres.models.saved_config import IncompleteConfig  # noqa: E402
from attnres.upcycle import upcycle  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An exported native model and an upcycled Llama (Block AttnRes, S = 2), saved."""
    root = tmp_path_factory.mktemp("saved")
    native = AttnResLM(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2,
                                   residual={"kind": "attnres_block", "block_size": 2}))
    AttnResForCausalLM.from_native(native).save_pretrained(root / "native")
    upcycle(tiny_model("llama"), "attnres_block", block_size=2).save_pretrained(root / "upcycled")
    return root


def edited(saved, source: str, name: str, change) -> str:
    """A copy of ``saved/source`` whose config.json ``change`` edited."""
    target = saved / name
    if not target.exists():
        shutil.copytree(saved / source, target)
        config = json.loads((target / "config.json").read_text())
        change(config)
        (target / "config.json").write_text(json.dumps(config))
    return str(target)


def upcycled_class():
    from attnres.hf.families import upcycled_classes

    return upcycled_classes("llama")[1]


#: name -> (source directory, the edit, the class whose from_pretrained loads it, what the
#: messages of the Auto classes and of that class say).
BAD = {
    "native without residual": ("native", lambda c: c.pop("residual"), lambda: AttnResForCausalLM,
                                ["has no field 'residual' (the AttnRes residual settings"] * 2),
    "upcycled without attnres_residual": ("upcycled", lambda c: c.pop("attnres_residual"), upcycled_class,
                                          ["has no field 'attnres_residual' (the AttnRes residual settings"] * 2),
    "upcycled without attnres_exact_eps": ("upcycled", lambda c: c.pop("attnres_exact_eps"), upcycled_class,
                                           ["has no field 'attnres_exact_eps'"] * 2),
    # The Auto classes read it with AttnResConfig, whose architecture it is not; the class refuses the model_type.
    "upcycled as model_type attnres": ("upcycled", lambda c: c.update(model_type="attnres"), upcycled_class,
                                       ["architectures ['AttnResLlamaForCausalLM'] do not match model_type 'attnres'",
                                        "model_type 'attnres' is not 'attnres_llama'"]),
    "native with a Llama architecture": ("native", lambda c: c.update(architectures=["LlamaForCausalLM"]),
                                         lambda: AttnResForCausalLM,
                                         ["architectures ['LlamaForCausalLM'] do not match model_type 'attnres'"] * 2),
}


@pytest.mark.parametrize("name", list(BAD))
def test_incomplete_or_mismatched_config_is_refused_naming_file_and_field(saved, name):
    source, change, cls, (auto_says, class_says) = BAD[name]
    directory = edited(saved, source, name.replace(" ", "_"), change)
    for loader, says in ((AutoConfig.from_pretrained, auto_says), (AutoModelForCausalLM.from_pretrained, auto_says),
                         (cls().from_pretrained, class_says)):
        with pytest.raises(IncompleteConfig) as refused:
            loader(directory)
        assert f"{directory}/config.json" in str(refused.value) and says in str(refused.value), str(refused.value)


#: name -> (source directory, a hand edit that breaks a field, what the field's check says).
BROKEN_FIELD = {
    "native heads": ("native", lambda c: c.update(n_heads=3), "ModelConfig.d_model must be divisible by n_heads=3"),
    "native residual kind": ("native", lambda c: c["residual"].update(kind="attnres_blok"),
                             "ModelConfig.residual.kind must be one of"),
    "upcycled block size": ("upcycled", lambda c: c["attnres_residual"].update(block_size=0),
                            "block_size must be an integer >= 1"),
}


@pytest.mark.parametrize("name", list(BROKEN_FIELD))
def test_a_field_broken_by_hand_is_refused_naming_the_file(saved, name):
    """The field's check named the field but not the file: `vllm serve DIR` showed it inside a
    validation error of vLLM's own ModelConfig. Now the message starts with the file."""
    source, change, says = BROKEN_FIELD[name]
    directory = edited(saved, source, name.replace(" ", "_"), change)
    for loader in (AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ValueError) as refused:
            loader(directory)
        assert str(refused.value).startswith(f"{directory}/config.json: ") and says in str(refused.value), \
            str(refused.value)


def test_attnres_class_refuses_a_family_model_type(saved):
    """``"llama"`` over an AttnRes Llama: the AttnRes class refuses it. (transformers' Auto
    classes pick plain Llama by the model_type, and report the residual's tensors as
    unexpected keys: that path never reaches attnres.)"""
    directory = edited(saved, "upcycled", "llama_model_type", lambda c: c.update(model_type="llama"))
    with pytest.raises(IncompleteConfig, match="config.json: model_type 'llama' is not 'attnres_llama'"):
        upcycled_class().from_pretrained(directory)


def _deprecations(build):
    """``build()`` and the messages of the ``DeprecationWarning``s it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = build()
    return value, [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


def test_complete_configs_still_load(saved):
    """The saved directories themselves load (and with flat residual keys of earlier versions,
    which count as residual settings). Those keys, an earlier export's, are read without a
    DeprecationWarning (the user never wrote them: every command that read the directory
    warned of them); the same key given by the user to from_pretrained still warns."""
    assert type(AutoModelForCausalLM.from_pretrained(saved / "native")).__name__ == "AttnResForCausalLM"
    assert type(AutoModelForCausalLM.from_pretrained(saved / "upcycled")).__name__ == "AttnResLlamaForCausalLM"

    def flat(config):
        residual = config.pop("residual")
        config["attnres_block_size"], config["attnres_impl"] = residual["block_size"], residual["schedule"]

    directory = edited(saved, "native", "legacy_keys", flat)
    config, said = _deprecations(lambda: AutoConfig.from_pretrained(directory))
    assert said == [] and config.residual["block_size"] == 2
    assert config.to_model_config() == AutoConfig.from_pretrained(saved / "native").to_model_config()
    given, said = _deprecations(lambda: AutoConfig.from_pretrained(directory, attnres_block_size=1))
    assert said == ["AttnResConfig.attnres_block_size is deprecated: use AttnResConfig.residual.block_size"]
    assert given.residual["block_size"] == 1  # (the key the user just wrote wins)


def test_an_upcycled_directory_of_an_earlier_version_loads_without_warning_of_its_keys(saved):
    """An upcycled directory an earlier version saved stores its residual's op as
    ``attnres_residual.impl`` / ``kernels``: read without a DeprecationWarning, as today's
    ``schedule`` / ``backend``."""
    def old_spellings(config):
        residual = config["attnres_residual"]
        residual["impl"], residual["kernels"] = residual.pop("schedule"), "torch_graph"
        residual.pop("backend")

    directory = edited(saved, "upcycled", "legacy_residual_keys", old_spellings)
    config, said = _deprecations(lambda: AutoConfig.from_pretrained(directory))
    assert said == []
    today = AutoConfig.from_pretrained(saved / "upcycled").attnres_residual
    assert config.attnres_residual == {**today, "backend": "reference"}


def test_a_training_run_or_checkpoint_given_to_from_pretrained_says_to_export_it(tmp_path):
    """A run directory's config.json is the training config: the AttnRes classes said only
    that the field 'residual' was missing, and told to restore it."""
    from attnres.checkpoint import CheckpointError

    run = tmp_path / "run"
    step = run / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": {"d_model": 32}, "steps": 2}))
    (step / "state.json").write_text("{}")
    for path, found in ((run, "a training run's directory (it holds checkpoints/)"),
                        (step, "a training checkpoint (it holds state.json)")):
        for cls in (AttnResForCausalLM, upcycled_class()):
            with pytest.raises(CheckpointError) as refused:
                cls.from_pretrained(path)
            assert str(refused.value) == (
                f"'{path}' is {found}, not a Hugging Face directory: write one with `attnres export {path} --out DIR` "
                f"and load DIR (attnres.inference.load_run('{path}') loads the run's own model as it is)")
