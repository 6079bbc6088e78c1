"""The loss of a sequence that context parallelism splits over ranks."""

from __future__ import annotations

import torch

from megapp import comm
from megapp.comm import Group

__all__ = ["masked_token_mean"]


def masked_token_mean(
    per_token_loss: torch.Tensor, loss_mask: torch.Tensor, cp_group: Group = None
) -> torch.Tensor:
    """The mean of ``per_token_loss`` over the tokens ``loss_mask`` keeps (a scalar, fp32).

    With a context-parallel group each rank holds a slice of the tokens: the count of kept
    tokens is summed over the group, and each rank returns ``cp × (its tokens' loss sum) /
    (kept tokens of the whole sequence)``. The mean of that over the cp ranks is the
    sequence's mean loss, and the gradient reduction over data × context ranks takes
    exactly that mean (Megatron-Core scales the loss by cp in the same way).
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
