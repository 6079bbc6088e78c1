"""The pretraining sampler: data-parallel partition of every global batch, exact resumption."""

import numpy as np
import pytest
import torch

from megapp.data.gpt_dataset import GPTDataset
from megapp.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megapp.training.data_iterators import (
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)


def batches(total, consumed, micro, rank, size, drop_last=True):
    return list(MegatronPretrainingSampler(total, consumed, micro, rank, size, drop_last))


def test_ranks_partition_each_global_batch_in_order():
    micro, dp = 3, 4
    per_rank = [batches(50, 0, micro, r, dp) for r in range(dp)]
    assert all(len(b) == 50 // (micro * dp) for b in per_rank)
    for step in range(len(per_rank[0])):
        global_batch = [i for r in range(dp) for i in per_rank[r][step]]
        assert global_batch == list(range(step * 12, step * 12 + 12))
    assert per_rank[1][0] == [3, 4, 5]


def test_resuming_gives_the_tail_of_the_full_sequence():
    for rank in range(2):
        full = batches(40, 0, 2, rank, 2)
        for steps_done in range(len(full)):
            resumed = batches(40, steps_done * 4, 2, rank, 2)
            assert resumed == full[steps_done:]


def test_length_and_the_final_partial_batch():
    sampler = MegatronPretrainingSampler(10, 0, 2, 1, 2)
    assert len(sampler) == len(list(sampler)) == 2
    kept = batches(10, 0, 2, 0, 2, drop_last=False)
    assert kept[-1] == [8, 9]
    assert batches(10, 0, 2, 1, 2, drop_last=False)[-1] == []
    assert len(MegatronPretrainingSampler(10, 0, 2, 0, 2, drop_last=False)) == 3


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 0, 1, 0, 1), "no samples"),
        ((10, 10, 1, 0, 1), "consumed_samples=10"),
        ((10, 0, 0, 0, 1), "micro_batch_size=0"),
        ((10, 0, 1, 2, 2), "data_parallel_rank=2"),
    ],
)
def test_invalid_arguments_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        MegatronPretrainingSampler(*args)


def test_data_loader_yields_micro_batches_of_token_windows(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    for start in range(0, 400, 40):
        builder.add_document(np.arange(start, start + 40))
    builder.finalize(str(tmp_path / "d.idx"))
    dataset = GPTDataset(IndexedDataset(str(tmp_path / "d")), 24, 8, cache=False)
    loader = build_pretraining_data_loader(dataset, 4, 2, 1, 2)
    first = next(iter(loader))
    assert first["tokens"].dtype == torch.int64
    assert first["tokens"].shape == (2, 9)
    # Consumed 4 samples: rank 1 reads samples 6 and 7 of the dataset.
    expected = np.stack([dataset[6]["tokens"], dataset[7]["tokens"]])
    np.testing.assert_array_equal(first["tokens"].numpy(), expected)
    assert build_pretraining_data_loader(None, 0, 2, 0, 1) is None
