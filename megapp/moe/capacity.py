"""Expert capacity: how many (token, expert) pairs an expert takes, and which are dropped.

With a capacity factor ``c``, each expert takes at most::

    capacity = ceil(T · k / E · c)

of the pairs that this rank's ``T`` tokens route to it (``k`` experts per token, ``E``
experts): ``c = 1`` is exactly an even share. As in Megatron-Core the rule runs in the
router, on each rank's own tokens, before any token leaves the rank, so an expert-parallel
layer drops exactly the pairs that the same layer in one process drops for the same tokens.

The pairs an expert keeps (``moe_token_drop_policy``):

- ``probs``: the ``capacity`` pairs with the highest routing probabilities;
- ``position``: the ``capacity`` earliest tokens, in the ``[s, b]`` order of the layer's
  input (sequence position first, then the sequence in the batch).

Ties (equal probabilities) go to the earlier token, so the rule is deterministic. A dropped
pair contributes nothing to its token's output; a token all of whose pairs are dropped
leaves the routed experts with zero (the residual connection carries it on).
"""

from __future__ import annotations

import math

import torch

__all__ = ["expert_capacity", "kept_pairs"]


def expert_capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    """``ceil(num_tokens · topk / num_experts · factor)``."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def kept_pairs(
    probs: torch.Tensor, experts: torch.Tensor, num_experts: int, capacity: int, policy: str
) -> torch.Tensor:
    """Which (token, slot) pairs stay: ``[T, k]`` bool for ``probs`` and ``experts`` ``[T, k]``
    (the chosen experts of each token, distinct within a row)."""
    flat_experts = experts.reshape(-1)
    if policy == "probs":
        # stable sorts: by probability (descending), then by expert; ties keep token order
        order = torch.sort(probs.reshape(-1), descending=True, stable=True).indices
        order = order[torch.sort(flat_experts[order], stable=True).indices]
    elif policy == "position":
        order = torch.sort(flat_experts, stable=True).indices
    else:
        raise ValueError(f"moe_token_drop_policy must be 'probs' or 'position', got {policy!r}")
    counts = torch.bincount(flat_experts, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    sorted_experts = flat_experts[order]
    place = torch.arange(order.numel(), device=order.device) - starts[sorted_experts]
    kept = torch.empty_like(flat_experts, dtype=torch.bool)
    kept[order] = place < capacity
    return kept.view_as(experts)
