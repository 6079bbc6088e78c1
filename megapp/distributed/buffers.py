"""Contiguous parameter and gradient buffers, cut into buckets for data-parallel reduction.

Every parameter of a model chunk becomes a view into one flat parameter buffer
(the model's dtype) and gets a ``main_grad``: a view into one flat fp32 gradient
buffer where every microbatch's gradient accumulates. Parameters are laid out
in reverse registration order, roughly the order backward produces their
gradients, and grouped into buckets of about ``bucket_size`` elements; a bucket
is reduced as soon as all its gradients are in.

Each bucket is padded to a multiple of the data-parallel size, so the
distributed optimizer can give data-parallel rank ``r`` the ``r``-th equal slice
of every bucket: one reduce-scatter gives each rank its slice of the summed
gradient, one all-gather gives everyone every rank's updated parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Bucket:
    """Parameters whose gradients are reduced together, and their span in the buffers."""

    params: list[nn.Parameter]
    start: int
    end: int  # padded: (end - start) is a multiple of the data-parallel size
    late: bool  # reduced only after the other groups' reductions (finalize_model_grads)
    pending: set[int] = field(default_factory=set)
    work: object | None = None
    param_data: torch.Tensor | None = None  # its own weight storage (ZeRO-3), else None

    def shard(self, rank: int, world: int) -> tuple[int, int]:
        """Buffer range ``[lo, hi)`` owned by data-parallel rank ``rank``."""
        size = (self.end - self.start) // world
        return self.start + rank * size, self.start + (rank + 1) * size


class ParamAndGradBuffer:
    """Flat parameter and fp32 gradient storage for ``params`` (see the module docstring).

    Args:
        params: the parameters, in the order their gradients are expected in backward.
        bucket_size: elements per bucket before a new one starts (``None``: one bucket).
        dp_size: data-parallel size each bucket is padded to a multiple of.
        is_late: parameters for which it returns True go to buckets of their own that are
            reduced last (they first need a sum over another group, e.g. tied embeddings).
        grad_dtype: dtype of ``main_grad`` (fp32 by default, also for bf16/fp16 models).
        allocate_grads: False leaves the gradients to someone else (ZeRO-2's
            :class:`~megapp.distributed.sharded_grads.ShardedGrads`): no ``grad_data``.
        unit_of: a key per parameter (e.g. its layer); a bucket never spans two keys, so
            one unit's weights can be gathered and freed together (ZeRO-3).
        bucket_storage: each bucket's weights in a storage of its own (``bucket.param_data``)
            that can be freed alone (ZeRO-3); ``param_data`` is then None.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        bucket_size: int | None,
        dp_size: int,
        is_late: Callable[[nn.Parameter], bool] = lambda p: False,
        grad_dtype: torch.dtype = torch.float32,
        allocate_grads: bool = True,
        unit_of: Callable[[nn.Parameter], object] | None = None,
        bucket_storage: bool = False,
    ):
        if not params:
            raise ValueError("a gradient buffer needs at least one parameter")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"one buffer holds one dtype on one device, got {dtypes} {devices}")
        self.dp_size = dp_size
        self.params = list(params)
        self.ranges: dict[int, tuple[int, int]] = {}  # id(param) -> buffer range
        self.buckets: list[Bucket] = []
        regular = [p for p in params if not is_late(p)]
        late = [p for p in params if is_late(p)]
        offset = 0
        for group, is_late_group in ((regular, False), (late, True)):
            current: list[nn.Parameter] = []
            start = offset
            for p in group:
                if unit_of is not None and current and unit_of(p) != unit_of(current[-1]):
                    offset = self._close(current, start, offset, is_late_group)
                    current, start = [], offset
                self.ranges[id(p)] = (offset, offset + p.numel())
                offset += p.numel()
                current.append(p)
                if bucket_size is not None and offset - start >= bucket_size:
                    offset = self._close(current, start, offset, is_late_group)
                    current, start = [], offset
            if current:
                offset = self._close(current, start, offset, is_late_group)
        (dtype,), (device,) = dtypes, devices
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        if bucket_storage:
            self.param_data = None
            for bucket in self.buckets:
                size = bucket.end - bucket.start
                bucket.param_data = torch.zeros(size, dtype=dtype, device=device)
        else:
            self.param_data = torch.zeros(offset, dtype=dtype, device=device)
        self.grad_dtype = grad_dtype
        self.grad_data = (
            torch.zeros(offset, dtype=grad_dtype, device=device) if allocate_grads else None
        )
        for p in self.params:
            lo, hi = self.ranges[id(p)]
            if bucket_storage:
                bucket = self.bucket_of[id(p)]
                view = bucket.param_data[lo - bucket.start : hi - bucket.start].view_as(p)
            else:
                view = self.param_data[lo:hi].view_as(p)
            view.copy_(p.data)
            p.data = view
            if self.grad_data is not None:
                p.main_grad = self.grad_data[lo:hi].view_as(p)

    @property
    def numel(self) -> int:
        """Elements of the whole buffer, padding included."""
        return self.buckets[-1].end

    def _close(self, params: list[nn.Parameter], start: int, end: int, late: bool) -> int:
        padded = start + -(-(end - start) // self.dp_size) * self.dp_size
        self.buckets.append(Bucket(list(params), start, padded, late))
        return padded

    def param_shard(self, p: nn.Parameter, rank: int) -> tuple[int, int] | None:
        """The part of ``p`` (flat element range within ``p``) owned by data-parallel ``rank``,
        or None when it owns none of it."""
        lo, hi = self.ranges[id(p)]
        own_lo, own_hi = self.bucket_of[id(p)].shard(rank, self.dp_size)
        lo2, hi2 = max(lo, own_lo), min(hi, own_hi)
        return (lo2 - lo, hi2 - lo) if lo2 < hi2 else None

    def reset(self) -> None:
        """Zero the gradients and mark every bucket as waiting for all its parameters."""
        if self.grad_data is not None:
            self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.pending = {id(p) for p in bucket.params}
            bucket.work = None
