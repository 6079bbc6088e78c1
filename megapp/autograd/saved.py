"""The tensors autograd keeps for backward: who may see them, rebuilding the cheap ones instead of
keeping them, and freeing what it does not keep.

A linear layer saves its input for the weight gradient. When that input is the output of a cheap
elementwise op whose own input is kept anyway (a norm's output, whose input the norm saves; an
activation's output, whose pre-activation the activation saves), storing it is waste:
:func:`recompute_saved` makes autograd store a recipe instead and rebuild the tensor when
backward asks for it. The rebuilt tensor is bit-identical (same op, same input).

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


class _Rebuild:
    """How to rebuild a saved view of the target: recompute, then take the same view."""

    __slots__ = ("fn", "inputs", "offset", "shape", "stride")

    def __init__(self, fn, inputs, saved: torch.Tensor, offset: int):
        self.fn, self.inputs = fn, inputs
        self.shape, self.stride, self.offset = saved.shape, saved.stride(), offset

    def __call__(self) -> torch.Tensor:
        value = self.fn(*self.inputs).contiguous()
        return value.as_strided(self.shape, self.stride, self.offset)


class _Target:
    """Where the target's memory is, without a reference to it: autograd keeps a saved
    tensor's pack hook alive until backward, and a hook holding the target would keep the
    very tensor it exists to free. The caller holds the target for the whole block, so its
    memory cannot be reused while the hook runs."""

    __slots__ = ("contiguous", "device", "dtype", "numel", "offset", "ptr")

    def __init__(self, target: torch.Tensor):
        self.ptr, self.offset = target.untyped_storage().data_ptr(), target.storage_offset()
        self.contiguous, self.numel = target.is_contiguous(), target.numel()
        self.dtype, self.device = target.dtype, target.device

    def holds(self, saved: torch.Tensor) -> bool:
        """Whether ``saved`` is the target or a view into the same contiguous memory."""
        return (
            self.contiguous
            and saved.dtype == self.dtype
            and saved.device == self.device
            and saved.untyped_storage().data_ptr() == self.ptr
            and saved.storage_offset() >= self.offset
            and saved.numel() <= self.numel
        )


@contextlib.contextmanager
def recompute_saved(
    target: torch.Tensor, fn: Callable[..., torch.Tensor], *inputs: object
) -> Iterator[None]:
    """Within the block, ops that save ``target`` for backward keep ``fn(*inputs)`` instead.

    ``fn(*inputs)`` must return ``target``'s values; it runs under ``no_grad`` in
    backward, once per saved use. ``inputs`` should be tensors kept anyway, weights
    included: a module's attributes may hold other tensors by then (after
    ``torch.func.functional_call``), so ``fn`` must not read them.
    """

    where = _Target(target)

    def pack(t: torch.Tensor):
        if where.holds(t):
            notify_kept(*inputs)
            return _Rebuild(fn, inputs, t, t.storage_offset() - where.offset)
        notify_kept(t)
        return t

    def unpack(saved):
        if isinstance(saved, _Rebuild):
            with torch.no_grad():
                return saved()
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


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
