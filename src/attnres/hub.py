"""Hugging Face Hub model ids (``organisation/name``) where a command takes a model's
folder: ``attnres upcycle --model``, ``attnres eval`` and ``attnres generate``. A name that is
no local file or directory and reads as an id is fetched into the Hugging Face cache.

Outside the transformers wing (:mod:`attnres.hf`, whose import needs ``transformers``): it
needs only ``huggingface_hub``, when a Hub id is fetched, and ``attnres generate`` and
``attnres analyze`` ask it about every checkpoint, a native run's too, which they load
without ``transformers``."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

__all__ = ["HUB_FILES", "HUB_ID", "OFFLINE_VARIABLES", "from_hub", "hub_unreachable", "is_hub_id", "local_folder",
           "offline_mode"]

#: A Hugging Face Hub model id, ``organisation/name``.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")

#: The files of a Hub model that are fetched: config, safetensors weights, tokenizer (not the
#: same weights again as .bin, .gguf or ONNX files).
HUB_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")

#: The environment variables that set the Hugging Face libraries' offline mode.
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


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


def hub_unreachable(timeout: float = 10.0) -> str | None:
    """Why the Hugging Face Hub (``HF_ENDPOINT``) cannot be reached, from one request without
    retries (a name that does not resolve, a connection refused, no answer in ``timeout``
    seconds), or ``None`` where it answers. The Hub client retries a failed request for about
    25 seconds before it gives up."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as e:  # (httpx's or requests' errors, OSError: any request that got no answer)
        return f"{constants.ENDPOINT}: {type(e).__name__}: {e}"
    return None


@contextlib.contextmanager
def offline_mode() -> Iterator[None]:
    """Within: ``huggingface_hub`` and ``datasets`` in offline mode, as ``HF_HUB_OFFLINE=1``
    sets them (they read the variable once, when imported: setting it later changes nothing):
    a data set is read from the local cache at once, or its absence raised at once, without
    requests and their retries. Set back after."""
    import datasets.config
    from huggingface_hub import constants

    held = [(module, name, getattr(module, name)) for module, name in (
        (constants, "HF_HUB_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE"))
        if hasattr(module, name)]
    for module, name, _ in held:
        setattr(module, name, True)
    try:
        yield
    finally:
        for module, name, value in held:
            setattr(module, name, value)
