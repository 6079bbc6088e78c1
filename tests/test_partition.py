"""Splitting layers into pipeline stages: every layer exactly once, balanced as asked."""

import itertools

import pytest
import torch
from torch import nn

from megapp.pipeline_parallel.partition import (
    check_layer_split,
    measured_times,
    parameter_counts,
    rank_chunks,
    rank_layer_counts,
    split_layers,
    stage_layer_ranges,
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


UNEVEN = [  # (num_layers, pp, vpp, first, last)
    (8, 4, None, 1, 3),
    (9, 4, None, None, 3),
    (10, 2, None, 4, 6),
    (12, 2, 2, 4, None),
    (16, 4, 2, 2, 2),
    (14, 4, 2, None, 2),
    (24, 3, 3, 3, 6),
]


def megatron_chunks(num_layers: int, pp: int, vpp: int | None, **split) -> dict:
    """Megatron-Core's own split: ``{(rank, chunk): (offset, count)}`` of every chunk for a
    TransformerConfig with ``split`` (its uneven-stage or embedding/loss fields); an empty
    chunk's offset is None (Megatron's is where it would start)."""
    config_module = pytest.importorskip("megatron.core.transformer.transformer_config")
    block = pytest.importorskip("megatron.core.transformer.transformer_block")
    layer = pytest.importorskip("megatron.core.transformer.transformer_layer")
    config = config_module.TransformerConfig(
        num_layers=num_layers,
        hidden_size=8,
        num_attention_heads=2,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        **split,
    )
    out = {}
    for rank, chunk in itertools.product(range(pp), range(vpp or 1)):
        vp_stage = chunk if vpp else None
        count = block.get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=rank)
        offset = layer.get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=rank)
        out[rank, chunk] = (offset if count else None, count)
    return out


@pytest.mark.parametrize("num_layers, pp, vpp, first, last", UNEVEN)
@pytest.mark.filterwarnings("ignore:full scope is deprecated")  # Megatron-Core's own default
def test_uneven_first_and_last_stages_split_as_megatron_core_does(num_layers, pp, vpp, first, last):
    """Every chunk's layers (offset and count) equal Megatron-Core's own for the same
    num_layers_in_first/last_pipeline_stage, with and without virtual stages."""
    theirs = megatron_chunks(
        num_layers,
        pp,
        vpp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
    )
    ranges = stage_layer_ranges(num_layers, pp, vpp, first=first, last=last)
    assert _covers(ranges, num_layers)
    for (rank, chunk), (offset, count) in theirs.items():
        assert ranges[chunk * pp + rank] == range(offset, offset + count), (rank, chunk)
    counts = rank_layer_counts(num_layers, pp, vpp, first=first, last=last)
    assert counts == [sum(len(r) for r in rank_chunks(ranges, pp, rank)) for rank in range(pp)]


def test_uneven_stages_follow_the_ranks_of_any_placement():
    """A V puts virtual stages 0 and 2p - 1 on rank 0: both hold half the first rank's
    count."""
    v = ((0, 3), (1, 2))  # placement[rank][chunk]
    assert _sizes(stage_layer_ranges(12, 2, 2, first=2, placement=v)) == [1, 5, 5, 1]
    assert _sizes(stage_layer_ranges(12, 2, 2, first=2)) == [1, 5, 1, 5]
    assert _sizes(stage_layer_ranges(8, 2, 2)) == [2, 2, 2, 2]


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((8, 4, None), {"first": 0}, "num_layers_in_first_pipeline_stage must be >= 1, got 0"),
        ((8, 2, 2), {"first": 3}, "first_pipeline_stage (3) is not divisible by virtual"),
        ((8, 1, None), {"last": 2}, "needs pipeline_model_parallel_size >= 2, got 1"),
        ((8, 2, None), {"first": 3, "last": 3}, "(3 + 3) must add up to num_layers (8)"),
        ((8, 4, None), {"first": 1, "last": 2}, "leave 5 of num_layers (8) to the other 2"),
        ((8, 4, 2), {"last": 4}, "other 3 pipeline stages (2 chunks each), which must divide"),
        ((8, 4, None), {"first": 8}, "leaves 0 of num_layers (8)"),
        ((8, 3, None), {}, "num_layers (8) is not divisible by pipeline_model_parallel_size"),
    ],
)
def test_impossible_uneven_stages_say_what_to_change(args, kwargs, message):
    with pytest.raises(ValueError) as info:
        stage_layer_ranges(*args, **kwargs)
    assert message in str(info.value)
    with pytest.raises(ValueError):
        check_layer_split(*args, **kwargs)


COUNTED = [  # (num_layers, pp, vpp, embedding, loss)
    (126, 16, 8, True, True),  # Llama 3.1 405B: the first and the last chunk hold no layer
    (94, 8, 4, True, True),  # Qwen3-235B-A22B: 2, then 3 on each of 30, then 2
    (94, 32, 3, True, True),
    (7, 4, None, True, False),
    (7, 2, 2, False, True),
    (6, 2, 2, True, True),
    (5, 1, None, True, True),
]


@pytest.mark.parametrize("num_layers, pp, vpp, embedding, loss", COUNTED)
@pytest.mark.filterwarnings("ignore:full scope is deprecated")  # Megatron-Core's own default
def test_embedding_and_loss_counted_as_layers_split_as_megatron_core_does(
    num_layers, pp, vpp, embedding, loss
):
    """Every chunk's layers (offset and count) equal Megatron-Core's own under
    account_for_embedding/loss_in_pipeline_split, empty chunks included."""
    theirs = megatron_chunks(
        num_layers,
        pp,
        vpp,
        account_for_embedding_in_pipeline_split=embedding,
        account_for_loss_in_pipeline_split=loss,
    )
    ranges = stage_layer_ranges(num_layers, pp, vpp, embedding=embedding, loss=loss)
    assert _covers(ranges, num_layers)
    assert len(ranges) == len(theirs) == pp * (vpp or 1)
    for (rank, chunk), (offset, count) in theirs.items():
        got = ranges[chunk * pp + rank]
        assert len(got) == count and (count == 0 or got.start == offset), (rank, chunk)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((126, 16, 8), {"embedding": True}, "num_layers (126) + embedding = 127 is not divisible"),
        ((94, 8, 5), {"embedding": True, "loss": True}, "leaves 12 per pipeline rank, which is"),
        ((8, 2, None), {"loss": True, "first": 4}, "cannot go with account_for_loss_in_pipeline"),
    ],
)
def test_impossible_counted_splits_say_what_to_change(args, kwargs, message):
    for check in (stage_layer_ranges, check_layer_split):
        with pytest.raises(ValueError) as info:
            check(*args, **kwargs)
        assert message in str(info.value)
