"""Splitting layers into pipeline stages: every layer exactly once, balanced as asked."""

import itertools

import pytest
from torch import nn

from megapp.pipeline_parallel.partition import (
    measured_times,
    parameter_counts,
    rank_chunks,
    split_layers,
)


def _sizes(ranges):
    return [len(r) for r in ranges]


def _covers(ranges, n):
    return [i for r in ranges for i in r] == list(range(n))


def test_even_split_and_remainder():
    assert _sizes(split_layers(8, 4)) == [2, 2, 2, 2]
    assert _sizes(split_layers(10, 4)) == [3, 3, 2, 2]
    assert _covers(split_layers(10, 4), 10)


def test_explicit_and_uneven_ends():
    assert _sizes(split_layers(10, 3, sizes=[2, 5, 3])) == [2, 5, 3]
    assert _sizes(split_layers(10, 4, first_stage_layers=1, last_stage_layers=3)) == [1, 3, 3, 3]
    assert _sizes(split_layers(9, 4, last_stage_layers=3)) == [2, 2, 2, 3]
    assert _sizes(split_layers(5, 2, first_stage_layers=2, last_stage_layers=3)) == [2, 3]


def test_weights_balance_the_heaviest_stage():
    weights = [5, 1, 1, 1, 1, 1, 1, 5]
    ranges = split_layers(8, 3, weights=weights)
    assert _covers(ranges, 8)
    heaviest = max(sum(weights[i] for i in r) for r in ranges)
    # brute force over every contiguous split
    best = min(
        max(sum(weights[a:b]) for a, b in itertools.pairwise((0, *cuts, 8)))
        for cuts in itertools.combinations(range(1, 8), 2)
    )
    assert heaviest == best == 6  # [5, 1] [1, 1, 1, 1] [1, 5]


def test_parameter_counts_and_times_feed_the_split():
    layers = [nn.Linear(4, 4), nn.Linear(4, 64), nn.Linear(64, 4), nn.Linear(4, 4)]
    counts = parameter_counts(layers)
    assert counts == [20.0, 320.0, 260.0, 20.0]
    assert _sizes(split_layers(4, 2, weights=counts)) == [2, 2]
    ticks = iter(range(100))
    import torch

    times = measured_times(layers, torch.randn(2, 4), repeats=2, timer=lambda: next(ticks))
    assert times == [1.0] * 4  # the fake timer advances one tick per measurement
    assert all(p.grad is None for layer in layers for p in layer.parameters())


def test_rank_chunks_follow_virtual_stages():
    ranges = split_layers(8, 4)  # 2 ranks × 2 chunks
    assert rank_chunks(ranges, 2, 0) == [range(0, 2), range(4, 6)]
    assert rank_chunks(ranges, 2, 1) == [range(2, 4), range(6, 8)]
    with pytest.raises(ValueError, match="do not divide"):
        rank_chunks(ranges, 3, 0)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((3, 4), {}, "cannot split 3 layers into 4 stages"),
        ((10, 3), {"sizes": [2, 5, 2]}, "summing to 10 layers (sum is 9)"),
        ((10, 3), {"sizes": [0, 5, 5]}, "positive counts"),
        ((10, 4), {"first_stage_layers": 1, "last_stage_layers": 2}, "must split evenly"),
        ((10, 2), {"first_stage_layers": 4, "last_stage_layers": 4}, "must equal num_layers"),
        ((4, 2), {"weights": [1.0, 2.0]}, "got 2 layer weights for 4 layers"),
        ((4, 2), {"sizes": [2, 2], "weights": [1, 1, 1, 1]}, "at most one of"),
        ((0, 2), {}, "need num_layers >= 1"),
    ],
)
def test_impossible_splits_say_what_to_change(args, kwargs, message):
    with pytest.raises(ValueError) as info:
        split_layers(*args, **kwargs)
    assert message in str(info.value)
