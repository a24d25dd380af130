"""The residual registry and protocol from outside the package: a variant registered here,
in user code, works in ``AttnResLM``, ``attnres train`` and the Hugging Face wrapper with no
other change; names are validated against the registry; variants describe their layout."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import attnres
from attnres import AttnResLM, ModelConfig, register_residual, registered_residuals
from attnres.experiments.flops import residual_flops_forward, training_flops_per_token
from attnres.nn.residual import AttnResBase, DepthHistory, HistoryLayout, ResidualState, ResidualStream, SingleStreamResidual
from attnres.nn.residual import residual_class
from attnres.nn.residual.attnres_base import Schedule

from conftest import assert_rel_close


@register_residual("scaled_test", replace=True)
class ScaledResidual(SingleStreamResidual):
    """``h + s_l f(h)``: one learned scalar per sublayer (a user's variant)."""

    def __init__(self, dim: int, n_sublayers: int, init: float = 1.0) -> None:
        super().__init__(dim, n_sublayers)
        self.init = init
        self.scale = nn.Parameter(torch.full((n_sublayers,), init))

    def reset_parameters(self) -> None:
        nn.init.constant_(self.scale, self.init)

    def update(self, l: int, h: Tensor, out: Tensor) -> Tensor:
        return h + self.scale[l].to(out.dtype) * out

    def residual_flops_per_token(self) -> float:
        return float(2 * self.n_sublayers * self.dim)


@register_residual("uncounted_test", replace=True)
class UncountedResidual(SingleStreamResidual):
    def update(self, l: int, h: Tensor, out: Tensor) -> Tensor:
        return h + out


SCALED = {"kind": "scaled_test", "options": {"init": 0.5}}


@register_residual("block_alias_test", replace=True)
class BlockAlias(attnres.nn.BlockAttnRes):  # (the registry's way to a second name: a subclass)
    pass


def test_user_variant_is_registered_and_builds_from_the_config():
    assert "scaled_test" in registered_residuals() and ScaledResidual.name == "scaled_test"
    model = AttnResLM(ModelConfig.preset("tiny", residual=SCALED))
    assert isinstance(model.residual, ScaledResidual)
    assert torch.equal(model.residual.scale, torch.full((4,), 0.5))  # the options reach __init__, init survives
    ids = torch.randint(0, 256, (2, 6))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert model.residual.scale.grad is not None and torch.isfinite(model.residual.scale.grad).all()
    # Scale 1 is the standard residual exactly.
    one = AttnResLM(ModelConfig.preset("tiny", residual={"kind": "scaled_test", "options": {"init": 1.0}}))
    std = AttnResLM(ModelConfig.preset("tiny", residual="standard"))
    std.load_state_dict({k: v for k, v in one.state_dict().items() if not k.startswith("residual.")})
    assert torch.equal(one(ids).logits, std(ids).logits)


def test_user_variant_trains_through_the_train_api(tmp_path):
    pytest.importorskip("safetensors")
    from test_train import write_corpus

    from attnres.train import TrainConfig, latest_checkpoint, train

    corpus = write_corpus(tmp_path / "corpus.txt")
    config = TrainConfig.from_dict({
        "model": {"preset": "tiny", "residual": SCALED}, "data": {"paths": [str(corpus)], "tokenizer": "byte"},
        "steps": 2, "seq_len": 16, "batch_size": 2, "warmup_steps": 1, "eval_every": 2, "eval_batches": 1,
        "log_every": 1, "diagnostics_every": 1, "out_dir": str(tmp_path / "run"), "progress": False,
        "tensorboard": False,
    })
    result = train(config)
    assert result.step == 2 and result.train_loss is not None
    from safetensors.torch import load_file

    weights = load_file(str(latest_checkpoint(tmp_path / "run") / "model.safetensors"))
    assert not torch.equal(weights["residual.scale"], torch.full((4,), 0.5))  # trained


def test_a_compare_report_leaves_out_the_mixing_of_a_variant_that_cannot_describe_it(tmp_path):
    """A registered variant without ``_mixing_matrix`` in a grid stopped the whole report with
    NotImplementedError; its mixing matrix is left out, saying why, and the others' stay."""
    pytest.importorskip("safetensors")
    pytest.importorskip("matplotlib")
    from test_train import overrides, write_corpus

    from attnres.experiments.job.analyze import mixing_section
    from attnres.train import load_config, train

    corpus = write_corpus(tmp_path / "corpus.txt")
    for kind in ("standard", "scaled_test"):
        train(load_config(None, overrides(corpus, tmp_path / kind, steps=2, **{"model.residual.kind": kind})))
    text = mixing_section({"standard": [tmp_path / "standard"], "scaled_test": [tmp_path / "scaled_test"]}, tmp_path)
    assert "| standard | 1 |" in text and "| scaled_test |" not in text
    assert "Not analysed: scaled_test (residual 'scaled_test'" in text and "_mixing_matrix(state" in text


def test_user_variant_round_trips_through_the_hf_wrapper(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from attnres.hf import AttnResForCausalLM

    torch.manual_seed(0)
    native = AttnResLM(ModelConfig.preset("tiny", residual=SCALED))
    with torch.no_grad():
        native.residual.scale.uniform_(0.2, 1.5)
    hf = AttnResForCausalLM.from_native(native)
    ids = torch.randint(0, 256, (2, 7))
    assert torch.equal(hf(ids).logits, native(ids).logits)
    hf.save_pretrained(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config.residual["kind"] == "scaled_test" and loaded.config.residual["options"] == {"init": 0.5}
    assert torch.equal(loaded(ids).logits, native(ids).logits)
    assert torch.equal(loaded.to_native().residual.scale, native.residual.scale)


def test_the_decorator_without_its_name_says_how_to_write_it():
    """``@register_residual`` above a class, without ``('name')``, was told that "a residual
    name must be a Python identifier ...; got <class ...>"; it now says the form it takes."""
    with pytest.raises(ValueError, match=r"^register_residual takes the variant's name first: "
                                         r"@register_residual\('my_residual'\) above class ScaledResidual, not a bare "
                                         r"@register_residual$"):
        register_residual(ScaledResidual)
    assert ScaledResidual.name == "scaled_test"  # (left as it was)


def test_unknown_and_duplicate_names_and_bad_options():
    with pytest.raises(ValueError) as info:
        ModelConfig(residual="no_such_residual")
    assert "ModelConfig.residual.kind must be one of" in str(info.value)
    assert all(repr(name) in str(info.value) for name in registered_residuals())
    with pytest.raises(ValueError, match="already registered"):
        register_residual("standard")(ScaledResidual)
    with pytest.raises(ValueError, match="Python identifier"):
        register_residual("not a name")
    with pytest.raises(TypeError, match="ResidualStream subclasses"):
        register_residual("plain_test")(object)
    with pytest.raises(ValueError, match=r"options \['inti'\] are not options of residual 'scaled_test' "
                       r"\(did you mean 'init' for 'inti'\?\); it takes \['init'\]"):
        ModelConfig(residual={"kind": "scaled_test", "options": {"inti": 2.0}})
    with pytest.raises(ValueError, match="options must be empty for residual 'attnres_block'"):
        ModelConfig(residual={"options": {"x": 1}})


def test_an_option_of_a_users_variant_given_beside_its_kind_is_named_under_options():
    """``{"kind": "scaled_test", "init": 0.5}`` - the option beside the kind, not under
    ``options`` - was refused as an unknown key, naming no field to use; the option is named
    as ``options.init``. A built-in variant's (no options) gets the nearest field as before."""
    with pytest.raises(ValueError, match=r"unknown ModelConfig.residual key\(s\) \['init'\] \(did you mean "
                                         r"'options.init' for 'init'\?\)"):
        ModelConfig(residual={"kind": "scaled_test", "init": 0.5})
    with pytest.raises(ValueError, match=r"\['block_sise'\] \(did you mean 'block_size' for 'block_sise'\?\)"):
        ModelConfig(residual={"kind": "attnres_block", "block_sise": 2})
    assert ModelConfig(residual={"kind": "scaled_test", "options": {"init": 0.5}}).residual.options == {"init": 0.5}


def test_a_residual_config_of_a_kind_not_registered_is_refused_as_it_is_built():
    """``ResidualConfig(kind="nope")`` on its own was accepted: only a ModelConfig using it
    refused the kind, away from where it was given. It is now refused as it is built, with
    ModelConfig's message (the registered names, the nearest one, how to register one's own),
    in every form the config takes; a variant registered first is accepted."""
    from attnres import ResidualConfig
    from attnres.nn.residual.registry import UnregisteredResidual

    with pytest.raises(UnregisteredResidual) as in_model:
        ModelConfig(residual="attnres_blok")
    for build in (lambda: ResidualConfig(kind="attnres_blok"), lambda: ResidualConfig.from_value("attnres_blok"),
                  lambda: ResidualConfig.from_value({"kind": "attnres_blok", "block_size": 2})):
        with pytest.raises(UnregisteredResidual) as built:
            build()
        assert str(built.value) == str(in_model.value) and built.value.kind == "attnres_blok"
    assert str(in_model.value).startswith("ModelConfig.residual.kind must be one of 'standard', 'attnres_full', ")
    assert "got 'attnres_blok' (did you mean 'attnres_block'?); a residual of your own is registered by importing " \
           "its module first" in str(in_model.value)
    assert ResidualConfig(kind="scaled_test", options={"init": 0.5}).kind == "scaled_test"  # (registered above)


def test_flops_come_from_the_variant_and_an_uncounted_one_says_so():
    cfg = ModelConfig.preset("tiny", residual=SCALED)
    assert residual_flops_forward(cfg) == 2 * cfg.n_sublayers * cfg.d_model
    assert training_flops_per_token(cfg, 16).residual == 3 * 2 * cfg.n_sublayers * cfg.d_model
    with pytest.raises(NotImplementedError, match="'uncounted_test' does not count its FLOPs"):
        residual_flops_forward(ModelConfig.preset("tiny", residual="uncounted_test"))


@pytest.mark.parametrize("residual, block_size", [("standard", None), ("attnres_block", 4), ("attnres_block", 3),
                                                  ("attnres_full", None), ("scaled_test", None)])
@pytest.mark.parametrize("schedule", ["two_phase", "naive"])
def test_history_and_resume_cut_the_stream_anywhere(residual, block_size, schedule):
    """``history`` then ``resume`` at every sublayer gives the uninterrupted forward, and the
    history has the layout the variant describes (Block with blocks that end at ``L`` too:
    the naive schedule resumed there took a ``None`` partial sum as a source)."""
    cfg = ModelConfig.preset("tiny", n_layers=3, residual={"kind": residual, "block_size": block_size,
                                                           "schedule": schedule})
    torch.manual_seed(0)
    module = cfg.build_residual().double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn_like(p))
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(2, 3, cfg.d_model, generator=g, dtype=torch.float64)
    outs = [torch.randn(2, 3, cfg.d_model, generator=g, dtype=torch.float64) * (l + 1) for l in range(cfg.n_sublayers)]

    def run(state, start):
        for l in range(start, cfg.n_sublayers):
            module.sublayer_input(state, l)
            module.add_output(state, l, outs[l])
        return module.finish(state)

    want = run(module.start(emb), 0)
    for cut in range(cfg.n_sublayers + 1):
        state = module.start(emb)
        for l in range(cut):
            module.sublayer_input(state, l)
            module.add_output(state, l, outs[l])
        history = module.history(state)
        layout = module.history_layout(cut)
        assert HistoryLayout(len(history.completed), history.running is not None) == layout
        assert_rel_close(run(module.resume(DepthHistory(*history), cut), cut), want, 1e-12, f"cut at {cut}")


def test_layouts_the_variants_describe():
    def build(**residual):
        with torch.device("meta"):
            return ModelConfig.preset("tiny", n_layers=3, residual=residual).build_residual()

    block = build(kind="attnres_block", block_size=4)
    assert [tuple(block.history_layout(s)) for s in range(7)] == [(1, False), (1, True), (1, True), (1, True),
                                                                 (2, False), (2, True), (2, True)]
    assert block.sources_per_mixer() == [1, 2, 2, 2, 2, 3, 3]
    full = build(kind="attnres_full")
    assert [tuple(full.history_layout(s)) for s in (0, 3, 6)] == [(1, False), (4, False), (7, False)]
    assert tuple(build(kind="standard").history_layout(3)) == (0, True)
    with pytest.raises(ValueError, match="'mhc' does not describe its history"):
        build(kind="mhc").history_layout(2)
    with pytest.raises(ValueError, match="holds 2 completed entries and a running tensor; got 1"):
        block.resume(DepthHistory([torch.zeros(1)], None), 5)


def test_the_public_surface():
    assert attnres.register_residual is register_residual
    assert issubclass(ScaledResidual, ResidualStream)
    for name in ("standard", "attnres_full", "attnres_block", "rezero", "layerscale", "highway", "denseformer",
                 "hyper_connections", "mhc", "mhc_lite"):
        assert name in registered_residuals()


def test_cli_imports_a_module_that_registers_a_residual(tmp_path, monkeypatch, capsys):
    """``attnres --import MODULE train ...``: the module registers its variant before the
    config is read, so the command line can name it."""
    pytest.importorskip("yaml")
    from attnres.cli import main as cli_main

    (tmp_path / "my_residuals.py").write_text(
        "from attnres import register_residual\n"
        "from attnres.nn.residual import SingleStreamResidual\n"
        "@register_residual('cli_test', replace=True)\n"
        "class Mine(SingleStreamResidual):\n"
        "    def update(self, l, h, out):\n"
        "        return h + 0.5 * out\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli_main(["--import", "my_residuals", "train", "--print-config", "model.residual.kind=cli_test"]) == 0
    assert "kind: cli_test" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["--import", "no_such_module_here", "train", "--print-config"])
    assert capsys.readouterr().err.strip().endswith(
        "attnres: error: --import no_such_module_here: No module named 'no_such_module_here'")


def test_cli_imports_a_python_file_by_its_path_and_names_a_near_module(tmp_path, monkeypatch, capsys):
    """``--import path/to/mine.py`` said "No module named 'path/to/mine.py'"; a misspelt
    module beside the user gets the nearest ``.py`` file's name."""
    pytest.importorskip("yaml")
    from attnres.cli import main as cli_main

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "by_path_residuals.py").write_text(
        "from attnres import register_residual\n"
        "from attnres.nn.residual import SingleStreamResidual\n"
        "@register_residual('by_path_test', replace=True)\n"
        "class Mine(SingleStreamResidual):\n"
        "    def update(self, l, h, out):\n"
        "        return h + 0.25 * out\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # (the import puts the file's directory first)
    assert cli_main(["--import", "elsewhere/by_path_residuals.py", "train", "--print-config",
                     "model.residual.kind=by_path_test"]) == 0
    assert "kind: by_path_test" in capsys.readouterr().out
    # What its checkpoints record, for the hint of a later command, from any folder: not the relative path.
    from attnres.nn.residual.imports import imports_record

    assert imports_record("by_path_test")["given"] == [str(tmp_path / "elsewhere" / "by_path_residuals.py")]
    (tmp_path / "my_residuals.py").write_text("")
    with pytest.raises(SystemExit):
        cli_main(["--import", "my_residual", "train", "--print-config"])
    assert capsys.readouterr().err.strip().endswith(
        "attnres: error: --import my_residual: No module named 'my_residual' (did you mean 'my_residuals'?)")


def test_a_variant_that_breaks_the_protocol_is_named_with_the_fix():
    """A class without ``update`` failed at build time ("Can't instantiate abstract class"), a
    required ``__init__`` argument with a TypeError, and an ``update`` of another shape in the
    next sublayer (a LayerNorm's size error, or the next output blamed for the stream's shape)."""
    class NoUpdate(SingleStreamResidual):
        pass

    with pytest.raises(TypeError, match=r"register_residual\('no_update_test'\): .*NoUpdate does not define update"):
        register_residual("no_update_test")(NoUpdate)
    assert "no_update_test" not in registered_residuals()

    class Bare(ResidualStream):
        pass

    with pytest.raises(TypeError, match="Bare does not define _add, _finish, _input, _start"):
        register_residual("bare_test")(Bare)

    # A protocol method the model cannot call as it does: a TypeError in the first forward, or at the build.
    class NoSublayerIndex(SingleStreamResidual):
        def update(self, h, out):
            return h + out

    with pytest.raises(TypeError, match=r"register_residual\('no_index_test'\): .*NoSublayerIndex.update\(self, h, out\) "
                       r"cannot be called as the model calls it, update\(self, l, h, out\)"):
        register_residual("no_index_test")(NoSublayerIndex)

    class NoDepth(SingleStreamResidual):
        def __init__(self, dim):
            super().__init__(dim, 4)

        def update(self, l, h, out):
            return h + out

    with pytest.raises(TypeError, match=r".*NoDepth.__init__\(self, dim\) cannot be called as the default from_config "
                       r"calls it, __init__\(self, dim, n_sublayers, \*\*options\), or define from_config"):
        register_residual("no_depth_test")(NoDepth)
    assert not {"no_index_test", "no_depth_test"} & set(registered_residuals())

    # One class under two names: its name became the second, and models of the first were reported under it.
    @register_residual("once_test")
    class Once(SingleStreamResidual):
        def update(self, l, h, out):
            return h + out

    with pytest.raises(ValueError, match=r"register_residual\('twice_test'\): .*Once is registered as 'once_test' "
                       r"already; a class has one name - register a subclass under 'twice_test'"):
        register_residual("twice_test")(Once)
    assert Once.name == "once_test" and "twice_test" not in registered_residuals()

    @register_residual("alias_test")
    class Alias(Once):
        pass

    assert (Alias.name, residual_class("once_test").name) == ("alias_test", "once_test")

    @register_residual("needs_gamma_test", replace=True)
    class NeedsGamma(SingleStreamResidual):
        def __init__(self, dim, n_sublayers, gamma):
            super().__init__(dim, n_sublayers)
            self.gamma = gamma

        def update(self, l, h, out):
            return torch.cat([h, self.gamma * out], -1)  # twice the width

    with pytest.raises(ValueError, match=r"ModelConfig.residual.options must set \['gamma'\] for residual "
                       r"'needs_gamma_test' .*model.residual.options.gamma=VALUE"):
        ModelConfig.preset("tiny", residual="needs_gamma_test")
    with pytest.raises(ValueError, match=r"options \['gama'\] are not options of residual 'needs_gamma_test' \(did you "
                       r"mean 'gamma'"):  # (was: "must set ['gamma']", the misspelling unnamed)
        ModelConfig.preset("tiny", residual={"kind": "needs_gamma_test", "options": {"gama": 0.5}})
    model = AttnResLM(ModelConfig.preset("tiny", residual={"kind": "needs_gamma_test", "options": {"gamma": 0.5}}))
    with pytest.raises(ValueError, match=r"residual 'needs_gamma_test': .*NeedsGamma.update\(0, h, out\) must return "
                       r"the next hidden state, of h's shape \[2, 5, 64\]; got \[2, 5, 128\]"):
        model(torch.randint(0, 256, (2, 5)))


def test_a_variant_not_registered_is_named_by_its_class_and_no_residual_is_called_like_a_layer():
    """A subclass used without ``register_residual`` has the name ``''``: its errors read
    "residual ''"; calling a residual like a layer, ``residual(x)``, got nn.Module's
    'missing the required "forward" function', which reads as a bug of the package."""

    class Unregistered(SingleStreamResidual):
        def update(self, l, h, out):
            return (h + out).sum(-1)  # the wrong shape

    m = Unregistered(8, 2)
    state = m.start(torch.randn(3, 8))
    m.sublayer_input(state, 0)
    with pytest.raises(ValueError, match=r"^residual .*Unregistered \(not registered\): .*Unregistered.update\(0, h, "
                                         r"out\) must return the next hidden state"):
        m.add_output(state, 0, torch.randn(3, 8))
    with pytest.raises(NotImplementedError, match=r"^residual .*Unregistered \(not registered\) does not count"):
        m.residual_flops_per_token()
    from attnres.nn import BlockAttnRes, StandardResidual

    for residual in (m, StandardResidual(8, 2), BlockAttnRes(8, 2, 1)):
        with pytest.raises(TypeError, match=r"is not called like a layer: drive it from your model's forward - state = "
                                            r"residual.start\(x\); .*residual.finish\(state\)"):
            residual(torch.randn(3, 8))


def test_cli_import_of_a_missing_file_or_a_path_without_py_says_so(tmp_path, monkeypatch, capsys):
    """``--import ./missing.py`` ended in a TypeError traceback about relative imports."""
    from attnres.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for value, said in [("./missing.py", f"no such file {str(tmp_path / 'missing.py')!r}"),
                        ("sub/mine", "neither a module name (such as my_residuals) nor the path of a .py file")]:
        with pytest.raises(SystemExit):
            cli_main(["--import", value, "train", "--print-config"])
        assert capsys.readouterr().err.strip().endswith(f"attnres: error: --import {value}: {said}")


def test_resume_with_other_options_names_the_option_once():
    """It said "model.residual.options: None there, {} here, model.residual.options.init: 0.5
    there, None here": options that were set, said to be None, and the field twice."""
    from attnres.checkpoint.locate import Source
    from attnres.train import TrainConfig
    from attnres.train.resume import check_resumable

    def config(options):
        return TrainConfig.from_dict({"model": {"preset": "tiny", "residual": {"kind": "scaled_test",
                                                                               "options": options}}}).to_dict()

    source = Source(Path("run/checkpoints/step-00000004"), {"step": 4})
    with pytest.raises(ValueError) as info:
        check_resumable(config({"init": 0.5}), config({}), source)
    assert "the config differs in ['model.residual.options.init'] (model.residual.options.init: 0.5 there, not set " \
           "here;" in str(info.value)
    check_resumable(config({"init": 0.5}), config({"init": 0.5}), source)


@dataclass
class _RecentState(ResidualState):
    sources: list | None = None


class _RecentNaive(Schedule):
    name = "naive"

    def start(self, m, embedding, common):
        return _RecentState(sources=[embedding], **common)

    def input(self, m, state, l):
        return m.attend_naive(state, l, m.recent(state.sources))

    def add(self, m, state, l, output):
        state.sources.append(output)

    def finish(self, m, state):
        return m.attend_naive(state, m.n_sublayers, m.recent(state.sources))


@register_residual("recent_test", replace=True)
class RecentAttnRes(AttnResBase):
    """A user's depth-attention variant on ``AttnResBase`` (docs/design.md): the embedding and
    the ``k`` most recent outputs, on the naive schedule."""

    SCHEDULES = {"naive": _RecentNaive()}

    def __init__(self, dim: int, n_sublayers: int, k: int = 2, eps: float = 1e-6) -> None:
        self.k = k
        super().__init__(dim, n_sublayers, eps=eps, schedule="naive")

    def recent(self, sources):
        return sources if len(sources) <= 1 + self.k else [sources[0], *sources[-self.k:]]

    def sources_per_mixer(self) -> list[int]:
        return [min(l + 1, 1 + self.k) for l in range(self.n_sublayers + 1)]


def test_a_depth_attention_variant_of_the_users_takes_its_options():
    """An ``AttnResBase`` subclass built by the default ``from_config`` had every option refused
    ("options must be empty ... its settings are fields of ModelConfig.residual"), which is
    true of Full and Block only."""
    model = AttnResLM(ModelConfig.preset("tiny", residual={"kind": "recent_test", "options": {"k": 1}}))
    assert model.residual.k == 1 and model.residual.sources_per_mixer() == [1] + [2] * model.config.n_sublayers
    ids = torch.randint(0, 256, (2, 6))
    assert torch.isfinite(model(ids, labels=ids).loss)
    with pytest.raises(ValueError, match=r"options \['kk'\] are not options of residual 'recent_test' "
                       r"\(did you mean 'k' for 'kk'\?\)"):
        ModelConfig(residual={"kind": "recent_test", "options": {"kk": 1}})
    with pytest.raises(ValueError, match="options must be empty for residual 'attnres_full'"):  # Full's are fields
        ModelConfig(residual={"kind": "attnres_full", "options": {"k": 1}})


def test_an_option_value_init_refuses_is_named_as_the_option():
    """``model.residual.options.init=abc`` ended in a TypeError traceback from ``torch.full``
    inside the user's ``__init__``."""
    with pytest.raises(ValueError, match=r"ModelConfig.residual.options \{'init': 'abc'\}: ScaledResidual.__init__ of "
                       r"residual 'scaled_test' refused them \(TypeError: .*fill_value.*\); set values it takes, e.g. "
                       r"model.residual.options.init=VALUE \(attnres train\), --residual-option init=VALUE \(attnres upcycle\)$"):
        AttnResLM(ModelConfig.preset("tiny", residual={"kind": "scaled_test", "options": {"init": "abc"}}))


def test_the_commands_after_a_run_of_a_users_residual_say_to_import_its_module(tmp_path, monkeypatch):
    """The resume hint at the end of a run said `attnres train out_dir=... --resume`, which
    fails ("kind must be one of ...") without the --import the run was trained with; the
    export's note said only `import attnres.hf`."""
    import json

    from attnres.cli.train import _how_to_continue
    from attnres.train import TrainConfig

    here = str(Path(__file__).resolve())  # this module registers 'scaled_test'; not in the working directory
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = TrainConfig.from_dict({"model": {"preset": "tiny", "residual": SCALED}, "out_dir": "run"})
    assert _how_to_continue(config) == f"continue with --resume (`attnres --import {here} train out_dir=run --resume`: " \
                                       "the run's own config)"
    assert "`attnres train out_dir=run --resume`" in _how_to_continue(TrainConfig.from_dict({"out_dir": "run"}))
    pytest.importorskip("transformers")  # (attnres export's)
    from attnres.cli.export import _and_the_residual

    (tmp_path / "config.json").write_text(json.dumps({"residual": SCALED, "residual_module": "test_registry"}))
    assert _and_the_residual(tmp_path / "config.json") == \
        f" and `import test_registry` ({here}), which registers its residual 'scaled_test'; or with " \
        "trust_remote_code=True, which imports test_registry itself (config.json's residual_module) where Python " \
        "finds it: on PYTHONPATH, or installed"  # (was: only the import)
    (tmp_path / "config.json").write_text(json.dumps({"residual": {"kind": "attnres_block"}}))
    assert _and_the_residual(tmp_path / "config.json") == ""


@pytest.mark.parametrize("how", ["name", "path"])
def test_cli_import_of_a_module_with_a_syntax_error_says_where(tmp_path, monkeypatch, capsys, how):
    """A syntax error in the module given to --import was a traceback through argparse."""
    from attnres.cli import main as cli_main

    (tmp_path / "broken_residuals.py").write_text("import torch\ndef f(:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    value = "broken_residuals" if how == "name" else str(tmp_path / "broken_residuals.py")
    with pytest.raises(SystemExit):
        cli_main(["--import", value, "train", "--print-config"])
    file = tmp_path / "broken_residuals.py"
    assert capsys.readouterr().err.strip().endswith(
        f"attnres: error: --import {value}: invalid syntax in {file}, line 2: def f(:; fix the module, or run "
        f"`python {file}` to see it")


def test_registering_a_taken_name_names_who_has_it_and_a_class_defined_again_replaces_it():
    """A built-in's name was answered "pass replace=True" (which would change what every such
    checkpoint loads as), and replace=True replaced it; the same class defined again - its
    module reloaded, a notebook cell run a second time - was refused as a clash."""
    source = ("from attnres import register_residual\nfrom attnres.nn.residual import SingleStreamResidual\n"
              "@register_residual('again_test')\nclass Again(SingleStreamResidual):\n"
              "    def update(self, l, h, out):\n        return h + out\n")
    first, second = {"__name__": "notebook"}, {"__name__": "notebook"}
    exec(source, first)
    exec(source, second)  # the cell run again
    assert residual_class("again_test") is second["Again"]
    with pytest.raises(ValueError, match=r"residual 'standard' is already registered: it is a built-in variant "
                       r"\(attnres.nn.residual.standard.StandardResidual\); register ScaledResidual under a name of "
                       r"its own, e.g. register_residual\('my_standard'\)"):
        register_residual("standard")(ScaledResidual)
    # replace=True too: a checkpoint or export naming 'standard' would load as the built-in where the module is not
    # imported, silently another function (it replaced it).
    with pytest.raises(ValueError, match=r"residual 'standard' is already registered: it is a built-in variant .*"
                       r"\(replace=True replaces a variant of your own, never a built-in"):
        register_residual("standard", replace=True)(ScaledResidual)
    assert residual_class("standard").builtin()
    with pytest.raises(ValueError, match=r"residual 'again_test' is already registered by notebook.Again; register "
                       r"ScaledResidual under another name, or pass replace=True to override it"):
        register_residual("again_test")(ScaledResidual)


def _grid_folder(tmp_path: Path, experiment: str, variant: str) -> Path:
    """A grid's folder (tiny preset) holding one finished run of ``variant``."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("scipy")
    import json

    out = tmp_path / "grid"
    (out / variant / "seed0").mkdir(parents=True)
    (out / "experiment.json").write_text(json.dumps({"experiment": experiment, "preset": "tiny", "overrides": []}))
    (out / variant / "seed0" / "result.json").write_text(json.dumps({"variant": variant, "seed": 0}))
    return out


def test_a_grid_folder_with_variants_added_in_python_is_not_reported_from_the_command_line(tmp_path, capsys):
    """`attnres compare --report-only` (or a CLI run) on the folder of a grid a user extended in
    Python replaced its report with one without their variants, saying nothing."""
    from attnres.cli import main as cli_main

    out = _grid_folder(tmp_path, "compare", "scaled")
    (out / "report.md").write_text("the report with scaled\n")
    for argv in (["compare", "--out", str(out), "--report-only"], ["compare", "--out", str(out), "--seeds", "0"]):
        with pytest.raises(SystemExit) as info:
            cli_main(argv)
        assert str(info.value) == (f"attnres compare: error: {str(out)!r} holds finished runs of variants not in the "
                                   "'compare' grid (scaled: added to it in Python, docs/experiments.md 'Grids'); a "
                                   "report written from the command line would leave them out: write it in Python with "
                                   "that grid (write_report(name, run_experiment(grid, out), out)), or pick another --out")
    assert (out / "report.md").read_text() == "the report with scaled\n"


def test_a_users_variant_that_cannot_be_cut_into_stages_is_told_what_to_define():
    """parallel.pp=2 with a depth-attention variant of the user's said only that it "does not
    describe its history", not what would make it cut."""
    with pytest.raises(ValueError, match=r"residual 'recent_test' does not describe its history between sublayers, so "
                       r"it cannot be cut into pipeline stages \(to cut it, define history_layout\(sublayer\), "
                       r"_history\(state\) and _resume\(history, at_sublayer, common\): docs/design.md"):
        RecentAttnRes(8, 4).history_layout(2)
    with pytest.raises(ValueError, match=r"cannot be cut into pipeline stages$"):  # a built-in's: nothing to define
        ModelConfig.preset("tiny", residual="mhc").build_residual().history_layout(2)


def test_a_schedule_a_users_depth_attention_variant_lacks_is_named():
    """Setting a schedule the variant's ``SCHEDULES`` lacks (the default "two_phase", through
    ``options.schedule`` or the attribute) was a bare ``KeyError: 'two_phase'``."""
    residual = RecentAttnRes(8, 4)
    with pytest.raises(ValueError, match=r"schedule must be one of \('naive',\) for RecentAttnRes, got 'two_phase'"):
        residual.schedule = "two_phase"
    assert residual.schedule == "naive"


def test_print_config_names_the_options_of_a_users_residual_left_at_their_defaults(capsys):
    """``--print-config`` showed ``options: {}`` for a variant of the user's: its settings, left
    at ``__init__``'s defaults, were nowhere (a built-in's fields all are)."""
    import yaml

    from attnres.cli import main as cli_main

    assert cli_main(["train", "--print-config", "model.residual.kind=recent_test", "model.residual.options.k=3"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("# model.residual.options of residual 'recent_test' left at RecentAttnRes's defaults: "
                                 "eps=1e-06")
    assert yaml.safe_load(out)["model"]["residual"]["options"] == {"k": 3}  # (a comment: it still loads)
    assert cli_main(["train", "--print-config", "model.residual.kind=scaled_test", "model.residual.options.init=2"]) == 0
    assert cli_main(["train", "--print-config", "model.residual.kind=standard"]) == 0
    assert "left at" not in capsys.readouterr().out


def test_phase1_settings_are_refused_for_a_users_variant_without_a_two_phase_schedule():
    """``autocast_phase1_sums=true`` was accepted for a depth-attention variant whose schedules
    are naive only - it has no Phase 1, so the setting did nothing."""
    with pytest.raises(ValueError, match=r"ModelConfig.residual.autocast_phase1_sums applies to Full and Block AttnRes' "
                       r"two-phase schedule .*residual 'recent_test'"):
        ModelConfig(residual={"kind": "recent_test", "autocast_phase1_sums": True})
    assert ModelConfig(residual={"kind": "attnres_full", "autocast_phase1_sums": True}).residual.autocast_phase1_sums


def test_an_option_value_init_refuses_is_a_config_error_at_print_config(capsys):
    """``model.residual.options.init=abc`` passed ``--print-config`` and every config check, and
    failed only when the model was built, after the data was read."""
    from attnres.cli import main as cli_main

    with pytest.raises(ValueError, match=r"options \{'init': 'abc'\}: ScaledResidual.__init__ of residual 'scaled_test' "
                       r"refused them"):
        ModelConfig(residual={"kind": "scaled_test", "options": {"init": "abc"}})
    with pytest.raises(SystemExit) as info:
        cli_main(["train", "--print-config", "model.residual.kind=scaled_test", "model.residual.options.init=abc"])
    assert "ScaledResidual.__init__ of residual 'scaled_test' refused them" in str(info.value)


def test_a_grid_with_a_variant_that_does_not_count_its_flops_stops_before_any_run(tmp_path):
    """A user's variant without ``residual_flops_per_token`` in a grid trained the runs before
    it and its own, then stopped the grid with NotImplementedError while writing its record."""
    import dataclasses

    from attnres.experiments import get_experiment, run_experiment
    from attnres.experiments.job.presets import Variant

    grid = get_experiment("compare", "tiny")
    grid = dataclasses.replace(grid, variants=[*grid.variants, Variant("uncounted", {"residual": "uncounted_test"}, family="uncounted")])
    with pytest.raises(ValueError, match=r"variant 'uncounted': residual 'uncounted_test' does not count its FLOPs: "
                       r"define residual_flops_per_token\(\) \(a grid records each run's training FLOPs; checked before "
                       r"the first run starts\)"):
        run_experiment(grid, tmp_path / "grid", log=lambda line: None)
    assert not (tmp_path / "grid").exists()  # nothing trained


def test_a_folder_of_another_grid_is_named_as_such_not_as_variants_added_in_python(tmp_path):
    from attnres.cli import main as cli_main

    out = _grid_folder(tmp_path, "block-size", "s4")
    with pytest.raises(SystemExit, match="holds a different experiment"):
        cli_main(["compare", "--preset", "tiny", "--out", str(out), "--report-only"])


def test_a_pipeline_takes_a_users_variant_without_parameters_and_refuses_one_with():
    """What docs/design.md says of a variant of one's own under parallel.pp > 1 (the registry's
    docstring said the pipeline accepts any registered name)."""
    from attnres.distributed.pipeline import PipelineChunk

    def chunk(residual):
        model = AttnResLM(ModelConfig.preset("tiny", residual=residual, tie_embeddings=False))
        return PipelineChunk(model, 0, range(0, 1), 2)

    assert chunk("uncounted_test").n_completed_in == 0  # the hidden state alone
    with pytest.raises(ValueError, match="residual 'scaled_test' has parameters it cannot split"):
        chunk(SCALED)


def test_the_unregistered_residual_error_names_only_what_the_run_recorded(monkeypatch):
    """What a command says for a run's residual that is not registered here, from its
    checkpoint's record (``attnres.nn.residual.imports``): the --import values as given, else the
    class's module; a script's class (``__main__``) cannot be imported; no record (a checkpoint
    of an earlier version), another error or another kind (a misspelt override): ``None``, the
    registry's own message."""
    from attnres.nn.residual import imports
    from attnres.nn.residual.imports import imports_record, unregistered_residual_error

    monkeypatch.setattr(imports, "_GIVEN", [])  # (no --import in this process)

    with pytest.raises(ValueError) as info:
        residual_class("gone_test")
    error = info.value
    record = {"given": ["path/to/my res.py"], "residual": "gone_test", "residual_module": "my_res"}
    assert unregistered_residual_error(error, record) == (
        "residual 'gone_test' is not registered: this run was trained with --import 'path/to/my res.py'; add --import "
        "'path/to/my res.py' (`attnres --import 'path/to/my res.py' <command> ...`; in Python, `import my_res` first)")
    assert unregistered_residual_error(error, {**record, "given": [], "residual_module": "__main__"}).startswith(
        "residual 'gone_test' is not registered: this run was trained by a script that defined it (its __main__)")
    for other in (None, {**record, "residual": "gone_other"}, {"given": [], "residual": "gone_test"}):
        assert unregistered_residual_error(error, other) is None
    assert unregistered_residual_error(ValueError("another"), record) is None
    assert imports_record("scaled_test") == {"given": [], "residual": "scaled_test", "residual_module": __name__}
    assert imports_record("attnres_block")["residual_module"] is None


_REGISTERS = '''
from attnres import register_residual, registered_residuals
from attnres.nn.residual import SingleStreamResidual


@register_residual("on_import_test", replace=True)
class OnImport(SingleStreamResidual):
    def update(self, l, h, out):
        return h + out


def test_registers_one_more():
    @register_residual("in_a_test_test", replace=True)
    class InATest(SingleStreamResidual):
        def update(self, l, h, out):
            return h + out

    assert {"on_import_test", "in_a_test_test"} <= set(registered_residuals())


def test_keeps_what_its_module_registered_on_import():
    assert "on_import_test" in registered_residuals() and "in_a_test_test" not in registered_residuals()
'''
_SEES = '''
from attnres.nn.residual import registered_residuals, residual_class


def test_sees_attnres_variants_only():
    assert [name for name in registered_residuals() if not residual_class(name).builtin()] == []
'''


def test_a_variant_registered_by_one_test_module_is_not_seen_by_the_next(tmp_path):
    """Test modules share one process in an xdist worker: a variant one module registered (on
    import, or in a test) was seen by the modules after it - a test compiling every registered
    residual built test_registry's 'needs_gamma_test', which wants an option, and failed in CI
    only when the two modules met in one worker. The suite's fixture (``registry_isolation``)
    gives each test attnres's variants and its own module's; two runs in one process, the second
    with a registering module first, pass alike."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_first_registers.py").write_text(_REGISTERS)
    (tmp_path / "test_then_sees.py").write_text(_SEES)
    args = ["-q", "-p", "no:cacheprovider", "-p", "registry_isolation", "--import-mode=importlib",
            "--rootdir", str(tmp_path), "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    assert pytest.main([*args, str(tmp_path / "test_then_sees.py")]) == pytest.ExitCode.OK
    assert pytest.main([*args, str(tmp_path / "test_first_registers.py"),
                        str(tmp_path / "test_then_sees.py")]) == pytest.ExitCode.OK


@dataclass
class _HiddenState(ResidualState):
    h: Tensor | None = None


class _CommonLeftOut(ResidualStream):
    """A variant of one's own whose ``_start`` and ``_resume`` build their state without ``**common``."""

    def _start(self, embedding, common):
        return _HiddenState(dtype=embedding.dtype, h=embedding)

    def _input(self, state, l):
        return state.h

    def _add(self, state, l, output):
        state.h = state.h + output

    def _finish(self, state):
        return state.h

    def history_layout(self, sublayer):
        return HistoryLayout(0, True)

    def _resume(self, history, at_sublayer, common):
        return _HiddenState(dtype=history.running.dtype, h=history.running)


def test_a_variant_whose_state_leaves_out_the_common_fields_is_told_at_start_and_resume():
    """It failed at the first ``add_output``: "the stream is on None ... output.to('None')"."""
    module, x = _CommonLeftOut(4, 2), torch.randn(3, 4)
    with pytest.raises(TypeError, match=r"_CommonLeftOut._start\(embedding, common\) must return a ResidualState built "
                                        r"with the fields it is given, e\.g\. MyState\(h=embedding, \*\*common\)"):
        module.start(x)
    with pytest.raises(TypeError, match=r"_CommonLeftOut._resume\(history, at_sublayer, common\) must return"):
        module.resume(DepthHistory([], x), 1)


def test_the_upcycle_of_a_users_residual_and_its_run_s_export_say_to_import_its_module(tmp_path, monkeypatch, capsys):
    """`attnres --import MODULE upcycle --residual NAME`: its hint to continue training said
    `attnres train ...`, which fails without the --import; and the export of a run of an
    upcycled (family) model named no module to import (its config holds the residual as
    `attnres_residual`, not `residual`)."""
    pytest.importorskip("transformers")
    from fixtures.tiny_families import tiny_model

    from attnres.cli import main as cli_main
    from attnres.cli.export import _and_the_residual
    from attnres.data import ByteTokenizer
    from attnres.hf import make_hf_tokenizer

    here = str(Path(__file__).resolve())  # this module registers 'scaled_test'; not in the working directory
    monkeypatch.chdir(tmp_path)
    tiny_model("llama", vocab_size=256).save_pretrained(tmp_path / "llama")
    make_hf_tokenizer(ByteTokenizer()).save_pretrained(tmp_path / "llama")
    assert cli_main(["upcycle", "--model", "llama", "--out", "up", "--residual", "scaled_test"]) == 0
    assert f"continue training with `attnres --import {here} train model.from_hf=up init_from=up ...`" \
        in capsys.readouterr().out
    assert _and_the_residual(tmp_path / "up" / "config.json") == \
        f" and `import test_registry` ({here}), which registers its residual 'scaled_test'; or with " \
        "trust_remote_code=True, which imports test_registry itself (config.json's attnres_residual_module) where " \
        "Python finds it: on PYTHONPATH, or installed"


def test_a_subclass_of_block_attnres_under_its_own_name_is_another_model_at_another_block_size(tmp_path):
    """The fields that one variant only reads (the block size: Block AttnRes') were compared
    for that variant's name alone: a subclass registered under its own name, which builds
    from the block size as Block AttnRes does, resumed at another block size without a word,
    and init_from loaded its weights into another block size unrefused - another model from
    the same weights. Both say it now, as for Block AttnRes; Full AttnRes still reads none."""
    from attnres.checkpoint import Source
    from attnres.models.residual_change import changed_residual_fields
    from attnres.train.config import TrainConfig
    from attnres.train.resume import check_resumable

    model = ModelConfig(vocab_size=64, d_model=32, n_layers=8, n_heads=2, max_seq_len=32,
                        residual={"kind": "block_alias_test", "block_size": 2})
    other = model.replace(residual={"block_size": 4})
    assert AttnResLM(other).residual.block_size == 4
    saved = TrainConfig(model=model, seq_len=16).to_dict()
    with pytest.raises(ValueError, match=r"differs in \['model.residual.block_size'\] "
                                         r"\(model.residual.block_size: 2 there, 4 here"):
        check_resumable(saved, TrainConfig(model=other, seq_len=16).to_dict(),
                        Source(tmp_path / "step-00000001", {"config": saved, "step": 1}))
    assert changed_residual_fields(model.to_dict(), other) == ["residual.block_size"]
    full = model.replace(residual={"kind": "attnres_full"})
    assert changed_residual_fields(full.to_dict(), full.replace(residual={"block_size": 4})) == []


@register_residual("block_scaled_test", replace=True)
class BlockScaledResidual(SingleStreamResidual):
    """A user's variant that builds from the block size without being Block AttnRes: one
    learned scalar per block of ``block_size`` sublayers."""

    reads_fields = frozenset({"block_size"})

    def __init__(self, dim: int, n_sublayers: int, block_size: int = 1) -> None:
        super().__init__(dim, n_sublayers)
        self.block_size = block_size
        self.scale = nn.Parameter(torch.ones(-(-n_sublayers // block_size)))

    @classmethod
    def from_config(cls, config, dim: int, n_sublayers: int) -> BlockScaledResidual:
        return cls(dim, n_sublayers, config.resolved_block_size(n_sublayers))

    def update(self, l: int, h: Tensor, out: Tensor) -> Tensor:
        return h + self.scale[l // self.block_size].to(out.dtype) * out


def test_a_users_variant_that_declares_the_block_size_it_reads_is_another_model_at_another_one(tmp_path):
    """Which residual fields a variant reads was decided by its class (Block AttnRes and its
    subclasses read the block size): a user's variant that builds from the block size
    otherwise resumed at another block size without a word - another model from the same
    steps. A variant names the fields it reads (``reads_fields``): a resume at another block
    size is refused, naming it, and a variant that declares none compares none; a field no
    variant can read (misspelt) is refused at registration."""
    from attnres.checkpoint import Source
    from attnres.train.config import TrainConfig
    from attnres.train.resume import check_resumable

    model = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=2, max_seq_len=32,
                        residual={"kind": "block_scaled_test", "block_size": 2})
    other = model.replace(residual={"block_size": 4})
    assert AttnResLM(model).residual.scale.shape == (4,) and AttnResLM(other).residual.scale.shape == (2,)
    saved = TrainConfig(model=model, seq_len=16).to_dict()
    with pytest.raises(ValueError, match=r"differs in \['model.residual.block_size'\] "
                                         r"\(model.residual.block_size: 2 there, 4 here"):
        check_resumable(saved, TrainConfig(model=other, seq_len=16).to_dict(),
                        Source(tmp_path / "step-00000001", {"config": saved, "step": 1}))
    assert "residual.block_size" not in model.replace(residual=SCALED).resolved_fields()
    with pytest.raises(ValueError, match=r"^register_residual\('misspelt_test'\): .*Misspelt\.reads_fields must be a set "
                                         r"of 'block_size', 'full_group_size', 'hc_streams', 'sinkhorn_iters' .*; got frozenset\(\{'blocksize'\}\)"):
        @register_residual("misspelt_test")
        class Misspelt(BlockScaledResidual):
            reads_fields = frozenset({"blocksize"})


def test_a_users_variant_built_by_the_default_from_config_refuses_a_config_of_another_kind():
    """Each built-in variant's ``from_config`` refuses a config of another kind; a user's
    variant built by the default one (``ResidualStream.from_config``) was built from any
    config - ``ScaledResidual.from_config(ResidualConfig(kind="attnres_block"), d, L)`` a scaled
    residual, an ``attnres_block`` model's options read as its own. It refuses, naming the kind
    given and the one it builds; its own kind builds as before, and so does a subclass not
    registered of it. A class not registered is told how to give it a kind."""
    from attnres.nn.residual import ResidualConfig

    with pytest.raises(ValueError, match=r"^ScaledResidual.from_config builds residual 'scaled_test'; the config's kind "
                                         r"is 'attnres_block' \(BlockAttnRes\): build_residual\(config, dim, "
                                         r"n_sublayers\) builds the class its kind names$"):
        ScaledResidual.from_config(ResidualConfig(kind="attnres_block", block_size=2), 8, 4)
    assert type(ScaledResidual.from_config(ResidualConfig(kind="scaled_test", options={"init": 0.5}), 8, 4)) is \
        ScaledResidual

    class Subclass(ScaledResidual):
        pass

    class Unregistered(SingleStreamResidual):
        def update(self, l, h, out):
            return h + out

    assert type(Subclass.from_config(ResidualConfig(kind="scaled_test"), 8, 4)) is Subclass
    with pytest.raises(ValueError, match=r"^.*Unregistered.from_config builds a class not registered; the config's kind "
                                         r"is 'standard' \(StandardResidual\): .*, and register_residual\('my_residual'\) "
                                         r"above class .*Unregistered gives it a kind of its own$"):
        Unregistered.from_config(ResidualConfig(kind="standard"), 8, 4)
