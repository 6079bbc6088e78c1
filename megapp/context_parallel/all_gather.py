"""Context parallelism by all-gathering keys and values once per call.

Each cp rank gathers the whole sequence's keys and values (one all-gather of
``[2, b, kv_heads, s/cp, d]`` from every rank, restored to sequence order) and
attends with its own queries. Causal, each of its two query chunks attends only
to the keys up to its own end, with the diagonal block masked: chunk ``c`` of
``n`` tokens sees keys ``0 … (c + 1)·n − 1``, which is the same work on every
rank under the load-balanced layout. The gather is the sequence-parallel mapping
over the cp group, so the backward reduce-scatters dK/dV to their owners.

The attention runs block by block (fused: each chunk's keys before its diagonal, then
the diagonal; materialized: tiles of one chunk's queries against one chunk's keys;
:func:`~megapp.context_parallel.blocks.attend_in_tiles`) and keeps, beside the
gathered keys and values, only q, its output and the log-sum-exp. The gather
cannot overlap the attention it feeds; in exchange it is one collective instead
of ``cp − 1`` point-to-point steps. Tensors as in
:mod:`~megapp.context_parallel.ring`.
"""

from __future__ import annotations

import torch

from megapp import comm
from megapp.comm import Group
from megapp.context_parallel import blocks
from megapp.context_parallel.layout import chunks_of_rank, restore_order
from megapp.tensor_parallel.mappings import gather_from_sequence_parallel_region

__all__ = ["all_gather_attention"]


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Group,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """Attention of this cp rank's queries ``[b, heads, s/cp, d]`` over the keys and values
    of the whole sequence, all-gathered over ``group``; returns ``[b, heads, s/cp, d]``."""
    cp = comm.world_size(group)
    if cp == 1:
        return blocks.attend(q, k, v, scale, causal)
    # [2, b, g, s/cp, d] -> sequence first for the all-gather -> [2, b, g, s, d] in order
    kv = gather_from_sequence_parallel_region(torch.stack([k, v]).movedim(3, 0), group)
    kv = restore_order(kv, cp, dim=0).movedim(0, 3)  # the gathered buffer freed here
    chunk = q.shape[2] // 2
    # causal, each query chunk sees the keys up to its own end, the last chunk masked
    ends = [(index + 1) * chunk for index in chunks_of_rank(cp, comm.rank(group))]
    return blocks.attend_in_tiles(q, kv, scale, causal, chunk, ends if causal else None)
