"""Token storage in Megatron's memory-mapped `.bin`/`.idx` format (MMIDIDX, version 1).

The `.bin` file is every sequence's tokens back to back in one dtype. The
`.idx` file describes it, little-endian, with no padding:

    offset  size       field
    0       9          magic b"MMIDIDX\\x00\\x00"
    9       8  <Q      version, always 1
    17      1  <B      dtype code (DTYPE_CODES)
    18      8  <Q      sequence count n
    26      8  <Q      document-index entry count d (documents + 1)
    34      4·n int32  sequence lengths, in tokens
    34+4n   8·n int64  sequence pointers, byte offsets into .bin
    34+12n  8·d int64  document indices: document k is sequences
                       [document_indices[k], document_indices[k+1]); starts with 0

A document may hold several sequences (Megatron's sentence splitting) or none.
Files written here are byte-identical to those of Megatron's builder.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # 34

# Megatron's dtype codes; the numbers are part of the file format.
DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int | None) -> type[np.number]:
    """The token dtype for a vocabulary of `vocab_size` ids: uint16 below 65500, else int32.

    The 65500 threshold is Megatron's; it leaves room under 2**16 for padding ids.
    """
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(path_prefix: str) -> str:
    """`{path_prefix}.bin`."""
    return path_prefix + ".bin"


def index_file_path(path_prefix: str) -> str:
    """`{path_prefix}.idx`."""
    return path_prefix + ".idx"


def _dtype_code(dtype: Any) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except (KeyError, TypeError):
        names = ", ".join(np.dtype(t).name for t in DTYPE_CODES.values())
        raise ValueError(f"dtype {dtype!r} has no MMIDIDX code; use one of {names}") from None


class IndexedDatasetBuilder:
    """Writes a `.bin` file token by token and its `.idx` file at `finalize`.

    Args:
        bin_path: the `.bin` file to create (overwritten if present).
        dtype: token dtype, one of DTYPE_CODES' types (see `optimal_dtype`).
    """

    def __init__(self, bin_path: str, dtype: Any = np.int32) -> None:
        self.dtype = np.dtype(dtype)
        _dtype_code(self.dtype)
        self.bin_path = bin_path
        self._data_file = open(bin_path, "wb")  # noqa: SIM115 - closed in finalize
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def _as_tokens(self, tokens: Any) -> np.ndarray:
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {array.shape}")
        if array.size and array.dtype != self.dtype and self.dtype.kind in "iu":
            # A silent wrap-around (70000 -> 4464 in uint16) would corrupt the data.
            info = np.iinfo(self.dtype)
            low, high = int(array.min()), int(array.max())
            if low < info.min or high > info.max:
                raise ValueError(
                    f"token ids span [{low}, {high}], outside {self.dtype.name}'s "
                    f"[{info.min}, {info.max}]; pick a wider dtype"
                )
        return array.astype(self.dtype, copy=False)

    def add_item(self, tokens: Any) -> None:
        """Append one sequence (1-D ints: list, numpy array or CPU tensor) to the open document."""
        array = self._as_tokens(tokens)
        self._data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(int(array.size))

    def end_document(self) -> None:
        """Close the open document: the sequences added since the last close form one document."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens: Any, lengths: Sequence[int] | None = None) -> None:
        """Append one whole document.

        Args:
            tokens: the document's tokens, 1-D.
            lengths: how the tokens split into sequences; default one sequence of all of
                them (so an empty document is one empty sequence and reads back as []).
        """
        array = self._as_tokens(tokens)
        lengths = [int(array.size)] if lengths is None else [int(n) for n in lengths]
        if sum(lengths) != array.size:
            raise ValueError(f"lengths sum to {sum(lengths)} but the document has {array.size}")
        self._data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.end_document()

    def add_index(self, path_prefix: str) -> None:
        """Append every document of the pair `path_prefix` (same dtype), tokens copied as
        they are; the documents keep their sequences."""
        if self.document_indices[-1] != len(self.sequence_lengths):
            raise ValueError("add_index after add_item: close the open document first")
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise ValueError(
                f"{path_prefix} holds {other.dtype.name} tokens, this dataset {self.dtype.name}"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(int(n) for n in other.sequence_lengths)
        self.document_indices.extend(int(d) + offset for d in other.document_indices[1:])
        del other
        with open(data_file_path(path_prefix), "rb") as stream:
            shutil.copyfileobj(stream, self._data_file)

    def finalize(self, idx_path: str) -> None:
        """Close the `.bin` file and write the `.idx` file; an open document is closed first."""
        if self.document_indices[-1] != len(self.sequence_lengths):
            self.end_document()
        self._data_file.close()
        write_index(idx_path, self.dtype, self.sequence_lengths, self.document_indices)


def write_index(
    idx_path: str, dtype: Any, sequence_lengths: Iterable[int], document_indices: Iterable[int]
) -> None:
    """Write an `.idx` file for sequences of the given lengths (pointers follow from them)."""
    lengths = np.asarray(list(sequence_lengths), dtype=np.int32)
    documents = np.asarray(list(document_indices), dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(idx_path, "wb") as stream:
        stream.write(INDEX_MAGIC)
        stream.write(struct.pack("<Q", INDEX_VERSION))
        stream.write(struct.pack("<B", _dtype_code(dtype)))
        stream.write(struct.pack("<Q", len(lengths)))
        stream.write(struct.pack("<Q", len(documents)))
        stream.write(lengths.tobytes(order="C"))
        stream.write(pointers.tobytes(order="C"))
        stream.write(documents.tobytes(order="C"))


def _map(path: str) -> np.ndarray:
    # numpy cannot map an empty file; an all-empty dataset has an empty .bin.
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=np.uint8)
    # A plain ndarray view (the map stays alive as its base) so slices are not memmaps.
    return np.memmap(path, mode="r", dtype=np.uint8).view(np.ndarray)


class IndexedDataset:
    """Read-only, memory-mapped view of a `.bin`/`.idx` pair.

    `dataset[i]` is sequence i's tokens as a numpy array of the file's dtype (a view
    into the map; copy it before writing). Raises FileNotFoundError naming a missing
    file and ValueError naming the file and the fault for a corrupt or truncated index.
    """

    def __init__(self, path_prefix: str) -> None:
        self.path_prefix = path_prefix
        self._open()

    def _open(self) -> None:
        idx_path = index_file_path(self.path_prefix)
        bin_path = data_file_path(self.path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file not found: {path}")
        self._index = _map(idx_path)
        self._read_header(idx_path)
        self._data = _map(bin_path)
        self._check_data(bin_path)

    def _read_header(self, idx_path: str) -> None:
        size = self._index.size
        if size < HEADER_BYTES:
            raise ValueError(
                f"{idx_path}: truncated index, {size} bytes < {HEADER_BYTES}-byte header"
            )
        head = bytes(self._index[:HEADER_BYTES])
        if head[:9] != INDEX_MAGIC:
            raise ValueError(f"{idx_path}: not an MMIDIDX index (magic {head[:9]!r})")
        version, code, n, d = struct.unpack("<QBQQ", head[9:])
        if version != INDEX_VERSION:
            raise ValueError(f"{idx_path}: index version {version}, only {INDEX_VERSION} is known")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path}: unknown dtype code {code}")
        expected = HEADER_BYTES + 12 * n + 8 * d
        if size != expected:
            detail = " (a multimodal index with sequence modes)" if size == expected + n else ""
            raise ValueError(
                f"{idx_path}: header says {n} sequences and {d} document-index entries, "
                f"which need {expected} bytes, but the file has {size}{detail}"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.sequence_lengths = self._index[HEADER_BYTES : HEADER_BYTES + 4 * n].view(np.int32)
        offset = HEADER_BYTES + 4 * n
        self.sequence_pointers = self._index[offset : offset + 8 * n].view(np.int64)
        offset += 8 * n
        self.document_indices = self._index[offset : offset + 8 * d].view(np.int64)
        docs = self.document_indices
        if d == 0 or docs[0] != 0 or docs[-1] != n or np.any(np.diff(docs) < 0):
            raise ValueError(
                f"{idx_path}: document indices must rise from 0 to the sequence count {n}"
            )

    def _check_data(self, bin_path: str) -> None:
        n = len(self.sequence_lengths)
        need = 0
        if n:
            need = (
                int(self.sequence_pointers[-1])
                + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            )
        if self._data.size != need:
            raise ValueError(
                f"{bin_path}: index expects {need} bytes of tokens, file has {self._data.size}"
            )

    def __getstate__(self) -> dict[str, str]:
        # Reopen by path in the unpickled copy (DataLoader workers) instead of copying the maps.
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.path_prefix = state["path_prefix"]
        self._open()

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        """Number of documents (document_indices has one more entry)."""
        return len(self.document_indices) - 1

    def __getitem__(self, idx: int) -> np.ndarray:
        """Sequence `idx`'s tokens."""
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `idx` (to its end when length is None)."""
        idx = int(idx)
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences")
        total = int(self.sequence_lengths[idx])
        if length is None:
            length = total - offset
        if offset < 0 or length < 0 or offset + length > total:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) outside sequence {idx} of {total}"
            )
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return self._data[start : start + length * self.dtype.itemsize].view(self.dtype)

    def document(self, k: int) -> np.ndarray:
        """All tokens of document `k` (its sequences concatenated)."""
        first, last = int(self.document_indices[k]), int(self.document_indices[k + 1])
        if first == last:
            return np.zeros(0, dtype=self.dtype)
        start = int(self.sequence_pointers[first])
        stop = (
            int(self.sequence_pointers[last - 1])
            + int(self.sequence_lengths[last - 1]) * self.dtype.itemsize
        )
        return self._data[start:stop].view(self.dtype)

    def token_id_range(self, chunk: int = 1 << 26) -> tuple[int, int] | None:
        """The smallest and largest token id in the `.bin` file (None when it holds none).
        One pass over the file, ``chunk`` tokens at a time."""
        count = self._data.size // self.dtype.itemsize
        if count == 0:
            return None
        tokens = self._data[: count * self.dtype.itemsize].view(self.dtype)
        low, high = None, None
        for start in range(0, count, chunk):
            part = tokens[start : start + chunk]
            lo, hi = int(part.min()), int(part.max())
            low = lo if low is None else min(low, lo)
            high = hi if high is None else max(high, hi)
        return low, high

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both `{path_prefix}.bin` and `{path_prefix}.idx` exist."""
        return os.path.isfile(index_file_path(path_prefix)) and os.path.isfile(
            data_file_path(path_prefix)
        )
