"""What every ``attnres`` command shares: the parser class, the process's rank under
torchrun (one message per node), the output-place and count checks, the one-line message
for a missing extra, the package's warnings as one line, and the CPU allocator setting."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ..hub import is_hub_id
from ..shell_words import launched, shell_path
from ..user_warning import at_the_raise_site
from ..validation import did_you_mean, did_you_mean_each


class Parser(argparse.ArgumentParser):
    """An argument parser whose ``--help`` can end with text made only when asked for
    (``help_tail``): ``attnres train --help`` lists every config field that way.
    ``override_keys``: for a command that takes ``key=value`` overrides, the top-level keys
    (asked for only on an error), so that ``--steps 5`` is answered with ``steps=5``.
    ``path_option``: the option that takes the file the positional takes too (train's
    ``--config``), so that a file named ``-c.yaml``, which argparse reads as an option, is
    answered with both ways to give it; every command's path named ``-run`` (that exists) and
    value given as ``--out -g`` are answered with the way argparse reads them.
    Under a launch it prints once per node (:func:`first_on_node`)."""

    def __init__(self, *args, help_tail: Callable[[], str] | None = None,
                 override_keys: Callable[[], Iterable[str]] | None = None, path_option: str | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.help_tail = help_tail
        self.override_keys = override_keys
        self.path_option = path_option

    def parse_known_args(self, args=None, namespace=None):
        # kept for the hint of a missing required option: a misspelt ``--promt`` makes
        # argparse say only that ``--prompt`` is required (its check comes before the one of
        # unrecognised arguments); a subcommand's parser is given its own part of the line
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        text = super().format_help()
        return text + "\n" + self.help_tail() + "\n" if self.help_tail is not None else text

    def _print_message(self, message, file=None) -> None:
        # argparse prints --help and --version here; every rank of a launch (torchrun ...
        # train --help) asked alike: printed once per node, as the other messages are
        if first_on_node():
            super()._print_message(message, file)

    def error(self, message: str):
        if not first_on_node():  # every rank of a launch parses the same line: one message per node
            leave_the_message_to_the_first_on_node()
            self.exit(2)
        super().error(message + self._nearest_hint(message))

    def _nearest_hint(self, message: str) -> str:
        """For argparse's messages of a misspelling (an invalid choice, an unrecognised option,
        a required option missing because it was misspelt) the nearest allowed one:
        ``attnres analyse`` -> 'analyze', ``--temprature`` -> '--temperature' (Python 3.14's
        ``suggest_on_error``, for every Python we run on)."""
        choice = re.search(r"invalid choice: (\S+) \(choose from (.*)\)$", message)
        if choice:
            value = choice.group(1).strip("'\"")
            return did_you_mean(value, [c.strip().strip("'\"") for c in choice.group(2).split(",")])
        if message.startswith("unrecognized arguments: "):
            words = message[len("unrecognized arguments: "):].split()
            return self._unknown_options_hint(words) + self._dash_file_hint(words)
        missing = re.fullmatch(r"argument (\S+): expected one argument", message)
        if missing:  # (`--out -g`: argparse took the value for an option)
            given = getattr(self, "_given", [])
            names = missing.group(1).split("/")
            following = [given[i + 1] for i, word in enumerate(given[:-1]) if word in names]
            if self.path_option in names:
                return self._dash_file_hint(following)
            return self._dash_value_hint(names[-1], following)
        if message.startswith("the following arguments are required: ") or re.match(r"one of the arguments .* is "
                                                                                      r"required$", message):
            return self._unknown_options_hint(getattr(self, "_given", []))
        return ""

    def _unknown_options_hint(self, words: list[str]) -> str:
        options = [o for action in self._actions for o in action.option_strings]
        # (--import is attnres's own option, misplaced after the command: main() says so)
        flags = dict.fromkeys(w.split("=")[0] for w in words if w.startswith("--") and w.split("=")[0] != "--import")
        unknown = [f for f in flags if f not in options]
        return did_you_mean_each(unknown, options, meant=self._overrides_meant(words, unknown))

    def _dash_file_hint(self, words: list[str]) -> str:
        """For each of ``words`` that names a path but starts with '-' (``attnres eval -run``,
        ``attnres train -c.yaml``: argparse took it for an option, and ``--config -c.yaml`` for
        a missing value), the forms argparse reads as the path: ``./-run``, and for train's
        config file ``--config=-c.yaml`` too (a ``.yaml`` name there need not exist yet to be
        meant)."""
        options = {o for action in self._actions for o in action.option_strings}
        config = self.path_option is not None
        paths = [w for w in words if w.startswith("-") and "=" not in w and w not in options
                 and (w.endswith((".yaml", ".yml")) or os.path.isfile(w) if config
                      else os.path.exists(os.path.expanduser(w)))]
        forms = [f"{w!r} starts with '-', which argparse reads as an option: give the "
                 + (f"file as {shell_path(w)} or {shlex.quote(f'{self.path_option}={w}')}" if config
                    else f"path as {shell_path(w)}") for w in paths]
        return f" ({'; '.join(forms)})" if forms else ""

    def _dash_value_hint(self, option: str, words: list[str]) -> str:
        """For the value ``option`` was given that starts with '-' (``--out -g``, ``--model
        -run``), which argparse read as an option and so found no value: the form it reads as
        the value, ``--out=-g``. Nothing for a word that is one of the options (the value was
        left out)."""
        options = {o for action in self._actions for o in action.option_strings}
        values = [w for w in words if w.startswith("-") and w not in options]
        forms = [f"{w!r} starts with '-', which argparse reads as an option: give it as {shlex.quote(f'{option}={w}')}"
                 for w in dict.fromkeys(values)]
        return f" ({'; '.join(forms)})" if forms else ""

    def _overrides_meant(self, words: list[str], unknown: list[str]) -> dict[str, str]:
        """The override each unknown ``--KEY[=VALUE]`` of :attr:`override_keys` means, as a
        PyTorch script's options are written (``--steps 5``, ``--lr=3e-4``,
        ``--model.d-model 64``): ``steps=5``; argparse's nearest option was ``--help``."""
        if self.override_keys is None or not unknown:
            return {}
        keys, meant = set(self.override_keys()), {}
        words = getattr(self, "_given", words)  # (argparse took a value after a flag for the overrides: `--steps 5`)
        for i, word in enumerate(words):
            flag, eq, value = word.partition("=")
            key = flag[2:].replace("-", "_")
            if flag not in unknown or key.split(".")[0] not in keys:
                continue
            following = words[i + 1] if i + 1 < len(words) else "-"
            if not eq and not following.startswith("-") and "=" not in following:
                value = following
            meant[flag] = f"{key}={value if value or eq else 'VALUE'}"
        return meant


#: What the reading commands take as their checkpoint.
CHECKPOINT_HELP = "a checkpoint directory (step-*) or a run directory (its newest)"
#: What generate, eval and analyze take there besides (their transformers path).
TRANSFORMERS_HELP = "a transformers directory (an export, an upcycle) or a Hugging Face Hub id (ORG/NAME)"


def add_checkpoint_argument(parser: argparse.ArgumentParser, transformers: bool = False) -> None:
    """The checkpoint a command reads, given either way: ``attnres generate runs/x ...`` or
    ``attnres generate --checkpoint runs/x ...`` (:func:`resolve_checkpoint` makes
    ``args.checkpoint`` of it after parsing). ``transformers``: the command reads a
    transformers directory or a Hub id there too, and its help says so."""
    what = f"{CHECKPOINT_HELP}, or {TRANSFORMERS_HELP}" if transformers else CHECKPOINT_HELP
    parser.add_argument("checkpoint_path", nargs="?", metavar="CHECKPOINT", help=f"{what} (or --checkpoint)")
    parser.add_argument("--checkpoint", help=f"{what} (or as the first argument)")
    parser.set_defaults(checkpoint_parser=parser, checkpoint_transformers=transformers, checkpoint_takes=(
        "a run or checkpoint directory, a transformers directory or a Hub id" if transformers
        else "a run or checkpoint directory"))


#: ``--dtype`` choices of the commands that run a model (``torch`` dtype names).
DTYPES = ("float32", "bfloat16", "float16")


def resolve_checkpoint(args: argparse.Namespace) -> None:
    """``args.checkpoint`` from the positional ``CHECKPOINT`` or ``--checkpoint`` of a
    command that :func:`add_checkpoint_argument` set up (else nothing): one is required, and
    both only when they agree."""
    parser = getattr(args, "checkpoint_parser", None)
    if parser is None:
        return
    given = [p for p in (args.checkpoint_path, args.checkpoint) if p is not None]
    if not given:
        parser.error(f"the following arguments are required: CHECKPOINT ({args.checkpoint_takes}, or "
                     "--checkpoint DIR)")
    if len(set(given)) > 1:
        parser.error(f"two checkpoints given: {given[0]!r} and --checkpoint {given[1]!r}; give one")
    args.checkpoint = given[0]
    if not Path(args.checkpoint).exists() and not (args.checkpoint_transformers and is_hub_id(args.checkpoint)):
        from ..checkpoint.locate import no_checkpoint_at

        # (named as given, before the command loads anything: the loaders' own message names
        # the path only, as a library function's argument)
        parser.error(f"{'CHECKPOINT' if args.checkpoint_path is not None else '--checkpoint'} "
                     f"{no_checkpoint_at(args.checkpoint)}")
    del args.checkpoint_path, args.checkpoint_parser, args.checkpoint_takes, args.checkpoint_transformers


#: The arguments whose empty value the command itself explains: free text (``--prompt ""``:
#: nothing to continue), a task list ('none' for no task), the training overrides.
OWN_EMPTY_MESSAGE = frozenset({"prompt", "tasks", "overrides"})

#: The arguments whose spaces are text (``attnres generate --stop " "``, a blank line as
#: ``--stop $'\n\n'``): only ``""`` is empty.
SPACES_ARE_TEXT = frozenset({"stop"})


#: The arguments that name a file or folder (the commands' dests): a ``~`` leading one is the
#: home directory, as in a training config's paths. The shell leaves it where the path is
#: quoted for its spaces (``attnres status "~/my runs"``: "'.' holds no '~'", while
#: ``attnres train "out_dir=~/my runs"`` trained there).
PATH_ARGUMENTS = frozenset({"config", "resume_from", "out", "checkpoint_path", "checkpoint", "compare", "text",
                            "tokenizer", "prompt_file", "model", "dirs"})


def expand_home(args: argparse.Namespace) -> None:
    """``~`` and ``~user`` at the start of the path arguments (:data:`PATH_ARGUMENTS`) of
    ``args``, expanded in place."""
    def expanded(value):
        return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value

    for dest in PATH_ARGUMENTS & vars(args).keys():
        value = getattr(args, dest)
        setattr(args, dest, list(map(expanded, value)) if isinstance(value, list) else expanded(value))


def refuse_empty_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """An option or argument given as an empty string (``--out ""``; a shell variable that is
    not set, ``--out "$DIR"``) is a usage error naming it: as a path it was read as the
    current directory ('.', where export wrote its model), and an empty ``--resume-from`` or
    ``--preset`` was taken as not given (a new run, the default grid, trained)."""
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        spaces = action.dest in SPACES_ARE_TEXT
        if action.dest in OWN_EMPTY_MESSAGE or not any(isinstance(v, str) and not (v if spaces else v.strip())
                                                       for v in (value if isinstance(value, list) else [value])):
            continue
        name = max(action.option_strings, key=len) if action.option_strings else action.metavar or action.dest
        said = _first_clause(action.help or "")
        parser.error(f"{name} is empty" + (f"; {name}: {said}" if said else ""))


def _first_clause(help_text: str) -> str:
    """An option's ``--help`` up to its first ``;`` outside parentheses, without the
    parenthesised notes of its default or other spelling (``(default 8)``, ``(or --checkpoint)``)."""
    depth = 0
    for i, c in enumerate(help_text):
        depth += (c == "(") - (c == ")")
        if c == ";" and depth == 0:
            help_text = help_text[:i]
            break
    return re.sub(r" \((?:default|or )[^()]*(?:\([^()]*\)[^()]*)*\)", "", help_text).strip()


def first_on_node() -> bool:
    """Whether this process prints what every process of a launch would print alike: one
    process, or the first rank of its node (torchrun's ``LOCAL_RANK`` 0)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


#: How long a rank that leaves an error every rank has to the first rank of its node waits
#: before it exits (seconds): torchrun stops a launch's other ranks as soon as one fails, so
#: a silent rank that exited at once could stop the first one before it printed the message
#: (then the user saw none). The first rank's failure stops this one's wait.
SILENT_RANK_WAIT_S = 10.0


def leave_the_message_to_the_first_on_node() -> None:
    """Wait (:data:`SILENT_RANK_WAIT_S`) for the first rank of the node to print the error
    this rank shares with it and end the launch; called by a rank that does not print it
    (``not first_on_node()``) before it exits."""
    time.sleep(SILENT_RANK_WAIT_S)


def refuse_a_multi_rank_launch(command: str, why: str) -> None:
    """``SystemExit`` where a launcher (torchrun) started the one-process ``command`` on
    several ranks: each rank ran all of it (an export, an evaluation, a report, written into
    the same place at once) and printed everything once per rank. Said once per node, with
    ``why`` (what the one process does). Torchrun's workers are told by its run id (a job
    script may export ``WORLD_SIZE`` for its own launch and run such a command beside it)."""
    world = os.environ.get("WORLD_SIZE", "1")
    if "TORCHELASTIC_RUN_ID" not in os.environ or not world.isdigit() or int(world) <= 1:
        return
    if not first_on_node():
        leave_the_message_to_the_first_on_node()
        raise SystemExit(1)
    raise SystemExit(f"attnres {command}: error: it runs in one process ({why}), but torchrun started {world} ranks, "
                     f"each of which would run all of it and write the same files; run it without torchrun: "
                     f"`attnres {command} ...`")


def rank_zero() -> bool:
    """One process, or rank 0 of a launch: the one that reports how a run ended."""
    return os.environ.get("RANK", "0") == "0"


def end_process(status: int | str | None) -> None:
    """End this process now with ``status`` (an exit status, or a message for stderr and
    status 1, as ``SystemExit`` takes them), its output flushed, skipping the interpreter's
    finalization (``os._exit``)."""
    if isinstance(status, str):
        print(status, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status if isinstance(status, int) else 0 if status is None else 1)


def version_line() -> str:
    from .. import __version__

    return f"attnres {__version__}"


class ImportModule(argparse.Action):
    """``--import MODULE``: imported as soon as it is parsed, so that what it registers is
    known to everything after it (config validation, ``train --help``). The current directory
    is searched first, as ``python -m attnres`` does: the ``attnres`` console script alone
    would not find a ``my_residuals.py`` beside the user. A ``.py`` file's path imports that
    file's module (its directory searched first)."""

    def __call__(self, parser, namespace, value, option_string=None):
        import importlib

        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module, file = value, Path(value)
        # (else a TypeError about relative imports, or "No module named 'path/to/mine'")
        if file.suffix == ".py" and not file.is_file():
            parser.error(f"--import {value}: no such file {str(file.resolve())!r}")
        if file.suffix != ".py" and not all(part.isidentifier() for part in value.split(".")):
            parser.error(f"--import {value}: neither a module name (such as my_residuals) nor the path of a .py file")
        if file.suffix == ".py":  # a file's path: its module, found beside it
            module, folder = file.stem, str(file.resolve().parent)
            if folder not in sys.path:
                sys.path.insert(0, folder)
        try:
            importlib.import_module(module)
        except ImportError as e:
            here = [p.stem for p in Path.cwd().glob("*.py")]
            hint = did_you_mean(module, here) if getattr(e, "name", None) == module else ""
            parser.error(f"--import {value}: {e}{hint}")
        except SyntaxError as e:  # (a traceback through argparse's internals, before the command had started)
            where = f"{e.filename}, line {e.lineno}" + (f": {e.text.strip()}" if e.text and e.text.strip() else "")
            parser.error(f"--import {value}: {e.msg} in {where}; fix the module, or run "
                         f"`python {shell_path(e.filename)}` to see it")
        # As given, for the checkpoints to record (record_given_imports); a file's path made
        # absolute: the hint of a later command in another folder named a file not there.
        getattr(namespace, self.dest).append(str(file.resolve()) if file.suffix == ".py" else value)


def record_given_imports(values: list[str]) -> None:
    """The command's ``--import`` values, as given, for the checkpoints it writes to record, so
    that a later command without them can name them (:mod:`attnres.nn.residual.imports`).
    Without any, no model code is imported for it (``attnres status`` stays light); those of an
    earlier command of this process are forgotten."""
    if values or f"{__name__.split('.')[0]}.nn.residual.imports" in sys.modules:
        from ..nn.residual.imports import set_given_imports

        set_given_imports(values)


def residual_import(kind: str) -> str | None:
    """The ``--import`` argument that registers residual ``kind`` in another process, as this
    one has it: its module's name (a module beside the user, or in a package), else its file's
    path; ``None`` for a built-in variant, a name not registered here, or a class of a script
    run as ``__main__`` (nothing to import)."""
    from ..nn.residual import residual_class

    try:
        cls = residual_class(kind)
    except ValueError:
        return None
    name = cls.__module__
    if cls.builtin() or name == "__main__":
        return None
    file = getattr(sys.modules.get(name), "__file__", None)
    if "." in name or file is None or Path(file).resolve().parent == Path.cwd().resolve():
        return name
    return str(Path(file).resolve())  # (`--import my_residuals` finds it only from its own folder)


def attnres_command(kind: str) -> str:
    """``attnres`` as another process must be started for residual ``kind``: with the
    ``--import`` that registers it (:func:`residual_import`) where it is the user's own."""
    import shlex

    module = residual_import(kind)
    return f"attnres --import {shlex.quote(module)}" if module else "attnres"


def resume_command(out_dir: str, attnres: str, parallel: dict, world: int, per_node: int | None) -> str:
    """The command that resumes the run in ``out_dir`` as it was launched: ``attnres`` (as
    :func:`attnres_command` gives it), in one process, or for ``world`` ranks under torchrun
    with the run's ``parallel`` settings that differ from the defaults (the stored config
    leaves the layout to the launch, so a plain ``--resume`` trains in one process).
    ``per_node``: ranks per node; ``None`` or fewer than ``world`` (several nodes): the
    launch's own options are the user's to repeat (``torchrun ...``)."""
    from ..distributed.parallel import ParallelConfig

    resume = f"out_dir={shell_path(out_dir)} --resume"
    if world <= 1:
        return f"{attnres} train {resume}"
    default = ParallelConfig().to_dict()
    layout = "".join(f" parallel.{k}={str(v).lower() if isinstance(v, bool) else v}"
                     for k, v in parallel.items() if k in default and v != default[k])
    return launched(f"{attnres} train {resume}{layout}", world, per_node)


def apply_cpu_allocator(settings: dict) -> None:
    """``cpu_allocator`` of a training config (``settings``: its fields; default
    ``"retain"``), applied to this process when it trains on the CPU. The command sets it for
    its own process only; the library never changes malloc (attnres.train.cpu_memory)."""
    import torch

    from ..train import TrainConfig
    from ..train.cpu_memory import set_cpu_allocator

    device = settings.get("device", "auto")
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        set_cpu_allocator(settings.get("cpu_allocator", TrainConfig.cpu_allocator))


#: The extra each command needs beyond torch (pyproject.toml's optional dependencies); every
#: command but ``env``, which needs none (``status`` reads checkpoints: safetensors).
COMMAND_EXTRAS = {"train": "train", "generate": "train", "status": "train", "compare": "experiments",
                  "experiment": "experiments", "analyze": "experiments", "plot": "experiments", "export": "hf",
                  "eval": "hf", "upcycle": "upcycle"}
#: The extras that bring another extra's packages with their own (pyproject.toml: ``upcycle =
#: [gguf, attnres[hf]]``): where a command's extra brings the missing module's, the line names
#: the command's - one install - rather than the module's, after which the command fails again.
EXTRAS_BROUGHT = {"upcycle": ("hf",)}
#: The extra of a module that a command needs only for some of its inputs, whatever the
#: command's own extra: transformers for a transformers directory, a family's model
#: (``model.hf_architecture``) or ``generate --chat`` (the train and experiments extras hold
#: none), gguf for ``upcycle`` of a GGUF file.
MODULE_EXTRAS = {"transformers": "hf", "gguf": "upcycle"}


def runs_under(command: str, dirs: list[str]) -> list:
    """The training run directories at or under each of ``dirs`` (each once, in order:
    :func:`attnres.train.status.find_runs`); a folder that does not exist ends ``attnres
    command`` with its one-line error."""
    from pathlib import Path

    from ..checkpoint.locate import holds_hf_model
    from ..train.status import find_runs
    from ..validation import missing_path_hint

    missing = [d for d in dirs if not Path(d).exists()]
    if missing:
        named = ", ".join(repr(d) + missing_path_hint(d, directories_only=True) for d in missing)
        raise SystemExit(f"attnres {command}: error: no such folder: {named}")
    try:
        found = {d: find_runs(d) for d in dirs}
    except PermissionError as e:  # (a folder this user may not list: a traceback)
        raise SystemExit(f"attnres {command}: error: DIR: {str(e.filename)!r} cannot be read: permission denied") from None
    files = [d for d in dirs if not found[d] and Path(d).is_file()]  # (a file of a run stands for its run)
    if files:
        raise SystemExit(f"attnres {command}: error: {', '.join(map(repr, files))} is a file, not a run or a folder "
                         "of runs")
    # (an upcycle or export: "no training runs under" it, the way a folder not yet trained into reads)
    models = [d for d in dirs if not found[d] and holds_hf_model(d)]
    if models:
        raise SystemExit(f"attnres {command}: error: {', '.join(map(repr, models))} is a Hugging Face model directory "
                         "(an upcycle, an export), not a training run: attnres generate, eval and analyze read it, and "
                         "`attnres train model.from_hf=DIR init_from=DIR out_dir=RUN` trains a run from it")
    # once per run, however it was spelt: `attnres plot /abs/run run` drew one run labelled "." (the
    # two paths' common folder is the run) and `attnres status` listed it twice
    once: dict = {}
    for path in (path for runs in found.values() for path in runs):
        once.setdefault(path.resolve(), path)
    return list(once.values())


def missing_extra(argv: list[str], error: ImportError) -> str | None:
    """The one-line error for a command of ``argv`` that failed to import a third-party
    module: which extra to install. ``None`` when ``error`` is not about such a module."""
    missing = (error.name or "").partition(".")[0]
    if not missing or missing == "attnres":
        return None
    from ..extras import install_command

    command = next((a for a in argv if a in COMMAND_EXTRAS), None)
    own = COMMAND_EXTRAS.get(command, "train")
    extra = MODULE_EXTRAS.get(missing, own)
    if extra in EXTRAS_BROUGHT.get(own, ()):
        extra = own
    return (f"attnres{f' {command}' if command else ''}: error: this needs the '{extra}' extra: "
            f"{install_command(extra)} (the module {missing!r} is not installed)")


def check_output_dir(command: str, out: str) -> None:
    """``--out`` of ``command``, a directory to write into, checked before any work."""
    from ..output_paths import OutputPathError
    from ..output_paths import check_output_dir as check

    try:
        check(out, "--out")
    except OutputPathError as e:
        raise SystemExit(f"{command}: error: {e}") from None


#: The package's directory: a warning raised from a file under it is the package's own.
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def plain_warnings() -> Iterator[None]:
    """Within: the package's own warnings printed as one line, ``attnres: warning: ...``, as a
    command's other messages are, instead of Python's ``file:line: UserWarning: ...`` and a
    line of our source; other packages' warnings as Python prints them. Under torchrun the
    package's own are printed by the first rank of each node only, as the errors every rank has
    alike are: the ranks of a node run one command on the same files (a deprecated key, a
    warm-up longer than the run), and those a rank has alone are rank 0's (a stale lock taken
    over), which is the first of its node."""
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        try:
            ours = Path(filename).resolve().is_relative_to(_PACKAGE_DIR)
        except (OSError, ValueError):
            ours = False
        if not ours:
            return original(message, category, filename, lineno, file, line)
        if not first_on_node():
            return
        stream = sys.stderr if file is None else file
        if stream is not None:  # a warning that names the package for Python's format names it once
            stream.write(f"attnres: warning: {str(message).removeprefix('attnres: ')}\n")

    with warnings.catch_warnings(), at_the_raise_site():  # (no user's line to name: the package's own, printed so)
        warnings.showwarning = show
        yield


def train_config_keys() -> list[str]:
    """``TrainConfig``'s top-level fields: what the training commands' overrides set (imported
    only when a command line is refused: ``--help`` and a good line do without it)."""
    import dataclasses

    from ..train.config import TrainConfig

    return [f.name for f in dataclasses.fields(TrainConfig)]


def override_split_by_the_shell(arguments: list[str]) -> str | None:
    """An override whose YAML list or mapping the shell cut at its spaces, put together again
    (``data.paths=[a.txt,`` ``b.txt]``: ``data.paths=[a.txt, b.txt]``), or ``None``."""
    for i, argument in enumerate(arguments):
        if "=" not in argument:
            continue
        whole = argument
        for word in arguments[i + 1:]:
            depth = whole.count("[") + whole.count("{") - whole.count("]") - whole.count("}")
            if depth <= 0 or "=" in word:
                break
            whole += " " + word
        if whole != argument:
            return whole
    return None
