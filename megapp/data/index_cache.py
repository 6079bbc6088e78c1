"""Index arrays cached as `.npy` files, keyed by a hash of everything they depend on.

A cache entry is `{stem}_{hash}_{name}.npy` for each array plus
`{stem}_{hash}_description.json` (the settings in words, written last: an entry
without it is incomplete and rebuilt). The hash covers the settings and the data
file's size and modification time, so changed data or settings miss the cache and
the arrays are rebuilt; nothing is ever read back under the wrong settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np


def file_fingerprint(path: str) -> dict[str, int]:
    """Size and modification time (ns) of `path`: cheap, and changes when the file is rewritten."""
    stat = os.stat(path)
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def description_hash(description: dict[str, Any]) -> str:
    """md5 of the description's canonical JSON (sorted keys), as hex."""
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def _save_atomically(path: str, write: Callable[[str], None]) -> None:
    # Write beside the target and rename, so a reader never sees half a file even
    # when several ranks build the same entry at once.
    directory = os.path.dirname(path) or "."
    handle, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    os.close(handle)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_or_build(
    cache_dir: str | None,
    stem: str,
    description: dict[str, Any],
    names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
) -> tuple[dict[str, np.ndarray], bool]:
    """The arrays `names` from the cache, or from `build()` (then saved).

    Args:
        cache_dir: directory of the cache; None builds without caching.
        stem: readable file-name prefix (dataset and split).
        description: JSON-able settings the arrays depend on; its hash keys the entry.
        names: the array names `build` returns.
        build: computes the arrays on a miss.

    Returns:
        (arrays by name, memory-mapped read-only on a hit; True when built anew).
    """
    if cache_dir is None:
        return build(), True
    key = description_hash(description)
    base = os.path.join(cache_dir, f"{stem}_{key}")
    paths = {name: f"{base}_{name}.npy" for name in names}
    marker = f"{base}_description.json"
    if os.path.isfile(marker) and all(os.path.isfile(p) for p in paths.values()):
        return {name: np.load(p, mmap_mode="r") for name, p in paths.items()}, False
    arrays = build()
    os.makedirs(cache_dir, exist_ok=True)
    for name, path in paths.items():
        _save_atomically(path, lambda tmp, a=arrays[name]: _save_npy(tmp, a))
    text = json.dumps(description, sort_keys=True, indent=1, default=str)
    _save_atomically(marker, lambda tmp: _write_text(tmp, text))
    return arrays, True


def _save_npy(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as stream:
        np.save(stream, array, allow_pickle=False)


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as stream:
        stream.write(text)
