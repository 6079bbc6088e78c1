"""Data for the training loop: datasets built once per job, iterators that resume exactly.

Only the chunks that read a batch get an iterator: the first virtual stage
(tokens) and the last (labels and loss mask). Each reads every microbatch of
its data-parallel slice, starting from the samples already consumed, so a
resumed run reads exactly what the uninterrupted run would have read next.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megapp import comm
from megapp.data.samplers import build_pretraining_data_loader
from megapp.training.arguments import ArgumentsError

T = TypeVar("T")


def rank0_first(build: Callable[[], T]) -> T:
    """Run ``build`` on rank 0, then on the others (which then find rank 0's caches).

    A settings error on rank 0 (ArgumentsError, ValueError, OSError) is raised on
    every rank as an :class:`ArgumentsError` with rank 0's message, so the whole job
    stops with one clear error instead of ranks waiting on each other.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        try:
            return build()
        except (ValueError, OSError) as error:
            raise ArgumentsError(str(error)) from error
    rank = dist.get_rank()
    result, message = None, None
    if rank == 0:
        try:
            result = build()
        except (ValueError, OSError) as error:
            message = str(error)
    message = comm.broadcast_object(message, src=0)
    if message is not None:
        raise ArgumentsError(message)
    if rank != 0:
        try:
            result = build()
        except (ValueError, OSError) as error:  # a node that cannot see rank 0's files
            raise ArgumentsError(f"rank {rank}: {error}") from error
    comm.barrier()
    return result


def _loader_iterator(
    dataset: Any,
    consumed: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int,
    cyclic: bool,
) -> Iterator[Any]:
    """Micro-batches of this data-parallel rank from ``consumed`` samples on; a cyclic
    iterator starts over at sample 0 when the dataset runs out (evaluation data).

    The sampler reads whole chunks of ``micro_batch_size · dp`` samples, so a cyclic
    pass covers the largest multiple of the chunk and ``consumed`` maps into it.
    """
    total = len(dataset)
    if cyclic:
        usable = total // (micro_batch_size * dp_size) * (micro_batch_size * dp_size)
        if usable == 0:
            raise ArgumentsError(
                f"a split of {total} samples holds no micro-batch for every data-parallel "
                f"rank ({micro_batch_size} × {dp_size}); give it more documents (--split)"
            )
        total, consumed = usable, consumed % usable
    start = consumed
    while True:
        if start < total:
            loader = build_pretraining_data_loader(
                dataset, start, micro_batch_size, dp_rank, dp_size, num_workers
            )
            # Starting a DataLoader draws a seed from the global generator; keep that
            # stream for dropout, so its position depends on the iterations alone.
            with torch.random.fork_rng(devices=[]):
                batches = iter(loader)
            yield from batches
        if not cyclic:
            return
        start = 0


def chunk_iterators(
    dataset: Any,
    chunks: Sequence[Any],
    *,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    cyclic: bool = False,
) -> list[Iterator[Any] | None] | None:
    """One iterator per model chunk: for the chunks that read data (the first and last
    virtual stage, ``module.pre_process`` / ``post_process``), None for the others.

    Returns None when ``dataset`` is None (a split without documents).
    """
    if dataset is None:
        return None
    out: list[Iterator[Any] | None] = []
    for chunk in chunks:
        model = getattr(chunk, "module", chunk)
        reads = model.pre_process or model.post_process
        out.append(
            _loader_iterator(
                dataset, consumed_samples, micro_batch_size, dp_rank, dp_size, num_workers, cyclic
            )
            if reads
            else None
        )
    return out
