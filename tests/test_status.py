"""``attnres status``: where the runs under some folders stand (attnres.train.status)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("yaml")

from test_train import overrides, write_corpus  # noqa: E402

from attnres.cli import main as cli_main  # noqa: E402
from attnres.train import load_config, train  # noqa: E402
from attnres.train.lock import RunLock  # noqa: E402
from attnres.train.metrics import read_metrics  # noqa: E402
from attnres.train.status import find_runs, run_status  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """runs/done (finished), runs/grid/block/seed0 (stopped at step 3 of 6), runs/hf (a
    transformers directory, no run)."""
    root = tmp_path_factory.mktemp("status")
    corpus = write_corpus(root / "corpus.txt")
    train(load_config(None, overrides(corpus, root / "runs" / "done")))
    train(load_config(None, overrides(corpus, root / "runs" / "grid" / "block" / "seed0", stop_after=3,
                                      checkpoint_every=3, **{"model.residual": "standard"})))
    (root / "runs" / "hf").mkdir()
    (root / "runs" / "hf" / "config.json").write_text("{}")
    return root / "runs"


def test_each_run_is_found_once_and_read_from_what_it_wrote(runs):
    assert find_runs(runs) == [runs / "done", runs / "grid" / "block" / "seed0"]  # not hf, not inside a run
    assert find_runs(runs / "done") == [runs / "done"]
    done = run_status(runs / "done")
    records = read_metrics(runs / "done" / "metrics.jsonl")
    last_train = [r for r in records if r["kind"] == "train"][-1]
    last_eval = [r for r in records if r["kind"] == "eval"][-1]
    assert (done.step, done.steps, done.checkpoint_step, done.state) == (6, 6, 6, "finished")
    assert (done.residual, done.n_layers) == ("attnres_block", 2)
    assert done.train_loss == last_train["loss"] and done.tokens_per_s == last_train["tokens_per_s"]
    assert (done.val_loss, done.val_step) == (last_eval["val_loss"], last_eval["step"])
    stopped = run_status(runs / "grid" / "block" / "seed0")
    assert (stopped.step, stopped.steps, stopped.checkpoint_step, stopped.state) == (3, 6, 3, "stopped")
    assert stopped.residual == "standard"


def test_a_run_in_progress_is_told_by_its_live_lock(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "grid" / "block" / "seed0", run)
    with RunLock(run):  # this process holds it, as a training process would
        status = run_status(run)
        assert status.state == "running" and status.holder.startswith("PID ")
    assert run_status(run).state == "stopped"
    (run / "run.lock").write_text(json.dumps({"pid": 2**22 + 7, "host": __import__("socket").gethostname()}))
    assert run_status(run).state == "stopped"  # a lock left by a killed process: not running


def test_the_command_prints_a_line_per_run(runs, capsys):
    assert cli_main(["status", str(runs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["run", "model", "step", "train", "loss", "val", "loss", "(at", "step)", "tok/s",
                                "(last", "1", "step)", "checkpoint", "state"]  # (log_every 1)
    # (S: a block-size sweep's runs, or runs/block4 beside runs/block8, read alike without it)
    assert len(lines) == 5 and "attnres_block S=2, 2 layers, d 64" in lines[1] and " 6/6 " in lines[1]
    assert "standard, 2 layers" in lines[2]
    assert lines[1].endswith("step 6      finished") and lines[2].endswith("stopped")
    stopped = lines[2].split()[0]  # and how to continue it
    assert lines[4].startswith(f"continue a stopped run with `attnres train out_dir={stopped} --resume`")
    assert cli_main(["status", str(runs), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["state"] for r in rows] == ["finished", "stopped"] and rows[1]["step"] == 3
    assert [r["block_size"] for r in rows] == [2, None]
    assert cli_main(["status", str(runs / "hf")]) == 0
    assert "no training runs under" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="attnres status: error: no such folder: '.*nowhere'"):
        cli_main(["status", str(runs / "nowhere")])


def _logged_run(path: Path, train_steps: list[int]) -> Path:
    """A run directory as far as status reads it: config.json and train records at ``train_steps``."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model": {"residual": "standard"}, "steps": 100}))
    (path / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 5.0, "tokens": 64 * s,
                                                            "tokens_per_s": 1000.0 * s}) + "\n" for s in train_steps))
    return path


def test_tokens_per_s_is_labelled_with_the_steps_of_its_last_logging_window(tmp_path, capsys):
    """The table's "tok/s" was the last logging window's rate alone (a run slowed down by another
    job read as slow throughout, a window of 5 steps beside one of 100 read alike), unlabelled:
    read as the run's mean. The header names the window's steps where every run's is as long,
    each cell otherwise; --json gives tokens_per_s_steps. A step a resume logged again (after
    a kill past its checkpoint) does not shorten the window to 0."""
    _logged_run(tmp_path / "a", [10, 20, 30])
    _logged_run(tmp_path / "b", [10, 20, 30, 20, 30])  # (resumed at 10 after a kill at 35)
    assert run_status(tmp_path / "b").tokens_per_s_steps == 10
    assert cli_main(["status", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "tok/s (last 10 steps)" in lines[0] and "  30,000  " in lines[1] and "(10 steps)" not in lines[1]
    _logged_run(tmp_path / "c", [10, 20, 25])  # (its last step, 25: a window of 5)
    _logged_run(tmp_path / "d", [1])
    assert cli_main(["status", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "tok/s (last window)" in lines[0] and "30,000 (10 steps)" in lines[1] and "25,000 (5 steps)" in lines[3]
    assert "1,000 (1 step)" in lines[4]
    assert cli_main(["status", str(tmp_path / "c"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens_per_s_steps"] == 5


def test_a_run_named_twice_by_different_paths_is_one_run(runs, capsys, monkeypatch, tmp_path):
    """`attnres status /abs/runs/done runs/done` listed the run twice, and `attnres plot` of the
    two drew one run labelled "." (the two paths' common folder is the run itself)."""
    monkeypatch.chdir(runs.parent)
    spellings = [str(runs / "done"), "runs/done", "runs/grid/../done/"]
    assert cli_main(["status", *spellings]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith(str(runs / "done"))  # the header and the run, as first named
    out = tmp_path / "curves.png"
    assert cli_main(["plot", *spellings, "--out", str(out)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("(1 run: done)")


@pytest.mark.parametrize("command", ["status", "plot"])
def test_a_hugging_face_model_directory_is_said_to_be_one(tmp_path, command, capsys):
    """`attnres status llama-attnres` (an upcycle) said "no training runs under" it, and `plot`
    the same as an error, as of a folder not trained into yet: it is a model, and the message
    names what reads it and how to train a run from it."""
    model = tmp_path / "llama-attnres"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    with pytest.raises(SystemExit, match=rf"^attnres {command}: error: '.*llama-attnres' is a Hugging Face model "
                                         r"directory \(an upcycle, an export\), not a training run: attnres generate, "
                                         r"eval and analyze read it, and `attnres train model.from_hf=DIR init_from=DIR "
                                         r"out_dir=RUN` trains a run from it$"):
        cli_main([command, str(model)])


def test_json_lines_stay_strict_json_when_a_loss_is_not_a_number(runs, tmp_path, capsys):
    """A NaN validation loss or an infinite rate in metrics.jsonl was printed as ``NaN`` /
    ``Infinity``, which is not JSON (jq and JavaScript refuse the line); now ``null``."""
    run = tmp_path / "run"
    shutil.copytree(runs / "done", run)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "eval", "step": 6, "val_loss": NaN}\n{"kind": "train", "step": 6, "loss": 4.0, '
                '"tokens_per_s": Infinity}\n')

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    assert cli_main(["status", str(run), "--json"]) == 0
    row = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert (row["val_loss"], row["val_step"], row["tokens_per_s"], row["train_loss"]) == (None, 6, None, 4.0)


def test_a_path_inside_a_run_finds_that_run(runs, capsys):
    """`attnres status RUN/checkpoints/step-N` (the path generate / eval take) said "no
    training runs under ..." and exited 0: a checkpoint, a run's checkpoints/ or tensorboard/
    folder now stand for their run, in status and plot alike."""
    run = runs / "done"
    step = sorted((run / "checkpoints").glob("step-*"))[-1]
    # (its own files too: `attnres plot RUN/metrics.jsonl` said it was "a file, not a run")
    for inside in (step, run / "checkpoints", step / "model.safetensors", run / "metrics.jsonl", run / "config.json"):
        assert find_runs(inside) == [run], inside
    assert cli_main(["status", str(step)]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith(str(run))


def test_dot_from_within_a_run_s_checkpoints_stands_for_the_run(runs, monkeypatch, capsys):
    """`.` from within RUN/checkpoints (or one of its step-* directories) was no run: its path has
    no name and no parents to read, so `attnres status .` said "no training runs under .", and
    generate / export / --resume-from . said it was "neither a checkpoint nor a run directory";
    RUN/checkpoints was. It now stands for the run, named as reached from here (`..`)."""
    from attnres.checkpoint.locate import (find_valid_checkpoint, refuse_out_dir_not_a_run, run_of_checkpoint,
                                           training_output)
    from attnres.output_paths import OutputPathError

    run = runs / "done"
    step = sorted((run / "checkpoints").glob("step-*"))[-1]
    monkeypatch.chdir(run / "checkpoints")
    assert find_runs(".") == [Path("..")]
    assert training_output(".") == "the checkpoints/ folder of the training run '..'"
    assert run_of_checkpoint(".") == (Path(".."), None)
    assert find_valid_checkpoint(".").path.resolve() == step.resolve()
    assert cli_main(["status", "."]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("..")
    monkeypatch.chdir(step)
    assert find_runs(".") == [Path("../..")]
    assert run_of_checkpoint(".") == (Path("../.."), step.name)
    with pytest.raises(OutputPathError, match=re.escape("is a checkpoint of the run '../..', not a run directory")):
        refuse_out_dir_not_a_run(".")  # (out_dir=. there: it was "a training checkpoint", of no run)


@pytest.mark.parametrize("where", ["checkpoints/run", "runs/checkpoints"])
def test_a_run_in_or_named_a_checkpoints_folder_is_trained_on_with_its_own_config(tmp_path, monkeypatch, where):
    """A run kept in a folder named ``checkpoints`` (``~/checkpoints/RUN``), or named so itself,
    was taken for a checkpoint (or the checkpoints/ folder) of the folder above it: the command
    that trains on from it named that folder's config.json, and not the run's architecture."""
    from attnres.checkpoint.locate import refuse_out_dir_not_a_run, train_on_from
    from attnres.output_paths import OutputPathError

    run = tmp_path / where
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / "checkpoints" / "step-00000002" / "state.json").write_text("{}")
    (run / "config.json").write_text(json.dumps({"model": {"hf_architecture": "LlamaForCausalLM"}}))
    monkeypatch.chdir(tmp_path)
    for given in (run, Path(where)):
        architecture, command = train_on_from(given)
        assert architecture == "LlamaForCausalLM"
        assert command == f"attnres train --config {given / 'config.json'} init_from={given} out_dir=DIR"
    start = f"`attnres train --config {where}/config.json init_from={where} "
    with pytest.raises(OutputPathError, match=re.escape(start)):
        refuse_out_dir_not_a_run(Path(where) / "checkpoints")


@pytest.mark.parametrize("command", ["status", "plot"])
def test_a_file_or_a_misspelt_folder_is_an_error(runs, tmp_path, command, capsys):
    """`attnres status corpus.txt` said "no training runs under corpus.txt" with exit status 0;
    a misspelt folder gave no hint of the one meant."""
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SystemExit, match=f"attnres {command}: error: '.*notes.txt' is a file, not a run or a folder"):
        cli_main([command, str(tmp_path / "notes.txt")])
    with pytest.raises(SystemExit, match=r"no such folder: '.*gird' \(did you mean 'grid'\?\)"):
        cli_main([command, str(runs / "gird")])


def test_a_stopped_run_of_a_grid_is_continued_with_its_grids_command(runs, tmp_path, capsys):
    """`attnres status` told a stopped run of `attnres compare` to continue with `attnres train
    out_dir=... --resume`, which leaves the grid without the run's record; now the grid's own
    command (its preset and overrides from experiment.json), as `attnres compare` parses it."""
    from attnres.cli import build_parser
    from attnres.cli.experiment import _split_overrides

    run = tmp_path / "grid" / "block" / "seed0"
    shutil.copytree(runs / "grid" / "block" / "seed0", run)
    header = {"experiment": "compare", "preset": "tiny", "overrides": ["steps=6", "data.paths=[a b.txt]"]}
    (tmp_path / "grid" / "experiment.json").write_text(json.dumps(header))
    assert cli_main(["status", str(tmp_path / "grid")]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    command = last.split("`")[1]
    assert command == f"attnres compare --preset tiny --out {tmp_path / 'grid'} --seeds 0 steps=6 'data.paths=[a b.txt]'"
    parser = build_parser()
    args = parser.parse_args(__import__("shlex").split(command)[1:])
    _split_overrides(args, parser)  # (as `attnres compare` does: the overrides end --seeds' list)
    assert (args.out, args.seeds, args.overrides) == (str(tmp_path / "grid"), [0], header["overrides"])
    # The grid's command trains its other variants of the seed too (a grid split among processes by --variants,
    # which experiment.json does not record, had the other processes' variants trained): the hint's --variants,
    # put where it says, limits it to this run
    hint = last.split("`")[3]
    assert hint == "--variants block" and last.split("`")[5] == "--seeds 0"
    alone = command.replace("--seeds 0", f"--seeds 0 {hint}")
    args = parser.parse_args(__import__("shlex").split(alone)[1:])
    _split_overrides(args, parser)
    assert (args.seeds, args.variants, args.overrides) == ([0], ["block"], header["overrides"])


@pytest.mark.parametrize("variant", ["my block", "it's"])
def test_the_variants_hint_quotes_a_variant_named_with_shell_characters(tmp_path, variant):
    """The continue hint of a grid split by --variants printed the variant's name as it is:
    every built-in name is shell-safe, but a grid file's variant named "my block" gave
    `--variants my block`, which the shell reads as two variants. The name is quoted now: the
    hint, pasted where it says, gives back the name."""
    import shlex

    from attnres.cli import build_parser
    from attnres.cli.experiment import _split_overrides
    from attnres.cli.status import _continue_command

    grid = tmp_path / "grid"
    (grid / variant / "seed0").mkdir(parents=True)
    (grid / "experiment.json").write_text(json.dumps({"experiment": "compare", "preset": "tiny",
                                                      "overrides": ["steps=6"]}))
    said = _continue_command(str(grid / variant / "seed0")).split("`")
    command, hint = said[1], said[3]
    assert shlex.split(hint) == ["--variants", variant]
    parser = build_parser()
    args = parser.parse_args(shlex.split(command.replace("--seeds 0", f"--seeds 0 {hint}"))[1:])
    _split_overrides(args, parser)
    assert (args.seeds, args.variants, args.overrides) == ([0], [variant], ["steps=6"])


@pytest.mark.parametrize("where, typed", [("grid", "."), ("grid/block/seed0", "."), ("grid/block", "seed0/../seed0"),
                                          ("grid/block", "seed0/checkpoints")])
def test_a_grids_run_named_by_a_relative_path_is_continued_with_the_grid_at_its_absolute_path(
        runs, tmp_path, monkeypatch, capsys, where, typed):
    """The grid's command took the grid's folder from the path as typed: `attnres status .`
    from inside the run looked for experiment.json in `./..` of `.` (`.` again) and told the
    run to resume alone (the grid left without its record), and a relative --out named another
    folder, or none, once pasted elsewhere. The run's path is made absolute first."""
    run = tmp_path / "grid" / "block" / "seed0"
    shutil.copytree(runs / "grid" / "block" / "seed0", run)
    (tmp_path / "grid" / "experiment.json").write_text(json.dumps({"experiment": "compare", "preset": "tiny",
                                                                    "overrides": ["steps=6"]}))
    monkeypatch.chdir(tmp_path / where)
    assert cli_main(["status", typed]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (f"continue a stopped run with `attnres compare --preset tiny "
                                                        f"--out {tmp_path / 'grid'} --seeds 0 steps=6` (its grid's "
                                                        "command, for this seed: it also trains the grid's other "
                                                        "variants not finished for it; `--variants block` after "
                                                        "`--seeds 0` continues this run alone)")


def test_a_stopped_run_trained_under_torchrun_is_continued_launched_as_it_was(runs, tmp_path, capsys):
    """`attnres status` told a run stopped under torchrun (4 ranks, tp=2 x pp=2) to continue
    with a one-process `attnres train out_dir=... --resume` (the stored config leaves the
    layout to the launch: a run that needed 4 GPUs resumed in one). Now the torchrun launch of
    docs/scale-out.md with the ranks and parallel.* settings its newest checkpoint records."""
    run = tmp_path / "runs" / "pp"
    shutil.copytree(runs / "grid" / "block" / "seed0", run)
    state_file = run / "checkpoints" / "step-00000003" / "state.json"
    state = json.loads(state_file.read_text())
    assert state["launch"] == {"world_size": 1, "local_world_size": 1}  # what the one-process trainer recorded
    state["config"]["parallel"].update(tp=2, pp=2, pp_schedule="gpipe")

    def hint(world: int, per_node: int) -> str:
        state_file.write_text(json.dumps({**state, "launch": {"world_size": world, "local_world_size": per_node}}))
        assert cli_main(["status", str(run)]) == 0
        return capsys.readouterr().out.splitlines()[-1]

    assert hint(4, 4) == (f"continue a stopped run with `torchrun --standalone --nproc-per-node 4 -m attnres train "
                          f"out_dir={run} --resume parallel.tp=2 parallel.pp=2 parallel.pp_schedule=gpipe` (its own config)")
    assert hint(16, 8).startswith("continue a stopped run with `torchrun ... -m attnres train")  # two nodes: their launch
    assert hint(1, 1) == f"continue a stopped run with `attnres train out_dir={run} --resume` (its own config)"


def test_a_stopped_run_of_a_residual_of_the_users_own_is_continued_with_its_import(runs, tmp_path, capsys):
    """status's command for a stopped run of a registered residual had no --import: the
    resume it gave stopped at "residual 'mine' is not registered". The checkpoint's imports
    record gives the run's own --import values, else its residual class's module."""
    run = tmp_path / "runs" / "mine"
    shutil.copytree(runs / "grid" / "block" / "seed0", run)
    state_file = run / "checkpoints" / "step-00000003" / "state.json"
    state = json.loads(state_file.read_text())

    def hint(imports: dict, world: int = 1) -> str:
        launch = {"world_size": world, "local_world_size": world}
        state_file.write_text(json.dumps({**state, "imports": imports, "launch": launch}))
        assert cli_main(["status", str(run)]) == 0
        return capsys.readouterr().out.splitlines()[-1]

    given = {"given": ["/home/u/my res.py"], "residual": "mine", "residual_module": "my_res"}
    assert hint(given) == (f"continue a stopped run with `attnres --import '/home/u/my res.py' train out_dir={run} "
                           "--resume` (its own config)")
    assert hint({**given, "given": []}, world=2) == (
        f"continue a stopped run with `torchrun --standalone --nproc-per-node 2 -m attnres --import my_res train "
        f"out_dir={run} --resume` (its own config)")
    for nothing_to_import in ({**given, "given": [], "residual_module": "__main__"}, {**given, "given": [],
                              "residual_module": None}):
        assert hint(nothing_to_import).startswith("continue a stopped run with `attnres train out_dir=")


def test_a_diverged_run_is_called_diverged_not_stopped(tmp_path, capsys):
    """A run whose loss or gradient norm became NaN stopped without saving and was shown as
    "stopped", with the hint to continue it - which diverges again. The trainer now logs a
    ``diverged`` record, and status calls the run so, with no hint to resume it."""
    from attnres.train import TrainingDiverged

    corpus = write_corpus(tmp_path / "corpus.txt")
    run = tmp_path / "runs" / "nan"
    with pytest.raises(TrainingDiverged):
        train(load_config(None, overrides(corpus, run, lr="1e30", schedule="constant", warmup_steps=0, grad_clip=0,
                                          checkpoint_every=1)))
    last = read_metrics(run / "metrics.jsonl")[-1]
    assert (last["kind"], last["step"]) == ("diverged", 2) and not math.isfinite(last["loss"] + last["grad_norm"])
    status = run_status(run)
    assert (status.state, status.step, status.checkpoint_step) == ("diverged", 2, 1)
    assert cli_main(["status", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "diverged" in out and "continue a stopped run" not in out


def test_a_run_whose_config_json_is_damaged_is_reported_from_its_checkpoint(runs, tmp_path, capsys):
    """A finished run whose config.json was truncated (a full disk, an editor) was called
    "stopped", of '?' steps, with no word of the file. Its newest checkpoint stores the
    config: the run is "finished" again, and the damaged file is named; without that either,
    the state is "unknown", not "stopped"."""
    run = tmp_path / "runs" / "done"
    shutil.copytree(runs / "done", run)
    text = (run / "config.json").read_text()
    (run / "config.json").write_text(text[: len(text) // 2])
    status = run_status(run)
    assert (status.step, status.steps, status.checkpoint_step, status.state) == (6, 6, 6, "finished")
    assert (status.residual, status.n_layers) == ("attnres_block", 2)
    assert status.config_error.startswith(f"{str(run / 'config.json')!r} cannot be read (JSONDecodeError: ")
    assert status.config_error.endswith("the model and steps are those its checkpoint step-00000006 stores")
    assert cli_main(["status", str(tmp_path / "runs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith("finished") and lines[3] == f"{run}: {status.config_error}"
    (run / "checkpoints" / "step-00000006" / "state.json").unlink()
    status = run_status(run)
    assert (status.step, status.steps, status.state, status.residual) == (6, None, "unknown", None)
    assert status.config_error.endswith("; the model and steps are unknown")


def test_unreadable_metrics_lines_are_counted_once_per_run(tmp_path, recwarn):
    """A metrics.jsonl line cut short (a kill mid-write) or of the wrong types (a hand edit)
    was skipped without a word: the table's step and losses came from the other lines. One
    line per run says how many were skipped, in which file, and which lines; the table is
    the same."""
    run = tmp_path / "runs" / "cut"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": {"residual": "standard"}, "steps": 10}))
    records = [{"kind": "train", "step": 1, "loss": 5.0, "tokens_per_s": 9.0}, {"kind": "train", "step": "two"},
               {"kind": "train", "step": 3, "loss": 4.0, "tokens_per_s": 9.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "tra')
    assert cli_main(["status", str(tmp_path / "runs")]) == 0
    assert [str(w.message) for w in recwarn if "metrics.jsonl" in str(w.message)] == [
        f"{str(run / 'metrics.jsonl')!r}: skipped 2 unreadable line(s) [2, 4] (a run killed mid-write leaves a "
        "truncated last line)"]
    status = run_status(run)
    assert (status.step, status.train_loss) == (3, 4.0)


def test_runs_of_different_tokenizers_are_said_not_to_compare(runs, tmp_path, capsys):
    """The table set a byte run's losses beside a BPE run's (nats per byte against per word
    piece) as if they compared. A line below it says they do not, naming the tokenizers."""
    for name, vocab, tokenizer in (("byte", 256, "byte"), ("bpe", 4096, "bpe")):
        run = tmp_path / "runs" / name
        shutil.copytree(runs / "done", run)
        config = json.loads((run / "config.json").read_text())
        config["model"]["vocab_size"], config["data"]["tokenizer"] = vocab, tokenizer
        (run / "config.json").write_text(json.dumps(config))
    assert run_status(tmp_path / "runs" / "bpe").tokenizer == "4096 tokens (bpe)"
    assert cli_main(["status", str(tmp_path / "runs")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "the losses are per token of different tokenizers (256 tokens (byte), 4096 tokens (bpe)), which do not "
        "compare; attnres eval gives each run's bits per byte, which do")
    assert cli_main(["status", str(tmp_path / "runs" / "byte"), str(runs / "grid")]) == 0  # (one tokenizer: no line)
    assert "tokenizers" not in capsys.readouterr().out


def test_runs_of_one_tokenizer_on_different_text_are_said_not_to_compare(runs, tmp_path, capsys):
    """A baseline on one corpus beside a variant on another (one tokenizer) was set side by
    side without a word; a line below the table names each text's fingerprint and a run of it.
    Runs of one text (a grid's seeds) and runs without checkpoints (no fingerprint) say nothing."""
    for name in ("a", "b"):
        shutil.copytree(runs / "done", tmp_path / "runs" / name)
    state_file = tmp_path / "runs" / "b" / "checkpoints" / "step-00000006" / "state.json"
    state = json.loads(state_file.read_text())
    a = state["data"]["fingerprint"]
    state["data"]["fingerprint"] = "f" * 64  # (another text: status reads state.json without verifying it)
    state_file.write_text(json.dumps(state))
    assert run_status(tmp_path / "runs" / "b").data == "f" * 12 and run_status(runs / "done").data == a[:12]
    assert cli_main(["status", str(tmp_path / "runs")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"the runs trained on different text (data fingerprints {a[:12]} ({tmp_path / 'runs' / 'a'}), "
        f"{'f' * 12} ({tmp_path / 'runs' / 'b'})), so their losses do not compare")
    shutil.rmtree(tmp_path / "runs" / "b" / "checkpoints")
    assert cli_main(["status", str(tmp_path / "runs"), str(runs / "done")]) == 0
    assert "different text" not in capsys.readouterr().out


def test_a_finished_run_copied_without_its_checkpoints_is_finished(runs, tmp_path):
    """Runs copied without their checkpoints (as results/ holds the committed grids) were
    called "stopped" at step 3600 of 3600, though nothing continues them. One whose log
    reached its last step is finished; one that did not is still stopped."""
    run = tmp_path / "done"
    shutil.copytree(runs / "done", run, ignore=shutil.ignore_patterns("checkpoints"))
    status = run_status(run)
    assert (status.step, status.steps, status.checkpoint_step, status.state) == (6, 6, None, "finished")
    stopped = tmp_path / "stopped"
    shutil.copytree(runs / "grid" / "block" / "seed0", stopped, ignore=shutil.ignore_patterns("checkpoints"))
    assert (run_status(stopped).step, run_status(stopped).state) == (3, "stopped")


def _written_run(run: Path, residual: dict, records: list[dict]) -> Path:
    """A run directory as a run writes it (config.json, metrics.jsonl), no checkpoint."""
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"steps": 6, "model": {"n_layers": 2, "d_model": 32,
                                                                      "residual": residual}}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_the_block_size_is_shown_for_every_variant_that_reads_it(tmp_path):
    """status showed S for residual.kind "attnres_block" by name: a subclass of Block AttnRes
    registered by the user (read with `attnres --import MODULE status`) showed none. S is
    shown wherever the run's variant reads the block size (its class's reads_fields); not for
    one that does not, nor for a kind not registered here (not guessed)."""
    from attnres.nn.residual import BlockAttnRes, ResidualConfig, register_residual

    @register_residual("status_block_test", replace=True)
    class StatusBlock(BlockAttnRes):
        pass

    record = [{"kind": "train", "step": 1, "loss": 3.0}]
    S = {kind: run_status(_written_run(tmp_path / kind, {"kind": kind, "block_size": 4}, record)).block_size
         for kind in ("attnres_block", "status_block_test", "attnres_full", "not_registered_here")}
    assert S == {"attnres_block": 4, "status_block_test": 4, "attnres_full": None, "not_registered_here": None}
    # a block size left to be derived (null) shows the S the model derives: ceil(L / 8), L = 2 x 2 sublayers
    assert run_status(_written_run(tmp_path / "auto", {"kind": "attnres_block", "block_size": None}, record)).block_size \
        == ResidualConfig().resolved_block_size(4) == 1
    deep = _written_run(tmp_path / "deep", {"kind": "attnres_block", "block_size": None}, record)
    (deep / "config.json").write_text(json.dumps({"steps": 6, "model": {"n_layers": 24, "d_model": 32, "residual": {
        "kind": "attnres_block", "block_size": None}}}))
    assert run_status(deep).block_size == 6  # (48 sublayers: 8 blocks of 6, report §3.2's N = 8)


def test_a_run_resumed_onto_other_text_is_said_to_be(tmp_path, capsys):
    """plot warned of a run resumed onto other text (its metrics.jsonl's data_change record):
    its validation losses before and after are of two texts. status said nothing of it. It
    names the run and the step (once, where an earlier version logged a repeated resume twice)."""
    change = {"kind": "data_change", "step": 2, "fingerprint": "b" * 64, "before": "a" * 64}
    records = [{"kind": "eval", "step": 2, "val_loss": 3.0}, change, change, {"kind": "eval", "step": 4, "val_loss": 2.0}]
    run = _written_run(tmp_path / "runs" / "resumed", {"kind": "standard"}, records)
    _written_run(tmp_path / "runs" / "plain", {"kind": "standard"}, records[:1])
    assert run_status(run).data_changes == [2]
    assert cli_main(["status", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert (f"{run} was resumed onto other text (allow_data_change) at step 2: its validation loss before and after is "
            "of two texts' validation splits, which do not compare") in out
    assert out.count("resumed onto other text") == 1
    assert cli_main(["status", str(tmp_path / "runs"), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["data_changes"] for r in rows] == [[], [2]]
