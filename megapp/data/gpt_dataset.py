"""GPT pre-training samples: fixed-length token windows over a split of an indexed dataset.

Each sample is `{"tokens": int64[sequence_length + 1]}`, a window of the document
stream described in `gpt_indices`; windows cross document boundaries (the EOD
tokens written at preprocessing mark them). `megapp.training.data_iterators.get_batch`
turns a collated batch into tokens, labels, loss mask and position ids.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from megapp.data.gpt_indices import build_gpt_indices
from megapp.data.index_cache import file_fingerprint, load_or_build
from megapp.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path

# Part of every cache key: bump it when the index arithmetic changes.
INDEX_FORMAT_VERSION = 1
_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


class GPTDataset:
    """Samples of `sequence_length + 1` tokens from documents `[start, stop)` of a dataset.

    Args:
        indexed_dataset: the tokens.
        num_samples: samples wanted; epochs repeat (each reshuffled) to reach it.
            None means one epoch. `len(dataset)` can exceed it (whole epochs are built).
        sequence_length: model sequence length; samples hold one token more.
        seed: seed of the document and sample shuffles.
        sequence_range: `(start, stop)` sequences of the dataset forming this split;
            None is all of them. Sequences are the units of the stream (a document
            written as several sequences contributes each one separately, as in Megatron).
        split: split name, for cache file names and logs.
        cache: whether to cache the index arrays as `.npy` files.
        cache_dir: where; None puts them next to the `.bin`/`.idx` files.

    The indices are rebuilt whenever the settings or the `.idx` file (size, mtime) change.
    """

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        num_samples: int | None,
        sequence_length: int,
        seed: int = 1234,
        sequence_range: tuple[int, int] | None = None,
        split: str = "train",
        cache: bool = True,
        cache_dir: str | None = None,
    ) -> None:
        self.indexed_dataset = indexed_dataset
        self.sequence_length = int(sequence_length)
        self.split = split
        num_sequences = len(indexed_dataset)
        start, stop = sequence_range if sequence_range is not None else (0, num_sequences)
        if not 0 <= start <= stop <= num_sequences:
            raise ValueError(f"sequence range [{start}, {stop}) outside {num_sequences} sequences")
        self.sequences = np.arange(start, stop, dtype=np.int64)

        prefix = indexed_dataset.path_prefix
        idx_path = index_file_path(prefix)
        self.description: dict[str, Any] = {
            "class": type(self).__name__,
            "format": INDEX_FORMAT_VERSION,
            "path_prefix": os.path.abspath(prefix),
            "split": split,
            "sequence_range": [int(start), int(stop)],
            "num_samples": num_samples,
            "sequence_length": self.sequence_length,
            "seed": int(seed),
            "idx_file": file_fingerprint(idx_path),
            "bin_size": os.path.getsize(data_file_path(prefix)),
        }
        directory = cache_dir if cache_dir is not None else os.path.dirname(os.path.abspath(prefix))
        arrays, self.built_anew = load_or_build(
            directory if cache else None,
            f"{os.path.basename(prefix)}_{split}",
            self.description,
            _INDEX_NAMES,
            lambda: build_gpt_indices(
                indexed_dataset.sequence_lengths,
                self.sequences,
                num_samples,
                self.sequence_length,
                seed,
            ),
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        """Number of samples available (whole epochs; at least the requested count)."""
        return len(self.shuffle_index)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        """`{"tokens": int64[sequence_length + 1]}` of sample `idx` (in shuffled order)."""
        return {"tokens": self.sample_tokens(int(self.shuffle_index[self._check(idx)]))}

    def _check(self, idx: int) -> int:
        idx = int(idx)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        return idx

    def sample_tokens(self, sample: int) -> np.ndarray:
        """Tokens of unshuffled sample `sample`: stream positions
        `[sample·sequence_length, (sample + 1)·sequence_length]`, int64."""
        first, first_offset = (int(v) for v in self.sample_index[sample])
        last, last_offset = (int(v) for v in self.sample_index[sample + 1])
        get = self.indexed_dataset.get
        if first == last:
            parts = [get(self.document_index[first], first_offset, last_offset - first_offset + 1)]
        else:
            parts = [get(self.document_index[first], first_offset)]
            parts += [get(self.document_index[i]) for i in range(first + 1, last)]
            parts.append(get(self.document_index[last], 0, last_offset + 1))
        return np.concatenate(parts).astype(np.int64)
