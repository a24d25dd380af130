"""Load a trained model and its tokenizer from a training checkpoint (no transformers needed).

The tokenizer comes from the checkpoint itself (``tokenizer.json``, or the byte marker in
``state.json``), so a run can be used from any directory, after its data has moved or
changed. Checkpoints written before the tokenizer was stored fall back, with a warning, to
making it from the run's data settings as then (cached beside the data, or retrained).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data.tokenizer import (CHAT_SETTINGS, ByteTokenizer, Tokenizer, generation_record, load_tokenizer_file,
                              tokenizer_from_state)
from ..models.config import ModelConfig
from ..models.factory import build_model
from ..migrations import stored_config
from ..models.lm import AttnResLM
from ..nn.residual.imports import unregistered_residual_error
from ..ops.depth_attention.library import triton_unavailable
from ..checkpoint import CheckpointError, Source, find_valid_checkpoint, load_weights, no_checkpoint_at
from ..distributed.launch import no_cuda_reason
from ..user_warning import warn_user
from ..validation import check_path_argument, did_you_mean, unsupported_device_hint

__all__ = ["LoadedRun", "load_run", "load_model", "load_tokenizer", "check_vocabulary", "pick_device"]


def pick_device(name: str | None, option: str = "--device") -> torch.device:
    """``"auto"`` (or ``None``): CUDA when available, else the CPU; otherwise a device name
    such as ``"cpu"``, ``"cuda"`` or ``"cuda:1"``. Raises ``ValueError`` naming the allowed
    values for a bad name, and for CUDA where there is none; ``option`` is the argument the
    error names (the command line's ``--device``, or a Python function's ``device``)."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(_bad_device(name, option)) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            cpu = f"{option} cpu" if option.startswith("--") else f"{option}='cpu'"
            raise ValueError(f"{option} {name!r}: no CUDA device is available here ({no_cuda_reason()}); use {cpu}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{option} {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise ValueError(_bad_device(name, option))
    return device


def _bad_device(name: str, option: str) -> str:
    allowed = ("auto", "cpu", "cuda")
    hint = unsupported_device_hint(name) or did_you_mean(name, allowed)
    return f"{option} must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {name!r}{hint}"


#: Files of a training checkpoint that using the model does not need.
INFERENCE_OPTIONAL = ("optimizer.safetensors",)


@dataclass(repr=False)
class LoadedRun:
    """A verified checkpoint loaded for use: the model (eval mode; an ``AttnResLM``, or an
    ``attnres.hf.families`` model for ``model.hf_architecture``), the run config (its
    ``state.json``'s ``config``), the checkpoint directory and its whole ``state.json``."""

    model: AttnResLM
    run_config: dict
    checkpoint: Path
    state: dict

    def __repr__(self) -> str:
        """One line (a notebook shows ``run`` so): the checkpoint, its step and the model in
        brief, not the model's module tree and the whole ``state.json`` twice."""
        params = list(self.model.parameters())
        return (f"LoadedRun(checkpoint={str(self.checkpoint)!r}, step {self.state.get('step')}, "
                f"{type(self.model).__name__} of {sum(p.numel() for p in params):,} parameters, "
                f"{str(params[0].dtype).removeprefix('torch.')} on {params[0].device})")

    def chat_settings(self) -> dict[str, str]:
        """The chat template and end-of-turn token kept with the run's tokenizer (a run started
        from an instruct model's directory; :data:`attnres.data.tokenizer.CHAT_SETTINGS`), those
        it has: none for attnres's own tokenizers."""
        meta = self.state.get("tokenizer") or {}
        return {k: meta[k] for k in CHAT_SETTINGS if isinstance(meta.get(k), str)}

    def stop_ids(self, tokenizer: Tokenizer) -> tuple[int, ...]:
        """The end-of-sequence ids kept with the run's tokenizer (a run started from an instruct
        model's directory): those of the directory's ``generation_config.json`` in its order
        (:data:`attnres.data.tokenizer.GENERATION_DEFAULTS`), then its end-of-turn token's if
        they lack it, the ones ``tokenizer`` (the run's own) holds; none for attnres's own tokenizers."""
        meta = self.state.get("tokenizer") or {}
        backend = getattr(tokenizer, "backend", None)
        end_of_turn = self.chat_settings().get("eos_token")
        tokens = [*generation_record(meta.get("generation")).get("eos_tokens", []), *([end_of_turn] if end_of_turn else [])]
        ids = [backend.token_to_id(t) for t in tokens] if backend is not None else []
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling defaults kept from the ``generation_config.json`` of the directory the
        run started from (``do_sample``, ``temperature``, ``top_p``, ...: JSON scalars that
        validate), those it had; ``{}`` for attnres's own runs and for earlier checkpoints."""
        kept = generation_record((self.state.get("tokenizer") or {}).get("generation"))
        kept.pop("eos_tokens", None)
        return kept

    def validation_text(self) -> str:
        """The run's validation split, read again from its data: the absolute paths the
        checkpoint recorded (a relative ``data.paths`` is relative to where the run started,
        not to here), or, from checkpoints of earlier versions, ``data.paths`` as given. A
        warning when the data no longer has the fingerprint the checkpoint was trained on;
        ``ValueError`` saying to pass other text when it cannot be read."""
        from ..data import load_corpus

        data = self.run_config["data"]
        saved = self.state.get("data") or {}
        paths = saved.get("paths", data["paths"])
        try:
            corpus = load_corpus(paths, data["val_fraction"], data.get("text_field", "text"))
        except ValueError as e:
            raise ValueError(f"the validation split of checkpoint {str(self.checkpoint)!r} cannot be read again from "
                             f"its data {paths}: {e}; pass the held-out text (--text FILE)") from None
        if saved.get("fingerprint") not in (None, corpus.digest):
            warn_user(f"the data at {paths} changed since checkpoint {str(self.checkpoint)!r} was trained: "
                      "its validation split is not the run's (and may overlap the training text); pass --text")
        return corpus.val


#: How often :func:`load_run` takes a run's newest checkpoint again after the one it was
#: reading was removed (a run still training rotates them, keep_checkpoints).
PRUNED_RETRIES = 3


def load_run(path: str | Path, device: str | torch.device | None = "cpu") -> LoadedRun:
    """The model of a training checkpoint - a ``step-*`` directory, or a run directory (its
    newest checkpoint that verifies) - on ``device`` (see :func:`pick_device`). The
    optimiser's state is not needed: a checkpoint without ``optimizer.safetensors`` loads.
    Returns a :class:`LoadedRun`: the model in eval mode, the run's config (a dict), the
    checkpoint's path and its verified state (step, tokenizer, ...)."""
    check_path_argument(path, "load_run(path, device='cpu')")
    # (a bad one: before any loading, named as this function's argument, not the command line's --device)
    device = device if isinstance(device, torch.device) else pick_device(device, "device")
    for _ in range(PRUNED_RETRIES):
        source = find_valid_checkpoint(path, optional=INFERENCE_OPTIONAL)
        if source is None:
            raise CheckpointError(no_checkpoint_at(path))
        run_config = source.run_config()
        config = runnable_backend(saved_model_config(source), device, source.path)
        model = build_model(config)  # AttnResLM, or a transformers family's modules around the residual
        try:
            load_weights(source.path, source.state, model)  # a sharded (DCP) one is read in this process
        except FileNotFoundError:
            if source.path.exists():
                raise
            _removed_while_read(source.path, given_step=source.path == Path(path))
            continue
        return LoadedRun(model.to(device).eval(), run_config, source.path, source.state)
    raise CheckpointError(f"the checkpoints of {str(path)!r} were removed as fast as they were read ({PRUNED_RETRIES} "
                          "times): its run keeps very few (keep_checkpoints); copy one aside and load the copy")


def runnable_backend(config: ModelConfig, device: torch.device, checkpoint: Path) -> ModelConfig:
    """``config``, its residual's ``backend="triton"`` replaced by ``"auto"`` (with a warning)
    where the Triton kernels cannot run on ``device``: a GPU run's checkpoint loaded on a CPU,
    or where triton is missing. The backend picks the implementation of one function, not the
    weights; kept, it failed the first forward, telling ``attnres generate`` / ``eval`` to use
    another backend, which neither command can set."""
    reason = triton_unavailable(device) if config.residual.backend == "triton" else None
    if reason is None:
        return config
    warn_user(f"checkpoint {str(checkpoint)!r} was trained with model.residual.backend='triton', which cannot run "
              f"here ({reason}): loading it with backend='auto' (the same function, the implementation picked "
              "by device)")
    return config.replace(residual={"backend": "auto"})


def _removed_while_read(checkpoint: Path, given_step: bool) -> None:
    """Say that ``checkpoint`` (verified, then gone while its weights were read) was removed:
    the rotation of a run still training (``keep_checkpoints``) deleted it once it had written
    a newer one. Of a run directory, the newest is loaded instead (a warning); a ``step-*``
    directory given by name is an error naming the run (a FileNotFoundError's traceback
    named a weights file alone)."""
    run = checkpoint.parent.parent
    if given_step:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} was removed while it was read: its run, still training, "
                              "keeps only its newest checkpoints (keep_checkpoints); name a newer one, or the run "
                              f"directory {str(run)!r} for its newest")
    warn_user(f"checkpoint {str(checkpoint)!r} was removed while it was read (its run, still training, keeps only its "
              "newest checkpoints: keep_checkpoints); loading the run's newest instead")


def saved_model_config(source: Source) -> ModelConfig:
    """The :class:`ModelConfig` a checkpoint's run config describes; a config this version
    cannot read (a field of a newer attnres, a residual of a module not imported: named by the
    checkpoint's record of its imports) is a :class:`CheckpointError` that names the checkpoint
    as well as the field. Keys of an earlier version it stores migrate without a warning
    (:func:`attnres.migrations.stored_config`)."""
    try:
        with stored_config():  # (an earlier version's spellings: no warning about what the checkpoint stores)
            return ModelConfig.from_dict(source.run_config()["model"])
    except (ValueError, TypeError) as e:
        said = unregistered_residual_error(e, source.state.get("imports")) or (
            f"its saved model config (config.model in state.json) cannot be built here: {e}")
        raise CheckpointError(f"checkpoint {str(source.path)!r}: {said}") from None


def load_model(path: str | Path, device: str | torch.device | None = "cpu") -> tuple[AttnResLM, dict]:
    """``(model, run config)`` of a checkpoint or run directory (see :func:`load_run`)."""
    run = load_run(path, device)
    return run.model, run.run_config


def load_tokenizer(source: LoadedRun | str | Path, tokenizer_path: str | None = None) -> Tokenizer:
    """The tokenizer of a run: ``tokenizer_path`` (a ``tokenizer.json``, or a directory holding
    one) when given, else the one stored in the checkpoint (``source``: a :class:`LoadedRun`,
    or a checkpoint or run directory). Checkpoints of earlier versions store none: then the one the run's data
    settings produce (cached beside the data, or retrained identically), with a warning.
    With a :class:`LoadedRun`, a tokenizer whose vocabulary is not the model's is refused
    (``ValueError``): its ids would index other embeddings, and the text would be garbage."""
    if not isinstance(source, (LoadedRun, str, os.PathLike)):  # (the model, run.model: pathlib's "expected str, ...")
        raise TypeError(f"load_tokenizer takes the LoadedRun that load_run(path) gives, or a checkpoint or run directory; "
                        f"got {type(source).__name__}" + (": pass the run, load_tokenizer(run), not run.model"
                                                          if isinstance(source, torch.nn.Module) else ""))
    tokenizer = _find_tokenizer(source, tokenizer_path)
    if isinstance(source, LoadedRun):
        # The run's own tokenizer may have fewer tokens than a padded embedding (attnres.train.setup).
        own = tokenizer_path is None and source.state.get("tokenizer") is not None
        check_vocabulary(tokenizer, source.model.config.vocab_size, tokenizer_path, padded=own)
    return tokenizer


def check_vocabulary(tokenizer: Tokenizer, vocab_size: int, tokenizer_path: str | None = None,
                     padded: bool = False) -> None:
    """Raise ``ValueError`` unless ``tokenizer`` has the model's ``vocab_size`` tokens (or,
    with ``padded``, at most that many: an embedding padded beyond the tokenizer)."""
    if tokenizer.vocab_size == vocab_size or (padded and tokenizer.vocab_size < vocab_size):
        return
    what = f"--tokenizer {tokenizer_path!r}" if tokenizer_path is not None else "the checkpoint's tokenizer"
    fix = ("pass the tokenizer.json the model was trained with, or omit --tokenizer to use the one stored in the "
           "checkpoint" if tokenizer_path is not None else "pass the tokenizer.json it was trained with (--tokenizer)")
    raise ValueError(f"{what} has {tokenizer.vocab_size} tokens, the model's vocabulary (vocab_size) {vocab_size}: "
                     f"its ids would index other embeddings; {fix}")


def _find_tokenizer(source: LoadedRun | str | Path, tokenizer_path: str | None) -> Tokenizer:
    """:func:`load_tokenizer` without the vocabulary check."""
    if tokenizer_path is not None:
        return load_tokenizer_file(tokenizer_path, "--tokenizer")
    if isinstance(source, LoadedRun):
        checkpoint, state = source.checkpoint, source.state
    else:
        found = find_valid_checkpoint(source, optional=INFERENCE_OPTIONAL)
        if found is None:
            raise CheckpointError(no_checkpoint_at(source))
        checkpoint, state = found.path, found.state
    if state.get("tokenizer") is not None:
        return tokenizer_from_state(state["tokenizer"], checkpoint)
    data = Source(checkpoint, state).run_config().get("data") or {}
    if "tokenizer" not in data:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} stores neither a tokenizer nor the data settings to "
                              "make one from: pass the tokenizer.json it was trained with (--tokenizer)")
    old = f"checkpoint {str(checkpoint)!r} stores no tokenizer (written by an earlier version)"
    if data["tokenizer"] == "byte":
        warn_user(f"{old}: bytes, as its data settings say; pass --tokenizer to choose another")
        return ByteTokenizer()
    from ..data import earlier_cache_tokenizer, load_corpus, prepare_data

    # (the BPE it trained with is its version's cache's: one trained again here need not be it)
    trained_on = earlier_cache_tokenizer(data, old, "; pass --tokenizer to choose another")
    if trained_on is not None:
        return trained_on
    warn_user(f"{old}: making it from the run's data settings (no token cache of its version is left to take it "
              "from); pass --tokenizer to choose one")
    corpus = load_corpus(data["paths"], data["val_fraction"], data.get("text_field", "text"), read=False)
    return prepare_data(corpus, data["tokenizer"], data["vocab_size"], data["cache_dir"],
                        bpe_sample=data.get("bpe_sample")).tokenizer
