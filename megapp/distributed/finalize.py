"""The one post-backward step: make every rank's gradients final."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megapp import comm
from megapp.comm import Group
from megapp.distributed.ddp import DistributedDataParallel
from megapp.param_attributes import is_sequence_parallel, is_tied_embedding


def _all_reduce_coalesced(grads: list[torch.Tensor], group: Group) -> None:
    if not grads or comm.world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group)
    torch._foreach_copy_(
        grads,
        [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)],
    )


def finalize_model_grads(
    chunks: Sequence[DistributedDataParallel],
    *,
    tp_group: Group = None,
    embedding_group: Group = None,
) -> None:
    """After the last backward of an iteration:

    1. wait for the data-parallel reduction of every regular bucket;
    2. sum the gradients of sequence-parallel replicated parameters (norm weights,
       row-parallel biases) over the tensor-parallel group, each rank having seen
       only its part of the sequence;
    3. sum the tied word-embedding gradient over the embedding group (first and
       last pipeline stage), so both copies take the same step; when both stages
       live on this rank (a V-shaped placement) the two copies are summed here;
    4. reduce the late buckets holding those parameters over data-parallel ranks.
    """
    for chunk in chunks:
        chunk.finish_grad_sync()
    params = [p for chunk in chunks for p in chunk.buffer.params]
    sequence_parallel = [p.main_grad for p in params if is_sequence_parallel(p)]
    if sequence_parallel and tp_group is None:
        raise ValueError(
            "the model is sequence parallel but no tp_group was given: its norm and bias "
            "gradients would miss the other tensor-parallel ranks' tokens"
        )
    _all_reduce_coalesced(sequence_parallel, tp_group)
    embedding = [p.main_grad for p in params if is_tied_embedding(p)]
    if len(embedding) > 2:
        raise ValueError("a rank holds the tied embedding at most twice (first and last stage)")
    if len(embedding) == 2:  # a V-shaped placement: first and last stage on this rank
        embedding[0].add_(embedding[1])
        embedding[1].copy_(embedding[0])
        embedding = []
    if embedding and embedding_group is None:
        raise ValueError(
            "the word embedding is tied across pipeline stages but no embedding_group was "
            "given: its two copies would take different steps"
        )
    _all_reduce_coalesced(embedding, embedding_group)
    for chunk in chunks:
        chunk.sync_late_grads()
