"""Hugging Face Hub model ids (``organisation/name``) where a command takes a model's
folder: ``attnres upcycle --model``, ``attnres eval`` and ``attnres generate``. A name that is
no local file or directory and reads as an id is fetched into the Hugging Face cache."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["HUB_FILES", "HUB_ID", "from_hub", "is_hub_id", "local_folder"]

#: A Hugging Face Hub model id, ``organisation/name``.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")

#: The files of a Hub model that are fetched: config, safetensors weights, tokenizer (not the
#: same weights again as .bin, .gguf or ONNX files).
HUB_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")


def is_hub_id(name: str | Path) -> bool:
    """Whether ``name`` is to be fetched from the Hub: it reads as ``organisation/name``, and
    neither it nor its first part is a local file or directory (``runs/atnres`` beside a
    ``runs/`` folder is a misspelt run, not a Hub id), and it does not end in ``.gguf`` (a
    GGUF file's path)."""
    text = str(name)
    return (bool(HUB_ID.fullmatch(text)) and not Path(text).exists() and not Path(text).parent.exists()
            and not text.lower().endswith(".gguf"))


def from_hub(model_id: str, option: str = "--model") -> Path:
    """The local folder of Hub model ``model_id``: downloaded into the Hugging Face cache
    (``HF_HOME``; a token from ``hf auth login`` or ``HF_TOKEN`` for a gated model), or found
    there with ``HF_HUB_OFFLINE=1``. ``option``: how the command took it, for the error."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model_id, allow_patterns=list(HUB_FILES)))
    except (OSError, ValueError) as e:  # not found, gated, offline, no network: all OSError; a bad id: ValueError
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{option} {model_id!r} is no local file or directory, and as a Hugging Face Hub model id it "
                         f"could not be fetched ({type(e).__name__}: {reason}); check the name, or download it where "
                         f"there is a network (`hf download {model_id} --local-dir DIR`) and give {option} DIR") from None


def local_folder(name: str, option: str = "--model") -> str:
    """``name`` as it is, or, for a Hub id (:func:`is_hub_id`), the folder it is fetched into."""
    return str(from_hub(name, option)) if is_hub_id(name) else name
