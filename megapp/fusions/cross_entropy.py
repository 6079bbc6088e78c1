"""The per-shard kernels of the vocabulary-parallel cross entropy, in three tiers.

:func:`megapp.tensor_parallel.vocab_parallel_cross_entropy` runs these on one rank's shard of
the logits, ``[..., w]`` (any leading dims; viewed as rows), whose ids are ``[start, start + w)``
of the padded vocabulary; the first ``real`` of them are real ids, the rest padding. With ``z``
a row, ``m`` its max over every shard (all-reduced between the first two calls), ``t`` the
target, ``K`` the real vocabulary size and ``ε`` the smoothing weight:

- :func:`cross_entropy_fwd_max`: ``max_{k<real} z_k`` (−inf when ``real == 0``);
- :func:`cross_entropy_fwd_sums`: in one pass, ``[Σ_{k<real} exp(z_k − m), z_t − m]`` and, with
  label smoothing, ``Σ_{k<real} (z_k − m)`` (``z_t − m`` is 0 when ``t`` is another shard's);
- :func:`cross_entropy_bwd`: ``grad_k = ((exp((z_k − m) − log Z) − (1 − ε)[k = t]) − ε/K)·g``
  for real ids and 0 for padding, in the logits' dtype.

Row values (``m``, the sums, ``log Z``, the loss gradient ``g``) are float32, float64 for
float64 logits; so is the math. The ``*_reference`` functions are pure PyTorch in the kernels'
order of operations (``csrc/include/megapp/cross_entropy.h``); the others run the tier they are
given (from ``select_tier("cross_entropy", logits)``).
"""

from __future__ import annotations

import torch

from megapp.fusions.common import acc_dtype, run_tier


def _shifted(logits: torch.Tensor, row_max: torch.Tensor, real: int) -> torch.Tensor:
    """``z − m`` over the real ids, ``[..., real]`` in the accumulation type."""
    return logits[..., :real].to(acc_dtype(logits.dtype)) - row_max.unsqueeze(-1)


def _local_target(target: torch.Tensor, start: int, real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's index in the shard (0 where absent) and whether it is one of its real ids."""
    local = target.to(torch.int64) - start
    in_shard = (local >= 0) & (local < real)
    return local.masked_fill(~in_shard, 0), in_shard


def cross_entropy_fwd_max_reference(logits: torch.Tensor, real: int) -> torch.Tensor:
    """Row max over the real ids: ``[..., w]`` -> ``[...]`` float32 (float64 for float64)."""
    acc = acc_dtype(logits.dtype)
    if real == 0:  # a shard of padding only
        return torch.full(logits.shape[:-1], float("-inf"), dtype=acc, device=logits.device)
    return logits[..., :real].amax(dim=-1).to(acc)  # a max is exact in any dtype


def cross_entropy_fwd_sums_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    row_max: torch.Tensor,
    start: int,
    real: int,
    smoothing: bool,
) -> torch.Tensor:
    """``[..., 2]`` = (Σ exp(z − m), z_t − m), or ``[..., 3]`` adding Σ (z − m) with smoothing."""
    shifted = _shifted(logits, row_max, real)
    local, in_shard = _local_target(target, start, real)
    if real > 0:
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~in_shard, 0.0)
    else:
        target_logit = torch.zeros_like(row_max)
    sums = [torch.exp(shifted).sum(dim=-1), target_logit]
    if smoothing:
        sums.append(shifted.sum(dim=-1))
    return torch.stack(sums, dim=-1)


def cross_entropy_bwd_reference(
    grad_loss: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    row_max: torch.Tensor,
    log_z: torch.Tensor,
    start: int,
    real: int,
    eps: float,
    vocab_size: int,
) -> torch.Tensor:
    """Gradient of the loss w.r.t. the logits shard, ``[..., w]`` in the logits' dtype."""
    acc = acc_dtype(logits.dtype)
    # The weights in double, rounded once to the accumulation type (as the kernels do).
    one_minus_eps = torch.tensor(1.0 - eps, dtype=acc, device=logits.device)
    eps_over_k = torch.tensor(eps / vocab_size, dtype=acc, device=logits.device)
    p = torch.exp(_shifted(logits, row_max, real) - log_z.unsqueeze(-1))
    local, in_shard = _local_target(target, start, real)
    hit = torch.zeros_like(p)
    if real > 0:
        weight = in_shard.to(acc) * one_minus_eps  # exactly 1 − ε or 0
        hit.scatter_(-1, local.unsqueeze(-1), weight.unsqueeze(-1))
    grad = torch.zeros(logits.shape, dtype=acc, device=logits.device)  # padding ids stay 0
    grad[..., :real] = ((p - hit) - eps_over_k) * grad_loss.to(acc).unsqueeze(-1)
    return grad.to(logits.dtype)


def cross_entropy_fwd_max(logits: torch.Tensor, real: int, tier: str) -> torch.Tensor:
    """:func:`cross_entropy_fwd_max_reference` in ``tier``."""
    return run_tier(tier, "cross_entropy_fwd_max", cross_entropy_fwd_max_reference, logits, real)


def cross_entropy_fwd_sums(
    logits: torch.Tensor,
    target: torch.Tensor,
    row_max: torch.Tensor,
    start: int,
    real: int,
    smoothing: bool,
    tier: str,
) -> torch.Tensor:
    """:func:`cross_entropy_fwd_sums_reference` in ``tier``; target holds int64 global ids."""
    args = (logits, target, row_max, start, real, smoothing)
    return run_tier(tier, "cross_entropy_fwd_sums", cross_entropy_fwd_sums_reference, *args)


def cross_entropy_bwd(
    grad_loss: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    row_max: torch.Tensor,
    log_z: torch.Tensor,
    start: int,
    real: int,
    eps: float,
    vocab_size: int,
    tier: str,
) -> torch.Tensor:
    """:func:`cross_entropy_bwd_reference` in ``tier``."""
    args = (grad_loss, logits, target, row_max, log_z, start, real, eps, vocab_size)
    return run_tier(tier, "cross_entropy_bwd", cross_entropy_bwd_reference, *args)


__all__ = [
    "cross_entropy_bwd",
    "cross_entropy_bwd_reference",
    "cross_entropy_fwd_max",
    "cross_entropy_fwd_max_reference",
    "cross_entropy_fwd_sums",
    "cross_entropy_fwd_sums_reference",
]
