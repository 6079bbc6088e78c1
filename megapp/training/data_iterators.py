"""Data for the training loop: datasets built once per job, the sampler and per-chunk iterators
that resume exactly, the split of a batch into the model's inputs, and the mean loss over
its kept tokens.

Only the chunks that read a batch get an iterator: the first virtual stage
(tokens) and the last (labels and loss mask). Each reads every microbatch of
its data-parallel slice, starting from the samples already consumed, so a
resumed run reads exactly what the uninterrupted run would have read next.

Samples are taken in order in global chunks of ``micro_batch_size · dp`` indices
(:class:`MegatronPretrainingSampler`); rank r reads the r-th ``micro_batch_size``
slice of each chunk. Resuming from ``consumed_samples`` (a multiple of the chunk
size after whole steps) continues the exact sequence an uninterrupted run would
have read. :func:`get_batch` turns a batch of token windows into tokens, labels,
loss mask and position ids; under context parallelism every cp rank of a data-parallel
rank reads the same samples and keeps its slice of them (:func:`split_batch`), and
:func:`masked_token_mean` is the loss over the kept tokens of whole sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.utils.data

from megapp import comm
from megapp.context_parallel.layout import split as cp_split
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


def get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss mask and position ids for left-to-right training on `data` `[b, s]`.

    Args:
        data: input tokens `[b, s]`.
        eod_token: the end-of-document id.
        eod_mask_loss: zero the loss where the input is EOD, i.e. do not train the
            prediction of a new document's first token from the previous document.
        reset_position_ids: restart positions at 0 after every EOD, so each packed
            document sees the positions it would see alone.

    Returns:
        loss_mask float32 `[b, s]` and position_ids int64 `[b, s]`.
    """
    batch, length = data.shape
    loss_mask = torch.ones(batch, length, dtype=torch.float32, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    positions = torch.arange(length, dtype=torch.long, device=data.device).expand(batch, length)
    if not reset_position_ids:
        return loss_mask, positions.contiguous()
    # A document starts at 0 and after every EOD; each position counts from the
    # latest start at or before it (a running maximum of the start positions).
    starts = torch.zeros_like(positions)
    starts[:, 1:] = torch.where(data[:, :-1] == eod_token, positions[:, 1:], 0)
    latest_start = torch.cummax(starts, dim=1).values
    return loss_mask, positions - latest_start


def get_batch(
    batch: dict[str, Any],
    eod_token: int,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
) -> dict[str, torch.Tensor]:
    """Split collated windows `{"tokens": [b, s + 1]}` into the model's inputs and targets.

    Returns:
        tokens `[b, s]` (positions 0..s-1), labels `[b, s]` (positions 1..s),
        loss_mask float32 `[b, s]`, position_ids int64 `[b, s]`.
    """
    windows = torch.as_tensor(batch["tokens"]).long()
    tokens = windows[:, :-1].contiguous()
    labels = windows[:, 1:].contiguous()
    loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod_token, eod_mask_loss, reset_position_ids
    )
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
    }


def split_batch(batch: dict[str, torch.Tensor], cp_group: comm.Group) -> dict[str, torch.Tensor]:
    """This context-parallel rank's slice of every ``[b, s]`` tensor of a batch (tokens,
    labels, loss mask, position ids: the global positions travel with their tokens,
    :func:`megapp.context_parallel.layout.split`); the batch itself without cp."""
    cp = comm.world_size(cp_group)
    if cp == 1:
        return batch
    rank = comm.rank(cp_group)
    return {name: cp_split(t, cp, rank, dim=1) for name, t in batch.items()}


def masked_token_mean(
    per_token_loss: torch.Tensor, loss_mask: torch.Tensor, cp_group: comm.Group = None
) -> torch.Tensor:
    """The mean of ``per_token_loss`` over the tokens ``loss_mask`` keeps (a scalar, fp32).

    Under context parallelism each rank holds a slice of the tokens: the count of kept
    tokens is summed over the cp group, and each rank returns ``cp × (its tokens' loss
    sum) / (kept tokens of the whole sequence)``. The mean of that over the cp ranks is the
    sequence's mean loss, and the gradient reduction over data × context ranks takes
    exactly that mean (Megatron-Core scales the loss by cp the same way).
    """
    mask = loss_mask.float()
    total = (per_token_loss.float() * mask).sum()
    count = mask.sum().detach()
    cp = comm.world_size(cp_group)
    if cp > 1:
        count = count.clone()
        comm.all_reduce(count, cp_group)
        total = total * cp
    return total / count.clamp(min=1.0)
