"""The loop's data: resuming from a consumed-sample count reads exactly what an
uninterrupted run reads next, evaluation data wraps around, only data chunks read, and a
corpus too small for its split is named before training starts."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import pretrain_gpt
from megapp.data import ByteTokenizer, IndexedDatasetBuilder
from megapp.training.arguments import ArgumentsError
from megapp.training.data_iterators import chunk_iterators, rank0_first
from tests.support import args_for

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


def _write_corpus(prefix, documents):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for _ in range(documents):
        builder.add_document(np.arange(1, 41))
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_a_corpus_too_small_for_the_split_says_so(tmp_path, capsys):
    """A train split without sequences stops the job with one line; empty valid and test
    splits, with evaluation on, are one warning line each and training goes on."""
    base = (
        "--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
        "--micro-batch-size 1 --lr 1e-3 --train-iters 4"
    )
    one = _write_corpus(tmp_path / "one", 1)
    config = args_for(f"--data-path {one} --split 1,1,1", 1, base)
    with pytest.raises(ArgumentsError) as error:
        pretrain_gpt.datasets_provider(config, [4, 10, 2], tokenizer=ByteTokenizer())
    assert str(error.value) == (
        f"--data-path: the train split gets no sequences: the 1 sequence of {one} split "
        "'1,1,1' as train 0, valid 1, test 0; give more data or a larger train share of the split"
    )

    five = _write_corpus(tmp_path / "five", 5)
    config = args_for(f"--data-path {five} --split 969,30,1 --eval-iters 2", 1, base)
    train, valid, test = pretrain_gpt.datasets_provider(
        config, [4, 10, 2], tokenizer=ByteTokenizer()
    )
    assert len(train) >= 4 and valid is None and test is None
    sizes = f"the 5 sequences of {five} split '969,30,1' as train 5, valid 0, test 0"
    assert capsys.readouterr().out.splitlines() == [
        f"warning: no valid data: {sizes}; evaluation on valid data is skipped",
        f"warning: no test data: {sizes}; evaluation on test data is skipped",
    ]
    config = args_for(f"--data-path {five} --split 969,30,1 --eval-iters 0", 1, base)
    pretrain_gpt.datasets_provider(config, [4, 10, 2], tokenizer=ByteTokenizer())
    assert capsys.readouterr().out == ""
