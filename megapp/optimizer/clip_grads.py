"""Global gradient norm and clipping across a model-parallel layout.

The norm of the whole model's gradient is assembled from every rank's local pieces, so each
gradient element must be counted exactly once: tensor-parallel shards are distinct on every
tp rank, replicated parameters are counted on tp rank 0 only, and a ``shared`` parameter
(the tied output embedding on the last pipeline stage) duplicates another rank's copy and is
not counted at all. Clipping, in contrast, scales every local gradient, duplicates included,
so all copies stay equal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megapp import comm
from megapp.param_attributes import is_duplicate, is_tensor_parallel


def _local_grad(param: torch.Tensor) -> torch.Tensor | None:
    # Data-parallel wrappers accumulate into ``main_grad``; it replaces ``grad`` when present.
    if hasattr(param, "main_grad"):
        return param.main_grad
    return param.grad


def counts_in_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank's copy of ``param`` enters the global norm: not a ``shared``
    duplicate, and either a tensor-parallel shard or (replicated over tp) on tp rank 0."""
    if is_duplicate(param):
        return False
    return is_tensor_parallel(param) or tp_rank == 0


def grads_for_norm(params: Iterable[torch.Tensor], tp_rank: int) -> list[torch.Tensor]:
    """The gradients of ``params`` this rank contributes to the global norm
    (:func:`counts_in_norm`), skipping parameters with no gradient. Uses ``main_grad``
    where it exists.
    """
    grads = []
    for param in params:
        if not counts_in_norm(param, tp_rank):
            continue
        grad = _local_grad(param)
        if grad is not None:
            grads.append(grad)
    return grads


def grads_to_clip(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Every local gradient of ``params`` (``main_grad`` where it exists), duplicates included."""
    return [grad for grad in map(_local_grad, params) if grad is not None]


def _reduction_device(grads: list[torch.Tensor]) -> torch.device:
    if grads:
        return grads[0].device
    # A rank with nothing to count still joins the all-reduce, on the backend's device.
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_grad_norm(
    grads: list[torch.Tensor],
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
) -> float:
    """The ``norm_type``-norm of all ``grads`` on all ranks of ``group``, as a float.

    ``grads`` come from :func:`grads_for_norm`. Per-tensor norms are computed in fp32 (one
    fused call); for a p-norm their p-th powers are summed and all-reduced with SUM, for the
    inf-norm the maxima are all-reduced with MAX. ``group`` None means no communication.
    """
    norm_type = float(norm_type)
    if not norm_type > 0.0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    device = _reduction_device(grads)
    if grads:
        norms = torch._foreach_norm(grads, norm_type, dtype=torch.float32)
        per_tensor = torch.stack([norm.to(device) for norm in norms])
    else:
        per_tensor = torch.zeros(1, dtype=torch.float32, device=device)
    if math.isinf(norm_type):
        total = per_tensor.max().reshape(1)
        if group is not None:
            comm.all_reduce(total, group, dist.ReduceOp.MAX)
        return float(total.item())
    total = per_tensor.pow(norm_type).sum().reshape(1)
    if group is not None:
        comm.all_reduce(total, group)
    return float(total.item()) ** (1.0 / norm_type)


def clip_grad_by_total_norm_(
    grads_to_clip: list[torch.Tensor], max_norm: float, total_norm: float
) -> float:
    """Scale ``grads_to_clip`` in place by ``max_norm / (total_norm + 1e-6)`` when below 1.

    Returns the factor applied (1.0 when nothing was scaled). The 1e-6 keeps the result just
    under ``max_norm`` and matches ``torch.nn.utils.clip_grad_norm_``.
    """
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    # A nan norm compares false and leaves the grads alone; the overflow check skips that step.
    if not clip_coeff < 1.0 or not grads_to_clip:
        return 1.0
    torch._foreach_mul_(grads_to_clip, clip_coeff)
    return clip_coeff


def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    *,
    tp_rank: int,
    norm_type: float = 2.0,
    group: dist.ProcessGroup | None = None,
) -> float:
    """Clip the gradients of ``params`` to a global norm of ``max_norm``; return the norm
    measured before clipping. ``group`` spans the ranks holding distinct pieces of the
    gradient (model parallel, plus data parallel when gradients are sharded over it)."""
    params = list(params)
    total_norm = get_grad_norm(grads_for_norm(params, tp_rank), norm_type, group)
    clip_grad_by_total_norm_(grads_to_clip(params), max_norm, total_norm)
    return total_norm
