"""Run an experiment grid: one sub-directory per (variant, seed), resumable, sequential.

Layout of ``out``::

    out/experiment.json               name, preset, overrides (a re-run must set the same)
    out/<variant>/seed<k>/            the attnres.train run directory (metrics.jsonl, checkpoints)
    out/<variant>/seed<k>/result.json written last: the run is finished; a re-run skips it

A run directory holding checkpoints but no ``result.json`` (an interrupted run) is resumed.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...checkpoint.locate import holds_hf_model, newest_state, training_output
from ...checkpoint.manifest import step_of_directory
from ...data import corpus_fingerprint, load_corpus, prepare_data
from ...distributed.launch import training_device
from ...migrations import FLAT_RESIDUAL_KEYS, stored_config
from ...models import AttnResLM, ModelConfig
from ...models.config import readers_in_words, residual_fields_given
from ...nn.residual import registered_residuals, residual_class
from ...output_paths import strict_json, write_text_atomically
from ...progress import clock
from ...shell_words import shell_path
from ...termination import Terminated
from ...train import TrainConfig, TrainingDiverged, TrainingOutOfMemory, latest_checkpoint, train
from ...train.config import apply_overrides, flatten, parse_override, sets_vocab_size
from ...train.resume import DataChanged
from ...train.metrics import read_metrics
from ...user_warning import warn_user
from ...validation import SEED_MAX, did_you_mean_each
from ..flops import non_embedding_parameters, residual_flops_forward, to_pflops_days, training_flops_per_token
from .override_paths import absolute_path_overrides
from .presets import Experiment, Variant
from ..layout import (EXPERIMENT_FILE, RESULT_FILE, data_fingerprint, grid_overrides, read_experiment_header,
                      read_grid_file, run_dir)


def run_config(experiment: Experiment, variant: Variant, seed: int, out_dir: Path,
               overrides: list[str] = ()) -> TrainConfig:
    """The ``TrainConfig`` of one run: the experiment's base, the variant's changes, the
    user's ``key=value`` overrides (applied to every run alike), then seed and out_dir."""
    check_grid_overrides(experiment, overrides)
    try:
        return _variant_config(experiment, variant, seed, out_dir, overrides)
    except ValueError as e:
        try:  # (whose error it is: a misspelt override is every run's, not the first variant's)
            _variant_config(experiment, variant, seed, out_dir, ())
        except ValueError:
            raise ValueError(f"experiment {experiment.name!r} variant {variant.name!r}: {e}") from None
        raise ValueError(f"experiment {experiment.name!r}, the overrides {list(overrides)} (every run of the grid): "
                         f"{e}") from None


def _variant_config(experiment: Experiment, variant: Variant, seed: int, out_dir: Path,
                    overrides: list[str] | tuple[str, ...]) -> TrainConfig:
    """:func:`run_config` after its checks: ``ValueError`` where the config is not one."""
    base = {**experiment.base, **variant.train}
    base["model"] = {**base["model"], **variant.model}
    data = apply_overrides(base, list(overrides))
    data.update(seed=seed, out_dir=str(out_dir))
    if not {"preset", "from_hf"} & set(data["model"]):  # the grids give sizes over ModelConfig's own defaults
        data["model"] = ModelConfig.from_dict(data["model"])
    return TrainConfig.from_dict(data)


def check_grid_overrides(experiment: Experiment, overrides: list[str]) -> None:
    """Refuse an override of what the grid itself sets: a field its variants differ in (e.g.
    ``model.residual.kind`` in ``compare``, which would train three alike models under three
    names), ``seed`` / ``out_dir``, which every run gets from ``--seeds`` / ``--out``, or
    ``resume`` / ``resume_from``: the grid resumes each run from its own checkpoints (given,
    the grid's header was written and its first run refused with train's advice, "drop
    --resume", or resumed another run's checkpoint into each of its runs)."""
    resumed = "the grid sets for each run (a run with checkpoints is resumed from its newest: give the grid's command again)"
    set_by_grid = {("seed",): "--seeds sets for each run", ("out_dir",): "--out sets for each run",
                   ("resume",): resumed, ("resume_from",): resumed}
    per_variant: dict[tuple[str, ...], list[str]] = {}
    for v in experiment.variants:
        for key, value in flatten({"model": v.model, **v.train}).items():
            per_variant.setdefault(tuple(key.split(".")), []).append(f"{v.name}: {value}")
    for path, values in per_variant.items():
        # (the values and the way to train others: `model.residual.block_size=4` on compare said only
        # "choose variants with --variants", which cannot change S)
        shown = ", ".join(values[:4]) + (f", ... ({len(values)} variants)" if len(values) > 4 else "")
        set_by_grid.setdefault(path, f"the {experiment.name!r} grid sets per variant ({shown}): choose among its "
                                     "variants with --variants, or train other values as a Variant of your own in "
                                     "Python (docs/experiments.md, \"Grids\")")
    for item in overrides:
        keys = _residual_path(tuple(parse_override(item)[0]))
        for path, owner in set_by_grid.items():
            n = min(len(keys), len(path))
            if keys[:n] == path[:n]:  # the override sets this field, or a section holding it
                raise ValueError(f"override {item!r} changes {'.'.join(path)}, which {owner}")


def _residual_path(keys: tuple[str, ...]) -> tuple[str, ...]:
    """An override's key path with an earlier version's flat residual key as the field it sets
    (``model.attnres_block_size`` is ``model.residual.block_size``): spelt so, an override of
    what the variants set was not seen as one - `attnres compare model.attnres_block_size=4`
    trained the grid's Block AttnRes at S = 4 under its S = 2 name, and the baselines with it."""
    if len(keys) >= 2 and keys[0] == "model" and keys[1] in FLAT_RESIDUAL_KEYS:
        return ("model", "residual", *FLAT_RESIDUAL_KEYS[keys[1]], *keys[2:])
    return keys


def warn_unread_grid_overrides(experiment: Experiment, configs: list[tuple[Variant, int, TrainConfig]],
                               overrides: list[str] | tuple[str, ...]) -> None:
    """Warn once for each variant-specific residual field an override gives (``block_size``,
    ``hc_streams``, ...) that none of the grid's runs ``configs`` reads: `attnres compare
    model.residual.hc_streams=2` trained every run as if it were not there without a word, the
    warning ``attnres train`` gives (the grid builds its runs' configs from mappings, which
    say nothing). A field some variant reads is for those variants, as meant."""
    given = residual_fields_given(apply_overrides({}, list(overrides)).get("model"))
    kinds = list(dict.fromkeys(config.model.residual.kind for _, _, config in configs))
    for name in sorted(given):
        if configs and not any(name in residual_class(kind).reads_fields for kind in kinds):
            value = getattr(configs[0][2].model.residual, name)
            warn_user(f"override model.residual.{name}={value!r} is read only by "
                      f"{readers_in_words(name, 'and') or 'no registered variant'}, none of the runs of the "
                      f"{experiment.name!r} grid ({', '.join(kinds)}): each trains the same model whatever it holds, "
                      "so it is not used (leave it out)")


def median_step_time(metrics_path: Path, tokens_per_step: int) -> float | None:
    """Median seconds per optimiser step over the ``train`` records of ``metrics.jsonl``
    (each holds the tokens/s of its logging window); the first window (warm-up) is dropped
    when there are others."""
    records = read_metrics(metrics_path)
    rates = [r["tokens_per_s"] for r in records if r["kind"] == "train" and r.get("tokens_per_s")]
    if len(rates) > 1:
        rates = rates[1:]
    return statistics.median(tokens_per_step / r for r in rates) if rates else None


def model_counts(config: ModelConfig) -> tuple[int, int]:
    """``(total parameters, residual-mechanism parameters)``, counted on the meta device."""
    with torch.device("meta"):
        model = AttnResLM(config)
    return model.num_parameters(), model.residual_parameters()


@functools.lru_cache(maxsize=8)
def _training_tokens(paths: tuple[str, ...], val_fraction: float, tokenizer: str, vocab_size: int,
                     cache_dir: str | None, text_field: str = "text", bpe_sample: int | None = None) -> int:
    corpus = load_corpus(list(paths), val_fraction, text_field, read=False)
    return len(prepare_data(corpus, tokenizer, vocab_size, cache_dir, bpe_sample=bpe_sample).train)


def data_passes(config: TrainConfig) -> float:
    """How many times a run of ``config`` goes over its training split: the windows it draws
    (``steps`` × batch × accumulation) over the split's ``seq_len`` windows (the sampler's
    epoch; above 1 some windows are seen twice). Tokenises the data on first use (cached)."""
    d = config.data
    n_tokens = _training_tokens(tuple(d.paths), d.val_fraction, d.tokenizer, d.vocab_size, d.cache_dir, d.text_field,
                                d.bpe_sample)
    return config.steps * (config.tokens_per_step // config.seq_len) / (n_tokens // config.seq_len)


def check_flops_counted(configs: list[tuple[Variant, int, TrainConfig]]) -> None:
    """Raise ``ValueError`` naming the variant when a run's residual does not count its FLOPs
    (a user's without ``residual_flops_per_token``): every record holds its run's training
    FLOPs, and such a grid stopped only once that run had trained."""
    for name, model in {v.name: c.model for v, _, c in configs}.items():
        try:
            residual_flops_forward(model)
        except NotImplementedError as e:
            raise ValueError(f"variant {name!r}: {e} (a grid records each run's training FLOPs; checked before the "
                             "first run starts)") from None


def check_one_process(configs: list[tuple[Variant, int, TrainConfig]]) -> None:
    """Raise ``ValueError`` when the runs' ``parallel.*`` asks for more than one rank: a grid
    trains its runs one after another in one process (a launch under torchrun is refused),
    and its first run was refused with train's advice to launch ``torchrun ... -m attnres
    train``, after the grid's header was written."""
    parallel = configs[0][2].parallel if configs else None
    ranks = None if parallel is None else (parallel.dp or 1) * parallel.tp * parallel.pp
    if ranks is not None and ranks > 1:
        raise ValueError(f"parallel asks for dp {parallel.dp or 1} x tp {parallel.tp} x pp {parallel.pp} = {ranks} "
                         "ranks, where a grid trains its runs one after another in one process: leave the parallel.* "
                         "overrides out (or train each run with attnres train under torchrun)")


def check_data_passes(configs: list[tuple[Variant, int, TrainConfig]], limit: float | None) -> None:
    """Raise ``ValueError`` naming every run of ``configs`` that would go over its training
    split more than ``limit`` times (nothing to check when ``limit`` is ``None``)."""
    if limit is None:
        return
    over = [(v.name, s, passes) for v, s, c in configs if (passes := data_passes(c)) > limit]
    if over:
        runs = ", ".join(f"{name} seed {seed}: {passes:.3f}" for name, seed, passes in over)
        raise ValueError(f"this grid allows at most {limit:g} pass(es) over the training data; runs beyond it "
                         f"({runs}) would see tokens twice: give more data (data.paths) or fewer steps")


def check_data_found(configs: list[tuple[Variant, int, TrainConfig]]) -> None:
    """Raise ``ValueError`` for data paths of ``configs`` that name no text (a missing file, an
    empty folder), before the grid's header is written: it recorded the overrides of a grid
    that never trained, and the command given again with the path corrected was refused as
    another grid's."""
    for paths, text_field in dict.fromkeys((tuple(c.data.paths), c.data.text_field) for _, _, c in configs):
        if paths:  # (none: the built-in corpus)
            load_corpus(list(paths), text_field=text_field, read=False)


def passes_drawn(checkpoint: Path | None) -> float | None:
    """The passes over its training split a run made, from the sampler position its final
    ``checkpoint`` stores (``None`` without one)."""
    if checkpoint is None:
        return None
    sampler = json.loads((Path(checkpoint) / "state.json").read_text())["sampler"]
    return sampler["samples_drawn"] / sampler["n_windows"]


def run_one(config: TrainConfig, variant: Variant, vocab_size_given: bool = False) -> dict[str, Any] | None:
    """Train (or resume) one run and write its ``result.json``; returns that record, or
    ``None`` for a run that ``stop_after`` ended before its ``steps``: stopped at its
    checkpoint, not finished (its record written then had it skipped as "finished earlier" by
    every later command, at a loss of step K).

    Record fields: variant, family, coords, seed, steps, tokens, data_passes (passes over the
    training split: above 1, tokens were seen twice), val_loss, params,
    residual_params, non_embedding_params (the scaling-law model size), flops_per_token (training, per token), flops (total training FLOPs),
    pflops_days, step_time_s (median seconds per step), peak_memory_bytes (of the GPU it trains on;
    None on the CPU, a GPU machine's included), data_fingerprint (of the text it trained on).
    """
    out = Path(config.out_dir)
    # (replaced=True: a checkpoint a kill left moved aside is the run's, which train's start renames back; a run
    # holding only that was started fresh, and refused by that start as holding checkpoints)
    if latest_checkpoint(out, replaced=True) is not None:
        config.resume = True
    device = training_device(config.device)
    gpu = device if device.type == "cuda" else None
    if gpu is not None:
        torch.cuda.reset_peak_memory_stats(gpu)
    result = train(config, vocab_size_given=vocab_size_given)
    if result.interrupted:  # (re-running resumes it; a SIGTERM's is the status 143 of the command, as train's)
        stopped = Terminated if result.interrupted == "SIGTERM" else KeyboardInterrupt
        raise stopped(f"run {out} stopped by {result.interrupted}, at its checkpoint")
    if result.step < config.steps:
        return None
    with stored_config():  # (the tokenizer's vocab; a run an earlier version finished stored old keys)
        model = ModelConfig.from_dict(json.loads((out / "config.json").read_text())["model"])
    params, residual_params = model_counts(model)
    flops = training_flops_per_token(model, config.seq_len)
    tokens = config.steps * config.tokens_per_step
    record = {
        "variant": variant.name, "family": variant.family, "coords": variant.coords, "seed": config.seed,
        "steps": config.steps, "tokens": tokens, "data_passes": passes_drawn(result.checkpoint), "val_loss": result.val_loss,
        "params": params, "residual_params": residual_params, "non_embedding_params": non_embedding_parameters(model),
        "flops_per_token": flops.total, "flops": flops.total * tokens, "pflops_days": to_pflops_days(flops.total * tokens),
        "step_time_s": median_step_time(out / "metrics.jsonl", config.tokens_per_step),
        "peak_memory_bytes": None if gpu is None else torch.cuda.max_memory_allocated(gpu),
        "data_fingerprint": data_fingerprint(result.checkpoint),
    }
    # (atomically: a grid killed mid-write left a truncated result.json, which stopped every later command)
    write_text_atomically(out / RESULT_FILE, strict_json(record, indent=1), "the run's record")
    return record


def read_result(path: Path) -> dict[str, Any]:
    """The record a finished run wrote to ``path`` (its ``result.json``); ``ValueError`` naming
    the file and the fix when it cannot be read (truncated, edited): the error of the JSON
    parser alone, "Unterminated string starting at: line 4 column 2", named no file."""
    return read_grid_file(path, "delete it, and the grid's command makes it again from the run's final checkpoint "
                                "(training nothing)")


def _hf_model_directory(out: Path) -> str:
    """What ``out``, holding a ``config.json`` and no checkpoint, is in words: an upcycled or
    exported model (its weights beside it) was called "a training run's directory"."""
    if holds_hf_model(out):
        return ("a Hugging Face model directory (config.json and its weights: an upcycle, an export), which the "
                "grid's runs and report would mix with")
    return "a training run's directory (it holds config.json)"


def check_not_foreign(out: Path) -> None:
    """Raise ``ValueError`` when ``out``, holding no experiment, holds what a grid's files would
    mix with or replace: a training run (its ``config.json``, or a checkpoint), or a
    ``report.md`` of something else (an ``attnres analyze`` output, notes)."""
    what = training_output(out) or (_hf_model_directory(out) if (out / "config.json").is_file() else None)
    if what is None and (out / "report.md").is_file():
        what = f"a folder with a report.md that no experiment wrote (no {EXPERIMENT_FILE}), which the grid's would replace"
    grid = next((p for p in out.absolute().parents if "experiment" in (read_experiment_header(p) or {})), None)
    if what is not None and grid is not None:  # (a grid's run, `--report-only` of it: "a new folder" reported nothing)
        raise ValueError(f"--out {str(out)!r} is {what}, a run of the grid {str(grid)!r}: give the grid's folder, "
                         f"--out {shell_path(grid)}, to continue or report it")
    if what is not None:
        raise ValueError(f"--out {str(out)!r} is {what}; pick another --out, e.g. a new folder")
    if grid is not None:  # (a grid's variant folder, say: a new grid there mixed its runs with the grid's)
        raise ValueError(f"--out {str(out)!r} is inside the grid {str(grid)!r} (it holds {EXPERIMENT_FILE}); pick a "
                         "folder outside it, or that grid's folder to continue it")


def check_same_experiment(out: str | Path, header: dict[str, Any], check_overrides: bool = True) -> None:
    """Raise ``ValueError`` when ``out`` holds an experiment whose ``experiment.json`` differs
    from ``header`` in a key ``header`` gives: results (and reports) of different grids must
    not mix. ``check_overrides=False``: the overrides are compared later (after they are
    validated), and only said where the header cannot be read. ``--report-only`` passes the
    overrides only where the command gives some."""
    out = Path(out)
    saved = read_experiment_header(out)
    if saved is None and (out / EXPERIMENT_FILE).exists():  # (cut short, or edited: the grid's runs are still there)
        mine = (f"; if this command trained the grid, put its header back: {json.dumps(header)}; else"
                if "overrides" in header else ";")
        raise ValueError(f"{str(out / EXPERIMENT_FILE)!r} is not an experiment header (a JSON mapping){mine} pick "
                         "another --out")
    if saved is None:
        check_not_foreign(out)
        return
    differing = sorted(k for k in header if k != "overrides" and saved.get(k) != header[k])
    if differing == ["preset"]:  # (the same grid at another size: the folder's own is one option away)
        raise ValueError(f"{str(out)!r} holds the {saved.get('experiment')!r} grid of preset {saved.get('preset')!r}, "
                         f"not {header['preset']!r}: give --preset {saved.get('preset')}, or no --preset (the "
                         f"folder's own), to continue or report it, or another --out for a {header['preset']!r} grid")
    if differing:
        raise ValueError(f"{str(out)!r} holds a different experiment (differs in {differing}: "
                         f"{ {k: saved.get(k) for k in differing} }, not { {k: header[k] for k in differing} }); "
                         "pick another --out")
    if check_overrides and "overrides" in header and not _same_overrides(saved.get("overrides"), header["overrides"]) \
            and _trained_anything(out):  # (else the header of a grid that failed before its first checkpoint: replaced)
        was, now = (" ".join(map(str, o)) if o else "none" for o in (saved.get("overrides"), header["overrides"]))
        if was == "none":  # (it read "trained with the overrides none")
            trained, again = "without overrides", "give none"
        else:
            trained, again = f"with the overrides {was}", "give its overrides again (in any order)"
        raise ValueError(f"{str(out)!r} holds the {saved.get('experiment')!r} grid trained {trained}; this command "
                         f"gives {now}: to continue it {again}, or pick another --out")


#: The ``data`` fields that say where a grid's text lies, not what it is: a grid moved or
#: copied with its data (another folder, another machine) continues with the new paths, as
#: ``attnres train --resume`` does; the text there is checked against the fingerprint its
#: runs recorded (:func:`check_same_text`).
DATA_LOCATION = ("paths", "cache_dir")


def _trained_anything(out: Path) -> bool:
    """Whether a run of the grid in ``out`` wrote a checkpoint or its record: a header alone
    (its first run refused at its start, ``device=cuda`` on a machine without one) bound the
    grid to the overrides that failed, and the command without them was refused as another
    grid's."""
    return any(out.glob("*/seed*/checkpoints/step-*")) or any(out.glob(f"*/seed*/{RESULT_FILE}"))


def _same_overrides(saved: Any, given: list[str]) -> bool:
    """Whether two lists of ``key=value`` overrides set the same fields to the same values
    (``steps=6 lr=1e-3`` is ``lr=1e-3 steps=6``: a grid resumed with them is the same grid),
    where the data lies aside (:data:`DATA_LOCATION`)."""
    if saved == given:
        return True
    try:
        return _fields(saved, located=False) == _fields(given, located=False)
    except (TypeError, ValueError):  # (an experiment.json edited by hand: only the same list matches)
        return False


def _fields(overrides: list[str], located: bool = True) -> dict[str, Any]:
    """The fields a grid's ``overrides`` set, as a nested mapping: per-launch ones left out
    (stop_after pauses a grid, and an experiment.json of an earlier version may hold it), the
    relative paths made absolute against this directory, as this command's are (a header of
    an earlier version holds them as typed); ``located=False``: without :data:`DATA_LOCATION`."""
    fields = apply_overrides({}, absolute_path_overrides(grid_overrides(list(overrides))))
    if not located and isinstance(fields.get("data"), dict):
        fields["data"] = {k: v for k, v in fields["data"].items() if k not in DATA_LOCATION}
    return fields


def _data_location(overrides: list[str]) -> tuple[Any, ...]:
    data = _fields(overrides).get("data")
    return tuple(data.get(k) for k in DATA_LOCATION) if isinstance(data, dict) else (None,) * len(DATA_LOCATION)


def check_same_text(out: Path, saved: dict[str, Any] | None, given: list[str],
                    configs: list[tuple[Variant, int, TrainConfig]]) -> None:
    """Raise ``ValueError`` when this command's data paths (``given``, absolute) are not the
    ones the grid's header ``saved`` records - the grid moved, or its data did - and the text
    there is not the one its runs trained on (the fingerprint their records and checkpoints
    hold): new seeds would train on other text. Reads the text (or its token cache's record)
    only where the paths moved and a run recorded its text."""
    if saved is None or not configs:
        return
    try:
        if _data_location(saved.get("overrides") or []) == _data_location(given):
            return
    except (TypeError, ValueError):
        return
    recorded = {r.get("data_fingerprint") for r in load_records(out)}
    recorded |= {(found[1].get("data") or {}).get("fingerprint") if isinstance(found[1].get("data"), dict) else None
                 for run in out.glob("*/seed*") if (found := newest_state(run)) is not None}
    recorded.discard(None)
    if not recorded:
        return
    data = configs[0][2].data
    here = corpus_fingerprint(load_corpus(list(data.paths), data.val_fraction, data.text_field, read=False),
                              data.cache_dir)
    if here not in recorded:
        raise ValueError(f"data.paths {list(data.paths) or '(the built-in corpus)'} hold other text than the grid in "
                         f"{str(out)!r} trained on (fingerprint {here[:12]}; its runs': "
                         f"{', '.join(sorted(f[:12] for f in recorded))}): give the paths where its text lies now, or "
                         "train this text as a new grid, in another --out")


def run_experiment(experiment: Experiment, out: str | Path, seeds: list[int] = (0,), overrides: list[str] = (),
                   log: Callable[[str], None] = print, variants: list[str] | None = None) -> list[dict[str, Any]]:
    """Run every (seed, variant) of ``experiment`` under ``out``, seed by seed, skipping finished
    runs; returns all records (finished earlier or now; a run ``stop_after`` ended before its
    steps has none). ``variants``: only these (by name),
    e.g. to split one grid over several processes or machines sharing ``out``.

    Raises ``ValueError`` if ``out`` holds a different experiment, preset, or overrides
    (results of different grids must not mix), on an unknown variant, on a bad override, or
    when a run would go over its training data more than ``experiment.max_data_passes``
    times (checked before the first run starts)."""
    seeds = _checked_seeds(seeds)
    chosen = _chosen_variants(experiment, variants)
    out = Path(out)
    # (the paths absolute: the command status gives, and the runs' resumes, read them from other directories too)
    overrides = absolute_path_overrides(list(overrides))
    header = {"experiment": experiment.name, "preset": experiment.preset, "overrides": grid_overrides(overrides)}
    # Seed-major: each seed completes a whole comparison before the next seed starts, so an
    # interrupted grid still holds comparable runs. Every run is validated before the first starts,
    # and before the header: a misspelt override (stpes=600) given to continue a grid was refused
    # as one the grid was not trained with, not by its name.
    configs = [(v, s, run_config(experiment, v, s, run_dir(out, v.name, s), overrides))
               for s in seeds for v in chosen]
    warn_unread_grid_overrides(experiment, configs, overrides)
    check_same_experiment(out, header)
    # (a model.vocab_size of the user's, replaced by the tokenizer's, is warned of as attnres train does)
    vocab_size_given = sets_vocab_size(None, overrides)
    marker = out / EXPERIMENT_FILE
    check_one_process(configs)
    check_data_passes(configs, experiment.max_data_passes)
    check_flops_counted(configs)
    check_data_found(configs)
    check_same_text(out, read_experiment_header(out), header["overrides"], configs)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomically(marker, json.dumps(header, indent=1), "the grid's header")  # (cut short, the grid is lost)
    records = []
    pace = _Pace()
    for i, (variant, seed, config) in enumerate(configs, 1):
        if is_finished(config):
            log(f"[{i}/{len(configs)}] {variant.name} seed {seed}: finished earlier, skipped")
            records.append(read_result(Path(config.out_dir) / RESULT_FILE))
            continue
        done_steps = _trained_steps(config)
        if done_steps:
            log(f"[{i}/{len(configs)}] {variant.name} seed {seed}: resuming at step {done_steps} of {config.steps}")
        else:
            log(f"[{i}/{len(configs)}] {variant.name} seed {seed}: training {config.steps} step{'' if config.steps == 1 else 's'}")
        started = time.perf_counter()
        try:
            record = run_one(config, variant, vocab_size_given=vocab_size_given)
        except (TrainingDiverged, TrainingOutOfMemory) as e:  # (the message alone named no run of the grid)
            raise type(e)(f"run {variant.name} seed {seed} ({config.out_dir}): {str(e).rstrip('.')} (the grid's "
                          "finished runs are kept: --report-only reports them)") from e
        except DataChanged as e:  # (train's advice, allow_data_change=true, is an override the grid refuses)
            raise ValueError(f"run {variant.name} seed {seed} ({config.out_dir}): {e.what}, where the grid's runs "
                             "are trained on the same text: put the original text back at its data.paths to continue "
                             "the grid, or train the new text as a new grid, in another --out") from None
        took = pace.add(config.end_step - done_steps, time.perf_counter() - started)
        if record is None:
            log(f"[{i}/{len(configs)}] {variant.name} seed {seed}: stopped at step {config.end_step} of {config.steps} "
                f"(stop_after; took {clock(took)}): the grid's command without stop_after continues it")
            continue
        # the runs still to train, each from its latest checkpoint (an interrupted grid's)
        left = [max(c.end_step - _trained_steps(c), 0) for _, _, c in configs[i:]
                if not (Path(c.out_dir) / RESULT_FILE).exists()]
        log(f"[{i}/{len(configs)}] {variant.name} seed {seed}: val loss {record['val_loss']:.4f} (took {clock(took)}"
            + (f"; about {clock(pace.seconds(sum(left)))} to go for {len(left)} run(s))" if left else ")"))
        records.append(record)
    return records


def nothing_to_train(experiment: Experiment, out: str | Path, seeds: list[int] = (0,), overrides: list[str] = (),
                     variants: list[str] | None = None) -> bool:
    """Whether every run that :func:`run_experiment` with these arguments goes through has
    finished already, so that it would train nothing; ``ValueError`` as it raises it, for the
    seeds, the variants and the overrides."""
    overrides = absolute_path_overrides(list(overrides))
    return all(is_finished(run_config(experiment, v, s, run_dir(out, v.name, s), overrides))
               for s in _checked_seeds(seeds) for v in _chosen_variants(experiment, variants))


def _checked_seeds(seeds) -> list[int]:
    """``seeds`` as a list; ``ValueError`` naming ``--seeds`` where it is empty, holds what is
    not a seed, or a seed twice."""
    seeds = list(seeds)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= SEED_MAX for s in seeds):
        raise ValueError(f"seeds (--seeds) must be a non-empty list of integers >= 0 and <= {SEED_MAX}; got {seeds!r}")
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:  # (the second one would only be reported "finished earlier, skipped")
        raise ValueError(f"seeds (--seeds) list {', '.join(map(str, twice))} more than once; each seed is one run per variant: "
                         f"give distinct seeds, e.g. --seeds {' '.join(map(str, dict.fromkeys(seeds)))}")
    return seeds


def is_finished(config: TrainConfig) -> bool:
    """Whether the run of ``config`` has finished: its ``result.json`` written at its last
    step (a grid's command skips it)."""
    return (Path(config.out_dir) / RESULT_FILE).exists() and not _stopped_early(config)


def _chosen_variants(experiment: Experiment, variants: list[str] | None) -> list[Variant]:
    """The variants of ``experiment`` that ``variants`` names (all of them for ``None``);
    ``ValueError`` naming the grid's for an unknown name."""
    if variants is None:
        return experiment.variants
    names = [v.name for v in experiment.variants]
    unknown = [v for v in variants if v not in names]
    if unknown or not variants:
        own = [v for v in unknown if v in registered_residuals()]
        raise ValueError(f"variants (--variants) must be names of the {experiment.name!r} grid {names}; got "
                         f"{list(variants)!r}"
                         f"{did_you_mean_each(unknown, names)}"
                         + (f"; {own} {'is a registered residual' if len(own) == 1 else 'are registered residuals'}"
                            ", in no grid: add it to one as a Variant in Python (docs/experiments.md, 'Grids')"
                            if own else ""))
    return [v for v in experiment.variants if v.name in variants]


def _stopped_early(config: TrainConfig) -> bool:
    """Whether a run with a ``result.json`` ended before its ``steps``: one written at
    ``stop_after`` by an earlier version, which skipped the run as finished for good. (A
    run copied without its checkpoints is finished: nothing says otherwise.)"""
    return 0 < _trained_steps(config) < config.steps


def _trained_steps(config: TrainConfig) -> int:
    """The steps a run has trained so far: its latest checkpoint's (0 without one; one a kill
    left moved aside counts: the run's next start renames it back)."""
    latest = latest_checkpoint(config.out_dir, replaced=True)
    return 0 if latest is None else step_of_directory(latest)


class _Pace:
    """Seconds per training step over the runs trained so far: the time a grid's remaining
    runs will take, roughly (variants differ in cost, and a run's set-up counts as its steps)."""

    def __init__(self) -> None:
        self.steps, self.time = 0, 0.0

    def add(self, steps: int, seconds: float) -> float:
        """Count a run of ``steps`` trained in ``seconds`` (none trained: its set-up alone, not
        counted); ``seconds`` back."""
        if steps > 0:
            self.steps, self.time = self.steps + steps, self.time + seconds
        return seconds

    def seconds(self, steps: int) -> float:
        return self.time / max(self.steps, 1) * steps


def load_records(out: str | Path, experiment: Experiment | None = None) -> list[dict[str, Any]]:
    """Every finished run's record under ``out`` (all seeds run so far), in the grid order of
    ``experiment`` when given (its variants only), else by directory name."""
    records = [read_result(p) for p in sorted(Path(out).glob(f"*/seed*/{RESULT_FILE}"))]
    if experiment is None:
        return records
    order = {v.name: i for i, v in enumerate(experiment.variants)}
    return sorted((r for r in records if r["variant"] in order), key=lambda r: (order[r["variant"]], r["seed"]))
