"""GPT samples: index arithmetic against Megatron's walk, the token stream, seeds, the cache."""

import os

import numpy as np
import pytest
import torch

from megapp.data.gpt_dataset import GPTDataset
from megapp.data.gpt_indices import build_gpt_indices, build_sample_index, num_epochs_needed
from megapp.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megapp.training.data_iterators import get_batch

LENGTHS = [7, 0, 3, 12, 1, 0, 5, 9, 2, 4, 0, 6]


def write_numbered(prefix, lengths, start=0):
    """Documents of the given lengths holding consecutive ids, so every token is unique."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    documents, next_id = [], start
    for n in lengths:
        documents.append(list(range(next_id, next_id + n)))
        next_id += n
        builder.add_document(documents[-1])
    builder.finalize(f"{prefix}.idx")
    return str(prefix), documents


def megatron_sample_walk(sizes, document_index, seq_length):
    """Megatron's sample-index loop, step by step, as the reference."""
    total = int(sum(sizes[d] for d in document_index))
    num_samples = (total - 1) // seq_length
    rows = [(0, 0)]
    position, offset = 0, 0
    while len(rows) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            length = sizes[document_index[position]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                position, offset = position + 1, 0
        rows.append((position, offset))
    return np.array(rows)


@pytest.mark.parametrize("seq_length", [1, 2, 3, 5, 8, 13])
def test_sample_index_matches_megatrons_walk(seq_length):
    rng = np.random.default_rng(seq_length)
    sizes = rng.integers(0, 6, size=40)
    document_index = rng.permutation(np.tile(np.arange(40), 2)).astype(np.int32)
    ours = build_sample_index(sizes, document_index, seq_length)
    np.testing.assert_array_equal(ours, megatron_sample_walk(sizes, document_index, seq_length))


def test_samples_are_slices_of_the_document_stream(tmp_path):
    prefix, documents = write_numbered(tmp_path / "d", LENGTHS)
    dataset = GPTDataset(IndexedDataset(prefix), 30, 4, seed=3, cache=False)
    stream = np.concatenate([documents[d] for d in dataset.document_index])
    assert len(dataset) >= 30
    for sample in range(len(dataset)):
        expected = stream[sample * 4 : sample * 4 + 5]
        np.testing.assert_array_equal(dataset.sample_tokens(sample), expected)
    first = dataset[0]["tokens"]
    assert first.dtype == np.int64 and first.shape == (5,)
    np.testing.assert_array_equal(first, dataset.sample_tokens(int(dataset.shuffle_index[0])))
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_epochs_repeat_every_document_once_per_epoch(tmp_path):
    prefix, _ = write_numbered(tmp_path / "d", LENGTHS)
    tokens = sum(LENGTHS)  # 49 per epoch
    dataset = GPTDataset(IndexedDataset(prefix), 40, 4, seed=0, cache=False)
    epochs = num_epochs_needed(tokens, 40, 4)
    assert epochs == 4  # 40·4 + 1 = 161 tokens need 4 epochs of 49
    assert len(dataset) == (epochs * tokens - 1) // 4 >= 40
    counts = np.bincount(dataset.document_index, minlength=len(LENGTHS))
    assert counts.tolist() == [epochs] * len(LENGTHS)
    assert sorted(dataset.shuffle_index.tolist()) == list(range(len(dataset)))


def test_short_final_epoch_is_shuffled_apart():
    sizes = np.full(100, 10)
    # 1010 samples of 10 need 11 epochs; the 11th gives only 11 of ~100 samples.
    indices = build_gpt_indices(sizes, np.arange(100), 1010, 10, seed=5)
    last_epoch = indices["document_index"][-100:]
    assert sorted(last_epoch.tolist()) == list(range(100))
    before_last = (10 * 1000 - 1) // 10
    assert sorted(indices["shuffle_index"][:before_last].tolist()) == list(range(before_last))


def test_indices_are_deterministic_per_seed(tmp_path):
    prefix, _ = write_numbered(tmp_path / "d", LENGTHS)
    dataset = IndexedDataset(prefix)
    a = GPTDataset(dataset, 20, 4, seed=7, cache=False)
    b = GPTDataset(dataset, 20, 4, seed=7, cache=False)
    c = GPTDataset(dataset, 20, 4, seed=8, cache=False)
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)
    assert not np.array_equal(a.document_index, c.document_index)
    samples_a = [a[i]["tokens"].tolist() for i in range(len(a))]
    assert samples_a == [b[i]["tokens"].tolist() for i in range(len(b))]
    assert samples_a != [c[i]["tokens"].tolist() for i in range(len(c))]


def test_seed_fixes_the_shuffle_like_megatron():
    # One RandomState: documents shuffled first, then samples.
    sizes = np.array([3, 4, 5, 6])
    indices = build_gpt_indices(sizes, np.arange(4), None, 2, seed=1234)
    rng = np.random.RandomState(1234)
    document_index = np.arange(4, dtype=np.int32)
    rng.shuffle(document_index)
    shuffle_index = np.arange((18 - 1) // 2, dtype=np.uint32)
    rng.shuffle(shuffle_index)
    np.testing.assert_array_equal(indices["document_index"], document_index)
    np.testing.assert_array_equal(indices["shuffle_index"], shuffle_index)
    assert indices["shuffle_index"].dtype == np.uint32


def test_sequence_range_limits_the_split(tmp_path):
    prefix, _ = write_numbered(tmp_path / "d", LENGTHS)
    dataset = GPTDataset(IndexedDataset(prefix), None, 3, sequence_range=(3, 8), cache=False)
    assert sorted(set(dataset.document_index.tolist())) == [3, 4, 5, 6, 7]
    assert len(dataset) == (sum(LENGTHS[3:8]) - 1) // 3


def test_cache_is_reused_and_rebuilt_when_settings_or_data_change(tmp_path):
    prefix, _ = write_numbered(tmp_path / "d", LENGTHS)
    first = GPTDataset(IndexedDataset(prefix), 20, 4, seed=1)
    assert first.built_anew
    assert len(list(tmp_path.glob("d_train_*_sample_index.npy"))) == 1
    again = GPTDataset(IndexedDataset(prefix), 20, 4, seed=1)
    assert not again.built_anew
    np.testing.assert_array_equal(again.shuffle_index, first.shuffle_index)
    assert GPTDataset(IndexedDataset(prefix), 20, 4, seed=2).built_anew
    assert GPTDataset(IndexedDataset(prefix), 20, 5, seed=1).built_anew
    assert GPTDataset(IndexedDataset(prefix), 21, 4, seed=1).built_anew

    # New data under the same name: the old indices must not be reused.
    write_numbered(tmp_path / "d", [*LENGTHS, 8], start=100)
    changed = GPTDataset(IndexedDataset(prefix), 20, 4, seed=1)
    assert changed.built_anew
    assert 12 in changed.document_index.tolist()
    # Same size, only a newer modification time: still rebuilt.
    stat = os.stat(f"{prefix}.idx")
    os.utime(f"{prefix}.idx", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert GPTDataset(IndexedDataset(prefix), 20, 4, seed=1).built_anew


def test_incomplete_cache_entry_is_rebuilt(tmp_path):
    prefix, _ = write_numbered(tmp_path / "d", LENGTHS)
    GPTDataset(IndexedDataset(prefix), 20, 4, seed=1, cache_dir=str(tmp_path / "cache"))
    (marker,) = (tmp_path / "cache").glob("*_description.json")
    marker.unlink()
    rebuilt = GPTDataset(IndexedDataset(prefix), 20, 4, seed=1, cache_dir=str(tmp_path / "cache"))
    assert rebuilt.built_anew


def test_too_little_data_is_reported(tmp_path):
    prefix, _ = write_numbered(tmp_path / "d", [2, 1])
    with pytest.raises(ValueError, match="3 tokens, fewer than one sample of 5"):
        GPTDataset(IndexedDataset(prefix), None, 4, cache=False)


def test_get_batch_shifts_labels_and_masks_after_eod():
    eod = 0
    windows = torch.tensor([[5, 6, 0, 7, 8, 0, 9], [1, 2, 3, 4, 5, 6, 7]])
    batch = get_batch({"tokens": windows}, eod, eod_mask_loss=True, reset_position_ids=True)
    assert batch["tokens"].tolist() == [[5, 6, 0, 7, 8, 0], [1, 2, 3, 4, 5, 6]]
    assert batch["labels"].tolist() == [[6, 0, 7, 8, 0, 9], [2, 3, 4, 5, 6, 7]]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 1, 1, 0], [1] * 6]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]]
    plain = get_batch({"tokens": windows}, eod)
    assert plain["loss_mask"].sum().item() == 12
    assert plain["position_ids"].tolist() == [list(range(6))] * 2
