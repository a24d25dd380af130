"""Whether a run may start from a checkpoint: resume (``resume`` / ``resume_from``) and
fine-tuning starts (``init_from``). Finding the checkpoint is :mod:`attnres.checkpoint.locate`'s.

* :func:`config_of_the_run` - ``attnres train --resume`` without a config file: the run's
  stored config, with the command's overrides.
* :func:`check_resumable` - the config may differ only in fields that do not change the
  trajectory; ``steps`` only where the learning rate of every step already taken stays the
  same (:func:`schedule_change`); ``init_from`` only by being left out.
* :func:`check_progress` - the checkpoint's step and ``tokens_seen`` agree (every step
  consumed ``tokens_per_step`` tokens).
* :func:`check_data` - the data's fingerprint must match the checkpoint's, unless
  ``allow_data_change`` says otherwise.
* :func:`init_model_changes` - what an ``init_from`` run changes about the checkpoint's model
  while its weights still fit, said at start-up.
* :func:`refuse_residual_change` - an ``init_from`` run whose residual is not the
  checkpoint's, refused unless ``allow_residual_change`` says it is meant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointError, Source
from ..checkpoint.locate import newest_state, run_of_checkpoint, train_on_from
from ..checkpoint.manifest import latest_checkpoint
from ..migrations import stored_config
from ..models.config import READ_BY_SOME_KINDS, ModelConfig
from ..models.residual_change import HOW_NOT_WHAT, changed_residual_fields, residual_change_refusal
from ..nn.residual.imports import unregistered_residual_error
from ..shell_words import shell_path
from .config import RESUMABLE_CHANGES, TrainConfig, apply_overrides, flatten, model_from_spec
from .schedule import lr_factor, wsd_decay_start
from ..user_warning import warn_user
from ..validation import missing_path_hint


def _normalised(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config as this version writes it (older checkpoints may lack newer fields or
    use older spellings, such as the deprecated ``distributed``: no warning about the user's
    config for what an old checkpoint stores); the saved mapping itself when it no longer
    validates."""
    try:
        with stored_config():
            return TrainConfig.from_dict(saved).to_dict()
    except (ValueError, TypeError):
        return saved


#: What a resumed run takes from its command, not from its stored config: whether and where
#: to resume, when to stop, the processes it runs on (a pipelined run may resume in one
#: process) and how progress is shown.
PER_LAUNCH = frozenset({"resume", "resume_from", "out_dir", "stop_after", "parallel", "distributed", "dist_timeout_s",
                        "setup_timeout_s", "progress"})


def config_of_the_run(config: TrainConfig, overrides: list[str]) -> tuple[TrainConfig, Path | None]:
    """The config of ``attnres train --resume`` given no config file: the run's own, as its
    newest checkpoint stores it (its data paths made absolute, so that it resumes from any
    directory), with ``overrides`` applied (``config``: the same overrides on the defaults,
    which names the checkpoint), so that ``--resume steps=2000`` needs no restated model.
    :data:`PER_LAUNCH` fields come from the command. Returns ``config`` and ``None`` where no
    stored config reads (the resume then says what is wrong); else the new config and the
    checkpoint it came from."""
    found = newest_state(config.resume_from if config.resume_from is not None else config.out_dir)
    stored = found[1].get("config") if found is not None else None
    if not isinstance(stored, dict):
        return config, None
    if config.resume_from is not None and not any(o.partition("=")[0].strip() == "out_dir" for o in overrides):
        _refuse_the_default_out_dir(config, found[0])
    base = {k: v for k, v in _normalised(stored).items() if k not in PER_LAUNCH}
    paths = (found[1].get("data") or {}).get("paths")
    if isinstance(base.get("data"), dict) and isinstance(paths, list):
        base["data"] = {**base["data"], "paths": paths}
    launch = {k: v for k, v in config.to_dict().items() if k in PER_LAUNCH}
    try:
        resumed = TrainConfig.from_dict(_the_runs_model(apply_overrides({**base, **launch}, overrides), overrides))
    except ValueError as e:  # (a residual of the user's, its module not imported: the one the run recorded)
        missing = unregistered_residual_error(e, found[1].get("imports"))
        if missing is None:
            raise
        raise ValueError(f"checkpoint {str(found[0])!r}: {missing}") from None
    if not any(o.partition("=")[0].strip() in ("data", "data.paths") for o in overrides):
        _refuse_moved_data(resumed.data.paths, found[0])
    return resumed, found[0]


def _the_runs_model(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``data`` (the run's stored config with ``overrides``) with its model read as stored
    (within ``stored_config()``) where no override changes it: the run's own, warned of when
    the run started - its single block was said again at each ``--resume``. A ``model.*``
    override restates it, and is warned of as the user's."""
    if any(o.partition("=")[0].strip().split(".")[0] == "model" for o in overrides) or \
            not isinstance(data.get("model"), dict):
        return data
    with stored_config():
        return {**data, "model": model_from_spec(data.get("model"))}


def _refuse_the_default_out_dir(config: TrainConfig, checkpoint: Path) -> None:
    """``ValueError`` for ``--resume-from CHECKPOINT`` given no out_dir (nor a config file):
    the run went on in the default out_dir (``runs/attnres``), not in the checkpoint's run,
    said only by the start-up summary. Where the default is that run, nothing is said."""
    run, step = run_of_checkpoint(checkpoint) or (None, None)
    if run is not None and run.resolve() == Path(config.out_dir).resolve():
        return
    later = (f" (its checkpoints after {step} set aside as superseded)"
             if run is not None and latest_checkpoint(run) != checkpoint else "")
    own = (f"give out_dir={shell_path(str(run))} to continue that run{later}, or out_dir=DIR to continue it in a new "
           "directory" if run is not None else "give out_dir=DIR, the directory to continue it in")
    raise ValueError(f"resume_from={config.resume_from!r} without out_dir would continue it into the default out_dir "
                     f"{config.out_dir!r}, not its run: {own}")


def unregistered_in_the_resumed_run(error: Exception, data: dict[str, Any]) -> str | None:
    """The message of ``error`` (a residual not registered here) for a config that resumes a
    run (``data``: :func:`~attnres.train.config.config_data`) where its checkpoint recorded
    the module that registers it: ``attnres train --resume model.residual.kind=mine`` without
    ``--import`` restates the run's kind, which is refused before the run is read. ``None``
    for another error, a config that resumes nothing, or a checkpoint without the record."""
    if not (data.get("resume") is True or isinstance(data.get("resume_from"), str)):
        return None
    where = data["resume_from"] if isinstance(data.get("resume_from"), str) else data.get("out_dir", TrainConfig.out_dir)
    found = newest_state(Path(where).expanduser()) if isinstance(where, str) else None
    said = unregistered_residual_error(error, found[1].get("imports")) if found is not None else None
    return None if said is None else f"checkpoint {str(found[0])!r}: {said}"


def _refuse_moved_data(paths: list[str], checkpoint: Path) -> None:
    """Raise ``ValueError`` for a data path stored with the run at ``checkpoint`` that is no
    longer there: the data moved, and the error said only that the path (which the command
    never named) does not exist."""
    gone = [p for p in paths if not any(c in p for c in "*?[") and not Path(p).exists()]
    if gone:
        raise ValueError(f"data path {gone[0]!r}, stored with the run ({str(checkpoint)!r}), does not exist"
                         f"{missing_path_hint(gone[0])}: if the data moved, give data.paths=[...] where it is now "
                         "(resuming checks that it holds the same text)")


def schedule_change(saved: dict[str, Any], current: dict[str, Any], done: int) -> str | None:
    """``None`` when the learning rate of each of the ``done`` steps already taken is the same
    under ``current`` as under ``saved`` (then a changed ``steps`` changes nothing about the
    past: the resumed run equals a run trained with the new ``steps`` from the start);
    otherwise the first step where they differ, in words."""
    keys = ("schedule", "warmup_steps", "min_lr_ratio", "decay_fraction")
    if saved.get("steps") == current.get("steps"):
        return None
    for s in range(done):
        old = lr_factor(s, saved["steps"], *(saved[k] for k in keys))
        new = lr_factor(s, current["steps"], *(current[k] for k in keys))
        if old != new:
            return (f"at step {s + 1} the learning rate was {old:.4g} x lr with steps={saved['steps']} and would have "
                    f"been {new:.4g} x lr with steps={current['steps']}")
    return None


def check_resumable(saved: dict[str, Any], current: dict[str, Any], source: Source) -> None:
    """Raise ``ValueError`` when ``current`` may not continue ``source`` (whose config is
    ``saved``): a field that changes the trajectory differs, or ``steps`` changes the
    learning rate of the steps already taken, or falls below them."""
    (old, old_unset), (new, new_unset) = _as_the_model_reads_it(_normalised(saved)), _as_the_model_reads_it(current)
    if new.get("init_from") is not None and not _same_path(new["init_from"], old.get("init_from")):
        # init_from may stay as it was (the run's first command again, with --resume); another
        # one would be ignored without a word: the checkpoint's weights are what continues.
        raise ValueError(f"cannot resume from {str(source.path)!r} with init_from={new['init_from']!r}: a resumed run "
                         f"continues its checkpoint's weights (the run started from init_from={old.get('init_from')!r});"
                         " drop init_from to resume, or start a new run (another out_dir) from those weights")
    differing = _differing(old, new, RESUMABLE_CHANGES, old_unset & new_unset)
    if differing:
        def said(values: dict[str, Any], k: str) -> str:
            return repr(values[k]) if k in values else "not set"

        values = ", ".join(f"{k}: {said(old, k)} there, {said(new, k)} here" for k in differing)
        # (a config file or an override the first command did not have: the run goes on with its own config)
        raise ValueError(f"cannot resume from {str(source.path)!r}: the config differs in {differing} ({values}; "
                         "to continue the run as it was, set those fields as the checkpoint has them, or resume it with "
                         f"its own config: `attnres train out_dir={shell_path(str(new['out_dir']))} --resume`, with no "
                         f"config file and no override of them; only {sorted(RESUMABLE_CHANGES)} may change on resume; "
                         "to start over from these weights with other settings, use init_from)")
    step = source.step
    if current["steps"] < step:
        raise ValueError(f"cannot resume from {str(source.path)!r}: steps={current['steps']} is below the checkpoint's "
                         f"step {step}")
    change = schedule_change(old, new, step)
    if change is not None:
        raise ValueError(
            f"cannot resume from {str(source.path)!r} with steps={new['steps']}: the checkpoint was trained with "
            f"steps={old['steps']}, and the {old['schedule']!r} learning-rate schedule spans `steps` ({change}), so the "
            "run would jump to another point of its schedule. To stop earlier, keep "
            f"steps={old['steps']} and set stop_after=K. To train longer, start a new run from this checkpoint's "
            f"weights with its run's config, `{train_on_from(source.path)[1]}` (fresh optimiser and schedule)"
            + _why_steps_cannot_change(old, new, step))


def _why_steps_cannot_change(old: dict[str, Any], new: dict[str, Any], step: int) -> str:
    """The end of :func:`check_resumable`'s refusal of a changed ``steps``: which schedule
    would have allowed it - or, for a WSD run (which allows it before its decay), which decay
    the steps already taken reach."""
    if old["schedule"] != "wsd":
        return (", or, for a schedule you mean to extend, use schedule=wsd or constant: their steps may change on "
                "resume while the learning rate of the steps already taken stays the same (WSD: before the decay "
                "starts).")
    # Both schedules are flat after the warm-up until their decay starts: one of them starts within the steps taken.
    lead = ". A WSD run's steps may change on resume only before its decay starts"
    start = wsd_decay_start(old["steps"], old["warmup_steps"], old["decay_fraction"])
    if start < step:
        return f"{lead}, and this run is past it: its decay started at step {start + 1} of steps={old['steps']}."
    start = wsd_decay_start(new["steps"], new["warmup_steps"], new["decay_fraction"])
    return (f"{lead}, and with steps={new['steps']} the decay would start at step {start + 1}, which the checkpoint "
            f"(step {step}) has already taken.")


def _as_the_model_reads_it(config: dict[str, Any]) -> tuple[dict[str, Any], frozenset[str]]:
    """A run config flattened (``model.n_heads``), its model section as the model reads it
    (:func:`_model_as_read`): a field left unset and one spelled as what it resolves to are
    the same model, the same steps, which a resume continues; and the model fields it leaves
    unset."""
    model = config.get("model") if isinstance(config.get("model"), dict) else None
    flat = flatten({k: v for k, v in config.items() if k != "model" or model is None})
    if model is None:
        return flat, frozenset()
    read, unset = _model_as_read(model)
    return {**flat, **{f"model.{k}": v for k, v in read.items()}}, frozenset(f"model.{k}" for k in unset)


def _model_as_read(model: dict[str, Any] | ModelConfig) -> tuple[dict[str, Any], frozenset[str]]:
    """A model config (a dict, as stored, or one its caller has built already) flattened as
    the model reads it (:meth:`ModelConfig.resolved_fields`): a field left unset as what it
    resolves to (a Block AttnRes block size, ``n_kv_heads``), a field the residual does not
    read left out; as written where it does not build here. And the fields it leaves unset
    (``None``): one unset on both sides differs only where the fields it derives from do,
    which name the change (``n_heads``, not the ``n_kv_heads`` that follows it)."""
    config = model
    if not isinstance(config, ModelConfig):
        try:
            with stored_config():  # (an old checkpoint's spellings: no warning about what it stores)
                config = ModelConfig.from_dict(dict(model))
        except (TypeError, ValueError):
            written = flatten(model)
            return written, frozenset(k for k, v in written.items() if v is None)
    return config.resolved_fields(), frozenset(k for k, v in flatten(config.to_dict()).items() if v is None)


def _differing(old: dict[str, Any], new: dict[str, Any], same: frozenset[str],
               unset: frozenset[str] = frozenset()) -> list[str]:
    """The keys of two configs flattened as read (:func:`_model_as_read`) whose values differ,
    less those of ``same``; less those ``unset`` on both sides (a derived value: what it derives
    from says it - and, where one side does not build here, a value resolved on the other side
    only); less a field only some variants read, on one side only - the kinds differ, which
    says it - and an empty mapping on one side (``options: {}``) against its keys on the
    other, which say it."""
    differing = sorted(k for k in set(old) | set(new) if k not in same and k not in unset and old.get(k) != new.get(k))
    differing = [k for k in differing if not any(d.startswith(k + ".") for d in differing)]
    return [k for k in differing if k.removeprefix("model.") not in READ_BY_SOME_KINDS or (k in old and k in new)]


def check_resumable_before_data(saved: dict[str, Any], current: dict[str, Any], source: Source) -> None:
    """:func:`check_resumable` before the data is read, when ``current``'s vocabulary is not
    yet the tokenizer's (it is set from the data): the vocabulary taken as the checkpoint's, so
    that a changed ``seq_len`` or ``batch_size`` is named as such rather than met as a sampler
    that does not fit. The full check follows once the data is read."""
    model = dict(current["model"])
    model["vocab_size"] = (_normalised(saved).get("model") or {}).get("vocab_size", model["vocab_size"])
    check_resumable(saved, {**current, "model": model}, source)


def _same_path(a: str, b: str | None) -> bool:
    return b is not None and (a == b or Path(a).expanduser().resolve() == Path(b).expanduser().resolve())


def check_progress(source: Source) -> None:
    """Raise :class:`CheckpointError` when ``source``'s ``tokens_seen`` is not its step times
    the tokens per step of its config: its state was edited (a run consumes the same number of
    tokens every step, and no field that changes it may change on resume)."""
    state = source.state
    tokens, config = state.get("tokens_seen"), _normalised(state.get("config") or {})
    try:
        per_step = config["batch_size"] * config["grad_accum"] * config["seq_len"]
    except (KeyError, TypeError):
        return  # a config this version cannot read: check_resumable names what differs
    if tokens is not None and tokens != source.step * per_step:
        raise CheckpointError(f"checkpoint {str(source.path)!r} is inconsistent: step {source.step} at "
                              f"{per_step} tokens per step is {source.step * per_step} tokens, but its state.json "
                              f"says tokens_seen={tokens}; the checkpoint was edited")


class DataChanged(ValueError):
    """The data differ from those of the checkpoint a run resumes (:func:`check_data`);
    ``what`` is the message less its advice, for a caller whose advice is another (a grid's)."""

    def __init__(self, message: str, what: str | None = None) -> None:
        super().__init__(message)
        self.what = what if what is not None else message


def check_data(source: Source, fingerprint: str, allow_change: bool) -> bool:
    """Compare the data's ``fingerprint`` with the one ``source`` was trained on. Returns
    whether the data changed (then ``allow_change`` was set: a warning says so); raises
    :class:`DataChanged` when it changed and ``allow_change`` is not set. Checkpoints of earlier
    versions store no fingerprint: a warning says the data cannot be checked."""
    saved = (source.state.get("data") or {}).get("fingerprint")
    if saved is None:
        warn_user(f"checkpoint {str(source.path)!r} stores no data fingerprint (written by an earlier version): "
                  "cannot check that the data is unchanged")
        return False
    if saved == fingerprint:
        return False
    if not allow_change:
        what = (f"the training data differ from the data checkpoint {str(source.path)!r} was trained on (fingerprint "
                f"{fingerprint[:12]} vs {saved[:12]})")
        raise DataChanged(
            f"{what}: resuming would continue on other text without a word. Point data.paths at the original data, or "
            "set allow_data_change=true to continue on the new data (tokenised with the checkpoint's tokenizer, the "
            "data position starting over)", what)
    warn_user(f"allow_data_change=true: the data differ from checkpoint {str(source.path)!r}'s (fingerprint "
              f"{fingerprint[:12]} vs {saved[:12]}); continuing on the new data with the checkpoint's tokenizer, "
              "the data position starting over")
    return True


#: Model fields that change how a model is computed or stored, not what it computes (see
#: ``ResidualConfig``), and the vocabulary, which a run takes from the checkpoint's tokenizer.
_NOT_A_MODEL_CHANGE = frozenset({"vocab_size", *(f"residual.{name}" for name in HOW_NOT_WHAT)})


def init_model_changes(source: Source, model: dict[str, Any]) -> str | None:
    """In words, the fields in which ``model`` (the run's ``model`` config as a dict) differs
    from the model of ``source``, the checkpoint an ``init_from`` run starts from, although
    its weights fit (a block size, ``rope_theta``, Full vs Block AttnRes): the run then trains
    another model than the checkpoint's from its weights. That may be meant (a longer
    ``max_seq_len``, a residual change ``allow_residual_change`` allowed), but it should not go
    unsaid, as a ``--config`` left out would give it. A transformers directory is compared as
    its ``config.json`` describes it (fields set beside ``model.from_hf`` change it), less the
    residual of a plain family model upcycled into AttnRes, whose new queries start at their
    faithful init. ``None`` when they agree."""
    directory = bool(source.state.get("hf_directory"))
    if directory:
        saved = _directory_model(source)
        theirs, match = "the directory's (its config.json)", "leave them out (model.from_hf gives the directory's)"
    else:
        saved = _normalised({"model": source.run_config()["model"]}).get("model", {})
        theirs, match = "the checkpoint's", "set the fields as the checkpoint has them (or pass its run's --config)"
    # (as the model reads them, as a residual change is refused: a field left unset and the value it resolves to,
    # or a block size that Full AttnRes does not read, were "another model")
    with stored_config():  # (the run's model, warned of when its config was made: its single block said again here)
        ours = ModelConfig.from_dict(model)  # (built once: the residual check and the fields as read)
    (old, old_unset), (new, new_unset) = _model_as_read(saved), _model_as_read(ours)
    differing = _differing(old, new, _NOT_A_MODEL_CHANGE, old_unset & new_unset)
    if directory and not changed_residual_fields(saved, ours):
        differing = [k for k in differing if not k.startswith("residual.")]  # (the upcycle's new queries)
    if not differing:
        return None
    values = ", ".join(f"model.{k}: {old.get(k)!r} there, {new.get(k)!r} here" for k in differing)
    return (f"init_from={str(source.path)!r}: its weights fit, but this run's model differs from {theirs} in "
            f"{['model.' + k for k in differing]} ({values}): it trains that model from those weights; {match} to "
            "continue its own model")


def _directory_model(source: Source) -> dict[str, Any]:
    """The model config (as a dict) of ``source``, a transformers directory, as its
    ``config.json`` describes it."""
    return model_from_spec({"from_hf": str(source.path)}).to_dict()


def refuse_residual_change(source: Source, model: ModelConfig, allowed: bool) -> None:
    """Raise ``ValueError`` when ``model`` (the run's model config) has another residual than
    ``source``, the checkpoint an ``init_from`` run starts from, while its weights fit
    (:func:`~attnres.models.residual_change.residual_change_refusal`: Full vs Block AttnRes,
    another block size) - as a left-out ``--config`` gives it. ``allowed``
    (``allow_residual_change``): meant (upcycling a Block AttnRes run into Full AttnRes);
    :func:`init_model_changes` still says it of a checkpoint. A transformers directory is
    compared as its ``config.json`` describes it: ``model.residual`` set beside
    ``model.from_hf`` changes its residual."""
    if allowed:
        return
    if source.state.get("hf_directory"):
        saved = _directory_model(source)
        match = "Leave model.residual out (model.from_hf gives the directory's)"
    else:
        saved = source.run_config()["model"]
        match = "Set model.residual as the checkpoint has it (or pass its run's --config)"
    refusal = residual_change_refusal(saved, model, f"init_from={str(source.path)!r}", "this run's",
                                      f"{match}, or set allow_residual_change=true to train this residual from those "
                                      "weights")
    if refusal is not None:
        raise ValueError(refusal)
