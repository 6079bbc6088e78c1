"""Which part of the sequence each context-parallel rank holds.

Causal attention costs more at the end of a sequence than at its start (a query
attends to every key before it), so contiguous slices would leave the first cp
rank nearly idle. As in Megatron-Core, the sequence of length ``s`` is cut into
``2·cp`` chunks of ``s / (2·cp)`` tokens and cp rank ``i`` holds chunks ``i`` and
``2·cp − 1 − i``: every rank then holds the same number of (query, key) pairs
under the causal mask. With cp = 2 and s = 8, rank 0 holds positions
0 1 6 7 and rank 1 holds 2 3 4 5.

"Rank order" is the concatenation of every rank's slice, rank 0 first: what an
all-gather along the sequence delivers. :func:`restore_order` turns it into the
sequence's own order and :func:`to_rank_order` back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megapp import comm
from megapp.comm import Group
from megapp.tensor_parallel.mappings import gather_first

__all__ = [
    "check_sequence_length",
    "chunks_of_rank",
    "gather",
    "merge",
    "positions",
    "restore_order",
    "split",
    "to_rank_order",
]


def check_sequence_length(seq_length: int, cp: int) -> None:
    """Raise ValueError unless ``seq_length`` splits into ``2·cp`` equal chunks."""
    if cp > 1 and seq_length % (2 * cp):
        raise ValueError(
            f"sequence length {seq_length} is not divisible by 2 × context-parallel size "
            f"(2 × {cp} = {2 * cp}); each cp rank holds two equal chunks of it, so use a "
            f"multiple of {2 * cp}"
        )


def chunks_of_rank(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of ``2·cp``) that cp rank ``cp_rank`` holds, in sequence order."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp rank {cp_rank} is outside [0, {cp})")
    return cp_rank, 2 * cp - 1 - cp_rank


def _rank_order_chunks(cp: int) -> list[int]:
    """Global chunk index at each place of the rank order: [0, 2cp−1, 1, 2cp−2, ...]."""
    return [c for r in range(cp) for c in chunks_of_rank(cp, r)]


def _select_chunks(x: torch.Tensor, cp: int, dim: int, chunks: Sequence[int]) -> torch.Tensor:
    dim = dim % x.dim()
    length = x.shape[dim]
    check_sequence_length(length, cp)
    shaped = x.unflatten(dim, (2 * cp, length // (2 * cp)))
    index = torch.tensor(chunks, dtype=torch.long, device=x.device)
    picked = shaped.index_select(dim, index)
    return picked.flatten(dim, dim + 1)


def split(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 0) -> torch.Tensor:
    """This cp rank's slice of ``x`` along ``dim`` (the sequence): ``[s, ...]`` ->
    ``[s/cp, ...]`` with ``dim=0``, ``[b, s, ...]`` -> ``[b, s/cp, ...]`` with ``dim=1``.
    Differentiable; ``x`` itself when cp is 1."""
    if cp == 1:
        return x
    return _select_chunks(x, cp, dim, chunks_of_rank(cp, cp_rank))


def to_rank_order(x: torch.Tensor, cp: int, dim: int = 0) -> torch.Tensor:
    """The whole sequence along ``dim`` -> every rank's slice, rank 0 first."""
    if cp == 1:
        return x
    return _select_chunks(x, cp, dim, _rank_order_chunks(cp))


def restore_order(x: torch.Tensor, cp: int, dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`to_rank_order`: every rank's slice, rank 0 first -> the sequence."""
    if cp == 1:
        return x
    places = _rank_order_chunks(cp)
    return _select_chunks(x, cp, dim, [places.index(c) for c in range(2 * cp)])


def merge(slices: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """The whole sequence from every cp rank's slice (``slices[i]`` from cp rank ``i``)."""
    return restore_order(torch.cat(list(slices), dim=dim), len(slices), dim)


def gather(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """All-gather this cp group's slices along ``dim`` into the whole sequence (not
    differentiable: for outputs, evaluation and checks)."""
    cp = comm.world_size(group)
    if cp == 1:
        return x
    gathered = gather_first(x.detach().movedim(dim, 0), group)
    return restore_order(gathered, cp, 0).movedim(0, dim)


def positions(
    seq_length: int, cp: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global position ids ``[s/cp]`` (int64) of the tokens cp rank ``cp_rank`` holds, for
    position embeddings and rotary frequencies."""
    check_sequence_length(seq_length, cp)
    if cp == 1:
        return torch.arange(seq_length, device=device)
    chunk = seq_length // (2 * cp)
    return torch.cat(
        [
            torch.arange(c * chunk, (c + 1) * chunk, device=device)
            for c in chunks_of_rank(cp, cp_rank)
        ]
    )
