"""ZeRO-2 gradients: each data-parallel rank keeps only its slice of the reduced gradients.

With ZeRO-1 every rank accumulates whole gradients over the microbatches and
reduce-scatters them once per step: ``Φ`` fp32 gradient elements per rank. Here a
bucket's gradients exist whole only while one microbatch's backward fills them (a
scratch tensor per bucket); when the bucket is complete it is reduce-scattered at once.
The reduction is settled (waited on, this rank's slice of the sum added into a
persistent slice store of ``Φ/dp`` elements, the scratch freed) when the next bucket's
starts, so one runs at a time, and at the latest when the backward that filled it ends
(:meth:`ShardedGrads.settle`): outside a backward no whole gradient is alive, and within
one, the bucket filling and the one reducing. The price is one reduce-scatter per
microbatch instead of one per step.

Buckets marked late (gradients that must first be summed over another group: tied
embedding copies, sequence-parallel replicas) keep whole gradients for the step, as
under ZeRO-1, and are reduce-scattered into the slice store once, after that sum.

The buffer and group are the chunk's dense ones, or its experts' and the expert-data-parallel
group; the experts' gradients are divided by the dense data-parallel size all the same
(``divide_by``: see :class:`~megapp.distributed.ddp.DistributedDataParallel`).
"""

from __future__ import annotations

import torch
from torch import nn

from megapp import comm
from megapp.comm import Group
from megapp.distributed.buffers import Bucket, ParamAndGradBuffer


class ShardedGrads:
    """The gradient storage of one chunk's buffer under ZeRO-2 (see the module docstring).

    Args:
        buffer: built with ``allocate_grads=False``; its buckets are sliced over ``dp_group``.
        dp_group: the ranks that sum the gradients and each keep one slice.
        dtype: the gradients' dtype.
        divide_by: every gradient is divided by this before the sum (``None``: the size of
            ``dp_group``, the mean over it).
    """

    def __init__(
        self,
        buffer: ParamAndGradBuffer,
        dp_group: Group,
        dtype: torch.dtype,
        *,
        divide_by: int | None = None,
    ):
        self.buffer, self.dp_group, self.dtype = buffer, dp_group, dtype
        self.dp_size, self.dp_rank = comm.world_size(dp_group), comm.rank(dp_group)
        self.divide_by = self.dp_size if divide_by is None else divide_by
        device = buffer.params[0].device
        self.offsets: dict[int, int] = {}  # id(bucket) -> start in the slice store
        self._buckets = {id(bucket): bucket for bucket in buffer.buckets}
        size = 0
        for bucket in buffer.buckets:
            self.offsets[id(bucket)] = size
            size += (bucket.end - bucket.start) // self.dp_size
        self.store = torch.zeros(size, dtype=dtype, device=device)
        self.scratch: dict[int, torch.Tensor] = {}
        self.in_flight: dict[int, tuple[comm.Pending, torch.Tensor]] = {}
        for bucket in buffer.buckets:
            if bucket.late:  # whole for the step
                self._allocate(bucket)

    # ----- storage ---------------------------------------------------------
    def owned(self, bucket: Bucket) -> torch.Tensor:
        """This rank's slice of ``bucket``'s reduced gradient."""
        start = self.offsets[id(bucket)]
        return self.store[start : start + (bucket.end - bucket.start) // self.dp_size]

    def _allocate(self, bucket: Bucket) -> None:
        scratch = torch.zeros(bucket.end - bucket.start, dtype=self.dtype, device=self.store.device)
        self.scratch[id(bucket)] = scratch
        for p in bucket.params:
            lo, hi = self.buffer.ranges[id(p)]
            p.main_grad = scratch[lo - bucket.start : hi - bucket.start].view(p.shape)

    def _free(self, bucket: Bucket) -> None:
        del self.scratch[id(bucket)]
        for p in bucket.params:
            p.main_grad = None

    # ----- gradient arrival ------------------------------------------------
    def accumulate(self, param: nn.Parameter) -> None:
        """Add ``param.grad`` in; start the bucket's reduction once all of it is in."""
        bucket = self.buffer.bucket_of[id(param)]
        if not bucket.late:
            self._settle(bucket)  # the previous microbatch's reduction, if any
            if id(bucket) not in self.scratch:
                self._allocate(bucket)
                bucket.pending = {id(p) for p in bucket.params}
        param.main_grad.add_(param.grad)
        bucket.pending.discard(id(param))
        if not bucket.pending and not bucket.late:
            self._start(bucket)

    def _start(self, bucket: Bucket) -> None:
        self.settle()  # one reduction at a time: the scratch behind it is freed
        scratch = self.scratch[id(bucket)]
        scratch.div_(self.divide_by)  # the data-parallel mean
        out = torch.empty_like(self.owned(bucket))
        work = comm.reduce_scatter_into(out, scratch, self.dp_group, async_op=True)
        self.in_flight[id(bucket)] = (work, out)

    def _settle(self, bucket: Bucket) -> None:
        flight = self.in_flight.pop(id(bucket), None)
        if flight is None:
            return
        work, out = flight
        work.wait()
        self.owned(bucket).add_(out)
        if not bucket.late:
            self._free(bucket)

    def settle(self) -> None:
        """Settle every reduction in flight (the end of a backward: its last bucket's)."""
        for key in list(self.in_flight):
            self._settle(self._buckets[key])

    # ----- end of the step -------------------------------------------------
    def finish(self, late: bool) -> None:
        """Reduce what is still whole (a bucket some parameter sent no gradient to, or the
        late ones) and add every rank's slice into the store."""
        for bucket in self.buffer.buckets:
            if (
                bucket.late == late
                and id(bucket) in self.scratch
                and id(bucket) not in self.in_flight
            ):
                self._start(bucket)
        for bucket in self.buffer.buckets:
            if bucket.late == late:
                self._settle(bucket)

    def reset(self) -> None:
        """Zero the slices (and the late buckets' whole gradients) for the next step."""
        for bucket in self.buffer.buckets:
            self._settle(bucket)
        self.store.zero_()
        for bucket in self.buffer.buckets:
            if bucket.late:
                self.scratch[id(bucket)].zero_()
            elif id(bucket) in self.scratch:
                self._free(bucket)
            bucket.pending = {id(p) for p in bucket.params}

    def grad_bytes(self) -> int:
        """Bytes of gradient storage held now (the slices, and any whole bucket)."""
        tensors = [self.store, *self.scratch.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
