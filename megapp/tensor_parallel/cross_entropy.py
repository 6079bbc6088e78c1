"""Cross entropy over vocabulary-parallel logits, without gathering the full vocabulary.

Tensor-parallel rank ``r`` of ``tp`` holds ``logits_shard = logits[..., r·w:(r+1)·w]`` with
``w = V_pad/tp`` (see :mod:`megapp.tensor_parallel.utils`); every rank holds the same targets.
With ``z`` the logits, ``t`` the target id and ``K`` the real (unpadded) vocabulary size:

    m       = max_k z_k                                all-reduce MAX  [..]
    Z       = Σ_k exp(z_k − m)                         all-reduce SUM  [..]
    z_t − m = the one shard's masked lookup            all-reduce SUM  [..]
    loss    = log Z − (z_t − m)

The two sums travel in one all-reduce, so the forward costs two collectives of ``[s, b]``-sized
tensors whatever the vocabulary size. Padded ids (``>= K``) are left out of the max and the
sums, so they get zero probability and zero gradient.

Label smoothing follows Megatron: with ``ε = label_smoothing · K/(K−1)``,

    loss = (1 − ε)·(log Z − (z_t − m)) + ε·(log Z − (1/K)·Σ_{k<K} (z_k − m)),

i.e. the target distribution is ``1 − label_smoothing`` on the target and
``label_smoothing/(K−1)`` on every other real id. That equals
``torch.nn.functional.cross_entropy(..., label_smoothing=ε)``, which spreads ``ε`` over all
``K`` ids. The sum over the real ids rides in the same all-reduce as the other two.

Backward needs no communication: ``∂loss/∂z_k = p_k − (1 − ε)·[k = t] − (ε/K)·[k < K]`` with
``p_k = exp(z_k − m − log Z)``, recomputed from the logits.

The passes over the shard are fused kernels (the CUDA, C++ CPU or PyTorch reference tier,
chosen per call as for every fused op): the row max, one pass for the three sums, and in
backward one pass that writes the gradient in the logits' dtype. Backward keeps only the logits
shard itself (in its own dtype), the target and two float32 values per token (``m`` and
``log Z``; float64 for float64 logits), no ``[..., w]`` float32 buffer: for bf16 logits 2 bytes
per logit where a saved float32 softmax took 4. Nothing saved is modified, so backward may run
more than once (``retain_graph=True``).

The passes take one rank's shard of the logits, ``[..., w]`` (any leading dims; viewed as
rows), whose ids are ``[start, start + w)`` of the padded vocabulary; the first ``real`` of them
are real ids, the rest padding. With ``z`` a row, ``m`` its max over every shard (all-reduced
between the first two passes), ``t`` the target, ``K`` the real vocabulary size and ``ε`` the
smoothing weight:

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
import torch.distributed as dist
from torch.autograd.function import FunctionCtx, once_differentiable

from megapp import comm
from megapp.fusions.extension import acc_dtype, run_tier, select_tier

__all__ = [
    "cross_entropy_bwd",
    "cross_entropy_bwd_reference",
    "cross_entropy_fwd_max",
    "cross_entropy_fwd_max_reference",
    "cross_entropy_fwd_sums",
    "cross_entropy_fwd_sums_reference",
    "vocab_parallel_cross_entropy",
]

Group = dist.ProcessGroup | None
_OP = "cross_entropy"  # the fused op's name for the tier choice


# ----- the passes over one shard -----


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


# ----- the loss over the tensor-parallel group -----


def _world_and_rank(group: Group) -> tuple[int, int]:
    # No group means no tensor parallelism, as for every tensor-parallel mapping.
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp, group: Group, world: int) -> None:
    # Every rank has the same shapes, so skipping empty tensors is skipped everywhere.
    if world > 1 and x.numel() > 0:
        comm.all_reduce(x, group, op)


def _check_target(target: torch.Tensor, vocab_size: int) -> None:
    """Reject a target id outside ``[0, vocab_size)``.

    On the host: a ValueError naming the id (one min/max reduction). On a GPU: a
    device-side assertion queued before the loss kernels, as torch's own cross entropy
    does, because reading the answer back would stall the host once per loss call; a
    failed assertion surfaces as CUDA's "device-side assert triggered" at the next
    synchronization and stops every later kernel, so no out-of-range logit is read.
    """
    if target.numel() == 0:
        return
    if target.device.type != "cpu":
        torch._assert_async(
            ((target >= 0) & (target < vocab_size)).all(),
            f"vocab_parallel_cross_entropy: a target id is outside the vocabulary of size "
            f"{vocab_size} (valid ids are [0, {vocab_size}))",
        )
        return
    lo, hi = torch.stack(torch.aminmax(target)).tolist()
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"vocab_parallel_cross_entropy: target id {bad} is outside the vocabulary of size "
            f"{vocab_size} (valid ids are [0, {vocab_size}))"
        )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss ``[...]`` from ``logits_shard [..., w]``; keeps the logits, m and log Z."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits_shard: torch.Tensor,
        target: torch.Tensor,
        label_smoothing: float,
        vocab_size: int,
        group: Group,
        world: int,
        rank: int,
    ) -> torch.Tensor:
        tier = select_tier(_OP, logits_shard)
        width = logits_shard.shape[-1]
        start = rank * width
        real = min(max(vocab_size - start, 0), width)  # real (unpadded) ids in this shard
        # The kernels' index type, in a private contiguous copy (8 B per token): the caller may
        # refill its label buffer before backward.
        target = target.to(torch.int64, memory_format=torch.contiguous_format, copy=True)

        row_max = cross_entropy_fwd_max(logits_shard, real, tier)
        _all_reduce(row_max, dist.ReduceOp.MAX, group, world)
        # Σ exp(z − m), z_t − m (on the one rank that holds t) and Σ_{k<K} (z − m): one pass.
        smoothing = label_smoothing > 0
        sums = cross_entropy_fwd_sums(logits_shard, target, row_max, start, real, smoothing, tier)
        _all_reduce(sums, dist.ReduceOp.SUM, group, world)  # one collective for all the sums
        sum_exp, target_logit, *sum_real = sums.unbind(dim=-1)

        log_z = sum_exp.log()
        loss = log_z - target_logit
        eps = 0.0
        if smoothing:
            eps = label_smoothing * vocab_size / (vocab_size - 1)
            mean_nll = log_z - sum_real[0] / vocab_size  # mean over real ids of −log p_k
            loss = (1.0 - eps) * loss + eps * mean_nll

        ctx.save_for_backward(logits_shard, target, row_max, log_z)
        ctx.tier, ctx.eps, ctx.vocab_size, ctx.start, ctx.real = tier, eps, vocab_size, start, real
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits_shard, target, row_max, log_z = ctx.saved_tensors
        grad = cross_entropy_bwd(
            grad_loss,
            logits_shard,
            target,
            row_max,
            log_z,
            ctx.start,
            ctx.real,
            ctx.eps,
            ctx.vocab_size,
            ctx.tier,
        )
        return grad, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group: Group = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token cross entropy of vocabulary-parallel logits.

    Args:
        logits_shard: ``[s, b, V_pad/tp]`` (any ``[..., V_pad/tp]``, any float dtype), this
            rank's contiguous block of the padded vocabulary: ids ``[r·V_pad/tp, (r+1)·V_pad/tp)``
            on tensor-parallel rank ``r``.
        target: ``[s, b]`` (``logits_shard.shape[:-1]``) integer global ids, the same on every
            rank of ``tp_group``.
        label_smoothing: Megatron's smoothing in ``[0, 1)``: the target keeps
            ``1 − label_smoothing``, the other ``vocab_size − 1`` real ids share the rest.
        tp_group: the tensor-parallel group; ``None`` means no tensor parallelism (the
            logits are the whole vocabulary), as in every tensor-parallel layer.
        vocab_size: the real vocabulary size ``K <= V_pad``; ids ``>= K`` are padding, with zero
            probability and zero gradient. Default: ``V_pad`` (no padding).

    Returns:
        The loss per token, ``[s, b]``, float32 (float64 for float64 logits), identical on every
        rank of ``tp_group``. Its gradient flows to ``logits_shard`` only.

    Raises:
        ValueError: a target id outside ``[0, vocab_size)`` (raised on every rank, before any
            communication), or inconsistent shapes and sizes.
    """
    world, rank = _world_and_rank(tp_group)
    if logits_shard.dim() == 0 or logits_shard.shape[-1] == 0:
        raise ValueError(
            f"logits_shard must be [..., V/tp] with V/tp >= 1, got {tuple(logits_shard.shape)}"
        )
    if tuple(target.shape) != tuple(logits_shard.shape[:-1]):
        raise ValueError(
            f"target must be logits_shard.shape[:-1] = {tuple(logits_shard.shape[:-1])}, "
            f"got {tuple(target.shape)}"
        )
    if target.dtype == torch.bool or target.dtype.is_floating_point or target.is_complex():
        raise ValueError(f"target must hold integer ids, got {target.dtype}")
    padded = logits_shard.shape[-1] * world
    if vocab_size is None:
        vocab_size = padded
    if not 1 <= vocab_size <= padded:
        raise ValueError(
            f"vocab_size {vocab_size} is outside [1, {padded}] (the sharded width "
            f"{logits_shard.shape[-1]} × {world} tensor-parallel ranks)"
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if label_smoothing > 0 and vocab_size < 2:
        raise ValueError("label smoothing needs a vocabulary of at least 2 ids")
    _check_target(target, vocab_size)
    return _VocabParallelCrossEntropy.apply(
        logits_shard, target, float(label_smoothing), vocab_size, tp_group, world, rank
    )
