"""Upcycling mixture-of-experts decoders: per family x {Full, Block S = 2, Block S = 4 (ragged:
L = 6)}, the same function at conversion (logits and every MoE layer's router logits, also
with small hidden states where the epsilon adjustment matters), greedy generation with and
without the cache, bit-identical save/load, gradients into the pseudo-queries and the experts
that received tokens, the family's auxiliary loss, training through ``attnres train`` and the
expert-load analysis."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402

from attnres.upcycle import FAMILIES, REFUSED, layout_of, upcycle  # noqa: E402
from attnres.hf.families.moe import RouterRecorder, moe_routers  # noqa: E402
from fixtures.tiny_families import VOCAB, tiny_model  # noqa: E402

from conftest import rel_err  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MOE = [name for name, layout in FAMILIES.items() if layout.router is not None]
AUX = [name for name in MOE if FAMILIES[name].router.aux_loss_coef]
RESIDUALS = [
    pytest.param(("attnres_full", None), id="full"),
    pytest.param(("attnres_block", 2), id="block-S2"),  # S divides L = 6
    pytest.param(("attnres_block", 4), id="block-S4"),  # ragged: blocks of 4 and 2 sublayers
]
TOL = {torch.float32: 1e-5, torch.float64: 1e-6}


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest entry of ``b``."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def ids(batch: int = 2, length: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def small_hidden(model):
    """``model`` with its embedding shrunk by 1e-3: ``mean(h^2)`` far below the norms' epsilon."""
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1e-3)
    return model


@pytest.mark.parametrize("residual", RESIDUALS)
@pytest.mark.parametrize("model_type", MOE)
def test_logits_and_router_logits_are_the_original(model_type, residual):
    kind, S = residual
    x = ids()
    for dtype, tol in TOL.items():
        for shrink in (False, True):
            base = tiny_model(model_type, dtype)
            if shrink:
                small_hidden(base)
            up = upcycle(base, kind, block_size=S).eval()
            with torch.no_grad():
                want, got = base(x, output_router_logits=True), up(x, output_router_logits=True)
            what = (dtype, "small hidden" if shrink else "")
            assert max_rel(got.logits, want.logits) <= tol, (what, max_rel(got.logits, want.logits))
            assert len(got.router_logits) == len(want.router_logits) == len(moe_routers(base)) > 0
            for layer, (g, w) in enumerate(zip(got.router_logits, want.router_logits)):
                assert max_rel(g, w) <= tol, (what, layer, max_rel(g, w))
            if shrink and dtype == torch.float32:  # and it is the epsilon adjustment that makes it exact
                with torch.no_grad():
                    plain = upcycle(base, kind, block_size=S, exact_eps=False)(x).logits
                assert max_rel(plain, want.logits) > 100 * tol


@pytest.mark.parametrize("residual", RESIDUALS)
@pytest.mark.parametrize("model_type", MOE)
def test_greedy_generation_with_and_without_cache_is_the_original(model_type, residual):
    kind, S = residual
    base = tiny_model(model_type)
    up = upcycle(base, kind, block_size=S).eval()
    prompt = ids(1, 5)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = base.generate(prompt, **kw)
    assert torch.equal(up.generate(prompt, **kw), want)
    assert torch.equal(up.generate(prompt, use_cache=False, **kw), want)


@pytest.mark.parametrize("residual", RESIDUALS)
@pytest.mark.parametrize("model_type", MOE)
def test_save_and_load_is_bit_identical(tmp_path, model_type, residual):
    kind, S = residual
    up = upcycle(tiny_model(model_type), kind, block_size=S).eval()
    with torch.no_grad():  # as after some training: queries away from zero
        for m in up.residual.mixers:
            m.query.normal_(std=0.3)
    up.save_pretrained(tmp_path / "up")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "up").eval()
    assert type(loaded) is type(up)
    x = ids()
    with torch.no_grad():
        a, b = loaded(x, output_router_logits=True), up(x, output_router_logits=True)
    assert torch.equal(a.logits, b.logits)
    assert all(torch.equal(p, q) for p, q in zip(a.router_logits, b.router_logits))


def _experts_of(model, layer: int):
    path = FAMILIES[model.config.model_type.removeprefix("attnres_")].router.path
    return model.model.layers[layer].get_submodule(path.rsplit(".", 1)[0] + ".experts")


@pytest.mark.parametrize("residual", RESIDUALS)
@pytest.mark.parametrize("model_type", MOE)
def test_gradients_reach_the_queries_and_exactly_the_experts_that_got_tokens(model_type, residual):
    """Every mixer with two or more sources gets a gradient (the first sublayer's has only
    the embedding). One token routes to top-k of the experts: those, and only those, get a
    gradient in every expert weight."""
    kind, S = residual
    up = upcycle(tiny_model(model_type), kind, block_size=S).train()
    x = ids()
    up(x, labels=x, **up.training_forward_kwargs()).loss.backward()
    counts = up.residual.sources_per_mixer()
    for i, m in enumerate(up.residual.mixers):
        assert (m.query.grad.abs().sum() > 0) == (counts[i] > 1), i
    up.zero_grad()
    token = ids(1, 1)
    with RouterRecorder(up) as rec:
        up(token, labels=token).logits.sum().backward()
    for layer, _ in rec.routers:
        chosen = set(rec.selected[layer][0].flatten().tolist())
        n_experts = rec.logits[layer][0].shape[-1]
        assert 0 < len(chosen) < n_experts
        for name, p in _experts_of(up, layer).named_parameters():
            got = {e for e in range(n_experts) if p.grad[e].abs().sum() > 0}
            assert got == chosen, (layer, name)


@pytest.mark.parametrize("residual", RESIDUALS)
@pytest.mark.parametrize("model_type", MOE)
def test_the_auxiliary_loss_is_the_original(model_type, residual):
    kind, S = residual
    base = tiny_model(model_type)
    up = upcycle(base, kind, block_size=S).train()
    base.train()
    x = ids()
    torch.manual_seed(0)
    want = base(x, labels=x, output_router_logits=True)
    torch.manual_seed(0)  # the same router jitter, where a family has one (PhiMoE's sparse mixer)
    got = up(x, labels=x, **up.training_forward_kwargs())
    if model_type in AUX:
        assert up.training_forward_kwargs() == {"use_cache": False, "output_router_logits": True}
        assert got.aux_loss is not None and abs(got.aux_loss.item() - want.aux_loss.item()) <= 1e-5 * want.aux_loss.item()
        assert abs(got.loss.item() - want.loss.item()) <= 1e-5 * want.loss.item()  # cross-entropy + coef * aux
    else:  # DeepSeek-style routers train without one in transformers
        assert up.training_forward_kwargs() == {"use_cache": False} and getattr(want, "aux_loss", None) is None


def test_router_outputs_follow_the_recorded_contract():
    """Every supported router returns ``(logits [N, E], weights [N, k], selected [N, k])``;
    the routers found are the MoE layers the family records logits for."""
    for model_type in MOE:
        base = tiny_model(model_type)
        x = ids()
        with RouterRecorder(base) as rec, torch.no_grad():
            out = base(x, output_router_logits=True)
        assert [layer for layer, _ in rec.routers] == sorted(rec.logits), model_type
        assert len(rec.routers) == len(out.router_logits), model_type
        for (layer, _), logged in zip(rec.routers, out.router_logits):
            logits, selected = rec.logits[layer][0], rec.selected[layer][0]
            assert torch.equal(logits, logged) and logits.shape[0] == x.numel(), model_type
            assert selected.shape[0] == x.numel() and selected.max() < logits.shape[-1], model_type


def test_a_router_returning_the_selected_experts_first_is_recorded_as_well():
    """GraniteMoE's router in transformers 5.20 (the newest on Python 3.10) returns
    ``(selected, weights, logits)``: the recorder takes the logits and the selected experts
    from where they are (was: the indices recorded as logits, the logits as the selection -
    the expert-load analysis of ``attnres analyze`` counted wrong experts)."""
    base = tiny_model("granitemoe")
    routers = moe_routers(base)
    for _, router in routers:  # that order, whichever the installed transformers returns
        router.forward = lambda h, f=router.forward: (lambda o: o[::-1] if o[0].is_floating_point() else o)(f(h))
    h = torch.randn(7, base.config.hidden_size)
    with RouterRecorder(base) as rec, torch.no_grad():
        outs = {layer: router(h) for layer, router in routers}
    for layer, (selected, _, logits) in outs.items():
        assert not selected.is_floating_point() and logits.shape == (7, base.config.num_local_experts)
        assert torch.equal(rec.logits[layer][0], logits) and torch.equal(rec.selected[layer][0], selected)


def test_an_upcycled_model_loads_with_the_experts_implementation_of_its_family(tmp_path, monkeypatch):
    """transformers lets a class set its experts implementation (``grouped_mm``, its default,
    or ``eager``) when the source of the class's module uses its experts decorator, a
    verdict cached on the class: an AttnRes model answers as its family's class (was: in a
    process that had not asked the family's class first - loading an upcycled directory -
    ``eager`` experts, and ``experts_implementation="grouped_mm"`` a ValueError)."""
    up = upcycle(tiny_model("qwen3_moe"), "attnres_block", block_size=2)
    up.save_pretrained(tmp_path)
    for cls in type(up).__mro__:  # as in a fresh process
        if "_can_set_experts_implementation_cached_value" in vars(cls):
            monkeypatch.delattr(cls, "_can_set_experts_implementation_cached_value")
    for asked in (None, "grouped_mm"):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation=asked)
        assert type(loaded) is type(up) and loaded.config._experts_implementation == "grouped_mm"


def _compiled_step_matches_eager(model_type: str, kind: str, S: int | None, backend: str = "inductor",
                                 **changes) -> None:
    # Compiled afresh, and past Dynamo's recompile limit an error: the limit was reached by the
    # ninth of the slow suite's families in one process, whose frames then ran eagerly, silently
    # (compared eager with eager, in 0.05 s).
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        _compiled_step(model_type, kind, S, backend, **changes)


def _compiled_step(model_type: str, kind: str, S: int | None, backend: str, **changes) -> None:
    """``changes``: config fields of the tiny model (:func:`tiny_model`)."""
    eager = upcycle(tiny_model(model_type, **changes), kind, block_size=S).train()
    compiled = upcycle(tiny_model(model_type, **changes), kind, block_size=S).train()
    x = ids()
    kwargs = eager.training_forward_kwargs()
    results = []
    for model, fn in ((eager, eager), (compiled, torch.compile(compiled, backend=backend))):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(0)
        loss = fn(x, labels=x, **kwargs).loss
        loss.backward()
        grads = torch.cat([m.query.grad.flatten() for m in model.residual.mixers])
        opt.step()
        results.append((loss.detach(), grads, [m.query.detach().clone() for m in model.residual.mixers]))
    (l0, g0, q0), (l1, g1, q1) = results
    assert rel_err(l1, l0) <= 1e-5 and rel_err(g1, g0) <= 1e-4
    counts = compiled.residual.sources_per_mixer()
    assert [bool(q.abs().sum() > 0) for q in q1] == [n > 1 for n in counts]  # the step moved the queries


@pytest.mark.compile
def test_one_optimizer_step_under_torch_compile():
    """GPT-OSS: a mixture of experts whose MLP returns a tuple, with its auxiliary loss,
    traced by Dynamo and AOTAutograd into forward and backward graphs (``aot_eager``: what
    the upcycled layout could break; inductor's code generation of those graphs - two
    minutes on two cores - is the slow suite's, for every family). Two decoder layers - one
    sliding-window and one full-attention, as GPT-OSS alternates them - not the fixture's three:
    each layer is traced anew (11.1 -> 7.3 CPU-s)."""
    _compiled_step_matches_eager("gpt_oss", "attnres_block", 2, backend="aot_eager", num_hidden_layers=2)


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("residual", RESIDUALS)
@pytest.mark.parametrize("model_type", MOE)
def test_one_optimizer_step_under_torch_compile_every_family(model_type, residual):
    _compiled_step_matches_eager(model_type, *residual)


def test_refused_mixture_of_experts_layouts_say_why():
    from transformers import AutoConfig

    reasons = {"flex_olmo": "router read the raw residual stream", "cohere2_moe": "in parallel",
               "minimax": "normalised stream", "longcat_flash": "shortcut"}
    for model_type, words in reasons.items():
        assert model_type in REFUSED
        with pytest.raises(ValueError, match=words):
            layout_of(model_type)
    flex = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "flex_olmo", vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, pad_token_id=None, eos_token_id=None))
    with pytest.raises(ValueError, match="cannot upcycle model_type 'flex_olmo'.*post-norm"):
        upcycle(flex)


def test_every_family_is_a_training_architecture():
    from attnres.models.config import HF_ARCHITECTURES

    assert set(HF_ARCHITECTURES) == set(FAMILIES)


@pytest.mark.parametrize("model_type", ["gpt_oss", "glm4_moe", "deepseek_v3"])
def test_a_saved_moe_directory_describes_the_training_model(tmp_path, model_type):
    """``model.from_hf=DIR``: the run's model is the directory's, scaled RoPE (GPT-OSS's YaRN),
    partial rotation (GLM-4.5) and latent attention (DeepSeek-V3) included, and
    ``init_from=DIR`` fills it with the same function."""
    from attnres.models import ModelConfig
    from attnres.train.hf_source import load_hf_weights
    from attnres.hf.families.build import build_hf_model, model_fields_from_directory

    base = tiny_model(model_type)
    if model_type == "glm4_moe":
        base = tiny_model(model_type, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5})
    upcycle(base, "attnres_block", block_size=2).save_pretrained(tmp_path / "up")
    config = ModelConfig.from_dict(model_fields_from_directory(tmp_path / "up"))
    assert config.hf_architecture == model_type and config.residual.block_size == 2
    model = build_hf_model(config)
    load_hf_weights(model, tmp_path / "up")
    x = ids()
    with torch.no_grad():
        assert max_rel(model.eval()(x).logits, base(x).logits) <= 1e-5
    assert not model.config.output_router_logits  # evaluation losses are the cross-entropy alone


def test_a_family_model_may_set_its_own_head_dim():
    from attnres.models import ModelConfig

    fields = dict(d_model=2880, n_heads=64, n_kv_heads=8)  # GPT-OSS: 2880 / 64 = 45, head_dim 64
    ModelConfig(**fields, hf_architecture="gpt_oss", hf_config={"head_dim": 64})
    with pytest.raises(ValueError, match="head dimension"):
        ModelConfig(**fields)


def test_a_family_config_value_of_a_type_yaml_gives_is_taken_or_named():
    """docs/upcycling.md's "set router_aux_loss_coef to 0" (`model.hf_config.router_aux_loss_coef=0`,
    an integer in YAML) ended the run's set-up, after the data was tokenised, in huggingface_hub's
    traceback "expected float, got int"; it is the float 0.0. A value the family's config refuses
    otherwise is said where the config is made, naming the field."""
    pytest.importorskip("yaml")
    from attnres.hf.families.build import build_hf_model
    from attnres.models import ModelConfig
    from attnres.train import load_config

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    model = build_hf_model(ModelConfig.preset("tiny", hf_architecture="qwen3_moe",
                                              hf_config={**moe, "router_aux_loss_coef": 0}))
    assert model.config.router_aux_loss_coef == 0.0 and isinstance(model.config.router_aux_loss_coef, float)
    base = ["model.hf_architecture=qwen3_moe", *(f"model.hf_config.{k}={v}" for k, v in moe.items())]
    with pytest.raises(ValueError, match=r"ModelConfig.hf_config: the 'qwen3_moe' config refuses it: .*'hidden_act' "
                                         r"expected str, got int \(value: 3\)"):
        load_config(None, [*base, "model.hf_config.hidden_act=3"])
    assert load_config(None, [*base, "model.hf_config.router_aux_loss_coef=0"]).model.hf_config["router_aux_loss_coef"] == 0


def test_a_family_config_alias_s_value_is_checked_as_its_field():
    """An alias of a family config field (Mixtral's ``num_experts`` for ``num_local_experts``)
    was set past transformers' strict check: ``num_experts=4.0`` (a float, as YAML writes
    ``4.0``) was taken at config time and failed where the model was built, "empty() takes 1
    positional argument but 2 were given". It is refused at config time as its field's value
    is; an alias given beside its field (a change merged over a directory's) still wins."""
    from attnres.hf.families.build import check_hf_config, hf_config_of
    from attnres.models import ModelConfig

    moe = dict(num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"ModelConfig.hf_config: the 'mixtral' config refuses it: .*'num_local_experts' "
                                         r"expected int, got float \(value: 4.0\)"):
        check_hf_config(ModelConfig.preset("tiny", hf_architecture="mixtral", hf_config={**moe, "num_experts": 4.0}))
    both = ModelConfig.preset("tiny", hf_architecture="mixtral", hf_config={**moe, "num_local_experts": 4})
    assert hf_config_of(both.replace(hf_config={"num_experts": 6})).num_local_experts == 6


def test_an_alias_set_over_a_directory_s_field_is_saved_as_that_field_alone(tmp_path):
    """``model.from_hf=DIR model.hf_config.num_experts=8`` over a Mixtral directory (whose
    config.json says ``num_local_experts``) kept both keys in the run's config (its
    config.json): which one counted hung on their order when read. It is saved as the field."""
    pytest.importorskip("yaml")
    from transformers import MixtralConfig

    from attnres.train import TrainConfig, load_config

    MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=256).save_pretrained(tmp_path / "mixtral")
    config = load_config(None, [f"model.from_hf={tmp_path / 'mixtral'}", "model.hf_config.num_experts=8"])
    saved = config.to_dict()["model"]["hf_config"]
    assert saved["num_local_experts"] == 8 and "num_experts" not in saved, saved
    assert TrainConfig.from_dict(json.loads(json.dumps(config.to_dict()))).model.hf_config == saved
    given = load_config(None, ["model.hf_architecture=mixtral", "model.hf_config.num_local_experts=4",
                               "model.hf_config.num_experts=6"])  # (both in one config: the later, as read)
    assert given.model.hf_config == {"num_local_experts": 6}


# -- expert load -------------------------------------------------------------------------

def test_expert_load_is_the_originals_at_conversion_and_well_formed():
    from attnres.analysis.experts import expert_load, expert_load_table

    base = tiny_model("deepseek_v3")
    x = ids(4, 16)
    want = expert_load(base, x)
    got = expert_load(upcycle(base, "attnres_block", block_size=2), x)
    assert [g.layer for g in got] == [w.layer for w in want] == [1, 2]  # layer 0 is dense (first_k_dense_replace)
    for g, w in zip(got, want):
        assert g.fraction == w.fraction and g.tokens == 64 and g.top_k == 2 and g.n_experts == 8
        assert sum(g.fraction) == pytest.approx(1.0) and 0 <= g.entropy <= 1 and g.max_load >= 1
    assert "| upcycled | 1 | 8 (2) |" in expert_load_table([("upcycled", got)])


def test_expert_load_summaries_are_exact_on_known_loads():
    from attnres.analysis.experts import load_of_selections

    even = load_of_selections(0, [torch.tensor([[0, 1], [2, 3]])], 4)
    assert even.fraction == [0.25] * 4 and even.entropy == pytest.approx(1.0) and even.max_load == pytest.approx(1.0)
    skewed = load_of_selections(3, [torch.tensor([[0], [0]]), torch.tensor([[0], [1]])], 4)
    assert skewed.fraction == [0.75, 0.25, 0.0, 0.0] and skewed.idle == 2 and skewed.tokens == 4
    assert skewed.max_load == pytest.approx(3.0)
    assert skewed.entropy == pytest.approx(-(0.75 * torch.tensor(0.75).log() + 0.25 * torch.tensor(0.25).log()).item()
                                           / torch.tensor(4.0).log().item())


# -- attnres train and analyze on MoE family models -----------------------------------------

SMALL_MOE = {"model.hf_config.num_experts": 4, "model.hf_config.num_experts_per_tok": 2,
             "model.hf_config.moe_intermediate_size": 32, "model.hf_config.router_aux_loss_coef": 0.01}


def _records(run, kind):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if f'"kind": "{kind}"' in line]


def test_train_an_moe_family_from_scratch_logs_the_aux_loss_and_expert_load(tmp_path):
    pytest.importorskip("yaml")
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main
    from attnres.train import load_config, train
    from attnres.train.metrics import scalars

    corpus = write_corpus(tmp_path / "corpus.txt")
    args = overrides(corpus, tmp_path / "run", steps=2, diagnostics_every=1, checkpoint_every=2,
                     **{"model.hf_architecture": "qwen3_moe", "model.residual.kind": "attnres_block",
                        "model.residual.block_size": 2}, **SMALL_MOE)
    result = train(load_config(None, args))
    assert result.step == 2
    train_records = _records(tmp_path / "run", "train")
    assert all(r["aux_loss"] > 0 for r in train_records)  # logged beside the language-modelling loss
    diag = _records(tmp_path / "run", "diagnostics")[-1]
    assert [d["layer"] for d in diag["expert_load"]] == [0, 1]  # preset tiny: 2 layers
    assert all(sum(d["fraction"]) == pytest.approx(1.0) and len(d["fraction"]) == 4 for d in diag["expert_load"])
    # and their summaries, which TensorBoard / W&B get as scalars, one per MoE layer
    fractions = [torch.tensor(d["fraction"], dtype=torch.float64) for d in diag["expert_load"]]
    assert diag["expert_load_entropy"] == pytest.approx(
        [(-torch.special.xlogy(f, f).sum() / math.log(4)).item() for f in fractions], abs=1e-9)
    assert diag["expert_max_load"] == pytest.approx([4 * f.max().item() for f in fractions], abs=1e-9)
    assert {"diagnostics/expert_max_load/1", "diagnostics/depth_entropy/4"} <= set(scalars("diagnostics", diag))
    # attnres analyze: the depth mixing matrix and, per MoE layer, the expert load
    assert cli_main(["analyze", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "an"), "--rows", "2",
                     "--seq-len", "16"]) == 0
    report = (tmp_path / "an" / "report.md").read_text()
    assert "## Expert load" in report and "| A | 1 | 4 (2) |" in report
    data = json.loads((tmp_path / "an" / "mixing.json").read_text())
    assert len(data[0]["expert_load"]) == 2 and len(data[0]["matrix"]) == 5  # L + 1 rows


def test_continued_training_adds_the_family_aux_loss_and_starts_at_the_original(tmp_path):
    """``attnres train model.from_hf=DIR init_from=DIR`` of an upcycled MoE: the first
    logged loss is the original's language-modelling loss on the same batch and the logged
    auxiliary loss the original's; the objective adds ``router_aux_loss_coef`` times it (the
    routers of a run with the coefficient at 0 end elsewhere, nothing else differing)."""
    pytest.importorskip("yaml")
    from safetensors.torch import load_file
    from test_train import overrides, write_corpus

    from attnres.data.tokenizer import train_bpe
    from attnres.train import load_config, latest_checkpoint, train

    corpus = write_corpus(tmp_path / "corpus.txt")
    tok = train_bpe(corpus.read_text(), 300)
    first, routers = {}, {}
    for name, coef, residual in (("original", 0.5, "standard"), ("up", 0.5, "attnres_block"), ("up0", 0.0, "attnres_block")):
        base = tiny_model("mixtral", vocab_size=tok.vocab_size, max_position_embeddings=128, router_aux_loss_coef=coef)
        d = tmp_path / name
        upcycle(base, residual, block_size=2 if residual == "attnres_block" else None).save_pretrained(d)
        (d / "tokenizer.json").write_text(tok.to_json())
        args = overrides(corpus, tmp_path / f"run-{name}", steps=2, lr="1e-3", warmup_steps=0, optimizer="adamw",
                         checkpoint_every=2, **{"model.from_hf": str(d), "init_from": str(d), "data.tokenizer": "bpe"})
        config = load_config(None, [a for a in args if not a.startswith("model=")])
        assert config.model.hf_architecture == "mixtral"
        train(config)
        first[name] = _records(tmp_path / f"run-{name}", "train")[0]
        weights = load_file(str(latest_checkpoint(tmp_path / f"run-{name}") / "model.safetensors"))
        routers[name] = {k: v for k, v in weights.items() if ".mlp.gate." in k}
    for name in ("up", "up0"):
        assert first[name]["loss"] == pytest.approx(first["original"]["loss"], rel=1e-5)
        assert first[name]["aux_loss"] == pytest.approx(first["original"]["aux_loss"], rel=1e-5)
    assert first["up"]["aux_loss"] >= 1.0 - 1e-6  # top-2 of 4 experts: at least the balanced value 1
    assert routers["up"].keys() == routers["up0"].keys() and routers["up"]
    assert any(not torch.equal(routers["up"][k], routers["up0"][k]) for k in routers["up"])


@pytest.mark.slow
def test_the_upcycle_moe_benchmark_runs_in_quick_mode(tmp_path):
    """``benchmarks/upcycle_moe.py --quick``: pretraining, the upcycle, continued training of
    both, the routing measurements and the report, at toy size."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "upcycle_moe.py"
    subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                   check=True, capture_output=True)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    routing = results["seeds"]["0"]["routing"]
    assert routing[0]["query_norm"] == 0 and all(x["agreement"] == 1.0 for x in routing[0]["layers"])
    assert routing[-1]["query_norm"] > 0
    assert {"report.md", "loss.png", "experts.png", "config.json"} <= {p.name for p in (tmp_path / "out").iterdir()}
