"""The README's shell examples as written: every ``attnres`` line of its ``bash`` blocks; and
its own-model Python example.

What takes seconds runs: ``attnres upcycle`` (on a tiny Qwen3 saved where the example looks,
``path/to/qwen3``), ``train --help`` and every ``attnres train`` line (also under
``torchrun``) up to its resolved config (``--print-config``: the config, its files and its
overrides are read and validated, nothing is trained). Lines that train for minutes
(``attnres compare``) or read runs the README made earlier (``attnres analyze``) are parsed
by the command's own parser and their grid looked up. ``make`` targets, ``pip`` lines and
lines with a ``...`` placeholder are not commands to copy as they are.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

pytest.importorskip("yaml")

from attnres.cli import build_parser  # noqa: E402
from attnres.cli import main as cli_main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_commands() -> list[list[str]]:
    """The arguments of every ``attnres`` command line in the README's ``bash`` blocks (after
    ``attnres`` or ``-m attnres``), comments and line continuations removed."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.split(r"(?:^|\s)#\s", line)[0].strip()
            if not re.search(r"(^|\s)attnres(\s|$)", line):
                continue
            words = shlex.split(line)
            if "..." in words or words[0] in ("pip", "make"):
                continue
            commands.append(words[words.index("attnres") + 1:])
    return commands


def test_the_readme_has_the_commands_this_test_expects():
    commands = readme_commands()
    assert sum(c[0] == "train" for c in commands) >= 10 and ["train", "--help"] in commands
    assert any(c[0] == "upcycle" for c in commands) and any(c[0] == "compare" for c in commands)


def test_every_readme_command_runs_or_parses_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from attnres.data.tokenizer import train_bpe
    from attnres.experiments import get_experiment
    from fixtures.tiny_families import tiny_model

    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_train import write_corpus

    monkeypatch.chdir(tmp_path)  # what the README's relative paths mean: the user's directory
    pretrained = tmp_path / "path" / "to" / "qwen3"
    readme_qwen3(tiny_model).save_pretrained(pretrained)
    train_bpe(write_corpus(tmp_path / "corpus.txt").read_text(), 300).save(pretrained / "tokenizer.json")
    for argv in readme_commands():
        command = " ".join(argv)
        if argv[0] == "upcycle":
            assert cli_main(argv) == 0, command
        elif argv == ["train", "--help"]:
            with pytest.raises(SystemExit) as done:
                cli_main(argv)
            assert done.value.code == 0, command
        elif argv[0] == "train":
            extra = [] if "--print-config" in argv else ["--print-config"]
            assert cli_main([*argv, *extra]) == 0, command
        else:  # minutes of training, or the runs of earlier examples: the command line itself
            args, rest = build_parser().parse_known_args(argv)
            assert all("=" in r for r in rest), command
            if args.command == "compare":
                get_experiment("compare", args.preset or "demo")
        printed = capsys.readouterr()
        assert "Traceback" not in printed.err, (command, printed.err)
    assert not (tmp_path / "runs").exists()  # nothing trained


def readme_qwen3(tiny_model):
    """The small pretrained Qwen3 the README's ``path/to/qwen3`` stands for: 8 layers, so that
    the examples' ``block_size=8`` (sublayers, for a real Qwen3 of 28 layers) gives 2 blocks -
    of the fixture's 3 layers (6 sublayers) it is a single block, which warns."""
    return tiny_model("qwen3", max_position_embeddings=2048, num_hidden_layers=8)


def readme_python_blocks() -> list[str]:
    """The README's ``python`` blocks, as written."""
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_every_readme_python_block_runs_as_written(tmp_path):
    """Each ``python`` block of the README runs as written, in a fresh interpreter, in a
    directory that holds what the blocks name: a small pretrained Qwen3 at ``path/to/qwen3``
    and a trained run at ``runs/compare/block/seed0`` (`make demo`'s)."""
    pytest.importorskip("transformers")
    import os
    import subprocess
    import sys

    from fixtures.tiny_families import tiny_model
    from test_train import write_corpus

    blocks = readme_python_blocks()
    assert len(blocks) >= 4 and any("load_run(" in b for b in blocks)
    readme_qwen3(tiny_model).save_pretrained(tmp_path / "path" / "to" / "qwen3")
    corpus = write_corpus(tmp_path / "corpus.txt")
    run = tmp_path / "runs" / "compare" / "block" / "seed0"
    assert cli_main(["train", "data.tokenizer=byte", f"data.paths=[{corpus}]", "seq_len=32", "batch_size=2", "steps=2",
                     "warmup_steps=1", "model.d_model=32", "model.n_heads=2", "model.residual.kind=attnres_block",
                     f"out_dir={run}", "progress=false", "tensorboard=false"]) == 0
    # (one thread, as the suite's other subprocesses: the blocks' small models gain little from more, whose
    # waiting threads spin on a loaded machine - 35 -> 24 CPU-s for the six blocks under load)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(README.parent / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    for i, block in enumerate(blocks):
        done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"README python block {i}:\n{block}\n{done.stderr[-3000:]}"
        # (a warning from an example as written alarms its reader for nothing: the notebook example's
        # eval_batches asked for more validation windows than its text holds. attnres's warnings name the
        # user's line, here the block's, "<string>:N:"; another library's, with its own file, may come and go)
        warned = re.search(r"^<string>:\d+: \w+Warning: .*", done.stderr, re.M)
        assert not warned, f"README python block {i} warns:\n{warned[0]}"


def python_block_under(heading: str) -> str:
    """The first ``python`` block of the README section ``heading``."""
    section = README.read_text().split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_own_model_example_runs_as_written_and_is_attnres():
    """The README's AttnRes-in-your-own-model example: its logits' shape, gradients reaching
    every pseudo-query, and the two-phase schedule equal to the per-sublayer reference."""
    scope: dict = {}
    exec(compile(python_block_under("### AttnRes in your own PyTorch model"), "README.md", "exec"), scope)
    model, logits = scope["model"], scope["logits"]
    assert logits.shape == (2, 64, 1000)
    assert all(not m.query.detach().any() for m in model.residual.mixers)
    logits.square().mean().backward()
    counts = model.residual.sources_per_mixer()  # (a mixer of one source has weight 1 and no gradient)
    assert all(float(m.query.grad.abs().max()) > 0 for m, n in zip(model.residual.mixers, counts) if n > 1)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.residual.mixers[3].query.normal_()  # away from uniform weights
        fast = model(ids)
        model.residual.schedule = "naive"
        assert torch.allclose(model(ids), fast, rtol=1e-4, atol=1e-5)


def test_the_docstrings_of_the_public_packages_show_an_example_that_runs():
    """``help(attnres.nn)`` and ``help(attnres.ops)`` showed one line each and no way to use
    them; the package's own example must keep running as well. ``help(attnres.inference)``'s
    example generated from an ``input_ids`` it never made, from a run that is not there."""
    import doctest

    import attnres
    import attnres.inference
    import attnres.nn
    import attnres.ops

    for module in (attnres, attnres.nn, attnres.ops, attnres.inference):
        tests = doctest.DocTestFinder(recurse=False).find(module, module.__name__, globs={})
        assert tests and tests[0].examples, f"{module.__name__}'s docstring shows no example"
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        for test in tests:
            runner.run(test)
        assert runner.summarize(verbose=False).failed == 0, f"{module.__name__}'s example fails"


def test_make_alone_lists_every_target():
    """``make`` alone ran the first rule, which only built .venv (minutes, without a word)."""
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make")
    makefile = README.parent / "Makefile"
    phony = re.search(r"^\.PHONY: (.*)$", makefile.read_text(), re.M).group(1).split()
    listed = subprocess.run(["make", "-s", "-f", str(makefile)], capture_output=True, text=True, check=True,
                            cwd=README.parent).stdout
    assert [t for t in phony if t != "help" and f"make {t} " not in listed] == [], listed


def make_dry_run(*arguments: str) -> list[list[str]]:
    """The commands ``make -n ARGUMENTS`` prints (runs nothing), each split as the shell would."""
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make")
    printed = subprocess.run(["make", "-n", "-f", str(README.parent / "Makefile"), *arguments], capture_output=True,
                             text=True, check=True, cwd=README.parent).stdout
    return [shlex.split(line) for line in printed.splitlines()]


def test_the_readme_says_how_to_install_without_a_clone():
    """The Quick start was a clone's (`make demo`) and every install line `pip install -e
    ".[EXTRA]"`: a user given a wheel or an sdist read nothing on installing it. The Quick
    start installs both by their file names, of this version, with extras pyproject.toml
    declares, as every `pip install -e` line of the README names one."""
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11)

    project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    text = README.read_text()
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    version = re.escape(project["version"])
    for archive in (rf"attnres-{version}-py3-none-any\.whl", rf"attnres-{version}\.tar\.gz"):
        named = re.findall(rf'"{archive}\[([\w,]+)\]"', quick_start)
        assert named and all(set(e.split(",")) <= extras for e in named), (archive, named)
    clone_lines = re.findall(r'pip install (?:[\w.=<>-]+ )*-e "\.\[([a-z,]+)\]"', text)  # (not the EXTRA placeholder)
    assert clone_lines and all(set(e.split(",")) <= extras for e in clone_lines), clone_lines


def test_make_demo_passes_args_on_as_the_readme_says():
    """``make demo`` took no overrides: a user who wanted ``steps=50`` retyped the command.
    ``ARGS`` is added to it, as the README's quick start shows (and to ``make train``'s)."""
    found = re.search(r'`make demo ARGS="([^"]*)"` runs `(attnres compare [^`]*)`', README.read_text())
    assert found, "the quick start shows make demo ARGS=... and the command it runs"
    (ran,) = [c[c.index("attnres"):] for c in make_dry_run("demo", f"ARGS={found.group(1)}") if "attnres" in c]
    assert ran == shlex.split(found.group(2))
    assert ran[-4:] == ["steps=50", "--seeds", "0", "1"]
    (ran,) = [c for c in make_dry_run("train", 'ARGS=steps=5 "data.paths=[a b.txt]"') if "attnres" in c]
    assert ran[ran.index("attnres"):] == ["attnres", "train", "--config", "configs/train-cpu.yaml", "steps=5",
                                          "data.paths=[a b.txt]"]
    (ran,) = [c for c in make_dry_run("demo") if "attnres" in c]  # without ARGS: the demo as it was
    assert ran[ran.index("attnres"):] == ["attnres", "compare", "--preset", "demo", "--out", "runs/compare"]


def test_the_python_api_of_attnres_analyze_is_named_with_its_signature():
    """The README named the pieces of `attnres analyze` in Python but not the function that
    writes its whole report (a notebook user analysing a checkpoint had to read the CLI's code)."""
    import inspect

    found = re.search(r"`attnres\.experiments\.job\.analyze\.write_analysis(\(.*?\))`", README.read_text())
    assert found, "the README names write_analysis with its signature"
    from attnres.experiments.job.analyze import write_analysis

    written = inspect.signature(eval(f"lambda {found.group(1)[1:-1]}: None"))  # (the README's defaults, as Python)
    assert [(p.name, p.default) for p in written.parameters.values()] == [
        (p.name, p.default) for p in inspect.signature(write_analysis).parameters.values()]


def doc_python_blocks(name: str) -> list[str]:
    """The ``python`` blocks of ``docs/NAME``, as written."""
    return re.findall(r"```python\n(.*?)```", (README.parent / "docs" / name).read_text(), re.S)


def test_the_inference_doc_python_blocks_run_as_written():
    """docs/inference.md's blocks in one namespace, as a reader runs them one after the other:
    the batch generated and streamed, then the static-cache pieces (decode n tokens, rewind).
    Off CUDA the CUDA-graph mode the second block names (its comment: "on CUDA") is swapped for
    its eager twin, decode="static" / mode="eager" - the same step, not captured."""
    import warnings

    blocks = doc_python_blocks("inference.md")
    assert len(blocks) == 2 and 'decode="graph"' in blocks[1] and 'mode="graph"' in blocks[1]
    if not torch.cuda.is_available():
        blocks[1] = blocks[1].replace('decode="graph"', 'decode="static"').replace('mode="graph"', 'mode="eager"')
    scope: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (an example as written should not alarm its reader)
        for i, block in enumerate(blocks):
            exec(compile(block, f"docs/inference.md block {i}", "exec"), scope)
    from attnres.inference import generate

    model, ids, mask, n = scope["model"], scope["ids"], scope["mask"], scope["n"]
    assert scope["new"].shape == (2, 64) and scope["tokens"].shape == (2, n)
    # (the decoder's tokens follow the one fed first, the prefill's greedy pick: generate's from its second on)
    assert torch.equal(scope["tokens"], generate(model, ids, mask, max_new_tokens=n + 1)[:, 1:])
    assert scope["decoder"].length == ids.shape[1]  # rewound to the prompt


def test_the_upcycling_doc_python_block_runs_as_written(tmp_path, monkeypatch):
    """docs/upcycling.md's block on a small pretrained Llama at ``path/to/llama`` (8 layers: the
    block's block_size=8 sublayers gives 2 blocks) with its tokenizer: the directory it writes
    loads after ``import attnres.hf`` with the tokenizer beside it, and computes the original's
    logits."""
    pytest.importorskip("transformers")
    import warnings

    from fixtures.tiny_families import tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attnres.data import ByteTokenizer
    from attnres.hf import make_hf_tokenizer

    (block,) = doc_python_blocks("upcycling.md")
    monkeypatch.chdir(tmp_path)
    original = tiny_model("llama", vocab_size=256, num_hidden_layers=8)
    original.save_pretrained("path/to/llama")
    make_hf_tokenizer(ByteTokenizer()).save_pretrained("path/to/llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(compile(block, "docs/upcycling.md", "exec"), {})
    up = AutoModelForCausalLM.from_pretrained("llama-attnres").eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained("llama-attnres")("The meaning of")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(up(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)


def test_the_readme_resumes_a_pipelined_run_in_one_process_as_it_says(tmp_path, monkeypatch, capsys):
    """The README resumed its pipelined run in one process with ``parallel.pp=1``, as if the
    run's ``pp=2`` carried over: a resume takes ``parallel.*`` from its command (unset: 1),
    never from the run. The command is the run's out_dir alone, and against a run stored at
    ``pp=2`` it resolves to one process."""
    import json

    from attnres.train import load_config

    lines = README.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# resume the pipelined run in one process"))
    command = next(line for line in lines[at:] if not line.startswith("#"))
    argv = shlex.split(command)
    argv = argv[argv.index("attnres") + 1:]
    assert not any(word.startswith("parallel.") for word in argv), command  # (it would say what is so anyway)
    assert "takes parallel.* from its command (unset: 1, one process), never from the run" in " ".join(
        line.lstrip("# ") for line in lines[at:at + 2])
    out_dir = next(word.partition("=")[2] for word in argv if word.startswith("out_dir="))
    monkeypatch.chdir(tmp_path)
    step = tmp_path / out_dir / "checkpoints" / "step-2"  # (its state.json: all --print-config reads)
    step.mkdir(parents=True)
    stored = load_config(None, ["parallel.pp=2", "model.n_layers=4", "model.tie_embeddings=false", f"out_dir={out_dir}"])
    (step / "state.json").write_text(json.dumps({"step": 2, "config": stored.to_dict()}))
    assert cli_main([*argv, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "n_layers: 4" in printed and re.search(r"parallel: \{dp: null, tp: 1, pp: 1,", printed), printed
