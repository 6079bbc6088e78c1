"""Read a DCP checkpoint without letting its files run code.

DCP stores tensor data with ``torch.save`` (read back with ``weights_only=True``) but its
``.metadata`` file with plain :mod:`pickle`, which calls whatever a crafted file names.
:func:`read_metadata_file` reads that file with an unpickler that

- resolves only an explicit list of ``(module, name)`` pairs: DCP's metadata classes and
  the types their fields hold (``torch.Size``, dtypes, layouts, paths), never a whole
  module and never a dotted name (``module.os.system``);
- sets state (pickle's BUILD) only on instances of those classes, never on a class;
- then checks the result field by field, so DCP gets exactly the structure it wrote:
  tensor entries, and storage entries that point at plain files of the checkpoint
  directory with non-negative offsets and no transforms.

:func:`check_data_files` then makes sure every data file the metadata names is there and
long enough, so a truncated shard is named before any rank starts reading.
"""

from __future__ import annotations

import os
import pathlib
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.serialization
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from megapp.checkpointing.errors import CheckpointError

_STORAGE_INFO = dcp_filesystem._StorageInfo  # what FileSystemWriter records per item
_MEMORY_FORMAT = dcp_metadata._MEM_FORMAT_ENCODING  # how TensorProperties pickles its format

# Classes whose instances the metadata is made of; only these may receive state (BUILD).
_CLASSES = (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    MetadataIndex,
    _STORAGE_INFO,
)
_PATHS = (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath)


def _allowed() -> dict[tuple[str, str], Any]:
    """Every global a metadata file may name, by the exact pair pickle writes for it."""
    allowed: dict[tuple[str, str], Any] = {}
    for obj in (*_CLASSES, _MEMORY_FORMAT, torch.Size, OrderedDict, *_PATHS):
        allowed[(obj.__module__, obj.__qualname__)] = obj
    for path in _PATHS:  # Python 3.13 moved the classes to pathlib._local; either name
        allowed[("pathlib", path.__name__)] = path
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    return allowed


_ALLOWED = _allowed()


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (so that BUILD can be checked) with an explicit allowlist."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def _refuse(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"{self.path}: {what}, which is not part of DCP's metadata; refusing to load it "
            "(the file may have been tampered with)"
        )

    def find_class(self, module: str, name: str) -> Any:
        if "." in name:
            raise self._refuse(f"names the dotted global {module}.{name}")
        obj = _ALLOWED.get((module, name))
        if obj is None:
            raise self._refuse(f"names {module}.{name}")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise self._refuse("holds a persistent reference")

    def _load_build(self) -> None:
        target = self.stack[-2]
        if isinstance(target, type) or not isinstance(target, _CLASSES):
            raise self._refuse(f"sets the state of a {type(target).__name__} {target!r:.60}")
        pickle._Unpickler.dispatch[pickle.BUILD[0]](self)

    dispatch: ClassVar = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: _load_build}


def _fail(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}; it is not DCP metadata as megapp writes it")


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(isinstance(n, int) and n >= 0 for n in value)


def _check_tensor_entry(key: str, md: Any, path: Path) -> None:
    if isinstance(md, BytesStorageMetadata):
        return
    if not isinstance(md, TensorStorageMetadata):
        raise _fail(path, f"entry {key!r} is a {type(md).__name__}")
    props = md.properties
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
        raise _fail(path, f"entry {key!r} has no tensor properties")
    if not _is_size(md.size) or not isinstance(md.chunks, list):
        raise _fail(path, f"entry {key!r} has no size or chunk list")
    for chunk in md.chunks:
        if not (
            isinstance(chunk, ChunkStorageMetadata)
            and _is_size(chunk.offsets)
            and _is_size(chunk.sizes)
            and len(chunk.offsets) == len(chunk.sizes) == len(md.size)
        ):
            raise _fail(path, f"entry {key!r} has a malformed chunk")


def _is_plain_file_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def _check_storage_entry(index: Any, info: Any, path: Path) -> None:
    if not isinstance(index, MetadataIndex) or not isinstance(info, _STORAGE_INFO):
        raise _fail(path, f"a storage entry is a {type(info).__name__}")
    if not _is_plain_file_name(info.relative_path):
        raise _fail(path, f"entry {index.fqn!r} points outside the checkpoint directory")
    if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
        raise _fail(path, f"entry {index.fqn!r} has a negative or non-integer byte range")
    if getattr(info, "transform_descriptors", None):
        raise _fail(path, f"entry {index.fqn!r} asks for stream transforms")


def read_metadata_file(path: str | os.PathLike) -> Metadata:
    """The :class:`Metadata` in a DCP ``.metadata`` file, read with the restricted unpickler
    and checked field by field. Raises :class:`CheckpointError` naming the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError as error:
        raise CheckpointError(f"{path}: missing") from error
    except Exception as error:  # a truncated or garbled file fails anywhere in pickle
        raise CheckpointError(
            f"{path}: unreadable ({type(error).__name__}: {error}); the checkpoint is corrupt"
        ) from error
    if not isinstance(metadata, Metadata):
        raise _fail(path, f"it holds a {type(metadata).__name__}")
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
        raise _fail(path, "its entries are not a dict of names")
    for key, md in entries.items():
        _check_tensor_entry(key, md, path)
    if not isinstance(storage, dict):
        raise _fail(path, "it has no storage index")
    for index, info in storage.items():
        _check_storage_entry(index, info, path)
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        raise _fail(path, "its storage_meta is not a StorageMeta")
    return metadata


def check_data_files(metadata: Metadata, directory: str | os.PathLike) -> None:
    """Every data file the metadata points at exists and holds the byte ranges it names."""
    directory = Path(directory)
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = directory / name
        try:
            size = file.stat().st_size
        except OSError as error:
            raise CheckpointError(f"{file}: missing ({error.strerror})") from error
        if size < end:
            raise CheckpointError(
                f"{file}: truncated ({size} bytes; the checkpoint's index needs {end}); "
                "the checkpoint is corrupt"
            )


class SafeFileSystemReader(FileSystemReader):
    """A :class:`FileSystemReader` whose metadata is read by :func:`read_metadata_file`
    (or given, when the caller has already read and checked it)."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None):
        super().__init__(path)
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self.metadata
        if metadata is None:
            metadata = read_metadata_file(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
