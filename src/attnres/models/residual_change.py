"""Weights saved from one residual loaded into a model of another: Full and Block AttnRes (and
Block AttnRes of another block size) have parameters of the same names and shapes, so a
checkpoint of one loads into the other without a word, and the model then computes something
else from them. :func:`residual_change_refusal` says so, in one wording for every loader that
knows both models: ``attnres train init_from=...`` (:mod:`attnres.train.resume`) and the
Python loaders of :mod:`attnres.checkpoint`, each with its own way out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..migrations import stored_config
from .config import READ_BY_SOME_KINDS, ModelConfig
from .factory import build_model

__all__ = ["HOW_NOT_WHAT", "changed_residual_fields", "residual_change_refusal", "residual_difference"]

#: The residual fields that change how a model is computed or stored, not what it computes
#: (see ``ResidualConfig``): a checkpoint's weights continue the same model under another one.
HOW_NOT_WHAT = frozenset({"schedule", "backend", "recompute_phase1", "autocast_stream", "autocast_norm_output",
                          "autocast_phase1_sums", "full_group_size"})


def _residual_fields(config: ModelConfig) -> dict[str, Any]:
    """The residual fields of a model ``config`` that change what the model computes,
    flattened, as the model reads them (:meth:`ModelConfig.resolved_fields`): Block AttnRes'
    block size as its ``S`` (``None`` resolved), and only for a variant that reads it (Block
    AttnRes, its subclasses, a variant of the user's whose ``reads_fields`` names it)."""
    return {k: v for k, v in config.resolved_fields().items()
            if k.startswith("residual.") and k.removeprefix("residual.") not in HOW_NOT_WHAT}


def _parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]] | None:
    """The names and shapes of the weights of a model built from ``config`` (on the meta
    device: nothing allocated), or ``None`` where it cannot be built here."""
    try:
        with torch.device("meta"):
            model = build_model(config)
    except Exception:  # (a residual of the user's not importable here, ...: the load names what does not fit)
        return None
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _compared(saved: Mapping[str, Any], ours: ModelConfig) -> tuple[ModelConfig, dict[str, Any], dict[str, Any],
                                                                       list[str]] | None:
    """``saved`` built, the residual fields of it and of ``ours`` (:func:`_residual_fields`) and
    those of them that differ; ``None`` where ``saved`` cannot be built here."""
    try:
        with stored_config():  # (an old checkpoint's spellings: no warning about what it stores)
            theirs = ModelConfig.from_dict(dict(saved))
        old, new = _residual_fields(theirs), _residual_fields(ours)
    except (KeyError, TypeError, ValueError):
        return None
    # (a block size on one side only: the kinds differ, which says it)
    differing = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k)
                       and (k not in READ_BY_SOME_KINDS or k in old.keys() & new.keys()))
    return theirs, old, new, differing


def _fitting_change(saved: Mapping[str, Any], ours: ModelConfig) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """The residual fields of ``saved`` and of ``ours`` (:func:`_residual_fields`) and those of
    them that differ where the weights of one still load into the other; no fields where they
    cannot be compared (``saved`` cannot be built here)."""
    compared = _compared(saved, ours)
    if compared is None:
        return {}, {}, []  # a stored model this version cannot build: the load names what does not fit
    theirs, old, new, differing = compared
    if not differing:
        return old, new, []
    # Weights that do not fit (a standard run into AttnRes) are named by the load, field by field. (The
    # vocabulary is not the residual's: compared at the checkpoint's, the load names another one.)
    shapes = _parameter_shapes(theirs), _parameter_shapes(ours.replace(vocab_size=theirs.vocab_size))
    if None not in shapes and shapes[0] != shapes[1]:
        return old, new, []
    return old, new, differing


def changed_residual_fields(saved: Mapping[str, Any], ours: ModelConfig) -> list[str]:
    """The residual fields (flattened: ``residual.kind``) in which ``ours`` differs from
    ``saved`` (a checkpoint's model config, as stored) where the weights of one still load into
    the other (Full vs Block AttnRes, another block size: the same names and shapes); ``[]``
    where the residuals agree (another kernel or schedule is the same model), where the weights
    do not fit (a standard model into AttnRes), or where ``saved`` cannot be built here."""
    return _fitting_change(saved, ours)[2]


def residual_change_refusal(saved: Mapping[str, Any], ours: ModelConfig, where: str, whose: str,
                            way_out: str) -> str | None:
    """The refusal of loading the weights of a checkpoint whose model config is ``saved`` (the
    ``model`` section of its run config, as stored) into the model of ``ours`` where their
    residuals differ while the weights have the same names and shapes
    (:func:`changed_residual_fields`); ``None`` where they do not (another residual whose
    weights do not fit is named by the load: an option to allow it could not help). The message
    starts with ``where`` (``"init_from='...'"``) and ``whose`` (``"this run's"``) and ends
    with ``way_out`` (how to load the checkpoint's own residual, or to allow this one)."""
    old, new, differing = _fitting_change(saved, ours)
    if not differing:
        return None
    values = _in_words(old, new, differing)
    return (f"{where}: {whose} residual differs from the checkpoint's ({values}); its weights would load into this "
            "model without a word (the same names and shapes), which computes something else from them. "
            f"{way_out} (e.g. a Block AttnRes run continued as Full AttnRes)")


def residual_difference(saved: Mapping[str, Any], ours: ModelConfig) -> str | None:
    """The residual fields in which ``ours`` differs from ``saved`` (a checkpoint's model
    config, as stored), as a refusal names them (``model.residual.kind: 'attnres_block' there,
    'standard' here``), whether or not the weights fit; ``None`` where the residuals agree or
    ``saved`` cannot be built here. A load whose weights do not fit names the missing and
    unexpected weights; this says which model they belong to."""
    compared = _compared(saved, ours)
    if compared is None or not compared[3]:
        return None
    _, old, new, differing = compared
    return _in_words(old, new, differing)


def _in_words(old: Mapping[str, Any], new: Mapping[str, Any], differing: list[str]) -> str:
    """The ``differing`` residual fields as a refusal names them: ``model.residual.kind:
    'attnres_block' there, 'standard' here``."""
    return ", ".join(f"model.{k}: {old.get(k)!r} there, {new.get(k)!r} here" for k in differing)
