"""Observers of the tensors megapp's own saved-tensor hooks keep for backward.

``checkpoint`` and ``recompute_saved`` install saved-tensor hooks, and the
innermost hooks hide what they keep from any outer ones. An activation
audit registers here to still see every tensor those mechanisms hold on to.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

_observers: list[Callable[[torch.Tensor], None]] = []


@contextlib.contextmanager
def observe_saved(observer: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call ``observer`` with every tensor megapp's hooks keep while the block runs."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


def notify_kept(*values: object) -> None:
    """Tell the observers about every tensor among ``values`` (no-op without observers)."""
    if _observers:
        for value in values:
            if isinstance(value, torch.Tensor):
                for observer in _observers:
                    observer(value)
