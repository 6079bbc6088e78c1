"""The built-in corpus: standard-library sources as documents, rebuilt only when stale."""

import os
import sysconfig
from pathlib import Path

from megapp.data.corpus import build_default_corpus, stdlib_source_files
from megapp.data.indexed_dataset import IndexedDataset
from megapp.data.tokenizers import ByteTokenizer

LIMIT = 60_000


def expected_files(limit):
    files, read = [], 0
    for path in stdlib_source_files():
        files.append(path)
        read += path.stat().st_size
        if read >= limit:
            return files
    return files


def test_sources_are_sorted_and_exclude_site_packages():
    files = stdlib_source_files()
    assert len(files) > 100
    assert not any("site-packages" in path.parts for path in files)
    names = [path.name for path in files]
    assert "os.py" in names and "json" in {path.parent.name for path in files}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    relative = [path.relative_to(stdlib).as_posix() for path in files]
    assert relative == sorted(relative)


def test_one_document_per_file_with_eod(tmp_path):
    tokenizer = ByteTokenizer()
    prefix = build_default_corpus(str(tmp_path / "c" / "stdlib"), tokenizer, max_bytes=LIMIT)
    dataset = IndexedDataset(prefix)
    files = expected_files(LIMIT)
    assert dataset.num_documents == len(files)
    for i, path in enumerate(files):
        tokens = dataset[i].tolist()
        assert tokens[-1] == tokenizer.eod
        assert bytes(tokens[:-1]) == path.read_bytes()


def test_existing_pair_is_reused_until_settings_change(tmp_path):
    tokenizer = ByteTokenizer()
    prefix = build_default_corpus(str(tmp_path / "stdlib"), tokenizer, max_bytes=LIMIT)
    written = os.stat(f"{prefix}.bin").st_mtime_ns
    build_default_corpus(prefix, tokenizer, max_bytes=LIMIT)
    assert os.stat(f"{prefix}.bin").st_mtime_ns == written
    build_default_corpus(prefix, tokenizer, max_bytes=2 * LIMIT)
    assert IndexedDataset(prefix).num_documents == len(expected_files(2 * LIMIT))
    # Without its stamp (an interrupted build) the pair is not trusted and is rewritten.
    os.remove(f"{prefix}.json")
    with open(f"{prefix}.bin", "r+b") as stream:
        stream.truncate(10)
    build_default_corpus(prefix, tokenizer, max_bytes=2 * LIMIT)
    assert bytes(IndexedDataset(prefix)[0][:-1].tolist()) == stdlib_source_files()[0].read_bytes()
