"""Config keys of earlier versions (:mod:`attnres.migrations`): each old spelling loads to
the config its new spelling gives, with exactly one ``DeprecationWarning`` naming the old
and the new key; the committed configs of earlier runs still load."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from attnres import ModelConfig, ResidualConfig
from attnres.train.config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def loaded(build):
    """``build()`` and the messages of the deprecation warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = build()
    return value, [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


NEW = {"kind": "attnres_full", "schedule": "naive", "backend": "reference"}


@pytest.mark.parametrize(
    ("old", "old_key", "new_key"),
    [
        ({"kind": "attnres_full", "impl": "naive", "backend": "reference"}, "residual.impl", "residual.schedule"),
        ({"kind": "attnres_full", "schedule": "naive", "kernels": "reference"}, "residual.kernels", "residual.backend"),
        ({"kind": "attnres_full", "schedule": "naive", "kernels": "torch_graph"}, "residual.kernels='torch_graph'",
         "residual.backend='reference'"),
        ({"kind": "attnres_full", "schedule": "naive", "backend": "torch_graph"}, "residual.backend='torch_graph'",
         "residual.backend='reference'"),
    ],
)
def test_each_old_residual_key_loads_to_the_same_config_with_one_warning(old, old_key, new_key):
    fields = ModelConfig.preset("tiny").to_dict()
    for build in (lambda residual: ModelConfig.preset("tiny", residual=residual),
                  lambda residual: ModelConfig.from_dict({**fields, "residual": residual}),
                  lambda residual: ModelConfig(**{**fields, "residual": residual})):
        cfg, messages = loaded(lambda: build(old))
        assert cfg == build(NEW)
        assert messages == [f"ModelConfig.{old_key} is deprecated: use ModelConfig.{new_key}"]
    cfg, messages = loaded(lambda: ResidualConfig(**old))
    assert cfg == ResidualConfig(**NEW) and len(messages) == 1


@pytest.mark.parametrize(
    ("flat", "new_key", "value"),
    [("attnres_impl", "residual.schedule", "naive"), ("attnres_kernels", "residual.backend", "torch"),
     ("attnres_kernels='torch_graph'", "residual.backend='reference'", "torch_graph")],
)
def test_each_old_flat_key_loads_to_the_same_config_with_one_warning(flat, new_key, value):
    key = flat.split("=")[0]
    new = {"schedule": value} if key == "attnres_impl" else {"backend": "reference" if value == "torch_graph" else value}
    want = ModelConfig.preset("tiny", residual=new)
    cfg, messages = loaded(lambda: ModelConfig.preset("tiny", **{key: value}))
    assert cfg == want and messages == [f"ModelConfig.{flat} is deprecated: use ModelConfig.{new_key}"]


def test_old_attributes_read_the_new_fields_with_a_warning():
    cfg = ModelConfig.preset("tiny", residual={"schedule": "naive", "backend": "torch"})
    for read, value in [(lambda: cfg.residual.impl, "naive"), (lambda: cfg.residual.kernels, "torch"),
                        (lambda: cfg.attnres_impl, "naive"), (lambda: cfg.attnres_kernels, "torch")]:
        got, messages = loaded(read)
        assert got == value and len(messages) == 1
    with pytest.raises(AttributeError):
        cfg.residual.nonsense  # noqa: B018


def test_cli_overrides_with_the_old_keys_keep_working(tmp_path):
    want = load_config(None, ["model.residual.backend=triton", "model.residual.schedule=naive"])
    for overrides in (["model.residual.kernels=triton", "model.residual.impl=naive"],
                      ["model.residual.kernels=triton", "model.residual.schedule=naive"]):
        cfg, messages = loaded(lambda: load_config(None, overrides))
        old = [o.split("=")[0].removeprefix("model.") for o in overrides if "kernels" in o or "impl" in o]
        assert cfg.model == want.model and len(messages) == 1 and all(f"ModelConfig.{k}" in messages[0] for k in old)
    # A saved config with the new keys, overridden with an old one: the override wins.
    saved = tmp_path / "run.yaml"
    saved.write_text(json.dumps(want.to_dict()))
    cfg, messages = loaded(lambda: load_config(saved, ["model.residual.kernels=torch"]))
    assert cfg.model.residual.backend == "torch" and len(messages) == 1


def test_an_unknown_old_value_is_still_refused_naming_the_new_field():
    with pytest.raises(ValueError, match=r"ModelConfig.residual.backend must be one of 'auto', 'torch', 'triton', "
                                         r"'reference'; got 'cuda'"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            ModelConfig.preset("tiny", residual={"kernels": "cuda"})


def model_sections(data):
    """Every mapping inside ``data`` that describes a model (it has a ``residual``)."""
    if isinstance(data, dict):
        if "residual" in data:
            yield data
        for value in data.values():
            yield from model_sections(value)
    elif isinstance(data, list):
        for value in data:
            yield from model_sections(value)


#: Committed configs of earlier runs, one per spelling they hold: flat ``attnres_*`` keys with
#: ``distributed`` (a run's config), nested ``impl`` / ``kernels`` (an upcycling's pretraining).
COMMITTED = ["results/ablation-small/full+input_independent_mixing/seed0/config.json",
             "results/block-size-small/s4/seed0/config.json",
             "results/upcycle-moe/config.json"]


@pytest.mark.parametrize("path", COMMITTED)
def test_committed_configs_with_old_keys_load_with_one_warning_per_config(path):
    data = json.loads((ROOT / path).read_text())
    if "model" in data:
        config, messages = loaded(lambda: TrainConfig.from_dict(data))
        models = [config.model]
    else:
        section = next(model_sections(data))
        model, messages = loaded(lambda: ModelConfig.from_dict(section))
        models = [model]
    assert messages and len(messages) == len(set(messages))  # one warning per config
    assert all("is deprecated: use" in m or "keys of an earlier version are deprecated" in m for m in messages)
    assert all(m.residual.schedule in ("two_phase", "naive") and m.residual.backend == "auto" for m in models)


def test_every_committed_model_config_loads():
    """Every model described by a committed config.json under results/ loads, old keys and all."""
    paths = sorted((ROOT / "results").rglob("config.json"))
    sections = [s for p in paths for s in model_sections(json.loads(p.read_text()))]
    assert len(sections) > 20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for section in sections:
            ModelConfig.from_dict(section)


def test_a_config_saved_by_an_earlier_version_gives_one_warning_naming_every_old_key():
    """A checkpoint of the flat-key era holds up to 13 old keys, which the user never wrote:
    one warning names them all with their new places (was: one line each, on every command
    that read the checkpoint, and again for its export)."""
    flat = {"attnres_block_size": 2, "attnres_impl": "naive", "attnres_kernels": "torch_graph", "hc_streams": 4}
    want = ModelConfig.preset("tiny", residual={"block_size": 2, "schedule": "naive", "backend": "reference"})
    fields = {k: v for k, v in ModelConfig.preset("tiny").to_dict().items() if k != "residual"}
    for build in (lambda: ModelConfig.from_dict({**fields, **flat}), lambda: ModelConfig.preset("tiny", **flat)):
        cfg, messages = loaded(build)
        assert cfg == want and messages == [
            "4 keys of an earlier version are deprecated: ModelConfig.attnres_block_size -> "
            "ModelConfig.residual.block_size, ModelConfig.attnres_impl -> ModelConfig.residual.schedule, "
            "ModelConfig.attnres_kernels='torch_graph' -> ModelConfig.residual.backend='reference', "
            "ModelConfig.hc_streams -> ModelConfig.residual.hc_streams (read as the new ones; a config saved by "
            "this version writes those)"]
    pytest.importorskip("transformers")  # (the export's config)
    from attnres.hf import AttnResConfig

    _, messages = loaded(lambda: AttnResConfig(**{**fields, "residual": {"kind": "attnres_block", "impl": "naive"},
                                                  **flat}))
    assert len(messages) == 1 and all(key in messages[0] for key in [*flat, "residual.impl"])



def test_a_checkpoint_storing_a_committed_config_of_an_earlier_version_loads_and_resumes(tmp_path):
    """The migrations were met from real old files as configs only: a checkpoint whose
    state.json stores one (a committed run's config of the flat-key era, with the
    ``distributed`` key, as that version's attnres train wrote it) loads with load_run into the
    model the migrated config describes, and ``attnres train --resume`` builds its config from
    it. None warns of the old keys: the checkpoint stores them, the user never wrote them
    (load_run - attnres generate, eval, analyze, export - warned "13 keys of an earlier version
    are deprecated"); nor does attnres eval's look at the stored model's context length."""
    import shutil

    import torch

    from attnres import AttnResLM
    from attnres.checkpoint import write_checkpoint
    from attnres.cli.eval import _checkpoint_model_config
    from attnres.distributed import ParallelConfig
    from attnres.inference import load_run
    from attnres.train.resume import config_of_the_run

    path = ROOT / COMMITTED[0]
    data = json.loads(path.read_text())
    assert "attnres_impl" in data["model"] and data["distributed"] == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = AttnResLM(ModelConfig.from_dict(data["model"]))
    run = tmp_path / "run"
    write_checkpoint(run, 2, model.state_dict(), {"state": {}, "param_groups": []}, {"config": data}, keep=1)
    shutil.copy(path, run / "config.json")
    loaded_run, messages = loaded(lambda: load_run(run))
    assert loaded_run.model.config == model.config and loaded_run.model.config.residual.kind == "attnres_full"
    assert loaded_run.model.config.residual.ablation.input_independent_mixing
    assert all(torch.equal(a, b) for a, b in zip(loaded_run.model.state_dict().values(), model.state_dict().values()))
    assert messages == []
    stored, messages = loaded(lambda: _checkpoint_model_config(str(run)))
    assert stored == model.config and messages == []
    (config, source), _ = loaded(lambda: config_of_the_run(TrainConfig(out_dir=str(run)), []))
    assert source == run / "checkpoints" / "step-00000002"
    assert config.model == model.config and config.parallel == ParallelConfig() and config.steps == data["steps"]


def test_report_only_and_status_over_a_grid_of_an_earlier_version_do_not_warn_of_its_stored_keys(tmp_path, capsys):
    """`attnres compare --report-only` over a copy of results/compare-long (docs/experiments.md),
    whose runs' config.json an earlier version wrote with 13 flat ``attnres_*`` keys, warned
    "13 keys of an earlier version are deprecated: ..." - keys the user never wrote (the
    report's mixing section built each run's model from its config.json). It and `attnres
    status` now read those configs without a deprecation warning, and the report is written."""
    import shutil

    from attnres.cli import main as cli_main

    out = tmp_path / "compare-long"
    shutil.copytree(ROOT / "results" / "compare-long", out)
    stored = json.loads((out / "block" / "seed0" / "config.json").read_text())["model"]
    assert {"attnres_impl", "attnres_block_size", "hc_streams"} <= set(stored)  # (what an earlier version wrote)
    (out / "report.md").unlink()
    for command in (["compare", "--out", str(out), "--report-only"], ["status", str(out)]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cli_main(command) == 0
        said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
        assert said == [], (command, said)
        assert "deprecated" not in capsys.readouterr().err
    assert "## Depth mixing matrices" in (out / "report.md").read_text()


def test_a_config_the_user_passes_with_the_old_spellings_still_warns(tmp_path):
    """What the report reads quietly (:func:`attnres.migrations.stored_config`) is the
    earlier version's stored config only: the same keys in a --config file of the user's, or
    in an override beside a stored config, still warn, and read the same within it."""
    import yaml

    from attnres.migrations import stored_config
    from attnres.train.config import load_config

    data = json.loads((ROOT / COMMITTED[0]).read_text())
    file = tmp_path / "old.yaml"
    file.write_text(yaml.safe_dump(data))
    config, messages = loaded(lambda: load_config(file))
    assert len(messages) == 2 and any("13 keys of an earlier version are deprecated" in m for m in messages)
    assert any(m.startswith("TrainConfig.distributed is deprecated") for m in messages)
    with stored_config():
        quiet, none = loaded(lambda: load_config(file))
    assert none == [] and quiet == config
    _, after = loaded(lambda: ModelConfig.from_dict({**data["model"]}))
    assert len(after) == 1  # (the quiet is over when the stored config is read)
    # a resumed run of an earlier version's checkpoint: its stored keys are quiet, an old key the user gives is not
    from attnres import AttnResLM
    from attnres.checkpoint import write_checkpoint
    from attnres.train.resume import config_of_the_run

    run = tmp_path / "run"
    write_checkpoint(run, 2, AttnResLM(config.model).state_dict(), {"state": {}, "param_groups": []}, {"config": data},
                     keep=1)
    _, resumed = loaded(lambda: config_of_the_run(TrainConfig(out_dir=str(run)), []))
    _, given = loaded(lambda: config_of_the_run(TrainConfig(out_dir=str(run)), ["distributed=auto"]))
    assert resumed == [] and len(given) == 1 and given[0].startswith("TrainConfig.distributed is deprecated")


def test_a_stored_config_read_in_one_thread_leaves_another_threads_warnings(monkeypatch):
    """stored_config() set a flag of the process: while a thread read a checkpoint's config (a
    data loader, a server's thread), the warning of an old key the user gave in another was
    silenced, and a stored config read while the user's thread was inside warned. The quiet
    belongs to the thread (contextvars) that reads the stored config."""
    import threading

    import attnres.migrations as migrations
    from attnres.migrations import stored_config

    said: list[tuple[str, str]] = []
    monkeypatch.setattr(migrations, "warn_user",
                        lambda message, *args: said.append((threading.current_thread().name, message)))
    inside, go_on = threading.Event(), threading.Event()

    def reads_a_stored_config() -> None:
        with stored_config():
            inside.set()
            go_on.wait(10)
            ModelConfig(attnres_block_size=2)  # the stored config's own old key: quiet

    def the_users_config() -> None:
        ModelConfig(attnres_block_size=2)  # given by the user: warns

    loader = threading.Thread(target=reads_a_stored_config, name="loader")
    loader.start()
    assert inside.wait(10)
    ModelConfig(attnres_block_size=2)  # the user's, in the main thread
    go_on.set()
    loader.join(10)
    with stored_config():  # and the other way round: the user's thread given an old key while this one reads
        user = threading.Thread(target=the_users_config, name="user")
        user.start()
        user.join(10)
        ModelConfig(attnres_block_size=2)
    assert [name for name, _ in said] == ["MainThread", "user"]
    assert all("attnres_block_size is deprecated" in message for _, message in said)
