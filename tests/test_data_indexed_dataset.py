"""The .bin/.idx format: round trips, the exact header bytes, and clear errors for bad files."""

import pickle
import struct

import numpy as np
import pytest

from megapp.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    optimal_dtype,
)
from megapp.data.token_check import check_token_ids, token_id_range

DOCUMENTS = [[5, 6, 7], [], [1], [9, 9, 9, 9, 2], []]


def write(prefix, documents, dtype):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for tokens in documents:
        builder.add_document(tokens)
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip_keeps_every_document_including_empty_ones(tmp_path, dtype):
    documents = [*DOCUMENTS, [60000, 0, 65535] if dtype == np.uint16 else [2**31 - 1, 70000]]
    dataset = IndexedDataset(write(tmp_path / "d", documents, dtype))
    assert dataset.dtype == np.dtype(dtype)
    assert len(dataset) == dataset.num_documents == len(documents)
    assert dataset.sequence_lengths.tolist() == [len(d) for d in documents]
    assert dataset.document_indices.tolist() == list(range(len(documents) + 1))
    for i, tokens in enumerate(documents):
        assert dataset[i].dtype == np.dtype(dtype)
        assert dataset[i].tolist() == tokens
        assert dataset.document(i).tolist() == tokens
    assert dataset.get(3, offset=1, length=3).tolist() == [9, 9, 9]
    assert dataset.get(3, offset=2).tolist() == [9, 9, 2]
    # the .bin holds the tokens alone, in order, as Megatron reads them
    tokens = np.fromfile(tmp_path / "d.bin", dtype=dtype)
    assert tokens.tolist() == [t for document in documents for t in document]


def test_documents_of_several_sequences(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "s.bin"), np.uint16)
    builder.add_item([1, 2])
    builder.add_item([3])
    builder.end_document()
    builder.add_document([4, 5, 6], lengths=[1, 2])
    builder.end_document()  # a document with no sequences at all
    builder.finalize(str(tmp_path / "s.idx"))
    dataset = IndexedDataset(str(tmp_path / "s"))
    assert len(dataset) == 4
    assert dataset.document_indices.tolist() == [0, 2, 4, 4]
    assert [dataset[i].tolist() for i in range(4)] == [[1, 2], [3], [4], [5, 6]]
    assert dataset.document(1).tolist() == [4, 5, 6]
    assert dataset.document(2).tolist() == []


def test_all_empty_dataset_has_an_empty_bin_and_still_opens(tmp_path):
    dataset = IndexedDataset(write(tmp_path / "e", [[], []], np.uint16))
    assert (tmp_path / "e.bin").read_bytes() == b""  # no tokens
    assert [dataset[0].tolist(), dataset[1].tolist()] == [[], []]


def test_header_bytes_follow_the_documented_layout(tmp_path):
    write(tmp_path / "h", [[1, 2, 3], [], [4]], np.uint16)
    raw = (tmp_path / "h.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)
    assert raw[17] == 8  # uint16's code
    n, d = struct.unpack("<QQ", raw[18:34])
    assert (n, d) == (3, 4)  # d counts document_indices entries: documents + 1
    assert np.frombuffer(raw, np.int32, n, 34).tolist() == [3, 0, 1]
    assert np.frombuffer(raw, np.int64, n, 34 + 4 * n).tolist() == [0, 6, 6]  # byte offsets
    assert np.frombuffer(raw, np.int64, d, 34 + 12 * n).tolist() == [0, 1, 2, 3]
    assert len(raw) == 34 + 12 * n + 8 * d


def test_dtype_codes_are_megatrons():
    names = {code: np.dtype(t).name for code, t in DTYPE_CODES.items()}
    assert names == {
        1: "uint8",
        2: "int8",
        3: "int16",
        4: "int32",
        5: "int64",
        6: "float64",
        7: "float32",
        8: "uint16",
    }


def test_optimal_dtype_switches_to_int32_for_large_vocabularies():
    assert optimal_dtype(257) == np.uint16
    assert optimal_dtype(50257) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(128256) == np.int32


def test_token_outside_the_dtype_is_refused(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16)
    with pytest.raises(ValueError, match=r"\[0, 70000\], outside uint16"):
        builder.add_document([0, 70000])


def _corrupt(tmp_path, edit):
    prefix = write(tmp_path / "c", DOCUMENTS, np.uint16)
    path = tmp_path / "c.idx"
    path.write_bytes(edit(bytearray(path.read_bytes())))
    return prefix


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda b: b"NOTMMIDX\x00" + b[9:], "not an MMIDIDX index"),
        (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "index version 2"),
        (lambda b: b[:17] + bytes([42]) + b[18:], "unknown dtype code 42"),
        (lambda b: b[:20], "truncated index, 20 bytes"),
        (lambda b: b[:-8], "which need 142 bytes, but the file has 134"),
        (lambda b: b + b"\x00" * 8, "but the file has 150"),
        (lambda b: b[:-8] + struct.pack("<q", 3), "document indices must rise from 0"),
    ],
)
def test_corrupt_index_names_the_file_and_the_fault(tmp_path, edit, message):
    prefix = _corrupt(tmp_path, edit)
    with pytest.raises(ValueError, match=message) as error:
        IndexedDataset(prefix)
    assert str(tmp_path / "c.idx") in str(error.value)


def test_data_file_shorter_than_the_index_says(tmp_path):
    prefix = write(tmp_path / "b", DOCUMENTS, np.uint16)
    (tmp_path / "b.bin").write_bytes((tmp_path / "b.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"b\.bin: index expects 18 bytes of tokens, file has 16"):
        IndexedDataset(prefix)


def test_missing_file_names_the_path(tmp_path):
    prefix = write(tmp_path / "m", DOCUMENTS, np.uint16)
    (tmp_path / "m.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"m\.bin"):
        IndexedDataset(prefix)
    with pytest.raises(FileNotFoundError, match=r"nowhere\.idx"):
        IndexedDataset(str(tmp_path / "nowhere"))
    assert not IndexedDataset.exists(prefix)


def test_out_of_range_reads_raise(tmp_path):
    dataset = IndexedDataset(write(tmp_path / "r", DOCUMENTS, np.uint16))
    with pytest.raises(IndexError):
        dataset[5]
    with pytest.raises(IndexError, match=r"tokens \[2, 4\) outside sequence 0 of 3"):
        dataset.get(0, offset=2, length=2)


def test_pickled_dataset_reopens_by_path(tmp_path):
    dataset = IndexedDataset(write(tmp_path / "p", DOCUMENTS, np.int32))
    payload = pickle.dumps(dataset)
    assert len(payload) < 500  # the maps are not copied into the pickle
    copy = pickle.loads(payload)
    assert [copy[i].tolist() for i in range(len(copy))] == DOCUMENTS


def test_token_id_range_is_scanned_in_chunks_and_cached(tmp_path):
    prefix = str(tmp_path / "ids")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in range(30):
        builder.add_document(np.arange(doc, doc + 7) * (-1 if doc == 29 else 1))
    builder.finalize(prefix + ".idx")
    assert IndexedDataset(prefix).token_id_range(chunk=5) == (-35, 34)
    cache = tmp_path / "cache"
    assert token_id_range(prefix, str(cache)) == (-35, 34)
    cached = list(cache.glob("ids_ids_*_range.npy"))
    assert len(cached) == 1
    np.save(cached[0], np.array([3, 4]))  # the next call reads the cache, not the data
    assert token_id_range(prefix, str(cache)) == (3, 4)
    with pytest.raises(ValueError, match=r"ids.bin: its smallest token id is -35, outside"):
        check_token_ids([prefix], 36)


def test_check_token_ids_names_the_file_the_id_and_the_vocabulary(tmp_path):
    prefix = str(tmp_path / "other")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_document(np.array([1, 2, 50256, 3]))
    builder.add_document(np.array([], dtype=np.uint16))
    builder.finalize(prefix + ".idx")
    check_token_ids([prefix], 50257)  # fits GPT-2's vocabulary
    with pytest.raises(
        ValueError,
        match=r"other.bin: its largest token id is 50256, outside the tokenizer's vocabulary "
        r"of 257",
    ):
        check_token_ids([prefix], 257)
