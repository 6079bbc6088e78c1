"""Read a DCP checkpoint without unpickling anything but its own metadata classes.

DCP stores tensor data with ``torch.save`` (read back with ``weights_only=True``) but
its ``.metadata`` file with plain :mod:`pickle`, which would run whatever a crafted
file names. :class:`SafeFileSystemReader` reads that file with an unpickler that
resolves only the classes DCP's metadata is made of (its dataclasses, ``torch.Size``,
dtypes, layouts and paths) and refuses every other global.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ALLOWED_MODULES = {
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
}
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata names {module}.{name}, which is not part of DCP's metadata; "
            "refusing to load it"
        )


def read_metadata_file(path) -> Metadata:
    """The :class:`Metadata` in a DCP ``.metadata`` file, read with the restricted unpickler."""
    with open(path, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """A :class:`FileSystemReader` whose metadata is read by :func:`read_metadata_file`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        metadata = read_metadata_file(path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
