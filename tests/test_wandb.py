"""``wandb_project=NAME``: the run's metrics mirrored to Weights & Biases (attnres.train.wandb_log).

W&B itself is stood in for by a module that records what it is given (the real package,
where installed, runs once in offline mode: no network)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types
import warnings
from pathlib import Path

import pytest

pytest.importorskip("yaml")

from test_train import overrides, write_corpus  # noqa: E402

from attnres.train import load_config, train  # noqa: E402
from attnres.train.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


class FakeWandb(types.ModuleType):
    """The part of ``wandb`` the mirror uses, recording its calls."""

    def __init__(self, fail: Exception | None = None) -> None:
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.errors = types.SimpleNamespace(Error=type("Error", (Exception,), {}))
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.finished = 0
        self.configs: list[dict] = []  # the config given at init, then each update
        self.exit_codes: list = []
        self.fail = fail
        self.starting_step = 0  # where W&B's steps of a resumed run go on from

    def init(self, **kwargs):
        if self.fail is not None:
            raise self.errors.Error(str(self.fail))
        self.inits.append(kwargs)
        self.configs.append(dict(kwargs.get("config") or {}))
        config = types.SimpleNamespace(update=lambda values, allow_val_change=False: self.configs.append(dict(values)))
        return types.SimpleNamespace(log=lambda values, step: self.logged.append((step, dict(values))),
                                     finish=self._finish, starting_step=self.starting_step, config=config)

    def _finish(self, exit_code=None) -> None:
        self.finished += 1
        self.exit_codes.append(exit_code)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus.txt")


def test_a_run_mirrors_its_records_and_a_resumed_run_continues_the_same_wandb_run(tmp_path, corpus, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    train(load_config(None, overrides(corpus, out, wandb_project="attnres-tests", stop_after=3, checkpoint_every=3)))
    (init,) = fake.inits
    assert init["project"] == "attnres-tests" and init["name"] == str(out) and init["resume"] == "allow"
    assert init["dir"] == str(out) and init["config"]["model"]["residual"]["kind"] == "attnres_block"
    assert json.loads((out / "wandb.json").read_text()) == {"id": init["id"], "project": "attnres-tests"}
    assert fake.finished == 1
    # every scalar of metrics.jsonl, at its step, under <kind>/<name> (lists: one per element)
    want: dict[int, dict] = {}
    for record in read_metrics(out / "metrics.jsonl"):
        for name, value in record.items():
            if name in ("kind", "step") or value is None:
                continue
            values = enumerate(value) if isinstance(value, list) else [(None, value)]
            for i, v in values:
                if isinstance(v, (int, float)):
                    key = f"{record['kind']}/{name}" + ("" if i is None else f"/{i}")
                    want.setdefault(record["step"], {})[key] = v
    got: dict[int, dict] = {}
    for step, values in fake.logged:
        got.setdefault(step, {}).update(values)
    assert got == want and {"train/loss", "eval/val_loss", "diagnostics/block_grad_norm/0"} <= set(got[3])
    # --resume: the same W&B run, from the checkpoint's step on
    fake.logged.clear()
    train(load_config(None, overrides(corpus, out, wandb_project="attnres-tests", resume="true")))
    assert [i["id"] for i in fake.inits] == [init["id"]] * 2 and fake.finished == 2
    assert min(step for step, _ in fake.logged) == 4
    # a new run in another out_dir: another W&B run
    train(load_config(None, overrides(corpus, tmp_path / "other", wandb_project="attnres-tests", steps=2)))
    assert fake.inits[-1]["id"] != init["id"]


def test_a_resume_before_steps_the_wandb_run_already_holds_says_they_stay(tmp_path, corpus, monkeypatch):
    """A run interrupted after its last checkpoint had logged later steps to W&B, whose steps
    only go up: the redone steps are ignored there, which the resumed run now says."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    train(load_config(None, overrides(corpus, out, wandb_project="p", stop_after=2, checkpoint_every=2)))
    fake.starting_step = 5  # steps 3 and 4 logged, then the run was killed
    with pytest.warns(UserWarning, match=r"wandb_project='p': the W&B run \w+ already holds steps up to 4, logged "
                                         r"before the interruption; this run resumes at step 3, so W&B keeps the old "
                                         r"values of steps 3-4 and ignores the redone ones"):
        train(load_config(None, overrides(corpus, out, wandb_project="p", resume="true", stop_after=4,
                                          checkpoint_every=2)))
    fake.starting_step = 5  # nothing logged beyond the checkpoint (step 4): no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="warmup_steps")
        train(load_config(None, overrides(corpus, out, wandb_project="p", resume="true", checkpoint_every=2)))
    assert fake.finished == 3


def test_without_wandb_nothing_is_mirrored(tmp_path, corpus, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    train(load_config(None, overrides(corpus, tmp_path / "run", steps=2)))
    assert fake.inits == [] and not (tmp_path / "run" / "wandb.json").exists()


def test_a_missing_package_or_a_bad_name_is_refused_before_any_work(tmp_path, corpus, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"wandb_project='p' needs the wandb package \((\S+ -m )?pip install .*\[wandb\]"):
        train(load_config(None, overrides(corpus, tmp_path / "run", wandb_project="p")))
    with pytest.raises(ValueError, match=r"TrainConfig.wandb_project must be a W&B project name: .* got 'team/p'"):
        train(load_config(None, overrides(corpus, tmp_path / "run", wandb_project="team/p")))
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="TrainConfig.wandb_project must be a Weights & Biases project name"):
        load_config(None, overrides(corpus, tmp_path / "run", wandb_project="''"))


def test_a_wandb_that_cannot_start_says_how_to_log_in_or_go_offline(tmp_path, corpus, monkeypatch):
    pytest.importorskip("tensorboard")
    from torch.utils import tensorboard

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(fail=RuntimeError("api_key not configured (no-tty)")))
    closed = []
    writer = tensorboard.SummaryWriter
    monkeypatch.setattr(tensorboard, "SummaryWriter", type("Writer", (writer,), {
        "close": lambda self: closed.append(self) or writer.close(self)}))
    with pytest.raises(ValueError, match=r"wandb_project='p': W&B could not start the run \(Error: api_key not "
                                         r"configured \(no-tty\)\); log in .*WANDB_MODE=offline"):
        train(load_config(None, overrides(corpus, tmp_path / "run", wandb_project="p", tensorboard="true")))
    assert closed == []  # W&B starts before the data is read, the TensorBoard writer after it


def test_a_wandb_that_cannot_start_is_said_before_the_data_is_read(tmp_path, corpus, monkeypatch):
    """Not logged in: the run stopped only after the whole corpus had been read and tokenised
    (minutes for a large one); now W&B starts before the data is read, and a fresh out_dir
    the failed start made is removed again."""
    from attnres.train import setup

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(fail=RuntimeError("api_key not configured (no-tty)")))
    read = []
    monkeypatch.setattr(setup, "load_corpus", lambda *a, **k: read.append(a) or pytest.fail("the data was read"))
    with pytest.raises(ValueError, match=r"wandb_project='p': W&B could not start the run"):
        train(load_config(None, overrides(corpus, tmp_path / "run", wandb_project="p")))
    assert read == [] and not (tmp_path / "run").exists()


def test_the_wandb_run_gets_the_config_the_data_resolves(tmp_path, corpus, monkeypatch):
    """W&B starts before the data is read; the model's vocabulary, which the tokenizer sets,
    reaches its config once known, and a set-up that fails after it started marks its W&B
    run failed and leaves no wandb.json in a fresh out_dir."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    train(load_config(None, overrides(corpus, out, wandb_project="p", steps=2, **{"data.tokenizer": "bpe",
                                                                                    "data.vocab_size": 300})))
    (init,) = fake.inits
    assert fake.configs[-1]["model"]["vocab_size"] == json.loads((out / "config.json").read_text())["model"][
        "vocab_size"] != init["config"]["model"]["vocab_size"]
    small = tmp_path / "small.txt"
    small.write_text("too small to split\n")
    with pytest.raises(ValueError, match="too small"):
        train(load_config(None, overrides(small, tmp_path / "fails", wandb_project="p")))
    assert fake.exit_codes[-1] == 1 and not (tmp_path / "fails").exists()


def test_the_real_package_offline(tmp_path, corpus, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    train(load_config(None, overrides(corpus, out, wandb_project="attnres-tests", steps=2)))
    run_id = json.loads((out / "wandb.json").read_text())["id"]
    assert list((out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
