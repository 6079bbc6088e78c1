"""The router's auxiliary losses, and how backward sees them.

With ``T`` tokens, ``E`` experts, ``k`` experts per token, ``s_{t,e}`` the router's scores
over all experts (softmax of the logits, or sigmoid scores divided by their sum) and
``c_e`` the number of tokens whose top k (of those scores, before any drop) holds ``e``:

- load balancing (Switch Transformer / GShard, as Megatron-Core computes it)::

      f_e = c_e / (T·k),   P_e = (1/T) Σ_t s_{t,e},   L_aux = coeff · E · Σ_e f_e · P_e

  It is ``coeff`` for a perfectly even router (``f_e = P_e = 1/E``) and grows with the
  imbalance; only ``P`` carries a gradient. Hugging Face's Mixtral counts ``f_e`` without
  the ``1/k``, so its loss is ``k`` times this one.
- sequence-level load balancing (DeepSeek-V3): the same loss over the ``s`` tokens of each
  sequence, averaged over the ``b`` sequences.
- z-loss (ST-MoE): ``L_z = coeff · mean_t (logsumexp_e logits_{t,e})²``, keeping the
  logits small.

A loss is attached to a tensor of the forward with :func:`attach`: the tensor passes
unchanged, and backward adds ``scale`` as the loss's own gradient (Megatron-Core's
``MoEAuxLossAutoScaler``), so one ``backward`` of the main loss trains the router on both.
``scale`` is what the main loss's gradient is multiplied by (1, or ``1 / microbatches``
and a loss scale when the training loop uses them).
"""

from __future__ import annotations

import torch

from megapp import comm
from megapp.comm import Group

__all__ = [
    "AuxLossScaler",
    "attach",
    "expert_bias_update",
    "load_balancing_loss",
    "sequence_load_balancing_loss",
    "z_loss",
]


def load_balancing_loss(
    scores: torch.Tensor, chosen: torch.Tensor, topk: int, coeff: float, group: Group = None
) -> torch.Tensor:
    """``coeff · E / (k · T²) · Σ_e c_e · Σ_t s_{t,e}`` for this rank's tokens: ``scores`` and
    ``chosen`` ``[T_local, E]`` (``chosen`` 1 where a token's top k holds the expert).

    ``group`` holds the ranks with the other parts of the same sequences (sequence or context
    parallelism): the counts ``c_e`` and ``T`` are theirs together, so the losses of the ranks
    add up to the loss of the whole. ``None``: this rank's tokens alone.
    """
    num_experts = scores.shape[-1]
    per_expert = scores.sum(dim=0)
    counts = _summed(chosen.sum(dim=0).to(per_expert.dtype), group)
    num_tokens = scores.shape[0] * comm.world_size(group)
    scale = coeff * num_experts / (topk * num_tokens * num_tokens)
    return (per_expert * counts).sum() * scale


def sequence_load_balancing_loss(
    scores: torch.Tensor,
    chosen: torch.Tensor,
    batch: int,
    topk: int,
    coeff: float,
    group: Group = None,
) -> torch.Tensor:
    """:func:`load_balancing_loss` of every sequence, averaged over the ``batch`` sequences.

    ``scores`` and ``chosen`` ``[s·b, E]`` are in ``[s, b]`` order (as ``[s, b, h]`` tokens
    flatten); ``group`` as in :func:`load_balancing_loss`.
    """
    num_experts = scores.shape[-1]
    per_sequence = scores.reshape(-1, batch, num_experts).sum(dim=0)  # [b, E]
    counts = chosen.reshape(-1, batch, num_experts).sum(dim=0).to(per_sequence.dtype)
    counts = _summed(counts, group)
    seq_len = scores.shape[0] // batch * comm.world_size(group)
    scale = coeff * num_experts / (topk * seq_len * seq_len)
    return (per_sequence * counts).sum() * scale / batch


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """``coeff · mean((logsumexp(logits, -1))²)`` over the tokens of ``logits`` ``[T, E]``."""
    return torch.logsumexp(logits, dim=-1).square().mean() * coeff


def _summed(counts: torch.Tensor, group: Group) -> torch.Tensor:
    """``counts`` summed over ``group`` (a copy; itself for one rank)."""
    if comm.world_size(group) == 1:
        return counts
    counts = counts.clone()
    comm.all_reduce(counts, group)
    return counts


def expert_bias_update(
    bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float
) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free step: ``bias + rate · sign(mean(c) − c)``; an
    expert with more than the mean load gets a lower bias and is chosen less often."""
    load = tokens_per_expert.to(bias.dtype)
    return bias + rate * torch.sign(load.mean() - load)


class AuxLossScaler(torch.autograd.Function):
    """Forward: ``x`` unchanged (the loss is kept). Backward: ``x``'s gradient passes, and the
    loss receives ``scale`` as its gradient, as if it had been added to the main loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def attach(x: torch.Tensor, loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``x``, carrying ``loss`` into backward with gradient ``scale`` (see the module)."""
    return AuxLossScaler.apply(x, loss, scale)
