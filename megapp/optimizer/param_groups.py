"""Split parameters into a weight-decayed group and an undecayed one.

Weight matrices are decayed; biases, norm weights and every other 1-D parameter are not
(decaying a norm's gain or a bias only pulls it towards zero without regularising anything).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

NoDecayFn = Callable[[str, nn.Parameter], bool]


def default_no_decay(name: str, param: nn.Parameter) -> bool:
    """True for parameters that should not be decayed: biases and all 1-D parameters."""
    return name.endswith(".bias") or param.ndim == 1


def _named_parameters(
    source: nn.Module | Iterable[nn.Module] | Iterable[tuple[str, nn.Parameter]],
) -> list[tuple[str, nn.Parameter]]:
    if isinstance(source, nn.Module):
        return list(source.named_parameters())
    items = list(source)
    if all(isinstance(item, nn.Module) for item in items):
        # Model chunks (virtual pipeline stages): prefix names so they stay distinct.
        return [
            (f"{index}.{name}", param)
            for index, chunk in enumerate(items)
            for name, param in chunk.named_parameters()
        ]
    return [(name, param) for name, param in items]


def get_param_groups(
    source: nn.Module | Iterable[nn.Module] | Iterable[tuple[str, nn.Parameter]],
    weight_decay: float,
    no_decay_fn: NoDecayFn | None = None,
) -> list[dict[str, Any]]:
    """Optimizer param groups for ``source``: a module, a list of model chunks, or
    ``(name, param)`` pairs.

    Returns up to two dicts, the decayed group first: ``{"params": [...], "weight_decay":
    weight_decay, "wd_mult": 1.0}`` and ``{"params": [...], "weight_decay": 0.0,
    "wd_mult": 0.0}`` (``wd_mult`` lets a weight-decay schedule leave the second group at
    zero). Parameters keep the order in which ``source`` yields them; frozen ones
    (``requires_grad=False``) and repeats of the same tensor are left out; empty groups are
    dropped. ``no_decay_fn(name, param)`` overrides :func:`default_no_decay`.
    """
    no_decay_fn = no_decay_fn or default_no_decay
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, param in _named_parameters(source):
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (no_decay if no_decay_fn(name, param) else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": float(weight_decay), "wd_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
    ]
    return [group for group in groups if group["params"]]
