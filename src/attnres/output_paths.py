"""Where a command writes: checked before any work, with one line naming the setting, the
path and the cause (a file in the way, a read-only file system, no permission), and written
so that a failure loses nothing that was there.

:func:`check_output_dir` and :func:`check_output_file` create nothing: a directory that does
not exist yet is checked by creating (and removing) a temporary one where it would go, so a
command that stops later for another reason leaves no empty directory behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .user_warning import warn_user

__all__ = ["HF_MODEL_FILES", "HF_MODULE_FILE", "HF_TOKENIZER_FILES", "HF_WEIGHT_FILES", "OutputPathError",
           "check_output_dir", "check_output_file", "file_in_the_way", "honour_umask", "not_a_directory", "os_cause",
           "read_json_object", "replace_atomically", "save_figure_atomically", "strict_json", "write_directory_atomically",
           "write_text_atomically"]


#: The files a Hugging Face directory keeps its weights in (``save_pretrained``'s
#: ``model.safetensors`` or its shards and their index; older ``pytorch_model*.bin``): what
#: loaders read as the model (vLLM: every ``*.safetensors`` file, or the ones the index names).
#: Not ``training_args.bin`` and the like, which hold no weights.
HF_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.bin.index.json")

#: The other files a loader reads as part of a Hugging Face model directory: the tokenizer's
#: (fast or SentencePiece or BPE vocabularies, its config and special tokens), the chat
#: templates and the generation settings. Left beside another model's files, a stale one is
#: read as the new model's: an instruct model's chat template or end-of-turn token would
#: apply to a base model upcycled into the same directory.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt",
                      "merges.txt", "chat_template.jinja", "chat_template.json", "additional_chat_templates/*.jinja",
                      "generation_config.json")
#: The module file of a saved AttnRes directory, which ``config.json``'s ``auto_map`` names
#: for transformers' ``trust_remote_code`` loading (:mod:`attnres.hf.families.remote_code`).
HF_MODULE_FILE = "attnres_classes.py"
#: Every file of a model that ``attnres export`` / ``attnres upcycle`` replace as a whole.
HF_MODEL_FILES = HF_WEIGHT_FILES + HF_TOKENIZER_FILES + (HF_MODULE_FILE,)


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by ``None``, through mappings,
    lists and tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def strict_json(value: Any, **kwargs: Any) -> str:
    """``json.dumps(value, **kwargs)`` as strict JSON: a float that is not finite (NaN, an
    infinity) is written as ``null``. Python's ``json`` writes them as ``NaN`` and ``Infinity``,
    which JSON does not have: ``jq``, JavaScript and ``json.loads(..., parse_constant=...)``
    refuse the file."""
    return json.dumps(_finite(value), allow_nan=False, **kwargs)


def read_json_object(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The JSON object a file written here holds, and ``None``; or ``None`` and why it cannot
    be read, in words for an error (cut short or edited: the exception; another JSON value)."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"
    return (value, None) if isinstance(value, dict) else (None, f"a JSON {type(value).__name__}, not an object")


class OutputPathError(ValueError):
    """A place to write cannot be used: a file in the way, not writable, cannot be created."""


def os_cause(e: OSError) -> str:
    """An ``OSError``'s reason in words ("read-only file system", "no space left on device")."""
    return (e.strerror or str(e)).lower()


def file_in_the_way(path: Path) -> Path | None:
    """The first existing component of ``path`` (itself included) that is not a directory."""
    for part in (*reversed(path.parents), path):
        if part.exists() and not part.is_dir():
            return part
    return None


def not_a_directory(what: str, path: Path, blocker: Path) -> OutputPathError:
    """The error for ``path`` (of setting ``what``) where ``blocker``, a file, is in the way."""
    where = "it is a file" if blocker == path else f"{str(blocker)!r} is a file"
    return OutputPathError(f"{what} {str(path)!r} cannot be used: {where}, not a directory; pick another {what}")


def honour_umask(paths) -> None:
    """Give the files ``paths`` the permissions a plain ``open`` would have (``0o666`` less the
    process's umask). safetensors (0.6 and later) writes through a private temporary file and
    leaves ``0600``: a checkpoint or export that the user's colleagues, or a server running as
    another user, could not read, beside a ``state.json`` and ``config.json`` they can."""
    mask = os.umask(0)  # the only way to read it; set back at once
    os.umask(mask)
    for path in paths:
        os.chmod(path, 0o666 & ~mask)


def _probe(directory: Path) -> None:
    """Create and remove a temporary directory in ``directory``: raises ``OSError`` where
    nothing can be created there (a file, a subdirectory)."""
    shutil.rmtree(tempfile.mkdtemp(prefix=".attnres-write-check-", dir=directory), ignore_errors=True)


def check_output_dir(path: str | Path, what: str = "--out") -> Path:
    """``path`` as a directory to write into: an existing directory where files can be
    created, or a missing one that can be created (its nearest existing parent a directory
    that takes a new entry). Creates nothing; raises :class:`OutputPathError` naming
    ``what`` (the option or field: ``"--out"``, ``"data.cache_dir"``), the path and the cause."""
    path = Path(path).expanduser()
    blocker = file_in_the_way(path)
    if blocker is not None:
        raise not_a_directory(what, path, blocker)
    existing = next(p for p in (path, *path.parents) if p.exists())  # "/" or "." at the latest
    try:
        _probe(existing)
    except OSError as e:
        verb = "is not writable" if existing == path else "cannot be created"
        raise OutputPathError(f"{what} {str(path)!r} {verb}: {os_cause(e)}") from None
    return path


def check_output_file(path: str | Path, what: str = "--out") -> Path:
    """``path`` as a file to (over)write: not a directory, in an existing directory where
    files can be created. Creates nothing; raises :class:`OutputPathError` naming ``what``,
    the path and the cause."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise OutputPathError(f"{what} {str(path)!r} is a directory; give the path of a file")
    if not path.parent.is_dir():
        blocker = file_in_the_way(path.parent)
        if blocker is not None:
            raise not_a_directory(what, path.parent, blocker)
        raise OutputPathError(f"{what} {str(path)!r}: the folder {str(path.parent)!r} does not exist; create it first")
    try:
        _probe(path.parent)
    except OSError as e:
        raise OutputPathError(f"{what} {str(path)!r} cannot be written: {os_cause(e)}") from None
    return path


def replace_atomically(path: Path, write: Callable[[Path], None], what: str = "--out") -> None:
    """Run ``write(tmp)`` on a temporary file beside ``path`` (its suffix kept: matplotlib's
    ``savefig`` tells the format by it), then rename it over ``path``: a failure or an
    interruption while writing (a full disk, Ctrl-C, a kill) leaves what was at ``path``, never
    a file cut short, and no temporary file. An ``OSError`` becomes :class:`OutputPathError`
    naming ``what``, the path and the cause; anything else propagates."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        raise OutputPathError(f"{what} {str(path)!r} could not be written: {os_cause(e)}") from None
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomically(path: Path, text: str, what: str = "--out") -> None:
    """Write ``text`` to ``path`` by :func:`replace_atomically`."""
    replace_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), what)


def save_figure_atomically(fig: Any, path: Path, what: str = "--out", **savefig: Any) -> None:
    """``fig.savefig(path, **savefig)`` (a matplotlib figure) by :func:`replace_atomically`:
    a figure cut short by a kill stayed so, and replaced the one a finished command wrote."""
    replace_atomically(path, lambda tmp: fig.savefig(tmp, **savefig), what)


def write_directory_atomically(path: Path, write: Callable[[Path], None], what: str = "--out",
                               weights: tuple[str, ...] = ()) -> Path:
    """Run ``write(staging)`` on an empty temporary directory beside ``path``, then put what it
    wrote in place: the whole directory by one rename when ``path`` does not exist yet, else
    each file by one rename over the file of its name, and then the files of ``path`` (not of
    its subdirectories) that match a pattern of ``weights`` (:data:`HF_WEIGHT_FILES`,
    :data:`HF_MODEL_FILES`) and that ``write`` did not produce are removed, with a warning
    naming them: the files of the model that was there (its shards and their index beside a
    new single file, which a loader following the index would read instead of the new ones;
    its chat template beside a tokenizer without one). Other files stay.
    A failure or an interruption while writing (a disk that filled up, Ctrl-C) leaves ``path``
    as it was - never a half-written weights file that loads as damaged - and no directory it
    created. An ``OSError`` becomes :class:`OutputPathError` naming ``what``, the path and the
    cause; anything else propagates."""
    missing = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    staging = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        mask = os.umask(0)  # (mkdtemp makes it 0700: give it what a plain mkdir would)
        os.umask(mask)
        os.chmod(staging, 0o777 & ~mask)
        write(staging)
        if not path.exists():
            os.replace(staging, path)
            return path
        written = sorted(f.relative_to(staging) for f in staging.rglob("*") if f.is_file())
        stale = sorted({f for pattern in weights for f in path.glob(pattern)
                        if f.is_file() and f.relative_to(path) not in written})
        for name in written:
            target = path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / name, target)
        for file in stale:  # (once the new weights are in place: never a directory without any)
            file.unlink()
        if stale:
            warn_user(f"{what} {str(path)!r}: removed {len(stale)} file(s) of the model it held, which the new one "
                      f"does not overwrite: {', '.join(str(f.relative_to(path)) for f in stale)}")
        return path
    except OSError as e:
        raise OutputPathError(f"{what} {str(path)!r} could not be written ({os_cause(e)}); what was there is "
                              "kept") from None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if not path.exists():  # (failed before the rename: the folders made for it go too)
            for folder in missing:
                try:
                    folder.rmdir()
                except OSError:
                    break
