"""The loop's data iterators: resuming from a consumed-sample count reads exactly what an
uninterrupted run reads next, evaluation data wraps around, only data chunks read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megapp.training.arguments import ArgumentsError
from megapp.training.data_iterators import chunk_iterators, rank0_first

DATASET = [{"tokens": torch.tensor([i])} for i in range(10)]


def _ids(iterator, n):
    return [next(iterator)["tokens"].flatten().tolist() for _ in range(n)]


def _chunk(pre, post):
    return SimpleNamespace(module=SimpleNamespace(pre_process=pre, post_process=post))


@pytest.mark.parametrize("cyclic", [False, True])
def test_resume_continues_the_same_sequence(cyclic):
    """dp rank 1 of 2, micro batch 2: every read consumes 4 samples of the global order;
    evaluation data wraps after the 8 samples that fill whole reads (2 are never read)."""
    common = dict(micro_batch_size=2, dp_rank=1, dp_size=2, cyclic=cyclic)
    (whole,) = chunk_iterators(DATASET, [_chunk(True, True)], consumed_samples=0, **common)
    reads = 6 if cyclic else 2
    expected = _ids(whole, reads)
    assert expected[:2] == [[2, 3], [6, 7]]
    for done in range(reads):
        (resumed,) = chunk_iterators(
            DATASET, [_chunk(True, True)], consumed_samples=4 * done, **common
        )
        assert _ids(resumed, reads - done) == expected[done:]
    if not cyclic:
        with pytest.raises(StopIteration):
            next(whole)


def test_only_the_first_and_last_stage_read():
    chunks = [_chunk(True, False), _chunk(False, False), _chunk(False, True)]
    iterators = chunk_iterators(
        DATASET, chunks, consumed_samples=0, micro_batch_size=1, dp_rank=0, dp_size=1
    )
    assert [it is None for it in iterators] == [False, True, False]
    assert _ids(iterators[0], 2) == _ids(iterators[2], 2) == [[0], [1]]  # the same batches
    assert (
        chunk_iterators(None, chunks, consumed_samples=0, micro_batch_size=1, dp_rank=0, dp_size=1)
        is None
    )


def test_too_small_evaluation_split_and_build_errors_are_clear():
    (it,) = chunk_iterators(
        DATASET[:3],
        [_chunk(True, True)],
        consumed_samples=0,
        micro_batch_size=2,
        dp_rank=0,
        dp_size=2,
        cyclic=True,
    )
    with pytest.raises(ArgumentsError, match=r"split of 3 samples holds no micro-batch"):
        next(it)

    def broken():
        raise ValueError("corpus.idx: truncated index")

    with pytest.raises(ArgumentsError, match=r"corpus\.idx: truncated index"):
        rank0_first(broken)
