"""The three index arrays behind a GPT dataset, as pure functions of lengths, seed and sizes.

A GPT sample is `sequence_length + 1` consecutive tokens of one long stream: the
documents of a split, each epoch in a fresh shuffled order, laid end to end.
Consecutive samples share one token (the last label of sample i is the first input
of sample i+1), so sample i starts at stream position i·sequence_length.

- document index `[epochs · documents] int32`: the order of documents in the stream.
- sample index `[samples + 1, 2] int64`: row i is (position in the document index,
  token offset in that document) of sample i's first token; row i+1 gives its last.
- shuffle index `[samples] uint32|int64`: the order in which samples are served.

The arithmetic and the use of one `numpy.random.RandomState(seed)` (document
shuffle first, then sample shuffle) follow Megatron's GPTDataset, so the same
data, seed and sizes give the same samples in the same order.
"""

from __future__ import annotations

import math

import numpy as np

# Megatron keeps a short last epoch out of the global shuffle when it would give
# fewer than this fraction of an epoch's samples, so it is not spread thin over all.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def num_epochs_needed(tokens_per_epoch: int, num_samples: int | None, sequence_length: int) -> int:
    """Smallest number of epochs whose tokens cover `num_samples` samples (1 when None)."""
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise ValueError(f"cannot draw {num_samples} samples from a split with no tokens")
    requested = num_samples * sequence_length + 1
    return max(1, math.ceil(requested / tokens_per_epoch))


def separate_final_epoch(
    tokens_per_epoch: int, num_epochs: int, num_samples: int | None, sequence_length: int
) -> tuple[bool, int]:
    """Whether the last epoch is shuffled on its own, and the sample count before it."""
    if num_epochs == 1 or num_samples is None:
        return False, 0
    before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // sequence_length
    from_last = num_samples - before_last
    per_epoch = (tokens_per_epoch - 1) // sequence_length
    return from_last < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch), before_last


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_last: bool
) -> np.ndarray:
    """`documents` repeated `num_epochs` times and shuffled; the last epoch apart if asked."""
    if separate_last and num_epochs > 1:
        head = build_document_index(documents, num_epochs - 1, rng, False)
        tail = build_document_index(documents, 1, rng, False)
        return np.concatenate((head, tail))
    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, sequence_length: int
) -> np.ndarray:
    """Rows (document-index position, offset) of every sample boundary, `[samples + 1, 2]`.

    Row k locates stream token k·sequence_length. Megatron walks the documents in a
    loop; a cumulative sum and a binary search give the same rows at numpy speed.
    Empty documents are stepped over (a boundary always lands on a real token).
    """
    # Gather first, widen after: the lengths may be a large memory map.
    lengths = np.asarray(sequence_lengths)[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    if total == 0:
        return np.zeros((1, 2), dtype=np.int64)
    num_samples = (total - 1) // sequence_length
    positions = np.arange(num_samples + 1, dtype=np.int64) * sequence_length
    where = np.searchsorted(ends, positions, side="right")
    sample_index = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sample_index[:, 0] = where
    sample_index[:, 1] = positions - (ends[where] - lengths[where])
    # Megatron's first row is (0, 0) even when the first documents are empty.
    sample_index[0] = 0
    return sample_index


def build_shuffle_index(
    num_samples: int, total_size: int, rng: np.random.RandomState
) -> np.ndarray:
    """A permutation of [0, total_size) shuffling [0, num_samples) and the rest separately."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    head = np.arange(num_samples, dtype=dtype)
    rng.shuffle(head)
    if num_samples == total_size:
        return head
    tail = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate((head, tail))


def build_gpt_indices(
    sequence_lengths: np.ndarray,
    documents: np.ndarray,
    num_samples: int | None,
    sequence_length: int,
    seed: int,
) -> dict[str, np.ndarray]:
    """Document, sample and shuffle index for drawing `num_samples` samples from `documents`.

    Args:
        sequence_lengths: `[sequences]` token count of every sequence in the dataset.
        documents: the sequence ids of this split (each one a unit of the stream).
        num_samples: samples wanted (epochs repeat to reach it); None for one epoch.
        sequence_length: tokens per sample input; a sample holds one more.
        seed: seed of the single RandomState used for both shuffles.

    Returns:
        {"document_index", "sample_index", "shuffle_index"}; the number of samples
        available is `len(shuffle_index)`, which can exceed `num_samples`.
    """
    if sequence_length < 1:
        raise ValueError(f"sequence_length must be positive, got {sequence_length}")
    documents = np.asarray(documents)
    tokens_per_epoch = int(np.asarray(sequence_lengths)[documents].sum(dtype=np.int64))
    if num_samples is None and tokens_per_epoch < sequence_length + 1:
        raise ValueError(
            f"the split has {tokens_per_epoch} tokens, fewer than one sample of "
            f"{sequence_length + 1}"
        )
    epochs = num_epochs_needed(tokens_per_epoch, num_samples, sequence_length)
    separate, before_last = separate_final_epoch(
        tokens_per_epoch, epochs, num_samples, sequence_length
    )
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, epochs, rng, separate)
    sample_index = build_sample_index(sequence_lengths, document_index, sequence_length)
    total = len(sample_index) - 1
    shuffle_index = build_shuffle_index(before_last if separate else total, total, rng)
    return {
        "document_index": document_index,
        "sample_index": sample_index,
        "shuffle_index": shuffle_index,
    }
