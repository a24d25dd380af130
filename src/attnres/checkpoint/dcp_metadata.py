"""Reading a DCP checkpoint's ``.metadata`` without running what it holds.

``torch.distributed.checkpoint`` stores the index of a sharded checkpoint (which tensor,
which chunk, in which file at which offset) as a pickle, and its ``FileSystemReader`` reads
it with ``pickle.load``: a ``.metadata`` file from someone else can run any code when a
checkpoint is resumed, generated from or exported. The SHA-256 list in ``state.json`` does
not help (whoever wrote the file wrote the list). So the metadata is read here with an
unpickler that builds only the classes DCP's metadata consists of (the dataclasses of
``torch.distributed.checkpoint.metadata``, the file-system reader's ``_StorageInfo``,
``torch.Size``, dtypes, the layout and memory-format encodings, paths) and refuses anything
else; the result is then checked to describe tensors only (DCP reads a non-tensor entry with
``torch.load(weights_only=False)``) stored in plain files of the checkpoint's own directory.
:class:`VerifiedReader` hands that metadata to DCP, so DCP never unpickles it itself.
(The ``.distcp`` data files hold tensors that DCP reads with ``torch.load(weights_only=True)``.)

Safetensors exports (``attnres export``, :func:`attnres.checkpoint.consolidate`) hold no
pickle at all: they are the format for sharing a model.
"""

from __future__ import annotations

import pathlib
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as _filesystem
from torch.distributed.checkpoint import metadata as _metadata

from .manifest import CheckpointError

__all__ = ["METADATA_FILE", "read_dcp_metadata", "VerifiedReader", "dcp_file_sizes"]

METADATA_FILE = ".metadata"

#: Everything a DCP metadata pickle of tensors refers to, by (module, name).
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name): getattr(_metadata, name)
    for name in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
                 "StorageMeta", "_MEM_FORMAT_ENCODING")
}
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _filesystem._StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a layout by name, from a table
_ALLOWED.update({("pathlib", name): getattr(pathlib, name)  # StorageMeta.checkpoint_id
                 for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")})


class _MetadataUnpickler(pickle.Unpickler):
    """Builds the classes of :data:`_ALLOWED` and torch's dtypes; refuses every other global
    (``os.system``, ``builtins.eval``, ...), so the pickle cannot call anything else."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP metadata never holds")


def _refuse(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{str(path)!r} is not a DCP metadata file this package can read safely: {why}. Nothing "
                           "from it was run. Load sharded checkpoints only from sources you trust; share models as "
                           "safetensors exports (attnres export, attnres.checkpoint.consolidate)")


def _is_tensor_entry(m) -> bool:
    """A tensor's description: its size, dtype and chunks of the types DCP writes."""
    return (isinstance(m, _metadata.TensorStorageMetadata) and isinstance(m.size, torch.Size)
            and isinstance(m.properties, _metadata.TensorProperties) and isinstance(m.properties.dtype, torch.dtype)
            and isinstance(m.chunks, list)
            and all(isinstance(c, _metadata.ChunkStorageMetadata) and isinstance(c.offsets, torch.Size)
                    and isinstance(c.sizes, torch.Size) for c in m.chunks))


def _is_plain_file(info) -> bool:
    """A storage index entry: an item of a plain file of the checkpoint directory, untransformed."""
    name = getattr(info, "relative_path", None)
    return (isinstance(info, _filesystem._StorageInfo) and isinstance(name, str) and Path(name).name == name
            and name not in ("", ".", "..") and not info.transform_descriptors
            and all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length)))


def _check_structure(meta, path: Path) -> None:
    """Tensors only, stored in plain files of the checkpoint directory."""
    if not isinstance(meta, _metadata.Metadata):
        raise _refuse(path, f"it holds a {type(meta).__name__}, not DCP Metadata")
    entries = meta.state_dict_metadata
    if not isinstance(entries, dict) or not all(isinstance(k, str) and _is_tensor_entry(m) for k, m in entries.items()):
        raise _refuse(path, "it describes entries other than tensors (DCP would unpickle those from the data files)")
    storage = meta.storage_data
    if not isinstance(storage, dict) or not all(isinstance(k, _metadata.MetadataIndex) for k in storage):
        raise _refuse(path, "it has no storage index")
    for info in storage.values():
        if not _is_plain_file(info):
            name = getattr(info, "relative_path", None)
            raise _refuse(path, f"its storage index names {name!r}, not a plain file of the checkpoint directory")


def read_dcp_metadata(dcp_dir: str | Path):
    """The ``Metadata`` of the DCP checkpoint in ``dcp_dir``, read without running code
    (see the module docstring). :class:`CheckpointError` when the file is missing, is not
    DCP metadata, or refers to anything else."""
    path = Path(dcp_dir) / METADATA_FILE
    try:
        with path.open("rb") as f:
            meta = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(Path(dcp_dir).parent)!r} is incomplete: "
                              f"{Path(dcp_dir).name}/{METADATA_FILE} is missing") from None
    except Exception as e:  # noqa: BLE001 - whatever a malformed pickle raises
        raise _refuse(path, str(e) or type(e).__name__) from None
    _check_structure(meta, path)
    return meta


def dcp_file_sizes(meta) -> dict[str, int]:
    """The data files the metadata's storage index names, each with the size it needs
    (the end of the last item stored in it)."""
    sizes: dict[str, int] = {}
    for info in meta.storage_data.values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    return sizes


class VerifiedReader(FileSystemReader):
    """DCP's file-system reader whose metadata is read once by :func:`read_dcp_metadata`
    (on construction: a bad file raises :class:`CheckpointError` before DCP starts)."""

    def __init__(self, dcp_dir: str | Path) -> None:
        super().__init__(str(dcp_dir))
        self._verified = read_dcp_metadata(dcp_dir)

    def read_metadata(self) -> _metadata.Metadata:  # no **kwargs: DCP then never looks for per-rank metadata files
        meta = self._verified
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = _metadata.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta
