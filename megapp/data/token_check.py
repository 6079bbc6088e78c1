"""Check, once at start-up, that a dataset's token ids fit the tokenizer's vocabulary.

Ids at or above the vocabulary would index past the embedding (an error deep inside the
first step) or, worse, land in its padding rows and train silently. The range of ids in a
`.bin` file takes one pass over it; the result is cached next to the dataset's index
caches, keyed by the file's size and modification time, so later runs read it for free.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from megapp.data.index_cache import file_fingerprint, load_or_build
from megapp.data.indexed_dataset import IndexedDataset, data_file_path


def token_id_range(path_prefix: str, cache_dir: str | None = None) -> tuple[int, int] | None:
    """Smallest and largest id in ``{path_prefix}.bin`` (None when empty), cached in
    ``cache_dir`` (default: beside the dataset)."""
    bin_path = data_file_path(path_prefix)
    directory = cache_dir if cache_dir is not None else os.path.dirname(os.path.abspath(bin_path))

    def build() -> dict[str, np.ndarray]:
        found = IndexedDataset(path_prefix).token_id_range()
        return {"range": np.array(found if found is not None else [], dtype=np.int64)}

    description = {"kind": "token id range", "data": file_fingerprint(bin_path)}
    stem = os.path.basename(path_prefix)
    arrays, _ = load_or_build(directory, f"{stem}_ids", description, ("range",), build)
    found = arrays["range"]
    return (int(found[0]), int(found[1])) if len(found) else None


def check_token_ids(
    path_prefixes: Sequence[str], vocab_size: int, cache_dir: str | None = None
) -> None:
    """Raise ValueError naming the file, its out-of-range id and the vocabulary size when a
    dataset holds an id outside ``[0, vocab_size)``."""
    for prefix in path_prefixes:
        found = token_id_range(prefix, cache_dir)
        if found is None:
            continue
        low, high = found
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            which = "smallest" if low < 0 else "largest"
            raise ValueError(
                f"{data_file_path(prefix)}: its {which} token id is {bad}, outside the "
                f"tokenizer's vocabulary of {vocab_size}; tokenize the data with the same "
                "tokenizer the run uses (--tokenizer-type and its files)"
            )
