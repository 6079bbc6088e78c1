"""A built-in training corpus: the running interpreter's standard-library sources.

Every Python installation carries some 30 MB of real, varied text in its
standard library, so a demo can train with no download. Each `*.py` file (sorted
by path, `site-packages` excluded) is one document, tokenized and ended with EOD.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

from megapp.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
    optimal_dtype,
)

# Changes in what the corpus holds bump this, so older pairs are rebuilt.
CORPUS_FORMAT_VERSION = 1
_SKIPPED_DIRECTORIES = {"site-packages", "dist-packages", "__pycache__"}
_PROBE_TEXT = "def f(x):\n    return x + 1  # naïve ünïcode\n"


def stdlib_source_files() -> list[Path]:
    """The standard library's `*.py` files, sorted by their path inside it."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for directory, subdirectories, names in os.walk(root):
        # Prune installed packages (not the standard library, and large) and caches.
        subdirectories[:] = [d for d in subdirectories if d not in _SKIPPED_DIRECTORIES]
        files += [Path(directory, name) for name in names if name.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _stamp(files: list[Path], tokenizer: Any, max_bytes: int | None) -> dict[str, Any]:
    # Identifies both the sources and the tokenizer; the probe's ids change if the
    # tokenizer's vocabulary or merges do.
    return {
        "format": CORPUS_FORMAT_VERSION,
        "python": sys.version,
        "stdlib": sysconfig.get_paths()["stdlib"],
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "latest_mtime_ns": max((p.stat().st_mtime_ns for p in files), default=0),
        "tokenizer": type(tokenizer).__name__,
        "vocab_size": tokenizer.vocab_size,
        "eod": tokenizer.eod,
        "probe": tokenizer.tokenize(_PROBE_TEXT),
        "max_bytes": max_bytes,
    }


def build_default_corpus(output_prefix: str, tokenizer: Any, max_bytes: int | None = None) -> str:
    """Write (or reuse) `{output_prefix}.bin/.idx` holding the standard library's sources.

    Args:
        output_prefix: path prefix of the pair; its directory is created.
        tokenizer: any megapp tokenizer (ByteTokenizer is fast and needs no files).
        max_bytes: stop after the file that brings the source bytes read to this
            many (None: all of it, about 30 MB).

    Returns:
        `output_prefix`, ready for `IndexedDataset`. An existing pair is reused when its
        stamp (`{output_prefix}.json`: sources, tokenizer, max_bytes) still matches.
    """
    files = stdlib_source_files()
    if not files:
        raise FileNotFoundError(f"no *.py files under {sysconfig.get_paths()['stdlib']}")
    stamp = _stamp(files, tokenizer, max_bytes)
    stamp_path = output_prefix + ".json"
    if IndexedDataset.exists(output_prefix) and os.path.isfile(stamp_path):
        with open(stamp_path, encoding="utf-8") as stream:
            if json.load(stream) == stamp:
                return output_prefix
    if os.path.exists(stamp_path):
        os.remove(stamp_path)  # an interrupted rebuild must not look up to date
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(
        data_file_path(output_prefix), optimal_dtype(tokenizer.vocab_size)
    )
    read = 0
    for path in files:
        source = path.read_bytes()
        read += len(source)
        tokens = tokenizer.tokenize(source.decode("utf-8", errors="replace"))
        builder.add_document([*tokens, tokenizer.eod])
        if max_bytes is not None and read >= max_bytes:
            break
    builder.finalize(index_file_path(output_prefix))
    # The stamp goes last: a crash mid-build leaves no stamp, so the pair is rebuilt.
    with open(stamp_path, "w", encoding="utf-8") as stream:
        json.dump(stamp, stream)
    return output_prefix
