"""tools/data/merge_datasets.py and IndexedDatasetBuilder.add_index, against megatron-core's."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megapp.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "data" / "merge_datasets.py"


def write_pair(prefix, documents, dtype=np.uint16):
    """`documents`: lists of sequences; a document may hold none."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for sequences in documents:
        builder.add_document([t for s in sequences for t in s], [len(s) for s in sequences])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


SHARDS = {
    "shard_b": [[[5, 6], [7]], [], [[8, 9, 10]]],
    "shard_a": [[[1, 2, 3]], [[4]]],
    "shard_c": [[], [[11], [], [12, 13]]],
}


def run_tool(*args):
    return subprocess.run(
        [sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=60
    )


def test_merge_equals_megatron_core_add_index(tmp_path):
    mc_indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    shards = tmp_path / "shards"
    shards.mkdir()
    for name, documents in SHARDS.items():
        write_pair(shards / name, documents)
    result = run_tool("--input", shards, "--output-prefix", tmp_path / "merged")
    assert result.returncode == 0, result.stderr
    assert "3 pairs, 7 documents, 8 sequences" in result.stderr
    reference = mc_indexed.IndexedDatasetBuilder(str(tmp_path / "reference.bin"), np.uint16)
    for name in sorted(SHARDS):  # a directory's pairs are taken in name order
        reference.add_index(str(shards / name))
    reference.finalize(str(tmp_path / "reference.idx"))
    for suffix in (".bin", ".idx"):
        ours = (tmp_path / f"merged{suffix}").read_bytes()
        assert ours == (tmp_path / f"reference{suffix}").read_bytes(), suffix
    merged = IndexedDataset(str(tmp_path / "merged"))
    documents = [d for name in sorted(SHARDS) for d in SHARDS[name]]
    assert [merged.document(k).tolist() for k in range(merged.num_documents)] == [
        [t for s in d for t in s] for d in documents
    ]


def test_prefixes_in_the_given_order_and_builder_use(tmp_path):
    a = write_pair(tmp_path / "a", SHARDS["shard_a"])
    c = write_pair(tmp_path / "c", SHARDS["shard_c"])
    result = run_tool("--input", c, a, "--output-prefix", tmp_path / "out" / "ca")
    assert result.returncode == 0, result.stderr
    merged = IndexedDataset(str(tmp_path / "out" / "ca"))
    assert merged.document_indices.tolist() == [0, 0, 3, 4, 5]
    # The builder can add whole documents around a merged pair.
    builder = IndexedDatasetBuilder(str(tmp_path / "mixed.bin"), np.uint16)
    builder.add_document(torch.tensor([99]))
    builder.add_index(a)
    builder.add_item([100])
    with pytest.raises(ValueError, match="close the open document first"):
        builder.add_index(a)
    builder.finalize(str(tmp_path / "mixed.idx"))
    mixed = IndexedDataset(str(tmp_path / "mixed"))
    assert [mixed.document(k).tolist() for k in range(4)] == [[99], [1, 2, 3], [4], [100]]


def test_bad_inputs_end_with_one_line_and_no_output(tmp_path):
    a = write_pair(tmp_path / "a", SHARDS["shard_a"])
    wide = write_pair(tmp_path / "wide", SHARDS["shard_b"], dtype=np.int32)
    out = tmp_path / "o"
    cases = [
        ((a, wide), "holds int32 tokens, this dataset uint16"),
        ((a, tmp_path / "missing"), "indexed dataset file not found"),
        ((tmp_path / "empty_dir",), "no .idx files in this directory"),
        ((a, out), "is also an input"),
    ]
    (tmp_path / "empty_dir").mkdir()
    for inputs, message in cases:
        result = run_tool("--input", *inputs, "--output-prefix", out)
        assert result.returncode == 1, inputs
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
        assert not Path(f"{out}.bin").exists() and not Path(f"{out}.idx").exists()
