"""The package's warnings name the user's line (``attnres.user_warning.warn_user``), not one of
the package's own: Python showed ``.../attnres/migrations.py:77: DeprecationWarning`` and a line
of our source, and hid a ``DeprecationWarning`` raised so outside ``__main__``. The ``attnres``
command still prints each as its own one line."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from attnres import AttnResLM, ModelConfig
from attnres.ops.depth_attention import cpu_kernel


def _caught(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return caught


def _assert_named_here(caught: list[warnings.WarningMessage], category: type[Warning], text: str) -> None:
    ours = [w for w in caught if issubclass(w.category, category) and text in str(w.message)]
    assert ours, [str(w.message) for w in caught]
    assert [(w.filename, w.category) for w in ours] == [(__file__, category)] * len(ours)


def test_a_deprecated_key_names_the_users_line():
    """attnres.migrations, through the dataclasses' generated ``__init__`` (a nested residual
    key named a line of migrations.py) and ``load_config`` (one of train/config.py)."""
    caught = _caught(lambda: ModelConfig(residual={"kind": "attnres_full", "impl": "naive"}))
    _assert_named_here(caught, DeprecationWarning, "residual.impl is deprecated")
    _assert_named_here(_caught(lambda: ModelConfig(attnres_block_size=4)), DeprecationWarning,
                       "attnres_block_size is deprecated")
    config = ModelConfig()
    _assert_named_here(_caught(lambda: config.residual.impl), DeprecationWarning, "ResidualConfig.impl is deprecated")


def test_a_deprecated_override_names_the_users_load_config():
    pytest.importorskip("yaml")
    from attnres.train import load_config

    caught = _caught(lambda: load_config(None, ["model.attnres_block_size=4"]))
    _assert_named_here(caught, DeprecationWarning, "attnres_block_size is deprecated")


def test_a_json_data_file_names_the_users_line(tmp_path):
    """attnres.data.corpus: a ``.json`` file read as plain text."""
    from attnres.data.corpus import load_corpus

    path = tmp_path / "text.json"
    path.write_text("a line of text\n" * 100)
    _assert_named_here(_caught(lambda: load_corpus([str(path)])), UserWarning, "is read as plain text")


def test_non_finite_logits_name_the_users_generate_call():
    """attnres.inference.generate: the warning is raised in the generator behind ``generate``."""
    from attnres.inference import generate

    model = AttnResLM(ModelConfig.preset("tiny")).eval()
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    caught = _caught(lambda: generate(model, torch.tensor([[1, 2]]), max_new_tokens=2))
    _assert_named_here(caught, RuntimeWarning, "are not finite")


def test_a_truncated_metrics_line_names_the_users_line(tmp_path):
    """attnres.train.metrics."""
    from attnres.train.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "tr')
    _assert_named_here(_caught(lambda: read_metrics(path)), UserWarning, "skipped 1 unreadable line(s)")


def test_the_cpu_kernel_failing_to_build_names_the_users_forward(monkeypatch, tmp_path):
    """attnres.ops: raised inside a training forward, which ``torch.nn.Module.__call__`` and
    the dispatcher run; the user's line is the model's call."""
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    model = AttnResLM(ModelConfig.preset("tiny"))
    ids = torch.randint(0, 256, (2, 8))
    cpu_kernel.cpu_kernel.cache_clear()
    try:
        caught = _caught(lambda: model(ids, labels=ids).loss.backward())
    finally:
        cpu_kernel.cpu_kernel.cache_clear()
    _assert_named_here(caught, UserWarning, "the CPU kernel could not be built")


def test_the_command_prints_the_packages_warning_once_as_its_own(monkeypatch, capsys):
    """The ``attnres`` command names no user's line: a deprecated preset is one line of its own,
    ``attnres: warning: ...``, not Python's ``file:line: DeprecationWarning`` and a source line."""
    pytest.importorskip("yaml")
    from attnres.cli import run

    monkeypatch.setattr(sys, "argv", ["attnres", "train", "--print-config", "model=demo"])
    with warnings.catch_warnings():
        with pytest.raises(SystemExit) as done:
            run()
    assert done.value.code == 0
    err = capsys.readouterr().err
    assert err == ("attnres: warning: model preset 'demo' is now called 'train-cpu' ('demo' names the `attnres compare` "
                   "/ `make demo` grid); the old name will be removed\n")


@pytest.mark.parametrize("given, said", [
    ("model=demo", "model preset 'demo' is now called 'train-cpu'"),
    ("model.attnres_block_size=2", "ModelConfig.attnres_block_size is deprecated: use ModelConfig.residual.block_size"),
])
def test_the_command_shows_its_deprecations_under_pythons_own_filters(given, said, monkeypatch, capsys):
    """``attnres train`` holds back the warnings of building its config (a resume without a
    config file shows the run's own instead) and then shows them: issued anew, without the
    module that raised them, a ``DeprecationWarning`` of the package fell to Python's default
    "ignore" (pytest's own filters, which show every one, hid that)."""
    pytest.importorskip("yaml")
    from attnres.cli import run

    monkeypatch.setattr(sys, "argv", ["attnres", "train", "--print-config", given])
    with warnings.catch_warnings():
        warnings.resetwarnings()  # (Python's defaults outside __main__, as the command runs)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        with pytest.raises(SystemExit) as done:
            run()
    assert done.value.code == 0
    assert f"attnres: warning: {said}" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["-c", "stdin"])
def test_a_warning_for_a_line_of_python_c_or_standard_input_is_shown(how):
    """``python -c`` and a script on standard input (as the interactive interpreter) run in a
    ``__main__`` loaded by the built-in importer: passed on as ``warn_explicit``'s
    ``module_globals``, it made every warning of the package an ImportError, "'__main__' is not
    a built-in module" (a warm-up longer than the run, a missing matplotlib in ``attnres
    analyze``: the work stopped)."""
    import os
    import subprocess
    from pathlib import Path

    code = "from attnres import ModelConfig\nModelConfig(attnres_block_size=4)\nprint('done')\n"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    argv, stdin = ([sys.executable, "-c", code], None) if how == "-c" else ([sys.executable, "-"], code)
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr[-2000:]
    where = "<string>" if how == "-c" else "<stdin>"
    assert f"{where}:2: DeprecationWarning: ModelConfig.attnres_block_size is deprecated" in done.stderr
