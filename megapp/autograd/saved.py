"""The tensors autograd keeps for backward: who may see them, and freeing what it does not keep.

``checkpoint`` and ``recompute_saved`` install saved-tensor hooks, and the innermost
hooks hide what they keep from any outer ones; they report it through
:func:`notify_kept`, and an observer registered with :func:`observe_saved` (an
activation audit, :class:`SavedStorages`) still sees every tensor they hold on to.

A pipeline stage sends its output on, but its own backward needs only the output's
autograd node and the incoming gradient, not the values it sent (Megatron's trick). A
forward runs under :meth:`SavedStorages.recording`, which says afterwards which outputs
no backward node reads; once such an output's send is done, :func:`drop_storage` frees
it, and :func:`run_backward` starts a backward from outputs that may have been freed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

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


class SavedStorages:
    """Records the storage of every tensor autograd keeps for backward while a forward runs.

    A sent activation may be dropped only if no backward node keeps its values:
    its own node (tanh keeps its output) or a node that produced another sent
    tensor from it (a stage returning ``(h, h * s)`` keeps ``h`` in the product's
    node). megapp's own saved-tensor hooks (recompute) hide what they keep from
    outer hooks, so their observers are watched too.
    """

    def __init__(self) -> None:
        self.pointers: set[int] = set()

    def _add(self, t: torch.Tensor) -> torch.Tensor:
        if t.numel():
            self.pointers.add(t.untyped_storage().data_ptr())
        return t

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record what autograd saves inside the ``with`` block."""
        with (
            torch.autograd.graph.saved_tensors_hooks(self._add, lambda t: t),
            observe_saved(self._add),
        ):
            yield

    def droppable(self, outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The outputs whose values no backward node needs: no view, no saved storage."""
        return tuple(
            t
            for t in outputs
            if t.grad_fn is not None
            and t._base is None
            and t.numel()
            and t.untyped_storage().data_ptr() not in self.pointers
        )


def drop_storage(t: torch.Tensor) -> None:
    """Replace ``t``'s values by one element; its autograd node stays for the backward."""
    t.data = torch.empty((1,), device=t.device, dtype=t.dtype)


def run_backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Backward from ``outputs`` (some possibly dropped) with ``grads``, one per output;
    outputs that do not require grad are skipped. Gradients accumulate into the leaves."""
    # The engine call skips autograd's shape check, which a dropped output would fail.
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    if pairs:
        torch.autograd.Variable._execution_engine.run_backward(
            tuple(o for o, _ in pairs),
            tuple(g for _, g in pairs),
            keep_graph=False,
            create_graph=False,
            inputs=(),
            allow_unreachable=True,
            accumulate_grad=True,
        )
