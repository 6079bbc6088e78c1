"""Pure vocabulary arithmetic for tensor parallelism (no torch.distributed).

The vocabulary of ``V`` ids is padded to ``V_pad`` (a multiple of ``multiple × tp``, Megatron's
``make_vocab_size_divisible_by × tp``) and split into ``tp`` contiguous blocks: rank ``r`` holds
ids ``[r·V_pad/tp, (r+1)·V_pad/tp)``. The padding ids ``[V, V_pad)`` live at the end of the last
block(s); a block may be all padding when ``V_pad − V ≥ V_pad/tp``.
"""

from __future__ import annotations

__all__ = ["pad_vocab_size", "vocab_range"]


def pad_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Smallest ``V_pad >= vocab_size`` divisible by ``multiple × tp``.

    ``multiple=128`` is Megatron's default ``make_vocab_size_divisible_by`` (GPT-2's 50257 ids
    become 50304 at tp 1, 50432 at tp 2, 50688 at tp 4); ``multiple=1`` pads only to a multiple of
    ``tp``.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    step = multiple * tp
    return -(-vocab_size // step) * step


def vocab_range(padded_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Ids ``[start, end)`` of the (padded) vocabulary held by tensor-parallel ``rank``."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if padded_vocab_size < 1 or padded_vocab_size % world_size:
        raise ValueError(
            f"padded vocabulary size {padded_vocab_size} is not divisible by the {world_size} "
            f"tensor-parallel ranks; pad it with pad_vocab_size()"
        )
    per_rank = padded_vocab_size // world_size
    return rank * per_rank, (rank + 1) * per_rank
