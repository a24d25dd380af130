"""Every option and config key the README and docs/ name exists: ``attnres SUBCOMMAND
--option`` in that subcommand's parser (``attnres --import X`` in the top one), ``python
benchmarks/X.py --option`` in that script, a value among those the command lists (``generate
--decode graph``, ``experiment scaling --preset cpu --variants block_s1``), a config key
(``model.residual.block_size``, ``data.val_fraction=...``) among ``TrainConfig``'s fields,
``make TARGET VAR=...`` among the Makefile's targets and variables, an ``ATTNRES_*`` variable
among those the code reads, and a keyword a doc passes one of the package's functions
(``prefill(..., chunk_size=256)``) among its parameters. A renamed option, value, field,
target or keyword left a doc telling users to type what argparse, the config, make or Python
refuses."""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

import pytest

from attnres.cli import build_parser
from attnres.train.config import TrainConfig, flatten

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "benchmarks" / "results").glob("*/README.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
OPTION = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")


def parser_options() -> tuple[set[str], dict[str, set[str]]]:
    """The top-level parser's options, and each subcommand's."""
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    options = lambda p: {o for action in p._actions for o in action.option_strings}  # noqa: E731
    return options(parser), {name: options(command) for name, command in commands.items()}


def attnres_line(commands) -> re.Pattern:
    """``attnres [--top-option ...] COMMAND REST``, up to a pipe, ``;``, ``&`` or the code
    span's end: the top options, the command and the rest as groups."""
    return re.compile(r"\battnres((?:\s+--[\w-]+(?:[ =](?!-)[^\s`]+)?)*)\s+(" + "|".join(commands)
                      + r")\b([^`\n|;&]*)")


def joined(text: str) -> str:
    """``text`` with the lines a trailing ``\\`` continues joined (a long command's options
    go on its next lines)."""
    return re.sub(r"\\\n\s*", " ", text)


def unknown_options(text: str, top: set[str], commands: dict[str, set[str]], root: Path = ROOT) -> list[str]:
    """``attnres [--top-option ...] COMMAND ... --option`` and ``python benchmarks/X.py ...
    --option`` in ``text`` (on one line, lines continued with ``\\`` joined, up to a pipe,
    ``;`` or ``&&``) whose option the command lacks: not in the subcommand's parser, or not
    written in the script's source."""
    command_line = attnres_line(commands)
    script_line = re.compile(r"\bpython3?\s+((?:benchmarks|studies)/[\w/.-]+\.py)([^`\n|;&]*)")
    problems = []
    for line in joined(text).splitlines():
        for before, command, after in command_line.findall(line):
            problems += [f"attnres {o}" for o in OPTION.findall(before) if o not in top]
            problems += [f"attnres {command} {o}" for o in OPTION.findall(after) if o not in commands[command]]
        for script, after in script_line.findall(line):
            source = (root / script).read_text() if (root / script).exists() else ""
            problems += [f"{script} {o}" for o in OPTION.findall(after) if f'"{o}"' not in source]
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_option_a_doc_names_is_its_command_s(doc):
    assert unknown_options(doc.read_text(), *parser_options()) == []


def test_the_option_check_finds_an_option_its_command_lacks(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "b.py").write_text('parser.add_argument("--out")')
    top, commands = {"--import"}, {"train": {"--config"}, "generate": {"--seed"}}
    text = ("`attnres --import m train --config c.yaml --gone` then\n"
            "attnres --nope x generate --seed 1 | grep --count x\n"
            "python benchmarks/b.py --out d --missing && attnres generate --seed 2\n"
            "attnres train --config c.yaml \\\n    --lost x\n"
            "python benchmarks/b.py \\\n  --out d --far\n")
    assert unknown_options(text, top, commands, tmp_path) == [
        "attnres train --gone", "attnres --nope", "benchmarks/b.py --missing", "attnres train --lost",
        "benchmarks/b.py --far"]


def choices() -> dict[tuple[str, str], set[str]]:
    """The values a subcommand's option or positional takes where its parser lists them
    (``generate --decode``, ``experiment NAME``; a positional as ``""``)."""
    return {(name, option): {str(c) for c in action.choices}
            for name, command in build_parser().commands.items() for action in command._actions
            if action.choices and not isinstance(action, argparse._SubParsersAction)
            for option in (action.option_strings or [""])}


def grid_values(command: str, name: str | None, preset: str | None) -> tuple[set[str], set[str]]:
    """The presets of ``attnres compare`` / ``attnres experiment NAME``, and its grid's
    variants at ``preset`` (or the command's default preset)."""
    from attnres.cli.experiment import DEFAULT_PRESET
    from attnres.experiments import PRESETS, get_experiment

    name = "compare" if command == "compare" else name
    if name not in PRESETS:
        return set(), set()
    preset = preset or DEFAULT_PRESET.get(name, "cpu")
    variants = {v.name for v in get_experiment(name, preset).variants} if preset in PRESETS[name] else set()
    return set(PRESETS[name]), variants


#: A value a doc names that is no value of this version, for a reason the doc says.
NOT_VALUES = {"attnres experiment no-free-lunch"}  # experiments.md: the study's grid when it lived in the package
#: A placeholder of a value: ``NAME``, ``{a,b}``, ``<dir>``, ``...``, and ``step|tokens`` (up
#: to its ``|``, a table cell's ``step\|tokens`` up to its ``\``).
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*|.*[{}<>\\].*|.*\.\.\..*")


def unknown_values(text: str, commands: set[str], listed: dict[tuple[str, str], set[str]],
                   grids=grid_values) -> list[str]:
    """The values ``attnres COMMAND ...`` lines of ``text`` give where the command lists the
    ones it takes - an option's or a positional's choices, the grid and ``--preset`` of
    ``compare`` and ``experiment``, and the variants ``--variants`` names - that are not
    among them (placeholders, ``NAME`` or ``{a,b}``, are not values)."""
    problems = []
    for _, command, after in attnres_line(commands).findall(joined(text)):
        words = [w.strip("\"'[]") for part in after.split()  # (--option=value as two words; [--option value])
                 for w in (part.split("=", 1) if part.startswith("--") else [part])]
        given = lambda option: words[words.index(option) + 1] if option in words[:-1] else None  # noqa: E731
        values = []
        if words and (command, "") in listed and not words[0].startswith("-"):
            values.append(("", words[0], listed[command, ""]))
        values += [(option, given(option), allowed) for (c, option), allowed in listed.items()
                   if c == command and option and given(option) is not None]
        if command in ("compare", "experiment"):
            name = words[0] if command == "experiment" and words else None
            presets, variants = grids(command, name, given("--preset"))
            if presets and given("--preset") is not None:
                values.append(("--preset", given("--preset"), presets))
            if variants and "--variants" in words:
                for word in words[words.index("--variants") + 1:]:
                    if word.startswith("-") or "=" in word:
                        break
                    values.append(("--variants", word, variants))
        for option, value, allowed in values:
            shown = f"attnres {command}" + (f" {option}" if option else "") + f" {value}"
            if value not in allowed and not PLACEHOLDER.fullmatch(value) and shown not in NOT_VALUES:
                problems.append(shown)
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_value_a_doc_gives_a_command_is_one_it_takes(doc):
    assert unknown_values(doc.read_text(), set(build_parser().commands), choices()) == []


def test_the_value_check_finds_a_value_its_command_refuses():
    listed = {("generate", "--decode"): {"auto", "graph"}, ("experiment", ""): {"scaling", "compare"}}
    grids = lambda command, name, preset: ({"tiny", "cpu"}, {"block_s1", "full_s1"})  # noqa: E731
    text = ("`attnres generate --decode graph`, `attnres generate --decode=cuda-graph`, "
            "`attnres generate --decode {auto,graph}`, `attnres experiment NAME --preset cpu`, "
            "`attnres generate [--decode graf]`\n"
            "attnres experiment scalling --preset small --out d \\\n  --variants block_s1 blok_s1 --seeds 0 &\n"
            "attnres compare --preset long --variants full_s1 steps=5 oops\n")
    assert unknown_values(text, {"generate", "experiment", "compare"}, listed, grids) == [
        "attnres generate --decode cuda-graph", "attnres generate --decode graf", "attnres experiment scalling",
        "attnres experiment --preset small", "attnres experiment --variants blok_s1", "attnres compare --preset long"]
    assert choices()[("generate", "--decode")] >= {"auto", "graph"} and "scaling" in choices()[("experiment", "")]
    assert grid_values("compare", None, "long")[0] == {"tiny", "demo", "long"}
    assert {"block_s4", "full_s1"} <= grid_values("experiment", "scaling", None)[1]


#: Keys a ``model`` section takes besides ``ModelConfig``'s fields (``train/config.py``'s
#: ``model_from_spec``), and the mappings whose keys are free: a residual's own options
#: and a transformers family's config.
MODEL_SPEC_KEYS = {"model.preset", "model.from_hf"}
FREE_MAPPINGS = ("model.residual.options.", "model.hf_config.")
#: Dotted names the docs show that are not keys, each for a reason the doc says.
NOT_KEYS = {"model.block_size",  # README: the wrong key whose error names model.residual.block_size
            "model.config"}  # upcycling.md: a transformers model's attribute
#: A dotted name that may be a key: not a call (``model.to(...)``), not a file name
#: (``model.safetensors``, ``model.safetensors.index.json``).
KEY = re.compile(r"(?<![\w.$/-])((?:model|data|parallel)(?:\.\w+)+)(?![\w(.])(?<!\.safetensors)(?<!\.json)")


def config_keys() -> set[str]:
    """Every key an override or a YAML file may set, and every section above one."""
    keys = set(flatten(TrainConfig().to_dict())) | MODEL_SPEC_KEYS
    return keys | {key.rsplit(".", i)[0] for key in keys for i in range(1, key.count("."))}


def unknown_keys(text: str, keys: set[str]) -> list[str]:
    """The config keys ``text`` names that ``keys`` lacks: a code span that is a key, and a
    ``key=value`` in a code span or a ``bash`` block (Python code's ``data.train`` is not one)."""
    bash = [block for block in FENCE.findall(text) if block.startswith("```bash")]
    named = [span for span in CODE_SPAN.findall(FENCE.sub("", text)) if KEY.fullmatch(span)]
    for code in [*CODE_SPAN.findall(FENCE.sub("", text)), *bash]:
        named += re.findall(KEY.pattern + r"(?==)", code)
    return [key for key in named
            if key not in keys and key not in NOT_KEYS and not key.startswith(FREE_MAPPINGS)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_config_key_a_doc_names_is_a_field(doc):
    assert unknown_keys(doc.read_text(), config_keys()) == []


def test_the_key_check_finds_a_key_no_config_has():
    keys = config_keys()
    assert {"model.residual.block_size", "model.residual", "data.val_fraction", "model.preset"} <= keys
    text = ("`model.residual.block_size` and `data.val_fraction=0.1`, `model.residual.options.init=0.5`, "
            "`model.residual.blocksize`, `model.to(device)`, `model.safetensors.index.json`\n"
            "```bash\nattnres train parallel.pp=2 data.val=0.1\n```\n"
            "```python\nx = data.train_tokens\n```\n")
    assert unknown_keys(text, keys) == ["model.residual.blocksize", "data.val"]


def unknown_make_targets(text: str, makefile: str) -> list[str]:
    """``make TARGET`` in the code spans and ``bash`` blocks of ``text`` whose target the
    Makefile lacks (prose's "make it" is not a command)."""
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    code = [*CODE_SPAN.findall(FENCE.sub("", text)),
            *(block for block in FENCE.findall(text) if block.startswith("```bash"))]
    return [target for span in code for target in re.findall(r"(?<![\w-])make ([a-z][\w-]*)", span)
            if target not in targets]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_make_target_a_doc_names_exists(doc):
    assert unknown_make_targets(doc.read_text(), (ROOT / "Makefile").read_text()) == []


def test_the_make_check_finds_a_target_the_makefile_lacks():
    makefile = "test: venv\n\tpytest\nbench-serving:\n\tpython b.py\n"
    text = "`make test`, to make it run; `make gone`\n```bash\nmake bench-serving && make lost\n```\n"
    assert unknown_make_targets(text, makefile) == ["gone", "lost"]


def unknown_make_variables(text: str, makefile: str) -> list[str]:
    """``make TARGET VAR=value`` in the code spans and ``bash`` blocks of ``text`` whose
    variable the Makefile does not set (make would take it and change nothing)."""
    variables = set(re.findall(r"^([A-Z][A-Z0-9_]*)\s*[?:]?=", makefile, re.M))
    code = [*CODE_SPAN.findall(FENCE.sub("", text)),
            *(block for block in FENCE.findall(text) if block.startswith("```bash"))]
    return [variable for span in code for command in re.findall(r"(?<![\w-])make [a-z][\w-]*((?: [A-Z]\w*=\S*)+)", span)
            for variable in re.findall(r" ([A-Z]\w*)=", command) if variable not in variables]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_make_variable_a_doc_sets_is_the_makefile_s(doc):
    assert unknown_make_variables(doc.read_text(), (ROOT / "Makefile").read_text()) == []


def test_the_make_variable_check_finds_one_the_makefile_does_not_set():
    makefile = "PYTEST_ARGS ?=\nTORCH_SPEC := torch\nARGS = \ntest: venv\n\tpytest $(PYTEST_ARGS)\n"
    text = ("`make test PYTEST_ARGS=-x`, `make test PYTEST_ARG=-x`\n"
            "```bash\nmake demo ARGS=\"steps=5\" TORCH=2.13\n```\n")
    assert unknown_make_variables(text, makefile) == ["PYTEST_ARG", "TORCH"]


def unknown_environment_variables(text: str, sources: str) -> list[str]:
    """The ``ATTNRES_*`` environment variables ``text`` names that ``sources`` (the package's,
    the tests', the benchmarks' and the Makefile's text) never reads or sets."""
    return sorted({name for name in re.findall(r"\bATTNRES_[A-Z0-9_]+\b", text)
                   if not re.search(rf"[\"']{name}[\"']|\b{name}=|\$\(?{name}\b", sources)})


def attnres_sources() -> str:
    """The text of every file that may read or set an ``ATTNRES_*`` variable."""
    files = [p for folder in ("src", "tests", "benchmarks") for p in (ROOT / folder).rglob("*.py")]
    return "\n".join([p.read_text() for p in files] + [(ROOT / "Makefile").read_text()])


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_attnres_environment_variable_a_doc_names_is_read(doc):
    assert unknown_environment_variables(doc.read_text(), attnres_sources()) == []


def test_the_environment_check_finds_a_variable_nothing_reads():
    sources = 'os.environ.get("ATTNRES_CPU_KERNEL")\n\tATTNRES_HYPOTHESIS=explore pytest\n'
    text = "`ATTNRES_CPU_KERNEL=0`, `ATTNRES_HYPOTHESIS=explore`, `ATTNRES_NO_KERNEL=1`, $ATTNRES_GONE"
    assert unknown_environment_variables(text, sources) == ["ATTNRES_GONE", "ATTNRES_NO_KERNEL"]


#: Where a doc names the package's Python functions: a bare name (``prefill(...)``,
#: ``ModelConfig.preset(...)``) is looked up in these, a dotted ``attnres.x.f(...)`` where it says.
API_MODULES = ("attnres", "attnres.inference", "attnres.checkpoint", "attnres.train", "attnres.data",
               "attnres.models", "attnres.nn", "attnres.analysis", "attnres.experiments", "attnres.hf")
#: Calls a doc writes with a keyword our function of that name does not take, each for a reason:
#: transformers' ``model.generate`` (hf.md, testing.md), the README's example of a keyword
#: ``TrainConfig`` refuses, and kernels.md's notation for a fused norm's input.
NOT_OUR_CALLS = {"generate(use_cache=True)", 'generate(..., cache_implementation="static")',
                 "generate(inputs_embeds=...)", "TrainConfig(val_fraction=0.1)", "RMSNorm(h, readers=k)"}


def api_function(name: str):
    """The package's callable ``name`` names, or None (another library's, a method of a
    variable: ``model.generate``)."""
    import importlib

    if name.startswith("attnres."):  # the longest module the name starts with, then its attributes
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            try:
                found = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attribute in parts[i:]:
                found = getattr(found, attribute, None)
            return found if callable(found) else None
        return None
    for module in API_MODULES:
        try:
            found = importlib.import_module(module)
        except ImportError:  # (an extra not installed: transformers for attnres.hf)
            continue
        for attribute in name.split("."):
            found = getattr(found, attribute, None)
        if callable(found):
            return found
    return None


def unknown_keywords(text: str, resolve=api_function) -> list[str]:
    """``name(..., keyword=...)`` in the code spans of ``text`` whose function (the package's,
    by ``resolve``) takes no such keyword (nor ``**kwargs``)."""
    problems = []
    for span in CODE_SPAN.findall(FENCE.sub("", text).replace("\n", " ")):
        for name, arguments in re.findall(r"(?<![\w.])((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\(([^()]*)\)", span):
            function = resolve(name)
            if function is None or f"{name.rsplit('.', 1)[-1]}({arguments})" in NOT_OUR_CALLS:
                continue
            try:
                parameters = inspect.signature(function).parameters
            except (TypeError, ValueError):  # (a builtin without one)
                continue
            if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
                continue
            keywords = re.findall(r"(?:^|,)\s*([A-Za-z_]\w*)\s*=(?!=)", arguments)
            problems += [f"{name}({keyword}=)" for keyword in keywords if keyword not in parameters]
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_keyword_a_doc_passes_a_function_of_the_package_is_one_it_takes(doc):
    assert unknown_keywords(doc.read_text()) == []


def test_the_keyword_check_finds_a_keyword_the_function_lacks():
    def load_run(path, device="cpu"):
        pass

    resolve = {"load_run": load_run, "attnres.inference.load_run": load_run}.get
    text = ("`load_run(path, device=\"cpu\")`, `attnres.inference.load_run(path, devices=\"cpu\")`,\n"
            "`load_run(path, map_location=None)`, `model.generate(ids, use_cache=True)`\n"
            "```python\nload_run(p, nope=1)\n```\n")
    assert unknown_keywords(text, resolve) == ["attnres.inference.load_run(devices=)", "load_run(map_location=)"]
    assert api_function("prefill") is not None and api_function("ModelConfig.preset") is not None
    assert api_function("attnres.checkpoint.load_checkpoint") is not None and api_function("model.generate") is None
