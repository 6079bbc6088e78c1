"""Evaluation: forward-only pipeline iterations over held-out batches, no gradients."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from megapp import comm
from megapp.distributed.ddp import DistributedDataParallel
from megapp.parallel_state import TrainGroups
from megapp.pipeline_parallel import forward_backward
from megapp.pipeline_parallel.compute import ForwardStepFunc
from megapp.pipeline_parallel.p2p import TensorSpec
from megapp.pipeline_parallel.schedules import Schedule


def evaluate(
    forward_step_func: ForwardStepFunc,
    data_iterators: Iterator | Sequence[Iterator | None] | None,
    chunks: Sequence[DistributedDataParallel],
    *,
    num_microbatches: int,
    eval_iters: int,
    groups: TrainGroups,
    tensor_shapes: Sequence[TensorSpec] | None = None,
    schedule: str | Schedule | None = None,
) -> float:
    """Mean loss of ``eval_iters`` global batches, identical on every rank.

    Each batch runs the training schedule's forwards only (dropout off); its loss is
    the mean over microbatches and data-parallel replicas, as in training, and the
    result is the mean over the batches. ``tensor_shapes`` as for
    :func:`~megapp.pipeline_parallel.forward_backward` (None: negotiated per message).
    ``schedule``: the training schedule, whose forwards run in its order (default the
    catalog's for the number of chunks).
    """
    if eval_iters < 1:
        raise ValueError(f"eval_iters must be >= 1, got {eval_iters}")
    was_training = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    try:
        total = torch.zeros(1, dtype=torch.float64)
        for _ in range(eval_iters):
            result = forward_backward(
                forward_step_func,
                data_iterators,
                list(chunks),
                num_microbatches,
                schedule=schedule,
                pp_group=groups.pp,
                channels=groups.pp_channels,
                forward_only=True,
                tensor_shapes=tensor_shapes,
            )
            total += result.loss.detach().double().cpu()
    finally:
        for chunk, mode in zip(chunks, was_training, strict=True):
            chunk.train(mode)
    if comm.world_size(groups.dp_cp) > 1:  # each cp rank's loss is cp × its share
        device = result.loss.device
        total = total.to(device)
        comm.all_reduce(total, groups.dp_cp)
        total = total.cpu() / comm.world_size(groups.dp_cp)
    return float(total.item()) / eval_iters
