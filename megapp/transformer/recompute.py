"""Recompute a cheap tensor in backward instead of keeping it for the op that saves it.

A linear layer saves its input for the weight gradient. When that input is
the output of a cheap elementwise op whose own input is kept anyway (a norm's
output, whose input the norm saves; an activation's output, whose
pre-activation the activation saves), storing it is waste: ``recompute_saved``
makes autograd store a recipe instead and rebuild the tensor when backward
asks for it. The rebuilt tensor is bit-identical (same op, same input).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from megapp.autograd.saved import notify_kept


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
