"""AdamW with the fastest implementation the parameters' device allows.

The choice is a pure function of (where the parameters live, whether apex imports) and is
logged once per process and kind:

- ``"apex"``: apex ``FusedAdam`` in decoupled (AdamW) mode, when apex is installed and every
  parameter is on CUDA;
- ``"torch_fused"``: ``torch.optim.AdamW(fused=True)`` on CUDA without apex;
- ``"torch_foreach"``: ``torch.optim.AdamW(foreach=True)`` otherwise (CPU, mixed devices).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)

ParamGroups = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


def choose_adamw(all_cuda: bool, apex_available: bool) -> str:
    """``"apex"``, ``"torch_fused"`` or ``"torch_foreach"`` (see the module docstring)."""
    if all_cuda and apex_available:
        return "apex"
    if all_cuda:
        return "torch_fused"
    return "torch_foreach"


@functools.cache
def _apex_fused_adam() -> type | None:
    try:
        from apex.optimizers import FusedAdam
    except ImportError:  # apex is optional; torch's own kernels are the fallback
        return None
    return FusedAdam


@functools.cache
def _log_choice(kind: str) -> None:
    logger.info("megapp: AdamW uses the %s implementation", kind)


def _all_params(param_groups: list[Any]) -> list[torch.Tensor]:
    if param_groups and isinstance(param_groups[0], dict):
        return [param for group in param_groups for param in group["params"]]
    return list(param_groups)


def build_adamw(
    param_groups: ParamGroups,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """An AdamW optimizer over ``param_groups`` (parameters or group dicts, e.g. from
    :func:`megapp.optimizer.get_param_groups`; a group's own ``weight_decay`` wins over
    the default given here). Weight decay is decoupled: ``p -= lr * weight_decay * p``."""
    param_groups = list(param_groups)
    params = _all_params(param_groups)
    if not params:
        raise ValueError("build_adamw got no parameters")
    all_cuda = all(param.is_cuda for param in params)
    fused_adam = _apex_fused_adam() if all_cuda else None
    kind = choose_adamw(all_cuda, fused_adam is not None)
    _log_choice(kind)
    options = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if kind == "apex":
        return fused_adam(param_groups, adam_w_mode=True, **options)
    if kind == "torch_fused":
        return torch.optim.AdamW(param_groups, fused=True, **options)
    return torch.optim.AdamW(param_groups, foreach=True, **options)
