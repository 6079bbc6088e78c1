"""Train/valid/test splits over sequences, weighted blending of datasets, and datasets too
small for their split."""

import math

import numpy as np
import pytest

from megapp.data.blended_dataset import BlendedDataset, build_blending_indices
from megapp.data.builder import build_train_valid_test_datasets, parse_data_path, parse_split
from megapp.data.indexed_dataset import IndexedDatasetBuilder
from megapp.data.split_rules import (
    blend_shares,
    blend_sizes,
    core_sequence_ranges,
    legacy_sequence_ranges,
    split_sequence_ranges,
)


def write_numbered(prefix, lengths, start):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for n in lengths:
        builder.add_document(np.arange(start, start + n))
        start += n
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_parse_split_normalizes_and_pads():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98,2") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    for bad in ("", "a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match="split"):
            parse_split(bad)


def test_core_split_rounds_the_cumulative_bookends():
    assert core_sequence_ranges(parse_split("969,30,1"), 1000) == [
        (0, 969),
        (969, 999),
        (999, 1000),
    ]
    # Bookends 0, 1/3, 2/3, 1 of 10 round to 0, 3, 7, 10.
    assert core_sequence_ranges(parse_split("1,1,1"), 10) == [(0, 3), (3, 7), (7, 10)]
    assert core_sequence_ranges(parse_split("1,1,1"), 301) == [(0, 100), (100, 201), (201, 301)]
    assert core_sequence_ranges(parse_split("98,2"), 7) == [(0, 7), (7, 7), None]


def test_legacy_split_rounds_each_share_then_shifts():
    assert legacy_sequence_ranges(parse_split("969,30,1"), 1000) == [
        (0, 969),
        (969, 999),
        (999, 1000),
    ]
    # Each share rounds down to 3 of 10; the missing sequence shifts every boundary by one.
    assert legacy_sequence_ranges(parse_split("1,1,1"), 10) == [(0, 4), (4, 7), (7, 10)]
    assert legacy_sequence_ranges(parse_split("1,1,1"), 301) == [(0, 101), (101, 201), (201, 301)]
    assert legacy_sequence_ranges(parse_split("969,30,1"), 7) == [(0, 7), (7, 7), (7, 7)]


def test_both_rules_split_sequences_not_documents():
    # Documents of 2, 3 and 5 sequences (boundaries 0, 2, 5, 10): both rules cut inside them.
    fractions = parse_split("1,1,1")
    assert split_sequence_ranges(fractions, 10, "core") == [(0, 3), (3, 7), (7, 10)]
    assert split_sequence_ranges(fractions, 10, "legacy") == [(0, 4), (4, 7), (7, 10)]
    assert split_sequence_ranges(parse_split("1,1"), 10, "legacy") == [(0, 5), (5, 10), None]
    with pytest.raises(ValueError, match="data rules 'newest' unknown"):
        split_sequence_ranges(fractions, 10, "newest")


def test_blend_sizes_core_and_legacy():
    # A 30/70 blend of 33 samples: core asks 10 -> 11 and 24 -> 25 and has 10 + 24 = 34.
    assert blend_sizes([30, 70], 33) == ([11, 25], 34)
    # Legacy asks ceil(33 · 0.3 · 1.005) = 10 and ceil(33 · 0.7 · 1.005) = 24, and holds both.
    assert blend_sizes([30, 70], 33, "legacy") == ([10, 24], 34)
    assert blend_sizes([3, 1], 1000, "legacy") == ([754, 252], 1006)
    # 0.6 + 0.3 + 0.1 is 0.9999999999999999: normalised once, 5 · 0.6000000000000001 > 3.
    assert blend_shares([0.6, 0.3, 0.1]) == [
        0.6000000000000001,
        0.30000000000000004,
        0.10000000000000002,
    ]
    assert blend_sizes([0.6, 0.3, 0.1], 5) == ([5, 3, 2], 7)
    assert blend_sizes([0.6, 0.3, 0.1], 5, "legacy") == ([4, 2, 1], 7)


@pytest.mark.parametrize("seed", range(4))
def test_legacy_blend_holds_the_sum_of_its_requests(seed):
    rng = np.random.default_rng(seed)
    weights = np.round(rng.uniform(0.05, 1.0, 2 + seed % 3), 2).tolist()
    total = 0.0
    for w in weights:  # legacy Megatron-LM sums the weights left to right
        total += w
    for n in [1, 2, 7, 99, 1000, 1999]:
        asked = [math.ceil(n * (w / total) * 1.005) for w in weights]
        assert blend_sizes(weights, n, "legacy") == (asked, sum(asked)), (weights, n)


def test_legacy_normalises_left_to_right():
    # numpy sums eight or more weights pairwise; legacy Megatron-LM left to right.
    weights = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    total = 0.0
    for w in weights:
        total += w
    assert total != float(np.sum(weights))
    assert blend_shares(weights, "legacy") == [w / total for w in weights]
    assert blend_shares(weights, "core") == (np.asarray(weights) / np.sum(weights)).tolist()


def test_blending_order_by_hand():
    dataset_index, sample_index = build_blending_indices([0.5, 0.3, 0.2], 10)
    assert dataset_index.tolist() == [0, 1, 2, 0, 1, 0, 2, 0, 1, 0]
    assert sample_index.tolist() == [0, 0, 0, 1, 1, 2, 1, 3, 2, 4]
    assert dataset_index.dtype == np.int16 and sample_index.dtype == np.int64


@pytest.mark.parametrize("weights", [[0.2, 0.8], [1, 1, 1], [0.5, 0.3, 0.15, 0.05]])
def test_every_prefix_of_the_blend_follows_the_weights(weights):
    size = 3000
    shares = np.asarray(weights) / np.sum(weights)
    dataset_index, sample_index = build_blending_indices(shares, size)
    taken = np.zeros((size + 1, len(weights)))
    taken[1:] = np.cumsum(np.eye(len(weights))[dataset_index], axis=0)
    drift = np.abs(taken - np.outer(np.arange(size + 1), shares))
    assert drift.max() <= 1.0
    # Each dataset's samples are taken in order 0, 1, 2, ...
    for d in range(len(weights)):
        picked = sample_index[dataset_index == d]
        assert picked.tolist() == list(range(len(picked)))


def test_blended_dataset_serves_member_samples_and_checks_sizes():
    a, b = [f"a{i}" for i in range(10)], [f"b{i}" for i in range(10)]
    blend = BlendedDataset([a, b], [3, 1], 8)
    assert [blend[i] for i in range(8)] == ["a0", "b0", "a1", "a2", "a3", "b1", "a4", "a5"]
    with pytest.raises(IndexError):
        blend[8]
    with pytest.raises(ValueError, match="takes 15 samples from dataset 0, which has 10"):
        BlendedDataset([a, b], [3, 1], 20)


def test_parse_data_path():
    assert parse_data_path("corpus") == (["corpus"], None)
    assert parse_data_path(["30", "a", "70", "b"]) == (["a", "b"], [30.0, 70.0])
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        parse_data_path(["30", "a", "b"])
    with pytest.raises(ValueError, match="weights must be numbers"):
        parse_data_path(["a", "30", "b", "70"])
    with pytest.raises(ValueError, match="weights must be positive"):
        parse_data_path(["0", "a", "1", "b"])


def test_a_split_without_sequences_is_absent_even_when_samples_are_asked(tmp_path):
    # 80 sequences at 969,30,1: the test bookends round to [80, 80). megatron-core builds
    # an empty dataset there and loops forever looking for its samples; megapp has none.
    prefix = write_numbered(tmp_path / "d", [6] * 80, start=0)
    train, valid, test = build_train_valid_test_datasets(prefix, "969,30,1", [50, 8, 1], 4)
    assert test is None and len(valid) >= 8 and len(train) >= 50
    # A split of only empty sequences cannot give samples either: one clear error.
    empty_tail = write_numbered(tmp_path / "e", [6] * 8 + [0] * 2, start=0)
    with pytest.raises(ValueError, match="cannot draw 3 samples from a split with no tokens"):
        build_train_valid_test_datasets(empty_tail, "8,2", [10, 3, 0], 4, cache=False)


def test_splits_of_one_dataset_hold_disjoint_documents(tmp_path):
    prefix = write_numbered(tmp_path / "d", [5] * 100, start=0)
    train, valid, test = build_train_valid_test_datasets(
        prefix, "80,15,5", [None, None, None], 4, cache=False
    )
    documents = [set(d.document_index.tolist()) for d in (train, valid, test)]
    assert documents == [set(range(80)), set(range(80, 95)), set(range(95, 100))]
    none_for_test = build_train_valid_test_datasets(prefix, "90,10,0", [50, 5, 0], 4, cache=False)
    assert none_for_test[2] is None
    assert len(none_for_test[0]) >= 50


def test_blend_of_two_datasets_follows_the_weights(tmp_path):
    low = write_numbered(tmp_path / "low", [8] * 40, start=0)
    high = write_numbered(tmp_path / "high", [8] * 40, start=10_000)
    train, valid, _ = build_train_valid_test_datasets(
        ["0.25", low, "0.75", high], "9,1,0", [400, 40, 0], 4, cache_dir=str(tmp_path / "c")
    )
    assert isinstance(train, BlendedDataset) and len(train) == 400
    from_high = sum(int(train[i]["tokens"][0] >= 10_000) for i in range(len(train)))
    assert from_high == 300
    assert len(valid) == 40
    again = build_train_valid_test_datasets(
        ["0.25", low, "0.75", high], "9,1,0", [400, 40, 0], 4, cache_dir=str(tmp_path / "c")
    )
    assert not again[0].built_anew
    with pytest.raises(ValueError, match="needs a sample count for every split"):
        build_train_valid_test_datasets(["1", low, "1", high], "9,1,0", [None, 4, 0], 4)


def test_a_dataset_too_small_to_train_on_is_one_clear_error(tmp_path):
    # One sequence in thirds: the bookends round to train [0, 0), valid [0, 1), test [1, 1).
    prefix = write_numbered(tmp_path / "one", [40], start=0)
    message = (
        rf"^the train split gets no sequences: the 1 sequence of {prefix} split '1,1,1' as "
        r"train 0, valid 1, test 0; give more data or a larger train share of the split$"
    )
    with pytest.raises(ValueError, match=message):
        build_train_valid_test_datasets(prefix, "1,1,1", [10, 2, 2], 4, cache=False)
    # In a blend, one member too small is enough.
    big = write_numbered(tmp_path / "big", [8] * 30, start=100)
    with pytest.raises(ValueError, match=rf"train split gets no sequences: .* of {prefix} split"):
        build_train_valid_test_datasets(["1", big, "1", prefix], "1,1,1", [10, 2, 2], 4)
    # Nothing asked of the train split (evaluation only, or one epoch): no error.
    assert build_train_valid_test_datasets(prefix, "1,1,1", [0, 2, 2], 4, cache=False)[0] is None
    one_epoch = build_train_valid_test_datasets(prefix, "1,1,1", [None] * 3, 4, cache=False)
    assert one_epoch[0] is None and len(one_epoch[1]) == 9


def test_empty_evaluation_splits_are_reported_once_each(tmp_path):
    # Five sequences at 969,30,1: the valid and test bookends round to [5, 5).
    prefix = write_numbered(tmp_path / "five", [8] * 5, start=0)
    lines = []
    train, valid, test = build_train_valid_test_datasets(
        prefix, "969,30,1", [20, 4, 4], 4, cache=False, warn=lines.append
    )
    assert len(train) >= 20 and valid is None and test is None
    sizes = f"the 5 sequences of {prefix} split '969,30,1' as train 5, valid 0, test 0"
    assert lines == [
        f"warning: no valid data: {sizes}; evaluation on valid data is skipped",
        f"warning: no test data: {sizes}; evaluation on test data is skipped",
    ]
    # A split asked for nothing, or present, is not reported.
    lines.clear()
    build_train_valid_test_datasets(prefix, "3,2,0", [20, 4, 4], 4, cache=False, warn=lines.append)
    assert lines == [
        f"warning: no test data: the 5 sequences of {prefix} split '3,2,0' as train 3, "
        "valid 2, test 0; evaluation on test data is skipped"
    ]
    lines.clear()
    build_train_valid_test_datasets(
        prefix, "969,30,1", [20, 0, 0], 4, cache=False, warn=lines.append
    )
    assert lines == []
