"""Which sample indices each data-parallel rank reads, resumable from a consumed-sample count.

Samples are taken in order in global chunks of `micro_batch_size · dp` indices;
rank r reads the r-th `micro_batch_size` slice of each chunk. Resuming from
`consumed_samples` (a multiple of the chunk size after whole steps) continues the
exact sequence an uninterrupted run would have read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class MegatronPretrainingSampler:
    """Batch sampler yielding this rank's micro-batches of sample indices.

    Args:
        total_samples: samples in the dataset (indices run over [0, total_samples)).
        consumed_samples: samples all ranks together already consumed; iteration
            starts there.
        micro_batch_size: samples per rank per micro-batch.
        data_parallel_rank: this rank's index in the data-parallel group.
        data_parallel_size: ranks in the data-parallel group.
        drop_last: drop a final chunk smaller than `micro_batch_size · dp` (otherwise
            each rank gets its slice of it, possibly short or empty).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"no samples to draw: total_samples={total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed_samples={consumed_samples} must be in [0, total_samples={total_samples})"
            )
        if micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(
                f"micro_batch_size={micro_batch_size} and data_parallel_size="
                f"{data_parallel_size} must be positive"
            )
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank={data_parallel_rank} must be in [0, {data_parallel_size})"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        """Micro-batches this rank will yield."""
        chunk = self.micro_batch_size * self.data_parallel_size
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, chunk)
        return full + int(rest > 0 and not self.drop_last)

    def __iter__(self) -> Iterator[list[int]]:
        chunk = self.micro_batch_size * self.data_parallel_size
        begin = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples, chunk):
            stop = min(start + chunk, self.total_samples)
            if stop - start < chunk and self.drop_last:
                return
            yield list(range(start + begin, min(start + begin + self.micro_batch_size, stop)))


def build_pretraining_data_loader(
    dataset: Any,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
) -> Any:
    """A torch DataLoader over `dataset` driven by MegatronPretrainingSampler.

    Batches are `{"tokens": int64 [micro_batch_size, sequence_length + 1]}` for a
    GPT dataset; returns None when `dataset` is None (a split with no documents).
    """
    if dataset is None:
        return None
    import torch.utils.data  # local: the rest of megapp.data works without torch

    sampler = MegatronPretrainingSampler(
        len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
    )
