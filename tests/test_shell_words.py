"""The commands attnres prints for the user to paste (in backticks in its messages) name the
user's paths as one shell word each: a run under ``Läufe 2026/run 'b'`` was printed bare, and
the pasted command split it at the space (or stopped at the quote)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from attnres.checkpoint.locate import refuse_loading_training_output, refuse_out_dir_not_a_run
from attnres.shell_words import shell_path
from attnres.train.status import refuse_a_folder_of_runs

NAMES = ["Läufe 2026/run 'b'", "my run", "-x", "a=b", "$HOME [x]", "null", "1e3"]


@pytest.mark.parametrize("name", NAMES)
def test_a_path_reads_back_as_itself_in_bash(name):
    """bash itself, not only shlex: the word comes back as the path (``-x`` as ``./-x``, the
    same folder, which argparse does not take for an option)."""
    said = subprocess.run(["bash", "-c", f"printf '%s' {shell_path(name)}"], capture_output=True, text=True,
                          check=True).stdout
    assert said == (f"./{name}" if name.startswith("-") else name)
    assert shell_path("runs/plain") == "runs/plain"  # (nothing to quote: printed as it was)


def _commands(message: str) -> list[list[str]]:
    """The backticked commands of ``message`` as the shell splits them."""
    return [shlex.split(c) for c in re.findall(r"`([^`]+)`", message)]


def _run(folder: Path) -> Path:
    """A training run's files, as far as the refusals look: config, log, one checkpoint."""
    (folder / "checkpoints" / "step-00000001").mkdir(parents=True)
    (folder / "checkpoints" / "step-00000001" / "state.json").write_text("{}")
    (folder / "config.json").write_text("{}")
    (folder / "metrics.jsonl").write_text("")
    return folder


def test_out_dir_in_a_checkpoint_names_the_run_pasteably(tmp_path):
    run = _run(tmp_path / "Läufe 2026" / "run 'b'")
    step = run / "checkpoints" / "step-00000001"
    with pytest.raises(ValueError) as refused:
        refuse_out_dir_not_a_run(step)
    commands = _commands(str(refused.value))
    assert ["attnres", "train", f"out_dir={run}", "--resume"] in commands
    assert ["--resume-from", str(step), f"out_dir={run}"] in commands
    # (with the run's config, which builds its model: init_from alone builds the default one)
    assert ["attnres", "train", "--config", str(run / "config.json"), f"init_from={step}", "out_dir=DIR"] in commands


@pytest.mark.parametrize(("parallel", "launch", "ranks"), [
    ({"tp": 2, "pp": 1, "dp": None}, {"world_size": 4, "local_world_size": 4}, "--nproc-per-node 4"),
    ({"tp": 2, "pp": 2, "dp": None}, None, "--nproc-per-node 4"),  # (no launch recorded: the fewest ranks)
    ({"tp": 2, "pp": 1, "dp": 2}, {"world_size": 3, "local_world_size": 3}, "--nproc-per-node 4"),  # (not its layout)
    ({"tp": 1, "pp": 2, "dp": None}, {"world_size": 4, "local_world_size": 2}, "..."),  # (two nodes: the user's)
])
def test_the_train_on_command_of_a_tp_pp_run_is_launched_as_its_layout_asks(tmp_path, parallel, launch, ranks):
    """A tp/pp run's config.json keeps its ``parallel.*`` layout, which ``--config`` takes: the
    printed train-on command (``attnres train --config RUN/config.json init_from=... out_dir=DIR``)
    run as printed, in one process, was refused (the layout asks for several ranks). It is
    launched under torchrun on the ranks the run recorded, where they fit its layout."""
    import json

    from attnres.checkpoint.locate import train_on_from
    from attnres.distributed.parallel import ParallelConfig, resolve_degrees

    run = _run(tmp_path / "run")
    (run / "config.json").write_text(json.dumps({"model": {}, "parallel": parallel}))
    state = {"launch": launch} if launch is not None else {}
    (run / "checkpoints" / "step-00000001" / "state.json").write_text(json.dumps(state))
    command = train_on_from(run)[1]
    torchrun = "torchrun ..." if ranks == "..." else f"torchrun --standalone {ranks}"
    assert command == f"{torchrun} -m attnres train --config {run / 'config.json'} init_from={run} out_dir=DIR"
    if ranks != "...":  # (the layout resolves on the ranks launched)
        resolve_degrees(ParallelConfig.from_dict(parallel), int(ranks.split()[-1]))
    (run / "config.json").write_text(json.dumps({"model": {}}))  # a one-process run: as it was
    (run / "checkpoints" / "step-00000001" / "state.json").write_text(json.dumps({"launch": {"world_size": 1}}))
    assert train_on_from(run)[1] == f"attnres train --config {run / 'config.json'} init_from={run} out_dir=DIR"


def test_the_train_on_command_imports_the_runs_own_residual(tmp_path):
    """A run of a residual of the user's own (``attnres --import my_pkg.residuals train ...``)
    records its imports; the printed train-on command left ``--import`` out and, pasted, could
    not build the model ("residual 'my_res' is not registered"). It names them, before the
    command (an option of ``attnres`` itself), under torchrun too."""
    import json

    from attnres.checkpoint.locate import train_on_from

    run = _run(tmp_path / "run")
    (run / "config.json").write_text(json.dumps({"model": {}}))
    state = (run / "checkpoints" / "step-00000001" / "state.json")
    imports = {"given": ["my_pkg.residuals", "/home/me/my res.py"], "residual": "my_res", "residual_module": "my_pkg.residuals"}
    state.write_text(json.dumps({"imports": imports}))
    rest = f"train --config {run / 'config.json'} init_from={run} out_dir=DIR"
    flags = "--import my_pkg.residuals --import '/home/me/my res.py'"
    assert train_on_from(run)[1] == f"attnres {flags} {rest}"
    assert shlex.split(train_on_from(run)[1])[:5] == ["attnres", "--import", "my_pkg.residuals", "--import", "/home/me/my res.py"]
    state.write_text(json.dumps({"imports": {**imports, "given": []}}))  # (imported in Python: its module)
    assert train_on_from(run)[1] == f"attnres --import my_pkg.residuals {rest}"
    (run / "config.json").write_text(json.dumps({"model": {}, "parallel": {"tp": 2}}))
    assert train_on_from(run)[1] == f"torchrun --standalone --nproc-per-node 2 -m attnres --import my_pkg.residuals {rest}"
    state.write_text(json.dumps({"imports": {**imports, "given": [], "residual_module": None}}))  # a built-in one
    assert train_on_from(run)[1] == f"torchrun --standalone --nproc-per-node 2 -m attnres {rest}"


def test_a_folder_of_runs_names_its_run_pasteably(tmp_path):
    runs = tmp_path / "Läufe 2026"
    run = _run(runs / "run 'b'")
    with pytest.raises(ValueError) as refused:
        refuse_a_folder_of_runs(runs)
    assert _commands(str(refused.value)) == [["attnres", "train", f"out_dir={run}", "--resume"]]
    assert f"(out_dir={shlex.quote(str(runs / 'NAME'))})" in str(refused.value)


def test_loading_a_run_as_transformers_names_the_export_pasteably(tmp_path):
    run = _run(tmp_path / "Läufe 2026" / "run 'b'")
    with pytest.raises(ValueError) as refused:
        refuse_loading_training_output(run)
    assert _commands(str(refused.value)) == [["attnres", "export", str(run), "--out", "DIR"]]


def test_a_stopped_runs_commands_paste_back_to_it(tmp_path, capsys):
    """End to end, a run under a folder with a space, a non-ASCII letter and a quote: the
    "continue with" hint of a stopped run and status's resume command give its out_dir back,
    and resuming it with another ``steps`` is refused naming its checkpoint as ``init_from``
    that pastes (it was printed bare)."""
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main

    (tmp_path / "Läufe 2026").mkdir()
    corpus = write_corpus(tmp_path / "Läufe 2026" / "my text.txt", n_lines=100)
    run = tmp_path / "Läufe 2026" / "run 'b'"
    assert cli_main(["train", *overrides(corpus, run, steps=3, stop_after=2, warmup_steps=0)]) == 0
    said = capsys.readouterr()
    (resume,) = _commands(said.out + said.err)
    assert resume == ["attnres", "train", f"out_dir={run}", "--resume"]
    assert cli_main(["status", str(run.parent)]) == 0
    assert _commands(capsys.readouterr().out) == [resume]
    with pytest.raises(SystemExit) as refused:
        cli_main([*resume[1:], "steps=4"])
    step = run / "checkpoints" / "step-00000002"
    assert f"`attnres train --config {shlex.quote(str(run / 'config.json'))} init_from={shlex.quote(str(step))} " \
           "out_dir=DIR` (fresh optimiser" in str(refused.value)


def test_the_train_on_command_of_a_stopped_resumed_run_trains_to_its_steps(tmp_path, capsys):
    """The train-on command a refused ``steps`` change prints (``--config RUN/config.json
    init_from=CHECKPOINT out_dir=DIR``), run as printed with DIR filled in and the longer
    ``steps`` asked for: the run's config.json held its last invocation's ``stop_after=2`` and
    ``resume=true``, so the new run stopped at step 2 without reaching its steps, or was refused
    as no run to resume. Left out with a note, it trains to its ``steps``; stated again as
    overrides, they are this run's."""
    from test_train import overrides, write_corpus

    from attnres.cli import main as cli_main

    corpus = write_corpus(tmp_path / "text.txt", n_lines=100)
    run = tmp_path / "run"
    assert cli_main(["train", *overrides(corpus, run, steps=3, stop_after=1, warmup_steps=0)]) == 0
    assert cli_main(["train", f"out_dir={run}", "--resume", "stop_after=2"]) == 0  # (config.json: resume=true)
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        cli_main(["train", f"out_dir={run}", "--resume", "steps=4"])
    (train_on,) = [c for c in _commands(str(refused.value)) if "--config" in c]
    train_on = [f"out_dir={tmp_path / 'longer'}" if word == "out_dir=DIR" else word for word in train_on]
    with pytest.warns(UserWarning, match=r"is a training run's config: left out its stop_after=2, resume=true, "):
        assert cli_main([*train_on[1:], "steps=4"]) == 0
    assert "finished at step 4" in capsys.readouterr().out
    assert cli_main([*train_on[1:], "steps=4", f"out_dir={tmp_path / 'short'}", "stop_after=1"]) == 0
    assert "stopped at step 1 of 4 (stop_after)" in capsys.readouterr().out


def test_the_left_out_note_of_a_runs_config_is_rank_zeros(tmp_path, monkeypatch):
    """``load_config(RUN/config.json)`` under torchrun: every rank reads the same file, and the
    note of its left-out ``stop_after`` was said once per rank. Rank 0 says it; the others
    leave the file's field out as quietly."""
    import json
    import warnings

    from attnres.train.config import TrainConfig, load_config

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)  # (a run's directory: its config.json is the run's)
    (run / "config.json").write_text(json.dumps({**TrainConfig().to_dict(), "stop_after": 2}))
    monkeypatch.setenv("RANK", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(run / "config.json").stop_after is None
    monkeypatch.setenv("RANK", "0")
    with pytest.warns(UserWarning, match=r"is a training run's config: left out its stop_after=2,"):
        load_config(run / "config.json")


def test_status_names_a_grid_folder_that_starts_with_a_dash_as_a_path(tmp_path, monkeypatch):
    """``attnres compare --out -g`` (from its folder): status's command to continue a stopped
    run of the grid said ``--out -g``, which argparse refuses ("expected one argument"). The
    grid's folder is given absolute now (to paste anywhere), which argparse reads as a path."""
    import json

    from attnres.cli.status import _continue_command

    monkeypatch.chdir(tmp_path)
    (tmp_path / "-g").mkdir()
    (tmp_path / "-g" / "experiment.json").write_text(json.dumps({"experiment": "compare", "preset": "tiny",
                                                                 "overrides": ["steps=3"]}))
    command = _commands(_continue_command("-g/block/seed0"))[0]  # (then the --variants hint's pieces)
    assert command == ["attnres", "compare", "--preset", "tiny", "--out", str(tmp_path / "-g"), "--seeds", "0", "steps=3"]
