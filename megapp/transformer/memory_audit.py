"""Count the activation bytes a module keeps for backward, term by term.

Every tensor autograd saves during the forward (and every tensor megapp's
checkpoint and recompute blocks hold on to) is attributed to the innermost
submodule running when it was saved. Storages are counted once, however
many views of them are saved; parameters are not activations and are skipped.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from megapp.autograd.saved import observe_saved


@dataclass
class ActivationAudit:
    """Bytes kept for backward, by submodule name (``""`` is the module itself)."""

    terms: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, list[tuple[tuple[int, ...], torch.dtype]]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    def in_units(self, unit_bytes: int) -> dict[str, float]:
        return {name: b / unit_bytes for name, b in self.terms.items()}


def audit_saved_activations(module: nn.Module, *args, **kwargs) -> ActivationAudit:
    """Run ``module(*args, **kwargs)`` once and report what it keeps for backward."""
    param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: set[int] = set()
    terms: dict[str, int] = defaultdict(int)
    shapes: dict[str, list] = defaultdict(list)
    stack = [""]
    names = {sub: name for name, sub in module.named_modules()}

    def record(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in param_storages or key in seen or storage.nbytes() == 0:
            return
        seen.add(key)
        terms[stack[-1]] += storage.nbytes()
        shapes[stack[-1]].append((tuple(t.shape), t.dtype))

    def pack(t: torch.Tensor) -> torch.Tensor:
        record(t)
        return t

    def enter(name: str) -> None:
        stack.append(name)

    def leave() -> None:  # a forward hook must return None or it replaces the output
        stack.pop()

    handles = []
    for sub, name in names.items():
        handles.append(sub.register_forward_pre_hook(lambda m, a, n=name: enter(n)))
        handles.append(sub.register_forward_hook(lambda m, a, o: leave()))
    try:
        with contextlib.ExitStack() as ctx:
            ctx.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            ctx.enter_context(observe_saved(record))
            module(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return ActivationAudit(dict(terms), dict(shapes))
