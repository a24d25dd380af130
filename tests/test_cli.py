"""The command line (issue 15): ``key=value`` overrides anywhere on the line, ``attnres
train --help`` listing every field, ``--print-config`` and ``--version``."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path

import pytest

pytest.importorskip("yaml")

import yaml  # noqa: E402
from test_train import overrides, write_corpus  # noqa: E402

import attnres  # noqa: E402
from attnres.cli import build_parser, main as cli_main  # noqa: E402
from attnres import registered_residuals  # noqa: E402
from attnres.train.config import flatten  # noqa: E402
from attnres.train import TrainConfig, load_config  # noqa: E402
from attnres.train.config import DataConfig  # noqa: E402
from attnres.distributed import ParallelConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"attnres {attnres.__version__}"


def test_train_help_lists_every_field_with_default_and_allowed_values(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    lines = {line.split("=")[0].strip(): line for line in text.splitlines()
             if " = " in line and line.startswith("  ") and not line.startswith("      ")}  # (not a meaning's line)
    defaults = TrainConfig(progress=False)
    for f in dataclasses.fields(TrainConfig):
        if f.name not in ("model", "data", "parallel"):
            assert f.name in lines, f.name
    for f in dataclasses.fields(DataConfig):
        assert f"data.{f.name}" in lines, f.name
    for f in dataclasses.fields(ParallelConfig):
        assert f"parallel.{f.name}" in lines, f.name
    for name in flatten(defaults.model.to_dict()):
        assert f"model.{name}" in lines, name
    for name in ("model", "model.preset", "model.from_hf"):  # the model section's keys that are not fields
        assert name in lines, name
    assert "one of 'adamw', 'muon'" in lines["optimizer"] and "'adamw'" in lines["optimizer"]
    assert "steps = 1000" in lines["steps"] and "an integer >= 1" in lines["steps"]
    assert "a finite number > 0" in lines["lr"]
    assert all(repr(r) in lines["model.residual.kind"] for r in registered_residuals())  # asked from the registry
    assert "model.d_model = 64" in lines["model.d_model"]  # the default preset's value
    # each field says what it does, on the line below it (a new field without a meaning fails here)
    below = dict(zip(text.splitlines(), text.splitlines()[1:]))
    from attnres.train.reference import MEANINGS

    assert set(MEANINGS) == set(lines), set(MEANINGS) ^ set(lines)  # none missing, none stale
    for name, line in lines.items():
        assert below[line] == f"      {MEANINGS[name]}", name


def test_train_help_says_what_each_field_takes(capsys):
    """``--help`` said weight_decay and grad_clip take "a number in [0.0, inf]" (inf is refused:
    every number must be finite), listed model.hf_architecture's families without its default,
    null, and called batch_size the sequences of an optimiser step (a step takes grad_accum
    batches of batch_size sequences)."""
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    text = capsys.readouterr().out
    lines = {line.split("=")[0].strip(): line for line in text.splitlines() if " = " in line}
    below = dict(zip(text.splitlines(), text.splitlines()[1:]))
    for name in ("weight_decay", "grad_clip"):
        assert lines[name].endswith("  a finite number >= 0"), lines[name]
    assert lines["model.hf_architecture"].endswith("'granitemoe', or null (the native decoder)")
    assert "micro-batch" in below[lines["batch_size"]] and "grad_accum" in below[lines["batch_size"]]


def test_print_config_shows_the_resolved_config(capsys, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: train-cpu\nlr: 1.0e-3\n")
    assert cli_main(["train", "--config", str(cfg), "--print-config", "model.residual=standard", "steps=7"]) == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)  # the comment on the vocabulary does not change what loads
    assert printed == load_config(cfg, ["model.residual=standard", "steps=7"]).to_dict()
    assert out.endswith("# model.vocab_size is replaced by the tokenizer's vocabulary when the run starts (data.tokenizer, "
                        "data.vocab_size; an init_from or resumed model's padded embedding keeps its size)\n")
    assert printed["model"]["d_model"] == 128 and printed["lr"] == 1e-3  # the train-cpu preset, the file's lr
    assert not (tmp_path / "runs").exists()


def test_how_to_continue_under_torchrun_says_the_launch_and_layout(monkeypatch):
    """A run stopped under torchrun (stop_after, a signal) says to continue it launched as it
    was, with its parallel.* settings: the plain `attnres train out_dir=... --resume` it said
    resumes a 4-rank tp x pp run in one process (the stored config leaves the layout out)."""
    from attnres.cli.train import _how_to_continue

    config = load_config(None, ["out_dir=runs/x", "parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule=gpipe"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _how_to_continue(config) == "continue with --resume (`attnres train out_dir=runs/x --resume`: the run's own config)"
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _how_to_continue(config) == (
        "continue with --resume, launched as this run was (`torchrun --standalone --nproc-per-node 4 -m attnres train "
        "out_dir=runs/x --resume parallel.tp=2 parallel.pp=2 parallel.pp_schedule=gpipe`: the run's own config; any "
        "other layout resumes it too)")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two nodes: their launch is theirs to repeat
    assert "(`torchrun ... -m attnres train out_dir=runs/x --resume parallel.tp=2" in _how_to_continue(config)


def test_print_config_under_torchrun_is_printed_once_per_node(capsys, monkeypatch):
    """Every rank of `torchrun ... -m attnres train --print-config` resolves the same config:
    the node's first rank prints it (each rank printed it: a config per rank, interleaved)."""
    for local_rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert cli_main(["train", "--print-config", "steps=7"]) == 0
        assert ("steps: 7" in capsys.readouterr().out) == printed


@pytest.mark.parametrize("asked", [["train", "--help"], ["--help"], ["--version"]])
def test_help_under_torchrun_is_printed_once_per_node(capsys, monkeypatch, asked):
    """`torchrun --nproc-per-node 2 -m attnres train --help` printed the help once per rank,
    one after the other; the node's first rank prints it, the others end as quietly (status 0)."""
    for name, value in {"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "job"}.items():
        monkeypatch.setenv(name, value)
    printed = {}
    for local_rank in ("0", "1"):
        monkeypatch.setenv("RANK", local_rank)
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(SystemExit) as ended:
            cli_main(asked)
        assert ended.value.code in (0, None)
        printed[local_rank] = capsys.readouterr()
    assert printed["0"].out.startswith("usage: attnres" if asked[0] != "--version" else "attnres ")
    assert printed["1"].out == printed["1"].err == ""


@pytest.mark.parametrize("command", [["export", "RUN", "--out", "OUT"], ["generate", "RUN", "--prompt", "a"],
                                     ["eval", "RUN", "--out", "OUT/eval.json"], ["analyze", "RUN"],
                                     ["plot", "RUN", "--out", "OUT/curves.png"],
                                     ["compare", "--preset", "tiny", "--out", "OUT"]])
def test_a_one_process_command_under_torchrun_is_refused_once_per_node(capsys, monkeypatch, tmp_path, command):
    """`torchrun --nproc-per-node 2 -m attnres export RUN --out DIR` (a sharded checkpoint
    taken to need the ranks that wrote it) ran the export on each rank, both writing DIR at
    once and printing everything twice; `compare` printed every line twice, wrote its report
    from both ranks and timed each variant's step on both at once. The node's first rank says
    to run it without torchrun, the others exit without a word (after waiting for it);
    nothing is read or written."""
    from attnres.cli import common

    monkeypatch.setattr(common, "SILENT_RANK_WAIT_S", 0.0)
    argv = [a.replace("RUN", str(tmp_path / "no-run")).replace("OUT", str(tmp_path / "out")) for a in command]
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # a job script's own variables, without torchrun:
    assert common.refuse_a_multi_rank_launch(command[0], "") is None  # not refused
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # (torchrun's workers have it)
    why = (r"it trains its runs one after another .*; to spread a grid over processes, start one per --variants, sharing --out"
           if command[0] == "compare" else r"sharded checkpoints included: it reads every rank's shards itself"
           if command[0] != "plot" else "one figure")
    with pytest.raises(SystemExit, match=rf"attnres {command[0]}: error: it runs in one process \({why}\), but "
                                         rf"torchrun started 2 ranks, .*; run it without torchrun: "
                                         rf"`attnres {command[0]} ...`"):
        cli_main(argv)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as silent:
        cli_main(argv)
    assert silent.value.code == 1 and not (tmp_path / "out").exists()
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("override", ["wandb_project='1e3'", "data.paths=['2e5']", "out_dir='1E3'"])
def test_print_config_loads_back_strings_that_look_like_numbers(capsys, tmp_path, override):
    """A string such as '1e3' (a W&B project, a path) was printed plain, as PyYAML's YAML 1.1
    writes it, and the config loader, which reads 1e3 as a number, read back a float (refused)."""
    assert cli_main(["train", "--print-config", override]) == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    assert load_config(printed).to_dict() == load_config(None, [override]).to_dict()


def test_overrides_on_both_sides_of_resume(tmp_path, capsys):
    """``attnres train a=b --resume c=d`` (also what torchrun passes on): argparse fills a
    positional list once, so the overrides after ``--resume`` used to be rejected."""
    corpus = write_corpus(tmp_path / "corpus.txt")
    args = overrides(corpus, tmp_path / "run", stop_after=2)
    assert cli_main(["train", *args]) == 0
    args = overrides(corpus, tmp_path / "run")
    assert cli_main(["train", *args[:4], "--resume", *args[4:]]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli_main(["train", *args[:4], "--resume", "not-an-override"])
    assert capsys.readouterr().err.rstrip().endswith(
        "attnres train: error: 'not-an-override' is neither a key=value override nor a config file")


def test_config_file_as_a_positional_argument(capsys, tmp_path, monkeypatch):
    """``attnres train run.yaml key=value`` (what users type, and what the multi-node recipe
    passes) is ``--config run.yaml``; one config file at most, and an argument that is neither
    a file nor ``key=value`` is refused naming it."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: demo\nlr: 1.0e-3\n")
    assert cli_main(["train", str(cfg), "--print-config", "steps=7"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == load_config(cfg, ["steps=7"]).to_dict()
    assert cli_main(["train", "steps=7", "--print-config", str(cfg)]) == 0  # anywhere on the line
    assert yaml.safe_load(capsys.readouterr().out) == load_config(cfg, ["steps=7"]).to_dict()
    with pytest.raises(SystemExit):
        cli_main(["train", str(cfg), "--config", str(cfg), "--print-config"])
    assert "one config file at most" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["train", str(tmp_path / "missing.yaml"), "--print-config"])
    err = capsys.readouterr().err
    # (as --config says it, with the nearest name: it was "'...' is neither a key=value override nor a config file")
    assert "attnres train: error: config file '" + str(tmp_path / "missing.yaml") + "' does not exist" in err
    assert err.startswith("usage: attnres train ")  # train's usage, not the top level's
    (tmp_path / "configs").mkdir()
    cfg.rename(tmp_path / "configs" / "run.yaml")
    monkeypatch.chdir(tmp_path)
    for given, meant in (("confgs/run.yaml", "configs"), ("configs/rnu.yaml", "run.yaml")):
        with pytest.raises(SystemExit):
            cli_main(["train", given, "--print-config"])
        err = capsys.readouterr().err
        assert f"error: config file '{given}' does not exist" in err and f"(did you mean '{meant}'?)" in err, err
    # where no configs/ is here (an installed wheel, another directory): the shipped config, not "'.' holds no 'confgs'"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with pytest.raises(SystemExit):
        cli_main(["train", "confgs/train-cpu.yaml", "--print-config"])
    assert "(did you mean 'configs/train-cpu.yaml', shipped with attnres?)" in capsys.readouterr().err


def test_a_config_file_with_an_equals_sign_in_its_name_is_told_to_take_config(tmp_path, monkeypatch, capsys):
    """``attnres train "lr=3e-4.yaml"`` (a file named after its setting) was read as the override
    lr='3e-4.yaml' ("unknown key" for others); the refusal names the file and --config, which takes it."""
    monkeypatch.chdir(tmp_path)
    Path("a=b ä.yaml").write_text("steps: 7\n")
    with pytest.raises(SystemExit):
        cli_main(["train", "a=b ä.yaml", "--print-config"])
    err = capsys.readouterr().err
    assert err.rstrip().endswith("attnres train: error: 'a=b ä.yaml' is a config file, but the '=' in its name makes "
                                 "it a key=value override here: give it with --config 'a=b ä.yaml'")
    assert cli_main(["train", *shlex.split(err.rpartition("give it with ")[2]), "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["steps"] == 7


@pytest.mark.parametrize("argv", [["-c.yaml"], ["steps=7", "-c.yaml"], ["--config", "-c.yaml"]])
def test_a_config_file_whose_name_starts_with_a_dash_is_told_the_forms_argparse_takes(tmp_path, monkeypatch, capsys,
                                                                                        argv):
    """``attnres train -c.yaml`` got argparse's "unrecognized arguments: -c.yaml" alone (and
    ``--config -c.yaml`` "expected one argument"): argparse reads a word that starts with '-'
    as an option. The refusal now gives the two forms it reads as the file, and each works."""
    monkeypatch.chdir(tmp_path)
    Path("-c.yaml").write_text("steps: 7\n")
    with pytest.raises(SystemExit):
        cli_main(["train", *argv, "--print-config"])
    err = capsys.readouterr().err
    said = "expected one argument" if argv[0] == "--config" else "unrecognized arguments: -c.yaml"
    assert err.rstrip().endswith(f"attnres train: error: {'argument --config: ' * (argv[0] == '--config')}{said} "
                                 "('-c.yaml' starts with '-', which argparse reads as an option: give the file as "
                                 "./-c.yaml or --config=-c.yaml)"), err
    for form in err.rstrip()[:-1].rpartition("give the file as ")[2].split(" or "):
        assert cli_main(["train", *shlex.split(form), "--print-config"]) == 0
        assert yaml.safe_load(capsys.readouterr().out)["steps"] == 7
    with pytest.raises(SystemExit):  # an unknown option that names no file: no such hint
        cli_main(["train", "-x", "--print-config"])
    assert capsys.readouterr().err.rstrip().endswith("attnres train: error: unrecognized arguments: -x")


@pytest.mark.parametrize("argv, dest", [
    (["eval", "-run"], "checkpoint_path"), (["generate", "-run", "--prompt", "hi"], "checkpoint_path"),
    (["analyze", "-run"], "checkpoint_path"),
    (["export", "-run", "--out", "x"], "checkpoint_path"), (["status", "-run"], "dirs"), (["plot", "-run"], "dirs"),
    (["export", "run", "--out", "-run"], "out"), (["upcycle", "--model", "-run", "--out", "y"], "model"),
    (["compare", "--out", "-run"], "out"), (["plot", "run", "--out", "-run"], "out")])
def test_a_path_argument_that_starts_with_a_dash_is_told_the_form_argparse_takes(tmp_path, monkeypatch, capsys, argv,
                                                                                  dest):
    """Only attnres train told a file named -c.yaml how to give it: the other commands got
    argparse's bare "unrecognized arguments: -run" for a run folder named -run, and "argument
    --out: expected one argument" for --out -run. Each now says the word starts with '-' and
    gives the form argparse reads (./-run, --out=-run), and that form parses to the path."""
    monkeypatch.chdir(tmp_path)
    Path("-run").mkdir()
    with pytest.raises(SystemExit):
        cli_main(argv)
    err = capsys.readouterr().err.rstrip()
    assert err.endswith("('-run' starts with '-', which argparse reads as an option: give "
                        + ("the path as ./-run)" if dest in ("checkpoint_path", "dirs") else f"it as --{dest}=-run)")), err
    form = err[:-1].rpartition(" as ")[2]
    fixed = [form if word == "-run" else word for word in argv]
    if form.startswith("--"):  # (the option and its value in one word)
        fixed = [w for i, w in enumerate(fixed) if not (w.startswith("--") and i + 1 < len(fixed) and fixed[i + 1] == form)]
    value = getattr(build_parser().parse_args(fixed), dest)
    assert value in ("./-run", "-run", ["./-run"]), value
    with pytest.raises(SystemExit):  # an option that names nothing here: argparse's words alone
        cli_main([argv[0], "-nothere"])
    assert "starts with '-'" not in capsys.readouterr().err


def test_a_quoted_tilde_in_a_path_argument_is_the_home_directory(tmp_path, monkeypatch, capsys):
    """``attnres status "~/my runs"`` (quoted for its space, so the shell leaves the ``~``) said
    "no such folder: '.' holds no '~'", where ``attnres train "out_dir=~/my runs/a"`` had
    trained there; every command's path arguments now read ``~`` as the home directory."""
    import json

    from attnres.cli.common import expand_home

    monkeypatch.setenv("HOME", str(tmp_path))
    run = tmp_path / "my runs" / "Lauf ä"
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    assert cli_main(["status", "--json", "~/my runs"]) == 0
    assert [json.loads(line)["path"] for line in capsys.readouterr().out.splitlines()] == [str(run)]
    args = argparse.Namespace(dirs=["~/a", "b/~"], out="~", checkpoint_path="~/c", prompt="~/not a path", x=None)
    expand_home(args)
    assert vars(args) == dict(dirs=[str(tmp_path / "a"), "b/~"], out=str(tmp_path), checkpoint_path=str(tmp_path / "c"),
                              prompt="~/not a path", x=None)


@pytest.mark.parametrize("argv, whole", [
    (["train", "data.paths=[a.txt,", "b.txt]", "steps=3", "--print-config"], "data.paths=[a.txt, b.txt]"),
    (["train", "steps=3", "data.paths=[a.txt,", "b.txt,", "c.txt]"], "data.paths=[a.txt, b.txt, c.txt]"),
    (["train", "model={preset:", "tiny}", "--print-config"], "model={preset: tiny}"),
    (["compare", "--out", "x", "data.paths=[a.txt,", "b.txt]"], "data.paths=[a.txt, b.txt]"),
    (["experiment", "ablation", "--out", "x", "--seeds", "0", "data.paths=[a.txt,", "b.txt]"], "data.paths=[a.txt, b.txt]"),
])
def test_an_override_the_shell_split_at_its_spaces_is_named_whole(capsys, argv, whole):
    """``data.paths=[a.txt, b.txt]`` unquoted reaches attnres as two arguments: the piece
    after the space was refused as "'b.txt]' is neither a key=value override nor a config
    file" (two such pieces: "one config file at most"), by compare as a YAML error of the
    first piece, by experiment as "unrecognized arguments"; the override itself was not named."""
    with pytest.raises(SystemExit):
        cli_main(argv)
    assert capsys.readouterr().err.rstrip().endswith(
        f'attnres {argv[0]}: error: the shell split an override at its spaces: quote it, "{whole}", or leave the '
        "spaces out")


class _Ended(Exception):
    """What ``os._exit`` raises here instead of ending the test process."""


@pytest.mark.parametrize(("returned", "status", "stderr"),
                         [(0, 0, ""), (3, 3, ""), (None, 0, ""), ("attnres train: error: bad", 1, "attnres train: error: bad\n")])
def test_command_of_a_rank_ends_without_the_interpreter_finalization(monkeypatch, capsys, returned, status, stderr):
    """``attnres`` (:func:`attnres.cli.run`) in a process that joined a process group: the group
    destroyed, the output flushed, then ``os._exit`` with main's status (a message printed,
    status 1), not the interpreter's finalization, in which gloo's threads abort the process
    now and then. Without a group it exits as ``SystemExit`` would."""
    import attnres.cli as cli
    import attnres.distributed.launch as launch

    def main():
        if isinstance(returned, str):
            raise SystemExit(returned)
        return returned

    def end(code):
        raise _Ended(code)

    destroyed = []
    monkeypatch.setattr(cli, "main", main)
    monkeypatch.setattr(launch, "destroy_process_group", lambda: destroyed.append(True))
    monkeypatch.setattr(cli.os, "_exit", end)
    with pytest.raises(SystemExit) as alone:
        cli.run()
    assert alone.value.code == returned and not destroyed
    monkeypatch.setattr(cli, "_in_process_group", lambda: True)
    with pytest.raises(_Ended) as ended:
        cli.run()
    assert ended.value.args == (status,) and destroyed == [True] and capsys.readouterr().err == stderr


def test_unrecognized_arguments_are_refused_by_the_commands_own_parser(capsys):
    """An argument a command does not take is named with that command's usage (not the
    top-level one), and a second path given to ``analyze`` says how to compare two."""
    with pytest.raises(SystemExit) as exit_:
        cli_main(["analyze", "runs/a", "runs/b"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: attnres analyze")
    assert err.rstrip().endswith("attnres analyze: error: unrecognized arguments: runs/b (one checkpoint at a time; "
                                 "to compare two: attnres analyze A --compare B)")
    with pytest.raises(SystemExit):
        cli_main(["generate", "runs/a", "--prompt", "x", "--bogus"])
    err = capsys.readouterr().err
    assert err.startswith("usage: attnres generate")
    assert err.rstrip().endswith("attnres generate: error: unrecognized arguments: --bogus")


def test_missing_arguments_name_only_what_is_required(capsys):
    """The overrides are optional: a command missing its required arguments does not list
    ``key=value`` among them."""
    for argv, required in ((["experiment"], "name, --out"), (["experiment", "compare"], "--out")):
        with pytest.raises(SystemExit):
            cli_main(argv)
        assert capsys.readouterr().err.rstrip().endswith(f"error: the following arguments are required: {required}")


def test_the_commands_that_run_a_model_share_the_device_default():
    """analyze defaulted to the CPU where generate and eval take CUDA when there is one."""
    parser = build_parser()
    defaults = {name: parser.commands[name].get_default("device") for name in ("analyze", "eval", "generate")}
    assert defaults == {"analyze": "auto", "eval": "auto", "generate": "auto"}


def test_every_option_with_a_default_says_it_in_its_help():
    """`attnres generate --help` showed `--top-k TOP_K  keep the k most likely tokens (0 = all)`
    without saying 0 is what one gets; an option that has a value when not given names it."""
    import argparse

    parser = build_parser()
    silent = []
    for name, command in parser.commands.items():
        for action in command._actions:
            if (not action.option_strings or action.default is None or action.default is False
                    or action.default == argparse.SUPPRESS or action.help in (None, argparse.SUPPRESS)):
                continue
            if "default" not in action.help:
                silent.append(f"{name} {action.option_strings[0]}: {action.help}")
    assert not silent, silent


@pytest.mark.parametrize("misplaced", [["--import", "my_residuals"], ["--import=my_residuals"]])
def test_import_after_the_command_says_where_it_goes(capsys, misplaced):
    """`attnres train --import my_residuals ...` said only "unrecognized arguments: --import"."""
    with pytest.raises(SystemExit):
        cli_main(["train", *misplaced, "model.residual.kind=mine", "--print-config"])
    err = capsys.readouterr().err
    assert "--import goes before the command: `attnres --import MODULE train ...`" in err, err
    with pytest.raises(SystemExit):  # (not taken for a misspelt --prompt)
        cli_main(["generate", "x", "--prompt", "a", *misplaced])
    assert "did you mean" not in capsys.readouterr().err
